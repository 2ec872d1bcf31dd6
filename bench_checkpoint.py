"""
Measures what fault tolerance costs and buys, with the functions the entrypoints use:

- save: how long the training loop is blocked by a memory snapshot (/dev/shm) and by a background checkpoint to
  out_dir, against a synchronous torch.save (+ fsync) of the same state, taken in turns in one process;
- recovery: seconds from SIGKILLing a worker of an elastic torchrun job (train.py, the tiny model) until the
  restarted job logs its next step.

python bench_checkpoint.py                          # both, GPT-2 124M with AdamW state, on the GPU if there is one
python bench_checkpoint.py --what=save --n_layer=4  # a smaller state
python bench_checkpoint.py --device=cpu             # on the CPU (recovery: 2 processes, or --nproc)

It writes only into out_dir, a folder of its own: one it makes (or an empty one), marked as its own, and refuses any
other, so that a run's folder given by mistake is never written over. The saves it times are removed at the end;
the recovery job's run and log stay there until the next time.
"""

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext

import torch

from checkpoint import atomic_save, save_in_background, snapshot_dir, wait_for_copies, wait_for_saves
from configurator import check_model_shape, check_out_dir, configure, quiet_interrupt
from distributed import pick_device
from model import GPT, GPTConfig

quiet_interrupt()  # Ctrl-C: one line, no traceback

# -----------------------------------------------------------------------------
what = 'all'  # 'save', 'recovery' or 'all'
out_dir = 'bench_checkpoint'  # a folder of the benchmark's own (see above)
repeats = 5
n_layer = 12
n_head = 12
n_embd = 768
vocab_size = 50304
block_size = 1024
batch_size = 0  # save: sequences in the step the copy overlaps; 0: 4 on the CPU, 32 on a GPU (~100 ms on an H100)
device = 'auto'  # 'auto' (cuda if there is a GPU, else cpu), 'cpu' or 'cuda'
dtype = 'auto'  # save: autocast of the step, as in train.py ('auto': bfloat16 on GPUs that have it, float32 on CPU)
kills = 3  # recovery: workers killed one after another in one job
nproc = 0  # recovery: worker processes; 0: one per GPU, or 2 on the CPU
dataset = 'shakespeare_char'  # recovery: data/<dataset> as prepare.py writes it
# -----------------------------------------------------------------------------
config, _ = configure(globals())
# a bad value is one line here, before out_dir is made: not a traceback, nor (a misspelt what) nothing measured
if what not in ('save', 'recovery', 'all'):
    sys.exit(f"error: what={what!r}: use save, recovery or all")
if dtype not in ('auto', 'float32', 'bfloat16', 'float16'):
    sys.exit(f"error: dtype={dtype!r}: use auto, float32, bfloat16 or float16")
check_model_shape(config)
for key, least in (('repeats', 1), ('kills', 1), ('batch_size', 0), ('nproc', 0)):
    if config[key] < least:
        sys.exit(f"error: {key}={config[key]} must be {least} or more")
device, device_type = pick_device(device)
if dtype == 'auto':
    dtype = ('bfloat16' if torch.cuda.is_bf16_supported(including_emulation=False) else 'float16') \
        if device_type == 'cuda' else 'float32'
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
batch_size = batch_size or (32 if device_type == 'cuda' else 4)
nproc = nproc or (torch.cuda.device_count() if device_type == 'cuda' else 2)
MARK = os.path.join(out_dir, 'BENCH_CHECKPOINT')  # says that the folder is the benchmark's own
check_out_dir(out_dir)
if os.path.isdir(out_dir) and os.listdir(out_dir) and not os.path.isfile(MARK):
    sys.exit(f"error: out_dir={out_dir} holds files that bench_checkpoint.py did not write, which it would write "
             f"over: give a new or empty folder with --out_dir")
os.makedirs(out_dir, exist_ok=True)
with open(MARK, 'w') as f:
    f.write("bench_checkpoint.py's folder: it replaces its own files here (save/, recovery/, recovery.log)\n")


def bench_save():
    """Times the saves in out_dir/save and a snapshot folder of this process's own, and removes both at the end
    (also after Ctrl-C or an error, once the saves in flight have ended)."""
    save_dir, shm_dir = os.path.join(out_dir, 'save'), snapshot_dir(f'bench-{os.getpid()}')
    try:
        return time_saves(save_dir, os.path.join(shm_dir, 'ckpt.pt'))
    finally:
        wait_for_saves()
        shutil.rmtree(save_dir, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)


def time_saves(save_dir, shm):
    torch.manual_seed(0)
    # weights and AdamW's moments stay float32, as in train.py: autocast runs the step in dtype
    model = GPT(GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=vocab_size,
                          block_size=block_size)).to(device)
    optimizer = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), device_type)
    x = torch.randint(vocab_size, (batch_size, block_size), device=device)
    ctx = nullcontext() if dtype == 'float32' else torch.autocast(device_type=device_type, dtype=ptdtype)
    os.makedirs(os.path.dirname(shm), exist_ok=True)
    os.makedirs(save_dir, exist_ok=True)

    def synchronize():
        # The loop's own stream only, as train.py's .tolist() before wait_for_copies() waits: a device-wide
        # synchronize would also wait for a copy running on a stream of its own, and hide what it costs.
        if device_type == 'cuda':
            torch.cuda.current_stream().synchronize()

    def step(snapshot_to=None):
        """A training step, as train.py takes it after a snapshot: the state is copied during forward and
        backward, and the optimizer waits for the copy. Returns (seconds in all, seconds the loop was blocked).
        On a GPU the clocks are read once the loop's queued work is done (but for t1: the save queues none)."""
        synchronize()
        t0 = time.perf_counter()
        if snapshot_to:
            save_in_background({'model': model.state_dict(), 'optimizer': optimizer.state_dict(), 'iter_num': 1},
                               snapshot_to, keep=1 + (snapshot_to != shm))  # as train.py
        t1 = time.perf_counter()
        with ctx:
            loss = model(x, x)[1]
        loss.backward()
        synchronize()
        t2 = time.perf_counter()
        wait_for_copies()
        t3 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize()
        return time.perf_counter() - t0, (t1 - t0) + (t3 - t2)

    step()  # AdamW's moments exist from the first step on
    # each tensor once: the state dict names the tied head and the token embedding, one tensor that a save writes once
    size = sum({t.data_ptr(): t.nbytes for t in model.state_dict().values()}.values()) + \
        sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    print(f"state: {model.get_num_params() / 1e6:.1f}M parameters, {size / 2**20:,.1f} MiB with AdamW's moments; "
          f"steps of {batch_size}x{block_size} tokens" + (f" in {dtype} on {torch.cuda.get_device_name(device)}"
                                                          if device_type == 'cuda' else ""))
    keys = ('sync torch.save', 'plain step', 'memory: blocked', 'memory: step', 'storage: blocked', 'storage: step')
    times = {k: [] for k in keys}
    for r in range(repeats + 1):  # the first round allocates the host copies: left out of the medians
        t0 = time.perf_counter()
        atomic_save({'model': model.state_dict(), 'optimizer': optimizer.state_dict(), 'iter_num': 1},
                    os.path.join(save_dir, 'sync.pt'))
        sync = time.perf_counter() - t0
        plain, _ = step()
        mem_step, mem_blocked = step(shm)
        wait_for_saves()
        disk_step, disk_blocked = step(os.path.join(save_dir, 'ckpt.pt'))
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
    return med


def steps_logged(path):
    try:
        with open(path) as f:
            return [json.loads(line)['iter'] for line in f if '"loss"' in line and line.endswith('\n')]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def workers(pid):
    """The pids of torchrun's children that run train.py."""
    def read(path):  # a process that ends meanwhile makes /proc answer ENOENT or, while it is reaped, ESRCH
        try:
            with open(path, 'rb') as f:
                return f.read()
        except (FileNotFoundError, ProcessLookupError):
            return b''
    children = sorted(int(c) for c in read(f'/proc/{pid}/task/{pid}/children').split())
    return [c for c in children if b'train.py' in read(f'/proc/{c}/cmdline')]


def bench_recovery():
    run_dir = os.path.join(out_dir, 'recovery')
    metrics = os.path.join(run_dir, 'metrics.jsonl')
    # port 0: the agent binds a port of the kernel's choosing for its rendezvous (one node), where a port picked
    # here and freed could be bound by another process in the seconds before torchrun binds it
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--nnodes=1:2', f'--nproc_per_node={nproc}',
           f'--max-restarts={kills}', '--rdzv-backend=c10d', '--rdzv-endpoint=127.0.0.1:0',
           '--rdzv-conf=last_call_timeout=1', os.path.join(os.path.dirname(os.path.abspath(__file__)), 'train.py'),
           f'--dataset={dataset}', f'--out_dir={run_dir}',
           f'--device={device_type}', '--compile=False', '--n_layer=2', '--n_head=2', '--n_embd=32',
           '--block_size=32', '--batch_size=4', '--gradient_accumulation_steps=2', '--eval_interval=100000',
           '--eval_iters=4', '--max_iters=100000', '--save_memory_interval=10']
    shutil.rmtree(run_dir, ignore_errors=True)  # the last benchmark's run (out_dir is its own): it would be resumed
    log_path = os.path.join(out_dir, 'recovery.log')
    p = subprocess.Popen(cmd, stdout=open(log_path, 'w'), stderr=subprocess.STDOUT)
    recoveries, start = [], 0
    try:  # the job stops with the benchmark, however it ends (Ctrl-C, a failed check)
        for k in range(kills):
            while not steps_logged(metrics) or steps_logged(metrics)[-1] < start + 30:  # 30 steps into this run
                assert p.poll() is None, f"the job ended early: see {log_path}"
                time.sleep(0.005)
            victim = workers(p.pid)[k % nproc]
            last = steps_logged(metrics)[-1]
            written_before = os.stat(metrics).st_ino
            t_kill = time.time()
            os.kill(victim, signal.SIGKILL)
            while True:  # the restarted job says where it resumes, then logs that step first
                with open(log_path) as f:
                    resumed = [int(line.rsplit(' ', 1)[1]) for line in f if line.startswith('resuming from ')]
                # the killed job logged that step too: the restarted one's row is in the file it puts in place of
                # the old
                logged = steps_logged(metrics)
                if len(resumed) > k and os.stat(metrics).st_ino != written_before and resumed[k] in logged:
                    break
                assert p.poll() is None, f"the job ended: see {log_path}"
                time.sleep(0.005)
            recoveries.append(time.time() - t_kill)
            start = resumed[k]
            print(f"kill {k + 1}: worker killed after iter {last}, resumed at iter {start}, its first step logged "
                  f"{recoveries[-1]:.2f} s after the kill", flush=True)
    finally:
        p.send_signal(signal.SIGTERM)  # torchrun stops the workers (which save a checkpoint first)
        p.wait()
    print(f"recovery, SIGKILL to the next logged step: median {statistics.median(recoveries):.2f} s over {kills} "
          f"kill{'s' * (kills != 1)}")
    return recoveries


if what in ('save', 'all'):
    bench_save()
if what in ('recovery', 'all'):
    bench_recovery()
