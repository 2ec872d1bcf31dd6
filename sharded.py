"""
What fsdp_train.py needs of sharded parameters besides FSDP2 and tensor parallelism themselves: the global norm
of gradients that live on one or two meshes (and clipping by it), a rank's own pieces of its state (for memory
snapshots), loading a checkpoint of any kind into the shards, and train.py's whole state out of them (the
optimizer state numbered by parameter as train.py's, where the sharded one is keyed by name).
"""

import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     get_state_dict, set_optimizer_state_dict, set_state_dict)
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten_with_path, tree_map_only

from checkpoint import dcp_load, upgrade_optimizer_state


def total_norm(grads):
    """The global norm of sharded gradients: it adds every rank's shards. Under tensor parallelism the blocks'
    matrices live on the 2-D mesh and the rest on dp alone, so the squares are summed per mesh (a DTensor's sum
    reduces over its own mesh) before the whole is added up."""
    by_mesh = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    total_sq = 0.0
    for gs in by_mesh.values():
        sq = torch.stack([g.float().pow(2).sum() for g in gs]).sum()
        total_sq = total_sq + (sq.full_tensor() if isinstance(sq, DTensor) else sq)
    return total_sq.sqrt()


def clip_grad_norm(parameters, max_norm):
    """Gradient clipping over sharded gradients, by their global norm, which it returns."""
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = total_norm(grads)
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(scale.to(g.device))
    return norm


def local_shards(state):
    """The state with each DTensor replaced by this rank's piece of it (a view, no copy): a memory snapshot."""
    return tree_map_only(DTensor, lambda t: t.to_local(), state)


@torch.no_grad()
def load_local_shards(state, saved):
    """Copies a memory snapshot's pieces (local_shards of the same mesh) into the state's shards."""
    ours, theirs = tree_flatten_with_path(local_shards(state))[0], tree_flatten_with_path(saved)[0]
    if [path for path, _ in ours] != [path for path, _ in theirs]:
        raise ValueError("its shards are not laid out as this model's and optimizer's")
    for (_, t), (_, s) in zip(ours, theirs):
        if torch.is_tensor(t):
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


def full_state(model, optimizer, raw_model):
    """train.py's model and optimizer state dicts, whole, gathered into rank 0's CPU memory (a collective)."""
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    osd = get_optimizer_state_dict(model, optimizer, options=full)
    return get_model_state_dict(model, options=full), optim_state_dict_by_index(osd, raw_model) if osd else osd


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
