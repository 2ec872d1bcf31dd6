"""
What ds_train.py needs of DeepSpeed 0.19.8 besides its engine: the offload settings and a user's config file merged
into the generated config (its keys and types checked), the engine's checkpoint I/O taken over (background writes,
weights_only loads) and its checkpoint folders read (which iteration, which layout), a guard for the one step it
leaves unchecked, its state as train.py's whole model and AdamW state and back (for the consolidated ckpt.pt, which
resumes at any world size and stage), and what each rank holds in memory.
"""

import filecmp
import json
import os
import re
import shutil
import sys

import torch
import torch.distributed as dist
import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime import constants
from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils import (safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_set_full_fp32_param,
                             safe_set_full_optimizer_state)
from deepspeed.utils.tensor_fragment import fragment_address
from pydantic import ValidationError

from checkpoint import (checkpoint_iter, in_ram, is_snapshot, kept, point_latest, read_name, reason, same_step,
                        saved_for, step_folders)
from runlog import count_overflow, count_skipped, stop_diverged

# the classes that DeepSpeed 0.19.8 pickles into its checkpoints besides tensors and containers
DS_SAFE_GLOBALS = [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]

# ZeRO-3's settings for a compiled model. Its hooks on every module (a graph break at each) left dynamo a frame per
# Linear, compiled again for each weight's shape and grad mode, and its own hooks' frames once per module: past its
# recompile limit of 8 those ran uncompiled (on CPU, 44 recompiles in 4 steps of the 2-layer model). With each Block
# a ZeRO leaf, hooks on the Block alone gather its parameters (a block's at a time rather than a Linear's; for its
# backward too), and its forward compiles whole, once for every block. DeepSpeed's memory-efficient F.linear then
# has nothing to do (it re-gathers a weight for backward, and saves what F.linear saves), and it is where dynamo
# recompiled on a GPU: plain F.linear instead.
ZERO3_COMPILED = {'leaf_module': {'classes': ['Block']}, 'memory_efficient_linear': False}


def check_offload(offload_optimizer, offload_params, zero_stage):
    """A one-line error where an offload setting is no device or folder, or needs a higher ZeRO stage or libaio."""
    for key, value in (('offload_optimizer', offload_optimizer), ('offload_params', offload_params)):
        nvme = value not in ('none', 'cpu')  # ZeRO-Infinity: a folder on an NVMe drive
        if nvme and not os.path.isdir(value):
            sys.exit(f"error: {key}={value!r} is neither none, cpu nor an existing folder (on an NVMe drive)")
        lowest = 3 if nvme or key == 'offload_params' else 1
        if value != 'none' and zero_stage < lowest:
            sys.exit(f"error: {key}={value} needs zero_stage {'3' if lowest == 3 else '1 or more'}, not {zero_stage}")
        if nvme and not getattr(get_accelerator().create_op_builder('AsyncIOBuilder'), 'is_compatible',
                                lambda: False)():
            sys.exit(f"error: {key} to NVMe needs DeepSpeed's async_io op, which needs libaio: apt-get install "
                     f"libaio-dev (or yum install libaio-devel), or offload to cpu")


def offload(key, value, device_type):
    """The DeepSpeed config's offload entry for a key's value: none, cpu, or an NVMe folder."""
    if value == 'none':
        return {}
    if value == 'cpu':
        return {key: {'device': 'cpu', 'pin_memory': device_type == 'cuda'}}  # pinned: faster copies to GPUs
    return {key: {'device': 'nvme', 'nvme_path': value}}


def add_config_file(ds_cfg, path):
    """Adds a user's DeepSpeed config file to the generated config. Its settings that contradict ds_train.py's keys,
    that DeepSpeed does not read or that have the wrong type are refused together, in one line."""
    try:
        with open(path) as f:
            extra = json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"error: cannot read ds_config {path} ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
    if not isinstance(extra, dict):
        sys.exit(f"error: ds_config {path} holds a JSON {type(extra).__name__}, not an object of DeepSpeed settings")
    clashes = []
    merge_config(ds_cfg, extra, '', clashes)  # ours stay where theirs differ
    problems = [contradictions(ds_cfg, extra, clashes)] if clashes else []
    problems += check_settings(ds_cfg, extra)
    if problems:
        sys.exit(f"error: {path} {'; it '.join(problems)}")


def bucket_sizes(zero, n_params):
    """ZeRO's buckets hold 5e8 elements unless a config says otherwise, allocated anew every step (a CPU feels it,
    and deterministic mode fills them: 0.49 s a step of a tiny model): a bucket of the model's size takes all its
    gradients, the one bucket of the default, the same sums. A user's size stays; "auto" takes this one, rounded up
    to an even count: stages 1 and 2 assert that the all-gather's is even (n_embd=33 made it odd: a traceback)."""
    for key in ('reduce_bucket_size', 'allgather_bucket_size'):
        if zero.get(key, 'auto') == 'auto':
            zero[key] = min(int(5e8), n_params + n_params % 2)


# a generated setting -> the flag of ds_train.py that sets it (value -> the flag's value); a file's offload entry
# (which ours lacks where its flag is none) is one too
OFFLOADS = ('offload_optimizer', 'offload_param')
offload_flag = lambda v: v.get('nvme_path', 'NVME_PATH') if v.get('device') == 'nvme' else v.get('device')
FLAGS = {'zero_optimization.offload_optimizer': ('offload_optimizer', offload_flag),
         'zero_optimization.offload_param': ('offload_params', offload_flag),
         'zero_optimization.stage': ('zero_stage', lambda v: v), 'gradient_clipping': ('grad_clip', lambda v: v),
         'train_micro_batch_size_per_gpu': ('batch_size', lambda v: v),
         'bf16.enabled': ('dtype', lambda v: 'bfloat16' if v else 'float32'),
         'fp16.enabled': ('dtype', lambda v: 'float16' if v else 'float32')}
BATCH = ('train_batch_size', 'train_micro_batch_size_per_gpu', 'gradient_accumulation_steps')


def contradictions(ours, extra, clashes):
    """What one line says of the file's settings that contradict the generated config (ours): each with ours, then
    the flags that generate the file's values, and the settings no flag can make agree, to drop. The batch's three
    come from batch_size and gradient_accumulation_steps, which counts micro-steps over all ranks."""
    flags, drop = {}, []
    for key, value, _ in clashes:
        if key in FLAGS:
            flags[FLAGS[key][0]] = FLAGS[key][1](value)
        elif key in ('optimizer', 'scheduler'):
            drop.append(f"{key} (ds_train.py makes AdamW and the LR schedule from its keys)")
        elif key == 'bf16.check_grad_overflow':  # without it a step of a finite loss takes non-finite gradients
            drop.append(f"{key} (a step of non-finite gradients would spoil the weights for good)")
        elif key not in BATCH:
            drop.append(key)
    total, micro, accum = (ours[k] for k in BATCH)
    ranks, steps = total // (micro * accum), total // micro  # ours: train_batch_size = micro x accum x ranks
    theirs = {k: v for k, v in extra.items() if k in BATCH and type(v) is int and v > 0}  # not "auto"
    micro = theirs.get(BATCH[1], micro)
    if BATCH[0] in theirs and theirs[BATCH[0]] % micro:
        drop.append(f"{BATCH[0]} ({theirs.pop(BATCH[0])} is no whole number of {micro}-sequence micro-batches)")
    want = theirs[BATCH[0]] // micro if BATCH[0] in theirs else theirs.get(BATCH[2], accum) * ranks
    if want != steps:
        flags['gradient_accumulation_steps'] = want
    if BATCH[2] in theirs and theirs[BATCH[2]] * ranks != want:
        drop.append(f"{BATCH[2]} (its {theirs[BATCH[2]]} a rank fits {want / theirs[BATCH[2]]:g} ranks, not {ranks}: "
                    f"DeepSpeed derives it)")
    said = [f"{key}={json.dumps(value)} ({json.dumps(here)} here)" for key, value, here in clashes if here is not None]
    if not said:  # an optimizer or scheduler section alone
        return f"sets {', '.join(k for k, _, _ in clashes)}: ds_train.py makes AdamW and the LR schedule from its " \
               f"keys; drop {'it' if len(clashes) == 1 else 'them'}"
    said = f"contradicts the config in {', '.join(said)}: "
    drop = f"drop {', '.join(drop)}" if drop else ''
    if not flags:
        return said + drop
    return f"{said}give `{' '.join(f'--{k}={v}' for k, v in flags.items())}`{drop and ' and '}{drop}, or drop those " \
           f"settings from the file"


# The type each top-level setting takes, from its default in DeepSpeed's constants; those whose default (None) tells
# none are counts.
DEFAULTS = {getattr(constants, n): getattr(constants, n + '_DEFAULT') for n in dir(constants)
            if n.isupper() and isinstance(getattr(constants, n), str) and hasattr(constants, n + '_DEFAULT')}
DEFAULTS.update(dict.fromkeys([constants.TRAIN_BATCH_SIZE, constants.TRAIN_MICRO_BATCH_SIZE_PER_GPU,
                                constants.GRADIENT_ACCUMULATION_STEPS, constants.STEPS_PER_PRINT,
                                constants.VOCABULARY_SIZE], 1))
TYPES = {bool: ((bool,), 'true or false'), int: ((int,), 'a whole number'), float: ((int, float), 'a number'),
         str: ((str,), 'a string')}


class Reads(dict):
    """A config dict that notes which top-level keys are looked up, in order."""
    def __init__(self, d, seen):
        super().__init__(d)
        self.seen = seen  # copy.copy (which DeepSpeedConfig makes) shares it

    def __getitem__(self, k):
        self.seen.append(k)
        return super().__getitem__(k)

    def get(self, k, default=None):
        self.seen.append(k)
        return super().get(k, default)

    def __contains__(self, k):
        self.seen.append(k)
        return super().__contains__(k)

    def keys(self):  # `key in config.keys()` is how some settings are looked up
        return Reads(dict.fromkeys(super().keys()), self.seen)


def check_settings(ds_cfg, extra):
    """DeepSpeed ignores a top-level key it does not know (a misspelt setting goes unnoticed) and takes a value of
    the wrong type until the step that uses it, after the first eval: both are refused here, before anything is
    written, each named in the list returned. The keys it knows are those its config reader looks up; nested
    sections are pydantic models, which refuse unknown fields and wrong types themselves: their errors are named
    too, and the reader goes on without that section, so that one line says every mistake of the file."""
    seen, problems, cfg = [], [], dict(ds_cfg)
    for _ in range(len(extra) + 1):
        try:
            DeepSpeedConfig(Reads(cfg, seen))
            break
        except ValidationError as e:  # the section last looked up refused the file's settings in it
            section = seen[-1] if seen else None
            first = e.errors()[0]['loc'][:1]  # a model of several sections (the monitors) names the section itself
            section, within = (first[0], ()) if first and first[0] in extra else (section, (section,))
            if section not in extra:
                return problems  # not the file's: deepspeed.initialize raises it again, and ds_train.py says why
            for err in e.errors():
                key = '.'.join(map(str, (*within, *err['loc'])))
                if err['input'] == 'auto':
                    continue  # a bucket size ds_train.py sets (bucket_sizes), or deepspeed.initialize's to refuse
                if err['type'] == 'extra_forbidden':
                    problems.append(f"sets {key!r}, which DeepSpeed {deepspeed.__version__} does not read: check its "
                                    f"spelling, or drop it")
                else:
                    problems.append(f"sets {key}={json.dumps(err['input'], default=str)}, which DeepSpeed refuses "
                                    f"({err['msg']})")
            cfg.pop(section)
        except (TypeError, DeepSpeedConfigError) as e:  # a traceback: a top-level setting its reader trips on
            section = seen[-1] if seen else None  # ("wall_clock_breakdown": "yes"), or a section it dropped ("amp")
            if section not in extra:
                raise
            if isinstance(e, TypeError) and section in DEFAULTS:
                cfg[section] = DEFAULTS[section]  # the reader goes on; the type it takes is named below
            else:
                problems.append(f"sets {section}, which DeepSpeed refuses ({str(e).splitlines()[0][:200]})")
                cfg.pop(section)
        except (ValueError, AssertionError):
            return problems  # deepspeed.initialize raises it again, and ds_train.py says why in one line
    for k, v in extra.items():
        want, words = TYPES.get(type(DEFAULTS.get(k)), ((object,), ''))
        ours = v == 'auto' and cfg.get(k) != 'auto'  # "auto" for a setting the generated config has: ours stays
        if k not in seen:
            problems.append(f"sets {k!r}, which DeepSpeed {deepspeed.__version__} does not read: check its spelling, "
                            f"or drop it")
        elif k in cfg and not ours and (not isinstance(v, want) or isinstance(v, bool) and bool not in want):
            problems.append(f"sets {k}={json.dumps(v)}, but DeepSpeed takes {words} there")
    return problems


def merge_config(ours, theirs, where, clashes):
    """theirs added to ours, in place; where a value of theirs differs from ours, ours stays and (dotted key, theirs,
    ours) goes to clashes. "auto" (Hugging Face's word for "as the trainer says") takes ours."""
    for k, v in theirs.items():
        if isinstance(v, dict) and isinstance(ours.get(k), dict):
            merge_config(ours[k], v, f'{where}{k}.', clashes)
        elif k in ('optimizer', 'scheduler') and not where:
            clashes.append((k, v, None))
        elif where == 'zero_optimization.' and k in OFFLOADS and isinstance(v, dict) and \
                v.get('device', 'none') != 'none':  # an offload is part of the layout checkpoints resume at: the flag's
            clashes.append((f'{where}{k}', v, 'none'))
        elif k in ours and ours[k] != v and v != 'auto':
            clashes.append((f'{where}{k}', v, ours[k]))
        elif k not in ours:
            ours[k] = v


class DeferredWrites(CheckpointEngine):
    """The engine's file I/O, taken over: at a save it hands us each file's state instead of writing it, and
    save_checkpoint below writes them in the background. Loads read with weights_only, the engine's state being
    data too (its few classes allowed by name)."""
    def __init__(self):
        super().__init__()
        self.files = []

    def create(self, info):
        self.files = []

    def save(self, state_dict, path):
        self.files.append((path, state_dict))

    def load(self, path, map_location=None):
        with torch.serialization.safe_globals(DS_SAFE_GLOBALS):
            return torch.load(path, map_location=map_location, weights_only=True)

    def commit(self, info):
        return True

    def makedirs(self, path, exist_ok=False):
        if not is_snapshot(path):  # a snapshot's folder is made by its background write, whose failure is a warning
            os.makedirs(path, exist_ok=exist_ok)

    def preserves_storage_sharing(self):
        return False  # no clones: the thread copies the tensors into host memory, while the next step runs


def copy_recovery_scripts(save_path):
    """In place of the engine's copy of its zero_to_fp32.py and zero_to_torch.py beside every save, in the loop's
    thread, which a full disk made a traceback that left a script half-written: each is copied once, whole or not
    at all, and never beside a memory snapshot (no one reads it in RAM). One that cannot be copied is a warning;
    the checkpoint's own background write tells whether the save failed."""
    if is_snapshot(save_path):
        return
    for name in ('zero_to_fp32.py', 'zero_to_torch.py'):
        source, path = os.path.join(os.path.dirname(deepspeed.__file__), 'utils', name), os.path.join(save_path, name)
        if os.path.isfile(path) and filecmp.cmp(source, path, shallow=False):
            continue
        try:
            shutil.copyfile(source, path + '.tmp')
            os.chmod(path + '.tmp', 0o755)
            os.replace(path + '.tmp', path)
        except OSError as e:
            if os.path.isfile(path + '.tmp'):
                os.remove(path + '.tmp')
            print(f"warning: DeepSpeed's {name} could not be copied beside the checkpoints ({reason(e)})",
                  file=sys.stderr, flush=True)


def engine_state(path):
    """Our state in the engine checkpoint folder at path (the client state: iter_num, run_id, world_size, config),
    once every file of the folder loads; raises where one does not (cut short, corrupt). With mmap only each
    file's index is read."""
    files = sorted(f for f in os.listdir(path) if f.endswith('.pt'))
    with torch.serialization.safe_globals(DS_SAFE_GLOBALS):
        for f in files:
            torch.load(os.path.join(path, f), map_location='cpu', weights_only=True, mmap=True)
        states = [f for f in files if f.endswith('model_states.pt')][0]
        return torch.load(os.path.join(path, states), map_location='cpu', weights_only=True, mmap=True)


SETTINGS = ('offload_optimizer', 'offload_params', 'dtype')  # of the layout, besides the world size and stage


def checkpoint_iter_at(path, run_id, layout, foreign, ds_dir, rank=None):
    """The iteration of an engine checkpoint folder, None where another run or another layout wrote it (layout:
    world_size, zero_stage, the offloads and the dtype; the shards resume only at the one that cut them, DeepSpeed's
    CPU Adam fails on a state saved without it, and its bf16 optimizer's files have names of their own), those in
    ds_dir and the run's own memory snapshots noted in foreign as (path, world size, their layout) (a copy's
    snapshots are find_resume's to keep); or a ckpt.pt's, as checkpoint_iter reads it. With rank, None too for a
    memory snapshot that lacks that rank's ZeRO shards: a node's holds its own ranks' alone, and a job back on its
    nodes in another order (a requeue) has other ranks there."""
    if not os.path.isdir(path):
        return checkpoint_iter(path, run_id)
    ours = engine_state(path)
    if run_id is not None and ours.get('run_id', run_id) != run_id:
        return None
    precision = ours.get('ds_config', {})  # the dtype as resolved (the config may say auto)
    theirs = {'world_size': ours['world_size'], 'zero_stage': ours['config']['zero_stage'],
              'offload_optimizer': ours['config'].get('offload_optimizer', 'none'),
              'offload_params': ours['config'].get('offload_params', 'none'),
              'dtype': 'bfloat16' if precision.get('bf16', {}).get('enabled') else
              'float16' if precision.get('fp16', {}).get('enabled') else 'float32'}
    kind = lambda k, v: 'nvme' if k.startswith('offload') and v not in ('none', 'cpu') else v  # one NVMe folder as any
    if any(kind(k, theirs[k]) != kind(k, layout[k]) for k in layout):
        # (a snapshot kept in out_dir is the run's own: keep_earlier_snapshots kept a copy's apart)
        if path.startswith(ds_dir) or is_snapshot(path) and (not in_ram(path) or
                                                             saved_for(path, os.path.dirname(ds_dir),
                                                                       ours.get('run_id'), engine_state, say=False)):
            foreign.append((path, ours['world_size'], theirs))
        return None
    shards = lambda r='': [n for n in os.listdir(path) if f'zero_pp_rank_{r}' in n]
    if rank is not None and is_snapshot(path) and shards() and not shards(f'{rank}_'):
        return None
    return int(ours['iter_num'])


def folder_iter(path):
    """The iteration of a whole engine checkpoint folder in out_dir/ds, of any layout: the fallbacks that a save
    keeps (point_latest) include the folders of the layout before a resume at another world size or stage, whole
    states of the run, as fsdp_train.py keeps its own; raises where a file does not load."""
    return int(engine_state(path)['iter_num'])


def whole_at(folder, iter_num, run_id, layout, best=0):
    """Whether out_dir/ds/step-N (folder) is this run's whole checkpoint of iter_num, the one latest names: True in
    this layout, 'other' in the layout before a resume at another world size or stage (which went on from the
    consolidated ckpt.pt of that step: its first eval saves the same state again), else False. A save to its step
    (a run resumed from its memory snapshot of a step saved already, a new best there) keeps its files, which
    removed to be written again would leave latest naming a folder half-written, and the step nowhere but in a
    node's RAM or ckpt.pt, until the new ones were in; another layout's files take none of ours beside them. Rank 0
    looks and every rank takes its answer (a collective): all have to take the same way. best (a new best there:
    the step folders to keep): rank 0 names another layout's folder best as it is, the run's state at that step, as
    the caller's export names it in best.pt, rather than keep naming an older one that the run's evals no longer
    count as its best."""
    whole = [False]
    if dist.get_rank() == 0 and read_name(os.path.join(os.path.dirname(folder), 'latest')) == os.path.basename(folder):
        try:
            state = engine_state(folder)
            if state.get('run_id', run_id) == run_id and int(state['iter_num']) == iter_num:
                whole[0] = checkpoint_iter_at(folder, run_id, layout, [], os.path.dirname(folder)) == iter_num or \
                    'other'
        except Exception:  # damaged: written anew
            pass
    if whole[0] == 'other' and best:
        point_latest(folder, folder_iter, best, best=True)
    dist.broadcast_object_list(whole, src=0)
    return whole[0]


def best_behind(ds_dir, iter_num, run_id, best_path):
    """Whether ds_dir/best names this run's step iter_num while best_path (the export's best.pt) holds another state:
    a run saved with save_consolidated=False since, run again with it from that step, writes it there too."""
    return read_name(os.path.join(ds_dir, 'best')) == f'best-step-{iter_num:08d}' and \
        not same_step({'iter_num': iter_num, 'run_id': run_id}, best_path)


def on_this_job(foreign):
    """foreign (checkpoint_iter_at's) less the memory snapshots that this job's nodes do not hold for every rank of
    their layout: a node's holds its own ranks' ZeRO shards alone, so after a node was lost (the job back on fewer
    nodes) no layout resumes them here, and the node's first rank says so. A collective."""
    shards = lambda path: {int(m[1]) for n in os.listdir(path) if (m := re.search(r'zero_pp_rank_(\d+)_', n))}
    key = lambda path, ranks, theirs: (os.path.basename(path), ranks, tuple(sorted(theirs.items())))
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, [(key(*f), shards(f[0])) for f in foreign if is_snapshot(f[0])])
    held = {}
    for at, ranks in (f for v in views for f in v):
        held.setdefault(at, set()).update(ranks)
    part = [f for f in foreign if is_snapshot(f[0]) and shards(f[0]) and held[key(*f)] != set(range(f[1]))]
    if part and int(os.environ.get('LOCAL_RANK', 0)) == 0:
        path, ranks, _ = max(part, key=lambda f: f[0])
        print(f"note: the memory snapshot {path} of {ranks} ranks lacks the shards of nodes that are not in this job "
              f"(a node lost, or the job back on fewer nodes): no layout resumes it here", flush=True)
    return [f for f in foreign if f not in part]


def refuse_other_layouts(resume_from, foreign, layout, ckpt_path, eval_only, print0):
    """find_resume's check for ds_train.py (foreign: checkpoint_iter_at's folders of another layout). Another
    layout's folder newer than the state resumed: continuing from the older export would prune it, or replace it at
    its step, with a state it never held (rank 0 reads the storage; a launcher stops the others)."""
    foreign[:] = on_this_job(foreign)  # a node's snapshot of another layout counts where the job holds all its shards
    resume_path = resume_from and resume_from[1]
    newer = [f for f in foreign if resume_from is not None and int(os.path.basename(f[0])[5:]) > resume_from[0]]
    if foreign:
        path, ranks, theirs = (newer or foreign)[0]
        at, flags = layout_words(theirs, layout)
    if (newer or foreign and resume_from is None) and eval_only:  # an eval of it reads the shards as they are
        sys.exit(f"error: the run's newest state, {path}, was written by {ranks} ranks at {at}, and ZeRO's shards "
                 f"load only so: evaluate it with {ranks} ranks and {flags}")
    if newer:
        sys.exit(f"error: the run's newest state, {path}, was written by {ranks} ranks at {at}, and ZeRO's shards "
                 f"resume only so: use {ranks} ranks and {flags} --save_consolidated=True --always_save_checkpoint="
                 f"True until it saves (at once where it has finished; SIGTERM saves): any layout resumes {ckpt_path}")
    elif foreign and resume_path in kept(ckpt_path):
        print0(f"{path} was written by {ranks} ranks at {at}, not {layout['world_size']} at "
               f"{layout_words(layout, theirs)[0]}: continuing from the consolidated {resume_path} instead")
    elif foreign and resume_from is None:
        sys.exit(f"error: {path} was written by {ranks} ranks at {at}, and ZeRO's shards resume only so; with no "
                 f"consolidated {ckpt_path} to go on from (save_consolidated=False, or none saved yet) use {ranks} "
                 f"ranks and {flags}")


def read_engine_state(path):
    """Our state: the client state in the (first) model-states file of an engine folder (mmap reads only what is
    used), or a ckpt.pt whole, whose weights load into the module now and moments into the engine later. Data,
    never code."""
    if os.path.isdir(path):
        path = os.path.join(path, sorted(f for f in os.listdir(path) if f.endswith('model_states.pt'))[0])
        return torch.load(path, map_location='cpu', weights_only=True, mmap=True)
    return torch.load(path, map_location='cpu', weights_only=True)


def layout_words(layout, ours):
    """A layout as the messages name it, and as the flags that give it: `zero_stage=2, offload_optimizer=cpu` and
    `--zero_stage=2 --offload_optimizer=cpu`, the other settings only where they differ from ours or their default."""
    keys = ['zero_stage'] + [k for k in SETTINGS if layout[k] != ours[k] or layout[k] not in ('none', 'float32')]
    return ', '.join(f'{k}={layout[k]}' for k in keys), ' '.join(f'--{k}={layout[k]}' for k in keys)


def engine_folders(folder):
    """The step folders of an engine's checkpoints up to the one latest names: those after it were cut short."""
    latest = os.path.join(folder, 'latest')
    if not os.path.exists(latest):
        return []
    with open(latest) as f:
        newest = f.read().strip()
    return [path for path in step_folders(folder) if os.path.basename(path) <= newest]


def guard_step(optimizer):
    """At stage 0 in fp32 DeepSpeed steps our AdamW as it is, unchecked: a step with non-finite gradients is
    skipped, and the overflow flag (which the engine reads after the step, as it does ZeRO's) says so."""
    def guarded_step(adamw_step=optimizer.step):
        grads = [p.grad for g in optimizer.param_groups for p in g['params'] if p.grad is not None]
        optimizer.overflow = not torch.isfinite(torch.nn.utils.get_total_norm(grads)).item()
        if not optimizer.overflow:
            adamw_step()
    optimizer.step = guarded_step


def step_or_stop(model, in_a_row, iter_num, out_dir, run_id):
    """model.step(), which in float16 raises a bare Exception on every rank alike where gradients overflow with the
    loss scale already at DeepSpeed's min_loss_scale: the run stops there as max_nonfinite_steps would stop it
    (runlog.stop_diverged), in one line naming the last good state rather than in a traceback."""
    try:
        model.step()
    except Exception as e:
        if 'loss scale already at minimum' not in str(e):  # DeepSpeed's DynamicLossScaler.update_scale
            raise
        stop_diverged(in_a_row + 1, iter_num, out_dir, run_id, "gradient in float16 at DeepSpeed's min_loss_scale",
                      dtype='float16')


def count_step(model, nonfinite, in_a_row, limit, iter_num, log, out_dir, run_id, dtype):
    """The non-finite steps in a row after this one (runlog.count_skipped): one of a non-finite loss, or one the
    engine did not take. In float16 a step of a finite loss that the engine did not take is its loss scaler's skip
    of overflowing gradients, said and logged with the scale it lowered to, as train.py's are (count_overflow):
    DeepSpeed's own line for it is at a log level that prints nothing, and a run of them up to its min_loss_scale
    stopped as "1 steps in a row". A static scale (a ds_config's loss_scale) never reaches that stop: limit overflows
    in a row stop the run as non-finite steps do (it skipped every step forever)."""
    skipped = not model.was_step_applied()
    if dtype == 'float16' and skipped and not nonfinite:
        return count_overflow(in_a_row, iter_num, model.optimizer.loss_scale, log, out_dir, run_id,
                              limit=None if model.dynamic_loss_scale() else limit)
    return count_skipped(nonfinite or skipped, in_a_row, limit, iter_num, log, out_dir, run_id, dtype=dtype)


def by_norm_where_zero_checks(asked, given, zero_stage, dtype, offload_optimizer):
    """Whether a non-finite gradient is to be found by the global norm alone (overflow_by_norm): where ZeRO checks
    each gradient before its norm, stages 1 and 2 in bf16 or fp16 without an offloaded optimizer. Elsewhere it is
    off, and refused in one line where it was given (the others check no gradient one by one)."""
    where = zero_stage in (1, 2) and dtype != 'float32' and offload_optimizer == 'none'
    if asked and not where and given:
        sys.exit(f"error: overflow_by_norm=True is for ZeRO stages 1 and 2 in bfloat16 or float16 without an offloaded "
                 f"optimizer (the others check no gradient one by one), not zero_stage={zero_stage}, dtype={dtype}, "
                 f"offload_optimizer={offload_optimizer}: drop it")
    return asked and where


def norm_is_read(ds_cfg, given, ds_config):
    """Whether DeepSpeed's step computes the global norm (compute_grad_norm), which a ds_config file may turn off.
    Where it does not and overflow_by_norm was given, a one-line error; where it was a default, DeepSpeed's own
    check of each gradient stays. (bf16's check_grad_overflow, without which the norm is not read for a non-finite
    gradient either, no file turns off: it is ds_train.py's own setting.)"""
    if ds_cfg['zero_optimization'].get('compute_grad_norm', True):
        return True
    if given:
        sys.exit(f"error: overflow_by_norm=True finds a non-finite gradient by the global norm, which {ds_config} "
                 f"turns off (compute_grad_norm): drop one of them")
    return False


def overflow_by_norm_alone(zero):
    """ZeRO-1/2 in bf16 or fp16 checks each gradient for a non-finite value (seven kernels a gradient, queued from
    Python, then a wait for the verdict) and then the global norm it clips by, which is not finite wherever a
    gradient is not: the norm alone decides. On one GPU GPT-2's step waited on a host that spent a third of its time
    in the first check."""
    zero.check_overflow = lambda partition_gradients=True: None  # step() set zero.overflow = False before it


def remove_shm_buffer_name(rank):
    """Under its launcher (which sets LOCAL_SIZE) DeepSpeed on the CPU maps a 66 MB shared-memory file per rank
    for its inference all-reduce and never removes it; once every rank has mapped the others', the names can go."""
    dist.barrier()
    shm = f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR')}_{os.environ.get('MASTER_PORT')}"
    if os.path.exists(f'/dev/shm/{shm}_{rank}'):
        os.remove(f'/dev/shm/{shm}_{rank}')


def link_optimizer_state(raw_model, optimizer):
    """DeepSpeed 0.19.8 links each parameter to its fragments of the optimizer state lazily, in its step, after the
    first weight-decay group's update, when the second group (biases, gains) has no state yet: link the rest."""
    for p in raw_model.parameters():
        m = getattr(p, '_hp_mapping', None)
        if m is not None and not m.optim_fragment:
            flat = optimizer.param_groups[m.param_group_index]['params'][0]
            m.set_optim_state_fragment(flat, optimizer.state[flat])


def stage0_pieces(tensors, shapes):
    """At stage 0 AdamW steps the parameters themselves (fp32), or one flat fp32 copy of each group (bf16, fp16):
    the group's parameters' tensors, or their views in that flat tensor."""
    if len(tensors) == len(shapes):
        return tensors
    return [t.view(s) for t, s in zip(tensors[0].split([s.numel() for s in shapes]), shapes)]


def gather_state(engine, raw_model, optimizer, group_names, adamw_groups):
    """train.py's model and optimizer state dicts, whole, in CPU memory. A collective: under ZeRO each parameter's
    fp32 master weights and Adam moments are all-reduced from the fragments that the ranks own."""
    params = dict(raw_model.named_parameters())
    moments = ('exp_avg', 'exp_avg_sq')
    weights, state = {}, {}
    if any(hasattr(p, '_hp_mapping') or hasattr(p, 'ds_id') for p in params.values()):  # ZeRO 1-3
        link_optimizer_state(raw_model, optimizer)
        for n, p in params.items():
            weights[n] = safe_get_full_fp32_param(p).cpu()
            state[n] = {k: safe_get_full_optimizer_state(p, k).cpu() for k in moments}
    else:
        for group, g in zip(group_names, optimizer.param_groups):
            shapes = [params[n].shape for n in group]
            ws = stage0_pieces(g['params'], shapes)
            ms = {k: stage0_pieces([optimizer.state[m][k] for m in g['params']], shapes) for k in moments}
            for i, n in enumerate(group):
                weights[n], state[n] = ws[i].detach().cpu(), {k: ms[k][i].cpu() for k in moments}
    name_of = {id(p): n for n, p in params.items()}  # the tied lm_head.weight is wte's parameter
    model_sd = {k: weights[name_of[id(v)]] for k, v in raw_model.state_dict(keep_vars=True).items()}
    # numbered as train.py's AdamW numbers its parameters, with its hyperparameters
    step = torch.tensor(float(next(iter(optimizer.state.values()))['step']))  # every parameter takes every step
    names = [n for group in group_names for n in group]
    groups, start = [], 0
    for g, live, group in zip(adamw_groups, optimizer.param_groups, group_names):  # the settings as they are now
        groups.append({**g, **{k: live[k] for k in g if k in live}, 'params': list(range(start, start + len(group)))})
        start += len(group)
    return model_sd, {'state': {i: {'step': step, **state[n]} for i, n in enumerate(names)}, 'param_groups': groups}


@torch.no_grad()
def load_state(engine, raw_model, optimizer, group_names, model_sd, optim_sd, device):
    """gather_state's inverse: train.py's whole weights and AdamW state, whatever world size, stage or entrypoint
    wrote them, into this engine; each rank keeps its own part (under ZeRO its fragments of every parameter's fp32
    master weights and Adam moments). The module holds the weights already (they were loaded before the engine
    was made); the fp32 master copies are set again, since in bf16 the engine made them from rounded weights."""
    params = dict(raw_model.named_parameters())
    names = [n for group in group_names for n in group]
    saved = {names[i]: s for i, s in optim_sd['state'].items()}
    if saved:
        # Adam's state exists only from its first step on: a step on zero gradients at lr 0 makes it (zero moments,
        # the weights unmoved), and then takes the saved moments and step count. Its flat fp32 tensors: each group's
        # own, or at stage 3 the sub-groups that the engine hands it only for the length of a step
        zero3 = getattr(engine.optimizer, 'fp32_partitioned_groups_flat', None)
        flats = [(engine.optimizer.sub_group_to_group_id[j], t) for j, t in enumerate(zero3)] if zero3 else \
            [(i, p) for i, g in enumerate(optimizer.param_groups) for p in g['params']]
        before = [(g['params'], g['lr']) for g in optimizer.param_groups]
        grads = [t.grad for _, t in flats]
        for i, g in enumerate(optimizer.param_groups):
            g['params'], g['lr'] = [t for j, t in flats if j == i], 0.0
        for _, t in flats:
            t.grad = torch.zeros_like(t)
        optimizer.step()
        for g, (params_before, lr) in zip(optimizer.param_groups, before):
            g['params'], g['lr'] = params_before, lr
        for (_, t), grad in zip(flats, grads):
            t.grad = grad
        step = float(next(iter(saved.values()))['step'])
        for s in optimizer.state.values():
            s['step'] = s['step'].fill_(step) if torch.is_tensor(s['step']) else int(step)
    if any(hasattr(p, '_hp_mapping') or hasattr(p, 'ds_id') for p in params.values()):  # ZeRO 1-3
        link_optimizer_state(raw_model, optimizer)
        for n, p in params.items():
            safe_set_full_fp32_param(p, model_sd[n].to(device))
            for k in saved.get(n, {}):
                if k != 'step':
                    safe_set_full_optimizer_state(p, saved[n][k].to(device), k)
    else:
        for group, g in zip(group_names, optimizer.param_groups):
            shapes = [params[n].shape for n in group]
            for n, w in zip(group, stage0_pieces(g['params'], shapes)):
                w.copy_(model_sd[n])
            for k in ('exp_avg', 'exp_avg_sq') if saved else ():
                for n, m in zip(group, stage0_pieces([optimizer.state[t][k] for t in g['params']], shapes)):
                    m.copy_(saved[n][k])


def state_bytes(engine, raw_model, optimizer):
    """Bytes of parameters, gradients and optimizer state on this rank, counted by storage (a flat buffer once,
    however many views of it): the module's weights (their partitions at stage 3) and the fp32 master partitions
    that ZeRO steps (the same storage at stage 3 in fp32, a copy at 1 and 2); the reduced gradients; the Adam
    moments. DeepSpeed frees the gradients within its step, so they are counted before it."""
    def size(tensors):
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
    mine = [getattr(p, 'ds_tensor', p) for p in raw_model.parameters()]
    # ZeRO-3 hands the optimizer its fp32 partitions only for the length of a step
    masters = [p for g in optimizer.param_groups for p in g['params']] + \
        list(getattr(engine.optimizer, 'fp32_partitioned_groups_flat', []))
    # where each stage keeps them after the reduction: stage 0 in .grad, 1 and 2 in averaged_gradients (views of
    # one partition buffer), 3 in one flat buffer of partitions, and with offload beside the CPU master copies
    zero_grads = [g for gs in getattr(engine.optimizer, 'averaged_gradients', {}).values() for g in gs or []]
    grads = [p.grad for p in list(raw_model.parameters()) + masters if p.grad is not None] + zero_grads + \
        [getattr(engine.optimizer, 'grad_partitions_flat_buffer', None)]
    return dict(param_bytes=size(mine + masters),
                grad_bytes=size(g for g in grads if g is not None),
                optim_bytes=size(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)))

