"""Reads py-spy's raw profiles of a training worker (tests/gpu_check.py's part C): how busy its host was, and in
which of the loop's lines and functions its samples fell. py-spy samples; this only counts."""

import collections
import re


def threads(raw):
    """({stack: samples} of the main thread, {stack: samples} of the threads that torch started, its autograd engine's
    on a GPU) in the file of `py-spy record --threads -f raw`, a stack a line:
    'thread (TID): NAME;outermost (file:line);...;innermost (file:line) SAMPLES'. A thread that Python started has a
    NAME (a heartbeat, a background save); one started in C++ has none, and on a GPU the backward and the hooks
    it calls (FSDP's, DeepSpeed's) run in one, while the main thread waits for it."""
    main, engine = collections.Counter(), collections.Counter()
    with open(raw) as f:
        for line in f:
            stack, _, n = line.rstrip('\n').rpartition(' ')
            thread, _, frames = stack.partition(';')
            if thread.startswith('thread (') and thread.endswith(': MainThread'):
                main[frames] += int(n)
            elif re.fullmatch(r'thread \(\d+\)', thread) and frames:  # no name; idle, it has no frames
                engine[frames] += int(n)
    return main, engine


def summary(raw, busy_raw, script):
    """(the main thread's samples, the share of them the host was busy, [(frame, share)] most first) of a worker
    running script. raw holds every sample (py-spy --idle), busy_raw the busy ones: py-spy's raw format does not mark
    a sample idle, so a second py-spy beside the first counts them. The host is busy where the main thread is or the
    autograd engine's thread is (the main thread waits for it in the backward). A frame's share is inclusive (the
    samples it is anywhere in): the loop's lines ('train.py:340', where a wait for the device shows, inside a call of
    C) and the functions under them ('backward (torch/_tensor.py)'), the engine thread's too. Of functions in the
    same stacks, a chain of calls (module.__call__, _call_impl, forward), only the innermost is kept: it says the
    most."""
    stacks, engine = threads(raw)
    loop = re.compile(rf'<module> \((?:.*/)?({re.escape(script)}:\d+)\)')
    where = collections.defaultdict(set)  # frame: the stacks it is in, (thread, stack)
    for stack in stacks:
        frames = stack.split(';')
        at = [i for i, frame in enumerate(frames) if loop.fullmatch(frame)]
        if at:  # else outside the loop's lines: start-up, the end, a stack torn (--nonblocking reads as it runs)
            for frame in [loop.fullmatch(frames[at[-1]])[1]] + frames[at[-1] + 1:]:
                where[re.sub(r':\d+\)$', ')', frame)].add(('main', stack))
    for stack in engine:  # called from C++: no line of the loop in it
        for frame in stack.split(';'):
            where[re.sub(r':\d+\)$', ')', frame)].add(('engine', stack))
    counts = {'main': stacks, 'engine': engine}
    total = sum(stacks.values())
    count = {frame: sum(counts[t][s] for t, s in where[frame]) for frame in where}
    top, seen = [], set()
    # most samples first, a line before a function in as many; where is in the order frames were met, outer first
    for frame in sorted(reversed(where), key=lambda f: (-count[f], ' (' in f)):
        if ' (' in frame:  # a function
            if frozenset(where[frame]) in seen:
                continue
            seen.add(frozenset(where[frame]))
        top.append((frame, count[frame] / total))
    # the two py-spys' samples differ by chance: a host never idle could read above 100% busy
    return total, min(1, sum(sum(t.values()) for t in threads(busy_raw)) / total) if total else 0, top
