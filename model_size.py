"""
Sizes a GPT before it is trained: its parameters, its checkpoint, and the memory each rank needs for
parameters, gradients, optimizer state (AdamW, fp32 master weights, as every entrypoint here keeps them) and
activations (an estimate) under DDP, ZeRO-1/2/3, FSDP, tensor parallel and 2-D, at a world size and dtype; with
pp_size, each rank of pp_train.py's pipeline too (the first and the last hold the embeddings and the head), its
stages tensor parallel with tp_size.

python model_size.py --model=gpt2-xl --world_size=8
python model_size.py --n_layer=4 --n_head=4 --n_embd=128 --block_size=64 --vocab_size=65 --world_size=2 --dtype=float32
python model_size.py config/train_shakespeare_char_cpu.py   # a training config: its shape, batch and data's vocabulary
python model_size.py config/gpt2-small.toml                 # a TOML one too (Decent-DP's names taken, as in training)
python model_size.py out-shakespeare-char                   # a run folder or checkpoint: the shape it saved
python model_size.py --model=gpt2 --pp_size=4                # and per rank of a 4-stage pipeline
python model_size.py --model=gpt2 --pp_size=4 --dp_shard=True  # each stage sharded over the 8 / 4 pipelines
python model_size.py --model=gpt2 --pp_size=2 --tp_size=2   # a rank of 2 stages, each tensor parallel over 2
python model_size.py --model=gpt2 --pp_size=2 --tp_size=2 --dp_shard=True  # and sharded over the 8 / 4 pipelines
"""

import json
import math
import os
import sys

import torch

from checkpoint import find_checkpoint, reason, run_versions
from configurator import check_model_name, check_model_shape, configure, quiet_interrupt
from data import data_dir, meta_vocab
from model import GPT2_SHAPES, GPT, GPTConfig

quiet_interrupt()  # Ctrl-C: one line, no traceback

# -----------------------------------------------------------------------------
model = ''  # a GPT-2 shape ('gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl') instead of n_layer / n_head / n_embd
n_layer = 12
n_head = 12
n_embd = 768
block_size = 1024
vocab_size = 50304  # unless the dataset's meta.pkl gives one, as in training
dataset = ''  # a training config's: its meta.pkl (a character-level prep's) gives the vocabulary; '' none
random_data = False  # a training config's: its synthetic GPT-2 tokens, whatever the dataset
bias = False
world_size = 8
tp_size = 0  # the tensor-parallel group of the 2-D row (and of each stage with pp_size); 0: none shown unless
# world_size / 2 divides evenly (and none in the stages)
batch_size = 12  # sequences per micro-step per rank, for the activation estimate
dtype = 'bfloat16'  # the compute dtype: activations take 2 bytes an element in bfloat16, 4 in float32; auto: a GPU's
activation_checkpointing = False
pp_size = 0  # pipeline stages (pp_train.py, one per rank): 0 none shown
pp_schedule = '1f1b'  # pp_train.py's: zbv places two stages a rank in a V (the first rank holds both ends)
stages_per_rank = 1  # the interleaved schedules' stages per rank (pp_train.py's interleaved-1f1b, interleaved-zb)
dp_shard = False  # pp_train.py's: each stage sharded over world_size / (pp_size x tp_size) pipelines (between steps)
# -----------------------------------------------------------------------------


def saved_shape(path):
    """The model_args a checkpoint (a ckpt.pt, a sharded folder, a run folder) was saved with, read without its
    weights (mmap): sizing never loads or builds a model."""
    try:
        ckpt = find_checkpoint(path)
        # a ds_train.py run saved with save_consolidated=False has no ckpt.pt, nor has a folder of step folders
        # (RUN/ds, RUN/dcp, RUN/decent): the step folder that its latest names has the shape (a run folder of
        # any name holds no latest file of its own)
        for latest in (os.path.join(path, 'ds', 'latest'), os.path.join(path, 'latest')):
            if not os.path.exists(ckpt) and os.path.isfile(latest):
                ckpt = find_checkpoint(latest)
    except ValueError as e:  # a latest or best file that names no step folder
        sys.exit(f"error: {e}: give a step folder or a ckpt.pt of the run, or --n_layer, --n_head, --n_embd")
    ckpt = path if os.path.isdir(path) and not os.path.exists(ckpt) else ckpt  # a step folder of ZeRO's shards
    if os.path.isdir(ckpt):  # DCP's extra.pt, DeepSpeed's model states (our state beside its own), or a replica
        states = sorted(f for f in os.listdir(ckpt) if f.endswith('model_states.pt') or f == 'rank-0.pt')
        ckpt = os.path.join(ckpt, states[0] if states else 'extra.pt')
    # a run folder: its newest ckpt.pt version that loads, as the other tools read it
    versions = run_versions(path, ckpt)
    for version in versions[:-1]:
        try:
            return torch.load(version, map_location='cpu', weights_only=True, mmap=True)['model_args']
        except Exception as e:
            print(f"warning: {version} is damaged ({reason(e)}): passed over for the version before it",
                  file=sys.stderr)
    ckpt = versions[-1] if versions else ckpt
    try:
        return torch.load(ckpt, map_location='cpu', weights_only=True, mmap=True)['model_args']
    except FileNotFoundError:
        sys.exit(f"error: {path} is neither a config file (*.py, *.toml) nor a checkpoint or a run folder with a "
                 f"ckpt.pt")
    except Exception as e:
        sys.exit(f"error: cannot read the model's shape from {ckpt} ({reason(e)}): give --n_layer, --n_head, --n_embd")


def shape_of(path):
    """A checkpoint or run folder given as an argument: the shape it saved, which flags after it may change."""
    shape = saved_shape(path)
    return [(k, shape[k]) for k in ('n_layer', 'n_head', 'n_embd', 'block_size', 'vocab_size', 'bias') if k in shape]


# a training config sets keys this tool lacks (out_dir, learning_rate, ...): only the shape, batch and data count here
config, given = configure(globals(), skip_unknown_in_files=True, positional=shape_of)
check_model_name(model, given)
if dataset and 'vocab_size' not in given:
    vocab_size = meta_vocab(dataset, random_data) or vocab_size
    if not random_data and not os.path.isfile(os.path.join(data_dir(dataset), 'train.bin')):
        # not prepared here, where training would stop: a character-level prep's vocabulary is its text's, unknown
        print(f"note: {data_dir(dataset)} holds no prepared data (train.bin), so the vocabulary is taken as GPT-2's "
              f"{vocab_size}; a character-level prep's is its meta.pkl's: prepare the data first, or give "
              f"--vocab_size")
dtype = 'bfloat16' if dtype == 'auto' else dtype  # the entrypoints' auto on a GPU (a TOML's amp = true)
if model:
    if model not in GPT2_SHAPES:
        sys.exit(f"error: unknown model={model!r}: use one of {', '.join(GPT2_SHAPES)}, or set n_layer, n_head, n_embd")
    n_layer, n_head, n_embd = GPT2_SHAPES[model]
if dtype not in ('bfloat16', 'float16', 'float32'):
    sys.exit(f"error: dtype={dtype!r}: use bfloat16, float16 or float32")
check_model_shape(dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, vocab_size=vocab_size))
for key in ('world_size', 'batch_size'):
    if config[key] < 1:
        sys.exit(f"error: {key}={config[key]} must be 1 or more")
if tp_size:  # one asked for by name is shown, or refused with the reason: never dropped silently
    if tp_size < 2:
        sys.exit(f"error: tp_size={tp_size} must be 2 or more, or 0 to choose one from world_size")
    for key, value in (('world_size', world_size), ('n_head', n_head), ('4 * n_embd', 4 * n_embd)):
        if value % tp_size:
            sys.exit(f"error: {key}={value} is not a multiple of tp_size={tp_size}: tensor parallelism splits it "
                     f"evenly; choose a tp_size that divides world_size, n_head and 4 * n_embd")

if dp_shard and not pp_size:
    sys.exit("error: dp_shard=True shards the stages of pp_train.py's pipelines: give --pp_size too")
if pp_size:
    # stage_blocks: stages > layers, one line
    from pipeline import SCHEDULES, placement, stage_blocks, stage_ids, stages_refused
    if pp_size < 1 or stages_per_rank < 1:
        sys.exit(f"error: pp_size={pp_size} and stages_per_rank={stages_per_rank} must be 1 or more")
    if pp_schedule not in SCHEDULES:
        sys.exit(f"error: pp_schedule={pp_schedule!r} is not one of {', '.join(SCHEDULES)}")
    if 'pp_schedule' in given and (message := stages_refused(pp_schedule, stages_per_rank, given)):
        sys.exit(f"error: {message}")
    # pp_train.py's stages a rank for its schedule: the interleaved ones' stages_per_rank, zbv's two, one otherwise;
    # a schedule not named keeps stages_per_rank as given
    v, v_shape = placement(pp_schedule, stages_per_rank) if 'pp_schedule' in given else (stages_per_rank, False)
    stage_blocks(0, pp_size * v, n_layer)
    if dp_shard and world_size % (pp_size * (tp_size or 1)):
        sys.exit(f"error: dp_shard=True shards each stage over world_size / (pp_size x tp_size) pipelines, and "
                 f"pp_size={pp_size} x tp_size={tp_size or 1} does not divide world_size={world_size}: give a "
                 f"world_size that it divides")
with torch.device('meta'):  # shapes only, of one block: the others are alike, so nothing grows with n_layer
    gpt = GPT(GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=1, n_head=n_head, n_embd=n_embd,
                        bias=bias))
params = {n: p.shape for n, p in gpt.named_parameters()}  # a tied parameter once
LAYERS = lambda name: n_layer if '.h.' in name else 1  # one block's parameters stand for n_layer blocks'
N = sum(math.prod(shape) * LAYERS(n) for n, shape in params.items())
COLWISE = ('attn.c_q', 'attn.c_k', 'attn.c_v', 'mlp.c_fc')  # split by output rows (weights and biases)
ROWWISE = ('attn.c_proj', 'mlp.c_proj')  # split by input columns (weights; their biases stay whole)


def local_numel(name, shape, tp, dp):
    """Elements of one parameter on one rank: tensor parallel splits the blocks' matrices, then FSDP splits dim 0
    of what is left into dp pieces, the last padded as FSDP2 pads it."""
    shape = list(shape)
    if tp > 1 and '.h.' in name:
        if name.rsplit('.', 1)[0].endswith(COLWISE):
            shape[0] //= tp
        elif name.rsplit('.', 1)[0].endswith(ROWWISE) and name.endswith('weight'):
            shape[1] //= tp
    shape[0] = math.ceil(shape[0] / dp)
    return math.prod(shape)


def sharded(tp, dp):
    return sum(local_numel(n, shape, tp, dp) * LAYERS(n) for n, shape in params.items())


def activations(tp):
    """Activation bytes a rank keeps for the backward, after Korthikanti et al. (2022), per layer
    s·b·h·(10 + 24/t) elements of 2 bytes with flash attention (no s² scores), plus the fp32 logits and their
    gradient; with checkpointing, each layer keeps only its input and one layer is rebuilt at a time."""
    s, b, h, elem = block_size, batch_size, n_embd, (4 if dtype == 'float32' else 2)
    layer = s * b * h * (10 + 24 / tp) * elem / 2
    kept = n_layer * s * b * h * elem + layer if activation_checkpointing else n_layer * layer
    return kept + 2 * s * b * vocab_size * 4


W = world_size
tp2 = tp_size or (W // 2 if W >= 4 and W % 2 == 0 else 0)
rows = {  # (parameters, gradients, optimizer state) in bytes on one rank, fp32 master weights and AdamW
    'DDP': (4 * N, 4 * N, 8 * N),
    'ZeRO-1': (4 * N, 4 * N, 8 * N / W),
    'ZeRO-2': (4 * N, 4 * N / W, 8 * N / W),
    'ZeRO-3 / FSDP': (4 * sharded(1, W), 4 * sharded(1, W), 8 * sharded(1, W)),
}
if n_head % W == 0 and (4 * n_embd) % W == 0:
    rows[f'TP {W}'] = (4 * sharded(W, 1), 4 * sharded(W, 1), 8 * sharded(W, 1))
if tp2 > 1 and W % tp2 == 0 and n_head % tp2 == 0 and (4 * n_embd) % tp2 == 0:
    per_rank = sharded(tp2, W // tp2)
    rows[f'FSDP {W // tp2} x TP {tp2}'] = (4 * per_rank, 4 * per_rank, 8 * per_rank)
act = {name: activations(int(name.split('TP ')[1]) if 'TP ' in name else 1) for name in rows}
for r in range(pp_size):
    # a pipeline rank holds its stages' blocks, the first stage's also the embeddings, the last's the final layer
    # norm and a copy of the tied head (none where it holds both); data parallel keeps whole replicas of each stage
    stages = stage_ids(r, pp_size, v, v_shape)
    first, last = 0 in stages, pp_size * v - 1 in stages
    blocks = sum(len(stage_blocks(i, pp_size * v, n_layer)) for i in stages)
    outside = {n: math.prod(shape) for n, shape in params.items() if '.h.' not in n}
    n = blocks * sum(local_numel(name, shape, tp_size or 1, 1) for name, shape in params.items() if '.h.' in name)
    n += (outside['transformer.wte.weight'] + outside['transformer.wpe.weight']) * first
    n += sum(k for name, k in outside.items() if name.startswith('transformer.ln_f')) * last
    n += outside['transformer.wte.weight'] * (last and not first)  # the head's copy of the tied weight
    name = f'PP {pp_size}{f" x TP {tp_size}" * bool(tp_size)} rank {r}'
    n /= world_size // (pp_size * (tp_size or 1)) if dp_shard else 1  # FSDP's shards over dp (its padding aside)
    rows[name] = (4 * n, 4 * n, 8 * n)
    act[name] = activations(tp_size or 1) * blocks / n_layer  # one micro-batch's; up to pp_size in flight

print(f"{N:,} parameters ({N - block_size * n_embd:,} without position embeddings), "
      f"{n_layer} layers, {n_head} heads, {n_embd} wide, block {block_size}, vocab {vocab_size}")
saved = 12 * N  # fp32 weights and AdamW's two moments; the tied head is the embedding, saved once
print(f"checkpoint: {4 * N / 2**20:,.1f} MiB of fp32 weights, {saved / 2**20:,.1f} MiB with AdamW state")
print(f"per rank at world size {W}, {dtype}, batch {batch_size}x{block_size}"
      f"{', activation checkpointing' if activation_checkpointing else ''} (MiB):")
print(f"{'':>18} {'params':>10} {'grads':>10} {'optim':>10} {'acts (est.)':>12} {'total':>10}")
for name, (p, g, o) in rows.items():
    print(f"{name:>18} {p / 2**20:10.1f} {g / 2**20:10.1f} {o / 2**20:10.1f} {act[name] / 2**20:12.1f} "
          f"{(p + g + o + act[name]) / 2**20:10.1f}")
print(json.dumps({'params': N, 'checkpoint_bytes': saved, **{name: dict(param_bytes=p, grad_bytes=g, optim_bytes=o,
                  activation_bytes=act[name]) for name, (p, g, o) in rows.items()}}))
