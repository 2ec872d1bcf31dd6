"""Runs the repo's scripts as processes forked from a server that has imported torch once (multiprocessing's
forkserver). A fresh interpreter spends about 2 s of CPU on `import torch` and on torch._dynamo, which torch's
optimizer imports at its first param group; the suite starts hundreds of such processes on 2 cores, and a forked one
starts in milliseconds. Each process is still its own: its own interpreter state from the server's snapshot (which
has run no torch op, so no thread pool, and holds none of the repo's modules), its own gloo group, its own exit.

Several ranks get what torchrun gives its workers: the RANK/WORLD_SIZE/... environment and an agents' store that
this process serves, so distributed.start() takes the same path as under torchrun (a store per incarnation of the
group). As under torchrun, a rank that fails brings the others down (SIGTERM, then SIGKILL) and the run exits 1.
What is about torchrun itself (its restarts, kills of a worker, signals passed on, SLURM) runs torchrun."""

import atexit
import importlib.machinery
import json
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import resource
import runpy
import shutil
import subprocess
import sys
import tempfile
import threading
import time

# what every entrypoint imports and would take a fresh interpreter seconds; none of them starts a thread on import.
# inductor's compile_fx: deepspeed.initialize imports it in every ds_train.py process (its Muon optimizer's
# torch.compile, at the optimizer's check), 0.7 s of CPU each time, the larger part of a forked rank's start.
# torch's pipelining: 0.05 s in each pp_train.py process. Not deepspeed: it would save 0.26 s of CPU in each
# ds_train.py process, but every other fork of the larger server cost more (test_pp.py with -n 2: 101-103 s without,
# 110-114 s with it, in turns on the 2-core machine). cpuinfo_once: py-cpuinfo's answer asked once a process
PRELOAD = ['torch', 'torch._dynamo', 'torch.distributed.checkpoint', 'torch.distributed.fsdp', 'numpy',
           'torch._inductor.compile_fx', 'torch.distributed.pipelining', 'cpuinfo_once']
_context = None
_clean_path = None


def _start_server(env):
    """The forkserver, started once per test process with the settings its children need from their start:
    one OpenMP thread (read when torch loads libgomp) and unbuffered stdout (read when the interpreter starts), and
    this folder on its path, for PRELOAD's modules of it (Python 3.11's forkserver takes no sys.path of ours)."""
    global _context, _clean_path
    if _context is None:
        # sys.path as a fresh `python script.py` has it, past its first entry (the script's folder) and without
        # PYTHONPATH's entries, which each child puts first from its own environment
        bare = {k: v for k, v in env.items() if k != 'PYTHONPATH'}
        _clean_path = json.loads(subprocess.check_output([sys.executable, '-c', 'import sys, json; '
                                                          'print(json.dumps(sys.path[1:]))'], env=bare, text=True))
        saved = dict(os.environ)
        here = os.path.dirname(os.path.abspath(__file__))
        os.environ.update(OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1',
                          PYTHONPATH=os.pathsep.join(filter(None, [here, os.environ.get('PYTHONPATH')])))
        try:
            _context = multiprocessing.get_context('forkserver')
            _context.set_forkserver_preload(PRELOAD)
            multiprocessing.forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
    return _context


def _child(script, args, env, cwd, out, err, path):
    """In the forked process: what `python script args` would do, with its stdout and stderr into the files out and
    err (appended to, so that several ranks share them as torchrun's workers share its streams)."""
    for fd, name in ((1, out), (2, err)):
        os.dup2(os.open(name, os.O_WRONLY | os.O_APPEND), fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if env.get('TEST_AS_MARGIN') and env.get('RANK', '0') in env.get('TEST_AS_RANKS', env.get('RANK', '0')).split(','):
        # a test of running out of memory: the rank (of TEST_AS_RANKS, or each) may map this many bytes more than
        # it has now, so that an allocation beyond fails at once, as on a full device, whatever the machine's RAM
        with open('/proc/self/status') as f:
            now = int(next(line for line in f if line.startswith('VmSize:')).split()[1]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (now + int(env['TEST_AS_MARGIN']),) * 2)
    given = [os.path.abspath(p) for p in env.get('PYTHONPATH', '').split(os.pathsep) if p]  # a test's stand-in modules
    as_main(script, args, [*given, *path])


def as_main(script, args, path):
    """Runs script with args in this process as `python script args` would (path: sys.path past the script's
    folder), to the process's exit."""
    sys.argv = [script, *args]
    sys.path[:] = [os.path.dirname(script), *path]
    code = 0
    try:
        runpy.run_path(script, run_name='__main__')
    except SystemExit as e:  # as the interpreter reads sys.exit's argument
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:
        sys.excepthook(*sys.exc_info())  # as the interpreter reports it: through the hooks a script installed
        code = 1
    # the interpreter's end: wait for the threads that are not daemons, then the atexit functions
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def start(script, args, env, cwd, nproc=1, nodes=None):
    """Starts script with args on nproc ranks and returns at once: (the ranks' processes, what finish() needs). A
    test that signals or kills a rank (its .pid) mid-run, as a fault, saves a fresh interpreter's start-up. nodes:
    (folder, ranks) of each node, its ranks run there (their cwd), numbered as torchrun's agents number them."""
    context = _start_server(env)
    main = sys.modules['__main__']
    if getattr(main, '__spec__', None) is None and hasattr(main, '__file__'):
        # a script's own process (tests/gpu_check.py's dry run), not pytest's: multiprocessing would run the script
        # again in each child, as __mp_main__, before _child; the child runs a script of its own and needs none of
        # it (a main module named __main__ is one that multiprocessing leaves alone)
        main.__spec__ = importlib.machinery.ModuleSpec('__main__', None)
    tmp = tempfile.mkdtemp(prefix='launch-')
    out, err = os.path.join(tmp, 'out'), os.path.join(tmp, 'err')
    open(out, 'w').close()
    open(err, 'w').close()
    store, envs = None, [env]
    if nproc > 1:
        import torch.distributed as dist  # the agents' store; a test process has imported torch already
        store = dist.TCPStore('127.0.0.1', 0, nproc, is_master=True, wait_for_workers=False)
        common = dict(env, MASTER_ADDR='127.0.0.1', MASTER_PORT=str(store.port), WORLD_SIZE=str(nproc),
                      LOCAL_WORLD_SIZE=str(nproc), ROLE_WORLD_SIZE=str(nproc), GROUP_RANK='0', GROUP_WORLD_SIZE='1',
                      ROLE_NAME='default', TORCHELASTIC_USE_AGENT_STORE='True', TORCHELASTIC_RESTART_COUNT='0',
                      TORCHELASTIC_MAX_RESTARTS='0', TORCHELASTIC_RUN_ID='none')
        envs = [dict(common, RANK=str(r), LOCAL_RANK=str(r), ROLE_RANK=str(r)) for r in range(nproc)]
    cwds = [cwd] * nproc
    if nodes:
        places = [(folder, i, local, size) for i, (folder, size) in enumerate(nodes) for local in range(size)]
        assert len(places) == nproc, (nodes, nproc)
        cwds = [folder for folder, *_ in places]
        for e, (_, i, local, size) in zip(envs, places):
            e.update(LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(size), GROUP_RANK=str(i),
                     GROUP_WORLD_SIZE=str(len(nodes)))
    procs = [context.Process(target=_child, args=(script, args, e, str(c), out, err, _clean_path))
             for e, c in zip(envs, cwds)]
    for p in procs:
        p.start()
    return procs, (script, args, tmp, store)


def finish(started, timeout=600):
    """Waits for the ranks that start() returned; a CompletedProcess with both streams (every rank's) and the exit
    code (the process's own for one rank; 0 or 1 for several, as torchrun's)."""
    procs, (script, args, tmp, _) = started
    try:
        deadline, kill_at = time.time() + timeout, None
        while any(p.exitcode is None for p in procs):
            multiprocessing.connection.wait([p.sentinel for p in procs if p.exitcode is None], timeout=1)
            now = time.time()
            if now > deadline:
                for p in procs:
                    p.kill()
                raise subprocess.TimeoutExpired([script, *args], timeout)
            if kill_at is None and any(p.exitcode not in (None, 0) for p in procs):  # as torchrun: stop the others
                kill_at = now + 30
                for p in procs:
                    if p.exitcode is None:
                        p.terminate()
            if kill_at is not None and now > kill_at:
                for p in procs:
                    p.kill()
        with open(os.path.join(tmp, 'out')) as f, open(os.path.join(tmp, 'err')) as g:
            stdout, stderr = f.read(), g.read()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    code = procs[0].exitcode if len(procs) == 1 else int(any(p.exitcode != 0 for p in procs))
    return subprocess.CompletedProcess([script, *args], code, stdout, stderr)


def launch(script, args, env, cwd, nproc=1, timeout=600, nodes=None):
    """Runs script with args on nproc ranks to its end: finish()'s CompletedProcess."""
    return finish(start(script, args, env, cwd, nproc, nodes), timeout)
