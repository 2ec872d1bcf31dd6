"""
What fsdp_train.py and pp_train.py need of sharded parameters besides FSDP2 and tensor parallelism themselves: a
block's tensor-parallel plan (its heads' own dropout streams with it) and the check that it can split the model, the
global norm of gradients that live on one or two meshes (and clipping by it), a rank's own pieces of its state (for
memory snapshots), writing a DCP checkpoint folder in the background, loading a checkpoint of any kind into the
shards, and train.py's whole state out of them (a consolidated checkpoint, the optimizer state numbered by parameter
as train.py's, where the sharded one is keyed by name).
"""

import hashlib
import os
import shutil
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     get_state_dict, set_optimizer_state_dict, set_state_dict)
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.optim.adamw import adamw
from torch.utils._pytree import tree_flatten_with_path, tree_map_only

from checkpoint import (atomic_save, dcp_load, in_background, mark_run, note_failure, point_latest, print0,
                        same_step, save_in_background, upgrade_optimizer_state, wait_for_saves)


def tensor_parallel(block, tp_mesh):
    """Tensor parallelism in a GPT block over tp_mesh (Megatron's plan; fsdp_train.py's and pp_train.py's): q, k, v
    and the MLP's first layer split by output (heads, hidden units), the projections back by input, so one
    all-reduce in attention and one in the MLP, forward and backward. The block takes and gives whole activations
    (plain tensors, the same on every rank of the group); its layer norms stay whole. Apply it before compile and
    FSDP (torchtitan's order)."""
    parallelize_module(block, tp_mesh, {
        'attn.c_q': ColwiseParallel(), 'attn.c_k': ColwiseParallel(), 'attn.c_v': ColwiseParallel(),
        'attn.c_proj': RowwiseParallel(), 'mlp.c_fc': ColwiseParallel(), 'mlp.c_proj': RowwiseParallel()})
    if block.attn.dropout > 0:
        own_attention_dropout(block.attn, tp_mesh.get_local_rank())


def own_attention_dropout(attn, tp_rank):
    """Megatron's model-parallel RNG, without a second state to save: the attention probabilities of a tp rank's own
    heads take dropout masks of their own, while the replicated activations (embeddings, the residual dropouts after
    the all-reduces) keep the stream that the tp group shares, whose masks must agree across it. Entering attention,
    the device's generator is seeded from its shared state and the tp rank (a hash: no draw, no sync), and the shared
    state comes back before attn.resid_dropout. So the ranks' own masks are a function of the shared state: a
    checkpoint's RNG brings them back, and activation checkpointing's recompute (which restores the shared state)
    draws them again. Runs eagerly under compile (a graph break each side of it). It follows model.py's attention,
    which draws in scaled_dot_product_attention, then in resid_dropout; the MLP's one dropout (after its all-reduce)
    draws from the shared stream."""
    shared = []

    @torch.compiler.disable
    def enter(module, args):
        if module.training:
            generator = default_generator(args[0].device)
            state = generator.get_state()
            digest = hashlib.blake2b(state.numpy().tobytes() + tp_rank.to_bytes(4, 'little'), digest_size=8).digest()
            generator.manual_seed(int.from_bytes(digest, 'little'))
            shared.append((generator, state))

    @torch.compiler.disable
    def leave(*_):
        if shared:
            generator, state = shared.pop()
            generator.set_state(state)
    attn.register_forward_pre_hook(enter)
    attn.resid_dropout.register_forward_pre_hook(leave)


def default_generator(device):
    """The generator that dropout on the device draws from."""
    if device.type == 'cpu':
        return torch.default_generator
    return torch.get_device_module(device.type).default_generators[device.index or 0]


def step_with_whole_tensors(optimizer):
    """Lets optimizer.step() (and DCP's, which makes a resumed run's state) take tensor-parallel DTensors and plain
    tensors in one list, which torch's fused AdamW refuses: pp_train.py's TP stages hold both (layer norms and
    embeddings whole, the same on every rank of the tp group). Under DTensor's implicit replication the plain ones
    are taken as replicated on the tp mesh, and the kernel runs on each rank's own pieces: bit for bit its step."""
    entered = []

    def enter(*_):
        entered.append(implicit_replication())
        entered[-1].__enter__()
    optimizer.register_step_pre_hook(enter)
    optimizer.register_step_post_hook(lambda *_: entered.pop().__exit__(None, None, None))


def check_tp_size(config, tp_size):
    """Exits with the fix unless tensor parallelism can split the model's heads and MLP units evenly."""
    for name, n, what in (('n_head', config.n_head, 'heads'), ('4 * n_embd', 4 * config.n_embd, 'MLP units')):
        if n % tp_size != 0:
            sys.exit(f"error: tp_size={tp_size} does not divide {name}={n}: tensor parallelism splits the {what} "
                     f"evenly, so use a tp_size that divides {n}")


@torch.no_grad()  # DTensor.to_local() with gradients on is an autograd function call: 3 us a gradient, on the host
def total_norm(grads):
    """The global norm of sharded gradients: it adds every rank's shards. Under tensor parallelism the blocks'
    matrices live on the 2-D mesh and the rest on dp alone, so the squares are summed per mesh and placements, over
    the mesh's dimensions that split them, before the whole is added up. The sums are of each rank's own pieces, in
    foreach kernels, not a DTensor op per gradient: those cost the host more than the GPU's whole step (an H100)."""
    by_layout = {}
    for g in grads:
        layout = (g.device_mesh, g.placements) if isinstance(g, DTensor) else None
        by_layout.setdefault(layout, []).append(g.to_local() if isinstance(g, DTensor) else g)
    total_sq = 0.0
    for layout, gs in by_layout.items():
        sq = torch.stack(torch._foreach_norm([g.float() for g in gs])).pow(2).sum()
        if layout is not None:  # a sum over the dimensions that shard (or leave partial), none over those that copy
            mesh, placements = layout
            # on the mesh's device: CPU-offloaded gradients' sums too, which nccl would not take from the CPU
            sq = sq.to(mesh.device_type)
            if mesh.ndim > 1 and mesh.size() == dist.get_world_size() and not any(p.is_replicate() for p in placements):
                # TP's matrices, sharded over both dimensions of the world's mesh: one all-reduce of all ranks, where
                # DTensor would run one per dimension in turn (and warn so on every rank)
                dist.all_reduce(sq)
            else:
                sq = DTensor.from_local(sq, mesh, [Replicate() if p.is_replicate() else Partial() for p in placements],
                                        run_check=False).full_tensor()
        total_sq = total_sq + sq
    return total_sq.sqrt()


@torch.no_grad()
def clip_grad_norm(parameters, max_norm):
    """Gradient clipping over sharded gradients, by their global norm, which it returns."""
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = total_norm(grads)
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    pieces = {}
    for g in grads:
        piece = g.to_local() if isinstance(g, DTensor) else g
        pieces.setdefault(piece.device, []).append(piece)
    for where, same in pieces.items():
        torch._foreach_mul_(same, scale.to(where))
    return norm


@torch.no_grad()
def step_on_shards(optimizer):
    """optimizer.step() of a fused AdamW over sharded parameters, on each rank's own pieces of them (plain tensors,
    the same memory): the same kernels on the same numbers, past DTensor's dispatch of each list op, which on an
    H100 took the sharded step 4.46 ms of host time against 0.35 (tests/host_time.py). Its first step is
    optimizer.step() itself, which makes the state (DTensors, as checkpoints keep it); so is any step in which a
    parameter has a gradient and no state yet (none the step before): there it is made."""
    if any(p.grad is not None and not optimizer.state.get(p) for g in optimizer.param_groups for p in g['params']):
        return optimizer.step()
    local = lambda t: t._local_tensor if isinstance(t, DTensor) else t  # to_local()'s autograd call costs the host
    for group in optimizer.param_groups:
        params = [p for p in group['params'] if p.grad is not None]
        state = [optimizer.state[p] for p in params]
        adamw([local(p) for p in params], [local(p.grad) for p in params], [local(s['exp_avg']) for s in state],
              [local(s['exp_avg_sq']) for s in state], [], [s['step'] for s in state], fused=True,
              found_inf=getattr(optimizer, 'found_inf', None), amsgrad=False, beta1=group['betas'][0],
              beta2=group['betas'][1], lr=group['lr'], weight_decay=group['weight_decay'], eps=group['eps'],
              maximize=False)


def local_shards(state):
    """The state with each DTensor replaced by this rank's piece of it (a view, no copy): a memory snapshot."""
    return tree_map_only(DTensor, lambda t: t.to_local(), state)


def rank_pieces(state):
    """The state with each tensor as this rank holds it, on the CPU: (its part, a DTensor's local shard; where that
    part starts in the whole; the whole's shape), for one gather of every rank's pieces into one rank (put_together)."""
    def piece(t):
        if isinstance(t, DTensor):
            return t.to_local().detach().cpu(), tuple(t.__create_chunk_list__()[0].offsets), tuple(t.shape)
        return t.detach().cpu(), (0,) * t.dim(), tuple(t.shape)
    return tree_map_only(torch.Tensor, piece, state)


def put_together(held):
    """A tensor put together from the pieces of it that ranks hold (rank_pieces(), a list in rank order). A part held by
    several ranks (replicas) is the lowest rank's, as that rank's full_tensor() would have taken its own."""
    t = torch.empty(held[0][2], dtype=held[0][0].dtype)
    for part, start, _ in reversed(held):  # the lowest rank's last
        t[tuple(slice(s, s + n) for s, n in zip(start, part.shape))] = part
    return t


_checkpoint_group = None  # DCP's background saves' own: two threads' collectives on one group would interleave


def save_dcp(state, extra, path, resume_path, keep=2, best=False):
    """Every rank calls this: it starts writing the sharded state into the DCP folder path (out_dir/dcp/step-N)
    and returns once DCP has copied this rank's shards to host memory; a thread of DCP's writes them, then
    .metadata, and rank 0 then points latest (with best, best too) at the folder (point_latest, keeping keep).
    extra, the small state, goes beside them in extra.pt. One save at a time, as they share a group. A resumed
    run's first eval finds its folder there (a new best there: its extra.pt, below)."""
    global _checkpoint_group
    wait_for_saves('dcp')
    if path == resume_path and not best:
        return
    if _checkpoint_group is None:
        _checkpoint_group = dist.new_group(backend='gloo')
    # A run resumed from a memory snapshot of the step of a whole folder here (saved, then killed) holds it already:
    # removed to be written again, it would leave latest naming a folder half-written until the new one is done, and
    # the step nowhere but in this node's RAM. A new best takes the new extra.pt alone, which records its val loss
    # (the folder may be of a save between evals).
    whole = torch.tensor([dist.get_rank() == 0 and os.path.isfile(os.path.join(path, '.metadata')) and
                          same_step(extra, os.path.join(path, 'extra.pt'))], dtype=torch.int32)
    dist.broadcast(whole, src=0, group=_checkpoint_group)  # rank 0's look: every rank has to take the same way
    if whole.item():
        if dist.get_rank() == 0:
            try:
                if best:
                    atomic_save(extra, os.path.join(path, 'extra.pt'))  # a new file: best-step-N's link keeps the old
                point_latest(path, keep=keep, best=best)  # in case the kill came before the folder was pointed at
            except OSError as e:  # a full disk: the run stops at the next agreement, the folder as it was
                note_failure([path], e)
        return
    begun = torch.tensor([1], dtype=torch.int32)
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)  # what a save cut short left there
        try:
            os.makedirs(path)
            mark_run(path, extra.get('run_id', ''))  # a kill while extra.pt is written leaves a folder of the run's
            atomic_save(extra, os.path.join(path, 'extra.pt'))
        except OSError as e:  # a full disk: the run stops at the next agreement, as for a write that fails later
            note_failure([path], e)
            begun[0] = 0
    dist.broadcast(begun, src=0, group=_checkpoint_group)  # nobody writes into the folder before it is clean
    if not begun.item():
        return
    saving = dcp.async_save(state, checkpoint_id=path, process_group=_checkpoint_group)
    in_background(saving.result, 'dcp', path=path,
                  then=lambda ok: ok and dist.get_rank() == 0 and point_latest(path, keep=keep, best=best))
    print0(f"saving checkpoint to {path}")


def read_start(path):
    """A starting point's small state, read as data, never code: the extra.pt beside a DCP folder's shards, or a
    whole file (this rank's memory snapshot, or a train.py checkpoint, whose weights load before sharding)."""
    return torch.load(os.path.join(path, 'extra.pt') if os.path.isdir(path) else path, map_location='cpu',
                      weights_only=True)


@torch.no_grad()
def load_local_shards(state, saved):
    """Copies a memory snapshot's pieces (local_shards of the same mesh) into the state's shards. Tensors only, by
    their place in the state: pp_train.py's optimizer groups name the whole GPT's parameters in what it saves (as
    its DCP folders must) and only its stages' in a rank's own state, and the groups' settings come from the config."""
    tensors = lambda tree: [(path, t) for path, t in tree_flatten_with_path(tree)[0] if torch.is_tensor(t)]
    ours, theirs = tensors(local_shards(state)), tensors(saved)
    if [path for path, _ in ours] != [path for path, _ in theirs]:
        raise ValueError("its shards are not laid out as this model's and optimizer's")
    for (_, t), (_, s) in zip(ours, theirs):
        t.copy_(s)


def load_sharded_state(model, optimizer, checkpoint, path, raw_model):
    """Loads a resumed run's weights and optimizer state into the sharded model and optimizer: each rank reads the
    pieces of the saved shards that its own shards cover, from a DCP folder (whatever mesh wrote it) or from its
    own memory snapshot (which this mesh wrote); or, from a train.py checkpoint (whose weights the model took
    before it was sharded), the optimizer state, which train.py numbers by parameter and FSDP keys by name."""
    if 'model' in checkpoint:
        osd = optim_state_dict_by_name(upgrade_optimizer_state(raw_model, checkpoint['optimizer']), raw_model)
        set_optimizer_state_dict(model, optimizer, osd, options=StateDictOptions(full_state_dict=True))
        return
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {'model': model_sd, 'optim': optim_sd}
    if 'shards' in checkpoint:
        load_local_shards(state, checkpoint['shards'])
    else:
        dcp_load(state, path)  # .metadata and the shards read as data
    set_state_dict(model, optimizer, model_state_dict=state['model'], optim_state_dict=state['optim'])


def sharded_state(model, optimizer):
    """The model's and the optimizer's state dicts, with this rank's shards (DTensors) in them: what DCP saves."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {'model': model_sd, 'optim': optim_sd}


def save_full(model, optimizer, raw_model, extra, path, keep=1, best=None):
    """Every rank calls this: it gathers the whole state into rank 0's CPU memory, and rank 0 writes it to path in
    train.py's format, in the background (a consolidated checkpoint, for train.py, sample.py and export_hf.py); keep
    and best as checkpoint.atomic_save takes them."""
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(model, options=full)
    osd = get_optimizer_state_dict(model, optimizer, options=full)  # keyed by name; empty but on rank 0
    if dist.get_rank() == 0:
        save_in_background({'model': model_sd, 'optimizer': optim_state_dict_by_index(osd, raw_model), **extra}, path,
                           keep=keep, best=best)
        print0(f"saving consolidated checkpoint to {path}")


def optim_state_dict_by_name(osd, model):
    """train.py's AdamW state (parameters numbered in param_groups order) keyed by parameter name instead."""
    names = [n for group in model.param_groups() for n in group]
    return {'state': {names[i]: s for i, s in osd['state'].items()},
            'param_groups': [{**g, 'params': [names[i] for i in g['params']]} for g in osd['param_groups']]}


def optim_state_dict_by_index(osd, model):
    """The inverse: a state keyed by parameter name, numbered as train.py's optimizer numbers its parameters."""
    index = {n: i for i, n in enumerate(n for group in model.param_groups() for n in group)}
    return {'state': {index[n]: s for n, s in osd['state'].items()},
            'param_groups': [{**g, 'params': [index[n] for n in g['params']]} for g in osd['param_groups']]}
