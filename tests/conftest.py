"""Shared fixtures: the repo's scripts run as real processes (forked as torchrun would start them, launcher.py) in
temporary folders."""

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import launch, start

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / 'shared' / 'data'
SHAKESPEARE = SHARED_DATA / 'tinyshakespeare' / 'input.txt'

# The test files, slowest first, by their time in `pytest -n 3 --dist loadfile --durations=0 tests` on the 2-core
# machine (seconds, summed over their tests; the figures are 8e7e89f's run: 811 tests in 625 s, 1,825 s summed, 608 s
# a worker on average, so the order, an earlier run's, leaves little idle): each xdist worker takes the next file
# when it is done with one, so with the slow ones first the workers end within seconds of each other. xdist would
# otherwise order the files by their number of tests, which put the slowest last and left a worker idle for up to
# two minutes at the end. A file not listed goes after these. CPU: the CPU seconds of the file's whole process tree,
# `pytest -q` on that file alone, before and after a change (the figure that counts on 2 cores; wall time there is
# the other jobs' noise).
SLOWEST_FIRST = ['test_fault.py',  # 249; CPU alone 243 -> 215 s (its SIGTERM runs ride on the SIGKILL jobs);
                 # 170 -> 111 s with torchrun's workers forked (tests/forked_torchrun.py; this figure and the
                 # 94 -> 67, 58 -> 36 and 40 -> 14 below count every process of the tree, sampled from /proc,
                 # the forkserver's children too)
                 'test_interrupt.py',  # 63 (Ctrl-C in every entrypoint, prepare.py, bench.py; forked); CPU 49 -> 43 s
                 'test_fault_write.py',  # 118; CPU alone 124 -> 96 s (8 steps, a save every 2); 94 -> 67 forked
                 'test_ds.py',  # 111; CPU 89 s (91 with its runs without deepspeed in fresh interpreters)
                 'test_pp.py',  # 212 (4-rank runs: sharded pipelines, pp 2 x tp 2; 8 ranks sharded x tp 2); CPU 145 s
                 'test_cluster.py',  # 103, with bench_network.py's smoke runs forked from the test server
                 'test_slurm.py',  # 114; 93 s of CPU
                 'test_interop.py',  # 87; CPU alone 58 -> 36 s (its deterministic 2-rank reruns forked)
                 'test_saved_state.py',  # 69 with the shared runs' setup; 53 s of CPU
                 'test_gpu_check.py',  # 66-78 (its dry run's part A three runs at a time); CPU alone 73 -> 42 s
                 # with the dry run's one-process scripts forked
                 'test_fault_single.py',  # 69 with its killed and signalled runs forked (117-180 in fresh interpreters)
                 'test_hellaswag.py',  # 62; 58 s of CPU (70 with 2-step runs, full evals in the loop)
                 'test_fault_resize.py',  # 45
                 'test_compat.py',  # 40; CPU alone 40 -> 14 s (the old code's runs forked)
                 'test_keep.py',  # 52
                 'test_fsdp.py',  # 45
                 'test_fineweb.py',  # 51
                 'test_oom.py',  # 54 alone (`pytest -q` of the file on the 2-core machine, not yet in a full run)
                 'test_random_data.py',  # 17
                 'test_decent.py',  # 22
                 'test_prepare.py',  # 48
                 'test_runlock.py',  # 5 (the shared data's setup elsewhere)
                 'test_names_from_files.py',  # 8
                 'test_coming_from.py',  # 9
                 'test_tools_bad_input.py',  # 19
                 'test_diloco.py']  # 16; the rest under 15 each


def pytest_configure(config):
    if hasattr(config.option, 'loadscopereorder'):  # xdist's --no-loadscope-reorder: keep the order below
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


# a model small enough for a step in a few milliseconds, in fp32 on the CPU
TINY = ['--device=cpu', '--compile=False', '--n_layer=2', '--n_head=2', '--n_embd=32', '--block_size=32',
        '--batch_size=4', '--dropout=0.0', '--bias=True', '--learning_rate=3e-3', '--warmup_iters=2',
        '--lr_decay_iters=40', '--min_lr=3e-4', '--eval_iters=4', '--log_interval=1']


def env(nthreads=1):
    """The environment of a run: tiktoken offline, and nthreads threads per process (None: the environment's).
    torchrun gives each rank one thread; a process started alone takes one per core, and its OpenMP threads spin
    while the other xdist worker's runs hold a core: a 40-step run of the tiny model, with other jobs on the 2
    cores, took 713 s (181 s of CPU) with 2 threads and 58 s (12 s of CPU) with one. Where a test needs torch's own
    threads (nthreads=None), they wait for work asleep (OMP_WAIT_POLICY=PASSIVE), not spinning on a core that another
    worker's runs need: the same threads, the same sums."""
    e = dict(os.environ)
    e['TIKTOKEN_CACHE_DIR'] = str(SHARED_DATA / 'tiktoken_cache')  # tiktoken offline
    e['PYTHONUNBUFFERED'] = '1'
    if nthreads:
        e['OMP_NUM_THREADS'] = str(nthreads)
    else:
        e.setdefault('OMP_WAIT_POLICY', 'PASSIVE')
    e.pop('RANK', None)
    return e


def gpt2():
    """tiktoken's gpt2 encoding, read from the shared cache (offline) without setting TIKTOKEN_CACHE_DIR for the tests
    that run after (tiktoken keeps the encoding it loaded)."""
    saved = os.environ.get('TIKTOKEN_CACHE_DIR')
    os.environ['TIKTOKEN_CACHE_DIR'] = env()['TIKTOKEN_CACHE_DIR']
    try:
        import tiktoken
        return tiktoken.get_encoding('gpt2')
    finally:
        if saved is None:
            del os.environ['TIKTOKEN_CACHE_DIR']
        else:
            os.environ['TIKTOKEN_CACHE_DIR'] = saved

def run(script, *args, nproc=1, cwd, check=True, nthreads=1, nodes=None):
    """Runs one of the repo's scripts, on nproc ranks, in processes forked from a server that has imported torch
    (launcher.py: as torchrun would start them, in milliseconds instead of seconds). nthreads=None, the environment's
    threads, runs a fresh interpreter (under torchrun for several ranks): the server's OpenMP has one thread."""
    if nthreads == 1:
        p = launch(str(REPO / script), list(map(str, args)), env(), cwd, nproc=nproc, nodes=nodes)
    else:
        launcher = [] if nproc == 1 else ['-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={nproc}']
        p = subprocess.run([sys.executable, *launcher, str(REPO / script), *map(str, args)], cwd=cwd, env=env(nthreads),
                           capture_output=True, text=True, timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"{script} {' '.join(map(str, args))} on {nproc} exited {p.returncode}\n"
                             f"{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    return p


def begin(script, *args, cwd):
    """Starts one of the repo's scripts on one process, forked as run() forks it, and returns at once: the process (to
    signal or kill mid-run, as a fault; no interpreter's start-up to wait for first) and what launcher.finish() waits on
    for the CompletedProcess, its output and exit code."""
    started = start(str(REPO / script), list(map(str, args)), env(), cwd)
    return started[0][0], started


_ports_given = set()


def free_port():
    """A port for a process that binds it later (a rendezvous, a launcher's master port), picked below the kernel's
    ephemeral ports. One that bind(0) returned and was freed goes to the next bind(0) on the machine in 1 of ~14,000
    (measured), and the suite's gloo ranks and stores bind several a second while a launcher spends 5 to 30 s
    importing torch before it binds its port: a rendezvous then joined a stranger's socket. Here only another such
    pick can take it."""
    with open('/proc/sys/net/ipv4/ip_local_port_range') as f:
        low = int(f.read().split()[0])
    for _ in range(100):
        # random's own state may be seeded by a test: every xdist worker would pick the same ports
        port = random.SystemRandom().randrange(15000, 25000) if low >= 25000 else 0
        with socket.socket() as s:
            try:
                s.bind(('127.0.0.1', port))
            except OSError:  # in use
                continue
            if s.getsockname()[1] not in _ports_given:  # SLURM's three daemons get three
                _ports_given.add(s.getsockname()[1])
                return s.getsockname()[1]
    raise RuntimeError('no free port in 15000-25000')


def one_line_error(p, nproc=1):
    """The `error: ...` line of a run that had to fail: a non-zero exit and, on one process, nothing else on
    stderr (no traceback). With several ranks, each rank that failed may add its own."""
    assert p.returncode != 0, p.stdout[-2000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith('error: ')]
    assert errors, p.stderr[-2000:]
    if nproc == 1:
        assert p.stderr.strip() == errors[0]
    return errors[0]


def counts_tokens(state):
    """Whether a checkpoint's (or snapshot's) count of the tokens trained, which --epochs ends on, is its iterations at
    its config's global batch, as in a run that kept one batch."""
    c = state['config']
    return state['tokens_trained'] == state['iter_num'] * c['gradient_accumulation_steps'] * c['batch_size'] * \
        c['block_size'] and state['iter_num'] > 0


def read_metrics(out_dir):
    """{iter: loss} of the logged steps, and the list of eval rows, from a run's metrics.jsonl (where a loss that
    was not finite is null: NaN here)."""
    losses, evals = {}, []
    with open(Path(out_dir) / 'metrics.jsonl') as f:
        for line in f:
            row = {k: float('nan') if v is None else v for k, v in json.loads(line).items()}
            if 'loss' in row:
                losses[row['iter']] = row['loss']
            if 'val_loss' in row:
                evals.append(row)
    return losses, evals


WANDB_STUB = """import json, os
def _record(*call):
    with open(os.environ['WANDB_CALLS'], 'a') as f:
        f.write(json.dumps(call, default=str) + '\\n')
def init(**kwargs):
    _record('init', kwargs)
def log(row, **kwargs):
    _record('log', row)
"""


@pytest.fixture
def wandb_calls(tmp_path, monkeypatch):
    """A stand-in for the wandb package (not installed, and the tests are offline) on the runs' path: () -> the
    calls that the test's runs with --wandb_log=True made of it, [('init', kwargs), ('log', row), ...]."""
    (tmp_path / 'wandb_stub').mkdir()
    (tmp_path / 'wandb_stub' / 'wandb.py').write_text(WANDB_STUB)
    monkeypatch.setenv('PYTHONPATH', str(tmp_path / 'wandb_stub'))
    monkeypatch.setenv('WANDB_CALLS', str(tmp_path / 'wandb_calls.jsonl'))
    calls = tmp_path / 'wandb_calls.jsonl'
    return lambda: [tuple(json.loads(line)) for line in calls.read_text().splitlines()] if calls.exists() else []


@pytest.fixture(scope='session')
def data_dir(tmp_path_factory):
    """tiny Shakespeare, char-level and GPT-2 BPE, prepared once for the whole session."""
    assert SHAKESPEARE.exists(), f"{SHAKESPEARE} is missing: the tests need ../shared/data beside the repo"
    root = tmp_path_factory.mktemp('data')
    run('prepare.py', 'shakespeare_char', f'--input={SHAKESPEARE}', f'--out_root={root}', cwd=root)
    run('prepare.py', 'shakespeare', f'--input={SHAKESPEARE}', f'--out_root={root}', cwd=root)
    return root


# DeepSpeed builds its C++ ops the first time they are used (on 2 cores its shared-memory communicator takes about
# a minute, CPU Adam two and a half) into TORCH_EXTENSIONS_DIR: one folder for every test of a session, and of the
# sessions after it on the same machine, so that each op is built once
os.environ.setdefault('TORCH_EXTENSIONS_DIR', str(Path.home() / '.cache' / 'torch_extensions' / 'nanogpt-tests'))


@pytest.fixture(scope='session')
def shared_run(tmp_path_factory, data_dir):
    """shared_run(script, *args, nproc=1) -> the out_dir of that run of the tiny model on char-level Shakespeare,
    made once per session (once per xdist worker) for every test that compares against it or starts from it. The
    folder is shared: read it, or copy it before anything writes into it."""
    done = {}

    def shared(script, *args, nproc=1):
        key = (script, nproc, *map(str, args))
        if key not in done:
            out = tmp_path_factory.mktemp('shared') / 'run'
            run(script, *TINY, f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={out}', *args, nproc=nproc,
                cwd=out.parent)
            done[key] = out
        return done[key]
    return shared
