# the baby GPT: a character-level Shakespeare model, ~10.7M parameters, a few minutes on one GPU; where torch sees
# no GPU it takes nanoGPT's CPU recipe instead (config/train_shakespeare_char_cpu.py, at the end) and says so
# python prepare.py shakespeare_char && python train.py config/train_shakespeare_char.py

import os

import torch

out_dir = 'out-shakespeare-char'
eval_interval = 250  # keep frequent: it overfits
eval_iters = 200
log_interval = 10  # don't print too often

always_save_checkpoint = False  # only save when val improves

wandb_log = False
wandb_project = 'shakespeare-char'
wandb_run_name = 'mini-gpt'

dataset = 'shakespeare_char'
gradient_accumulation_steps = 1
batch_size = 64
block_size = 256  # context of up to 256 previous characters

n_layer = 6
n_head = 6
n_embd = 384
dropout = 0.2

learning_rate = 1e-3  # a small network can take a higher learning rate
max_iters = 5000
lr_decay_iters = 5000  # usually max_iters
min_lr = 1e-4  # usually learning_rate / 10
beta2 = 0.99  # a little higher: few tokens per iteration

warmup_iters = 100

if not torch.cuda.is_available():
    _cpu = os.path.join(os.path.dirname(__file__), 'train_shakespeare_char_cpu.py')
    if os.environ.get('RANK', '0') == '0':  # one line, not one per rank
        print(f"no GPU: {__file__} takes the CPU recipe of {_cpu} (a 0.8M-parameter model, 2000 iterations)")
    with open(_cpu) as _f:
        exec(_f.read())  # (not compile(): `compile` here is the config key)
