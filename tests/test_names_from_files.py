"""Names read from files stay inside their folder, and tools delete only what they made: a planted run_id or DCP
`latest` never becomes a path elsewhere (a run's end would otherwise rmtree what it names); export_hf.py writes
through a temporary folder of its own, keeps a user's `OUT.tmp/`, and on a full disk leaves nothing behind."""

import shutil

import torch

from conftest import TINY, one_line_error, run
from test_saved_state import fill, small_disk  # noqa: F401  (the fixture, for the full-disk export)

ARGS = ['--gradient_accumulation_steps=1', '--max_iters=10', '--eval_interval=5']


def planted(tmp_path, run_dir):
    """(a user's folder beside, the copy of run_dir that a name planted in it may lead there)"""
    victim = tmp_path / 'victim'
    victim.mkdir()
    (victim / 'keep.txt').write_text('a user file')
    shutil.copytree(run_dir, tmp_path / 'run')
    return victim, tmp_path / 'run'


def test_a_planted_run_id_never_becomes_a_path(tmp_path, data_dir, shared_run):
    victim, out = planted(tmp_path, shared_run('train.py', *ARGS))
    (out / 'run_id').write_text(f'zz/../../..{victim}')  # /dev/shm/nanogpt-zz/../../.. is /
    for ckpt in out.glob('ckpt*.pt'):  # checkpoints without an id, as old code wrote them, which any id matches
        state = torch.load(ckpt, weights_only=True)
        state.pop('run_id', None)
        torch.save(state, ckpt)
    p = run('train.py', *TINY, f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={out}', *ARGS,
            '--max_iters=12', cwd=tmp_path, check=False)
    assert 'is no run id' in one_line_error(p) and 'delete it' in one_line_error(p)
    assert (victim / 'keep.txt').read_text() == 'a user file'


def test_a_planted_dcp_latest_is_refused_by_the_tools(tmp_path, shared_run):
    out = tmp_path / 'run'
    shutil.copytree(shared_run('fsdp_train.py', *ARGS), out)
    (out / 'dcp' / 'latest').write_text('../../elsewhere')
    p = run('sample.py', f'--out_dir={out}', '--device=cpu', '--num_samples=1', '--max_new_tokens=5', cwd=tmp_path,
            check=False)
    assert 'not a step-N folder' in one_line_error(p) and 'delete' not in one_line_error(p)  # it said: delete RUN


def test_a_latest_or_best_file_that_names_no_folder_is_one_line_in_every_tool(tmp_path):
    # a folder in a pointer's place, or junk in it, was a traceback (sample.py, export_hf.py, model_size.py, and
    # train.py's --init_from=RUN/best), or "checkpoint RUN is corrupt: delete it", of a run whose state is all there
    (tmp_path / 'a' / 'dcp' / 'latest').mkdir(parents=True)
    (tmp_path / 'b' / 'dcp').mkdir(parents=True)
    (tmp_path / 'b' / 'dcp' / 'latest').write_text('junk')
    (tmp_path / 'b' / 'dcp' / 'best').write_text('junk')
    cases = [(('sample.py', '--init_from=a', '--device=cpu'), "a/dcp/latest cannot be read (IsADirectoryError"),
             (('export_hf.py', '--ckpt=b', '--out=hf'), "b/dcp/latest names 'junk', not a step-N folder: give a step"),
             (('model_size.py', 'b'), "b/dcp/latest names 'junk', not a step-N folder: give a step"),
             (('train.py', '--init_from=b/best', '--out_dir=out'), "b/dcp/best names 'junk', not a best-step-N")]
    for args, says in cases:
        assert says in one_line_error(run(*args, cwd=tmp_path, check=False)), args
    assert sorted(p.name for p in tmp_path.iterdir()) == ['a', 'b']


def test_a_planted_dcp_best_never_leads_a_new_best_to_remove_a_folder_elsewhere(tmp_path, data_dir, shared_run):
    victim, out = planted(tmp_path, shared_run('fsdp_train.py', *ARGS))
    (out / 'dcp' / 'best').write_text('best-step-00000010/../../../victim')  # a run folder someone handed over
    run('fsdp_train.py', *TINY, f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={out}', *ARGS,
        '--max_iters=15', cwd=tmp_path)
    assert (out / 'dcp' / 'best').read_text() == 'best-step-00000015'  # a new best was saved, so the test means it
    assert (victim / 'keep.txt').read_text() == 'a user file'


def test_export_keeps_a_users_tmp_folder_and_cleans_its_own_on_a_full_disk(tmp_path, shared_run, small_disk):
    ckpt = shared_run('train.py', *ARGS)
    (tmp_path / 'hf.tmp').mkdir()
    (tmp_path / 'hf.tmp' / 'notes.txt').write_text('kept')
    run('export_hf.py', f'--ckpt={ckpt}', f'--out={tmp_path / "hf"}', cwd=tmp_path)
    assert (tmp_path / 'hf' / 'model.safetensors').exists()
    assert (tmp_path / 'hf.tmp' / 'notes.txt').read_text() == 'kept'
    assert sorted(p.name for p in tmp_path.iterdir()) == ['hf', 'hf.tmp']
    disk = small_disk('2m')
    fill(disk)
    p = run('export_hf.py', f'--ckpt={ckpt}', f'--out={disk / "hf"}', cwd=tmp_path, check=False)
    assert 'cannot write' in one_line_error(p)
    assert [p.name for p in disk.iterdir()] == ['filler']  # no half-written folder, no temporary one
