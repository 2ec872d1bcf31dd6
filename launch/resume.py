"""
Runs a training entrypoint, resuming from the checkpoint in its out_dir when there is one:

    python launch/resume.py train.py config/train_gpt2.py --out_dir=out-gpt2
    torchrun --nproc-per-node=8 launch/resume.py fsdp_train.py config/train_gpt2.py      # in every worker

The cluster launchers (slurm/, k8s/) start the entrypoints through it, so that a job the scheduler requeues, or a
worker group that torchrun restarts, continues from its last checkpoint instead of starting over and then
overwriting it. A run whose out_dir holds a checkpoint (ckpt.pt, or fsdp_train.py's dcp/latest) gets
--init_from=resume after its other arguments (the last one wins); a run without one starts as its arguments say,
so a new run needs a fresh out_dir. The arguments go through the entrypoint's own configurator first: a bad key
exits here with the usual one-line error.
"""

import ast
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from configurator import configure  # noqa: E402


def script_config(script, argv):
    """The config that `python script *argv` would run with: the script's config globals, with the arguments
    applied as the script itself applies them; bad ones exit with the configurator's error."""
    with open(script) as f:
        tree = ast.parse(f.read(), script)
    try:
        namespace = script_globals(tree, script, stdlib_only=True)
    except NameError:  # a default computed with a third-party module (torch.cuda...): import it after all
        namespace = script_globals(tree, script, stdlib_only=False)
    config, _ = configure(namespace, argv)
    return config


def script_globals(tree, script, stdlib_only):
    """Runs a script's top-level statements up to the one that calls configure(), which define its config
    globals. With stdlib_only, imports from outside the standard library are left out: leaving torch out
    keeps this instant, and defaults need os.cpu_count() at most."""
    namespace = {'__name__': 'config_of_' + os.path.basename(script), '__file__': script}
    for node in tree.body:
        calls = [n.func.id for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
        if 'configure' in calls:
            break
        modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ''] if isinstance(node, ast.ImportFrom) else []
        if stdlib_only and any(m.split('.')[0] not in sys.stdlib_module_names for m in modules):
            continue
        exec(compile(ast.Module([node], type_ignores=[]), script, 'exec'), namespace)
    return namespace


def has_checkpoint(out_dir):
    return os.path.exists(os.path.join(out_dir, 'ckpt.pt')) or os.path.exists(os.path.join(out_dir, 'dcp', 'latest'))


if __name__ == '__main__':
    if len(sys.argv) < 2 or not os.path.isfile(sys.argv[1]):
        sys.exit(f"error: {sys.argv[1] if len(sys.argv) > 1 else 'no script given'} is not a file: "
                 f"usage: python launch/resume.py SCRIPT.py [config.py] [--key=value ...]")
    script, args = sys.argv[1], sys.argv[2:]
    out_dir = script_config(script, args)['out_dir']
    if has_checkpoint(out_dir):
        if os.environ.get('RANK', '0') == '0':
            print(f"{out_dir} holds a checkpoint: resuming from it", flush=True)
        args.append('--init_from=resume')
    # the entrypoint takes this process over: torchrun's worker and its signals are the entrypoint's own
    os.execv(sys.executable, [sys.executable, script, *args])
