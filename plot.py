"""
Draws loss curves from one or more runs' metrics.jsonl into a PNG: train loss per logged step and val loss at each
eval, against the step (left) and against wall time (right), one colour per run.

python plot.py out-ddp out-fsdp --labels=train.py,fsdp_train.py --out=parity.png
"""

import json
import os
import sys

from configurator import configure

# -----------------------------------------------------------------------------
out = 'loss.png'
labels = ''  # comma-separated names for the runs; their folder names by default
title = ''
# -----------------------------------------------------------------------------


def read_run(path):
    """The logged steps and evals of a run folder (or a metrics.jsonl path)."""
    if os.path.isdir(path):
        path = os.path.join(path, 'metrics.jsonl')
    steps, evals = [], []
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if 'loss' in row:
                steps.append(row)
            if 'val_loss' in row:
                evals.append(row)
    return steps, evals


def main():
    runs = [a for a in sys.argv[1:] if not a.startswith('--')]
    configure(globals(), [a for a in sys.argv[1:] if a.startswith('--')])
    if not runs:
        sys.exit("error: name at least one run: python plot.py RUN_DIR [RUN_DIR ...] [--out=loss.png]")
    names = labels.split(',') if labels else [os.path.basename(os.path.normpath(r)) for r in runs]
    if len(names) != len(runs):
        sys.exit(f"error: {len(names)} labels for {len(runs)} runs: give one label per run")
    data = []
    for r in runs:
        try:
            data.append(read_run(r))
        except (OSError, ValueError) as e:
            sys.exit(f"error: cannot read the metrics of {r} ({type(e).__name__}): give a run's out_dir or its metrics.jsonl")
    try:
        import matplotlib
    except ImportError:
        sys.exit("error: plot.py needs matplotlib, which training does not: pip install matplotlib")
    matplotlib.use('Agg')  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for (steps, evals), name, color in zip(data, names, plt.rcParams['axes.prop_cycle'].by_key()['color'] * 10):
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
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    tmp = out + '.tmp.png'
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, out)
    print(f"wrote {out}: {len(runs)} run(s)")


if __name__ == '__main__':
    main()
