"""
An emulated cluster on one machine: N nodes as network namespaces on one bridge, each node's link capped at a rate
(tbf, both ways), and a real multi-node torchrun on every node (c10d rendezvous on node 0's address, gloo on the
node's eth0). To rehearse a multi-node launch before paying for nodes, and to measure what a mode sends against a
link (bench_network.py, the tests). Not an emulation of latency or loss (the kernels here have no netem), nor of
GPUs. Needs root, `ip` and `tc`. Everything it makes is removed on exit, on failure and on SIGTERM/SIGINT/SIGHUP too.

    sudo python launch/cluster.py --nodes=2 --rate=100mbit -- train.py config/train_shakespeare_char_cpu.py \
        --gradient_accumulation_steps=4 --max_iters=50
    sudo python launch/cluster.py --remove_stale     # what a SIGKILLed harness left behind

From Python (the tests, bench_network.py):

    with Cluster(nodes=2, rate='1gbit') as c:
        procs = c.torchrun(['train.py', ...], nproc_per_node=1, logs=folder)
        c.link(1, up=False); ...; c.link(1, up=True)
        c.counters(0)  # {'tx_bytes': ..., 'rx_bytes': ...} of node 0's eth0; c.counters(): every node's
"""

import argparse
import ipaddress
import itertools
import os
import random
import re
import signal
import subprocess
import sys
import time

TAG = 'ncl'  # the prefix of every name this harness gives: namespaces ncl-<pid>-<k>-n<i>, links ncl<k><pid>...
_count = itertools.count()


def sh(*args, check=True):
    """Runs a command (a list of words); a failure raises with the command's own message."""
    p = subprocess.run([str(a) for a in args], capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, args))}: {p.stderr.strip() or p.stdout.strip()}")
    return p.stdout


def namespaces_work():
    """None where this machine lets us make the nodes (a network namespace, a tmpfs in it, a tbf qdisc), else why
    not (for a test's skip message)."""
    if os.geteuid() != 0:
        return "not root: network namespaces need root"
    name = f'{TAG}-probe-{os.getpid()}'
    try:
        sh('ip', 'netns', 'add', name)
    except (RuntimeError, FileNotFoundError) as e:
        return f"cannot make a network namespace ({e})"
    try:
        sh('ip', 'netns', 'exec', name, 'sh', '-c', 'mount -t tmpfs tmpfs /dev/shm')
        sh('ip', 'netns', 'exec', name, 'tc', 'qdisc', 'add', 'dev', 'lo', 'root', 'tbf', 'rate', '1gbit', 'burst',
           '256kb', 'latency', '100ms')
    except (RuntimeError, FileNotFoundError) as e:
        return f"a network namespace cannot have a node's /dev/shm or tbf link ({e})"
    finally:
        sh('ip', 'netns', 'del', name, check=False)
    return None


def free_subnet():
    """A private /24 for the cluster, at random in 10.128.0.0/9, that none of the host's own addresses is in. The
    host has no address on the bridge and no route to it, so two clusters cannot reach each other in any case."""
    taken = [ipaddress.ip_interface(w).network for line in sh('ip', '-4', '-o', 'addr').splitlines()
             for w in line.split()[3:4]]
    while True:
        net = ipaddress.ip_network(f'10.{random.randint(128, 255)}.{random.randint(0, 255)}.0/24')
        if not any(net.overlaps(t) for t in taken):
            return net


class Cluster:
    """with Cluster(nodes, rate) as c: the nodes exist inside the block and are gone after it. rate is tc's
    (e.g. '100mbit', '1gbit'), or None for no cap."""

    def __init__(self, nodes, rate=None, burst='256kb'):
        self.n, self.rate, self.burst = nodes, rate, burst
        k = next(_count)
        # names: namespaces may be long; links at most 15 characters (IFNAMSIZ): ncl + 7 hex digits of the pid +
        # the cluster's count and the node's
        self.id = f'{os.getpid():07x}{k:x}'
        self.bridge = f'{TAG}{self.id}b'
        self.names = [f'{TAG}-{os.getpid()}-{k}-n{i}' for i in range(nodes)]
        self.host_ends = [f'{TAG}{self.id}n{i}' for i in range(nodes)]
        self.subnet = free_subnet()
        self.addrs = [str(self.subnet.network_address + 1 + i) for i in range(nodes)]
        self.procs = []  # everything started in the nodes, each in a session of its own
        self._made = []  # (kind, name) of what exists, to remove in reverse
        self._handlers = {}

    def __enter__(self):
        # a SIGTERM (or SIGHUP) would end the process without running `finally`: make it an exception that does
        for s in (signal.SIGTERM, signal.SIGHUP):
            try:
                self._handlers[s] = signal.signal(s, _raise_exit)
            except ValueError:  # not the main thread: leave the signals alone
                pass
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def _build(self):
        sh('ip', 'link', 'add', self.bridge, 'type', 'bridge')
        self._made.append(('link', self.bridge))
        sh('ip', 'link', 'set', self.bridge, 'up')
        for i, (name, host_end, addr) in enumerate(zip(self.names, self.host_ends, self.addrs)):
            sh('ip', 'netns', 'add', name)
            self._made.append(('netns', name))
            sh('ip', 'link', 'add', host_end, 'type', 'veth', 'peer', 'name', 'eth0', 'netns', name)
            self._made.append(('link', host_end))
            sh('ip', 'link', 'set', host_end, 'master', self.bridge, 'up')
            self.run(i, 'ip', 'addr', 'add', f'{addr}/{self.subnet.prefixlen}', 'dev', 'eth0')
            self.run(i, 'ip', 'link', 'set', 'eth0', 'up')
            self.run(i, 'ip', 'link', 'set', 'lo', 'up')
            if self.rate:
                self.set_rate(i, self.rate)

    def set_rate(self, node, rate):
        """Caps the node's link at rate, both ways: what it sends (its eth0) and what it receives (the bridge's
        side of its cable), as a full-duplex NIC of that rate would."""
        tbf = ['root', 'tbf', 'rate', rate, 'burst', self.burst, 'latency', '100ms']
        self.run(node, 'tc', 'qdisc', 'replace', 'dev', 'eth0', *tbf)
        sh('tc', 'qdisc', 'replace', 'dev', self.host_ends[node], *tbf)

    def run(self, node, *cmd, check=True):
        """A command inside the node's namespace, to completion; returns its stdout."""
        return sh('ip', 'netns', 'exec', self.names[node], *cmd, check=check)

    def popen(self, node, cmd, env=None, log=None, cwd=None):
        """Starts a command inside the node (in a session of its own, so that close() can end it and all its
        children); output to the file log, or to this process's. The command has a /dev/shm of its own, as on a
        node of its own: the entrypoints keep their snapshots there under names that only the node makes unique
        (`ip netns exec` gives it a mount namespace of its own, so the tmpfs goes when its last process does)."""
        out = open(log, 'w') if log else None
        node_shm = ['sh', '-c', 'mount -t tmpfs tmpfs /dev/shm && exec "$@"', 'node-shm']
        p = subprocess.Popen(['ip', 'netns', 'exec', self.names[node], *node_shm, *map(str, cmd)], env=env, cwd=cwd,
                             stdout=out, stderr=subprocess.STDOUT if out else None, start_new_session=True)
        if out:
            out.close()
        self.procs.append(p)
        return p

    def torchrun(self, script_args, nproc_per_node=1, port=29500, max_restarts=0, min_nodes=None, env=None,
                 logs=None, cwd=None, python=sys.executable):
        """One torchrun per node, all in one c10d rendezvous on node 0's address, which hosts its store; gloo
        talks over each node's eth0. max_restarts > 0 makes the group elastic: a failed worker restarts the
        whole group (with --nnodes=min_nodes:N, on fewer nodes too). Returns the torchruns' Popens."""
        env = {**(os.environ if env is None else env), 'GLOO_SOCKET_IFNAME': 'eth0'}
        nnodes = f'{min_nodes}:{self.n}' if min_nodes else str(self.n)
        procs = []
        for i in range(self.n):
            # a node learns from is_host whether to serve the store: torchrun would compare the endpoint with the
            # machine's hostname, which is the host's in every namespace
            conf = f'is_host={int(i == 0)},last_call_timeout=1'
            cmd = [python, '-m', 'torch.distributed.run', f'--nnodes={nnodes}', f'--nproc_per_node={nproc_per_node}',
                   '--rdzv-backend=c10d', f'--rdzv-endpoint={self.addrs[0]}:{port}', f'--rdzv-id={self.id}',
                   f'--rdzv-conf={conf}', f'--max-restarts={max_restarts}', '--local-addr', self.addrs[i],
                   *script_args]
            procs.append(self.popen(i, cmd, env=env, cwd=cwd, log=logs and os.path.join(logs, f'node{i}.log')))
        return procs

    def pids(self):
        """Every process that runs inside one of the nodes."""
        return [int(pid) for kind, name in self._made if kind == 'netns'
                for pid in sh('ip', 'netns', 'pids', name, check=False).split()]

    def kill(self, node):
        """A node dies: SIGKILL to everything in it (its torchrun agent and workers), as a power cut would."""
        for pid in sh('ip', 'netns', 'pids', self.names[node], check=False).split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass

    def link(self, node, up):
        """Takes the node's cable out (up=False) or puts it back."""
        sh('ip', 'link', 'set', self.host_ends[node], 'up' if up else 'down')

    def counters(self, node=None):
        """{'tx_bytes', 'rx_bytes'} of the node's eth0, as its kernel counts them (frames' bytes, headers in); of
        every node, where node is None. Read from the cable's host end, whose counters are the same numbers seen from
        the other side (a veth counts what it sends as what its peer receives), in microseconds: an `ip netns exec`
        into the node took 10 to 30 ms on a busy machine, time in which a run goes on sending."""
        def read(host_end, name):
            with open(f'/sys/class/net/{host_end}/statistics/{name}') as f:
                return int(f.read())
        out = [{'tx_bytes': read(h, 'rx_bytes'), 'rx_bytes': read(h, 'tx_bytes')}
               for h in (self.host_ends if node is None else [self.host_ends[node]])]
        return out if node is None else out[0]

    def close(self, grace=10):
        """Ends every process in the nodes: SIGTERM to the sessions it started (torchrun passes it on to its
        workers, which save a checkpoint and exit), then SIGKILL to whatever still runs in a node after grace
        seconds (torchrun's workers have sessions of their own); then removes the namespaces, links and bridge,
        newest first. Safe to call twice."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.time() + grace
        while self.pids() and time.time() < deadline:
            time.sleep(0.05)
        while self.pids():
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        for p in self.procs:
            p.wait()
        self.procs = []
        for kind, name in reversed(self._made):
            # a namespace's end of a veth goes with the namespace, and the host's end with it
            sh('ip', kind, 'del', name, check=False)
        self._made = []
        for s, h in self._handlers.items():
            signal.signal(s, h)
        self._handlers = {}


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


def leftovers(pid=None):
    """The namespaces and links that this harness made (all, or those of the process pid) and that still exist."""
    netns = [w.split()[0] for w in sh('ip', 'netns', 'list').splitlines() if w.startswith(f'{TAG}-')]
    links = [w.split(':')[1].strip().split('@')[0] for w in sh('ip', '-o', 'link').splitlines()]
    links = [name for name in links if name.startswith(TAG)]
    if pid is not None:
        netns = [n for n in netns if n.startswith(f'{TAG}-{pid}-')]
        links = [n for n in links if n.startswith(f'{TAG}{pid:07x}')]
    return netns, links


def remove_stale():
    """Removes what harnesses whose process is gone left behind (a SIGKILL runs no cleanup): the processes still
    running in their nodes, the namespaces, the links."""
    netns, links = leftovers()
    for name in netns:
        if not os.path.exists(f'/proc/{name.split("-")[1]}'):
            for pid in sh('ip', 'netns', 'pids', name, check=False).split():  # what it had started there
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            sh('ip', 'netns', 'del', name, check=False)
            print(f"removed namespace {name}")
    for name in links:
        if not os.path.exists(f'/proc/{int(name[len(TAG):len(TAG) + 7], 16)}'):
            sh('ip', 'link', 'del', name, check=False)
            print(f"removed link {name}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                     usage='%(prog)s [options] -- SCRIPT [ARGS...]')
    parser.add_argument('--nodes', type=int, default=2)
    parser.add_argument('--nproc_per_node', type=int, default=1)
    parser.add_argument('--rate', default=None, help="each node's link, as tc writes it: 100mbit, 1gbit; none: no cap")
    parser.add_argument('--max_restarts', type=int, default=0)
    parser.add_argument('--min_nodes', type=int, default=None, help='elastic: --nnodes=MIN:NODES (with --max_restarts)')
    parser.add_argument('--kill', default=None, metavar='NODE@SECONDS',
                        help='SIGKILL everything in node NODE SECONDS after the start (a fault drill)')
    parser.add_argument('--port', type=int, default=29500)
    parser.add_argument('--remove_stale', action='store_true', help='remove what a killed harness left, and exit')
    args, rest = parser.parse_known_args()
    if args.remove_stale:
        return remove_stale()
    if rest[:1] == ['--']:
        rest = rest[1:]
    if not rest:
        sys.exit("error: give the script and its arguments after --, e.g. -- train.py config/x.py")
    why = namespaces_work()
    if why:
        sys.exit(f"error: {why}")
    for key, low in (('nodes', 1), ('nproc_per_node', 1), ('max_restarts', 0), ('min_nodes', 1)):
        if getattr(args, key) is not None and getattr(args, key) < low:
            sys.exit(f"error: --{key}={getattr(args, key)}: give {low} or more")
    if (args.min_nodes or 0) > args.nodes:
        sys.exit(f"error: --min_nodes={args.min_nodes}: give at most --nodes={args.nodes}")
    # tc's own words for a rate; anything else made a traceback from inside the nodes' setup
    if args.rate is not None and not re.fullmatch(r'\d+(\.\d+)?([kmgt]i?)?(bit|bps)?', args.rate, re.IGNORECASE):
        sys.exit(f"error: --rate={args.rate}: give a rate as tc writes it, e.g. 100mbit or 1gbit")
    try:
        kill_node, kill_after = (int(args.kill.split('@')[0]), float(args.kill.split('@')[1])) if args.kill else (0, 0)
    except (IndexError, ValueError):
        sys.exit(f"error: --kill={args.kill}: give NODE@SECONDS, e.g. --kill=1@30")
    if args.kill and not 0 <= kill_node < args.nodes:
        sys.exit(f"error: --kill={args.kill}: no node {kill_node} among {args.nodes}")
    # a mistyped script was found by every node's torchrun, after the nodes were made: python's error and a traceback
    if not rest[0].startswith('-') and not os.path.isfile(rest[0]):
        sys.exit(f"error: {rest[0]} is not a file in {os.getcwd()}: give the entrypoint after --, as from the repo "
                 f"root: -- train.py config/...")
    with Cluster(args.nodes, args.rate) as c:
        print(f"{args.nodes} nodes on {c.subnet} ({', '.join(c.addrs)}), links {args.rate or 'uncapped'}; "
              f"rendezvous at {c.addrs[0]}:{args.port}", flush=True)
        before = c.counters()
        t0 = time.time()
        procs = c.torchrun(rest, args.nproc_per_node, args.port, args.max_restarts, args.min_nodes)
        if args.kill:
            time.sleep(kill_after)
            c.kill(kill_node)
            print(f"killed node {kill_node} (everything in it) at {time.time() - t0:.1f} s", flush=True)
        codes = [p.wait() for p in procs]
        seconds = time.time() - t0
        after = c.counters()
        for i in range(c.n):
            sent = after[i]['tx_bytes'] - before[i]['tx_bytes']
            print(f"node {i}: exit {codes[i]}, sent {sent / 1e6:.1f} MB, {8 * sent / seconds / 1e6:.1f} Mbit/s "
                  f"over {seconds:.1f} s")
    return max(codes, key=abs)


if __name__ == '__main__':
    sys.exit(main())
