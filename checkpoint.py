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

import atexit
import functools
import io
import json
import math
import os
import pathlib
import pickle
import re
import shlex
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
import warnings
import zipfile
from contextlib import nullcontext
from types import SimpleNamespace

import torch
import torch.distributed as dist

from data import data_dir, meta_vocab, vocabulary
from model import GPT, GPTConfig
from oom import asked, is_oom
from runlock import (FOLDERS, HOLD, RUN_ID, in_ram, is_snapshot, kept_folder, launch_identity, launch_pods,
                     let_go, snapshot_dir, try_hold)


def find_checkpoint(path):
    """The checkpoint a path names: a file, a sharded folder, a run folder's newest checkpoint, with RUN/best
    the run's best by val loss (best.pt, else the sharded folder that its dcp/best names), or the folder that a
    <kind>/latest or <kind>/best file names."""
    run, name = os.path.split(os.path.normpath(path))
    if name in ('latest', 'best') and os.path.basename(run) in ('dcp', 'ds', 'decent') and os.path.isfile(path):
        # the file beside the step folders that names the newest or the best: the folder it names
        return os.path.join(run, _named(path, r'(best-)?step-\d+', 'step-N'))
    if name == 'best' and not os.path.exists(path) and os.path.isdir(run or '.'):
        pointer, best_pt = os.path.join(run, 'dcp', 'best'), os.path.join(run, 'best.pt')
        if not os.path.exists(pointer):
            return best_pt
        # (step-N: the step folder itself, which it names while a save of that step as the best again replaces
        # best-step-N, point_latest)
        name = _named(pointer, r'(best-)?step-\d+', 'best-step-N')
        # both, where one entrypoint continued another's run: the newer is the better (a best replaces one only
        # for a lower val loss, and a resumed run carries that loss on)
        return best_pt if _saved_iter(best_pt) >= int(name.split('-')[-1]) else os.path.join(run, 'dcp', name)
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, 'extra.pt')):
        (step, passed), ckpt = newest_step_folder(path), os.path.join(path, 'ckpt.pt')
        at = lambda folder: int(os.path.basename(folder)[5:])
        # the newer of it and ckpt.pt, which is newer where train.py continued the run from its export
        found = ckpt if step is None or _saved_iter(ckpt) > at(step) else step
        if passed and not os.path.exists(found):
            return passed[0]  # nothing whole: the folder latest names, whose error says what is wrong with it
        if passed and _saved_iter(ckpt) <= at(passed[0]) and (passed[0], found) not in _said:
            _said.add((passed[0], found))
            print(f"warning: passing over {passed[0]}, which {os.path.join(path, 'dcp', 'latest')} names, as it is "
                  f"not whole ({passed[1]}): reading {found}, the run's newest complete state, as its resume does",
                  file=sys.stderr, flush=True)
        return found
    return path


_said = set()  # the warnings given, each once however often a tool looks its path up


def newest_step_folder(run):
    """(the newest complete step folder in run/dcp, as the run's resume finds it, or None; (the folder that latest
    names, why it is not whole) where it is newer and passed over, else None). One newer than latest names (the run
    killed before it pointed latest at it) counts; the one latest names may have had its save killed mid-write, or a
    shard cut short since."""
    root, latest = os.path.join(run, 'dcp'), os.path.join(run, 'dcp', 'latest')
    named = os.path.join(root, _named(latest, r'step-\d+', 'step-N')) if os.path.exists(latest) else None
    whole = next((f for f in step_folders(root) if re.fullmatch(r'step-\d+', os.path.basename(f)) and _complete(f)),
                 None)
    if named is None or whole is not None and os.path.basename(whole) >= os.path.basename(named):
        return whole, None
    try:
        why = "its save did not complete" if checkpoint_iter(named) is None else None
    except Exception as e:
        why = reason(e)
    return (named, None) if why is None else (whole, (named, why))  # (whole now: a live run's save completed it)


def _named(pointer, pattern, what):
    """The folder name that a latest or best file holds. A name read from a file never leads out of its folder; a
    pointer that names none, or cannot be read (a folder in its place), is a ValueError, as for bad input."""
    try:
        with open(pointer) as f:
            name = f.read(100).strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{pointer} cannot be read ({reason(e)})") from None
    if not re.fullmatch(pattern, name):
        raise ValueError(f"{pointer} names {name[:40]!r}, not a {what} folder")
    return name


def _saved_iter(path):
    """The iteration of the checkpoint file at path; -1 where there is none, or it is damaged."""
    try:
        return int(torch.load(path, map_location='cpu', weights_only=True, mmap=True)['iter_num'])
    except Exception:
        return -1


def load_checkpoint(path, dropout=None):
    """Returns (model, checkpoint) for the checkpoint at path: the GPT with its weights (on the CPU; dropout as
    given, else as saved), and the checkpoint's small state (model_args, config, iter_num, ...). Raises
    FileNotFoundError where there is none, and other exceptions (never a BaseException) where it is damaged. A
    run folder stands for its newest ckpt.pt that loads: a damaged one is passed over for the version before it
    (ckpt.prev.pt, ...), with a warning, as a resume does. Where a run in progress moves its latest (or best) on
    while its folder is read, and prunes the step folder it named, the newest is read again."""
    return read_checkpoint(path, dropout)[:2]


def read_checkpoint(path, dropout=None):
    """load_checkpoint's (model, checkpoint) and the file or folder read: a version before a damaged ckpt.pt."""
    found = find_checkpoint(path)
    try:
        return _load_newest(path, found, dropout)
    except Exception:
        if found != path and find_checkpoint(path) != found:
            return read_checkpoint(path, dropout)
        raise


def _load_newest(path, found, dropout):
    versions = run_versions(path, found) or ([found] if os.path.exists(found) else [])
    if not versions:
        raise FileNotFoundError(f"no checkpoint at {found}")
    for version in versions:
        try:
            model, checkpoint = _load(version, dropout)
        except Exception as e:
            if version == versions[-1] or is_oom(e):  # (short of memory: no damage, nor cause to read an older one)
                e.checkpoint_path = version  # the file that failed, for the error (checkpoint_or_exit)
                raise
            print(f"warning: {version} is damaged ({reason(e)}): passed over for the version before it",
                  file=sys.stderr, flush=True)
            continue
        if version != found:
            print(f"warning: reading {version} (iter {checkpoint.get('iter_num')}), since the run's newest ckpt.pt "
                  f"is missing or damaged", file=sys.stderr, flush=True)
        if 'optimizers' in checkpoint:  # decent_train.py's file of one rank: its replica is not the run's model
            print(f"note: {version} is one rank's own replica, not the run's model, which is "
                  + ("DiLoCo's global model (the replica moves away from it within a window)"
                     if 'diloco' in checkpoint else "the replicas' average") + ": the run folder's ckpt.pt holds that",
                  file=sys.stderr, flush=True)
        return model, checkpoint, version


def run_versions(path, found):
    """Where path is a run folder whose newest checkpoint is found, its ckpt.pt: the versions of it that are there,
    newest first, which a tool tries in turn; else []."""
    if not (os.path.isdir(path) and os.path.basename(found) == 'ckpt.pt'):
        return []
    return [v for v in kept(found) if os.path.exists(v)]


def _load(path, dropout):
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
    line = text.splitlines()[0] if text else ''
    if len(line) > 200:  # torch's advice runs on (a truncated ckpt.pt): its first sentences, not half of one
        line = line[:line.rfind('. ', 0, 200) + 1] or line[:200]
    return f"{type(e).__name__}: {line}" if line else type(e).__name__


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
    names never part). A write that fails (a full disk) removes its temporary file, which would hold the space that
    the next start needs, and raises. The folder is made here where it is missing (a memory snapshot's, in /dev/shm),
    so that a folder that cannot be made (a read-only or full /dev/shm) fails the write like any other cause."""
    os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
    _writing.add(path + '.tmp')
    with open(path + '.tmp', 'wb') as f:
        errors = []

        def write(data):  # torch.save reports a failed write as an "unexpected pos": the exception says why (an
            try:              # OSError, or a Ctrl-C's KeyboardInterrupt, raised here where Python checks for signals)
                return f.write(data)
            except BaseException as e:
                errors.append(e)
                raise
        # a Ctrl-C may be raised as write is entered, before its try, and torch.save leaves only its "unexpected
        # pos": the default handler's KeyboardInterrupt is recorded (a handler runs in the main thread alone)
        handler = signal.getsignal(signal.SIGINT)
        hooked = threading.current_thread() is threading.main_thread() and handler is signal.default_int_handler

        def interrupted(signum, frame):
            errors.append(KeyboardInterrupt())
            raise errors[-1]
        try:
            if hooked:
                signal.signal(signal.SIGINT, interrupted)
            torch.save(obj, SimpleNamespace(write=write, flush=f.flush))
            f.flush()
            os.fsync(f.fileno())
        except BaseException as e:
            os.remove(path + '.tmp')
            raise (errors[0] if errors else e) from None
        finally:
            if hooked:
                signal.signal(signal.SIGINT, handler)
    # a save that crashed between linking ckpt.pt as ckpt.prev.pt and replacing it has moved the versions down already
    moved = os.path.exists(path) and os.path.exists(previous(path)) and os.path.samefile(path, previous(path))
    # one saved in a run of float16 overflows (keep.keeping) replaces the newest where that holds the same weights, and
    # the first after a taken step prunes the version kept besides it
    newest = _header(path)
    same = same_step(obj, path) or skipped(obj) and newest is not None and weights_of(newest) == weights_of(obj)
    try:
        for n in range(keep - 1, 0, -1) if not same and not moved else []:
            if os.path.exists(previous(path, n - 1)):
                # the newest becomes ckpt.prev.pt as a second name (a link), so that path names a whole checkpoint
                # at every moment, which a crash here leaves to the tools that read it
                (same_file if n == 1 else os.replace)(previous(path, n - 1), previous(path, n))
        os.replace(path + '.tmp', path)
        _writing.discard(path + '.tmp')
        if newest is not None and skipped(newest) and not skipped(obj) and os.path.exists(previous(path, keep)):
            os.remove(previous(path, keep))
    except BaseException:
        if os.path.exists(path + '.tmp'):  # a Ctrl-C may come once it is renamed
            os.remove(path + '.tmp')  # a copy in place of a link that did not fit: the space goes back, path is whole
        raise
    if best:
        same_file(path, best)


def _header(path):
    """The checkpoint at path with its tensors unread (mmap), or None where there is none or it does not load."""
    try:
        return torch.load(path, map_location='cpu', weights_only=True, mmap=True) if os.path.isfile(path) else None
    except Exception:
        return None


def skipped(obj):
    """The steps skipped in a row before a checkpoint was saved (float16's overflows, keep.skips_save), 0 for most."""
    return obj.get('skipped', 0) if isinstance(obj, dict) else 0


def weights_of(obj):
    """(run id, the iteration whose weights a checkpoint holds): skipped steps leave them as the step before did."""
    return obj.get('run_id'), obj['iter_num'] - skipped(obj) if 'iter_num' in obj else None


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
    if os.path.exists(to) and os.path.samefile(path, to):
        return  # so it does (a rename onto another name of the same file would do nothing, and leave the .tmp)
    if os.path.exists(to + '.tmp'):
        os.remove(to + '.tmp')  # our own temporary name, left by a crash
    try:
        os.link(path, to + '.tmp')
    except OSError:
        try:
            shutil.copyfile(path, to + '.tmp')
        except BaseException:
            if os.path.isfile(to + '.tmp'):
                os.remove(to + '.tmp')  # a copy cut short (a full disk): to is as it was
            raise
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
_failed = []  # (path, reason) of each storage checkpoint of this process that could not be written
_writing = set()  # the temporary files that atomic_save is writing (or left by a failure, which removes them itself)


def remove_unfinished_writes():
    """Removes the temporary files of the checkpoints being written, for a process that leaves at once (a second
    Ctrl-C) and takes their writers with it: a half-written file is no state, and one the size of a checkpoint
    holds space (or, in /dev/shm, memory) that the next start needs. The newest whole checkpoint is never touched."""
    for tmp in list(_writing):
        try:
            os.remove(tmp)
        except OSError:  # renamed into place a moment ago, or removed by its writer
            pass


def note_failure(paths, e):
    """A write failed (in the background, or as a save began). A memory snapshot's is a warning: the storage
    checkpoints are intact, and a restart resumes from them (only the snapshot's shortcut is lost). A storage
    checkpoint's stops the run: the loop learns of it at its next agree() or at finish_saves(), and exits on every
    rank (exit_after_failed_save)."""
    failures = getattr(e, 'failures', None)  # DCP's CheckpointException: what went wrong, on the first rank
    why = reason(next(iter(failures.values()))[0] if isinstance(failures, dict) and failures else e)
    if 'unexpected pos' in why and _nearly_full(paths[0]):  # torch's serializer, on a write that fell short
        why = f"No space left on device, as it seems ({why})"
    if is_oom(e):  # the copy of the state in host memory that the write starts from
        why = "out of host RAM copying the state for it" + (f", asking {asked(e)} more" if asked(e) else "")
    if all(is_snapshot(p) for p in paths):
        print(f"warning: the memory snapshot {paths[0]} could not be written ({why}); training goes on, and a "
              f"restart would resume from the newest storage checkpoint", file=sys.stderr, flush=True)
    else:
        _failed.append((next(p for p in paths if not is_snapshot(p)), why))


def _nearly_full(path):
    """Whether the file system that path is on (or would be) has less than 1 MiB free."""
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path or '.')
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < 2**20


def _step_folder(path):
    """The step folder (out_dir/<kind>/step-N) that path is or lies in, or None."""
    for folder in (path, os.path.dirname(path)):
        if re.fullmatch(r'step-\d+', os.path.basename(folder)):
            return folder
    return None


def _intact(path):
    """The newest complete checkpoint that a failed write to path left, as the next start resumes it: of the step
    folder that latest names (the one beside a step folder that failed; those of every kind for a ckpt.pt) and the
    ckpt.pt in its place, the newer (on a tie the folder). Where ckpt.pt is an export (decent_train.py's, pp_train.py's,
    ds_train.py's), the step folder saved before it at that iteration is the newest state, and a newer export of a
    save whose step folder did not fit is the newest in turn (its folder's files removed, it fitted): "no checkpoint
    was complete" was untrue, and so was the older one named. decent_train.py's resume takes its folders first (its
    ckpt.pt holds the replicas' average): ckpt.pt only where latest names none."""
    folder = _step_folder(path)
    out_dir = os.path.dirname(os.path.dirname(folder) if folder else path)
    ckpt = os.path.join(out_dir, 'ckpt.pt')
    folders = [_latest_of(os.path.dirname(folder))] if folder else \
        [_latest_of(os.path.join(out_dir, kind)) for kind in sorted(set(FOLDERS.values()))]
    # (the folder latest names even where it is gone: removed as cut short, its error says it is not whole)
    found = [p for p in folders if p and (folder or os.path.exists(p))] + [ckpt] * os.path.exists(ckpt)
    if folder and os.path.basename(os.path.dirname(folder)) == 'decent' and found and found[0] != ckpt:
        return found[0]

    def newest(p):
        try:
            it = _whole_iter(p, None) if os.path.isdir(p) else checkpoint_iter(p)
        except Exception:  # damaged: the resume passes over it
            it = None
        return -1 if it is None else it
    return max(found, key=newest, default=None)


def _latest_of(root):
    """The step folder that root/latest names, or None."""
    latest = os.path.join(root, 'latest')
    if os.path.isfile(latest):
        with open(latest, errors='replace') as f:
            return os.path.join(root, f.read().strip())
    return None


def pruned_under_eval(path, out_dir):
    """An eval_only run reads a live run's newest state without holding out_dir: where that run saved newer ones
    and pruned it meanwhile (the step folder gone or going, latest naming another), the read's failure is no
    damage, and the error says so rather than advise moving a live run's folder aside."""
    latest = _latest_of(os.path.dirname(path)) if _step_folder(path) == path else None
    if not os.path.exists(path) or latest not in (None, path):
        sys.exit(f"error: the run in {out_dir} saved a newer checkpoint and pruned {path} while this eval read it: "
                 f"run the eval again, which reads the newest (or evaluate a copy of one with --init_from)")


def load_failed(path, e, out_dir, eval_only):
    """Exits in one line where the state a run resumes (path) does not load into its model or optimizer (e): an
    eval's read of a state that the live run pruned meanwhile is no damage (pruned_under_eval); anything else is a
    damaged or foreign checkpoint, to be moved aside (for an eval, which moving it would leave nothing to read:
    restored, or another one evaluated). Running short of memory is no damage: that error goes on (oom.py)."""
    if is_oom(e):
        raise e
    if eval_only:
        pruned_under_eval(path, out_dir)
    sys.exit(f"error: checkpoint {path} does not fit this model ({reason(e)}): {aside_or_restore(eval_only)}")


def aside_or_restore(eval_only):
    """The fix for a run's checkpoint that does not load. Not, for an eval, to move it aside: the eval would then
    score a new, untrained model (or the version before), as if it were the run's."""
    return "restore a good copy to evaluate it, or evaluate another checkpoint with --init_from" if eval_only else \
        "move it aside (mv, to a name of your own) or restore a good copy"


def _complete(folder):
    try:
        return checkpoint_iter(folder) is not None
    except Exception:
        return False


def _whole_step_iter(folder, kind, run_id):
    """The iteration of a step folder of ds_train.py or decent_train.py (kind 'ds', 'decent') where it is whole and
    of the run (run_id, None: any), as far as a tool can tell without DeepSpeed (whose classes its optimizer files
    hold), else None: decent_train.py's as its resume reads it (checkpoint_iter: every rank's file in, of one
    iteration); ds_train.py's where its model states are among its files, each a whole archive (torch's zip, whose
    index at its end a file cut short lacks), whose model states say they are the run's, as its resume reads them."""
    try:
        if kind == 'decent':
            return checkpoint_iter(folder, run_id)
        files = sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith('.pt'))
        for path in files:
            zipfile.ZipFile(path).close()
        return next((checkpoint_iter(f, run_id) for f in files if f.endswith('model_states.pt')), None)
    except Exception:
        return None


def _whole_iter(folder, run_id):
    """The iteration of a step folder of any entrypoint where it is whole and of the run (run_id, None: any), as far
    as a tool can tell, else None."""
    kind = os.path.basename(os.path.dirname(folder))
    if kind in ('ds', 'decent'):
        return _whole_step_iter(folder, kind, run_id)
    try:
        return checkpoint_iter(folder, run_id)
    except Exception:
        return None


def _whole(path):
    """Whether the checkpoint at path (a file, or a step folder of any entrypoint) is complete and loads, as far as
    a tool can tell."""
    kind = os.path.basename(os.path.dirname(path)) if _step_folder(path) == path else None
    if kind in ('ds', 'decent'):
        return _whole_step_iter(path, kind, None) is not None
    return os.path.exists(path) and _complete(path)


def save_failed():
    """Whether a storage checkpoint of this process could not be written."""
    return bool(_failed)


def exit_after_failed_save():
    """Every rank calls this once the ranks have agreed that one of them could not write a storage checkpoint: the
    saves still in flight are finished first (the newest complete checkpoint stays as it is: a failed write leaves
    the one before in place and removes its temporary files), then each rank whose write failed exits with the
    one-line error, the others with a non-zero status only."""
    wait_for_saves()
    dist.barrier()
    if _failed:
        path, why = _failed[0]
        folder, intact = _step_folder(path), _intact(path)
        # what was written of it: a folder cut short. Not the one latest names where the file that failed is there
        # still: written again into that whole folder (a new best's state, at the step it resumed from), it is the old
        if folder is not None and os.path.isdir(folder) and not (folder == intact and os.path.exists(path)) \
                and not _complete(folder):
            shutil.rmtree(folder, ignore_errors=True)
        before = f"the newest complete one, {intact}, is intact" if intact else "no checkpoint was complete before"
        if intact and not _whole(intact):  # damaged, and removed to be written anew: the resume passes over it
            older = next((p for p in (step_folders(os.path.dirname(intact)) if _step_folder(intact) == intact else
                                      kept(intact)) if p != intact and _whole(p)), None)
            named = ", which latest names," if _step_folder(intact) == intact else ""
            before = f"{intact}{named} is not whole (it was damaged, and this save was writing it anew); " + \
                (f"the newest complete one before it, {older}, is intact" if older else "none before it is complete")
        fix = "free host RAM (the save copies the whole state there first)" if why.startswith('out of host RAM') \
            else "free space (or fix the folder)"
        sys.exit(f"error: writing the checkpoint {path} failed ({why}), so the run stopped; {before}: {fix} and run "
                 f"the same command again to resume")
    sys.exit(1)


def finish_saves():
    """The end of a run, on every rank (a collective): waits for the saves in flight, and stops as
    exit_after_failed_save does where any rank's storage checkpoint could not be written."""
    wait_for_saves()
    failed = [None] * dist.get_world_size()
    dist.all_gather_object(failed, save_failed())
    if any(failed):
        exit_after_failed_save()


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
        except Exception as e:  # the previous file is still in place
            note_failure(paths, e)
        finally:
            if then is not None:
                try:
                    then(ok)  # always: it may be a collective that the other ranks' threads wait in
                except Exception as e:  # pointing latest at the folder
                    note_failure(paths, e)
    thread = threading.Thread(target=save, name=f'save {slot}')
    thread.start()
    _writers[slot] = (thread, copied)


def in_background(wait, slot, then, path=None):
    """For a save that another library writes in the background (DCP's, into path): a thread calls wait() until
    it is written, then then(True), or then(False) if it failed. wait_for_saves(slot) waits for both."""
    wait_for_saves(slot)
    copied = threading.Event()
    copied.set()

    def finish():
        ok = False
        try:
            wait()
            ok = True
        except BaseException as e:  # the previous checkpoint is still in place (DCP's failure is a BaseException)
            note_failure([path or slot], e)
        try:
            then(ok)
        except Exception as e:
            note_failure([path or slot], e)
    thread = threading.Thread(target=finish, name=f'save {slot}')
    thread.start()
    _writers[slot] = (thread, copied)


def commit(folder, ok, group, writer, iter_of=None, keep=2, best=False, weights=None):
    """Called by each rank's writer thread once its files of the checkpoint folder are written (ok) or could not
    be: the ranks agree over group (a gloo group of the writer threads' own, since two threads' collectives on one
    group would pair up wrongly), and only if every rank's files are in does the writer point latest at the folder
    and prune the ones before (point_latest, with keep, best and weights). A crash before leaves latest naming the
    previous folder. Returns whether this rank pointed latest at it."""
    written = torch.tensor(float(ok))
    dist.all_reduce(written, op=dist.ReduceOp.MIN, group=group)
    if written.item() and writer:
        point_latest(folder, iter_of, keep, best, weights)
        return True
    return False


def wait_for_copies():
    for thread, copied in list(_writers.values()):
        copied.wait()


def wait_for_saves(slot=None):
    for p in [slot] if slot else list(_writers):
        if p in _writers:
            _writers.pop(p)[0].join()


def host_copy(obj, into=None, _memo=None):
    """obj with every tensor copied to the CPU (pinned when it comes from a GPU), into the tensors of an earlier
    copy where their shapes match. A tensor that appears twice (the tied head's weight is the token embedding's) is
    copied once and appears twice in the copy too, so a save writes it once, as torch.save of the live state does."""
    memo = {} if _memo is None else _memo
    if torch.is_tensor(obj):
        key = (obj.device, obj.data_ptr(), obj.dtype, tuple(obj.shape), obj.stride()) if obj.numel() else None
        if key in memo:
            return memo[key]
        # an earlier copy's tensor that holds another's copy already (shared there, apart here) is not written over
        if torch.is_tensor(into) and into.shape == obj.shape and into.dtype == obj.dtype \
                and all(into is not t for t in memo.values()):
            out = into.copy_(obj.detach(), non_blocking=True)
        else:
            out = torch.empty(obj.shape, dtype=obj.dtype, device='cpu', pin_memory=obj.is_cuda)
            out.copy_(obj.detach(), non_blocking=True)
        if key is not None:
            memo[key] = out
        return out
    if isinstance(obj, dict):
        return {k: host_copy(v, into.get(k) if isinstance(into, dict) else None, memo) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        into = into if isinstance(into, (list, tuple)) and len(into) == len(obj) else [None] * len(obj)
        return type(obj)(host_copy(v, i, memo) for v, i in zip(obj, into))
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


def read_run_id(path):
    """The run id in the file at path. It names a folder (snapshot_dir), so it is checked like any name read from a
    file: one that could lead out of that folder (a planted `../..`) is an error, never a path."""
    try:
        with open(path, encoding='utf-8') as f:
            run_id = f.read(200).strip()
    except (OSError, UnicodeDecodeError) as e:
        sys.exit(f"error: cannot read {path} ({reason(e)}): delete it (the run then resumes from its checkpoints)")
    if not RUN_ID.fullmatch(run_id):
        sys.exit(f"error: {path} holds {run_id[:40]!r}, which is no run id (letters, digits, - and _): delete it "
                 f"(the run then resumes from its checkpoints)")
    return run_id


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
            if is_oom(e):  # a good checkpoint that this process has no memory to read: not one to pass over
                raise
            skipped.append((path, reason(e)))
            continue
        if it is None:
            continue
        if best[0] is None or it > best[0]:
            best = (it, path)
    return (*best, skipped)


def launch_of(layout):
    """The LAYOUT of a rank's snapshot (rank-R-of-LAYOUT.pt) as the launch that reads it back: fsdp_train.py's DPxTP,
    pp_train.py's DPxPPpp (DPxPPxTPpp with tensor parallel stages), decent_train.py's world size."""
    sizes = [int(n) for n in re.findall(r'\d+', layout)]
    mesh = f" --pp_size={sizes[1]}" + (f" --tp_size={sizes[2]}" if len(sizes) == 3 else '') if layout.endswith('pp') \
        else f" --tp_size={sizes[1]}" if len(sizes) == 2 else ''
    return f"{math.prod(sizes)} ranks" + (f" and{mesh}" if mesh else '')


RANK_FILE = re.compile(r'rank-(\d+)-of-(.+?)(\.prev\d*)?\.pt')  # a rank's snapshot: its rank, its layout, its version


def other_layouts(folder, names, mine=lambda path: True, script=None):
    """(found, passed): the loadable snapshots in a run's snapshot folder that another layout of ranks wrote
    (rank-R-of-LAYOUT.pt, where LAYOUT differs from that of names, this rank's), as (iter_num, path, LAYOUT, R); the
    damaged are passed over, and those that mine (saved_for) says a copy of the run's folder saved, which passed says
    are there. Only script's: another entrypoint's are others_snapshot's, whose error names that entrypoint (no
    layout of this one reads them)."""
    layout = lambda name: (m := RANK_FILE.fullmatch(name)) and m.group(2)
    ours = {layout(n) for n in names}
    if None in ours or not ours or not os.path.isdir(folder):
        return [], False
    theirs = sorted(os.path.join(folder, n) for n in os.listdir(folder) if layout(n) not in ours | {None})
    theirs = [p for p in theirs if script is None or wrote(p, script)]
    runs = [p for p in theirs if mine(p)]
    found = [(newest_loadable([p])[0], p, *RANK_FILE.fullmatch(os.path.basename(p)).group(2, 1)) for p in runs]
    return [(it, p, layout, int(r)) for it, p, layout, r in found if it is not None], len(runs) < len(theirs)


def others_snapshot(folder, script, mine=lambda path: True):
    """(iter_num, path, writer) of the newest snapshot in a run's snapshot folder that another entrypoint than
    script wrote, in a form that script does not read and other_layouts does not see: train.py's ckpt.pt,
    ds_train.py's step folder (the one its latest names), and the others' rank-R-of-LAYOUT.pt files.
    (None, None, None) where there is none; damaged ones, and those that mine (saved_for) says a copy of the run's
    folder saved, are passed over. Ranks' files count at the newest step that every rank with a file here holds:
    a rank killed mid-write holds the step before."""
    found, ranks = [], {}  # ranks: {layout: {rank: {iter_num: path}}}
    if not os.path.isdir(folder):
        return None, None, None
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        newest = read_name(path) if name == 'latest' and script != 'ds_train.py' else None
        rank = RANK_FILE.fullmatch(name)
        try:
            if name == 'ckpt.pt' and script != 'train.py':
                found.append((checkpoint_iter(path), path, writer_of(path)))
            elif rank and not wrote(path, script) and mine(path):
                ranks.setdefault(rank.group(2), {}).setdefault(int(rank.group(1)), {})[checkpoint_iter(path)] = path
            elif re.fullmatch(r'step-\d{1,12}', newest or '') and os.path.isdir(os.path.join(folder, newest)):
                found.append((int(newest[5:]), os.path.join(folder, newest), 'ds_train.py'))
        except Exception:
            continue  # damaged
    for held in ranks.values():
        it = max(set.intersection(*(set(its) for its in held.values())) - {None}, default=None)
        if it is not None:
            found.append((it, held[min(held)][it], writer_of(held[min(held)][it])))
    found = [f for f in found if f[0] is not None and mine(f[1])]
    return max(found, key=lambda f: f[0], default=(None, None, None))


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


def step_folders(root, prefix='step-'):
    """The checkpoint folders root/step-N (prefix 'best-step-': the kept bests), newest first (none where root is
    missing). Only those named so: a copy a user keeps beside them (step-N.bak, step-N keep) is none, which a resume
    would read and pruning remove."""
    return [os.path.join(root, f) for f in sorted(os.listdir(root), reverse=True)
            if re.fullmatch(re.escape(prefix) + r'\d+', f)] if os.path.isdir(root) else []


def folder_run(folder):
    """The run id that the files of a step folder carry, read from the first that loads of its extra.pt (DCP),
    rank-K.pt (any rank's, decent_train.py) and model-states file (DeepSpeed), else the run_id that its save wrote
    first (mark_run); '' where that file holds none (saved before runs had ids, which counts as any run's), None
    where no file tells: none there (a folder copied in by hand without them), or none loads."""
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    for name in (n for n in names if n == 'extra.pt' or re.fullmatch(r'rank-\d+\.pt', n) or
                 n.endswith('model_states.pt')):
        try:
            return str(torch.load(os.path.join(folder, name), map_location='cpu', weights_only=True,
                                  mmap=True).get('run_id') or '')
        except Exception:  # damaged: another file may tell
            continue
    # a save cut short before its first file (temporaries alone): the run it names as it begins (mark_run)
    return read_name(os.path.join(folder, 'run_id')) if 'run_id' in names else None


def mark_run(folder, run_id):
    """Where a save begins the step folder (before any rank writes into it): the run's id in it, so that a save cut
    short before its first file (a kill leaves temporaries, or one rank's optimizer shard) is the run's own: pruned,
    not set aside as unknown-run-step-N at every resume, one more each crash, until the disk fills."""
    try:
        os.makedirs(folder, exist_ok=True)
        write_name(os.path.join(folder, 'run_id'), run_id)
    except OSError:
        pass  # a full disk: the save's own files fail next, and say so


def same_run(folder, run_id):
    """Whether the step folder is provably of the run run_id (folder_run's; None: no run's), as pruning needs before
    it removes one: its files say so, or they hold no id (saved before runs had ids). A folder whose run no file
    tells is not, unless it holds nothing at all: there is nothing in it to lose."""
    theirs = folder_run(folder)
    if theirs is None:
        return os.path.isdir(folder) and not os.listdir(folder)
    return '' in (theirs, run_id) or theirs == run_id


def point_latest(folder, iter_of=None, keep=2, best=False, weights=None):
    """Once the checkpoint folder out_dir/<kind>/step-N is complete: rewrites the latest file beside it to name it,
    and removes the older step folders of its run (complete, cut short or damaged) but for the newest keep - 1
    complete ones, the fallbacks should this one ever turn out damaged: one that another run saved (copied in by
    hand), or whose run no file tells (same_run), is never removed, nor counted. Newer ones (a save cut short, or
    one passed over as damaged at a resume) are left alone: another rank may be writing the next one already, and a
    save to the same step replaces them. With best, the folder is also kept as best-step-N (hard links: never
    pruned, nor changed by a later save to step-N), which the best file names, in place of the best before (the
    run's own alone). The best file names a whole folder at every moment: while best-step-N of a step saved as the
    best again is replaced, the step folder itself. weights (a save in a run of float16 overflows, keep.keeping: a
    function of an older folder, whether it holds the same weights): those are removed, not counted."""
    root, name = os.path.split(folder)
    write_name(os.path.join(root, 'latest'), name)
    mine = folder_run(folder)  # the run's own id, which pruning asks of every folder it would remove
    if best:
        # the folder's copy under a name of its own: best.tmp is the best file's (write_name), which a copy by that
        # name left by a kill would stop from being written, at every later start
        before, tmp, kept_as = read_name(os.path.join(root, 'best')), os.path.join(root, 'best-copy.tmp'), \
            os.path.join(root, 'best-' + name)
        for left in (tmp, os.path.join(root, 'best.tmp')):  # our own temporary names, left by a crash
            if os.path.isdir(left) and not os.path.islink(left):
                shutil.rmtree(left)
            elif os.path.lexists(left):
                os.remove(left)
        if os.path.exists(kept_as):  # the step saved as the best again: no rename replaces a folder that holds files,
            write_name(os.path.join(root, 'best'), name)  # so best names the same state, whole, while it is replaced
        try:
            shutil.copytree(folder, tmp, copy_function=same_file)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # copies that did not fit (no links)
            raise
        shutil.rmtree(kept_as, ignore_errors=True)
        os.replace(tmp, kept_as)
        write_name(os.path.join(root, 'best'), 'best-' + name)
        # a better one has taken its place (or a crash mid-replacement left its copy, named step-N in best); a name
        # read from a file never leads out of its folder
        stale = before and 'best-' + before.removeprefix('best-')
        if stale and stale != 'best-' + name and re.fullmatch(r'best-step-\d+', stale) and \
                same_run(os.path.join(root, stale), mine):
            shutil.rmtree(os.path.join(root, stale), ignore_errors=True)
    fallbacks, named = 0, read_name(os.path.join(root, 'best'))
    # (a step folder that best names, after a crash mid-replacement, is the best: kept until a better one comes)
    for old in [f for f in map(os.path.basename, step_folders(root)) if f < name and f != named]:
        if not same_run(os.path.join(root, old), mine):
            continue  # another run's, copied in by hand, or one whose run no file tells: kept, and no fallback
        if fallbacks < keep - 1:
            try:  # (not one of the same weights as this, which it replaces)
                if (iter_of or checkpoint_iter)(os.path.join(root, old)) is not None and \
                        not (weights and weights(os.path.join(root, old))):
                    fallbacks += 1
                    continue
            except Exception:
                pass
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)


def write_name(path, name):
    """Writes the folder name that a latest or best file holds, whole or not at all."""
    try:
        with open(path + '.tmp', 'w') as f:
            f.write(name)
        os.replace(path + '.tmp', path)
    except BaseException:
        if os.path.isfile(path + '.tmp'):
            os.remove(path + '.tmp')  # a full disk, a name not to be replaced: the file still names the folder before
        raise


def read_name(path):
    """The folder name a latest or best file holds, or None where there is none."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def kept_best(out_dir, run_id, best_val_loss):
    """best_val_loss, or the lower val loss of a best this run keeps in out_dir (best.pt, <kind>/best): a resume
    from an older state than its newest (one damaged, or moved away by hand) carries that state's best_val_loss,
    and an eval between the two would have replaced the better best. The lowest over the ranks, so that all agree
    on each eval's save (a collective)."""
    for path in [os.path.join(out_dir, 'best.pt')] + [os.path.join(out_dir, kind, read_name(os.path.join(
            out_dir, kind, 'best')) or 'best') for kind in sorted(set(FOLDERS.values()))]:
        for file in [path] if os.path.isfile(path) else [os.path.join(path, f) for f in ('extra.pt', 'rank-0.pt')]:
            try:
                saved = torch.load(file, map_location='cpu', weights_only=True, mmap=True)
                if saved.get('run_id') == run_id and saved.get('val_loss') is not None:
                    best_val_loss = min(best_val_loss, float(saved['val_loss']))
            except Exception:  # none there, or damaged: it is no best to keep
                pass
    if not dist.is_initialized():
        return best_val_loss
    each = [None] * dist.get_world_size()
    dist.all_gather_object(each, best_val_loss)
    return min(each)


# -----------------------------------------------------------------------------
# Where a run starts, shared by the entrypoints: this run's newest state (a memory snapshot or a checkpoint in
# out_dir), else the weights that init_from names.

# Each entrypoint's storage in out_dir: a folder of step folders of its own (`latest` names the newest complete
# one; train.py has none), and beside them the whole ckpt.pt (and ckpt.prev.pt) that every entrypoint reads:
# train.py's own checkpoint, the others' export. The config saved in a checkpoint tells its writer by a key that
# only that entrypoint has.
# pp_train.py's DCP folders are fsdp_train.py's: each resumes the other's (the model's own parameter names). FOLDERS is
# runlock's, which the tools that import no torch check their outputs against (configurator.runs_own)
OWN_KEY = {'pp_train.py': 'pp_size', 'fsdp_train.py': 'tp_size', 'ds_train.py': 'zero_stage',
           'decent_train.py': 'topology'}


def writer_of(path):
    """The entrypoint that wrote the checkpoint file at path, from its saved config."""
    config = torch.load(path, map_location='cpu', weights_only=True, mmap=True).get('config', {})
    return next((script for script, key in OWN_KEY.items() if key in config), 'train.py')


def wrote(path, script):
    """Whether script wrote the file at path (or it cannot tell: a damaged file is judged where it is loaded)."""
    try:
        return writer_of(path) == script
    except Exception:
        return True


def others_newest(out_dir, script):
    """(iter_num, folder, writer) of the newest complete state in out_dir that another entrypoint than script
    keeps in a folder of its own (the step folder its `latest` names), or None."""
    newest = None
    for writer, kind in FOLDERS.items():
        latest = os.path.join(out_dir, kind, 'latest')
        if kind == FOLDERS.get(script) or not os.path.isfile(latest):
            continue
        with open(latest, errors='replace') as f:
            name = f.read().strip()
        found = re.fullmatch(r'step-(\d{1,12})', name)
        if found and os.path.isdir(os.path.join(out_dir, kind, name)) and (newest is None or
                                                                            int(found[1]) > newest[0]):
            folder = os.path.join(out_dir, kind, name)
            if os.path.isfile(os.path.join(folder, 'extra.pt')):  # fsdp_train.py's or pp_train.py's
                try:
                    writer = writer_of(os.path.join(folder, 'extra.pt'))
                except Exception:
                    pass
            newest = (int(found[1]), folder, writer)
    return newest


def misplaced(out_dir, storage):
    """A one-line reason where something stands in out_dir where the entrypoints write a file (a ckpt.pt that is
    a folder) or a folder of step folders (a dcp that is a file): every save there would fail, or move it; a run's
    own out_dir there (out/ds, out/ds/zero2), which a start afresh would move aside with the state it took it for. And a
    config.json that no run wrote (a Hugging Face export's): the run would write its own over it."""
    kinds = [os.path.join(out_dir, k) for k in sorted(set(FOLDERS.values()))]
    for path in [p for paths in storage for p in paths] + [os.path.join(out_dir, 'best.pt')] + kinds:
        if path.endswith('.pt') and os.path.exists(path) and not os.path.isfile(path):
            return f"{path} is a folder, where the checkpoint file goes"
        if not path.endswith('.pt') and os.path.exists(path) and not os.path.isdir(path):
            return f"{path} is a file, where a folder of checkpoints goes"
    for kind in kinds:  # a run of its own (out/ds for a DeepSpeed run), or a folder of runs: a start afresh here would
        # move them, under them. No step folder holds a config.json
        inner = sorted(os.path.join(kind, n) for n in os.listdir(kind)) if os.path.isdir(kind) else []
        run = next((r for r in [kind] + inner if os.path.isfile(os.path.join(r, 'config.json'))), None)
        if run:
            inside = '' if run == kind else f', inside {kind}'
            return f"{run} is another run's out_dir (its config.json says so){inside}, where a run in {out_dir} " \
                "keeps its checkpoints"
    for path in [os.path.join(kind, name) for kind in kinds for name in ('latest', 'best')]:
        if os.path.exists(path) and not os.path.isfile(path):  # the save that points it at its folder would fail
            return f"{path} is a folder, where the file that names the {os.path.basename(path)} step folder goes"
    for name in ('run_id', 'config.json'):  # (a metrics.jsonl that is not a file is set aside: runlog.read_log)
        path = os.path.join(out_dir, name)
        if os.path.exists(path) and not os.path.isfile(path):
            return f"{path} is a folder, where the run's {name} goes"
    path = os.path.join(out_dir, 'config.json')
    if os.path.isfile(path):
        try:
            with open(path, encoding='utf-8') as f:
                ours = 'out_dir' in json.loads(f.read(1 << 20))  # every run's config.json holds its settings
        except (OSError, ValueError, TypeError):
            ours = False
        if not ours:
            return f"{path} is not a run's config.json (a Hugging Face export's?), and a run would write over it"
    return None


def where_saved(out_dir):
    """What a saved state holds of the folder it is saved for (saved_for): its real path, and its inode and device,
    which a rename or a move within its disk keeps and a copy never has (None on a node where it is not there)."""
    st = os.stat(out_dir) if os.path.isdir(out_dir) else None
    return {'out_dir': os.path.realpath(out_dir), 'out_dir_ino': st and st.st_ino, 'out_dir_dev': st and st.st_dev}


def saved_for(snapshot, out_dir, run_id, state_of=None, say=True):
    """Whether the memory snapshot (a file, or a folder that state_of reads: ds_train.py's) was saved by the run in
    out_dir. A copy of a run's folder (cp -r, to branch an experiment) holds the same run_id, which names the
    snapshot folder: each run resumed the other's snapshots, a state it never trained, and went on to push its own
    checkpoints out. A snapshot is this run's where it was saved for this folder: the same real path, or the same
    inode on the same device (the folder renamed or moved on its disk). A copy is another inode, also once the folder
    it was copied from is deleted, or another device (a filesystem's snapshot of it). An older snapshot holds no
    inode (only its real path, or its config's out_dir as given): it is the other copy's where the folder it names
    is another one that holds this run's id. say: a note where it is not."""
    try:
        state = state_of(snapshot) if os.path.isdir(snapshot) else \
            torch.load(snapshot, map_location='cpu', weights_only=True, mmap=True)
        # its out_dir's real path: the config's as given, where a relative one names another folder from another
        # working folder (a copied project folder, each copy run from its own); older ones hold only that
        saved = state.get('out_dir') or state.get('config', {}).get('out_dir')
        ino, dev = state.get('out_dir_ino'), state.get('out_dir_dev')
    except Exception:
        return True  # unreadable here (or a folder with no state_of): newest_loadable has judged it already
    if saved is None or os.path.realpath(saved) == os.path.realpath(out_dir):
        return True
    if ino is not None:
        # the same inode number on another filesystem is another folder: a btrfs or ZFS snapshot or clone of this
        # one keeps its inode numbers (older snapshots hold no device)
        if ino == os.stat(out_dir).st_ino and dev in (None, os.stat(out_dir).st_dev):
            return True
    else:
        try:  # the other folder's, read as data: whatever it holds, only this run's id makes it a copy
            with open(os.path.join(saved, 'run_id'), encoding='utf-8') as f:
                if f.read(200).strip() != run_id:
                    return True
        except (OSError, UnicodeDecodeError):
            return True
    if int(os.environ.get('LOCAL_RANK', 0)) == 0 and say:
        print(f"note: passing over the memory snapshot {snapshot}, which a run in {saved} saved (its folder was "
              f"copied from this one's, or this one's from it): this run resumes from its own checkpoints", flush=True)
    return False


def kept_snapshots(out_dir):
    """The folders in out_dir of its run's memory snapshots kept there out of RAM, each node's (keep_earlier_snapshots,
    runlock.kept_folder): by a start afresh over the run (moved into before-RUN_ID/ with its other saved states),
    which the run continued there (--out_dir=RUN/before-RUN_ID) resumes, or by the start of a copy of out_dir that
    found them in the RAM the two share (kept-): the run resumes them as it would in RAM."""
    names = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []
    return [p for p in (os.path.join(out_dir, n) for n in names) if kept_folder(p) and os.path.isdir(p)]


def say_resumed(path, iter_num, max_iters, eval_only, print0):
    """The resume's line. A run started again once done (or with max_iters lowered below its state) has nothing to
    train: it evaluates and ends, which the line says, as the auto-resume line before it says that the run continues."""
    where = '' if iter_num < max_iters or eval_only else 'at' if iter_num == max_iters else 'past'
    print0(f"resuming from {path} at iter {iter_num}" + (f", {where} max_iters={max_iters}: the run evaluates and "
                                                         f"ends (raise --max_iters to train on)" if where else ""))


def find_resume(out_dir, init_from, auto_resume, eval_only, snapshots, storage, where, iter_of=None, script=None,
                state_of=None, whole=None, check=None):
    """(run_id, (iter_num, path) to resume from or None), the same on every rank (a collective). out_dir/run_id
    names the run; snapshots names this rank's snapshot files in the run's node-local folder (or is a function of
    the folder that lists their paths); storage is lists of paths in out_dir, which rank 0 reads (it must be
    storage every node shares): the first list that holds a loadable checkpoint gives the newest of them, unless a
    later list holds a newer one that another entrypoint wrote (the run went on there). A
    memory snapshot counts only at an iteration that every rank holds (a replaced node holds none; a rank killed
    while writing holds the one before) and the checkpoints do not pass. Damaged ones are skipped with a warning,
    or are an error where nothing else loads; init_from=resume with nothing to resume is an error naming where
    (what storage was looked for). script is the entrypoint: a start that would not continue the newest state that
    another entrypoint keeps in out_dir is an error naming it (a new run over it would cut its log and, once it
    resumed there, prune its folders). eval_only with init_from=scratch evaluates the run's newest state. state_of
    reads a snapshot folder's own state (saved_for). whole: where a node's snapshot is the whole state (train.py's),
    (the path in out_dir, the versions kept there): the newest that a node holds, where not every rank does (a node
    replaced, the job back on other nodes, a write cut short on one), is saved there, and every rank resumes it.
    check(resume_from) is the entrypoint's own refusal, made before the start is announced."""
    rank = dist.get_rank()
    run_id, held, disk, damaged, others, wrong, foreign = None, {}, (None, None), [], None, None, ([], False)
    other = (None, None, None)  # the newest snapshot of another entrypoint, which this one does not read
    passed = False  # a snapshot of a copy of this run's folder lies in the run's snapshot folder
    theirs = []  # the names of those in it, on the node's first rank
    busy = None  # where a live run of a copy of this run's folder holds that folder: who
    first = int(os.environ.get('LOCAL_RANK', 0)) == 0
    if not eval_only:  # (an eval holds no out_dir, and writes nothing there)
        if rank == 0:
            put_back_earlier_run(out_dir)
        dist.barrier()  # before any rank reads out_dir
    # an eval of another model is no resume; an eval of out_dir (init_from=scratch) is one of its newest state
    wanted = init_from == 'resume' or (auto_resume and (not eval_only or init_from == 'scratch'))
    # a start afresh that its launcher restarts (a worker lost under torchrun, a SLURM requeue, a container restarted
    # by Kubernetes) goes on with the run it began: afresh again, each restart would set aside the steps since and
    # train from step 0
    relaunch = not auto_resume and not eval_only and relaunched(out_dir)
    wanted = wanted or bool(relaunch)
    run_id_path = os.path.join(out_dir, 'run_id')
    # the run there, read before rank 0 moves it (keep_earlier_run); an eval of another model has no business with it
    earlier = read_run_id(run_id_path) if os.path.isfile(run_id_path) and (wanted or not eval_only) else None
    if wanted and os.path.isfile(run_id_path):
        run_id = read_run_id(run_id_path)
        folder = snapshot_dir(run_id)
        # a copy of this folder running on this node writes its snapshots there too: while it lives, this run
        # neither moves them nor writes its own (each would replace the other's), nor removes the folder at its end
        busy = try_hold(folder, "a run of a copy of this run's folder") if first and not eval_only else None
        # its snapshots in RAM, and those kept in its out_dir (kept_snapshots: its own, from its own folder)
        wheres = [folder] + kept_snapshots(out_dir)
        mine = lambda where, say=True: (lambda path: where != folder or saved_for(path, out_dir, run_id, state_of,
                                                                                  say=say))
        for kept_in in wheres:  # (not `where`: that names the checkpoint for init_from=resume's error)
            for path in snapshots(kept_in) if callable(snapshots) else [os.path.join(kept_in, n) for n in snapshots]:
                it, _, bad = newest_loadable([path], iter_of=iter_of)
                damaged += bad
                if it is not None and mine(kept_in)(path):
                    held[it] = path if kept_in == folder or it not in held else held[it]  # the one in RAM first
                elif it is not None:
                    passed = True
        # another layout's, which this one cannot read: a copy's are passed over and kept, as those of this layout
        layouts = [other_layouts(where, [] if callable(snapshots) else snapshots, mine(where), script)
                   for where in wheres]
        foreign = ([f for found, _ in layouts for f in found], any(copys for _, copys in layouts))
        # and another entrypoint's
        other = max((others_snapshot(where, script, mine(where, say=False)) for where in wheres),
                    key=lambda v: -1 if v[0] is None else v[0])
        if first and os.path.isdir(folder) and not busy:
            # all of them, those that the listing above leaves out too (a DeepSpeed step folder past its latest)
            theirs = [n for n in sorted(os.listdir(folder))
                      if not saved_for(os.path.join(folder, n), out_dir, run_id, state_of, say=False)]
        passed = passed or foreign[1] or bool(theirs)
    if rank == 0:
        wrong = misplaced(out_dir, storage)
        others = others_newest(out_dir, script)
    if wanted and rank == 0 and not wrong:
        # this run's newest, not one of a run that it was started afresh over (that only when asked to resume)
        for paths in storage:
            *found, bad = newest_loadable(paths, run_id=run_id, or_any=init_from == 'resume', iter_of=iter_of)
            damaged += bad  # a later list's too (decent_train.py's ckpt.pt): set aside, never moved down its versions
            if found[0] is None:
                continue
            if disk[0] is None or found[0] > disk[0] and os.path.isfile(found[1]) and writer_of(found[1]) != script:
                disk = found
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, (run_id, held, tuple(disk), damaged, uuid.uuid4().hex, others, wrong, foreign[0],
                                  passed, busy, other))
    run_id, _, (disk_iter, disk_path), _, new_id, others, wrong, _, _, _, _ = views[0]
    if wrong:
        sys.exit(f"error: {wrong}: move it out of {out_dir} (nothing was changed)")
    damaged = [d for v in views for d in v[3]]
    mem_iter = max(set.intersection(*(set(v[1]) for v in views)), default=None)
    if run_id is not None and mem_iter is not None and all(v[0] == run_id for v in views) \
            and (disk_iter is None or mem_iter >= disk_iter):
        resume_from = (mem_iter, held[mem_iter])
    elif disk_iter is not None:
        run_id, resume_from = run_id or new_id, (disk_iter, disk_path)
    else:
        run_id, resume_from = new_id, None  # a fresh run gets a new id
    # (iter, -rank) of the newest whole snapshot that a node holds (rank: the first that holds it)
    newest = max(((it, -r) for r, v in enumerate(views) if v[0] == views[0][0] for it in v[1]), default=None)
    promote = whole and wanted and not eval_only and newest and (resume_from is None or newest[0] > resume_from[0])
    if promote:
        run_id, resume_from = views[0][0], (newest[0], whole[0])
    # the run's newest state in snapshots of another layout, which this one cannot read: starting without it (afresh,
    # under a new run id) would strand them in /dev/shm, so the layout that wrote them has to save it first. Only
    # where this job's nodes hold it for every rank of that layout: one that lacks some ranks' (a kill during the round
    # of saves, a node lost, the job back on fewer nodes) no layout resumes here
    found = {f for v in views for f in v[7]}
    ranks = lambda it, layout: {f[3] for f in found if f[0] == it and f[2] == layout}
    it, path, layout = max(((it, path, layout) for it, path, layout, _ in found
                            if ranks(it, layout) == set(range(math.prod(map(int, re.findall(r'\d+', layout)))))),
                           default=(None, None, None))
    part = max(found, default=None)
    if part and (resume_from is None or resume_from[0] < part[0]) and (it is None or it < part[0]):
        print0(f"note: the memory snapshot {part[1]} (iter {part[0]}) of another layout lacks some ranks' of that "
               f"step, cut short by a kill or on nodes not in this job (a node lost, or the job back on fewer nodes): "
               f"no layout resumes it here")
    if it is not None and (resume_from is None or resume_from[0] < it) and eval_only:
        # (an eval started afresh evaluates a new model, and keeps nothing in out_dir)
        sys.exit(f"error: this run's newest state (iter {it}) is the memory snapshot {path} of another layout, which "
                 f"only that layout reads: evaluate it with the layout in its name ({launch_of(layout)}, the same "
                 f"flags)")
    if it is not None and (resume_from is None or resume_from[0] < it):
        sys.exit(f"error: this run's newest state (iter {it}) is the memory snapshot {path} of another layout, which "
                 f"only that layout reads: resume with the layout in its name ({launch_of(layout)}) and let it save a "
                 f"checkpoint to {out_dir} (SIGTERM does) before changing it, or start afresh with "
                 f"--auto_resume=False (the snapshots are then kept in {out_dir})")
    # an eval of a run's newest state is the eval of the entrypoint that reads it (one started afresh is refused)
    # (quoted where the shell would split it: a name with spaces)
    evaluate = lambda writer: f"evaluate it with `{writer} --out_dir={shlex.quote(out_dir)} --eval_only=True` (under " \
                              f"torchrun as before)"
    if others and (resume_from is None or resume_from[0] < others[0]) and wanted and eval_only:
        it, folder, writer = others
        sys.exit(f"error: {out_dir} holds a run of {writer}, whose newest state ({folder}, iter {it}) {script} cannot "
                 f"read: {evaluate(writer)}")
    if others and (resume_from is None or resume_from[0] < others[0]) and not eval_only:
        it, folder, writer = others
        sys.exit(f"error: {out_dir} holds a run of {writer}, whose newest state ({folder}, iter {it}) "
                 f"{script} cannot resume: continue it with `{writer} --out_dir={shlex.quote(out_dir)}` (under "
                 f"torchrun as before), or start a new run from its weights with "
                 f"--init_from={shlex.quote(out_dir)} and another --out_dir")
    it, path, writer = max((v[10] for v in views), key=lambda v: -1 if v[0] is None else v[0])
    if it is not None and (resume_from is None or resume_from[0] < it) and eval_only:
        sys.exit(f"error: this run's newest state (iter {it}) is the memory snapshot {path} of {writer}, which "
                 f"{script} does not read: {evaluate(writer)}")
    if it is not None and (resume_from is None or resume_from[0] < it):
        sys.exit(f"error: this run's newest state (iter {it}) is the memory snapshot {path} of {writer}, which "
                 f"{script} does not read: continue the run with `{writer} --out_dir={shlex.quote(out_dir)}` "
                 f"(under torchrun as before) and let it save a checkpoint to {out_dir} (SIGTERM does) before "
                 f"switching, or start afresh with --auto_resume=False (the snapshots are then kept in {out_dir})")
    if resume_from is None and damaged:
        path, why = damaged[0]
        afresh = "" if eval_only else " (or start afresh over it with --auto_resume=False)"
        sys.exit(f"error: checkpoint {path} is corrupt or not a training checkpoint ({why}): "
                 f"{aside_or_restore(eval_only)}{afresh}")
    if resume_from is None and init_from == 'resume':
        sys.exit(f"error: no checkpoint at {where}: point --out_dir at a run's folder, or use --init_from=scratch")
    # the copy's snapshots share this run's folder in /dev/shm: this run's saves would replace them and its end
    # would remove them, the copy's newest state where it was killed; they (and not this run's own beside them) are
    # kept in out_dir first. Where they cannot be, or the copy is running, the run takes no snapshots of its own
    if any(v[9] for v in views):
        _copy_in_ram.append(snapshot_dir(run_id))
        who = next(v[9] for v in views if v[9])
        print0(f"warning: {who}: this run takes no memory snapshots of its own while that run lasts (each would "
               f"replace the other's), and leaves that folder as it is")
    elif any(v[8] for v in views) and not eval_only:
        kept = [None] * dist.get_world_size()
        dist.all_gather_object(kept, keep_earlier_snapshots(out_dir, run_id, 'copy', theirs))
        if not all(kept):
            _copy_in_ram.append(snapshot_dir(run_id))
    for path, why in damaged:
        print0(f"warning: skipping the damaged {path} ({why}); resuming from the newest one before it")
    # only for a run that continues: a new one moves an earlier run's files aside as they are (keep_earlier_run)
    if wanted and not eval_only and resume_from is not None:  # the same on every rank
        moved = [set_aside_damaged(out_dir, damaged, earlier, resume_from[1]) if rank == 0 else None]
        if rank == 0 and earlier:  # (the id in out_dir/run_id: a folder without one has no other run's to tell)
            set_aside_others(out_dir, earlier, resume_from[1])
        dist.broadcast_object_list(moved)  # renamed before any rank reads the state it resumes from
        resume_from = (resume_from[0], moved[0].get(resume_from[1], resume_from[1]))
    if check:
        check(resume_from)
    if promote:
        why = [None]
        if rank == -newest[1]:
            try:
                # mmap: its tensors are read from the file (in RAM already) as they are written, never held twice
                state = torch.load(held[newest[0]], map_location='cpu', weights_only=True, mmap=True)
                atomic_save(state, whole[0], whole[1])
                print(f"the memory snapshot {held[newest[0]]} on {socket.gethostname()} (iter {newest[0]}) is the "
                      f"run's newest state, which not every node holds: saved as {whole[0]}, which every rank "
                      f"resumes from", flush=True)
            except Exception as e:
                why = [f"error: the run's newest state, the memory snapshot {held[newest[0]]} on "
                       f"{socket.gethostname()} (iter {newest[0]}), which not every node holds, could not be saved "
                       f"as {whole[0]} ({reason(e)}): free space there and restart"]
        dist.broadcast_object_list(why, src=-newest[1])
        if why[0]:
            sys.exit(why[0])
    if eval_only and resume_from is not None:
        print0(f"eval_only: evaluating the newest state of the run in {out_dir}, {resume_from[1]} at iter "
               f"{resume_from[0]}; nothing in {out_dir} is written but its eval rows in metrics.jsonl")
    elif eval_only and init_from == 'scratch' and auto_resume:  # a mistyped out_dir: an untrained model's loss,
        # read as the run's; who wants that loss says so with --auto_resume=False (no run to resume, on purpose)
        sys.exit(f"error: eval_only: {out_dir} holds no saved state of a run to evaluate: point --out_dir at a run's "
                 f"folder, or evaluate a checkpoint or GPT-2 with --init_from=PATH or --init_from=gpt2 "
                 f"(--auto_resume=False evaluates a new, untrained model)")
    elif eval_only and init_from == 'scratch':
        print0("eval_only: --auto_resume=False: evaluating a new, untrained model")
    elif resume_from is not None and relaunch and init_from != 'resume':
        print0(f"auto-resume: {out_dir} holds the state of the run that this launch started (iter {resume_from[0]}), "
               f"and {relaunch}, so it continues: --auto_resume=False started it afresh over the run before, never "
               f"over itself")
    elif resume_from is not None and init_from != 'resume':
        # init_from names where a new run starts, which this one did long ago: one who meant a new run is told
        start = "--auto_resume=False starts afresh" if init_from == 'scratch' else \
            f"not from --init_from={init_from}, a new run's start: give another --out_dir for one, or " \
            f"--auto_resume=False to set this run aside in {out_dir}"
        print0(f"auto-resume: {out_dir} holds this run's state at iter {resume_from[0]}, so the run continues "
               f"({start})")
    if resume_from is None and not eval_only:  # a new run: what earlier runs saved here is kept, out of its way
        # a run asked to resume that finds nothing it can read (a lost node's half of a sharded snapshot, and no
        # checkpoint) starts afresh too, under a new id: what the old id's folder holds is kept likewise, not left
        # holding RAM (a live copy's, or a copy's that did not fit, stays)
        if earlier and (not wanted or not holds_a_copys_snapshots()):
            keep_earlier_snapshots(out_dir, earlier, state_of=state_of)
            dist.barrier()  # every node's are in out_dir before rank 0 moves them in with the run's other states
        kept = [keep_earlier_run(out_dir, earlier) if rank == 0 else None]
        dist.broadcast_object_list(kept)  # moved before any rank writes there; every rank learns where
        if kept[0]:
            _kept[os.path.abspath(out_dir)] = kept[0]
    if first and not eval_only and not holds_a_copys_snapshots():
        try_hold(snapshot_dir(run_id), "a run of a copy of this run's folder")  # a new run's (held above otherwise)
    return run_id, resume_from


def relaunched(out_dir):
    """Why this start is a restart of the launch that started, or last resumed, the run in out_dir (as runlog.open_log
    writes it into config.json), or None where it is not: its launcher's restart (torchrun's of its workers, a SLURM
    requeue: their restart counts, on any rank) of that launch (a torchrun job's rendezvous, a SLURM job), or a pod
    of that launch running again (Kubernetes restarted its container in place, which counts no restart, or another
    pod's restart made its torchrun restart its workers: runlock.launch_pods). A collective. A new launch of the same
    name (a second command in one SLURM allocation, a torchrun job started again with its --rdzv-id, a Kubernetes job
    deleted and made again) is no restart."""
    again = [any(int(os.environ.get(k) or 0) > 0 for k in ('SLURM_RESTART_COUNT', 'TORCHELASTIC_RESTART_COUNT'))]
    if dist.is_initialized() and dist.get_world_size() > 1:  # torchrun counts it only where workers failed
        counts = [None] * dist.get_world_size()
        dist.all_gather_object(counts, again[0])
        again = counts
    pods = launch_pods()
    try:
        with open(os.path.join(out_dir, 'config.json'), encoding='utf-8') as f:
            before = json.loads(f.read(1 << 20))
        before = before if isinstance(before, dict) else {}
    except (OSError, ValueError):  # none, or not a run's: no launch to compare
        before = {}
    # (plain python, a static rendezvous: a launch with no name)
    if any(again) and launch_identity() is not None and before.get('launch') == launch_identity():
        return "its launcher has restarted it"
    ran = sorted(set(pods) & set(p for p in before.get('pods') or [] if isinstance(p, str)))
    if ran:
        return f"its pod {ran[0]} runs it again (Kubernetes restarted a container of the job)"
    return None


def set_aside_damaged(out_dir, damaged, run_id=None, resume_path=None):
    """A run that will write to out_dir resumes past damaged versions of its ckpt.pt ((path, why) in damaged): each
    is renamed damaged-NAME, kept but out of the versions that the run's saves move down, where it would take the
    place of a good one, and the good ones are renamed up into the gaps, as if it had never been written. A gap
    left otherwise (a start stopped between these renames, a version deleted by hand) closes too: a save moves the
    versions down one each, so a gap would let the oldest be replaced while a slot stood empty. A damaged step folder
    is kept as damaged-step-N. run_id (out_dir/run_id's): a version, or a best.pt, that another run saved (copied in
    by hand: the resume passes it over) is kept as other-run-NAME likewise, where the saves would move it down and
    out, or a new best replace it, unsaid (never resume_path, the state resumed). Returns {old path: new path} of
    those renamed up."""
    path = os.path.join(out_dir, 'ckpt.pt')
    bad = {os.path.abspath(p) for p, _ in damaged}
    versions = [v for v in kept(path) if os.path.lexists(v)]
    good, moved = [], {}
    for v in versions + [os.path.join(out_dir, 'best.pt')]:
        theirs = _file_run(v) if run_id and v != resume_path and os.path.abspath(v) not in bad else ''
        if os.path.abspath(v) in bad:
            aside = unused(os.path.join(out_dir, 'damaged-' + os.path.basename(v)))
            os.replace(v, aside)
            print(f"the damaged {v} is kept as {aside}, out of the versions that this run's saves move down",
                  flush=True)
        elif theirs not in ('', run_id):
            aside = unused(os.path.join(out_dir, 'other-run-' + os.path.basename(v)))
            os.replace(v, aside)
            print(f"{v} was saved by another run (id {theirs}, not this run's {run_id}): kept as {aside}, out of "
                  f"the files that this run's saves move down and replace", flush=True)
        elif v in versions:
            good.append(v)
    for n, v in enumerate(good):  # the n-th good one is at version n or later: the names before it are free
        if v != previous(path, n):
            os.replace(v, previous(path, n))
            moved[v] = previous(path, n)
            print(f"{v} is renamed {previous(path, n)}: the versions follow each other with no gap, as a save "
                  f"moves each down one", flush=True)
    # a damaged step folder: the run's save of its step removed it to write its own there, and pruning removed an
    # older one; kept aside likewise (a shard cut short leaves the others good), latest naming the newest left
    for root in sorted({os.path.join(out_dir, kind) for kind in FOLDERS.values()}):
        for name in sorted((n for n in os.listdir(root) if re.fullmatch(r'step-\d+', n)), reverse=True) \
                if os.path.isdir(root) else []:
            if os.path.abspath(os.path.join(root, name)) in bad:
                aside = unused(os.path.join(root, 'damaged-' + name))
                os.replace(os.path.join(root, name), aside)
                print(f"the damaged {os.path.join(root, name)} is kept as {aside}, out of the folders that this "
                      f"run's saves replace and prune", flush=True)
                latest_before(root, name)
    return moved


def _file_run(path):
    """The run id in the checkpoint file at path; '' where it holds none (saved before runs had ids, which counts as
    any run's), is not there, or does not load (a damaged one is judged where it is loaded)."""
    try:
        return str(torch.load(path, map_location='cpu', weights_only=True, mmap=True).get('run_id') or '')
    except Exception:
        return ''


def latest_before(root, name):
    """Where latest named the step folder name, just moved aside (best, a best-step-N): it names the newest folder
    before it that is whole and of the run (the one in out_dir/run_id), or goes. Never one cut short, nor one
    copied in by hand from another run, which a resume would pass over and a tool refuse."""
    pointer, prefix = ('best', 'best-step-') if name.startswith('best-') else ('latest', 'step-')
    if read_name(os.path.join(root, pointer)) == name:
        run_id = read_name(os.path.join(os.path.dirname(root), 'run_id'))
        left = [f for f in step_folders(root, prefix) if os.path.basename(f) < name and
                _whole_iter(f, run_id) is not None]
        if left:
            write_name(os.path.join(root, pointer), os.path.basename(left[0]))
        else:
            os.remove(os.path.join(root, pointer))


def set_aside_others(out_dir, run_id, resume_path):
    """A run that resumes in out_dir moves aside each step folder there, and each best-step-N, that another run
    wrote (its run id says so: a folder copied in by hand from another run's out_dir), kept as other-run-step-N
    (other-run-best-step-N): the run's save of that step would remove it to write its own there, a new best would
    replace or prune it, and pruning would count it among the run's fallbacks. One whose run no file tells (copied
    in without the file that tells it, or damaged) is kept as unknown-run-step-N likewise. latest (best), where it
    named one, names the run's newest whole folder left."""
    for root in sorted({os.path.join(out_dir, kind) for kind in FOLDERS.values()}):
        for folder in step_folders(root) + step_folders(root, 'best-step-'):
            theirs = folder_run(folder) if folder != resume_path else run_id
            if theirs in ('', run_id) or not os.path.isdir(folder) or not os.listdir(folder):  # (nothing to keep)
                continue
            name = os.path.basename(folder)
            aside = unused(os.path.join(root, ('unknown-run-' if theirs is None else 'other-run-') + name))
            os.replace(folder, aside)
            why = ": no file in it tells which run saved it" if theirs is None else \
                f" was saved by another run (id {theirs}, not this run's {run_id})"
            print(f"{folder}{why}: kept as {aside}, out of the folders that this run's saves replace and prune",
                  flush=True)
            latest_before(root, name)


_kept = {}  # out_dir -> (the folder that keep_earlier_run moved the earlier run's saved states into, their names)
_unsettled = {}  # out_dir -> (before-RUN_ID.tmp, before-RUN_ID): an earlier run set aside by a start not yet training
_settled = {}  # the same, once the start has renamed it before-RUN_ID, until its run's first records are written


def where_kept(path):
    """path, or where keep_earlier_run has moved what it names: a run started afresh over out_dir from the weights
    of out_dir (or of a file or folder in it) reads them there."""
    for out_dir, (kept_as, names) in _kept.items():  # (the .tmp folder, until the start settles: settle_earlier_run)
        rel = os.path.relpath(os.path.abspath(path), out_dir)
        if rel == '.':
            return kept_as
        if rel.split(os.sep)[0] in names + ['best']:  # RUN/best names no file of its own
            return os.path.join(kept_as, rel)
    return path


# the names in out_dir of a run's saved state and its records, which a new run there would rotate, prune or replace
RUN_NAMES = re.compile(r'(ckpt|best)(\.prev\d*)?\.pt|(diverged|damaged|other-run)-.+|dcp|ds|decent|run_id|config\.json'
                       r'|metrics\.jsonl(\.damaged-.+)?')


def keep_earlier_run(out_dir, earlier):
    """A run started afresh in an out_dir that holds another run's saved states (--auto_resume=False, or a run
    whose own state was never saved) would rotate and prune them, replace its best by a worse one and its
    config.json by its own. They move, as they are, into out_dir/before-RUN_ID.tmp/ (renames, nothing copied or
    lost), named before-RUN_ID/ once the run begins (settle_earlier_run); `earlier` is the id in out_dir/run_id, if
    any. A log with no saved state is kept by runlog.open_log. Returns (the .tmp folder, the names moved), or None
    where there was nothing to move. Its memory snapshots, which keep_earlier_snapshots put in out_dir, count as
    saved states: a run that saved only those keeps its config.json."""
    snapshots = re.compile(rf'snapshots\.(before|kept)-{re.escape(earlier or "")}-.+')
    names = sorted(n for n in os.listdir(out_dir) if RUN_NAMES.fullmatch(n) and (n not in FOLDERS.values() or
                   _holds_steps(os.path.join(out_dir, n))) or earlier and snapshots.fullmatch(n)) \
        if os.path.isdir(out_dir) else []
    if not any(n not in ('run_id', 'config.json', 'metrics.jsonl') for n in names):
        return
    kept_as = base = os.path.join(out_dir, f"before-{earlier or time.strftime('%Y%m%d-%H%M%S')}")
    n = 1
    while os.path.lexists(kept_as) or os.path.lexists(kept_as + '.tmp'):
        n += 1
        kept_as = f'{base}.{n}'
    # into a folder of a temporary name, renamed once the new run begins (settle_earlier_run): the run moves whole
    # or not at all, and a start that stops before it trains (a bad flag, an init_from that cannot be read, a
    # killed start) leaves it where a plain restart resumes it: put back at its exit, or by the next start
    os.mkdir(kept_as + '.tmp')
    _unsettled[os.path.abspath(out_dir)] = (kept_as + '.tmp', kept_as)
    atexit.register(_put_back_unsettled)  # now: it runs before distributed.start's exit, registered earlier
    for name in names:
        os.rename(os.path.join(out_dir, name), os.path.join(kept_as + '.tmp', name))
    return os.path.abspath(kept_as + '.tmp'), names


def _holds_steps(folder):
    """Whether a dcp/, ds/ or decent/ in out_dir is a run's state: it holds step folders (step-N, best-step-N and
    those set aside beside them). One that holds none is the user's own (notes, another tool's output), which stays
    where they put it."""
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return any(re.fullmatch(r'([a-z-]+-)?step-\d+(\.\d+)?', n) and os.path.isdir(os.path.join(folder, n))
               for n in names)


def settle_earlier_run(out_dir):
    """Called as a new run begins to write (runlog.open_log, rank 0): the earlier run that keep_earlier_run moved
    aside takes its own name, before-RUN_ID/."""
    tmp, kept_as = _unsettled.pop(os.path.abspath(out_dir), (None, None))
    if tmp:
        os.rename(tmp, kept_as)
        _settled[os.path.abspath(out_dir)] = (tmp, kept_as)
        print(f"{out_dir} holds an earlier run's saved states: kept, as they were, in {kept_as}", flush=True)


def unsettle_earlier_run(out_dir):
    """Called where the new run's first records (run_id, config.json, metrics.jsonl) could not be written (a full
    disk) after settle_earlier_run: the start is refused, and the earlier run goes back into out_dir, as the start
    found it, where a plain restart resumes it."""
    tmp, kept_as = _settled.pop(os.path.abspath(out_dir), (None, None))
    if tmp:
        os.rename(kept_as, tmp)
        put_back_earlier_run(out_dir, say=False)
        print(f"the earlier run's saved states in {kept_as}: put back in {out_dir}, as they were", flush=True)


def _put_back_unsettled():
    """A start that exits before its run begins (an error after find_resume) leaves out_dir as it found it."""
    while _unsettled:
        put_back_earlier_run(_unsettled.popitem()[0], say=False)


def as_settled(path):
    """path, named as it is once the start settles: in before-RUN_ID/, not in the .tmp folder it is read from now."""
    for tmp, kept_as in _unsettled.values():
        rel = os.path.relpath(os.path.abspath(path), os.path.abspath(tmp))
        if rel.split(os.sep)[0] != os.pardir:
            return os.path.normpath(os.path.join(kept_as, rel))
    return path


def put_back_earlier_run(out_dir, say=True):
    """A start that stopped before its run began, once keep_earlier_run had moved an earlier run's saved states,
    left them in out_dir/before-RUN_ID.tmp/ (killed midway, in two parts: there and in out_dir), which no resume or
    tool reads as the run: they go back where they were, as if that start had never begun, and this start keeps
    them whole, or resumes them, as it is told. say: a line that says so."""
    for tmp in sorted(os.listdir(out_dir) if os.path.isdir(out_dir) else []):
        if not (re.fullmatch(r'before-.+\.tmp', tmp) and os.path.isdir(os.path.join(out_dir, tmp))):
            continue
        for name in sorted(os.listdir(os.path.join(out_dir, tmp))):
            # only what keep_earlier_run moves, and none that is there twice (each moved, or did not)
            ours = RUN_NAMES.fullmatch(name) or name.startswith(('snapshots.before-', 'snapshots.kept-'))
            if ours and not os.path.lexists(os.path.join(out_dir, name)):
                os.rename(os.path.join(out_dir, tmp, name), os.path.join(out_dir, name))
        if not os.listdir(os.path.join(out_dir, tmp)):
            os.rmdir(os.path.join(out_dir, tmp))
        if say:
            print(f"a start over {out_dir} was killed before its run began, with an earlier run's saved states in "
                  f"{os.path.join(out_dir, tmp)}: put back in {out_dir}, as they were", flush=True)


def unused(path):
    """path, or where that is taken, path with .2, .3, ... before a .pt: whatever was kept under it stays."""
    root, ext = os.path.splitext(path) if path.endswith('.pt') else (path, '')
    n = 1
    while os.path.lexists(path):
        n += 1
        path = f'{root}.{n}{ext}'
    return path


def keep_earlier_snapshots(out_dir, run_id, whose='before', theirs=None, state_of=None, afresh=False):
    """A run started afresh over out_dir (auto_resume=False) takes it over, so the earlier run's memory snapshots
    on this node could never be resumed again, and would hold its RAM until a reboot: they move into out_dir
    (snapshots.before-RUN_ID-HOST/), where nothing of them is lost and find_resume reads them once the run is
    continued (in before-RUN_ID/, where keep_earlier_run moves them). Where they do not fit, they stay, with a
    warning. whose='copy': those of a copy of out_dir (the same run_id), kept as snapshots.copy-RUN_ID-HOST/, which
    no resume reads; theirs, if given, names the folder's entries that are the copy's (the rest, this run's own,
    stay); afresh: those of a copy found as a run starts afresh, under another id. state_of reads a snapshot
    folder's state (saved_for). Returns False where they stay: the folder then holds what this run must neither
    replace nor remove."""
    folder = snapshot_dir(run_id)
    if int(os.environ.get('LOCAL_RANK', 0)) != 0 or not os.path.isdir(folder) or theirs == []:
        return True
    # the earlier run may be live still, in a copy of out_dir (the same run id): they are its newest state, its own
    busy = try_hold(folder, "a run of a copy of this run's folder") if whose == 'before' else None
    if busy:
        print(f"note: {busy}: its memory snapshots there are left to it (this run starts afresh under a new id)",
              flush=True)
        return False
    if not set(os.listdir(folder)) - {HOLD}:  # a run killed before its first snapshot: its hold, now this run's,
        return True  # goes with the folder at this run's end
    if whose == 'before':  # a killed copy's among them would be resumed as the earlier run's own: kept apart first
        copys = [n for n in sorted(os.listdir(folder))
                 if n != HOLD and not saved_for(os.path.join(folder, n), out_dir, run_id, state_of, say=False)]
        if not keep_earlier_snapshots(out_dir, run_id, 'copy', copys or [], state_of, afresh=True):
            return False
        if copys and not set(os.listdir(folder)) - {HOLD}:  # they were all the copy's
            let_go(folder)
            shutil.rmtree(folder, ignore_errors=True)
            return True
    # a copy's go where its folder is (and holds that run still), whose next start resumes them there (find_resume);
    # else into out_dir, where they are kept
    home = whose == 'copy' and copys_folder([os.path.join(folder, n) for n in theirs or []], out_dir, run_id,
                                            state_of)
    for where, kind in ([(home, 'kept')] if home else []) + [(out_dir, whose)]:
        kept_as = base = os.path.join(where, f"snapshots.{kind}-{run_id}-{socket.gethostname()}")
        n = 1
        # a copy's are kept each time they are passed over, and a run's each time it is started afresh over
        # (continued in before-RUN_ID/ between), beside any .tmp that a crash mid-copy left (not ours to remove)
        while os.path.lexists(kept_as) or os.path.lexists(kept_as + '.tmp'):
            n += 1
            kept_as = f'{base}.{n}'
        # the hold on the folder is no snapshot (a dead run's, or this run's, taken above)
        others = lambda d, names: [n for n in names if d == folder and (n == HOLD or theirs and n not in theirs)]
        try:
            try:
                shutil.copytree(folder, kept_as + '.tmp', ignore=others)
                os.rename(kept_as + '.tmp', kept_as)
            except OSError:
                shutil.rmtree(kept_as + '.tmp', ignore_errors=True)  # the part copied: made here, just now
                raise
            break
        except OSError as e:
            if where != out_dir:
                continue
            # copytree gathers its files' errors into one list: the first says why (a full disk)
            why = e.args[0][0][2] if isinstance(e, shutil.Error) and e.args and e.args[0] else reason(e)
            print(f"warning: the {'copy' if whose == 'copy' else 'earlier run'}'s memory snapshots stay in {folder}, "
                  f"holding RAM: they could not be kept in {out_dir} ({why}); " +
                  ("this run takes no memory snapshots of its own, which would replace them, and leaves them there "
                   "at its end: free space and restart the run to keep them there, or " if whose == 'copy' and
                   not afresh else "") +
                  "delete the folder once they are not wanted", flush=True)
            return False
    for name in theirs or []:
        path = os.path.join(folder, name)
        shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
    if theirs is None:
        let_go(folder)
        shutil.rmtree(folder, ignore_errors=True)
    print(f"the {'copy' if whose == 'copy' else 'earlier run'}'s memory snapshots moved from {folder} (RAM) to "
          f"{kept_as}" + (f", where the run in {home} resumes them" if kind == 'kept' else ""), flush=True)
    return True


def copys_folder(paths, out_dir, run_id, state_of=None):
    """The folder that the snapshots at paths, a copy's of out_dir, were saved for, where it is there still (not
    out_dir, nor moved: its real path) and holds that run (run_id; not started afresh since): there the copy's next
    start resumes them, kept as snapshots.kept-RUN_ID-HOST/ (find_resume). None where they name no one such folder."""
    homes = set()
    for path in paths:
        try:
            state = state_of(path) if os.path.isdir(path) else \
                torch.load(path, map_location='cpu', weights_only=True, mmap=True)
            homes.add(os.path.realpath(state.get('out_dir') or state['config']['out_dir']))
        except Exception:
            return None  # unreadable here (or a folder with no state_of): kept in out_dir, where nothing is resumed
    home = homes.pop() if len(homes) == 1 else None
    try:
        same = home and home != os.path.realpath(out_dir) and read_name(os.path.join(home, 'run_id')) == run_id
    except ValueError:  # not text
        return None
    return home if same else None


_copy_in_ram = []  # the snapshot folder, where a copy running there holds it, or its snapshots could not be moved


def holds_a_copys_snapshots():
    """Whether this run's snapshot folder holds a copy's snapshots (a copy running there, or find_resume could not
    move them): the run takes none of its own, which would replace them, and sets aside or removes nothing there."""
    return bool(_copy_in_ram)


def print0(*args):
    if dist.get_rank() == 0:
        print(*args, flush=True)


def remove_snapshots(run_id, eval_only=False, nonfinite_steps=0):
    """At the end of a run, once every rank's saves are written (out_dir holds the final state): the node's
    snapshots go, to free the RAM they hold. Not after an eval_only run: they are the run's it evaluated. Nor where
    the run ended in nonfinite_steps (a SIGTERM or max_iters right after a skipped step): its last save was skipped
    (keep.skips_save), so its newest good state may be a snapshot, which the next start resumes from."""
    dist.barrier()
    if nonfinite_steps and int(os.environ.get('RANK', 0)) == 0 and os.path.isdir(snapshot_dir(run_id)):
        print(f"the memory snapshots in {snapshot_dir(run_id)} stay: no save after the non-finite step, so the run's "
              f"last good state may be there; the next start resumes from it", flush=True)
    if int(os.environ.get('LOCAL_RANK', 0)) == 0 and not eval_only and not nonfinite_steps \
            and not holds_a_copys_snapshots():
        shutil.rmtree(snapshot_dir(run_id), ignore_errors=True)


SHAPE_KEYS = ('n_layer', 'n_head', 'n_embd', 'block_size', 'bias', 'vocab_size')
PRETRAINED = ('gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl')


def hf_folder(path):
    """Whether path is a Hugging Face model folder (export_hf.py's, save_pretrained's): it holds the weights file,
    which no run folder does (both have a config.json)."""
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f)) for f in
                                       ('model.safetensors', 'model.safetensors.index.json', 'pytorch_model.bin'))


def pretrained_or_exit(name, dropout=0.0):
    """OpenAI's GPT-2 (gpt2 ... gpt2-xl) from the Hugging Face hub, or a GPT-2 folder that save_pretrained or
    export_hf.py wrote, or a one-line error saying what is missing or damaged."""
    local = os.path.exists(name) or os.path.isabs(name) or name.startswith(('.', '~'))
    if local and not os.path.isdir(name):
        sys.exit(f"error: {name} is no folder: give a Hugging Face GPT-2 folder (export_hf.py or save_pretrained "
                 f"wrote it), or gpt2, gpt2-medium, gpt2-large, gpt2-xl")
    try:
        with warnings.catch_warnings():  # torch's note on a plain pickle's protocol: a one-line error says enough
            warnings.filterwarnings('ignore', 'Detected pickle protocol', UserWarning)
            return GPT.from_pretrained(name, dict(dropout=dropout))
    except ImportError:
        sys.exit(f"error: init_from={name} needs Hugging Face transformers: pip install transformers")
    except NotImplementedError as e:  # GPT.from_pretrained's refusal: settings that make another function
        sys.exit(f"error: {name} is a GPT-2 of another kind, which model.py's GPT does not compute ({e}): give a "
                 f"GPT-2 folder with GPT-2's settings (export_hf.py's)")
    except Exception as e:
        if local:  # a folder given by mistake, or damaged: its pickles were read as data, a planted one refused
            sys.exit(f"error: {name} is not an intact Hugging Face GPT-2 folder ({reason(e)}): give a folder that "
                     f"export_hf.py or save_pretrained wrote, or gpt2, gpt2-medium, gpt2-large, gpt2-xl")
        if not isinstance(e, OSError):  # it came, but does not load: a damaged file in the local cache
            sys.exit(f"error: {name} from the Hugging Face hub does not load ({reason(e)}): its copy in the local "
                     f"cache (HF_HOME, ~/.cache/huggingface) may be damaged: delete that model's folder there to "
                     f"download it again")
        cache = "put the model in the local cache (HF_HOME, ~/.cache/huggingface) on a machine with the network"
        fix = f"{cache}, or give an export_hf.py folder" if os.environ.get('HF_HUB_OFFLINE', '') not in ('', '0') \
            else f"check the network, or {cache}"
        sys.exit(f"error: could not load {name} from the Hugging Face hub ({reason(e)}): {fix}")


# the flags that have a run write its export (ckpt.pt, which the tools read) at its next eval: at once where it has
# finished (an eval that saves nothing, no new best under always_save_checkpoint=False, would write none)
EXPORTS = {'ds_train.py': ' --save_consolidated=True --always_save_checkpoint=True',
           'decent_train.py': ' --always_save_checkpoint=True'}


def checkpoint_or_exit(path, fix, dropout=0.0):
    """(model, checkpoint, the file or folder read) for a tool (dropout off) or init_from, or a one-line error:
    where there is no checkpoint, naming fix; where it is damaged, saying so; where it is some other file, saying
    what to give instead; where its weights are not finite, saying so."""
    try:
        with warnings.catch_warnings():  # torch's note on a plain pickle's protocol (a meta.pkl given by mistake)
            warnings.filterwarnings('ignore', 'Detected pickle protocol', UserWarning)
            model, checkpoint, read = read_checkpoint(path, dropout=dropout)
    except FileNotFoundError as e:
        shards_snapshot_or_exit(path)
        parent, name = os.path.split(os.path.normpath(path))
        if name in FOLDERS.values() and (os.path.isfile(os.path.join(path, 'latest')) or step_folders(path)):
            # the folder of a run's step folders (RUN/dcp), which holds no checkpoint itself: the run folder does
            parent = parent or '.'
            if name != 'ds' or os.path.exists(os.path.join(parent, 'ckpt.pt')):
                sys.exit(f"error: {path} holds the step folders of the run in {parent}: give the run folder {parent} "
                         f"(its newest state)" + (", or one of those step folders" if name == 'dcp' else ""))
            path = parent  # ZeRO's shards alone: what the run folder needs is said below
        folder = path if os.path.isdir(path) else find_checkpoint(path)  # or the one a latest or best file names
        run, kind = os.path.dirname(os.path.dirname(os.path.normpath(folder))), step_folder_kind(folder)
        # ds_train.py run again with it writes the export of the state it resumes (at once where the run is finished)
        # at an eval that saves: its final one is no new best, and a config may leave always_save_checkpoint off
        export = lambda run: (f"`ds_train.py --out_dir={shlex.quote(run)}{EXPORTS['ds_train.py']}`, "
                              f"with the run's other flags and ranks, writes {os.path.join(run, 'ckpt.pt')}: at once "
                              f"where the run has finished, else at its next save")
        if kind:  # their step folders: ZeRO's shards, or the replicas
            run, best = run or '.', os.path.basename(os.path.normpath(folder)).startswith('best')
            same = export_of(folder, run)  # the whole model of that step, saved beside it at the same save
            if same:
                print(f"note: reading {same}, the whole model that {kind}_train.py saved with {folder} (its own "
                      f"files only it reads back)", file=sys.stderr, flush=True)
                return checkpoint_or_exit(same, fix, dropout)
            what = f"{kind}_train.py, which only it resumes"
            # ds: save_consolidated=False; decent_train.py exports at every save, and this one did not complete
            how = f"(save_consolidated=False): {export(run)}" if kind == 'ds' else \
                f"(its export did not complete): give this step's rank-R.pt (one replica), or continue the run " \
                f"with `decent_train.py --out_dir={shlex.quote(run)}{EXPORTS['decent_train.py']}` (its other flags " \
                f"and ranks as before), which exports at once where the run has finished, else at its next save"
            if not os.path.exists(os.path.join(run, 'best.pt' if best else 'ckpt.pt')):
                sys.exit(f"error: {folder} is a step folder of {what}, and {run} holds no whole model beside it {how}")
            whole = f"give its best, {os.path.join(run, 'best.pt')}" if best else \
                f"give the run folder {run} (its newest, ckpt.pt" + \
                (", the replicas averaged, or DiLoCo's global model; or this step's rank-R.pt, one replica)"
                 if kind == 'decent' else ")")
            sys.exit(f"error: {folder} is a step folder of {what}: {whole}")
        run = path if os.path.isdir(path) else os.path.dirname(os.path.normpath(path))  # a run folder, or RUN/best
        if os.path.isfile(os.path.join(run, 'ds', 'latest')):  # ZeRO's shards alone: save_consolidated=False
            sys.exit(f"error: {run} holds ds_train.py's step folders but no {os.path.basename(find_checkpoint(path))} "
                     f"(save_consolidated=False), and only ds_train.py reads ZeRO's shards: {export(run)}")
        run_id = read_run_id(os.path.join(path, 'run_id')) if os.path.isfile(os.path.join(path, 'run_id')) else None
        # killed before a save: in RAM, or kept in the folder by a start afresh over the run (keep_earlier_snapshots)
        snapshots = next((f for f in ([snapshot_dir(run_id)] + kept_snapshots(path) if run_id else [])
                          if os.path.isdir(f) and set(os.listdir(f)) - {HOLD}), None)
        if snapshots:
            whole = os.path.join(snapshots, 'ckpt.pt')  # train.py's snapshot is a whole ckpt.pt; the others' shards
            where = "this node's memory snapshots of the run, in" if in_ram(snapshots) else \
                "memory snapshots of the run, kept in"
            sys.exit(f"error: {path} holds no checkpoint yet, only {where} "
                     f"{snapshots}: " + (f"give {whole}, or " if os.path.isfile(whole) else "") +
                     "resume the run (it starts from them) until it saves one: its command, flags and ranks, with "
                     "--max_iters=1 saves the newest at once and ends (its own max_iters again trains on)")
        sys.exit(f"error: {e}: {fix}")
    except Exception as e:
        if is_oom(e):  # no damage: the one line says how to fit (oom.py)
            raise
        shards_snapshot_or_exit(path)
        try:
            path = getattr(e, 'checkpoint_path', None) or find_checkpoint(path)
        except ValueError as bad:  # a latest or best file that names no step folder: the run's state is all there
            sys.exit(f"error: {bad}: give a step folder or a ckpt.pt of the run (its training goes by the step "
                     f"folders themselves)")
        # "delete" only for what is a damaged checkpoint: a sharded folder, or a file named as ours (ckpt.pt,
        # ckpt.prev.pt, best.pt) that torch.load could not read. Any other file (DCP's extra.pt,
        # DeepSpeed's model states, a config.json, a meta.pkl, another project's .pt) may be a run's good state.
        unread = any(f.filename == torch.serialization.__file__ for f in traceback.extract_tb(e.__traceback__))
        folder = os.path.dirname(path) or '.'
        if os.path.isfile(path) and hf_folder(folder) and not re.fullmatch(r'(ckpt|best)(\.prev\d*)?\.pt',
                                                                            os.path.basename(path)):
            # model.safetensors, config.json: a Hugging Face model is read as its folder
            sys.exit(f"error: {path} is a file of the Hugging Face folder {folder}: give the folder, which sample.py "
                     f"and every entrypoint take with --init_from={folder}, and transformers reads as it is")
        if os.path.isdir(path) or unread and re.fullmatch(r'(ckpt|best)(\.prev\d*)?\.pt', os.path.basename(path)):
            sys.exit(f"error: checkpoint {path} is corrupt ({reason(e)}): move it aside (mv, to a name of your own) "
                     f"or restore a good copy")
        sys.exit(f"error: {path} is not a model checkpoint ({reason(e)}): give a ckpt.pt, a run folder or a sharded "
                 f"checkpoint folder (dcp/step-N)")
    model, checkpoint, newer = newer_state(path, model, checkpoint, dropout)
    read = read if newer == path else find_checkpoint(newer)  # a memory snapshot newer than the run's checkpoints
    finite_or_exit(model, read)
    return model, checkpoint, read


def export_of(folder, run):
    """The version of run's ckpt.pt (or best.pt) that ds_train.py or decent_train.py saved together with its step
    folder (the same run and iteration), which the tools read where they cannot read the folder itself; else None.
    The run's older step folders are its older versions (ckpt.prev.pt, ...), kept as many as the folders."""
    m = re.fullmatch(r'(?:best-)?step-(\d{1,12})', os.path.basename(os.path.normpath(folder)))  # its iteration
    run_id = folder_run(folder)
    if not m or not run_id:  # no run id: the folder's files or run_id cut short, or a folder saved before runs had them
        return None
    versions = kept(os.path.join(run, 'ckpt.pt'))
    for path in [os.path.join(run, 'best.pt')] + versions if m[0].startswith('best') else versions:
        try:
            saved = torch.load(path, map_location='cpu', weights_only=True, mmap=True)
            if (saved['iter_num'], saved.get('run_id')) == (int(m[1]), run_id):
                return path
        except Exception:  # missing or damaged: another version may be it
            continue
    return None


def step_folder_kind(folder):
    """'ds' or 'decent' where folder is a step folder of ds_train.py or decent_train.py, as what it holds tells (ZeRO's
    model states, the replicas' rank-R.pt) or, for one cut short, its name in their folder of step folders; else None.
    A run folder that lies in a folder named ds or decent (--out_dir=runs/ds/a) is no step folder."""
    if not os.path.isdir(folder):
        return None
    names, (kind, name) = os.listdir(folder), os.path.split(os.path.normpath(folder))
    if any(n.endswith('model_states.pt') for n in names):
        return 'ds'
    if any(re.fullmatch(r'rank-\d+\.pt', n) for n in names):
        return 'decent'
    kind = os.path.basename(kind)
    return kind if kind in ('ds', 'decent') and re.fullmatch(r'(best-)?step-\d+', name) else None


def newer_state(path, model, checkpoint, dropout):
    """(model, checkpoint, path) of a run folder's newest state (or RUN/best's best) where the checkpoint read
    (checkpoint) is not it. A run killed after its last checkpoint left a newer memory snapshot on this node:
    train.py's, a whole ckpt.pt, is read in its place (in one process: the ranks of a run on several nodes would each
    read their own node's). ds_train.py's step folders newer than its ckpt.pt (save_consolidated=False since), and
    the other snapshots (ranks' shards, or one replica) are read back by their run alone: a warning says that the
    state read is older, and how to have the newest. A copy's snapshots are not this folder's (saved_for)."""
    run, best = (path, False) if os.path.isdir(path) else (os.path.dirname(os.path.normpath(path)), True)
    saved, read = checkpoint.get('iter_num'), find_checkpoint(path)
    if not isinstance(saved, int) or os.path.exists(os.path.join(path, 'extra.pt')) or \
            best and os.path.basename(os.path.normpath(path)) != 'best' or not os.path.isdir(run or '.'):
        return model, checkpoint, path  # a file or a step folder: the state it names
    newer, run_id = [], read_name(os.path.join(run, 'run_id')) or ''  # (iter_num, path, writer, what it is)
    for kind in ('ds', 'decent'):  # their step folders, beside the ckpt.pt (best.pt) that holds their whole model
        root = os.path.join(run, kind)
        name = read_name(os.path.join(root, 'best' if best else 'latest')) or ''
        if not re.fullmatch(r'(best-)?step-\d{1,12}', name):
            continue
        # the newest whole one, as the run's resume finds it: one cut short since (a file truncated) is passed over
        # for the one before; ds_train.py's resume reads none past latest, decent_train.py's any whole one
        found = [os.path.join(root, name)] if best else \
            [f for f in step_folders(root) if kind == 'decent' or os.path.basename(f) <= name]
        # (of this run: another's, put there by hand, the resume passes over, as it does a folder of its own that
        # does not load)
        whole = next(((it, f) for f in found for it in [_whole_step_iter(f, kind, run_id or None)] if it is not None),
                     None)
        if whole:
            newer.append((*whole, f'{kind}_train.py', 'its step folder'))
    if not best and RUN_ID.fullmatch(run_id):
        # ds_train.py's snapshot is a step folder: its model states say which folder it was saved for
        engine = lambda folder: torch.load(os.path.join(folder, 'mp_rank_00_model_states.pt'), map_location='cpu',
                                           weights_only=True, mmap=True)
        for folder in [snapshot_dir(run_id)] + kept_snapshots(run):  # (those kept in run are its own)
            it, snapshot, writer = others_snapshot(folder, None, lambda p: not in_ram(p) or
                                                   saved_for(p, run, run_id, engine, say=False))
            if it is not None:
                newer.append((it, snapshot, writer, "the run's memory snapshot"))
    it, state, writer, what = max(newer, key=lambda n: n[0], default=(-1, None, None, None))
    if it <= saved:
        return model, checkpoint, path
    if os.path.basename(state) == 'ckpt.pt' and int(os.environ.get('WORLD_SIZE', 1)) == 1:  # train.py's snapshot
        try:
            whole = _load(state, dropout)
            if not all(torch.isfinite(p).all() for p in whole[0].parameters()):
                raise ValueError("its weights hold inf or nan")
        except Exception as e:  # cut short, or spoilt: the checkpoint is the newest good state
            if is_oom(e):
                raise
            print(f"warning: reading {read} (iter {saved}): the run's newer memory snapshot {state} (iter {it}) does "
                  f"not load ({reason(e)})", file=sys.stderr, flush=True)
            return model, checkpoint, path
        it = whole[1].get('iter_num', it)  # a run in progress may have replaced it since it was listed
        print(f"note: reading the run's memory snapshot {state} (iter {it}), newer than {read} (iter {saved}): "
              f"the run's newest state, which it has not saved since", file=sys.stderr, flush=True)
        return *whole, state
    print(f"warning: reading {read} (iter {saved}), an older state than {what} {state} (iter {it}), which only "
          f"{writer} reads back: continue it with `{writer} --out_dir={shlex.quote(run)}{EXPORTS.get(writer, '')}` "
          f"(its other flags and ranks as before) until it saves, for that state", file=sys.stderr, flush=True)
    return model, checkpoint, path


def shards_snapshot_or_exit(path):
    """A one-line error where path is (or lies in) the memory snapshot of an fsdp_train.py, pp_train.py or
    ds_train.py run: each rank's own shards, in that run's layout, which only the run reads back as it resumes.
    train.py's, a whole ckpt.pt, is read as it is; decent_train.py's, one replica, with a note."""
    if not (is_snapshot(path) and os.path.exists(path)):
        return
    shm, parent = os.path.dirname(snapshot_dir('')), os.path.dirname(os.path.abspath(path))
    if in_ram(path):  # the run's folder of snapshots: /dev/shm/nanogpt-RUN_ID
        root = os.path.join(shm, os.path.relpath(os.path.abspath(path), shm).split(os.sep)[0])
    else:  # or one kept in its out_dir (kept_folder), where path is a snapshot or lies in a DeepSpeed step folder
        root = parent if kept_folder(parent) else os.path.dirname(parent)
    names = os.path.relpath(os.path.abspath(path), root).split(os.sep) + \
        (sorted(os.listdir(root)) if os.path.isdir(root) else [])  # the path's own names first
    scripts = {r'rank-\d+-of-\d+x\d+(x\d+)?pp(\.prev\d*)?\.pt': 'pp_train.py',
               r'rank-\d+-of-\d+x\d+(\.prev\d*)?\.pt': 'fsdp_train.py', r'latest|best|(best-)?step-\d+': 'ds_train.py'}
    script = next((s for n in names for pattern, s in scripts.items() if re.fullmatch(pattern, n)), None)
    if script:
        run = f"the out_dir whose run_id file holds {os.path.basename(root)[len('nanogpt-'):]}" if in_ram(path) else \
            f"--out_dir={shlex.quote(os.path.dirname(root))}, where it is kept"
        sys.exit(f"error: {path} is {script}'s memory snapshot of a run, its ranks' own shards, which only that run "
                 f"reads back as it resumes: resume the run ({run}) until it saves, then give its out_dir (its "
                 f"command with --max_iters=1 saves the newest snapshot at once)")


def finite_or_exit(model, path):
    """A one-line error where the weights read from path hold inf or nan: they would sample nothing (torch.multinomial
    fails on them), export a model of nan logits, or start a run whose every step is skipped."""
    params = dict(model.named_parameters())
    bad = [name for name, p in params.items() if not torch.isfinite(p).all()]
    if bad:
        sys.exit(f"error: the weights in {find_checkpoint(path)} hold inf or nan ({len(bad)} of {len(params)} tensors: "
                 f"{bad[0]}): they were saved after the run had diverged; give a checkpoint of it from before "
                 f"(ckpt.pt, best.pt or an earlier step folder)")


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


def check_vocabulary(config, checkpoint, path):
    """A one-line error where a resume would go on with data whose token ids stand for other tokens than the run
    trained on: its saves would push the run's own checkpoints out for a model trained on both. A checkpoint records
    its data's vocabulary (data.vocabulary), which catches a folder prepared again under its name with another
    tokenizer or text, and a vocabulary of the same size; an older one only its size and dataset, where a dataset of
    another name and vocabulary size is refused. (A run that began on such data, from another model's weights,
    resumes on it.)"""
    saved_vocab = checkpoint.get('vocabulary')
    if saved_vocab is not None:
        now = vocabulary(config['dataset'], config['random_data'])
        if now != saved_vocab:
            def what(v, a='a'):
                return 'GPT-2 BPE tokens' if v == 'gpt2' else f"the ids of {a} {v.split('-')[1]}-character vocabulary"
            ours = what(now, 'another' if what(now) == what(saved_vocab) else 'a')  # the same size: other characters
            sys.exit(f"error: {data_dir(config['dataset'])} holds {ours}, but the run it would continue ({path}) "
                     f"trained on {what(saved_vocab)}: the data was prepared again or is another dataset; prepare "
                     f"the run's data as it was, or give another --out_dir for a new run")
        return
    vocab, saved = meta_vocab(config['dataset'], config['random_data']), checkpoint['model_args']['vocab_size']
    was = checkpoint.get('config', {}).get('dataset')
    if vocab is not None and vocab != saved and was != config['dataset']:
        sys.exit(f"error: {os.path.join(data_dir(config['dataset']), 'meta.pkl')} has {vocab} tokens, but the run "
                 f"it would continue ({path}) has a vocabulary of {saved}, from dataset {was!r}: give the run's own "
                 f"dataset, or another --out_dir for a new run")


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
            check_vocabulary(config, checkpoint, resume_path)
            take_shape(model_args, checkpoint['model_args'], config, given)
            model = GPT(GPTConfig(**model_args))
            if 'model' in checkpoint or not (os.path.isdir(resume_path) or 'shards' in checkpoint):
                model.load_state_dict(GPT.upgrade_state_dict(checkpoint['model']))
        except Exception as e:
            if is_oom(e):  # no damage: the one line says how to fit (oom.py)
                raise
            if config.get('eval_only'):
                pruned_under_eval(resume_path, config['out_dir'])
            sys.exit(f"error: checkpoint {resume_path} is corrupt or not a training checkpoint ({reason(e)}): "
                     f"{aside_or_restore(config.get('eval_only'))}")
    elif init_from in PRETRAINED or init_from not in ('scratch', 'resume') and hf_folder(init_from):  # export_hf.py's
        print0(f"initializing from OpenAI GPT-2 weights: {init_from}" if init_from in PRETRAINED else
               f"initializing from the weights of the Hugging Face folder {init_from}")
        model = pretrained_or_exit(init_from, model_args['dropout'])
        for k in ('n_layer', 'n_head', 'n_embd', 'bias', 'vocab_size'):
            model_args[k] = getattr(model.config, k)
    elif init_from != 'scratch':
        # any entrypoint's checkpoint, or a run folder's newest: its weights, with a new optimizer from step 0
        init_from = where_kept(init_from)
        # the tools' reader and errors: a run killed before its first save, a ds or decent step folder, ... alike
        model, ckpt, read = checkpoint_or_exit(init_from, "give a ckpt.pt, a sharded checkpoint or a run folder",
                                               model_args['dropout'])
        take_shape(model_args, ckpt['model_args'], config, given)
        print0(f"initializing from the weights of {as_settled(read)}")
    else:
        model = GPT(GPTConfig(**model_args))
    block_size = config['block_size']
    if block_size > model.config.block_size and 'block_size' not in given:
        # a Hugging Face GPT-2 of a shorter context than the default's (a small run exported): its own, as a
        # checkpoint's; one given (a flag, a config file) longer than the model's is the error below
        print0(f"block_size={model.config.block_size}: the model's positions (the default's {block_size} is longer)")
        block_size = config['block_size'] = model_args['block_size'] = model.config.block_size
    if block_size < model.config.block_size:
        model.crop_block_size(block_size)  # fine-tune GPT-2 with a shorter context
        model_args['block_size'] = block_size
    elif block_size > model.config.block_size:
        sys.exit(f"error: block_size={block_size} is longer than the model's {model.config.block_size} positions: "
                 f"use --block_size={model.config.block_size} or less")
    return model, checkpoint


def take_settings(optimizer, config, given, saved=None):
    """A resumed optimizer's settings, once load_state_dict has put the saved ones back: a key in given (set by a
    config file or a flag; config itself: every key) takes effect; one left at its default keeps the saved value,
    which config then records, so that a resume without the run's config file neither changes the optimizer nor
    saves a config that says otherwise. The groups are configure_optimizers' (the decayed parameters, then the
    rest); AccumAdamW's window is moment_accum_steps. saved: the run's saved config, where the load may have put no
    setting back (ds_train.py's of a ckpt.pt)."""
    def setting(key, value):
        config[key] = config[key] if key in given else (saved or {}).get(key, value)
        return config[key]
    groups = optimizer.param_groups
    groups[0]['weight_decay'] = setting('weight_decay', groups[0]['weight_decay'])
    for group in groups:
        if 'betas' in group:
            group['betas'] = (setting('beta1', group['betas'][0]), setting('beta2', group['betas'][1]))
        if 'accum_steps' in group:
            group['accum_steps'] = setting('moment_accum_steps', group['accum_steps'])


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
