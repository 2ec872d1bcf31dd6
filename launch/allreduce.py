"""
gloo's all-reduce alone, as DDP runs it on a step's gradients: one buffer of --numel float32 values all-reduced
--iters times after --warmup untimed ones. Rank 0 prints one JSON line: the numel and each timed all-reduce's
seconds. bench_network.py runs it on the emulated cluster (mode `allreduce`) to see how close the ring comes to the
link's rate, with no compute around it.

    torchrun --nnodes=2 ... launch/allreduce.py --numel=3200000 --iters=10
"""

import argparse
import json
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
p.add_argument('--numel', type=int, required=True, help='float32 values in the buffer (a model: its parameters)')
p.add_argument('--iters', type=int, default=10, help='timed all-reduces')
p.add_argument('--warmup', type=int, default=2, help='untimed all-reduces first (connections, buffers)')
args = p.parse_args()

dist.init_process_group('gloo')
buffer = torch.zeros(args.numel)
seconds = []
for i in range(args.warmup + args.iters):
    dist.barrier()  # each all-reduce starts together, so its time is the ring's, not a late rank's
    t0 = time.perf_counter()
    dist.all_reduce(buffer)
    if i >= args.warmup:
        seconds.append(time.perf_counter() - t0)
if dist.get_rank() == 0:
    print(json.dumps({'numel': args.numel, 'seconds': seconds}), flush=True)
dist.destroy_process_group()
