"""
The GPT-2 language model, shared by every entrypoint in this repo.

It knows nothing about how it is trained: no process groups, wrapping or sharding live here. Parameter names
follow nanoGPT (and so Hugging Face's GPT-2), except that attention keeps q, k and v as three projections
(c_q, c_k, c_v) instead of one fused c_attn, so that tensor parallelism can shard them column-wise by heads.
Checkpoints that use the fused layout are converted by `upgrade_state_dict`.
"""

import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257 rounded up to a multiple of 64 for faster matmuls
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # bias in Linears and LayerNorms, as GPT-2; False is a little faster and as good
    # how the step computes, not what: the same parameters and checkpoints either way. Off until a GPU run shows
    # that they pay (docs/speed.md); bench.py alone sets them, where no sharding or tensor parallelism splits a
    # weight that they read whole
    fused_qkv: bool = False  # q, k and v from one matmul of their three weights stacked, not three matmuls
    loss_rows: int = 0  # the training loss over this many rows of logits at a time (LinearCrossEntropy); 0: at once
    # under autocast, the residual stream in autocast's dtype (bf16), not float32 (nanoGPT's): half the bytes that
    # each layer norm and residual add reads and writes. This one changes the numerics: a loss check decides
    autocast_residual: bool = False


# (n_layer, n_head, n_embd) of OpenAI's GPT-2 sizes: 124M, 350M, 774M and 1558M parameters
GPT2_SHAPES = {'gpt2': (12, 12, 768), 'gpt2-medium': (24, 16, 1024), 'gpt2-large': (36, 20, 1280),
               'gpt2-xl': (48, 25, 1600)}


def count_params(n_layer, n_head, n_embd, block_size, vocab_size, bias=True, **_):
    """The GPT's parameters (the tied embedding once) by arithmetic, building nothing: a shape too big for the
    machine is sized, and refused, in no time and no memory."""
    b = int(bool(bias))
    block = 2 * n_embd * (1 + b) + 4 * (n_embd * n_embd + b * n_embd) + 8 * n_embd * n_embd + b * 5 * n_embd
    return vocab_size * n_embd + block_size * n_embd + n_layer * block + n_embd * (1 + b)


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0, "n_embd must be a multiple of n_head"
        self.c_q = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_k = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_v = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.head_dim = config.n_embd // config.n_head
        self.dropout = config.dropout
        self.fused_qkv = config.fused_qkv

    def forward(self, x):
        B, T, _ = x.size()
        if self.fused_qkv:
            # one matmul three times as wide fills more of a GPU; the stacking is a copy that a compiled step folds
            # into the cast to bf16 it does anyway
            w = torch.cat((self.c_q.weight, self.c_k.weight, self.c_v.weight))
            b = None if self.c_q.bias is None else torch.cat((self.c_q.bias, self.c_k.bias, self.c_v.bias))
            q, k, v = F.linear(x, w, b).view(B, T, 3, -1, self.head_dim).transpose(1, 3).unbind(2)  # (B, nh, T, hs)
        else:
            # -1 heads rather than n_head: under tensor parallelism each rank holds only its own heads
            q = self.c_q(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
            k = self.c_k(x).view(B, T, -1, self.head_dim).transpose(1, 2)
            v = self.c_v(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.resid_dropout(self.c_proj(y))


class LinearCrossEntropy(torch.autograd.Function):
    """F.cross_entropy(x @ weight.T, targets, ignore_index=-1) over `rows` rows of x at a time, each chunk's
    gradients computed on the way forward and its logits freed at once. The whole batch's logits are B·T·V floats:
    for GPT-2 at batch 12, 1.2 GB in bf16 and 2.5 GB more in float32 for the softmax, written and read back in
    the backward pass. Here one chunk's exist at a time; the matmuls are the same three."""

    @staticmethod
    def forward(ctx, x, weight, targets, rows):
        count = (targets != -1).sum()
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        for i in range(0, x.size(0), rows):
            xi, ti = x[i:i + rows], targets[i:i + rows]
            logits = xi @ weight.t()  # bf16 under autocast, as lm_head's would be
            logp = logits.float().log_softmax(-1)
            keep = (ti != -1).unsqueeze(1)
            target = ti.clamp(min=0).unsqueeze(1)  # an ignored row's target is any index: it is masked out
            loss -= (logp.gather(1, target) * keep).sum()
            # d loss / d logits = (softmax - one_hot(target)) / count, on the rows that count
            g = logp.exp_().scatter_add_(1, target, -keep.float()).mul_(keep / count).to(logits.dtype)
            del logits, logp
            if grad_x is not None:
                grad_x[i:i + rows] = g @ weight
            if grad_w is not None:
                grad_w += g.t() @ xi
        ctx.save_for_backward(grad_x, grad_w)
        return loss / count

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_w = ctx.saved_tensors
        return (None if grad_x is None else grad_x * grad_loss, None if grad_w is None else grad_w * grad_loss,
                None, None)


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        # GPT-2 was trained with the tanh approximation of GELU; the exact one shifts imported logits by ~1e-3
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate='tanh')))


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.vocab_size is not None and config.block_size is not None
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # weight tying: the output projection is the token embedding (https://paperswithcode.com/method/weight-tying)
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        # GPT-2: residual projections scaled so that the residual stream's variance does not grow with depth
        for pn, p in self.named_parameters():
            if pn.endswith('c_proj.weight'):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def get_num_params(self, non_embedding=True):
        """Parameter count; position embeddings are left out by default (token embeddings count, as lm_head)."""
        n_params = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n_params -= self.transformer.wpe.weight.numel()
        return n_params

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        assert t <= self.config.block_size, f"sequence of length {t} is longer than block_size {self.config.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        if self.config.autocast_residual and torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))  # the blocks' outputs (bf16) then keep it so
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None and self.config.loss_rows and torch.is_grad_enabled():
            logits = None  # never made whole: that is the point
            loss = LinearCrossEntropy.apply(x.view(b * t, -1), self.lm_head.weight, targets.view(-1),
                                            self.config.loss_rows)
        elif targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            # generation needs only the last position's logits; the list index keeps the time dimension
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss

    def crop_block_size(self, block_size):
        """Shrink the context length, e.g. to fine-tune GPT-2 (1024) with a smaller block_size."""
        assert block_size <= self.config.block_size
        self.config.block_size = block_size
        self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size])

    def crop_vocab_size(self, vocab_size):
        """Drop the embedding rows past vocab_size: the padding of a GPT-2 BPE model trained here (50304 -> 50257),
        ids with no text. Its logits are then those of the tokens alone, as an export's are."""
        assert vocab_size <= self.config.vocab_size
        self.config.vocab_size = vocab_size
        self.transformer.wte.weight = nn.Parameter(self.transformer.wte.weight[:vocab_size])
        self.lm_head.weight = self.transformer.wte.weight  # still tied

    @staticmethod
    def upgrade_state_dict(sd):
        """Takes a model state dict in nanoGPT's or this repo's layout and returns it in this repo's layout:
        drops torch.compile's `_orig_mod.` prefix and the causal-mask buffers old nanoGPT saved, and splits each
        fused c_attn (q, k, v stacked along the output dimension) into c_q, c_k, c_v."""
        out = {}
        for k, v in sd.items():
            k = k.removeprefix('_orig_mod.')
            if k.endswith('.attn.bias') or k.endswith('.attn.masked_bias'):
                continue
            if '.attn.c_attn.' in k:
                for name, part in zip(('c_q', 'c_k', 'c_v'), v.chunk(3, dim=0)):
                    out[k.replace('c_attn', name)] = part.clone()
            else:
                out[k] = v
        return out

    @classmethod
    def from_pretrained(cls, model_type, override_args=None):
        """GPT-2 weights from Hugging Face: a hub name ('gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl') or a local
        folder written by `GPT2LMHeadModel.save_pretrained`. Only dropout may be overridden."""
        override_args = override_args or {}
        assert all(k == 'dropout' for k in override_args), "only dropout can be overridden"
        from transformers import GPT2LMHeadModel  # imported here only: training from scratch does not need it
        from transformers.utils.logging import disable_progress_bar
        disable_progress_bar()  # its "Loading weights" bar: lines on stderr around a tool's output or one-line error
        try:  # the local cache first: with the hub asked first, an offline node waits out its retries (or hangs)
            hf_model = GPT2LMHeadModel.from_pretrained(model_type, weights_only=True, local_files_only=True)
        except OSError:  # not there: from the hub, as before (a .bin is data, never code)
            hf_model = GPT2LMHeadModel.from_pretrained(model_type, weights_only=True)
        hf = hf_model.config
        # settings that save_pretrained keeps and under which GPT2LMHeadModel computes another function than this GPT:
        # loaded, they would give another model without a word ('gelu_pytorch_tanh' is gelu_new, in another kernel)
        ours = {'activation_function': ('gelu_new', 'gelu_pytorch_tanh'), 'layer_norm_epsilon': (1e-5,),
                'scale_attn_weights': (True,), 'scale_attn_by_inverse_layer_idx': (False,),
                'tie_word_embeddings': (True,), 'n_inner': (None, 4 * hf.n_embd)}
        other = [f"{k}={getattr(hf, k)!r}" for k, values in ours.items() if getattr(hf, k, values[0]) not in values]
        if other:
            raise NotImplementedError(', '.join(other))
        config = GPTConfig(block_size=hf.n_positions, vocab_size=hf.vocab_size, n_layer=hf.n_layer,
                           n_head=hf.n_head, n_embd=hf.n_embd, bias=True,
                           dropout=override_args.get('dropout', 0.0))
        model = GPT(config)
        # Hugging Face stores its Linear layers as Conv1D, whose weights are the transpose of nn.Linear's
        transposed = ('attn.c_attn.weight', 'attn.c_proj.weight', 'mlp.c_fc.weight', 'mlp.c_proj.weight')
        sd_hf = {k: (v.t() if k.endswith(transposed) else v) for k, v in hf_model.state_dict().items()}
        sd_hf = cls.upgrade_state_dict(sd_hf)
        sd = model.state_dict()
        missing = set(sd) - set(sd_hf)
        assert not missing, f"Hugging Face checkpoint lacks {sorted(missing)}"
        with torch.no_grad():
            for k in sd:
                assert sd_hf[k].shape == sd[k].shape, f"{k}: {sd_hf[k].shape} != {sd[k].shape}"
                sd[k].copy_(sd_hf[k])
        return model

    def param_groups(self):
        """Parameter names in the optimizer's two groups: matrices (Linear weights, embeddings) decay; biases and
        LayerNorm gains do not. Each tied parameter appears once."""
        named = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        return [n for n, p in named if p.dim() >= 2], [n for n, p in named if p.dim() < 2]

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        params = dict(self.named_parameters())
        decay, nodecay = self.param_groups()
        optim_groups = [
            {'params': [params[n] for n in decay], 'weight_decay': weight_decay},
            {'params': [params[n] for n in nodecay], 'weight_decay': 0.0},
        ]
        # the fused kernel does the whole update in a few launches; recent torch has it for CUDA and CPU
        fused = 'fused' in inspect.signature(torch.optim.AdamW).parameters and device_type in ('cuda', 'cpu')
        return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas, **({'fused': True} if fused else {}))

    def flops_per_token(self):
        """Training FLOPs per token: 6N for the matmuls of forward and backward, plus attention's
        12·L·H·Q·T (PaLM paper, appendix B)."""
        cfg = self.config
        L, H, Q, T = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, cfg.block_size
        return 6 * self.get_num_params() + 12 * L * H * Q * T

    def estimate_mfu(self, fwdbwd_per_iter, dt, device_name, dtype='bfloat16'):
        """Model FLOPs utilization: achieved FLOP/s over the device's peak dense FLOP/s for the run's dtype. None
        where the peak is unknown (a CPU, an unlisted GPU): no number beats a wrong one."""
        peak = peak_flops(device_name, dtype)
        if peak is None or dt <= 0:
            return None
        return self.flops_per_token() * self.config.block_size * fwdbwd_per_iter / dt / peak

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """Extend idx (B, T) by max_new_tokens sampled tokens; call in eval mode."""
        for _ in range(max_new_tokens):
            idx_cond = idx if idx.size(1) <= self.config.block_size else idx[:, -self.config.block_size:]
            logits, _ = self(idx_cond)
            # in float32, less the largest first: a small temperature sends the others to -inf, and never (in float16
            # autocast's logits, from about 1e-4) the largest to inf, which softmax makes nan
            logits = logits[:, -1, :].float()
            logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float('Inf')
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


# Peak dense (no sparsity) bf16 tensor-core FLOP/s from NVIDIA's datasheets, matched against
# torch.cuda.get_device_name() in order: the first entry whose words all appear in the name wins,
# so the specific variants come before the general ones (('H100',) would otherwise match the PCIe card).
PEAK_BF16_FLOPS = [
    (('H100', 'PCIe'), 756e12),
    (('H100', 'NVL'), 835e12),
    (('H100',), 989e12),   # SXM5; its device name is 'NVIDIA H100 80GB HBM3'
    (('H800', 'PCIe'), 756e12),
    (('H800',), 989e12),
    (('GH200',), 989e12),
    (('H200', 'NVL'), 835e12),
    (('H200',), 989e12),   # SXM
    (('H20',), 148e12),
    (('B200',), 2250e12),
    (('A100',), 312e12),   # SXM4 and PCIe alike
    (('A800',), 312e12),
    (('A10',), 125e12),
    (('L40S',), 362e12),
    (('L40',), 181e12),
    (('L4',), 121e12),
    (('RTX', 'A6000'), 155e12),
    (('RTX', '4090'), 165e12),
    (('RTX', '3090'), 71e12),
]


def peak_flops(device_name, dtype='bfloat16'):
    """Peak dense FLOP/s of a device by its name for a run in dtype, or None when it is unknown or a CPU. float16's
    is bf16's on every GPU listed; float32 runs its matmuls in TF32 (every entrypoint turns it on), whose peak is half
    of bf16's on each of them: measured against bf16's, an fp32 run's MFU would read half what it is."""
    if not device_name:
        return None
    words = device_name.replace('-', ' ').split()
    if 'Laptop' in words:
        return None  # a laptop's chip of the same name has fewer cores and lower clocks than the desktop card listed
    for keys, flops in PEAK_BF16_FLOPS:
        if all(k in words for k in keys):
            return flops / 2 if dtype == 'float32' else flops
    return None
