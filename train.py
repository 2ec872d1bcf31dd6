"""
Trains a GPT with DistributedDataParallel, or on one process.

One process:      python train.py config/train_shakespeare_char.py --device=cpu
One node, 8 GPUs: torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2.py
Two nodes:        torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HEAD:29500 train.py ...

The global batch in tokens, the data stream and the logged loss do not depend on the world size, and a run
resumed from its checkpoint repeats the uninterrupted run exactly (RNG and data position are saved with it).
"""

import atexit
import json
import math
import os
import shutil
import signal
import sys
import time
import uuid
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from checkpoint import (find_checkpoint, incarnation_store, load_checkpoint, newest_loadable, previous, reason_of,
                        save_in_background, snapshot_dir, wait_for_copies, wait_for_saves)
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
max_nonfinite_steps = 5  # a step whose loss or gradient is not finite is skipped; this many in a row stop the run
# -----------------------------------------------------------------------------
config, given = configure(globals())

# distributed init: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE
ddp = 'RANK' in os.environ
rank, local_rank, world_size = (int(os.environ[k]) for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE')) if ddp else (0, 0, 1)
master_process = rank == 0  # does all the logging and checkpoint writing
dp_rank, dp_size = rank, world_size  # with DDP every rank is a data-parallel rank
if device == 'auto':
    device = f'cuda:{local_rank}' if torch.cuda.is_available() else 'cpu'
elif device == 'cuda' and ddp:
    device = f'cuda:{local_rank}'
device_type = device.split(':')[0]
if device_type == 'cuda' and not torch.cuda.is_available():
    sys.exit("error: device=cuda but torch sees no GPU: use --device=cpu (or auto)")
if dtype == 'auto':
    # real bf16 only: emulated bf16 on older GPUs (V100, T4) is slower than fp16 with a loss scaler
    dtype = ('bfloat16' if torch.cuda.is_bf16_supported(including_emulation=False) else 'float16') \
        if device_type == 'cuda' else 'float32'
if dtype not in ('float32', 'bfloat16', 'float16'):
    sys.exit(f"error: dtype={dtype!r} is not one of auto, float32, bfloat16, float16")
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
if ddp:
    if device_type == 'cuda':
        torch.cuda.set_device(device)
    store = None
    if os.environ.get('TORCHELASTIC_USE_AGENT_STORE') == 'True':
        # torchrun's store outlives a restart of the workers, and gloo would read the dead workers' addresses from it
        # (and fail the restart): each incarnation of the group gets a store of its own
        store = incarnation_store(rank, world_size)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size,
                            device_id=torch.device(device) if device_type == 'cuda' else None)
    # an early exit (a one-line error, an exception) tears the groups down too: left to the interpreter's end, gloo's
    # threads can abort it ('terminate called without an active exception')
    atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
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

print0(f"world size {world_size}, {accum_steps} micro-steps per rank, {tokens_per_iter:,} tokens per iteration")

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
ckpt_path = os.path.join(out_dir, 'ckpt.pt')
run_id_path = os.path.join(out_dir, 'run_id')  # names the run's snapshots, so that a new run in out_dir never takes an old one's


def find_resume_point():
    """(run_id, (iter_num, path) to resume from or None, damaged files passed over). All ranks agree: a memory
    snapshot counts only if every node holds the same one (a replaced node holds none, a node that died while
    writing an older one); else rank 0's newest checkpoint in out_dir, which must be storage they all share."""
    run_id, mem_iter, disk, damaged = None, None, (None, None), []
    wanted = init_from == 'resume' or (auto_resume and not eval_only)  # an eval of another model is no resume
    if wanted and os.path.exists(run_id_path):
        with open(run_id_path) as f:
            run_id = f.read().strip()
        mem_iter, _, damaged = newest_loadable([os.path.join(snapshot_dir(run_id), 'ckpt.pt')])
    if wanted:
        # this run's newest, not one of a run that it was started afresh over (that only when asked to resume)
        this_run = dict(run_id=run_id, or_any=init_from == 'resume')
        *disk, disk_damaged = newest_loadable([ckpt_path, previous(ckpt_path)], **this_run)
        damaged += disk_damaged
    views = [(run_id, mem_iter, tuple(disk), uuid.uuid4().hex)]
    if ddp:
        views = [None] * world_size
        dist.all_gather_object(views, (run_id, mem_iter, tuple(disk), uuid.uuid4().hex))
    run_id, mem_iter, (disk_iter, disk_path), new_id = views[0]
    if run_id is not None and mem_iter is not None and all(v[:2] == (run_id, mem_iter) for v in views) \
            and (disk_iter is None or mem_iter >= disk_iter):
        return run_id, (mem_iter, os.path.join(snapshot_dir(run_id), 'ckpt.pt')), damaged
    if disk_iter is not None:
        return run_id or new_id, (disk_iter, disk_path), damaged
    return new_id, None, damaged  # a fresh run gets a new id


run_id, resume_from, damaged = find_resume_point()
if resume_from is None and damaged:
    path, reason = damaged[0]
    sys.exit(f"error: checkpoint {path} is corrupt or not a training checkpoint ({reason}): delete it or restore a "
             f"good copy (or start afresh over it with --auto_resume=False)")
if resume_from is None and init_from == 'resume':
    sys.exit(f"error: no checkpoint at {ckpt_path}: point --out_dir at a run's folder, or use --init_from=scratch")
for path, reason in damaged:
    print0(f"warning: skipping the damaged {path} ({reason}); resuming from the newest one before it")
snapshot_path = os.path.join(snapshot_dir(run_id), 'ckpt.pt')

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
        checkpoint = torch.load(resume_path, map_location='cpu', weights_only=True)  # a checkpoint is data, never code
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
# optimizer, and the loss scaler that float16 needs
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
scaler = torch.amp.GradScaler(device_type, enabled=(dtype == 'float16'))

# -----------------------------------------------------------------------------
# checkpoint load: the rest of the state, so that the run continues exactly where it stopped
if checkpoint is not None:
    try:
        optimizer.load_state_dict(raw_model.upgrade_optimizer_state(checkpoint['optimizer']))
    except Exception as e:
        sys.exit(f"error: checkpoint {resume_path} has an optimizer state that does not fit this model "
                 f"({reason_of(e)}): delete it or restore a good copy")
    if checkpoint.get('scaler') and scaler.is_enabled():  # a bf16 or fp32 run saved the disabled scaler's {}
        scaler.load_state_dict(checkpoint['scaler'])
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
    print0("compiling the model... (takes a ~minute)")
    model = torch.compile(model)
eval_model = model  # evaluation needs no gradient sync, so it runs outside DDP
if ddp:
    model = DDP(model, device_ids=[torch.device(device).index] if device_type == 'cuda' else None)


def save_checkpoint(to='storage', wait=False):
    """Every rank calls this (RNG states are gathered). to='storage': rank 0 writes out_dir/ckpt.pt, keeping the one
    before as ckpt.prev.pt; to='memory': the first rank of each node writes the node's snapshot. A thread copies
    the state to host memory while the next step's forward and backward run (the loop waits only if the copy
    takes longer), then writes the copy to a temporary file, renamed when complete: a crash mid-write leaves the
    previous one in place."""
    rng = {'cpu': torch.get_rng_state(), **({'cuda': torch.cuda.get_rng_state()} if device_type == 'cuda' else {})}
    rngs = [None] * world_size
    if ddp:
        dist.all_gather_object(rngs, rng)
    else:
        rngs = [rng]
    if not (master_process if to == 'storage' else local_rank == 0):
        return
    checkpoint = {
        'model': raw_model.state_dict(),
        'optimizer': optimizer.state_dict(),
        'model_args': model_args,
        'iter_num': iter_num,
        'best_val_loss': best_val_loss,
        'config': config,
        'rng': rngs,
        'data_rng': data_gen.get_state(),
        'run_id': run_id,  # so that a run started afresh over this out_dir never takes it for its own
        'scaler': scaler.state_dict(),
    }
    if to == 'memory':
        os.makedirs(os.path.dirname(snapshot_path), exist_ok=True)
    save_in_background(checkpoint, ckpt_path if to == 'storage' else snapshot_path, keep_previous=(to == 'storage'))
    if wait:
        wait_for_saves()
    if to == 'storage':
        print0(f"saving checkpoint to {ckpt_path}")


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
        for k in range(dp_rank, eval_iters, dp_size):
            X, Y = get_batch(split, offsets[k])
            with ctx:
                _, loss = eval_model(X, Y)
            total += loss.float()
        if ddp:
            dist.all_reduce(total)
        out[split] = total.item() / eval_iters
    eval_model.train()
    return out


def state_bytes():
    """Bytes of parameters, gradients and optimizer state on this rank: DDP keeps a full replica of each."""
    size = lambda tensors: sum(t.numel() * t.element_size() for t in tensors)
    return dict(param_bytes=size(model.parameters()),
                grad_bytes=size(p.grad for p in model.parameters() if p.grad is not None),
                optim_bytes=size(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)))


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
        # DDP all-reduces gradients in backward; only the last micro-step's backward needs to
        sync = nullcontext() if not ddp or micro_step == accum_steps - 1 else model.no_sync()
        with sync, ctx:
            _, loss = model(X, Y)
            # gradients add up over micro-steps, so each is scaled to make the sum a mean over the rank's batch
            loss = loss / accum_steps
        loss_sum += loss.detach().float()
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    else:
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    # A non-finite loss or gradient would spoil the weights for good, so the step is skipped (float16's scaler
    # skips overflowing gradients by itself: there only the loss counts). The ranks have to decide alike, as
    # they do about a SIGTERM, so one small all-reduce carries both.
    nonfinite = ~torch.isfinite(loss_sum if dtype == 'float16' else loss_sum + grad_norm)
    flags = torch.stack([nonfinite.float(), torch.tensor(float(bool(stop_signals)), device=device)])
    if ddp:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    nonfinite, stop = flags.tolist()
    wait_for_copies()  # a snapshot taken before this step may still be copying the weights it is about to change
    if not nonfinite or scaler.is_enabled():
        scaler.step(optimizer)
        scaler.update()
    nonfinite_steps = nonfinite_steps + 1 if nonfinite else 0
    if nonfinite:
        print0(f"iter {iter_num}: non-finite loss or gradient, step skipped ({nonfinite_steps} in a row)")
        log_metrics(skipped='non-finite loss or gradient')
        if nonfinite_steps >= max_nonfinite_steps:
            wait_for_saves()
            sys.exit(f"error: {nonfinite_steps} steps in a row up to iter {iter_num} had a non-finite loss or "
                     f"gradient; {ckpt_path} holds the last good state: lower learning_rate, use bfloat16 rather "
                     f"than float16, or check the data")
    if local_iter_num == 0:  # gradients and optimizer state exist from the first step on
        mem = state_bytes()
        print0("per-rank memory: " + ", ".join(f"{k.removesuffix('_bytes')} {v / 2**20:.2f} MiB" for k, v in mem.items()))
        log_metrics(**mem)
    optimizer.zero_grad(set_to_none=True)
    steps_timed += 1

    if iter_num % log_interval == 0:
        # the loss of the whole global batch: the mean over ranks of each rank's mean over its micro-steps
        if ddp:
            dist.all_reduce(loss_sum)
        lossf = loss_sum.item() / world_size  # .item() waits for the GPU, so the time below is real
        dt = (time.time() - t0) / steps_timed
        mfu = raw_model.estimate_mfu(batch_size * accum_steps, dt, device_name)
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

wait_for_saves()
if local_rank == 0 and os.path.exists(os.path.dirname(snapshot_path)):
    shutil.rmtree(os.path.dirname(snapshot_path), ignore_errors=True)  # out_dir holds the final state: free the RAM
if master_process:
    metrics.close()
if ddp:
    dist.barrier()  # gloo's teardown has aborted when one rank left while another was still in a collective
    dist.destroy_process_group()
