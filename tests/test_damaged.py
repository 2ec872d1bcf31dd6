"""Damaged state in real processes: a truncated newest memory snapshot in /dev/shm is skipped with a warning, and
the run goes on from the one before it on the same curve (all four entrypoints; a truncated newest checkpoint in
out_dir, at the same world size or another: test_fault_resize.py)."""

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
