# evaluate OpenAI's gpt2-large on OpenWebText (n_layer=36, n_head=20, n_embd=1280)
# python train.py config/eval_gpt2-large.py
batch_size = 8
eval_iters = 500  # more batches for a better estimate
eval_only = True
wandb_log = False
init_from = 'gpt2-large'
