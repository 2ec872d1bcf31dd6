"""
nanoGPT's configuration convention, with the errors it left out.

An entrypoint's module-level globals of type int, float, bool or str are its config (ALL_CAPS names are
constants, not keys). Call

    config, given = configure(globals())

right after them: every `config/x.py` argument is run as Python, every `config/x.toml` read as TOML (tables group
keys), and every `--key=value` or `--key value` argument is parsed with ast.literal_eval (a bare word is a string;
a bool key alone, `--eval_only`, is True), in the order given (a file that overrides an earlier flag says so in a
line), each checked against the default's name and type.
A config file runs like a module: it may import (modules, functions and _names are not keys) and knows its own
path as __file__. The names other projects give our keys, and their config files, are translated by seeds.py.
`-h` or `--help` prints the script's docstring and its keys.
`config` is the final dict of every key; `given` the keys that a file or flag set. With skip_unknown_in_files,
a config file may set keys the script lacks (bench.py reads training configs), but a flag may not.
Bad input exits with a one-line error that names the fix. check_model_shape(config) and check_optimizer(config)
check the values of the model's and AdamW's keys, where a script has them.
"""

import ast
import difflib
import math
import os
import re
import select
import shlex
import sys
import tempfile
import types

import seeds

CONFIG_TYPES = (int, float, bool, str)

# Every rank of a job writes to the same stdout and stderr. Unbuffered (PYTHONUNBUFFERED=1, as many images set), a
# line is two writes, its text and then its newline (print, and Python's own exit message), so two ranks' one-line
# errors run together; a line at a time, each line is one write and stays whole
for _stream in (sys.stdout, sys.stderr):
    if getattr(_stream, 'write_through', False) and hasattr(_stream, 'reconfigure'):
        _stream.reconfigure(write_through=False, line_buffering=True)


def config_keys(namespace):
    # ALL_CAPS names are constants by Python's convention (an imported DEFAULT_PATH), not keys
    return {k: v for k, v in namespace.items() if not k.startswith('_') and not k.isupper() and type(v) in CONFIG_TYPES}


def _check(key, value, defaults, where, script=''):
    if key == 'config' and 'config' not in defaults and isinstance(value, str):  # --config FILE, -c FILE elsewhere
        fix = f"write {value} without --config" if value.endswith(('.py', '.toml')) else \
            "a *.py or *.toml one (a YAML file's keys are --key=value flags here)"
        sys.exit(f"error: {where}: a config file is given by its path alone, first: {fix}")
    if key not in defaults:
        owners = _owners(key, script)
        if owners:  # another entrypoint's key: the user meant that mode
            sys.exit(f"error: {where}: {key} is a key of {' and '.join(owners)}, not of {script}: run "
                     f"{owners[0]} in its place, with the same flags and launcher (`torchrun ... {owners[0]} ...`)")
        seeds.launcher_option(key, where, script)
        run_flag = TOOLS.get(script)
        if run_flag and not where.startswith('-') and key in _keys_of('train.py'):
            # nanoGPT's sample.py runs a training config and samples from its out_dir: here the tools take the run
            out = value if key == 'out_dir' else defaults.get('out_dir', 'OUT_DIR')  # the file's, where read yet
            sys.exit(f"error: {where}: {key} is a key of training configs (train.py's), not of {script}, which reads "
                     f"the run such a config trained: give {script} {run_flag}={shlex.quote(str(out))}, the config's "
                     f"out_dir, in place of the config")
        close = difflib.get_close_matches(key, [*defaults, *seeds.names(defaults)], n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}?" if close else f"valid keys: {', '.join(sorted(defaults))}"
        sys.exit(f"error: {where}: unknown config key '{key}'; {hint}")
    want = type(defaults[key])
    if want is float and type(value) is int:
        value = float(value)  # --learning_rate=1 means 1.0
    if type(value) is not want:
        sys.exit(f"error: {where}: {key} must be {want.__name__} like its default {defaults[key]!r}, "
                 f"got {type(value).__name__} {value!r}")
    if want is float and not math.isfinite(value):  # --learning_rate=1e999 reads as inf, a TOML's nan as nan
        sys.exit(f"error: {where}: {key}={value} is not a finite number: give one like its default {defaults[key]!r}")
    if want is str and '\0' in value:  # a config file's "\x00": no path can hold one (os raises ValueError)
        sys.exit(f"error: {where}: {key}={value!r} holds a NUL byte (\\x00), which no path or name can: remove it")
    if want is str and (value == '~' or value.startswith('~/')):
        value = os.path.expanduser(value)  # a shell leaves the ~ of --out_dir=~/x as it is: a folder named ~ here
    return value


ENTRYPOINTS = ('train.py', 'fsdp_train.py', 'ds_train.py', 'decent_train.py', 'pp_train.py')
TOOLS = {'sample.py': '--out_dir', 'export_hf.py': '--ckpt', 'eval_hellaswag.py': '--ckpt'}  # the flag of a run


def _keys_of(script):
    """The config keys of one of the entrypoints beside this file: the names assigned at its top before its
    configure() call, read as text, not run; none where it is not there (one script copied alone)."""
    try:
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), script), encoding='utf-8') as f:
            body = ast.parse(f.read()).body
    except (OSError, SyntaxError, ValueError):
        return set()
    keys = set()
    for node in body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                getattr(node.value.func, 'id', None) == 'configure':
            break
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, 'target', None)]
        keys.update(t.id for t in targets if isinstance(t, ast.Name))
    return {key for key in keys if not key.startswith('_') and not key.isupper()}


def _owners(key, script):
    """The other entrypoints that have key in their config, where script is one of them."""
    if script not in ENTRYPOINTS:
        return []
    return [other for other in ENTRYPOINTS if other != script and key in _keys_of(other)]


def _assigned_names(source):
    """{name: line} of the names a config file assigns at its top level, even to the default's own value."""
    names = {}
    for node in ast.parse(source).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, 'target', None)]
        names.update({t.id: node.lineno for t in targets if isinstance(t, ast.Name)})
    return names


def _default(key, defaults):
    """A key's default, or else a seed's flag's (seeds.py), whose type says how its value reads; None for neither."""
    return defaults.get(key, seeds.flag_default(key))


def _arguments(argv, defaults):
    """argv as [(path, None, None)] for a config file and [(arg, key, text)] for a flag, as people write them:
    --key=value, --key value, and a bool key alone (--eval_only) for True. text is None for a bool key alone."""
    out, i = [], 0
    while i < len(argv):
        arg, i = argv[i], i + 1
        if not arg.startswith('--'):
            out.append((arg, None, None))
        elif '=' in arg:
            key, text = arg[2:].split('=', 1)
            out.append((arg, key, text))
        else:
            key, after = arg[2:], argv[i] if i < len(argv) else None
            default = _default(key, defaults)
            missing = after is None or after.startswith('--')
            if type(default) is bool and after not in BOOLS and str(after).lower() in BOOL_WORDS:
                # argparse's str flags read any word (DLRover's --compile FALSE): here a bool's value is one of BOOLS
                sys.exit(f"error: {arg} {after}: {key} takes True or False (or true, false), or the flag alone for "
                         f"True")
            if type(default) is bool and after not in BOOLS or default is None and missing or key == 'help':
                # argparse's store_true, and --help, which takes no value (`--help config/x.py` asks for help);
                # or a name this script lacks (--eval_onyl), which configure() answers
                out.append((arg, key, None))
            elif missing:
                seeds.needs_value(arg)
            else:
                out.append((f'{arg} {after}', key, after))
                i += 1
    return out


BOOLS = {'True': True, 'False': False, 'true': True, 'false': False}  # Python's, and argparse users' lower case
BOOL_WORDS = ('true', 'false', '1', '0', 'yes', 'no', 'on', 'off')  # meant as a bool's value, in another spelling


def _parse(text, key, defaults):
    if text is None:
        return True  # a bool flag alone
    default = _default(key, defaults)
    if type(default) is bool and text in BOOLS:
        return BOOLS[text]
    if type(default) is int and re.fullmatch(r'0\d+', text):
        return int(text)  # a step copied from a folder's name (dcp/step-00000006), which Python's syntax refuses
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = text  # a bare word such as --device=cpu
    if type(default) is str and type(value) is not str:
        value = text  # a string key takes any text: --out_dir=2024 is a folder, not a number
    return value


def _read_text(path):
    """A config file's text (.py or .toml), or a one-line error naming the file, and the line of a bad byte."""
    try:
        with open(path, 'rb') as f:
            data = f.read()
    except OSError as e:
        sys.exit(f"error: cannot read config file {path}: {e.strerror}{seeds.config_here(path)}")
    try:
        return data.decode('utf-8-sig')  # as Python reads a source file; a BOM from an editor is fine
    except UnicodeDecodeError as e:
        line = data.count(b'\n', 0, e.start) + 1
        sys.exit(f"error: {path}:{line}: not UTF-8 (byte {data[e.start]:#x}): save the config file as UTF-8")


def _read_py(arg, defaults):
    """[(key, value, where)] of what the config file arg sets, run as Python."""
    source = _read_text(arg)
    scope = dict(defaults, __file__=arg)
    try:
        exec(compile(source, arg, 'exec'), scope)
    except (Exception, SystemExit) as e:  # SystemExit too: sys.exit(0) in a config must not end the run as done
        # name the config file's own line, not this module's
        line = e.lineno if isinstance(e, SyntaxError) else None
        tb = e.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == arg:
                line = tb.tb_lineno
            tb = tb.tb_next
        if isinstance(e, SystemExit):
            sys.exit(f"error: {arg}:{line}: the config file calls sys.exit({e.code!r}): "
                     f"a config file only sets keys; remove the exit")
        sys.exit(f"error: {arg}:{line}: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}")
    assigned = _assigned_names(source)
    settings = []
    for key, value in scope.items():
        if key.startswith('_') or isinstance(value, (types.ModuleType, types.FunctionType, type)):
            continue
        if key in defaults and value is defaults[key] and key not in assigned:
            continue  # left as it was
        settings.append((key, value, f"{arg}:{assigned[key]}" if key in assigned else arg))
    return settings


def configure(namespace, argv=None, skip_unknown_in_files=False, positional=None):
    """positional(arg): [(key, value)] for an argument that is no config file nor flag (model_size.py's checkpoint,
    whose shape it sets), or a one-line error."""
    argv = sys.argv[1:] if argv is None else argv
    # torch.distributed.launch and the deepspeed launcher add --local-rank=K (--local_rank=K), which says what
    # LOCAL_RANK in the environment says
    argv = [a for a in argv if a.partition('=')[::2] not in (('--local-rank', os.environ.get('LOCAL_RANK')),
                                                              ('--local_rank', os.environ.get('LOCAL_RANK')))]
    defaults = config_keys(namespace)
    given = set()
    arguments, said = seeds.config_file_flag(_arguments(argv, defaults))  # torchtitan's --job.config_file FILE
    if any(arg in ('-h', '--help') and text is None for arg, _, text in arguments):  # alone, not a flag's value
        print(f"{(namespace.get('__doc__') or '').strip()}\n\nits keys, with their defaults (set by config files, *.py "
              f"or *.toml, and --key=value or --key value, in order):\n" +
              '\n'.join(f"  --{k}={v!r}" for k, v in defaults.items()))
        sys.exit(0)
    # what the seed projects' names need to see: the entrypoint, and the other flags (nnScaler's come in pairs)
    script = os.path.basename(namespace.get('__file__') or sys.argv[0])
    context = seeds.context(script, defaults,
                            {key: _parse(text, key, defaults) for _, key, text in arguments if key},
                            [arg for arg, key, _ in arguments if key is None and arg.endswith(('.py', '.toml'))])
    context['notes'] += said
    flagged = context['flagged']  # the flag that set each key (a later file's value replaces it), for seeds.finish
    for arg, key, text in arguments:
        if key is None:
            if arg.endswith('.py'):
                settings, source = _read_py(arg, defaults), 'file'
            elif arg.endswith('.toml'):
                settings, source = seeds.read_toml(arg, _read_text(arg), context), 'toml'
            else:
                seeds.check_positional(arg, script)  # minGPT-DDP's Hydra overrides
                bare = arg.lstrip('-')  # Hydra's habit (key=value) or one dash (-key=value), with a key of ours
                if bare.split('=')[0] in defaults and '=' in bare:
                    sys.exit(f"error: argument '{arg}' is neither a config file (*.py, *.toml) nor --key=value: "
                             f"write it as --{bare}")
                if positional is None or arg.startswith('-'):
                    sys.exit(f"error: argument '{arg}' is neither a config file (*.py, *.toml) nor --key=value")
                settings, source = [(key, value, arg) for key, value in positional(arg)], 'file'
        else:
            if key.split('.')[0] in seeds.HYDRA_SECTIONS:  # a Hydra override with dashes: its line, not unknown key's
                seeds.check_positional(f"{key}={'True' if text is None else text}", script)
            settings, source = [(key, _parse(text, key, defaults), arg)], 'flag'
        # a name that neither this script nor a seed's flag knows, alone: its translation may need a value (--lr)
        alone = source == 'flag' and text is None and _default(key, defaults) is None
        for key, value, where in settings:
            for key, value in seeds.translate(key, value, where, source, context):
                if key not in defaults and skip_unknown_in_files and source != 'flag':
                    continue  # e.g. a training config read by bench.py for its model and batch
                if alone and type(defaults.get(key)) not in (bool, type(None)):
                    seeds.needs_value(arg)
                value = _check(key, value, defaults, where, script)
                if source == 'flag':
                    if key in flagged and flagged[key].split('=')[0] != arg.split('=')[0] and value != namespace[key]:
                        # two names of one key (a seed's and ours): the line of the first would name a value unused
                        context['notes'].append((None, f"note: {arg} sets {key}={value!r} over {flagged[key]} before "
                                                       f"it on the command line: the later one wins"))
                    flagged[key] = arg
                elif key in flagged and value != defaults[key]:
                    # nanoGPT's rule, kept; argparse's, Hydra's and TOML users expect the flag to win wherever it is.
                    # Every rank forgets the flag alike (finish() reads what is left); rank 0 says so
                    flag = flagged.pop(key)
                    if os.environ.get('RANK', '0') == '0':
                        print(f"note: {where} sets {key}={value!r} over {flag} before it on the command line: the "
                              f"later one wins (arguments apply in order); give the flag after the file to keep its "
                              f"value", flush=True)
                namespace[key] = defaults[key] = value
                given.add(key)
    for key, value in seeds.dlrover_defaults(context, given):  # defaults, not given: a checkpoint's shape still wins
        namespace[key] = defaults[key] = value
    for key, value, where in seeds.finish(context):  # --epochs, once the data and batch are known
        namespace[key] = defaults[key] = _check(key, value, defaults, where, script)
        given.add(key)
    seeds.print_notes(context)
    return config_keys(namespace), given


def check_model_shape(config):
    """Exits with a one-line error where the keys of config that shape a GPT (any of n_layer, n_head, n_embd,
    block_size, vocab_size, dropout; those missing are not checked) cannot make one."""
    for key in ('n_layer', 'n_head', 'n_embd', 'block_size', 'vocab_size'):
        if key in config and not config[key] >= 1:
            sys.exit(f"error: {key}={config[key]} must be 1 or more")
    if 'n_embd' in config and 'n_head' in config and config['n_embd'] % config['n_head']:
        n_embd, n_head = config['n_embd'], config['n_head']
        near = max(1, round(n_embd / n_head)) * n_head
        sys.exit(f"error: n_embd={n_embd} is not a multiple of n_head={n_head}: each head takes n_embd / n_head "
                 f"channels; use n_embd={near}, or an n_head that divides {n_embd}")
    if 'dropout' in config and not 0 <= config['dropout'] < 1:
        sys.exit(f"error: dropout={config['dropout']} must be at least 0 and below 1 "
                 f"(0.0 to pretrain, about 0.1 to finetune)")


def check_optimizer(config):
    """Exits with a one-line error where an AdamW key of config (any of learning_rate, weight_decay, beta1, beta2,
    grad_clip) is out of range: torch raises on some, and a negative weight_decay or grad_clip would run on silently."""
    for key in ('learning_rate', 'weight_decay', 'grad_clip'):
        if key in config and not config[key] >= 0:  # written so that NaN fails too
            hint = ' (0 turns clipping off)' if key == 'grad_clip' else ''
            sys.exit(f"error: {key}={config[key]} must be 0 or more{hint}")
    for key in ('beta1', 'beta2'):
        if key in config and not 0 <= config[key] < 1:
            sys.exit(f"error: {key}={config[key]} must be at least 0 and below 1 (usually beta1=0.9, beta2=0.95)")


# -----------------------------------------------------------------------------
# The one validation step of the training entrypoints, before anything is written (bench.py and model_size.py
# check the shape and optimizer keys they share): a value out of its range is a one-line error.

STEPS = {  # the counts of the loop and of its saves: key -> the least it may be
    'batch_size': 1, 'gradient_accumulation_steps': 1, 'eval_interval': 1, 'eval_iters': 1, 'log_interval': 1,
    'max_iters': 0, 'warmup_iters': 0, 'lr_decay_iters': 0, 'min_lr': 0, 'save_memory_interval': 0,
    'save_storage_interval': 0, 'max_nonfinite_steps': 1, 'keep_checkpoints': 1, 'stages_per_rank': 1,
    'blocks_per_unit': 1,
}


def check_config(config):
    """Exits with a one-line error naming the fix where a key is out of its range (the model's shape, the
    optimizer's, the loop's counts), init_from names nothing, or out_dir cannot be a folder to write in."""
    check_model_shape(config)
    check_optimizer(config)
    for key, least in STEPS.items():
        if key in config and not config[key] >= least:  # written so that NaN fails too
            sys.exit(f"error: {key}={config[key]} must be {least} or more")
    check_seed(config)
    check_schedule(config)
    if config.get('wandb_log'):
        import importlib.util
        if importlib.util.find_spec('wandb') is None:
            # set by a flag or by a config file (Decent-DP's publishes wandb_log = true): a flag turns either off
            sys.exit("error: wandb_log=True but wandb is not installed: pip install wandb, or add --wandb_log=False")
    if config.get('backend') in ('nccl', 'mpi') or config.get('device') == 'mps':
        import torch
        import torch.distributed as dist
        gpu = config.get('device', 'auto').startswith('cuda') or config.get('device') == 'auto' and \
            torch.cuda.is_available()
        if config['backend'] == 'nccl' and not gpu:
            sys.exit(f"error: backend=nccl needs CUDA GPUs, and device={config['device']} has none: use --backend=gloo "
                     f"(or auto)")
        if config['backend'] == 'mpi' and not dist.is_mpi_available():
            sys.exit("error: backend=mpi but this torch was built without MPI: use --backend=gloo (or auto)")
        if config.get('device') == 'mps' and not torch.backends.mps.is_available():
            sys.exit("error: device=mps but this machine has no Apple GPU torch can use: use --device=cpu (or auto)")
    from checkpoint import find_checkpoint  # here: the config convention itself needs no torch
    init_from = config.get('init_from', 'scratch')
    try:
        named = init_from in ('scratch', 'resume', 'gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl') or \
            os.path.exists(init_from) or os.path.exists(find_checkpoint(init_from))  # RUN/best
    except ValueError as e:  # a dcp/best that names no best-step folder
        sys.exit(f"error: init_from={init_from!r}: {e}: give a step folder or a ckpt.pt of that run")
    if not named and os.sep in init_from:  # a path, as the tools take one: their error, not an unknown name's
        sys.exit(f"error: no checkpoint at {init_from}: give a ckpt.pt, a sharded checkpoint or a run folder")
    if not named:
        sys.exit(f"error: unknown init_from={init_from!r}: use scratch, resume, gpt2, gpt2-medium, gpt2-large, gpt2-xl "
                 f"or the path of a checkpoint (a ckpt.pt, a sharded checkpoint folder, a run's out_dir, or "
                 f"out_dir/best for its best)")
    if 'out_dir' in config:
        check_out_dir(config['out_dir'], evaluates=config.get('eval_only') and init_from in ('scratch', 'resume'))
        if config.get('eval_only') and init_from == 'scratch' and config.get('auto_resume') is False and \
                os.path.isfile(os.path.join(config['out_dir'], 'run_id')):  # its row would go into the run's log
            sys.exit(f"error: eval_only with auto_resume=False evaluates a new, untrained model, not the run in "
                     f"{config['out_dir']}: drop --auto_resume=False to evaluate the run's newest state, or give "
                     f"another --out_dir")


def runs_own(path):
    """Where path lies in what a run removes: its checkpoint folders (RUN/dcp, RUN/decent/step-N: its saves prune
    the step folders, a new best replaces best-step-N) or its memory snapshots in RAM (its end removes them), as named
    or where a link leads (ln -s RUN/dcp/step-N mine): (the words that say so, RUN, the run id of the snapshots),
    else None. What a run or a tool writes there goes with them."""
    from runlock import FOLDERS, in_ram, snapshot_dir  # (no torch: the light tools check their outputs)
    for p in dict.fromkeys((os.path.abspath(path), os.path.realpath(path))):
        if in_ram(p) and snapshot_dir('').startswith('/dev/shm/'):
            run_id = p[len(snapshot_dir('')):].split(os.sep)[0]
            return (f"lies in {snapshot_dir('')}{run_id}, the memory snapshots of run {run_id}, which that run "
                    f"removes at its end"), None, run_id
        kind = p
        while kind != os.path.dirname(kind):
            run = os.path.dirname(kind)
            if os.path.basename(kind) in FOLDERS.values() and os.path.isfile(os.path.join(run, 'run_id')):
                return (f"{'is' if kind == p else 'lies in'} {kind}, where the run in {run} keeps (and prunes) its "
                        f"checkpoints"), run, None
            kind = run
    return None


def outside_runs_or_exit(path, flag):
    """A tool's output (flag=path) in what a run removes (runs_own) is a one-line error: it would go with them."""
    found = runs_own(path)
    if found:
        sys.exit(f"error: {flag}={path} {found[0]}, and what is written there goes with them: give {flag} a path "
                 f"outside it")


def check_out_dir(out_dir, evaluates=False):
    """out_dir must be a folder this process can write in, or one it can make; nothing is written to find out
    but a temporary file, removed at once, in the nearest folder that exists. evaluates: an eval_only run of the
    checkpoint in out_dir, which may be read-only."""
    if not out_dir:
        sys.exit("error: out_dir is empty: give --out_dir=FOLDER")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        sys.exit(f"error: out_dir={out_dir} is a file, not a folder: give another --out_dir")
    found = runs_own(out_dir)
    if found and found[2]:
        sys.exit(f"error: out_dir={out_dir} {found[0]}: give that run's own out_dir (whose run_id file holds "
                 f"{found[2]}) to resume it, or another --out_dir")
    if found:  # (it started afresh there, where its user meant to resume RUN, and was pruned with the step folder)
        sys.exit(f"error: out_dir={out_dir} {found[0]}: to continue that run give "
                 f"--out_dir={shlex.quote(found[1])}; for a new run from a checkpoint there, --init_from=FOLDER and an "
                 f"--out_dir of its own")
    # RUN/best is the name the tools read RUN's best by (meant here as a run from it): a folder there, they would
    # read its newest checkpoint in place of that best, without a word
    for p in dict.fromkeys((os.path.abspath(out_dir), os.path.realpath(out_dir))):
        best = p
        while best != os.path.dirname(best) and os.path.basename(best) != 'best':
            best = os.path.dirname(best)
        run = os.path.dirname(best)
        if os.path.basename(best) == 'best' and os.path.isfile(os.path.join(run, 'run_id')):
            sys.exit(f"error: out_dir={out_dir} {'is' if best == p else 'lies in'} {best}, which names the best "
                     f"checkpoint of the run in {run} (sample.py, export_hf.py and --init_from read it there): to "
                     f"train from it give --init_from={shlex.quote(best)} and an --out_dir of its own; to continue "
                     f"that run, --out_dir={shlex.quote(run)}")
    # a step folder kept out of its run (cp -r RUN/dcp/step-N kept): a run there would start afresh over it, its own
    # run_id in place of the one that the folder's files carry
    names = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []
    saved = [n for n in names if n in ('.metadata', 'extra.pt') or re.fullmatch(r'.*model_states\.pt|rank-\d+\.pt', n)]
    if saved:
        sys.exit(f"error: out_dir={out_dir} is a checkpoint's step folder ({saved[0]} in it), not a run's out_dir: "
                 f"to train from it give --init_from={shlex.quote(out_dir)} and an --out_dir of its own")
    parent = os.path.abspath(out_dir)
    while not os.path.exists(parent):
        if os.path.islink(parent):  # a link to a folder not there (scratch space purged, say): no folder can be made
            sys.exit(f"error: out_dir={out_dir}: {parent} is a symbolic link to {os.readlink(parent)}, which does "
                     f"not exist: make that folder, or give another --out_dir")
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        sys.exit(f"error: out_dir={out_dir} would lie below {parent}, which is a file: give another --out_dir")
    try:
        tempfile.TemporaryFile(dir=parent).close()
    except OSError as e:
        fix = f"to evaluate its checkpoint, give it as --init_from={shlex.quote(out_dir)}, and a folder you can " \
            "write to, for the log, as --out_dir" if evaluates else "give a folder you can write to with --out_dir"
        sys.exit(f"error: cannot write in {parent} for out_dir={out_dir} ({e.strerror}): {fix}")


def check_seed(config):
    """torch takes a seed in [0, 2**64); the loops add a few to it (evals, ranks), so it is kept below 2**63."""
    if 'seed' in config and not 0 <= config['seed'] < 2**63:
        sys.exit(f"error: seed={config['seed']} must be from 0 to {2**63 - 1}")


def check_schedule(config):
    """Warns where the learning-rate schedule is legal but not what anyone means: it rises, or never decays."""
    keys = ('warmup_iters', 'lr_decay_iters', 'learning_rate', 'min_lr')
    if not config.get('decay_lr', False) or os.environ.get('RANK', '0') != '0' or not all(k in config for k in keys):
        return
    warmup, decay, top, least = (config[k] for k in keys)
    if 'max_iters' in config and warmup > config['max_iters']:
        print(f"warning: warmup_iters={warmup} > max_iters={config['max_iters']}: the run ends still warming up; "
              f"set --warmup_iters below max_iters")
    if decay < warmup:
        print(f"warning: lr_decay_iters={decay} < warmup_iters={warmup}: the rate jumps from its peak to min_lr at "
              f"once; set --lr_decay_iters above warmup_iters (usually = max_iters)")
    if least > top:
        print(f"warning: min_lr={least} > learning_rate={top}: the schedule rises instead of decaying; set --min_lr "
              f"about learning_rate / 10")


def quiet_interrupt():
    """Ctrl-C in a tool ends it with one line and exit status 130, not a traceback (finally blocks still run and
    remove temporary files); so does a reader of its output that has left (`| head`), silently, with 141."""
    def hook(kind, value, tb, default=sys.excepthook):
        if issubclass(kind, BrokenPipeError) and reader_gone(sys.__stdout__):
            # the reader took what it wanted: as other Unix tools, no traceback and 128 + SIGPIPE (os._exit, since
            # the interpreter's flush of what is left would raise again)
            os._exit(141)
        if issubclass(kind, KeyboardInterrupt):
            # to the process's own stderr: torch's init_process_group wraps this hook in one that points sys.stderr
            # at a buffer while it runs (to prefix the rank), which os._exit would leave unwritten
            print("error: interrupted (Ctrl-C); nothing half-written is kept: rerun to start over", file=sys.__stderr__)
            sys.__stderr__.flush()
            os._exit(130)
        default(kind, value, tb)
    sys.excepthook = hook


def reader_gone(stream):
    """Whether stream is a pipe whose reader has exited: poll reports it as an error (Linux) or a hang-up."""
    try:
        poll = select.poll()
        poll.register(stream.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # no stream, or not a file
        return False


def check_model_name(model, given):
    """A GPT-2 name (model=gpt2...) sets the shape: a shape key given beside it would be ignored, so it is refused."""
    both = sorted(given & {'n_layer', 'n_head', 'n_embd'}) if model else []
    if both:
        sys.exit(f"error: model={model} sets n_layer, n_head and n_embd, so {', '.join(both)} would be ignored: drop "
                 f"--model to give the shape yourself, or drop {', '.join('--' + k for k in both)}")
