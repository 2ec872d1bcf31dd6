"""
Measures what fault tolerance costs and buys, with the functions the entrypoints use:

- save: how long the training loop is blocked by a memory snapshot (/dev/shm) and by a background checkpoint to
  out_dir, against a synchronous torch.save (+ fsync) of the same state, taken in turns in one process;
- recovery: seconds from SIGKILLing a worker of an elastic torchrun job (train.py, the tiny model) until the
  restarted job logs its next step.

python bench_checkpoint.py                          # both, GPT-2 124M with AdamW state on this machine's CPU
python bench_checkpoint.py --what=save --n_layer=4  # a smaller state
"""

import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time

import torch

from checkpoint import atomic_save, save_in_background, snapshot_dir, wait_for_copies, wait_for_saves
from configurator import configure
from model import GPT, GPTConfig

# -----------------------------------------------------------------------------
what = 'all'  # 'save', 'recovery' or 'all'
out_dir = 'bench_checkpoint'
repeats = 5
n_layer = 12
n_head = 12
n_embd = 768
vocab_size = 50304
block_size = 1024
batch_size = 4  # save: the step the copy overlaps
kills = 3  # recovery: workers killed one after another in one job
dataset = 'shakespeare_char'  # recovery: data/<dataset> as prepare.py writes it
# -----------------------------------------------------------------------------
config, _ = configure(globals())
os.makedirs(out_dir, exist_ok=True)


def bench_save():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=vocab_size, block_size=block_size))
    optimizer = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), 'cpu')
    x = torch.randint(vocab_size, (batch_size, block_size))

    def step(snapshot_to=None):
        """A training step, as train.py takes it after a snapshot: the state is copied during forward and
        backward, and the optimizer waits for the copy. Returns (seconds in all, seconds the loop was blocked)."""
        t0 = time.perf_counter()
        if snapshot_to:
            save_in_background({'model': model.state_dict(), 'optimizer': optimizer.state_dict(), 'iter_num': 1},
                               snapshot_to, keep_previous=snapshot_to.endswith('ckpt.pt'))
        t1 = time.perf_counter()
        model(x, x)[1].backward()
        t2 = time.perf_counter()
        wait_for_copies()
        t3 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, (t1 - t0) + (t3 - t2)

    step()  # AdamW's moments exist from the first step on
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + \
        sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    print(f"state: {model.get_num_params() / 1e6:.1f}M parameters, {size / 2**20:.0f} MiB with AdamW's moments; "
          f"steps of {batch_size}x{block_size} tokens")
    shm = os.path.join(snapshot_dir('bench'), 'ckpt.pt')
    os.makedirs(os.path.dirname(shm), exist_ok=True)
    keys = ('sync torch.save', 'plain step', 'memory: blocked', 'memory: step', 'storage: blocked', 'storage: step')
    times = {k: [] for k in keys}
    for r in range(repeats + 1):  # the first round allocates the host copies: left out of the medians
        t0 = time.perf_counter()
        atomic_save({'model': model.state_dict(), 'optimizer': optimizer.state_dict(), 'iter_num': 1},
                    os.path.join(out_dir, 'sync.pt'))
        sync = time.perf_counter() - t0
        plain, _ = step()
        mem_step, mem_blocked = step(shm)
        wait_for_saves()
        disk_step, disk_blocked = step(os.path.join(out_dir, 'ckpt.pt'))
        wait_for_saves()
        row = dict(zip(keys, (sync, plain, mem_blocked, mem_step, disk_blocked, disk_step)))
        print(f"round {r}: " + ", ".join(f"{k} {v:.3f} s" for k, v in row.items()), flush=True)
        if r > 0:
            for k in keys:
                times[k].append(row[k])
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"medians over {repeats} rounds: " + ", ".join(f"{k} {v:.3f} s" for k, v in med.items()))
    for k in ('memory', 'storage'):
        print(f"{k}: the loop is blocked {med[k + ': blocked'] / med['sync torch.save'] * 100:.1f}% of a "
              f"synchronous save; the step with it takes {med[k + ': step'] / med['plain step']:.2f}x a plain one")
    os.remove(shm)
    return med


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def steps_logged(path):
    try:
        with open(path) as f:
            return [json.loads(line)['iter'] for line in f if '"loss"' in line and line.endswith('\n')]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def bench_recovery():
    run_dir = os.path.join(out_dir, 'recovery')
    metrics = os.path.join(run_dir, 'metrics.jsonl')
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--nnodes=1:2', '--nproc_per_node=2',
           f'--max-restarts={kills}', '--rdzv-backend=c10d', f'--rdzv-endpoint=127.0.0.1:{free_port()}',
           '--rdzv-conf=last_call_timeout=1', 'train.py', f'--dataset={dataset}', f'--out_dir={run_dir}',
           '--device=cpu', '--compile=False', '--n_layer=2', '--n_head=2', '--n_embd=32',
           '--block_size=32', '--batch_size=4', '--gradient_accumulation_steps=2', '--eval_interval=100000',
           '--eval_iters=4', '--max_iters=100000', '--save_memory_interval=10']
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: an old one's checkpoint would be resumed
    log_path = os.path.join(out_dir, 'recovery.log')
    p = subprocess.Popen(cmd, stdout=open(log_path, 'w'), stderr=subprocess.STDOUT)
    recoveries, start = [], 0
    for k in range(kills):
        while not steps_logged(metrics) or steps_logged(metrics)[-1] < start + 30:  # 30 steps into this run
            assert p.poll() is None, f"the job ended early: see {log_path}"
            time.sleep(0.005)
        with open(f'/proc/{p.pid}/task/{p.pid}/children') as f:
            victim = int(f.read().split()[k % 2])
        last = steps_logged(metrics)[-1]
        t_kill = time.time()
        os.kill(victim, signal.SIGKILL)
        while True:  # the restarted job says where it resumes, then logs that step first
            with open(log_path) as f:
                resumed = [int(line.rsplit(' ', 1)[1]) for line in f if line.startswith('resuming from ')]
            if len(resumed) > k and resumed[k] in steps_logged(metrics):
                break
            assert p.poll() is None, f"the job ended: see {log_path}"
            time.sleep(0.005)
        recoveries.append(time.time() - t_kill)
        start = resumed[k]
        print(f"kill {k + 1}: worker killed after iter {last}, resumed at iter {start}, its first step logged "
              f"{recoveries[-1]:.2f} s after the kill", flush=True)
    p.send_signal(signal.SIGTERM)  # torchrun stops the workers (which save a checkpoint first)
    p.wait()
    print(f"recovery, SIGKILL to the next logged step: median {statistics.median(recoveries):.2f} s over {kills} kills")
    return recoveries


if what in ('save', 'all'):
    bench_save()
if what in ('recovery', 'all'):
    bench_recovery()
