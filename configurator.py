"""
nanoGPT's configuration convention, with the errors it left out.

An entrypoint's module-level globals of type int, float, bool or str are its config. Call

    config, given = configure(globals())

right after them: every `config/x.py` argument is run as Python and every `--key=value` argument is parsed with
ast.literal_eval (a bare word is a string), in the order given, each checked against the default's name and type.
A config file runs like a module: it may import (modules, functions and _names are not keys) and knows its own
path as __file__.
`config` is the final dict of every key; `given` the keys that a file or flag set. With skip_unknown_in_files,
a config file may set keys the script lacks (bench.py reads training configs), but a flag may not.
Bad input exits with a one-line error that names the fix.
"""

import ast
import difflib
import os
import sys
import tempfile
import types

CONFIG_TYPES = (int, float, bool, str)


def config_keys(namespace):
    return {k: v for k, v in namespace.items() if not k.startswith('_') and type(v) in CONFIG_TYPES}


def _check(key, value, defaults, where):
    if key not in defaults:
        close = difflib.get_close_matches(key, defaults, n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}?" if close else f"valid keys: {', '.join(sorted(defaults))}"
        sys.exit(f"error: {where}: unknown config key '{key}'; {hint}")
    want = type(defaults[key])
    if want is float and type(value) is int:
        value = float(value)  # --learning_rate=1 means 1.0
    if type(value) is not want:
        sys.exit(f"error: {where}: {key} must be {want.__name__} like its default {defaults[key]!r}, "
                 f"got {type(value).__name__} {value!r}")
    return value


def _assigned_names(source):
    """{name: line} of the names a config file assigns at its top level, even to the default's own value."""
    names = {}
    for node in ast.parse(source).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, 'target', None)]
        names.update({t.id: node.lineno for t in targets if isinstance(t, ast.Name)})
    return names


def configure(namespace, argv=None, skip_unknown_in_files=False):
    argv = sys.argv[1:] if argv is None else argv
    defaults = config_keys(namespace)
    given = set()
    for arg in argv:
        if not arg.startswith('--'):
            if not arg.endswith('.py'):
                sys.exit(f"error: argument '{arg}' is neither a config file (*.py) nor --key=value")
            try:
                with open(arg) as f:
                    source = f.read()
            except OSError as e:
                sys.exit(f"error: cannot read config file {arg}: {e.strerror}")
            scope = dict(defaults, __file__=arg)
            try:
                exec(compile(source, arg, 'exec'), scope)
            except Exception as e:
                # name the config file's own line, not this module's
                line = e.lineno if isinstance(e, SyntaxError) else None
                tb = e.__traceback__
                while tb is not None:
                    if tb.tb_frame.f_code.co_filename == arg:
                        line = tb.tb_lineno
                    tb = tb.tb_next
                sys.exit(f"error: {arg}:{line}: {type(e).__name__}: {e}")
            assigned = _assigned_names(source)
            for key, value in scope.items():
                if key.startswith('_') or isinstance(value, (types.ModuleType, types.FunctionType, type)):
                    continue
                if key in defaults and value is defaults[key] and key not in assigned:
                    continue  # left as it was
                if key not in defaults and skip_unknown_in_files:
                    continue  # e.g. a training config read by bench.py for its model and batch
                where = f"{arg}:{assigned[key]}" if key in assigned else arg
                namespace[key] = defaults[key] = _check(key, value, defaults, where)
                given.add(key)
        else:
            if '=' not in arg:
                sys.exit(f"error: flag '{arg}' needs a value: write it as {arg}=VALUE")
            key, text = arg[2:].split('=', 1)
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                value = text  # a bare word such as --device=cpu
            if key in defaults and type(defaults[key]) is str and type(value) is not str:
                value = text  # a string key takes any text: --out_dir=2024 is a folder, not a number
            namespace[key] = defaults[key] = _check(key, value, defaults, arg)
            given.add(key)
    return config_keys(namespace), given


# -----------------------------------------------------------------------------
# The one validation step of the training entrypoints, before anything is written: each key of theirs that
# holds a number has a range, and a value outside it is a one-line error.

RANGES = {  # key: (least, bound): the value must lie in [least, bound), or be at least `least` where bound is None
    'batch_size': (1, None), 'block_size': (1, None), 'gradient_accumulation_steps': (1, None),
    'eval_interval': (1, None), 'eval_iters': (1, None), 'log_interval': (1, None), 'max_iters': (0, None),
    'n_layer': (1, None), 'n_head': (1, None), 'n_embd': (1, None), 'dropout': (0, 1),
    'learning_rate': (0, None), 'min_lr': (0, None), 'weight_decay': (0, None), 'beta1': (0, 1), 'beta2': (0, 1),
    'grad_clip': (0, None), 'warmup_iters': (0, None), 'lr_decay_iters': (0, None),
    'save_memory_interval': (0, None), 'save_storage_interval': (0, None), 'max_nonfinite_steps': (1, None),
}


def check_config(config):
    """Exits with a one-line error naming the fix where a key is out of its range, the model's width does not
    split into its heads, or out_dir cannot be a folder to write in."""
    for key, (least, bound) in RANGES.items():
        value = config.get(key)
        if value is not None and not (least <= value and (bound is None or value < bound)):
            want = f"{least} or more" if bound is None else f"in [{least}, {bound})"
            sys.exit(f"error: {key}={value} is out of range: give --{key} {want}")
    if 'n_embd' in config and config['n_embd'] % config['n_head']:
        sys.exit(f"error: n_embd={config['n_embd']} is not a multiple of n_head={config['n_head']}: every head takes "
                 f"n_embd / n_head channels, so make n_embd a multiple of n_head")
    init_from = config.get('init_from', 'scratch')
    if init_from not in ('scratch', 'resume', 'gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl') and \
            not os.path.exists(init_from):
        sys.exit(f"error: unknown init_from={init_from!r}: use scratch, resume, gpt2, gpt2-medium, gpt2-large, gpt2-xl "
                 f"or the path of a checkpoint (a ckpt.pt, a sharded checkpoint folder or a run's out_dir)")
    if 'out_dir' in config:
        check_out_dir(config['out_dir'])


def check_out_dir(out_dir):
    """out_dir must be a folder this process can write in, or one it can make; nothing is written to find out
    but a temporary file, removed at once, in the nearest folder that exists."""
    if not out_dir:
        sys.exit("error: out_dir is empty: give --out_dir=FOLDER")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        sys.exit(f"error: out_dir={out_dir} is a file, not a folder: give another --out_dir")
    parent = os.path.abspath(out_dir)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        sys.exit(f"error: out_dir={out_dir} would lie below {parent}, which is a file: give another --out_dir")
    try:
        tempfile.TemporaryFile(dir=parent).close()
    except OSError as e:
        sys.exit(f"error: cannot write in {parent} for out_dir={out_dir} ({e.strerror}): give a folder you can "
                 f"write to with --out_dir")
