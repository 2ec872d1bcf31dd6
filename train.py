"""
Trains a GPT with DistributedDataParallel, or on one process.

One process:      python train.py config/train_shakespeare_char.py
One node, 8 GPUs: torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2.py
Two nodes:        torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HEAD:29500 train.py ...

The global batch in tokens, the data stream and the logged loss do not depend on the world size, and a run
resumed from its checkpoint repeats the uninterrupted run exactly (RNG and data position are saved with it).
"""

import math
import os
import sys
import time
from contextlib import nullcontext

from configurator import check_config, configure, quiet_interrupt
quiet_interrupt()  # before torch's ~3 s import: a Ctrl-C there ends with one line, not a traceback
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from checkpoint import (create_model, find_resume, finish_saves, is_snapshot, kept, kept_best, load_failed,
                        remove_snapshots, save_in_background, say_resumed, snapshot_dir, take_settings,
                        upgrade_optimizer_state, wait_for_copies, wait_for_saves, where_saved)
from data import check_token_ids, find_bins, meta_vocab, read_rows, vocabulary
from distributed import (agree, check_fits, finish, gather_rng, on_every_rank, pick_device, restore_rng, skip_on_device,
                         split_accumulation, start, state_bytes, stop_signal, use_deterministic_algorithms)
from hellaswag import DEFAULT_PATH, evaluate, load_or_exit
from keep import keeping, saves_at_eval, skips_save, unsaved
from oom import explain_oom
from runlock import hold
from runlog import ends_diverged, heed, open_log
from seeds import start_tokens

# -----------------------------------------------------------------------------
# config: defaults train GPT-2 124M on OpenWebText; config/*.py and --key=value override them
# I/O
out_dir = 'out'
eval_interval = 2000
log_interval = 1
eval_iters = 200
eval_only = False  # exit right after the first eval
hellaswag_interval = 0  # steps between HellaSwag evals (run `python prepare.py hellaswag` first); 0: none
always_save_checkpoint = True  # save after every eval, not only on a new best val loss
init_from = 'scratch'  # 'scratch', 'resume' (out_dir's checkpoint), 'gpt2'..'gpt2-xl', or a checkpoint's path (weights)
# wandb logging
wandb_log = False
wandb_project = 'owt'
wandb_run_name = 'gpt2'
# data
dataset = 'openwebtext'  # data/<dataset>/{train,val}.bin as prepare.py writes them (or a path to such a folder)
random_data = False  # synthetic tokens instead of data/<dataset> (data.py): for cluster bring-up and benchmarks
gradient_accumulation_steps = 5 * 8  # micro-steps per optimizer step, in total over all ranks
batch_size = 12  # sequences per micro-step per rank
block_size = 1024
# model
n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0  # 0 for pretraining, try 0.1+ for finetuning
bias = False
# under bf16 autocast, the residual stream in bf16 (not float32): half the bytes each layer norm and residual add
# move, as FSDP's and DeepSpeed's bf16 parameters have it; other numerics, the same parameters (docs/speed.md)
autocast_residual = False
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
keep_checkpoints = 2  # the newest states kept in out_dir (fallbacks of a damaged one); the best by val loss besides
# -----------------------------------------------------------------------------
config, given = configure(globals())
check_config(config)  # every key in its range and out_dir writable, before anything is written
explain_oom(globals())  # running out of memory ends in one line that says how to fit, not a traceback

# distributed init: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE; without it, a group of one
device, device_type = pick_device(device)
if dtype == 'auto':
    # real bf16 only: emulated bf16 on older GPUs (V100, T4) is slower than fp16 with a loss scaler
    dtype = ('bfloat16' if torch.cuda.is_bf16_supported(including_emulation=False) else 'float16') \
        if device_type == 'cuda' else 'float32'
if autocast_residual and dtype != 'bfloat16':
    sys.exit(f"error: autocast_residual=True needs dtype=bfloat16 (here {dtype}): float16's range is too narrow for "
             f"the residual stream, float32 has no autocast")
if dtype not in ('float32', 'bfloat16', 'float16'):
    sys.exit(f"error: dtype={dtype!r} is not one of auto, float32, bfloat16, float16")
if backend == 'auto':
    backend = 'nccl' if device_type == 'cuda' else 'gloo'
rank, local_rank, world_size = start(backend, device, config=config)
master_process = rank == 0  # does all the logging and checkpoint writing
dp_rank, dp_size = rank, world_size  # with DDP every rank is a data-parallel rank
accum_steps = split_accumulation(gradient_accumulation_steps, dp_size)  # micro-steps on this rank
torch.manual_seed(seed)  # every rank builds the same initial model
if device_type == 'cuda':
    torch.set_float32_matmul_precision('high')  # TF32 matmuls (the API that inductor's max-autotune reads)
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
ctx = nullcontext() if dtype == 'float32' else torch.autocast(device_type=device_type, dtype=ptdtype)


def print0(*args, **kwargs):
    if master_process:
        print(*args, **kwargs, flush=True)


if deterministic:
    use_deterministic_algorithms(device_type)
    if dropout != 0.0:
        print0(f"deterministic: dropout {dropout} turned off")
    dropout = config['dropout'] = 0.0

# -----------------------------------------------------------------------------
# data: nanoGPT's uint16 train.bin / val.bin
bin_path, n_tokens = on_every_rank(find_bins, dataset, block_size, random_data)  # on one node only: every rank says so


def get_batch(split, offsets):
    chunk = torch.from_numpy(read_rows(bin_path[split], offsets.numpy(), block_size + 1))
    x, y = chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()
    if device_type == 'cuda':
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


# The training stream is a function of the seed and the step alone: each step draws the offsets of the whole
# global batch from one generator and each (rank, micro-step) takes its own row, so 1, 2 or 8 ranks see the same
# data, and saving this generator's state saves the data position.
data_gen = torch.Generator().manual_seed(seed)


def draw_train_offsets():
    offsets = torch.randint(n_tokens['train'] - block_size, (gradient_accumulation_steps, batch_size),
                            generator=data_gen)
    return offsets[dp_rank * accum_steps:(dp_rank + 1) * accum_steps]


# -----------------------------------------------------------------------------
# where to start: this run's newest complete state, a memory snapshot (one per node) or a checkpoint in out_dir
ckpt_path = os.path.join(out_dir, 'ckpt.pt')
best_path = os.path.join(out_dir, 'best.pt')  # the state of the best val loss so far, never pruned
if not eval_only:  # an eval writes nothing: it neither holds out_dir nor waits for whoever does
    hold(out_dir)  # one run at a time in out_dir, for the run's lifetime
run_id, resume_from = find_resume(out_dir, init_from, auto_resume, eval_only,
                                  snapshots=['ckpt.pt', 'ckpt.prev.pt'],  # (the one before: keep.keeping)
                                  storage=[kept(ckpt_path)], where=ckpt_path, script='train.py',
                                  whole=(ckpt_path, keep_checkpoints))  # a node's snapshot holds every rank's state
snapshot_path = os.path.join(snapshot_dir(run_id), 'ckpt.pt')
resume_path = resume_from and resume_from[1]

# -----------------------------------------------------------------------------
# model
meta_vocab_size = meta_vocab(dataset, random_data)
data_vocab = vocabulary(dataset, random_data)  # what its ids stand for, saved with the run (check_vocabulary)
model_args = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, bias=bias,
                  vocab_size=meta_vocab_size or 50304, dropout=dropout)
check_fits(model_args, device)  # a shape too big for this machine is refused before it is built
# a checkpoint is data, never code
model, checkpoint = create_model(resume_path, lambda path: torch.load(path, map_location='cpu', weights_only=True),
                                 init_from, model_args, config, given)
block_size = model_args['block_size']  # the checkpoint's, where the run resumes or starts from one
tokens_per_iter = gradient_accumulation_steps * batch_size * block_size  # the global batch, whatever the world size
print0(f"world size {world_size}, {accum_steps} micro-step{'s' * (accum_steps > 1)} per rank, "
       f"{tokens_per_iter:,} tokens per iteration")
model.config.autocast_residual = autocast_residual  # how the step computes: not in model_args, nor checkpoints
check_token_ids(bin_path, model.config.vocab_size)
hellaswag = load_or_exit(DEFAULT_PATH, model.config.vocab_size) if hellaswag_interval else []
iter_num, best_val_loss = (checkpoint['iter_num'], float(checkpoint['best_val_loss'])) if checkpoint else (0, 1e9)
skipped = checkpoint.get('skipped', 0) if checkpoint else 0  # float16 overflows in a row just before it
# the tokens trained so far: --epochs ends the run on them, whatever global batch each launch had
max_iters, tokens_trained, lr_batch = start_tokens(checkpoint, iter_num, tokens_per_iter, config, print0)
best_val_loss = kept_best(out_dir, run_id, best_val_loss)  # a resume from before the best keeps it best
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
        optimizer.load_state_dict(upgrade_optimizer_state(raw_model, checkpoint['optimizer']))
        take_settings(optimizer, config, given)
    except Exception as e:
        load_failed(resume_path, e, out_dir, eval_only)
    if checkpoint.get('scaler') and scaler.is_enabled():  # a bf16 or fp32 run saved the disabled scaler's {}
        scaler.load_state_dict(checkpoint['scaler'])
    if 'data_rng' in checkpoint:  # nanoGPT's checkpoints carry no RNG: their data stream starts afresh
        data_gen.set_state(checkpoint['data_rng'])
    restore_rng(checkpoint.get('rng', []), print0)
    say_resumed(resume_path, iter_num, max_iters, eval_only, print0)
    checkpoint = None  # free the memory

if compile:
    print0("compiling the model... (takes a ~minute)")
    model = torch.compile(model)
eval_model = model  # evaluation needs no gradient sync, so it runs outside DDP
if world_size > 1:
    model = DDP(model, device_ids=[torch.device(device).index] if device_type == 'cuda' else None)


def save_checkpoint(to='storage', wait=False, val_loss=None, best=False):
    """Every rank calls this (RNG states are gathered). to='storage': a checkpoint in out_dir; to='memory': a
    snapshot in the node's folder in /dev/shm. A thread copies the state to host memory while the next step's
    forward and backward run (the optimizer step waits for the copy), then writes it to temporary files, renamed
    when complete: a crash mid-write leaves the previous one in place. Rank 0 writes out_dir/ckpt.pt (the one before
    kept as ckpt.prev.pt, and so on: keep_checkpoints in all; a new best also as best.pt), the first rank of each
    node the node's snapshot. Nothing is saved in a run of non-finite steps (but for float16's overflows alone)."""
    if skips_save(to, nonfinite_steps, iter_num, print0):
        return
    extra = {
        'model_args': model_args,
        'iter_num': iter_num,
        'tokens_trained': tokens_trained,  # at each launch's global batch: where --epochs ends (start_tokens)
        'lr_batch': lr_batch,  # the tokens an iteration of the LR schedule stands for (None: iterations)
        'best_val_loss': best_val_loss,
        'config': config,
        'vocabulary': data_vocab,
        'rng': gather_rng(),
        'data_rng': data_gen.get_state(),
        'run_id': run_id,  # so that a run started afresh over this out_dir never takes it for its own
        **where_saved(out_dir),  # the folder it is saved for, however named, and its inode (saved_for)
        'val_loss': val_loss,  # the eval's it was saved at (None: a save between evals)
        'skipped': nonfinite_steps,  # float16 overflows just before: its weights are those of iter_num - skipped
    }
    checkpoint = {'model': raw_model.state_dict(), 'optimizer': optimizer.state_dict(), 'scaler': scaler.state_dict(),
                  **extra}
    if to == 'memory' and local_rank == 0:
        save_in_background(checkpoint, snapshot_path, keep=keeping(1, nonfinite_steps))
    elif to == 'storage' and master_process:
        save_in_background(checkpoint, ckpt_path, keep=keeping(keep_checkpoints, nonfinite_steps),
                           best=best and best_path)
        print0(f"saving checkpoint to {ckpt_path}")
    if wait:
        wait_for_saves()


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
        # every rank runs the same number of forwards (under FSDP, ZeRO-3 or TP each takes part in the others');
        # the extra ones where eval_iters does not divide by dp_size count for nothing
        for k in range(dp_rank, -(-eval_iters // dp_size) * dp_size, dp_size):
            X, Y = get_batch(split, offsets[k % eval_iters])
            with ctx:
                _, loss = eval_model(X, Y)
            total += loss.float() * (k < eval_iters)
        dist.all_reduce(total)
        out[split] = total.item() / eval_iters
    eval_model.train()
    return out


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
log_metrics = open_log(out_dir, run_id, {**config, 'world_size': world_size}, resume_from and iter_num,
                       write=master_process, eval_only=eval_only)
if wandb_log and master_process:
    import wandb
    wandb.init(project=wandb_project, name=wandb_run_name, config=config, id=run_id, resume='allow')  # one run's curves
device_name = torch.cuda.get_device_name(device) if device_type == 'cuda' else device_type

# -----------------------------------------------------------------------------
# training loop
t0, steps_timed = time.time(), 0
local_iter_num = 0  # steps taken by this process, whatever iter_num it started from
loss_sum = torch.zeros((), device=device)
nonfinite_steps = skipped  # in a row: a resume within float16's overflows counts on from those before it
while True:
    # the step before's verdict (agree), read only now: a non-finite step is counted, a SIGTERM or Ctrl-C stops here
    nonfinite_steps, stop = heed(nonfinite_steps, max_nonfinite_steps, log_metrics, out_dir, run_id, scaler)
    if stop:
        print0(f"{stop_signal()}: saving a checkpoint at iter {iter_num} and exiting")
        save_checkpoint(wait=True)
        break
    lr = get_lr(tokens_trained / lr_batch if lr_batch else iter_num) if decay_lr else learning_rate
    for param_group in optimizer.param_groups:
        param_group['lr'] = lr

    # past max_iters too: a run resumed from a memory snapshot beyond a lowered max_iters saves it before its end
    # frees the snapshots
    if iter_num % eval_interval == 0 or iter_num >= max_iters or eval_only:
        losses = estimate_loss()
        print0(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        log_metrics(iter_num, train_loss=losses['train'], val_loss=losses['val'])
        if wandb_log and master_process:
            wandb.log({'iter': iter_num, 'train/loss': losses['train'], 'val/loss': losses['val'], 'lr': lr})
        save, best = saves_at_eval(losses, best_val_loss, always_save_checkpoint, print0,
                                   last=iter_num >= max_iters and (save_memory_interval or is_snapshot(resume_path)))
        if save:
            best_val_loss = min(best_val_loss, losses['val'])
            if iter_num > 0 and not eval_only:  # an eval of a run writes no checkpoint
                save_checkpoint(val_loss=losses['val'], best=best)
        t0, steps_timed = time.time(), 0  # leave evals out of the step time
    elif save_storage_interval and iter_num % save_storage_interval == 0 and local_iter_num > 0:
        save_checkpoint()
    if hellaswag_interval and (iter_num % hellaswag_interval == 0 or iter_num == max_iters):
        hs = evaluate(eval_model, hellaswag, device, ctx, block_size, dp_rank, dp_size)
        print0(f"step {iter_num}: hellaswag acc {hs['acc']:.4f}, acc_norm {hs['acc_norm']:.4f} ({hs['n']} examples)")
        log_metrics(iter_num, hellaswag_acc=hs['acc'], hellaswag_acc_norm=hs['acc_norm'])
        t0, steps_timed = time.time(), 0
    if iter_num >= max_iters or eval_only:
        # a run that ends in non-finite steps stops as max_nonfinite_steps would: a save since may hold bad weights
        ends_diverged(nonfinite_steps, losses, iter_num, out_dir, run_id, dtype=dtype)
        break
    if save_memory_interval and iter_num % save_memory_interval == 0 and local_iter_num > 0:
        save_checkpoint('memory')

    # one optimizer step over the whole global batch, in accum_steps micro-steps on each rank
    offsets = draw_train_offsets()
    for micro_step in range(accum_steps):
        X, Y = get_batch('train', offsets[micro_step])
        # DDP all-reduces gradients in backward; only the last micro-step's backward needs to
        sync = nullcontext() if world_size == 1 or micro_step == accum_steps - 1 else model.no_sync()
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
    # A non-finite loss or gradient would spoil the weights for good, so the step is skipped; the ranks decide alike,
    # as about SIGTERM, on the device, where the fused AdamW skips by the verdict (found_inf) with no wait for it
    # (float16's scaler skips overflowing gradients by itself, and sets found_inf so: heed counts its skips apart)
    nonfinite = agree(~torch.isfinite(loss_sum if dtype == 'float16' else loss_sum + grad_norm), iter_num,
                      ~torch.isfinite(grad_norm))
    skip_on_device(optimizer, nonfinite)
    wait_for_copies()  # a snapshot taken before this step may still be copying the weights it is about to change
    scaler.step(optimizer)
    scaler.update()
    if local_iter_num == 0:  # gradients and optimizer state exist from the first step on
        mem = state_bytes(model.parameters(), [optimizer])
        print0("per-rank memory: " + ", ".join(f"{k[:-6]} {v / 2**20:.2f} MiB" for k, v in mem.items()))
        log_metrics(iter_num, **mem)
    optimizer.zero_grad(set_to_none=True)
    steps_timed += 1

    if iter_num % log_interval == 0 or local_iter_num == 0:  # a launch's first step (compiling) timed alone
        # the loss of the whole global batch: the mean over ranks of each rank's mean over its micro-steps
        dist.all_reduce(loss_sum)
        lossf = loss_sum.item() / world_size  # .item() waits for the GPU, so the time below is real
        dt = (time.time() - t0) / steps_timed
        mfu = raw_model.estimate_mfu(batch_size * accum_steps, dt, device_name, dtype)
        print0(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f} ms, {tokens_per_iter / dt:,.0f} tok/s"
               + (f", mfu {mfu * 100:.2f}%" if mfu is not None else ""))
        log_metrics(iter_num, loss=lossf, lr=lr, ms=dt * 1000, tokens_per_sec=tokens_per_iter / dt, mfu=mfu)
        t0, steps_timed = time.time(), 0
    loss_sum.zero_()
    iter_num += 1
    local_iter_num += 1
    tokens_trained += tokens_per_iter

finish_saves()  # a storage checkpoint that could not be written stops the run with an error
remove_snapshots(run_id, eval_only, unsaved(nonfinite_steps))  # out_dir holds the final state: free the RAM
finish()
