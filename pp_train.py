"""
Trains a GPT with pipeline parallelism (torch.distributed.pipelining), tensor parallelism inside each stage, and
data parallelism (or FSDP) across pipelines.

4 stages, 4 GPUs: torchrun --standalone --nproc_per_node=4 pp_train.py config/train_gpt2.py --pp_size=4
PP x DP, 2 nodes: torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HEAD:29500 \
                      pp_train.py config/train_gpt2.py --pp_size=4 --pp_schedule=interleaved-1f1b
Zero bubble:      torchrun --standalone --nproc_per_node=4 pp_train.py config/train_gpt2.py --pp_size=4 \
                      --pp_schedule=interleaved-zb --compile=False
PP x FSDP:        torchrun --standalone --nproc_per_node=8 pp_train.py config/train_gpt2.py --pp_size=4 --dp_shard=True
ZBV x FSDP:       torchrun --standalone --nproc_per_node=8 pp_train.py ... --pp_size=4 --pp_schedule=zbv \
                      --dp_shard=True --compile=False  (the tied embedding's shards in the first rank's first stage)
DP x PP x TP:     torchrun --standalone --nproc_per_node=8 pp_train.py config/train_gpt2.py --pp_size=2 --tp_size=2
FSDP x PP x TP:   torchrun --standalone --nproc_per_node=8 pp_train.py ... --pp_size=2 --tp_size=2 --dp_shard=True

The global batch in tokens, the data stream and the logged loss do not depend on the world size, and a run
resumed from its checkpoint repeats the uninterrupted run exactly (RNG and data position are saved with it).
Checkpoints are DCP folders under the model's own names: they resume at another (dp, pp, tp) layout and in
fsdp_train.py, and fsdp_train.py's here (docs/pipeline.md).
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage

from checkpoint import (create_model, find_resume, finish_saves, is_snapshot, kept, kept_best, load_failed, previous,
                        remove_snapshots, save_in_background, say_resumed, snapshot_dir, step_folders, take_settings,
                        wait_for_copies, wait_for_saves, where_saved)
from data import check_token_ids, find_bins, meta_vocab, read_rows, vocabulary
from distributed import (agree, check_fits, finish, gather_rng, groups_of, on_every_rank, pick_device, restore_rng,
                         skip_on_device, split_accumulation, start, state_bytes, stop_signal, torchrun_env,
                         use_deterministic_algorithms)
from hellaswag import DEFAULT_PATH, evaluate, load_or_exit
from keep import saves_at_eval, skips_save
from oom import explain_oom
from pipeline import (SCHEDULES, ZERO_BUBBLE, Forward, Part, check_snapshot_layout, clip, embedding_group, loss_fn,
                      make_schedule, placement, save_full, shard_stages, sharded_state, sharding_refused, stage_blocks,
                      stage_ids, stage_rank, stages_refused, tied_grads_and_norm, untaken)
from runlock import hold
from runlog import ends_diverged, heed, open_log
from seeds import start_tokens
from sharded import (check_tp_size, load_sharded_state, local_shards, read_start, save_dcp, step_on_shards,
                     step_with_whole_tensors, tensor_parallel)

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
dtype = 'auto'  # 'auto' (bfloat16 on GPUs, float32 on CPU), 'bfloat16' or 'float32'
compile = True  # torch.compile the model
seed = 1337
deterministic = False  # deterministic algorithms and dropout off, so that reruns give identical curves, on GPUs too
# fault tolerance
auto_resume = True  # on every start, continue from the newest complete snapshot or checkpoint of out_dir, if any
save_memory_interval = 0  # steps between snapshots of the whole state into node-local memory (/dev/shm); 0: none
save_storage_interval = 0  # steps between checkpoints to out_dir (in the background), besides the evals'; 0: none
max_nonfinite_steps = 5  # a step whose loss or gradient is not finite is skipped; this many in a row stop the run
keep_checkpoints = 2  # the newest states kept in out_dir (fallbacks of a damaged one); the best by val loss besides
# parallelism
pp_size = 1  # ranks per pipeline, one stage each (consecutive ranks); the world size / pp_size pipelines are DP
tp_size = 1  # tensor-parallel ranks in each stage (consecutive ranks, within a node); a pipeline is pp_size x tp_size
pp_schedule = '1f1b'  # 'gpipe' (all forwards, then all backwards), '1f1b', 'interleaved-1f1b' (looped stages),
# 'interleaved-zb' (looped, each backward split: the weights' gradients fill the bubble), 'zbv' (zero bubble on two
# stages a rank in a V, the first rank holding both ends) or 'dualpipev' (DeepSeek's, in zbv's V); the zero-bubble
# ones without torch.compile
stages_per_rank = 2  # the interleaved schedules' stages on each rank (the others take one)
dp_shard = False  # FSDP across the pipelines: each stage's parameters, gradients and AdamW state sharded over dp
adamw_on_shards = False  # with dp_shard, AdamW's step on each rank's own pieces, past DTensor's dispatch (a lever)
save_consolidated = False  # with each checkpoint also write out_dir/ckpt.pt in train.py's format (gathered on rank 0)
# -----------------------------------------------------------------------------
config, given = configure(globals())
check_config(config)  # every key in its range and out_dir writable, before anything is written
explain_oom(globals())  # running out of memory ends in one line that says how to fit, not a traceback

# distributed init: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE; without it, a group of one
device, device_type = pick_device(device)
if dtype == 'auto':
    dtype = 'bfloat16' if device_type == 'cuda' else 'float32'
if dtype not in ('float32', 'bfloat16'):
    sys.exit(f"error: dtype={dtype!r}: pp_train.py takes auto, float32 or bfloat16 (for float16 use train.py)")
if pp_schedule not in SCHEDULES:
    sys.exit(f"error: pp_schedule={pp_schedule!r} is not one of {', '.join(SCHEDULES)}")
if pp_schedule in ZERO_BUBBLE and compile:  # a compiled block's backward is one autograd node: it cannot split
    sys.exit(f"error: {pp_schedule} computes a stage's input gradients and its weights' apart, which torch.compile'd "
             f"blocks cannot: add --compile=False, or use --pp_schedule=interleaved-1f1b")
v, v_shape = placement(pp_schedule, stages_per_rank)  # the stages each rank holds, and whether in a V
if message := stages_refused(pp_schedule, stages_per_rank, given) or sharding_refused(dp_shard, adamw_on_shards):
    sys.exit(f"error: {message}")
if backend == 'auto':
    backend = 'nccl' if device_type == 'cuda' else 'gloo'
# the layout is checked before any rank joins the group, from what torchrun set: every rank refuses it alike
world_size = torchrun_env()[2]
if pp_size < 1 or world_size % pp_size != 0:
    sys.exit(f"error: {groups_of('pp_size', pp_size, world_size)}")
if tp_size < 1 or world_size // pp_size % tp_size != 0:  # a stage's ranks: tp groups of each pipeline, of each dp
    sys.exit(f"error: {groups_of('tp_size', tp_size, world_size // pp_size, 'world size / pp_size =')}")
dp_size = world_size // (pp_size * tp_size)
# the micro-batches of the pipeline's schedule are this rank's micro-steps: the same data as train.py's
accum_steps = split_accumulation(gradient_accumulation_steps, dp_size)
if message := untaken(pp_schedule, accum_steps, pp_size, dp_size):
    sys.exit(f"error: {message}")
rank, local_rank, world_size = start(backend, device, config=config)
master_process = rank == 0  # does all the logging and checkpoint writing
# the mesh is (dp, pp, tp), tp innermost: a tp group is tp_size consecutive ranks (a node's GPUs: TP's all-reduces
# need its links), a pipeline pp_size x tp_size (only activations cross stages, to the same tp rank), reading one batch
dp_rank, pp_rank = rank // (pp_size * tp_size), rank // tp_size % pp_size
mesh = init_device_mesh(device_type, (dp_size, pp_size, tp_size), mesh_dim_names=('dp', 'pp', 'tp'))
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
# where to start: this run's newest complete state, a memory snapshot (two per rank) or a checkpoint in out_dir
ckpt_path = os.path.join(out_dir, 'ckpt.pt')
dcp_dir = os.path.join(out_dir, 'dcp')
# a rank's own stages (or their shards), which only this layout reads back
snapshot_name = f"rank-{rank}-of-{dp_size}x{pp_size}{f'x{tp_size}' * (tp_size > 1)}pp.pt"
best_path = os.path.join(out_dir, 'best.pt')  # the consolidated state of the best val loss so far, never pruned
if not eval_only:  # an eval writes nothing: it neither holds out_dir nor waits for whoever does
    hold(out_dir)  # one run at a time in out_dir, for the run's lifetime
run_id, resume_from = find_resume(out_dir, init_from, auto_resume, eval_only,
                                  snapshots=[snapshot_name, previous(snapshot_name)],
                                  storage=[step_folders(dcp_dir) + kept(ckpt_path)],
                                  where=f"{dcp_dir} or {ckpt_path}", script='pp_train.py')
snapshot_path = os.path.join(snapshot_dir(run_id), snapshot_name)
resume_path = resume_from and resume_from[1]

# -----------------------------------------------------------------------------
# model
meta_vocab_size = meta_vocab(dataset, random_data)
data_vocab = vocabulary(dataset, random_data)  # what its ids stand for, saved with the run (check_vocabulary)
model_args = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, bias=bias,
                  vocab_size=meta_vocab_size or 50304, dropout=dropout)
check_fits(model_args, device)  # a shape too big for this machine is refused before it is built
# a checkpoint is data, never code
model, checkpoint = create_model(resume_path, read_start, init_from, model_args, config, given)
block_size = model_args['block_size']  # the checkpoint's, where the run resumes or starts from one
tokens_per_iter = gradient_accumulation_steps * batch_size * block_size  # the global batch, whatever the world size
print0(f"world size {world_size} (dp {dp_size} x pp {pp_size} x tp {tp_size}, {pp_schedule}"
       f"{', stages sharded over dp' * dp_shard}), "
       f"{accum_steps} micro-batch{'es' * (accum_steps > 1)} per pipeline, {tokens_per_iter:,} tokens per iteration")
check_token_ids(bin_path, model.config.vocab_size)
hellaswag = load_or_exit(DEFAULT_PATH, model.config.vocab_size) if hellaswag_interval else []
iter_num, best_val_loss = (checkpoint['iter_num'], float(checkpoint['best_val_loss'])) if checkpoint else (0, 1e9)
# the tokens trained so far: --epochs ends the run on them, whatever global batch each launch had
max_iters, tokens_trained, lr_batch = start_tokens(checkpoint, iter_num, tokens_per_iter, config, print0)
best_val_loss = kept_best(out_dir, run_id, best_val_loss)  # a resume from before the best keeps it best
check_tp_size(model.config, tp_size)
print0(f"{model.get_num_params() / 1e6:.2f}M parameters")
torch.manual_seed(seed + rank // tp_size)  # its own dropout masks, a tp group's shared stream (sharded.py)
raw_model = model  # the whole GPT: its config, names and MFU (the other ranks' stages left on the meta device)
# the model cut by blocks into pp_size stages (stages_per_rank each when interleaved, placed in a loop; two in a V
# with zbv), each under the GPT's own names; model is this rank's stages together: its state, optimizer, gradients
n_stages = pp_size * v
ids = stage_ids(pp_rank, pp_size, v, v_shape)
blocks = {s: stage_blocks(s, n_stages, raw_model.config.n_layer) for s in ids}
stages = [Part(raw_model, blocks[s], s == 0, s == n_stages - 1) for s in ids]
model = Part(raw_model, sum(blocks.values(), []), 0 in ids, n_stages - 1 in ids)
t = raw_model.transformer
for module in [t.h[i] for i in range(len(t.h)) if str(i) not in model.transformer.h] + [t.wpe] * (0 not in ids) + \
        [t.ln_f] * (n_stages - 1 not in ids) + [t.wte] * (0 not in ids and n_stages - 1 not in ids):
    module.to('meta')  # free what other ranks hold
raw_model.lm_head.weight = t.wte.weight  # tied again (to('meta') makes new parameters): the GPT's names stay its own
model.to(device)
for block in model.transformer.h.values():
    if tp_size > 1:  # tensor parallel first (torchtitan's order): heads and MLP units split over the tp group
        tensor_parallel(block, mesh['tp'])
    if compile:
        block.compile()  # in place, so parameter names (and checkpoints) stay the same
if dp_shard:  # FSDP across the pipelines: each block a unit, each stage a root
    shard_stages(stages, raw_model, mesh['dp'], ptdtype)  # bf16: gathered in bf16, reduced in fp32 (fsdp_train.py's)
tied = model.transformer['wte'].weight if 'wte' in model.transformer else None  # one in effect
tie_group = embedding_group(mesh, v_shape)  # this rank's and its peer's at the other end, sharing the tied weight
pp_group = mesh['pp'].get_group()
pipeline = [PipelineStage(stage, s, n_stages, device, group=pp_group) for stage, s in zip(stages, ids)]
# gradients summed over the micro-batches, then divided by their number (tied_grads_and_norm): train.py's mean
schedule = make_schedule(pp_schedule, pipeline, accum_steps, loss_fn, scale_grads=False)

# -----------------------------------------------------------------------------
# optimizer, over this rank's stages
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
if tp_size > 1:  # the blocks' matrices are DTensors, the rest plain tensors (unless sharded)
    step_with_whole_tensors(optimizer)

# -----------------------------------------------------------------------------
# checkpoint load: the rest of the state, so that the run continues exactly where it stopped
if checkpoint is not None:
    if is_snapshot(resume_path):  # a snapshot holds only its rank's own stages (or their shards)
        check_snapshot_layout(checkpoint, resume_path, (v, v_shape), dp_shard, eval_only, out_dir)
    try:
        load_sharded_state(model, optimizer, checkpoint, resume_path, raw_model)
        take_settings(optimizer, config, given)
    except Exception as e:
        load_failed(resume_path, e, out_dir, eval_only)
    if 'data_rng' in checkpoint:  # nanoGPT's checkpoints carry no RNG: their data stream starts afresh
        data_gen.set_state(checkpoint['data_rng'])
    restore_rng(checkpoint.get('rng', []), print0, mesh['tp'].get_group())
    say_resumed(resume_path, iter_num, max_iters, eval_only, print0)
    checkpoint = None  # free the memory

# evaluation runs the stages one after the other, through the pipeline's ranks
eval_model = Forward(stages, ids, [mesh['pp'].mesh.tolist()[stage_rank(s, pp_size, v_shape)] for s in range(n_stages)],
                     pp_group, device)


def save_checkpoint(to='storage', wait=False, val_loss=None, best=False):
    """Every rank calls this (RNG states are gathered). to='storage': a checkpoint in out_dir; to='memory': a
    snapshot in the node's folder in /dev/shm. A thread copies the state to host memory while the next step's
    forward and backward run (the optimizer step waits for the copy), then writes it to temporary files, renamed
    when complete: a crash mid-write leaves the previous one in place. Each rank saves its stages' state, into a DCP
    folder out_dir/dcp/step-N or its own snapshot; with save_consolidated, rank 0 also writes train.py's ckpt.pt.
    keep_checkpoints of each are kept, and a new best is named by dcp/best (and best.pt)."""
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
    }
    checkpoint = sharded_state(model, optimizer, raw_model)
    if to == 'memory':
        # the one before is kept: a rank killed mid-write holds it still, and so do the others
        save_in_background({'shards': local_shards(checkpoint), **extra}, snapshot_path, keep=2)
    else:
        save_dcp(checkpoint, extra, os.path.join(dcp_dir, f'step-{iter_num:08d}'), resume_path, keep_checkpoints, best)
        if save_consolidated:  # and train.py's whole checkpoint, gathered in rank 0's CPU memory
            save_full(model, optimizer, raw_model, extra, ckpt_path, keep_checkpoints, best and best_path)
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
        out[split] = total.item() / eval_iters / pp_size / tp_size  # a pipeline's ranks all add the same losses
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
nonfinite_steps = 0  # in a row
while True:
    # the step before's verdict (agree), read only now: a non-finite step is counted, a SIGTERM or Ctrl-C stops here
    nonfinite_steps, stop = heed(nonfinite_steps, max_nonfinite_steps, log_metrics, out_dir, run_id)
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
        hs = evaluate(eval_model, hellaswag, device, ctx, block_size, dp_rank, dp_size, pipeline=True)
        print0(f"step {iter_num}: hellaswag acc {hs['acc']:.4f}, acc_norm {hs['acc_norm']:.4f} ({hs['n']} examples)")
        log_metrics(iter_num, hellaswag_acc=hs['acc'], hellaswag_acc_norm=hs['acc_norm'])
        t0, steps_timed = time.time(), 0
    if iter_num >= max_iters or eval_only:
        # a run that ends in non-finite steps stops as max_nonfinite_steps would: a save since may hold bad weights
        ends_diverged(nonfinite_steps, losses, iter_num, out_dir, run_id)
        break
    if save_memory_interval and iter_num % save_memory_interval == 0 and local_iter_num > 0:
        save_checkpoint('memory')

    # one optimizer step over the whole global batch: the schedule runs the pipeline's accum_steps micro-batches
    offsets = draw_train_offsets()
    X, Y = get_batch('train', offsets.flatten())  # split by the schedule into the micro-steps' batches again
    micro_losses = []  # the last stage's, one per micro-batch
    with ctx:
        schedule.step(*([X] if 0 in ids else []), **(dict(target=Y, losses=micro_losses) if n_stages - 1 in ids
                                                      else {}))
    loss_sum += sum(loss.detach().float() for loss in micro_losses) / accum_steps  # only the last stage's ranks add
    grad_norm = tied_grads_and_norm(list(model.parameters()), tied, 0 in ids, accum_steps, mesh, dp_shard, tie_group)
    if grad_clip != 0.0:
        clip(model.parameters(), grad_norm, grad_clip)
    # A non-finite loss or gradient would spoil the weights for good, so the step is skipped; the ranks decide alike,
    # as about SIGTERM, on the device, where the fused AdamW skips by the verdict (found_inf) with no wait for it (a
    # non-finite loss shows on the last stage's ranks only: the agreement carries it)
    nonfinite = agree(~torch.isfinite(loss_sum + grad_norm), iter_num)
    skip_on_device(optimizer, nonfinite)
    wait_for_copies()  # a snapshot taken before this step may still be copying the weights it is about to change
    step_on_shards(optimizer) if adamw_on_shards else optimizer.step()  # off until a GPU run shows it pays
    if local_iter_num == 0:  # gradients and optimizer state exist from the first step on
        mem = state_bytes(model.parameters(), [optimizer])
        print0("per-rank memory: " + ", ".join(f"{k[:-6]} {v / 2**20:.2f} MiB" for k, v in mem.items()))
        ranks = [None] * world_size  # the stages differ (the end ones hold the embeddings and the head): all ranks'
        dist.all_gather_object(ranks, sum(mem.values()))
        print0("state by rank (params, grads, optim): " + ", ".join(f"{v / 2**20:.2f}" for v in ranks), "MiB")
        log_metrics(iter_num, **mem, rank_state_bytes=ranks)
    optimizer.zero_grad(set_to_none=True)
    steps_timed += 1

    if iter_num % log_interval == 0 or local_iter_num == 0:  # a launch's first step (compiling) timed alone
        # the loss of the whole global batch: the mean over pipelines of each last stage's mean over its micro-batches
        dist.all_reduce(loss_sum)  # (a last stage's tp ranks add the same)
        lossf = loss_sum.item() / dp_size / tp_size  # .item() waits for the GPU, so the time below is real
        dt = (time.time() - t0) / steps_timed
        mfu = raw_model.estimate_mfu(batch_size * accum_steps / pp_size / tp_size, dt, device_name, dtype)  # shared
        print0(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f} ms, {tokens_per_iter / dt:,.0f} tok/s"
               + (f", mfu {mfu * 100:.2f}%" if mfu is not None else ""))
        log_metrics(iter_num, loss=lossf, lr=lr, ms=dt * 1000, tokens_per_sec=tokens_per_iter / dt, mfu=mfu)
        t0, steps_timed = time.time(), 0
    loss_sum.zero_()
    iter_num += 1
    local_iter_num += 1
    tokens_trained += tokens_per_iter

finish_saves()  # a storage checkpoint that could not be written stops the run with an error
remove_snapshots(run_id, eval_only, nonfinite_steps)  # out_dir holds the final state: free the RAM
finish()
