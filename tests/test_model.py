import math

import pytest
import torch

from checkpoint import upgrade_optimizer_state
from model import GPT, GPTConfig, peak_flops


def tiny(**kw):
    cfg = dict(block_size=16, vocab_size=50, n_layer=2, n_head=2, n_embd=16, dropout=0.0, bias=True)
    cfg.update(kw)
    torch.manual_seed(0)
    return GPT(GPTConfig(**cfg))


def test_forward_shapes_loss_at_init_and_weight_tying():
    model = tiny()
    idx = torch.randint(50, (3, 10))
    logits, loss = model(idx, idx)
    assert logits.shape == (3, 10, 50)
    assert abs(loss.item() - math.log(50)) < 0.2  # near-uniform predictions at init
    logits, loss = model(idx)
    assert logits.shape == (3, 1, 50) and loss is None  # generation: last position only
    assert model.lm_head.weight is model.transformer.wte.weight
    # a tied parameter is counted once
    assert sum(p.numel() for p in model.parameters()) == len(torch.nn.utils.parameters_to_vector(model.parameters()))


def test_causal_attention_ignores_the_future():
    model = tiny().eval()
    idx = torch.randint(50, (1, 12))
    changed = idx.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 50
    a, _ = model(idx, idx)
    b, _ = model(changed, changed)
    assert torch.allclose(a[0, :8], b[0, :8], atol=1e-6)
    assert not torch.allclose(a[0, 8:], b[0, 8:], atol=1e-3)


def test_residual_projections_get_the_scaled_init():
    model = tiny(n_layer=8, n_embd=256, n_head=4)
    proj = torch.cat([b.attn.c_proj.weight.flatten() for b in model.transformer.h])
    fc = torch.cat([b.mlp.c_fc.weight.flatten() for b in model.transformer.h])
    assert abs(proj.std().item() - 0.02 / math.sqrt(2 * 8)) < 2e-4
    assert abs(fc.std().item() - 0.02) < 2e-4


def test_hugging_face_import_matches_its_logits(tmp_path):
    import transformers
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_head=4, n_embd=64, n_positions=32, vocab_size=100, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0))
    hf.eval()
    # make every weight count: the default init zeroes the biases
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(tmp_path)
    model = GPT.from_pretrained(str(tmp_path)).eval()
    assert (model.config.n_layer, model.config.n_head, model.config.n_embd, model.config.block_size,
            model.config.vocab_size) == (2, 4, 64, 32, 100)
    idx = torch.randint(100, (2, 32))
    ours, _ = model(idx, idx)
    theirs = hf(idx).logits
    assert (ours - theirs).abs().max().item() < 1e-5


def test_peak_flops_by_device_name():
    assert peak_flops('NVIDIA A100-SXM4-80GB') == 312e12
    assert peak_flops('NVIDIA A100-PCIE-40GB') == 312e12
    assert peak_flops('NVIDIA H100 80GB HBM3') == 989e12
    assert peak_flops('NVIDIA H100 PCIe') == 756e12
    assert peak_flops('NVIDIA H200') == 989e12
    assert peak_flops('NVIDIA H200 NVL') == 835e12  # the PCIe card: not the SXM's
    assert peak_flops('NVIDIA H100 NVL') == 835e12
    # float16 peaks with bf16; float32's matmuls run in TF32 (the entrypoints turn it on), at half of it
    assert peak_flops('NVIDIA H100 80GB HBM3', 'float16') == 989e12
    assert peak_flops('NVIDIA H100 80GB HBM3', 'float32') == 494.5e12
    assert peak_flops('NVIDIA A100-SXM4-80GB', 'float32') == 156e12
    assert peak_flops('cpu', 'float32') is None
    assert peak_flops('NVIDIA A10') == 125e12  # not A100's
    assert peak_flops('NVIDIA H20') == 148e12  # not H200's
    assert peak_flops('cpu') is None
    assert peak_flops('NVIDIA GeForce GTX 1080') is None
    assert peak_flops('NVIDIA GeForce RTX 4090') == 165e12
    assert peak_flops('NVIDIA GeForce RTX 4090 Laptop GPU') is None  # not the desktop card's
    assert peak_flops('') is None


def test_estimate_mfu_counts_flops_and_is_none_where_the_peak_is_unknown():
    model = tiny()
    cfg = model.config
    per_token = 6 * model.get_num_params() + 12 * cfg.n_layer * cfg.n_head * (cfg.n_embd // cfg.n_head) * cfg.block_size
    expected = per_token * cfg.block_size * 8 / 0.5 / 989e12
    assert model.estimate_mfu(8, 0.5, 'NVIDIA H100 80GB HBM3') == pytest.approx(expected, rel=1e-12)
    assert model.estimate_mfu(8, 0.5, 'NVIDIA H100 80GB HBM3', 'float32') == pytest.approx(2 * expected, rel=1e-12)
    # N counts the tied token embedding once (the lm_head's matmul), the position embedding not at all (a lookup)
    counted = sum(p.numel() for n, p in model.named_parameters() if n != 'transformer.wpe.weight')
    assert model.get_num_params() == counted
    assert model.estimate_mfu(8, 0.5, 'cpu') is None
    assert model.estimate_mfu(8, 0.5, 'Some Future GPU') is None


def test_generate_extends_and_crop_block_size():
    model = tiny().eval()
    idx = torch.randint(50, (2, 5))
    out = model.generate(idx, 20, temperature=1.0, top_k=5)  # longer than block_size: the context slides
    assert out.shape == (2, 25) and torch.equal(out[:, :5], idx)
    torch.manual_seed(1)
    greedy = model.generate(idx, 3, top_k=1)
    torch.manual_seed(2)
    assert torch.equal(greedy, model.generate(idx, 3, top_k=1))  # top_k=1 is argmax whatever the seed
    model.crop_block_size(8)
    assert model.transformer.wpe.weight.shape[0] == 8
    assert model(torch.randint(50, (1, 8)))[0].shape == (1, 1, 50)


def test_optimizer_decays_matrices_only():
    model = tiny()
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu')
    decay, nodecay = opt.param_groups
    assert decay['weight_decay'] == 0.1 and nodecay['weight_decay'] == 0.0
    assert all(p.dim() >= 2 for p in decay['params']) and all(p.dim() < 2 for p in nodecay['params'])
    assert len(decay['params']) + len(nodecay['params']) == len(list(model.parameters()))


def fuse_qkv(sd):
    """This repo's state dict in nanoGPT's layout (one c_attn), as nanoGPT's torch.compile'd runs save it."""
    out = {}
    for k, v in sd.items():
        if '.c_q.' in k:
            out['_orig_mod.' + k.replace('c_q', 'c_attn')] = torch.cat([v, sd[k.replace('c_q', 'c_k')],
                                                                       sd[k.replace('c_q', 'c_v')]])
        elif '.c_k.' not in k and '.c_v.' not in k:
            out['_orig_mod.' + k] = v
    return out


def test_nanogpt_layout_converts_to_ours():
    model = tiny()
    sd = model.state_dict()
    assert not any('c_attn' in k for k in sd)
    upgraded = GPT.upgrade_state_dict(fuse_qkv(sd))
    assert upgraded.keys() == sd.keys()
    assert all(torch.equal(upgraded[k], sd[k]) for k in sd)


def test_nanogpt_optimizer_state_converts_to_ours():
    model = tiny()
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu')
    idx = torch.randint(50, (2, 8))
    model(idx, idx)[1].backward()
    opt.step()
    ours = opt.state_dict()
    # the same state in nanoGPT's order: each c_q, c_k, c_v triple stands as one c_attn
    params = dict(model.named_parameters())
    decay, nodecay = model.param_groups()
    names = decay + nodecay
    fused_names = [n.replace('c_q', 'c_attn') for n in names if '.c_k.' not in n and '.c_v.' not in n]
    theirs_state = {}
    for i, n in enumerate(fused_names):
        if '.c_attn.' in n:
            parts = [ours['state'][names.index(n.replace('c_attn', x))] for x in ('c_q', 'c_k', 'c_v')]
            theirs_state[i] = {'step': parts[0]['step'].clone(),
                               'exp_avg': torch.cat([p['exp_avg'] for p in parts]),
                               'exp_avg_sq': torch.cat([p['exp_avg_sq'] for p in parts])}
        else:
            theirs_state[i] = ours['state'][names.index(n)]
    n_decay_fused = sum(1 for n in fused_names if params.get(n, None) is None or params[n].dim() >= 2) - \
        sum(1 for n in fused_names if '.c_attn.bias' in n)
    groups = [dict(ours['param_groups'][0], params=list(range(n_decay_fused))),
              dict(ours['param_groups'][1], params=list(range(n_decay_fused, len(fused_names))))]
    upgraded = upgrade_optimizer_state(model, {'state': theirs_state, 'param_groups': groups})
    assert [g['params'] for g in upgraded['param_groups']] == [g['params'] for g in ours['param_groups']]
    for i, s in ours['state'].items():
        for k in ('step', 'exp_avg', 'exp_avg_sq'):
            assert torch.equal(upgraded['state'][i][k], s[k]), (i, k)
    # a state that is already ours passes through
    assert upgrade_optimizer_state(model, ours) is ours


def relative_error(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize('levers', [dict(fused_qkv=True), dict(loss_rows=7), dict(fused_qkv=True, loss_rows=64),
                                    dict(autocast_residual=True)])
def test_speed_levers_compute_the_plain_models_loss_and_gradients(levers):
    """GPTConfig's fused_qkv, loss_rows and autocast_residual change how the step computes, not what: the same loss
    and gradients in float32 (to rounding), near them under bf16 autocast, the same eval loss, and a loss scaled
    before backward (as gradient accumulation scales it) scales the gradients. 7 rows do not divide the 30 of the
    batch, and ignored targets (-1) count for nothing."""
    plain, fast = tiny(), tiny(**levers)
    residual = []  # what the second block reads: the residual stream
    fast.transformer.h[1].register_forward_pre_hook(lambda module, args: residual.append(args[0].dtype))
    assert fast.state_dict().keys() == plain.state_dict().keys()  # the same parameters: checkpoints are alike
    idx, targets = torch.randint(50, (3, 10)), torch.randint(50, (3, 10))
    targets[0, :4] = -1
    for dtype, scale, tolerance in ((torch.float32, 1.0, 1e-6), (torch.float32, 0.25, 1e-6),
                                    (torch.bfloat16, 1.0, 2e-2)):
        grads = []
        for model in (plain, fast):
            model.zero_grad(set_to_none=True)
            with torch.autocast('cpu', dtype=dtype, enabled=dtype != torch.float32):
                _, loss = model(idx, targets)
            (loss * scale).backward()
            grads.append((loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
        (loss0, grad0), (loss1, grad1) = grads
        assert abs(loss1.item() - loss0.item()) <= tolerance * loss0.item()
        assert relative_error(grad1, grad0) <= tolerance * (10 if dtype == torch.float32 else 1), (dtype, scale)
        assert torch.isfinite(grad1).all()
    # bf16 under autocast where the lever says so, else float32 (also in a float32 step: autocast is off)
    bf16 = torch.bfloat16 if levers.get('autocast_residual') else torch.float32
    assert residual == [torch.float32, torch.float32, bf16], residual
    with torch.no_grad():  # eval: the plain path, logits and all
        (logits0, loss0), (logits1, loss1) = plain(idx, targets), fast(idx, targets)
    assert logits1.shape == logits0.shape and torch.allclose(loss1, loss0, rtol=1e-6)
    # an ignored row's gradient is nothing: the loss does not depend on what it would have predicted
    fast.zero_grad(set_to_none=True)
    x = torch.randn(30, 16, requires_grad=True)
    from model import LinearCrossEntropy
    LinearCrossEntropy.apply(x, fast.lm_head.weight, targets.view(-1), levers.get('loss_rows', 4)).backward()
    assert (x.grad[:4] == 0).all() and (x.grad[4:] != 0).any()
