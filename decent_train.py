"""
Trains a GPT with decentralized data parallelism (Decent-DP, ICLR 2025): instead of all-reducing gradients, every
rank keeps its own replica, takes its own optimizer step on its share of the batch, and then averages its
parameters with a few peers that a topology picks.

Ring, 8 GPUs:     torchrun --standalone --nproc_per_node=8 decent_train.py config/train_gpt2.py --topology=ring
Two nodes:        torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HEAD:29500 \
                      decent_train.py config/train_gpt2.py --topology=alternating-exp-ring --optimizer=accumadamw

Everything but the distribution is train.py's: config keys, data stream, logging and exact resume. A topology is
a cycle of mixing rounds; in each round the ranks split into groups and every group averages its replicas (an
all-reduce within the group), so each round's mixing matrix is doubly stochastic. A bucket of parameters is
updated and starts mixing as soon as its gradients are complete, while the backward goes on, and the next
forward waits for each bucket only where it needs it. Evals run on the average of all replicas and log how far
the replicas are from it. Checkpoints hold every rank's replica and optimizer state (out_dir/decent/step-N/), and
out_dir/ckpt.pt the averaged model in train.py's format, for sample.py and train.py; a train.py checkpoint starts
every replica here, and so does the average of the replicas where the world size has changed.
"""

import atexit
import json
import math
import os
import shutil
import signal
import sys
import threading
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from checkpoint import (atomic_save, find_checkpoint, host_copy, incarnation_store, load_checkpoint,
                        newest_loadable, point_latest, previous, reason_of, save_in_background, snapshot_dir,
                        wait_for_copies, wait_for_saves)
from configurator import configure
from data import read_meta
from model import GPT, GPTConfig

# -----------------------------------------------------------------------------
# config: defaults train GPT-2 124M on OpenWebText; config/*.py and --key=value override them
# I/O
out_dir = 'out'
eval_interval = 2000
log_interval = 1
eval_iters = 200
eval_only = False  # exit right after the first eval
always_save_checkpoint = True  # save after every eval, not only on a new best val loss
init_from = 'scratch'  # 'scratch', 'resume' (out_dir's checkpoint), 'gpt2'..'gpt2-xl', or a checkpoint's path (weights only)
# wandb logging
wandb_log = False
wandb_project = 'owt'
wandb_run_name = 'gpt2'
# data
dataset = 'openwebtext'  # data/<dataset>/{train,val}.bin as prepare.py writes them (or a path to such a folder)
gradient_accumulation_steps = 5 * 8  # micro-steps per optimizer step, in total over all ranks
batch_size = 12  # sequences per micro-step per rank
block_size = 1024
# model
n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0  # 0 for pretraining, try 0.1+ for finetuning
bias = False
# AdamW
learning_rate = 6e-4
max_iters = 600000
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0  # clip gradients at this norm; 0 disables
# learning rate schedule: linear warmup, then cosine decay to min_lr
decay_lr = True
warmup_iters = 2000
lr_decay_iters = 600000  # ~ max_iters, per Chinchilla
min_lr = 6e-5  # ~ learning_rate / 10, per Chinchilla
# system
device = 'auto'  # 'auto' (cuda:LOCAL_RANK if there is a GPU, else cpu), 'cpu', 'cuda', 'cuda:1', 'mps'
backend = 'auto'  # 'auto' (nccl on CUDA, gloo otherwise), 'nccl' or 'gloo'
dtype = 'auto'  # 'auto' (bfloat16 on GPUs that have it, else float16 on CUDA, float32 on CPU), or one of those
compile = True  # torch.compile the model
seed = 1337
deterministic = False  # deterministic algorithms and dropout off, so that reruns give identical curves, on GPUs too
# fault tolerance
auto_resume = True  # on every start, continue from the newest complete snapshot or checkpoint of out_dir, if any
save_memory_interval = 0  # steps between snapshots of the whole state into node-local memory (/dev/shm); 0: none
save_storage_interval = 0  # steps between checkpoints to out_dir (in the background), besides the evals'; 0: none
max_nonfinite_steps = 5  # a step whose loss is not finite is skipped; this many in a row stop the run
# decentralized
topology = 'ring'  # 'complete', 'ring', 'one-peer-exp' (2^k ranks) or 'alternating-exp-ring' (2^k nodes)
optimizer = 'adamw'  # 'adamw', 'accumadamw' (Adam's moments take in the mean gradient of accum_steps steps) or 'sgd'
accum_steps = 4  # accumadamw: steps whose mean gradient makes one update of the moments; grow it with the ranks
# -----------------------------------------------------------------------------
config, given = configure(globals())

# distributed init: torchrun sets RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE; without it, a group of one
ddp = 'RANK' in os.environ
rank, local_rank, world_size = (int(os.environ[k]) for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE')) if ddp else (0, 0, 1)
local_world_size = int(os.environ.get('LOCAL_WORLD_SIZE', world_size)) if ddp else 1  # ranks per node
master_process = rank == 0  # does all the logging and checkpoint writing
dp_rank, dp_size = rank, world_size  # every rank is a data-parallel rank with a replica of its own


def mixing_rounds(topology, world_size, local_world_size):
    """The topology's cycle of mixing rounds. A round is a partition of the ranks into groups (sorted lists of
    ranks); every group averages its replicas, a rank alone keeps its own. Step t mixes with round t % len(rounds).
    Raises ValueError where the topology cannot serve this world size."""
    n = world_size
    if topology == 'complete':
        return [[list(range(n))]]
    if topology == 'ring':
        # each rank averages with its right neighbour, then with its left: the ring's edges in two matchings, or
        # three when n is odd (the closing edge then needs a round of its own)
        if n <= 2:
            return [[list(range(n))]]
        edges = [sorted([i, (i + 1) % n]) for i in range(n)]
        if n % 2 == 0:
            return [edges[0::2], edges[1::2]]
        return [edges[0:n - 1:2] + [[n - 1]], edges[1::2] + [[0]], [edges[n - 1]] + [[i] for i in range(1, n - 1)]]
    if topology == 'one-peer-exp':
        # round k pairs each rank with the one 2^k away (their k-th bits differ): after the log2(n) rounds of a
        # cycle every replica is the exact average, at one peer per round
        if n & (n - 1):
            raise ValueError(f"topology=one-peer-exp needs a power-of-2 world size, not {n}: use ring or complete")
        return [[[j, j + 2 ** k] for j in range(n) if not j & 2 ** k] for k in range(n.bit_length() - 1)] or [[[0]]]
    if topology == 'alternating-exp-ring':
        # rounds within nodes (the fast links: every node averages its ranks) alternate with rounds between nodes,
        # where nodes pair as in one-peer-exp and each rank averages with the same local rank on the peer node
        nodes = n // local_world_size
        if local_world_size < 2 or n % local_world_size or nodes < 2 or nodes & (nodes - 1):
            raise ValueError(f"topology=alternating-exp-ring needs 2, 4, 8, ... nodes of at least 2 ranks each, not "
                             f"world size {n} with LOCAL_WORLD_SIZE={local_world_size} ranks per node: use ring")
        within = [list(range(a * local_world_size, (a + 1) * local_world_size)) for a in range(nodes)]
        rounds = []
        for node_pairs in mixing_rounds('one-peer-exp', nodes, 1):
            rounds.append(within)
            rounds.append([[a * local_world_size + j, b * local_world_size + j]
                           for a, b in node_pairs for j in range(local_world_size)])
        return rounds
    raise ValueError(f"unknown topology={topology!r}: use complete, ring, one-peer-exp or alternating-exp-ring")


try:
    rounds = mixing_rounds(topology, world_size, local_world_size)
except ValueError as e:
    sys.exit(f"error: {e}")
if optimizer not in ('adamw', 'accumadamw', 'sgd'):
    sys.exit(f"error: unknown optimizer={optimizer!r}: use adamw, accumadamw or sgd")
if accum_steps < 1:
    sys.exit(f"error: accum_steps={accum_steps}: AccumAdamW needs at least 1 step per update of its moments")
if device == 'auto':
    device = f'cuda:{local_rank}' if torch.cuda.is_available() else 'cpu'
elif device == 'cuda' and ddp:
    device = f'cuda:{local_rank}'
device_type = device.split(':')[0]
if device_type == 'cuda' and not torch.cuda.is_available():
    sys.exit("error: device=cuda but torch sees no GPU: use --device=cpu (or auto)")
if dtype == 'auto':
    dtype = 'bfloat16' if device_type == 'cuda' else 'float32'
if dtype not in ('float32', 'bfloat16'):
    sys.exit(f"error: dtype={dtype!r}: decent_train.py takes auto, float32 or bfloat16 (float16's loss scaler would "
             f"have to see every bucket's gradients before any bucket steps; use train.py for it)")
if backend == 'auto':
    backend = 'nccl' if device_type == 'cuda' else 'gloo'
for key in ('save_memory_interval', 'save_storage_interval', 'max_nonfinite_steps'):
    if config[key] < (key == 'max_nonfinite_steps'):
        sys.exit(f"error: {key}={config[key]} " + ("must be 1 or more (1 stops at the first non-finite step)"
                 if key == 'max_nonfinite_steps' else "is negative: give a number of steps, or 0 for none"))
if gradient_accumulation_steps % dp_size != 0:
    sys.exit(f"error: gradient_accumulation_steps={gradient_accumulation_steps} does not divide across {dp_size} "
             f"data-parallel ranks: make it a multiple of {dp_size} (it is the total over all ranks)")
micro_steps = gradient_accumulation_steps // dp_size  # on this rank (accum_steps is AccumAdamW's)
tokens_per_iter = gradient_accumulation_steps * batch_size * block_size  # the global batch, whatever the world size
if init_from not in ('scratch', 'resume', 'gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl') and not os.path.exists(init_from):
    sys.exit(f"error: unknown init_from={init_from!r}: use scratch, resume, gpt2, gpt2-medium, gpt2-large, gpt2-xl "
             f"or the path of a checkpoint (a ckpt.pt, a sharded checkpoint folder or a run's out_dir)")
if device_type == 'cuda':
    torch.cuda.set_device(device)
if ddp:
    store = None
    if os.environ.get('TORCHELASTIC_USE_AGENT_STORE') == 'True':
        # torchrun's store outlives a restart of the workers, and gloo would read the dead workers' addresses from it
        # (and fail the restart): each incarnation of the group gets a store of its own
        store = incarnation_store(rank, world_size)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size,
                            device_id=torch.device(device) if device_type == 'cuda' else None)
else:
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
# an early exit (a one-line error, an exception) tears the groups down too: left to the interpreter's end, gloo's
# threads can abort it ('terminate called without an active exception')
atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
# the background writers of storage checkpoints agree over a group of their own: collectives of two threads on
# one group would interleave
checkpoint_group = dist.new_group(backend='gloo')
# each round's process groups: every rank creates every group, in the same order, and keeps the one it is in
mixing_groups, made = [], {}  # per round: (this rank's group, its size), or None where the round leaves it alone
for groups in rounds:
    mine = None
    for ranks in groups:
        if len(ranks) > 1:
            if tuple(ranks) not in made:
                made[tuple(ranks)] = dist.new_group(ranks)
            if rank in ranks:
                mine = (made[tuple(ranks)], len(ranks))
    mixing_groups.append(mine)
torch.manual_seed(seed)  # every rank builds the same initial model
if device_type == 'cuda':
    torch.backends.cuda.matmul.fp32_precision = 'tf32'
    torch.backends.cudnn.conv.fp32_precision = 'tf32'
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
ctx = nullcontext() if dtype == 'float32' else torch.autocast(device_type=device_type, dtype=ptdtype)


def print0(*args, **kwargs):
    if master_process:
        print(*args, **kwargs, flush=True)


if deterministic:
    os.environ.setdefault('CUBLAS_WORKSPACE_CONFIG', ':4096:8')  # cuBLAS is deterministic only with a fixed workspace
    torch.use_deterministic_algorithms(True)
    if device_type == 'cuda':
        torch.backends.cudnn.benchmark = False
        # the fused attention kernels add up their backward in a varying order; the math one does not
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
    if dropout != 0.0:
        print0(f"deterministic: dropout {dropout} turned off")
    dropout = config['dropout'] = 0.0

print0(f"world size {world_size}, {micro_steps} micro-steps per rank, {tokens_per_iter:,} tokens per iteration")
print0(f"topology {topology}, a cycle of {len(rounds)} mixing rounds; optimizer {optimizer}")

# SIGTERM is how SLURM and Kubernetes preempt a job (torchrun passes it on to the workers): the loop notices it at
# the last micro-step, finishes the step, saves a checkpoint and exits cleanly.
stop_signals = []
signal.signal(signal.SIGTERM, lambda signum, frame: stop_signals.append(signum))

# -----------------------------------------------------------------------------
# data: nanoGPT's uint16 train.bin / val.bin
data_dir = os.path.join('data', dataset)
bin_path, n_tokens = {}, {}
for split in ('train', 'val'):
    bin_path[split] = os.path.join(data_dir, f'{split}.bin')
    if not os.path.exists(bin_path[split]):
        sys.exit(f"error: {bin_path[split]} not found: run `python prepare.py {dataset}` "
                 f"(or `python prepare.py text --input=FILE --name={dataset}`) first")
    n_tokens[split] = os.path.getsize(bin_path[split]) // 2
    if n_tokens[split] < block_size + 1:
        sys.exit(f"error: {bin_path[split]} holds {n_tokens[split]} tokens, fewer than block_size + 1 = {block_size + 1}: "
                 f"lower --block_size or prepare more data")


def get_batch(split, offsets):
    # a new memmap per batch: a long-lived one keeps every page it touched and grows without bound
    data = np.memmap(bin_path[split], dtype=np.uint16, mode='r')
    chunk = torch.from_numpy(data[offsets.numpy()[:, None] + np.arange(block_size + 1)].astype(np.int64))
    x, y = chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()
    if device_type == 'cuda':
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


# The training stream is a function of the seed and the step alone: each step draws the offsets of the whole
# global batch from one generator and each (rank, micro-step) takes its own row, so 1, 2 or 8 ranks see the same
# data, and saving this generator's state saves the data position.
data_gen = torch.Generator().manual_seed(seed)


def draw_train_offsets():
    offsets = torch.randint(n_tokens['train'] - block_size, (gradient_accumulation_steps, batch_size), generator=data_gen)
    return offsets[dp_rank * micro_steps:(dp_rank + 1) * micro_steps]


# -----------------------------------------------------------------------------
# where to start: the newest complete state of this run, a memory snapshot or a checkpoint in out_dir
ckpt_path = os.path.join(out_dir, 'ckpt.pt')  # the averaged export, or train.py's: every replica can start from it
decent_dir = os.path.join(out_dir, 'decent')  # the replicas, a folder per step and a file per rank
run_id_path = os.path.join(out_dir, 'run_id')  # names the run's snapshots, so that a new run in out_dir never takes an old one's
snapshot_name = f'rank-{rank}-of-{world_size}.pt'  # a rank's own replica, which only this world size can take back


def find_resume_point():
    """(run_id, (iter_num, path) to resume from or None, damaged files passed over), alike on every rank. A memory
    snapshot counts only at an iteration that every rank holds (a replaced node holds none; a rank killed while
    writing holds the one before, which is why each keeps two); else rank 0's newest checkpoint in out_dir, which
    must be storage they all share: a folder of replicas, or where there is none, a ckpt.pt."""
    run_id, held, disk, damaged = None, {}, (None, None), []
    wanted = init_from == 'resume' or (auto_resume and not eval_only)  # an eval of another model is no resume
    if wanted and os.path.exists(run_id_path):
        with open(run_id_path) as f:
            run_id = f.read().strip()
        for path in (os.path.join(snapshot_dir(run_id), snapshot_name),
                     previous(os.path.join(snapshot_dir(run_id), snapshot_name))):
            it, _, bad = newest_loadable([path])
            damaged += bad
            if it is not None:
                held[it] = path
    if wanted and master_process:
        folders = sorted(os.listdir(decent_dir), reverse=True) if os.path.isdir(decent_dir) else []
        # this run's newest, not one of a run that it was started afresh over (that only when asked to resume)
        this_run = dict(run_id=run_id, or_any=init_from == 'resume')
        # the replicas; only where none are complete, a ckpt.pt that every replica starts from
        for paths in ([os.path.join(decent_dir, f) for f in folders if f.startswith('step-')],
                      [ckpt_path, previous(ckpt_path)]):
            *disk, bad = newest_loadable(paths, **this_run)
            damaged += bad
            if disk[0] is not None:
                break
    views = [None] * world_size
    dist.all_gather_object(views, (run_id, held, tuple(disk), damaged, uuid.uuid4().hex))
    run_id, _, (disk_iter, disk_path), _, new_id = views[0]
    damaged = [d for v in views for d in v[3]]
    mem_iter = max(set.intersection(*(set(v[1]) for v in views)), default=None)
    if run_id is not None and mem_iter is not None and all(v[0] == run_id for v in views) \
            and (disk_iter is None or mem_iter >= disk_iter):
        return run_id, (mem_iter, held[mem_iter]), damaged
    if disk_iter is not None:
        return run_id or new_id, (disk_iter, disk_path), damaged
    return new_id, None, damaged  # a fresh run gets a new id


run_id, resume_from, damaged = find_resume_point()
if resume_from is None and damaged:
    path, reason = damaged[0]
    sys.exit(f"error: checkpoint {path} is corrupt or not a training checkpoint ({reason}): delete it or restore a "
             f"good copy (or start afresh over it with --auto_resume=False)")
if resume_from is None and init_from == 'resume':
    sys.exit(f"error: no checkpoint at {decent_dir} or {ckpt_path}: point --out_dir at a run's folder, or use "
             f"--init_from=scratch")
for path, reason in damaged:
    print0(f"warning: skipping the damaged {path} ({reason}); resuming from the newest one before it")
snapshot_path = os.path.join(snapshot_dir(run_id), snapshot_name)

# -----------------------------------------------------------------------------
# model
meta_vocab_size = None
meta_path = os.path.join(data_dir, 'meta.pkl')
if os.path.exists(meta_path):
    meta_vocab_size = read_meta(meta_path)['vocab_size']
model_args = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, bias=bias,
                  vocab_size=meta_vocab_size or 50304, dropout=dropout)
iter_num, best_val_loss, checkpoint = 0, 1e9, None


def take_shape(ckpt_args):
    """The model's shape comes from the checkpoint; a key that says otherwise is a mistake, not a request."""
    for k in ('n_layer', 'n_head', 'n_embd', 'block_size', 'bias', 'vocab_size'):
        if k in given and config[k] != ckpt_args[k]:
            sys.exit(f"error: {k}={config[k]!r} contradicts the checkpoint's {k}={ckpt_args[k]!r}: drop that "
                     f"setting to start from it, or use another out_dir to train a new model")
        model_args[k] = ckpt_args[k]
        if k in config:  # and the globals (block_size sizes the batches) and the config saved with the run
            globals()[k] = config[k] = ckpt_args[k]


def averaged_replicas(folder, ranks):
    """The state that a run of that many ranks saved in folder: its replicas and their optimizer states (Adam's
    moments, AccumAdamW's gradient sum) averaged over the ranks, the rest as rank 0 saved it. One file at a time,
    summed in float64, so that equal replicas (complete mixing) average to themselves exactly."""
    def fold(total, x, f):  # f(total's tensor, x's) for each floating-point tensor of x; total's value elsewhere
        if torch.is_tensor(x) and x.is_floating_point():
            return f(total, x)
        if isinstance(x, dict):
            return {k: fold(total[k], v, f) for k, v in x.items()}
        if isinstance(x, list):
            return [fold(t, v, f) for t, v in zip(total, x)]
        return total

    def replica(r, **kw):
        saved = torch.load(os.path.join(folder, f'rank-{r}.pt'), map_location='cpu', weights_only=True, **kw)
        return saved, {'model': saved['model'], 'optimizers': saved['optimizers']}

    first, own = replica(0)
    total = fold(own, own, lambda t, x: x.double())
    for r in range(1, ranks):
        total = fold(total, replica(r, mmap=True)[1], lambda t, x: t.add_(x))
    return {**first, **fold(total, own, lambda t, x: t.div_(ranks).to(x.dtype))}


if resume_from is not None:
    # this run's own state, a replica per rank (a folder of them, or this rank's memory snapshot); else a ckpt.pt
    # (train.py's, or this script's averaged export) that every replica starts from
    resume_path = resume_from[1]
    if init_from != 'resume':
        print0(f"auto-resume: {out_dir} holds this run's state at iter {resume_from[0]}, so the run continues "
               f"(--auto_resume=False starts afresh)")
    try:
        if os.path.isdir(resume_path):
            saved = len(torch.load(os.path.join(resume_path, 'rank-0.pt'), map_location='cpu', weights_only=True,
                                   mmap=True)['rng'])  # ranks, each with its RNG in every file
            if saved == world_size:
                resume_path = os.path.join(resume_path, f'rank-{rank}.pt')
            else:
                # The algorithm's state is one replica per rank, which does not reshard: at another world size (an
                # elastic restart with fewer or more nodes) every rank starts from their average, as evals see it
                print0(f"{resume_path} holds the replicas of {saved} ranks, not {world_size}: every rank starts "
                       f"from their average")
                checkpoint = averaged_replicas(resume_path, saved)
        if checkpoint is None:
            checkpoint = torch.load(resume_path, map_location='cpu', weights_only=True)  # data, never code
        ckpt_args = checkpoint['model_args']
        take_shape(ckpt_args)
        model = GPT(GPTConfig(**model_args))
        model.load_state_dict(GPT.upgrade_state_dict(checkpoint['model']))
        iter_num, best_val_loss = checkpoint['iter_num'], float(checkpoint['best_val_loss'])  # nanoGPT saved a tensor
    except Exception as e:
        sys.exit(f"error: checkpoint {resume_path} is corrupt or not a training checkpoint ({reason_of(e)}): "
                 f"delete it or restore a good copy")
elif init_from in ('gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl'):
    print0(f"initializing from OpenAI GPT-2 weights: {init_from}")
    try:
        model = GPT.from_pretrained(init_from, dict(dropout=dropout))
    except ImportError:
        sys.exit(f"error: init_from={init_from} needs Hugging Face transformers: pip install transformers")
    except OSError as e:
        sys.exit(f"error: could not load {init_from} from the Hugging Face hub ({str(e).splitlines()[0][:200]}): "
                 f"check the network, or set HF_HUB_OFFLINE=1 with the model in the local cache")
    for k in ('n_layer', 'n_head', 'n_embd', 'bias', 'vocab_size'):
        model_args[k] = getattr(model.config, k)
elif init_from != 'scratch':
    # any entrypoint's checkpoint, or a run folder's newest: its weights, with a new optimizer from step 0
    try:
        model, ckpt = load_checkpoint(init_from, dropout=dropout)
        take_shape(ckpt['model_args'])
    except Exception as e:
        sys.exit(f"error: cannot read a checkpoint at {init_from} ({reason_of(e)}): "
                 f"give a ckpt.pt, a sharded checkpoint or a run folder")
    print0(f"initializing from the weights of {find_checkpoint(init_from)}")
else:
    model = GPT(GPTConfig(**model_args))
if block_size < model.config.block_size:
    model.crop_block_size(block_size)  # fine-tune GPT-2 with a shorter context
    model_args['block_size'] = block_size
elif block_size > model.config.block_size:
    sys.exit(f"error: block_size={block_size} is longer than the model's {model.config.block_size} positions: "
             f"use --block_size={model.config.block_size} or less")
print0(f"{model.get_num_params() / 1e6:.2f}M parameters")
model.to(device)
torch.manual_seed(seed + dp_rank)  # and then draws its own dropout masks
raw_model = model  # the bare module: its state_dict and MFU, whatever wraps it below


# -----------------------------------------------------------------------------
# buckets, the unit of update and mixing: the embeddings with the tied head and the final LayerNorm, then each
# block. A bucket's parameters become views into one flat tensor, so that it mixes in one all-reduce, no copies.
@dataclass(eq=False)  # buckets are compared by identity, not by their tensors
class Bucket:
    params: list
    flat: torch.Tensor
    optimizer: torch.optim.Optimizer = None
    ready: int = 0  # parameters whose gradient this backward has completed
    stepped_at: int = -1  # the iteration of its last update
    work: dist.Work = None  # its mixing all-reduce, while in flight


def make_bucket(params):
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    for p in params:
        p.data = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return Bucket(params, flat)


in_blocks = {p for block in model.transformer.h for p in block.parameters()}
buckets = [make_bucket([p for p in model.parameters() if p not in in_blocks])]
buckets += [make_bucket(list(block.parameters())) for block in model.transformer.h]
bucket_of = {p: bucket for bucket in buckets for p in bucket.params}
last_micro_step = False  # set by the loop: only the last micro-step's backward updates and mixes


def update_and_mix(bucket):
    """This rank's optimizer step on the bucket, then its average with this round's group, in the background."""
    bucket.optimizer.step()
    bucket.stepped_at = iter_num
    group = mixing_groups[iter_num % len(mixing_groups)]
    if group is not None:
        process_group, size = group
        bucket.flat.div_(size)  # the all-reduce adds up the group's x_j / size: their average
        bucket.work = dist.all_reduce(bucket.flat, group=process_group, async_op=True)


def on_gradient(param):
    """A parameter's gradient is complete: once all of its bucket's are, the bucket updates and starts mixing
    while the backward goes on through the layers before it."""
    if not last_micro_step or grad_clip != 0.0:
        return  # more micro-steps to come, or clipping, which needs the rank's whole gradient first
    bucket = bucket_of[param]
    bucket.ready += 1
    if bucket.ready == len(bucket.params):
        bucket.ready = 0
        update_and_mix(bucket)


def wait_for(bucket):
    if bucket.work is not None:
        bucket.work.wait()
        bucket.work = None


def finish_mixing():
    for bucket in buckets:
        wait_for(bucket)


for p in bucket_of:
    p.register_post_accumulate_grad_hook(on_gradient)
# the next forward waits for each bucket's mixing just before the module that reads it, so the later buckets
# still travel while the earlier layers compute
model.register_forward_pre_hook(lambda module, args: wait_for(buckets[0]))
for block, bucket in zip(model.transformer.h, buckets[1:]):
    block.register_forward_pre_hook(lambda module, args, bucket=bucket: wait_for(bucket))


# -----------------------------------------------------------------------------
# optimizer: one per bucket, each with train.py's two groups (weight decay on matrices and embeddings only)
class AccumAdamW(torch.optim.Optimizer):
    """The method's AccumAdam, with AdamW's decoupled weight decay: the parameters move every step, but the
    moments take in the mean gradient of accum_steps steps at once, so that with few samples per rank and step
    they estimate the statistics of a larger batch. Each step's direction uses the moments as they would be with
    this step's gradient taken in, so accum_steps=1 is exactly AdamW. state['step'] counts the moments' updates,
    as AdamW's does, so AdamW's state carries over both ways."""

    def __init__(self, params, lr, betas, weight_decay, accum_steps, eps=1e-8):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay, accum_steps=accum_steps, eps=eps))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group['betas']
            for p in group['params']:
                if p.grad is None:
                    continue
                state = self.state[p]
                if 'grad_sum' not in state:  # a fresh state, or AdamW's
                    state.setdefault('step', 0)
                    state.setdefault('exp_avg', torch.zeros_like(p))
                    state.setdefault('exp_avg_sq', torch.zeros_like(p))
                    state['grad_sum'], state['grads_summed'] = torch.zeros_like(p), 0
                g = p.grad
                exp_avg = state['exp_avg'].lerp(g, 1 - beta1)
                exp_avg_sq = state['exp_avg_sq'].mul(beta2).addcmul_(g, g, value=1 - beta2)
                t = state['step'] + 1
                denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** t)).add_(group['eps'])
                p.mul_(1 - group['lr'] * group['weight_decay'])
                p.addcdiv_(exp_avg, denom, value=-group['lr'] / (1 - beta1 ** t))
                state['grad_sum'].add_(g)
                state['grads_summed'] += 1
                if state['grads_summed'] == group['accum_steps']:
                    mean = state['grad_sum'].div_(group['accum_steps'])
                    state['exp_avg'].lerp_(mean, 1 - beta1)
                    state['exp_avg_sq'].mul_(beta2).addcmul_(mean, mean, value=1 - beta2)
                    state['step'] = t
                    state['grad_sum'].zero_()
                    state['grads_summed'] = 0


decay = set(raw_model.param_groups()[0])
names = {p: n for n, p in raw_model.named_parameters()}


def make_optimizer(params):
    groups = [{'params': [p for p in params if names[p] in decay], 'weight_decay': weight_decay},
              {'params': [p for p in params if names[p] not in decay], 'weight_decay': 0.0}]
    if optimizer == 'sgd':
        return torch.optim.SGD(groups, lr=learning_rate)
    if optimizer == 'accumadamw':
        return AccumAdamW(groups, lr=learning_rate, betas=(beta1, beta2), weight_decay=weight_decay,
                          accum_steps=accum_steps)
    fused = {'fused': True} if device_type in ('cuda', 'cpu') else {}  # one kernel for the update, as train.py's
    return torch.optim.AdamW(groups, lr=learning_rate, betas=(beta1, beta2), **fused)


for bucket in buckets:
    bucket.optimizer = make_optimizer(bucket.params)

# -----------------------------------------------------------------------------
# checkpoint load: the rest of the state, so that the run continues exactly where it stopped
if checkpoint is not None:
    saved_optimizer = checkpoint.get('config', {}).get('optimizer', 'adamw')
    if 'optimizers' in checkpoint and saved_optimizer != optimizer:
        sys.exit(f"error: {resume_path} holds the state of optimizer={saved_optimizer}: resume with "
                 f"--optimizer={saved_optimizer}, or delete {decent_dir} to start from the averaged {ckpt_path}")
    try:
        if 'optimizers' in checkpoint:  # this script's: every bucket's own
            for bucket, state in zip(buckets, checkpoint['optimizers'], strict=True):
                bucket.optimizer.load_state_dict(state)
        elif optimizer != 'sgd':
            # train.py's AdamW state, numbered over the whole model: train.py's optimizer reads it, and each
            # bucket's takes its parameters' moments from there
            adamw = raw_model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
            adamw.load_state_dict(raw_model.upgrade_optimizer_state(checkpoint['optimizer']))
            for p, state in adamw.state.items():
                if optimizer == 'accumadamw':
                    state = {**state, 'step': int(state['step'])}  # it counts in a plain int
                bucket_of[p].optimizer.state[p] = state
    except Exception as e:
        sys.exit(f"error: checkpoint {resume_path} has an optimizer state that does not fit this model "
                 f"({reason_of(e)}): delete it or restore a good copy")
    if 'data_rng' in checkpoint:  # nanoGPT's checkpoints carry no RNG: their data stream starts afresh
        data_gen.set_state(checkpoint['data_rng'])
    rng = checkpoint.get('rng', [])
    if len(rng) == world_size:
        torch.set_rng_state(rng[rank]['cpu'])
        if device_type == 'cuda' and 'cuda' in rng[rank]:
            torch.cuda.set_rng_state(rng[rank]['cuda'])
    elif rng:
        print0(f"checkpoint was written by {len(rng)} ranks, not {world_size}: dropout masks start afresh")
    print0(f"resuming from {resume_path} at iter {iter_num}")
    checkpoint = None  # free the memory

if compile:
    print0("compiling the blocks... (takes a ~minute)")
    for block in model.transformer.h:
        block.forward = torch.compile(block.forward)  # the forward only: the hooks that wait for mixing stay eager
eval_model = model


@torch.no_grad()
def average_replicas():
    """Replaces every rank's replica by the mean of all of them. Returns this rank's own, to put back with
    restore_replica, and the consensus distance: the mean over ranks of ||x_i - mean|| / ||mean||."""
    finish_mixing()
    own = [bucket.flat.clone() for bucket in buckets]
    for bucket in buckets:
        dist.all_reduce(bucket.flat)
        bucket.flat.div_(world_size)
    sq_distance = sum((x - bucket.flat).pow(2).sum() for x, bucket in zip(own, buckets))
    sq_norm = sum(bucket.flat.pow(2).sum() for bucket in buckets)
    distance = (sq_distance / sq_norm).sqrt()
    dist.all_reduce(distance)
    return own, distance.item() / world_size


@torch.no_grad()
def restore_replica(own):
    for bucket, x in zip(buckets, own):
        bucket.flat.copy_(x)


storage_copy, storage_writer = None, None  # this rank's storage checkpoint in host memory, and its writer thread


def save_checkpoint(to='storage', wait=False):
    """Every rank calls this (RNG states are gathered) and saves its own replica and optimizer state, with the
    rest of the state: to='storage' into out_dir/decent/step-N/rank-R.pt, to='memory' into a file of the node's
    snapshot folder. Both are written in the background, from copies in host memory: storage's is made before this
    returns, a snapshot's by its thread while the next step's forward runs (the last backward, whose hooks may
    update the buckets, waits for it). A thread writes each to a temporary file, renamed when complete: a crash
    mid-write leaves the previous one in place. Once every rank's file of a storage checkpoint is in, rank 0 points
    out_dir/decent/latest at its folder and removes the ones before the previous. Storage also writes
    out_dir/ckpt.pt in train.py's format: the average of the replicas and of their Adam moments, for sample.py
    and train.py."""
    global storage_copy, storage_writer
    finish_mixing()  # the last step's averages may still be on their way into the replica
    rng = {'cpu': torch.get_rng_state(), **({'cuda': torch.cuda.get_rng_state()} if device_type == 'cuda' else {})}
    rngs = [None] * world_size
    dist.all_gather_object(rngs, rng)
    extra = {
        'model_args': model_args,
        'iter_num': iter_num,
        'best_val_loss': best_val_loss,
        'config': config,
        'rng': rngs,
        'data_rng': data_gen.get_state(),
        'run_id': run_id,  # so that a run started afresh over this out_dir never takes it for its own
    }
    checkpoint = {'model': raw_model.state_dict(), 'optimizers': [b.optimizer.state_dict() for b in buckets], **extra}
    if to == 'memory':
        os.makedirs(os.path.dirname(snapshot_path), exist_ok=True)
        # the one before is kept: a rank killed mid-write holds it still, and so do the others
        save_in_background(checkpoint, snapshot_path, keep_previous=True)
    else:
        folder = os.path.join(decent_dir, f'step-{iter_num:08d}')
        if not (resume_from is not None and resume_from[1] == folder):  # a resumed run's first eval finds it there
            wait_for_storage()  # its host copy is about to be overwritten
            storage_copy = host_copy(checkpoint, storage_copy)
            if device_type == 'cuda':
                torch.cuda.synchronize()  # the copies into pinned memory were asynchronous
            os.makedirs(folder, exist_ok=True)
            storage_writer = threading.Thread(target=write_storage, args=(storage_copy, folder))
            storage_writer.start()
            print0(f"saving checkpoint to {folder}")
        # the export: train.py's optimizer over the averaged model holds the averaged moments (sgd has none)
        own, _ = average_replicas()
        adamw = raw_model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
        for p, bucket in bucket_of.items():
            state = bucket.optimizer.state.get(p, {})
            if 'exp_avg' in state:
                moments = torch.stack([state['exp_avg'], state['exp_avg_sq']])
                dist.all_reduce(moments)
                moments /= world_size
                adamw.state[p] = dict(step=torch.tensor(float(state['step'])), exp_avg=moments[0], exp_avg_sq=moments[1])
        if master_process:
            save_in_background({'model': raw_model.state_dict(), 'optimizer': adamw.state_dict(), **extra}, ckpt_path)
            print0(f"saving the averaged model to {ckpt_path}")
        wait_for_copies()  # the average has to be copied before the replica comes back
        restore_replica(own)
    if wait:
        wait_for_storage()
        wait_for_saves()


def write_storage(state, folder):
    """In the background: writes this rank's file of a storage checkpoint. Once every rank's is in (they agree over
    the checkpoint group), rank 0 points latest at the folder and removes the older ones but the one before."""
    written = torch.ones(())
    try:
        atomic_save(state, os.path.join(folder, f'rank-{rank}.pt'))
    except Exception as e:  # the previous checkpoint is still in place; training goes on
        print(f"warning: writing {folder} failed ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        written.zero_()
    dist.all_reduce(written, op=dist.ReduceOp.MIN, group=checkpoint_group)
    if master_process and written.item():
        point_latest(folder)


def wait_for_storage():
    global storage_writer
    if storage_writer is not None:
        storage_writer.join()
        storage_writer = None


@torch.no_grad()
def estimate_loss():
    """Mean loss of the averaged model over eval_iters batches per split, the same batches at every eval (a fixed
    seed), so that evals compare; the batches are shared out over the ranks and the sum all-reduced. Each rank's
    own replica is put back after; the consensus distance comes along."""
    own, consensus = average_replicas()
    out = {}
    eval_model.eval()
    for i, split in enumerate(('train', 'val')):
        gen = torch.Generator().manual_seed(seed + 1 + i)
        offsets = torch.randint(n_tokens[split] - block_size, (eval_iters, batch_size), generator=gen)
        total = torch.zeros((), device=device)
        for k in range(dp_rank, eval_iters, dp_size):
            X, Y = get_batch(split, offsets[k])
            with ctx:
                _, loss = eval_model(X, Y)
            total += loss.float()
        dist.all_reduce(total)
        out[split] = total.item() / eval_iters
    eval_model.train()
    restore_replica(own)
    return out, consensus


def state_bytes():
    """Bytes of parameters, gradients and optimizer state on this rank: a full replica of each, as DDP's."""
    size = lambda tensors: sum(t.numel() * t.element_size() for t in tensors)
    return dict(param_bytes=size(model.parameters()),
                grad_bytes=size(p.grad for p in model.parameters() if p.grad is not None),
                optim_bytes=size(v for b in buckets for s in b.optimizer.state.values() for v in s.values()
                                 if torch.is_tensor(v)))


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / max(1, lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))  # from 1 down to 0
    return min_lr + coeff * (learning_rate - min_lr)


# -----------------------------------------------------------------------------
# logging: one line per logged step for people, the same as JSON in out_dir/metrics.jsonl for programs
resumed = resume_from is not None
if master_process:
    os.makedirs(out_dir, exist_ok=True)
    if not eval_only:
        with open(run_id_path + '.tmp', 'w') as f:
            f.write(run_id)
        os.replace(run_id_path + '.tmp', run_id_path)
    with open(os.path.join(out_dir, 'config.json'), 'w') as f:
        json.dump({**config, 'world_size': world_size, 'local_world_size': local_world_size, 'mixing_rounds': rounds},
                  f, indent=1)  # the run's settings, beside its results
    metrics_path = os.path.join(out_dir, 'metrics.jsonl')
    if resumed and os.path.exists(metrics_path):
        # rows that an interrupted run logged after its checkpoint are about to be logged again
        with open(metrics_path) as f:
            kept = [line for line in f if line.strip() and json.loads(line).get('iter', 0) < iter_num]
        with open(metrics_path + '.tmp', 'w') as f:
            f.writelines(kept)
        os.replace(metrics_path + '.tmp', metrics_path)
    metrics = open(metrics_path, 'a' if resumed else 'w', buffering=1)
if wandb_log and master_process:
    import wandb
    wandb.init(project=wandb_project, name=wandb_run_name, config=config)
device_name = torch.cuda.get_device_name(device) if device_type == 'cuda' else device_type


def log_metrics(**row):
    if master_process:
        metrics.write(json.dumps({'iter': iter_num, **row, 'time': round(time.time() - t_start, 3)}) + '\n')


# -----------------------------------------------------------------------------
# training loop
t_start = time.time()
t0, steps_timed = time.time(), 0
local_iter_num = 0  # steps taken by this process, whatever iter_num it started from
loss_sum = torch.zeros((), device=device)
nonfinite_steps = 0  # in a row
while True:
    lr = get_lr(iter_num) if decay_lr else learning_rate
    for bucket in buckets:
        for param_group in bucket.optimizer.param_groups:
            param_group['lr'] = lr

    if iter_num % eval_interval == 0 or iter_num == max_iters:
        losses, consensus = estimate_loss()
        print0(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}, "
               f"consensus distance {consensus:.3e}")
        log_metrics(train_loss=losses['train'], val_loss=losses['val'], consensus_distance=consensus)
        if wandb_log and master_process:
            wandb.log({'iter': iter_num, 'train/loss': losses['train'], 'val/loss': losses['val'], 'lr': lr,
                       'consensus_distance': consensus})
        if losses['val'] < best_val_loss or always_save_checkpoint:
            best_val_loss = min(best_val_loss, losses['val'])
            if iter_num > 0:
                save_checkpoint()
        t0, steps_timed = time.time(), 0  # leave evals out of the step time
    elif save_storage_interval and iter_num % save_storage_interval == 0 and local_iter_num > 0:
        save_checkpoint()
    if iter_num >= max_iters or eval_only:
        break
    if save_memory_interval and iter_num % save_memory_interval == 0 and local_iter_num > 0:
        save_checkpoint('memory')

    # one step of every replica on its share of the global batch, in micro_steps micro-steps on each rank
    offsets = draw_train_offsets()
    for micro_step in range(micro_steps):
        X, Y = get_batch('train', offsets[micro_step])
        # the last micro-step's backward updates each bucket and starts its mixing as soon as its gradients are in
        last_micro_step = micro_step == micro_steps - 1
        with ctx:
            _, loss = model(X, Y)
            # gradients add up over micro-steps, so each is scaled to make the sum a mean over the rank's batch
            loss = loss / micro_steps
        loss_sum += loss.detach().float()
        if last_micro_step:
            # A non-finite loss would spoil the replicas for good, so the step is skipped, before the backward
            # whose hooks may update the buckets (so only the loss is checked, not the gradient). The ranks have to
            # decide alike, as they do about a SIGTERM, so one small all-reduce carries both.
            nonfinite = ~torch.isfinite(loss_sum)
            flags = torch.stack([nonfinite.float(), torch.tensor(float(bool(stop_signals)), device=device)])
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            nonfinite, stop = flags.tolist()
            wait_for_copies()  # a snapshot taken before this step may still be copying the replica about to change
            if nonfinite:
                break
        loss.backward()
    if not nonfinite:
        if grad_clip != 0.0:
            # clipped by this rank's own gradient norm, which needs every gradient: the buckets update and mix only
            # now, and the communication overlaps the next forward alone
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        for bucket in buckets:  # all of them when clipping; otherwise the backward has updated every one
            if bucket.stepped_at != iter_num:
                update_and_mix(bucket)
    nonfinite_steps = nonfinite_steps + 1 if nonfinite else 0
    if nonfinite:
        print0(f"iter {iter_num}: non-finite loss, step skipped ({nonfinite_steps} in a row)")
        log_metrics(skipped='non-finite loss')
        if nonfinite_steps >= max_nonfinite_steps:
            wait_for_storage()
            wait_for_saves()
            sys.exit(f"error: {nonfinite_steps} steps in a row up to iter {iter_num} had a non-finite loss; "
                     f"{decent_dir} holds the last good state: lower learning_rate or check the data")
    if local_iter_num == 0:  # gradients and optimizer state exist from the first step on
        mem = state_bytes()
        print0("per-rank memory: " + ", ".join(f"{k.removesuffix('_bytes')} {v / 2**20:.2f} MiB" for k, v in mem.items()))
        log_metrics(**mem)
    for bucket in buckets:
        bucket.optimizer.zero_grad(set_to_none=True)
    steps_timed += 1

    if iter_num % log_interval == 0:
        # the loss of the whole global batch: the mean over ranks of each rank's mean over its micro-steps
        dist.all_reduce(loss_sum)
        lossf = loss_sum.item() / world_size  # .item() waits for the GPU, so the time below is real
        dt = (time.time() - t0) / steps_timed
        mfu = raw_model.estimate_mfu(batch_size * micro_steps, dt, device_name)
        print0(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f} ms, {tokens_per_iter / dt:,.0f} tok/s"
               + (f", mfu {mfu * 100:.2f}%" if mfu is not None else ""))
        log_metrics(loss=lossf, lr=lr, ms=dt * 1000, tokens_per_sec=tokens_per_iter / dt, mfu=mfu)
        t0, steps_timed = time.time(), 0
    loss_sum.zero_()
    iter_num += 1
    local_iter_num += 1
    if stop:
        print0(f"SIGTERM: saving a checkpoint at iter {iter_num} and exiting")
        save_checkpoint(wait=True)
        break

wait_for_storage()
wait_for_saves()
dist.barrier()  # every rank's snapshot is written before its node's folder goes
if local_rank == 0 and os.path.exists(os.path.dirname(snapshot_path)):
    shutil.rmtree(os.path.dirname(snapshot_path), ignore_errors=True)  # out_dir holds the final state: free the RAM
if master_process:
    metrics.close()
finish_mixing()
dist.barrier()  # gloo's teardown has aborted when one rank left while another was still in a collective
dist.destroy_process_group()
