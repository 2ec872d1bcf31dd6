"""Ctrl-C is a preemption, in real processes: SIGINT in training finishes the step, saves a checkpoint of that step
and exits non-zero with one line (the run is not done); a second Ctrl-C leaves at once, and the newest checkpoint
still loads. In a tool, Ctrl-C is one line and a non-zero exit, not a traceback."""

import os
import pty
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, SHAKESPEARE, TINY, begin, env, free_port, one_line_error, run
from launcher import finish
from test_fault import logged_iters

ARGS = ['--gradient_accumulation_steps=2', '--max_iters=100000', '--eval_interval=4']


def as_at_a_terminal():
    """A process started in the background of a shell (`cmd &`, as a suite may be) has SIGINT ignored, and Python
    keeps it so: Ctrl-C at a terminal reaches a process that has its default handling, as here."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(cmd, data_dir, out_dir, cwd):
    # a session of its own, so that the test can send SIGINT to the whole group, as a terminal's Ctrl-C does
    return subprocess.Popen([sys.executable, *cmd, *TINY, f'--dataset={data_dir / "shakespeare_char"}',
                             f'--out_dir={out_dir}', *ARGS], cwd=cwd, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=as_at_a_terminal)


def interrupt_after(p, out_dir, iters):
    while not (logged_iters(out_dir) and logged_iters(out_dir)[-1] >= iters):
        assert p.poll() is None, p.communicate()
        time.sleep(0.01)
    os.killpg(p.pid, signal.SIGINT)


def forked(script, data_dir, out_dir, cwd):
    """An entrypoint on one process, forked from the test server (conftest.begin): no interpreter's start-up. Each
    entrypoint sets its own SIGINT handler, so a Ctrl-C reaches it as at a terminal; the signal goes to the process
    alone, which shares the test's process group. Returns (the process, what launcher.finish() waits on)."""
    return begin(script, *TINY, f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={out_dir}', *ARGS, cwd=cwd)


def ctrl_c_after(p, out_dir, iters):
    while not (logged_iters(out_dir) and logged_iters(out_dir)[-1] >= iters):
        assert p.exitcode is None
        time.sleep(0.01)
    os.kill(p.pid, signal.SIGINT)


def stopped_at(out):
    return int(re.search(r'SIGINT \(Ctrl-C\): saving a checkpoint at iter (\d+) and exiting', out)[1])


def test_ctrl_c_in_train_saves_the_step_and_exits_non_zero_with_one_line(tmp_path, data_dir):
    out_dir = tmp_path / 'run'
    p, started = forked('train.py', data_dir, out_dir, tmp_path)
    ctrl_c_after(p, out_dir, 5)
    done = finish(started, timeout=120)
    out, err = done.stdout, done.stderr
    assert done.returncode == 130, err[-3000:]
    assert err.strip() == "error: stopped by Ctrl-C after saving a checkpoint: rerun the same command to resume"
    stopped = stopped_at(out)
    assert stopped > 5
    assert torch.load(out_dir / 'ckpt.pt', weights_only=True)['iter_num'] == stopped
    p = run('train.py', *TINY, f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={out_dir}',
            '--gradient_accumulation_steps=2', f'--max_iters={stopped + 1}', cwd=tmp_path)
    assert f'at iter {stopped}' in p.stdout


def test_ctrl_c_that_also_ends_the_reader_of_the_runs_output_still_saves_the_step(tmp_path, data_dir):
    # `python train.py ... | tee log`: Ctrl-C ends tee too, and the run's first print after it (the handler's own)
    # raised BrokenPipeError, a traceback that lost the steps since the last eval's checkpoint
    out_dir = tmp_path / 'run'
    p = start([str(REPO / 'train.py')], data_dir, out_dir, tmp_path)
    while not (logged_iters(out_dir) and logged_iters(out_dir)[-1] >= 5):
        assert p.poll() is None, p.communicate()
        time.sleep(0.01)
    p.stdout.close()  # the reader is gone
    os.killpg(p.pid, signal.SIGINT)
    err = p.stderr.read()
    assert p.wait(timeout=120) == 130, err[-3000:]
    assert err.strip() == "error: stopped by Ctrl-C after saving a checkpoint: rerun the same command to resume"
    assert torch.load(out_dir / 'ckpt.pt', weights_only=True)['iter_num'] == logged_iters(out_dir)[-1] + 1


@pytest.mark.parametrize('nohup', [False, True])
def test_a_closed_terminals_sighup_saves_the_step_and_under_nohup_the_run_trains_on(tmp_path, data_dir, nohup):
    # SIGHUP, which a terminal that closes sends the runs started there, killed the run where it stood, losing the
    # steps since its last save, and what it printed then to the closed terminal raised OSError (EIO); nohup ignores
    # SIGHUP, and the run must train on then
    out_dir = tmp_path / 'run'
    terminal, its_end = pty.openpty()
    p = subprocess.Popen([sys.executable, str(REPO / 'train.py'), *TINY, f'--dataset={data_dir / "shakespeare_char"}',
                          f'--out_dir={out_dir}', *ARGS], cwd=tmp_path, env=env(), stdout=its_end,
                         stderr=subprocess.PIPE, text=True, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN if nohup else signal.SIG_DFL))
    os.close(its_end)
    try:
        while not (logged_iters(out_dir) and logged_iters(out_dir)[-1] >= 5):
            assert p.poll() is None, p.communicate()
            os.read(terminal, 1 << 16)  # what the terminal shows
    finally:
        os.close(terminal)  # closed: what the run prints now fails with EIO
    p.send_signal(signal.SIGHUP)
    if nohup:
        interrupt_after(p, out_dir, logged_iters(out_dir)[-1] + 5)  # it trained on, and stops at a Ctrl-C
    err = p.stderr.read()
    assert p.wait(timeout=120) == (130 if nohup else 129), err[-3000:]
    assert err.strip() == f"error: stopped by {'Ctrl-C' if nohup else 'SIGHUP'} after saving a checkpoint: rerun the " \
        "same command to resume"
    assert torch.load(out_dir / 'ckpt.pt', weights_only=True)['iter_num'] == logged_iters(out_dir)[-1] + 1


def test_ctrl_c_on_two_ranks_saves_the_same_step_on_both_and_exits_non_zero(tmp_path, data_dir):
    out_dir = tmp_path / 'run'
    p = start(['-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', str(REPO / 'train.py')],
              data_dir, out_dir, tmp_path)
    interrupt_after(p, out_dir, 3)
    out, err = p.communicate(timeout=180)
    assert p.returncode != 0, out[-3000:]
    # torchrun itself answers SIGINT with a traceback of its own (SignalException); the workers' exit is clean
    assert 'error: stopped by Ctrl-C after saving a checkpoint' in err and 'train.py", line' not in err, err[-3000:]
    stopped = stopped_at(out)
    assert torch.load(out_dir / 'ckpt.pt', weights_only=True)['iter_num'] == stopped


def test_ranks_whose_torchrun_is_killed_save_the_step_and_exit(tmp_path, data_dir):
    # torchrun starts each rank in a session of its own: SIGKILLed (kill -9, the OOM killer), it left them training
    # on to max_iters, holding out_dir (a restart was refused) and their devices, with nothing to stop them. One
    # rank shows it (each rank sees its own launcher go, and agree() stops them all at one step)
    out_dir = tmp_path / 'run'
    p = start(['-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=1', str(REPO / 'train.py')],
              data_dir, out_dir, tmp_path)
    while not (logged_iters(out_dir) and logged_iters(out_dir)[-1] >= 3):
        assert p.poll() is None, p.communicate()
        time.sleep(0.01)
    os.kill(p.pid, signal.SIGKILL)
    try:
        out, err = p.communicate(timeout=120)  # the ranks hold its output pipes until they exit
    except subprocess.TimeoutExpired:
        for pid in [int(d) for d in os.listdir('/proc') if d.isdigit()]:  # the ranks, by their own out_dir
            try:
                with open(f'/proc/{pid}/cmdline', 'rb') as f:
                    if f'--out_dir={out_dir}'.encode() in f.read().split(b'\0'):
                        os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        raise AssertionError("the ranks went on training with their torchrun gone") from None
    stopped = int(re.search(r'the launcher \(pid \d+\) is gone: saving a checkpoint at iter (\d+)', out)[1])
    assert torch.load(out_dir / 'ckpt.pt', weights_only=True)['iter_num'] == stopped
    assert not (out_dir / 'run.lock').exists() and 'Traceback' not in err, err[-3000:]


@pytest.mark.parametrize('script', ['fsdp_train.py', 'ds_train.py', 'decent_train.py', 'pp_train.py'])
def test_ctrl_c_in_every_entrypoint_saves_the_step_it_stops_at_and_the_rerun_resumes_there(tmp_path, data_dir, script):
    out_dir = tmp_path / 'run'
    p, started = forked(script, data_dir, out_dir, tmp_path)
    ctrl_c_after(p, out_dir, 5)
    done = finish(started, timeout=180)
    out, err = done.stdout, done.stderr
    assert done.returncode == 130, err[-3000:]
    assert err.strip().splitlines()[-1] == \
        "error: stopped by Ctrl-C after saving a checkpoint: rerun the same command to resume", err[-3000:]
    assert 'Traceback' not in err
    stopped = stopped_at(out)
    assert stopped > 5
    p = run(script, *TINY, f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={out_dir}',
            '--gradient_accumulation_steps=2', f'--max_iters={stopped + 1}', cwd=tmp_path)
    assert f'holds this run\'s state at iter {stopped},' in p.stdout, p.stdout[-3000:]


# Runs a script with the write of the first checkpoint that follows a Ctrl-C held up halfway, for up to a minute,
# as a big model's long write would be: the tiny model's takes milliseconds, less than a busy machine may take to
# wake the test that sends the second Ctrl-C, which then came after the save and the exit's message
SLOW_SAVE = '''
import io, os, runpy, signal, sys, threading, time
sys.path.insert(0, os.path.dirname(sys.argv[1]))
import checkpoint, distributed, torch
save, atomic_save, held, holds = torch.save, checkpoint.atomic_save, threading.local(), []
def held_atomic_save(*args, **kwargs):  # a checkpoint's write (not torch.save pickling the RNG states to gather)
    held.up = signal.SIGINT in distributed._stop_signals
    return atomic_save(*args, **kwargs)
def slow_save(obj, f, *args, **kwargs):
    if not getattr(held, 'up', False) or holds:  # the first such write only
        return save(obj, f, *args, **kwargs)
    holds.append(obj)
    buffer = io.BytesIO()
    save(obj, buffer, *args, **kwargs)
    data = buffer.getvalue()
    f.write(data[:len(data) // 2])
    f.flush()
    print('write held', flush=True)
    time.sleep(60)
    f.write(data[len(data) // 2:])
checkpoint.atomic_save, torch.save = held_atomic_save, slow_save
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name='__main__')
'''


def test_a_second_ctrl_c_during_the_save_leaves_at_once_and_the_newest_checkpoint_loads(tmp_path, data_dir):
    out_dir = tmp_path / 'run'
    (tmp_path / 'slow_save.py').write_text(SLOW_SAVE)
    p, started = begin(tmp_path / 'slow_save.py', REPO / 'train.py', *TINY,
                       f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={out_dir}', *ARGS, cwd=tmp_path)
    ctrl_c_after(p, out_dir, 5)  # evals at 4 saved a checkpoint already
    stdout = os.path.join(started[1][2], 'out')  # the file that the process's stdout goes to (launcher.start)
    while 'write held\n' not in open(stdout).read():  # the checkpoint of the stop is being written
        assert p.exitcode is None
        time.sleep(0.01)
    assert (out_dir / 'ckpt.pt.tmp').stat().st_size  # half of it written
    os.kill(p.pid, signal.SIGINT)
    done = finish(started, timeout=120)
    err = done.stderr
    assert done.returncode == 130
    assert err.strip().startswith('error: interrupted twice: left without saving'), err[-3000:]
    assert not (out_dir / 'ckpt.pt.tmp').exists()  # it left in the middle of the write, and removed the half
    newest = [torch.load(f, weights_only=True)['iter_num'] for f in (out_dir / 'ckpt.pt', out_dir / 'ckpt.prev.pt')
              if f.exists()]
    assert newest and max(newest) >= 4
    p = run('train.py', *TINY, f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={out_dir}',
            '--gradient_accumulation_steps=2', f'--max_iters={max(newest) + 1}', cwd=tmp_path)
    assert f'at iter {max(newest)}' in p.stdout


def test_a_run_left_by_a_second_ctrl_c_before_its_first_save_is_named_so_and_starts_again(tmp_path, data_dir):
    # the second Ctrl-C leaves its snapshot folder in RAM holding its hold alone: no tool may call that a snapshot,
    # and --init_from=resume named that folder ("no checkpoint at /dev/shm/nanogpt-...") in place of out_dir's ckpt.pt
    out_dir = tmp_path / 'run'
    (tmp_path / 'slow_save.py').write_text(SLOW_SAVE)
    p, started = begin(tmp_path / 'slow_save.py', REPO / 'train.py', *TINY,
                       f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={out_dir}', *ARGS,
                       '--eval_interval=100000', cwd=tmp_path)
    ram = None
    try:
        ctrl_c_after(p, out_dir, 2)  # no eval yet, so no checkpoint
        ram = Path('/dev/shm') / f"nanogpt-{(out_dir / 'run_id').read_text().strip()}"
        stdout = os.path.join(started[1][2], 'out')
        while 'write held\n' not in open(stdout).read():  # the stop's checkpoint, its first, is being written
            assert p.exitcode is None
            time.sleep(0.01)
        os.kill(p.pid, signal.SIGINT)
        done = finish(started, timeout=120)
        assert done.returncode == 130 and done.stderr.strip() == "error: interrupted twice: left without saving; a " \
            "save being written is dropped, those before it kept: rerun the same command to go on from the run's " \
            "newest saved state", done.stderr[-2000:]  # it said "out_dir keeps its newest complete checkpoint"
        assert os.listdir(ram) == ['run.lock'] and not (out_dir / 'ckpt.pt').exists()
        for script, flags in (('sample.py', ['--device=cpu', f'--out_dir={out_dir}']),
                              ('export_hf.py', [f'--ckpt={out_dir}', f'--out={tmp_path / "hf"}']),
                              ('train.py', [*TINY, f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={out_dir}',
                                            '--init_from=resume'])):
            msg = one_line_error(run(script, *flags, cwd=tmp_path, check=False))
            assert msg.startswith(f"error: no checkpoint at {out_dir / 'ckpt.pt'}: "), msg
        assert not (tmp_path / 'hf').exists()
        p = run('train.py', *TINY, f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={out_dir}',
                '--gradient_accumulation_steps=2', '--max_iters=2', cwd=tmp_path)
        assert 'resuming' not in p.stdout and (out_dir / 'ckpt.pt').exists() and not ram.exists()
    finally:
        if ram:
            shutil.rmtree(ram, ignore_errors=True)


@pytest.mark.parametrize('tool', ['sample.py', 'bench.py', 'bench_checkpoint.py', 'bench_pipeline.py', 'plot.py'])
def test_ctrl_c_in_a_tool_is_one_line_and_a_non_zero_exit(tmp_path, data_dir, shared_run, tool):
    e = dict(env(), PYTHONFAULTHANDLER='1')
    if tool == 'sample.py':
        ckpt = shared_run('train.py', '--max_iters=4', '--gradient_accumulation_steps=1')
        args = [f'--out_dir={ckpt}', '--device=cpu', '--num_samples=1000', '--max_new_tokens=30', '--start=a',
                f'--meta_path={data_dir / "shakespeare_char" / "meta.pkl"}']
    elif tool == 'bench.py':
        args = ['--device=cpu', '--dtype=float32', '--compile=False', '--n_layer=2', '--n_head=2', '--n_embd=32',
                '--block_size=32', '--batch_size=4', '--iters=1000000', '--warmup=0']
    elif tool == 'bench_checkpoint.py':
        args = ['--what=save', '--device=cpu', '--n_layer=1', '--n_head=2', '--n_embd=32', '--vocab_size=65',
                '--block_size=32', '--repeats=1000000', f'--out_dir={tmp_path / "bench"}']
    elif tool == 'bench_pipeline.py':  # one rank, as torchrun would start it
        args = ['--steps=1000000', '--microbatches=1']
        e.update(RANK='0', WORLD_SIZE='1', MASTER_ADDR='127.0.0.1', MASTER_PORT=str(free_port()))
    else:  # plot.py reads a pipe that a writer holds open: it waits there, in the middle of reading the run
        os.mkfifo(tmp_path / 'metrics.jsonl')
        args = [str(tmp_path / 'metrics.jsonl'), f'--out={tmp_path / "loss.png"}']
    p = subprocess.Popen([sys.executable, str(REPO / tool), *args], cwd=tmp_path, env=e,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=as_at_a_terminal)
    if tool == 'plot.py':
        while True:  # the pipe opens for writing once plot.py has opened it for reading
            try:
                pipe = os.open(tmp_path / 'metrics.jsonl', os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError:
                assert p.poll() is None, p.communicate()
                time.sleep(0.01)
    else:
        assert p.stdout.readline()  # sampling / timing has begun
    p.send_signal(signal.SIGINT)
    if tool == 'plot.py':
        # CPython only sets a flag when a signal lands in the instants between its last check and the blocking
        # read(), which then waits on: a line from the writer wakes it, as more of a run would from a real file
        give_up = time.monotonic() + 60
        while p.poll() is None and time.monotonic() < give_up:
            try:
                os.write(pipe, b'\n')  # a blank line, which plot.py skips
            except OSError:  # plot.py has closed the pipe on its way out
                pass
            time.sleep(0.2)
    try:
        out, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # say where it was
        p.send_signal(signal.SIGABRT)  # faulthandler (PYTHONFAULTHANDLER) prints every thread's stack
        out, err = p.communicate()
        raise AssertionError(f"{tool} did not stop within 60 s of Ctrl-C; its stacks:\n{err[-4000:]}") from None
    assert p.returncode == 130, err[-3000:]
    assert err.strip() == "error: interrupted (Ctrl-C); nothing half-written is kept: rerun to start over"
    if tool == 'plot.py':
        os.close(pipe)
        assert not (tmp_path / 'loss.png').exists()
    if tool == 'bench_checkpoint.py':
        assert os.listdir(tmp_path / 'bench') == ['BENCH_CHECKPOINT']  # the saves it was timing are gone


def test_ctrl_c_while_an_entrypoint_imports_torch_is_one_line_and_exit_130(tmp_path):
    # Ctrl-C in the first ~3 s of a run, while torch loads, printed a KeyboardInterrupt traceback: a stand-in torch
    # that takes the Ctrl-C on import makes the moment exact
    (tmp_path / 'torch.py').write_text("import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(30)\n")
    for script in ('train.py', 'fsdp_train.py', 'ds_train.py', 'decent_train.py', 'pp_train.py'):
        p = subprocess.run([sys.executable, str(REPO / script)], cwd=tmp_path, capture_output=True, text=True,
                           env=dict(env(), PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}"), preexec_fn=as_at_a_terminal,
                           timeout=60)
        assert (p.returncode, p.stderr.strip(), p.stdout) == \
            (130, "error: interrupted (Ctrl-C); nothing half-written is kept: rerun to start over", ''), script
    assert os.listdir(tmp_path) == ['torch.py']  # nothing written: the run had not begun


def test_ctrl_c_in_prepare_keeps_the_folder_as_it_was(tmp_path):
    """A GPT-2 prep over an earlier char-level one (--force), interrupted while it writes: the earlier files stay
    whole, and the partial ones are gone."""
    small = tmp_path / 'small.txt'
    small.write_text(SHAKESPEARE.read_text()[:20000])
    out_dir = tmp_path / 'data'
    subprocess.run([sys.executable, str(REPO / 'prepare.py'), 'text', f'--input={small}', '--tokenizer=char',
                    f'--out_dir={out_dir}'],
                   cwd=tmp_path, env=env(), check=True, capture_output=True)
    before = {f.name: f.read_bytes() for f in out_dir.iterdir()}
    big = tmp_path / 'big.txt'
    big.write_text(SHAKESPEARE.read_text() * 40)  # 44 MB: tens of seconds of BPE on one core
    p = subprocess.Popen([sys.executable, str(REPO / 'prepare.py'), 'text', f'--input={big}', '--tokenizer=gpt2',
                          '--num_proc=1', f'--out_dir={out_dir}', '--force=True'], cwd=tmp_path, env=env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=as_at_a_terminal)
    partial = out_dir / 'train.bin.tmp'
    while not (partial.exists() and partial.stat().st_size > 0):
        assert p.poll() is None, p.communicate()
        time.sleep(0.01)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, err[-3000:]
    assert err.strip().splitlines()[-1] == \
        "error: interrupted (Ctrl-C); nothing half-written is kept: rerun to start over" and 'Traceback' not in err
    assert {f.name: f.read_bytes() for f in out_dir.iterdir()} == before


def test_ctrl_c_inside_a_checkpoint_write_is_the_keyboard_interrupt_and_leaves_no_file(tmp_path, monkeypatch):
    # a tool's Ctrl-C lands in the write that torch.save calls back, the one place there Python checks for signals;
    # torch.save turned it into "RuntimeError: unexpected pos", which a tool printed as a traceback, exit 1
    sys.path.insert(0, str(REPO))
    import checkpoint
    writes, real_open = [], open

    class Interrupted:  # the file, whose third write is interrupted
        def __init__(self, f):
            self.f = f

        def write(self, data):
            writes.append(len(data))
            if len(writes) == 3:
                raise KeyboardInterrupt
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

    monkeypatch.setattr(checkpoint, 'open', lambda path, *a, **k: Interrupted(real_open(path, *a, **k)),
                        raising=False)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.atomic_save({'x': torch.zeros(100000)}, str(tmp_path / 'ckpt.pt'))
    assert len(writes) == 3 and os.listdir(tmp_path) == []


def test_a_rank_stopped_by_another_ranks_signal_says_so_not_that_its_launcher_is_gone(monkeypatch):
    # one rank's SIGTERM (a pod's, a node's) stops every rank at the same step; rank 0, which prints the line, had
    # said "the launcher (pid N) is gone" of its live launcher
    import distributed
    monkeypatch.setattr(distributed, '_stop_signals', [])
    monkeypatch.setattr(distributed, '_launcher', [os.getppid()])
    assert distributed.stop_signal() == 'another rank was stopped'
    monkeypatch.setattr(distributed, '_launcher', [-1])  # the pid of a launcher that is gone: this one's parent is not
    assert distributed.stop_signal() == 'the launcher (pid -1) is gone'
