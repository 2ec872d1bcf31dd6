"""
What a run writes about itself into out_dir besides checkpoints, from rank 0: run_id (which names its snapshots
and is written into its checkpoints, so that a run started afresh over an old out_dir never takes the old run's
state for its own), config.json (its settings, beside its results) and metrics.jsonl (one JSON object a logged
step, eval or event, which plot.py and the tests read).

Nothing is touched until the first row is logged, once training has begun: a run that fails to start (a bad key,
data that do not fit the model, a damaged checkpoint) leaves the files of the run it would have resumed as they
were.
"""

import json
import os
import sys
import time

import torch.distributed as dist

from checkpoint import wait_for_saves
from keep import set_aside


def open_log(out_dir, run_id, settings, resumed_at=None, write=True, eval_only=False):
    """log(iter_num, **row) appends a row to out_dir/metrics.jsonl with the time since this call; the first call
    writes run_id (not for an eval_only run, which is no run of its own) and config.json (settings), and drops the
    rows that a resumed run (resumed_at: its iteration) logged after its checkpoint, since they are about to be
    logged again. write=False (every rank but the first) makes log do nothing."""
    t_start, metrics = time.time(), []

    def log(iter_num, **row):
        if not write:
            return
        if not metrics:
            metrics.append(_start(out_dir, run_id, settings, resumed_at, eval_only))
        metrics[0].write(json.dumps({'iter': iter_num, **row, 'time': round(time.time() - t_start, 3)}) + '\n')
    return log


def _start(out_dir, run_id, settings, resumed_at, eval_only):
    os.makedirs(out_dir, exist_ok=True)
    if not eval_only:
        replace_text(os.path.join(out_dir, 'run_id'), run_id)
    replace_text(os.path.join(out_dir, 'config.json'), json.dumps(settings, indent=1))
    path = os.path.join(out_dir, 'metrics.jsonl')
    if resumed_at is not None and os.path.exists(path):
        with open(path) as f:
            kept = [line for line in f if line.strip() and json.loads(line).get('iter', 0) < resumed_at]
        replace_text(path, ''.join(kept))
    return open(path, 'a' if resumed_at is not None else 'w', buffering=1)


def replace_text(path, text):
    """Writes a small file whole or not at all (a temporary file, then a rename)."""
    with open(path + '.tmp', 'w') as f:
        f.write(text)
    os.replace(path + '.tmp', path)


def count_skipped(nonfinite, in_a_row, limit, iter_num, log, out_dir, run_id, what='loss or gradient'):
    """The non-finite steps in a row after this one, which the loop skipped: each is logged, and `limit` in a row
    stop the run with an error (every rank calls this alike), once the saves in flight are written and what was
    saved since the weights went bad (at the first of these steps) is set aside: out_dir's newest state is the last
    good one, which the error names."""
    if not nonfinite:
        return 0
    in_a_row += 1
    if int(os.environ.get('RANK', 0)) == 0:
        print(f"iter {iter_num}: non-finite {what}, step skipped ({in_a_row} in a row)", flush=True)
    log(iter_num, skipped=f'non-finite {what}')
    if in_a_row >= limit:
        wait_for_saves()
        if dist.is_initialized():
            dist.barrier()  # every rank's snapshot is written before its node's are looked at
        newest = list(set_aside(out_dir, iter_num - in_a_row + 1, run_id))
        if dist.is_initialized():
            dist.broadcast_object_list(newest)  # rank 0's view of out_dir
        held = f"{newest[0]} (iter {newest[1]}) holds the last good state" if newest[0] else \
            f"{out_dir} holds no state saved before the weights went bad"
        sys.exit(f"error: {in_a_row} steps in a row up to iter {iter_num} had a non-finite {what}; {held}: lower "
                 f"learning_rate, use bfloat16 rather than float16, or check the data")
    return in_a_row
