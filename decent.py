"""
What decent_train.py needs besides its loop: the topologies as cycles of mixing rounds, the flat buckets that a
replica updates and mixes in, DiLoCo's outer step on a bucket (and Streaming DiLoCo's fragments of buckets, each on
a schedule of its own), AccumAdamW, the average of a checkpoint's replicas (to resume at another world size), and
its step folders kept as they are (one that lacks a rank's file set aside, another world size's named best).
"""

import math
import os
import re
import shutil
from dataclasses import dataclass

import torch
import torch.distributed as dist

from checkpoint import (checkpoint_iter, latest_before, mark_run, note_failure, point_latest, read_name, take_settings,
                        unused, wait_for_copies)
from distributed import launch_with


TOPOLOGIES = ('complete', 'ring', 'one-peer-exp', 'alternating-exp-ring')


def mixing_rounds(topology, world_size, local_world_size):
    """The topology's cycle of mixing rounds. A round is a partition of the ranks into groups (sorted lists of
    ranks); every group averages its replicas, a rank alone keeps its own. Step t mixes with round t % len(rounds).
    Raises ValueError where the topology cannot serve this world size."""
    n = world_size
    if topology == 'complete':
        return [[list(range(n))]]
    if topology == 'ring':
        # each rank averages with its right neighbour, then with its left: the ring's edges in two matchings, or
        # three when n is odd (the closing edge then needs a round of its own)
        if n <= 2:
            return [[list(range(n))]]
        edges = [sorted([i, (i + 1) % n]) for i in range(n)]
        if n % 2 == 0:
            return [edges[0::2], edges[1::2]]
        return [edges[0:n - 1:2] + [[n - 1]], edges[1::2] + [[0]], [edges[n - 1]] + [[i] for i in range(1, n - 1)]]
    if topology == 'one-peer-exp':
        # round k pairs each rank with the one 2^k away (their k-th bits differ): after the log2(n) rounds of a
        # cycle every replica is the exact average, at one peer per round
        if n & (n - 1):
            raise ValueError(f"topology=one-peer-exp needs a power-of-2 world size, not {n}: use --topology=ring or "
                             f"--topology=complete")
        return [[[j, j + 2 ** k] for j in range(n) if not j & 2 ** k] for k in range(n.bit_length() - 1)] or [[[0]]]
    if topology == 'alternating-exp-ring':
        # rounds within nodes (the fast links: every node averages its ranks) alternate with rounds between nodes,
        # where nodes pair as in one-peer-exp and each rank averages with the same local rank on the peer node
        if local_world_size is None:  # distributed.ranks_per_node()'s: the nodes run different counts
            raise ValueError("topology=alternating-exp-ring needs as many ranks on every node, and torchrun's "
                             "--nproc_per_node differs between the nodes here: give every node the same, or use "
                             "--topology=ring")
        nodes = n // local_world_size
        if local_world_size < 2 or n % local_world_size or nodes < 2 or nodes & (nodes - 1):
            here = (f"and {launch_with(2, nnodes=2)}, or use --topology=ring" if n == 1 and 'RANK' not in os.environ
                    else f"not world size {n} with LOCAL_WORLD_SIZE={local_world_size} ranks per node: use "
                    f"--topology=ring")
            raise ValueError(f"topology=alternating-exp-ring needs 2, 4, 8, ... nodes of at least 2 ranks each, {here}")
        within = [list(range(a * local_world_size, (a + 1) * local_world_size)) for a in range(nodes)]
        rounds = []
        for node_pairs in mixing_rounds('one-peer-exp', nodes, 1):
            rounds.append(within)
            rounds.append([[a * local_world_size + j, b * local_world_size + j]
                           for a, b in node_pairs for j in range(local_world_size)])
        return rounds
    raise ValueError(f"unknown topology={topology!r}: use {', '.join(TOPOLOGIES[:-1])} or {TOPOLOGIES[-1]}")


def plan_words(config, rounds, given=()):
    """What the replicas do, as the log says it: DiLoCo's outer steps (the window, the fragments, the overlap), or
    the topology's cycle of mixing rounds; with the replicas' optimizer, and a warning where no round mixes (one
    process) or a topology given goes unused (DiLoCo's). Counts of one in the singular."""
    n = lambda count, word: f"{count} {word}{'s' * (count != 1)}"
    if config['diloco_steps']:
        fragments = config['diloco_fragments']
        idle = (f"\nwarning: topology {config['topology']} is not used: DiLoCo averages over all ranks once a "
                f"window (drop --diloco_steps for gossip)") if 'topology' in given else ''
        return (f"DiLoCo: an outer {config['outer_optimizer']} step every {n(config['diloco_steps'], 'step')} on "
                f"{f'each of {fragments} fragments' if fragments > 1 else 'the whole model'}, landing "
                f"{n(config['diloco_overlap'], 'step')} later, pseudo-gradients sent in {config['diloco_dtype']}; "
                f"inner optimizer {config['replica_optimizer']}{idle}")
    plan = f"topology {config['topology']}, a cycle of {n(len(rounds), 'mixing round')}; optimizer " \
           f"{config['replica_optimizer']}"
    if any(len(group) > 1 for groups in rounds for group in groups):
        return plan
    # one rank: every round leaves its replica as it is, and each step is train.py's on one process
    how = launch_with(2) if 'RANK' not in os.environ else 'give torchrun --nproc_per_node=2 or more'
    return (f"{plan}\nwarning: one process: topology {config['topology']} has no other replica to mix with, so this "
            f"trains a single model with no gossip; {how}")


def check_optimizers(config, n_layer, given=()):
    """What is wrong with the keys of the replicas' optimizer and DiLoCo's (config's, for a model of n_layer
    blocks; given: the keys a file or flag set), in a sentence, or None."""
    if config['replica_optimizer'] not in ('adamw', 'accumadamw', 'sgd'):
        return f"unknown replica_optimizer={config['replica_optimizer']!r}: use adamw, accumadamw or sgd"
    if config['moment_accum_steps'] < 1:
        return f"moment_accum_steps={config['moment_accum_steps']}: AccumAdamW needs 1 step or more per moment update"
    steps, optimizer, lr, momentum = (config[k] for k in ('diloco_steps', 'outer_optimizer', 'outer_learning_rate',
                                                          'outer_momentum'))
    fragments, overlap, alpha = config['diloco_fragments'], config['diloco_overlap'], config['diloco_alpha']
    if steps < 0:
        return f"diloco_steps={steps}: give the inner steps per outer step, or 0 to mix every step"
    if optimizer not in ('nesterov', 'sgd'):
        return f"unknown outer_optimizer={optimizer!r}: use nesterov or sgd"
    if not 0 <= momentum < 1 or (optimizer == 'nesterov' and momentum == 0):
        return f"outer_momentum={momentum}: in [0, 1), above 0 for nesterov (or use outer_optimizer=sgd)"
    if not lr > 0:
        return f"outer_learning_rate={lr} must be above 0 (the paper's is 0.7)"
    if not 1 <= fragments <= n_layer + 1:
        return (f"diloco_fragments={fragments}: from 1 to the {n_layer + 1} buckets of the model (the embeddings, "
                f"then each of its {n_layer} blocks)")
    if (fragments > 1 or overlap) and not steps:
        return "diloco_fragments and diloco_overlap take effect with diloco_steps > 0 only: give diloco_steps"
    # a key given that the run would not use goes unsaid otherwise: a misspelt topology under DiLoCo (a known one, a
    # config file's say, is a warning in plan_words), or DiLoCo's outer keys under gossip
    if steps and 'topology' in given and config['topology'] not in TOPOLOGIES:
        return (f"unknown topology={config['topology']!r}, which diloco_steps={steps} would not use anyway (DiLoCo "
                f"averages over all ranks once a window): drop it, or use {', '.join(TOPOLOGIES)} for gossip")
    unused = sorted({'outer_optimizer', 'outer_learning_rate', 'outer_momentum', 'diloco_alpha'} & set(given))
    if unused and not steps:
        return (f"{' and '.join(unused)} take{'s' * (len(unused) == 1)} effect with diloco_steps > 0 only: give "
                f"diloco_steps")
    if not 0 <= overlap < max(steps, 1):
        return (f"diloco_overlap={overlap}: from 0 to diloco_steps - 1 ({steps - 1}), so that a fragment's outer "
                f"step lands before its next one starts")
    if not 0 <= alpha < 1:
        return f"diloco_alpha={alpha}: in [0, 1), the replica's own weight in the merge (1 would never take θ_global)"
    if config['diloco_dtype'] not in ('float32', 'bfloat16'):
        return f"unknown diloco_dtype={config['diloco_dtype']!r}: use float32 or bfloat16"
    if config['diloco_dtype'] != 'float32' and not steps:
        return "diloco_dtype takes effect with diloco_steps > 0 only: give diloco_steps"
    return None


def check_resumed(checkpoint, path, config, ckpt_path, snapshot):
    """What keeps this run (config's keys) from reading a checkpoint (the state at path), in a sentence, or None:
    another replica optimizer's state, or a DiLoCo run without diloco_steps (a forgotten flag, most likely). An eval
    trains nothing: it only has to read the state as the run would (θ_global, the replicas' optimizers)."""
    saved = checkpoint.get('config', {})
    optimizer = saved.get('replica_optimizer', saved.get('optimizer', 'adamw'))  # its old name
    # a memory snapshot's state is in no ckpt.pt yet (there may be none, or an older one): the run has to save it first
    first = f"once a resume has saved it to {config['out_dir']} (SIGTERM does) " if snapshot else ""
    if 'optimizers' in checkpoint and optimizer != config['replica_optimizer']:
        fix = f"--replica_optimizer={optimizer}"
        return f"{path} holds the state of replica_optimizer={optimizer}: " + (
            f"evaluate it with {fix}" if config['eval_only'] else f"resume with {fix}, or {first}start a new run from "
            f"its averaged weights with --init_from={ckpt_path} and another --out_dir")
    if 'diloco' in checkpoint and not config['diloco_steps']:
        steps = saved.get('diloco_steps')
        return f"{path} holds a DiLoCo run (diloco_steps={steps}): " + (
            f"evaluate it with --diloco_steps={steps} (the eval is then of its global model)" if config['eval_only']
            else f"resume with its --diloco_steps, or {first}start a gossip run from its global model with "
            f"--init_from={ckpt_path} and another --out_dir")
    return None


def make_mixing_groups(rounds, rank):
    """Each round's process group for this rank, and its size (None where the round leaves the rank alone): every
    rank creates every group, in the same order, as torch.distributed requires."""
    mixing_groups, made = [], {}
    for groups in rounds:
        mine = None
        for ranks in groups:
            if len(ranks) > 1:
                if tuple(ranks) not in made:
                    made[tuple(ranks)] = dist.new_group(ranks)
                if rank in ranks:
                    mine = (made[tuple(ranks)], len(ranks))
        mixing_groups.append(mine)
    return mixing_groups


@dataclass(eq=False)  # buckets are compared by identity, not by their tensors
class Bucket:
    params: list
    flat: torch.Tensor
    optimizer: torch.optim.Optimizer = None
    ready: int = 0  # parameters whose gradient this backward has completed
    stepped_at: int = -1  # the iteration of its last update
    work: dist.Work = None  # its mixing all-reduce (or DiLoCo's of the pseudo-gradient), while in flight
    outer: torch.Tensor = None  # DiLoCo: the bucket of θ_global, as the last outer step left it
    outer_optimizer: torch.optim.Optimizer = None  # DiLoCo: moves outer by the replicas' mean pseudo-gradient
    phase: int = 0  # DiLoCo: its fragment's outer steps start after the steps t where (t + 1) % H == phase
    alpha: float = 0.0  # DiLoCo: the replica's own weight when an outer step lands (0: it restarts from θ_global)
    sent_at: int = -1  # DiLoCo: the step after which its last outer step started
    lands_at: int = 0  # DiLoCo: that outer step lands before the forward of this iteration (or at a save from it on)
    wire: torch.dtype = torch.float32  # DiLoCo: the dtype its pseudo-gradient travels in (diloco_dtype)
    sent: torch.Tensor = None  # DiLoCo below float32: the pseudo-gradient in the all-reduce, for outer.grad once done


def make_buckets(model):
    """The model's buckets: the embeddings with the tied head and the final LayerNorm, then each block. A bucket's
    parameters become views into one flat tensor, so that it mixes in one all-reduce, no copies."""
    in_blocks = {p for block in model.transformer.h for p in block.parameters()}
    buckets = []
    for params in [[p for p in model.parameters() if p not in in_blocks]] + [list(b.parameters())
                                                                             for b in model.transformer.h]:
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        offset = 0
        for p in params:
            p.data = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        buckets.append(Bucket(params, flat))
    return buckets



def wait_for(bucket, now, finish=False):
    """Until the bucket's mixing all-reduce, if one is in flight, is done. Under DiLoCo that all-reduce is the
    pseudo-gradient's, and the outer step follows once due (at iteration lands_at): θ_global moves, and the
    replica's bucket merges with it. Until then a forward lets the all-reduce fly on (Streaming DiLoCo's overlap);
    finish=True (a checkpoint, an eval, the end) completes it all the same, and the mean pseudo-gradient waits in
    outer.grad for its iteration, part of the state that a checkpoint saves."""
    due = now >= bucket.lands_at
    if bucket.work is not None and (due or finish):
        bucket.work.wait()
        bucket.work = None
        if bucket.sent is not None:  # back to float32 (exactly) for the outer optimizer and the checkpoints
            bucket.outer.grad.copy_(bucket.sent)
            bucket.sent = None
    if due and bucket.outer is not None and bucket.outer.grad is not None:
        wait_for_copies()  # a checkpoint taken since the outer step started may still be copying θ_global
        bucket.outer_optimizer.step()
        bucket.outer.grad = None
        bucket.flat.lerp_(bucket.outer, 1 - bucket.alpha)  # at alpha 0 exactly θ_global, as in DiLoCo


def start_outer_step(bucket, now, overlap):
    """DiLoCo, at the end of the bucket's window (after step now): the sum over ranks of (θ_global - θ_local) /
    world size, the mean pseudo-gradient, in the background, as the gradient of θ_global; wait_for(bucket) takes
    the outer step before the forward of iteration now + 1 + overlap, so that `overlap` inner steps hide it."""
    # an outer step still in flight lands first: only a run resumed with another diloco_steps, diloco_fragments or
    # diloco_overlap can end a window before the last one's step landed, and the new pseudo-gradient would drop it
    wait_for(bucket, bucket.lands_at, finish=True)
    bucket.outer.grad = (bucket.outer - bucket.flat).div_(dist.get_world_size())
    if bucket.wire == torch.float32:
        bucket.work = dist.all_reduce(bucket.outer.grad, async_op=True)
    else:
        # bfloat16 (diloco_dtype): each rank's share divided in float32 first, as above, so that one cast rounds it
        # and the partial sums stay at the mean's scale; the ring then sums in bfloat16, rounding at each hop (gloo,
        # 2 to 8 ranks: within 0.24 to 0.37% of the exact mean's norm, docs/network.md), which an all-gather summed
        # in float32 would spare at W/2 times the bytes: as many as float32's ring at 4 ranks
        bucket.sent = bucket.outer.grad.to(bucket.wire)
        bucket.work = dist.all_reduce(bucket.sent, async_op=True)
    bucket.sent_at, bucket.lands_at = now, now + 1 + overlap


def fragment_of(sizes, fragments):
    """Streaming DiLoCo's fragments: for each bucket (of so many parameters, in the model's order), the one of
    `fragments` contiguous runs of buckets it belongs to. Each run takes the next buckets while its middle stays
    within an equal share of what the runs before it left (a bucket too big for one share fills a run alone), and
    none is empty while there are buckets enough."""
    out, f, rest, filled = [], 0, sum(sizes), 0
    for i, size in enumerate(sizes):
        if filled and f < fragments - 1 and (filled + size / 2 > rest / (fragments - f)
                                             or len(sizes) - i <= fragments - 1 - f):
            f, rest, filled = f + 1, rest - filled, 0
        out.append(f)
        filled += size
    return out


def make_outer(buckets, window, fragments, optimizer, lr, momentum, alpha, wire):
    """DiLoCo's θ_global: a bucket of its own beside each bucket of the replica, with its outer optimizer (SGD,
    Nesterov's or heavy-ball momentum), and its fragment's place in the window: fragment f's outer steps start
    after the steps t where (t + 1) % window == f * window // fragments, so that the fragments take turns; its
    pseudo-gradients travel in the dtype named wire. Returns each bucket's fragment."""
    of = fragment_of([bucket.flat.numel() for bucket in buckets], fragments)
    for bucket, f in zip(buckets, of):
        bucket.outer = bucket.flat.clone()
        # one tensor each: foreach kernels (CUDA's default) gain nothing, and the step is landed()'s ops on any device
        bucket.outer_optimizer = torch.optim.SGD([bucket.outer], lr=lr, momentum=momentum,
                                                 nesterov=optimizer == 'nesterov', foreach=False)
        bucket.phase, bucket.alpha, bucket.wire = f * window // fragments, alpha, getattr(torch, wire)
    return of


def outer_state(buckets, land=False):
    """DiLoCo's state beside the replica: θ_global, its optimizer's momentum, and the mean pseudo-gradients whose
    outer steps have not landed yet (None where none) with the iteration they land at: in float32, which holds one
    that travelled in bfloat16 exactly, so that it lands the same after a resume at either diloco_dtype.
    land=True (the export at a run's end, its all-reduces done, θ_global in the model: global_model's): the momentum
    as those outer steps leave it when they land (landed's, the one copy of the buckets in flight), none pending, no
    θ_global; the buckets' own still in flight, as the step folders keep them for a longer run to land on time."""
    state = {'outer': [b.outer for b in buckets], 'outer_optimizers': [b.outer_optimizer.state_dict() for b in buckets],
             'pending': [b.outer.grad for b in buckets], 'lands_at': [b.lands_at for b in buckets]}
    if land:
        del state['outer']
    for i, bucket in enumerate(buckets):
        if land and bucket.outer.grad is not None:
            saved, momentum = state['outer_optimizers'][i], landed(bucket)
            if momentum is not None:  # (a copy of the dicts: the optimizer's own hold the momentum before it lands)
                state['outer_optimizers'][i] = {**saved, 'state': {0: {**saved['state'].get(0, {}),
                                                                       'momentum_buffer': momentum}}}
            state['pending'][i] = None
    return state


@torch.no_grad()
def landed(bucket, into=None):
    """The outer step in flight on the bucket as it will land, without taking it: θ_global moved by it written into
    `into` (where given: the replica's flat, put aside), and its momentum returned (None without momentum), the one
    bucket-sized tensor this allocates. Op for op torch's single-tensor SGD step (no weight decay or maximize), which
    make_outer's outer optimizers take, so bit for bit what wait_for's outer_optimizer.step() will give (the tests
    check it): a copy of the optimizer to step would copy θ_global, its gradient and its momentum."""
    group = bucket.outer_optimizer.param_groups[0]
    g, m, momentum = bucket.outer.grad, group['momentum'], None
    if m:
        buf = bucket.outer_optimizer.state.get(bucket.outer, {}).get('momentum_buffer')
        momentum = g.clone() if buf is None else buf.mul(m).add_(g, alpha=1 - group['dampening'])
    if into is not None:
        step = g if momentum is None else torch.add(g, momentum, alpha=m, out=into) if group['nesterov'] else momentum
        torch.add(bucket.outer, step, alpha=-group['lr'], out=into)
    return momentum


@torch.no_grad()
def restore_outer(buckets, saved, own, optimizer, lr, momentum):
    """DiLoCo's state from a checkpoint: `saved`, its 'diloco' (rank 0's: every rank's are the same; ckpt.pt's
    has no θ_global beside the model, which is θ_global), or None where it has none (a gossip or train.py
    checkpoint): θ_global is then the average of the replicas loaded. The outer optimizer takes the config's
    settings. Mid-window replicas only continue on the ranks that made them (own): the rest start from θ_global.
    The position in each window is iter_num's."""
    if saved is None:
        average_replicas(buckets)
    for i, bucket in enumerate(buckets):
        bucket.outer.copy_(saved['outer'][i] if saved is not None and 'outer' in saved else bucket.flat)
        if saved is not None:
            bucket.outer_optimizer.load_state_dict(saved['outer_optimizers'][i])
            bucket.outer_optimizer.param_groups[0].update(lr=lr, momentum=momentum, nesterov=optimizer == 'nesterov',
                                                          foreach=False)  # (a checkpoint from before saved None)
            if saved.get('pending', [None] * len(buckets))[i] is not None:  # an outer step still to land
                bucket.outer.grad, bucket.lands_at = saved['pending'][i].to(bucket.outer), saved['lands_at'][i]
        if not own:
            bucket.flat.copy_(bucket.outer)


def outer_bytes(buckets, now):
    """The bytes of pseudo-gradient this rank put into all-reduces after step now (their payload: a ring
    all-reduce sends about twice that), in the dtype they travelled in."""
    return sum(b.outer.numel() * b.wire.itemsize for b in buckets if b.sent_at == now)


@torch.no_grad()
def global_model(buckets, land=False, own=None):
    """Puts DiLoCo's θ_global in place of this rank's replica (every rank holds the same one: no communication),
    with the outer steps in flight landed where land (landed's, one bucket at a time); returns the replica (own,
    where the caller has copied it already), to put back with restore_replica."""
    own = own or [bucket.flat.clone() for bucket in buckets]
    for bucket in buckets:
        if land and bucket.outer.grad is not None:
            landed(bucket, into=bucket.flat)
        else:
            bucket.flat.copy_(bucket.outer)
    return own


class AccumAdamW(torch.optim.Optimizer):
    """The method's AccumAdam, with AdamW's decoupled weight decay: the parameters move every step, but the
    moments take in the mean gradient of accum_steps steps at once, so that with few samples per rank and step
    they estimate the statistics of a larger batch. Each step's direction uses the moments as they would be with
    this step's gradient taken in, so accum_steps=1 is exactly AdamW. state['step'] counts the moments' updates,
    as AdamW's does, so AdamW's state carries over both ways."""

    def __init__(self, params, lr, betas, weight_decay, accum_steps, eps=1e-8):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay, accum_steps=accum_steps, eps=eps))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group['betas']
            for p in group['params']:
                if p.grad is None:
                    continue
                state = self.state[p]
                if 'grad_sum' not in state:  # a fresh state, or AdamW's
                    state.setdefault('step', 0)
                    state.setdefault('exp_avg', torch.zeros_like(p))
                    state.setdefault('exp_avg_sq', torch.zeros_like(p))
                    state['grad_sum'], state['grads_summed'] = torch.zeros_like(p), 0
                g = p.grad
                exp_avg = state['exp_avg'].lerp(g, 1 - beta1)
                exp_avg_sq = state['exp_avg_sq'].mul(beta2).addcmul_(g, g, value=1 - beta2)
                t = state['step'] + 1
                denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** t)).add_(group['eps'])
                p.mul_(1 - group['lr'] * group['weight_decay'])
                p.addcdiv_(exp_avg, denom, value=-group['lr'] / (1 - beta1 ** t))
                state['grad_sum'].add_(g)
                state['grads_summed'] += 1
                # at least: a resume may lower accum_steps below the gradients that a window summed already
                if state['grads_summed'] >= group['accum_steps']:
                    mean = state['grad_sum'].div_(state['grads_summed'])
                    state['exp_avg'].lerp_(mean, 1 - beta1)
                    state['exp_avg_sq'].mul_(beta2).addcmul_(mean, mean, value=1 - beta2)
                    state['step'] = t
                    state['grad_sum'].zero_()
                    state['grads_summed'] = 0



def make_optimizers(buckets, model, kind, lr, betas, weight_decay, moment_accum_steps, device_type):
    """Each bucket's optimizer (set as its .optimizer, and returned in a list), with train.py's two groups (weight
    decay on matrices and embeddings only): AdamW (fused, one kernel for the update, as train.py's), AccumAdamW or
    plain SGD."""
    decay, names = set(model.param_groups()[0]), {p: n for n, p in model.named_parameters()}
    for bucket in buckets:
        groups = [{'params': [p for p in bucket.params if names[p] in decay], 'weight_decay': weight_decay},
                  {'params': [p for p in bucket.params if names[p] not in decay], 'weight_decay': 0.0}]
        if kind == 'sgd':
            bucket.optimizer = torch.optim.SGD(groups, lr=lr)
        elif kind == 'accumadamw':
            bucket.optimizer = AccumAdamW(groups, lr=lr, betas=betas, weight_decay=weight_decay,
                                          accum_steps=moment_accum_steps)
        else:
            bucket.optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, fused=device_type in ('cuda', 'cpu'))
    return [bucket.optimizer for bucket in buckets]


def moments_from_adamw(adamw, state, bucket_of, config, given):
    """Loads train.py's AdamW state (numbered over the whole model) into adamw, train.py's optimizer over the same
    model, and hands each bucket's optimizer its parameters' moments from there, and the settings (config's then)."""
    adamw.load_state_dict(state)
    take_settings(adamw, config, given)
    for p, state in adamw.state.items():
        if isinstance(bucket_of[p].optimizer, AccumAdamW):
            state = {**state, 'step': int(state['step'])}  # it counts in a plain int
        bucket_of[p].optimizer.state[p] = state
    for optimizer in {id(b.optimizer): b.optimizer for b in bucket_of.values()}.values():
        take_settings(optimizer, config, config)


def read_replica(path, rank, world_size, print0):
    """A rank's replica and optimizer state from a folder of every rank's; a memory snapshot or a ckpt.pt
    (train.py's, or decent_train.py's averaged export) whole. Data, never code. The algorithm's state is one
    replica per rank, which does not reshard: at another world size (an elastic restart with fewer or more nodes)
    every rank starts from their average, as evals see it (DiLoCo's then from θ_global, which restore_outer puts
    back)."""
    if not os.path.isdir(path):
        return torch.load(path, map_location='cpu', weights_only=True)
    first = torch.load(os.path.join(path, 'rank-0.pt'), map_location='cpu', weights_only=True, mmap=True)
    saved = len(first['rng'])
    if saved == world_size:
        return torch.load(os.path.join(path, f'rank-{rank}.pt'), map_location='cpu', weights_only=True)
    # DiLoCo's replicas are put back to θ_global (restore_outer), which the files hold beside them
    start = "DiLoCo's global model θ_global" if 'outer' in first.get('diloco', {}) else "their average"
    print0(f"{path} holds the replica{'s' * (saved > 1)} of {saved} rank{'s' * (saved > 1)}, not {world_size}: every "
           f"rank starts from {start}")
    return averaged_replicas(path, saved)


def replicas_in(folder):
    """How many ranks' replicas a step folder holds: rank 0's file holds the RNG state of every rank."""
    return len(torch.load(os.path.join(folder, 'rank-0.pt'), map_location='cpu', weights_only=True, mmap=True)['rng'])


def set_aside_incomplete(folder, run_id):
    """Before a save into the step folder out_dir/decent/step-N: where one is there that lacks a rank's file (a save
    cut short, a file removed), rank 0 renames it incomplete-step-N, so that the files it holds (a replica of that
    step, maybe of another state) are kept rather than written over, and marks the folder the run's (mark_run). A
    collective: no rank writes before."""
    if dist.get_rank() == 0 and os.path.isdir(folder):
        try:
            whole = checkpoint_iter(folder) is not None
        except Exception:  # a file that does not load: kept likewise
            whole = False
        if not whole:
            aside = unused(os.path.join(os.path.dirname(folder), 'incomplete-' + os.path.basename(folder)))
            os.replace(folder, aside)
            # latest names the whole one before it until the save is done (a failed save leaves it there)
            latest_before(os.path.dirname(folder), os.path.basename(folder))
            print(f"{folder} lacks a rank's file (a save cut short, or a file removed): kept as {aside}, and the "
                  f"step saved anew", flush=True)
    if dist.get_rank() == 0:
        mark_run(folder, run_id)
    dist.barrier()


def prune_incomplete(folder, run_id):
    """On rank 0, once the step folder out_dir/decent/step-N is whole and latest names it: removes each
    incomplete-step-M (set_aside_incomplete) with M < N that this run alone wrote (written_by). It is a save of the
    run cut short, which pruning removes as it removes a step-M folder of the run cut short once a newer one is
    whole: a rank's file is missing, so it is never a fallback. One of another run, of no run that a file tells, or
    holding anything else (a file put there by hand) is kept, and so is one at step N until a later save is whole."""
    root, name = os.path.split(folder)  # (no error of its own can fail the save, which is whole)
    for aside in sorted(os.listdir(root)):
        m = re.fullmatch(r'incomplete-step-(\d+)(\.\d+)?', aside)  # unused() numbers a second one of a step .2, ...
        if m and int(m.group(1)) < int(name.removeprefix('step-')) and written_by(os.path.join(root, aside), run_id):
            shutil.rmtree(os.path.join(root, aside), ignore_errors=True)
            print(f"removed {os.path.join(root, aside)}, a save of this run cut short: {folder}, newer, is whole",
                  flush=True)


def written_by(folder, run_id):
    """Whether the folder holds this run's files alone: its run_id file and each rank-R.pt (loaded to read its id)
    name run_id, at least one of them is there, and nothing else is but their temporaries (rank-R.pt.tmp)."""
    told = False
    try:
        names = os.listdir(folder)
    except OSError:  # gone meanwhile, or unreadable: nothing here to remove
        return False
    for name in names:
        path = os.path.join(folder, name)
        if not os.path.isfile(path) or os.path.islink(path):
            return False
        if re.fullmatch(r'rank-\d+\.pt\.tmp', name):
            continue
        if name == 'run_id':
            theirs = read_name(path)
        elif re.fullmatch(r'rank-\d+\.pt', name):
            try:
                theirs = torch.load(path, map_location='cpu', weights_only=True, mmap=True).get('run_id')
            except Exception:  # damaged: which run wrote it, no one can tell
                return False
        else:
            return False
        if theirs != run_id:
            return False
        told = True
    return told


def name_best(folder, keep):
    """On rank 0, a new best at the step of a folder of another world size's replicas (the one resumed, their average
    in every rank): the folder is named best as it is, the state whose average best.pt holds, rather than best
    keep naming an older one. A failure (a full disk) stops the run as a failed save does, best as it was."""
    try:
        point_latest(folder, keep=keep, best=True)
    except OSError as e:
        note_failure([folder], e)


def averaged_replicas(folder, ranks):
    """The state that a run of that many ranks saved in folder: its replicas and their optimizer states (Adam's
    moments, AccumAdamW's gradient sum) averaged over the ranks, the rest as rank 0 saved it. One file at a time,
    summed in float64, so that equal replicas (complete mixing) average to themselves exactly."""
    def fold(total, x, f):  # f(total's tensor, x's) for each floating-point tensor of x; total's value elsewhere
        if torch.is_tensor(x) and x.is_floating_point():
            return f(total, x)
        if isinstance(x, dict):
            return {k: fold(total[k], v, f) for k, v in x.items()}
        if isinstance(x, list):
            return [fold(t, v, f) for t, v in zip(total, x)]
        return total

    def replica(r, **kw):
        saved = torch.load(os.path.join(folder, f'rank-{r}.pt'), map_location='cpu', weights_only=True, **kw)
        return saved, {'model': saved['model'], 'optimizers': saved['optimizers']}

    first, own = replica(0)
    total = fold(own, own, lambda t, x: x.double())
    for r in range(1, ranks):
        total = fold(total, replica(r, mmap=True)[1], lambda t, x: t.add_(x))
    return {**first, **fold(total, own, lambda t, x: t.div_(ranks).to(x.dtype))}



@torch.no_grad()
def average_replicas(buckets):
    """Replaces every rank's replica by the mean of all of them (a collective, once mixing is done). Returns this
    rank's own, to put back with restore_replica, and the consensus distance: the mean over ranks of
    ||x_i - mean|| / ||mean||."""
    world_size = dist.get_world_size()
    own = [bucket.flat.clone() for bucket in buckets]
    for bucket in buckets:
        dist.all_reduce(bucket.flat)
        bucket.flat.div_(world_size)
    sq_distance = sum((x - bucket.flat).pow(2).sum() for x, bucket in zip(own, buckets))
    sq_norm = sum(bucket.flat.pow(2).sum() for bucket in buckets)
    distance = (sq_distance / sq_norm).sqrt()
    dist.all_reduce(distance)
    return own, distance.item() / world_size


@torch.no_grad()
def restore_replica(buckets, own):
    for bucket, x in zip(buckets, own):
        bucket.flat.copy_(x)


def average_moments(bucket_of, adamw):
    """Fills train.py's AdamW (over the averaged model) with the ranks' mean Adam moments (a collective), for the
    export; SGD has none."""
    for p, bucket in bucket_of.items():
        state = bucket.optimizer.state.get(p, {})
        if 'exp_avg' in state:
            moments = torch.stack([state['exp_avg'], state['exp_avg_sq']])
            dist.all_reduce(moments)
            moments /= dist.get_world_size()
            adamw.state[p] = dict(step=torch.tensor(float(state['step'])), exp_avg=moments[0], exp_avg_sq=moments[1])
