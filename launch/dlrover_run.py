"""
dlrover-run for torch 2.13, with the same arguments:

    python launch/dlrover_run.py --standalone --nproc_per_node=2 --max_restarts=3 train.py ...

With --standalone, dlrover 0.6.1 starts its local job master through torch's SubprocessHandler, passing the six
arguments it had up to torch 2.8; torch 2.9 added a seventh, numa_options, with no default, so every standalone
launch fails with "SubprocessHandler.__init__() missing 1 required positional argument: 'numa_options'". Here that
one call gets numa_options=None, which is what torch passes itself when no NUMA binding is asked for. Under
DLRover's ElasticJob the master runs in its own pod and plain dlrover-run works.
"""
import functools
import inspect
import sys

try:
    from dlrover.trainer.torch import elastic_run
except ImportError as e:
    sys.exit(f"error: launch/dlrover_run.py needs dlrover ({e}): pip install dlrover==0.6.1 grpcio==1.85.1 "
             f"protobuf==7.36.2 kubernetes==35.0.0 pynvml==11.5.3")

if 'numa_options' in inspect.signature(elastic_run.SubprocessHandler).parameters:
    elastic_run.SubprocessHandler = functools.partial(elastic_run.SubprocessHandler, numa_options=None)

if __name__ == '__main__':
    sys.exit(elastic_run.main())  # what the dlrover-run command runs
