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
the standalone mode, said in a line, and more nodes a one-line error.
"""
import functools
import inspect
import os
import sys

try:
    from dlrover.trainer.torch import elastic_run
except ImportError as e:
    sys.exit(f"error: launch/dlrover_run.py needs dlrover ({e}): pip install dlrover==0.6.1 grpcio==1.85.1 "
             f"protobuf==7.36.2 kubernetes==35.0.0 pynvml==11.5.3")

if 'numa_options' in inspect.signature(elastic_run.SubprocessHandler).parameters:
    elastic_run.SubprocessHandler = functools.partial(elastic_run.SubprocessHandler, numa_options=None)

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
