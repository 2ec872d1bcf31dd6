"""
Running out of memory, on a GPU or in host RAM: the script ends with one line that says what ran out and where,
what was asked of it and how to make it fit, and a non-zero exit, in place of torch's traceback. Any other
exception keeps its traceback. Not for sizing a model before a run: model_size.py does that, and
distributed.check_fits refuses weights that cannot fit at all.

    explain_oom(globals())   # after configure(): the script's settings, read when the memory runs out
"""

import os
import re
import socket
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

POSTED = 'nanogpt/out_of_memory'  # the store's key where a rank that ran out of memory posts its rank


def is_oom(e):
    """Whether exception e is an allocation that failed: torch's on a GPU, its CPU allocator's (a RuntimeError),
    numpy's or Python's MemoryError."""
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return True
    # (a mapped file's read that the address space has no room for: "unable to mmap ...: Cannot allocate memory")
    return isinstance(e, RuntimeError) and any(s in str(e) for s in ("can't allocate memory", 'out of memory',
                                                                     'Cannot allocate memory'))


def asked(e):
    """The size of the allocation that failed, in words ('7.6 GiB'), as its message gives it, or None."""
    text = str(e)
    found = re.search(r'allocate (\d+) bytes', text)  # torch's CPU allocator
    if found:
        n = int(found[1])
        return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"
    found = re.search(r'(?:[Tt]ried to|Unable to) allocate ([\d.]+ [KMGTP]?i?B)', text)  # torch's CUDA's, numpy's
    return found and found[1]


def ran_out(device):
    """The memory that ran out, in words: a GPU's, or the host's RAM; and which rank, on which host, where several."""
    what = f"{device}'s memory" if torch.device(device).type != 'cpu' else "host RAM"
    if int(os.environ.get('WORLD_SIZE', 1)) > 1:
        what += f" of rank {os.environ.get('RANK', 0)} on {socket.gethostname()}"
    return what


def where(tb, g):
    """Which part of the script ran out: an eval, a save, or a training step (the first, or which), by the
    functions in the traceback and the loop's counters in the script's globals g."""
    names = [frame.f_code.co_name for frame, _ in traceback.walk_tb(tb)]
    for name, part in (('estimate_loss', 'an eval'), ('evaluate', 'a HellaSwag eval'),
                       ('save_checkpoint', "a save's copy of the state"), ('generate', 'sampling')):
        if name in names:
            return part
    if 'local_iter_num' in g:  # the loop has begun
        return 'the first training step' if g['local_iter_num'] == 0 else f"training step {g.get('iter_num')}"
    return 'a training step' if 'step' in names else 'the start (building the model, loading the state)'


def shape(g):
    """The model's shape in words ('a model of ...'), and its settings, from the script's globals: model_args where
    it has them (a checkpoint's, where it resumed), else its n_layer / n_head / n_embd, or a loaded model's config
    (sample.py)."""
    config = g.get('model_args') or getattr(getattr(g.get('model'), 'config', None), '__dict__', None) or g
    n = ""
    if all(k in config for k in ('n_layer', 'n_head', 'n_embd', 'block_size', 'vocab_size')):
        from model import count_params
        n = f" ({count_params(**config) / 1e6:,.2f}M parameters)"
    if 'n_layer' not in config:  # a tool still reading it
        return "the model", config
    return f"a model of n_layer={config['n_layer']}, n_head={config['n_head']}, n_embd={config['n_embd']}{n}", config


def oom_line(e, tb, g):
    """The one-line error for exception e (an allocation that failed) with traceback tb, in the script whose
    globals are g."""
    size, part = asked(e), where(tb, g)
    head = f"error: out of {ran_out(g.get('device', 'cpu'))} in {part}" + (f", asking {size} more" if size else "")
    model, config = shape(g)
    if 'num_samples' in g:  # sample.py: one sequence at a time, so it is the model's fp32 weights that do not fit
        fix = "use --device=cpu (host RAM)" if torch.device(g['device']).type != 'cpu' else "free host RAM"
        return f"{head}, sampling from {model}, whose fp32 weights do not fit: {fix}, or a smaller model"
    block = config.get('block_size', g.get('block_size'))
    ask = f"with batch_size={g['batch_size']} x block_size={block} tokens a micro-step a rank and {model}"
    size_it = " ".join(f"--{k}={config[k]}" for k in ('n_layer', 'n_head', 'n_embd', 'vocab_size') if k in config)
    size_it = (f"size a run first with `python model_size.py {size_it} --block_size={block} --batch_size=N "
               f"--world_size={os.environ.get('WORLD_SIZE', 1)}`")
    if part.startswith('the start'):  # before a batch: the weights, gradients and AdamW state alone do not fit
        return (f"{head}, {ask}: the model's state does not fit, whatever the batch: use a smaller model, or shard "
                f"it over more ranks (fsdp_train.py, ds_train.py --zero_stage=3), and {size_it}")
    checkpointing = " or --activation_checkpointing=True," if g.get('activation_checkpointing') is False else ""
    return (f"{head}, {ask}: use a smaller --batch_size with a larger --gradient_accumulation_steps, which keeps the "
            f"tokens per step,{checkpointing} and {size_it}")


def explain_oom(g):
    """Installs the hook that ends a script which ran out of memory with oom_line, not the traceback. g: the
    script's globals, read then. The interpreter's end follows as for any uncaught exception: the checkpoint saves
    still in flight (threads) are finished first, and the exit status is non-zero."""
    def hook(kind, value, tb, chained=sys.excepthook):
        store, key = group_store() or (None, None)
        if not is_oom(value):
            # the other ranks' collectives fail once a rank that ran out has left (gloo's "Connection closed by
            # peer"): no fault of theirs, and a traceback of each would bury the line that says how to fit
            who = store and store.check([key]) and store.get(key).decode()
            if not who:
                return chained(kind, value, tb)
            print(f"error: rank {os.environ['RANK']} stopped: rank {who} ran out of memory (its line above says "
                  f"how to fit the run)", file=sys.__stderr__, flush=True)
            return
        if store:
            store.set(key, os.environ['RANK'])
        # to the process's own stderr: torch's init_process_group wraps this hook in one that prefixes each line
        print(oom_line(value, tb, g), file=sys.__stderr__, flush=True)
    sys.excepthook = hook


def group_store():
    """(store, key): where the ranks of a group of several meet even once a collective has failed, and the key
    under which a rank that ran out posts its rank; None without a group, or where the store cannot be reached.
    Under torchrun, its agents' store, which outlives the workers (rank 0, the group's own store's host, may be the
    one that ran out), keyed by this incarnation of the group (distributed.incarnation_store's post); else the
    group's own."""
    try:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        if os.environ.get('TORCHELASTIC_USE_AGENT_STORE') == 'True':
            store = dist.TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), is_master=False,
                                  timeout=timedelta(seconds=5))
            return store, f"{POSTED}/{store.get('nanogpt/incarnation').decode()}"
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(timedelta(seconds=5))
        store.check([POSTED])
        return store, POSTED
    except Exception:
        return None
