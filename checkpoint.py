"""
Checkpoints, shared by every entrypoint and tool. Three parts:

- Reading the model out of any checkpoint this repo's entrypoints (or nanoGPT) write, in one process, for
  sample.py, export_hf.py and init_from=<path>: a train.py ckpt.pt (also the consolidated exports of fsdp_train.py,
  ds_train.py and decent_train.py, and nanoGPT's own), an fsdp_train.py sharded folder (any world size or mesh
  wrote it), or a run's out_dir, standing for its newest checkpoint (RUN/best: its best by val loss).
- Writing without stopping training: atomic files (the newest keep_checkpoints versions, and the best), copies to
  host memory and writes in background threads, node-local memory snapshots, and committing a checkpoint folder
  (every rank's files in, then `latest`, then the older folders pruned but keep_checkpoints - 1).
- Where a run starts: this run's newest complete state, found alike on every rank with damaged files skipped
  (find_resume), the model built from it or from init_from (create_model), and old optimizer layouts upgraded.

What goes into a checkpoint, and loading the optimizer, RNG and data position, stays in each entrypoint.
"""

import functools
import io
import os
import pathlib
import pickle
import re
import shutil
import sys
import tempfile
import threading
import uuid
import warnings
from contextlib import nullcontext

import torch
import torch.distributed as dist

from model import GPT, GPTConfig


def find_checkpoint(path):
    """The checkpoint a path names: a file, a sharded folder, a run folder's newest checkpoint, or with RUN/best
    the run's best by val loss (best.pt, else the sharded folder that its dcp/best names)."""
    run, name = os.path.split(os.path.normpath(path))
    if name == 'best' and not os.path.exists(path) and os.path.isdir(run or '.'):
        pointer = os.path.join(run, 'dcp', 'best')
        if os.path.exists(os.path.join(run, 'best.pt')) or not os.path.exists(pointer):
            return os.path.join(run, 'best.pt')
        with open(pointer) as f:
            return os.path.join(run, 'dcp', f.read().strip())
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


def reason(e):
    """Exception e in a few words on one line, for an error message or a warning. torch's refusal of a pickle that
    holds code advises loading it with the check turned off, which would run that code: that is not passed on."""
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

def atomic_save(obj, path, keep=1, best=None):
    """torch.save to path.tmp, then a rename: a crash mid-write leaves the old file. keep > 1 keeps that many
    versions: the older ones move down to ckpt.prev.pt, ckpt.prev2.pt, ... (the oldest beyond keep is replaced), a
    fallback should the new one ever turn out damaged; but a save of the iteration path holds replaces it. best, if
    given, names a file to hold this state too (a hard link: no file here is ever changed in place, so the two
    names never part)."""
    with open(path + '.tmp', 'wb') as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    for n in range(keep - 1, 0, -1) if not same_step(obj, path) else []:
        if os.path.exists(previous(path, n - 1)):
            os.replace(previous(path, n - 1), previous(path, n))
    os.replace(path + '.tmp', path)
    if best:
        same_file(path, best)


def same_step(obj, path):
    """Whether the checkpoint at path is of the same run and iteration as obj (a resumed run's first eval saves the
    state it resumed from again): it is replaced, not kept, so that no older state is pushed out for it."""
    if not isinstance(obj, dict) or 'iter_num' not in obj or not os.path.isfile(path):
        return False
    try:
        old = torch.load(path, map_location='cpu', weights_only=True, mmap=True)
        return (old['iter_num'], old.get('run_id')) == (obj['iter_num'], obj.get('run_id'))
    except Exception:
        return False  # damaged: kept aside like any older one


def same_file(path, to):
    """Makes `to` name the file at path (a hard link, or a copy where the filesystem has none), atomically."""
    if os.path.exists(to + '.tmp'):
        os.remove(to + '.tmp')  # our own temporary name, left by a crash
    try:
        os.link(path, to + '.tmp')
    except OSError:
        shutil.copyfile(path, to + '.tmp')
    os.replace(to + '.tmp', to)


def previous(path, n=1):
    """The n-th version before the file at path that atomic_save keeps: ckpt.prev.pt, ckpt.prev2.pt, ..."""
    if n == 0:
        return path
    root, ext = os.path.splitext(path)
    return root + '.prev' + (str(n) if n > 1 else '') + ext


def kept(path):
    """The versions of the file at path that atomic_save kept, newest first (those present): where a run looks
    for the state to resume."""
    folder, name = os.path.split(path)
    root, ext = os.path.splitext(name)
    found = {0: path}
    for f in os.listdir(folder or '.') if os.path.isdir(folder or '.') else []:
        m = re.fullmatch(re.escape(root) + r'\.prev(\d*)' + re.escape(ext), f)
        if m and m[1] != '1' and not m[1].startswith('0'):
            found[int(m[1] or 1)] = os.path.join(folder, f)
    return [found[n] for n in sorted(found)]


_host_copies = {}  # slot -> the host copy of the state last saved in it, reused so that no save allocates
_writers = {}  # slot -> (the thread saving it, an event set once its copy of the state is complete)


def save_in_background(state, path, keep=1, slot=None, then=None, best=None):
    """Saves the state to path (atomically) from a background thread, which first copies the state's tensors into
    host memory and then writes the copy. The caller goes on at once, but must call wait_for_copies() before it
    changes the state (the optimizer step): the copy overlaps the next forward and backward, which only read it.
    A checkpoint of several files (DeepSpeed's) gives lists of paths and of their states. slot names the host copy
    to reuse and the save to wait for first (by default the path; one slot for saves whose paths change). then,
    if given, runs in the thread once the files are written, with True, or False if one could not be. keep and best
    as atomic_save takes them."""
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
                atomic_save(s, p, keep, best)
            ok = True
        except Exception as e:  # the previous file is still in place; training goes on
            print(f"warning: writing {slot} failed ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        finally:
            if then is not None:
                then(ok)  # always: it may be a collective that the other ranks' threads wait in
    thread = threading.Thread(target=save, name=f'save {slot}')
    thread.start()
    _writers[slot] = (thread, copied)


def in_background(wait, slot, then):
    """For a save that another library writes in the background (DCP's): a thread calls wait() until it is
    written, then then(True), or then(False) if it failed. wait_for_saves(slot) waits for both."""
    wait_for_saves(slot)
    copied = threading.Event()
    copied.set()

    def finish():
        ok = False
        try:
            wait()
            ok = True
        except Exception as e:  # the previous checkpoint is still in place; training goes on
            print(f"warning: writing {slot} failed ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        then(ok)
    thread = threading.Thread(target=finish, name=f'save {slot}')
    thread.start()
    _writers[slot] = (thread, copied)


def commit(folder, ok, group, writer, iter_of=None, keep=2, best=False):
    """Called by each rank's writer thread once its files of the checkpoint folder are written (ok) or could not
    be: the ranks agree over group (a gloo group of the writer threads' own, since two threads' collectives on one
    group would pair up wrongly), and only if every rank's files are in does the writer point latest at the folder
    and prune the ones before (point_latest, with keep and best). A crash before leaves latest naming the previous
    folder."""
    written = torch.tensor(float(ok))
    dist.all_reduce(written, op=dist.ReduceOp.MIN, group=group)
    if written.item() and writer:
        point_latest(folder, iter_of, keep, best)


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


def newest_loadable(paths, run_id=None, or_any=False, iter_of=None):
    """(iter_num, path, skipped) for the newest of the checkpoints at paths (files, or folders as checkpoint_iter,
    or the iter_of given, reads them) that loads; missing and incomplete ones are passed over, with run_id those of
    another run too (or, with or_any, only where that run has none), and damaged ones (truncated, corrupt, not a
    checkpoint) are listed in skipped as (path, reason). (None, None, skipped) when none loads. On a tie the first
    in paths wins."""
    if run_id is not None and or_any:
        found = newest_loadable(paths, run_id, iter_of=iter_of)
        return found if found[0] is not None else newest_loadable(paths, iter_of=iter_of)
    best, skipped = (None, None), []
    for path in paths:
        if not os.path.exists(path):
            continue
        try:
            it = (iter_of or checkpoint_iter)(path, run_id)
        except Exception as e:
            skipped.append((path, reason(e)))
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


def step_folders(root):
    """The checkpoint folders root/step-N, newest first (none where root is missing)."""
    return [os.path.join(root, f) for f in sorted(os.listdir(root), reverse=True) if f.startswith('step-')] \
        if os.path.isdir(root) else []


def point_latest(folder, iter_of=None, keep=2, best=False):
    """Once the checkpoint folder out_dir/<kind>/step-N is complete: rewrites the latest file beside it to name it,
    and removes the older step folders (complete, cut short or damaged) but for the newest keep - 1 complete ones,
    the fallbacks should this one ever turn out damaged. Newer ones (a save cut short, or one passed over as damaged
    at a resume) are left alone: another rank may be writing the next one already, and a save to the same step
    replaces them. With best, the folder is also kept as best-step-N (hard links: never pruned, nor changed by a
    later save to step-N), which the best file names, in place of the best before."""
    root, name = os.path.split(folder)
    write_name(os.path.join(root, 'latest'), name)
    if best:
        before = read_name(os.path.join(root, 'best'))
        if os.path.exists(os.path.join(root, 'best.tmp')):
            shutil.rmtree(os.path.join(root, 'best.tmp'))  # our own temporary name, left by a crash
        shutil.copytree(folder, os.path.join(root, 'best.tmp'), copy_function=same_file)
        shutil.rmtree(os.path.join(root, 'best-' + name), ignore_errors=True)
        os.replace(os.path.join(root, 'best.tmp'), os.path.join(root, 'best-' + name))
        write_name(os.path.join(root, 'best'), 'best-' + name)
        if before and before != 'best-' + name and before.startswith('best-step-'):
            shutil.rmtree(os.path.join(root, before), ignore_errors=True)  # a better one has taken its place
    fallbacks = 0
    for old in sorted((f for f in os.listdir(root) if f.startswith('step-') and f < name), reverse=True):
        if fallbacks < keep - 1:
            try:
                if (iter_of or checkpoint_iter)(os.path.join(root, old)) is not None:
                    fallbacks += 1
                    continue
            except Exception:
                pass
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)


def write_name(path, name):
    with open(path + '.tmp', 'w') as f:
        f.write(name)
    os.replace(path + '.tmp', path)


def read_name(path):
    """The folder name a latest or best file holds, or None where there is none."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


# -----------------------------------------------------------------------------
# Where a run starts, shared by the entrypoints: this run's newest state (a memory snapshot or a checkpoint in
# out_dir), else the weights that init_from names.

def find_resume(out_dir, init_from, auto_resume, eval_only, snapshots, storage, where, iter_of=None):
    """(run_id, (iter_num, path) to resume from or None), the same on every rank (a collective). out_dir/run_id
    names the run; snapshots names this rank's snapshot files in the run's node-local folder (or is a function of
    the folder that lists their paths); storage is lists of paths in out_dir, which rank 0 reads (it must be
    storage every node shares): the first list that holds a loadable checkpoint gives the newest of them. A
    memory snapshot counts only at an iteration that every rank holds (a replaced node holds none; a rank killed
    while writing holds the one before) and the checkpoints do not pass. Damaged ones are skipped with a warning,
    or are an error where nothing else loads; init_from=resume with nothing to resume is an error naming where
    (what storage was looked for)."""
    rank = dist.get_rank()
    run_id, held, disk, damaged = None, {}, (None, None), []
    wanted = init_from == 'resume' or (auto_resume and not eval_only)  # an eval of another model is no resume
    run_id_path = os.path.join(out_dir, 'run_id')
    if wanted and os.path.isfile(run_id_path):
        with open(run_id_path) as f:
            run_id = f.read().strip()
        folder = snapshot_dir(run_id)
        for path in snapshots(folder) if callable(snapshots) else [os.path.join(folder, n) for n in snapshots]:
            it, _, bad = newest_loadable([path], iter_of=iter_of)
            damaged += bad
            if it is not None:
                held[it] = path
    if wanted and rank == 0:
        # this run's newest, not one of a run that it was started afresh over (that only when asked to resume)
        for paths in storage:
            *disk, bad = newest_loadable(paths, run_id=run_id, or_any=init_from == 'resume', iter_of=iter_of)
            damaged += bad
            if disk[0] is not None:
                break
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, (run_id, held, tuple(disk), damaged, uuid.uuid4().hex))
    run_id, _, (disk_iter, disk_path), _, new_id = views[0]
    damaged = [d for v in views for d in v[3]]
    mem_iter = max(set.intersection(*(set(v[1]) for v in views)), default=None)
    if run_id is not None and mem_iter is not None and all(v[0] == run_id for v in views) \
            and (disk_iter is None or mem_iter >= disk_iter):
        resume_from = (mem_iter, held[mem_iter])
    elif disk_iter is not None:
        run_id, resume_from = run_id or new_id, (disk_iter, disk_path)
    else:
        run_id, resume_from = new_id, None  # a fresh run gets a new id
    if resume_from is None and damaged:
        path, why = damaged[0]
        sys.exit(f"error: checkpoint {path} is corrupt or not a training checkpoint ({why}): delete it or restore "
                 f"a good copy (or start afresh over it with --auto_resume=False)")
    if resume_from is None and init_from == 'resume':
        sys.exit(f"error: no checkpoint at {where}: point --out_dir at a run's folder, or use --init_from=scratch")
    for path, why in damaged:
        print0(f"warning: skipping the damaged {path} ({why}); resuming from the newest one before it")
    if resume_from is not None and init_from != 'resume':
        print0(f"auto-resume: {out_dir} holds this run's state at iter {resume_from[0]}, so the run continues "
               f"(--auto_resume=False starts afresh)")
    return run_id, resume_from


def print0(*args):
    if dist.get_rank() == 0:
        print(*args, flush=True)


def remove_snapshots(run_id):
    """At the end of a run, once every rank's saves are written (out_dir holds the final state): the node's
    snapshots go, to free the RAM they hold."""
    dist.barrier()
    if int(os.environ.get('LOCAL_RANK', 0)) == 0:
        shutil.rmtree(snapshot_dir(run_id), ignore_errors=True)


SHAPE_KEYS = ('n_layer', 'n_head', 'n_embd', 'block_size', 'bias', 'vocab_size')
PRETRAINED = ('gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl')


def pretrained_or_exit(name, dropout=0.0):
    """OpenAI's GPT-2 (gpt2 ... gpt2-xl) from the Hugging Face hub, or a one-line error saying what is missing."""
    try:
        return GPT.from_pretrained(name, dict(dropout=dropout))
    except ImportError:
        sys.exit(f"error: init_from={name} needs Hugging Face transformers: pip install transformers")
    except OSError as e:
        sys.exit(f"error: could not load {name} from the Hugging Face hub ({reason(e)}): check the network, or set "
                 f"HF_HUB_OFFLINE=1 with the model in the local cache")


def checkpoint_or_exit(path, fix):
    """load_checkpoint(path) for a tool (dropout off), or a one-line error: where there is no checkpoint, naming
    fix; where it is damaged, saying so."""
    try:
        return load_checkpoint(path, dropout=0.0)
    except FileNotFoundError as e:
        sys.exit(f"error: {e}: {fix}")
    except Exception as e:
        sys.exit(f"error: checkpoint {find_checkpoint(path)} is corrupt or not a model checkpoint ({reason(e)}): "
                 f"delete it or restore a good copy")


def take_shape(model_args, ckpt_args, config, given):
    """The model's shape comes from the checkpoint; a key that says otherwise is a mistake, not a request. The
    config saved with the run (and the entrypoint's block_size, which sizes the batches) follow it."""
    for k in SHAPE_KEYS:
        if k in given and config[k] != ckpt_args[k]:
            sys.exit(f"error: {k}={config[k]!r} contradicts the checkpoint's {k}={ckpt_args[k]!r}: drop that "
                     f"setting to start from it, or use another out_dir to train a new model")
        model_args[k] = ckpt_args[k]
        if k in config:
            config[k] = ckpt_args[k]


def create_model(resume_path, read, init_from, model_args, config, given):
    """(model, checkpoint): the GPT to train, on the CPU, and the checkpoint it resumes (None for a new run).
    A resumed run reads its checkpoint with read(resume_path), whose model_args give the shape, and takes its
    weights from it ('model'; the shards of a checkpoint folder or a snapshot of 'shards' the entrypoint loads
    itself, once the model is sharded); init_from names
    OpenAI's GPT-2, or any entrypoint's checkpoint, whose weights start a new run; else a new model. Updates
    model_args (and config) to the model's shape; a block_size below the model's crops it."""
    checkpoint = None
    if resume_path is not None:
        try:
            checkpoint = read(resume_path)
            take_shape(model_args, checkpoint['model_args'], config, given)
            model = GPT(GPTConfig(**model_args))
            if 'model' in checkpoint or not (os.path.isdir(resume_path) or 'shards' in checkpoint):
                model.load_state_dict(GPT.upgrade_state_dict(checkpoint['model']))
        except Exception as e:
            sys.exit(f"error: checkpoint {resume_path} is corrupt or not a training checkpoint ({reason(e)}): delete "
                     f"it or restore a good copy")
    elif init_from in PRETRAINED:
        print0(f"initializing from OpenAI GPT-2 weights: {init_from}")
        model = pretrained_or_exit(init_from, model_args['dropout'])
        for k in ('n_layer', 'n_head', 'n_embd', 'bias', 'vocab_size'):
            model_args[k] = getattr(model.config, k)
    elif init_from != 'scratch':
        # any entrypoint's checkpoint, or a run folder's newest: its weights, with a new optimizer from step 0
        try:
            model, ckpt = load_checkpoint(init_from, dropout=model_args['dropout'])
            take_shape(model_args, ckpt['model_args'], config, given)
        except Exception as e:
            sys.exit(f"error: cannot read a checkpoint at {init_from} ({reason(e)}): give a ckpt.pt, a sharded "
                     f"checkpoint or a run folder")
        print0(f"initializing from the weights of {find_checkpoint(init_from)}")
    else:
        model = GPT(GPTConfig(**model_args))
    block_size = config['block_size']
    if block_size < model.config.block_size:
        model.crop_block_size(block_size)  # fine-tune GPT-2 with a shorter context
        model_args['block_size'] = block_size
    elif block_size > model.config.block_size:
        sys.exit(f"error: block_size={block_size} is longer than the model's {model.config.block_size} positions: "
                 f"use --block_size={model.config.block_size} or less")
    return model, checkpoint


def upgrade_optimizer_state(model, osd):
    """Takes the state dict of an optimizer that configure_optimizers built, here or in nanoGPT, and returns it
    for the model: nanoGPT's fused c_attn entries are split into c_q, c_k, c_v, whose parameters it
    ordered the same way otherwise. A state that fits neither layout, or not the parameters' shapes, raises."""
    ours = [n for group in model.param_groups() for n in group]
    # nanoGPT's order is ours with each c_q, c_k, c_v triple standing as one c_attn
    theirs = [n.replace('c_q', 'c_attn') for n in ours if '.c_k.' not in n and '.c_v.' not in n]
    count = sum(len(g['params']) for g in osd['param_groups'])
    if count not in (len(ours), len(theirs)) or len(osd['param_groups']) != 2:
        raise ValueError(f"the optimizer state holds {count} parameters in {len(osd['param_groups'])} groups; "
                         f"this model has {len(ours)} in 2")
    if count == len(ours):
        state = osd['state']
    else:
        index = {n: i for i, n in enumerate(ours)}
        state = {}
        for i, name in enumerate(theirs):
            if i not in osd['state']:
                continue
            s = osd['state'][i]
            if '.c_attn.' not in name:
                state[index[name]] = s
                continue
            for j, qkv in enumerate(('c_q', 'c_k', 'c_v')):
                state[index[name.replace('c_attn', qkv)]] = {
                    k: (v.chunk(3, dim=0)[j] if v.dim() > 0 else v).clone() if torch.is_tensor(v) else v
                    for k, v in s.items()}
    params = dict(model.named_parameters())
    for i, s in state.items():
        for k, v in s.items():
            if torch.is_tensor(v) and v.dim() > 0 and v.shape != params[ours[i]].shape:
                raise ValueError(f"optimizer state {k} of {ours[i]} has shape {tuple(v.shape)}, the parameter "
                                 f"{tuple(params[ours[i]].shape)}")
    if state is osd['state']:
        return osd
    groups, start = [], 0
    for g, names in zip(osd['param_groups'], model.param_groups()):
        groups.append({**g, 'params': list(range(start, start + len(names)))})
        start += len(names)
    return {'state': state, 'param_groups': groups}
