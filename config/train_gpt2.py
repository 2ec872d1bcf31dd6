# GPT-2 (124M) on OpenWebText, on one node of 8 A100 40GB: about 4 days to a loss of ~2.85
# python prepare.py openwebtext && torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2.py

wandb_log = False
wandb_project = 'owt'
wandb_run_name = 'gpt2-124M'

# 12 batch * 1024 block * 40 micro-steps (5 per GPU on 8 GPUs) = 491,520 tokens, about 0.5M per iteration
batch_size = 12
block_size = 1024
gradient_accumulation_steps = 5 * 8
# a GPU with 80 GB takes a larger micro-batch, which keeps more of it busy (docs/speed.md): the same tokens in
# --batch_size=30 --gradient_accumulation_steps=16 (2 micro-steps per GPU on 8). fsdp_train.py's step waits on its
# hooks on the host: --reshard_after_forward=False --blocks_per_unit=4 made it 1.63x faster on one H100, for 237 MiB
# more on each rank (the parameters whole from forward to backward; docs/speed.md)

# 600,000 iterations: about 300B tokens
max_iters = 600000
lr_decay_iters = 600000

eval_interval = 1000
eval_iters = 200
log_interval = 10

weight_decay = 1e-1
