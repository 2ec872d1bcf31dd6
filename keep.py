"""
Which saved states a run keeps, shared by the entrypoints: never a worse one in place of a good one. An eval whose
loss is not finite saves nothing (saves_at_eval), and no save is made in a run of non-finite steps (but for float16's
overflows alone, whose weights gave a finite loss: skips_save); a run stopped by max_nonfinite_steps sets aside what
it saved since its weights went bad (set_aside), so that its newest state is the newest good one. The newest
keep_checkpoints states and the best by val loss (best.pt, or best-step-N beside the step folders) are written by
checkpoint.py's atomic_save and point_latest; this module only decides.
"""

import math
import os
import re

import torch

from checkpoint import holds_a_copys_snapshots, kept, kept_snapshots, read_name, snapshot_dir, unused, write_name

KINDS = ('dcp', 'ds', 'decent')  # the folders of step folders that fsdp_train.py, ds_train.py, decent_train.py write


def saves_at_eval(losses, best_val_loss, always_save_checkpoint, print0, last=False):
    """(save, best) after an eval: save a checkpoint (nanoGPT's rule: on a new best val loss, or always), and it
    is a new best. last: the run's last eval, whose end frees its memory snapshots (it took some, or resumed from
    one; not where the folder holds a copy's, which the end leaves): it saves whatever its loss, or the state they
    held, newer than out_dir's, would go with them (the best stays best.pt). Never where a loss is not finite: the
    weights have gone bad, and the last good state stays the newest."""
    if not all(math.isfinite(v) for v in losses.values()):
        print0("the eval's loss is not finite: nothing saved, the last good state stays the newest")
        return False, False
    best = losses['val'] < best_val_loss
    return bool(best or always_save_checkpoint or last and not holds_a_copys_snapshots()), best


def set_aside(out_dir, first_bad, run_id):
    """Called by each rank when a run stops for its non-finite steps, the first of which was at iter first_bad:
    the states saved at first_bad or later hold the weights that gave it (skipped steps change nothing), so they
    are renamed diverged-... (kept, not deleted, but out of every resume's and tool's sight) and the good ones
    before take the newest names: ckpt.pt stays the newest. Rank 0 does it in out_dir, the first rank of each node
    in its memory snapshots. Returns (path, iter) of out_dir's newest good state, or (None, None), and the
    (path, iter) of rank 0's newest good snapshot where it is newer (the next start resumes from it), else None:
    in RAM, or kept in out_dir out of RAM (before-RUN_ID/, a copy's start), which a resume reads alike."""
    snapshot = (None, -1)
    # (not where the folder holds a copy's snapshots: this run took none, and those are the copy's newest states)
    if int(os.environ.get('LOCAL_RANK', 0)) == 0 and os.path.isdir(snapshot_dir(run_id)) \
            and not holds_a_copys_snapshots():
        snapshot = _set_aside_in(snapshot_dir(run_id), first_bad, files=_snapshots(snapshot_dir(run_id)))
    if int(os.environ.get('RANK', 0)) != 0:
        return None, None, None
    for folder in kept_snapshots(out_dir):  # every node's, in the storage they share
        snapshot = max(snapshot, _set_aside_in(folder, first_bad, files=_snapshots(folder)), key=lambda n: n[1])
    newest = _set_aside_in(out_dir, first_bad, files=['ckpt.pt'])
    for kind in KINDS:
        newest = max(newest, _set_aside_in(os.path.join(out_dir, kind), first_bad, files=[]), key=lambda n: n[1])
    return (*(newest if newest[0] is not None else (None, None)), snapshot if snapshot[1] > newest[1] else None)


def _snapshots(folder):
    return [f for f in os.listdir(folder) if f.endswith('.pt') and not f.startswith('diverged')]


def _iter(path):
    try:
        return int(torch.load(path, map_location='cpu', weights_only=True, mmap=True)['iter_num'])
    except Exception:
        return None  # damaged: a resume passes it over anyway


def _set_aside_in(folder, first_bad, files):
    """set_aside in one folder: its step-N folders (latest rewritten to the newest left) and each file's versions
    (kept(file)). Returns (path, iter) of the newest state left, or (None, -1)."""
    newest = (None, -1)
    if not os.path.isdir(folder):
        return newest
    steps = sorted(f for f in os.listdir(folder) if re.fullmatch(r'step-\d+', f))
    for step in steps:
        if int(step[5:]) >= first_bad:
            os.replace(os.path.join(folder, step), unused(os.path.join(folder, 'diverged-' + step)))
    left = [s for s in steps if int(s[5:]) < first_bad]
    if read_name(os.path.join(folder, 'latest')) is not None and left:
        write_name(os.path.join(folder, 'latest'), left[-1])
        newest = (os.path.join(folder, left[-1]), int(left[-1][5:]))
    elif read_name(os.path.join(folder, 'latest')) is not None:
        os.remove(os.path.join(folder, 'latest'))  # it named a state set aside: there is no good one here
    for name in set(re.sub(r'\.prev\d*\.pt$', '.pt', f) for f in files):
        versions = kept(os.path.join(folder, name))
        good = []
        for path in versions:
            it = _iter(path)
            if it is not None and it >= first_bad:
                root, ext = os.path.splitext(path)
                os.replace(path, unused(f"{os.path.join(folder, 'diverged-' + os.path.basename(root))}-{it}{ext}"))
            else:
                good.append(path)
        for path, name_to in zip(good, versions):  # newest first: each moves up into a name already vacated
            if path != name_to:
                os.replace(path, name_to)
        if good and _iter(versions[0]) is not None and _iter(versions[0]) > newest[1]:
            newest = (versions[0], _iter(versions[0]))
    return newest


# whether a step of the run of skipped steps the loop is in had a non-finite loss (or, but for float16's overflows, a
# non-finite gradient): the weights that gave it may have gone bad (runlog.count_skipped sets it; a taken step clears
# it)
bad_loss = [False]


def skips_save(to, nonfinite_steps, iter_num, print0):
    """Whether the entrypoint's save_checkpoint(to) saves nothing: in a run of non-finite steps, whose weights may
    have gone bad. Not in a run of float16's overflows alone (the loss scaler finding its scale): their weights are
    the last taken step's, a finite loss their witness, and a run that ends there (a SIGTERM, max_iters) keeps them;
    such a save (keeping) pushes out no state from before. No memory snapshot where the run's snapshot folder holds a
    copy's, which it would replace."""
    if to == 'memory' and holds_a_copys_snapshots():
        return True
    if unsaved(nonfinite_steps):
        print0(f"iter {iter_num}: no {to} save after {nonfinite_steps} non-finite steps: the last good state stays")
    return unsaved(nonfinite_steps) > 0


def unsaved(nonfinite_steps):
    """The skipped steps in a row after which nothing is saved (skips_save): 0 in a run of float16 overflows alone."""
    return nonfinite_steps if bad_loss[0] else 0


def keeping(keep, nonfinite_steps):
    """The versions a save keeps (keep, keep_checkpoints): one more in a run of float16 overflows, where its weights
    are those of the step before them, which a run that goes on to stop diverged sets aside: the newest state from
    before them is never pushed out for it. A later save of the same weights replaces it rather than push out another
    (checkpoint.atomic_save, point_latest), and the first save after a taken step prunes the one kept besides."""
    return keep + (nonfinite_steps > 0)
