"""
HellaSwag (Zellers et al. 2019), scored as GPT-2's reproductions score it (build-nanogpt, llm.c): each example's
context is followed by each of its 4 endings (with a leading space), and the ending the model finds likeliest wins,
by the sum of its tokens' cross-entropy (acc) or by their mean (acc_norm, fair to long endings). The validation
set's 10,042 examples come from `python prepare.py hellaswag`.

    examples = load_or_exit('data/hellaswag/hellaswag_val.jsonl', model.config.vocab_size)  # once, at start-up
    scores = evaluate(model, examples, device, ctx, block_size, dp_rank, dp_size)    # {'n', 'acc', 'acc_norm'}

Marks for reference by this scoring: OpenAI's GPT-2 124M acc_norm 0.2955 (llm.c quotes 0.2945), GPT-3 124M 0.337.
"""

import json
import math
import os
import sys

import torch
import torch.distributed as dist
from torch.nn import functional as F

from data import gpt2_encoding_or_exit

GPT2_VOCAB = 50257  # tokens of GPT-2's BPE; a model trained here pads its vocabulary to 50304
EOT = 50256  # the padding token of a batch; padded positions are never scored, so any id would do
DEFAULT_PATH = os.path.join('data', 'hellaswag', 'hellaswag_val.jsonl')


def load_examples(path):
    """The examples of a HellaSwag jsonl file (one JSON object a line, as rowanz/hellaswag writes them), each as
    {'ctx': str, 'endings': [4 str], 'label': 0..3}. Raises FileNotFoundError where there is no file, and ValueError
    with a one-line message naming FILE:LINE where a line is not such an example."""
    examples = []
    with open(path, 'rb') as f:  # bytes, so that a bad line is named by its number, not by a decoder's offset
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode('utf-8')
            except UnicodeDecodeError:
                raise ValueError(f"{where}: not UTF-8 text: fix the line, or fetch the file again with "
                                 f"python prepare.py hellaswag") from None
            if not line.strip():
                continue  # a trailing blank line
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not a JSON object ({e.msg} at column {e.colno}): fix the line, or fetch "
                                 f"the file again with python prepare.py hellaswag") from None
            except RecursionError:  # a line nested deeper than the parser's stack: no example is
                raise ValueError(f"{where}: not a HellaSwag example (nested too deep to read): fix the line, or "
                                 f"fetch the file again with python prepare.py hellaswag") from None
            examples.append(check_example(row, where))
    if not examples:
        raise ValueError(f"{path}: no examples in the file: give HellaSwag's jsonl (python prepare.py hellaswag)")
    return examples


def check_example(row, where):
    if not isinstance(row, dict):
        raise ValueError(f"{where}: an object with ctx, endings and label was expected, got {short(row)}: fix the line")
    ctx, endings, label = row.get('ctx'), row.get('endings'), row.get('label')
    if not isinstance(ctx, str) or not ctx:
        # the first ending token is predicted from the context's last one: an empty context leaves nothing to do so
        raise ValueError(f"{where}: ctx must be a non-empty string, got {short(ctx)}: fix the line")
    if not isinstance(endings, list) or len(endings) != 4 or not all(isinstance(e, str) for e in endings):
        raise ValueError(f"{where}: endings must be a list of 4 strings, got {short(endings)}: fix the line")
    if isinstance(label, str) and label in ('0', '1', '2', '3'):
        label = int(label)  # Hugging Face's copy of the data set writes the label as a string
    if type(label) is not int or not 0 <= label <= 3:
        raise ValueError(f"{where}: label must be 0, 1, 2 or 3 (the right ending's index), got {short(label)}: "
                         f"fix the line")
    return {'ctx': ctx, 'endings': endings, 'label': label}


def short(value):
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + '...'


def check_vocab(vocab_size):
    """Raises ValueError where the model's vocabulary cannot be GPT-2's BPE (a char-level model's)."""
    if vocab_size < GPT2_VOCAB:
        raise ValueError(f"HellaSwag needs a model with GPT-2's BPE vocabulary ({GPT2_VOCAB} tokens or more), and "
                         f"this one has {vocab_size}: train on a GPT-2 BPE dataset (e.g. shakespeare, openwebtext)")


def load_or_exit(path, vocab_size=None):
    """load_examples for a script: a missing or malformed file, or (given vocab_size) a model that is not GPT-2 BPE,
    is a one-line error and an exit."""
    try:
        if vocab_size is not None:
            check_vocab(vocab_size)
        examples = load_examples(path)
    except FileNotFoundError:
        sys.exit(f"error: no HellaSwag file at {path}: run python prepare.py hellaswag (--input=FILE for a local "
                 f"copy of hellaswag_val.jsonl)")
    except IsADirectoryError:
        sys.exit(f"error: {path} is a folder, not HellaSwag's jsonl: give the file, e.g. "
                 f"{os.path.join(path, 'hellaswag_val.jsonl')}")
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    # the evals render the examples with GPT-2's BPE, whose first use downloads two files: on a node that has no
    # internet, a one-line error now, not a traceback at the first eval (maybe hours into a resumed run)
    encoding()
    return examples


def encoding():
    return gpt2_encoding_or_exit()  # loaded once per process: tiktoken keeps it


def render(example, block_size, enc=None):
    """The 4 rows the model reads for an example: (tokens, scored) per ending, tokens being the context's and then
    the ending's, and scored the ending's positions. The model reads tokens[:-1] and predicts tokens[1:], so a row
    holds block_size + 1 tokens at most: a longer one keeps its last ones, the ending whole and the end of the
    context (an ending that alone is longer keeps its last tokens too)."""
    enc = enc or encoding()
    ctx = enc.encode_ordinary(example['ctx'])
    rows = []
    for ending in example['endings']:
        end = enc.encode_ordinary(' ' + ending)  # GPT-2's tokens carry the space before a word
        tokens, scored = (ctx + end)[-(block_size + 1):], ([False] * len(ctx) + [True] * len(end))[-(block_size + 1):]
        rows.append((tokens, scored))
    return rows


def token_losses(logits, targets):
    """The cross-entropy of each scored position (target >= 0), 0 at the others: a float32 tensor of targets' shape.
    The softmax runs over GPT-2's 50257 tokens only: a model trained here has 47 padding rows, tokens no text has,
    that the exported model and OpenAI's GPT-2 do not have."""
    keep = targets >= 0
    losses = torch.zeros(targets.shape, device=logits.device)
    losses[keep] = F.cross_entropy(logits[keep][:, :GPT2_VOCAB].float(), targets[keep], reduction='none')
    return losses


@torch.no_grad()
def ending_losses(model, example, device, ctx, block_size, enc=None, pipeline=False):
    """(sums, means): the cross-entropy of each ending's tokens, summed and averaged per token, as float32 tensors
    of 4 on the device. One forward for the 4 endings, padded on the right to the longest (causal attention never
    looks right, so the padding changes nothing before it) and the padding left unscored. The forward is the
    model's own (model(idx, targets), whatever wraps it), which returns every position's logits when given
    targets; a pipeline's (pipeline.Forward) is given token_losses, which its last stage computes, to send every
    rank 4 x T losses rather than 4 x T x vocab logits."""
    rows = render(example, block_size, enc)
    T = max(len(tokens) for tokens, _ in rows) - 1
    idx = torch.full((4, T), EOT, dtype=torch.long)
    targets = torch.full((4, T), -1, dtype=torch.long)
    for i, (tokens, scored) in enumerate(rows):
        n = len(tokens) - 1
        idx[i, :n] = torch.tensor(tokens[:-1])
        targets[i, :n] = torch.tensor([t if s else -1 for t, s in zip(tokens[1:], scored[1:])])
    idx, targets = idx.to(device), targets.to(device)
    with ctx:
        out, _ = model(idx, targets, per_token=token_losses) if pipeline else model(idx, targets)
    losses = out if pipeline else token_losses(out, targets)
    keep = targets >= 0
    sums = torch.zeros(4, device=losses.device).index_add_(0, keep.nonzero()[:, 0], losses[keep])
    return sums, sums / keep.sum(1)


def evaluate(model, examples, device, ctx, block_size, rank=0, world_size=1, group=None, progress=False,
             pipeline=False):
    """{'n', 'acc', 'acc_norm'} of the model over the examples. Rank r of world_size data-parallel ranks scores
    examples r, r + world_size, ...; the counts are all-reduced over group (the default group) where
    torch.distributed is initialized and world_size > 1 (else they are this rank's share's). Where the group holds
    several ranks per data-parallel rank (a tensor-parallel group's ranks score the same examples), each example
    is counted once.
    Every rank runs the same number of forwards, since under FSDP, ZeRO-3 or TP each is a collective: where the
    examples do not share out evenly, a rank scores a repeat of an example that counts for nothing.
    The model is put in eval mode and back. pipeline: the model is pipeline.Forward (ending_losses)."""
    check_vocab(unwrap(model).config.vocab_size)
    reduce = world_size > 1 and dist.is_initialized()
    replicas, rest = divmod(dist.get_world_size(group), world_size) if reduce else (1, 0)
    if rest:
        raise ValueError(f"world_size={world_size} does not divide the group's {dist.get_world_size(group)} ranks: "
                         f"give the data-parallel rank and size")
    n = len(examples)
    enc = encoding()
    was_training = model.training
    model.eval()
    counts = torch.zeros(3, dtype=torch.long, device=device)  # examples, right by sum, right by mean
    steps = range(rank, math.ceil(n / world_size) * world_size, world_size)
    if progress and rank == 0:
        from tqdm import tqdm
        steps = tqdm(steps, desc='hellaswag', unit='example', disable=None)  # None: no bar where stderr is no tty
    for k in steps:
        example = examples[k % n]
        sums, means = ending_losses(model, example, device, ctx, block_size, enc, pipeline)
        right = torch.stack([sums.argmin(), means.argmin()]) == example['label']  # argmin: the first of a tie
        counts += torch.cat([torch.ones(1, dtype=torch.long, device=device), right.long()]) * int(k < n)
    model.train(was_training)
    if reduce:
        dist.all_reduce(counts, group=group)
        counts //= replicas  # a tp group's ranks all added the same counts
    total, right, right_norm = counts.tolist()
    return {'n': total, 'acc': right / total, 'acc_norm': right_norm / total}


def unwrap(model):
    """The GPT inside whatever wraps it for its config: DDP's and DeepSpeed's .module, torch.compile's _orig_mod
    (FSDP2 keeps the class itself)."""
    while hasattr(model, 'module') or hasattr(model, '_orig_mod'):
        model = getattr(model, 'module', None) or model._orig_mod
    return model
