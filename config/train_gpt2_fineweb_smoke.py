# config/train_gpt2_fineweb.py at a size a CPU runs in seconds (HellaSwag's evals aside): the same data, schedule
# shape, evals and HellaSwag, on a 2-layer model and 40 steps. For trying the recipe end to end, not for results:
# python train.py config/train_gpt2_fineweb_smoke.py      (after prepare.py fineweb-edu and prepare.py hellaswag)

import os

with open(os.path.join(os.path.dirname(__file__), 'train_gpt2_fineweb.py')) as _f:
    exec(_f.read())  # (not compile(): `compile` here is the config key)

out_dir = 'out-gpt2-fineweb-smoke'
device = 'cpu'
compile = False
n_layer = 2
n_head = 2
n_embd = 64
batch_size = 4
block_size = 32
gradient_accumulation_steps = 2
max_iters = 40
lr_decay_iters = 40
warmup_iters = 4
eval_interval = 20
eval_iters = 4
hellaswag_interval = 20
log_interval = 5
save_storage_interval = 0
