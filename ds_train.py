"""
Trains a GPT with DeepSpeed's ZeRO: optimizer state (stage 1), gradients too (2) and parameters too (3) sharded
over the data-parallel ranks, optionally offloaded to CPU memory (ZeRO-Offload) or NVMe (ZeRO-Infinity).

torchrun, 8 GPUs:   torchrun --standalone --nproc_per_node=8 ds_train.py config/train_gpt2.py --zero_stage=2
deepspeed, 8 GPUs:  deepspeed --num_gpus 8 ds_train.py config/train_gpt2.py --zero_stage=3 --offload_optimizer=cpu
Two nodes:          torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HEAD:29500 \
                        ds_train.py config/train_gpt2.py --batch_size=8 --gradient_accumulation_steps=64

Everything but the distribution is train.py's: config keys, data stream, logging, eval and exact resume. The
DeepSpeed config is generated from train.py's keys, so that one config trains on the same global batch in tokens
here and there; a ds_config JSON file may add to it, not contradict it. Checkpoints are the engine's folders
(out_dir/ds/step-N/, resumed at the same world size and stage), and save_consolidated writes beside each one
train.py's ckpt.pt, which sample.py, train.py and the other entrypoints read, and from which this script resumes
at another world size or stage (an elastic restart with fewer or more nodes).
"""

import math
import os
import shutil
import sys
import time
import warnings
from contextlib import nullcontext

from configurator import check_config, configure, quiet_interrupt
quiet_interrupt()  # before torch's ~3 s import: a Ctrl-C there ends with one line, not a traceback
import torch
import torch.distributed as dist

from checkpoint import (commit, create_model, find_resume, finish_saves, is_snapshot, kept, kept_best, load_failed,
                        mark_run, reason, remove_snapshots, same_step, save_in_background, say_resumed, snapshot_dir,
                        take_settings, upgrade_optimizer_state, wait_for_copies, wait_for_saves, weights_of,
                        where_saved)
from data import check_token_ids, find_bins, meta_vocab, read_rows, vocabulary
from distributed import (agree, check_fits, finish, gather_rng, on_every_rank, pick_device, restore_rng,
                         split_accumulation, start, stop_signal, use_deterministic_algorithms)
from model import GPT
from hellaswag import DEFAULT_PATH, evaluate, load_or_exit
from keep import keeping, saves_at_eval, skips_save, unsaved
from oom import explain_oom
from runlock import hold
from runlog import diverged_fix, ends_diverged, open_log
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
device = 'auto'  # 'auto' (cuda:LOCAL_RANK if there is a GPU, else cpu), 'cpu', 'cuda', 'cuda:1'
backend = 'auto'  # 'auto' (nccl on CUDA, gloo otherwise), 'nccl' or 'gloo'
dtype = 'auto'  # 'auto' (bfloat16 on GPUs that have it, else float16 on CUDA, float32 on CPU), or one of those
compile = True  # torch.compile the model
seed = 1337
deterministic = False  # deterministic algorithms and dropout off, so that reruns give identical curves, on GPUs too
# fault tolerance
auto_resume = True  # on every start, continue from the newest complete snapshot or checkpoint of out_dir, if any
save_memory_interval = 0  # steps between snapshots of the whole state into node-local memory (/dev/shm); 0: none
save_storage_interval = 0  # steps between checkpoints to out_dir, besides the evals'; 0: none
max_nonfinite_steps = 5  # a step whose loss or gradient is not finite is skipped; this many in a row stop the run
keep_checkpoints = 2  # the newest states kept in out_dir (fallbacks of a damaged one); the best by val loss besides
# DeepSpeed
zero_stage = 2  # 0: data parallel; 1: optimizer state sharded; 2: and gradients; 3: and parameters
offload_optimizer = 'none'  # 'none', 'cpu' (optimizer state and step in CPU memory) or an NVMe folder (stage 3)
offload_params = 'none'  # 'none', 'cpu' or an NVMe folder: parameters between uses (stage 3)
ds_config = ''  # a DeepSpeed config JSON file whose entries are added to the generated config (never contradict it)
overflow_by_norm = True  # ZeRO 1-2 in bf16/fp16 without offload: a non-finite gradient found by the global norm alone
save_consolidated = True  # with each checkpoint also write out_dir/ckpt.pt in train.py's format (gathered on rank 0)
# -----------------------------------------------------------------------------
config, given = configure(globals())
check_config(config)  # every key in its range and out_dir writable, before anything is written
explain_oom(globals())  # running out of memory ends in one line that says how to fit, not a traceback

# DeepSpeed, imported after the config: the manifest tests read the config without it
try:
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from ds_state import (ZERO3_COMPILED, DeferredWrites, add_config_file, best_behind, bucket_sizes, check_offload,
                          by_norm_where_zero_checks, checkpoint_iter_at, copy_recovery_scripts, count_step,
                          engine_folders, engine_state, folder_iter, gather_state, guard_step, load_state,
                          norm_is_read, offload, overflow_by_norm_alone, read_engine_state, refuse_other_layouts,
                          remove_shm_buffer_name, state_bytes, step_or_stop, whole_at)
except ImportError as e:
    sys.exit(f"error: ds_train.py needs DeepSpeed ({e}): pip install deepspeed==0.19.8")
# DeepSpeed 0.19.8 calls collectives that torch 2.13 deprecates, and torch says so at each call
warnings.filterwarnings('ignore', message=r'`torch\.distributed\.\w+` is deprecated', category=FutureWarning)

# distributed init: torchrun and the deepspeed launcher set RANK, LOCAL_RANK and WORLD_SIZE; without, a group of one
device, device_type = pick_device(device)
if device_type != get_accelerator().device_name():  # DeepSpeed puts the model on the accelerator it chose on import
    sys.exit(f"error: device={device}, but DeepSpeed chose its {get_accelerator().device_name()} accelerator: set "
             f"DS_ACCELERATOR={device_type} in the environment (cuda or cpu)")
if dtype == 'auto':
    # real bf16 only: emulated bf16 on older GPUs (V100, T4) is slower than fp16 with a loss scaler
    dtype = ('bfloat16' if torch.cuda.is_bf16_supported(including_emulation=False) else 'float16') \
        if device_type == 'cuda' else 'float32'
if dtype not in ('float32', 'bfloat16', 'float16'):
    sys.exit(f"error: dtype={dtype!r} is not one of auto, float32, bfloat16, float16")
if dtype == 'float16' and not get_accelerator().is_fp16_supported():
    sys.exit(f"error: dtype=float16: DeepSpeed's {get_accelerator().device_name()} accelerator has no float16 "
             f"here; use bfloat16 or float32")
if zero_stage not in (0, 1, 2, 3):
    sys.exit(f"error: zero_stage={zero_stage} is not one of 0 (data parallel), 1 (optimizer state sharded), "
             f"2 (and gradients), 3 (and parameters)")
check_offload(offload_optimizer, offload_params, zero_stage)
# a non-finite gradient found by the global norm alone, where ZeRO would check each gradient first (1.32x an H100 step)
by_norm = by_norm_where_zero_checks(overflow_by_norm, 'overflow_by_norm' in given, zero_stage, dtype, offload_optimizer)
if backend == 'auto':
    backend = 'nccl' if device_type == 'cuda' else 'gloo'
rank, local_rank, world_size = start(backend, device, deepspeed=True, config=config)
try:
    deepspeed.init_distributed(dist_backend=backend)  # takes the group start() made, or makes it under its launcher
except OSError as e:  # on a CPU it compiles its collectives first, into ~/.cache unless told otherwise
    sys.exit(f"error: DeepSpeed could not build its CPU collectives ({reason(e)}): set TORCH_EXTENSIONS_DIR to a "
             f"folder this user can write in (its default, ~/.cache/torch_extensions, is not)")
master_process = rank == 0  # does all the logging and checkpoint writing
dp_rank, dp_size = rank, world_size  # every rank is a data-parallel rank: ZeRO shards over all of them
if device_type == 'cpu':
    remove_shm_buffer_name(rank)
# before the groups: a rank that exits while another is still making a group cuts that short (a traceback)
accum_steps = split_accumulation(gradient_accumulation_steps, dp_size)  # micro-steps on this rank
# the threads that write checkpoints agree in collectives of their own that they are complete, one group a kind
# (memory, storage) so that two threads' collectives never meet
checkpoint_groups = {to: dist.new_group(backend='gloo') for to in ('memory', 'storage')}
torch.manual_seed(seed)  # every rank builds the same initial model
if device_type == 'cuda':
    torch.set_float32_matmul_precision('high')  # TF32 matmuls (the API that inductor's max-autotune reads)
ctx = nullcontext()  # no autocast: DeepSpeed's bf16 and fp16 modes cast the model, with fp32 master weights


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
# where to start: this run's newest complete state, an engine checkpoint in the node's memory or in out_dir (at the
# world size and stage that wrote it, which ZeRO's shards need), else the consolidated ckpt.pt (at any)
ckpt_path = os.path.join(out_dir, 'ckpt.pt')  # the consolidated export (or train.py's): resumes at any layout
best_path = os.path.join(out_dir, 'best.pt')  # the consolidated state of the best val loss so far, never pruned
ds_dir = os.path.join(out_dir, 'ds')  # the engine's checkpoints, a folder per step
foreign = []  # engine checkpoints in ds_dir or memory of another layout: (path, world size, their layout)
layout = dict(world_size=world_size, zero_stage=zero_stage, offload_optimizer=offload_optimizer,
              offload_params=offload_params, dtype=dtype)
engine_iter = lambda path, run_id=None: checkpoint_iter_at(path, run_id, layout, foreign, ds_dir, rank)
if not eval_only:  # an eval writes nothing: it neither holds out_dir nor waits for whoever does
    hold(out_dir)  # one run at a time in out_dir, for the run's lifetime


run_id, resume_from = find_resume(out_dir, init_from, auto_resume, eval_only, snapshots=engine_folders,
                                  storage=[engine_folders(ds_dir) + kept(ckpt_path)],
                                  where=f"{os.path.join(ds_dir, 'latest')} or {ckpt_path}", iter_of=engine_iter,
                                  script='ds_train.py', state_of=engine_state,
                                  check=lambda found: refuse_other_layouts(found, foreign, layout, ckpt_path,
                                                                           eval_only, print0))
resume_path = resume_from and resume_from[1]

# -----------------------------------------------------------------------------
# model
meta_vocab_size = meta_vocab(dataset, random_data)
data_vocab = vocabulary(dataset, random_data)  # what its ids stand for, saved with the run (check_vocabulary)
model_args = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, bias=bias,
                  vocab_size=meta_vocab_size or 50304, dropout=dropout)
check_fits(model_args, device)  # a shape too big for this machine is refused before it is built


model, checkpoint = create_model(resume_path, read_engine_state, init_from, model_args, config, given)
if checkpoint is not None and 'model' in checkpoint:
    try:  # checked against the parameters' shapes now: at stage 3 the engine leaves them empty
        checkpoint['model'] = GPT.upgrade_state_dict(checkpoint['model'])
        checkpoint['optimizer'] = upgrade_optimizer_state(model, checkpoint['optimizer']) \
            if checkpoint.get('optimizer') else {'state': {}}
    except Exception as e:
        load_failed(resume_path, e, out_dir, eval_only)
block_size = model_args['block_size']  # the checkpoint's, where the run resumes or starts from one
tokens_per_iter = gradient_accumulation_steps * batch_size * block_size  # the global batch, whatever the world size
print0(f"world size {world_size}, {accum_steps} micro-step{'s' * (accum_steps > 1)} per rank, "
       f"{tokens_per_iter:,} tokens per iteration")
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
# optimizer (train.py's AdamW and weight-decay groups), and the engine that shards it
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
adamw_groups = [{k: v for k, v in g.items() if k != 'params'} for g in optimizer.param_groups]  # for the export
group_names = raw_model.param_groups()  # read now: at stage 3 the engine leaves each parameter an empty shape
if offload_optimizer != 'none':
    # the offloaded step runs on the CPU, in DeepSpeed's vectorized Adam (a C++ op it builds on first use)
    groups = [{'params': g['params'], 'weight_decay': g['weight_decay']} for g in optimizer.param_groups]
    optimizer = DeepSpeedCPUAdam(groups, lr=learning_rate, betas=(beta1, beta2), adamw_mode=True)


# The DeepSpeed config, from train.py's keys: the same global batch (batch_size x gradient_accumulation_steps
# sequences, over all ranks), clipping and precision. The LR schedule stays ours (get_lr sets it each step).
ds_cfg = {
    'train_batch_size': batch_size * gradient_accumulation_steps,
    'train_micro_batch_size_per_gpu': batch_size,
    'gradient_accumulation_steps': accum_steps,
    'gradient_clipping': grad_clip,
    'bf16': {'enabled': dtype == 'bfloat16', 'check_grad_overflow': True},  # a ds_config may not take it away
    'fp16': {'enabled': dtype == 'float16'},
    'zero_optimization': {'stage': zero_stage,
                          **offload('offload_optimizer', offload_optimizer, device_type),
                          **offload('offload_param', offload_params, device_type),
                          **(ZERO3_COMPILED if zero_stage == 3 and compile else {})},
}
if ds_config:  # a user's settings, added where they contradict none of ours
    add_config_file(ds_cfg, ds_config)
bucket_sizes(ds_cfg['zero_optimization'], sum(p.numel() for p in model.parameters()))  # the model's, not 5e8
by_norm = by_norm and norm_is_read(ds_cfg, 'overflow_by_norm' in given, ds_config)  # ds_config may turn it off
try:
    model, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_cfg)
except ValueError as e:  # pydantic's errors about ds_config's settings among them: the class, the field, the reason
    why = '; '.join(line.strip() for line in str(e).splitlines()[:3])[:300]
    sys.exit(f"error: DeepSpeed rejects the config ({why}){f': check {ds_config}' if ds_config else ''}")
if zero_stage == 0 and dtype == 'float32':
    guard_step(model.optimizer)  # DeepSpeed steps our AdamW unchecked here: a non-finite step is skipped as ZeRO's are
if by_norm:
    overflow_by_norm_alone(model.optimizer)
    print0("a non-finite gradient is found by the global norm alone")
model.checkpoint_engine = DeferredWrites()  # its saves are ours to write in the background
model._copy_recovery_script = copy_recovery_scripts  # once, whole or not at all, beside storage only

# -----------------------------------------------------------------------------
# checkpoint load: the rest of the state, so that the run continues exactly where it stopped
if checkpoint is not None:
    try:
        if os.path.isdir(resume_path):  # each rank's shards of the weights and the optimizer state
            loaded, _ = model.load_checkpoint(os.path.dirname(resume_path), tag=os.path.basename(resume_path))
            assert loaded is not None, "DeepSpeed found no checkpoint there"
        else:  # a fp16 run's loss scale is not in it: the engine's starts afresh
            load_state(model, raw_model, optimizer, group_names, checkpoint['model'], checkpoint['optimizer'], device)
    except Exception as e:
        load_failed(resume_path, e, out_dir, eval_only)
    take_settings(optimizer, config, given, saved=checkpoint.get('config'))  # the engine's load put its own back
    if 'data_rng' in checkpoint:  # nanoGPT's checkpoints carry no RNG: their data stream starts afresh
        data_gen.set_state(checkpoint['data_rng'])
    restore_rng(checkpoint.get('rng', []), print0)
    say_resumed(resume_path, iter_num, max_iters, eval_only, print0)
    checkpoint = None  # free the memory

if compile:
    print0("compiling the model... (takes a ~minute)")
    if zero_stage == 3:  # each Block's forward, left whole by ZeRO3_COMPILED: one graph, the same for every block
        for block in raw_model.transformer.h:
            block.forward = torch.compile(block.forward)
    else:
        model.compile()  # the engine compiles its module in place
eval_model = model  # at stage 3 every rank takes part in each forward, evaluation's too


def save_checkpoint(to='storage', wait=False, val_loss=None, best=False):
    """Every rank calls this (RNG states are gathered). to='storage': a checkpoint in out_dir; to='memory': a
    snapshot in the node's folder in /dev/shm. A thread copies the state to host memory while the next step's
    forward and backward run (the optimizer step waits for the copy), then writes it to temporary files, renamed
    when complete: a crash mid-write leaves the previous one in place. The engine hands over each rank's files (its
    shards, and our state as its client state) for out_dir/ds/step-N/ or the node's snapshot folder; once every
    rank's are written, the first rank (of each node, for snapshots) points latest at the folder (a new best: best
    too). With save_consolidated, storage also writes train.py's ckpt.pt (a new best also as best.pt)."""
    if skips_save(to, nonfinite_steps, iter_num, print0):
        return
    folder = os.path.join(ds_dir if to == 'storage' else snapshot_dir(run_id), f'step-{iter_num:08d}')
    wait_for_saves(f'ds-{to}')  # the save before of this kind is complete and latest names it
    # a resumed run's first eval (or a save to a step whose folder is whole): the folder stays as it is, a new best
    # writes our state beside the engine's alone (its val loss; another layout's folder is named best as it is), the
    # export where it lacks one or the best (best.pt of the step ds/best names: save_consolidated=False since)
    export = to == 'storage' and save_consolidated
    whole = to == 'storage' and (folder == resume_path or whole_at(folder, iter_num, run_id, layout, best and
                                                                   keep_checkpoints))
    behind = export and whole and best_behind(ds_dir, iter_num, run_id, best_path)  # best.pt older than ds/best
    beside = best and whole != 'other'  # a new best's state beside the engine's: in a folder of this layout alone
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
        'world_size': world_size,
        'skipped': nonfinite_steps,  # float16 overflows just before: its weights are those of iter_num - skipped
    }
    if whole and not beside and not (export and (best or behind or not same_step(extra, ckpt_path))):
        return
    if not whole or beside:
        writer = master_process if to == 'storage' else local_rank == 0  # of latest, and of the folder's cleaning
        if writer and os.path.isdir(folder) and not whole:
            shutil.rmtree(folder)  # cut short, damaged, or not what latest names: written anew (after the barrier)
        if writer and to == 'storage' and not whole:
            mark_run(folder, run_id)  # before the engine's barrier: a kill mid-write leaves a folder of the run's
        # The engine writes its model-states file (our state in it) from the first data-parallel rank only; a
        # snapshot needs one in every node's folder, so there the first rank of each node writes it too
        first_only = model.save_non_zero_checkpoint
        model.save_non_zero_checkpoint = first_only or (to == 'memory' and local_rank == 0)
        model.save_checkpoint(*os.path.split(folder), client_state=extra, save_latest=False)  # (its dir and tag)
        model.save_non_zero_checkpoint = first_only
        files = [f for f in model.checkpoint_engine.files if not whole or f[0].endswith('model_states.pt')]
        paths, states = zip(*files) if files else ((), ())
        keep = keeping(keep_checkpoints if to == 'storage' else 2, nonfinite_steps)
        same = (lambda old: weights_of(engine_state(old)) == weights_of(extra)) if nonfinite_steps else None
        save_in_background(list(states), list(paths), slot=f'ds-{to}',
                           then=lambda ok: commit(folder, ok, checkpoint_groups[to], writer, best=best,
                                                  iter_of=folder_iter if to == 'storage' else engine_iter,
                                                  keep=keep, weights=same))
        if to == 'storage':
            print0(f"saving checkpoint to {folder}")
    if export:
        model_sd, optim_sd = gather_state(model, raw_model, optimizer, group_names, adamw_groups)
        if master_process:
            save_in_background({'model': model_sd, 'optimizer': optim_sd, **extra}, ckpt_path,
                               keep=keeping(keep_checkpoints, nonfinite_steps), best=(best or behind) and best_path)
            print0(f"saving consolidated checkpoint to {ckpt_path}")
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
        with ctx:
            _, loss = model(X, Y)
        # the engine scales each micro-step's loss by 1 / accum_steps (its gradient_accumulation_steps), so that
        # the gradients add up to a mean over the rank's batch, and reduces them only at the last micro-step
        loss_sum += loss.detach().float() / accum_steps
        model.backward(loss)
        if micro_step == accum_steps - 1:
            if local_iter_num == 0:
                grad_bytes = state_bytes(model, raw_model, optimizer)['grad_bytes']  # reduced; the step frees them
            # the ranks have to agree about a non-finite loss, as they do about a SIGTERM
            nonfinite, stop = agree(~torch.isfinite(loss_sum))
            wait_for_copies()  # a save begun before this step may still be copying the state it is about to change
        step_or_stop(model, nonfinite_steps, iter_num, out_dir, run_id)  # steps at the last micro-step, or counts
    # A non-finite loss or gradient would spoil the weights for good. The engine skips a step whose gradients are
    # not finite (ZeRO and the bf16/fp16 optimizers check, our guard below does at stage 0 in fp32), and a
    # non-finite loss gives non-finite gradients. float16's loss scaler skips overflows as a matter of course:
    # those are counted apart.
    if nonfinite and model.was_step_applied():
        sys.exit(f"error: iter {iter_num} had a non-finite loss but DeepSpeed took the step; {ds_dir} holds the last "
                 f"good state: {diverged_fix(dtype)}")
    nonfinite_steps = count_step(model, nonfinite, nonfinite_steps, max_nonfinite_steps, iter_num, log_metrics,
                                 out_dir, run_id, dtype)
    if local_iter_num == 0:  # gradients and optimizer state exist from the first step on
        mem = {**state_bytes(model, raw_model, optimizer), 'grad_bytes': grad_bytes}
        print0("per-rank memory: " + ", ".join(f"{k[:-6]} {v / 2**20:.2f} MiB" for k, v in mem.items()))
        log_metrics(iter_num, **mem)
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
    if stop:
        print0(f"{stop_signal()}: saving a checkpoint at iter {iter_num} and exiting")
        save_checkpoint(wait=True)
        break

finish_saves()  # a storage checkpoint that could not be written stops the run with an error
remove_snapshots(run_id, eval_only, unsaved(nonfinite_steps))  # out_dir holds the final state: free the RAM
finish()
