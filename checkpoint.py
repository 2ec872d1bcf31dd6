"""
Reads the model out of any checkpoint this repo's entrypoints (or nanoGPT) write, in one process:

- a train.py ckpt.pt (also fsdp_train.py's consolidated one, and nanoGPT's own),
- an fsdp_train.py sharded folder (out_dir/dcp/step-N/, any world size or mesh wrote it),
- a run's out_dir, standing for its newest checkpoint of either kind.

sample.py, export_hf.py and the entrypoints' init_from=<path> use it; resuming a run stays with each entrypoint,
which also restores the optimizer, RNG and data position.
"""

import functools
import io
import os
import pathlib
import pickle
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
import uuid
import warnings
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist

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
    FileNotFoundError where there is none, and other exceptions (never a BaseException) where it is damaged."""
    path = find_checkpoint(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path}")
    overrides = {} if dropout is None else {'dropout': dropout}
    if os.path.isdir(path):
        # a torch.distributed.checkpoint folder: its shards are read into a whole model, whatever wrote them
        checkpoint = torch.load(os.path.join(path, 'extra.pt'), map_location='cpu', weights_only=True)
        model = GPT(GPTConfig(**{**checkpoint['model_args'], **overrides}))
        state = {'model': model.state_dict()}
        with warnings.catch_warnings():  # it says it assumes one process, which is what is meant
            warnings.simplefilter('ignore', UserWarning)
            dcp_load(state, path, no_dist=True)
        model.load_state_dict(state['model'])
    else:
        checkpoint = torch.load(path, map_location='cpu', weights_only=True)  # a checkpoint is data, never code
        model = GPT(GPTConfig(**{**checkpoint['model_args'], **overrides}))
        model.load_state_dict(GPT.upgrade_state_dict(checkpoint.pop('model')))
        checkpoint.pop('optimizer', None)
    return model, checkpoint


def reason_of(e):
    """Exception e in a few words on one line, for an error message or a warning. torch's refusal of a pickle that
    holds code advises loading it with weights_only=False, which would run that code: that is not passed on."""
    text = str(e).strip()
    if isinstance(e, pickle.UnpicklingError) and 'weights_only' in text:
        found = re.search(r'GLOBAL ([\w.]{1,100})', text)
        if found:
            return f"UnpicklingError: it holds objects other than tensors and plain data ({found[1]}), refused unread"
        return "UnpicklingError: it is no pickle of tensors and plain data"  # garbage, most likely
    return f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__


# -----------------------------------------------------------------------------
# DCP folders read as data. DCP unpickles a folder's .metadata, and the non-tensor values among its shards (the
# optimizer's settings), with no restriction: a planted one would run its code in whoever reads the folder.

@functools.cache
def _dcp_metadata_globals():
    """The names that DCP's metadata pickles, with what they stand for: its own dataclasses, torch.Size, dtypes,
    layouts (through torch's own helper) and the checkpoint's path."""
    from torch.distributed.checkpoint import filesystem, metadata
    names = {('torch.distributed.checkpoint.metadata', name): getattr(metadata, name) for name in (
        'Metadata', 'TensorStorageMetadata', 'BytesStorageMetadata', 'ChunkStorageMetadata', 'TensorProperties',
        'StorageMeta', 'MetadataIndex', '_MEM_FORMAT_ENCODING')}
    names[('torch.distributed.checkpoint.filesystem', '_StorageInfo')] = filesystem._StorageInfo
    names[('torch', 'Size')] = torch.Size
    names.update({('torch', name): v for name, v in vars(torch).items() if isinstance(v, torch.dtype)})
    names[('torch.serialization', '_get_layout')] = torch.serialization._get_layout  # a lookup by name
    for module in ('pathlib', 'pathlib._local'):  # the module that Python 3.13 and later names
        names.update({(module, name): getattr(pathlib, name) for name in ('PosixPath', 'PurePosixPath')})
    return names


class _DCPMetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        # only what is listed, taken from modules already imported: a name is never imported on a pickle's say
        if (module, name) in _dcp_metadata_globals():
            return _dcp_metadata_globals()[module, name]
        raise pickle.UnpicklingError(f"it names {module}.{name}, which DCP's metadata never holds")


def read_dcp_metadata(folder):
    """The Metadata of the DCP folder, read as data: refuses a .metadata that names anything but DCP's own types,
    or shards outside the folder; and a folder whose shards are missing or shorter than it says."""
    from torch.distributed.checkpoint.metadata import Metadata
    if not os.path.exists(os.path.join(folder, '.metadata')):
        raise ValueError("it has no .metadata, which DCP writes last: its save was cut short")
    with open(os.path.join(folder, '.metadata'), 'rb') as f:
        metadata = _DCPMetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise ValueError("its .metadata holds no DCP metadata")
    ends = {}
    for info in metadata.storage_data.values():
        name = getattr(info, 'relative_path', None)
        if not isinstance(name, str) or os.path.basename(name) != name or name in ('', '.', '..'):
            raise ValueError(f"its .metadata names a shard {name!r} that is not a file of the folder")
        ends[name] = max(ends.get(name, 0), info.offset + info.length)
    for name, end in ends.items():
        if not os.path.exists(os.path.join(folder, name)):
            raise ValueError(f"its shard {name} is missing")
        if os.path.getsize(os.path.join(folder, name)) < end:
            raise ValueError(f"{name} holds {os.path.getsize(os.path.join(folder, name))} bytes, not {end}")
    return metadata


def dcp_load(state, folder, **kwargs):
    """dcp.load(state) from the DCP folder, reading it as data: .metadata through read_dcp_metadata, the
    non-tensor values with weights_only. A failure is raised as what caused it: DCP's own CheckpointException is a
    BaseException, which `except Exception` would let through as a traceback."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import StorageMeta

    metadata = read_dcp_metadata(folder)  # its errors raised here, before DCP could log them with a traceback

    class Reader(dcp.FileSystemReader):
        def read_metadata(self):  # no rank argument, so DCP never falls back to a rank's own metadata file
            metadata.storage_meta = metadata.storage_meta or StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class Planner(dcp.DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            # read back with weights_only, then handed on re-saved: DCP's own code still puts it in place
            plain = io.BytesIO()
            torch.save(torch.load(value, map_location='cpu', weights_only=True), plain)
            plain.seek(0)
            super().load_bytes(read_item, plain)

    try:
        dcp.load(state, storage_reader=Reader(folder), planner=Planner(), **kwargs)
    except CheckpointException as e:
        raise next(iter(e.failures.values()))[0] from None  # what went wrong, on the first rank it went wrong on


# -----------------------------------------------------------------------------
# Fault tolerance, shared by the entrypoints: writing in the background, node-local memory snapshots, and
# finding the newest state that loads.

def incarnation_store(rank, world_size):
    """A store for init_process_group under torchrun's agents that this incarnation of the worker group alone uses.
    The agents' store outlives a restart, and gloo (NCCL too) would read the dead workers' addresses from it and fail
    the restart; nor can the restart count name the incarnation, since it differs between nodes (an agent that
    restarts its workers because another node's died counts no restart). So rank 0 serves a new store on a free
    port and posts its port and a new token in the agents' store; the other ranks take what is posted once the store
    there holds that token (a post left by the last incarnation names a dead rank 0's port)."""
    agents = dist.TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), world_size, is_master=False)
    if rank == 0:
        token = uuid.uuid4().hex
        store = dist.TCPStore(os.environ['MASTER_ADDR'], 0, world_size, is_master=True, wait_for_workers=False)
        store.set('token', token)
        agents.set('nanogpt/incarnation', f'{store.port} {token}')
        return store
    while True:
        port, token = agents.get('nanogpt/incarnation').decode().split()
        try:
            socket.create_connection((os.environ['MASTER_ADDR'], int(port)), timeout=2).close()  # a dead one refuses
            store = dist.TCPStore(os.environ['MASTER_ADDR'], int(port), world_size, is_master=False,
                                  timeout=timedelta(seconds=10))
            if store.get('token').decode() == token:  # not another store that took the port since
                store.set_timeout(timedelta(minutes=30))
                return store
        except (OSError, RuntimeError):  # an old post
            pass
        time.sleep(0.1)


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


_host_copies = {}  # slot -> the host copy of the state last saved in it, reused so that no save allocates
_writers = {}  # slot -> (the thread saving it, an event set once its copy of the state is complete)


def save_in_background(state, path, keep_previous=False, slot=None, then=None):
    """Saves the state to path (atomically) from a background thread, which first copies the state's tensors into
    host memory and then writes the copy. The caller goes on at once, but must call wait_for_copies() before it
    changes the state (the optimizer step): the copy overlaps the next forward and backward, which only read it.
    A checkpoint of several files (DeepSpeed's) gives lists of paths and of their states. slot names the host copy
    to reuse and the save to wait for first (by default the path; one slot for saves whose paths change). then,
    if given, runs in the thread once the files are written, with True, or False if one could not be."""
    slot = slot or path
    wait_for_saves(slot)  # its host copy is about to be overwritten
    copied = threading.Event()
    paths, states = (path, state) if isinstance(path, list) else ([path], [state])
    # On a GPU the copy gets a stream of its own: on the loop's stream it would queue between the next forward's
    # kernels and hold them up for as long as it takes. The stream first waits for the work queued so far (the last
    # optimizer step), which has to be recorded here, in the caller's thread, before more is queued.
    gpu, stream = next((t.device for t in tensors(states) if t.is_cuda), None), None
    if gpu is not None:
        stream = torch.cuda.Stream(gpu)
        stream.wait_stream(torch.cuda.current_stream(gpu))

    def save():
        ok = False
        try:
            try:
                with torch.cuda.stream(stream) if stream is not None else nullcontext():
                    _host_copies[slot] = host_copy(states, _host_copies.get(slot))
                if stream is not None:
                    stream.synchronize()  # the copies into pinned memory were asynchronous
            finally:
                copied.set()
            for p, s in zip(paths, _host_copies[slot]):
                atomic_save(s, p, keep_previous)
            ok = True
        except Exception as e:  # the previous file is still in place; training goes on
            print(f"warning: writing {slot} failed ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        finally:
            if then is not None:
                then(ok)  # always: it may be a collective that the other ranks' threads wait in
    thread = threading.Thread(target=save, name=f'save {slot}')
    thread.start()
    _writers[slot] = (thread, copied)


def wait_for_copies():
    for thread, copied in list(_writers.values()):
        copied.wait()


def wait_for_saves(slot=None):
    for p in [slot] if slot else list(_writers):
        if p in _writers:
            _writers.pop(p)[0].join()


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


def newest_loadable(paths, run_id=None, or_any=False):
    """(iter_num, path, skipped) for the newest of the checkpoints at paths (files, or folders as checkpoint_iter
    reads them) that loads; missing and incomplete ones are passed over, with run_id those of another run too (or,
    with or_any, only where that run has none), and damaged ones (truncated, corrupt, not a checkpoint) are listed in
    skipped as (path, reason). (None, None, skipped) when none loads. On a tie the first in paths wins."""
    if run_id is not None and or_any:
        found = newest_loadable(paths, run_id)
        return found if found[0] is not None else newest_loadable(paths)
    best, skipped = (None, None), []
    for path in paths:
        if not os.path.exists(path):
            continue
        try:
            it = checkpoint_iter(path, run_id)
        except Exception as e:
            skipped.append((path, reason_of(e)))
            continue
        if it is None:
            continue
        if best[0] is None or it > best[0]:
            best = (it, path)
    return (*best, skipped)


def checkpoint_iter(path, run_id=None):
    """The iteration of the checkpoint at path, or None while it is incomplete, or, given a run_id, where another run
    wrote it (one that a run started afresh over its out_dir left there); raises where it is damaged. A file
    is complete once it exists (every writer here renames a finished temporary file). A DCP folder (fsdp_train.py's)
    once it holds .metadata, which DCP writes last, after every rank's shards; its shards must be as long as
    .metadata says. A folder of per-rank files (decent_train.py's replicas) once every rank's file is in; they
    must agree on the iteration. With mmap only a file's index is read, not its tensors."""
    def iter_of(file):
        checkpoint = torch.load(file, map_location='cpu', weights_only=True, mmap=True)
        if run_id is not None and checkpoint.get('run_id', run_id) != run_id:  # older ones without an id count
            return None
        return int(checkpoint['iter_num'])
    if not os.path.isdir(path):
        return iter_of(path)
    if os.path.exists(os.path.join(path, '.metadata')) or os.path.exists(os.path.join(path, 'extra.pt')):
        if not os.path.exists(os.path.join(path, '.metadata')):
            return None
        read_dcp_metadata(path)  # raises where it is damaged, shards cut short among that
        return iter_of(os.path.join(path, 'extra.pt'))
    if not os.path.exists(os.path.join(path, 'rank-0.pt')):
        return None
    ranks = len(torch.load(os.path.join(path, 'rank-0.pt'), map_location='cpu', weights_only=True, mmap=True)['rng'])
    files = [os.path.join(path, f'rank-{r}.pt') for r in range(ranks)]
    if not all(os.path.exists(f) for f in files):
        return None
    iters = {iter_of(f) for f in files}
    if len(iters) != 1:
        raise ValueError(f"its ranks' files hold iterations {sorted(iters)}")
    return iters.pop()


def point_latest(folder):
    """Once the checkpoint folder out_dir/<kind>/step-N is complete: rewrites the latest file beside it to name it,
    and removes the older step folders (complete, cut short or damaged) but for the newest complete one, the
    fallback should this one ever turn out damaged. Newer ones (a save cut short, or one passed over as damaged at
    a resume) are left alone: another rank may be writing the next one already, and a save to the same step
    replaces them."""
    root, name = os.path.split(folder)
    latest = os.path.join(root, 'latest')
    with open(latest + '.tmp', 'w') as f:
        f.write(name)
    os.replace(latest + '.tmp', latest)
    fallback = None
    for old in sorted((f for f in os.listdir(root) if f.startswith('step-') and f < name), reverse=True):
        if fallback is None:
            try:
                if checkpoint_iter(os.path.join(root, old)) is not None:
                    fallback = old
                    continue
            except Exception:
                pass
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)
