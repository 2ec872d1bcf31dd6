"""prepare.py fineweb-edu / fineweb on parquet files the tests write: tokens, the fixed val split, resume after a
SIGKILL, a finished prep kept, and bad input refused without leaving a folder."""

import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import REPO, SHAKESPEARE, env, gpt2, one_line_error, run

EOT = 50256


def documents(n, min_chars=0, max_chars=400):
    """n documents cut from tiny Shakespeare at varied places and lengths, some with non-ASCII text or whitespace at
    an end, and one empty: a prep that ran documents together, or dropped one, would not give expected()'s tokens."""
    text = SHAKESPEARE.read_text()
    docs = []
    for i in range(n):
        start = (i * 7919) % (len(text) - max_chars)
        doc = text[start:start + min_chars + (i * 131) % (max_chars - min_chars)]
        docs.append(doc + ' café ☃ \n' if i % 13 == 0 else ' ' + doc if i % 17 == 0 else doc)
    docs[5] = ''
    return docs


def write_parquet(path, docs, row_group_size, **columns):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({'text': docs, **columns}), path, row_group_size=row_group_size)


def expected(docs):
    enc = gpt2()
    return [t for doc in docs for t in enc.encode_ordinary(doc) + [EOT]]


def tokens(path):
    return np.fromfile(path, dtype=np.uint16).tolist()


def test_fineweb_tokens_are_each_document_and_an_eot_and_val_is_the_first_val_docs(tmp_path):
    docs = documents(300)
    write_parquet(tmp_path / 'a.parquet', docs[:150], 32)
    write_parquet(tmp_path / 'b.parquet', docs[150:], 50, id=[f'd{i}' for i in range(150)])
    # listed out of order: the files are read sorted, so val is the same however they are listed
    p = run('prepare.py', 'fineweb-edu', '--data_files=b.parquet,a.parquet', '--val_docs=40', '--chunk_docs=16',
            '--num_proc=2', cwd=tmp_path)
    out = tmp_path / 'data' / 'fineweb-edu'
    val, train = tokens(out / 'val.bin'), tokens(out / 'train.bin')
    assert val == expected(docs[:40]) and val.count(EOT) == 40
    assert train == expected(docs[40:]) and train.count(EOT) == 260
    assert sorted(f.name for f in out.iterdir()) == ['prep.json', 'train.bin', 'val.bin']  # no progress.json nor .tmp
    assert f"{len(train):,} train and {len(val):,} val tokens (val: the first 40 of 300 documents)" in p.stdout


def test_finished_fineweb_prep_is_not_redone_unless_forced(tmp_path):
    write_parquet(tmp_path / 'a.parquet', documents(60), 16)
    args = ('prepare.py', 'fineweb', '--data_files=a.parquet', '--val_docs=10', '--num_proc=1')
    run(*args, cwd=tmp_path)
    out = tmp_path / 'data' / 'fineweb'
    before = {f.name: (f.stat().st_mtime_ns, f.read_bytes()) for f in out.iterdir()}
    p = run(*args, cwd=tmp_path)
    assert p.stdout.strip() == 'data/fineweb is already prepared from this input with these settings: pass ' \
                               '--force=True to prepare it again'
    assert {f.name: (f.stat().st_mtime_ns, f.read_bytes()) for f in out.iterdir()} == before
    p = run(*args, '--force=True', cwd=tmp_path)
    assert 'already prepared' not in p.stdout
    after = {f.name: (f.stat().st_mtime_ns, f.read_bytes()) for f in out.iterdir()}
    assert {k: v[1] for k, v in after.items()} == {k: v[1] for k, v in before.items()}
    assert all(after[k][0] != before[k][0] for k in before)  # written again


def test_fineweb_prep_killed_midway_resumes_and_ends_byte_identical(tmp_path):
    # ~3.4M characters in 3000 documents read 10 at a time: 300 chunks, each written, synced and recorded, so a
    # SIGKILL a few chunks in lands mid-prep (the test fails, not passes, if the prep ended first)
    docs = documents(3000, min_chars=300, max_chars=2000)
    # resuming past 150 documents skips a.parquet unread, then b.parquet's row groups before the point, then
    # documents of the row group it falls in
    write_parquet(tmp_path / 'a.parquet', docs[:150], 64)
    write_parquet(tmp_path / 'b.parquet', docs[150:], 300)
    args = ['fineweb-edu', '--data_files=a.parquet,b.parquet', '--val_docs=100', '--chunk_docs=10', '--num_proc=2']
    run('prepare.py', *args, '--name=whole', cwd=tmp_path)

    cut = tmp_path / 'data' / 'cut'
    proc = subprocess.Popen([sys.executable, str(REPO / 'prepare.py'), *args, '--name=cut'], cwd=tmp_path, env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    done = 0
    while proc.poll() is None and done < 200:
        try:
            done = json.loads((cut / 'progress.json').read_text())['docs']
        except (OSError, ValueError):
            pass
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, 'the prep ended before it could be killed'
    record = json.loads((cut / 'progress.json').read_text())
    assert 200 <= record['docs'] < 3000
    assert not (cut / 'train.bin').exists()
    # the state a kill leaves between writing a chunk's tokens and recording them: tokens beyond the record, here
    # also in val.bin.tmp, which the resumed prep (past the first 100 documents) no longer writes to
    for split in ('train', 'val'):
        with open(cut / f'{split}.bin.tmp', 'ab') as f:
            f.write(b'\x01\x02' * 777)

    # resuming with other settings would mix two preps in one file: refused, the partial prep left as it was
    msg = one_line_error(run('prepare.py', *args, '--name=cut', '--val_docs=400', cwd=tmp_path, check=False))
    assert msg.startswith('error: data/cut holds a prep interrupted with other input or settings (val_docs=100): '
                          'give those to resume it, or pass --force=True to start over'), msg
    assert json.loads((cut / 'progress.json').read_text()) == record

    p = run('prepare.py', *args[:-1], '--num_proc=1', '--name=cut', cwd=tmp_path)  # the worker count may change
    assert f"resuming: {record['docs']:,} documents already done" in p.stdout
    for split in ('train', 'val'):
        assert (cut / f'{split}.bin').read_bytes() == (tmp_path / 'data' / 'whole' / f'{split}.bin').read_bytes()
    assert sorted(f.name for f in cut.iterdir()) == ['prep.json', 'train.bin', 'val.bin']
    assert tokens(cut / 'val.bin') == expected(docs[:100])


def killed_fineweb(tmp_path, *args):
    """A FineWeb prep into tmp_path/d SIGKILLed (KILLED_AT) before its third record of progress: 100 of 300 documents
    recorded in d/progress.json, 150 in its partial files. Returns its command."""
    from test_prepare import KILLED_AT
    write_parquet(tmp_path / 'a.parquet', documents(300), 50)
    fineweb = [str(REPO / 'prepare.py'), 'fineweb-edu', '--data_files=a.parquet', '--val_docs=20', '--chunk_docs=50',
               '--num_proc=1', '--out_dir=d']
    p = subprocess.run([sys.executable, '-c', KILLED_AT, 'progress.json.tmp', '3', *fineweb, *args], cwd=tmp_path,
                       env=env(), capture_output=True, text=True)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]  # killed, not ended
    assert json.loads((tmp_path / 'd' / 'progress.json').read_text())['docs'] == 100
    return fineweb


def test_a_text_or_document_prep_never_writes_over_an_interrupted_fineweb_prep(tmp_path):
    """They write the partial files that the FineWeb prep resumes from: refused in one line, the folder left as it
    was. --force replaces it, its record of progress removed before those files are written over: a kill then leaves
    no record that counts the new prep's tokens as the FineWeb prep's, and the prep ends with none."""
    from test_prepare import KILLED_AT, state
    killed_fineweb(tmp_path)
    folder = tmp_path / 'd'
    before = state(folder)
    (tmp_path / 'poem.txt').write_text('the quick brown fox jumps over the lazy dog\n' * 50)
    (tmp_path / 'docs.jsonl').write_text(''.join(json.dumps({'text': d}) + '\n' for d in DOCS))
    for args in (['text', '--input=poem.txt', '--tokenizer=char'], ['openwebtext-10k', '--data_files=docs.jsonl']):
        msg = one_line_error(run('prepare.py', *args, '--num_proc=1', '--out_dir=d', cwd=tmp_path, check=False))
        assert msg == 'error: d holds an interrupted FineWeb prep (progress.json), whose partial files this prep ' \
                      'would overwrite: run the same fineweb command again to resume it, pass --force=True to ' \
                      'replace it, or prepare into another folder (--name, --out_root or --out_dir)', msg
        assert state(folder) == before
    text = [str(REPO / 'prepare.py'), 'text', '--input=poem.txt', '--tokenizer=char', '--out_dir=d', '--force=True']
    p = subprocess.run([sys.executable, '-c', KILLED_AT, 'prep.json.tmp', '1', *text], cwd=tmp_path, env=env(),
                       capture_output=True, text=True)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]  # as it puts its files in place, its tokens written
    assert not (folder / 'progress.json').exists() and not (folder / 'progress.json.tmp').exists()
    run(*text, cwd=tmp_path)
    assert sorted(f.name for f in folder.iterdir()) == ['meta.pkl', 'prep.json', 'train.bin', 'val.bin']


def test_a_fineweb_record_that_does_not_match_its_files_never_replaces_a_finished_prep(tmp_path):
    """A FineWeb prep forced over a finished one and killed, its partial files then lost: run again without --force,
    it cannot resume, and starting over is refused as it is where no record is left."""
    from test_prepare import state
    (tmp_path / 'poem.txt').write_text('the quick brown fox jumps over the lazy dog\n' * 50)
    run('prepare.py', 'text', '--input=poem.txt', '--tokenizer=char', '--out_dir=d', cwd=tmp_path)
    fineweb = killed_fineweb(tmp_path, '--force=True')
    folder = tmp_path / 'd'
    (folder / 'val.bin.tmp').unlink()
    (folder / 'run.lock').unlink()  # the killed prep's hold, which the next one takes over
    before = state(folder)
    msg = one_line_error(run(*fineweb, cwd=tmp_path, check=False))
    assert msg.startswith("error: d holds a finished prep of other input or settings (input_sha256='"), msg
    assert state(folder) == before  # the char prep whole, its meta.pkl with it


def write_file(path, content):
    if isinstance(content, list):  # columns of a parquet file
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.table({k: v for k, v in content}), path)
    else:
        path.write_text(content)


DOCS = [f"document number {i} says hello" for i in range(20)]


@pytest.mark.parametrize('files, args, message', [
    ({'a.parquet': [('content', DOCS)]}, [],
     "a.parquet has no 'text' column (it has ['content']): set --text_column"),
    ({'a.parquet': [('text', list(range(20)))]}, [], "the 'text' column of "),
    ({'a.parquet': [('text', DOCS)]}, ['--val_docs=20'],
     'val_docs=20 but the files hold 20 documents: lower --val_docs to leave some for train'),
    ({'a.parquet': [('text', DOCS)], 'b.parquet': [('text', DOCS)]}, ['--val_docs=40'],
     'val_docs=40 but the files hold 40 documents'),
    ({'a.parquet': 'not parquet at all'}, [], "cannot read "),
    ({'a.jsonl': '{"text": "hi"}\n'}, [], "takes .parquet files"),
    ({'a.parquet': [('text', DOCS)]}, ['--val_fraction=0.1'], "val is its first --val_docs documents"),
    ({'a.parquet': [('text', DOCS)]}, ['--val_docs=0'], 'val_docs=0 must be 1 or more'),
    ({'a.parquet': [('text', DOCS)]}, ['--chunk_docs=0'], 'chunk_docs=0 must be 1 or more'),
])
def test_bad_fineweb_input_is_a_one_line_error_leaving_no_folder(tmp_path, files, args, message):
    for name, content in files.items():
        write_file(tmp_path / name, content)
    msg = one_line_error(run('prepare.py', 'fineweb-edu', f"--data_files={','.join(files)}", '--val_docs=5', *args,
                             cwd=tmp_path, check=False))
    assert message in msg, msg
    if message.startswith("the 'text'"):
        assert msg.endswith("a.parquet holds int64, not text: set --text_column"), msg
    if message.startswith('cannot read'):
        assert 'a.parquet as parquet (ArrowInvalid: ' in msg and msg.endswith('give parquet files that hold documents')
    assert sorted(f.name for f in tmp_path.iterdir()) == sorted(files)


@pytest.mark.parametrize('bad, message', [
    (None, "row 130 has a null 'text': give each document a string, or remove it"),
    (b'caf\xe9', "rows 128 to 143 hold a 'text' that is not UTF-8 text"),
])
def test_bad_document_deep_in_the_files_drops_the_partial_prep(tmp_path, bad, message):
    import pyarrow as pa
    import pyarrow.parquet as pq
    docs = [d.encode() for d in documents(200)]
    docs[130] = bad
    column = pa.array(docs, type=pa.binary()).view(pa.string())  # as a writer that skipped validation would
    pq.write_table(pa.table({'text': column}), tmp_path / 'a.parquet', row_group_size=64)
    p = run('prepare.py', 'fineweb-edu', '--data_files=a.parquet', '--val_docs=5', '--chunk_docs=16', cwd=tmp_path,
            check=False)
    # after 8 chunks the progress bar is on stderr, above the error: the error is its one last line
    assert p.returncode == 1 and 'Traceback' not in p.stderr
    last = p.stderr.strip().splitlines()[-1].split('\r')[-1]
    assert last.startswith('error: ') and message in last, p.stderr[-500:]
    assert sorted(f.name for f in tmp_path.iterdir()) == ['a.parquet']  # no data/ left, nor data/fineweb-edu/


def test_fineweb_from_the_hub_offline_is_a_one_line_error_naming_data_files(tmp_path):
    e = dict(env(), HF_HUB_OFFLINE='1')
    p = subprocess.run([sys.executable, str(REPO / 'prepare.py'), 'fineweb-edu'], cwd=tmp_path, env=e,
                       capture_output=True, text=True, timeout=300)
    msg = one_line_error(p)
    assert msg.startswith('error: could not list HuggingFaceFW/fineweb-edu (sample-10BT) on the Hugging Face hub ('), \
        msg
    assert msg.endswith('download its parquet files and pass --data_files=FILE[,FILE...]'), msg
    assert not any(tmp_path.iterdir())


def test_fineweb_settings_given_to_another_dataset_are_refused(tmp_path):
    msg = one_line_error(run('prepare.py', 'shakespeare', f'--input={SHAKESPEARE}', '--val_docs=5', '--chunk_docs=9',
                             cwd=tmp_path, check=False))
    assert msg == 'error: chunk_docs, val_docs is for fineweb and fineweb-edu only: leave it out for shakespeare', msg
    assert not any(tmp_path.iterdir())


def test_the_recipe_runs_end_to_end_on_a_cpu_with_its_smoke_config(tmp_path):
    """prepare.py fineweb-edu and hellaswag, then config/train_gpt2_fineweb_smoke.py (the recipe at a CPU's size):
    val loss and HellaSwag at steps 0, 20 and 40, and the loss falls."""
    from test_hellaswag import made_up_examples, write_jsonl
    write_parquet(tmp_path / 'a.parquet', documents(400, min_chars=200, max_chars=800), 64)
    run('prepare.py', 'fineweb-edu', '--data_files=a.parquet', '--val_docs=40', cwd=tmp_path)
    write_jsonl(tmp_path / 'made_up.jsonl', made_up_examples(5, seed=7))
    run('prepare.py', 'hellaswag', '--input=made_up.jsonl', cwd=tmp_path)
    p = run('train.py', str(REPO / 'config' / 'train_gpt2_fineweb_smoke.py'), cwd=tmp_path)
    metrics = tmp_path / 'out-gpt2-fineweb-smoke' / 'metrics.jsonl'
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r['iter'] for r in rows if 'val_loss' in r] == [0, 20, 40]
    assert [r['iter'] for r in rows if 'hellaswag_acc_norm' in r] == [0, 20, 40]
    losses = {r['iter']: r['loss'] for r in rows if 'loss' in r}
    assert sorted(losses) == list(range(0, 40, 5)) and losses[35] < losses[0] - 1.0
    assert 'hellaswag acc' in p.stdout and '524,288' not in p.stdout  # the smoke sizes, not the recipe's batch
