"""
Trains a GPT with FSDP2 (fully_shard), tensor parallelism, or both on a 2-D mesh.

FSDP, 8 GPUs:       torchrun --standalone --nproc_per_node=8 fsdp_train.py config/train_gpt2.py
TP within a node:   torchrun --standalone --nproc_per_node=8 fsdp_train.py config/train_gpt2.py --tp_size=8
2-D, 2 nodes:       torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HEAD:29500 \
                        fsdp_train.py config/train_gpt2.py --tp_size=8     # TP inside each node, FSDP across

Everything but the distribution is train.py's: config keys, data stream, logging, eval and exact resume. Each
block's parameters, gradients and optimizer state are sharded over the data-parallel ranks; with tp_size > 1 the
ranks form a (dp, tp) mesh, each block's matmuls are split by heads and hidden units over tp, and FSDP shards
over dp. Checkpoints are torch.distributed.checkpoint folders that load at another world size and mesh; a
train.py checkpoint resumes here, and save_consolidated writes train.py's ckpt.pt for sample.py and train.py.
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

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._composable import checkpoint as checkpoint_activations
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     get_state_dict, set_optimizer_state_dict, set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils._pytree import tree_flatten_with_path, tree_map_only

from checkpoint import (atomic_save, dcp_load, find_checkpoint, incarnation_store, load_checkpoint, newest_loadable,
                        point_latest, previous, reason_of, save_in_background, snapshot_dir, wait_for_copies,
                        wait_for_saves)
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
dtype = 'auto'  # 'auto' (bfloat16 on GPUs, float32 on CPU), 'bfloat16' or 'float32'; bf16 params, fp32 reduce
compile = True  # torch.compile each block
seed = 1337
deterministic = False  # deterministic algorithms and dropout off, so that reruns give identical curves, on GPUs too
# fault tolerance
auto_resume = True  # on every start, continue from the newest complete snapshot or checkpoint of out_dir, if any
save_memory_interval = 0  # steps between snapshots of the whole state into node-local memory (/dev/shm); 0: none
save_storage_interval = 0  # steps between checkpoints to out_dir (in the background), besides the evals'; 0: none
max_nonfinite_steps = 5  # a step whose loss or gradient is not finite is skipped; this many in a row stop the run
# parallelism
tp_size = 1  # tensor-parallel ranks per group (within a node, ideally); the world size / tp_size ranks shard FSDP
reshard_after_forward = True  # free each block's gathered parameters after its forward (ZeRO-3); False: ZeRO-2-like
cpu_offload = False  # keep parameters, gradients and optimizer state in CPU memory between uses
activation_checkpointing = False  # recompute each block's activations in backward instead of storing them
save_consolidated = False  # with each checkpoint also write out_dir/ckpt.pt in train.py's format (gathered on rank 0)
# -----------------------------------------------------------------------------
config, given = configure(globals())

# distributed init: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE; without it, a group of one
ddp = 'RANK' in os.environ
rank, local_rank, world_size = (int(os.environ[k]) for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE')) if ddp else (0, 0, 1)
master_process = rank == 0  # does all the logging and checkpoint writing
if tp_size < 1 or world_size % tp_size != 0:
    sys.exit(f"error: tp_size={tp_size} does not divide the world size {world_size}: use a divisor of it")
# the mesh is (dp, tp) with tp innermost, so a tp group is tp_size consecutive ranks: the GPUs of one node
dp_rank, dp_size = rank // tp_size, world_size // tp_size
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
    sys.exit(f"error: dtype={dtype!r}: fsdp_train.py takes auto, float32 or bfloat16 (float16 needs a loss "
             f"scaler for sharded gradients; use train.py for it)")
if device_type not in ('cuda', 'cpu'):
    sys.exit(f"error: FSDP{' with cpu_offload' if cpu_offload else ''} runs on cuda or cpu, not {device_type}: "
             f"use --device=cuda or cpu, or train.py")
if backend == 'auto':
    backend = 'nccl' if device_type == 'cuda' else 'gloo'
for key in ('save_memory_interval', 'save_storage_interval', 'max_nonfinite_steps'):
    if config[key] < (key == 'max_nonfinite_steps'):
        sys.exit(f"error: {key}={config[key]} " + ("must be 1 or more (1 stops at the first non-finite step)"
                 if key == 'max_nonfinite_steps' else "is negative: give a number of steps, or 0 for none"))
if gradient_accumulation_steps % dp_size != 0:
    sys.exit(f"error: gradient_accumulation_steps={gradient_accumulation_steps} does not divide across {dp_size} "
             f"data-parallel ranks: make it a multiple of {dp_size} (it is the total over all ranks)")
accum_steps = gradient_accumulation_steps // dp_size  # micro-steps on this rank
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
# DCP's background saves talk over a group of their own: collectives of two threads on one group would interleave
checkpoint_group = dist.new_group(backend='gloo')
mesh = init_device_mesh(device_type, (dp_size, tp_size), mesh_dim_names=('dp', 'tp'))
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

print0(f"world size {world_size} (dp {dp_size} x tp {tp_size}), {accum_steps} micro-steps per rank, "
       f"{tokens_per_iter:,} tokens per iteration")

# SIGTERM is how SLURM and Kubernetes preempt a job (torchrun passes it on to the workers): the loop notices it at
# the end of the step, saves a checkpoint and exits cleanly.
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
    return offsets[dp_rank * accum_steps:(dp_rank + 1) * accum_steps]


# -----------------------------------------------------------------------------
# where to start: the newest complete state of this run, a memory snapshot or a checkpoint in out_dir
ckpt_path = os.path.join(out_dir, 'ckpt.pt')  # train.py's checkpoint, or the consolidated one: a starting point too
dcp_dir = os.path.join(out_dir, 'dcp')  # the sharded checkpoints, a folder per step
run_id_path = os.path.join(out_dir, 'run_id')  # names the run's snapshots, so that a new run in out_dir never takes an old one's
snapshot_name = f'rank-{rank}-of-{dp_size}x{tp_size}.pt'  # a rank's own shards, which only this mesh can read back


def find_resume_point():
    """(run_id, (iter_num, path) to resume from or None, damaged files passed over), alike on every rank. A memory
    snapshot counts only at an iteration that every rank holds (a replaced node holds none; a rank killed while
    writing holds the one before, which is why each keeps two); else rank 0's newest checkpoint in out_dir, which
    must be storage they all share: a DCP folder (at any mesh), else a train.py checkpoint."""
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
        folders = sorted(os.listdir(dcp_dir), reverse=True) if os.path.isdir(dcp_dir) else []
        # this run's newest, not one of a run that it was started afresh over (that only when asked to resume)
        this_run = dict(run_id=run_id, or_any=init_from == 'resume')
        *disk, bad = newest_loadable([os.path.join(dcp_dir, f) for f in folders if f.startswith('step-')] +
                                     [ckpt_path, previous(ckpt_path)], **this_run)
        damaged += bad
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
    sys.exit(f"error: no checkpoint at {dcp_dir} or {ckpt_path}: point --out_dir at a run's folder, or use "
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


if resume_from is not None:
    resume_path = resume_from[1]
    if init_from != 'resume':
        print0(f"auto-resume: {out_dir} holds this run's state at iter {resume_from[0]}, so the run continues "
               f"(--auto_resume=False starts afresh)")
    try:
        # the small state beside a DCP folder's shards; or a whole file: this rank's memory snapshot, or a train.py
        # checkpoint. Data, never code
        extra = os.path.join(resume_path, 'extra.pt') if os.path.isdir(resume_path) else resume_path
        checkpoint = torch.load(extra, map_location='cpu', weights_only=True)
        ckpt_args = checkpoint['model_args']
        take_shape(ckpt_args)
        model = GPT(GPTConfig(**model_args))
        if 'model' in checkpoint:  # a whole train.py checkpoint: load it now, before the model is sharded
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
for name, n, what in (('n_head', model.config.n_head, 'heads'), ('4 * n_embd', 4 * model.config.n_embd, 'MLP units')):
    if n % tp_size != 0:
        sys.exit(f"error: tp_size={tp_size} does not divide {name}={n}: tensor parallelism splits the {what} "
                 f"evenly, so use a tp_size that divides {n}")
print0(f"{model.get_num_params() / 1e6:.2f}M parameters")
model.to(device)
torch.manual_seed(seed + dp_rank)  # and then draws its own dropout masks (the same within a tp group)
raw_model = model  # the module itself, sharded in place below: its config and MFU

# tensor parallel first (torchtitan's order): q, k, v and the MLP's first layer split by output (heads, hidden
# units), the projections back by input, so each block needs one all-reduce in attention and one in the MLP
if tp_size > 1:
    for block in model.transformer.h:
        parallelize_module(block, mesh['tp'], {
            'attn.c_q': ColwiseParallel(), 'attn.c_k': ColwiseParallel(), 'attn.c_v': ColwiseParallel(),
            'attn.c_proj': RowwiseParallel(), 'mlp.c_fc': ColwiseParallel(), 'mlp.c_proj': RowwiseParallel()})
for block in model.transformer.h:
    if activation_checkpointing:
        checkpoint_activations(block)
    if compile:
        block.compile()  # in place, so parameter names (and checkpoints) stay the same
# then FSDP over dp: each block is a unit (gathered for its forward and backward only), the root holds the rest
mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if dtype == 'bfloat16' else None, reduce_dtype=torch.float32)
offload_policy = CPUOffloadPolicy(pin_memory=(device_type == 'cuda')) if cpu_offload else OffloadPolicy()
for block in model.transformer.h:
    fully_shard(block, mesh=mesh['dp'], reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
                offload_policy=offload_policy)
fully_shard(model, mesh=mesh['dp'], reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
            offload_policy=offload_policy)

# -----------------------------------------------------------------------------
# optimizer, over the sharded parameters (in CPU memory with cpu_offload)
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), 'cpu' if cpu_offload else device_type)


def optim_state_dict_by_name(osd):
    """train.py's AdamW state (parameters numbered in param_groups order) keyed by parameter name instead."""
    names = [n for group in raw_model.param_groups() for n in group]
    return {'state': {names[i]: s for i, s in osd['state'].items()},
            'param_groups': [{**g, 'params': [names[i] for i in g['params']]} for g in osd['param_groups']]}


def optim_state_dict_by_index(osd):
    """The inverse: a state keyed by parameter name, numbered as train.py's optimizer numbers its parameters."""
    index = {n: i for i, n in enumerate(n for group in raw_model.param_groups() for n in group)}
    return {'state': {index[n]: s for n, s in osd['state'].items()},
            'param_groups': [{**g, 'params': [index[n] for n in g['params']]} for g in osd['param_groups']]}


# -----------------------------------------------------------------------------
# checkpoint load: the rest of the state, so that the run continues exactly where it stopped
def local_shards(state):
    """The state with each DTensor replaced by this rank's piece of it (a view, no copy): a memory snapshot."""
    return tree_map_only(DTensor, lambda t: t.to_local(), state)


if checkpoint is not None:
    try:
        if 'model' not in checkpoint:
            # each rank reads the pieces of the saved shards that its own shards cover: from a DCP folder, whatever
            # mesh wrote it, or from its own memory snapshot, which this mesh wrote
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {'model': model_sd, 'optim': optim_sd}
            if 'shards' in checkpoint:
                ours = tree_flatten_with_path(local_shards(state))[0]
                saved = tree_flatten_with_path(checkpoint['shards'])[0]
                if [path for path, _ in ours] != [path for path, _ in saved]:
                    raise ValueError("its shards are not laid out as this model's and optimizer's")
                with torch.no_grad():
                    for (_, t), (_, s) in zip(ours, saved):
                        if torch.is_tensor(t):
                            t.copy_(s)
            else:
                dcp_load(state, resume_path)
            set_state_dict(model, optimizer, model_state_dict=state['model'], optim_state_dict=state['optim'])
        else:  # train.py's optimizer state is indexed by parameter order; the sharded one by name
            set_optimizer_state_dict(model, optimizer, optim_state_dict_by_name(raw_model.upgrade_optimizer_state(
                checkpoint['optimizer'])), options=StateDictOptions(full_state_dict=True))
    except Exception as e:
        sys.exit(f"error: checkpoint {resume_path} does not fit this model ({reason_of(e)}): "
                 f"delete it or restore a good copy")
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

eval_model = model  # under FSDP every rank takes part in each forward, evaluation's too


storage_writer = None  # the thread that sees the storage checkpoint in flight through


def save_checkpoint(to='storage', wait=False):
    """Every rank calls this (RNG states are gathered) and saves its own shards. to='storage': DCP writes them into
    out_dir/dcp/step-N/, rank 0 the rest of the state beside them; to='memory': into a file of the node's snapshot
    folder, which only this mesh can read back. Both are written in the background, from copies in host memory:
    DCP's is made before it returns, a snapshot's by its thread while the next step's forward and backward run
    (the optimizer step waits for it). A crash mid-write leaves the previous one in place: a DCP folder is complete
    once it holds .metadata, which DCP writes last, and only then does rank 0 point out_dir/dcp/latest at it and
    remove the folders before the previous one. With save_consolidated, also train.py's ckpt.pt."""
    global storage_writer
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
    model_sd, optim_sd = get_state_dict(model, optimizer)
    if to == 'memory':
        os.makedirs(os.path.dirname(snapshot_path), exist_ok=True)
        # the one before is kept: a rank killed mid-write holds it still, and so do the others
        save_in_background({'shards': local_shards({'model': model_sd, 'optim': optim_sd}), **extra}, snapshot_path,
                           keep_previous=True)
    else:
        path = os.path.join(dcp_dir, f'step-{iter_num:08d}')
        wait_for_storage()  # one DCP save at a time: they share the checkpoint group
        if not (resume_from is not None and resume_from[1] == path):  # a resumed run's first eval finds it there
            if master_process:
                shutil.rmtree(path, ignore_errors=True)  # what a save cut short left there
                os.makedirs(path)
                atomic_save(extra, os.path.join(path, 'extra.pt'))
            dist.barrier()  # nobody writes into the folder before it is clean
            # returns once the shards are copied to host memory; a thread of DCP's writes them
            saving = dcp.async_save({'model': model_sd, 'optim': optim_sd}, checkpoint_id=path,
                                    process_group=checkpoint_group)
            storage_writer = threading.Thread(target=finish_storage_save, args=(saving, path))
            storage_writer.start()
            print0(f"saving checkpoint to {path}")
        if save_consolidated:
            # gathered to full tensors in rank 0's CPU memory: train.py's checkpoint format
            full = StateDictOptions(full_state_dict=True, cpu_offload=True)
            model_sd = get_model_state_dict(model, options=full)
            optim_sd = get_optimizer_state_dict(model, optimizer, options=full)
            if master_process:
                save_in_background({'model': model_sd, 'optimizer': optim_state_dict_by_index(optim_sd), **extra},
                                   ckpt_path)
                print0(f"saving consolidated checkpoint to {ckpt_path}")
    if wait:
        wait_for_storage()
        wait_for_saves()


def finish_storage_save(saving, path):
    """In the background: once DCP has written every rank's shards, then .metadata, rank 0 points latest at the
    folder and removes the older ones but the one before."""
    try:
        saving.result()
    except Exception as e:  # the previous checkpoint is still in place; training goes on
        print(f"warning: writing {path} failed ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        return
    if master_process:
        point_latest(path)


def wait_for_storage():
    global storage_writer
    if storage_writer is not None:
        storage_writer.join()
        storage_writer = None


@torch.no_grad()
def estimate_loss():
    """Mean loss over eval_iters batches per split, the same batches at every eval (a fixed seed), so that evals
    compare; the batches are shared out over the ranks and the sum all-reduced."""
    out = {}
    eval_model.eval()
    for i, split in enumerate(('train', 'val')):
        gen = torch.Generator().manual_seed(seed + 1 + i)
        offsets = torch.randint(n_tokens[split] - block_size, (eval_iters, batch_size), generator=gen)
        total = torch.zeros((), device=device)
        # every rank runs the same number of forwards (each gathers shards from the others); the extra ones
        # where eval_iters does not divide by dp_size count for nothing
        for k in range(dp_rank, -(-eval_iters // dp_size) * dp_size, dp_size):
            X, Y = get_batch(split, offsets[k % eval_iters])
            with ctx:
                _, loss = eval_model(X, Y)
            total += loss.float() * (k < eval_iters)
        dist.all_reduce(total)
        out[split] = total.item() / eval_iters / tp_size  # a tp group's ranks all add the same losses
    eval_model.train()
    return out


def state_bytes():
    """Bytes of parameters, gradients and optimizer state on this rank: its shards of each."""
    size = lambda tensors: sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors)
    return dict(param_bytes=size(model.parameters()),
                grad_bytes=size(p.grad for p in model.parameters() if p.grad is not None),
                optim_bytes=size(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)))


def total_norm(grads):
    """The global norm of sharded gradients: it adds every rank's shards. Under tensor parallelism the blocks'
    matrices live on the 2-D mesh and the rest on dp alone, so the squares are summed per mesh (a DTensor's sum
    reduces over its own mesh) before the whole is added up."""
    by_mesh = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    total_sq = 0.0
    for gs in by_mesh.values():
        sq = torch.stack([g.float().pow(2).sum() for g in gs]).sum()
        total_sq = total_sq + (sq.full_tensor() if isinstance(sq, DTensor) else sq)
    return total_sq.sqrt()


def clip_grad_norm(max_norm):
    """Gradient clipping over sharded gradients, by their global norm, which it returns."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = total_norm(grads)
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(scale.to(g.device))
    return norm


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
        json.dump({**config, 'world_size': world_size}, f, indent=1)  # the run's settings, beside its results
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
    for param_group in optimizer.param_groups:
        param_group['lr'] = lr

    if iter_num % eval_interval == 0 or iter_num == max_iters:
        losses = estimate_loss()
        print0(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        log_metrics(train_loss=losses['train'], val_loss=losses['val'])
        if wandb_log and master_process:
            wandb.log({'iter': iter_num, 'train/loss': losses['train'], 'val/loss': losses['val'], 'lr': lr})
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

    # one optimizer step over the whole global batch, in accum_steps micro-steps on each rank
    offsets = draw_train_offsets()
    for micro_step in range(accum_steps):
        X, Y = get_batch('train', offsets[micro_step])
        # FSDP reduce-scatters gradients in backward; only the last micro-step's backward needs to
        model.set_requires_gradient_sync(micro_step == accum_steps - 1)
        with ctx:
            _, loss = model(X, Y)
            # gradients add up over micro-steps, so each is scaled to make the sum a mean over the rank's batch
            loss = loss / accum_steps
        loss_sum += loss.detach().float()
        loss.backward()
    if grad_clip != 0.0:
        grad_norm = clip_grad_norm(grad_clip)
    else:
        grad_norm = total_norm([p.grad for p in model.parameters() if p.grad is not None])
    # A non-finite loss or gradient would spoil the weights for good, so the step is skipped. The ranks have to
    # decide alike, as they do about a SIGTERM, so one small all-reduce carries both.
    nonfinite = ~torch.isfinite(loss_sum + grad_norm.to(device))
    flags = torch.stack([nonfinite.float(), torch.tensor(float(bool(stop_signals)), device=device)])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    nonfinite, stop = flags.tolist()
    wait_for_copies()  # a snapshot taken before this step may still be copying the shards it is about to change
    if not nonfinite:
        optimizer.step()
    nonfinite_steps = nonfinite_steps + 1 if nonfinite else 0
    if nonfinite:
        print0(f"iter {iter_num}: non-finite loss or gradient, step skipped ({nonfinite_steps} in a row)")
        log_metrics(skipped='non-finite loss or gradient')
        if nonfinite_steps >= max_nonfinite_steps:
            wait_for_storage()
            wait_for_saves()
            sys.exit(f"error: {nonfinite_steps} steps in a row up to iter {iter_num} had a non-finite loss or "
                     f"gradient; {dcp_dir} holds the last good state: lower learning_rate or check the data")
    if local_iter_num == 0:  # gradients and optimizer state exist from the first step on
        mem = state_bytes()
        print0("per-rank memory: " + ", ".join(f"{k.removesuffix('_bytes')} {v / 2**20:.2f} MiB" for k, v in mem.items()))
        log_metrics(**mem)
    optimizer.zero_grad(set_to_none=True)
    steps_timed += 1

    if iter_num % log_interval == 0:
        # the loss of the whole global batch: the mean over ranks of each rank's mean over its micro-steps
        dist.all_reduce(loss_sum)
        lossf = loss_sum.item() / world_size  # .item() waits for the GPU, so the time below is real
        dt = (time.time() - t0) / steps_timed
        mfu = raw_model.estimate_mfu(batch_size * accum_steps / tp_size, dt, device_name)  # tp shares the work
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
dist.barrier()  # gloo's teardown has aborted when one rank left while another was still in a collective
dist.destroy_process_group()
