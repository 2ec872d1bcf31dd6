"""
What pp_train.py needs besides torch.distributed.pipelining itself: a GPT cut into stages by blocks (each keeping the
model's own parameter names, so that checkpoints are the model's), which stages a rank holds (in a loop, or in
zbv's V), the schedules by name, the tied embedding's gradient summed across the first and the last stage,
gradients averaged over micro-batches and pipelines, their global norm, a plain forward through the pipeline for
evals, the consolidated checkpoint, and the memory a rank's stages need. Not for: the schedules themselves (torch's)
or the model (model.py, which knows nothing of pipelines).
"""

import itertools
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.pipelining import (Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from checkpoint import print0, save_in_background
from model import GPT
from sharded import optim_state_dict_by_index, put_together, rank_pieces
from sharded import sharded_state as stage_state


def stage_ids(pp_rank, pp_size, stages_per_rank, v_shape=False):
    """The stages a rank holds: in the looped placement of the interleaved schedules rank r holds r, r + pp, ...;
    in zbv's V, r and 2 pp - 1 - r (down the ranks and back up, so that the first rank holds both ends)."""
    if v_shape:
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + j * pp_size for j in range(stages_per_rank)]


# pp_train.py's schedules, torch's by name (gpipe and 1f1b run one stage a rank, the others a list of them)
SCHEDULES = {'gpipe': ScheduleGPipe, '1f1b': Schedule1F1B, 'interleaved-1f1b': ScheduleInterleaved1F1B,
             'interleaved-zb': ScheduleInterleavedZeroBubble, 'zbv': ScheduleZBVZeroBubble,
             'dualpipev': ScheduleDualPipeV}
ZERO_BUBBLE = ('interleaved-zb', 'zbv', 'dualpipev')  # backwards split in two, which compiled blocks cannot do
V_SHAPED = ('zbv', 'dualpipev')  # two stages a rank, down the ranks and back up


def placement(schedule, stages_per_rank):
    """(the stages on each rank, whether they lie in a V) for a schedule: zbv's and DualPipeV's two in a V, the
    interleaved schedules' stages_per_rank in a loop, one for the others."""
    if schedule in V_SHAPED:
        return 2, True
    return (stages_per_rank if schedule.startswith('interleaved') else 1), False


def make_schedule(name, stages, micro_batches, loss_fn, **kwargs):
    """torch's schedule of that name over this rank's stages (a list). Where the rank holds every stage (pp 1) and
    they are sharded (dp_shard), all of them stay gathered through the step, as under fsdp_train.py's
    reshard_after_forward=False: torch's plan keeps 3 of a rank's stages gathered, and would let the first go (its
    root gathers the tied embedding, shard_stages) while the last still computes with it."""
    Schedule = SCHEDULES[name]
    for stage in stages:
        # torch 2.11 (the GPU machine's) opens a stage's links with a send to each neighbour, even one on this rank,
        # which gloo cannot reach ("Pair is not connected": zbv's V, any pp 1); 2.13 no longer sends such. A schedule
        # hands a neighbour on the same rank its tensors directly, so those links are never used: leave them out.
        opens = getattr(stage, '_get_init_p2p_neighbors_ops', None)  # (a private method: gone in a later torch)
        if opens is not None:
            stage._get_init_p2p_neighbors_ops = lambda opens=opens: [op for op in opens() if op.peer != dist.get_rank()]
    schedule = Schedule(stages[0] if issubclass(Schedule, PipelineScheduleSingle) else stages, micro_batches,
                        loss_fn=loss_fn, **kwargs)
    if len(stages) > 3 and stages[0].is_first and stages[-1].is_last and isinstance(stages[0].submod, FSDPModule):
        # torch's own planning, private: imported here, so that another torch (a GPU machine's) fails only this case
        from torch.distributed.pipelining.schedules import _add_reduce_grad, _add_unshard_reshard
        schedule._prepare_schedule_with_comms({rank: _add_reduce_grad(_add_unshard_reshard(order, len(stages)),
                                                                      micro_batches)
                                               for rank, order in schedule.pipeline_order.items()}, 'compute_comms')
    return schedule


def stage_rank(stage, pp_size, v_shape=False):
    """The pipeline rank that holds a stage (stage_ids' inverse)."""
    return min(stage, 2 * pp_size - 1 - stage) if v_shape else stage % pp_size


def stage_blocks(stage, n_stages, n_layer):
    """The blocks of a stage: consecutive, as even as n_layer allows (the earlier stages take one fewer)."""
    if n_layer < n_stages:
        sys.exit(f"error: {n_stages} pipeline stages need n_layer >= {n_stages} (one block each at least), not "
                 f"{n_layer}: lower pp_size (or the stages each rank holds: stages_per_rank of the interleaved "
                 f"schedules, zbv's two), or add layers")
    return list(range(stage * n_layer // n_stages, (stage + 1) * n_layer // n_stages))


def schedule_takes(schedule, m, pp):
    """Whether schedule runs m micro-batches on pp ranks: GPipe and ZBV any number, DualPipeV one a stage at least
    (2 pp), 1F1B pp or more (it fills the pipeline before its first backward), and torch's interleaved schedules
    (1F1B, zero bubble) a multiple of their rounds besides, max(1, m // pp)."""
    if schedule == 'dualpipev':
        return m >= 2 * pp
    return m >= 1 and (schedule in ('gpipe', 'zbv') or m >= pp and (schedule == '1f1b' or m % (m // pp) == 0))


def untaken(schedule, m, pp, dp=1):
    """None where schedule runs m micro-batches a pipeline on pp ranks; else the one-line error that says why not
    and names the gradient_accumulation_steps nearest it that it runs, counted over dp pipelines."""
    if schedule_takes(schedule, m, pp):
        return None
    why = (f"it needs one for each of its {2 * pp} stages at least" if schedule == 'dualpipev' else
           f"it fills the pipeline before its first backward, so it needs at least pp_size={pp}" if m < pp else
           f"torch's runs them in {m // pp} rounds of equal size")
    counts = " or ".join(f"--gradient_accumulation_steps={k * dp}" for k in nearest_taken(schedule, m, pp))
    return (f"{schedule} does not run {m} micro-batch{'es' * (m != 1)} per pipeline ({why}): set {counts}"
            + (f" (counted over the {dp} pipelines)" if dp > 1 else "") + ", or use --pp_schedule=gpipe")


def stages_refused(schedule, stages_per_rank, given):
    """None where schedule runs the stages_per_rank that the command gave (given: the keys it set); else the one-line
    error naming the fix: the others place their own stages on a rank, and would leave it unused without a word."""
    if 'stages_per_rank' not in given or stages_per_rank == placement(schedule, stages_per_rank)[0]:
        return None
    if schedule in V_SHAPED:
        return (f"stages_per_rank={stages_per_rank}: {schedule} places two stages on each rank, in a V: drop "
                f"--stages_per_rank, or use --pp_schedule=interleaved-1f1b (or interleaved-zb) for {stages_per_rank}")
    return (f"stages_per_rank={stages_per_rank} is the interleaved schedules' ({schedule} runs one stage a rank): add "
            f"--pp_schedule=interleaved-1f1b (or interleaved-zb), or drop --stages_per_rank")


def sharding_refused(dp_shard, adamw_on_shards):
    """None where pp_train.py builds the sharding asked for (dp_shard, adamw_on_shards); else the one-line error that
    says why not and what to change."""
    if adamw_on_shards and not dp_shard:  # plain stages' parameters are plain tensors: there is no dispatch to skip
        return "adamw_on_shards=True steps AdamW on the shards of dp_shard=True: add --dp_shard=True, or drop it"
    return None


def nearest_taken(schedule, m, pp):
    """The micro-batch counts nearest m that schedule runs on pp ranks: the one below m (where there is one), and
    the one above (a multiple of pp, 2 pp or more, always is)."""
    below = [k for k in range(m - 1, 0, -1) if schedule_takes(schedule, k, pp)][:1]
    return below + [next(k for k in itertools.count(m + 1) if schedule_takes(schedule, k, pp))]


def embedding_group(mesh, v_shape):
    """Megatron's embedding group of this rank on the (dp, pp, tp) mesh: the first and the last stage's ranks of its
    (dp, tp) coordinate, which both hold the tied weight (None for the ranks between them, and in a V, where one
    rank holds both stages and the weight once). Every rank makes every group, as new_group needs."""
    if mesh['pp'].size() == 1 or v_shape:
        return None
    mine = None
    for ends in mesh.mesh[:, [0, -1]].transpose(1, 2).reshape(-1, 2).tolist():
        group = dist.new_group(ends)
        mine = group if dist.get_rank() in ends else mine
    return mine


class Part(nn.Module):
    """Some of a GPT's modules, the same objects, under the GPT's own names (transformer.h.5 stays transformer.h.5):
    the first stage holds the embeddings, the last the final layer norm and the head (and the token embedding under
    its name too, as the head is tied to it). A stage, or all the stages of a rank (its state and optimizer)."""

    def __init__(self, gpt, blocks, first, last):
        super().__init__()
        self.config, self.first, self.last = gpt.config, first, last
        t = gpt.transformer
        parts = dict(wte=t.wte, wpe=t.wpe, drop=t.drop) if first else dict(wte=t.wte) if last else {}
        self.transformer = nn.ModuleDict(dict(**parts, h=nn.ModuleDict({str(i): t.h[i] for i in blocks}),
                                              **(dict(ln_f=t.ln_f) if last else {})))
        if last:
            self.lm_head = gpt.lm_head

    # the optimizer's groups as the GPT makes them, over this part's parameters
    param_groups = GPT.param_groups
    configure_optimizers = GPT.configure_optimizers

    def forward(self, x):
        if self.training and not torch.is_grad_enabled():
            # torch 2.11's schedules infer the shapes that stages send by a forward without gradients in their first
            # step, whose dropout draws on the RNG; a resumed run takes that first step later than the uninterrupted
            # one did, and would draw other masks from then on. Training runs no other forward without gradients.
            with torch.random.fork_rng(devices=[x.device] if x.is_cuda else []):
                return self.layers(x)
        return self.layers(x)

    def layers(self, x):
        t = self.transformer
        if self.first:  # x: token ids
            x = t.drop(t.wte(x) + t.wpe(torch.arange(x.size(1), device=x.device)))
        for block in t.h.values():
            x = block(x)
        return self.lm_head(t.ln_f(x)) if self.last else x


def shard_stages(stages, raw_model, dp_mesh, dtype):
    """FSDP across the pipelines (pp_train.py's dp_shard): each block a unit and each stage a root, sharded over the
    dp mesh, whose parameters torch's schedules gather once a step and keep through its micro-batches, and whose
    gradients they reduce-scatter after the step's last backward (not for every micro-batch). As fsdp_train.py's,
    the parameters are gathered in the run's dtype (bf16: half the bytes) and the gradients reduced in fp32 into
    fp32 shards (the master weights, which checkpoints save); a bf16 stage's activations are then bf16, and torch's
    schedules send and receive them in the dtype that their first step finds. The GPT's head is tied to the sharded
    embedding again where no stage of this rank holds it, so that its parameters' names stay the GPT's own (a copy
    left behind would be one name too many in the optimizer's count). Tensor parallel blocks are sharded as
    fsdp_train.py's: their matrices' pieces become 2-D DTensors (dp's shard of each tp piece), the rest dp's alone.
    Where one rank holds the first and the last stage (zbv's V, or pp 1), the tied weight is the first stage's root's
    alone: the head is put in its tree too, so that FSDP sets the gathered weight on it (as on any module sharing a
    parameter), and the last stage's root leaves the weight out. The last stage computes with it, and its gradient
    adds to the first stage's before their root reduce-scatters it once: torch's schedules gather the first stage
    before its first forward, which comes before the last's, and let it go after its final backward, which comes
    after the last's, while a rank holds 3 stages or fewer, or all of them (make_schedule)."""
    fsdp = dict(mesh=dp_mesh, reshard_after_forward=False,
                mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32))
    both_ends = len(stages) > 1 and stages[0].first and stages[-1].last
    if both_ends:
        stages[0].lm_head = stages[-1].lm_head
    for stage in stages:
        for block in stage.transformer.h.values():
            fully_shard(block, **fsdp)
        fully_shard(stage, **fsdp, ignored_params={stage.lm_head.weight} if both_ends and stage.last else None)
    raw_model.lm_head.weight = raw_model.transformer.wte.weight


def check_snapshot_layout(checkpoint, path, layout, dp_shard, eval_only, out_dir):
    """Exits with the flags that resume (or evaluate) a rank's memory snapshot where this run places other stages on
    the rank (another schedule's placement, stages_per_rank or dp_shard) than the run that took it: a snapshot
    holds only its rank's own stages, or their shards."""
    saved = checkpoint.get('config', {})
    shard = saved.get('dp_shard', False)
    if (placement(saved.get('pp_schedule', '1f1b'), saved.get('stages_per_rank', 1)), shard) == (layout, dp_shard):
        return
    schedule = saved.get('pp_schedule')  # its stages_per_rank only where that places them (stages_refused)
    looped = f" --stages_per_rank={saved.get('stages_per_rank')}" if str(schedule).startswith('interleaved') else ''
    flags = f"--pp_schedule={schedule}{looped}" + (f" --dp_shard={shard}" if shard != dp_shard else "")
    sys.exit(f"error: the memory snapshot {path} holds the stages that {flags} place on this rank: " +
             ("evaluate it with these flags" if eval_only else f"resume with these flags, and let it save a "
              f"checkpoint to {out_dir} (SIGTERM does) before changing them"))


def loss_fn(logits, targets):
    """The last stage's loss, model.py's."""
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


@torch.no_grad()  # DTensor.to_local() with gradients on is an autograd function call (host time)
def tied_grads_and_norm(params, tied, counts_tied, micro_batches, mesh, dp_shard, tie_group):
    """After a step's backward, whose gradients are summed over the micro-batches: averages them over those and
    across pipelines (one all-reduce, as DDP's last bucket would; under dp_shard FSDP's reduce-scatter has averaged
    them across pipelines into each rank's shards), sums the tied embedding's gradient across the first and the last
    stage (Megatron's embedding group: both copies, or the same shard of each, then take the same update and stay
    equal), and returns the global norm, the tied one counted once (by the rank for which counts_tied, the first
    stage's). The average is taken here, once a parameter: torch's schedules divide each stage's gradients, which
    divides the tied weight twice where one rank holds both stages that use it (zbv's V, or a pipeline of one rank).
    Under tensor parallelism (the mesh's tp) a rank holds its pieces of the blocks' matrices, all-reduced across
    pipelines with the rest and counted in the norm over the tp group; the rest, the same on every rank of a tp
    group (layer norms, embeddings, the projections' biases), counted once. Under both (dp_shard with tp) every
    rank's shards of its pieces and of the rest are its own, summed over the world, the rest by a tp group's first."""
    grads = [local(p.grad) for p in params if p.grad is not None]
    dp_size = mesh['dp'].size()
    if dp_size > 1 and not dp_shard:
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=mesh['dp'].get_group())
        for g, s in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(s)
    torch._foreach_div_(grads, micro_batches * (1 if dp_shard else dp_size))
    if tie_group is not None and tied.grad is not None:
        dist.all_reduce(local(tied.grad), group=tie_group)
    counted = [p.grad for p in params if p.grad is not None and (p is not tied or counts_tied)]
    split = [tp_split(g) for g in counted]
    squares = lambda gs: torch.stack([g.float().pow(2).sum() for g in gs]).sum() if gs else torch.zeros(())
    whole = squares([local(g) for g, s in zip(counted, split) if not s])
    pieces = squares([local(g) for g, s in zip(counted, split) if s])
    if dp_shard:  # every shard of a piece on one rank: the world's sum, with a tp group's copies of the rest once
        sq = pieces + whole * (mesh['tp'].get_local_rank() == 0)
        dist.all_reduce(sq)
        return sq.sqrt()
    if mesh['tp'].size() > 1:  # each rank's pieces of the split matrices, added over the tp group
        dist.all_reduce(pieces, group=mesh['tp'].get_group())
    sq = whole + pieces
    dist.all_reduce(sq, group=mesh['pp'].get_group())
    return sq.sqrt()


def tp_split(t):
    """Whether a tensor is a DTensor split over the mesh's tp dimension (a TP piece, FSDP-sharded over dp or not)."""
    names = isinstance(t, DTensor) and t.device_mesh.mesh_dim_names or ()
    return 'tp' in names and t.placements[names.index('tp')].is_shard()


def local(t):
    """A tensor, or this rank's shard of a DTensor (the same memory)."""
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def clip(params, norm, max_norm):
    """Scales the gradients by max_norm / norm where the norm (global) is larger."""
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            local(p.grad).mul_(scale.to(p.grad.device))


class Forward(nn.Module):
    """model(idx, targets) -> (None, loss) through a pipeline, for evals (estimate_loss, HellaSwag): the stages run
    one after the other, each rank's activations sent point to point to the next stage's rank, and the last stage's
    loss broadcast to the pipeline's ranks. With per_token, a function of (logits, targets) whose result has targets'
    shape (HellaSwag's token losses), its result instead, and None for the loss. Either way the last stage computes
    what the eval needs from the logits, which are B x T x vocab (2.5 GB in fp32 for GPT-2's eval batch) and never
    leave it. A plain loop, not a schedule: evals' shapes vary."""

    def __init__(self, stages, ids, owners, pp_group, device):
        super().__init__()
        self.stages, self.ids, self.n_stages = nn.ModuleList(stages), ids, len(owners)
        self.owners, self.pp_group, self.device = owners, pp_group, device  # owners: each stage's global rank
        self.config = stages[0].config

    def forward(self, idx, targets, per_token=None):
        B, T = idx.shape
        x, mine = None, dist.get_rank()
        for s in self.ids:  # in order; the neighbouring stages' ranks send and receive their activations
            if s > 0 and self.owners[s - 1] != mine:
                x = torch.empty(B, T, self.config.n_embd, device=self.device)
                dist.recv(x, self.owners[s - 1], group=self.pp_group)
            x = self.stages[self.ids.index(s)](idx if s == 0 else x)
            if s < self.n_stages - 1 and self.owners[s + 1] != mine:
                dist.send(x.float().contiguous(), self.owners[s + 1], group=self.pp_group)
        if per_token:
            return self.from_last_stage(lambda: per_token(x.float(), targets), targets.shape), None
        return None, self.from_last_stage(lambda: loss_fn(x.float(), targets), ())

    def from_last_stage(self, compute, shape):
        """compute() on the last stage's rank, a float32 tensor of that shape, broadcast to the pipeline's ranks."""
        out = compute() if self.n_stages - 1 in self.ids else torch.empty(shape, device=self.device)
        if len(set(self.owners)) > 1:
            dist.broadcast(out, self.owners[-1], group=self.pp_group)
        return out


def sharded_state(part, optimizer, raw_model):
    """What DCP saves of a rank's stages: sharded.py's state, with each optimizer group's parameter names those of
    the whole GPT, as under FSDP. The groups are saved once for all ranks, so each rank's own names would leave
    the others' parameters without a group on load."""
    state = stage_state(part, optimizer)
    for group, names in zip(state['optim']['param_groups'], raw_model.param_groups()):
        group['params'] = list(names)
    return state


def save_full(part, optimizer, raw_model, extra, path, keep=1, best=None):
    """Every rank calls this: each sends its pieces of its stages' state (a DTensor's its own shard) to rank 0 in one
    gather, and rank 0 puts the whole state together and writes it in train.py's format (ckpt.pt, for train.py,
    sample.py, export_hf.py and --init_from) in the background. A full state dict gathered every DTensor on every
    rank, an all-gather per tensor and mesh dimension: 2.4 s of rank 0's a save of the tests' model at dp 2 x pp 2 x
    tp 2 on 8 ranks on 2 busy cores, where this takes 0.7 s (the same ckpt.pt, tensor for tensor)."""
    mine = rank_pieces(stage_state(part, optimizer))
    states = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object((mine['model'], mine['optim']), states, dst=0)
    if dist.get_rank() == 0:
        held, moments = {}, {}
        osd = {'state': {}, 'param_groups': [dict(g, params=[]) for g in mine['optim']['param_groups']]}
        for m, o in states:  # rank order: the tied weight is the first stage's, its head copy the last stage's
            for k, v in m.items():
                held.setdefault(k, []).append(v)
            for k, v in o['state'].items():
                for name, p in v.items():
                    moments.setdefault(k, {}).setdefault(name, []).append(p)
            for group, theirs in zip(osd['param_groups'], o['param_groups']):
                group['params'] += [n for n in theirs['params'] if n not in group['params']]
        model_sd = {k: put_together(held[k]) for k in raw_model.state_dict()}  # the GPT's own order
        osd['state'] = {k: {name: put_together(p) for name, p in v.items()} for k, v in moments.items()}
        order = {n: i for i, n in enumerate(n for group in raw_model.param_groups() for n in group)}
        for group in osd['param_groups']:
            group['params'].sort(key=order.get)
        save_in_background({'model': model_sd, 'optimizer': optim_state_dict_by_index(osd, raw_model), **extra}, path,
                           keep=keep, best=best)
        print0(f"saving consolidated checkpoint to {path}")


def stage_memory(config, pp_size, stages_per_rank=1, v_shape=False, bytes_per_param=4 + 4 + 8):
    """Per pipeline rank: the parameters its stages hold, and their bytes with a gradient and AdamW's two moments
    each (fp32: 4 + 4 + 8). The first rank holds the embeddings, the last the final layer norm and the (tied) head,
    whose weight it keeps a copy of (in zbv's V the first holds both, and the weight once). Activations are left
    out: they depend on the schedule's micro-batches in flight. A list of pp_size (params, bytes)."""
    with torch.device('meta'):
        gpt = GPT(config)
    out = []
    n_stages = pp_size * stages_per_rank
    for r in range(pp_size):
        ids = stage_ids(r, pp_size, stages_per_rank, v_shape)
        blocks = [b for s in ids for b in stage_blocks(s, n_stages, config.n_layer)]
        part = Part(gpt, blocks, 0 in ids, n_stages - 1 in ids)
        n = sum(p.numel() for p in part.parameters())
        out.append((n, n * bytes_per_param))
    return out
