"""train.py in real processes: DDP on gloo against one process, exact resume, nanoGPT checkpoints, logging."""

import json
import math
import re
import subprocess
import sys

import pytest
import torch

from conftest import REPO, TINY, env, free_port, one_line_error, read_metrics, run
from launcher import launch


def train(tmp_path, data_dir, out, *extra, nproc=1, dataset='shakespeare_char', check=True):
    return run('train.py', *TINY, f'--dataset={data_dir / dataset}', f'--out_dir={tmp_path / out}', *extra,
               nproc=nproc, cwd=tmp_path, check=check)


def weights(path):
    return torch.load(path, map_location='cpu', weights_only=True)['model']


def test_two_ranks_match_one_rank_with_the_same_global_batch(tmp_path, data_dir):
    # gradient_accumulation_steps is the total: 4 micro-steps on one rank, 2 on each of two
    args = ['--gradient_accumulation_steps=4', '--max_iters=12', '--eval_interval=12']
    train(tmp_path, data_dir, 'one', *args)
    train(tmp_path, data_dir, 'two', *args, nproc=2)
    one, one_evals = read_metrics(tmp_path / 'one')
    two, two_evals = read_metrics(tmp_path / 'two')
    assert sorted(one) == sorted(two) == list(range(12))
    for it in one:
        assert abs(one[it] - two[it]) <= 1e-5 * abs(one[it]), (it, one[it], two[it])
    assert one[11] < one[0] - 0.3  # it learns
    assert abs(one_evals[-1]['val_loss'] - two_evals[-1]['val_loss']) <= 1e-5 * one_evals[-1]['val_loss']
    w1, w2 = weights(tmp_path / 'one' / 'ckpt.pt'), weights(tmp_path / 'two' / 'ckpt.pt')
    # absolute: c_k's bias gets no gradient (softmax ignores a shift shared by all keys), so it holds only
    # rounding noise that Adam scales up, ~1e-6 on either side
    for k in w1:
        assert (w1[k] - w2[k]).abs().max().item() < 1e-5, k
    # the other launchers of two ranks: torch.distributed.launch (it adds --local-rank=K), and env:// alone, as a
    # Kubeflow PyTorchJob's plain `python` command sets it (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; no LOCAL_RANK)
    flags = [*TINY, f'--dataset={data_dir / "shakespeare_char"}', *args]
    launched = subprocess.run([sys.executable, '-m', 'torch.distributed.launch', '--nproc_per_node=2',
                             f'--master_port={free_port()}', str(REPO / 'train.py'), *flags,
                             f'--out_dir={tmp_path / "launch"}'], cwd=tmp_path, env=env(), capture_output=True,
                            text=True, timeout=300)
    assert launched.returncode == 0, launched.stderr[-3000:]
    # (both on this host: each took itself for its node's first rank, and the two wrote one memory snapshot file)
    port = free_port()
    ranks = [subprocess.Popen([sys.executable, str(REPO / 'train.py'), *flags, f'--out_dir={tmp_path / "plain"}',
                               '--save_memory_interval=1'],
                              cwd=tmp_path, env={**env(), 'RANK': str(r), 'WORLD_SIZE': '2', 'MASTER_ADDR': '127.0.0.1',
                                                 'MASTER_PORT': str(port)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert not [line for out in outputs for line in out.splitlines() if 'memory snapshot' in line], outputs
    p = launch(str(REPO / 'train.py'), flags + [f'--out_dir={tmp_path / "bare"}'], {**env(), 'RANK': '0',
               'WORLD_SIZE': '2'}, tmp_path)  # without the rest of env://: init_process_group's ValueError
    assert one_line_error(p) == "error: RANK and WORLD_SIZE are set, but not MASTER_ADDR and MASTER_PORT (rank 0's " \
        "host and a free port on it), which env:// needs: set them, or launch with torchrun"
    for out in ('launch', 'plain'):
        assert json.loads((tmp_path / out / 'config.json').read_text())['world_size'] == 2
        losses, _ = read_metrics(tmp_path / out)
        assert sorted(losses) == list(range(12))
        for it in two:
            assert abs(losses[it] - two[it]) <= 1e-6 * abs(two[it]), (out, it, losses[it], two[it])


@pytest.mark.parametrize('nproc', [1, 2])
def test_resume_repeats_the_uninterrupted_run_exactly(tmp_path, data_dir, nproc):
    # dropout on, so the RNG state has to come back too, on every rank
    args = ['--gradient_accumulation_steps=2', '--dropout=0.1', '--eval_interval=5', '--always_save_checkpoint=True']
    train(tmp_path, data_dir, 'full', *args, '--max_iters=10', nproc=nproc)
    train(tmp_path, data_dir, 'split', *args, '--max_iters=5', nproc=nproc)
    first, _ = read_metrics(tmp_path / 'split')
    assert sorted(first) == list(range(5))
    train(tmp_path, data_dir, 'split', *args, '--max_iters=10', '--init_from=resume', nproc=nproc)
    full, full_evals = read_metrics(tmp_path / 'full')
    split, split_evals = read_metrics(tmp_path / 'split')
    assert sorted(split) == list(range(10))
    assert [split[i] for i in range(10)] == [full[i] for i in range(10)]  # bit for bit
    assert split_evals[-1]['val_loss'] == full_evals[-1]['val_loss']
    w_full, w_split = weights(tmp_path / 'full' / 'ckpt.pt'), weights(tmp_path / 'split' / 'ckpt.pt')
    assert all(torch.equal(w_full[k], w_split[k]) for k in w_full)
    if nproc == 1:  # another weight_decay and beta2 take effect: AdamW's load_state_dict had put the saved ones back
        # an init_from given over a run in out_dir (a new run's start) is not used, and the line says so
        p = train(tmp_path, data_dir, 'split', *args, '--max_iters=11', '--weight_decay=0.5', '--beta2=0.9',
                  f'--init_from={tmp_path / "full"}')
        assert f"so the run continues (not from --init_from={tmp_path / 'full'}, a new run's start: give another " \
            f"--out_dir for one, or --auto_resume=False to set this run aside in {tmp_path / 'split'})" in p.stdout
        assert sorted(read_metrics(tmp_path / 'split')[0]) == list(range(11))
        groups = torch.load(tmp_path / 'split' / 'ckpt.pt', weights_only=True)['optimizer']['param_groups']
        assert [(g['weight_decay'], tuple(g['betas'])) for g in groups] == [(0.5, (0.9, 0.9)), (0.0, (0.9, 0.9))]


def test_log_line_and_metrics_leave_mfu_out_on_cpu(tmp_path, data_dir):
    p = train(tmp_path, data_dir, 'log', '--max_iters=3', '--eval_interval=3', '--gradient_accumulation_steps=1')
    lines = [l for l in p.stdout.splitlines() if l.startswith('iter ')]
    assert len(lines) == 3
    assert all(re.fullmatch(r'iter \d+: loss \d+\.\d{4}, time \d+\.\d\d ms, [\d,]+ tok/s', l) for l in lines), lines
    rows = [json.loads(l) for l in (tmp_path / 'log' / 'metrics.jsonl').read_text().splitlines()]
    steps = [r for r in rows if 'loss' in r]
    assert [r['iter'] for r in steps] == [0, 1, 2]
    assert all(r['mfu'] is None and r['tokens_per_sec'] > 0 and r['ms'] > 0 and r['lr'] > 0 for r in steps)
    evals = [r for r in rows if 'val_loss' in r]
    assert [r['iter'] for r in evals] == [0, 3] and evals[1]['val_loss'] < evals[0]['val_loss']


def nanogpt_checkpoint(path, model_args):
    """A checkpoint as nanoGPT's train.py writes it: a torch.compile'd model's keys (`_orig_mod.`), one fused
    c_attn per layer, AdamW state in nanoGPT's parameter order (its state_dict's order, tied lm_head left out),
    best_val_loss as a tensor, no RNG. Each tensor's exp_avg_sq is filled with its own number (and c_attn's q, k,
    v rows with three), so that a state landing on the wrong parameter shows."""
    from model import GPT, GPTConfig
    from test_model import fuse_qkv
    torch.manual_seed(123)
    model = GPT(GPTConfig(**model_args))
    sd = fuse_qkv(model.state_dict())
    names = [k.removeprefix('_orig_mod.') for k in sd if not k.endswith('lm_head.weight')]
    params = [torch.nn.Parameter(sd['_orig_mod.' + n].clone()) for n in names]
    decay = [p for p in params if p.dim() >= 2]
    nodecay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{'params': decay, 'weight_decay': 0.1}, {'params': nodecay, 'weight_decay': 0.0}],
                            lr=1e-3, betas=(0.9, 0.99))
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    expected = {}
    for i, (n, p) in enumerate(zip(names, params)):
        st = opt.state[p]
        if '.c_attn.' in n:
            for j, qkv in enumerate(('c_q', 'c_k', 'c_v')):
                st['exp_avg_sq'].narrow(0, j * model_args['n_embd'], model_args['n_embd']).fill_(100 * i + j + 1)
                expected[n.replace('c_attn', qkv)] = 100 * i + j + 1
        else:
            st['exp_avg_sq'].fill_(100 * i + 1)
            expected[n] = 100 * i + 1
    torch.save({'model': sd, 'optimizer': opt.state_dict(), 'model_args': model_args, 'iter_num': 6,
                'best_val_loss': torch.tensor(4.0), 'config': {'dataset': 'shakespeare_char'}}, path)
    return model, expected


def test_a_nanogpt_checkpoint_resumes_and_samples(tmp_path, data_dir):
    out = tmp_path / 'nano'
    out.mkdir()
    model_args = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, bias=True, vocab_size=65, dropout=0.0)
    model, expected = nanogpt_checkpoint(out / 'ckpt.pt', model_args)
    p = train(tmp_path, data_dir, 'nano', '--init_from=resume', '--max_iters=7', '--eval_interval=1',
              '--always_save_checkpoint=True', '--grad_clip=0.0', '--gradient_accumulation_steps=1')
    assert 'resuming from' in p.stdout and 'at iter 6' in p.stdout
    losses, evals = read_metrics(out)
    assert sorted(losses) == [6] and [e['iter'] for e in evals] == [6, 7]
    # the first eval saw nanoGPT's weights: the same loss as the model the test built, on the eval batches
    import numpy as np
    data = np.fromfile(data_dir / 'shakespeare_char' / 'val.bin', dtype=np.uint16)
    offsets = torch.randint(len(data) - 32, (4, 4), generator=torch.Generator().manual_seed(1337 + 2))
    model.eval()
    with torch.no_grad():
        val = sum(model(torch.from_numpy(data[o.numpy()[:, None] + np.arange(32)].astype(np.int64)),
                        torch.from_numpy(data[o.numpy()[:, None] + np.arange(1, 33)].astype(np.int64)))[1].item()
                  for o in offsets) / 4
    assert abs(evals[0]['val_loss'] - val) < 1e-5
    # one AdamW step later each parameter's exp_avg_sq is beta2 times its own nanoGPT value, plus a tiny g^2
    c = torch.load(out / 'ckpt.pt', weights_only=True)
    from model import GPT, GPTConfig
    names = [n for group in GPT(GPTConfig(**model_args)).param_groups() for n in group]
    for i, n in enumerate(names):
        st = c['optimizer']['state'][i]
        assert st['step'].item() == 2, n
        ratio = st['exp_avg_sq'] / (0.99 * expected[n])
        assert ratio.min().item() >= 1 and ratio.max().item() < 1.001, (n, ratio.min(), ratio.max())
    s = run('sample.py', f'--out_dir={out}', f'--meta_path={data_dir / "shakespeare_char" / "meta.pkl"}',
            '--num_samples=2', '--max_new_tokens=30', '--device=cpu', cwd=tmp_path)
    assert s.stdout.count('---------------') == 2


def test_float16_with_a_loss_scaler_learns_and_resumes_a_float32_checkpoint_and_bf16_its_residual(tmp_path, data_dir):
    train(tmp_path, data_dir, 'fp32', '--max_iters=4', '--eval_interval=4', '--gradient_accumulation_steps=1')
    train(tmp_path, data_dir, 'fp32', '--max_iters=12', '--eval_interval=4', '--gradient_accumulation_steps=1',
          '--dtype=float16', '--init_from=resume')
    losses, _ = read_metrics(tmp_path / 'fp32')
    assert all(math.isfinite(v) for v in losses.values()) and losses[11] < losses[4] - 0.2
    assert torch.load(tmp_path / 'fp32' / 'ckpt.pt', weights_only=True)['scaler']['scale'] > 0
    # the bf16 residual stream: runs started from that checkpoint's weights in bfloat16, with it and without, learn
    # alike but not to the bit (the lever is in effect); the checkpoint's shape is the same (how the step computes is
    # not saved). float16 is refused in one line, the run's folder untouched.
    p = train(tmp_path, data_dir, 'fp32', '--max_iters=16', '--dtype=float16', '--autocast_residual=True', check=False)
    assert p.returncode != 0 and 'autocast_residual=True needs dtype=bfloat16' in p.stderr
    assert 'Traceback' not in p.stderr and read_metrics(tmp_path / 'fp32')[0].keys() == losses.keys()
    bf16 = {}
    for lever in ('True', 'False'):
        train(tmp_path, data_dir, f'bf16-{lever}', '--max_iters=6', '--eval_interval=6', '--dtype=bfloat16',
              '--gradient_accumulation_steps=1', f'--init_from={tmp_path / "fp32"}', f'--autocast_residual={lever}')
        bf16[lever], _ = read_metrics(tmp_path / f'bf16-{lever}')
        assert all(math.isfinite(v) for v in bf16[lever].values()) and bf16[lever][5] < losses[11]
    assert bf16['True'] != bf16['False'] and abs(bf16['True'][5] - bf16['False'][5]) < 0.05
    saved = torch.load(tmp_path / 'bf16-True' / 'ckpt.pt', weights_only=True)
    assert saved['model_args'] == torch.load(tmp_path / 'bf16-False' / 'ckpt.pt', weights_only=True)['model_args']


def test_bench_times_steps(tmp_path, data_dir):
    p = run('bench.py', '--device=cpu', '--compile=False', '--n_layer=2', '--n_head=2', '--n_embd=32',
            '--block_size=32', '--batch_size=4', '--warmup=1', '--iters=3', cwd=tmp_path)
    assert re.search(r'median [\d.]+ ms/iter .* over 3 steps, [\d,]+ tok/s, mfu unknown', p.stdout), p.stdout
    row = json.loads(p.stdout.strip().splitlines()[-1])
    assert row['ms'] > 0 and row['mfu'] is None and row['params'] > 0
    p = run('bench.py', '--device=cpu', '--compile=False', '--n_layer=2', '--n_head=2', '--n_embd=32',
            '--real_data=True', f'--dataset={data_dir / "shakespeare_char"}', '--block_size=32', '--batch_size=4',
            '--warmup=1', '--iters=2', '--coordinate_descent=True', cwd=tmp_path)
    row = json.loads(p.stdout.strip().splitlines()[-1])
    assert row['params'] > 0 and row['real_data'] and not row['random_data']  # the row says what data it timed
    assert row['coordinate_descent'] is True  # a lever it takes (what it does to the kernels is a GPU matter)
