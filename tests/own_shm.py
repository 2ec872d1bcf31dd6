"""Runs an entrypoint (sys.argv[1:]) as the only rank of a node of its own, as on a cluster: a mount namespace of
the process's own whose /dev/shm is the folder that NODE_SHM_<RANK> names (a bind mount), and whose host name is that
folder's name, so that a test sets what each node's memory holds, and which node a rank lands on, before the job
starts. Root only (unshare, mount)."""

import ctypes
import os
import runpy
import subprocess
import sys

libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(0x00020000 | 0x04000000) != 0:  # CLONE_NEWNS | CLONE_NEWUTS
    raise OSError(ctypes.get_errno(), 'unshare')
shm = os.environ[f"NODE_SHM_{os.environ.get('RANK', '0')}"]
host = os.path.basename(shm).encode()  # the node's name: its memory's folder
libc.sethostname(host, len(host))
subprocess.run(['mount', '--make-rprivate', '/'], check=True)  # the bind mount below stays in this namespace
subprocess.run(['mount', '--bind', shm, '/dev/shm'], check=True)
os.environ.update(LOCAL_RANK='0', LOCAL_WORLD_SIZE='1', GROUP_RANK=os.environ.get('RANK', '0'))  # the node's first rank
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name='__main__')
