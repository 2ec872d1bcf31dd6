"""
What a run writes about itself into out_dir besides checkpoints, from rank 0: run_id (which names its snapshots
and is written into its checkpoints, so that a run started afresh over an old out_dir never takes the old run's
state for its own), config.json (its settings, beside its results, and the launch that last started it, with its
Kubernetes pods) and metrics.jsonl (one JSON object a logged step, eval or event, which plot.py and the tests read; a
resume that changes the settings logs what they were, {"iter": N, "settings_changed": {key: [before, now]}}).

Nothing is touched until the first row is logged, once training has begun: a run that fails to start (a bad key,
data that do not fit the model, a damaged checkpoint) leaves the files of the run it would have resumed as they
were, and those of a run it was to start afresh over (open_log settles their move aside).
"""

import errno
import json
import math
import os
import sys
import time

import torch.distributed as dist

from checkpoint import reason, settle_earlier_run, unsettle_earlier_run, wait_for_saves
from distributed import verdicts
from keep import bad_loss, set_aside
from runlock import launch_identity, launch_pods

EVALS = ('val_loss', 'hellaswag_acc_norm')  # the rows of an iteration's evals, which come before its checkpoint


def open_log(out_dir, run_id, settings, resumed_at=None, write=True, eval_only=False):
    """log(iter_num, **row) appends a row to out_dir/metrics.jsonl with the time since this call; the first call
    writes run_id and config.json (settings), and drops the rows that a resumed run (resumed_at: its iteration)
    logged after its checkpoint, since they are about to be logged again; the evals at resumed_at itself came before
    the checkpoint, and are kept unless the resumed run logs them again (the last eval of a finished run that is
    extended, off eval_interval, is not). An eval_only run writes nothing but its rows, appended and marked
    "eval_only": true: it evaluates a run (or a model), and is no run of its own, so a resume keeps them (read_log).
    write=False (every rank but the first) makes log do nothing (write=True also settles an earlier run that the
    start set aside: checkpoint.settle_earlier_run). A file that cannot be written (a full disk) is a one-line
    error, with nothing half-written left."""
    if write and not eval_only:
        settle_earlier_run(out_dir)  # the start has passed its checks: the earlier run it set aside stays aside
    pods = launch_pods() if not eval_only else []  # (a collective: every rank opens the log)
    t_start, metrics = time.time(), []
    mark = {'eval_only': True} if eval_only else {}
    pending = []  # (kind, line): the evals logged at resumed_at, written once the resumed run has not redone them
    warned = []  # the error of the first row that could not be written

    def settle(iter_num, row):
        """The pending evals to write before this row: those of another kind, once the run goes past them."""
        pending[:] = [(kind, line) for kind, line in pending if not (iter_num == resumed_at and kind in row)]
        if not pending or iter_num == resumed_at and any(kind in row for kind in EVALS):
            return ''  # the resumed run may still redo the others at its first iteration
        lines = ''.join(line for _, line in pending)
        pending.clear()
        return lines

    def log(iter_num, **row):
        # a loss that is not finite is written null: NaN and Infinity are no JSON, which many readers refuse
        row = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
        text = json.dumps({'iter': iter_num, **row, **mark, 'time': round(time.time() - t_start, 3)}) + '\n'
        if metrics:
            if write and metrics[0] is not None:
                failed = append(metrics[0], settle(iter_num, row) + text)
                if failed and not warned:  # a full disk: the checkpoints, not the log, decide whether the run stops
                    warned.append(failed)
                    print(f"warning: cannot write {os.path.join(out_dir, 'metrics.jsonl')} ({reason(failed)}): "
                          f"rows are not logged while it cannot be; training goes on", file=sys.stderr, flush=True)
            return
        # the first row, which every rank logs at the same point: the ranks learn together whether rank 0 could
        # write the run's files, and all stop if it could not
        made, error = [], None  # the files that the first row's writes create, removed again should one fail
        if write:
            try:
                metrics.append(_start(out_dir, run_id, settings, resumed_at, eval_only, text, made, pending, pods,
                                      lambda: settle(iter_num, row)))
            except OSError as e:
                for path in made:
                    if os.path.isfile(path):
                        os.remove(path)
                unsettle_earlier_run(out_dir)
                # (another --out_dir for a full disk only: for a file this user may not replace, one that a user of a
                # sticky shared folder owns, it would start the run afresh there rather than go on with it)
                fix = 'free space there, or give another --out_dir' if e.errno in (errno.ENOSPC, errno.EDQUOT) \
                    else "let this user replace the run's files there, and run the same command again"
                error = (f"error: cannot write {e.filename or os.path.join(out_dir, 'metrics.jsonl')} "
                         f"({e.strerror or reason(e)}): {fix}")
        else:
            metrics.append(None)
        if dist.is_initialized() and dist.get_world_size() > 1:
            errors = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error)
            error = error or (1 if any(errors) else None)
        if error:
            sys.exit(error)
    return log


def _start(out_dir, run_id, settings, resumed_at, eval_only, first_row, made, pending, pods, settle):
    """The log file with its first row, opened to append to, once the files of the run are written (each whole or
    not at all; those it makes listed in made); pending gets the evals at resumed_at, and settle() those of them that
    go before the first row. The log is read first (a damaged one set aside, see read_log), so that nothing is
    rewritten before it is known readable."""
    path = os.path.join(out_dir, 'metrics.jsonl')
    if eval_only:
        if os.path.exists(path) and not os.path.isfile(path):
            print(f"warning: {path} is not a file: this eval's rows are not logged", file=sys.stderr, flush=True)
            return None
        os.makedirs(out_dir, exist_ok=True)
        f = open(path, 'ab', buffering=0)
        f.write((b'\n' if f.tell() and _last_byte(path) != b'\n' else b'') + first_row.encode('utf-8'))  # kept apart
        return f
    kept, pending[:] = read_log(path, resumed_at) if resumed_at is not None else ([], [])
    os.makedirs(out_dir, exist_ok=True)
    if resumed_at is None and os.path.isfile(path) and os.path.getsize(path):
        # a run started afresh over an older run's log (--auto_resume=False): that log is kept beside, not cut
        stamp, n = time.strftime('%Y%m%d-%H%M%S'), 1
        while os.path.exists(aside := os.path.join(out_dir, f'metrics.before-{stamp}{f"-{n}" if n > 1 else ""}.jsonl')):
            n += 1  # never over another one kept so
        os.replace(path, aside)
        print(f"{path} holds an earlier run's log: kept as {aside}", flush=True)
    # the launch (and its Kubernetes pods), so that its restart of a run started afresh resumes it
    # (checkpoint.relaunched)
    settings = {**settings, 'launch': launch_identity(), **({'pods': pods} if pods else {})}
    changed = settings_changed(os.path.join(out_dir, 'config.json'), settings) if resumed_at is not None else {}
    # config.json says what the run runs with now; what it said before a resume that changed it stays in the log
    row = json.dumps({'iter': resumed_at, 'settings_changed': changed}) + '\n' if changed else ''
    for name, text in (('run_id', run_id), ('config.json', json.dumps(settings, indent=1)),
                       ('metrics.jsonl', ''.join(kept) + settle() + row + first_row)):
        if not os.path.exists(os.path.join(out_dir, name)):
            made.append(os.path.join(out_dir, name))
        try:
            replace_text(os.path.join(out_dir, name), text)
        except OSError as e:  # a write's error names no file
            raise OSError(e.errno, e.strerror, os.path.join(out_dir, name)) from None  # (not its .tmp)
    return open(path, 'ab', buffering=0)


def settings_changed(path, settings):
    """{key: [before, now]} of the settings that differ from those in the run's config.json at path ({} where it is
    missing or unreadable: then there is nothing to compare)."""
    try:
        with open(path, encoding='utf-8') as f:
            before = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return {}
    if not isinstance(before, dict):
        return {}
    now = json.loads(json.dumps(settings))  # as config.json holds them: tuples as lists
    # (not the launch: a torchrun's differs at each start, and it names no setting; nor its pods)
    return {k: [before.get(k), now.get(k)] for k in sorted((before.keys() | now.keys()) - {'launch', 'pods'})
            if before.get(k) != now.get(k)}


def append(f, text):
    """Appends text to the log file f (unbuffered) whole or not at all: a row that does not fit (a full disk) is cut
    off again, not left half-written. Returns the OSError, or None."""
    end, data = f.seek(0, os.SEEK_END), memoryview(text.encode('utf-8'))  # (a row cut off leaves f.tell() past it)
    try:
        while data:
            data = data[f.write(data):]
    except OSError as e:
        try:
            f.truncate(end)
        except OSError:
            pass  # a line cut short is set aside when the log is next read (read_log)
        return e
    return None


def _last_byte(path):
    with open(path, 'rb') as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1)


def read_log(path, before):
    """The lines of the log at path whose rows precede iteration `before`, and those of eval_only runs (which the
    resumed run does not log again) and of the settings that resumes changed (the only record of them); and
    [(kind, line)] of the evals at `before` (EVALS). Lines that are not a JSON object of a row (cut short by a crash,
    not UTF-8, edited by hand), or a folder in the log's place, are set aside into path.damaged-TIME, never lost, with
    a one-line warning: a damaged log never blocks a resume."""
    if not os.path.lexists(path):
        return [], []
    aside = f"{path}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"
    if not os.path.isfile(path):
        os.replace(path, aside)
        print(f"warning: {path} was not a file; it was moved to {aside} and the log starts anew",
              file=sys.stderr, flush=True)
        return [], []
    kept, evals, bad = [], [], []
    with open(path, 'rb') as f:
        for line in f:
            try:
                row = json.loads(line.decode('utf-8'))
                if not isinstance(row, dict) or not isinstance(row.get('iter', 0), int):
                    raise ValueError('not a row')
            except ValueError:  # UnicodeDecodeError and JSONDecodeError among them
                if line.strip():
                    bad.append(line if line.endswith(b'\n') else line + b'\n')
                continue
            if row.get('iter', 0) < before or row.get('eval_only') is True or 'settings_changed' in row:
                kept.append(line.decode('utf-8').rstrip('\n') + '\n')
            elif row.get('iter') == before and (kinds := [kind for kind in EVALS if kind in row]):
                evals.append((kinds[0], line.decode('utf-8').rstrip('\n') + '\n'))
    if bad:
        with open(aside + '.tmp', 'wb') as f:
            f.write(b''.join(bad))
        os.replace(aside + '.tmp', aside)
        print(f"warning: {len(bad)} unreadable line(s) of {path} set aside in {aside}; the run goes on",
              file=sys.stderr, flush=True)
    return kept, evals


def replace_text(path, text):
    """Writes a small file whole or not at all (a temporary file, then a rename); a failed write or rename leaves
    no temporary file."""
    try:
        with open(path + '.tmp', 'w') as f:
            f.write(text)
        os.replace(path + '.tmp', path)
    except BaseException:
        if os.path.isfile(path + '.tmp'):
            os.remove(path + '.tmp')
        raise


def count_skipped(nonfinite, in_a_row, limit, iter_num, log, out_dir, run_id, what='loss or gradient', dtype=None):
    """The non-finite steps in a row after this one, which the loop skipped: each is logged, and `limit` in a row
    stop the run (stop_diverged)."""
    bad_loss[0] = bool(nonfinite)  # a taken step ends the run of skips (float16's overflows leave it as it is)
    if not nonfinite:
        return 0
    in_a_row += 1
    if int(os.environ.get('RANK', 0)) == 0:
        print(f"iter {iter_num}: non-finite {what}, step skipped ({in_a_row} in a row)", flush=True)
    log(iter_num, skipped=f'non-finite {what}')
    if in_a_row >= limit:
        stop_diverged(in_a_row, iter_num, out_dir, run_id, what, dtype=dtype)
    return in_a_row


MIN_LOSS_SCALE = 1.0  # DeepSpeed's min_loss_scale too, below which its float16 runs stop


def count_overflow(in_a_row, iter_num, scale, log, out_dir, run_id, limit=None):
    """As count_skipped, for a float16 step whose gradients overflowed, which GradScaler skipped and whose loss scale
    it halved (to scale): a few in a row are its way of finding its scale, but one below MIN_LOSS_SCALE means the
    gradients overflow whatever the scale, and the run would skip every step from then on: it stops. A static scale
    (a ds_config's fp16 loss_scale; limit: max_nonfinite_steps) never falls: limit overflows in a row stop the run."""
    in_a_row += 1
    if int(os.environ.get('RANK', 0)) == 0:
        print(f"iter {iter_num}: float16 gradient overflow, step skipped, loss scale {'now ' * (limit is None)}"
              f"{scale:g} ({in_a_row} in a row)", flush=True)
    log(iter_num, skipped='float16 gradient overflow', loss_scale=scale)
    if scale < MIN_LOSS_SCALE or limit is not None and in_a_row >= limit:
        stop_diverged(in_a_row, iter_num, out_dir, run_id, f"gradient in float16 ({'static ' * (limit is not None)}"
                      f"loss scale {'down to ' * (limit is None)}{scale:g})", dtype='float16')
    return in_a_row


def ends_diverged(in_a_row, losses, iter_num, out_dir, run_id, what='loss or gradient', dtype=None):
    """At the run's last eval (every rank alike): where its last steps were non-finite and so is that eval, its
    weights went bad before max_nonfinite_steps could stop it, and a save made right after the step that spoiled
    them (before a loss showed it: a periodic or memory one) holds them; the run stops as the limit would."""
    if in_a_row and not all(math.isfinite(v) for v in losses.values()):
        stop_diverged(in_a_row, iter_num - 1, out_dir, run_id, what, ', and so had the final eval', dtype)


def stop_diverged(in_a_row, iter_num, out_dir, run_id, what, also='', dtype=None):
    """Stops the run whose in_a_row steps up to iter_num were non-finite with an error (every rank calls this
    alike), once the saves in flight are written and what was saved since the weights went bad (at the first of
    these steps) is set aside: out_dir's newest state is the last good one, which the error names."""
    wait_for_saves()
    if dist.is_initialized():
        dist.barrier()  # every rank's snapshot is written before its node's are looked at
    newest = list(set_aside(out_dir, iter_num - in_a_row + 1, run_id))
    if dist.is_initialized():
        dist.broadcast_object_list(newest)  # rank 0's view of out_dir
    held = f"{newest[0]} (iter {newest[1]}) holds the last good state" if newest[0] else \
        f"{out_dir} holds no state saved before the weights went bad"
    if newest[2] is not None:  # a memory snapshot after out_dir's newest: the next start resumes from it, not that
        held += f" (the memory snapshot of iter {newest[2][1]} in {os.path.dirname(newest[2][0])} is newer: a " \
                f"restart resumes it)"
    sys.exit(f"error: {in_a_row} steps in a row up to iter {iter_num} had a non-finite {what}{also}; {held}: "
             f"{diverged_fix(dtype)}")


def diverged_fix(dtype):
    """What to try when a run diverges: bfloat16's range is float32's, float16's overflows far sooner."""
    return f"lower learning_rate, {'use bfloat16 rather than float16, ' if dtype == 'float16' else ''}or check the data"


def heed(in_a_row, limit, log, out_dir, run_id, scaler=None):
    """The verdict on the step before, which agree() left on the device: a non-finite step counted (count_skipped),
    or with float16's GradScaler (scaler) an overflow it skipped (count_overflow), and whether the ranks were asked
    to stop. Returns (in_a_row, stop)."""
    stop, float16 = False, scaler is not None and scaler.is_enabled()
    for iter_num, nonfinite, stopped, overflow in verdicts():
        if float16 and overflow and not nonfinite:  # the scale it halved to, read now the device is past that step
            in_a_row = count_overflow(in_a_row, iter_num, scaler.get_scale(), log, out_dir, run_id)
        else:
            in_a_row = count_skipped(nonfinite, in_a_row, limit, iter_num, log, out_dir, run_id,
                                     dtype='float16' if float16 else None)
        stop = stop or stopped
    return in_a_row, stop
