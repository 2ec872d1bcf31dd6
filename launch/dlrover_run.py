"""
dlrover-run for torch 2.13, with the same arguments:

    python launch/dlrover_run.py --standalone --nproc_per_node=2 --max_restarts=3 train.py ...

With --standalone, dlrover 0.6.1 starts its local job master through torch's SubprocessHandler, passing the six
arguments it had up to torch 2.8; torch 2.9 added a seventh, numa_options, with no default, so every standalone
launch fails with "SubprocessHandler.__init__() missing 1 required positional argument: 'numa_options'". Here that
one call gets numa_options=None, which is what torch passes itself when no NUMA binding is asked for. Under
DLRover's ElasticJob the master runs in its own pod and plain dlrover-run works.

DLRover's nanoGPT example runs `dlrover-run --nnodes=1 --max_restarts=2 --nproc_per_node=2 train.py ...` without
--standalone, which outside an ElasticJob (no DLROVER_MASTER_ADDR) stops in a traceback; here one node then means
the standalone mode, said in a line, and more nodes a one-line error. The local master's port is picked below the
kernel's ephemeral ports (master_port), where no other process's connection takes it before the master binds it.
"""
import functools
import inspect
import os
import random
import socket
import sys

try:
    from dlrover.trainer.torch import elastic_run
except ImportError as e:
    sys.exit(f"error: launch/dlrover_run.py needs dlrover ({e}): pip install dlrover==0.6.1 grpcio==1.85.1 "
             f"protobuf==7.36.2 kubernetes==35.0.0 pynvml==11.5.3")

if 'numa_options' in inspect.signature(elastic_run.SubprocessHandler).parameters:
    elastic_run.SubprocessHandler = functools.partial(elastic_run.SubprocessHandler, numa_options=None)



def master_port():
    """A free port for the local job master, below the kernel's ephemeral ports (ip_local_port_range). dlrover's own
    pick, bind(0) then closed, is an ephemeral port that the master binds only after seconds of imports: on a busy
    host another process's connection may take it meanwhile, and the agent's first call is then refused."""
    try:
        with open('/proc/sys/net/ipv4/ip_local_port_range') as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
    for _ in range(100):
        port = random.SystemRandom().randrange(max(1024, low - 5000), low)
        with socket.socket() as s:
            try:
                s.bind(('127.0.0.1', port))
                return port
            except OSError:  # in use
                continue
    return 0


local_master = elastic_run._launch_dlrover_local_master


def launch_local_master(master_addr, job_name):  # an address given (DLROVER_MASTER_ADDR) is used as it is
    port = master_port()
    return local_master(master_addr or (f'127.0.0.1:{port}' if port else ''), job_name)


elastic_run._launch_dlrover_local_master = launch_local_master

if __name__ == '__main__':
    argv = sys.argv[1:]
    args = elastic_run.parse_args(argv)
    if not args.standalone and not os.environ.get('DLROVER_MASTER_ADDR'):
        if str(args.nnodes) not in ('1', '1:1'):
            sys.exit(f"error: dlrover-run --nnodes={args.nnodes} needs DLRover's job master, which its ElasticJob "
                     f"starts (k8s/elasticjob-train.yaml); on one node add --standalone, or run torchrun "
                     f"--nnodes={args.nnodes} --rdzv-backend=c10d --rdzv-endpoint=HEAD:PORT on each node")
        print("no DLRover job master (DLROVER_MASTER_ADDR unset) and one node: running as dlrover-run --standalone",
              flush=True)
        argv = ['--standalone', *argv]
    sys.exit(elastic_run.main(argv))  # what the dlrover-run command runs
