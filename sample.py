"""
Samples text from a trained model: any entrypoint's checkpoint (train.py's or nanoGPT's ckpt.pt, fsdp_train.py's
sharded folders), OpenAI's GPT-2, or a Hugging Face GPT-2 folder (export_hf.py's).

python sample.py --out_dir=out-shakespeare-char --start="ROMEO:" --num_samples=3 --max_new_tokens=200
python sample.py --init_from=gpt2-xl --start=FILE:prompt.txt
"""

import os
import shlex
import sys
from contextlib import nullcontext

import torch

from configurator import check_seed, configure, quiet_interrupt
from checkpoint import PRETRAINED, checkpoint_or_exit, find_checkpoint, hf_folder, pretrained_or_exit
from data import gpt2_encoding_or_exit, read_meta, vocabulary_of
from oom import explain_oom

# -----------------------------------------------------------------------------
init_from = 'resume'  # 'resume' (out_dir's newest checkpoint), 'best' (its best by val loss), 'gpt2'..'gpt2-xl',
# a checkpoint's path, or a Hugging Face GPT-2 folder (export_hf.py's, save_pretrained's)
out_dir = 'out'
start = "\n"  # the prompt; "FILE:prompt.txt" reads it from a file
num_samples = 10
max_new_tokens = 500
temperature = 0.8  # 1.0 keeps the model's distribution, lower is more conservative, 0 always takes the likeliest
top_k = 200  # sample from the k most likely tokens only; 0 for all
seed = 1337
device = 'auto'  # 'auto' (cuda if there is a GPU, else cpu), 'cpu', 'cuda', 'cuda:1'
dtype = 'auto'  # 'auto' (bfloat16 on GPUs that have it, else float16 on CUDA, float32 on CPU), or one of those
compile = False  # torch.compile the model (nanoGPT's key): the first sample waits for it, longer ones then go faster
meta_path = ''  # a char-level vocabulary (meta.pkl); by default data/<the checkpoint's dataset>/meta.pkl
# -----------------------------------------------------------------------------
quiet_interrupt()  # Ctrl-C: one line, no traceback
configure(globals())
explain_oom(globals())  # running out of memory ends in one line that says how to fit, not a traceback
check_seed(globals())

for name in ('num_samples', 'max_new_tokens'):
    if globals()[name] < 0:
        sys.exit(f"error: {name}={globals()[name]} is negative: give 0 or more")
if top_k < 0:
    sys.exit(f"error: top_k={top_k} is negative: give how many of the likeliest tokens to sample from, or 0 for all")
if not 0 <= temperature < float('inf'):  # written so that nan fails too
    sys.exit(f"error: temperature={temperature} is not a number from 0 up: give 0 (always the likeliest token) or more")
if temperature == 0:  # greedy, the limit of sampling as the temperature falls (dividing by 0 would give nan)
    temperature, top_k = 1.0, 1
if device == 'auto':
    device = 'cuda' if torch.cuda.is_available() else 'cpu'
try:
    device_type, index = torch.device(device).type, torch.device(device).index
except RuntimeError:
    device_type, index = None, None
if device_type not in ('cpu', 'cuda'):
    sys.exit(f"error: unknown device={device!r}: use auto, cpu, cuda or cuda:N")
if device_type == 'cuda' and (index or 0) >= torch.cuda.device_count():
    sys.exit(f"error: device={device} but torch sees {torch.cuda.device_count()} GPUs here: use --device=cpu "
             f"(or auto)")
if dtype == 'auto':
    dtype = ('bfloat16' if torch.cuda.is_bf16_supported(including_emulation=False) else 'float16') \
        if device_type == 'cuda' else 'float32'
dtypes = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}
if dtype not in dtypes:
    sys.exit(f"error: unknown dtype={dtype!r}: use auto, {', '.join(dtypes)}")
ptdtype = dtypes[dtype]
ctx = nullcontext() if dtype == 'float32' else torch.autocast(device_type=device_type, dtype=ptdtype)
if device_type == 'cuda':
    torch.set_float32_matmul_precision('high')  # TF32 matmuls (the API that inductor's max-autotune reads)

# model
dataset, trained_on = None, None
# an export_hf.py folder too (no meta.pkl is named in it); resume and best name out_dir's, never a folder so named
if init_from in PRETRAINED or init_from not in ('resume', 'best') and hf_folder(init_from):
    model = pretrained_or_exit(init_from)
else:
    try:  # a path, or RUN/best, which names a file or folder of another name (best.pt, dcp/best-step-N)
        known = os.path.exists(init_from) or os.path.exists(find_checkpoint(init_from))
    except ValueError:  # a pointer that names no checkpoint folder: checkpoint_or_exit says so in one line
        known = True
    # a name that is no path (gpt3) is unknown; a path that names no checkpoint gets checkpoint_or_exit's error, which
    # says what the run folder holds (RUN/best of a ds_train.py run without save_consolidated, ...)
    if init_from not in ('resume', 'best') and not known and os.sep not in init_from:
        sys.exit(f"error: unknown init_from={init_from!r}: use resume (out_dir's checkpoint), best, gpt2, "
                 f"gpt2-medium, gpt2-large, gpt2-xl or the path of a checkpoint")
    # any entrypoint's checkpoint: a ckpt.pt, a sharded folder, a run folder's newest, or RUN/best, its best
    path = {'resume': out_dir, 'best': os.path.join(out_dir, 'best')}.get(init_from, init_from)
    fix = "point --out_dir at a run's folder, or use --init_from=gpt2" if path != init_from else \
        "give --init_from=a ckpt.pt, a sharded checkpoint or a run folder"  # the path given, not out_dir, is wrong
    model, checkpoint, _ = checkpoint_or_exit(path, fix)
    dataset, trained_on = checkpoint.get('config', {}).get('dataset'), checkpoint.get('vocabulary')
model.eval()
model.to(device)
if compile:  # the module's own call, which generate makes (torch.compile(model) would wrap one it never calls);
    model.compile(dynamic=True)  # dynamic: the prompt grows by a token each step, one graph for every length

# tokenizer: the char vocabulary the data was prepared with, else GPT-2's BPE. The checkpoint's dataset leads to
# data/<dataset>/meta.pkl only where it is a folder's name: a path in a checkpoint is not followed out of data/
where, hint = 'no dataset in the checkpoint', 'data/<dataset>/meta.pkl'
if not meta_path and isinstance(dataset, str) and dataset:
    if os.path.basename(dataset) == dataset and dataset not in ('.', '..') and not os.path.isabs(dataset):
        meta_path = os.path.join('data', dataset, 'meta.pkl')
        if dataset.isprintable() and len(dataset) <= 200:  # run elsewhere, it is not found here: the file it names
            hint = shlex.quote(meta_path) + ' (relative to the folder the run was started in)'
    else:
        where = f"the checkpoint's dataset {dataset[:200]!r} is a path, which is not followed"
        if dataset.isprintable() and len(dataset) <= 200:  # the file it names, for the user to pass if it is theirs
            folder = os.path.expanduser(dataset)
            hint = shlex.quote(os.path.join(folder, 'meta.pkl')) + \
                ('' if os.path.isabs(folder) else ' (relative to the folder the run was started in)')
if meta_path and os.path.exists(meta_path):
    meta = read_meta(meta_path)
    stoi, itos = meta.get('stoi'), meta.get('itos')
    vocab = model.config.vocab_size
    if not (isinstance(stoi, dict) and isinstance(itos, dict) and all(i in itos for i in range(vocab))
            and all(type(i) is int and 0 <= i < vocab for i in stoi.values())):
        sys.exit(f"error: {meta_path} does not hold the vocabulary of this {vocab}-token model "
                 f"({meta['vocab_size']} tokens): pass the --meta_path of the data the model was trained on")
    if trained_on is not None and vocabulary_of(meta) != trained_on:  # as many characters, other ones or reordered
        sys.exit(f"error: {meta_path} is not the vocabulary the model was trained on (its data was prepared again "
                 f"since, or it is another dataset's): pass the --meta_path of the data the model was trained on")

    def encode(s):
        missing = sorted(set(c for c in s if c not in stoi))
        if missing:
            sys.exit(f"error: the prompt has characters the model's vocabulary lacks ({''.join(missing)!r}): "
                     f"remove them")
        return [stoi[c] for c in s]

    def decode(ids):
        return ''.join(itos[i] for i in ids)
else:
    if model.config.vocab_size < 50257:
        sys.exit(f"error: the model's vocabulary has {model.config.vocab_size} tokens, but no meta.pkl was found "
                 f"({meta_path or where}): pass --meta_path={hint}")
    enc = gpt2_encoding_or_exit()
    # a model trained from scratch pads its vocabulary to 50304: the padding ids have no text, so none is drawn, and
    # a seed samples the text of the Hugging Face export, which drops them (torch.multinomial's draws hang on the
    # length of the row, not on its probabilities alone)
    model.crop_vocab_size(enc.n_vocab)

    def encode(s):
        return enc.encode(s, allowed_special={"<|endoftext|>"})

    def decode(ids):
        return enc.decode(ids)

if start.startswith('FILE:'):
    try:
        with open(start[5:], encoding='utf-8') as f:
            start = f.read()
    except (OSError, UnicodeDecodeError) as e:
        sys.exit(f"error: cannot read the prompt file {start[5:]} ({type(e).__name__}): give a readable UTF-8 "
                 f"text file")
start_ids = encode(start)
if not start_ids:
    sys.exit("error: the prompt encodes to no tokens: give a non-empty --start")
x = torch.tensor(start_ids, dtype=torch.long, device=device)[None, ...]

torch.manual_seed(seed)  # here, not before the model: the samples are the same however many models a read built
with torch.no_grad(), ctx:
    for k in range(num_samples):
        y = model.generate(x, max_new_tokens, temperature=temperature, top_k=top_k or None)
        print(decode(y[0].tolist()))
        print('---------------', flush=True)  # each sample as it comes, also into a pipe or a file
