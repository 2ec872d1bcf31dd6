"""
nnScaler's nanoGPT entrypoint, by its name: `torchrun --nproc_per_node=4 train_nnscaler.py CONFIG --plan_ngpus=2
--runtime_ngpus=4` runs this project's own script for it, with the same arguments: train.py (a whole model on each
rank: its plan_ngpus=1, or use_nnscaler=False), fsdp_train.py where a model is split over plan_ngpus > 1 ranks
(tensor parallel); each takes nnScaler's flags and says what they are here (docs/coming-from.md).
"""
import os
import runpy
import sys

args = sys.argv[1:]
plan = [args[i + 1] if a == '--plan_ngpus' and i + 1 < len(args) else a.partition('=')[2]
        for i, a in enumerate(args) if a == '--plan_ngpus' or a.startswith('--plan_ngpus=')]
script = 'train.py' if not plan or plan[-1].strip() in ('', '1') else 'fsdp_train.py'
sys.argv[0] = os.path.join(os.path.dirname(os.path.abspath(__file__)), script)
runpy.run_path(sys.argv[0], run_name='__main__')
