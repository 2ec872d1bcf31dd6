# evaluate OpenAI's gpt2-xl on OpenWebText (n_layer=48, n_head=25, n_embd=1600)
# python train.py config/eval_gpt2-xl.py
batch_size = 8
eval_iters = 500  # more batches for a better estimate
eval_only = True
wandb_log = False
init_from = 'gpt2-xl'
