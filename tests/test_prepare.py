import json
import os
import pickle
import shlex
import shutil
import signal
import subprocess
import sys
import types

import numpy as np
import pytest

import seeds
from conftest import REPO, SHAKESPEARE, TINY, env, gpt2, one_line_error, run
from test_saved_state import small_disk  # noqa: F401 (a fixture)


def tokens(path):
    return np.fromfile(path, dtype=np.uint16)


def peak_kb():
    with open('/proc/self/status') as f:
        return int(next(line for line in f if line.startswith('VmHWM')).split()[1])


def test_char_prep_matches_nanogpt_and_round_trips(data_dir):
    d = data_dir / 'shakespeare_char'
    meta = pickle.loads((d / 'meta.pkl').read_bytes())
    train, val = tokens(d / 'train.bin'), tokens(d / 'val.bin')
    assert meta['vocab_size'] == 65 and (len(train), len(val)) == (1003854, 111540)  # nanoGPT's figures
    text = SHAKESPEARE.read_text()
    assert ''.join(meta['itos'][i] for i in train) + ''.join(meta['itos'][i] for i in val) == text


def test_bpe_prep_matches_nanogpt_and_round_trips(data_dir):
    enc = gpt2()
    d = data_dir / 'shakespeare'
    train, val = tokens(d / 'train.bin'), tokens(d / 'val.bin')
    assert (len(train), len(val)) == (301966, 36059)  # nanoGPT's figures
    text = SHAKESPEARE.read_text()
    assert enc.decode(train.tolist()) + enc.decode(val.tolist()) == text
    assert not (d / 'meta.pkl').exists()


def test_bpe_in_small_pieces_gives_the_tokens_of_the_whole(tmp_path, data_dir):
    # 1000-character pieces cut the text in ~1000 places: each cut must leave the tokens as they were
    run('prepare.py', 'text', f'--input={SHAKESPEARE}', '--tokenizer=gpt2', '--chunk_chars=1000', '--name=pieces',
        '--num_proc=2', f'--out_root={tmp_path}', cwd=tmp_path)
    for split in ('train', 'val'):
        ours, whole = tmp_path / 'pieces' / f'{split}.bin', data_dir / 'shakespeare' / f'{split}.bin'
        assert np.array_equal(tokens(ours), tokens(whole))


def test_bpe_pieces_of_text_without_spaces_stay_small_and_give_the_tokens_of_the_whole():
    # minified JSON and CJK text have no whitespace to cut at: the pieces (and memory) grew to the whole file, and
    # each block rescanned them all (a 40 MB line of digits took 49 s and 488 MB as characters; 1.6 s and 88 MB now)
    from prepare import safe_pieces
    enc = gpt2()
    json_line, chinese = '{"id":12,"tags":["it\'s","a1b2"],"n":3.5e-7}', '我们的模型，很小。第1章：它读了3本书！'
    for text in (json_line * 3000, chinese * 3000):
        pieces = list(safe_pieces(text[i:i + 1000] for i in range(0, len(text), 1000)))
        assert ''.join(pieces) == text and max(map(len, pieces)) <= 2000
        assert [t for piece in pieces for t in enc.encode_ordinary(piece)] == enc.encode_ordinary(text)
    digits = '31415926' * 1000  # one pre-token: cut at the end of a second block that holds no cut either
    assert [len(piece) for piece in safe_pieces(digits[i:i + 1000] for i in range(0, len(digits), 1000))] == [2000] * 4


def test_token_check_of_a_big_file_keeps_the_peak_memory_flat(tmp_path, monkeypatch):
    # one mapping over a whole train.bin kept each page it read: each rank's peak RSS was the dataset's size
    import data
    path = tmp_path / 'train.bin'
    ids = np.full((32 << 20) + 5, 7, dtype=np.uint16)  # 64 MB, and a partial last chunk that holds the largest id
    ids[-1] = 300
    ids.tofile(path)
    del ids
    monkeypatch.setattr(data, 'CHUNK', 1 << 20)

    with open(path, 'rb') as f:
        with open('/proc/self/clear_refs', 'w') as clear:
            clear.write('5')  # the peak RSS counts from here
        before = peak_kb()
        data.check_token_ids({'train': f}, 301)
        assert peak_kb() - before < 16 << 10  # kB: a chunk or two of 2 MB, not the file's 64 MB
        with pytest.raises(SystemExit, match='holds token id 300, past the model'):
            data.check_token_ids({'train': f}, 300)


def test_a_batch_from_a_bigger_token_file_takes_no_more_memory(tmp_path):
    # a memory map made anew for each batch held each page-cache folio a row touched (up to 2 MB on Linux 6.x) in the
    # run's RSS: 64 rows peaked at about the file's size up to ~75 MB, 4x higher for a 4x bigger train.bin
    import data
    rises = []
    for mb in (16, 64):
        path = tmp_path / f'{mb}.bin'
        np.arange(mb << 19, dtype=np.uint16).tofile(path)  # token i is i % 65536
        offsets = np.random.default_rng(0).integers(0, (mb << 19) - 257, 64)
        with open(path, 'rb') as f:
            with open('/proc/self/clear_refs', 'w') as clear:
                clear.write('5')  # the peak RSS counts from here
            before = peak_kb()
            rows = data.read_rows(f, offsets, 257)
            rises.append(peak_kb() - before)
            assert np.array_equal(rows, (offsets[:, None] + np.arange(257)) % 65536)
            os.truncate(path, 2 * offsets.max())  # written over in place (not renamed in) while a run reads it
            with pytest.raises(SystemExit, match=f'{path} shrank while this run read it'):
                data.read_rows(f, offsets, 257)
    assert rises[1] < 2 * rises[0] + (4 << 10), rises  # kB: the rows, whatever the size of the file


def test_bpe_prep_over_a_char_folder_removes_its_vocabulary(tmp_path):
    src = tmp_path / 'poem.txt'
    src.write_text('the quick brown fox jumps over the lazy dog\n' * 50)
    run('prepare.py', 'text', f'--input={src}', '--tokenizer=char', f'--out_root={tmp_path}', cwd=tmp_path)
    assert (tmp_path / 'poem' / 'meta.pkl').exists()
    # replacing a finished prep takes --force (test_a_finished_prep_is_kept_unless_forced)
    run('prepare.py', 'text', f'--input={src}', '--tokenizer=gpt2', f'--out_root={tmp_path}', '--force=True',
        cwd=tmp_path)
    assert not (tmp_path / 'poem' / 'meta.pkl').exists()  # else train.py would size the vocabulary from it


def test_text_prep_of_any_file_with_char_tokenizer(tmp_path):
    src = tmp_path / 'poem.txt'
    src.write_text('the quick brown fox jumps over the lazy dog\n' * 50)
    run('prepare.py', 'text', f'--input={src}', '--tokenizer=char', f'--out_root={tmp_path}', cwd=tmp_path)
    meta = pickle.loads((tmp_path / 'poem' / 'meta.pkl').read_bytes())
    ids = np.concatenate([tokens(tmp_path / 'poem' / 'train.bin'), tokens(tmp_path / 'poem' / 'val.bin')])
    assert ''.join(meta['itos'][i] for i in ids) == src.read_text()
    assert meta['vocab_size'] == len(set(src.read_text()))


def test_document_files_get_an_eot_after_each_document(tmp_path, monkeypatch):
    docs = [f"document number {i} says hello {'world ' * (i % 7) * 40}" for i in range(40)]
    for part in range(4):  # shards, given by a pattern: thousands of paths overran one argument
        rows = docs[part * 10:(part + 1) * 10]
        (tmp_path / f'docs-{part}.jsonl').write_text(''.join(json.dumps({'text': d}) + '\n' for d in rows))
    monkeypatch.setenv('HF_DATASETS_CACHE', str(tmp_path / 'hf'))
    run('prepare.py', 'openwebtext-10k', f'--data_files={tmp_path}/docs-*.jsonl', '--val_fraction=0.1', '--name=owt',
        f'--out_root={tmp_path}', '--num_proc=1', cwd=tmp_path)
    # the cache holds the documents once; a tokenized copy of them (8 bytes a token) stayed there too, 2.4x the input
    cached = sum(f.stat().st_size for f in (tmp_path / 'hf').rglob('*') if f.is_file())
    given = sum(f.stat().st_size for f in tmp_path.glob('docs-*.jsonl'))
    assert cached < 1.5 * given, (cached, given)
    assert json.loads((tmp_path / 'owt' / 'prep.json').read_text())['settings']['documents'] == \
        [str(tmp_path / f'docs-{part}.jsonl') for part in range(4)]  # the files, so that a new shard is a new prep
    enc = gpt2()
    got = []
    for split, n_docs in (('train', 36), ('val', 4)):
        ids = tokens(tmp_path / 'owt' / f'{split}.bin').tolist()
        assert ids.count(50256) == n_docs and ids[-1] == 50256
        got += enc.decode(ids).split('<|endoftext|>')[:-1]
    assert sorted(got) == sorted(docs)
    # text files: each one a document, its lines and blank lines kept (they were a document a line, breaks dropped)
    books = [f"book {i}\n\nits second paragraph,\nover two lines\n" + 'more words ' * i for i in range(5)]
    for i, book in enumerate(books):
        (tmp_path / f'book-{i}.txt').write_text(book)
    run('prepare.py', 'openwebtext-10k', f'--data_files={tmp_path}/book-*.txt', '--val_fraction=0.2', '--name=books',
        f'--out_root={tmp_path}', '--num_proc=1', cwd=tmp_path)
    got = [enc.decode(tokens(tmp_path / 'books' / f'{split}.bin').tolist()) for split in ('train', 'val')]
    assert sorted(''.join(got).split('<|endoftext|>')[:-1]) == books and got[1].count('<|endoftext|>') == 1


def test_a_document_prep_of_long_documents_keeps_its_peak_memory_flat(tmp_path, monkeypatch):
    # a batch of 1024 documents was tokenized whole into Python ints (about 36 bytes a token): a folder of 400 .txt
    # files of 250 kB peaked at 1.8 GB, of 1,600 at 4.4 GB; long documents now go in a text prep's pieces
    text = SHAKESPEARE.read_text()
    books = [text[i * 5000:] + text[:i * 5000] for i in range(8)]  # 8.9 MB of documents of 1.1 MB
    for i, book in enumerate(books):
        (tmp_path / f'book-{i}.txt').write_text(book)
    monkeypatch.setenv('HF_DATASETS_CACHE', str(tmp_path / 'hf'))
    # the peak from the tokenizer's loading on, which comes after datasets has read the documents: tokenizing alone
    script = """import sys
sys.path.insert(0, sys.argv.pop(1))
import prepare
def peak():
    return int(next(line for line in open('/proc/self/status') if line.startswith('VmHWM')).split()[1])
def encoding(load=prepare.gpt2_encoding_or_exit):
    enc = load()
    open('/proc/self/clear_refs', 'w').write('5')
    before.append(peak())
    return enc
before, prepare.gpt2_encoding_or_exit = [], encoding
prepare.main(sys.argv[1:])
print('peak rise kB', peak() - before[0])"""
    p = subprocess.run([sys.executable, '-c', script, str(REPO), 'openwebtext-10k',
                        f'--data_files={tmp_path}/book-*.txt', '--val_fraction=0.25', '--name=books',
                        f'--out_root={tmp_path}', '--num_proc=1', '--chunk_chars=65536'], cwd=tmp_path, env=env(),
                       capture_output=True, text=True, check=True)
    rise = int(p.stdout.split('peak rise kB')[1])
    assert rise < 16 << 10, rise  # kB: a few pieces of 64k characters and a document, not 8.9 MB's tokens as ints
    enc = gpt2()
    ids = np.concatenate([tokens(tmp_path / 'books' / f'{split}.bin') for split in ('train', 'val')])
    docs = np.split(ids, np.flatnonzero(ids == 50256) + 1)[:-1]  # each with its EOT
    assert sorted(d.tolist() for d in docs) == sorted(enc.encode_ordinary(b) + [50256] for b in books)


def test_a_document_prep_of_4x_the_documents_maps_no_more_of_them(tmp_path, monkeypatch):
    # its check of the text and its tokenizing read the documents through datasets' map of its Arrow files, which
    # kept every page read in the RSS to the end: it grew by the documents' size (+100 MB for 100 MB of JSON lines)
    words = SHAKESPEARE.read_text().split()
    monkeypatch.setenv('HF_DATASETS_CACHE', str(tmp_path / 'hf'))
    # the file pages mapped once the tokens are written (commit), less those once datasets has read the files in
    # (load_local): the pages of its Arrow files that the check, the split and tokenizing left mapped
    script = """import sys
sys.path.insert(0, sys.argv.pop(1))
import prepare
def mapped():
    return int(next(line for line in open('/proc/self/status') if line.startswith('RssFile')).split()[1])
def load(*args, load=prepare.load_local):
    ds = load(*args)
    before.append(mapped())
    return ds
def commit(*args, commit=prepare.commit):
    print('mapped kB', mapped() - before[0])
    commit(*args)
before, prepare.load_local, prepare.commit = [], load, commit
prepare.main(sys.argv[1:])"""
    rises = []
    for mb in (2, 8):
        with open(tmp_path / f'{mb}.jsonl', 'w') as f:
            for i in range((mb << 20) // 4000):  # documents of ~4,000 characters, as OpenWebText's
                f.write(json.dumps({'text': ' '.join(words[i * 700 % 200000:][:700])}) + '\n')
        p = subprocess.run([sys.executable, '-c', script, str(REPO), 'openwebtext', f'--out_dir={tmp_path}/{mb}',
                            f'--data_files={tmp_path}/{mb}.jsonl', '--num_proc=1', '--chunk_chars=65536'],
                           cwd=tmp_path, env=env(), capture_output=True, text=True, check=True)
        rises.append(int(p.stdout.split('mapped kB')[1].split()[0]))
    assert rises[1] < rises[0] + (3 << 10), rises  # kB: 6 MB more documents, not 6 MB more of them mapped


def test_vocab_larger_than_uint16_is_refused_without_output(tmp_path):
    src = tmp_path / 'wide.txt'
    src.write_text(''.join(chr(0x10000 + i) for i in range(70000)), encoding='utf-8')
    p = run('prepare.py', 'text', f'--input={src}', '--tokenizer=char', f'--out_root={tmp_path}/data', cwd=tmp_path,
            check=False)
    assert p.returncode != 0
    assert 'more than uint16' in p.stderr and '--tokenizer=gpt2' in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / 'data').exists()


def test_text_that_is_not_utf8(tmp_path):
    src = tmp_path / 'latin1.txt'
    src.write_bytes('caf\u00e9 au lait\n'.encode('latin-1') * 10)
    p = run('prepare.py', 'text', f'--input={src}', f'--out_root={tmp_path}/data', cwd=tmp_path, check=False)
    assert p.returncode != 0 and 'is not UTF-8 text' in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / 'data').exists()


@pytest.mark.parametrize('args, message', [
    (['nonsense'], "unknown dataset 'nonsense'"),
    (['text'], 'text needs --input=FILE'),
    (['text', '--input=/no/such/file.txt'], 'is not a file'),
    (['shakespeare', '--tokenizer=words'], "tokenizer='words'"),
    (['openwebtext', '--data_files=/no/such.parquet'], 'does not exist'),
    (['openwebtext', '--data_files=/no/such/*.parquet'], '--data_files=/no/such/*.parquet matches no file'),
])
def test_bad_prepare_arguments(tmp_path, args, message):
    p = run('prepare.py', *args, f'--out_root={tmp_path}/data', cwd=tmp_path, check=False)
    assert p.returncode != 0 and message in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / 'data').exists()


DOCS = [{'text': f"document number {i} says hello"} for i in range(20)]


def jsonl(rows, tail=''):
    return ''.join(json.dumps(r) + '\n' for r in rows) + tail


@pytest.mark.parametrize('files, args, message', [
    ({'d.jsonl': jsonl(DOCS, '{"text": "cut off\n')}, [],
     'd.jsonl:21: not a JSON object: each line of a .jsonl file must be one document such as {"text": "..."}; '
     'fix or remove that line'),
    ({'d.jsonl': jsonl(DOCS[:3], '[1, 2]\n')}, [], 'd.jsonl:4: not a JSON object'),
    ({'d.jsonl': jsonl(DOCS + [{'text': 5}])}, [],
     "the documents' 'text' field is not text in each of them (its type is Json"),
    ({'d.jsonl': jsonl([{'text': [d['text']]} for d in DOCS])}, [], "its type is List(Value('string'))"),
    ({'d.jsonl': jsonl(DOCS + [{'text': None}])}, [],
     "1 document(s) have a null 'text': give each one a string, or remove them"),
    ({'d.jsonl': jsonl(DOCS).encode() + b'{"text": "caf\xe9"}\n'}, [], "d.jsonl:21: its 'text' is not UTF-8 text"),
    ({'d.jsonl': ''}, [], '--data_files names d.jsonl, which is empty'),
    ({'d.jsonl': jsonl(DOCS), 'e.txt': 'text\n'}, [], 'mixes .jsonl and .txt files: give files of one type'),
    ({'d.txt': 'one book\nof two lines\n'}, [], '1 document(s): train and val need at least 2 (a .txt file is one): '
     'give more files, or split one by characters with prepare.py text --input=FILE'),
    ({'d.parquet': 'not parquet at all'}, [], 'cannot read --data_files as parquet (ArrowInvalid: Parquet magic bytes'),
    ({'d.jsonl': jsonl(DOCS)}, ['--val_fraction=0.0'],
     'val_fraction=0.0 must be above 0 and below 1 (e.g. 0.1), or -1 for the default'),
    ({'d.jsonl': jsonl(DOCS)}, ['--val_fraction=1.0'], 'val_fraction=1.0 must be above 0 and below 1'),
    ({'d.jsonl': jsonl(DOCS)}, ['--val_fraction=-0.5'], 'val_fraction=-0.5 must be above 0 and below 1'),
    ({'d.jsonl': jsonl(DOCS)}, ['--num_proc=0'], 'num_proc=0 must be 1 or more'),
    ({'d.jsonl': jsonl(DOCS)}, ['--name=../up'], "name='../up' must be a folder name, not a path"),
    ({'d.jsonl': jsonl(DOCS), 'data': 'a file'}, [], 'cannot write in data/owt: data is a file'),
])
def test_bad_document_files_leave_no_folder(tmp_path, files, args, message):
    for name, content in files.items():
        (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    data_files = ','.join(n for n in files if n != 'data')
    p = run('prepare.py', 'openwebtext-10k', f'--data_files={data_files}', '--name=owt', '--num_proc=1', *args,
            cwd=tmp_path, check=False)
    msg = one_line_error(p)
    assert message in msg, msg
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(files)  # no data/ nor data/owt/ left


@pytest.mark.parametrize('args, message', [
    (['--num_proc=0'], 'error: num_proc=0 must be 1 or more'),  # it was a ValueError of a thread pool
    (['--chunk_chars=0'], 'error: chunk_chars=0 must be 1 or more'),  # it said the file was empty
    (['--val_fraction=0.0'], 'error: val_fraction=0.0 must be above 0 and below 1'),  # it said the text was too short
    (['--val_fraction=1.5'], 'error: val_fraction=1.5 must be above 0 and below 1'),
    (['--val_fraction=0.9999'], "error: poem.txt's 880 characters split at val_fraction=0.9999 leave none for train: "
                                "use a longer text or another --val_fraction"),
    (['--name=sub/dir'], "error: name='sub/dir' must be a folder name, not a path"),
    (['--out_root=poem.txt/data'], 'error: cannot write in poem.txt/data/poem: poem.txt is a file'),
])
def test_bad_text_settings_leave_no_folder(tmp_path, args, message):
    (tmp_path / 'poem.txt').write_text('the quick brown fox jumps over the lazy dog\n' * 20)
    msg = one_line_error(run('prepare.py', 'text', '--input=poem.txt', *args, cwd=tmp_path, check=False))
    assert msg.startswith(message), msg
    assert [p.name for p in tmp_path.iterdir()] == ['poem.txt']


@pytest.mark.parametrize('dataset', ['shakespeare_char', 'hellaswag'])
def test_failed_download_removes_the_folders_it_made(tmp_path, dataset):
    # a proxy on a closed port fails the download at once, online or not
    e = dict(env(), HTTPS_PROXY='http://127.0.0.1:9', HTTP_PROXY='http://127.0.0.1:9')
    p = subprocess.run([sys.executable, str(REPO / 'prepare.py'), dataset, '--out_root=new/data'],
                       cwd=tmp_path, env=e, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and p.stderr.startswith('error: could not download ') and '--input=FILE' in p.stderr
    assert not any(tmp_path.iterdir())  # new/, new/data/ and new/data/DATASET/ were made for the download


def test_a_download_that_does_not_fit_is_one_line_and_leaves_no_partial_file(small_disk, monkeypatch):
    # it was a traceback, and the partial input.txt.tmp kept the disk full
    disk = small_disk('64k')
    sys.path.insert(0, str(REPO))
    import prepare

    class Response:
        content = b'x' * 200_000

        def raise_for_status(self):
            pass
    monkeypatch.setitem(sys.modules, 'requests', types.SimpleNamespace(get=lambda url, timeout: Response()))
    with pytest.raises(SystemExit) as e:
        prepare.download('https://example.org/input.txt', str(disk / 'input.txt'))
    assert e.value.code == f"error: writing in {disk} failed (No space left on device): free some space or choose " \
                           f"another --out_root"
    assert not any(disk.iterdir())

def test_document_files_as_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({'text': [d['text'] for d in DOCS], 'id': list(range(20))}), tmp_path / 'd.parquet')
    run('prepare.py', 'openwebtext-10k', '--data_files=d.parquet', '--val_fraction=0.1', '--name=owt', '--num_proc=1',
        cwd=tmp_path)
    assert tokens(tmp_path / 'data' / 'owt' / 'val.bin').tolist().count(50256) == 2
    assert tokens(tmp_path / 'data' / 'owt' / 'train.bin').tolist().count(50256) == 18
    assert sorted(p.name for p in (tmp_path / 'data' / 'owt').iterdir()) == ['prep.json', 'train.bin', 'val.bin']



def test_a_document_prep_on_a_full_disk_is_one_line_and_keeps_the_prep_before(tmp_path, small_disk, monkeypatch):
    # its tokens went into a memmap, whose first page past the disk's end killed prepare.py with SIGBUS, its
    # temporary file taking the rest of the disk
    disk = small_disk('256k')
    (tmp_path / 'd.jsonl').write_text(jsonl(DOCS))
    (tmp_path / 'big.jsonl').write_text(jsonl([{'text': f'word{i} ' * 400} for i in range(40)]))  # ~100k tokens
    args = ['--name=owt', f'--out_root={disk}', '--num_proc=1']
    run('prepare.py', 'openwebtext-10k', '--data_files=d.jsonl', *args, cwd=tmp_path)
    before = {p.name: p.read_bytes() for p in (disk / 'owt').iterdir()}
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    (disk / 'filler').write_bytes(b'\0' * (free - 64 * 1024))  # room for the lock and 64k of the 200k of tokens
    p = run('prepare.py', 'openwebtext-10k', '--data_files=big.jsonl', '--force=True', *args, cwd=tmp_path,
            check=False)
    assert p.returncode == 1 and 'Traceback' not in p.stderr, p.stderr[-2000:]  # after the progress bars, one line
    assert p.stderr.strip().splitlines()[-1] == f"error: writing in {disk / 'owt'} failed (No space left on device): " \
                                                f"free some space or choose another --out_root"
    assert {p.name: p.read_bytes() for p in (disk / 'owt').iterdir()} == before  # no .tmp, no lock left
    # its first step writes the documents into datasets' cache: a traceback there, or 'cannot read --data_files'
    monkeypatch.setenv('HF_DATASETS_CACHE', str(small_disk('64k')))
    p = run('prepare.py', 'openwebtext-10k', '--data_files=big.jsonl', '--force=True', *args, cwd=tmp_path,
            check=False)
    assert p.returncode == 1 and 'Traceback' not in p.stderr, p.stderr[-2000:]
    cache = os.environ['HF_DATASETS_CACHE']
    assert p.stderr.strip().splitlines()[-1].startswith(f"error: writing in datasets' cache {cache} failed (No space "
                                                        f"left on device): "), p.stderr[-500:]
    assert {p.name: p.read_bytes() for p in (disk / 'owt').iterdir()} == before

# -----------------------------------------------------------------------------
# nanoGPT's layout (data/<name>/prepare.py) and DLRover's command (prepare.py --src_data_path FILE)

FOLDERS = ['shakespeare_char', 'shakespeare', 'openwebtext', 'openwebtext-10k', 'fineweb-edu', 'fineweb', 'hellaswag']


def git_ignores(path):
    return subprocess.run(['git', 'check-ignore', '-q', path], cwd=REPO).returncode == 0


def test_each_dataset_has_its_folder_script_in_git_and_its_outputs_out_of_it():
    for name in FOLDERS:
        assert (REPO / 'data' / name / 'prepare.py').is_file(), name
        assert not git_ignores(f'data/{name}/prepare.py'), name
        for made in ('train.bin', 'val.bin', 'meta.pkl', 'input.txt', 'progress.json', 'prep.json', 'train.bin.tmp'):
            assert git_ignores(f'data/{name}/{made}'), (name, made)
    assert git_ignores('data/mine/train.bin')  # prepare.py text --name=mine


def test_a_folder_script_prepares_into_its_own_folder_from_anywhere(tmp_path):
    # a copy of the repo's layout, so that the outputs land in tmp_path
    repo = tmp_path / 'repo'
    (repo / 'data' / 'shakespeare_char').mkdir(parents=True)
    for f in ('prepare.py', 'configurator.py', 'seeds.py', 'data.py', 'runlock.py', 'data/shakespeare_char/prepare.py'):
        (repo / f).write_bytes((REPO / f).read_bytes())
    src = tmp_path / 'small.txt'
    src.write_text(SHAKESPEARE.read_text()[:20000])
    folder = repo / 'data' / 'shakespeare_char'
    made = {}
    for cwd, script in ((repo, 'data/shakespeare_char/prepare.py'), (folder, 'prepare.py'),
                        (tmp_path, 'repo/data/shakespeare_char/prepare.py')):
        p = subprocess.run([sys.executable, script, f'--input={src}'], cwd=cwd, env=env(), capture_output=True,
                           text=True)
        assert p.returncode == 0, p.stderr
        # the same prep again is not redone: that it says so shows that it looked in the same folder
        assert ('data/shakespeare_char is already prepared from this input' in p.stdout) == (cwd != repo), p.stdout
        assert sorted(os.listdir(folder)) == ['meta.pkl', 'prep.json', 'prepare.py', 'train.bin', 'val.bin'], cwd
        assert sorted(os.listdir(repo)) == ['configurator.py', 'data', 'data.py', 'prepare.py', 'runlock.py',
                                            'seeds.py'] and \
            os.listdir(repo / 'data') == ['shakespeare_char']  # nothing written elsewhere (no data/ under the cwd)
        made[str(cwd)] = (folder / 'train.bin').read_bytes() + (folder / 'val.bin').read_bytes()
    assert len(set(made.values())) == 1 and len(made[str(repo)]) == 2 * 20000
    meta = pickle.loads((folder / 'meta.pkl').read_bytes())
    ids = np.frombuffer(made[str(repo)], dtype=np.uint16)
    assert ''.join(meta['itos'][i] for i in ids) == src.read_text()


@pytest.mark.parametrize('args, where', [
    (['--src_data_path', 'corpus/data.txt'], 'corpus'),  # DLRover's argparse form: beside the text file
    (['--src_data_path=corpus/data.txt', '--output_dir', 'my data'], 'my data'),  # the command it names, quoted
], ids=['beside', 'output_dir'])
def test_dlrover_src_data_path_is_a_char_prep_and_names_ours(tmp_path, args, where):
    (tmp_path / 'corpus').mkdir()
    text = SHAKESPEARE.read_text()[:5000]
    (tmp_path / 'corpus' / 'data.txt').write_text(text)
    p = run('prepare.py', *args, cwd=tmp_path)
    command = f"python prepare.py text --input=corpus/data.txt --tokenizer=char --out_dir={shlex.quote(where)}"
    assert f"here that is `{command}`" in p.stdout, p.stdout
    meta = pickle.loads((tmp_path / where / 'meta.pkl').read_bytes())
    ids = np.concatenate([tokens(tmp_path / where / 'train.bin'), tokens(tmp_path / where / 'val.bin')])
    assert len(tokens(tmp_path / where / 'train.bin')) == 4500  # nanoGPT's 90% split, as DLRover's prep
    assert ''.join(meta['itos'][i] for i in ids) == text


@pytest.mark.parametrize('args, flag', [(['--src_data_path'], '--src_data_path'),
                                        (['--src_data_path', 'data.txt', '--output_dir'], '--output_dir'),
                                        (['--output_dir', 'x', '--src_data_path', '--force'], '--src_data_path')])
def test_dlrover_prep_flag_without_its_value_names_the_flag(args, flag):
    # as its argparse refuses it: not a prep of `--input=` (an error about a flag never typed), nor beside the file
    # for an --output_dir left empty
    with pytest.raises(SystemExit) as e:
        seeds.prepare_args(args)
    assert e.value.code == f"error: flag '{flag}' needs a value: write it as {flag}=VALUE or {flag} VALUE"


# -----------------------------------------------------------------------------
# a folder that holds a finished prep: kept unless --force, and never left as a mix of two preps

def state(folder):
    return {f.name: (f.stat().st_mtime_ns, f.read_bytes()) for f in folder.iterdir()}


def test_a_finished_prep_is_kept_unless_forced(tmp_path):
    """The same prep again (the same text from any copy) is not redone. A prep of other input or settings over a
    finished one, which a model trained on it needs (its meta.pkl), is refused in one line and the folder left as
    it was; so is one over a prep that records no settings (an older prepare.py's, or nanoGPT's). --force replaces."""
    poem, copy, other = tmp_path / 'poem.txt', tmp_path / 'copy.txt', tmp_path / 'other.txt'
    poem.write_text('the quick brown fox jumps over the lazy dog\n' * 50)
    copy.write_text(poem.read_text())
    other.write_text('pack my box with five dozen liquor jugs\n' * 50)
    (tmp_path / 'docs.jsonl').write_text(jsonl(DOCS))
    run('prepare.py', 'text', '--input=poem.txt', '--tokenizer=char', '--name=mine', cwd=tmp_path)
    folder = tmp_path / 'data' / 'mine'
    before = state(folder)
    for again in ('poem.txt', 'copy.txt'):
        p = run('prepare.py', 'text', f'--input={again}', '--tokenizer=char', '--name=mine', cwd=tmp_path)
        assert p.stdout.strip() == 'data/mine is already prepared from this input with these settings: pass ' \
                                   '--force=True to prepare it again', p.stdout
        assert state(folder) == before
    fix = 'which a model trained on it may need: pass --force=True to replace it, or prepare into another folder ' \
          '(--name, --out_root or --out_dir)'
    sha = json.loads((folder / 'prep.json').read_text())['settings']['input_sha256']
    sha = f"input_sha256='{sha[:12]}…'"  # cut short inside its quotes
    for args, changed in ((['text', '--input=other.txt', '--tokenizer=char'], sha + ')'),
                          (['text', '--input=poem.txt', '--tokenizer=gpt2'], "tokenizer='char')"),
                          (['text', '--input=poem.txt', '--tokenizer=char', '--val_fraction=0.2'], 'val_fraction=0.1)'),
                          (['openwebtext-10k', '--data_files=docs.jsonl', '--num_proc=1'], sha + ',')):
        msg = one_line_error(run('prepare.py', *args, '--name=mine', cwd=tmp_path, check=False))
        assert msg.startswith(f'error: data/mine holds a finished prep of other input or settings ({changed}'), msg
        assert msg.endswith(fix), msg
        assert state(folder) == before
    (folder / 'prep.json').unlink()  # as an older prepare.py, or nanoGPT's, left it
    before = state(folder)
    msg = one_line_error(run('prepare.py', 'text', '--input=poem.txt', '--tokenizer=char', '--name=mine', cwd=tmp_path,
                             check=False))
    assert msg == f"error: data/mine holds a finished prep that records no settings (an older prepare.py's, or " \
                  f"nanoGPT's), {fix}", msg
    assert state(folder) == before
    sys.path.insert(0, str(REPO))
    import data  # a run reading the folder, as every entrypoint does, while --force replaces its prep
    files, _ = data.find_bins(str(folder), 32)
    began = {split: tokens(folder / f'{split}.bin').tolist() for split in files}
    run('prepare.py', 'text', '--input=other.txt', '--tokenizer=char', '--name=mine', '--force=True', cwd=tmp_path)
    meta = pickle.loads((folder / 'meta.pkl').read_bytes())
    assert ''.join(meta['itos'][i] for i in tokens(folder / 'train.bin')) == other.read_text()[:1800]
    # the run goes on with the tokens it began with: it read the new ones, another vocabulary's ids, mid-run
    assert {split: data.read_rows(f, [0], len(began[split]))[0].tolist() for split, f in files.items()} == began


def test_a_vocabulary_whose_token_files_were_removed_is_kept_unless_forced(tmp_path):
    # the .bin files removed to save space, meta.pkl is still what a model trained on the folder decodes with: a prep
    # of other settings removed it (a GPT-2 prep's) or wrote another over it, as if the folder held nothing
    (tmp_path / 'poem.txt').write_text('the quick brown fox jumps over the lazy dog\n' * 50)
    run('prepare.py', 'text', '--input=poem.txt', '--tokenizer=char', '--name=mine', cwd=tmp_path)
    folder = tmp_path / 'data' / 'mine'
    meta = (folder / 'meta.pkl').read_bytes()
    for split in ('train', 'val'):
        (folder / f'{split}.bin').unlink()
    before = state(folder)
    msg = one_line_error(run('prepare.py', 'text', '--input=poem.txt', '--tokenizer=gpt2', '--name=mine', cwd=tmp_path,
                             check=False))
    assert msg.startswith("error: data/mine holds a finished prep of other input or settings (tokenizer='char')"), msg
    assert state(folder) == before
    run('prepare.py', 'text', '--input=poem.txt', '--tokenizer=char', '--name=mine', cwd=tmp_path)  # the same again
    assert (folder / 'meta.pkl').read_bytes() == meta and len(tokens(folder / 'train.bin')) == 1980

# Runs prepare.py as if another prepare.py finished a prep (the files of the folder argv[1]) in the folder just
# before this one holds it (the link of its run.lock), after its first look found none.
RACED = """
import os, runpy, shutil, sys
finished, done = sys.argv[1], []
def race(event, args):
    if event == 'os.link' and not done and os.path.basename(os.fspath(args[1])) == 'run.lock':
        done.append(1)
        for name in os.listdir(finished):
            shutil.copy(os.path.join(finished, name), os.path.dirname(os.fspath(args[1])))
sys.addaudithook(race)
sys.argv = sys.argv[2:]
sys.path[0] = os.path.dirname(sys.argv[0])
runpy.run_path(sys.argv[0], run_name='__main__')
"""


def test_a_prep_finished_by_another_prepare_between_the_first_look_and_the_hold_is_kept(tmp_path):
    """The look for a finished prep comes before the hold (a read-only folder that is prepared needs none), so it is
    taken again under the hold: a prep of other settings finished in between is refused, not replaced."""
    (tmp_path / 'poem.txt').write_text('the quick brown fox jumps over the lazy dog\n' * 50)
    (tmp_path / 'other.txt').write_text('pack my box with five dozen liquor jugs\n' * 50)
    run('prepare.py', 'text', '--input=other.txt', '--tokenizer=char', '--name=theirs', cwd=tmp_path)
    finished = tmp_path / 'data' / 'theirs'
    p = subprocess.run([sys.executable, '-c', RACED, str(finished), str(REPO / 'prepare.py'), 'text',
                        '--input=poem.txt', '--tokenizer=char', '--name=mine'], cwd=tmp_path, env=env(),
                       capture_output=True, text=True, timeout=120)
    assert one_line_error(p).startswith('error: data/mine holds a finished prep of other input'), p.stderr
    assert {f.name: f.read_bytes() for f in (tmp_path / 'data' / 'mine').iterdir()} == \
        {f.name: f.read_bytes() for f in finished.iterdir()}


# Runs prepare.py with a real SIGKILL just before its nth rename or removal of a file of the given name.
KILLED_AT = """
import os, runpy, signal, sys
name, nth = sys.argv[1], int(sys.argv[2])
seen = []
def kill(event, args):
    if event in ('os.rename', 'os.remove') and os.path.basename(os.fspath(args[0])) == name:
        seen.append(name)
        if len(seen) == nth:
            os.kill(os.getpid(), signal.SIGKILL)
sys.addaudithook(kill)
sys.argv = sys.argv[3:]
sys.path[0] = os.path.dirname(sys.argv[0])  # as `python prepare.py` has it
runpy.run_path(sys.argv[0], run_name='__main__')
"""


def read_back(folder):
    """The text that a reader (data.py, as every entrypoint and sample.py use it) takes from folder, or None where it
    refuses the folder. Tokens decoded with a vocabulary they were not made with give other text, or none."""
    sys.path.insert(0, str(REPO))
    import data
    try:
        paths, _ = data.find_bins(str(folder), 8)
        meta = data.read_meta(str(folder / 'meta.pkl')) if (folder / 'meta.pkl').exists() else None
    except SystemExit:
        return None
    ids = np.concatenate([tokens(paths['train']), tokens(paths['val'])])
    if meta is None:
        return gpt2().decode(ids.tolist())
    return ''.join(meta['itos'].get(int(i), '\0') for i in ids)


@pytest.mark.parametrize('tokenizer, steps', [
    ('char', [('prep.json.tmp', 1), ('train.bin.tmp', 1), ('val.bin.tmp', 1), ('meta.pkl.tmp', 1),
              ('prep.json.tmp', 2)]),
    ('gpt2', [('train.bin.tmp', 1), ('meta.pkl', 1), ('prep.json.tmp', 2)]),  # the char prep's meta.pkl removed
])
def test_a_prep_killed_while_it_puts_its_files_in_place_is_never_read_as_a_mix(tmp_path, tokenizer, steps):
    """A prep (--force) over a finished char prep, SIGKILLed before each rename or removal that puts its files in
    place: every reader then takes the old prep whole, or the new one, or refuses the folder in one line; a refused
    one is prepared again without --force."""
    old, new = 'the quick brown fox jumps over the lazy dog\n' * 50, 'to be, or not to be: that is the question\n' * 50
    (tmp_path / 'old.txt').write_text(old)
    (tmp_path / 'new.txt').write_text(new)
    run('prepare.py', 'text', '--input=old.txt', '--tokenizer=char', '--out_dir=template', cwd=tmp_path)
    prep = [str(REPO / 'prepare.py'), 'text', '--input=new.txt', f'--tokenizer={tokenizer}', '--out_dir=data']
    seen = set()
    for name, nth in steps:
        shutil.rmtree(tmp_path / 'data', ignore_errors=True)
        shutil.copytree(tmp_path / 'template', tmp_path / 'data')
        p = subprocess.run([sys.executable, '-c', KILLED_AT, name, str(nth), *prep, '--force=True'], cwd=tmp_path,
                           env=env(), capture_output=True, text=True)
        assert p.returncode == -signal.SIGKILL, (name, nth, p.stderr[-2000:])  # killed, not ended
        text = read_back(tmp_path / 'data')
        assert text in (old, new, None), (name, nth, text[:100])
        seen.add('old' if text == old else 'new' if text == new else 'refused')
        if text is None:
            folder = tmp_path / 'data'
            msg = one_line_error(run('train.py', *TINY, f'--dataset={folder}', '--out_dir=out', cwd=tmp_path,
                                     check=False))
            assert msg == f'error: {folder} holds a prep that stopped while its files were put in place (prep.json ' \
                          'is not marked complete), so its files may come from two preps: run that prep again with ' \
                          'prepare.py', msg
            subprocess.run([sys.executable, *prep], cwd=tmp_path, env=env(), check=True, capture_output=True)
            assert read_back(tmp_path / 'data') == new
    assert seen == ({'old', 'refused'} if tokenizer == 'char' else {'refused'}), seen
