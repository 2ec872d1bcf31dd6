"""slurm/torchrun.sbatch on a real SLURM: this module starts munged, slurmctld and two slurmd (nodes n1 and n2)
on this host, runs CPU jobs on gloo through the script, and stops its own daemons at the end.

Each slurmd runs in its own UTS and mount namespace, with the hostname of its node and an /etc/hosts that maps
n1 and n2 to 127.0.0.1, so the node names that `scontrol show hostnames` gives resolve inside the jobs (the
torchrun rendezvous is on the first of them). Starting the daemons takes root, as CI has.
"""

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

from conftest import REPO, TINY, env, free_port, read_metrics, run
from test_k8s import script_config  # puts the repo on sys.path

import decent  # noqa: E402
import distributed  # noqa: E402

INSTALL = 'apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge'
SBATCH = REPO / 'slurm' / 'torchrun.sbatch'
NODES = ('n1', 'n2')
# the reference's global batch: 4 micro-steps of 4 sequences, which 2 nodes share out as 2 each
BASE = ['--gradient_accumulation_steps=4', '--max_iters=10', '--eval_interval=10']


def slurm_conf(root, ports):
    """One controller and two nodes on 127.0.0.1, each on its own port; no accounting, cgroups or systemd."""
    return f"""\
ClusterName=pytest
SlurmctldHost=localhost
SlurmctldPort={ports['ctld']}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge-run/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
# the nodes are whatever this host is; take their size from this file
SlurmdParameters=config_overrides
# finished jobs stay in `scontrol show job` (there is no accounting database for sacct)
MinJobAge=3600
# a stopped run's processes get 5 s between SIGTERM and SIGKILL (30 by default): requeues are quicker
KillWait=5
# the main scheduler tests the pending jobs every second: a requeued job waited for it (60 s by default) or for the
# backfill scheduler (30 s) to start it once its begin time had passed, 21 s and more
SchedulerParameters=sched_interval=1
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port={ports['n1']} CPUs=2 State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port={ports['n2']} CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
"""


class Cluster:
    """munged, slurmctld and a slurmd per node, as child processes of the test; stop() ends exactly those."""

    def __init__(self, root):
        self.root, self.procs = root, []
        self.conf = root / 'slurm.conf'
        self.env = {**env(), 'SLURM_CONF': str(self.conf), 'OMP_NUM_THREADS': '1'}  # 2 cores, up to 4 ranks
        # jobs find this interpreter's python and torchrun first, and the daemons where Debian puts them
        self.env['PATH'] = f"{os.path.dirname(sys.executable)}:{self.env.get('PATH', '')}:/usr/sbin:/sbin"
        self.log = open(root / 'daemons.log', 'w')

    def start(self):
        missing = [b for b in ('munged', 'slurmctld', 'slurmd', 'sbatch', 'scontrol', 'sinfo', 'squeue', 'scancel')
                   if shutil.which(b, path=self.env['PATH']) is None]
        if missing:
            pytest.fail(f"SLURM is not installed ({', '.join(missing)} missing): run `{INSTALL}` as root")
        if os.geteuid() != 0:
            pytest.fail("the SLURM test starts its nodes in their own mount namespaces, which takes root")
        root = self.root
        (root / 'state').mkdir()
        for node in NODES:
            (root / f'spool-{node}').mkdir()
        (root / 'munge-key').mkdir(mode=0o700)  # munged refuses a key that others can read
        (root / 'munge-run').mkdir()
        (root / 'munge-run').chmod(0o755)
        key = root / 'munge-key' / 'munge.key'
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        ports = {'ctld': free_port(), **{node: free_port() for node in NODES}}
        self.conf.write_text(slurm_conf(root, ports))
        hosts = root / 'hosts'
        hosts.write_text(open('/etc/hosts').read() + '\n127.0.0.1 ' + ' '.join(NODES) + '\n')
        # every daemon in the foreground, so that the PID the test holds is the daemon's own; --force because
        # pytest's temporary folders are private (0700) and munged wants a socket path that anyone can traverse
        self.spawn('munged', '--foreground', '--force', f'--key-file={key}', f'--socket={root}/munge-run/munge.socket',
                   f'--pid-file={root}/munged.pid', f'--log-file={root}/munged.log', f'--seed-file={root}/munged.seed')
        self.wait_for(lambda: (root / 'munge-run' / 'munge.socket').exists(), 10, 'munged to open its socket')
        self.spawn('slurmctld', '-D', '-i', '-f', str(self.conf))
        for node in NODES:
            # unshare and sh exec into slurmd, so it keeps the PID; jobs inherit its hostname and /etc/hosts
            self.spawn('unshare', '--mount', '--uts', '--propagation', 'private', 'sh', '-c',
                       f'mount --bind {hosts} /etc/hosts && hostname {node} && exec slurmd -D -f {self.conf} -N {node}')
        self.wait_for(lambda: self.node_states() == {node: 'idle' for node in NODES}, 30, 'both nodes to be idle')

    def spawn(self, *cmd):
        self.procs.append(subprocess.Popen(cmd, env=self.env, stdout=self.log, stderr=subprocess.STDOUT))

    def node_states(self):
        p = subprocess.run(['sinfo', '--noheader', '--Node', '--format=%N %t'], env=self.env, capture_output=True,
                           text=True)
        return dict(line.split() for line in p.stdout.splitlines()) if p.returncode == 0 else {}

    def jobs_left(self):
        p = subprocess.run(['squeue', '--noheader'], env=self.env, capture_output=True, text=True)
        return p.returncode == 0 and p.stdout.strip() != ''

    def wait_for(self, ready, timeout, what):
        deadline = time.time() + timeout
        while not ready():
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead or time.time() > deadline:
                reason = f"{', '.join(dead)} exited" if dead else f"no luck in {timeout} s"
                pytest.fail(f"waiting for {what}: {reason}\n{self.daemon_logs()}")
            time.sleep(0.2)

    def daemon_logs(self):
        logs = sorted(self.root.glob('*.log'))
        return '\n'.join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in logs)

    def stop(self):
        # our jobs first (scancel reaches only this cluster's), then our daemons, by the PIDs we started
        if self.procs:
            subprocess.run(['scancel', '--full', '--user=root'], env=self.env, capture_output=True)
            deadline = time.time() + 20
            while self.jobs_left() and time.time() < deadline:
                time.sleep(0.5)
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.log.close()

    def sbatch(self, cwd, script, *args, nodes, nproc):
        """Submits slurm/torchrun.sbatch for `script` with `args`; returns the job id."""
        e = {**self.env, 'NPROC_PER_NODE': str(nproc), 'RDZV_PORT': str(free_port())}
        p = subprocess.run(['sbatch', '--parsable', f'--nodes={nodes}', f'--chdir={cwd}', str(SBATCH),
                            str(REPO / script), *map(str, args)], env=e, capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        return p.stdout.strip().split(';')[0]

    def job(self, job_id):
        """JobState, Restarts, ExitCode and StdOut of a job, from `scontrol show job` (no accounting here)."""
        p = subprocess.run(['scontrol', 'show', 'job', '--oneliner', job_id], env=self.env, capture_output=True,
                           text=True, check=True)
        return {k: re.search(rf'\b{k}=(\S+)', p.stdout).group(1) for k in ('JobState', 'Restarts', 'ExitCode',
                                                                           'StdOut')}

    def wait_job(self, job_id, until=('COMPLETED', 'FAILED', 'CANCELLED', 'TIMEOUT', 'NODE_FAIL'), timeout=240):
        """Polls the job until its state is one of `until` (sbatch --wait polls far more slowly)."""
        deadline = time.time() + timeout
        while (info := self.job(job_id))['JobState'] not in until:
            if time.time() > deadline:
                subprocess.run(['scancel', job_id], env=self.env)
                pytest.fail(f"job {job_id} still {info['JobState']} after {timeout} s\n{job_logs(info)}")
            time.sleep(0.5)
        return info


def job_logs(info):
    """The job's batch output and every node's log, for assertion messages."""
    out = Path(info['StdOut'])
    logs = [out, *sorted(out.parent.glob('logs/*/*.log'))]
    return '\n'.join(f"== {p}\n{p.read_text()[-3000:]}" for p in logs if p.exists())


@pytest.fixture(scope='module')
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp('slurm'))
    try:
        c.start()
        yield c
    finally:
        c.stop()


@pytest.fixture(scope='module')
def ref(tmp_path_factory, data_dir):
    """train.py in one plain process: the per-step losses that every job below must reproduce."""
    tmp = tmp_path_factory.mktemp('ref')
    run('train.py', *TINY, *BASE, f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={tmp / "ref"}', cwd=tmp)
    losses, _ = read_metrics(tmp / 'ref')
    assert losses[9] < losses[0] - 0.3  # it learns
    return losses


def submit_tiny(cluster, tmp_path, data_dir, script, *extra, nodes, nproc):
    return cluster.sbatch(tmp_path, script, *TINY, *BASE, f'--dataset={data_dir / "shakespeare_char"}',
                          f'--out_dir={tmp_path / "out"}', *extra, nodes=nodes, nproc=nproc)


@pytest.mark.parametrize('script', ['train.py', 'fsdp_train.py', 'ds_train.py'])
def test_two_node_job_completes_and_matches_one_process(cluster, ref, tmp_path, data_dir, script):
    job = submit_tiny(cluster, tmp_path, data_dir, script, nodes=2, nproc=1)
    info = cluster.wait_job(job)
    assert info['JobState'] == 'COMPLETED', job_logs(info)
    node_logs = sorted(p.name for p in (tmp_path / 'logs' / f'gpt-train-{job}').iterdir())
    assert node_logs == ['n1.log', 'n2.log']  # one torchrun per node, each with its own log
    assert 'rendezvous n1:' in open(info['StdOut']).read()  # on the first of `scontrol show hostnames`
    losses, _ = read_metrics(tmp_path / 'out')
    config = json.loads((tmp_path / 'out' / 'config.json').read_text())
    assert config['world_size'] == 2
    assert sorted(losses) == list(range(10))
    for it in range(10):
        assert abs(losses[it] - ref[it]) <= 1e-5 * abs(ref[it]), (it, losses[it], ref[it])


def test_decentralized_job_on_two_nodes_of_two_mixes_within_and_across_nodes(cluster, tmp_path, data_dir):
    # alternating-exp-ring needs the node structure: torchrun on each node sets LOCAL_WORLD_SIZE=2 of WORLD_SIZE=4
    job = submit_tiny(cluster, tmp_path, data_dir, 'decent_train.py', '--topology=alternating-exp-ring', nodes=2,
                      nproc=2)
    info = cluster.wait_job(job)
    assert info['JobState'] == 'COMPLETED', job_logs(info)
    # rank 0 prints, on whichever node the rendezvous made the first
    log = ''.join(p.read_text() for p in sorted((tmp_path / 'logs' / f'gpt-train-{job}').glob('*.log')))
    assert 'topology alternating-exp-ring, a cycle of 2 mixing rounds' in log, log[-3000:]
    assert json.loads((tmp_path / 'out' / 'config.json').read_text())['world_size'] == 4
    losses, _ = read_metrics(tmp_path / 'out')
    assert sorted(losses) == list(range(10)) and losses[9] < losses[0] - 0.3  # it learns


@pytest.mark.parametrize('bad, error', [
    ('--bacth_size=4', "unknown config key 'bacth_size'; did you mean batch_size"),  # from train.py's configurator
    ('--dataset=/nonexistent', "/nonexistent/train.bin not found: run `python prepare.py"),  # from train.py
], ids=['bad-key', 'missing-data'])
def test_a_failing_job_is_reported_failed_with_the_error_in_its_log(cluster, tmp_path, data_dir, bad, error):
    job = submit_tiny(cluster, tmp_path, data_dir, 'train.py', bad, nodes=2, nproc=1)
    info = cluster.wait_job(job)
    assert info['JobState'] == 'FAILED' and info['ExitCode'] != '0:0', job_logs(info)
    assert error in open(info['StdOut']).read(), job_logs(info)


def test_srun_of_several_tasks_without_torchrun_is_refused_in_one_line(cluster, tmp_path, data_dir):
    # `srun python train.py` sets no RANK: each task would train alone, over one out_dir, in the allocation meant for
    # one job of them all
    p = subprocess.run(['srun', '--nodes=2', '--ntasks-per-node=1', f'--chdir={tmp_path}', sys.executable,
                        str(REPO / 'train.py'), *TINY, f'--dataset={data_dir / "shakespeare_char"}',
                        f'--out_dir={tmp_path / "out"}'], env=cluster.env, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    lines = [line for line in (p.stdout + p.stderr).splitlines() if line.startswith('error: ')]
    assert lines == ["error: srun started 2 tasks of train.py without torchrun, which would each train alone: start "
                     "one torchrun a node, `srun --ntasks-per-node=1 torchrun --nnodes=$SLURM_NNODES "
                     "--nproc_per_node=N --rdzv-backend=c10d --rdzv-endpoint=HEAD:29500 train.py ...`, or submit "
                     "`sbatch slurm/torchrun.sbatch train.py ...`"], p.stdout + p.stderr
    assert not (tmp_path / 'out').exists()


STEPS_AFTER = 20  # the steps that the requeued run takes past the signalled one's checkpoint


def signalled(cluster, tmp_path, data_dir, sig):
    """A one-node job of train.py sent sig once it has saved its first checkpoint, released from the queue when SLURM
    has requeued it, and waited for: its final info and the iteration its first run saved at SLURM's signal."""
    # the first run trains until the signal lands, however late (34 to 51 steps past the first checkpoint, at iter
    # 100, with the 2 cores' other jobs on them; on an AMD EPYC's quieter 2 cores, 2.8 ms a step, 500 steps had ended
    # first): its config file's max_iters is far off. While the job waits requeued, its user sets the run's end there
    # (the file is read again at every start): the requeued run resumes and finishes STEPS_AFTER steps on
    out = tmp_path / 'out'
    config = tmp_path / 'run_config.py'
    config.write_text('max_iters = 1_000_000\n')
    job = cluster.sbatch(tmp_path, 'train.py', config, *TINY, f'--dataset={data_dir / "shakespeare_char"}',
                         f'--out_dir={out}', '--gradient_accumulation_steps=1', '--eval_interval=100',
                         '--always_save_checkpoint=True', *(['--auto_resume=False'] if sig == 'USR1' else []),
                         nodes=1, nproc=1)
    cluster.wait_for(lambda: (out / 'ckpt.pt').exists() or cluster.job(job)['JobState'] not in ('PENDING', 'RUNNING'),
                     120, 'the first checkpoint')
    assert (out / 'ckpt.pt').exists(), job_logs(cluster.job(job))
    # what SLURM sends the batch shell before a time limit (--signal=B:USR1@120) or on preemption (SIGTERM)
    subprocess.run(['scancel', f'--signal={sig}', '--batch', job], env=cluster.env, check=True)
    cluster.wait_for(lambda: cluster.job(job)['Restarts'] == '1' and cluster.job(job)['JobState'] == 'PENDING', 60,
                     'the job to be requeued')
    saves = lambda: re.findall(r'SIGTERM: saving a checkpoint at iter (\d+) and exiting', ''.join(
        p.read_text() for p in (tmp_path / 'logs' / f'gpt-train-{job}').glob('*.log')))
    cluster.wait_for(saves, 10, "the first run's checkpoint at the signal")
    saved = saves()
    assert len(saved) == 1, job_logs(cluster.job(job))
    config.write_text(f'max_iters = {int(saved[0]) + STEPS_AFTER}\n')
    # SLURM holds a requeued job for two minutes; release it in 3 s. Not at once: slurmd refuses a credential made in
    # the second its old run was killed in ('Job credential revoked'), and slurmctld then fails the job
    subprocess.run(['scontrol', 'update', f'JobId={job}', 'StartTime=now+3'], env=cluster.env, check=True)
    return job, cluster.wait_job(job), int(saved[0])


@pytest.fixture(scope='module')
def signalled_jobs(cluster, tmp_path_factory, data_dir):
    """The jobs of both signals at once, one on each node (each mostly waits: for its checkpoint, its requeue, its
    release): {sig: (its folder, job id, final info, the iteration saved at the signal)}."""
    folders = {sig: tmp_path_factory.mktemp(f'signalled-{sig}') for sig in ('USR1', 'TERM')}
    with ThreadPoolExecutor(2) as pool:
        jobs = {sig: pool.submit(signalled, cluster, folder, data_dir, sig) for sig, folder in folders.items()}
    return {sig: (folders[sig], *job.result()) for sig, job in jobs.items()}


@pytest.mark.parametrize('sig', ['USR1', 'TERM'], ids=['time-limit-warning', 'preemption'])
def test_a_signalled_job_is_requeued_and_resumes_from_its_checkpoint(signalled_jobs, sig):
    tmp_path, job, info, stopped = signalled_jobs[sig]
    out = tmp_path / 'out'
    assert info['JobState'] == 'COMPLETED' and info['Restarts'] == '1', job_logs(info)
    batch_log = open(info['StdOut']).read()
    assert f'SIG{sig}: requeueing job {job}' in batch_log, batch_log
    # both runs, appended (each node's log, should the requeued run have landed on the other node)
    node_log = ''.join(p.read_text() for p in sorted((tmp_path / 'logs' / f'gpt-train-{job}').glob('*.log')))
    # the requeued run was started with the first one's arguments: it resumed by itself (train.py's auto_resume), also
    # where they said --auto_resume=False (USR1's job): that started the job's first run afresh, not its requeued one
    auto = re.findall(rf"auto-resume: {re.escape(str(out))} holds (?:this run's state at iter |the state of the run "
                      rf"that this launch started \(iter )(\d+)", node_log)
    resumed = re.findall(r'resuming from .*ckpt\.pt at iter (\d+)', node_log)
    assert len(resumed) == 1 and 100 <= int(resumed[0]) == stopped and auto == resumed, node_log[-3000:]
    # the run SLURM stopped got SIGTERM and saved a checkpoint at the end of its step: nothing is redone
    saved = re.findall(r'SIGTERM: saving a checkpoint at iter (\d+) and exiting', node_log)
    assert saved == resumed, node_log[-3000:]
    losses, _ = read_metrics(out)
    # the steps after the checkpoint were logged again, once, and the run ended where its config file said
    assert sorted(losses) == list(range(stopped + STEPS_AFTER))


def test_a_job_its_user_cancels_stays_cancelled(cluster, tmp_path):
    # scancel sends the batch shell SIGTERM, as a preemption does: the script must not requeue a job that is ending
    (tmp_path / 'train.py').write_text('import time\nprint("started", flush=True)\ntime.sleep(600)\n')
    job = cluster.sbatch(tmp_path, tmp_path / 'train.py', nodes=1, nproc=1)
    logs = tmp_path / 'logs' / f'gpt-train-{job}'
    cluster.wait_for(lambda: any('started' in p.read_text() for p in logs.glob('*.log')), 120, 'the job to start')
    subprocess.run(['scancel', job], env=cluster.env, check=True)
    cluster.wait_for(lambda: cluster.job(job)['JobState'] not in ('RUNNING', 'COMPLETING'), 60, 'the job to end')
    info = cluster.job(job)
    assert info['JobState'] == 'CANCELLED' and info['Restarts'] == '0', job_logs(info)
    assert 'not requeueing it' in open(info['StdOut']).read(), job_logs(info)


def srun_args(tmp_path, nodelist, hostnames, cpus_per_node='2', node_info=''):
    """Runs the script with stand-ins for scontrol (which lists hostnames and prints node_info for any node), srun
    (which notes its arguments, runs its command as nodes 0 and 1 would, and fails as srun does when it cannot make
    the step) and torchrun (which notes its arguments on each node). Returns the script's completed process, the
    arguments srun got, and those torchrun got on nodes 0 and 1."""
    bin_ = tmp_path / 'bin'
    bin_.mkdir()
    (bin_ / 'scontrol').write_text(f'#!/bin/sh\n[ "$2" = hostnames ] && printf "{hostnames}" || printf "{node_info}"\n')
    (bin_ / 'srun').write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/srun-args\n'
                               'while [ "${1#--}" != "$1" ]; do shift; done\n'  # its options, then the command
                               'for id in 0 1; do SLURM_NODEID=$id "$@"; done\n'
                               'echo "srun: error: Unable to create step for job 7"; exit 1\n')
    (bin_ / 'torchrun').write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/torchrun-args-$SLURM_NODEID\n')
    for f in bin_.iterdir():
        f.chmod(0o755)
    (tmp_path / 'train.py').write_text('')
    slurm = {'SLURM_JOB_ID': '7', 'SLURM_JOB_NAME': 'gpt-train', 'SLURM_JOB_NODELIST': nodelist,
             'SLURM_NNODES': str(hostnames.count('\\n')), 'SLURM_JOB_CPUS_PER_NODE': cpus_per_node,
             'SLURM_GPUS_ON_NODE': '8'}
    p = subprocess.run(['bash', str(SBATCH), 'train.py'], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env={'PATH': f"{bin_}:/usr/bin:/bin", **slurm})
    return p, (tmp_path / 'srun-args').read_text().split(), \
        [(tmp_path / f'torchrun-args-{i}').read_text().split() for i in range(2)]


def test_nodes_of_different_sizes_get_a_cpu_count_that_each_has(tmp_path):
    # srun refuses a step that asks any node for more CPUs than it has ("More processors requested than permitted",
    # seen on this SLURM with nodes of 2 and 1 CPUs); stand-ins for srun and scontrol show the step the script asks for
    p, args, nodes = srun_args(tmp_path, 'gpu[01-02]', 'gpu01\\ngpu02\\n', cpus_per_node='72(x2),36')
    assert '--cpus-per-task=36' in args and all('--nproc-per-node=8' in a for a in nodes), (args, nodes)
    assert all('--rdzv-endpoint=gpu01:29507' in a for a in nodes), nodes  # no NodeAddr to go by: SLURM's name
    assert [a[-1] for a in nodes] == ['train.py', 'train.py'], nodes
    # no logs were written: one line that says so, not grep's and tail's complaints about a missing file
    assert p.returncode == 1 and p.stdout.splitlines()[-1] == 'error: srun exited with status 1 before any node ' \
        'wrote to logs/gpt-train-7/' and p.stderr == '', (p.stdout, p.stderr)


@pytest.mark.parametrize('head, endpoint', [('gpu01', '10.9.8.7'), ('localhost', 'localhost')])
def test_the_rendezvous_goes_to_the_first_nodes_address_where_its_slurm_name_does_not_resolve(tmp_path, head,
                                                                                             endpoint):
    # a cluster whose node names are SLURM's own (NodeName=gpu01 NodeHostname=cn-17): torchrun on every node would
    # fail to find a rendezvous host named gpu01; a name that resolves (localhost here) is kept as it is
    info = f'NodeName={head} Arch=x86_64 CoresPerSocket=1\\n   NodeAddr=10.9.8.7 NodeHostName=cn-17 Version=23.11\\n'
    p, args, nodes = srun_args(tmp_path, f'{head},gpu02', f'{head}\\ngpu02\\n', node_info=info)
    assert all(f'--rdzv-endpoint={endpoint}:29507' in a for a in nodes), (nodes, p.stdout, p.stderr)
    assert p.stderr == '', p.stderr
    # and the first node serves the rendezvous because it is told to: torchrun would look for 10.9.8.7 among its
    # hostname's addresses (cn-17's may be 127.0.1.1), and no node would serve it
    assert ['--rdzv-conf=is_host=1' in a for a in nodes] == [True, False], nodes
    assert ['--rdzv-conf=is_host=0' in a for a in nodes] == [False, True], nodes


@pytest.mark.parametrize('nproc', ['eight', '0', '8,8'])
def test_a_bad_process_count_is_refused_in_one_line_before_any_slurm_call(tmp_path, nproc):
    (tmp_path / 'train.py').write_text('')
    p = subprocess.run(['bash', str(SBATCH), 'train.py'], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env={**os.environ, 'NPROC_PER_NODE': nproc})
    assert p.returncode == 1 and p.stderr == '' and len(p.stdout.splitlines()) == 1, (p.stdout, p.stderr)
    assert p.stdout.startswith(f"error: '{nproc}' processes per node") and 'NPROC_PER_NODE' in p.stdout, p.stdout
    assert sorted(f.name for f in tmp_path.iterdir()) == ['train.py']  # no logs folder made


@pytest.mark.parametrize('args, right', [
    # Decent-DP's scripts take torchrun's path first; here the script starts torchrun itself
    (['/usr/bin/torchrun', 'config/gpt2-small.toml'], 'slurm/torchrun.sbatch train.py config/gpt2-small.toml'),
    (['/usr/bin/torchrun', 'config/decent-gpt2-small.toml', '--seed=1'],
     'slurm/torchrun.sbatch decent_train.py config/decent-gpt2-small.toml ...'),
    (['config/train_gpt2.py', 'fsdp_train.py'], 'slurm/torchrun.sbatch fsdp_train.py config/train_gpt2.py'),
    # torchrun's words before the entrypoint, as its users type them: the counts as this script takes them, the
    # entrypoint's flags kept, the launcher's dropped (not `train.py --nproc_per_node=4` nor `train.py python`)
    (['--nproc_per_node', '4', 'train.py', 'c.py', '--seed=1'], 'NPROC_PER_NODE=4 sbatch [options] '
     'slurm/torchrun.sbatch train.py c.py ...'),
    (['torchrun', '--nnodes=2', '--nproc-per-node=4', 'fsdp_train.py', 'c.toml'], 'NPROC_PER_NODE=4 sbatch [options] '
     '--nodes=2 slurm/torchrun.sbatch fsdp_train.py c.toml'),
    (['python', 'train.py', 'c.py'], ': sbatch [options] slurm/torchrun.sbatch train.py c.py'),
], ids=['torchrun-first', 'decent-toml', 'swapped', 'torchrun-options', 'torchrun-words', 'python'])
def test_an_entrypoint_not_ours_is_refused_in_one_line_before_any_slurm_call(tmp_path, args, right):
    # the check comes before anything that needs SLURM, so bash runs it here as sbatch would on a node
    p = subprocess.run(['bash', str(SBATCH), *args], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and p.stderr == '' and len(p.stdout.splitlines()) == 1, (p.stdout, p.stderr)
    assert p.stdout.startswith(f"error: {args[0]} is not a training entrypoint here") and \
        p.stdout.rstrip().endswith(right), p.stdout
    assert list(tmp_path.iterdir()) == []  # no logs folder made


@pytest.mark.parametrize('script', ['train.py', 'fsdp_train.py', 'ds_train.py', 'decent_train.py', 'pp_train.py'])
def test_every_entrypoint_passes_the_scripts_check(tmp_path, script):
    # from an empty folder: past the check of the name, the script stops at the file it cannot find there
    p = subprocess.run(['bash', str(SBATCH), script, 'config/train_gpt2.py'], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 1 and p.stdout.startswith(f"error: {script} is not a file"), p.stdout


def documented_submissions():
    """Every `sbatch ... slurm/torchrun.sbatch ENTRYPOINT ...` that the docs, the README and the script's own header
    give, continuation lines joined; placeholders (CONFIG, [options]) left out."""
    found = []
    for path in [REPO / 'README.md', SBATCH, *sorted((REPO / 'docs').glob('*.md'))]:
        text = re.sub(r'\\\n#?\s*', ' ', path.read_text())
        for m in re.finditer(r'(?:\w+=\S+ )*sbatch [^\n`|#;]*?slurm/torchrun\.sbatch [^\n`|#;(]*', text):
            words = m.group(0).split()
            if not any('[' in w or (w.isupper() and '=' not in w) or w.endswith('SCRIPT.py') for w in words):
                found.append((path.name, m.group(0).strip()))
    return found


@pytest.mark.parametrize('where, command', documented_submissions())
def test_every_documented_submission_fits_the_ranks_it_asks_for(where, command, monkeypatch):
    """The ranks a documented command starts (--nodes x NPROC_PER_NODE, else --gpus-per-node, else 1, as the
    script counts them) are ones its entrypoint and config run on: the micro-steps divide over the data-parallel
    ranks, and a decentralized topology has the nodes it needs."""
    words = command.split()
    at = words.index('slurm/torchrun.sbatch')
    flags = dict(w.lstrip('-').split('=', 1) for w in words[:at] if '=' in w)
    nodes = int(flags.get('nodes', 1))
    nproc = int(flags.get('NPROC_PER_NODE', flags.get('gpus-per-node', 1)))
    world = nodes * nproc
    monkeypatch.chdir(REPO)
    monkeypatch.setenv('WORLD_SIZE', str(world))  # what Decent-DP's global_batch_size is translated at
    monkeypatch.setenv('LOCAL_WORLD_SIZE', str(nproc))
    config = script_config(words[at + 1], words[at + 2:])
    try:
        distributed.split_accumulation(config['gradient_accumulation_steps'],
                                       world // config.get('tp_size', 1) // config.get('pp_size', 1))
        if words[at + 1] == 'decent_train.py' and not config['diloco_steps']:
            decent.mixing_rounds(config['topology'], world, nproc)
    except (SystemExit, ValueError) as e:
        pytest.fail(f"{where}: {command}: on {nodes} node(s) x {nproc}: {e}")
