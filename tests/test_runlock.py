"""One run at a time per folder (runlock.py): a second start over a run's out_dir is refused in one line naming
the holder while the first goes on untouched; a hold whose process died, whose host stopped touching it, or that
this run's own launcher left (a SLURM requeue) is taken over, also where a container restarted in its pod gave the
dead holder's pid to another process; prepare.py holds its dataset folder the same way.
(An elastic restart taking over its dead workers' hold is in test_fault.py's kill tests.)"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

from conftest import REPO, SHAKESPEARE, TINY, env, one_line_error, run

ARGS = ['--gradient_accumulation_steps=2', '--eval_interval=5']


def plant(folder, **holder):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / 'run.lock').write_text(json.dumps({'host': socket.gethostname(), 'since': 'then', 'launch': None,
                                                 **holder}))
    return folder / 'run.lock'


def dead_pid():
    p = subprocess.Popen(['true'])
    p.wait()
    return p.pid


def test_a_second_run_on_a_busy_out_dir_is_refused_and_the_first_goes_on(tmp_path, data_dir):
    out = tmp_path / 'run'
    first = subprocess.Popen([sys.executable, str(REPO / 'train.py'), *TINY, *ARGS, '--max_iters=100000',
                              f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={out}'], cwd=tmp_path,
                             env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        while not (out / 'metrics.jsonl').exists() or 'iter' not in (out / 'metrics.jsonl').read_text():
            assert first.poll() is None, first.stdout.read()
            time.sleep(0.2)
        for script, nproc in (('train.py', 1), ('fsdp_train.py', 2)):
            p = run(script, *TINY, *ARGS, '--max_iters=10', f'--dataset={data_dir / "shakespeare_char"}',
                    f'--out_dir={out}', nproc=nproc, cwd=tmp_path, check=False)
            error = one_line_error(p, nproc)
            assert f'{out} is in use by another run on host {socket.gethostname()}, pid {first.pid}' in error, error
        assert first.poll() is None  # untouched: still training
    finally:
        first.send_signal(signal.SIGTERM)  # a preemption: it saves and ends
        first.wait(timeout=120)
    rows = [json.loads(line) for line in (out / 'metrics.jsonl').read_text().splitlines()]
    iters = [r['iter'] for r in rows if 'loss' in r]
    assert iters == list(range(len(iters))), iters  # one run's log, not two interleaved
    assert not (out / 'run.lock').exists()  # released at its exit


def test_holds_of_the_dead_of_stale_hosts_and_of_a_requeue_are_taken_over(tmp_path, data_dir, monkeypatch):
    def start(out, check=True):
        return run('train.py', *TINY, *ARGS, '--max_iters=2', f'--dataset={data_dir / "shakespeare_char"}',
                   f'--out_dir={out}', cwd=tmp_path, check=check)
    plant(tmp_path / 'dead', pid=dead_pid())
    assert 'taking over the hold' in start(tmp_path / 'dead').stdout
    assert not (tmp_path / 'dead' / 'run.lock').exists()
    lock = plant(tmp_path / 'stale', host='another-host', pid=1)
    os.utime(lock, (time.time() - 600, time.time() - 600))
    assert 'has not touched it for' in start(tmp_path / 'stale').stdout
    # a container restarted in its pod (Kubernetes) starts its processes at the pids of the last one's: the pid of
    # the hold's dead holder is another live process's now, which only its start tells apart
    plant(tmp_path / 'restarted', pid=os.getpid(), started=1)
    assert 'taking over the hold' in start(tmp_path / 'restarted').stdout
    # and on a job of several pods, rank 0 may come back on another pod than the holder's, which touched its hold a
    # moment ago: that pod running this start again says its holder is gone
    plant(tmp_path / 'moved', host='job-worker-0', pid=1, pods=['pod-a', 'pod-b'])
    monkeypatch.setenv('POD_UID', 'pod-b')
    assert 'a pod of its launch, pod-b, runs this start' in start(tmp_path / 'moved').stdout
    monkeypatch.delenv('POD_UID')
    plant(tmp_path / 'fresh', host='another-host', pid=1)  # touched just now: alive over there
    assert 'is in use by another run on host another-host' in one_line_error(start(tmp_path / 'fresh', check=False))
    # a SLURM requeue: the same job and step, whose old process may still be in its last moments
    plant(tmp_path / 'requeued', pid=os.getpid(), launch='slurm-77.0')
    monkeypatch.setenv('SLURM_JOB_ID', '77')
    monkeypatch.setenv('SLURM_STEP_ID', '0')
    assert "this run's launcher restarted it" in start(tmp_path / 'requeued').stdout
    monkeypatch.setenv('SLURM_JOB_ID', '78')  # another job is another run
    plant(tmp_path / 'other-job', pid=os.getpid(), launch='slurm-77.0')
    assert 'is in use' in one_line_error(start(tmp_path / 'other-job', check=False))
    # torchrun's static rendezvous (--master_port, --node_rank) names every launch 'none': the same command on
    # another host over this folder is another run, not a restart of this one
    monkeypatch.delenv('SLURM_JOB_ID')
    monkeypatch.setenv('TORCHELASTIC_RUN_ID', 'none')
    monkeypatch.setenv('MASTER_ADDR', '127.0.0.1')
    monkeypatch.setenv('MASTER_PORT', '29555')
    plant(tmp_path / 'static', host='another-host', pid=1, launch='torchrun-none@127.0.0.1:29555')
    assert 'is in use' in one_line_error(start(tmp_path / 'static', check=False))


def test_prepare_holds_its_dataset_folder(tmp_path):
    folder = tmp_path / 'data' / 'shakespeare_char'
    plant(folder, pid=os.getpid())  # this test process: alive, on this host
    p = run('prepare.py', 'shakespeare_char', f'--input={SHAKESPEARE}', f'--out_root={tmp_path / "data"}',
            cwd=tmp_path, check=False)
    assert 'is in use by another prepare.py' in one_line_error(p)
    assert sorted(f.name for f in folder.iterdir()) == ['run.lock']  # nothing written beside it
    (folder / 'run.lock').unlink()
    run('prepare.py', 'shakespeare_char', f'--input={SHAKESPEARE}', f'--out_root={tmp_path / "data"}', cwd=tmp_path)
    assert sorted(f.name for f in folder.iterdir()) == ['meta.pkl', 'prep.json', 'train.bin', 'val.bin']


def test_a_folder_that_cannot_be_made_is_not_called_a_full_disk(tmp_path):
    # "free some space" is the fix for a full disk only: a link to nowhere in the folder's place is another matter
    sys.path.insert(0, str(REPO))
    import runlock
    (tmp_path / 'scratch').symlink_to(tmp_path / 'purged')
    said = runlock._take(str(tmp_path / 'scratch' / 'run'), 'a run')
    assert said.startswith(f"error: cannot write in {tmp_path / 'scratch' / 'run'} (") and \
        said.endswith('): give a folder this user can write in')
    assert 'free some space' not in said and not (tmp_path / 'purged').exists()


def test_a_hold_that_is_a_folder_or_a_link_to_nothing_is_named_not_taken_for_a_run(tmp_path):
    # it read as "in use by another run on host None" for two minutes, and then as a traceback
    sys.path.insert(0, str(REPO))
    import runlock
    (tmp_path / 'a' / 'run.lock').mkdir(parents=True)
    (tmp_path / 'a' / 'run.lock' / 'mine').write_text('kept')
    os.utime(tmp_path / 'a' / 'run.lock', (time.time() - 600, time.time() - 600))
    (tmp_path / 'b').mkdir()
    (tmp_path / 'b' / 'run.lock').symlink_to(tmp_path / 'nowhere')
    for folder in (tmp_path / 'a', tmp_path / 'b'):
        said = runlock._take(str(folder), 'a run')
        assert said == f"error: {folder / 'run.lock'} is no file (a folder, or a link to nothing), where the hold " \
                       f"goes: move it out of {folder}"
        assert sorted(os.listdir(folder)) == ['run.lock']  # nothing of ours left beside it
    assert (tmp_path / 'a' / 'run.lock' / 'mine').read_text() == 'kept'


def test_a_folder_on_a_filesystem_without_hard_links_is_held_all_the_same(tmp_path, monkeypatch):
    # vfat, exFAT and some FUSE mounts of buckets refuse link(): every start there stopped in a traceback
    sys.path.insert(0, str(REPO))
    import errno
    import runlock

    def no_links(*args, **kwargs):
        raise PermissionError(errno.EPERM, 'Operation not permitted')
    monkeypatch.setattr(os, 'link', no_links)
    folder = tmp_path / 'new' / 'run'
    assert runlock._take(str(folder), 'a run') is None
    assert json.loads((folder / 'run.lock').read_text())['pid'] == os.getpid() and os.listdir(folder) == ['run.lock']
    runlock._held.pop(str(folder))()  # the release at the exit: nothing left of the run that made the folders
    assert not (tmp_path / 'new').exists()
    plant(folder, pid=1)  # alive on this host: a second run is refused, its hold left as it was
    assert 'is in use by a run on host' in runlock._take(str(folder), 'a run')
    assert json.loads((folder / 'run.lock').read_text())['pid'] == 1 and os.listdir(folder) == ['run.lock']


def test_a_hold_in_a_folder_made_read_only_meanwhile_is_let_go_without_a_traceback(tmp_path, monkeypatch):
    # a run whose out_dir was made read-only mid-run (chattr +i, a remount) stopped with its one-line error, then
    # printed the release's PermissionError as a traceback at its exit; the hold left there is a dead holder's
    sys.path.insert(0, str(REPO))
    import errno
    import runlock
    folder = tmp_path / 'run'
    folder.mkdir()
    assert runlock._take(str(folder), 'a run') is None

    def read_only(path, *args, **kwargs):
        raise PermissionError(errno.EPERM, 'Operation not permitted', path)
    monkeypatch.setattr(os, 'remove', read_only)
    runlock._held.pop(str(folder))()
    monkeypatch.undo()
    assert json.loads((folder / 'run.lock').read_text())['pid'] == os.getpid()


def test_a_host_whose_clock_is_ahead_leaves_a_live_hold_alone(tmp_path, monkeypatch):
    # a host minutes ahead of the clock that stamps the shared folder's files (NFS: its server's; no NTP in a node,
    # or a clock stepped as a VM resumed) took a hold touched a second ago for a dead host's, and ran over the run
    sys.path.insert(0, str(REPO))
    import types
    import runlock
    monkeypatch.setattr(runlock, 'time', types.SimpleNamespace(time=lambda: time.time() + 3600,
                                                                strftime=time.strftime, sleep=time.sleep))
    live = plant(tmp_path / 'live', host='another-host', pid=1)  # touched just now, on the folder's clock
    assert 'is in use by a run on host another-host' in runlock._take(str(tmp_path / 'live'), 'a run')
    assert json.loads(live.read_text())['host'] == 'another-host' and not runlock.abandoned(str(tmp_path / 'live'))
    dead = plant(tmp_path / 'dead', host='another-host', pid=1)  # untouched for 10 minutes, on that clock too
    os.utime(dead, (time.time() - 600, time.time() - 600))
    assert runlock.abandoned(str(tmp_path / 'dead')) and runlock._take(str(tmp_path / 'dead'), 'a run') is None
    runlock._held.pop(str(tmp_path / 'dead'))()
    assert sorted(os.listdir(tmp_path)) == ['dead', 'live'] and os.listdir(tmp_path / 'live') == ['run.lock']


def test_a_start_in_another_container_of_the_host_leaves_a_live_hold_alone(tmp_path):
    # containers of one host may share its hostname (docker --network=host), each with pids of its own: a start in
    # one looked up the holder's pid in its own namespace, found none, and ran a second run over the live one
    sys.path.insert(0, str(REPO))
    import runlock
    for folder, pid in (('dead-here', dead_pid()), ('mine-here', os.getpid())):  # (as this namespace sees them)
        plant(tmp_path / folder, pid=pid, pidns='pid:[1]')  # touched just now, in another namespace
        assert 'is in use by a run on host' in runlock._take(str(tmp_path / folder), 'a run')
        assert not runlock.abandoned(str(tmp_path / folder)) and os.listdir(tmp_path / folder) == ['run.lock']
    lock = plant(tmp_path / 'stale', pid=dead_pid(), pidns='pid:[1]')  # its heartbeat stopped: taken over
    os.utime(lock, (time.time() - 600, time.time() - 600))
    assert runlock._take(str(tmp_path / 'stale'), 'a run') is None
    assert json.loads(lock.read_text())['pidns'] == os.readlink('/proc/self/ns/pid')
    runlock._held.pop(str(tmp_path / 'stale'))()
