"""Finds and stops the processes under a process, wherever their sessions are."""

import os
import signal


def under(pid):
    """pid and the processes under it (its children, theirs, ...), from /proc: torchrun's workers too, which run in
    sessions of their own."""
    children = {}
    for entry in filter(str.isdigit, os.listdir('/proc')):
        try:
            with open(f'/proc/{entry}/stat') as f:
                ppid = int(f.read().rsplit(')', 1)[1].split()[1])  # the name in () may hold spaces
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    tree, i = [pid], 0
    while i < len(tree):
        tree += children.get(tree[i], [])
        i += 1
    return tree


def stop(pid):
    """SIGKILLs pid and every process under it. torchrun starts each worker in a session of its own, out of reach of
    a kill of its process group: a worker left alive (and its compile workers) would hold the GPU, and the output
    pipe, which is read to its end, until it finished its run. The tree is frozen first, so that nothing in it
    starts a process between the look and the kill."""
    seen = []
    while True:
        new = [p for p in under(pid) if p not in seen]
        if not new:
            break
        for p in new:
            try:
                os.kill(p, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        seen += new
    for p in seen:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
