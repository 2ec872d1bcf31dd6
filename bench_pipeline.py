"""
Measures the pipeline bubble of pp_train.py's schedules (torch.distributed.pipelining's GPipe, 1F1B, interleaved
1F1B, interleaved zero bubble, ZBV and DualPipeV) against theory: the idle fraction of a step, (p - 1) / (m + p - 1)
for GPipe and 1F1B with p stages and m micro-batches, (p - 1) / (v m + p - 1) for interleaved 1F1B with v stages
per rank, and (p - 1) / (3 v m + p - 1) for the zero-bubble schedules (ZB1P: the weights' gradients fill two thirds of
interleaved 1F1B's idle time, where a forward, an input's gradient and a weight's gradient take as long as one
another), as many idle slots as torch's plan of them (its pipeline_order) holds; for zbv (v = 2) from m = 2p only,
below which its plan is not full and no figure is given; none for DualPipeV's plan (from m = 2p: below, a row says
it is not run, as for the 1F1B schedules below m = p).

torchrun --standalone --nproc_per_node=2 bench_pipeline.py
torchrun --standalone --nproc_per_node=4 bench_pipeline.py --microbatches=4,8,16

A stage's work is a sleep (forward 1 part, backward 2: the input's gradient 1 and a weight's 1, as a transformer
block's costs), so that what is measured is the schedule's own idle time, not the cores' contention: on a CPU
shared with other jobs, or with more ranks than cores, the figures still hold. The bubble measured: 1 - (a rank's
work, timed alone) / (the step's time); what is left over theory is the schedule's own overhead (sends, receives,
bookkeeping).
"""

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage

from configurator import configure, quiet_interrupt
from distributed import launch_with
from pipeline import SCHEDULES, ZERO_BUBBLE, make_schedule, nearest_taken, placement, schedule_takes, stage_ids

quiet_interrupt()  # Ctrl-C: one line, no traceback

# -----------------------------------------------------------------------------
forward_ms = 10.0  # a rank's forward of one micro-batch (split among its stages with interleaving)
microbatches = '1,2,4,8'  # the m to measure
stages_per_rank = 2  # v of the interleaved schedules
steps = 5  # timed steps per point, after one untimed
# -----------------------------------------------------------------------------
configure(globals())
# bad input is refused before the process group starts, on every rank alike: torchrun's environment has the ranks
if 'RANK' not in os.environ:
    sys.exit(f"error: bench_pipeline.py runs a pipeline stage on each rank, and {launch_with(2)}")
p = int(os.environ['WORLD_SIZE'])
counts = [int(m) if m.strip().isdigit() else 0 for m in microbatches.split(',')]
if min(counts) < 1:
    sys.exit(f"error: microbatches={microbatches!r} must be counts of 1 or more, comma-separated: e.g. "
             f"--microbatches=1,2,4,8")
for key in ('stages_per_rank', 'steps'):
    if globals()[key] < 1:
        sys.exit(f"error: {key}={globals()[key]} must be 1 or more")
if not forward_ms >= 0:
    sys.exit(f"error: forward_ms={forward_ms} must be 0 or more")
for m in counts:
    if m >= p and not schedule_takes('interleaved-1f1b', m, p):  # below p the 1F1B schedules are left out
        use = " or ".join(map(str, nearest_taken('interleaved-1f1b', m, p)))
        sys.exit(f"error: microbatches={microbatches!r}: interleaved 1F1B on {p} ranks does not run {m} (torch's runs "
                 f"them in {m // p} rounds of equal size): use {use} instead")


class Sleep(torch.autograd.Function):
    """x, after a sleep of forward seconds; its gradient after a sleep of backward seconds."""
    @staticmethod
    def forward(ctx, x, forward, backward):
        ctx.backward = backward
        time.sleep(forward)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward)
        return grad, None, None


class Stage(nn.Module):
    """The input's and a weight's gradients on paths of their own, as a linear layer's dX = dY W^T and dW = X^T dY:
    zero bubble computes the first in the backward and leaves the second for later. The input is scaled by a weight
    of its own, so that the first stage has an input path too (a GPT's embeddings feed its first block), which
    torch's zero bubble runs with the weights' (the first stage sends no gradient)."""
    def __init__(self, seconds):
        super().__init__()
        self.seconds, self.a, self.b = seconds, nn.Parameter(torch.ones(())), nn.Parameter(torch.ones(()))

    def forward(self, x):
        return Sleep.apply(x * self.a, self.seconds, self.seconds) * Sleep.apply(self.b, 0.0, self.seconds)


def measure(name, m, rank, p):
    v, v_shape = placement(name, stages_per_rank)
    seconds = forward_ms / 1000 / v
    ids = stage_ids(rank, p, v, v_shape)
    stages = [PipelineStage(Stage(seconds), s, p * v, torch.device('cpu')) for s in ids]
    schedule = make_schedule(name, stages, m, lambda out, y: out.mean())
    x, y = torch.randn(m, 4), torch.randn(m, 4)
    times = []
    for i in range(steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        schedule.step(*([x] if 0 in ids else []), **(dict(target=y) if p * v - 1 in ids else {}))
        dist.barrier()
        times.append(time.perf_counter() - t0)
    step = sorted(times[1:])[len(times[1:]) // 2]  # the median
    # a rank's work: its stages' forward and backward of every micro-batch, timed alone (a sleep overshoots a little)
    t0 = time.perf_counter()
    for _ in range(m):
        for stage in stages:
            stage.submod(x[:1]).sum().backward()
    work = time.perf_counter() - t0
    theory = (p - 1) / ((3 if name in ZERO_BUBBLE else 1) * v * m + p - 1)
    # no figure for zbv's plan below m = 2p (not full), nor for DualPipeV's (a plan of its own, m >= 2p)
    return 1 - work / step, None if name == 'zbv' and m < 2 * p or name == 'dualpipev' else theory, step


dist.init_process_group('gloo')
rank = dist.get_rank()
if rank == 0:
    print(f"{p} ranks, forward {forward_ms} ms + backward {2 * forward_ms} ms per micro-batch per rank")
    print(f"{'schedule':>17} {'m':>3} {'step ms':>8} {'bubble':>7} {'theory':>7}")
for name in SCHEDULES:
    for m in counts:
        if not schedule_takes(name, m, p):  # a row that says why, where a table without it would read as complete
            why = f"m >= 2p = {2 * p}, a micro-batch for each of its stages" if name == 'dualpipev' else \
                f"m >= p = {p} to fill the pipeline before its first backward"
            if rank == 0:
                print(f"{name:>17} {m:>3} {'-':>8} {'-':>7} {'-':>7}  not run: it needs {why}", flush=True)
            continue
        bubble, theory, step = measure(name, m, rank, p)
        if rank == 0:
            print(f"{name:>17} {m:>3} {step * 1000:>8.1f} {bubble:>7.3f} "
                  f"{'-' if theory is None else f'{theory:.3f}':>7}", flush=True)
dist.barrier()
dist.destroy_process_group()
os._exit(0)
