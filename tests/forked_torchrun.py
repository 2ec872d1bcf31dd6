"""torchrun, its own command line (torch.distributed.run's main), with its workers forked from it once it has
imported what every entrypoint imports (launcher.PRELOAD): `--run-path --start-method=fork` makes torchrun fork a
function for each worker of each group, in place of a fresh interpreter's 2.4 s of CPU importing torch and
torch._dynamo. Its rendezvous, its restarts of the group when a worker dies, the environment and store it gives the
workers and the signals it passes on are torchrun's own."""

import ctypes
import os
import signal
import sys

import launcher

for name in launcher.PRELOAD:
    __import__(name)
import torch.distributed.run as torchrun  # noqa: E402

PATH = sys.path[1:]  # a fresh `python script.py`'s sys.path past the script's folder


def worker(script, *args):
    """A worker, as torchrun forks it for --run-path: the script runs in a process of its own under it, as a rank of
    launcher.py's, because the entrypoints end with os._exit (distributed.finish) where torchrun's function would
    return. That process dies with the worker (a SIGKILL of the worker kills both) and gets the signals that
    torchrun sends the worker; the worker exits with its code."""
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the worker died before the line above
            os._exit(1)
        launcher.as_main(script, args, PATH)
    signalled = []

    def pass_on(sig, _):
        signalled.append(sig)
        os.kill(pid, sig)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # what torchrun passes on by default
        signal.signal(sig, pass_on)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    # a failure, as torchrun sees a worker's: its exit code, or 128 + the signal that ended it. Where torchrun
    # signalled it, stopping the group, the worker exits as the script did: returning, it would wait for torchrun to
    # read its result, which torchrun does not while it stops the group (it waits 30 s, then SIGKILLs it)
    if code or signalled:
        os._exit(code if code >= 0 else 128 - code)


torchrun.run_script_path = worker
torchrun.main()
