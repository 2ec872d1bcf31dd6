"""Fault tolerance in real processes, and the helpers of every test_fault*.py: SIGKILLed workers of 2-rank runs
under elastic torchrun (all four entrypoints) and dlrover-run, two nodes with a /dev/shm each, SIGTERM passed on by
torchrun. These compare against one uninterrupted run per entrypoint, made once (shared_run). The other faults:
test_fault_write.py (a kill mid-write), test_fault_resize.py (another world size, damaged checkpoints),
test_fault_single.py (one process: SIGTERM, damaged snapshots, a run started afresh, non-finite losses)."""

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import launcher
from checkpoint import snapshot_dir
from conftest import REPO, TINY, begin, counts_tokens, env, free_port, one_line_error, read_metrics, run


# torchrun, its own command line, forking its workers (every restarted group's too) from itself once it has imported
# torch (tests/forked_torchrun.py): a fresh interpreter's 2.4 s of CPU importing torch and torch._dynamo was most of
# these tests' CPU (5 or 6 of them a job). What the tests prove is torchrun's: its rendezvous, its restarts of the
# group after a worker's death, the environment and store it gives the workers, the SIGTERM it passes on
TORCHRUN = [sys.executable, str(REPO / 'tests' / 'forked_torchrun.py'), '--run-path', '--start-method=fork']


def elastic(script, *args, nproc=2, max_restarts=3):
    """The command of an elastic torchrun job of one node (1 to 2 allowed), with the rendezvous settings that make
    restarts quick (see the README)."""
    return [*TORCHRUN, '--nnodes=1:2', f'--nproc_per_node={nproc}',
            f'--max-restarts={max_restarts}', '--rdzv-backend=c10d', f'--rdzv-endpoint=127.0.0.1:{free_port()}',
            '--rdzv-conf=last_call_timeout=1', str(REPO / script), *map(str, args)]


def workers(pid):
    """The training processes that the launcher (pid) started (dlrover-run's children include its job master): where
    torchrun forks its workers (TORCHRUN), the process under each worker that runs the script."""
    def read(path):  # a process that ends meanwhile makes /proc answer ENOENT or, while it is reaped, ESRCH
        try:
            with open(path, 'rb') as f:
                return f.read()
        except (FileNotFoundError, ProcessLookupError):
            return b''

    def training(pid):
        children = [int(c) for c in read(f'/proc/{pid}/task/{pid}/children').split()]
        return [c for c in children if b'train.py' in read(f'/proc/{c}/cmdline')]
    if b'forked_torchrun.py' not in read(f'/proc/{pid}/cmdline'):
        return training(pid)
    return [runs for worker in training(pid) for runs in training(worker)]


def logged_iters(out_dir):
    try:
        with open(Path(out_dir) / 'metrics.jsonl') as f:
            return [json.loads(line)['iter'] for line in f if '"loss"' in line and line.endswith('\n')]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def killed_past(script, *args, out_dir, iters, cwd, ready=lambda: True):
    """Starts script on one process (forked as tests/launcher.py forks it) and SIGKILLs it once it has logged
    iteration `iters` and ready() holds; returns the run's memory snapshot folder."""
    p, started = begin(script, *args, cwd=cwd)
    try:
        while not (ready() and logged_iters(out_dir) and logged_iters(out_dir)[-1] >= iters):
            assert p.exitcode is None
            time.sleep(0.005)
    finally:
        p.kill()
        launcher.finish(started)
    return Path(snapshot_dir((Path(out_dir) / 'run_id').read_text().strip()))


def run_with_kills(cmd, out_dir, kill_after, cwd, timeout=300, sigterm_after=None):
    """Runs cmd (a torchrun job) and SIGKILLs one of its workers, in turn, once the run has logged each iteration of
    kill_after; with sigterm_after, then sends torchrun SIGTERM once the last restarted group has logged that iteration
    (torchrun passes it on to the workers, which save and exit). Returns (stdout, [the last iteration that each killed
    group logged], what stdout got after the SIGTERM)."""
    log = open(Path(cwd) / 'torchrun.log', 'w')
    p = subprocess.Popen(cmd, cwd=cwd, env=env(), stdout=log, stderr=subprocess.STDOUT, text=True)
    killed_at, deadline, seen, signalled = [], time.time() + timeout, 0, None
    try:
        for n, target in enumerate([*kill_after, *([sigterm_after] if sigterm_after is not None else [])]):
            while True:
                assert p.poll() is None, f"the job ended before iter {target}:\n" + open(log.name).read()[-3000:]
                assert time.time() < deadline, open(log.name).read()[-3000:]
                done = logged_iters(out_dir)
                pids = workers(p.pid)
                # the current group past where the killed one got to (a resume drops the log's later rows): the
                # killed one's last iteration can be past the next target already (a starved poller kills late),
                # and killing a group before it has resumed proves nothing
                if len(done) > seen and done[-1] >= target and len(pids) == 2:
                    if n == len(kill_after):  # as SLURM or Kubernetes stop a job
                        signalled = os.path.getsize(log.name)
                        p.send_signal(signal.SIGTERM)
                    else:
                        os.kill(pids[n % 2], signal.SIGKILL)
                    break
                time.sleep(0.005)
            if n == len(kill_after):
                break
            while p.poll() is None and set(workers(p.pid)) & set(pids):  # until torchrun has seen the death
                time.sleep(0.01)
            # every worker of the killed group is gone: its log is complete. Its last row is read now, not before the
            # kill: a poller held up between the two lets the group log steps and take snapshots meanwhile
            done = logged_iters(out_dir)
            killed_at.append(done[-1])
            seen = len(done)
        p.wait(timeout=max(1, deadline - time.time()))
    finally:
        p.kill()
        log.close()
    out = open(log.name).read()
    if sigterm_after is None:
        assert p.returncode == 0, out[-5000:]
        return out, killed_at, ''
    return out, killed_at, out[signalled:]  # torchrun itself ends on SIGTERM with a traceback (SignalException)


def kill_resumes(out, killed_at, eval_interval=30):
    """The step each kill resumed from, read in the job's output: a memory snapshot's, or, where a poller held up on a
    busy machine killed only once the storage save at an eval was written (the step after the kill), that newer
    checkpoint's, which a restart rightly takes. At least one kill must have resumed from a memory snapshot."""
    found = re.findall(r'resuming from (\S+) at iter (\d+)', out)
    assert len(found) == len(killed_at) and any('/nanogpt-' in path for path, _ in found), (killed_at, out[-5000:])
    for (path, start), last in zip(found, killed_at):
        assert '/nanogpt-' in path or int(start) == last + 1 and int(start) % eval_interval == 0, (killed_at, found)
    return [int(start) for _, start in found]


def assert_resumed_near(killed_at, resumed, interval=4):
    """Each kill resumed from a snapshot no later than the killed step and at most two intervals older: the killed
    worker was at most in step last + 1 and the newest snapshot is at most one interval older, but its file is
    written in the background while training goes on, so on a busy machine a kill can come before it is complete,
    and the run resumes from the one before (a kill at 13 while 12's is written resumes from 8)."""
    for last, start in zip(killed_at, resumed):
        assert last + 1 - 2 * interval <= start <= last + 1, (killed_at, resumed)


def weights(path):
    return torch.load(path, map_location='cpu', weights_only=True)['model']


def same_weights(a, b):
    return all(torch.equal(a[k], b[k]) for k in a) and a.keys() == b.keys()


def tiny(data_dir, out, *extra):
    return [*TINY, f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={out}', *extra]


def beside(shared_run, script, *args, nproc=2):
    """The uninterrupted reference, shared_run(script, *args, nproc=nproc), made in a thread beside the test's own run
    (a launcher's fresh interpreters take seconds to start): a future of its out_dir."""
    pool = ThreadPoolExecutor(1)
    future = pool.submit(shared_run, script, *args, nproc=nproc)
    pool.shutdown(wait=False)
    return future


def cut_short(path):
    """Truncates a file to a third, as a crash or a full disk would leave it."""
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 3])


# -----------------------------------------------------------------------------
# fsdp_train.py and decent_train.py: a memory snapshot and a storage checkpoint per rank (DCP shards, replicas)

# out_dir's folder of step folders
KIND = {'fsdp_train.py': 'dcp', 'pp_train.py': 'dcp', 'decent_train.py': 'decent', 'ds_train.py': 'ds'}


def final_weights(script, out_dir):
    """The weights of a run's newest storage checkpoint: train.py's, fsdp_train.py's or pp_train.py's model, every
    replica of decent_train.py's, ds_train.py's consolidated export."""
    if script in ('train.py', 'ds_train.py'):
        return weights(Path(out_dir) / 'ckpt.pt')
    folder = Path(out_dir) / KIND[script] / (Path(out_dir) / KIND[script] / 'latest').read_text()
    if KIND[script] == 'dcp':
        from checkpoint import load_checkpoint
        return load_checkpoint(str(folder))[0].state_dict()
    return {f'{f.stem} {k}': v for f in sorted(folder.glob('rank-*.pt')) for k, v in weights(f).items()}


def assert_same_run(ref_dir, ft_dir, script=None, exact=False):
    """Every step's loss and the last eval within 1e-5 of the reference's (or equal), and the final weights within
    1e-5 (or equal)."""
    (ref, ref_evals), (ft, ft_evals) = read_metrics(ref_dir), read_metrics(ft_dir)
    assert sorted(ft) == sorted(ref), (sorted(ft), sorted(ref))
    rel = 0.0 if exact else 1e-5
    for it in ref:
        assert abs(ft[it] - ref[it]) <= rel * abs(ref[it]), (it, ft[it], ref[it])
    assert abs(ft_evals[-1]['val_loss'] - ref_evals[-1]['val_loss']) <= rel * ref_evals[-1]['val_loss']
    if script:
        a, b = final_weights(script, ref_dir), final_weights(script, ft_dir)
        assert a.keys() == b.keys()
        for k in a:  # absolute: c_k's bias gets no gradient and holds only rounding noise that Adam scales up
            assert (a[k] - b[k]).abs().max().item() <= (0.0 if exact else 1e-5), k


# 2 ranks with dropout (the RNG of every rank comes back from the snapshot too), a memory snapshot every 4 steps.
# decent_train.py with the updates in the backward's hooks (no clipping) and AccumAdamW's window across the kills,
# pp_train.py as a pipeline of two stages; two kills (one of each rank, the second in the restarted group). The
# uninterrupted run of each entrypoint, shared_run(script, *KILLED, *KILL_ARGS[script], nproc=2), is the reference
# of every test below that runs it.
KILLED = ['--gradient_accumulation_steps=2', '--dropout=0.1', '--max_iters=60', '--eval_interval=30',
          '--save_memory_interval=4']
KILL_ARGS = {'train.py': [], 'fsdp_train.py': [], 'pp_train.py': ['--pp_size=2'], 'ds_train.py': ['--zero_stage=2'],
             'decent_train.py': ['--grad_clip=0.0', '--replica_optimizer=accumadamw', '--moment_accum_steps=3']}


@pytest.mark.parametrize('script', ['train.py', 'fsdp_train.py', 'pp_train.py', 'decent_train.py', 'ds_train.py'])
def test_sigkilled_workers_resume_from_their_memory_snapshots_and_finish_the_same(tmp_path, data_dir, shared_run,
                                                                                   script):
    args = [*KILLED, *KILL_ARGS[script]]
    ref = beside(shared_run, script, *args)
    # rank 0 past iter 7 (between snapshots), then rank 1 of the restarted group past iter 13; train.py's and
    # pp_train.py's job then gets SIGTERM past iter 19, which torchrun passes on (pp_train.py's stop is agreed across
    # its stages): the workers save, exit cleanly, and the run resumes from that checkpoint, its own and each
    # stage's state and RNG back, to the end
    sigterm = 19 if script in ('train.py', 'pp_train.py') else None
    out, killed_at, stopping = run_with_kills(elastic(script, *tiny(data_dir, tmp_path / 'ft', *args)),
                                              tmp_path / 'ft', [7, 13], cwd=tmp_path, sigterm_after=sigterm)
    if sigterm:
        stopped = int(re.search(r'SIGTERM: saving a checkpoint at iter (\d+) and exiting', stopping)[1])
        assert killed_at[-1] < stopped < 60, (killed_at, stopping[-3000:])
        if script == 'train.py':
            assert torch.load(tmp_path / 'ft' / 'ckpt.pt', weights_only=True)['iter_num'] == stopped
        else:
            assert (tmp_path / 'ft' / 'dcp' / 'latest').read_text() == f'step-{stopped:08d}'
        assert f'{script}", line' not in stopping, stopping[-3000:]  # no worker failed (torchrun reports its own)
        p = run(script, *tiny(data_dir, tmp_path / 'ft', *args), nproc=2, cwd=tmp_path)
        assert f'at iter {stopped}' in p.stdout
    ref = ref.result()
    # the node's snapshot (train.py, ds_train.py) or each rank's of its own shards, stage or replica (fsdp, pp, decent)
    assert_resumed_near(killed_at, kill_resumes(out, killed_at))
    # the same ranks take back exactly what they held: bit for bit (DeepSpeed: within 1e-5, all the issue asks)
    assert_same_run(ref, tmp_path / 'ft', script, exact=script != 'ds_train.py')
    run_id = (tmp_path / 'ft' / 'run_id').read_text()
    assert not os.path.exists(f'/dev/shm/nanogpt-{run_id}')  # a finished run frees its snapshots


def two_nodes_with_a_dev_shm_each(script, args, out_dir, kill_after=None):
    """An elastic job of two nodes of one rank, each node with a /dev/shm of its own (a mount namespace), as on a
    cluster; with kill_after, the second node's rank is SIGKILLed once that iteration is logged. Returns the two
    nodes' output and the last iteration logged before the kill (None without one)."""
    torchrun = [*TORCHRUN, '--nnodes=2', '--nproc_per_node=1', '--max-restarts=2',
                '--rdzv-backend=c10d', f'--rdzv-endpoint=127.0.0.1:{free_port()}', '--rdzv-conf=last_call_timeout=1',
                str(REPO / script), *args]
    own_shm = ['unshare', '--mount', '--propagation', 'private', 'sh', '-c',
               'mount -t tmpfs tmpfs /dev/shm && exec "$@"', 'node']
    logs = [open(out_dir.parent / f'{out_dir.name}-node{i}.log', 'w+') for i in range(2)]
    nodes = [subprocess.Popen(own_shm + torchrun, cwd=out_dir.parent, env=env(), stdout=log, stderr=subprocess.STDOUT)
             for log in logs]
    killed_at = None
    try:
        while kill_after is not None and not (logged_iters(out_dir) and logged_iters(out_dir)[-1] >= kill_after):
            assert all(n.poll() is None for n in nodes), Path(logs[0].name).read_text()[-3000:]
            time.sleep(0.005)
        if kill_after is not None:
            victim = workers(nodes[1].pid)[0]
            os.kill(victim, signal.SIGKILL)
            while nodes[1].poll() is None and victim in workers(nodes[1].pid):  # until its agent has reaped it
                time.sleep(0.01)
            # the log is complete: its last row is the iteration killed, which a poller held up before the kill
            # has let the job go past
            killed_at = logged_iters(out_dir)[-1]
        for n in nodes:
            n.wait(timeout=300)
    finally:
        for n in nodes:
            n.kill()
        for log in logs:
            log.close()
    out = Path(logs[0].name).read_text() + Path(logs[1].name).read_text()
    assert [n.returncode for n in nodes] == [0, 0], out[-5000:]
    return out, killed_at


def test_ds_memory_snapshots_of_two_nodes_with_a_dev_shm_each_resume_a_sigkilled_job(tmp_path, data_dir, shared_run):
    # The engine writes its model-states file (our state in it) from the first rank only; the second node's snapshot
    # needs one too. Restarting the group also has to work when the first node's agent restarts its worker for the
    # new member, which torchrun does not count as a restart. The reference: the same 2 ranks on one node.
    args = [*KILLED, *KILL_ARGS['ds_train.py']]
    ref = beside(shared_run, 'ds_train.py', *args)
    for attempt in range(2):
        ft = tmp_path / f'ft{attempt}'
        out, killed_at = two_nodes_with_a_dev_shm_each('ds_train.py', tiny(data_dir, ft, *args), ft, kill_after=9)
        # a poller held up on a busy machine may kill it only once the storage save at the eval of iter 30 is
        # written, which a restart rightly takes over any snapshot: that kill proves nothing here, so once more
        if killed_at < 28:
            break
    assert killed_at < 28, f'both kills came after iter 28 (the last at {killed_at}): the machine is too busy'
    ref = ref.result()
    resumed = [int(m) for m in re.findall(r'resuming from /dev/shm/nanogpt-\w+/step-\d+ at iter (\d+)', out)]
    # from a memory snapshot before the kill (at 9 or later): on a busy machine the newest both nodes hold may be
    # a few steps back, where a write was still in flight or failed with its peer
    assert len(resumed) == 1 and 0 < resumed[0] <= killed_at + 1, (killed_at, out[-5000:])
    assert_same_run(ref, ft, 'ds_train.py')


def nodes_of_one_rank(script, args, shms, cwd, kill_after=None, until=lambda: True):
    """A job of nodes of one rank each, rank r on the node whose /dev/shm is the folder shms[r] (own_shm.py: a test
    sets what each node's memory holds, and which node each rank lands on), forked as torchrun starts its workers,
    under one SLURM job id (a requeue takes over its holds). With kill_after, every rank is SIGKILLed (the job lost
    with its nodes) once that iteration is logged and until() holds. The CompletedProcess (exit 1 after a kill)."""
    out_dir = Path(next(a for a in args if a.startswith('--out_dir='))[len('--out_dir='):])
    job = dict(env(), GLOO_SOCKET_IFNAME='lo', SLURM_JOB_ID='4242',
               **{f'NODE_SHM_{r}': str(shm) for r, shm in enumerate(shms)})
    started = launcher.start(str(REPO / 'tests' / 'own_shm.py'), [str(REPO / script), *map(str, args)], job, cwd,
                    nproc=len(shms))
    while kill_after is not None and not (logged_iters(out_dir) and logged_iters(out_dir)[-1] >= kill_after):
        assert all(rank.exitcode is None for rank in started[0]), launcher.finish(started)
        time.sleep(0.005)
    deadline = time.time() + 120  # (a run that writes no such snapshot fails here, not at the test's timeout)
    while kill_after is not None and not until():
        assert all(rank.exitcode is None for rank in started[0]), launcher.finish(started)
        if time.time() > deadline:
            for rank in started[0]:
                os.kill(rank.pid, signal.SIGKILL)
            p = launcher.finish(started)
            raise AssertionError(f"the snapshots waited for were not written in 120 s: {p.stdout[-3000:]}")
        time.sleep(0.05)
    for rank in started[0] if kill_after is not None else []:
        os.kill(rank.pid, signal.SIGKILL)
    return launcher.finish(started, timeout=300)


def snapshots_past(folders, n):
    """nodes_of_one_rank's until: every folder holds a whole memory snapshot past iteration n. Logged iterations
    alone do not say it: on a loaded machine a step's snapshot may still be being written three steps later."""
    def until():
        try:
            return all(max(snapshots_of(f).values(), default=0) > n for f in folders)
        except (OSError, RuntimeError):  # ds_train.py's latest not written yet, a file as it is renamed into place
            return False
    return until


def snapshots_of(folder):
    """{name: iter_num} of the memory snapshot files (or step folders) in a run's snapshot folder."""
    found, latest = {}, Path(folder) / 'latest'
    for path in Path(folder).glob('*'):
        # ds_train.py's step folders up to the one latest names (one past it was cut short by the kill)
        if path.name.endswith('.pt') or path.name.startswith('step-') and path.name <= latest.read_text():
            state = torch.load(path if path.is_file() else next(path.glob('mp_rank_*')), weights_only=True, mmap=True)
            assert counts_tokens(state), path  # each entrypoint's snapshot holds the tokens trained
            found[path.name] = state['iter_num']
    return found


# A job of two nodes killed with its snapshots, and requeued on a fresh node and one of its own, the fresh one
# first: train.py took its newest state for lost (neither node's snapshot counts unless both hold it) and, with no
# checkpoint in out_dir, started afresh under a new run id, stranding the snapshot in RAM
def test_train_py_requeued_on_a_fresh_node_resumes_the_other_nodes_whole_snapshot(tmp_path, data_dir, shared_run):
    args = ['--gradient_accumulation_steps=2', '--eval_interval=1000', '--save_memory_interval=4']
    ref = beside(shared_run, 'train.py', *args, '--max_iters=12', nproc=2)
    out, a, fresh = tmp_path / 'out', tmp_path / 'a', tmp_path / 'fresh'
    for node in (a, fresh, tmp_path / 'b'):
        node.mkdir()
    nodes_of_one_rank('train.py', tiny(data_dir, out, *args, '--max_iters=100000'), [a, tmp_path / 'b'], tmp_path,
                      kill_after=9)
    run_id = (out / 'run_id').read_text()
    at = snapshots_of(a / f'nanogpt-{run_id}')['ckpt.pt']
    p = nodes_of_one_rank('train.py', tiny(data_dir, out, *args, '--max_iters=12'), [fresh, a], tmp_path)
    assert p.returncode == 0 and f"resuming from {out / 'ckpt.pt'} at iter {at}" in p.stdout, p.stdout[-3000:]
    assert (out / 'run_id').read_text() == run_id
    assert_same_run(ref.result(), out, 'train.py', exact=True)


NODES_ARGS = ['--gradient_accumulation_steps=2', '--eval_interval=1000', '--save_memory_interval=4']


@pytest.fixture(scope='module')
def killed_past_a_checkpoint(tmp_path_factory, data_dir):
    """script -> a job of two nodes of it with a checkpoint at 6, killed past 11 with each node's snapshots past the
    checkpoint (made once per script): restored, its folders are put back as the kill left them, at the same paths,
    so that the run in them stays this out_dir's (saved_for), and the job's (out, node a, node b, run id) returned."""
    made = {}

    def restored(script):
        if script not in made:
            root = tmp_path_factory.mktemp('killed')
            out, a, b = root / 'job' / 'out', root / 'job' / 'a', root / 'job' / 'b'
            for node in (a, b):
                node.mkdir(parents=True)
            nodes_of_one_rank(script, tiny(data_dir, out, *NODES_ARGS, '--max_iters=6'), [a, b], root)
            run_id = (out / 'run_id').read_text()  # the run that the next command resumes
            nodes_of_one_rank(script, tiny(data_dir, out, *NODES_ARGS, '--max_iters=100000'), [a, b], root,
                              kill_after=11,
                              until=snapshots_past([a / f'nanogpt-{run_id}', b / f'nanogpt-{run_id}'], 6))
            assert (out / 'run_id').read_text() == run_id
            shutil.copytree(root / 'job', root / 'as-killed', symlinks=True)
            made[script] = root, run_id
        root, run_id = made[script]
        shutil.rmtree(root / 'job')
        shutil.copytree(root / 'as-killed', root / 'job', symlinks=True)
        return root / 'job' / 'out', root / 'job' / 'a', root / 'job' / 'b', run_id
    return restored


# A job with a checkpoint at 6 and its snapshots past it, killed and requeued with its two nodes in the other order,
# where no rank finds its own shards in its node's snapshots: each rank took the other's step folder there and
# failed, calling it corrupt ("move it aside")
def test_ds_job_requeued_with_its_nodes_in_another_order_goes_on_from_its_checkpoint(tmp_path, data_dir, shared_run,
                                                                                     killed_past_a_checkpoint):
    ref = beside(shared_run, 'ds_train.py', *NODES_ARGS, '--max_iters=12', nproc=2)
    out, a, b, run_id = killed_past_a_checkpoint('ds_train.py')
    assert all(snapshots_of(node / f'nanogpt-{run_id}') for node in (a, b))  # each node's, past the checkpoint
    p = nodes_of_one_rank('ds_train.py', tiny(data_dir, out, *NODES_ARGS, '--max_iters=12'), [b, a], tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"resuming from {out / 'ds' / 'step-00000006'} at iter 6" in p.stdout, p.stdout[-3000:]
    assert_same_run(ref.result(), out, 'ds_train.py')


# An elastic job of two nodes with a checkpoint at 6 and its snapshots past it, back on one node after the other was
# lost: the node's half of the snapshots (rank 0's of two) was taken for the run's newest state, of another layout,
# and the start refused ("resume with the layout in its name", "use 2 ranks"), which no layout could do without the
# lost node. It goes on from the checkpoint, resharded (ds_train.py: its consolidated export)
@pytest.mark.parametrize('script, resumed', [('fsdp_train.py', 'dcp/step-00000006'), ('ds_train.py', 'ckpt.pt')])
def test_a_job_back_on_fewer_nodes_goes_on_from_its_checkpoint(tmp_path, data_dir, shared_run,
                                                                killed_past_a_checkpoint, script, resumed):
    ref = beside(shared_run, script, *NODES_ARGS, '--max_iters=12', nproc=2)
    out, a, _, run_id = killed_past_a_checkpoint(script)
    assert max(snapshots_of(a / f'nanogpt-{run_id}').values()) > 6  # the node's half, past the checkpoint
    p = nodes_of_one_rank(script, tiny(data_dir, out, *NODES_ARGS, '--max_iters=12'), [a], tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "not in this job (a node lost, or the job back on fewer nodes): no layout resumes it here" in p.stdout
    assert f"resuming from {out / resumed} at iter 6" in p.stdout, p.stdout[-3000:]
    assert_same_run(ref.result(), out, script)


# The same without a checkpoint, back on one node or on both in the other order (each rank's snapshot then on the
# other's node): the job starts afresh, under a new run id, and the nodes' snapshots were left in their RAM under the
# old one, which nothing names any more (a model's shards, for as long as the node runs)
@pytest.mark.parametrize('back', ['a', 'ba'])
def test_a_job_back_on_other_nodes_with_no_checkpoint_keeps_the_nodes_snapshots_in_out_dir(tmp_path, data_dir, back):
    args = ['--gradient_accumulation_steps=2', '--eval_interval=1000', '--save_memory_interval=4']
    out = tmp_path / 'out'
    for node in 'ab':
        (tmp_path / node).mkdir()
    # killed past iter 8, whose snapshot waited for the one of iter 4 to be written (at 5, a loaded machine could
    # still be writing that one: no snapshot on the node)
    nodes_of_one_rank('fsdp_train.py', tiny(data_dir, out, *args, '--max_iters=100000'),
                      [tmp_path / 'a', tmp_path / 'b'], tmp_path, kill_after=9)
    run_id = (out / 'run_id').read_text().strip()
    held = {node: snapshots_of(tmp_path / node / f'nanogpt-{run_id}') for node in back}
    assert all(held.values()) and not (out / 'dcp').exists()
    p = nodes_of_one_rank('fsdp_train.py', tiny(data_dir, out, *args, '--max_iters=2'),
                          [tmp_path / node for node in back], tmp_path)
    assert p.returncode == 0 and 'resuming from' not in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    assert (out / 'run_id').read_text().strip() != run_id  # a new run
    for node, snapshots in held.items():
        assert not (tmp_path / node / f'nanogpt-{run_id}').exists()
        assert snapshots_of(out / f'before-{run_id}' / f'snapshots.before-{run_id}-{node}') == snapshots


def test_dlrover_run_restarts_sigkilled_workers_and_train_py_finishes_bit_exact(tmp_path, data_dir, shared_run):
    # dlrover-run in place of torchrun, standalone (its job master on this node): it gives the workers no agent
    # store, and a new MASTER_PORT at each restart
    ref_dir = beside(shared_run, 'train.py', *KILLED)
    # the workers' flags as DLRover's nanoGPT example writes them: argparse's space-separated values, the data's
    # folder as --data_dir, and --epochs (an epoch of its loader is 125,478 steps here: max_iters=60 ends the run);
    # bare --decay_lr, since DLRover's default (taken here for what its flags leave out) is a constant rate
    dlrover = ['--n_layer', '2', '--n_head', '2', '--n_embd', '32', '--data_dir', str(data_dir / 'shakespeare_char'),
               '--epochs', '1', '--save_memory_interval', '4', '--save_storage_interval', '50', '--decay_lr']
    ours = [a for a in [*TINY, *KILLED] if a.split('=')[0] not in ('--n_layer', '--n_head', '--n_embd',
                                                                     '--save_memory_interval')]
    cmd = [sys.executable, str(REPO / 'launch' / 'dlrover_run.py'), '--standalone', '--nproc_per_node=2',
           '--max_restarts=3', str(REPO / 'train.py'), *dlrover, *ours, f'--out_dir={tmp_path / "ft"}']
    out, killed_at, _ = run_with_kills(cmd, tmp_path / 'ft', [6, 18], cwd=tmp_path)
    assert "--epochs 1 is DLRover's name: here --max_iters=125478" in out and 'max_iters=60 ends the run first' in out
    # the storage checkpoint at 50, between evals: saved before that step
    steps = [line for line in out.splitlines() if line.startswith(('iter ', 'saving checkpoint to '))]
    assert steps[steps.index(next(x for x in steps if x.startswith('iter 50:'))) - 1].startswith('saving checkpoint')
    assert_resumed_near(killed_at, kill_resumes(out, killed_at))
    ref_dir = ref_dir.result()
    (ref, ref_evals), (ft, ft_evals) = read_metrics(ref_dir), read_metrics(tmp_path / 'ft')
    assert ft == ref and [e['val_loss'] for e in ft_evals] == [e['val_loss'] for e in ref_evals]
    assert same_weights(weights(tmp_path / 'ft' / 'ckpt.pt'), weights(ref_dir / 'ckpt.pt'))


def test_dlrover_run_without_dlrover_a_one_line_error_says_how_to_install_it(tmp_path):
    (tmp_path / 'dlrover.py').write_text("raise ImportError('No module named dlrover')\n")
    p = subprocess.run([sys.executable, str(REPO / 'launch' / 'dlrover_run.py'), '--standalone', 'train.py'],
                       cwd=tmp_path, env={**env(), 'PYTHONPATH': str(tmp_path)}, capture_output=True, text=True)
    assert 'pip install dlrover==0.6.1' in one_line_error(p)


def test_bench_checkpoint_times_the_loop_blocked_per_save_against_a_synchronous_one(tmp_path):
    args = ['--what=save', '--device=cpu', '--n_layer=1', '--n_head=2', '--n_embd=64', '--vocab_size=2048',
            '--block_size=32', '--repeats=1']
    # a run's folder given by mistake is refused, and stays as it was
    run_dir = tmp_path / 'run'
    (run_dir / 'recovery').mkdir(parents=True)
    for name in ('ckpt.pt', 'ckpt.prev.pt', 'recovery/ckpt.pt'):
        (run_dir / name).write_text(name)
    before = sorted((str(f), f.read_bytes() if f.is_file() else None) for f in run_dir.rglob('*'))
    p = run('bench_checkpoint.py', *args, f'--out_dir={run_dir}', cwd=tmp_path, check=False)
    assert 'holds files that bench_checkpoint.py did not write' in one_line_error(p)
    assert sorted((str(f), f.read_bytes() if f.is_file() else None) for f in run_dir.rglob('*')) == before
    snapshots = set(glob.glob('/dev/shm/nanogpt-bench*'))
    p = run('bench_checkpoint.py', *args, f'--out_dir={tmp_path / "bench"}', cwd=tmp_path)
    for kind in ('memory', 'storage'):
        assert re.search(rf'{kind}: the loop is blocked [\d.]+% of a synchronous save; the step with it takes',
                         p.stdout)
    assert os.listdir(tmp_path / 'bench') == ['BENCH_CHECKPOINT']  # the saves it timed are gone, only its mark stays
    # the state it saves: weights and AdamW's two moments, the tied head counted once (as a save writes it)
    from model import GPT, GPTConfig
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=64, vocab_size=2048, block_size=32))
    n = sum(p.numel() for p in model.parameters())
    assert re.search(r"M parameters, ([\d.]+) MiB with AdamW's moments", p.stdout)[1] == f'{12 * n / 2**20:.1f}'
    assert set(glob.glob('/dev/shm/nanogpt-bench*')) == snapshots  # and its snapshot folder
