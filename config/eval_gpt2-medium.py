# evaluate OpenAI's gpt2-medium on OpenWebText (n_layer=24, n_head=16, n_embd=1024)
# python train.py config/eval_gpt2-medium.py
batch_size = 8
eval_iters = 500  # more batches for a better estimate
eval_only = True
wandb_log = False
init_from = 'gpt2-medium'
