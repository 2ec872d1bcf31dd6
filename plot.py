"""
Draws loss curves from one or more runs' metrics.jsonl into an image (PNG, or the format --out's extension names):
train loss per logged step and val loss at each eval, against the step (left) and against wall time (right), one
colour per run; and where a run logged HellaSwag (hellaswag_interval), its acc_norm (and acc, dashed) per step.

python plot.py out-ddp out-fsdp --labels=train.py,fsdp_train.py --out=parity.png
"""

import json
import os
import sys

from configurator import configure, outside_runs_or_exit, quiet_interrupt

quiet_interrupt()  # Ctrl-C: one line, no traceback

# -----------------------------------------------------------------------------
out = 'loss.png'
labels = ''  # comma-separated names for the runs; their folder names by default
title = ''
# -----------------------------------------------------------------------------


def read_run(path):
    """The logged steps and evals of a run folder (or a metrics.jsonl path); a line that is not such a row, or a
    run with none, is a one-line error."""
    if os.path.isdir(path):
        path = os.path.join(path, 'metrics.jsonl')
    steps, evals, hellaswag = [], [], []
    before, launches = 0.0, 0.0  # a row's time counts from its launch: a resumed run's starts from 0 again
    with open(path, encoding='utf-8') as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                sys.exit(f"error: {path}:{n}: not a JSON line ({e}): remove or repair that line")
            if not isinstance(row, dict):
                sys.exit(f"error: {path}:{n}: not a JSON object: remove or repair that line")
            if type(row.get('time')) in (int, float):
                if row['time'] < before:  # the first row of a later launch: its time goes on from the one before's
                    launches += before
                before, row['time'] = row['time'], row['time'] + launches
            for kind, rows in (('loss', steps), ('val_loss', evals), ('hellaswag_acc_norm', hellaswag)):
                if kind not in row:
                    continue
                if row[kind] is None:  # a loss that was not finite (older logs wrote NaN, which reads as nan too)
                    row[kind] = float('nan')
                bad = [k for k in ('iter', 'time', kind) if type(row.get(k)) not in (int, float)]
                if bad:
                    sys.exit(f"error: {path}:{n}: a row with '{kind}' lacks a number for '{bad[0]}': plot.py reads "
                             f"metrics.jsonl as the entrypoints write it; remove or repair that line")
                # what is drawn, not the whole row: a long run logs a row a step (a 600k-step log held 762 MB)
                rows.append({k: row[k] for k in ('iter', 'time', kind, 'hellaswag_acc') if k in row})
    if not steps and not evals:
        sys.exit(f"error: {path} holds no logged step or eval yet: plot the run once it has logged one")
    return steps, evals, hellaswag


def check_out():
    """A bad --out fails before any reading or plotting: an empty one, a folder, one in no folder, or a file there
    whose name has no extension, which is no image that plot.py wrote (a run's run_id, a step folder's latest)."""
    if not out:
        sys.exit("error: --out is empty: name the image to write, e.g. --out=loss.png")
    if os.path.isdir(out):
        sys.exit(f"error: --out={out} is a folder: name a file in it, e.g. --out={os.path.join(out, 'loss.png')}")
    if os.path.lexists(out) and not os.path.splitext(out)[1]:
        sys.exit(f"error: --out={out} is a file with no extension, which plot.py would replace by an image: name the "
                 f"image with its format's extension, e.g. --out={out}.png")
    folder = os.path.dirname(out) or '.'
    if not os.path.isdir(folder):
        problem = 'is not a folder' if os.path.exists(folder) else 'does not exist'
        sys.exit(f"error: --out={out}: {folder} {problem}: create that folder or choose another --out")
    outside_runs_or_exit(out, '--out')  # (in a run's step folder, the image went with its pruning)


def main():
    runs = []  # the arguments that are no flag nor a flag's value (--out loss.png), in order
    configure(globals(), positional=lambda arg: runs.append(arg) or [])
    if not runs:
        sys.exit("error: name at least one run: python plot.py RUN_DIR [RUN_DIR ...] [--out=loss.png]")
    names = labels.split(',') if labels else [os.path.basename(os.path.normpath(r)) for r in runs]
    if len(names) != len(runs):
        sys.exit(f"error: {len(names)} labels for {len(runs)} runs: give one label per run")
    check_out()
    data = []
    for r in runs:
        try:
            data.append(read_run(r))
        except (OSError, UnicodeDecodeError) as e:
            sys.exit(f"error: cannot read the metrics of {r} ({type(e).__name__}): give a run's out_dir or its "
                     f"metrics.jsonl")
    try:
        import matplotlib
    except ImportError:
        sys.exit("error: plot.py needs matplotlib, which training does not: pip install matplotlib")
    matplotlib.use('Agg')  # files only, no display needed
    import matplotlib.pyplot as plt

    with_hellaswag = any(hs for _, _, hs in data)
    fig, axes = plt.subplots(1, 3 if with_hellaswag else 2, figsize=(18 if with_hellaswag else 12, 4.5))
    # the extension's format, as matplotlib would take it (png without one), given explicitly: the temporary name's
    # .tmp would not do
    fmt = os.path.splitext(out)[1][1:].lower() or 'png'
    if fmt not in fig.canvas.get_supported_filetypes():
        sys.exit(f"error: --out={out}: matplotlib cannot write .{fmt} files: end it in one of "
                 f"{', '.join('.' + f for f in sorted(fig.canvas.get_supported_filetypes()))}")
    for (steps, evals, hs), name, color in zip(data, names, plt.rcParams['axes.prop_cycle'].by_key()['color'] * 10):
        if hs:
            axes[2].plot([r['iter'] for r in hs], [r['hellaswag_acc_norm'] for r in hs], color=color, marker='o', ms=3,
                         label=f'{name} acc_norm')
            axes[2].plot([r['iter'] for r in hs], [r.get('hellaswag_acc', float('nan')) for r in hs], color=color,
                         ls='--', lw=1, label=f'{name} acc')
        for ax, x in zip(axes, ('iter', 'time')):
            ax.plot([r[x] for r in steps], [r['loss'] for r in steps], color=color, alpha=0.35, lw=1,
                    label=f'{name} train')
            ax.plot([r[x] for r in evals], [r['val_loss'] for r in evals], color=color, marker='o', ms=3, lw=1.5,
                    label=f'{name} val')
    axes[0].set_xlabel('step')
    axes[1].set_xlabel('wall time (s)')
    for ax in axes:
        ax.set_ylabel('loss')
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if with_hellaswag:
        axes[2].set(xlabel='step', ylabel='HellaSwag accuracy')
        axes[2].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    tmp, made = f'{out}.{os.getpid()}.tmp', False  # a name of its own, made here: a user's file is never written over
    try:
        with open(tmp, 'xb') as f:
            made = True
            fig.savefig(f, dpi=110, format=fmt)
        os.replace(tmp, out)
    except BaseException as e:  # whatever stops the write (a full disk, a backend that is missing, Ctrl-C)
        if made and os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(e, OSError):
            sys.exit(f"error: cannot write {out} ({e.strerror}): choose a writable --out")
        if isinstance(e, Exception):  # e.g. .pgf without xelatex
            why = (str(e).splitlines() or [''])[0][:200]
            sys.exit(f"error: matplotlib cannot write {out} here ({type(e).__name__}: {why}): choose another "
                     f"format, e.g. .png")
        raise
    print(f"wrote {out}: {len(runs)} run(s)")


if __name__ == '__main__':
    main()
