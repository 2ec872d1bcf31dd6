"""
Trains a GPT with DeepSpeed's ZeRO: optimizer state (stage 1), gradients too (2) and parameters too (3) sharded
over the data-parallel ranks, optionally offloaded to CPU memory (ZeRO-Offload) or NVMe (ZeRO-Infinity).

torchrun, 8 GPUs:   torchrun --standalone --nproc_per_node=8 ds_train.py config/train_gpt2.py --zero_stage=2
deepspeed, 8 GPUs:  deepspeed --num_gpus 8 ds_train.py config/train_gpt2.py --zero_stage=3 --offload_optimizer=cpu
Two nodes:          torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HEAD:29500 ds_train.py ...

Everything but the distribution is train.py's: config keys, data stream, logging, eval and exact resume. The
DeepSpeed config is generated from train.py's keys, so that one config trains on the same global batch in tokens
here and there; a ds_config JSON file may add to it, not contradict it. Checkpoints are the engine's folders
(out_dir/ds/step-N/, resumed at the same world size and stage), and save_consolidated writes beside each one
train.py's ckpt.pt, which sample.py, train.py and the other entrypoints read, and from which this script resumes
at another world size or stage (an elastic restart with fewer or more nodes).
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
import warnings
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

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
# DeepSpeed
zero_stage = 2  # 0: data parallel; 1: optimizer state sharded; 2: and gradients; 3: and parameters
offload_optimizer = 'none'  # 'none', 'cpu' (optimizer state and step in CPU memory) or an NVMe folder (stage 3)
offload_params = 'none'  # 'none', 'cpu' or an NVMe folder: parameters between uses (stage 3)
ds_config = ''  # a DeepSpeed config JSON file whose entries are added to the generated config (never contradict it)
save_consolidated = True  # with each checkpoint also write out_dir/ckpt.pt in train.py's format (gathered on rank 0)
# -----------------------------------------------------------------------------
# the deepspeed launcher adds --local_rank=K, which says what LOCAL_RANK in the environment says
config, given = configure(globals(), [a for a in sys.argv[1:] if not a.startswith('--local_rank=')])

# DeepSpeed, imported after the config: launch/resume.py and the manifest tests read the config without it
try:
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    from deepspeed.utils import (safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_set_full_fp32_param,
                                 safe_set_full_optimizer_state)
except ImportError as e:
    sys.exit(f"error: ds_train.py needs DeepSpeed ({e}): pip install deepspeed==0.19.8")
# the classes that DeepSpeed 0.19.8 pickles into its checkpoints besides tensors and containers
DS_SAFE_GLOBALS = [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]
# DeepSpeed 0.19.8 calls collectives that torch 2.13 deprecates, and torch says so at each call
warnings.filterwarnings('ignore', message=r'`torch\.distributed\.\w+` is deprecated', category=FutureWarning)

# distributed init: torchrun and the deepspeed launcher set RANK, LOCAL_RANK and WORLD_SIZE; without, a group of one
ddp = 'RANK' in os.environ
rank, local_rank, world_size = (int(os.environ[k]) for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE')) if ddp else (0, 0, 1)
master_process = rank == 0  # does all the logging and checkpoint writing
dp_rank, dp_size = rank, world_size  # every rank is a data-parallel rank: ZeRO shards over all of them
if device == 'auto':
    device = f'cuda:{local_rank}' if torch.cuda.is_available() else 'cpu'
elif device == 'cuda' and ddp:
    device = f'cuda:{local_rank}'
device_type = device.split(':')[0]
if device_type == 'cuda' and not torch.cuda.is_available():
    sys.exit("error: device=cuda but torch sees no GPU: use --device=cpu (or auto)")
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
for key, value in (('offload_optimizer', offload_optimizer), ('offload_params', offload_params)):
    nvme = value not in ('none', 'cpu')  # ZeRO-Infinity: a folder on an NVMe drive
    if nvme and not os.path.isdir(value):
        sys.exit(f"error: {key}={value!r} is neither none, cpu nor an existing folder (on an NVMe drive)")
    lowest = 3 if nvme or key == 'offload_params' else 1
    if value != 'none' and zero_stage < lowest:
        sys.exit(f"error: {key}={value} needs zero_stage {'3' if lowest == 3 else '1 or more'}, not {zero_stage}")
    if nvme and not getattr(get_accelerator().create_op_builder('AsyncIOBuilder'), 'is_compatible', lambda: False)():
        sys.exit(f"error: {key} to NVMe needs DeepSpeed's async_io op, which needs libaio: apt-get install "
                 f"libaio-dev (or yum install libaio-devel), or offload to cpu")
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
if not ddp:  # a group of one, which DeepSpeed wraps (it asks for the LOCAL_RANK that its launchers set)
    os.environ.setdefault('LOCAL_RANK', '0')
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
elif os.environ.get('TORCHELASTIC_USE_AGENT_STORE') == 'True':
    # torchrun's store outlives a restart of the workers, and gloo would read the dead workers' addresses from it
    # (and fail the restart): each incarnation of the group gets a store of its own (DeepSpeed then takes this group)
    store = incarnation_store(rank, world_size)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size,
                            device_id=torch.device(device) if device_type == 'cuda' else None)
deepspeed.init_distributed(dist_backend=backend)
# an early exit (a one-line error, an exception) tears the groups down too: left to the interpreter's end, gloo's
# threads can abort it ('terminate called without an active exception')
atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
if device_type == 'cpu':
    # Under its launcher (which sets LOCAL_SIZE) DeepSpeed maps a 66 MB shared-memory file per rank for its
    # inference all-reduce and never removes it; once every rank has mapped the others', the names can go
    dist.barrier()
    shm = f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR')}_{os.environ.get('MASTER_PORT')}_{rank}"
    if os.path.exists(os.path.join('/dev/shm', shm)):
        os.remove(os.path.join('/dev/shm', shm))
torch.manual_seed(seed)  # every rank builds the same initial model
if device_type == 'cuda':
    torch.backends.cuda.matmul.fp32_precision = 'tf32'
    torch.backends.cudnn.conv.fp32_precision = 'tf32'
ctx = nullcontext()  # no autocast: DeepSpeed's bf16 and fp16 modes cast the model, with fp32 master weights


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


# where to start: the newest complete state of this run, a memory snapshot or a checkpoint in out_dir
ckpt_path = os.path.join(out_dir, 'ckpt.pt')  # the consolidated export (or train.py's): resumes at any layout
run_id_path = os.path.join(out_dir, 'run_id')  # names the run's snapshots, so that a new run in out_dir never takes an old one's
layout = (world_size, zero_stage)  # what ZeRO cuts its shards for: an engine checkpoint resumes only at the same


def newest_engine_checkpoint(folder, run_id=None, or_any=False):
    """((iter_num, path, (world size, zero stage) that wrote it) or None, damaged) for the engine checkpoints in
    folder: the one latest names, which is written only once every rank's files are, or else the newest before it
    whose files load; damaged ones are listed as (path, reason); with run_id, another run's count as none (with
    or_any, only where that run has none). With mmap only each file's index is read."""
    if run_id is not None and or_any:
        found = newest_engine_checkpoint(folder, run_id)
        return found if found[0] is not None else newest_engine_checkpoint(folder)
    try:
        with open(os.path.join(folder, 'latest')) as f:
            newest = f.read().strip()
    except OSError:
        return None, []
    damaged = []
    for name in sorted((f for f in os.listdir(folder) if f.startswith('step-') and f <= newest), reverse=True):
        path = os.path.join(folder, name)
        try:
            files = sorted(f for f in os.listdir(path) if f.endswith('.pt'))
            with torch.serialization.safe_globals(DS_SAFE_GLOBALS):
                for f in files:
                    torch.load(os.path.join(path, f), map_location='cpu', weights_only=True, mmap=True)
            states = [f for f in files if f.endswith('model_states.pt')][0]
            ours = torch.load(os.path.join(path, states), map_location='cpu', weights_only=True, mmap=True)
            if run_id is not None and ours.get('run_id', run_id) != run_id:
                return None, damaged
            return (int(ours['iter_num']), path, (ours['world_size'], ours['config']['zero_stage'])), damaged
        except Exception as e:
            damaged.append((path, reason_of(e)))
    return None, damaged


def find_resume_point():
    """(run_id, (iter_num, path) to resume from or None, damaged files passed over). All ranks agree: a memory
    snapshot counts only if every rank sees the same complete one (a replaced node holds none), else rank 0's
    newest engine checkpoint in out_dir. Both resume only at the world size and stage that wrote them; at another
    (an elastic restart with fewer or more nodes) the run continues from the newest consolidated ckpt.pt, which
    load_state scatters into any layout."""
    run_id, mem, disk, whole, damaged, whole_damaged = None, None, None, (None, None), [], []
    wanted = init_from == 'resume' or (auto_resume and not eval_only)  # an eval of another model is no resume
    if wanted and os.path.exists(run_id_path):
        with open(run_id_path) as f:
            run_id = f.read().strip()
        mem, damaged = newest_engine_checkpoint(snapshot_dir(run_id))
    if wanted:
        # this run's newest, not one of a run that it was started afresh over (that only when asked to resume)
        this_run = dict(run_id=run_id, or_any=init_from == 'resume')
        disk, disk_damaged = newest_engine_checkpoint(os.path.join(out_dir, 'ds'), **this_run)
        damaged += disk_damaged
        *whole, whole_damaged = newest_loadable([ckpt_path, previous(ckpt_path)], **this_run)
    views = [None] * world_size
    dist.all_gather_object(views, (run_id, mem, disk, tuple(whole), uuid.uuid4().hex))
    run_id, mem, disk, (whole_iter, whole_path), new_id = views[0]
    if run_id is not None and mem is not None and mem[2] == layout and all(v[:2] == (run_id, mem) for v in views) \
            and (disk is None or mem[0] >= disk[0]):
        return run_id, mem[:2], damaged
    if disk is not None and disk[2] == layout:
        return run_id or new_id, disk[:2], damaged
    if whole_iter is not None:
        if disk is not None:
            print0(f"{disk[1]} was written by {disk[2][0]} ranks at zero_stage={disk[2][1]}, not {world_size} at "
                   f"{zero_stage}: continuing from the consolidated {whole_path} instead")
        return run_id or new_id, (whole_iter, whole_path), damaged + whole_damaged
    if disk is not None:
        sys.exit(f"error: {disk[1]} was written by {disk[2][0]} ranks at zero_stage={disk[2][1]}, and ZeRO's shards "
                 f"resume only so; with no consolidated {ckpt_path} beside it (save_consolidated=False) use "
                 f"{disk[2][0]} ranks and --zero_stage={disk[2][1]}")
    return new_id, None, damaged + whole_damaged  # a fresh run gets a new id


run_id, resume_from, damaged = find_resume_point()
if resume_from is None and damaged:
    path, reason = damaged[0]
    sys.exit(f"error: checkpoint {path} is corrupt or not a training checkpoint ({reason}): delete it or restore "
             f"a good copy (or start afresh over it with --auto_resume=False)")
if resume_from is None and init_from == 'resume':
    sys.exit(f"error: no checkpoint at {os.path.join(out_dir, 'ds', 'latest')} or {ckpt_path}: point --out_dir at a "
             f"run's folder, or use --init_from=scratch")
for path, reason in damaged:
    print0(f"warning: skipping the damaged {path} ({reason}); resuming from the newest one before it")
if resume_from is not None:
    # the engine's checkpoint folder, whose weights and optimizer shards load into the engine below; or a ckpt.pt
    # in train.py's format, whose whole weights and Adam moments load_state scatters over the ranks
    resume_path = resume_from[1]
    if init_from != 'resume':
        print0(f"auto-resume: {out_dir} holds this run's state at iter {resume_from[0]}, so the run continues "
               f"(--auto_resume=False starts afresh)")
    try:
        if os.path.isdir(resume_path):
            # our state is the engine's client state, in the (first) model-states file; mmap reads only what is used
            states = sorted(f for f in os.listdir(resume_path) if f.endswith('model_states.pt'))[0]
            checkpoint = torch.load(os.path.join(resume_path, states), map_location='cpu', weights_only=True, mmap=True)
        else:
            checkpoint = torch.load(resume_path, map_location='cpu', weights_only=True)
        ckpt_args = checkpoint['model_args']
        take_shape(ckpt_args)
        model = GPT(GPTConfig(**model_args))
        if 'model' in checkpoint:  # a ckpt.pt: its weights into the module now, with the moments into the engine later
            checkpoint['model'] = GPT.upgrade_state_dict(checkpoint['model'])
            model.load_state_dict(checkpoint['model'])
            # checked against the parameters' shapes now: at stage 3 the engine leaves them empty
            checkpoint['optimizer'] = model.upgrade_optimizer_state(checkpoint['optimizer']) \
                if checkpoint.get('optimizer') else {'state': {}}
        iter_num, best_val_loss = checkpoint['iter_num'], float(checkpoint['best_val_loss'])
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
# optimizer (train.py's AdamW and weight-decay groups), and the engine that shards it
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
adamw_groups = [{k: v for k, v in g.items() if k != 'params'} for g in optimizer.param_groups]  # for the export
group_names = raw_model.param_groups()  # read now: at stage 3 the engine leaves each parameter an empty shape
if offload_optimizer != 'none':
    # the offloaded step runs on the CPU, in DeepSpeed's vectorized Adam (a C++ op it builds on first use)
    groups = [{'params': g['params'], 'weight_decay': g['weight_decay']} for g in optimizer.param_groups]
    optimizer = DeepSpeedCPUAdam(groups, lr=learning_rate, betas=(beta1, beta2), adamw_mode=True)


def offload(value):
    if value == 'cpu':
        return {'device': 'cpu', 'pin_memory': device_type == 'cuda'}  # pinned: faster copies to and from GPUs
    return {'device': 'nvme', 'nvme_path': value}


# The DeepSpeed config, from train.py's keys: the same global batch (batch_size x gradient_accumulation_steps
# sequences, over all ranks), clipping and precision. The LR schedule stays ours (get_lr sets it each step).
ds_cfg = {
    'train_batch_size': batch_size * gradient_accumulation_steps,
    'train_micro_batch_size_per_gpu': batch_size,
    'gradient_accumulation_steps': accum_steps,
    'gradient_clipping': grad_clip,
    'bf16': {'enabled': dtype == 'bfloat16'},
    'fp16': {'enabled': dtype == 'float16'},
    'zero_optimization': {'stage': zero_stage,
                          **({'offload_optimizer': offload(offload_optimizer)} if offload_optimizer != 'none' else {}),
                          **({'offload_param': offload(offload_params)} if offload_params != 'none' else {})},
}


def merge(ours, theirs, where):
    """theirs added to ours, in place; a value of theirs that differs from ours is an error."""
    for k, v in theirs.items():
        if isinstance(v, dict) and isinstance(ours.get(k), dict):
            merge(ours[k], v, f'{where}{k}.')
        elif k in ('optimizer', 'scheduler') and not where:
            sys.exit(f"error: {ds_config} sets {k}: ds_train.py makes the optimizer (AdamW, train.py's weight-decay "
                     f"groups) and the LR schedule from its config keys; drop {k!r} from the file")
        elif k in ours and ours[k] != v:
            sys.exit(f"error: {ds_config} sets {where}{k}={json.dumps(v)}, which contradicts {json.dumps(ours[k])} "
                     f"from the config (batch_size, gradient_accumulation_steps, grad_clip, dtype, zero_stage, "
                     f"offload_*): set it with those keys, or drop it from the file")
        else:
            ours[k] = v


if ds_config:
    try:
        with open(ds_config) as f:
            extra = json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"error: cannot read ds_config {ds_config} ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
    if not isinstance(extra, dict):
        sys.exit(f"error: ds_config {ds_config} holds a JSON {type(extra).__name__}, not an object of DeepSpeed settings")
    merge(ds_cfg, extra, '')
try:
    model, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_cfg)
except ValueError as e:  # pydantic's errors about ds_config's settings among them: the class, the field, the reason
    sys.exit(f"error: DeepSpeed rejects the config ({'; '.join(line.strip() for line in str(e).splitlines()[:3])[:300]})"
             f"{f': check {ds_config}' if ds_config else ''}")


class DeferredWrites(CheckpointEngine):
    """The engine's file I/O, taken over: at a save it hands us each file's state instead of writing it, and
    save_checkpoint below writes them in the background. Loads read with weights_only, the engine's state being
    data too (its few classes allowed by name)."""
    def __init__(self):
        super().__init__()
        self.files = []

    def create(self, info):
        self.files = []

    def save(self, state_dict, path):
        self.files.append((path, state_dict))

    def load(self, path, map_location=None):
        with torch.serialization.safe_globals(DS_SAFE_GLOBALS):
            return torch.load(path, map_location=map_location, weights_only=True)

    def commit(self, info):
        return True

    def preserves_storage_sharing(self):
        return False  # no clones: the thread copies the tensors into host memory, while the next step runs


if zero_stage == 0 and dtype == 'float32':
    # Here DeepSpeed steps our AdamW as it is, unchecked: a step with non-finite gradients is skipped, and the
    # overflow flag (which the engine reads after the step, as it does ZeRO's) says so
    def guarded_step(adamw_step=model.optimizer.step):
        grads = [p.grad for g in model.optimizer.param_groups for p in g['params'] if p.grad is not None]
        model.optimizer.overflow = not torch.isfinite(torch.nn.utils.get_total_norm(grads)).item()
        if not model.optimizer.overflow:
            adamw_step()
    model.optimizer.step = guarded_step
model.checkpoint_engine = DeferredWrites()
# the threads that write checkpoints agree in collectives of their own that they are complete, one group a kind
# (memory, storage) so that two threads' collectives never meet
checkpoint_groups = {to: dist.new_group(backend='gloo') for to in ('memory', 'storage')}

def link_optimizer_state():
    """DeepSpeed 0.19.8 links each parameter to its fragments of the optimizer state lazily, in its step, after the
    first weight-decay group's update, when the second group (biases, gains) has no state yet: link the rest."""
    for p in raw_model.parameters():
        m = getattr(p, '_hp_mapping', None)
        if m is not None and not m.optim_fragment:
            flat = optimizer.param_groups[m.param_group_index]['params'][0]
            m.set_optim_state_fragment(flat, optimizer.state[flat])


def stage0_pieces(tensors, shapes):
    """At stage 0 AdamW steps the parameters themselves (fp32), or one flat fp32 copy of each group (bf16, fp16):
    the group's parameters' tensors, or their views in that flat tensor."""
    if len(tensors) == len(shapes):
        return tensors
    return [t.view(s) for t, s in zip(tensors[0].split([s.numel() for s in shapes]), shapes)]


def gather_state():
    """train.py's model and optimizer state dicts, whole, in CPU memory. A collective: under ZeRO each parameter's
    fp32 master weights and Adam moments are all-reduced from the fragments that the ranks own."""
    params = dict(raw_model.named_parameters())
    moments = ('exp_avg', 'exp_avg_sq')
    weights, state = {}, {}
    if any(hasattr(p, '_hp_mapping') or hasattr(p, 'ds_id') for p in params.values()):  # ZeRO 1-3
        link_optimizer_state()
        for n, p in params.items():
            weights[n] = safe_get_full_fp32_param(p).cpu()
            state[n] = {k: safe_get_full_optimizer_state(p, k).cpu() for k in moments}
    else:
        for group, g in zip(group_names, optimizer.param_groups):
            shapes = [params[n].shape for n in group]
            ws = stage0_pieces(g['params'], shapes)
            ms = {k: stage0_pieces([optimizer.state[m][k] for m in g['params']], shapes) for k in moments}
            for i, n in enumerate(group):
                weights[n], state[n] = ws[i].detach().cpu(), {k: ms[k][i].cpu() for k in moments}
    name_of = {id(p): n for n, p in params.items()}  # the tied lm_head.weight is wte's parameter
    model_sd = {k: weights[name_of[id(v)]] for k, v in raw_model.state_dict(keep_vars=True).items()}
    # numbered as train.py's AdamW numbers its parameters, with its hyperparameters
    step = torch.tensor(float(next(iter(optimizer.state.values()))['step']))  # every parameter takes every step
    names = [n for group in group_names for n in group]
    groups, start = [], 0
    for g, live, group in zip(adamw_groups, optimizer.param_groups, group_names):
        groups.append({**g, 'lr': live['lr'], 'params': list(range(start, start + len(group)))})
        start += len(group)
    return model_sd, {'state': {i: {'step': step, **state[n]} for i, n in enumerate(names)}, 'param_groups': groups}


@torch.no_grad()
def load_state(model_sd, optim_sd):
    """gather_state's inverse: train.py's whole weights and AdamW state, whatever world size, stage or entrypoint
    wrote them, into this engine; each rank keeps its own part (under ZeRO its fragments of every parameter's fp32
    master weights and Adam moments). The module holds the weights already (they were loaded before the engine
    was made); the fp32 master copies are set again, since in bf16 the engine made them from rounded weights."""
    params = dict(raw_model.named_parameters())
    names = [n for group in group_names for n in group]
    saved = {names[i]: s for i, s in optim_sd['state'].items()}
    if saved:
        # Adam's state exists only from its first step on: a step on zero gradients at lr 0 makes it (zero moments,
        # the weights unmoved), and then takes the saved moments and step count. Its flat fp32 tensors: each group's
        # own, or at stage 3 the sub-groups that the engine hands it only for the length of a step
        zero3 = getattr(model.optimizer, 'fp32_partitioned_groups_flat', None)
        flats = [(model.optimizer.sub_group_to_group_id[j], t) for j, t in enumerate(zero3)] if zero3 else \
            [(i, p) for i, g in enumerate(optimizer.param_groups) for p in g['params']]
        before = [(g['params'], g['lr']) for g in optimizer.param_groups]
        grads = [t.grad for _, t in flats]
        for i, g in enumerate(optimizer.param_groups):
            g['params'], g['lr'] = [t for j, t in flats if j == i], 0.0
        for _, t in flats:
            t.grad = torch.zeros_like(t)
        optimizer.step()
        for g, (params_before, lr) in zip(optimizer.param_groups, before):
            g['params'], g['lr'] = params_before, lr
        for (_, t), grad in zip(flats, grads):
            t.grad = grad
        step = float(next(iter(saved.values()))['step'])
        for s in optimizer.state.values():
            s['step'] = s['step'].fill_(step) if torch.is_tensor(s['step']) else int(step)
    if any(hasattr(p, '_hp_mapping') or hasattr(p, 'ds_id') for p in params.values()):  # ZeRO 1-3
        link_optimizer_state()
        for n, p in params.items():
            safe_set_full_fp32_param(p, model_sd[n].to(device))
            for k in saved.get(n, {}):
                if k != 'step':
                    safe_set_full_optimizer_state(p, saved[n][k].to(device), k)
    else:
        for group, g in zip(group_names, optimizer.param_groups):
            shapes = [params[n].shape for n in group]
            for n, w in zip(group, stage0_pieces(g['params'], shapes)):
                w.copy_(model_sd[n])
            for k in ('exp_avg', 'exp_avg_sq') if saved else ():
                for n, m in zip(group, stage0_pieces([optimizer.state[t][k] for t in g['params']], shapes)):
                    m.copy_(saved[n][k])


# -----------------------------------------------------------------------------
# checkpoint load: the rest of the state, so that the run continues exactly where it stopped
if checkpoint is not None:
    try:
        if os.path.isdir(resume_path):  # each rank's shards of the weights and the optimizer state
            loaded, _ = model.load_checkpoint(os.path.dirname(resume_path), tag=os.path.basename(resume_path))
            assert loaded is not None, "DeepSpeed found no checkpoint there"
        else:  # a fp16 run's loss scale is not in it: the engine's starts afresh
            load_state(checkpoint['model'], checkpoint['optimizer'])
    except Exception as e:
        sys.exit(f"error: checkpoint {resume_path} does not load into this run ({reason_of(e)}): "
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

if compile:
    print0("compiling the model... (takes a ~minute)")
    model.compile()  # the engine compiles its module in place (at stage 3 it recompiles in ZeRO's hooks, though)
eval_model = model  # at stage 3 every rank takes part in each forward, evaluation's too


def save_checkpoint(to='storage', wait=False):
    """Every rank calls this: the engine hands over each rank's files of the state (shards of the weights and
    optimizer state, and our state as its client state: the RNG of every rank, the data position), and a thread
    copies them into host memory and writes them into out_dir/ds/step-N/ (to='memory': into the node's snapshot
    folder in /dev/shm), each atomically. The loop goes on at once: the copy overlaps the next forward and backward
    (the step waits for it). Once every rank's files are written, the first rank (of each node, for snapshots)
    points latest at the folder (a crash before leaves the previous one in place) and removes the older ones but
    the one before. With save_consolidated, storage checkpoints also write train.py's ckpt.pt, in the background
    too. wait=True returns once all is written."""
    ds_dir = os.path.join(out_dir, 'ds') if to == 'storage' else snapshot_dir(run_id)
    folder = os.path.join(ds_dir, f'step-{iter_num:08d}')
    if resume_from is not None and resume_from[1] == folder:
        return  # a resumed run's first eval: the checkpoint it started from
    wait_for_saves(f'ds-{to}')  # the save before of this kind is complete and latest names it
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
        'world_size': world_size,
    }
    writer = master_process if to == 'storage' else local_rank == 0  # of latest, and of the folder's cleaning
    if writer and os.path.isdir(folder):
        shutil.rmtree(folder)  # cut short, damaged, or of another world size: written anew (after the barrier within)
    # The engine writes its model-states file (our state in it) from the first data-parallel rank only; a snapshot
    # needs one in every node's folder, so there the first rank of each node writes it too
    first_only = model.save_non_zero_checkpoint
    model.save_non_zero_checkpoint = first_only or (to == 'memory' and local_rank == 0)
    model.save_checkpoint(ds_dir, tag=os.path.basename(folder), client_state=extra, save_latest=False)
    model.save_non_zero_checkpoint = first_only
    paths, states = zip(*model.checkpoint_engine.files) if model.checkpoint_engine.files else ((), ())

    def commit(ok):  # in the thread: every rank's files are written, or one rank's could not be
        written = torch.tensor(float(ok))
        dist.all_reduce(written, op=dist.ReduceOp.MIN, group=checkpoint_groups[to])
        if written.item() and writer:
            latest = os.path.join(ds_dir, 'latest')
            before = Path(latest).read_text().strip() if os.path.exists(latest) else None
            if os.path.join(ds_dir, str(before)) in [path for path, _ in damaged]:
                before = os.path.basename(resume_from[1])  # found damaged at the start: the run resumed from this
            with open(latest + '.tmp', 'w') as f:
                f.write(os.path.basename(folder))
            os.replace(latest + '.tmp', latest)
            damaged[:] = [d for d in damaged if d[0] != folder]  # written anew
            for old in os.listdir(ds_dir):  # the one before stays, should the newest ever turn out damaged
                if old.startswith('step-') and old < os.path.basename(folder) and old != before:
                    shutil.rmtree(os.path.join(ds_dir, old), ignore_errors=True)
    save_in_background(list(states), list(paths), slot=f'ds-{to}', then=commit)
    if to == 'storage':
        print0(f"saving checkpoint to {folder}")
    if save_consolidated and to == 'storage':
        model_sd, optim_sd = gather_state()
        if master_process:
            save_in_background({'model': model_sd, 'optimizer': optim_sd, **extra}, ckpt_path, keep_previous=True)
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
        # every rank runs the same number of forwards (at stage 3 each gathers parameters from the others); the
        # extra ones where eval_iters does not divide by dp_size count for nothing
        for k in range(dp_rank, -(-eval_iters // dp_size) * dp_size, dp_size):
            X, Y = get_batch(split, offsets[k % eval_iters])
            with ctx:
                _, loss = eval_model(X, Y)
            total += loss.float() * (k < eval_iters)
        dist.all_reduce(total)
        out[split] = total.item() / eval_iters
    eval_model.train()
    return out


def state_bytes():
    """Bytes of parameters, gradients and optimizer state on this rank, counted by storage (a flat buffer once,
    however many views of it): the module's weights (their partitions at stage 3) and the fp32 master partitions
    that ZeRO steps (the same storage at stage 3 in fp32, a copy at 1 and 2); the reduced gradients; the Adam
    moments. DeepSpeed frees the gradients within its step, so they are counted before it."""
    def size(tensors):
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
    mine = [getattr(p, 'ds_tensor', p) for p in raw_model.parameters()]
    # ZeRO-3 hands the optimizer its fp32 partitions only for the length of a step
    masters = [p for g in optimizer.param_groups for p in g['params']] + \
        list(getattr(model.optimizer, 'fp32_partitioned_groups_flat', []))
    # where each stage keeps them after the reduction: stage 0 in .grad, 1 and 2 in averaged_gradients (views of
    # one partition buffer), 3 in one flat buffer of partitions, and with offload beside the CPU master copies
    zero_grads = [g for gs in getattr(model.optimizer, 'averaged_gradients', {}).values() for g in gs or []]
    grads = [p.grad for p in list(raw_model.parameters()) + masters if p.grad is not None] + zero_grads + \
        [getattr(model.optimizer, 'grad_partitions_flat_buffer', None)]
    return dict(param_bytes=size(mine + masters),
                grad_bytes=size(g for g in grads if g is not None),
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
        with ctx:
            _, loss = model(X, Y)
        # the engine scales each micro-step's loss by 1 / accum_steps (its gradient_accumulation_steps), so that
        # the gradients add up to a mean over the rank's batch, and reduces them only at the last micro-step
        loss_sum += loss.detach().float() / accum_steps
        model.backward(loss)
        if local_iter_num == 0 and micro_step == accum_steps - 1:
            grad_bytes = state_bytes()['grad_bytes']  # reduced and not yet freed: the step frees them
        if micro_step == accum_steps - 1:
            # the ranks have to agree about a non-finite loss, as they do about a SIGTERM: one all-reduce for both
            flags = torch.stack([(~torch.isfinite(loss_sum)).float(), torch.tensor(float(bool(stop_signals)), device=device)])
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            nonfinite, stop = flags.tolist()
            wait_for_copies()  # a save begun before this step may still be copying the state it is about to change
        model.step()  # clips and steps the optimizer at the last micro-step; only counts the others
    # A non-finite loss or gradient would spoil the weights for good. The engine skips a step whose gradients are
    # not finite (ZeRO and the bf16/fp16 optimizers check, our guard below does at stage 0 in fp32), and a
    # non-finite loss gives non-finite gradients. float16's loss scaler skips overflows as a matter of course:
    # there only the loss counts.
    if nonfinite and model.was_step_applied():
        sys.exit(f"error: iter {iter_num} had a non-finite loss but DeepSpeed took the step; "
                 f"{os.path.join(out_dir, 'ds')} holds the last good state: lower learning_rate, use bfloat16 rather "
                 f"than float16, or check the data")
    nonfinite = nonfinite or (dtype != 'float16' and not model.was_step_applied())
    nonfinite_steps = nonfinite_steps + 1 if nonfinite else 0
    if nonfinite:
        print0(f"iter {iter_num}: non-finite loss or gradient, step skipped ({nonfinite_steps} in a row)")
        log_metrics(skipped='non-finite loss or gradient')
        if nonfinite_steps >= max_nonfinite_steps:
            wait_for_saves()
            sys.exit(f"error: {nonfinite_steps} steps in a row up to iter {iter_num} had a non-finite loss or "
                     f"gradient; {os.path.join(out_dir, 'ds')} holds the last good state: lower learning_rate, use "
                     f"bfloat16 rather than float16, or check the data")
    if local_iter_num == 0:  # gradients and optimizer state exist from the first step on
        mem = {**state_bytes(), 'grad_bytes': grad_bytes}
        print0("per-rank memory: " + ", ".join(f"{k.removesuffix('_bytes')} {v / 2**20:.2f} MiB" for k, v in mem.items()))
        log_metrics(**mem)
    steps_timed += 1

    if iter_num % log_interval == 0:
        # the loss of the whole global batch: the mean over ranks of each rank's mean over its micro-steps
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
if local_rank == 0 and os.path.exists(snapshot_dir(run_id)):
    shutil.rmtree(snapshot_dir(run_id), ignore_errors=True)  # out_dir holds the final state: free the RAM
if master_process:
    metrics.close()
dist.barrier()  # gloo's teardown has aborted when one rank left while another was still in a collective
dist.destroy_process_group()
