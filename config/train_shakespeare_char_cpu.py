# nanoGPT's CPU recipe for the baby GPT: a 0.8M-parameter character model that trains in a few minutes on a
# laptop CPU; nanoGPT's README quotes a val loss of about 1.88 at iter 2000
# python prepare.py shakespeare_char && python train.py config/train_shakespeare_char_cpu.py

out_dir = 'out-shakespeare-char'  # the same as the GPU config's, so one sample.py command serves both
eval_interval = 250
eval_iters = 20
log_interval = 1
always_save_checkpoint = False

dataset = 'shakespeare_char'
gradient_accumulation_steps = 1
batch_size = 12
block_size = 64

n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0

learning_rate = 1e-3
max_iters = 2000
lr_decay_iters = 2000
min_lr = 1e-4
beta2 = 0.99
warmup_iters = 100

device = 'cpu'
compile = False
