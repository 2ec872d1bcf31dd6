"""Damaged state in real processes: a truncated newest checkpoint in out_dir, or a truncated newest memory snapshot
in /dev/shm, is skipped with a warning, and the run goes on from the one before it on the same curve (all four
entrypoints; fsdp_train.py's truncated DCP checkpoint is also tested at another world size in test_fault.py)."""

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from checkpoint import snapshot_dir
from conftest import REPO, env, run
from test_fault import KIND, assert_same_run, cut_short, logged_iters, tiny


# the file cut short in the newest storage checkpoint (iter 8) and what the run resumes from instead (iter 4):
# train.py's ckpt.pt and the ckpt.prev.pt kept beside it; a rank's file of ds_train.py's and decent_train.py's
# step folders (decent_train.py on two ranks: rank 0 checks the second rank's file too, and names its own)
# (ds_train.py's consolidated ckpt.pt of the same step is cut too: it would resume there, as it is whole)
NEWEST = {'train.py': ('ckpt.pt', 'ckpt.prev.pt'),
          'ds_train.py': ('ds/step-00000008/zero_pp_rank_0_mp_rank_00_optim_states.pt', 'ds/step-00000004'),
          'decent_train.py': ('decent/step-00000008/rank-1.pt', 'decent/step-00000004')}


@pytest.mark.parametrize('script,nproc', [('train.py', 1), ('ds_train.py', 1), ('decent_train.py', 2)])
def test_a_truncated_newest_checkpoint_falls_back_to_the_one_before(tmp_path, data_dir, script, nproc):
    args = ['--gradient_accumulation_steps=2', '--eval_interval=4', '--save_storage_interval=4']
    run(script, *tiny(data_dir, tmp_path / 'ref', *args, '--max_iters=12'), nproc=nproc, cwd=tmp_path)
    run(script, *tiny(data_dir, tmp_path / 'ft', *args, '--max_iters=8'), nproc=nproc, cwd=tmp_path)
    damaged, before = NEWEST[script]
    cut_short(tmp_path / 'ft' / damaged)
    if script == 'ds_train.py':
        cut_short(tmp_path / 'ft' / 'ckpt.pt')
    p = run(script, *tiny(data_dir, tmp_path / 'ft', *args, '--max_iters=12'), nproc=nproc, cwd=tmp_path)
    newest = tmp_path / 'ft' / (damaged if script == 'train.py' else str(Path(damaged).parent))
    assert f'warning: skipping the damaged {newest} (' in p.stdout, p.stdout[-3000:]
    assert re.search(rf'resuming from \S+/ft/{before} at iter 4\b', p.stdout), p.stdout[-3000:]
    assert_same_run(tmp_path / 'ref', tmp_path / 'ft', script, exact=script != 'ds_train.py')
    if script != 'train.py':  # step 8 written anew is the fallback now, not step 4
        assert sorted(f.name for f in (tmp_path / 'ft' / KIND[script]).glob('step-*')) == ['step-00000008',
                                                                                            'step-00000012']


def newest_snapshot(script, folder):
    """(the path that a resume names as damaged, the file in it to cut short, its iteration) for the newest complete
    memory snapshot in folder: a file of train.py's, fsdp_train.py's or decent_train.py's (each of these but
    train.py's keeps the one before as .prev.pt), the step folder that ds_train.py's latest names there."""
    def iter_of(file):
        return torch.load(file, map_location='cpu', weights_only=True, mmap=True)['iter_num']
    if script == 'ds_train.py':
        step = folder / (folder / 'latest').read_text().strip()
        return step, step / 'zero_pp_rank_0_mp_rank_00_optim_states.pt', iter_of(step / 'mp_rank_00_model_states.pt')
    held = {iter_of(f): f for f in folder.glob('*.pt')}  # files still being written end in .tmp
    it = max(held)
    return held[it], held[it], it


@pytest.mark.parametrize('script', ['train.py', 'fsdp_train.py', 'ds_train.py', 'decent_train.py'])
def test_a_truncated_newest_memory_snapshot_falls_back_to_the_one_before(tmp_path, data_dir, script):
    args = ['--gradient_accumulation_steps=2', '--dropout=0.1', '--max_iters=24', '--eval_interval=12',
            '--save_memory_interval=2', '--save_storage_interval=6']
    run(script, *tiny(data_dir, tmp_path / 'ref', *args), cwd=tmp_path)
    out_dir = tmp_path / 'ft'
    p = subprocess.Popen([sys.executable, str(REPO / script), *tiny(data_dir, out_dir, *args)], cwd=tmp_path,
                         env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stored = out_dir / ('ckpt.pt' if script == 'train.py' else f'{KIND[script]}/latest')
    try:  # killed past its first storage checkpoint (iter 6), with snapshots every 2 steps
        while not (stored.exists() and logged_iters(out_dir) and logged_iters(out_dir)[-1] >= 9):
            assert p.poll() is None
            time.sleep(0.005)
    finally:
        p.kill()
        p.wait()
    shm = Path(snapshot_dir((out_dir / 'run_id').read_text().strip()))
    damaged, file, held = newest_snapshot(script, shm)
    cut_short(file)
    p = run(script, *tiny(data_dir, out_dir, *args), cwd=tmp_path)
    assert f'warning: skipping the damaged {damaged} (' in p.stdout, p.stdout[-3000:]
    start = int(re.search(r'resuming from \S+ at iter (\d+)', p.stdout)[1])
    # the snapshot before it; train.py's node keeps one, so its storage checkpoint (iter 6, or of the same iter)
    assert 6 <= start < held or (script == 'train.py' and start == held), (start, held)
    assert_same_run(tmp_path / 'ref', out_dir, script, exact=script != 'ds_train.py')
    assert not shm.exists()  # the finished run freed its snapshots, the damaged one too
