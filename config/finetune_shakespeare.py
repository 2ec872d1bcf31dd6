# fine-tune GPT-2 XL on tiny Shakespeare (GPT-2 BPE): a few minutes on one A100
# python prepare.py shakespeare && python train.py config/finetune_shakespeare.py

import time

out_dir = 'out-shakespeare'
eval_interval = 5
eval_iters = 40
wandb_log = False
wandb_project = 'shakespeare'
wandb_run_name = 'ft-' + str(int(time.time()))

dataset = 'shakespeare'
init_from = 'gpt2-xl'  # the largest GPT-2

always_save_checkpoint = False  # only save on a new best val loss

# 1 batch * 32 micro-steps * 1024 tokens = 32,768 tokens per iteration; Shakespeare has 301,966: ~9 iters an epoch
batch_size = 1
gradient_accumulation_steps = 32
max_iters = 20

learning_rate = 3e-5  # fine-tune at a constant, small learning rate
decay_lr = False
