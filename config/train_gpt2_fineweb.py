# GPT-2 (124M) on FineWeb-Edu's 10B-token sample, as the reproductions run it (build-nanogpt, llm.c): 524,288 tokens
# a step for 19,073 steps (about one epoch), lr 6e-4 with 700 warmup steps and a cosine to 10%, weight decay 0.1;
# val loss and HellaSwag every 250 steps.
# python prepare.py fineweb-edu && python prepare.py hellaswag
# python train.py config/train_gpt2_fineweb.py                                        # one GPU
# torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2_fineweb.py      # 8 GPUs (or fsdp_train.py, ...)

out_dir = 'out-gpt2-fineweb'
dataset = 'fineweb-edu'

wandb_log = False
wandb_project = 'fineweb'
wandb_run_name = 'gpt2-124M'

# 32 sequences * 1024 tokens * 16 micro-steps = 524,288 tokens a step on 1, 2, 4, 8 or 16 GPUs (2 micro-steps a
# GPU on 8); a GPU with less memory takes --batch_size=16 --gradient_accumulation_steps=32, the same batch
batch_size = 32
block_size = 1024
gradient_accumulation_steps = 16

max_iters = 19073  # 10B tokens / 524,288
lr_decay_iters = 19073
warmup_iters = 700
learning_rate = 6e-4
min_lr = 6e-5  # 10% of learning_rate
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0

eval_interval = 250
eval_iters = 40  # 40 * 32 * 1024 = 1.3M val tokens an eval
hellaswag_interval = 250  # all 10,042 examples, shared out over the ranks
log_interval = 10
save_storage_interval = 1000  # besides the evals' (always_save_checkpoint): a preempted run loses little
