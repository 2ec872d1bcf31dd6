"""
The host's time for each part of a training step, the plain model against FSDP2 (a group of one): forward and
backward, AdamW, the clip. Where a GPU waits for its host (fsdp_train.py's step on an H100 took 3x train.py's for
the same GPU work), these are what it waits for: the model is made too small to compute much, so that the host's
own time shows, on a CPU as on a GPU (whose kernels are only queued, not waited for).
    python tests/host_time.py                   # 12 layers, on the CPU
    python tests/host_time.py --device=cuda     # on a GPU: the host's time to queue each part
"""

import argparse
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import GPT, GPTConfig  # noqa: E402
from sharded import clip_grad_norm, step_on_shards  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
p.add_argument('--device', default='cpu')
p.add_argument('--n_layer', type=int, default=12)
p.add_argument('--iters', type=int, default=30)
args = p.parse_args()

with socket.socket() as s:  # a group of one, on a port of the kernel's choosing
    s.bind(('127.0.0.1', 0))
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(s.getsockname()[1]), RANK='0', WORLD_SIZE='1')
device_type = 'cuda' if args.device.startswith('cuda') else 'cpu'
dist.init_process_group('nccl' if device_type == 'cuda' else 'gloo')
mesh = init_device_mesh(device_type, (1,))
config = GPTConfig(n_layer=args.n_layer, n_head=4, n_embd=64, block_size=32, vocab_size=65, bias=False)
x = torch.randint(0, 65, (2, 32), device=args.device)


def median_ms(part):
    times = []
    for _ in range(args.iters + 3):
        t0 = time.perf_counter()
        part()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times[3:])[args.iters // 2]  # the first three warm up


print(f"host ms per part, median of {args.iters}, {args.n_layer} layers on {args.device}")
print(f"{'':8} {'fwd+bwd':>8} {'AdamW':>8} {'clip':>8}")
for mode in ('plain', 'fsdp'):
    torch.manual_seed(0)
    model = GPT(config).to(args.device)
    if mode == 'fsdp':  # as fsdp_train.py shards it: each block a unit, the root the rest
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), device_type)
    clip = clip_grad_norm if mode == 'fsdp' else torch.nn.utils.clip_grad_norm_

    def forward_backward():
        _, loss = model(x, x)
        loss.backward()
    parts = [median_ms(forward_backward), median_ms(optimizer.step), median_ms(lambda: clip(model.parameters(), 1.0))]
    print(f"{mode:8} " + ' '.join(f"{ms:8.2f}" for ms in parts), flush=True)
    if mode == 'fsdp':  # fsdp_train.py's lever: the same AdamW stepped on each rank's pieces, past DTensor's dispatch
        shards = median_ms(lambda: step_on_shards(optimizer))
        print(f"{'':8} AdamW on its shards (--adamw_on_shards=True): {shards:.2f}")
dist.destroy_process_group()
