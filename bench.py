"""
Times training steps of a GPT of any size on one device: median ms/iter, tokens/s and MFU.

python bench.py                                     # GPT-2 124M, block 1024, synthetic data, on the GPU
python bench.py --model=gpt2-medium --batch_size=8
python bench.py config/train_shakespeare_char_cpu.py --real_data=True --compile=False   # a config's model and batch
python bench.py --profile=True                      # a torch.profiler trace in bench_log/ instead
python bench.py --sdpa=cudnn --fused_qkv=True --loss_rows=4096   # levers (docs/speed.md), one at a time
python bench.py --autocast_residual=True            # a lever that changes the numerics: its loss is compared
"""

import json
import os
import statistics
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch

from configurator import check_model_name, check_model_shape, check_optimizer, check_seed, configure, quiet_interrupt
from data import check_token_ids, data_dir, find_bins, read_meta, read_rows
from distributed import check_fits
from model import GPT2_SHAPES, GPT, GPTConfig
from oom import explain_oom

quiet_interrupt()  # Ctrl-C: one line, no traceback

# -----------------------------------------------------------------------------
model = ''  # a GPT-2 shape ('gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl') instead of n_layer / n_head / n_embd
batch_size = 12
block_size = 1024
gradient_accumulation_steps = 1
n_layer = 12
n_head = 12
n_embd = 768
bias = False
dropout = 0.0
learning_rate = 6e-4
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
real_data = False  # read batches from data/<dataset>/train.bin; otherwise random tokens
random_data = True  # the entrypoints' random_data (data.py): one batch of its tokens, drawn once; False = real_data
dataset = 'openwebtext'
warmup = 10  # untimed steps first (compilation, allocator warm-up)
iters = 50  # timed steps
device = 'auto'
dtype = 'auto'
compile = True
compile_mode = 'default'  # torch.compile's mode: 'default', 'reduce-overhead', 'max-autotune-no-cudagraphs', ...
coordinate_descent = False  # inductor tunes each generated kernel's block sizes by coordinate descent (slower compile)
sdpa = 'auto'  # attention's kernel: 'auto' (PyTorch's choice), or only 'cudnn', 'flash', 'efficient' or 'math'
fused_qkv = False  # the levers of model.GPTConfig, which training leaves off until they are measured here
loss_rows = 0
autocast_residual = False
seed = 1337
profile = False  # write a torch.profiler trace instead of timing
# -----------------------------------------------------------------------------
config, given = configure(globals(), skip_unknown_in_files=True)  # training configs set keys a benchmark lacks
explain_oom(globals())  # running out of memory ends in one line that says how to fit, not a traceback
check_model_name(model, given)
if model:
    if model not in GPT2_SHAPES:
        sys.exit(f"error: unknown model={model!r}: use one of {', '.join(GPT2_SHAPES)}, or set n_layer, n_head, n_embd")
    n_layer, n_head, n_embd = GPT2_SHAPES[model]
    config.update(n_layer=n_layer, n_head=n_head, n_embd=n_embd)  # the JSON line reports the shape timed
check_model_shape(config)
check_seed(config)
check_optimizer(config)
for key, least in (('batch_size', 1), ('gradient_accumulation_steps', 1), ('iters', 1), ('warmup', 0)):
    if config[key] < least:
        sys.exit(f"error: {key}={config[key]} must be {least} or more")
SDPA = {'cudnn': 'enable_cudnn_sdp', 'flash': 'enable_flash_sdp', 'efficient': 'enable_mem_efficient_sdp',
        'math': 'enable_math_sdp'}
if sdpa != 'auto' and sdpa not in SDPA:
    sys.exit(f"error: sdpa={sdpa!r}: use auto, {', '.join(SDPA)}")
if loss_rows < 0:
    sys.exit(f"error: loss_rows={loss_rows} must be 0 (the loss at once) or more")
if dtype not in ('auto', 'float32', 'bfloat16', 'float16'):
    sys.exit(f"error: dtype={dtype!r}: use auto, float32, bfloat16 or float16")
if device == 'auto':
    device = 'cuda' if torch.cuda.is_available() else 'cpu'
try:
    torch.empty(1, device=device)  # a misspelt device, or a GPU this machine lacks, fails here rather than mid-run
except Exception as e:
    sys.exit(f"error: device={device!r} cannot be used here ({type(e).__name__}: {str(e).splitlines()[0][:150]}): "
             f"use cpu, or cuda / cuda:N for a GPU this machine has")
device_type = device.split(':')[0]
if profile:
    try:
        os.makedirs('bench_log', exist_ok=True)  # now, not after the profiled steps have run
    except OSError as e:
        sys.exit(f"error: cannot create ./bench_log for the trace ({e.strerror}): run bench.py in a folder where it "
                 f"can write bench_log/")
if dtype == 'auto':
    dtype = ('bfloat16' if torch.cuda.is_bf16_supported(including_emulation=False) else 'float16') \
        if device_type == 'cuda' else 'float32'
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
ctx = nullcontext() if dtype == 'float32' else torch.autocast(device_type=device_type, dtype=ptdtype)
torch.manual_seed(seed)
if device_type == 'cuda':
    torch.set_float32_matmul_precision('high')  # TF32 matmuls (the API that inductor's max-autotune reads)
for name, switch in SDPA.items():  # before compiling: the compiled graph keeps the kernel chosen when it is traced
    if sdpa != 'auto':
        getattr(torch.backends.cuda, switch)(name == sdpa)

vocab_size = 50304
if real_data and random_data and 'random_data' in given:
    sys.exit("error: real_data=True and random_data=True: choose one")
if real_data or not random_data:
    config.update(real_data=True, random_data=False)  # the JSON line reports the data timed, either way it was asked
    paths, counts = find_bins(dataset, block_size)  # whole uint16 tokens, enough of them, readable
    path, n_tokens = paths['train'], counts['train']
    meta = os.path.join(data_dir(dataset), 'meta.pkl')
    if os.path.exists(meta):
        vocab_size = read_meta(meta)['vocab_size']
    check_token_ids({'train': path}, vocab_size)  # an id past the vocabulary would index past the embedding
    gen = torch.Generator().manual_seed(seed)

    def get_batch():
        offsets = torch.randint(n_tokens - block_size, (batch_size,), generator=gen).numpy()
        chunk = torch.from_numpy(read_rows(path, offsets, block_size + 1))
        return chunk[:, :-1].contiguous().to(device), chunk[:, 1:].contiguous().to(device)
else:
    # kept on the device and reused, so that the timing is the model's alone
    chunk = torch.from_numpy(read_rows(find_bins(dataset, block_size, random_data=True)[0]['train'],
                                       np.arange(batch_size) * (block_size + 1), block_size + 1))
    x, y = chunk[:, :-1].contiguous().to(device), chunk[:, 1:].contiguous().to(device)

    def get_batch():
        return x, y

check_fits(dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, vocab_size=vocab_size,
                bias=bias), device)  # refused before it is built
gpt = GPT(GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                    dropout=dropout, bias=bias, fused_qkv=fused_qkv, loss_rows=loss_rows,
                    autocast_residual=autocast_residual)).to(device)
optimizer = gpt.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
scaler = torch.amp.GradScaler(device_type, enabled=(dtype == 'float16'))
torch._inductor.config.coordinate_descent_tuning = coordinate_descent
try:
    net = torch.compile(gpt, mode=compile_mode) if compile else gpt
except RuntimeError as e:  # a mode it does not know
    sys.exit(f"error: compile_mode={compile_mode!r}: {e}")
device_name = torch.cuda.get_device_name(device) if device_type == 'cuda' else device_type


def step():
    """One optimizer step, as train.py takes it on one process."""
    for _ in range(gradient_accumulation_steps):
        X, Y = get_batch()
        with ctx:
            _, loss = net(X, Y)
            loss = loss / gradient_accumulation_steps
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(gpt.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss


# what the device's time goes to, by words in the names of its kernels (compiled ones are named for the ops they
# fuse) or, on a CPU, its ops; the first kind whose word a name holds wins, so the specific kinds come first
PROFILE_KINDS = [
    ('attention', ('flash', 'fmha', 'attention', 'sdpa', 'cudnn')),
    ('loss', ('cross_entropy', 'log_softmax', 'nll_loss', 'softmax')),
    ('layer norm', ('layer_norm',)),
    ('gelu', ('gelu', 'tanh')),
    ('optimizer', ('adam', 'multi_tensor', 'foreach')),
    ('matmul', ('gemm', 'xmma', 'nvjet', 'cutlass', 'aten::mm', 'aten::addmm', 'aten::bmm', 'matmul', 'sm90_')),
    ('communication', ('nccl', 'all_reduce', 'allreduce')),
]


def sync():
    if device_type == 'cuda':
        torch.cuda.synchronize()


print(f"{gpt.get_num_params() / 1e6:.2f}M parameters, {n_layer} layers, {n_head} heads, {n_embd} wide, "
      f"batch {batch_size}x{gradient_accumulation_steps}x{block_size}, {dtype}, compile={compile}, on {device_name}")
for _ in range(warmup):
    step()
sync()
if profile:
    from torch.profiler import DeviceType, ProfilerActivity, profile as torch_profile, tensorboard_trace_handler
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == 'cuda' else [])
    with torch_profile(activities=activities, on_trace_ready=tensorboard_trace_handler('./bench_log')) as prof:
        for _ in range(iters):
            step()
        sync()
    sort = 'cuda_time_total' if device_type == 'cuda' else 'cpu_time_total'
    print(prof.key_averages().table(sort_by=sort, row_limit=20))
    # the device's time by what it was spent on, read off kernel (or on CPU, op) names: the first kind that matches
    kinds = {}
    for e in prof.key_averages():
        if device_type == 'cuda' and e.device_type == DeviceType.CPU:
            continue  # an op's device time is its kernels' time, and the kernels are rows of their own
        us = e.self_device_time_total if device_type == 'cuda' else e.self_cpu_time_total
        name = e.key.lower()
        kind = next((k for k, words in PROFILE_KINDS if any(w in name for w in words)), 'other')
        kinds[kind] = kinds.get(kind, 0) + us
    busy = sum(kinds.values())
    shares = {k: us / busy for k, us in sorted(kinds.items(), key=lambda kv: -kv[1]) if busy}
    print(f"busy {busy / 1000 / iters:.2f} ms a step: " + ", ".join(f"{k} {v * 100:.0f}%" for k, v in shares.items()))
    print(json.dumps({**config, 'device': device_name, 'dtype': dtype, 'busy_ms': busy / 1000 / iters,
                      'shares': shares}))
    sys.exit(0)

times = []
for _ in range(iters):
    t0 = time.perf_counter()
    loss = step()
    loss.item()  # waits for the device, so each step's time is real
    times.append(time.perf_counter() - t0)
dt = statistics.median(times)
tokens = batch_size * gradient_accumulation_steps * block_size
mfu = gpt.estimate_mfu(batch_size * gradient_accumulation_steps, dt, device_name, dtype)
print(f"median {dt * 1000:.2f} ms/iter (min {min(times) * 1000:.2f}, max {max(times) * 1000:.2f}) over {iters} steps, "
      f"{tokens / dt:,.0f} tok/s" + (f", mfu {mfu * 100:.2f}%" if mfu is not None else ", mfu unknown for this device"))
peak = torch.cuda.max_memory_allocated(device) if device_type == 'cuda' else None
print(json.dumps({**config, 'device': device_name, 'dtype': dtype, 'params': gpt.get_num_params(), 'ms': dt * 1000,
                  'tokens_per_sec': tokens / dt, 'mfu': mfu, 'loss': loss.item() * gradient_accumulation_steps,
                  'peak_memory_bytes': peak}))
