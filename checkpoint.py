"""
Reads the model out of any checkpoint this repo's entrypoints (or nanoGPT) write, in one process:

- a train.py ckpt.pt (also fsdp_train.py's consolidated one, and nanoGPT's own),
- an fsdp_train.py sharded folder (out_dir/dcp/step-N/, any world size or mesh wrote it),
- a run's out_dir, standing for its newest checkpoint of either kind.

sample.py, export_hf.py and the entrypoints' init_from=<path> use it; resuming a run stays with each entrypoint,
which also restores the optimizer, RNG and data position.
"""

import os
import sys
import tempfile
import threading
import warnings

import torch

from model import GPT, GPTConfig


def find_checkpoint(path):
    """The checkpoint a path names: a file, a sharded folder, or a run folder's newest checkpoint."""
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, 'extra.pt')):
        latest = os.path.join(path, 'dcp', 'latest')
        if os.path.exists(latest):
            with open(latest) as f:
                return os.path.join(path, 'dcp', f.read().strip())
        return os.path.join(path, 'ckpt.pt')
    return path


def load_checkpoint(path, dropout=None):
    """Returns (model, checkpoint) for the checkpoint at path: the GPT with its weights (on the CPU; dropout as
    given, else as saved), and the checkpoint's small state (model_args, config, iter_num, ...). Raises
    FileNotFoundError where there is none, and other exceptions where it is damaged."""
    path = find_checkpoint(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path}")
    overrides = {} if dropout is None else {'dropout': dropout}
    if os.path.isdir(path):
        # a torch.distributed.checkpoint folder: its shards are read into a whole model, whatever wrote them
        import torch.distributed.checkpoint as dcp
        checkpoint = torch.load(os.path.join(path, 'extra.pt'), map_location='cpu', weights_only=True)
        model = GPT(GPTConfig(**{**checkpoint['model_args'], **overrides}))
        state = {'model': model.state_dict()}
        with warnings.catch_warnings():  # it says it assumes one process, which is what is meant
            warnings.simplefilter('ignore', UserWarning)
            dcp.load(state, checkpoint_id=path, no_dist=True)
        model.load_state_dict(state['model'])
    else:
        checkpoint = torch.load(path, map_location='cpu', weights_only=True)  # a checkpoint is data, never code
        model = GPT(GPTConfig(**{**checkpoint['model_args'], **overrides}))
        model.load_state_dict(GPT.upgrade_state_dict(checkpoint.pop('model')))
        checkpoint.pop('optimizer', None)
    return model, checkpoint


# -----------------------------------------------------------------------------
# Fault tolerance, shared by the entrypoints: writing in the background, node-local memory snapshots, and
# finding the newest state that loads.

def atomic_save(obj, path, keep_previous=False):
    """torch.save to path.tmp, then a rename: a crash mid-write leaves the old file. keep_previous moves the old
    one to ckpt.prev.pt first, a fallback should the new one ever turn out damaged."""
    with open(path + '.tmp', 'wb') as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    if keep_previous and os.path.exists(path):
        os.replace(path, previous(path))
    os.replace(path + '.tmp', path)


def previous(path):
    root, ext = os.path.splitext(path)
    return root + '.prev' + ext


_host_copies = {}  # path -> the host copy of the state last written there, reused so that no save allocates
_writers = {}  # path -> the thread writing it


def save_in_background(state, path, keep_previous=False):
    """Copies the state's tensors into host memory, which is all the caller waits for, and writes that copy to
    path (atomically) in a background thread, while training goes on changing the originals."""
    wait_for_saves(path)  # its host copy is about to be overwritten
    _host_copies[path] = host_copy(state, _host_copies.get(path))
    if any(t.is_cuda for t in tensors(state)):
        torch.cuda.synchronize()  # the copies into pinned memory were asynchronous

    def write():
        try:
            atomic_save(_host_copies[path], path, keep_previous)
        except Exception as e:  # the previous file is still in place; training goes on
            print(f"warning: writing {path} failed ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
    _writers[path] = threading.Thread(target=write, name=f'save {path}')
    _writers[path].start()


def wait_for_saves(path=None):
    for p in [path] if path else list(_writers):
        if p in _writers:
            _writers.pop(p).join()


def host_copy(obj, into=None):
    """obj with every tensor copied to the CPU (pinned when it comes from a GPU), into the tensors of an earlier
    copy where their shapes match."""
    if torch.is_tensor(obj):
        if torch.is_tensor(into) and into.shape == obj.shape and into.dtype == obj.dtype:
            return into.copy_(obj.detach(), non_blocking=True)
        out = torch.empty(obj.shape, dtype=obj.dtype, device='cpu', pin_memory=obj.is_cuda)
        return out.copy_(obj.detach(), non_blocking=True)
    if isinstance(obj, dict):
        return {k: host_copy(v, into.get(k) if isinstance(into, dict) else None) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        into = into if isinstance(into, (list, tuple)) and len(into) == len(obj) else [None] * len(obj)
        return type(obj)(host_copy(v, i) for v, i in zip(obj, into))
    return obj


def tensors(obj):
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors(v)


def snapshot_dir(run_id):
    """The node-local folder of a run's memory snapshots: /dev/shm lives in RAM, so it outlives a training
    process (killed, crashed, restarted by torchrun) but not a reboot or a lost node."""
    return os.path.join('/dev/shm' if os.path.isdir('/dev/shm') else tempfile.gettempdir(), f'nanogpt-{run_id}')


def newest_loadable(paths):
    """(iter_num, path, skipped) for the newest of the checkpoint files at paths that loads; missing ones are
    passed over, and damaged ones (truncated, corrupt, not a checkpoint) listed in skipped as (path, reason).
    (None, None, skipped) when none loads. With mmap only the file's index is read, not its tensors."""
    best, skipped = (None, None), []
    for path in paths:
        if not os.path.exists(path):
            continue
        try:
            it = int(torch.load(path, map_location='cpu', weights_only=True, mmap=True)['iter_num'])
        except Exception as e:
            skipped.append((path, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"))
            continue
        if best[0] is None or it > best[0]:
            best = (it, path)
    return (*best, skipped)
