"""
Trains a GPT with decentralized data parallelism (Decent-DP, ICLR 2025): instead of all-reducing gradients, every
rank keeps its own replica, takes its own optimizer step on its share of the batch, and then averages its
parameters with a few peers that a topology picks.

Ring, 8 GPUs:     torchrun --standalone --nproc_per_node=8 decent_train.py config/train_gpt2.py --topology=ring
Two nodes:        torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HEAD:29500 \
                      decent_train.py config/train_gpt2.py --topology=alternating-exp-ring \
                      --replica_optimizer=accumadamw --batch_size=8 --gradient_accumulation_steps=64

Everything but the distribution is train.py's. A topology is a cycle of mixing rounds; in each round every group
of ranks averages its replicas (an all-reduce within the group). A bucket of parameters is updated and starts
mixing as soon as its gradients are complete, and the next forward waits for each bucket only where it needs it.
Evals run on the average of all replicas and log how far the replicas are from it. Checkpoints hold every rank's
replica and optimizer state (out_dir/decent/step-N/), and out_dir/ckpt.pt the averaged model in train.py's format;
a train.py checkpoint starts every replica here, and so does their average where the world size has changed.

DiLoCo (--diloco_steps=H): no mixing between outer steps; each replica takes H steps of its own optimizer, then the
replicas average their pseudo-gradients (one all-reduce, bucket by bucket; in half the bytes with
--diloco_dtype=bfloat16) and an outer Nesterov step moves the global model, which every replica starts the next
window from; evals and ckpt.pt see the global model. Streaming DiLoCo (--diloco_fragments=F --diloco_overlap=τ):
runs of blocks take their outer steps in turn, H/F steps apart, each landing τ inner steps after its all-reduce
started and merged into the replica (--diloco_alpha).
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

from checkpoint import (commit, create_model, find_resume, finish_saves, is_snapshot, kept, kept_best, load_failed,
                        previous, remove_snapshots, save_in_background, say_resumed, snapshot_dir, step_folders,
                        take_settings, upgrade_optimizer_state, wait_for_copies, wait_for_saves, where_saved)
from data import check_token_ids, find_bins, meta_vocab, read_rows, vocabulary
from decent import (average_moments, average_replicas, check_optimizers, check_resumed, global_model, make_buckets,
                    make_mixing_groups, make_optimizers, make_outer, mixing_rounds, moments_from_adamw, name_best,
                    outer_bytes, outer_state, plan_words, prune_incomplete, read_replica, replicas_in, restore_outer,
                    restore_replica, set_aside_incomplete, start_outer_step, wait_for)
from distributed import (agree, check_fits, finish, gather_rng, on_every_rank, pick_device, ranks_per_node, restore_rng,
                         split_accumulation, start, state_bytes, stop_signal, use_deterministic_algorithms)
from hellaswag import DEFAULT_PATH, evaluate, load_or_exit
from keep import saves_at_eval, skips_save
from oom import explain_oom
from runlock import hold
from runlog import count_skipped, ends_diverged, open_log
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
keep_checkpoints = 2  # the newest states kept in out_dir (fallbacks of a damaged one); the best by val loss besides
# decentralized
topology = 'ring'  # 'complete', 'ring', 'one-peer-exp' (2^k ranks) or 'alternating-exp-ring' (2^k nodes)
replica_optimizer = 'adamw'  # 'adamw', 'accumadamw' (Adam's moments take in the mean gradient of several steps), 'sgd'
# accumadamw: steps whose mean gradient makes one update of the moments (the method's accum_iter; grow it with the
# ranks), not gradient_accumulation_steps, which splits each step's batch into micro-steps as in every entrypoint
moment_accum_steps = 4
# DiLoCo (Douillard et al., 2023): replicas step alone for a window, then an outer step moves θ_global by their
# mean θ_global - θ_local
diloco_steps = 0  # H, the window; 0: off, the topology mixes the replicas every step
outer_optimizer = 'nesterov'  # 'nesterov' (the paper's) or 'sgd' (heavy-ball momentum; none at outer_momentum=0)
outer_learning_rate = 0.7
outer_momentum = 0.9
# Streaming DiLoCo (Douillard et al., 2025): fragments of the model take their outer steps in turn, each overlapped
diloco_fragments = 1  # F: contiguous runs of blocks (the embeddings with the first), one outer step each per window
diloco_overlap = 0  # τ: inner steps that run while a fragment's all-reduce is on the wire, before its outer step lands
diloco_alpha = 0.0  # the replica's own weight when a fragment's outer step lands (the paper's 0.5 with overlap)
diloco_dtype = 'float32'  # the pseudo-gradients' dtype on the wire: 'bfloat16' halves DiLoCo's bytes
# -----------------------------------------------------------------------------
config, given = configure(globals())
check_config(config)  # every key in its range and out_dir writable, before anything is written
explain_oom(globals())  # running out of memory ends in one line that says how to fit, not a traceback

# distributed init: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE; without it, a group of one
device, device_type = pick_device(device)
if dtype == 'auto':
    dtype = 'bfloat16' if device_type == 'cuda' else 'float32'
if dtype not in ('float32', 'bfloat16'):
    sys.exit(f"error: dtype={dtype!r}: decent_train.py takes auto, float32 or bfloat16 (float16's loss scaler would "
             f"have to see every bucket's gradients before any bucket steps; use train.py for it)")
if message := check_optimizers(config, n_layer, given):
    sys.exit(f"error: {message}")
if backend == 'auto':
    backend = 'nccl' if device_type == 'cuda' else 'gloo'
rank, local_rank, world_size = start(backend, device, config=config)
master_process = rank == 0  # does all the logging and checkpoint writing
dp_rank, dp_size = rank, world_size  # every rank is a data-parallel rank with a replica of its own
local_world_size = ranks_per_node()  # None where the nodes run different counts
try:
    rounds = [] if diloco_steps else mixing_rounds(topology, world_size, local_world_size)  # DiLoCo mixes nothing
except ValueError as e:
    sys.exit(f"error: {e}")
# before the groups: a rank that exits while another is still making a group cuts that short (a traceback)
accum_steps = split_accumulation(gradient_accumulation_steps, dp_size)  # micro-steps on this rank
# the background writers of storage checkpoints agree over a group of their own: collectives of two threads on
# one group would interleave
checkpoint_group = dist.new_group(backend='gloo')
mixing_groups = make_mixing_groups(rounds, rank)  # per round: (this rank's group, its size), or None
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
# where to start: this run's newest complete state, a memory snapshot (two per rank: one may be cut short) or a
# checkpoint in out_dir: a folder of replicas, or where there is none, a ckpt.pt that every replica starts from
ckpt_path = os.path.join(out_dir, 'ckpt.pt')  # the averaged export (DiLoCo's: θ_global), or train.py's
best_path = os.path.join(out_dir, 'best.pt')  # the averaged model of the best val loss so far (the seed's best_model)
decent_dir = os.path.join(out_dir, 'decent')  # the replicas, a folder per step and a file per rank
snapshot_name = f'rank-{rank}-of-{world_size}.pt'  # a rank's own replica, which only this world size can take back
if not eval_only:  # an eval writes nothing: it neither holds out_dir nor waits for whoever does
    hold(out_dir)  # one run at a time in out_dir, for the run's lifetime
run_id, resume_from = find_resume(out_dir, init_from, auto_resume, eval_only,
                                  snapshots=[snapshot_name, previous(snapshot_name)],
                                  storage=[step_folders(decent_dir), kept(ckpt_path)],
                                  where=f"{decent_dir} or {ckpt_path}", script='decent_train.py')
snapshot_path = os.path.join(snapshot_dir(run_id), snapshot_name)
resume_path = resume_from and resume_from[1]

# -----------------------------------------------------------------------------
# model
meta_vocab_size = meta_vocab(dataset, random_data)
data_vocab = vocabulary(dataset, random_data)  # what its ids stand for, saved with the run (check_vocabulary)
model_args = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, bias=bias,
                  vocab_size=meta_vocab_size or 50304, dropout=dropout)
check_fits(model_args, device)  # a shape too big for this machine is refused before it is built
# this rank's replica from a folder of every rank's (at another world size, their average), or a whole file
model, checkpoint = create_model(resume_path, lambda path: read_replica(path, rank, world_size, print0), init_from,
                                 model_args, config, given)
block_size = model_args['block_size']  # the checkpoint's, where the run resumes or starts from one
tokens_per_iter = gradient_accumulation_steps * batch_size * block_size  # the global batch, whatever the world size
print0(f"world size {world_size}, {accum_steps} micro-step{'s' * (accum_steps > 1)} per rank, "
       f"{tokens_per_iter:,} tokens per iteration")
print0(plan_words(config, rounds, given))  # DiLoCo's window and fragments, or the topology's mixing rounds
# a resumed (or --init_from) model's depth is its checkpoint's, not the config's that the fragments were checked against
if message := check_optimizers(config, model_args['n_layer'], given):
    sys.exit(f"error: {message}")
check_token_ids(bin_path, model.config.vocab_size)
hellaswag = load_or_exit(DEFAULT_PATH, model.config.vocab_size) if hellaswag_interval else []
iter_num, best_val_loss = (checkpoint['iter_num'], float(checkpoint['best_val_loss'])) if checkpoint else (0, 1e9)
# the tokens trained so far: --epochs ends the run on them, whatever global batch each launch had
max_iters, tokens_trained, lr_batch = start_tokens(checkpoint, iter_num, tokens_per_iter, config, print0)
best_val_loss = kept_best(out_dir, run_id, best_val_loss)  # a resume from before the best keeps it best
print0(f"{model.get_num_params() / 1e6:.2f}M parameters")
model.to(device)
torch.manual_seed(seed + dp_rank)  # and then draws its own dropout masks
raw_model = model  # the bare module: its state_dict and MFU, whatever wraps it below

# buckets, the unit of update and mixing: the embeddings with the head, then each block, each one flat tensor
buckets = make_buckets(model)
bucket_of = {p: bucket for bucket in buckets for p in bucket.params}
last_micro_step = False  # set by the loop: only the last micro-step's backward updates and mixes


def update_and_mix(bucket):
    """This rank's optimizer step on the bucket, then its average with this round's group, in the background."""
    bucket.optimizer.step()
    bucket.stepped_at = iter_num
    if diloco_steps:
        if (iter_num + 1) % diloco_steps == bucket.phase:  # its fragment's window ends: its outer step follows
            start_outer_step(bucket, iter_num, diloco_overlap)
        return
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


def finish_mixing():
    for bucket in buckets:
        wait_for(bucket, iter_num, finish=True)


for p in bucket_of:
    p.register_post_accumulate_grad_hook(on_gradient)
# the next forward waits for each bucket's mixing just before the module that reads it, so the later buckets
# still travel while the earlier layers compute
model.register_forward_pre_hook(lambda module, args: wait_for(buckets[0], iter_num))
for block, bucket in zip(model.transformer.h, buckets[1:]):
    block.register_forward_pre_hook(lambda module, args, bucket=bucket: wait_for(bucket, iter_num))

# -----------------------------------------------------------------------------
# optimizer: one per bucket, each with train.py's two groups (weight decay on matrices and embeddings only)
optimizers = make_optimizers(buckets, raw_model, replica_optimizer, learning_rate, (beta1, beta2), weight_decay,
                             moment_accum_steps, device_type)
if diloco_steps:  # θ_global beside the replica, bucket by bucket; each bucket's fragment sets its outer steps' phase
    fragments = make_outer(buckets, diloco_steps, diloco_fragments, outer_optimizer, outer_learning_rate,
                           outer_momentum, diloco_alpha, diloco_dtype)
    print0(f"DiLoCo: fragments of the buckets (the embeddings, then each block) {fragments}")

# -----------------------------------------------------------------------------
# checkpoint load: the rest of the state, so that the run continues exactly where it stopped
if checkpoint is not None:
    if message := check_resumed(checkpoint, resume_path, config, ckpt_path, is_snapshot(resume_path)):
        sys.exit(f"error: {message}")
    try:
        if 'optimizers' in checkpoint:  # this script's: every bucket's own
            for optimizer, state in zip(optimizers, checkpoint['optimizers'], strict=True):
                optimizer.load_state_dict(state)
                take_settings(optimizer, config, given)
        elif replica_optimizer != 'sgd':
            # train.py's AdamW state, numbered over the whole model: each bucket's takes its parameters' moments
            adamw = raw_model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
            moments_from_adamw(adamw, upgrade_optimizer_state(raw_model, checkpoint['optimizer']), bucket_of, config,
                               given)
        # the export's optimizer (ckpt.pt) says what the replicas' do
        weight_decay, beta1, beta2 = config['weight_decay'], config['beta1'], config['beta2']
    except Exception as e:
        load_failed(resume_path, e, out_dir, eval_only)
    if diloco_steps:  # θ_global, its momentum and the outer steps in flight; own: not an average, not ckpt.pt
        own = len(checkpoint.get('rng', [])) == world_size and 'optimizers' in checkpoint
        restore_outer(buckets, checkpoint.get('diloco'), own, outer_optimizer, outer_learning_rate, outer_momentum)
    if 'data_rng' in checkpoint:  # nanoGPT's checkpoints carry no RNG: their data stream starts afresh
        data_gen.set_state(checkpoint['data_rng'])
    restore_rng(checkpoint.get('rng', []), print0)
    say_resumed(resume_path, iter_num, max_iters, eval_only, print0)
    checkpoint = None  # free the memory

if compile:
    print0("compiling the blocks... (takes a ~minute)")
    for block in model.transformer.h:
        block.forward = torch.compile(block.forward)  # the forward only: the hooks that wait for mixing stay eager
eval_model = model


def save_checkpoint(to='storage', wait=False, val_loss=None, best=False, land=False):
    """Every rank calls this (RNG states are gathered). to='storage': a checkpoint in out_dir; to='memory': a
    snapshot in the node's folder in /dev/shm. A thread copies the state to host memory while the next step's
    forward and backward run (the optimizer step waits for the copy), then writes it to temporary files, renamed
    when complete: a crash mid-write leaves the previous one in place. Each rank saves its own replica and optimizer
    state, into out_dir/decent/step-N/rank-R.pt (once every rank's is in, rank 0 points latest at the folder) or
    its snapshot; storage also writes out_dir/ckpt.pt in train.py's format: the average of the replicas and of
    their Adam moments, for sample.py and train.py. keep_checkpoints of each are kept; a new best is named by
    decent/best, and best.pt holds its average. land (DiLoCo, a run's end): ckpt.pt's θ_global takes the outer steps
    still in flight, which the step folder keeps in flight for a longer run to land on time."""
    if skips_save(to, nonfinite_steps, iter_num, print0):
        return
    finish_mixing()  # the last step's averages may still be on their way into the replica
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
    }
    checkpoint = {'model': raw_model.state_dict(), 'optimizers': [o.state_dict() for o in optimizers], **extra}
    if diloco_steps:  # θ_global and its optimizer's state, in each rank's file (ckpt.pt's model is θ_global)
        checkpoint['diloco'] = outer_state(buckets)
    if to == 'memory':
        # the one before is kept: a rank killed mid-write holds it still, and so do the others
        save_in_background(checkpoint, snapshot_path, keep=2)
    else:
        folder = os.path.join(decent_dir, f'step-{iter_num:08d}')
        # a resumed run's first eval finds it there; a new best names it (another world size's replicas: kept whole)
        if folder != resume_path or best and replicas_in(folder) == world_size:
            set_aside_incomplete(folder, run_id)  # a folder there cut short keeps its files
            save_in_background(checkpoint, os.path.join(folder, f'rank-{rank}.pt'), slot='decent',
                               then=lambda ok: commit(folder, ok, checkpoint_group, master_process,
                                                      keep=keep_checkpoints, best=best)
                               and prune_incomplete(folder, run_id))  # older saves of this run set aside cut short
            print0(f"saving checkpoint to {folder}")
        elif best and master_process:  # another world size's replicas, whose average best.pt holds: named best as is
            name_best(folder, keep_checkpoints)
        # the export: train.py's optimizer over the averaged model holds the averaged moments (sgd has none)
        wait_for_copies()  # the replica is copied before it is averaged in place
        own = global_model(buckets, land) if diloco_steps else average_replicas(buckets)[0]
        adamw = raw_model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
        average_moments(bucket_of, adamw)
        if diloco_steps:
            extra['diloco'] = {k: v for k, v in outer_state(buckets, land).items() if k != 'outer'}
        if master_process:
            save_in_background({'model': raw_model.state_dict(), 'optimizer': adamw.state_dict(), **extra}, ckpt_path,
                               keep=keep_checkpoints, best=best and best_path)
            print0(f"saving {'the global model θ_global' if diloco_steps else 'the averaged model'} to {ckpt_path}")
        wait_for_copies()  # the average has to be copied before the replica comes back
        restore_replica(buckets, own)
    if wait:
        wait_for_saves()


@torch.no_grad()
def estimate_loss():
    """Mean loss of the averaged model over eval_iters batches per split, the same batches at every eval (a fixed
    seed), so that evals compare; the batches are shared out over the ranks and the sum all-reduced. Each rank's
    own replica is put back after; the consensus distance comes along."""
    finish_mixing()
    own, consensus = average_replicas(buckets)
    if diloco_steps:  # evals see θ_global, the model of ckpt.pt: at the run's end with its last outer steps landed
        global_model(buckets, land=iter_num >= max_iters, own=own)
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
    restore_replica(buckets, own)
    return out, consensus


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
settings = {**config, 'world_size': world_size, 'local_world_size': local_world_size, 'mixing_rounds': rounds}
log_metrics = open_log(out_dir, run_id, settings, resume_from and iter_num, write=master_process, eval_only=eval_only)
if wandb_log and master_process:
    import wandb
    wandb.init(project=wandb_project, name=wandb_run_name, config=config, id=run_id, resume='allow')  # one run's curves
device_name = torch.cuda.get_device_name(device) if device_type == 'cuda' else device_type

# -----------------------------------------------------------------------------
# training loop
t0, steps_timed = time.time(), 0
local_iter_num = 0  # steps taken by this process, whatever iter_num it started from
loss_sum = torch.zeros((), device=device)
nonfinite_steps = 0  # in a row
while True:
    lr = get_lr(tokens_trained / lr_batch if lr_batch else iter_num) if decay_lr else learning_rate
    for param_group in (g for optimizer in optimizers for g in optimizer.param_groups):
        param_group['lr'] = lr

    # past max_iters too: a run resumed from a memory snapshot beyond a lowered max_iters saves it before its end
    # frees the snapshots
    if iter_num % eval_interval == 0 or iter_num >= max_iters or eval_only:
        losses, consensus = estimate_loss()
        print0(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}, "
               f"consensus distance {consensus:.3e}")
        log_metrics(iter_num, train_loss=losses['train'], val_loss=losses['val'], consensus_distance=consensus)
        if wandb_log and master_process:
            wandb.log({'iter': iter_num, 'train/loss': losses['train'], 'val/loss': losses['val'], 'lr': lr,
                       'consensus_distance': consensus})
        save, best = saves_at_eval(losses, best_val_loss, always_save_checkpoint, print0,
                                   last=iter_num >= max_iters and (save_memory_interval or is_snapshot(resume_path)))
        if save:
            best_val_loss = min(best_val_loss, losses['val'])
            if iter_num > 0 and not eval_only:  # an eval of a run writes no checkpoint
                save_checkpoint(val_loss=losses['val'], best=best, land=iter_num >= max_iters)
        t0, steps_timed = time.time(), 0  # leave evals out of the step time
    elif save_storage_interval and iter_num % save_storage_interval == 0 and local_iter_num > 0:
        save_checkpoint()
    if hellaswag_interval and (iter_num % hellaswag_interval == 0 or iter_num == max_iters):
        finish_mixing()
        own = global_model(buckets, iter_num >= max_iters) if diloco_steps else average_replicas(buckets)[0]  # evals'
        hs = evaluate(eval_model, hellaswag, device, ctx, block_size, dp_rank, dp_size)
        restore_replica(buckets, own)
        print0(f"step {iter_num}: hellaswag acc {hs['acc']:.4f}, acc_norm {hs['acc_norm']:.4f} ({hs['n']} examples)")
        log_metrics(iter_num, hellaswag_acc=hs['acc'], hellaswag_acc_norm=hs['acc_norm'])
        t0, steps_timed = time.time(), 0
    if iter_num >= max_iters or eval_only:
        # a run that ends in non-finite steps stops as max_nonfinite_steps would: a save since may hold bad weights
        ends_diverged(nonfinite_steps, losses, iter_num, out_dir, run_id, 'loss')
        break
    if save_memory_interval and iter_num % save_memory_interval == 0 and local_iter_num > 0:
        save_checkpoint('memory')

    # one step of every replica on its share of the global batch, in accum_steps micro-steps on each rank
    offsets = draw_train_offsets()
    for micro_step in range(accum_steps):
        X, Y = get_batch('train', offsets[micro_step])
        # the last micro-step's backward updates each bucket and starts its mixing as soon as its gradients are in
        last_micro_step = micro_step == accum_steps - 1
        with ctx:
            _, loss = model(X, Y)
            # gradients add up over micro-steps, so each is scaled to make the sum a mean over the rank's batch
            loss = loss / accum_steps
        loss_sum += loss.detach().float()
        if last_micro_step:
            # A non-finite loss would spoil the replicas for good, so the step is skipped, before the backward
            # whose hooks may update the buckets (so only the loss is checked, not the gradient); the ranks
            # decide alike, as about a SIGTERM
            nonfinite, stop = agree(~torch.isfinite(loss_sum))
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
    nonfinite_steps = count_skipped(nonfinite, nonfinite_steps, max_nonfinite_steps, iter_num, log_metrics, out_dir,
                                    run_id, what='loss')
    if local_iter_num == 0:  # gradients and optimizer state exist from the first step on
        mem = state_bytes(model.parameters(), optimizers)
        print0("per-rank memory: " + ", ".join(f"{k[:-6]} {v / 2**20:.2f} MiB" for k, v in mem.items()))
        log_metrics(iter_num, **mem)
    for optimizer in optimizers:
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
        log_metrics(iter_num, loss=lossf, lr=lr, ms=dt * 1000, tokens_per_sec=tokens_per_iter / dt, mfu=mfu,
                    **({'outer_bytes': outer_bytes(buckets, iter_num)} if diloco_steps else {}))
        t0, steps_timed = time.time(), 0
    loss_sum.zero_()
    iter_num += 1
    local_iter_num += 1
    tokens_trained += tokens_per_iter
    if stop:
        print0(f"{stop_signal()}: saving a checkpoint at iter {iter_num} and exiting")
        save_checkpoint(wait=True)
        break

finish_saves()  # a storage checkpoint that could not be written stops the run with an error
remove_snapshots(run_id, eval_only, nonfinite_steps)  # out_dir holds the final state: free the RAM
finish_mixing()
finish()
