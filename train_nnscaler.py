"""
nnScaler's nanoGPT entrypoint, by its name: `torchrun --nproc_per_node=4 train_nnscaler.py CONFIG --plan_ngpus=2
--runtime_ngpus=4` runs this project's own script for it, with the same arguments: train.py (a whole model on each
rank: its plan_ngpus=1, or any with use_nnscaler=False), fsdp_train.py where a model is split over plan_ngpus > 1
ranks (tensor parallel); each takes nnScaler's flags and says what they are here (docs/coming-from.md).
"""
import os
import runpy
import sys

args = sys.argv[1:]


def last(flag):
    """The value of flag's last --flag=V or --flag V in args, or None."""
    found = [args[i + 1] if a == flag and i + 1 < len(args) else a.partition('=')[2]
             for i, a in enumerate(args) if a == flag or a.startswith(f'{flag}=')]
    return found[-1].strip() if found else None


# without nnScaler its script runs Lightning's DDP, a whole model on each rank, whatever plan_ngpus says
split = last('--plan_ngpus') not in (None, '', '1') and last('--use_nnscaler') not in ('False', 'false', '0')
script = 'fsdp_train.py' if split else 'train.py'
sys.argv[0] = os.path.join(os.path.dirname(os.path.abspath(__file__)), script)
runpy.run_path(sys.argv[0], run_name='__main__')
