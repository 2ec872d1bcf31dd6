"""
Proves and measures every entrypoint on one GPU, parts of it per command, each printing one table last (issue: "On
the GPU"). A lent GPU machine gives a session 15 minutes in all, its start included, and one command at most 10; so
one command runs parts A and B, each within its own seconds, then L and C until its deadline, and a later session's
runs what it did not reach.

On a GPU machine (the device tool's; DeepSpeed and py-spy travel as wheels in .whl/, tiny Shakespeare as
.gpu/input.txt, both made by tests/gpu_carry.sh; docs/speed.md has the calls):
    python tests/gpu_check.py --parts=A:250,B:300,L,C --deadline=570 --input=.gpu/input.txt --wheels=.whl --out=$OUT
On CPU, at tiny sizes, so that its own logic is proven before a GPU run relies on it (tests/test_gpu_check.py):
    python tests/gpu_check.py --dry_run --input=../shared/data/tinyshakespeare/input.txt

A: each entrypoint trains the baby GPT under torchrun (nccl, bf16, compiled): the loss falls, a checkpoint is
   written, a run stopped halfway and resumed ends on the uninterrupted run's loss bit for bit (deterministic),
   sample.py and export_hf.py read it; fsdp_train.py with CPU offload and activation checkpointing; ds_train.py at
   ZeRO-2 and ZeRO-3 with the optimizer offloaded; train.py in float16 with its scaler; a SIGKILLed worker under
   elastic torchrun resumes from its memory snapshot; config/train_shakespeare_char.py reaches nanoGPT's best val
   loss. The runs share the GPU, --jobs at a time: these are proofs, not timings.
B: bench.py on GPT-2 124M (T=1024) at a few micro-batches, and a profiler trace of the fastest; train.py's step
   with its verdict left on the device against a step that waits for it (the host sync it saves).
L: the levers, one at a time against the plain step at one batch, side by side: the loss a chunk of logits at a
   time, a bf16 residual stream, SDPA's cuDNN and flash kernels, one fused QKV matmul, those that paid together,
   and a compile mode; the plain step timed again last, for the spread (its first timing part B's, where the call
   ran B at that batch). Each must also train to the plain step's loss.
C: tok/s of fsdp_train.py, ds_train.py (ZeRO-2) and decent_train.py against train.py at the same batch, each one's
   peak GPU memory, and where its host's time goes (py-spy on its worker as it runs); and tests/host_time.py, the
   host's time per part of a step, plain against FSDP2.
Each check is a row: what, ok or FAIL, the figure. The exit status is 1 where a check failed or was not reached.
"""

import argparse
import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from hostprofile import summary  # tests/, beside this script, as proctree
from proctree import stop, under

BEGAN = time.time()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRYPOINTS = ('train.py', 'fsdp_train.py', 'ds_train.py', 'decent_train.py', 'pp_train.py')  # pp: 1 stage

p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
p.add_argument('--dry_run', action='store_true', help='CPU, gloo, fp32, no compile, a tiny model, a few steps')
p.add_argument('--input', default=os.path.join(REPO, 'data', 'shakespeare_char', 'input.txt'),
               help="tiny Shakespeare's input.txt")
p.add_argument('--wheels', default='', help='a folder of wheels to install first where DeepSpeed or py-spy is missing')
p.add_argument('--out', default='', help='where logs and the table go (default: a temporary folder)')
p.add_argument('--parts', default='ABLC', help='which parts to run, in this order, each with its own seconds if '
               'given (A:250,B:320): a part stops its runs when its seconds are up, and the next part begins')
p.add_argument('--entrypoints', default=','.join(ENTRYPOINTS), help='which entrypoints parts A and C run')
p.add_argument('--deadline', type=float, default=0, help='seconds from the start after which no run begins, and '
               'by which every run is stopped; its checks are rows "not reached". 0: none')
p.add_argument('--jobs', type=int, default=0, help="part A's runs at a time (0: 12 on a GPU, 3 dry)")
p.add_argument('--batch', type=int, default=0, help="the micro-batch of parts L (0: part B's fastest, else 16) and C "
               "(0: 12, nanoGPT's)")
p.add_argument('--only', default='', help="only the checks whose names (the table's) hold one of these "
               "comma-separated words, as 'zero_stage=3,SIGKILL,verdict': what an earlier call did not reach (part L "
               "times its plain step still, twice, and part C train.py's)")
args = p.parse_args()
dry = args.dry_run
plan = []  # [(part, its seconds or 0)], from 'ABLC' or 'A:250,B:320'
for item in args.parts.split(',') if ',' in args.parts or ':' in args.parts else args.parts:
    part, _, secs = item.partition(':')
    if part not in ('A', 'B', 'L', 'C') or secs and not secs.replace('.', '', 1).isdigit():
        sys.exit(f"error: --parts={args.parts}: give parts of ABLC in order, as ABLC or as A:250,B:320 (seconds)")
    plan.append((part, float(secs or 0)))
chosen = args.entrypoints.split(',')


def wanted(*checks):
    """Whether --only leaves one of these checks (names as the table's) to run."""
    return not args.only or any(w.lower() in c.lower() for c in checks for w in args.only.split(',') if w)


work = tempfile.mkdtemp(prefix='gpu_check-')
atexit.register(shutil.rmtree, work, ignore_errors=True)  # the runs' folders; their logs are archived in out first
out = args.out or work
logs = os.path.join(work, 'logs')  # one archive of them in out at the end: a device call brings back 8 files
os.makedirs(out, exist_ok=True)
os.makedirs(logs)
rows = []  # (part, what, ok, figure)
lock = threading.Lock()  # part A's runs report from threads
env = dict(os.environ, PYTHONUNBUFFERED='1', OMP_NUM_THREADS='1' if dry else os.environ.get('OMP_NUM_THREADS', '8'))
env['PYTHONPATH'] = os.pathsep.join(filter(None, [REPO, env.get('PYTHONPATH')]))

# py-spy, for part C's host profiles: beside this Python, where pip puts it, or on PATH
spy_path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get('PATH', '')])
if args.wheels and os.path.isdir(args.wheels):
    # of the wheels, those of what the machine lacks: DeepSpeed and the packages it needs, py-spy (part C's profiles)
    spy = [w for w in os.listdir(args.wheels) if w.startswith('py_spy-')]
    try:
        import deepspeed  # noqa: F401
        wheels = []
    except ImportError:
        wheels = [w for w in os.listdir(args.wheels) if w not in spy]
    wheels += [] if shutil.which('py-spy', path=spy_path) else spy
    if wheels:
        site = os.path.join(work, 'site')
        subprocess.run([sys.executable, '-m', 'pip', 'install', '-q', '--no-index', '--no-deps', '--no-compile',
                        '--target', site] + [os.path.join(args.wheels, w) for w in wheels], check=True)
        env['PYTHONPATH'] = os.pathsep.join([site, env['PYTHONPATH']])
        spy_path = os.pathsep.join([os.path.join(site, 'bin'), spy_path])  # --target puts scripts in bin/
PY_SPY = shutil.which('py-spy', path=spy_path)

# the settings of every run: the baby GPT on a GPU, a tiny model on CPU
if dry:
    SYSTEM = ['--device=cpu', '--dtype=float32', '--compile=False']
    MODEL = ['--n_layer=2', '--n_head=2', '--n_embd=32', '--block_size=32', '--batch_size=4', '--eval_iters=2',
             '--dropout=0.0', '--learning_rate=3e-3', '--warmup_iters=2', '--min_lr=3e-4']
    STEPS = 8
else:
    SYSTEM = ['--compile=True']  # device, dtype (bf16) and backend (nccl) are auto
    MODEL = ['--eval_iters=20', '--dropout=0.0']  # the config's baby GPT otherwise
    STEPS = 100
BASE = [os.path.join(REPO, 'config', 'train_shakespeare_char.py'), '--gradient_accumulation_steps=1',
        '--log_interval=1', f'--max_iters={STEPS}', f'--lr_decay_iters={STEPS}', '--always_save_checkpoint=True',
        '--deterministic=True'] + SYSTEM + MODEL


# runs an entrypoint (its path and arguments follow) with one thing changed or added, as a file of the work folder
WRAPPERS = {
    # the host made to wait for each step's verdict (distributed.agree), as a read at once would make it
    'sync': """import distributed
agree = distributed.agree
def agree_and_wait(nonfinite, *args, **kwargs):
    flag = agree(nonfinite, *args, **kwargs)
    flag.item()
    return flag
distributed.agree = agree_and_wait
""",
    # the memory the run took at its peak, printed at its end (finish() runs the atexit functions): the GPU's, or on
    # CPU (a dry run) the process's resident set, interpreter and all
    'peak': """import atexit, resource, torch
atexit.register(lambda: print('peak memory:', torch.cuda.max_memory_allocated() if torch.cuda.is_initialized()
                              else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, flush=True))
""",
    # what the device did in steps 20 to 30 (counted by their backward, one a step in part C, in every mode: an
    # optimizer can step more than once a step, DeepSpeed's once a parameter group): its busy time and kernels a
    # step, and the kernels that took most, from a profiler trace read at the end (reading it takes seconds, which
    # the host profile would count); beside the run's own ms/iter (untraced steps), the share of a step the GPU
    # worked. On CPU (a dry run) the ops, the host's time in them
    'trace': """import atexit, json, torch
from torch.profiler import DeviceType, ProfilerActivity, profile
_traced = {'steps': 0, 'cuda': False}
def _trace(first=20, last=30):
    _traced['steps'] += 1
    cuda = _traced['cuda'] = torch.cuda.is_initialized()
    if _traced['steps'] in (first, last) and cuda:
        torch.cuda.synchronize()  # the trace holds the steps' own kernels, all of them
    if _traced['steps'] == first:
        _traced['prof'] = profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda)
        _traced['prof'].__enter__()
    elif _traced['steps'] == last and 'prof' in _traced:
        _traced['prof'].__exit__(None, None, None)
        _traced['done'] = last - first
_backward = torch.Tensor.backward
def _counted(self, *args, **kwargs):
    _trace()
    return _backward(self, *args, **kwargs)
torch.Tensor.backward = _counted
def _report():
    if 'done' not in _traced:
        return
    prof, n, cuda = _traced['prof'], _traced['done'], _traced['cuda']
    # not the ranges that record_function marks on the GPU (the optimizer's step, FSDP's unshard...): each spans kernels
    # that are counted already, and FSDP's many would count its kernels twice
    rows = [e for e in prof.key_averages() if (e.device_type == DeviceType.CUDA) == cuda
            and not getattr(e, 'is_user_annotation', False)]
    if not cuda:  # each op once: the time in it, not in the ops it calls
        rows = [e for e in rows if e.key.startswith('aten::')]
    us = lambda e: e.self_device_time_total if cuda else e.self_cpu_time_total
    top = sorted(rows, key=us, reverse=True)[:6]
    print('trace: ' + json.dumps({'device': 'cuda' if cuda else 'cpu', 'busy_ms': sum(map(us, rows)) / 1e3 / n,
          'kernels': sum(e.count for e in rows) / n, 'top': [[e.key[:60], us(e) / 1e3 / n] for e in top]}), flush=True)
atexit.register(_report)
""",
}


def wrapped(how, cmd, script):
    """cmd, a torchrun command of script, with the worker started through the wrappers named in `how` (a+b)."""
    path = os.path.join(work, f'{how}_wrapper.py')
    with open(path, 'w') as f:
        f.write('import runpy, sys\n' + ''.join(WRAPPERS[w] for w in how.split('+')) +
                "sys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n")
    at = cmd.index(os.path.join(REPO, script))
    return cmd[:at] + [path] + cmd[at:]


part_ends = float('inf')  # the time at which the running part's seconds are up


def left():
    """Seconds to the deadline or the end of the part's seconds, whichever comes first."""
    return min(args.deadline - (time.time() - BEGAN) if args.deadline else float('inf'), part_ends - time.time())


def log_name(name):
    return os.path.join(logs, name.replace('/', '_') + '.log')


TIME_UP = 'time up'  # a run's code where the part's seconds or the deadline stopped it


def run(name, cmd, timeout=600, check=True, by_deadline=True, fork=True):
    """Runs cmd in the work folder, its output in out/<name>.log; returns (returncode, output, seconds). A run
    still going when the part's seconds or the deadline run out is stopped (TIME_UP), one past its own timeout too
    (124), and one that would start within 20 s of the end is not started (None). fork=False: a process of its own
    even in a dry run (one that py-spy finds by its command line)."""
    cut = False
    if by_deadline:
        if left() < 20:
            return None, 'not reached: the deadline came first', 0
        cut, timeout = left() < timeout, min(timeout, left())
    t0 = time.time()
    if dry and fork and cmd[0] == sys.executable and cmd[1].endswith('.py'):
        # a script on one process, forked from a server that has imported torch (tests/launcher.py, as the suite's
        # runs are): a fresh interpreter's 2 to 3 s of CPU, in each of the 20 such runs of a dry run, proves nothing
        # of this script, whose torchrun runs (elastic, and part C's) still start as on a GPU
        import launcher
        # these scripts (train.py, sample.py, export_hf.py, bench.py, ...) import none of what the suite's server
        # preloads for its ds_train.py and pp_train.py ranks alone: 1 s of CPU less at this server's start
        launcher.PRELOAD = [m for m in launcher.PRELOAD if m not in ('torch._inductor.compile_fx',
                                                                     'torch.distributed.pipelining', 'cpuinfo_once')]
        try:
            done = launcher.launch(cmd[1], cmd[2:], env, work, timeout=timeout)
            code, text = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired:
            code, text = TIME_UP if cut else 124, f"stopped after {time.time() - t0:.0f} s\n"
    else:
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
            code, text = proc.returncode, stdout + stderr
        except subprocess.TimeoutExpired:
            stop(proc.pid)
            stdout, stderr = proc.communicate()
            code, text = TIME_UP if cut else 124, f"stopped after {time.time() - t0:.0f} s\n{stdout}{stderr}"
    with open(log_name(name), 'w') as f:
        f.write(' '.join(cmd) + '\n' + text)
    if check and code != 0:
        print(f"{name}: exit {code}; last lines:\n" + '\n'.join(text.strip().splitlines()[-8:]), flush=True)
    return code, text, time.time() - t0


def torchrun(script, extra, nproc=1, elastic=False):
    if dry and script == 'train.py' and nproc == 1 and not elastic:
        # dry, train.py on one process runs as nanoGPT's `python train.py`: torchrun's agent would be a second
        # interpreter (2 to 3 s of CPU each, 8 in the suite's dry runs) that proves nothing of this script, whose
        # elastic torchrun the SIGKILL check proves. The other entrypoints' modes need torchrun's ranks
        return [sys.executable, os.path.join(REPO, script)] + BASE + list(extra)
    launcher = [sys.executable, '-m', 'torch.distributed.run', f'--nproc_per_node={nproc}']
    if elastic:
        # port 0: the agent binds a port of the kernel's choosing (one node), where a port picked here and freed
        # could be bound by another process in the seconds before torchrun binds it
        launcher += ['--nnodes=1:1', '--max-restarts=2', '--rdzv-backend=c10d', '--rdzv-endpoint=127.0.0.1:0',
                     '--rdzv-conf=last_call_timeout=1']
    else:
        launcher += ['--standalone']
    return launcher + [os.path.join(REPO, script)] + BASE + list(extra)


def metrics(out_dir):
    path = os.path.join(work, out_dir, 'metrics.jsonl')
    if not os.path.exists(path):
        return []
    with open(path) as f:  # a row without its newline is still being written (host_profile reads as the run goes)
        rows = [json.loads(line) for line in f if line.strip() and line.endswith('\n')]
    # null: a loss that was not finite; an MFU's, unknown (no peak for the device), as it was before nulls
    return [{k: float('nan') if v is None and k != 'mfu' else v for k, v in row.items()} for row in rows]


def row(part, what, ok, figure=''):
    with lock:
        rows.append((part, what, bool(ok), figure))
        print(f"[{part}] {'ok  ' if ok else 'FAIL'} {what}: {figure}", flush=True)
        with open(os.path.join(out, 'table.json'), 'w') as f:  # as it grows: a call cut short keeps its rows
            json.dump(rows, f)


def losses(out_dir):
    return {r['iter']: r['loss'] for r in metrics(out_dir) if 'loss' in r}


def mean_ms(out_dir, skip=5):
    ms = sorted(r['ms'] for r in metrics(out_dir) if 'ms' in r and r['iter'] >= skip)
    return ms[len(ms) // 2] if ms else None


def exited(code, secs=None):
    """A run's figure where it has no other: why it ended."""
    if code is None:
        return 'not reached: the deadline came first'
    if code == TIME_UP:
        return "stopped" + (f" after {secs:.0f} s" if secs is not None else '') + ": out of time"
    return f"exit {code}" + (f" after {secs:.0f} s" if secs is not None else '')


# -----------------------------------------------------------------------------
# data: the character-level Shakespeare in the work folder
if not os.path.isfile(args.input):
    sys.exit(f"error: no {args.input}: give --input=tiny Shakespeare's input.txt (carried along on a GPU machine)")
os.makedirs(os.path.join(work, 'data', 'shakespeare_char'), exist_ok=True)
shutil.copy(args.input, os.path.join(work, 'data', 'shakespeare_char', 'input.txt'))
code, _, _ = run('prepare', [sys.executable, os.path.join(REPO, 'prepare.py'), 'shakespeare_char'],
                 by_deadline=False)  # every part needs it
if code:
    sys.exit(f"error: prepare.py shakespeare_char failed: see {log_name('prepare')}")


def trains(part, what, code, secs, name):
    curve = losses(name)
    fell = bool(curve) and curve[max(curve)] < curve[min(curve)]
    # dynamo gave up on a frame: it ran uncompiled, slowly (a run not started has no log)
    limit = os.path.exists(log_name(name)) and 'torch._dynamo hit config.recompile_limit' in open(log_name(name)).read()
    row(part, what, code == 0 and fell and not limit,
        f"loss {curve[min(curve)]:.3f} -> {curve[max(curve)]:.3f} at step {max(curve)} in {secs:.0f} s"
        + (", stopped: out of time" if code == TIME_UP else '') + (", past dynamo's recompile limit" if limit else '')
        if curve else exited(code, secs))
    return curve


def entrypoint(script):
    """An entrypoint's whole run: it trains and saves, is sampled and exported."""
    name, extra = script[:-3], ['--zero_stage=2'] if script == 'ds_train.py' else []
    full = f'{name}-full'
    code, _, secs = run(full, torchrun(script, extra + [f'--out_dir={full}', f'--eval_interval={STEPS // 2}']))
    trains('A', f'{script} trains', code, secs, full)
    saved = os.path.exists(os.path.join(work, full, 'ckpt.pt')) or os.path.isdir(os.path.join(work, full, 'dcp'))
    row('A', f'{script} checkpoint', code == 0 and saved, full if code is not None else exited(code))
    code, text, _ = run(f'{name}-sample', [sys.executable, os.path.join(REPO, 'sample.py'), f'--out_dir={full}',
                                           '--num_samples=1', '--max_new_tokens=40', *SYSTEM[:1 if dry else 0]])
    row('A', f'{script} sample.py', code == 0, text.strip().splitlines()[-1][:40] if text.strip() else '')
    code, text, _ = run(f'{name}-export', [sys.executable, os.path.join(REPO, 'export_hf.py'), f'--ckpt={full}',
                                           f'--out={name}-hf'])
    said = [line for line in text.strip().splitlines() if '%|' not in line]  # not its progress bars
    row('A', f'{script} export_hf.py', code == 0 and os.path.isdir(os.path.join(work, f'{name}-hf')),
        said[-1][:60] if said else '')


def halves(script):
    """The same run stopped halfway (a run to max_iters=half) and resumed to the end, beside the whole run; returns
    the two exit codes, for resumed() to compare with the whole run's once both are done."""
    name, extra = script[:-3], ['--zero_stage=2'] if script == 'ds_train.py' else []
    first = f'{name}-half'
    code1, _, _ = run(first, torchrun(script, extra + [f'--out_dir={first}', f'--eval_interval={STEPS // 2}',
                                                         f'--max_iters={STEPS // 2}']))
    code2, _, _ = run(first + '-resumed', torchrun(script, extra + [f'--out_dir={first}',
                                                                    f'--eval_interval={STEPS // 2}']))
    return code1, code2


def resumed(script, code1, code2):
    """The run resumed halfway ends on the whole run's last loss, bit for bit."""
    curve, again = losses(f'{script[:-3]}-full'), losses(f'{script[:-3]}-half')
    same = bool(curve) and again.get(STEPS - 1) == curve.get(STEPS - 1)
    row('A', f'{script} exact resume', code1 == 0 and code2 == 0 and same,
        f"last loss {again.get(STEPS - 1)} vs {curve.get(STEPS - 1)}" if code2 is not None else exited(code2))


def recipe():
    """The baby GPT's whole recipe, config/train_shakespeare_char.py: nanoGPT's best val loss is 1.4697."""
    code, _, secs = run('shakespeare-full', [sys.executable, os.path.join(REPO, 'train.py'),
                                             os.path.join(REPO, 'config', 'train_shakespeare_char.py'),
                                             '--out_dir=shakespeare-full'])
    vals = [r['val_loss'] for r in metrics('shakespeare-full') if 'val_loss' in r]
    row('A', 'config/train_shakespeare_char.py', code == 0 and vals and min(vals) <= 1.47,
        f"best val loss {min(vals):.4f} in {secs:.0f} s (goal <= 1.47)" if vals else exited(code, secs))


def variant(script, extra, name):
    code, _, secs = run(name, torchrun(script, extra + [f'--out_dir={name}', f'--eval_interval={STEPS}']))
    trains('A', f'{script} {" ".join(extra)}', code, secs, name)


def snapshot_written(out_dir):
    """Whether the run in out_dir has a memory snapshot written whole (a busy machine writes one late)."""
    try:
        with open(os.path.join(work, out_dir, 'run_id')) as f:
            run_id = f.read().strip()
    except OSError:
        return False
    shm = '/dev/shm' if os.path.isdir('/dev/shm') else tempfile.gettempdir()
    return os.path.isfile(os.path.join(shm, f'nanogpt-{run_id}', 'ckpt.pt'))


def sigkill():
    """A worker SIGKILLed under elastic torchrun: the restarted group resumes from its memory snapshot."""
    name = 'train-kill'
    if left() < 60:
        return row('A', 'SIGKILL under elastic torchrun', False, exited(None))
    # no eval (so no storage checkpoint) before the end: the restart has the memory snapshots alone to resume from
    # long enough to be killed while it runs, short enough to end well within part A on a GPU once resumed. Dry, the
    # kill lands a step or two past step 4 (the step-2 snapshot is whole by then: a save waits for the one before), and
    # every step resumed writes a snapshot every 2: 120 steps leave a margin of over 100, where 400 took 2.5 s more CPU
    steps = STEPS * (15 if dry else 4)
    cmd = torchrun('train.py', [f'--out_dir={name}', f'--eval_interval={steps}', '--save_memory_interval=2',
                                f'--max_iters={steps}', f'--lr_decay_iters={steps}'], elastic=True)
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    time_up = threading.Event()
    timer = threading.Timer(left(), lambda: (time_up.set(), stop(proc.pid)))  # the part's seconds or the deadline
    if left() < float('inf'):
        timer.start()
    killed, text = False, []
    for line in proc.stdout:
        text.append(line)
        if not killed and line.startswith('iter ') and int(line.split()[1].rstrip(':')) >= STEPS // 2 \
                and snapshot_written(name):
            # this torchrun's worker (its child), not another check's on the same machine with the same out_dir
            worker = subprocess.run(['pgrep', '-P', str(proc.pid), '-f', '-n', f'train.py.*out_dir={name}'],
                                    capture_output=True, text=True).stdout.split()
            if worker:
                os.kill(int(worker[0]), signal.SIGKILL)
                killed = True
    proc.wait()
    timer.cancel()
    time_up = time_up.is_set() and proc.returncode != 0
    with open(log_name(name), 'w') as f:
        f.write(''.join(text))
    from_memory = any('resuming from /dev/shm' in line or 'resuming from ' + tempfile.gettempdir() in line
                      for line in text)
    row('A', 'SIGKILL under elastic torchrun', proc.returncode == 0 and killed and from_memory,
        'resumed from the memory snapshot' if from_memory and not time_up else
        exited(TIME_UP if time_up else proc.returncode) + f'; worker killed: {killed}, resumed: {from_memory}')


def bench(name, extra):
    """bench.py's JSON line, or None where it failed, and then the failure's figure."""
    sizes = ['--n_layer=2', '--n_head=2', '--n_embd=32', '--block_size=64', '--compile=False', '--device=cpu',
             '--iters=3', '--warmup=1'] if dry else ['--model=gpt2', '--block_size=1024', '--iters=30', '--warmup=10']
    code, text, secs = run(name, [sys.executable, os.path.join(REPO, 'bench.py')] + sizes + list(extra))
    said = [line for line in text.splitlines() if line.startswith('{')]  # its JSON line, whatever stderr says
    return (json.loads(said[-1]), '') if code == 0 and said else (None, exited(code, secs))


def speed(r):
    figure = f"{r['ms']:.2f} ms/iter, {r['tokens_per_sec']:,.0f} tok/s"
    figure += f", MFU {r['mfu'] * 100:.1f}%" if r['mfu'] else ''
    return figure + (f", peak {r['peak_memory_bytes'] / 2**30:.1f} GiB" if r['peak_memory_bytes'] else '')


parts = {}


def part_a():
    # dry, three at a time: with train.py alone, its whole run, its halves and the SIGKILL at once (mostly start-up)
    jobs = args.jobs or (3 if dry else 12)
    # the longest first; at tiny sizes it could not reach its loss
    work_list = [] if dry or not wanted('config/train_shakespeare_char.py') else [(recipe, ())]
    for script in [script for script in ENTRYPOINTS if script in chosen]:
        whole = [f'{script} {c}' for c in ('trains', 'checkpoint', 'sample.py', 'export_hf.py')]
        if wanted(*whole, f'{script} exact resume'):  # the resumed run is compared with the whole run
            work_list.append((entrypoint, (script,)))
        if wanted(f'{script} exact resume'):
            work_list.append((halves, (script,)))
    variants = [('fsdp_train.py', ['--cpu_offload=True', '--activation_checkpointing=True'], 'fsdp-offload-ac'),
                ('ds_train.py', ['--zero_stage=2', '--offload_optimizer=cpu'], 'zero2-offload'),
                ('ds_train.py', ['--zero_stage=3', '--offload_optimizer=cpu'], 'zero3-offload'),
                # zero bubble's split backward (input's gradients, then the weights'), uncompiled: one rank holds the V
                ('pp_train.py', ['--pp_schedule=zbv', '--compile=False'], 'pp-zbv'),
                # each stage an FSDP root and its blocks units (over a dp of one here: FSDP's hooks, under the schedule,
                # gathered in bf16), stepped on its shards
                ('pp_train.py', ['--dp_shard=True', '--adamw_on_shards=True'], 'pp-sharded'),
                # one rank of 4 sharded stages, all kept gathered through the step (pipeline.make_schedule's plan)
                ('pp_train.py', ['--dp_shard=True', '--pp_schedule=interleaved-1f1b', '--stages_per_rank=4'] +
                 ['--n_layer=4'] * dry, 'pp-4-sharded-stages'),  # (a block a stage: the baby GPT has 6)
                # Streaming DiLoCo: its outer steps are torch's single-tensor SGD (foreach=False), which
                # decent.landed() copies op for op to land the ones in flight at the end
                ('decent_train.py', ['--diloco_steps=4', '--diloco_fragments=2', '--diloco_overlap=1'], 'diloco')]
    if not dry:  # float16 and its scaler are for GPUs: on CPU autocast in float16 is not what is being proven
        variants.append(('train.py', ['--dtype=float16'], 'train-fp16'))
    work_list += [(variant, v) for v in variants if v[0] in chosen and wanted(f'{v[0]} {" ".join(v[1])}')]
    work_list += [(sigkill, ())] if wanted('SIGKILL under elastic torchrun') else []
    with ThreadPoolExecutor(jobs) as pool:
        futures = [(f, a, pool.submit(f, *a)) for f, a in work_list]
        for f, a, future in futures:
            result = future.result()  # a check's own exception stops the script, as it would run alone
            if f is halves:
                resumed(*a, *result)


def part_b():
    best = None
    for b in [b for b in ([2] if dry else [12, 32]) if wanted(f'bench.py batch {b}')]:  # nanoGPT's, and a fuller one
        r, failed = bench(f'bench-b{b}', [f'--batch_size={b}'])
        row('B', f'bench.py batch {b}', r, speed(r) if r else failed)
        if r and (best is None or r['tokens_per_sec'] > best['tokens_per_sec']):
            best = r
    if best:
        parts['batch'], parts['timed'] = best['batch_size'], best
    b = args.batch or parts.get('batch') or (2 if dry else 12)
    if wanted(f'profile at batch {b}'):
        # where the device's time goes, and how much of the step it is idle (the step's time is the timed run's)
        r, failed = bench('bench-profile', [f'--batch_size={b}', '--profile=True', '--iters=5'])
        if r and os.path.isdir(os.path.join(work, 'bench_log')) and args.out:
            shutil.make_archive(os.path.join(out, 'bench_trace'), 'gztar', os.path.join(work, 'bench_log'))
        timed = best if best and best['batch_size'] == b else None  # the step's time, where it was timed
        row('B', f'profile at batch {b}', r, f"busy {r['busy_ms']:.2f}" + (f" of {timed['ms']:.2f}" if timed else '') +
            " ms a step: " +
            ', '.join(f"{k} {v * 100:.0f}%" for k, v in r['shares'].items() if v >= 0.005) if r else failed)
    if wanted('verdict a step late vs every step'):
        # the lever of the non-finite check: train.py as it is (the verdict read a step late), and with the host made to
        # wait for each step's verdict, as a read at once would; logged every 10 steps, since a logged step waits too
        size = MODEL + ['--max_iters=4', '--log_interval=2'] if dry else \
            ['--n_layer=12', '--n_head=12', '--n_embd=768', '--block_size=1024', '--batch_size=12', '--max_iters=60',
             '--log_interval=10', '--eval_iters=2']
        ms, mfu, failed = {}, None, ''
        for name, wait in (('sync-late', False), ('sync-every-step', True)):
            cmd = torchrun('train.py', size + ['--random_data=True', f'--out_dir={name}', '--eval_interval=1000',
                                               '--always_save_checkpoint=False', '--deterministic=False'])
            code, _, secs = run(name, wrapped('sync', cmd, 'train.py') if wait else cmd)
            ms[name] = mean_ms(name, skip=2 if dry else 20) if code == 0 else None
            failed = failed or (code != 0 and exited(code, secs))
            mfu = mfu or next((r['mfu'] for r in reversed(metrics(name)) if r.get('mfu')), None)
        late, every = ms['sync-late'], ms['sync-every-step']
        row('B', 'verdict a step late vs every step', late and every,
            f"{late:.2f} vs {every:.2f} ms/iter ({every / late:.3f}x)" + (f"; train.py's MFU {mfu * 100:.1f}%"
                                                                          if mfu else '')
            if late and every else failed or 'no times logged: see sync-*.log')
    # train.py's own log for config/train_gpt2.py as a user runs it on one GPU (40 micro-steps of 12 a step), on
    # random tokens: the MFU it reports; and with the micro-batch an 80 GB GPU takes, the same 491,520 tokens a step
    # (30 x 16: on 8 GPUs too, 2 micro-steps each). Dry, the tiny model's 4 x 2 and then 8 x 1, the same tokens too:
    # 30 x 16 of it (GPT-2's vocabulary, 15,360 tokens a step) took a minute of CPU and proves no more of this script
    bigger = ['--batch_size=8', '--gradient_accumulation_steps=1'] if dry else \
        ['--batch_size=30', '--gradient_accumulation_steps=16']
    # and the bf16 residual stream, the lever that paid in part L (bench.py), in train.py's own step
    residual = bigger + ['--autocast_residual=True'] + (['--dtype=bfloat16'] if dry else [])
    def gpt2(extra):
        what = ''.join(' ' + a for a in extra)
        name = 'train-gpt2' + (f"-b{extra[0].split('=')[1]}" if extra else '') + ('-bf16' if extra == residual else '')
        # dry, 4 steps: the figure is still the median of two steps past the first two, as of four on a GPU
        tiny = SYSTEM + MODEL[:5] + ['--gradient_accumulation_steps=2'] if dry else []
        code, _, secs = run(name, [
            sys.executable, os.path.join(REPO, 'train.py'), os.path.join(REPO, 'config', 'train_gpt2.py'),
            '--random_data=True', f'--max_iters={4 if dry else 6}', '--log_interval=1', '--eval_interval=1000',
            '--eval_iters=1', '--always_save_checkpoint=False', f'--out_dir={name}'] + tiny + extra)
        logged = sorted((r['ms'], r['tokens_per_sec'], r['mfu']) for r in metrics(name)
                        if r.get('iter', 0) >= 2 and 'ms' in r)
        ms, tok, mfu = logged[len(logged) // 2] if logged else (None, None, None)
        row('B', 'train.py config/train_gpt2.py' + what, code == 0 and ms,
            f"{ms:,.0f} ms/iter, {tok:,.0f} tok/s" + (f", MFU {mfu * 100:.1f}%" if mfu else '') if ms else
            exited(code, secs))
    # one at a time on a GPU, where each is a timing; dry, where they prove the reading of the log alone, at once
    with ThreadPoolExecutor(3 if dry else 1) as pool:
        list(pool.map(gpt2, [extra for extra in ([], bigger, residual)
                             if wanted('train.py config/train_gpt2.py' + ''.join(' ' + a for a in extra))]))


def part_l():
    """Each lever against the plain step, in one call; a lever pays where it is faster than the spread of the plain
    step's two timings, and it must train to the plain step's loss (the same batch, seed and steps)."""
    batch = args.batch or parts.get('batch') or (2 if dry else 16)
    on_gpu = [] if dry else [('sdpa=cudnn', ['--sdpa=cudnn']), ('sdpa=flash', ['--sdpa=flash']),
                             ('coordinate_descent', ['--coordinate_descent=True']),
                             # CUDA graphs: one launch for the step's kernels, for a step bound by its host's launches
                             ('compile_mode=reduce-overhead', ['--compile_mode=reduce-overhead'])]
    # the likeliest to pay first (the profile's memory-bound kernels: the loss, the layer norms), should time run out
    levers = [('loss_rows', [f'--loss_rows={50 if dry else 4096}']),
              ('autocast_residual', ['--autocast_residual=True'])] + on_gpu + [('fused_qkv', ['--fused_qkv=True'])]
    # part B's run of this batch, where it ran in this call, is the same command: its timing is the first (on a GPU
    # a compile and a minute fewer)
    timed = parts.get('timed')
    base, failed = (timed, '') if timed and timed['batch_size'] == batch else \
        bench('lever-plain', [f'--batch_size={batch}'])
    row('L', f'plain step, batch {batch}', base, speed(base) if base else failed)
    if not base:
        return
    paid = []

    def measure(what, extra, name):
        r, failed = bench(name, [f'--batch_size={batch}'] + extra)
        row('L', what, r and abs(r['loss'] - base['loss']) <= 0.05 * abs(base['loss']),
            f"{speed(r)}, {base['ms'] / r['ms']:.3f}x; loss {r['loss']:.4f} vs {base['loss']:.4f}" if r else failed)
        return r
    for what, extra in [lever for lever in levers if wanted(lever[0])]:
        r = measure(what, extra, f"lever-{what.replace('=', '-')}")
        if r and base['ms'] / r['ms'] > 1.01:
            paid.append((what, extra))
    if len(paid) > 1:  # the two sdpa kernels exclude each other: the faster one only
        kernels = [p for p in paid if p[0].startswith('sdpa')]
        paid = [p for p in paid if p not in kernels[1:]]
        measure(' + '.join(w for w, _ in paid), [a for _, e in paid for a in e], 'lever-together')
    again, failed = bench('lever-plain-again', [f'--batch_size={batch}'])
    row('L', 'plain step again (the spread)', again,
        f"{speed(again)}, {base['ms'] / again['ms']:.3f}x the first" if again else failed)
    if not dry and wanted('compile_mode=max-autotune-no-cudagraphs'):  # last: its autotuning takes minutes
        measure('compile_mode=max-autotune-no-cudagraphs', ['--compile_mode=max-autotune-no-cudagraphs'],
                'lever-max-autotune')


def host_profile(name, script, steps, done):
    """Where the host's time goes in a run of part C: py-spy on its worker from its 5th logged step (compiled, warm)
    to its last, at 50 Hz, without pausing it (--nonblocking), the raw stacks in the logs (host-train.txt for
    train.py) and their top 30 beside (host-train.log); returns the figure for its row. done: set once the run ended."""
    if not PY_SPY:
        return '; no host profile (no py-spy: tests/gpu_carry.sh carries its wheel to --wheels)'
    while not done.is_set() and not any(r['iter'] >= 5 and 'ms' in r for r in metrics(name)):
        time.sleep(0.05)
    # torchrun's child, the worker: the process under this one with the run's out_dir, that is not torchrun
    workers = []
    for pid in under(os.getpid()):
        try:
            with open(f'/proc/{pid}/cmdline') as f:
                cmd = f.read().split('\0')
        except OSError:  # gone since
            continue
        if f'--out_dir={name}' in cmd and 'torch.distributed.run' not in cmd:
            workers.append(pid)
    if done.is_set() or not workers:
        return '; no host profile (the run ended before its 5th step)'
    # py-spy's raw format does not mark a sample idle: a second py-spy, without --idle, counts the busy ones
    label = name[len('speed-'):]  # the script's name, and its lever's
    raw = {idle: os.path.join(logs, f"host-{label}{'' if idle else '-busy'}.txt") for idle in (True, False)}
    spies = [subprocess.Popen([PY_SPY, 'record', '--pid', str(workers[0]), '--nonblocking', '--threads', '--rate=50',
                               '--duration=600', '--format=raw', f'--output={path}'] + ['--idle'] * idle,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for idle, path in raw.items()]
    while not done.is_set() and not any(r['iter'] >= steps - 1 and 'ms' in r for r in metrics(name)):
        time.sleep(0.05)
    for spy in spies:  # it writes what it has, as where the worker exited (not the final eval and shutdown then)
        spy.send_signal(signal.SIGINT)
    try:  # it ends in a fraction of a second: one that hangs must not hold the call past its deadline
        said = [spy.communicate(timeout=10)[0].strip().splitlines() for spy in spies]
    finally:
        for spy in spies:
            spy.kill()
    if any(spy.returncode for spy in spies) or not all(map(os.path.isfile, raw.values())):
        return f"; no host profile (py-spy: {next((s[-1] for s in said if s), 'no output')[:100]})"
    total, busy, top = summary(raw[True], raw[False], script)
    if not total:
        return '; no host profile (no samples of the main thread)'
    with open(os.path.join(logs, f'host-{label}.log'), 'w') as f:
        f.write(f"{total} samples of the main thread, the host {busy:.0%} busy (it or the autograd engine's thread), "
                f"{1 - busy:.0%} idle; the loop's lines and the functions under them, by the share of the samples they "
                f"are in:\n")
        f.writelines(f'{share:6.1%}  {frame}\n' for frame, share in top[:30])
    return f"; host {busy:.0%} busy, {total} samples: " + ', '.join(
        f"{re.sub(r'[(].*/', '(', frame)} {share:.0%}" for frame, share in top[:8])  # file names without folders


def traced(text, ms):
    """The figure of a run's trace line (the 'trace' wrapper): how much of its step (ms, untraced) the device
    worked, in how many kernels, and the kernels that took most."""
    lines = [line for line in text.splitlines() if line.startswith('trace: ')]
    if not lines:
        return '; no trace (the run ended before its 30th step)'
    t = json.loads(lines[-1][len('trace: '):])
    what = 'GPU busy' if t['device'] == 'cuda' else 'in ops'
    return (f"; {what} {t['busy_ms']:.1f} ms a step ({t['busy_ms'] / ms:.0%}), {t['kernels']:.0f} "
            f"{'kernels' if t['device'] == 'cuda' else 'ops'} a step, most: " +
            ', '.join(f"{name} {t_ms:.1f}" for name, t_ms in t['top'][:4]))


def part_c():
    # the modes side by side at one batch: GPT-2 124M (T=1024) on a GPU, the tiny model on CPU
    batch = [f'--batch_size={args.batch or (4 if dry else 12)}']
    model = MODEL + batch if dry else ['--n_layer=12', '--n_head=12', '--n_embd=768', '--block_size=1024',
                                       '--eval_iters=1', '--deterministic=False'] + batch
    base_ms = None
    # model_size.py's estimate of each mode's memory on one rank: parameters, gradients, optimizer, activations
    size = (['--n_layer=2', '--n_head=2', '--n_embd=32', '--block_size=32', '--dtype=float32'] if dry
            else ['--n_layer=12', '--n_head=12', '--n_embd=768', '--block_size=1024']) + batch
    code, text, _ = run('model_size', [sys.executable, os.path.join(REPO, 'model_size.py'), '--world_size=1',
                                       '--vocab_size=65'] + size)
    estimate = json.loads(text.strip().splitlines()[-1]) if code == 0 else {}
    # the modes, then the levers of their host's time, each timed against train.py and the mode as it is: FSDP's
    # units of several blocks, its blocks kept gathered from forward to backward, both, AdamW stepped on each rank's
    # shards, and all three; DeepSpeed's own check
    # of each gradient before its global norm, which finds a non-finite one alone by default (in bf16 in a dry run
    # too: fp32 has no such check)
    fsdp, ds = ('fsdp_train.py', [], 0.9, 'ZeRO-3 / FSDP'), ('ds_train.py', ['--zero_stage=2'], 0.85, 'ZeRO-2')
    runs = [(('train.py', [], None, 'DDP'), '', []), (fsdp, '', []), (ds, '', []),
            (('decent_train.py', [], 0.9, 'DDP'), '', []),
            (fsdp, 'blocks_per_unit=4', ['--blocks_per_unit=4']),
            (fsdp, 'blocks_per_unit=12', ['--blocks_per_unit=12']),
            (fsdp, 'reshard_after_forward=False', ['--reshard_after_forward=False']),
            (fsdp, 'reshard_after_forward=False + blocks_per_unit=4', ['--reshard_after_forward=False',
                                                                       '--blocks_per_unit=4']),
            (fsdp, 'adamw_on_shards=True', ['--adamw_on_shards=True']),
            (fsdp, 'all three', ['--reshard_after_forward=False', '--blocks_per_unit=4', '--adamw_on_shards=True']),
            (ds, 'overflow_by_norm=False', ['--overflow_by_norm=False'] + ['--dtype=bfloat16'] * dry)]
    plain = {}  # script -> its ms as it is
    # train.py runs as the others' base, and a mode as it is beside its levers
    bases = {'train.py'} | {run[0][0] for run in runs if run[1] and wanted(f'{run[0][0]} speed, {run[1]}')}
    for (script, extra, goal, mode), lever, flags in runs:
        what = f'{script} speed' + (f', {lever}' if lever else '')
        if script not in chosen or not wanted(what) and not (script in bases and not lever):
            continue
        # enough steps after the 5th for the host profile's samples at 50 Hz: train.py's 26 ms steps on an H100 about
        # 120, the tiny model's 2 to 3 ms on CPU about 25 (500 steps, 50 samples, took 0.7 s more CPU)
        steps = 250 if dry else 100
        name = f'speed-{script[:-3]}' + (f"-{re.sub('[^A-Za-z0-9_=]+', '-', lever).strip('-')}" if lever else '')
        done = threading.Event()
        with ThreadPoolExecutor(1) as pool:  # the profile beside the run
            profile = pool.submit(host_profile, name, script, steps, done)
            try:
                code, text, secs = run(name, wrapped('peak+trace', torchrun(script, extra + model + flags + [
                    f'--out_dir={name}', f'--max_iters={steps}', f'--eval_interval={steps * 10}',
                    '--always_save_checkpoint=False']), script), fork=False)
            finally:  # else the profile would wait for the run's steps for ever
                done.set()
        try:
            host = profile.result()
        except (OSError, subprocess.SubprocessError) as e:  # a py-spy that would not start or end: not the run's fault
            host = f'; no host profile ({e})'
        ms = mean_ms(name)
        base_ms = base_ms or ms
        plain[script] = plain.get(script) or (None if lever else ms)
        ratio = base_ms / ms if ms and base_ms else None
        peak = [int(line.split()[-1]) for line in text.splitlines() if line.startswith('peak memory: ')]
        memory = (f"; peak {peak[0] / 2**20:,.1f} MiB" if peak else '') + \
            (f" (model_size.py: {sum(estimate[mode].values()) / 2**20:,.1f} MiB)" if mode in estimate else '')
        against = (f", {plain[script] / ms:.2f}x {script} as it is" if plain.get(script) else '') if lever else \
            (f" (goal {goal}x)" if goal else '')
        row('C', what, code == 0 and ms is not None and (dry or lever or goal is None or ratio >= goal),
            f"{ms:.1f} ms/iter, {ratio:.2f}x train.py" + against + memory + traced(text, ms) + host if ms else
            exited(code, secs))
    # the host's time for each part of a step, plain against FSDP2, on a model too small to compute much
    code, text, secs = run('host-time', [sys.executable, os.path.join(REPO, 'tests', 'host_time.py')] +
                           (['--n_layer=2', '--iters=3'] if dry else ['--device=cuda']))
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines() if line.startswith(('plain', 'fsdp'))}
    shards = re.search(r'on its shards .*: ([\d.]+)', text)
    row('C', 'host ms per part, plain vs FSDP2', code == 0 and len(rows) == 2 and shards is not None, ', '.join(
        f"{part} {plain} vs {fsdp}" for part, plain, fsdp in zip(('fwd+bwd', 'AdamW', 'clip'), *rows.values()))
        + f", AdamW on the shards {shards[1]}" if code == 0 and len(rows) == 2 and shards else exited(code, secs))


for part, seconds in plan:
    part_ends = time.time() + seconds if seconds else float('inf')
    {'A': part_a, 'B': part_b, 'L': part_l, 'C': part_c}[part]()

print(f'\n{time.time() - BEGAN:.0f} s in all\n| part | check | result | figure |\n| --- | --- | --- | --- |')
order = {part: i for i, part in enumerate('ABLC')}
for part, what, ok, figure in sorted(rows, key=lambda r: order[r[0]]):
    print(f"| {part} | {what} | {'ok' if ok else 'FAIL'} | {figure} |")
if args.out:
    shutil.make_archive(os.path.join(out, 'logs-' + ''.join(part for part, _ in plan)), 'gztar', logs)
sys.exit(0 if rows and all(ok for _, _, ok, _ in rows) else 1)
