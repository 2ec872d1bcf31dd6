"""Fault tolerance in real processes: the workers SIGKILLed while they write a storage checkpoint, in all five
entrypoints; the job restarts from the checkpoint before and finishes on the curve of an uninterrupted run (a wider
model than the other tests', for a checkpoint big enough to be caught while it is written)."""

import gc
import os
import re
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import env, run
from test_fault import KIND, assert_same_run, elastic, tiny, workers


# what each entrypoint says it resumes from when that is its first storage checkpoint (iter 2), and where the second
# one's (iter 4) files are while they are written: train.py renames ckpt.pt.tmp into place, DCP writes its shards and
# then .metadata, ds_train.py and decent_train.py rename each rank's file from .tmp and then point latest at the folder
FIRST = {'train.py': 'ckpt.pt', 'fsdp_train.py': 'dcp/step-00000002', 'pp_train.py': 'dcp/step-00000002',
         'ds_train.py': 'ds/step-00000002', 'decent_train.py': 'decent/step-00000002'}
WRITING = {'train.py': 'ckpt.pt.tmp', 'fsdp_train.py': 'dcp/step-00000004/*.distcp',
           'pp_train.py': 'dcp/step-00000004/*.distcp', 'ds_train.py': 'ds/step-00000004/*.tmp',
           'decent_train.py': 'decent/step-00000004/*.tmp'}
# a pipeline of two stages, a block each (its stages write their own shards of the DCP folder)
LAYOUT = {'pp_train.py': ['--n_layer=2', '--pp_size=2']}


def first_complete(script, out_dir):
    """Whether the run's newest complete storage checkpoint is the one of iter 2."""
    if script == 'train.py':
        ckpt = out_dir / 'ckpt.pt'  # replaced by a rename: an open file stays whole
        return ckpt.exists() and torch.load(ckpt, weights_only=True, mmap=True)['iter_num'] == 2
    latest = out_dir / KIND[script] / 'latest'
    return latest.exists() and latest.read_text() == 'step-00000002'


@pytest.mark.parametrize('script', ['train.py', 'fsdp_train.py', 'pp_train.py', 'ds_train.py', 'decent_train.py'])
def test_sigkill_during_a_storage_write_falls_back_to_the_previous_checkpoint(tmp_path, data_dir, script):
    # a wide layer makes the checkpoint big enough (~90 MB with AdamW's moments) to be caught while it is written;
    # a save every 2 steps, as few as the kill and the checkpoints kept after it need (each such step costs the
    # workers and the reference a third of a second of CPU)
    args = ['--n_layer=1', '--n_embd=768', '--n_head=4', '--block_size=16', '--batch_size=2',
            '--gradient_accumulation_steps=2', '--max_iters=8', '--eval_interval=100', '--save_storage_interval=2',
            *LAYOUT.get(script, [])]
    out_dir = tmp_path / 'ft'
    log = open(tmp_path / 'torchrun.log', 'w')
    p = subprocess.Popen(elastic(script, *tiny(data_dir, out_dir, *args)), cwd=tmp_path, env=env(),
                         stdout=log, stderr=subprocess.STDOUT, text=True)
    # the uninterrupted run beside it, while torchrun's fresh interpreters start (it has its own out_dir); it saves
    # only its end, the weights to compare (a save changes nothing the run computes: exact resume holds by it)
    pool = ThreadPoolExecutor(1)
    ref = pool.submit(run, script, *tiny(data_dir, tmp_path / 'ref', *args, '--save_storage_interval=8'), nproc=2,
                      cwd=tmp_path)
    pool.shutdown(wait=False)
    # no collection of this process's garbage until the kill: a full one (torch's objects) takes 150-300 ms, longer
    # than a write lasts (DCP's: 130 ms), and the kill would come after it
    gc.disable()
    try:
        while not first_complete(script, out_dir):  # the first checkpoint is complete ...
            assert p.poll() is None, open(log.name).read()[-3000:]
            time.sleep(0.002)
        while not list(out_dir.glob(WRITING[script])):  # ... and the second one is being written: kill the writers
            assert p.poll() is None, open(log.name).read()[-3000:]
            time.sleep(0.001)
        # every worker, as a lost node would be: one rank alone may have written its part already, and a peer's
        # agreement with it completed, so that the second one rightly became the newest
        for pid in workers(p.pid):
            os.kill(pid, signal.SIGKILL)
        cut_short = first_complete(script, out_dir)  # the second never became the newest
        gc.enable()
        p.wait(timeout=300)
    finally:
        gc.enable()
        p.kill()
        log.close()
    ref.result()
    out = open(log.name).read()
    assert p.returncode == 0, out[-5000:]
    assert cut_short
    assert re.search(rf'resuming from \S+/ft/{FIRST[script]} at iter 2\b', out), out[-5000:]
    assert_same_run(tmp_path / 'ref', out_dir, script, exact=script != 'ds_train.py')
    if script != 'train.py':  # the cut-short folder was written anew at iter 4, and gone with the older ones since
        assert sorted(f.name for f in (out_dir / KIND[script]).glob('step-*')) == ['step-00000006', 'step-00000008']
