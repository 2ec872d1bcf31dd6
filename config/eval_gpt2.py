# evaluate OpenAI's gpt2 on OpenWebText (n_layer=12, n_head=12, n_embd=768)
# python train.py config/eval_gpt2.py
batch_size = 8
eval_iters = 500  # more batches for a better estimate
eval_only = True
wandb_log = False
init_from = 'gpt2'
