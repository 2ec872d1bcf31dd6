"""
One run at a time per folder, for every entrypoint (out_dir) and prepare.py (its dataset folder): a run holds the
folder for its lifetime (hold()), and a second start over it is refused in one line naming the holder. A run's
snapshot folder in RAM, which a copy of its out_dir shares, is held too (try_hold: checkpoint.find_resume). It names
the launch that a start belongs to (launch_identity, launch_pods), but does not decide what a run resumes or keeps:
checkpoint.py does. Where a run's step folders and snapshots lie (FOLDERS, snapshot_dir) is said here, without
torch, for the tools that must not write into them (configurator.runs_own).
"""

import atexit
import errno
import json
import os
import re
import socket
import sys
import tempfile
import threading
import time
import uuid

HOLD = 'run.lock'
RUN_ID = re.compile(r'[A-Za-z0-9_-]{1,64}')
# each entrypoint's folder of step folders in out_dir (checkpoint.py's storage; train.py has none)
FOLDERS = {'fsdp_train.py': 'dcp', 'pp_train.py': 'dcp', 'ds_train.py': 'ds', 'decent_train.py': 'decent'}
HEARTBEAT_S = 10  # the holder touches its hold this often; one untouched for STALE_S is a dead host's
STALE_S = 120


def launch_identity():
    """What stays the same when a launcher restarts this run's processes, and differs between runs: a SLURM job
    keeps its id when it is requeued, torchrun its rendezvous (id and the agents' store) over elastic restarts."""
    if os.environ.get('SLURM_JOB_ID'):  # and its step: two steps of one job at once are two runs
        return f"slurm-{os.environ['SLURM_JOB_ID']}.{os.environ.get('SLURM_STEP_ID', '')}"
    # a static rendezvous (--master_port, --node_rank) has the id 'none': the same for every such launch, so two
    # runs started alike on two hosts over one folder would each take it as its own launch's
    if os.environ.get('TORCHELASTIC_RUN_ID', 'none') != 'none':
        return f"torchrun-{os.environ['TORCHELASTIC_RUN_ID']}@{os.environ.get('MASTER_ADDR')}:" \
               f"{os.environ.get('MASTER_PORT')}"
    return None


def launch_pods():
    """The Kubernetes pods of this start's ranks, by their uids (sorted; [] elsewhere): a collective where a process
    group is up. The manifests in k8s/ give each pod's uid in POD_UID (the downward API's metadata.uid, the only
    thing in it that tells one pod from the next of the same name). A pod is its job's alone, and runs its command
    again only where the kubelet restarts its container in place, which tells the processes no restart count
    (torchrun's starts at 0 again): so a start in a pod that started or last resumed a run restarts that run's
    launch, and a job made anew (under the same name too) runs in pods of its own."""
    import torch.distributed as dist  # here: prepare.py holds its folder without torch (0.7 s to import)
    pods = [os.environ.get('POD_UID') or None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        pods = [None] * dist.get_world_size()
        dist.all_gather_object(pods, os.environ.get('POD_UID') or None)
    return sorted({p for p in pods if p})


def _started(pid):
    """When process pid started (clock ticks since boot, /proc's), or None where that is unknown (no /proc, no such
    process). A pid and its start name one process, where a pid alone may name another since: a container that
    the kubelet restarts in its pod starts its processes at the same pids as before."""
    try:
        with open(f'/proc/{pid}/stat', 'rb') as f:
            return int(f.read().rsplit(b')', 1)[1].split()[19])  # field 22, counted from the state after the name
    except (OSError, ValueError, IndexError):
        return None


def _pid_ns():
    """This process's pid namespace (/proc's name for it), or None where unknown: a pid names a process only there.
    Containers on one host have one each, and may share its hostname (docker --network=host)."""
    try:
        return os.readlink('/proc/self/ns/pid')
    except OSError:
        return None


def _here(holder, me):
    """Whether the holder of a hold runs where this process can see it by its pid: on this host, in this pid
    namespace (a hold that names none is of before they were named: as before, this host's)."""
    return holder.get('host') == me['host'] and holder.get('pidns') in (None, me.get('pidns'))


def _alive(pid, started=None):
    """Whether process pid lives, and where started is given (its holder's start), is the process that started
    then."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return started is None or _started(pid) in (None, started)


def _read_hold(path):
    """The holder named in a hold file, read as data ({} where it is unreadable: a hold cut short)."""
    try:
        with open(path, encoding='utf-8') as f:
            holder = json.loads(f.read(4096))
        return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
        return {}


def _to_make(folder):
    """The folders that os.makedirs(folder) would make, the deepest first: those not there yet."""
    made, path = [], os.path.abspath(folder)
    while not os.path.lexists(path) and path != os.path.dirname(path):
        made.append(path)
        path = os.path.dirname(path)
    return made


def _remove_empty(folders):
    """Removes folders, the deepest first (those not there passed over: a makedirs that failed midway), up to the
    first that is not empty: another's files in it."""
    for path in filter(os.path.isdir, folders):
        try:
            os.rmdir(path)
        except OSError:
            return


def _place(mine, path):
    """Puts the hold written in mine at path, or raises FileExistsError where a hold is there: a hard link, whole at
    once; on a filesystem without them (vfat, exFAT, some FUSE mounts of buckets) an exclusive create, then the
    holder (read as {} meanwhile, which is never taken over while it is fresh)."""
    try:
        os.link(mine, path)
        return
    except FileExistsError:
        raise
    except OSError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)  # FileExistsError where a hold is there
    try:
        with open(fd, 'wb') as f, open(mine, 'rb') as src:
            f.write(src.read())
    except BaseException:
        os.remove(path)  # a hold cut short would read as a live one's for minutes
        raise


def _cannot_write(folder, e, made):
    """The one-line error of a hold that could not be written, once the folders made for it are removed."""
    _remove_empty(made)
    fix = 'free some space there, or give another folder' if e.errno in (errno.ENOSPC, errno.EDQUOT) else \
        'give a folder this user can write in'
    return f"error: cannot write in {folder} ({e.strerror}): {fix}"


def _take(folder, what, tidy=False, pods=()):
    """Takes the hold on folder for this process, or returns the one-line error that refuses it. tidy: the folder
    is removed at the release where it is left empty, whoever made it (try_hold's: a snapshot folder in RAM, or
    export_hf.py's own temporary folder; never out_dir, which hold() takes). pods: this start's (launch_pods)."""
    made = _to_make(folder)
    path = os.path.join(folder, HOLD)
    me = {'host': socket.gethostname(), 'pid': os.getpid(), 'since': time.strftime('%Y-%m-%d %H:%M:%S'),
          'launch': launch_identity(), 'started': _started(os.getpid()), 'pidns': _pid_ns(),
          **({'pods': list(pods)} if pods else {})}
    # a name of its own: containers of one host may share its hostname and number their processes alike
    mine = f'{path}.{me["host"]}.{me["pid"]}.{uuid.uuid4().hex[:8]}.tmp'
    try:
        os.makedirs(folder, exist_ok=True)
        with open(mine, 'w') as f:
            json.dump(me, f)
    except OSError as e:  # a full disk: nothing of ours is left behind
        if os.path.exists(mine):
            os.remove(mine)
        return _cannot_write(folder, e, made)
    if os.path.lexists(path) and not os.path.isfile(path):  # never a hold: no run would ever let it go
        os.remove(mine)
        return (f"error: {path} is no file (a folder, or a link to nothing), where the hold goes: move it out of "
                f"{folder}")
    try:
        try:
            _place(mine, path)
        except FileExistsError:
            holder = _read_hold(path)
            try:  # on the clock that stamps the folder's files (mine's, written just now), not on this host's
                age = os.stat(mine).st_mtime - os.stat(path).st_mtime
            except FileNotFoundError:
                age = 0.0
            host, pid = holder.get('host'), holder.get('pid')
            if _here(holder, me) and pid == me['pid'] and holder.get('started') in (None, me['started']):
                return None  # held already, by this process
            ran = sorted(set(pods) & set(p for p in holder.get('pods') or [] if isinstance(p, str)))
            if holder.get('launch') and holder.get('launch') == me['launch']:
                why = "this run's launcher restarted it"
            elif ran and not _here(holder, me):  # (on this host, its pid and start tell whether it lives)
                why = f"a pod of its launch, {ran[0]}, runs this start (Kubernetes restarted a container of the job)"
            elif _here(holder, me) and isinstance(pid, int) and not _alive(pid, holder.get('started')):
                why = f"its holder, pid {pid} since {holder.get('since')}, is gone"
            elif not _here(holder, me) and host and age > STALE_S:  # (another container of this host: its pid is
                # none of this namespace's, alive or not, so its heartbeat tells)
                why = f"its holder on {host} has not touched it for {age:.0f} s"
            elif not holder and age > STALE_S:
                why = "it is unreadable and untouched"
            else:
                return (f"error: {folder} is in use by {what} on host {host}, pid {pid}, since {holder.get('since')} "
                        f"({path}): wait for it to end or stop it, or give this one another folder")
            os.replace(mine, path)
            print(f"taking over the hold on {folder}: {why}", flush=True)
        except OSError as e:  # the hold cannot be put in place (a full disk): nothing of ours is left behind
            os.remove(mine)
            return _cannot_write(folder, e, made)
    finally:
        if os.path.exists(mine):
            os.remove(mine)

    def beat():
        while True:
            time.sleep(HEARTBEAT_S)
            holder = _read_hold(path)
            if holder.get('pid') != me['pid'] or not _here(holder, me):
                return
            try:
                os.utime(path)
            except OSError:
                pass

    def release():
        holder = _read_hold(path)
        if holder.get('pid') == me['pid'] and _here(holder, me):
            try:
                os.remove(path)
            except OSError:  # the folder made read-only meanwhile: a dead holder's hold, which the next start takes
                pass
        # the folders this run made and left empty (a start that failed: new/run, and new too), or a dead run's
        _remove_empty(made or ([folder] if tidy else []))
    threading.Thread(target=beat, daemon=True, name='hold').start()
    atexit.register(release)
    _held[folder] = release
    return None


_held = {}  # folder -> its release


def abandoned(folder):
    """Whether folder holds a hold whose holder is gone, as _take sees it: a process of this host that has ended,
    or one of another host that has not touched it for STALE_S. False where it holds none: a folder that nobody
    holds may be anyone's, or a process's that has not taken its hold yet or has let it go."""
    path = os.path.join(folder, HOLD)
    holder = _read_hold(path)
    host, pid = holder.get('host'), holder.get('pid')
    try:
        touched = os.stat(path).st_mtime
    except FileNotFoundError:
        return False
    if _here(holder, {'host': socket.gethostname(), 'pidns': _pid_ns()}):
        return isinstance(pid, int) and not _alive(pid, holder.get('started'))
    return bool(host) and _now_in(os.path.dirname(os.path.abspath(folder))) - touched > STALE_S


def _now_in(folder):
    """The time now on the clock that stamps folder's files: a file made there just now, its mtime. A hold's age is
    measured on it, never on this host's clock: on a shared filesystem the server stamps the holder's heartbeat (NFS),
    and a host whose clock is minutes ahead of it (no NTP in a node, a clock stepped after a VM resumed) took a live
    run's hold, touched a second ago, for a dead host's, and ran a second run over its folder. This host's clock where
    nothing can be made there."""
    try:
        fd, probe = tempfile.mkstemp(prefix='.now-', dir=folder)
    except OSError:
        return time.time()
    try:
        return os.fstat(fd).st_mtime
    finally:
        os.close(fd)
        os.remove(probe)


def let_go(folder):
    """Releases the hold on folder now, rather than at exit (prepare.py, before it removes the folders it made)."""
    if folder in _held:
        _held.pop(folder)()


def try_hold(folder, what):
    """hold() for this process alone, never exiting: None where it now holds folder (or cannot write there: what
    it writes there fails alike), else where a live run holds it, the words that name that run."""
    refusal = _take(folder, what, tidy=True)
    return refusal[len('error: '):].split(': wait for')[0] if refusal and ' is in use by ' in refusal else None


def hold(folder, what='another run', collective=True):
    """Holds folder for the rest of this process (released at its exit, whichever way out): a second run over it
    is refused in one line naming the holder. A hold whose holder died (on this host), whose heartbeat stopped (on
    another host sharing the folder), or that this run's own launcher left (a torchrun restart, a SLURM requeue, a
    container of its Kubernetes job restarted: another pod's rank 0 may take it then) is taken over. collective:
    rank 0 takes it and every rank learns the verdict (a collective)."""
    if not collective:
        verdict = [_take(folder, what)]
    else:
        import torch.distributed as dist  # here: prepare.py holds its folder without torch (0.7 s to import)
        pods = launch_pods()
        verdict = [_take(folder, what, pods=pods) if dist.get_rank() == 0 else None]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(verdict, src=0)
            verdict[0] = verdict[0] or _not_shared(folder)
    if verdict[0]:
        sys.exit(verdict[0])


def _not_shared(folder):
    """None where every node sees the folder that rank 0 holds, else the one-line error (a collective). On each
    node's own disk a run trains on, but a sharded checkpoint's files are split over the nodes (none can load it) and
    a resume finds rank 0's checkpoint on its node alone. Each node's first rank writes a file of a new name there
    and rank 0 looks it up: a new name is asked of the server, never answered from a cache of names looked up
    before, as NFS answers for up to a minute that a folder made since is not there."""
    import torch.distributed as dist
    rank, mine, made, failed = dist.get_rank(), None, [], None
    if rank != 0 and os.environ.get('LOCAL_RANK', '0') == '0':
        made, mine = _to_make(folder), os.path.join(folder, f'.node-{uuid.uuid4().hex}')
        try:
            os.makedirs(folder, exist_ok=True)
            open(mine, 'x').close()
        except OSError as e:
            failed = e.strerror
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (socket.gethostname(), mine, failed))
    verdict = [None]
    if rank == 0:
        here = socket.gethostname()
        for r, (host, mark, why) in enumerate(seen):
            if why:
                verdict[0] = f"error: cannot write in {folder} on host {host}, rank {r} ({why}): give a folder " \
                             f"that every node can write in"
            elif mark and not os.path.exists(mark):
                verdict[0] = (f"error: {folder} is not one folder on every node: what rank {r} wrote there on host "
                              f"{host} is not in rank 0's on host {here}, and every node writes its ranks' part of "
                              f"a checkpoint there and reads the others' to resume: give a folder on a filesystem "
                              f"that every node shares (NFS, Lustre, a ReadWriteMany volume)")
            if verdict[0]:
                break
    dist.broadcast_object_list(verdict, src=0)
    if mine and os.path.exists(mine):
        os.remove(mine)
    _remove_empty(made)  # the folder it made on a node's own disk, where the run is refused
    return verdict[0]


def snapshot_dir(run_id):
    """The node-local folder of a run's memory snapshots: /dev/shm lives in RAM, so it outlives a training
    process (killed, crashed, restarted by torchrun) but not a reboot or a lost node."""
    if run_id and not RUN_ID.fullmatch(str(run_id)):  # read_run_id checked it; a new one is a uuid's hex
        raise ValueError(f"{run_id!r} is no run id")
    return os.path.join('/dev/shm' if os.path.isdir('/dev/shm') else tempfile.gettempdir(), f'nanogpt-{run_id}')


# a node's memory snapshots of a run kept out of RAM in its out_dir (checkpoint.keep_earlier_snapshots): by a start
# afresh that took it over (moved with its other saved states into before-RUN_ID/), or by a copy's start (kept)
KEPT_SNAPSHOTS = re.compile(r'snapshots\.(before|kept)-[^/]+(?<!\.tmp)')


def in_ram(path):
    """Whether path lies in a run's snapshot folder in node-local memory (None: no path)."""
    return path is not None and os.path.abspath(path).startswith(snapshot_dir(''))


def is_snapshot(path):
    """Whether path is (or lies in) a memory snapshot, read as one: in node-local memory, or kept in an out_dir
    (a file or a DeepSpeed step folder of a kept_folder, or a file of that step folder), not a checkpoint of out_dir
    (None: no path)."""
    if path is None:
        return False
    parent = os.path.dirname(os.path.abspath(path))
    return in_ram(path) or kept_folder(parent) or kept_folder(os.path.dirname(parent))


def kept_folder(folder):
    """Whether folder holds a run's memory snapshots kept out of RAM: named so (KEPT_SNAPSHOTS) for the run in the
    folder it lies in (its run_id), so that a user's folder that happens to be named so is none."""
    name = os.path.basename(folder)
    if not KEPT_SNAPSHOTS.fullmatch(name):
        return False
    try:
        with open(os.path.join(os.path.dirname(folder), 'run_id'), encoding='utf-8') as f:
            run_id = f.read(200).strip()
    except (OSError, UnicodeDecodeError):
        return False
    return bool(run_id) and name.startswith((f'snapshots.before-{run_id}-', f'snapshots.kept-{run_id}-'))
