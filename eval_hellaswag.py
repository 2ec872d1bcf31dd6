"""
HellaSwag accuracy of a model: any entrypoint's checkpoint (train.py's or nanoGPT's ckpt.pt, fsdp_train.py's
sharded folders, a run's out_dir), or OpenAI's GPT-2. The data comes from `python prepare.py hellaswag`.

python eval_hellaswag.py --ckpt=out-gpt2
python eval_hellaswag.py --init_from=gpt2 --limit=1000
torchrun --standalone --nproc_per_node=8 eval_hellaswag.py --init_from=gpt2-xl   # the examples shared out

Reference marks by this scoring: GPT-2 124M acc_norm 0.2955 (llm.c quotes 0.2945), GPT-3 124M 0.337.
"""

import os
import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist

from checkpoint import PRETRAINED, checkpoint_or_exit, find_checkpoint, hf_folder, pretrained_or_exit
from configurator import configure, quiet_interrupt
from data import gpt2_encoding_or_exit
from distributed import env_store, finish, pick_device, torchrun_env
from hellaswag import DEFAULT_PATH, evaluate, load_or_exit

quiet_interrupt()  # Ctrl-C: one line, no traceback

# -----------------------------------------------------------------------------
ckpt = 'out'  # a run's out_dir (its newest checkpoint), a ckpt.pt, or a sharded checkpoint folder
init_from = ''  # instead of ckpt: 'gpt2'..'gpt2-xl' from Hugging Face, or a folder that save_pretrained wrote
input = DEFAULT_PATH  # HellaSwag's jsonl
limit = 0  # score the first `limit` examples only; 0 for all
device = 'auto'  # 'auto' (cuda if there is a GPU, else cpu), 'cpu', 'cuda', 'cuda:1'
dtype = 'auto'  # 'auto' (bfloat16 on GPUs that have it, else float16 on CUDA, float32 on CPU), or one of those
# -----------------------------------------------------------------------------
config, given = configure(globals())
if 'ckpt' in given and init_from:
    sys.exit("error: both ckpt and init_from are given: give --ckpt for a checkpoint of this repo or --init_from "
             "for GPT-2, not both")
if limit < 0:
    sys.exit(f"error: limit={limit} is out of range: give --limit 0 (all) or more")
if dtype not in ('auto', 'float32', 'bfloat16', 'float16'):
    sys.exit(f"error: dtype={dtype!r}: use auto, float32, bfloat16 or float16")

device, device_type = pick_device(device)
if dtype == 'auto':
    dtype = ('bfloat16' if torch.cuda.is_bf16_supported(including_emulation=False) else 'float16') \
        if device_type == 'cuda' else 'float32'
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
ctx = nullcontext() if dtype == 'float32' else torch.autocast(device_type=device_type, dtype=ptdtype)

# model, read before the process group starts: a one-line error then leaves no group behind
if init_from:
    try:  # this repo's checkpoints are --ckpt's: a run folder (or its dcp/latest) or a file
        ours = init_from not in PRETRAINED and (os.path.isfile(init_from) or os.path.exists(find_checkpoint(init_from)))
    except ValueError:  # a dcp/latest that names no step folder: a run folder all the same
        ours = True
    try:  # a latest or best file beside a run's step folders, which names one: ours (a run folder named ds is not)
        pointer = find_checkpoint(init_from) != init_from
    except ValueError:
        pointer = True
    if os.path.isfile(init_from) and not init_from.endswith('.pt') and not pointer:
        # a Hugging Face folder's file, say
        sys.exit(f"error: {init_from} is a file, and --init_from takes a Hugging Face folder: give the folder that "
                 f"holds it, --init_from={os.path.dirname(init_from) or '.'}, or a checkpoint of this repo with --ckpt")
    if ours:
        sys.exit(f"error: {init_from} is a checkpoint file or a run folder, not a Hugging Face folder: evaluate a "
                 f"checkpoint of this repo with --ckpt={init_from}")
    model, name = pretrained_or_exit(init_from), init_from
elif hf_folder(ckpt):  # export_hf.py's: --ckpt said "no checkpoint at FOLDER/ckpt.pt"
    sys.exit(f"error: {ckpt} is a Hugging Face folder, not a checkpoint of this repo: evaluate it with "
             f"--init_from={ckpt}")
else:
    model, _, name = checkpoint_or_exit(ckpt, "give --ckpt=a run folder, a ckpt.pt or a sharded checkpoint folder, or "
                                           "--init_from=gpt2")
examples = load_or_exit(input, model.config.vocab_size)
if limit:
    examples = examples[:limit]
gpt2_encoding_or_exit()  # its first use downloads two files: offline, a one-line error here

# under torchrun every rank holds the whole model and scores its share of the examples; the counts are all-reduced.
# (distributed.start is the training loops': it would hold back a SIGTERM until a step ends, and here none does)
rank, _, world_size, _ = torchrun_env()
if world_size > 1:
    if device_type == 'cuda':
        torch.cuda.set_device(device)
    dist.init_process_group('nccl' if device_type == 'cuda' else 'gloo', store=env_store(), rank=rank,
                            world_size=world_size)
if device_type == 'cuda':
    torch.set_float32_matmul_precision('high')  # TF32 matmuls (the API that inductor's max-autotune reads)
model.to(device)
if rank == 0:
    print(f"{name}: {model.get_num_params() / 1e6:.2f}M parameters, {dtype} on {device}")
scores = evaluate(model, examples, device, ctx, model.config.block_size, rank, world_size, progress=True)
if rank == 0:
    print(f"hellaswag: {scores['n']} examples, acc {scores['acc']:.4f}, acc_norm {scores['acc_norm']:.4f}")
if world_size > 1:
    finish()  # the ranks leave together, and skip the interpreter's C++ teardown, where gloo has aborted a run
