"""
Reads the model out of any checkpoint this repo's entrypoints (or nanoGPT) write, in one process:

- a train.py ckpt.pt (also fsdp_train.py's consolidated one, and nanoGPT's own),
- an fsdp_train.py sharded folder (out_dir/dcp/step-N/, any world size or mesh wrote it),
- a run's out_dir, standing for its newest checkpoint of either kind.

sample.py, export_hf.py and the entrypoints' init_from=<path> use it; resuming a run stays with each entrypoint,
which also restores the optimizer, RNG and data position.
"""

import os
import warnings

import torch

from model import GPT, GPTConfig


def find_checkpoint(path):
    """The checkpoint a path names: a file, a sharded folder, or a run folder's newest checkpoint."""
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, 'extra.pt')):
        latest = os.path.join(path, 'dcp', 'latest')
        if os.path.exists(latest):
            with open(latest) as f:
                return os.path.join(path, 'dcp', f.read().strip())
        return os.path.join(path, 'ckpt.pt')
    return path


def load_checkpoint(path, dropout=None):
    """Returns (model, checkpoint) for the checkpoint at path: the GPT with its weights (on the CPU; dropout as
    given, else as saved), and the checkpoint's small state (model_args, config, iter_num, ...). Raises
    FileNotFoundError where there is none, and other exceptions where it is damaged."""
    path = find_checkpoint(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path}")
    overrides = {} if dropout is None else {'dropout': dropout}
    if os.path.isdir(path):
        # a torch.distributed.checkpoint folder: its shards are read into a whole model, whatever wrote them
        import torch.distributed.checkpoint as dcp
        checkpoint = torch.load(os.path.join(path, 'extra.pt'), map_location='cpu', weights_only=True)
        model = GPT(GPTConfig(**{**checkpoint['model_args'], **overrides}))
        state = {'model': model.state_dict()}
        with warnings.catch_warnings():  # it says it assumes one process, which is what is meant
            warnings.simplefilter('ignore', UserWarning)
            dcp.load(state, checkpoint_id=path, no_dist=True)
        model.load_state_dict(state['model'])
    else:
        checkpoint = torch.load(path, map_location='cpu', weights_only=True)  # a checkpoint is data, never code
        model = GPT(GPTConfig(**{**checkpoint['model_args'], **overrides}))
        model.load_state_dict(GPT.upgrade_state_dict(checkpoint.pop('model')))
        checkpoint.pop('optimizer', None)
    return model, checkpoint
