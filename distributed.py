"""
Process start-up and the collectives every entrypoint shares. Under torchrun (srun starting one a node), the deepspeed
launcher or dlrover-run a process learns its place from RANK, LOCAL_RANK and WORLD_SIZE; without them it is a group
of one, so the entrypoints' code is the same on one process as on many.

    rank, local_rank, world_size = start(backend, device)   # the process group, SIGTERM noted, teardown at exit
    nonfinite, stop = agree(nonfinite)                       # the ranks decide alike: a step, SIGTERM, a failed save
    rngs = gather_rng() ... restore_rng(rngs)                # every rank's RNG, for exact resume
"""

import atexit
import errno
import os
import signal
import socket
import sys
import time
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from checkpoint import exit_after_failed_save, remove_unfinished_writes, save_failed

_stop_signals = []
_launcher = []  # the pid of the launcher that started this rank (torchrun's agent), whose end stops the run
_queued = []  # the verdicts agree() left on the device for the host to read at the next step


def torchrun_env():
    """(rank, local_rank, world_size, local_world_size) as the launcher set them, or a group of one's."""
    if 'RANK' not in os.environ:
        tasks = int(os.environ.get('SLURM_STEP_NUM_TASKS') or 1)
        if tasks > 1:  # `srun python train.py`: srun's tasks know no RANK, and each would train alone over out_dir
            script, first = os.path.basename(sys.argv[0]), os.environ.get('SLURM_PROCID', '0') == '0'
            sys.exit(f"error: srun started {tasks} tasks of {script} without torchrun, which would each train alone: "
                     f"start one torchrun a node, `srun --ntasks-per-node=1 torchrun --nnodes=$SLURM_NNODES "
                     f"--nproc_per_node=N --rdzv-backend=c10d --rdzv-endpoint=HEAD:29500 {script} ...`, or submit "
                     f"`sbatch slurm/torchrun.sbatch {script} ...`" if first else 1)  # the line once, not a task's
        return 0, 0, 1, 1
    rank, world_size = int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])
    if 'LOCAL_RANK' not in os.environ:
        # env:// with no launcher: a Kubeflow PyTorchJob's plain `python` (a process a pod), or ranks started by hand.
        # Each took itself for its node's first rank: ranks on one host wrote one memory snapshot file at once, and
        # would all take cuda:0. Their places come from the hosts that all ranks name, through the group's store
        local_rank, local_world_size = place_on_node(rank, world_size)
        os.environ['LOCAL_RANK'], os.environ['LOCAL_WORLD_SIZE'] = str(local_rank), str(local_world_size)
    return rank, int(os.environ['LOCAL_RANK']), world_size, int(os.environ.get('LOCAL_WORLD_SIZE', world_size))


_store = []  # the store that place_on_node made, which the process group then uses (start, env_store)


def env_store():
    """The store for init_process_group where place_on_node made one (its port is taken by it), else None."""
    return _store[0] if _store else None


def place_on_node(rank, world_size):
    """(local rank, local world size) of an env:// rank that no launcher placed: its order among the ranks that
    run on its host (its hostname; a pod's is its own), as torchrun would have numbered them."""
    if world_size == 1:
        return 0, 1
    if not os.environ.get('MASTER_ADDR') or not os.environ.get('MASTER_PORT'):
        sys.exit("error: RANK and WORLD_SIZE are set, but not MASTER_ADDR and MASTER_PORT (rank 0's host and a free "
                 "port on it), which env:// needs: set them, or launch with torchrun")
    store = dist.TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), world_size, rank == 0,
                          timeout=timedelta(minutes=30))
    store.set(f'host/{rank}', socket.gethostname())
    hosts = [store.get(f'host/{r}').decode() for r in range(world_size)]  # (each waits for that rank's)
    _store.append(store)
    mine = [r for r, host in enumerate(hosts) if host == hosts[rank]]
    return mine.index(rank), len(mine)


def ranks_per_node():
    """LOCAL_WORLD_SIZE, where every node runs as many ranks, else None (a collective): torchrun lets each node start
    its own --nproc_per_node, and a layout by nodes that each rank built from its own node's count would differ
    between nodes, whose groups then wait on each other with no end and no message."""
    sizes = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, torchrun_env()[3])
    return sizes[0] if len(set(sizes)) == 1 else None


def on_every_rank(check, *args):
    """check(*args), whose bad input exits in one line, on every rank (a collective): where it fails on some ranks
    only (the data missing on one node), every rank exits with the first such rank's line, which names its host;
    the others would fail at their next collective with gloo's traceback, and the line be in one node's log alone."""
    try:
        result, failed = check(*args), None
    except SystemExit as e:
        result, failed = None, str(e.code)
    verdicts = [failed and (socket.gethostname(), failed)] * dist.get_world_size()
    if len(verdicts) > 1:
        dist.all_gather_object(verdicts, verdicts[0])
    bad = [(r, v) for r, v in enumerate(verdicts) if v]
    if len(bad) == len(verdicts):  # alike on every rank: its own line says it all
        sys.exit(failed)
    if bad:
        r, (host, line) = bad[0]
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        sys.exit(f"error: rank {r} on host {host}{more}: {line.removeprefix('error: ')}")
    return result


def launch_with(nproc, nnodes=1):
    """The torchrun command that starts this script on nproc ranks a node, for an error where a setting needs
    several ranks and the run was started by plain python (a group of one, which cannot hold them)."""
    script = os.path.basename(sys.argv[0])
    if nnodes == 1:
        return f"plain python starts one process: launch with `torchrun --nproc_per_node={nproc} {script} ...`"
    return (f"plain python starts one process: launch with `torchrun --nnodes={nnodes} --nproc_per_node={nproc} "
            f"--rdzv-backend=c10d --rdzv-endpoint=HEAD:29500 {script} ...` on each of {nnodes} nodes")


def groups_of(setting, size, world_size, of='the world size'):
    """The one-line error for a setting whose groups of size ranks do not divide the world size (or its part, of)."""
    if size > 1 and 'RANK' not in os.environ:
        return f"{setting}={size} needs {size} processes (or a multiple), and {launch_with(size)}"
    return f"{setting}={size} does not divide {of} {world_size}: use a divisor of it"


def pick_device(device):
    """(device, device_type): 'auto' and 'cuda' become this process's GPU (cuda:LOCAL_RANK), or 'auto' the CPU
    where there is none; a device torch does not know, or a GPU it cannot see, is a one-line error."""
    local_rank = torchrun_env()[1]
    if device == 'auto':
        device = 'cuda' if torch.cuda.is_available() else 'cpu'
    if device == 'cuda':
        device = f'cuda:{local_rank}'
    try:
        device_type = torch.device(device).type
    except RuntimeError:
        sys.exit(f"error: device={device!r} is not a device torch knows: use auto, cpu, cuda, cuda:N or mps")
    if device_type == 'cuda' and not torch.cuda.is_available():
        sys.exit("error: device=cuda but torch sees no GPU: use --device=cpu (or auto)")
    return device, device_type


def start(backend, device, deepspeed=False, config=None):
    """Joins the process group (or makes a group of one), tears it down at exit whatever the way out, and notes a
    SIGTERM for agree(); with config, refuses ranks started with other settings than rank 0's (same_settings).
    Returns (rank, local_rank, world_size)."""
    rank, local_rank, world_size, _ = torchrun_env()
    if 'RANK' in os.environ:  # torchrun starts each rank in a session of its own, which its death leaves running
        _launcher.append(os.getppid())
    device_type = torch.device(device).type
    if device_type == 'cuda':
        torch.cuda.set_device(device)
    # a group of one's own; or the store that env:// ranks with no launcher met in (place_on_node), else env://'s
    store = dist.HashStore() if world_size == 1 and 'RANK' not in os.environ else env_store()
    if os.environ.get('TORCHELASTIC_USE_AGENT_STORE') == 'True':
        # torchrun's store outlives a restart of the workers, and gloo would read the dead workers' addresses from
        # it (and fail the restart): each incarnation of the group gets a store of its own
        store = incarnation_store(rank, world_size)
    if 'RANK' not in os.environ and deepspeed:
        os.environ.setdefault('LOCAL_RANK', '0')  # DeepSpeed asks for what its launchers set
    if store is not None or not deepspeed:
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size,
                                device_id=torch.device(device) if device_type == 'cuda' else None)
    # An early exit (a one-line error, an exception) tears the group down too, and then leaves as finish() does,
    # without the interpreter's teardown of C++ objects: there gloo's threads aborted 5 of 8 two-rank runs stopped by
    # max_nonfinite_steps ('terminate called without an active exception', exit -6 instead of 1). Every exit but
    # finish()'s is a failure; atexit runs its functions last in, first out, so the exit goes last.
    atexit.register(_exit_failed)
    atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
    # SIGTERM is how SLURM and Kubernetes preempt a job (torchrun passes it on to the workers): the loop learns of
    # it from agree() at the end of a step, saves a checkpoint and exits cleanly. Ctrl-C (SIGINT) is a preemption by
    # hand: the same, but the exit is non-zero (finish), since the run is not done
    signal.signal(signal.SIGTERM, lambda signum, frame: _stop_signals.append(signum))
    signal.signal(signal.SIGINT, _interrupted)
    # Closing the terminal of a run started there without nohup (SIGHUP) would kill it where it stands, losing the
    # steps since its last save: it stops as at a Ctrl-C instead. Under nohup, which ignores SIGHUP, it trains on
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, lambda signum, frame: _stop_signals.append(signum))
    # `... | tee log`: the Ctrl-C ends tee too, and every print after it (the handler's first) would raise
    # BrokenPipeError, a traceback in place of the save
    sys.stdout, sys.stderr = (s if isinstance(s, Unread) else Unread(s) for s in (sys.stdout, sys.stderr))
    if config is not None and dist.is_initialized() and dist.get_world_size() > 1:
        same_settings(config)
    return rank, local_rank, world_size


def same_settings(config):
    """A one-line error on every rank (a collective) where a rank was started with other settings than rank 0's:
    torchrun passes each node's ranks the command typed on that node, and two nodes given another --batch_size each
    trained on with no word, config.json saying rank 0's. Paths may differ between nodes (where each mounts the
    data), and so may wandb's run name (config/finetune_shakespeare.py's is the time)."""
    mine = {k: v for k, v in config.items() if not k.startswith('wandb_') and not (isinstance(v, str) and '/' in v)}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (socket.gethostname(), mine))
    first = every[0][1]
    for r, (host, theirs) in enumerate(every):
        differ = sorted(k for k in theirs.keys() | first.keys() if theirs.get(k) != first.get(k))
        if differ:
            key = differ[0]
            sys.exit(f"error: rank {r} on host {host} was started with --{key}={theirs.get(key)}, rank 0 with "
                     f"--{key}={first.get(key)}: start every node with the same command and config file")


class Unread:
    """A stream (stdout, stderr) whose reader may be gone: what is written after it went goes nowhere."""
    def __init__(self, stream):
        self.stream = stream

    def __getattr__(self, name):
        return getattr(self.stream, name)

    def write(self, text):
        try:
            return self.stream.write(text)
        except OSError as e:
            self.gone(e)
            return len(text)

    def flush(self):
        try:
            self.stream.flush()
        except OSError as e:
            self.gone(e)

    def gone(self, e):
        # a pipe with no reader (EPIPE), or a terminal that was closed (EIO): its buffer's flush goes nowhere too
        if e.errno not in (errno.EPIPE, errno.EIO):
            raise e
        os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())


def _interrupted(signum, frame):
    if signal.SIGINT not in _stop_signals:
        _stop_signals.append(signum)
        if torchrun_env()[0] == 0:
            print("Ctrl-C: finishing this step and saving a checkpoint (Ctrl-C again to leave at once)", flush=True)
        return
    # a second Ctrl-C leaves now: checkpoints are written to temporary files and renamed when complete, so one
    # being written is lost (its temporary file removed), never the one before it
    remove_unfinished_writes()
    # (the run may have saved nothing yet, or hold a newer memory snapshot: the line names no state it cannot know)
    print("error: interrupted twice: left without saving; a save being written is dropped, those before it kept: "
          "rerun the same command to go on from the run's newest saved state", file=sys.stderr, flush=True)
    os._exit(130)


def stop_signal():
    """The name of the signal that stopped the run, for the loop's message."""
    if signal.SIGINT in _stop_signals:
        return 'SIGINT (Ctrl-C)'
    if signal.SIGHUP in _stop_signals:
        return 'SIGHUP (its terminal closed)'
    if signal.SIGTERM in _stop_signals:
        return 'SIGTERM'
    # the ranks stop together: where another rank's signal (or launcher's end) stopped this one, it says so
    if _launcher and ('launcher' in _stop_signals or os.getppid() != _launcher[0]):
        return f'the launcher (pid {_launcher[0]}) is gone'
    return 'another rank was stopped'


def device_memory(device):
    """Bytes this process may allocate on device: the GPU's free memory, or the host's available RAM."""
    if torch.device(device).type == 'cuda':
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open('/proc/meminfo') as f:
            return int(next(line for line in f if line.startswith('MemAvailable:')).split()[1]) * 1024
    except (OSError, StopIteration, ValueError, IndexError):
        return os.sysconf('SC_AVPHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')


def check_fits(model_args, device, shards=1):
    """Refuses, in one line, a model whose fp32 weights alone (before gradients, AdamW state and activations,
    which triple it and more) exceed the memory of the device, before a byte of it is built: otherwise it is built
    until the machine runs out, with no output. shards: the ways the weights are split (FSDP, ZeRO-3, TP)."""
    from model import count_params  # model.py knows nothing of distribution; this only counts its parameters
    n = count_params(**model_args)
    need, have = 4 * n / shards, device_memory(device)
    if need > have:
        sys.exit(f"error: the model has {n:,} parameters, {need / 2**30:,.1f} GiB of fp32 weights per rank, more "
                 f"than the {have / 2**30:,.1f} GiB free on {device}: make n_layer or n_embd smaller (size it with "
                 f"python model_size.py)")
    return n


def split_accumulation(gradient_accumulation_steps, dp_size):
    """The micro-steps of each data-parallel rank: the config's count is the total over all of them, so that the
    global batch is the same at any world size."""
    steps = gradient_accumulation_steps
    if steps % dp_size:
        # nnScaler and minGPT-DDP keep a rank's batch as ranks are added: say which value does that here
        grow, near = steps * dp_size, max(dp_size, round(steps / dp_size) * dp_size)
        keep = f", or ={near} to keep the global batch near its size" if near != grow else ""
        sys.exit(f"error: gradient_accumulation_steps={steps} does not divide across {dp_size} data-parallel ranks: "
                 f"it counts micro-steps over all ranks, so make it a multiple of {dp_size}: "
                 f"--gradient_accumulation_steps={grow} keeps each rank's batch as on one process and grows the global "
                 f"batch {dp_size}x (nnScaler's and minGPT-DDP's way){keep}")
    return gradient_accumulation_steps // dp_size


def use_deterministic_algorithms(device_type):
    """Deterministic kernels, so that reruns give identical curves, on GPUs too (dropout, which the caller turns
    off, aside)."""
    os.environ.setdefault('CUBLAS_WORKSPACE_CONFIG', ':4096:8')  # cuBLAS is deterministic only with a fixed workspace
    torch.use_deterministic_algorithms(True)
    if device_type == 'cuda':
        torch.backends.cudnn.benchmark = False
        # the fused attention kernels add up their backward in a varying order; the math one does not
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)


def agree(nonfinite, iter_num=None, overflow=None):
    """(nonfinite, stop) as every rank sees them: whether any rank's step was not finite (a tensor, so that the
    check queues on the device), and whether any rank was sent SIGTERM. One small all-reduce carries both, and
    whether any rank's storage checkpoint could not be written in the background: then every rank stops here.
    Given the step's iter_num, the host does not wait for the verdict: it returns at once the device's flag of a
    non-finite step, by which the fused AdamW skips its update there (found_inf), and verdicts() reads the rest
    at the next step, once the host has queued this step's update (a read now would stall the CPU that should run
    ahead of the GPU). overflow (float16's, a tensor): whether a rank's gradients overflowed, a step GradScaler
    skips by itself; verdicts() hands it on, so that such steps are counted too."""
    flags = torch.zeros(4, device=nonfinite.device)
    flags[0] = nonfinite  # on the device; the host's flags are filled in, not copied, so nothing waits here either
    if _launcher and os.getppid() != _launcher[0] and 'launcher' not in _stop_signals:
        # a killed torchrun (kill -9, the OOM killer) would leave this rank training on to max_iters, holding out_dir
        # and its device, with nothing to stop or restart it: it stops as at a SIGTERM
        _stop_signals.append('launcher')
    flags[1] = float(bool(_stop_signals))
    flags[2] = float(save_failed())
    if overflow is not None:
        flags[3] = overflow
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if iter_num is None:
        return read_verdict(flags)
    if flags.is_cuda:  # copied to the host in the stream's order, with an event to wait for that copy alone
        host, done = flags.to('cpu', non_blocking=True), torch.cuda.Event()
        done.record()
        _queued.append((iter_num, host, done))
    else:
        _queued.append((iter_num, flags, None))
    return flags[0]


def skip_on_device(optimizer, nonfinite):
    """The optimizer's next step leaves the weights, its moments and its step count as they are where nonfinite (a
    device tensor) is 1, decided on the device: the fused AdamW kernel reads it as found_inf, as it reads
    GradScaler's. A loaded state may have turned fusing off (nanoGPT's checkpoints from a CPU): it is on again."""
    for group in optimizer.param_groups:
        group.update(fused=True, foreach=None)
    optimizer.found_inf = nonfinite


def read_verdict(flags):
    nonfinite, stop, failed, _ = flags.tolist()
    if failed:
        exit_after_failed_save()
    return bool(nonfinite), bool(stop)


def verdicts():
    """The verdicts agree() queued (a step's, read at the next: the device has long reached them), as
    (iter_num, nonfinite, stop, overflow)."""
    while _queued:
        iter_num, flags, done = _queued.pop(0)
        if done is not None:
            done.synchronize()
        yield iter_num, *read_verdict(flags), bool(flags[3])


def gather_rng():
    """Every rank's RNG states, in rank order (a collective): they go into each checkpoint."""
    rngs = [None] * dist.get_world_size()
    dist.all_gather_object(rngs, rng_state())
    return rngs


def rng_state():
    """This rank's RNG states: the CPU's, and the GPU's once CUDA is up."""
    return {'cpu': torch.get_rng_state(), **({'cuda': torch.cuda.get_rng_state()} if torch.cuda.is_initialized()
                                             else {})}


def restore_rng(rngs, print0=print, tp_group=None):
    """Takes back this rank's RNG states from a checkpoint's; at another world size dropout starts afresh. The ranks
    of tp_group (a tensor-parallel group) then take its first rank's: their replicated activations' dropout masks
    must agree, and at another layout of the same world size (4 ranks FSDP -> 2x2 TP x FSDP) they had saved the
    states of different data-parallel ranks."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if len(rngs) == world_size:
        rng = [rngs[rank]]
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            dist.broadcast_object_list(rng, group=tp_group, group_src=0)
        torch.set_rng_state(rng[0]['cpu'])
        if 'cuda' in rng[0] and torch.cuda.is_initialized():
            torch.cuda.set_rng_state(rng[0]['cuda'])
    elif rngs:
        print0(f"checkpoint was written by {len(rngs)} ranks, not {world_size}: dropout masks start afresh")


def state_bytes(parameters, optimizers):
    """Bytes of parameters, gradients and optimizer state that this rank holds: a full replica of each under DDP,
    its shards under FSDP (a DTensor counts its local piece)."""
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t
    size = lambda tensors: sum(local(t).numel() * t.element_size() for t in tensors)
    parameters = list(parameters)
    return dict(param_bytes=size(parameters), grad_bytes=size(p.grad for p in parameters if p.grad is not None),
                optim_bytes=size(v for o in optimizers for s in o.state.values() for v in s.values()
                                 if torch.is_tensor(v)))


def _exit_failed():
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def finish():
    """The normal end: every rank leaves together (gloo's teardown has aborted when one rank left while another
    was still in a collective), and the process exits here, with what the interpreter's end would run (atexit) but
    not its teardown of C++ objects: there a gloo rank has still aborted, after its group was destroyed ('terminate
    called without an active exception', no Python frame left; 1 of 175 two-rank train.py runs), which fails a run
    that is done and would make torchrun restart it."""
    dist.barrier()
    dist.destroy_process_group()
    # a run stopped by hand, or by its terminal's end, is not done: 128 + the signal, as a shell reports it
    by_hand = next((s for s in (signal.SIGINT, signal.SIGHUP) if s in _stop_signals), None)
    if by_hand and torchrun_env()[0] == 0:
        print(f"error: stopped by {'Ctrl-C' if by_hand == signal.SIGINT else 'SIGHUP'} after saving a checkpoint: "
              f"rerun the same command to resume", file=sys.stderr)
    atexit.unregister(_exit_failed)  # this is the way out that succeeds
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 + by_hand if by_hand else 0)


def incarnation_store(rank, world_size):
    """A store for init_process_group under torchrun's agents that this incarnation of the worker group alone uses.
    The agents' store outlives a restart, and gloo (NCCL too) would read the dead workers' addresses from it and fail
    the restart; nor can the restart count name the incarnation, since it differs between nodes (an agent that
    restarts its workers because another node's died counts no restart). So rank 0 serves a new store on a free
    port and posts its port and a new token in the agents' store; the other ranks take what is posted once the store
    there holds that token (a post left by the last incarnation names a dead rank 0's port)."""
    agents = dist.TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), world_size, is_master=False)
    if rank == 0:
        token = uuid.uuid4().hex
        store = dist.TCPStore(os.environ['MASTER_ADDR'], 0, world_size, is_master=True, wait_for_workers=False)
        store.set('token', token)
        agents.set('nanogpt/incarnation', f'{store.port} {token}')
        return store
    while True:
        port, token = agents.get('nanogpt/incarnation').decode().split()
        try:
            socket.create_connection((os.environ['MASTER_ADDR'], int(port)), timeout=2).close()  # a dead one refuses
            store = dist.TCPStore(os.environ['MASTER_ADDR'], int(port), world_size, is_master=False,
                                  timeout=timedelta(seconds=10))
            if store.get('token').decode() == token:  # not another store that took the port since
                store.set_timeout(timedelta(minutes=30))
                return store
        except (OSError, RuntimeError):  # an old post
            pass
        time.sleep(0.1)
