"""One of launcher.PRELOAD, imported by the forkserver (and tests/forked_torchrun.py) before it forks the scripts:
py-cpuinfo's get_cpu_info, which DeepSpeed's CPU Adam calls three times in each rank that loads it (two flags of its
op builder and its own check), starts a fresh interpreter each time that times the CPU's clock: 1.5 s of CPU a call,
30 s of the suite's on the 2-core machine. Its answer does not change within a process: each process asks once."""

import functools

try:
    import cpuinfo
except ImportError:  # DeepSpeed's dependency: without it, nothing calls it
    cpuinfo = None
else:
    cpuinfo.get_cpu_info = functools.cache(cpuinfo.get_cpu_info)
