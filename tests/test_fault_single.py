"""Faults of runs on one process, which a signal reaches straight, in real processes: SIGTERM saves a checkpoint
and exits cleanly, and the run resumes on the same curve; a truncated newest memory snapshot of a SIGKILLed run is
skipped with a warning, the run finishing on the same curve; a run started afresh over an old one never resumes the
old one; non-finite losses skip the step, and several in a row stop the run. One uninterrupted run per entrypoint
(dropout, memory snapshots and storage checkpoints) is made once (shared_run): the reference of the first two, the
old run of the third."""

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from checkpoint import snapshot_dir
from conftest import REPO, begin, env, one_line_error, read_metrics, run
from launcher import finish, launch
from test_fault import (KIND, assert_same_run, beside, cut_short, final_weights, killed_past, logged_iters, tiny,
                        weights)
from test_saved_state import KEEP_SNAPSHOTS

ONE = ['--gradient_accumulation_steps=2', '--dropout=0.1', '--max_iters=24', '--eval_interval=12',
       '--save_memory_interval=2', '--save_storage_interval=6']


def newest_snapshot(script, folder):
    """(the path that a resume names as damaged, the file in it to cut short, its iteration) for the newest complete
    memory snapshot in folder: a file of train.py's, fsdp_train.py's, pp_train.py's or decent_train.py's (each but
    train.py's keeps the one before as .prev.pt), the step folder that ds_train.py's latest names there."""
    def iter_of(file):
        return torch.load(file, map_location='cpu', weights_only=True, mmap=True)['iter_num']
    if script == 'ds_train.py':
        step = folder / (folder / 'latest').read_text().strip()
        return step, step / 'zero_pp_rank_0_mp_rank_00_optim_states.pt', iter_of(step / 'mp_rank_00_model_states.pt')
    held = {iter_of(f): f for f in folder.glob('*.pt')}  # files still being written end in .tmp
    it = max(held)
    return held[it], held[it], it


@pytest.mark.parametrize('script', ['train.py', 'fsdp_train.py', 'pp_train.py', 'ds_train.py', 'decent_train.py'])
def test_a_truncated_newest_memory_snapshot_falls_back_to_the_one_before(tmp_path, data_dir, shared_run, script):
    ref_dir = beside(shared_run, script, *ONE, nproc=1)
    out_dir = tmp_path / 'ft'
    stored = out_dir / ('ckpt.pt' if script == 'train.py' else f'{KIND[script]}/latest')
    # killed past its first storage checkpoint (iter 6), with snapshots every 2 steps
    shm = killed_past(script, *tiny(data_dir, out_dir, *ONE), out_dir=out_dir, iters=9, cwd=tmp_path,
                      ready=stored.exists)
    damaged, file, held = newest_snapshot(script, shm)
    cut_short(file)
    p = run(script, *tiny(data_dir, out_dir, *ONE), cwd=tmp_path)
    assert f'warning: skipping the damaged {damaged} (' in p.stdout, p.stdout[-3000:]
    start = int(re.search(r'resuming from \S+ at iter (\d+)', p.stdout)[1])
    # the snapshot before it; train.py's node keeps one, so its storage checkpoint (iter 6, or of the same iter); and
    # where a busy machine wrote no snapshot past the storage checkpoint's iter 6, that checkpoint
    assert 6 <= start < held or (script == 'train.py' or held == 6) and start == held, (start, held)
    assert_same_run(ref_dir.result(), out_dir, script, exact=script != 'ds_train.py')
    assert not shm.exists()  # the finished run freed its snapshots, the damaged one too


@pytest.mark.parametrize('script', ['fsdp_train.py', 'decent_train.py', 'ds_train.py'])
def test_sigterm_saves_and_exits_cleanly_then_resumes_on_the_same_curve(tmp_path, data_dir, shared_run, script):
    # one process, which the signal reaches straight (train.py's and pp_train.py's tests have torchrun pass it on)
    ref_dir = shared_run(script, *ONE)
    out_dir = tmp_path / 'ft'
    p, started = begin(script, *tiny(data_dir, out_dir, *ONE), cwd=tmp_path)
    while not (logged_iters(out_dir) and logged_iters(out_dir)[-1] >= 6):
        assert p.exitcode is None
        time.sleep(0.005)
    os.kill(p.pid, signal.SIGTERM)
    done = finish(started, timeout=120)
    out, err = done.stdout, done.stderr
    assert done.returncode == 0 and 'Traceback' not in err and 'error' not in err, err[-3000:]
    stopped = int(re.search(r'SIGTERM: saving a checkpoint at iter (\d+) and exiting', out)[1])
    assert 6 < stopped < 24, out[-3000:]
    assert (out_dir / KIND[script] / 'latest').read_text() == f'step-{stopped:08d}'
    p = run(script, *tiny(data_dir, out_dir, *ONE), cwd=tmp_path)
    assert f'at iter {stopped}' in p.stdout
    assert_same_run(ref_dir, out_dir, exact=script != 'ds_train.py')  # DeepSpeed's resume: within 1e-5


@pytest.mark.parametrize('script', ['train.py', 'fsdp_train.py', 'pp_train.py', 'ds_train.py', 'decent_train.py'])
def test_a_run_started_afresh_over_an_old_run_and_killed_before_its_first_save_never_resumes_the_old_one(
        tmp_path, data_dir, shared_run, script):
    args = ['--gradient_accumulation_steps=1', '--eval_interval=4']
    shutil.copytree(shared_run(script, *ONE), tmp_path / 'run')  # the old run, saved at 24
    (tmp_path / 'run' / 'metrics.jsonl').unlink()
    fresh, started = begin(script, *tiny(data_dir, tmp_path / 'run', *args), '--max_iters=1000',
                           '--eval_interval=1000', '--auto_resume=False', cwd=tmp_path)
    while not (logged_iters(tmp_path / 'run') and logged_iters(tmp_path / 'run')[-1] >= 1):
        assert fresh.exitcode is None
        time.sleep(0.005)
    fresh.kill()
    assert finish(started).returncode == -signal.SIGKILL
    killed = Path(f"/dev/shm/nanogpt-{(tmp_path / 'run' / 'run_id').read_text().strip()}")  # its hold alone in it
    p = run(script, *tiny(data_dir, tmp_path / 'run', *args, '--max_iters=2'), cwd=tmp_path)
    assert 'auto-resume' not in p.stdout and 'resuming from' not in p.stdout, p.stdout[-3000:]
    assert logged_iters(tmp_path / 'run') == [0, 1]
    assert not killed.exists()  # the start that took over its hold removed the folder it left empty
    kept = list((tmp_path / 'run').glob('metrics.before-*.jsonl'))  # the killed run's log, kept beside, not cut
    assert len(kept) == 1 and '"iter": 1,' in kept[0].read_text()
    p = run(script, *tiny(data_dir, tmp_path / 'run', *args, '--max_iters=2', '--init_from=resume'), cwd=tmp_path)
    assert re.search(r'at iter 2\b', p.stdout)  # its own checkpoint now, which it resumes (and is done)


# Runs train.py with GPT.forward returning a NaN loss on the training steps in NAN_STEPS (counted in micro-steps
# of this process): the wrapper stands in for a real blow-up, which no small config brings about on cue. In
# pp_train.py the last stage's loss_fn as its schedule computes it, once per micro-batch (not as the schedule's first
# step infers the shapes of gradients with it, nor in an eval).
NAN_WRAPPER = '''
import os, runpy, sys
sys.path.insert(0, os.environ['REPO'])
import model, pipeline
forward, loss_fn, calls = model.GPT.forward, pipeline.loss_fn, [0]
bad = {int(s) for s in os.environ['NAN_STEPS'].split(',')}
overflow_from = int(os.environ.get('OVERFLOW_FROM') or 1 << 30)  # from then on, a finite loss, inf gradients
overflows = {int(s) for s in os.environ.get('OVERFLOW_STEPS', '').split(',') if s}  # and at these alone
def nan(loss):
    calls[0] += 1
    if calls[0] >= overflow_from or calls[0] in overflows:
        loss.register_hook(lambda grad: grad * float('inf'))
    return loss * float('nan') if calls[0] in bad else loss
def nan_forward(self, idx, targets=None):
    logits, loss = forward(self, idx, targets)
    return logits, nan(loss) if self.training and targets is not None else loss
model.GPT.forward = nan_forward
def nan_loss_fn(logits, targets):
    loss = loss_fn(logits, targets)
    return nan(loss) if sys._getframe(1).f_code.co_name == '_compute_loss' else loss
pipeline.loss_fn = nan_loss_fn
if os.environ.get('POISON_STEP'):  # that optimizer step leaves an inf in the weights, its loss and gradient finite
    from torch.optim.optimizer import register_optimizer_step_post_hook
    steps = [0]
    def poison(optimizer, args, kwargs):
        steps[0] += 1
        if steps[0] == int(os.environ['POISON_STEP']):
            optimizer.param_groups[0]['params'][0].data.fill_(float('inf'))
    register_optimizer_step_post_hook(poison)
if os.environ.get('TERM_STEP'):  # SIGTERM right after that optimizer step (a preemption), heeded a step later
    import signal
    from torch.optim.optimizer import register_optimizer_step_post_hook
    taken = [0]
    def term(optimizer, args, kwargs):
        taken[0] += 1
        if taken[0] == int(os.environ['TERM_STEP']):
            os.kill(os.getpid(), signal.SIGTERM)
    register_optimizer_step_post_hook(term)
if sys.argv[1].endswith('ds_train.py') and '--dtype=float16' in sys.argv:
    # DeepSpeed's CPU accelerator says float16 only where oneDNN has its kernels (AVX512-FP16, AMX): elsewhere torch's
    # own CPU float16 runs these tiny models, slower, and the loop under test is the same
    from deepspeed.accelerator import get_accelerator
    type(get_accelerator()).is_fp16_supported = lambda self: True
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name='__main__')
'''


def run_with_nans(tmp_path, nan_steps, *args, script='train.py', nproc=1, launcher=(), poison_step='',
                  overflow_from='', term_step='', overflow_steps=''):
    wrapper = tmp_path / 'nan_wrapper.py'
    wrapper.write_text(NAN_WRAPPER)
    environ = {**env(), 'REPO': str(REPO), 'NAN_STEPS': nan_steps, 'OMP_NUM_THREADS': '1',
               'POISON_STEP': str(poison_step), 'OVERFLOW_FROM': str(overflow_from), 'TERM_STEP': str(term_step),
               'OVERFLOW_STEPS': str(overflow_steps)}
    if not launcher:  # the ranks as tests/launcher.py starts them, each with the wrapper
        return launch(str(wrapper), [str(REPO / script), *map(str, args)], environ, tmp_path, nproc=nproc)
    return subprocess.run([sys.executable, *launcher, str(wrapper), str(REPO / script), *args], cwd=tmp_path,
                          text=True, env=environ, capture_output=True, timeout=300)


def test_train_nonfinite_loss_skips_the_step_and_several_in_a_row_stop_the_run(tmp_path, data_dir):
    args = ['--gradient_accumulation_steps=1', '--max_iters=12', '--eval_interval=6']
    p = run_with_nans(tmp_path, '4', *tiny(data_dir, tmp_path / 'one', *args))  # step 3 (the 4th) goes bad
    assert p.returncode == 0, p.stderr[-3000:]
    assert 'iter 3: non-finite loss or gradient, step skipped (1 in a row)' in p.stdout
    losses, _ = read_metrics(tmp_path / 'one')
    assert all(torch.isfinite(torch.tensor(v)) for it, v in losses.items() if it != 3) and losses[11] < losses[0]
    assert all(torch.isfinite(t).all() for t in weights(tmp_path / 'one' / 'ckpt.pt').values())
    # the skipped step left AdamW's step count too (its bias correction): 11 steps of 12
    state = torch.load(tmp_path / 'one' / 'ckpt.pt', weights_only=True)['optimizer']['state']
    assert state and all(s['step'].item() == 11 for s in state.values())
    # the same run preempted (SIGTERM) right after its non-finite step, which saves nothing: its memory snapshot of
    # iter 2 stays (the end of the run had removed it, and the next start began afresh), and the next start goes on
    # from it exactly, its step 3 again non-finite
    p = run_with_nans(tmp_path, '4', *tiny(data_dir, tmp_path / 'term', *args, '--save_memory_interval=2'),
                      term_step=3)
    assert p.returncode == 0 and 'iter 4: no storage save after 1 non-finite steps' in p.stdout, p.stdout[-2000:]
    p = run_with_nans(tmp_path, '2', *tiny(data_dir, tmp_path / 'term', *args, '--save_memory_interval=2'))
    assert re.search(r'resuming from \S+/nanogpt-\w+/ckpt\.pt at iter 2\n', p.stdout), p.stdout[-2000:]
    term, _ = read_metrics(tmp_path / 'term')
    assert term.keys() == losses.keys() and all(term[i] == losses[i] for i in losses if i != 3)
    assert all(torch.equal(t, weights(tmp_path / 'one' / 'ckpt.pt')[k]) for k, t in
               weights(tmp_path / 'term' / 'ckpt.pt').items())

    # from the 9th step on every loss is NaN: after max_nonfinite_steps=3 the run stops, the checkpoint of
    # iter 6 intact, and the error names the newer memory snapshot of iter 7, which a restart resumes
    p = run_with_nans(tmp_path, ','.join(map(str, range(9, 40))), *tiny(data_dir, tmp_path / 'many', *args),
                      '--max_nonfinite_steps=3', '--save_memory_interval=7')
    assert p.returncode != 0
    error = p.stderr.strip().splitlines()[-1]
    assert error.startswith('error: 3 steps in a row up to iter 10 had a non-finite loss') and \
        re.search(r'ckpt\.pt \(iter 6\) holds the last good state \(the memory snapshot of iter 7 in \S+ is newer: a '
                  r'restart resumes it\)', error), error
    ckpt = torch.load(tmp_path / 'many' / 'ckpt.pt', weights_only=True)
    assert ckpt['iter_num'] == 6 and all(torch.isfinite(t).all() for t in ckpt['model'].values())
    # the stop keeps its memory snapshot, which a restart would resume: the test's own, in RAM, removed here
    shutil.rmtree(snapshot_dir((tmp_path / 'many' / 'run_id').read_text().strip()))


def test_a_run_resumed_from_a_kept_memory_snapshot_that_diverges_names_the_state_a_restart_resumes(
        tmp_path, data_dir, shared_run):
    """A run killed at 12, its checkpoint at 10 and its memory snapshot of 11 kept out of RAM in its folder (by a
    start afresh over it, or a copy's start): resumed from that snapshot and diverging, its error named the older
    ckpt.pt as the state a restart resumes, while the restart resumed the snapshot."""
    args = ['--gradient_accumulation_steps=1', '--max_iters=10', '--eval_interval=5']
    out = tmp_path / 'run'
    shutil.copytree(shared_run('train.py', *args), out)
    (tmp_path / 'keep_snapshots.py').write_text(KEEP_SNAPSHOTS)
    run(tmp_path / 'keep_snapshots.py', REPO / 'train.py', *tiny(data_dir, out, *args, '--max_iters=12',
                                                                    '--save_memory_interval=1'), cwd=tmp_path)
    run_id = (out / 'run_id').read_text().strip()
    shutil.rmtree(out)
    shutil.copytree(shared_run('train.py', *args), out)  # its storage as it was at 10
    kept = out / f'snapshots.kept-{run_id}-{socket.gethostname()}'
    shutil.move(snapshot_dir(run_id), kept)
    # steps 12 and 13 non-finite (the wrapper counts from the resumed step 11)
    p = run_with_nans(tmp_path, ','.join(map(str, range(2, 40))), *tiny(data_dir, out, *args, '--max_iters=20',
                                                                         '--max_nonfinite_steps=2'))
    assert f'resuming from {kept}/ckpt.pt at iter 11' in p.stdout, p.stdout[-2000:]
    assert p.returncode == 1 and p.stderr.strip().splitlines()[-1] == (
        f"error: 2 steps in a row up to iter 13 had a non-finite loss or gradient; {out / 'ckpt.pt'} (iter 10) holds "
        f"the last good state (the memory snapshot of iter 11 in {kept} is newer: a restart resumes it): lower "
        f"learning_rate, or check the data"), p.stderr[-2000:]
    # diverging at the very step it resumes (11), the kept snapshot holds the weights that gave it: set aside as a
    # snapshot in RAM is, the error naming ckpt.pt, which the restart resumes
    p = run_with_nans(tmp_path, ','.join(map(str, range(1, 40))), *tiny(data_dir, out, *args, '--max_iters=20',
                                                                         '--max_nonfinite_steps=2'))
    assert p.returncode == 1 and p.stderr.strip().splitlines()[-1] == (
        f"error: 2 steps in a row up to iter 12 had a non-finite loss or gradient; {out / 'ckpt.pt'} (iter 10) holds "
        f"the last good state: lower learning_rate, or check the data"), p.stderr[-2000:]
    assert sorted(os.listdir(kept)) == ['diverged-ckpt-11.pt']
    shutil.rmtree(snapshot_dir(run_id), ignore_errors=True)  # (none is left in RAM: the test's own, if any)


def test_float16_overflows_are_counted_and_a_loss_scale_below_1_stops_the_run(tmp_path, data_dir):
    """From the 6th step on every gradient overflows, whatever GradScaler's scale: each skip is said and logged,
    with the scale it halved to, and the 17th, from 65536 to 0.5, stops the run as non-finite losses would."""
    out = tmp_path / 'run'
    p = run_with_nans(tmp_path, '0', *tiny(data_dir, out, '--gradient_accumulation_steps=1', '--max_iters=40',
                                           '--eval_interval=4', '--dtype=float16'), overflow_from=6)
    assert p.returncode == 1, p.stdout[-2000:]
    assert 'iter 5: float16 gradient overflow, step skipped, loss scale now 32768 (1 in a row)' in p.stdout
    assert p.stderr.strip().splitlines()[-1] == (
        f"error: 17 steps in a row up to iter 21 had a non-finite gradient in float16 (loss scale down to 0.5); "
        f"{out / 'ckpt.pt'} (iter 4) holds the last good state: lower learning_rate, use bfloat16 rather than "
        f"float16, or check the data")
    rows = [json.loads(line) for line in (out / 'metrics.jsonl').read_text().splitlines()]
    assert [r['loss_scale'] for r in rows if r.get('skipped') == 'float16 gradient overflow'] == \
        [2.0 ** -k for k in range(-15, 2)]
    ckpt = torch.load(out / 'ckpt.pt', weights_only=True)
    assert ckpt['iter_num'] == 4 and all(torch.isfinite(t).all() for t in ckpt['model'].values())


@pytest.mark.parametrize('script', ['train.py', 'ds_train.py'])
def test_a_run_resumed_within_float16_overflows_counts_on_from_those_before_it(tmp_path, data_dir, script):
    """The float16 runs of the tests around this one, whose gradients overflow from iter 5 on, ended by max_iters at
    iter 10 and resumed: the saves made there say how many steps in a row were skipped before them, and the resumed
    run counts on from them. It stops as the uninterrupted run does, word for word: the state of iter 4 the last good
    one (counting from 0, it had named the save of iter 10, whose weights are iter 5's, and set aside only what came
    after it)."""
    out = tmp_path / 'run'
    args = ['--gradient_accumulation_steps=1', '--eval_interval=4', '--dtype=float16',
            *(['--zero_stage=2'] * (script == 'ds_train.py'))]
    p = run_with_nans(tmp_path, '0', *tiny(data_dir, out, *args, '--max_iters=10'), script=script, overflow_from=6)
    assert p.returncode == 0 and re.search(r'iter 9: float16 gradient overflow, .* \(5 in a row\)', p.stdout), \
        p.stdout[-2000:]
    p = run_with_nans(tmp_path, '0', *tiny(data_dir, out, *args, '--max_iters=40'), script=script, overflow_from=1)
    assert p.returncode == 1 and re.search(r'iter 10: float16 gradient overflow, .* \(6 in a row\)', p.stdout), \
        p.stdout[-2000:]
    stop = '17 steps in a row up to iter 21 had a non-finite gradient in float16 (loss scale down to 0.5)' \
        if script == 'train.py' else "16 steps in a row up to iter 20 had a non-finite gradient in float16 at " \
        "DeepSpeed's min_loss_scale"
    assert p.stderr.strip().splitlines()[-1] == (
        f"error: {stop}; {out / 'ckpt.pt'} (iter 4) holds the last good state: lower learning_rate, use bfloat16 "
        f"rather than float16, or check the data")


def test_saves_in_a_run_of_float16_overflows_that_stops_the_run_push_out_no_good_state(tmp_path, data_dir):
    """keep_checkpoints=1, and every gradient overflows from iter 5 on: the saves of the run of overflows (storage
    and memory, every 2 steps) hold the weights of iter 5, which the stop sets aside; each replaced the one before it
    in place of pushing out the state of iter 4, which stays the newest in out_dir and in the node's memory."""
    out = tmp_path / 'run'
    p = run_with_nans(tmp_path, '0', *tiny(data_dir, out, '--gradient_accumulation_steps=1', '--max_iters=40',
                                           '--eval_interval=4', '--dtype=float16', '--keep_checkpoints=1',
                                           '--save_storage_interval=2', '--save_memory_interval=2'), overflow_from=6)
    shm = snapshot_dir((out / 'run_id').read_text().strip())
    kept = {f: torch.load(Path(shm) / f, weights_only=True)['iter_num'] for f in os.listdir(shm)}
    shutil.rmtree(shm)  # the test's own, in RAM
    assert p.returncode == 1 and f"{out / 'ckpt.pt'} (iter 4) holds the last good state" in p.stderr, p.stderr[-2000:]
    assert 'no storage save' not in p.stdout and p.stdout.count('saving checkpoint') == len(range(2, 21, 2))
    assert sorted(f.name for f in out.glob('*ckpt*')) == ['ckpt.pt', 'diverged-ckpt-20.pt']
    assert torch.load(out / 'ckpt.pt', weights_only=True)['iter_num'] == 4
    assert kept == {'ckpt.pt': 4, 'diverged-ckpt-20.pt': 20}


def test_deepspeed_float16_overflows_are_counted_and_its_min_loss_scale_stops_the_run(tmp_path, data_dir):
    """ds_train.py's float16 as train.py's: a step whose gradients overflow, which DeepSpeed's loss scaler skips, is
    said and logged with the scale it lowered to (DeepSpeed's own line is at a log level that prints nothing), and
    counted: the evals in a run of them save nothing, and the stop at its min_loss_scale says how many in a row (it
    said 1) and names the state from before them."""
    out = tmp_path / 'run'
    p = run_with_nans(tmp_path, '0', *tiny(data_dir, out, '--gradient_accumulation_steps=1', '--max_iters=40',
                                           '--eval_interval=4', '--dtype=float16', '--zero_stage=2'),
                      script='ds_train.py', overflow_from=6)
    assert p.returncode == 1, p.stdout[-2000:]
    assert 'iter 6: float16 gradient overflow, step skipped, loss scale now 8192 (2 in a row)' in p.stdout
    assert p.stderr.strip().splitlines()[-1] == (
        f"error: 16 steps in a row up to iter 20 had a non-finite gradient in float16 at DeepSpeed's min_loss_scale; "
        f"{out / 'ckpt.pt'} (iter 4) holds the last good state: lower learning_rate, use bfloat16 rather than "
        f"float16, or check the data")
    rows = [json.loads(line) for line in (out / 'metrics.jsonl').read_text().splitlines()]
    assert [r['loss_scale'] for r in rows if r.get('skipped') == 'float16 gradient overflow' and r['iter'] >= 5] \
        == [2.0 ** k for k in range(14, -1, -1)]
    assert torch.load(out / 'ckpt.pt', weights_only=True)['iter_num'] == 4


def test_deepspeed_float16_at_a_static_loss_scale_stops_after_max_nonfinite_steps_overflows(tmp_path, data_dir):
    """A ds_config's static fp16 loss scale never falls to DeepSpeed's min_loss_scale: gradients that overflow at it
    every step had the run skip every step forever. max_nonfinite_steps of them in a row stop it, in the same line."""
    out = tmp_path / 'run'
    (tmp_path / 'static.json').write_text(json.dumps({'fp16': {'enabled': True, 'loss_scale': 128}}))
    p = run_with_nans(tmp_path, '0', *tiny(data_dir, out, '--gradient_accumulation_steps=1', '--max_iters=30',
                                           '--eval_interval=4', '--dtype=float16', '--zero_stage=2',
                                           '--max_nonfinite_steps=3', f'--ds_config={tmp_path / "static.json"}'),
                      script='ds_train.py', overflow_from=6)
    assert p.returncode == 1, p.stdout[-2000:]
    assert 'iter 5: float16 gradient overflow, step skipped, loss scale 128 (1 in a row)' in p.stdout, p.stdout[-2000:]
    assert p.stderr.strip().splitlines()[-1] == (
        f"error: 3 steps in a row up to iter 7 had a non-finite gradient in float16 (static loss scale 128); "
        f"{out / 'ckpt.pt'} (iter 4) holds the last good state: lower learning_rate, use bfloat16 rather than "
        f"float16, or check the data")
    assert torch.load(out / 'ckpt.pt', weights_only=True)['iter_num'] == 4


@pytest.mark.parametrize('script', ['train.py', 'ds_train.py'])
def test_a_lone_float16_overflow_leaves_the_saves_after_it(tmp_path, data_dir, script):
    """A step whose gradients overflowed (the 4th, iter 3), which the loss scaler skipped, leaves the weights as the
    step before left them, and a finite loss showed them good: a SIGTERM heeded right after it saves the state
    (nothing was saved there, and the run's progress since its last save was lost); and so does the end of a run
    (max_iters) right after one. In train.py the memory snapshot after it is taken too: the non-finite losses from
    iter 5 on stop the run naming it, the newest good state."""
    args = ['--gradient_accumulation_steps=1', '--dtype=float16', *(['--zero_stage=2'] * (script == 'ds_train.py'))]
    out = tmp_path / 'term'
    # (DeepSpeed's scale starts at 65536, which overflows the first two steps: its first optimizer step is iter 2's)
    p = run_with_nans(tmp_path, '0', *tiny(data_dir, out, *args, '--max_iters=12', '--eval_interval=6'),
                      script=script, overflow_steps=4, term_step=1 if script == 'ds_train.py' else 3)
    assert p.returncode == 0, p.stderr[-2000:]
    assert 'iter 3: float16 gradient overflow, step skipped' in p.stdout, p.stdout[-2000:]
    assert 'SIGTERM: saving a checkpoint at iter 4 and exiting' in p.stdout and 'no storage save' not in p.stdout
    assert torch.load(out / 'ckpt.pt', weights_only=True)['iter_num'] == 4
    out = tmp_path / 'end'
    p = run_with_nans(tmp_path, '0', *tiny(data_dir, out, *args, '--max_iters=4', '--eval_interval=6'),
                      script=script, overflow_steps=4)
    assert p.returncode == 0 and 'no storage save' not in p.stdout, p.stdout[-2000:]
    assert torch.load(out / 'ckpt.pt', weights_only=True)['iter_num'] == 4
    if script == 'ds_train.py':
        return
    out = tmp_path / 'snapshot'
    p = run_with_nans(tmp_path, ','.join(map(str, range(6, 40))),
                      *tiny(data_dir, out, *args, '--max_iters=12', '--eval_interval=6', '--save_memory_interval=2',
                            '--max_nonfinite_steps=3'), overflow_steps=4)
    shutil.rmtree(snapshot_dir((out / 'run_id').read_text().strip()), ignore_errors=True)  # the test's own, in RAM
    assert p.returncode == 1
    assert re.search(r"error: 3 steps in a row up to iter 7 had a non-finite loss or gradient; \S+ holds no state "
                     r"saved before the weights went bad \(the memory snapshot of iter 4 in \S+ is newer",
                     p.stderr.strip().splitlines()[-1]), p.stderr[-2000:]


def test_weights_spoiled_by_a_step_with_a_finite_loss_are_never_left_the_newest_state(tmp_path, data_dir):
    """The 4th optimizer step (iter 3) puts an inf into the weights while its own loss and gradient were finite: the
    periodic save at iter 4 comes before any loss shows it, and holds them. The run ends (max_iters) before
    max_nonfinite_steps could stop it, on 2 non-finite steps and a non-finite final eval: it stops as the limit
    would, the save of iter 4 set aside, and the eval's checkpoint of iter 3 the newest. Tools refuse the bad one."""
    out = tmp_path / 'run'
    p = run_with_nans(tmp_path, '0', *tiny(data_dir, out, '--gradient_accumulation_steps=1', '--max_iters=6',
                                           '--eval_interval=3', '--save_storage_interval=1'), poison_step=4)
    assert p.returncode == 1, p.stdout[-2000:]
    assert p.stderr.strip().splitlines()[-1] == (
        f"error: 2 steps in a row up to iter 5 had a non-finite loss or gradient, and so had the final eval; "
        f"{out / 'ckpt.pt'} (iter 3) holds the last good state: lower learning_rate, or check the data")  # float32

    ckpt = torch.load(out / 'ckpt.pt', weights_only=True)
    assert ckpt['iter_num'] == 3 and all(torch.isfinite(t).all() for t in ckpt['model'].values())
    bad = out / 'diverged-ckpt-4.pt'
    assert not all(torch.isfinite(t).all() for t in weights(bad).values())
    for tool, args in (('sample.py', ['--device=cpu']), ('export_hf.py', [f'--out={tmp_path / "hf"}']),
                       ('train.py', tiny(data_dir, tmp_path / 'ft'))):
        q = run(tool, f"--{'ckpt' if tool == 'export_hf.py' else 'init_from'}={bad}", *args, cwd=tmp_path, check=False)
        assert one_line_error(q) == f"error: the weights in {bad} hold inf or nan (1 of 36 tensors: " \
            "transformer.wte.weight): they were saved after the run had diverged; give a checkpoint of it from " \
            "before (ckpt.pt, best.pt or an earlier step folder)", tool
    assert sorted(f.name for f in tmp_path.iterdir()) == ['nan_wrapper.py', 'run']


def test_a_two_rank_run_stopped_by_nonfinite_steps_exits_1_on_both_ranks_under_torchrun(tmp_path, data_dir):
    # a real torchrun and interpreters (the suite's launcher skips the interpreter's end): there, left to tear down
    # its C++ objects, gloo aborted 5 of 8 such runs (exit -6, 'terminate called without an active exception')
    p = run_with_nans(tmp_path, ','.join(map(str, range(8, 40))),
                      *tiny(data_dir, tmp_path / 'run', '--gradient_accumulation_steps=2', '--max_iters=12',
                            '--eval_interval=6', '--max_nonfinite_steps=3'),
                      launcher=('-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2'))
    assert p.returncode == 1
    assert p.stderr.count('error: 3 steps in a row up to iter 9 had a non-finite loss') == 2, p.stderr[-3000:]
    assert 'terminate called' not in p.stderr and sorted(re.findall(r'exitcode\s+: (-?\d+)', p.stderr)) == ['1', '1']


@pytest.mark.parametrize('script,extra', [('fsdp_train.py', []), ('fsdp_train.py', ['--adamw_on_shards=True']),
                                          ('decent_train.py', []),
                                          ('ds_train.py', ['--zero_stage=2']), ('ds_train.py', ['--zero_stage=0']),
                                          ('ds_train.py', ['--zero_stage=2', '--dtype=bfloat16']),
                                          ('ds_train.py', ['--zero_stage=2', '--dtype=bfloat16',
                                                           '--overflow_by_norm=False']),
                                          ('pp_train.py', ['--pp_size=2', '--pp_schedule=gpipe']),
                                          ('pp_train.py', ['--pp_size=2', '--pp_schedule=gpipe', '--dp_shard=True',
                                                           '--adamw_on_shards=True']),
                                          ('pp_train.py', ['--pp_size=2', '--pp_schedule=gpipe', '--tp_size=2'])],
                         ids=['fsdp', 'fsdp-adamw-on-shards', 'decent', 'ds-zero2', 'ds-zero0', 'ds-zero2-bf16-by-norm',
                              'ds-zero2-bf16-each', 'pp', 'pp-sharded-adamw-on-shards', 'pp-tp'])
def test_nonfinite_loss_skips_the_step_and_several_in_a_row_stop_the_run(tmp_path, data_dir, script, extra):
    # the 4th step goes bad, then every one from the 8th: after max_nonfinite_steps=3 the run stops, the checkpoint
    # of iter 6 intact. DeepSpeed skips the step itself under ZeRO (in fp32 by its norm, in bf16 by the norm alone,
    # its default, or with overflow_by_norm=False by DeepSpeed's check of each gradient and by its norm); at stage 0
    # ds_train.py guards our AdamW. A pipeline of 2 ranks (one micro-batch a step): only its last stage sees the loss,
    # and both skip the step.
    args = ['--gradient_accumulation_steps=1', '--max_iters=12', '--eval_interval=6', '--max_nonfinite_steps=3', *extra]
    p = run_with_nans(tmp_path, ','.join(map(str, [4, *range(8, 40)])), *tiny(data_dir, tmp_path / 'run', *args),
                      script=script, nproc=(2 if '--pp_size=2' in extra else 1) * (2 if '--tp_size=2' in extra else 1))
    assert p.returncode != 0
    assert re.search(r'iter 3: non-finite loss[a-z ]*, step skipped \(1 in a row\)', p.stdout), p.stdout[-3000:]
    assert 'iter 5: non-finite' not in p.stdout and 'iter 6: non-finite' not in p.stdout
    assert p.stderr.strip().splitlines()[-1].startswith('error: 3 steps in a row up to iter 9 had a non-finite loss')
    losses, _ = read_metrics(tmp_path / 'run')
    # ds_train.py and decent_train.py read the verdict at once (DeepSpeed's step and decent's backward need it on the
    # host), the others a step later, so they log the last bad step's loss before they stop
    bad = [3, 7, 8] if script in ('ds_train.py', 'decent_train.py') else [3, 7, 8, 9]
    assert [it for it, v in losses.items() if not math.isfinite(v)] == bad and losses[6] < losses[0]
    assert (tmp_path / 'run' / KIND[script] / 'latest').read_text() == 'step-00000006'
    assert all(torch.isfinite(t).all() for t in final_weights(script, tmp_path / 'run').values())
    assert ('found by the global norm alone' in p.stdout) == ('--dtype=bfloat16' in extra and
                                                              '--overflow_by_norm=False' not in extra)
