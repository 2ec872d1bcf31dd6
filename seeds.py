"""
The names that the projects this one grew from (DLRover, TensorStack t9k, nnScaler, minGPT-DDP, Decent-DP),
DiLoCo's implementations (the papers', OpenDiLoCo's, Prime's, torchft's) and the pipeline's users (torchtitan,
Megatron-LM) give our keys and values, and TOML config files (Decent-DP's and torchtitan's format), for
configurator.py, and DLRover's prep flags for prepare.py: a name that means exactly one of ours is taken and the run
says once what it is here; one that means something else is a one-line error naming our command. Not for our own
keys and rules: those are the
entrypoints' and the configurator's.
"""

import difflib
import math
import os
import re
import shlex
import sys
import tomllib

from data import data_dir, find_bins, is_path

TRAINERS = ('train.py', 'fsdp_train.py', 'ds_train.py', 'decent_train.py', 'pp_train.py')
DECENT_ONLY = ('topology', 'replica_optimizer', 'moment_accum_steps')  # decent_train.py's keys and no other's

# a seed's name for one of our keys, with the same meaning: name -> (whose, ours)
RENAMES = {
    'data_dir': ("DLRover's and Decent-DP's", 'dataset'),  # the folder of train.bin and val.bin: a path works here
    'log_dir': ("Decent-DP's", 'out_dir'),
    'context_length': ("Decent-DP's", 'block_size'),
    'grad_norm_clip': ("Decent-DP's", 'grad_clip'),
    'lr': ("Decent-DP's", 'learning_rate'),
    'warmup_steps': ("Decent-DP's", 'warmup_iters'),
    'eta_min': ("Decent-DP's", 'min_lr'),
    'eval_steps': ("Decent-DP's", 'eval_iters'),
    'n_layers': ("Decent-DP's", 'n_layer'),
    'n_heads': ("Decent-DP's", 'n_head'),
    'accum_steps': ("Decent-DP's", 'moment_accum_steps'),  # AccumAdamW's steps a moment update
    'save_dir': ("DLRover's", 'out_dir'),  # the folder of its checkpoints; its out_dir there is unused
    # DiLoCo's implementations: the paper's H (Prime's --diloco.inner_steps, OpenDiLoCo's --hv.local_steps, torchft's
    # sync_every: each fragment's window, torchtitan's sync_steps), its outer learning rate, Streaming DiLoCo's
    # fragments, τ and α (torchft's names)
    'inner_steps': ("DiLoCo's and Prime's", 'diloco_steps'),
    'local_steps': ("OpenDiLoCo's", 'diloco_steps'),
    'sync_every': ("torchft's", 'diloco_steps'),
    'sync_steps': ("torchtitan's", 'diloco_steps'),
    'outer_lr': ("DiLoCo's", 'outer_learning_rate'),
    'num_fragments': ("torchft's", 'diloco_fragments'),
    'fragment_sync_delay': ("torchft's", 'diloco_overlap'),
    'tau': ("Streaming DiLoCo's", 'diloco_overlap'),
    'fragment_update_alpha': ("torchft's", 'diloco_alpha'),
    # torchtitan's [parallelism] keys (--parallelism.KEY on its command line)
    'pipeline_parallel_degree': ("torchtitan's", 'pp_size'),
    'tensor_parallel_degree': ("torchtitan's", 'tp_size'),
    'pipeline_parallel_microbatch_size': ("torchtitan's", 'batch_size'),  # sequences a micro-batch, as ours
    'pipeline_parallel_schedule': ("torchtitan's", 'pp_schedule'),  # its names for the values too (translate)
    # Megatron-LM's flags, written with dashes there (--pipeline-model-parallel-size 4)
    'pipeline_model_parallel_size': ("Megatron-LM's", 'pp_size'),
    'tensor_model_parallel_size': ("Megatron-LM's", 'tp_size'),
    'micro_batch_size': ("Megatron-LM's", 'batch_size'),
    'num_layers': ("Megatron-LM's", 'n_layer'),
    'hidden_size': ("Megatron-LM's", 'n_embd'),
    'num_attention_heads': ("Megatron-LM's", 'n_head'),
    'seq_length': ("Megatron-LM's", 'block_size'),
    # its virtual pipeline: the stages a rank (two names for one), or the layers of a stage (translate)
    'num_virtual_stages_per_pipeline_rank': ("Megatron-LM's", 'stages_per_rank'),
    'virtual_pipeline_model_parallel_size': ("Megatron-LM's", 'stages_per_rank'),
    'num_layers_per_virtual_pipeline_stage': ("Megatron-LM's", 'stages_per_rank'),
}
DILOCO_NAMES = ('inner_steps', 'local_steps', 'sync_every', 'sync_steps', 'outer_lr', 'outer_momentum', 'nesterov',
                'num_fragments', 'fragment_sync_delay', 'fragment_update_alpha', 'should_quantize', 'compression')
TITAN = {k for k, (whose, _) in RENAMES.items() if whose == "torchtitan's"}
# torchtitan's other --fault_tolerance keys (its TorchFTManager's: torchft's replica groups), which no key here means:
# what to use instead. process_group (our backend) and semi_sync_method (DiLoCo, or local SGD) are taken
TORCHFT = {
    'enable': "torchft's replica groups are not built here: torchrun restarts the ranks after a failure "
              "(--max-restarts=N; elastic: --nnodes=MIN:MAX) and the run resumes from its newest state (auto_resume)",
    'replica_id': "each replica is a torchrun rank here, numbered by its RANK: leave it out",
    'group_size': "the replicas are torchrun's ranks, --nnodes x --nproc_per_node: leave it out",
    'min_replica_size': "torchrun --nnodes=MIN:MAX goes on with MIN nodes (and --max-restarts=N brings them back): "
                        "leave it out",
    'process_group_timeout_ms': "no key here: a rank that fails is torchrun's to restart (--max-restarts=N), and the "
                                "run resumes from its newest state: leave it out",
    'module_fqns_per_model_fragment': "fragments here are contiguous runs of blocks of near-equal size (the "
                                      "embeddings with the first): give --diloco_fragments=F",
}
# the tables that hold those names, as their projects' flags name them (--diloco.inner_steps 50, --hv.local-steps 500,
# --parallelism.pipeline_parallel_degree 4): Prime's [diloco], OpenDiLoCo's hv, torchtitan's fault_tolerance and
# parallelism
SECTIONS = {'diloco': DILOCO_NAMES, 'hv': DILOCO_NAMES, 'parallelism': TITAN,
            'fault_tolerance': (*DILOCO_NAMES, *TORCHFT, 'process_group', 'semi_sync_method')}
TITAN_KEYS = ('pipeline_parallel_schedule', 'pp_schedule')  # its schedule's key, and ours, which take its names
# torchtitan's schedule names (torch's classes, any case, as its get_schedule_class reads them) and ours
TITAN_SCHEDULES = {'gpipe': 'gpipe', '1f1b': '1f1b', 'interleaved1f1b': 'interleaved-1f1b',
                   'interleavedzerobubble': 'interleaved-zb', 'zbvzerobubble': 'zbv', 'dualpipev': 'dualpipev'}
# torchtitan's train_configs/*.toml (its JobConfig's tables, run as `--job.config_file FILE`): a key that means one of
# ours (its older names too: training.batch_size, training.warmup_steps), and the keys that set nothing here, with why
TITAN_TOML = {
    'job.dump_folder': 'out_dir', 'training.local_batch_size': 'batch_size', 'training.batch_size': 'batch_size',
    'training.seq_len': 'block_size', 'training.max_norm': 'grad_clip', 'training.dataset_path': 'dataset',
    'training.enable_cpu_offload': 'cpu_offload', 'training.seed': 'seed', 'training.warmup_steps': 'warmup_iters',
    'debug.seed': 'seed', 'debug.deterministic': 'deterministic', 'optimizer.lr': 'learning_rate',
    'lr_scheduler.warmup_steps': 'warmup_iters', 'checkpoint.interval': 'save_storage_interval',
    'checkpoint.keep_latest_k': 'keep_checkpoints', 'metrics.log_freq': 'log_interval',
    'metrics.enable_wandb': 'wandb_log', 'compile.enable': 'compile', 'validation.freq': 'eval_interval',
    'validation.steps': 'eval_iters',
}
TITAN_UNUSED = {
    'job.description': 'a label', 'job.print_args': 'the run prints its config', 'job.use_for_integration_test': '',
    'model.tokenizer_path': "the tokenizer is the prepared dataset's, prepare.py --tokenizer",
    'model.hf_assets_path': "the tokenizer is the prepared dataset's, prepare.py --tokenizer",
    'lr_scheduler.decay_ratio': 'the decay runs from warmup_iters to lr_decay_iters',
    'checkpoint.enable_checkpoint': 'checkpoints are written at each eval and every save_storage_interval steps',
    'checkpoint.folder': "checkpoints are out_dir's own", 'checkpoint.async_mode': 'checkpoints are written in the '
    'background', 'checkpoint.model_weights_only': '', 'checkpoint.last_save_model_only': '',
    'checkpoint.export_dtype': '', 'metrics.enable_tensorboard': "every step is a row of out_dir's metrics.jsonl, "
    "which plot.py draws", 'metrics.save_tb_folder': '', 'metrics.enable_color_printing': '',
    'metrics.disable_color_printing': '', 'profiling.enable_profiling': 'no profiler traces here',
    'profiling.save_traces_folder': '', 'profiling.profile_freq': '', 'profiling.enable_memory_snapshot': '',
    'profiling.save_memory_snapshot_folder': '', 'parallelism.fsdp_reshard_after_forward': '',
    'parallelism.enable_async_tensor_parallel': '', 'activation_checkpoint.selective_ac_option': '',
    'compile.components': '', 'validation.enabled': 'evals run every eval_interval steps',
    'validation.dataset': "the eval reads the dataset's val.bin", 'training.gc_freq': '',
}
TITAN_TABLES = ('job', 'model', 'training', 'lr_scheduler', 'checkpoint', 'metrics', 'profiling', 'parallelism',
                'activation_checkpoint', 'float8', 'compile', 'validation', 'comm', 'debug')  # answered in _titan
# its Llama 3 flavors' depth, heads and width (torchtitan/models/llama3's), for the GPT-2 shape its line names
LLAMA3 = {'debugmodel': (6, 16, 256), '8B': (32, 32, 4096), '70B': (80, 64, 8192), '405B': (126, 128, 16384)}
MEGATRON = {k for k, (whose, _) in RENAMES.items() if whose == "Megatron-LM's"}
MEGATRON_VIRTUAL = [k for k in MEGATRON if RENAMES[k][1] == 'stages_per_rank']
# torchtitan's and Megatron-LM's uneven cuts of a pipeline into stages (by layers, by modules, lighter end stages):
# pp_train.py shares the blocks out evenly (pipeline.stage_blocks), so only their even settings (0, false) mean ours
STAGE_SPLITS = {
    'pipeline_parallel_layers_per_stage': "torchtitan's", 'pipeline_parallel_first_stage_less_layers': "torchtitan's",
    'pipeline_parallel_last_stage_less_layers': "torchtitan's", 'module_fqns_per_model_part': "torchtitan's",
    'pipeline_parallel_module_fqns_per_model_part': "torchtitan's", 'pipeline_parallel_split_points': "torchtitan's",
    'decoder_first_pipeline_num_layers': "Megatron-LM's", 'decoder_last_pipeline_num_layers': "Megatron-LM's",
    'account_for_embedding_in_pipeline_split': "Megatron-LM's", 'account_for_loss_in_pipeline_split': "Megatron-LM's",
    'pipeline_model_parallel_layout': "Megatron-LM's",
}
# the default of a seed's flag, whose type says how `--key VALUE` and a bare `--key` read
FLAG_DEFAULTS = {'data_dir': '', 'log_dir': '', 'epochs': 0, 'use_nnscaler': False, 'plan_ngpus': 0,
                 'runtime_ngpus': 0, 'in_memory': False, 'amp': False, 'save_dir': '', 'use_fsdp': False,
                 'use_native_ckpt': False, 'nesterov': True, 'should_quantize': False}

# DLRover's nanoGPT example's defaults where they differ from ours (add_train_args in its train_utils.py, which its
# train.py, fsdp_train.py and ds_train.py share), for the keys its command line leaves out. Not its epochs=1: its
# epoch starts a sequence at every offset, block_size times ours, so its max_iters ends such a run first
DLROVER_SCRIPTS = ('train.py', 'fsdp_train.py', 'ds_train.py', 'model_size.py')  # its three, and our sizer of them
DLROVER_DEFAULTS = {'n_layer': 6, 'n_head': 6, 'n_embd': 384, 'block_size': 128, 'batch_size': 32, 'max_iters': 2000,
                    'decay_lr': False, 'warmup_iters': 0, 'lr_decay_iters': 10, 'compile': False,
                    'save_memory_interval': 20, 'save_storage_interval': 200}

# the rest of its example's flags (add_train_args; its fsdp_train.py's cpu_offload, ds_train.py's ds_config, its
# README's use_fsdp), which set how it trains and saves, not the shape a rank holds: model_size.py, given its whole
# command, leaves them out
DLROVER_RUN_FLAGS = ('out_dir', 'eval_interval', 'log_interval', 'eval_iters', 'eval_only', 'epochs', 'learning_rate',
                     'max_iters', 'weight_decay', 'beta1', 'beta2', 'grad_clip', 'gradient_accumulation_steps',
                     'decay_lr', 'warmup_iters', 'lr_decay_iters', 'min_lr', 'compile', 'save_memory_interval',
                     'save_storage_interval', 'dropout', 'save_dir', 'use_native_ckpt', 'ds_config', 'use_fsdp',
                     'cpu_offload')

# minGPT-DDP's Hydra overrides (key=value, no dashes) and ours
HYDRA = {
    'trainer_config.batch_size': '--batch_size={}', 'trainer_config.max_epochs': '--epochs={}',
    'trainer_config.grad_norm_clip': '--grad_clip={}', 'trainer_config.snapshot_path': '--out_dir=FOLDER',
    'trainer_config.save_every': '--save_storage_interval=STEPS (steps here, not epochs)',
    'trainer_config.use_amp': '--dtype=auto (bfloat16 on GPUs) or --dtype=float32',
    'trainer_config.data_loader_workers': 'nothing: each batch is read straight from train.bin, no workers',
    'trainer_config.distributed_method': 'train.py (ddp) or fsdp_train.py (fsdp) as the script torchrun runs',
    'trainer_config.cpu_offload': 'fsdp_train.py --cpu_offload={}',
    'gpt_config.n_layer': '--n_layer={}', 'gpt_config.n_head': '--n_head={}', 'gpt_config.n_embd': '--n_embd={}',
    'gpt_config.block_size': '--block_size={}', 'data_config.block_size': '--block_size={}',
    'gpt_config.embd_pdrop': '--dropout={}', 'gpt_config.resid_pdrop': '--dropout={}',
    'gpt_config.attn_pdrop': '--dropout={}', 'optimizer_config.learning_rate': '--learning_rate={}',
    'optimizer_config.weight_decay': '--weight_decay={}',
    'data_config.path': 'python prepare.py text --input={} --tokenizer=char (then --dataset=<its name>)',
    'data_config.train_split': 'python prepare.py text --input=FILE --tokenizer=char --val_fraction={} (the share '
                               'of the text for val.bin)',
    'data_config.truncate': 'nothing to set: prepare the part of the text to train on (head -c BYTES FILE > part.txt, '
                            'then python prepare.py text --input=part.txt --tokenizer=char)',
    'hydra.run.dir': '--out_dir={} (the folder of the run\'s files)',
}

HYDRA_OVERRIDE = re.compile(r'\+{0,2}([A-Za-z_]\w*(?:\.\w+)+)=(.*)')  # section.key=value, Hydra's +key and ++key too
HYDRA_SECTIONS = {key.split('.')[0] for key in HYDRA}  # trainer_config, gpt_config, ...: its --section.key flags

# the launchers' options (torchrun's, dlrover-run's, deepspeed's), which go before the script, not after it
LAUNCHER_OPTIONS = ('nproc_per_node', 'nnodes', 'standalone', 'max_restarts', 'rdzv_backend', 'rdzv_endpoint',
                    'rdzv_id', 'node_rank', 'master_addr', 'master_port', 'network_check', 'num_gpus', 'num_nodes')


# DLRover's --epochs as finish() read it, for start_tokens: (the epochs, train.bin's tokens, the max_iters that may
# end the run first); None where no --epochs bounds the run
_epochs = None


def flag_default(key):
    return FLAG_DEFAULTS.get(key)


def names(keys):
    """The seeds' flag names that a script of these keys takes, for a typo's 'did you mean' (--epoch, --data-dir)."""
    renamed = [k for k, (_, ours) in RENAMES.items() if ours in keys]
    translated = [k for k in FLAG_DEFAULTS if k not in RENAMES] + ['global_batch_size', 'n_steps', 'betas']
    return renamed + translated if 'max_iters' in keys else renamed


def config_file_flag(arguments):
    """configure()'s arguments with torchtitan's `--job.config_file FILE` as FILE alone, the way a config file is
    given here, and the lines that say so."""
    ours = [(text, None, None) if key == 'job.config_file' and text else (arg, key, text)
            for arg, key, text in arguments]
    return ours, [(None, f"{arg} is torchtitan's flag: here the file's path alone, `{text}`")
                  for arg, key, text in arguments if key == 'job.config_file' and text]


def launcher_option(key, where, script):
    """A one-line error where a launcher's option (DLRover's `--nproc_per_node=2`) follows the script."""
    if key.replace('-', '_') == 'local_rank' and script in TRAINERS:  # left by a launcher only where LOCAL_RANK agrees
        sys.exit(f"error: {where}: the rank that torch.distributed.launch and the deepspeed launcher add, with "
                 f"LOCAL_RANK set alike; given by hand, it sets nothing: leave it out, and launch with `torchrun "
                 f"--nproc_per_node=N {script} ...`")
    if key.replace('-', '_') in LAUNCHER_OPTIONS and script in TRAINERS:
        sys.exit(f"error: {where}: a launcher's option (torchrun's, dlrover-run's, deepspeed's), not {script}'s: give "
                 f"it before the script, as in `torchrun --{key}{'' if key == 'standalone' else '=N'} {script} ...`")


def needs_value(arg):
    sys.exit(f"error: flag '{arg}' needs a value: write it as {arg}=VALUE or {arg} VALUE")


def context(script, keys, flags, files):
    """What translate() sees: the entrypoint's file name, its keys (the live dict the configurator fills), every
    flag of the command line (nnScaler's come in pairs) and its config files (.py, .toml)."""
    global _epochs
    _epochs = None  # a configure() before this one (a test's, in the same process) set no --epochs of this run
    return dict(script=script, keys=keys, flags=flags, files=files, toml={}, notes=[], epochs=None,
                virtual=None, global_batch=None, local_batch=None, semi_sync=None, flagged={}, said={}, replaced={})


def _torchft(key, value, where, source, shown, ctx):
    """translate()'s answer to torchtitan's --fault_tolerance.KEY (torchft's): process_group is our backend;
    semi_sync_method 'diloco' is decent_train.py's DiLoCo, 'local_sgd' its outer step of plain averaging (at the
    window of sync_steps, 5 there where none is given: finish()); the rest have no counterpart (TORCHFT)."""
    if key == 'process_group' and value in ('gloo', 'nccl'):
        _note(ctx, where, source, shown, f"--backend={value}", "torchtitan's")
        return [('backend', value)]
    if key == 'process_group':
        sys.exit(f"error: {where}: torchft's process group {value!r} has no counterpart: use --backend=nccl or gloo")
    if key == 'semi_sync_method' and str(value).lower() in ('diloco', 'local_sgd'):
        local = str(value).lower() == 'local_sgd'  # torchft's LocalSGD: the replicas averaged every sync_every steps
        outer = [('outer_optimizer', 'sgd'), ('outer_learning_rate', 1.0), ('outer_momentum', 0.0)] if local else []
        if ctx['script'] != 'decent_train.py':  # the configurator names decent_train.py
            return outer or [('diloco_steps', 5)]
        ctx['semi_sync'] = where
        _note(ctx, where, source, shown, "--diloco_steps=H (its sync_steps)" +
              " --outer_optimizer=sgd --outer_learning_rate=1 --outer_momentum=0" * local, "torchtitan's")
        return outer
    if key == 'semi_sync_method':
        sys.exit(f"error: {where}: semi_sync_method={value!r}: torchtitan's are diloco and local_sgd "
                 f"(decent_train.py --diloco_steps=H); its synchronous training is train.py's or fsdp_train.py's")
    if key == 'enable' and value is False:
        _note(ctx, where, source, shown, "nothing to set (no torchft here)", "torchtitan's")
        return []
    sys.exit(f"error: {where}: {TORCHFT[key]}")


def _file_of(where):
    """The config file's path in a file's `where`: `path:line`, or the path alone."""
    path, _, line = where.rpartition(':')
    return path if path and line.isdigit() else where


def _safe(name):
    """An id from the environment as one folder's name: no `/` or `..` in it can point elsewhere."""
    return re.sub(r'[^\w-]', '_', name)


def _note(ctx, where, source, seed, ours, whose):
    if source == 'flag':
        ctx['notes'].append((None, f"{where} is {whose} name: here {ours}"))
    else:  # one line for a whole file, a project's names at a time (DLRover has no files: data_dir is Decent-DP's)
        text = f"{seed} is {ours}" if ours.startswith('--') else f"{seed}: {ours}"
        whose = "torchtitan's" if ctx.get('titan') == _file_of(where) else whose
        ctx['notes'].append(((_file_of(where), "Decent-DP's" if "Decent-DP's" in whose else whose), text))


UNUSED = ': unused here'  # a file's key that sets nothing here and needs no word of why


def print_notes(ctx):
    """Once per run (rank 0): a line per seed's flag, a line per config file written in a seed's names."""
    if os.environ.get('RANK', '0') != '0':
        return
    files = {}
    for i, (path, text) in enumerate(ctx['notes']):
        keys, later = ctx['replaced'].get(i, ((), {}))
        if path is None:
            print(text, flush=True)
        elif not keys or len(later) < len(keys):  # left out where the run has none of its values
            files.setdefault(path, []).append(text + ''.join(f", its {k} replaced by {w} after it"
                                                             for k, w in later.items()))
    for (path, whose), texts in files.items():
        unused = [t.removesuffix(UNUSED) for t in texts if t.endswith(UNUSED)]  # named together, at the end
        texts = [t for t in texts if not t.endswith(UNUSED)] + [f"unused here: {', '.join(unused)}"] * bool(unused)
        print(f"{path} is in {whose} names; here: {'; '.join(texts)}", flush=True)
    ctx['notes'].clear()


def _decent_command(script, where, source):
    config = f" {_file_of(where)}" if source != 'flag' else ''
    return f"`torchrun --nproc_per_node=N decent_train.py{config} ...`"


def _config_folder(config):
    """The config file's path less its extension, from the working folder where it lies in it (config/gpt2-small),
    else from the root (tmp/sweep/gpt2-small): two files of one name in two folders (a sweep's) get two folders."""
    path = os.path.relpath(os.path.abspath(config))
    if path.startswith(os.pardir + os.sep):
        path = os.path.abspath(config).lstrip(os.sep)
    return os.path.splitext(path)[0]


def _job_folder(log_dir, where, source, files):
    """(folder, why) for Decent-DP's log_dir, which there holds a folder per SLURM job, each started afresh. Ours
    resume what out_dir holds, so each job and config file gets its own, log_dir/<job>/<config's path>: two configs
    run in one job or allocation (AllReduce, then decentralized) must not continue each other's model. The job is
    named by what every rank of it sees alike and a restart keeps (its SLURM job id, or torchrun's run id), never by
    a clock, which differs between ranks and restarts. A --log_dir flag takes the command line's (last) config file."""
    config = _file_of(where) if source != 'flag' else (files[-1] if files else '')
    name = [_config_folder(config)] if config else []
    this, other = (' for this config file', 'job or config') if config else ('', 'job')
    job, run_id = os.environ.get('SLURM_JOB_ID', ''), os.environ.get('TORCHELASTIC_RUN_ID', 'none')
    if job:
        return os.path.join(log_dir, _safe(job), *name), \
            f"SLURM job {job}'s folder{this}: a requeued job resumes in it, another {other} starts afresh"
    # torchrun draws a new id each launch with --standalone or no rendezvous flags; its id is `none` with
    # --master_port, or with --rdzv-backend=c10d and no --rdzv-id
    if run_id not in ('', 'none'):
        folder = os.path.join(log_dir, _safe(run_id), *name)
        return folder, f"torchrun's run id's folder{this}: its restarts resume in it, a launch under another id " \
                       f"starts afresh in another (--out_dir={shlex.quote(folder)} continues this one)"
    if config:
        return os.path.join(log_dir, *name), \
            "this config file's folder, with no SLURM job or torchrun run id to name a job's: a rerun resumes in it"
    return log_dir, "no SLURM job or torchrun run id to name a job's folder: a rerun resumes in it"


def translate(key, value, where, source, ctx):
    """[(our key, value)] for a key a flag ('flag'), .py ('file') or TOML file ('toml') sets: ours as they are, a
    seed's name translated (saying so once), or a one-line error. A key this entrypoint lacks and no seed names comes
    back unchanged, for the configurator's unknown-key error. A flag (or a file) after a config file that sets a key
    of the file's line otherwise is noted, so that the line does not name a value the run no longer has
    (print_notes)."""
    n = len(ctx['notes'])
    pairs = _translate(key, value, where, source, ctx)
    for k, v in pairs:
        line = ctx['said'].pop(k, None)  # (the note, its keys, its value) of the file's line that set k last
        if line and v != line[2]:
            ctx['replaced'].setdefault(line[0], (line[1], {}))[1][k] = where
        elif line:
            ctx['said'][k] = line  # the file's own value again: its line holds
    if source != 'flag' and len(ctx['notes']) > n and ctx['notes'][n][0] is not None:  # the file's line said them
        ctx['said'].update({k: (n, [k for k, _ in pairs], v) for k, v in pairs})
    return pairs


def _translate(key, value, where, source, ctx):
    keys, script = ctx['keys'], ctx['script']
    toml = ctx['toml'] if source == 'toml' else {}
    if key.startswith('titan:'):  # a torchtitan file's key, with its table (read_toml)
        key = key.removeprefix('titan:')
        taken = _titan(key, value, where, source, ctx)
        if taken is not None:
            return taken
        key = key.rpartition('.')[2]  # a key of ours in its tables, or a name of its [parallelism]'s
    shown = key  # in a file's one line; a flag's line shows the flag as written
    section, _, name = key.rpartition('.')
    if name.replace('-', '_') in SECTIONS.get(section, ()):
        key = name.replace('-', '_')  # the name alone: --diloco.inner_steps 50 is inner_steps, as its TOML's [diloco]
    elif section == 'hv' and script in TRAINERS:
        sys.exit(f"error: {where}: OpenDiLoCo's hivemind setting has no counterpart: decent_train.py --diloco_steps=H "
                 f"runs its workers as torchrun's ranks, which meet at its --rdzv-endpoint; leave it out")
    if section == 'fault_tolerance' and key in (*TORCHFT, 'process_group', 'semi_sync_method') and script in TRAINERS:
        return _torchft(key, value, where, source, shown, ctx)
    if name.replace('-', '_') in STAGE_SPLITS and section in ('', 'parallelism') and \
            (script in TRAINERS or script == 'model_size.py'):
        whose = STAGE_SPLITS[name.replace('-', '_')]
        if value in (0, False) and ('less_layers' in name or name.startswith('account')):  # their even split
            _note(ctx, where, source, shown, "nothing to set (the blocks are shared out evenly over the stages)", whose)
            return []
        sys.exit(f"error: {where}: {whose} {name} sets the layers of each stage; here the blocks are shared out "
                 f"evenly over the pp_size x stages_per_rank stages (the embeddings and the head not counted as "
                 f"layers): leave it out, and give pp_train.py --stages_per_rank=S for S stages a rank")
    if name == 'pipeline_parallel_schedule_csv' and section in ('', 'parallelism') and script in TRAINERS:
        sys.exit(f"error: {where}: torchtitan's {name} reads a schedule's actions from a file, which is not built "
                 f"here: leave it out, and give --pp_schedule=NAME (gpipe, 1f1b, interleaved-1f1b, interleaved-zb, zbv "
                 f"or dualpipev)")
    if key.replace('-', '_') in MEGATRON:
        key = key.replace('-', '_')  # Megatron-LM's dashes
    if key in TITAN_KEYS and 'pp_schedule' in keys:  # the schedule, by torchtitan's name or ours
        name = re.sub(r'[-_]', '', str(value).lower()).removeprefix('schedule')
        if name == 'loopedbfs':
            sys.exit(f"error: {where}: torchtitan's LoopedBFS has no counterpart here: its looped placement runs "
                     f"--pp_schedule=interleaved-1f1b (or interleaved-zb), depth first")
        ours = TITAN_SCHEDULES.get(name, value)
        if ours != value or key != 'pp_schedule':
            _note(ctx, where, source, shown, f"--pp_schedule={ours}", "torchtitan's")
        return [('pp_schedule', ours)]
    if key == 'global-batch-size' and script == 'model_size.py':  # a rank's memory holds a micro-batch, not a step's
        if type(value) is not int or value < 1:
            sys.exit(f"error: {where}: {key} must be a whole number of sequences, 1 or more, got {value!r}")
        _note(ctx, where, source, shown, "not a size, left out (a rank's activations are a micro-batch's: "
                                         "--batch_size, its --micro-batch-size)", "Megatron-LM's")
        return []
    if key == 'global-batch-size' and 'gradient_accumulation_steps' in keys:  # Megatron-LM's, not Decent-DP's
        if type(value) is not int or value < 1:
            sys.exit(f"error: {where}: {key} must be a whole number of sequences, 1 or more, got {value!r}")
        ctx['global_batch'] = (value, where, "Megatron-LM's", source, shown)  # split once the flags are in: finish()
        return []
    if key in MEGATRON_VIRTUAL and 'stages_per_rank' in keys:
        if type(value) is not int or value < 1:
            sys.exit(f"error: {where}: {key} must be a whole number, 1 or more, got {value!r}")
        if key == 'num_layers_per_virtual_pipeline_stage':  # the stages a rank, once n_layer and pp_size are known
            ctx['virtual'] = (value, where)
            return []
        # the interleaved schedule, which Megatron-LM runs on these stages, unless the command names one (another
        # one is pp_train.py's error, stages_refused, not overruled here)
        schedule = [] if _schedule_named(ctx) else [('pp_schedule', 'interleaved-1f1b')]
        _note(ctx, where, source, shown, f"--stages_per_rank={value}" + " --pp_schedule=interleaved-1f1b" * bool(
            schedule), "Megatron-LM's")
        return [*schedule, ('stages_per_rank', value)]
    if key in ('plan_ngpus', 'runtime_ngpus') and ctx['flags'].get('use_nnscaler', True) in (False, 0):
        # its script reads them only for nnScaler: without it, Lightning's DDP runs on every rank, as here
        _note(ctx, where, source, shown, "unused with --use_nnscaler=False, as there", "nnScaler's")
        return []
    if key in ('plan_ngpus', 'runtime_ngpus'):
        pair = {**ctx['flags'], key: value}  # the other one from the flags, where one is in a config file
        plan, runtime = pair.get('plan_ngpus', 1), pair.get('runtime_ngpus')  # its plan_ngpus is 1 by default
        # nnScaler's runtime_ngpus=-1 (its default) means all of torchrun's WORLD_SIZE, whatever it is
        runtime = runtime if runtime is not None and runtime != -1 else 'N'
        if type(plan) is int and plan < 1:
            sys.exit(f"error: {where}: nnScaler's --plan_ngpus={plan}: a model is split over 1 GPU or more")
        world = int(os.environ.get('WORLD_SIZE', '1'))
        if plan == 1 and script == 'train.py' and runtime in ('N', world):  # what train.py on these ranks does
            if key == 'plan_ngpus' or 'plan_ngpus' not in ctx['flags']:  # one line for the pair
                given = pair.get('runtime_ngpus', -1)
                ctx['notes'].append((None, f"nnScaler's --plan_ngpus=1 --runtime_ngpus={given}: nothing to set here: "
                                           f"data parallel, a whole model on each of the {world} ranks, is train.py"))
            return []
        given_tp = ctx['flags'].get('tp_size', plan)
        if script == 'fsdp_train.py' and type(plan) is int and plan > 1 and given_tp != plan:
            # either one alone says the split; both, and the run would split otherwise than the line below says
            sys.exit(f"error: {where}: nnScaler's --plan_ngpus={plan} is --tp_size={plan} here, and --tp_size="
                     f"{given_tp} beside it says another split: give one of them")
        if script == 'fsdp_train.py' and type(plan) is int and plan > 1 and runtime in ('N', world) and \
                world % plan == 0:  # what fsdp_train.py --tp_size=plan does on these ranks
            if key == 'plan_ngpus' or 'plan_ngpus' not in ctx['flags']:  # one line for the pair
                dp = f"the {world // plan} groups data parallel with FSDP" if world > plan else "no data parallel"
                ctx['notes'].append((None, f"nnScaler's --plan_ngpus={plan} --runtime_ngpus="
                                           f"{pair.get('runtime_ngpus', -1)} is --tp_size={plan} here: each model "
                                           f"split over {plan} of the {world} ranks by tensor parallelism, {dp}"))
                return [('tp_size', plan)]
            return []
        if plan == 1:
            ours = f"torchrun --nproc_per_node={runtime} train.py ... (data parallel, a whole model on each GPU)"
        elif plan == runtime:
            ours = (f"torchrun --nproc_per_node={runtime} fsdp_train.py --tp_size={plan} ... (one model split over "
                    f"{plan} GPUs by tensor parallelism, no data parallel)")
        else:
            whole = type(plan) is type(runtime) is int and runtime % plan == 0
            if type(plan) is type(runtime) is int and not whole:
                sys.exit(f"error: {where}: nnScaler's --plan_ngpus={plan} --runtime_ngpus={runtime} splits no GPUs "
                         f"into whole groups: runtime_ngpus must be a multiple of plan_ngpus, there as here")
            groups = f"the {runtime // plan} groups" if whole else "the groups"
            ours = (f"torchrun --nproc_per_node={runtime} fsdp_train.py --tp_size={plan} ... (each model split over "
                    f"{plan} GPUs by tensor parallelism, {groups} data parallel with FSDP)")
        sys.exit(f"error: {where}: nnScaler's --plan_ngpus={plan} --runtime_ngpus={runtime} is `{ours}` here")
    if key == 'use_nnscaler' and value in (False, 0) and type(value) in (bool, int):  # what every entrypoint is
        _note(ctx, where, source, shown, "what every entrypoint is: plain PyTorch, nothing to set", "nnScaler's")
        return []
    if key == 'use_nnscaler':
        sys.exit(f"error: {where}: nnScaler's switch has no counterpart: every entrypoint here is plain PyTorch "
                 f"(train.py is its use_nnscaler=False, fsdp_train.py --tp_size=N its plan_ngpus=N); leave it out")
    if key == 'use_fsdp' and script in TRAINERS and type(value) is bool:  # DLRover's README: train.py --use_fsdp
        if value and script != 'fsdp_train.py':
            sys.exit(f"error: {where}: DLRover's --use_fsdp is fsdp_train.py here: run it in place of {script}, "
                     f"with the same flags and launcher (`dlrover-run ... fsdp_train.py ...`)")
        _note(ctx, where, source, shown, f"nothing to set ({script})", "DLRover's")
        return []
    if key == 'use_native_ckpt' and 'save_storage_interval' in keys and type(value) is bool:
        # its torch.save'd checkpoints rather than flash ones: ckpt.pt here is one, and snapshots in memory only add.
        # Its fsdp_train.py saves shards whatever the flag, as fsdp_train.py does here unless told to gather a ckpt.pt
        if ctx['flags'].get('save_consolidated', keys.get('save_consolidated')) is False:
            ours = "nothing to set (checkpoints are sharded, in out_dir/dcp/step-N, as its fsdp_train.py's are; " \
                "--save_consolidated=True adds a ckpt.pt written with torch.save)"
        else:
            ours = "nothing to set (out_dir's ckpt.pt is written with torch.save)"
        _note(ctx, where, source, shown, ours, "DLRover's")
        return []
    if script == 'model_size.py' and key in DLROVER_RUN_FLAGS and key not in keys and 'data_dir' in ctx['flags']:
        _note(ctx, where, source, shown, "not a size, left out", "DLRover's")
        return []
    if key == 'out_dir' and source == 'flag' and isinstance(ctx['flags'].get('save_dir'), str) and \
            ctx['flags']['save_dir'] and 'out_dir' in keys:
        # DLRover saves into --save_dir and reads no --out_dir; in the order given, an --out_dir after it would send
        # the checkpoints elsewhere (a pod's own disk, lost with the pod) while the line above says --save_dir's
        ctx['notes'].append((None, f"{where} is unused beside --save_dir, DLRover's checkpoint folder (as there)"))
        return []
    if key == 'gradient_accumulation_steps' and value == 0 and type(value) is int and _dlrover_command(ctx):
        # its own default: one micro-step a rank (total // ranks there), which dlrover_defaults counts in ranks here
        ctx['notes'].append((None, f"{where} is DLRover's default, one micro-step a rank: here that many in total "
                                   f"(in the line of its defaults below)"))
        return []
    if key.startswith('lora_'):
        sys.exit(f"error: {where}: DLRover's LoRA has no counterpart here: finetune the whole model "
                 f"(--init_from=gpt2 or a checkpoint, as config/finetune_shakespeare.py does); leave it out")
    if key == 'epochs' and 'max_iters' in keys:
        if type(value) not in (int, float) or not value > 0:
            sys.exit(f"error: {where}: epochs must be a number above 0 (epochs over train.bin's sequences), "
                     f"got {value!r}")
        ctx['epochs'] = (value, where)
        return []  # its max_iters needs the data and the batch, which later keys may still change: see finish()
    in_file = {k.rsplit('.', 1)[-1] for k in toml}  # the keys of this TOML file, which have no order there
    if key == 'log_dir' and 'out_dir' in keys and 'out_dir' in in_file:
        _note(ctx, where, source, shown, "unused (the file's out_dir is the folder)", "Decent-DP's")
        return []
    if key == 'log_dir' and 'out_dir' in keys and isinstance(value, str) and value:
        folder, why = _job_folder(value, where, source, ctx['files'])
        _note(ctx, where, source, shown, f"--out_dir={shlex.quote(folder)} ({why})", "Decent-DP's")
        return [('out_dir', folder)]
    if key == 'data_dir' and isinstance(value, str) and value and not is_path(value):
        value = os.path.join('.', value)  # a path there, always: mydata is ./mydata, not data/mydata
    if key == 'dataset' and 'data_dir' in in_file:  # Decent-DP's label beside its data_dir, which names the folder
        _note(ctx, where, source, f"dataset={value!r}", "a label there, unused (data_dir is the folder)", "Decent-DP's")
        return []
    if key in ('nesterov', 'should_quantize', 'compression') and script in TRAINERS:
        if key == 'nesterov' and type(value) is not bool:
            sys.exit(f"error: {where}: nesterov must be True or False, got {value!r}")
        if key == 'nesterov':  # the outer SGD's (DiLoCo's outer optimizer is SGD with Nesterov momentum)
            key, value = 'outer_optimizer', 'nesterov' if value else 'sgd'
            if key in keys:
                _note(ctx, where, source, shown, f"--outer_optimizer={value}", "DiLoCo's")
        elif value is False or str(value).lower() in ('no', 'none'):  # Prime's compression = "no": its default
            _note(ctx, where, source, shown, "nothing to set (pseudo-gradients travel in float32 by default)",
                  "torchft's" if key == 'should_quantize' else "Prime's")
            return []
        else:
            sys.exit(f"error: {where}: {'torchft' if key == 'should_quantize' else 'Prime'}'s 8-bit pseudo-gradients "
                     f"are not built here: decent_train.py --diloco_dtype=bfloat16 sends them in half float32's bytes")
    if key in RENAMES:
        whose, ours = RENAMES[key]
        if ours in keys:
            _note(ctx, where, source, shown, f"--{ours}={value}", whose)
            key = ours
        elif ours in DECENT_ONLY or script in TRAINERS:
            key = ours  # another entrypoint's key (pp_size), which this one lacks: said below, or by the configurator
    if key == 'n_steps' and 'max_iters' in keys:
        _note(ctx, where, source, shown, f"--max_iters={value} --lr_decay_iters={value}", "Decent-DP's")
        return [('max_iters', value), ('lr_decay_iters', value)]
    if key == 'global_batch_size' and 'batch_size' in keys:  # model_size.py has no gradient_accumulation_steps
        if value is True and source == 'flag':  # --global_batch_size alone
            needs_value(where)
        if type(value) is not int or value < 1:
            sys.exit(f"error: {where}: global_batch_size must be a whole number of sequences, 1 or more, "
                     f"got {value!r}")
        ctx['global_batch'] = (value, where, "Decent-DP's", source, shown)  # split once the flags are known (finish())
        return []
    if key == 'betas' and 'beta1' in keys:
        if value is True and source == 'flag':  # --betas alone
            needs_value(where)
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            sys.exit(f"error: {where}: betas must be a list of two numbers such as [0.9, 0.95], got {value!r}")
        _note(ctx, where, source, shown, f"--beta1={value[0]} --beta2={value[1]}", "Decent-DP's")
        return [('beta1', value[0]), ('beta2', value[1])]
    if key == 'eps' and 'learning_rate' in keys:
        if value != 1e-8:
            sys.exit(f"error: {where}: eps={value!r}: Adam's eps is its default 1e-8 here, set by no key; leave it out")
        _note(ctx, where, source, shown, "nothing to set (Adam's default)", "Decent-DP's")
        return []
    if key == 'in_memory' and 'dataset' in keys:
        _note(ctx, where, source, shown, "nothing to set (train.bin is read a batch at a time)", "Decent-DP's")
        return []
    if key == 'vocab_size' and key not in keys and 'n_layer' in keys:
        if value != 50304:
            sys.exit(f"error: {where}: vocab_size={value!r}: the vocabulary here is the dataset's meta.pkl, or GPT-2's "
                     f"50304 without one; prepare the data with the tokenizer you want and leave it out")
        _note(ctx, where, source, shown, "nothing to set (GPT-2's, where the data has no meta.pkl)", "Decent-DP's")
        return []
    if key == 'amp' and 'dtype' in keys:
        if type(value) is not bool:
            sys.exit(f"error: {where}: amp must be true or false, got {value!r}")
        dtype = 'auto' if value else 'float32'
        _note(ctx, where, source, shown, f"--dtype={dtype}", "Decent-DP's")
        return [('dtype', dtype)]
    if key in ('optim.name', 'optimizer.name') and 'learning_rate' in keys:
        name = str(value).lower()
        if 'replica_optimizer' in keys:
            _note(ctx, where, source, shown, f"--replica_optimizer={name}", "Decent-DP's")
            return [('replica_optimizer', name)]
        if name == 'adamw':
            _note(ctx, where, source, shown, f"nothing to set (AdamW is {script}'s)", "Decent-DP's")
            return []
        sys.exit(f"error: {where}: optimizer {value!r} is decent_train.py's --replica_optimizer={name}: run "
                 f"{_decent_command(script, where, source)}; {script} trains with AdamW")
    if key == 'lr_schedule.name' and 'decay_lr' in keys:
        if str(value).lower() != 'cosine':
            sys.exit(f"error: {where}: lr_schedule {value!r}: the schedule here is warmup then cosine "
                     f"(decay_lr=True, name = 'cosine') or a constant learning_rate (--decay_lr=False)")
        _note(ctx, where, source, shown, "--decay_lr=True", "Decent-DP's")
        return [('decay_lr', True)]
    if key == 'backend' and value in ('decentdp', 'pytorchddp') and script in TRAINERS:
        if (value == 'decentdp') == (script == 'decent_train.py'):
            _note(ctx, where, source, f"backend={value!r}", f"nothing to set ({script})", "Decent-DP's")
            return []
        if value == 'decentdp':
            sys.exit(f"error: {where}: backend='decentdp' is Decent-DP's decentralized training: run "
                     f"{_decent_command(script, where, source)}, not {script}")
        config = f" {_file_of(where)}" if source != 'flag' else ''
        sys.exit(f"error: {where}: backend='pytorchddp' is Decent-DP's all-reduce training: run "
                 f"`torchrun --nproc_per_node=N train.py{config} ...`, not decent_train.py")
    if key in DECENT_ONLY and key not in keys and script in TRAINERS:
        unused = (key == 'topology' and toml.get('train.backend') == 'pytorchddp') or \
            (key == 'moment_accum_steps' and str(toml.get('train.optim.name', '')).lower() == 'adamw')
        if unused:  # as in Decent-DP, which reads them only for its decentralized backend and AccumAdamW
            _note(ctx, where, source, shown, f"unused by {'pytorchddp' if key == 'topology' else 'AdamW'}, as there",
                  "Decent-DP's")
            return []
        sys.exit(f"error: {where}: {key} is decent_train.py's: run {_decent_command(script, where, source)}, or "
                 f"leave it out for {script}")
    # minGPT-DDP's key as a flag without its section (--max_epochs, --cpu_offload on train.py), where ours differs
    hydra = [k for k in HYDRA if k.endswith(f'.{key}') and not HYDRA[k].startswith(f'--{key}=')]
    if hydra and key not in keys and script in TRAINERS:
        if key == 'distributed_method' and {'ddp': 'train.py', 'fsdp': 'fsdp_train.py'}.get(str(value)) == script:
            _note(ctx, where, source, shown, f"nothing to set ({script})", "minGPT-DDP's")
            return []
        sys.exit(f"error: {where}: {key} is minGPT-DDP's {hydra[0]}: here {_hydra_ours(hydra[0], value)}")
    if key == 'topology' and value == 'exp' and key in keys:
        _note(ctx, where, source, f"topology={value!r}", "--topology=one-peer-exp", "Decent-DP's")
        return [(key, 'one-peer-exp')]
    if key == 'replica_optimizer' and isinstance(value, str) and value != value.lower() and key in keys:
        _note(ctx, where, source, f"{key}={value!r}", f"--{key}={value.lower()}", "Decent-DP's")
        return [(key, value.lower())]
    return [(key, value)]


def _titan(key, value, where, source, ctx):
    """[(our key, value)] for a key of torchtitan's TOML file (table.name), said in its one line, or a one-line error;
    None where its name alone says it (a key of ours, its [parallelism]'s names)."""
    keys, flags, toml, script = ctx['keys'], ctx['flags'], ctx['toml'], ctx['script']
    table, name = key.split('.', 1)

    def note(ours):
        _note(ctx, where, source, key, ours, "torchtitan's")
    if key == 'checkpoint.keep_latest_k' and value == 0 and 'keep_checkpoints' in keys and \
            'keep_checkpoints' not in flags:  # its "keep every checkpoint"
        sys.exit(f"error: {where}: torchtitan's keep_latest_k = 0 keeps every checkpoint; here the newest "
                 f"keep_checkpoints states and the best are kept: give keep_latest_k = N (N states), 1 or more")
    if key in ('training.local_batch_size', 'training.batch_size') and type(value) is int and value >= 1:
        ctx['local_batch'] = (value, where)  # a pipeline's step, where it has micro-batches (_global_batch)
    if key in TITAN_TOML and (TITAN_TOML[key] in keys or value in (False, 0)):
        ours = TITAN_TOML[key]
        note(f"--{ours}={value}" if ours in keys else f"nothing to set ({script} has no {ours})")
        return [(ours, value)] if ours in keys else []
    if key in TITAN_TOML:
        return [(TITAN_TOML[key], value)]  # another entrypoint's key (cpu_offload): the configurator names it
    float8 = table == 'float8' and (not value or not name.startswith(('enable', 'precompute')))  # none turned on
    if key in TITAN_UNUSED or table in ('comm', 'profiling') or float8 or key == 'model.converters' and not value:
        note(f"nothing to set ({TITAN_UNUSED[key]})" if TITAN_UNUSED.get(key) else UNUSED[2:])
        return []
    if table == 'model' and name in ('name', 'flavor'):
        if name == 'name' and 'model.flavor' in toml:
            return []  # one line for the pair, the flavor's
        shape = [f"--{k}" for k in ('n_layer', 'n_head', 'n_embd', 'init_from') if k in flags]
        if shape:
            note(f"unused: the model is a GPT-2 of {' '.join(shape)}")
            return []
        model, flavor = toml.get('model.name', ''), toml.get('model.flavor', '')
        layers, heads, width = LLAMA3.get(str(flavor), (12, 12, 768))
        named = f"{model} {flavor!r}" if flavor != '' else model or 'model'
        sys.exit(f"error: {where}: torchtitan's {named} is not built here (the model is GPT-2's): give a "
                 f"shape after the file, --n_layer={layers} --n_head={heads} --n_embd={width}"
                 + (" (that flavor's depth, heads and width)" if str(flavor) in LLAMA3 else " (GPT-2 small's)"))
    if key == 'training.steps':
        note(f"--max_iters={value} --lr_decay_iters={value}")
        return [('max_iters', value), ('lr_decay_iters', value)]
    if key == 'training.global_batch_size' and 'gradient_accumulation_steps' in keys:
        if type(value) is not int or not (value >= 1 or value == -1):
            sys.exit(f"error: {where}: global_batch_size must be a whole number of sequences, or -1, got {value!r}")
        ctx['global_batch'] = (value, where, "torchtitan's", source, key)  # split once the flags are known (finish())
        return []
    if key == 'training.dataset':
        if any(k in flags for k in ('dataset', 'data_dir')) or 'training.dataset_path' in toml:
            note("unused (the dataset is the command's)")
            return []
        if not os.path.isdir(data_dir(str(value))) and script != 'model_size.py':  # which needs only its meta.pkl
            sys.exit(f"error: {where}: torchtitan's dataset {value!r} is not prepared here: prepare one (python "
                     f"prepare.py openwebtext) and give --dataset=NAME after the file")
        return [('dataset', value)]
    if key == 'training.mixed_precision_param' and value in ('bfloat16', 'float32') and 'dtype' in keys:
        dtype = 'auto' if value == 'bfloat16' else 'float32'
        note(f"--dtype={dtype}" + " (bfloat16 on GPUs)" * (dtype == 'auto'))
        return [('dtype', dtype)]
    if key == 'training.dtype' and value == 'float32' or key == 'training.mixed_precision_reduce':
        note("nothing to set (float32 weights and gradients)")
        return []
    if key == 'lr_scheduler.decay_type' and 'decay_lr' in keys:
        note("--decay_lr=True" + (f" (a cosine decay: {value} is not built here)" if value != 'cosine' else ''))
        return [('decay_lr', True)]
    if key == 'lr_scheduler.min_lr_factor' and 'min_lr' in keys and type(value) in (int, float):
        lr = toml.get('optimizer.lr', keys['learning_rate'])
        note(f"--min_lr={value * lr:g} (min_lr_factor x lr)")
        return [('min_lr', value * lr)]
    if key == 'activation_checkpoint.mode' and value in ('none', 'selective', 'full'):
        if 'activation_checkpointing' not in keys:
            note(f"nothing to set ({script} stores the activations; fsdp_train.py --activation_checkpointing=True "
                 f"recomputes them)" if value != 'none' else "nothing to set")
            return []
        note(f"--activation_checkpointing={value != 'none'}" + " (whole blocks)" * (value == 'selective'))
        return [('activation_checkpointing', value != 'none')]
    if table == 'parallelism' and name.startswith('data_parallel_'):
        note("nothing to set (data parallel over the ranks that tp_size and pp_size leave)")
        return []
    if table == 'parallelism' and name.endswith('_degree') and value == 1:  # none: every script's default
        note("nothing to set (1)")
        return []
    if table == 'parallelism' and name.endswith('_degree') and name not in RENAMES or table == 'float8' or \
            key == 'model.converters':
        sys.exit(f"error: {where}: torchtitan's {key} = {value!r} has no counterpart here (no context or expert "
                 f"parallelism, no float8): leave it out, or at 1 or false")
    return None


def _dlrover_command(ctx):
    """Whether the command line is DLRover's example's: one of its scripts, its --data_dir flag, no config file."""
    return ctx['script'] in DLROVER_SCRIPTS and 'data_dir' in ctx['flags'] and not ctx['files']


def dlrover_defaults(ctx, given):
    """[(key, value)]: DLRover's defaults for the keys that its command line does not give, said in one line; none
    for any other command line. Its command line has its required --data_dir flag and no config file: our .py files
    never came from DLRover, and Decent-DP's TOML files name data_dir themselves; --epochs alone is minGPT-DDP's
    max_epochs too (seeds.HYDRA), and our --dataset is ours, so both keep our defaults. model_size.py takes them to
    size the command as train.py runs it (a key that a script lacks is skipped)."""
    keys = ctx['keys']
    if not _dlrover_command(ctx):
        return []
    # its gradient_accumulation_steps=0 is one micro-step a rank; ours counts them over all the data-parallel ranks
    ranks = max(1, int(os.environ.get('WORLD_SIZE', '1')) // max(1, keys.get('tp_size', 1)))
    # a GPT-2's shape (model_size.py's --model, an init_from of OpenAI's weights) is not the command's to leave out
    gpt2 = 'model' in given or str(keys.get('init_from', '')).startswith('gpt2')
    # a global batch beside it (Megatron-LM's, Decent-DP's) sets the micro-steps, and Decent-DP's the batch_size too
    whose = ctx['global_batch'][2] if ctx['global_batch'] else ''
    split = {"Megatron-LM's": ('gradient_accumulation_steps',),
             "Decent-DP's": ('gradient_accumulation_steps', 'batch_size')}.get(whose, ())
    taken = [(k, v) for k, v in {**DLROVER_DEFAULTS, 'gradient_accumulation_steps': ranks}.items()
             if k in keys and k not in given and k not in split and not (gpt2 and k in ('n_layer', 'n_head', 'n_embd'))]
    if taken:
        again = '' if ctx['script'] == 'model_size.py' else ', so resume it with the same command'
        flags = ' '.join(f"--{k}={v}" + (' (a micro-step a rank)' if k == 'gradient_accumulation_steps' else '')
                         for k, v in taken)
        ctx['notes'].append((None, f"DLRover's command line (--data_dir, no config file): its nanoGPT example's "
                                   f"defaults where it gives none{again}: {flags}"))
    return taken


def finish(ctx):
    """[(key, value, where)] that need the final config: Megatron-LM's layers a virtual stage, DLRover's
    --epochs (its loader's, over train.bin), which bounds max_iters (the smaller of the two ends the run, as there), and
    torchtitan's DiLoCo window where its semi_sync_method came without one."""
    return _global_batch(ctx) + _virtual_stages(ctx) + _epochs_iters(ctx) + _semi_sync(ctx)


def _semi_sync(ctx):
    """torchtitan's --fault_tolerance.semi_sync_method without a window (its sync_steps, our diloco_steps): its
    default, 5 steps."""
    if ctx['semi_sync'] is None or ctx['keys']['diloco_steps']:
        return []
    ctx['notes'].append((None, f"{ctx['semi_sync']}: torchtitan's sync_steps is 5 where none is given: here "
                               f"--diloco_steps=5"))
    return [('diloco_steps', 5, ctx['semi_sync'])]


def _global_batch(ctx):
    """The sequences of a step over all ranks (Megatron-LM's --global-batch-size, Decent-DP's and torchtitan's
    global_batch_size) as our gradient_accumulation_steps (micro-steps over all ranks) x batch_size: the global batch
    stays what it says whatever splits it. A --batch_size (or a seed's name for it) or --gradient_accumulation_steps
    that a flag gives splits it, in any order; else Megatron-LM's and torchtitan's count micro-batches of the final
    batch_size (their --micro-batch-size, local_batch_size) and Decent-DP's, which has no micro-batch, takes 16
    micro-steps (below)."""
    keys, flagged = ctx['keys'], ctx['flagged']
    # torchtitan cuts a pipeline's local_batch_size into micro-batches of pipeline_parallel_microbatch_size (our
    # batch_size, which both set): the micro-batches of its step follow, at its global batch's default of -1 too
    micro = any(k.rpartition('.')[2] == 'pipeline_parallel_microbatch_size' for k in [*ctx['flags'], *ctx['toml']])
    local = ctx['local_batch'] if micro and 'microbatch' in flagged.get('batch_size', 'microbatch') else None
    if ctx['global_batch'] is None and local and 'gradient_accumulation_steps' in keys.keys() - flagged.keys():
        ctx['global_batch'] = (-1, local[1], "torchtitan's", 'toml', 'training.local_batch_size')
    if ctx['global_batch'] is None:
        return []
    sequences, where, whose, source, shown = ctx['global_batch']
    batch, accum = keys['batch_size'], keys.get('gradient_accumulation_steps')  # model_size.py has no accum
    if sequences == -1:  # torchtitan's default: a local batch on each data-parallel rank
        sequences = (local[0] if local else batch) * max(1, int(os.environ.get('WORLD_SIZE', '1')) //
                                                         keys.get('tp_size', 1) // keys.get('pp_size', 1))
    by_batch, by_accum = 'batch_size' in flagged, accum is not None and 'gradient_accumulation_steps' in flagged
    if by_batch and by_accum and batch * accum != sequences and source != 'flag':  # the flags win over a file
        _note(ctx, where, source, shown, f"unused: --batch_size={batch} x --gradient_accumulation_steps={accum} on "
                                         f"the command line make the step's {batch * accum} sequences", whose)
        return []
    if by_batch and by_accum and batch * accum != sequences:
        sys.exit(f"error: {where}: {whose} {shown}={sequences} (sequences a step) is not --batch_size={batch} x "
                 f"--gradient_accumulation_steps={accum} = {batch * accum}: drop one of the two, and the other "
                 f"splits the {sequences}")
    if by_accum and not by_batch:
        if sequences % accum:
            sys.exit(f"error: {where}: {sequences} sequences do not split into gradient_accumulation_steps={accum} "
                     f"micro-batches: give a divisor of {sequences}")
        batch = sequences // accum
    elif by_batch or whose != "Decent-DP's":
        if sequences % batch:
            named = {"torchtitan's": ' (torchtitan\'s local_batch_size)', "Megatron-LM's": " (Megatron-LM's "
                     "--micro-batch-size)"}.get(whose, '')
            sys.exit(f"error: {where}: {sequences} sequences are no whole number of micro-batches of batch_size="
                     f"{batch}{named}: give a multiple of it")
        accum = sequences // batch
    else:
        # Decent-DP's is split over its workers (480 = 16 GPUs x 30); ours counts micro-steps over all ranks, so 16 of
        # them run on 16, 8, 4, 2 or 1 ranks alike; on more ranks, or a count that does not divide 16, a multiple of
        # the ranks (480 on 32: 32 x 15), as its workers split it there. Where none splits it, the run's own check
        # of the data-parallel ranks (fewer than these with tp_size or pp_size) says so
        accum, world = math.gcd(sequences, 16), int(os.environ.get('WORLD_SIZE', '1'))
        if accum % world and sequences % math.lcm(accum, world) == 0:
            accum = math.lcm(accum, world)
        batch = sequences // accum
    if whose == "Decent-DP's":
        pairs = [('gradient_accumulation_steps', accum)] * ('gradient_accumulation_steps' in keys) + \
            [('batch_size', batch)]
        _note(ctx, where, source, shown, ' '.join(f"--{k}={v}" for k, v in pairs), whose)
        return [(k, v, where) for k, v in pairs]
    ours = f"--gradient_accumulation_steps={accum} (micro-batches of --batch_size={batch}, over all ranks)"
    if "torchtitan" in whose:  # a key of its TOML file, said in the file's line
        _note(ctx, where, 'toml', shown, ours, whose)
    else:
        ctx['notes'].append((None, f"{where} is {whose} name: here {ours}"))
    return [('gradient_accumulation_steps', accum, where), ('batch_size', batch, where)]


def _virtual_stages(ctx):
    """Megatron-LM's --num-layers-per-virtual-pipeline-stage N: stages_per_rank = n_layer / (pp_size x N), in the
    interleaved schedule that it runs them with, unless the command names one."""
    if ctx['virtual'] is None:
        return []
    per_stage, where = ctx['virtual']
    layers, pp, schedule = ctx['keys']['n_layer'], ctx['keys']['pp_size'], ctx['keys']['pp_schedule']
    if pp < 1:  # model_size.py's 0: no pipeline
        sys.exit(f"error: {where}: the layers of a pipeline's stages need its ranks: give --pp_size too")
    if layers % (pp * per_stage):
        sys.exit(f"error: {where}: n_layer={layers} is no whole number of stages of {per_stage} layers on each of "
                 f"pp_size={pp} ranks: give --stages_per_rank=S (S stages a rank, which need not hold equal layers)")
    looped = [] if schedule.startswith('interleaved') or _schedule_named(ctx) else \
        [('pp_schedule', 'interleaved-1f1b', where)]
    ctx['notes'].append((None, f"{where} is Megatron-LM's name: here --stages_per_rank={layers // (pp * per_stage)}"
                               + " --pp_schedule=interleaved-1f1b" * bool(looped)
                               + f" ({layers} layers in {pp} x {layers // (pp * per_stage)} stages of {per_stage})"))
    return [*looped, ('stages_per_rank', layers // (pp * per_stage), where)]


def _schedule_named(ctx):
    """Whether the command line names a pipeline schedule, by our name or torchtitan's."""
    return any(k.rpartition('.')[2] in TITAN_KEYS for k in [*ctx['flags'], *ctx['toml']])


def _epochs_iters(ctx):
    if ctx['epochs'] is None:
        return []
    epochs, where = ctx['epochs']
    keys = ctx['keys']
    if keys.get('random_data'):
        sys.exit(f"error: {where}: epochs counts epochs over train.bin's sequences, and random_data=True reads none: "
                 f"give --max_iters instead")
    per_iter = keys['gradient_accumulation_steps'] * keys['batch_size']  # sequences an iteration, over all ranks
    if per_iter < 1 or keys['block_size'] < 1:
        return []  # check_config names the key that is out of range
    _, n_tokens = find_bins(keys['dataset'], keys['block_size'])
    # an epoch of DLRover's (and minGPT-DDP's) loader is a sequence starting at every offset of train.bin, not a pass
    # over its tokens: --epochs 1, its default, given, must not end a run that its max_iters ends there
    iters = math.ceil(epochs * (n_tokens['train'] - keys['block_size']) / per_iter)
    global _epochs
    # (epochs, the flag, train.bin's tokens, max_iters), for start_tokens, which says the run's max_iters in a line
    # once the model's block_size (a checkpoint's, not this config's) that an epoch is counted at is known
    _epochs = (epochs, where, n_tokens['train'], keys['max_iters'])
    return [('max_iters', iters, where)] if iters < keys['max_iters'] else []


def start_tokens(checkpoint, iter_num, tokens_per_iter, config, print0):
    """(max_iters, tokens, lr_batch) of a run at its start: the tokens trained before iter_num, as the resumed
    checkpoint saved them (0 for a new run; one older than that key: its iterations at its config's global batch, said
    in a line), and the tokens an iteration of the LR schedule stands for, or None where it counts iterations. Where
    --epochs ends the run (finish), the global batch may change at a relaunch (DLRover's default of a micro-step a
    rank, at another world size): max_iters (and config's) is then the iterations done and those the tokens left take
    at this batch, and the schedule goes by the tokens trained, in iterations of the run's first batch, so that
    warmup never restarts and the decay ends where the epochs do, as in a run at one batch."""
    tokens, lr_batch, batch = 0, None, tokens_per_iter
    if checkpoint is not None:
        saved = checkpoint.get('config') or {}
        batch = math.prod(saved.get(k, config[k]) for k in ('gradient_accumulation_steps', 'batch_size', 'block_size'))
        tokens, lr_batch = checkpoint.get('tokens_trained', iter_num * batch), checkpoint.get('lr_batch')
        if 'tokens_trained' not in checkpoint and _epochs is not None:
            print0(f"note: the checkpoint has no count of the tokens trained (saved before it had one): --epochs takes "
                   f"its {iter_num} iterations at its global batch of {batch:,} tokens")
    if _epochs is None:
        return config['max_iters'], tokens, None
    epochs, where, n_train, cap = _epochs
    block = config['block_size']  # the model's: create_model set it from a checkpoint or a Hugging Face folder
    target = epochs * (n_train - block) * block  # an epoch's tokens: a sequence at every offset
    whole, iters = math.ceil(target / tokens_per_iter), iter_num + math.ceil(max(0, target - tokens) / tokens_per_iter)
    print0(f"{where} is DLRover's name: here --max_iters={whole} ({epochs} epoch{'s' * (epochs != 1)} of train.bin's "
           f"{n_train - block:,} sequences of {block} tokens, one at each offset as DLRover's loader takes them, at "
           f"{tokens_per_iter // block:,} sequences an iteration)" + (f"; max_iters={cap} ends the run first"
                                                                       if whole >= cap else ''))
    if min(cap, iters) != min(cap, whole):  # a resume at another global batch than the run's so far
        print0(f"--epochs: {tokens:,} of their {target:,.0f} tokens trained by iter {iter_num}: here --max_iters="
               f"{iters} at {tokens_per_iter:,} tokens an iteration" + (f"; max_iters={cap} ends the run first"
                                                                        if cap < iters else ''))
    max_iters = config['max_iters'] = min(cap, iters)
    return max_iters, tokens, lr_batch or batch


def prepare_args(args):
    """DLRover's `prepare.py --src_data_path FILE [--output_dir DIR]` (a char-level prep written beside FILE, or into
    DIR) as our arguments, said in one line; None for any other command line."""
    flags, rest, i = {}, [], 0
    while i < len(args):
        key, eq, value = args[i].partition('=')
        if key in ('--src_data_path', '--output_dir'):
            if not eq and (i + 1 == len(args) or args[i + 1].startswith('--')):
                needs_value(key)  # as its argparse says; not an --input= or an out_dir left empty
            if not eq:
                value, i = args[i + 1], i + 1
            flags[key[2:]] = value
        else:
            rest.append(args[i])
        i += 1
    if 'src_data_path' not in flags:
        return None
    src = flags['src_data_path']
    ours = ['text', f'--input={src}', '--tokenizer=char',
            f"--out_dir={flags.get('output_dir') or os.path.dirname(src) or '.'}", *rest]
    shown = [f"{key}={shlex.quote(value)}" if eq else shlex.quote(arg) for arg in ours
             for key, eq, value in [arg.partition('=')]]  # a command to copy: its folders quoted as a shell wants
    print(f"DLRover's --src_data_path: here that is `python prepare.py {' '.join(shown)}`")
    return ours


def _hydra_ours(key, value, script=None):
    """Our command for minGPT-DDP's Hydra key (section.key) set to value, given to script."""
    if key == 'trainer_config.distributed_method':
        ours = {'ddp': 'train.py', 'fsdp': 'fsdp_train.py'}.get(str(value).lower())
        if ours and ours == script:  # it named the script that runs: not another one to run
            return f"nothing to set, {script} is what it names: drop it"
        return (ours or HYDRA[key].removesuffix(' as the script torchrun runs')) + \
            ' as the script torchrun runs (`torchrun --nproc_per_node=N SCRIPT ...`)'
    if key == 'data_config.train_split':  # its share for training, ours for val.bin
        try:
            value = round(1 - float(value), 6)
        except ValueError:
            value = '1-SPLIT'
    ours = HYDRA[key].format(value)
    return ours[len(f'{script} '):] if script and ours.startswith(f'{script} ') else ours  # the flag of this script


def check_positional(arg, script=None):
    """A one-line error for minGPT-DDP's Hydra overrides (section.key=value) given to script, naming ours."""
    if arg.endswith(('.yaml', '.yml')) and '=' not in arg:  # its gpt2_train_cfg.yaml itself, given as a config
        sys.exit(f"error: {arg} is a YAML config (minGPT-DDP's Hydra file), which is not read here: give its keys as "
                 f"our flags (trainer_config.batch_size: 64 is --batch_size=64; any section.key=value on the command "
                 f"line names its flag), or put them in a *.py or *.toml config file")
    m = HYDRA_OVERRIDE.fullmatch(arg)
    if not m:
        return
    key, value = m.groups()
    if key in HYDRA:
        sys.exit(f"error: {arg} is a Hydra override (minGPT-DDP's): here {_hydra_ours(key, value, script)}")
    close = difflib.get_close_matches(key, HYDRA, n=1, cutoff=0.8)  # a typo of its key, which Hydra refuses too
    if close:
        sys.exit(f"error: {arg} is a Hydra override (minGPT-DDP's) of no key in its file: did you mean {close[0]}? "
                 f"here that is {_hydra_ours(close[0], value, script)}")
    sys.exit(f"error: {arg} is a Hydra override (minGPT-DDP's): here keys are flags, --key=value, and config "
             f"files (docs/coming-from.md)")


def hydra_command(args):
    """The one line that answers minGPT-DDP's `python main.py` (or `python launch.py`, a process per GPU) with its Hydra
    overrides (args): our command for them, the script its distributed_method names with the flags of the others,
    and where a key is no flag of it (its data, its epochs of saves), what that is here. Its default data is a
    character-level text, tiny Shakespeare: ours is config/train_shakespeare_char.py."""
    script, flags, besides = 'train.py', [], []
    # its FSDP fork's README writes them as flags, --trainer_config.batch_size=128 (or the value after a space)
    overrides, i = [], 0
    while i < len(args):
        arg, i = args[i], i + 1
        if arg.startswith('--') and '.' in arg.split('=')[0]:
            arg = arg[2:]
            if '=' not in arg and i < len(args) and not args[i].startswith('--'):
                arg, i = f"{arg}={args[i]}", i + 1
        overrides.append(arg)
    for arg in overrides:
        m = HYDRA_OVERRIDE.fullmatch(arg)
        if not m or m[1] not in HYDRA:
            check_positional(arg)  # a YAML file, a key of no section, a typo of one: its one line
            return f"error: {arg} is not a Hydra override of minGPT-DDP's gpt2_train_cfg.yaml (section.key=value)"
        key, value = m.groups()
        if key == 'trainer_config.distributed_method' and value.lower() in ('ddp', 'fsdp'):
            script = 'train.py' if value.lower() == 'ddp' else 'fsdp_train.py'
            continue
        ours = _hydra_ours(key, value)
        if re.fullmatch(r'(fsdp_train\.py )?--\w+=\S+', ours):
            script = 'fsdp_train.py' if ours.startswith('fsdp_train.py') else script
            flags += [ours.split()[-1]] * (ours.split()[-1] not in flags)
        else:
            besides.append(f"{arg}: {ours}")
    command = shlex.join([script, 'config/train_shakespeare_char.py', *flags])
    name = os.path.basename(sys.argv[0])
    return (f"error: {name} is minGPT-DDP's {'launcher' if name == 'launch.py' else 'entrypoint'}; here "
            f"`torchrun --standalone --nproc_per_node=auto {command}` (a process per GPU, or `python {command}` for "
            f"one)" + "".join(f"; {b}" for b in besides) + " (docs/coming-from.md)")


def config_here(path):
    """Where a seed's path to one of nanoGPT's config files is not here (nnScaler's
    nanoGPT/config/train_shakespeare_char.py), the text naming ours of that name (config/ in this repo), or ''."""
    ours = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'config', os.path.basename(path))
    if not os.path.isfile(ours) or os.path.exists(path):
        return ''
    return f": here {ours if os.path.relpath(ours).startswith('..') else os.path.relpath(ours)}"


def _toml_lines(text):
    """{dotted key: line} of a TOML file's keys, for errors that name the line (tomllib does not keep them)."""
    lines, table = {}, ''
    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if s.startswith('[['):
            table = None  # arrays of tables are refused below
        elif s.startswith('['):
            table = '.'.join(p.strip().strip('"\'') for p in s[1:s.find(']')].split('.'))
        elif table is not None and (m := re.match(r'([\w."\' -]+?)\s*=', s)):
            key = '.'.join(p.strip().strip('"\'') for p in m.group(1).split('.'))
            lines.setdefault(f"{table}.{key}" if table else key, n)
    return lines


def read_toml(path, text, ctx):
    """[(key, value, where)] of a TOML config file's text. Tables only group keys: [model] n_layer = 12 sets n_layer,
    whatever the table; a key named `name` keeps its table's name (optim.name, lr_schedule.name), and so do torchft's
    in torchtitan's [fault_tolerance] (fault_tolerance.enable)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        m = re.search(r'\(at line (\d+), column \d+\)', str(e))
        where = f"{path}:{m.group(1)}" if m else path
        sys.exit(f"error: {where}: TOML: {str(e)[:m.start()].strip() if m else str(e)}")
    lines = _toml_lines(text)
    flat = {}

    def walk(table, prefix):
        for key, value in table.items():
            dotted = f"{prefix}{key}"
            if isinstance(value, dict):
                walk(value, dotted + '.')
            elif isinstance(value, list) and any(isinstance(v, dict) for v in value):
                sys.exit(f"error: {path}:{lines.get(dotted, '?')}: [[{dotted}]] is an array of tables, which sets "
                         f"no key here: write [{dotted}] once")
            else:
                flat[dotted] = value
    walk(doc, '')
    ctx['toml'] = flat
    if 'job' in doc or 'model.flavor' in flat or 'training.seq_len' in flat:  # torchtitan's: its tables name them
        ctx['titan'] = path
    settings = []
    for dotted, value in flat.items():
        parts = dotted.split('.')
        # torchft's names, too generic (enable, group_size) to mean one thing out of torchtitan's [fault_tolerance]
        torchft = parts[-2:-1] == ['fault_tolerance'] and parts[-1] in (*TORCHFT, 'process_group', 'semi_sync_method')
        key = '.'.join(parts[-2:]) if parts[-1] == 'name' or torchft else parts[-1]
        if ctx.get('titan') == path and (dotted in TITAN_TOML or dotted in TITAN_UNUSED or parts[0] in TITAN_TABLES):
            key = f'titan:{dotted}'  # translate(): its own meaning, which the key's last name alone may not say
        settings.append((key, value, f"{path}:{lines[dotted]}" if dotted in lines else path))
    return settings
