"""
Measures each parallelism mode against the link between nodes, on an emulated cluster (launch/cluster.py: network
namespaces with tbf-capped links, a real multi-node torchrun): for every mode x link rate x number of nodes, the
median and mean step time, the bytes each node sends per step (from its interface's counters, between two points of
the run), the bytes the mode's design implies, and the link use (bytes per step over the mean step time, as a fraction
of the rate). --straggler=10 makes the last node's link 10x slower.
Needs root. Prepare the data first (python prepare.py shakespeare_char).

sudo python bench_network.py                       # every mode, 1gbit/300mbit/100mbit, 2 and 4 nodes, a ~25M model
sudo python bench_network.py --quick=True          # ddp and DiLoCo, 2 nodes at 100mbit, the tiny test model
sudo python bench_network.py --modes=ddp,diloco-50 --rates=100mbit --nodes=4
sudo python bench_network.py --target_loss=2.3 --modes=ddp,diloco-50 --rates=100mbit --nodes=2   # time to a loss
sudo python bench_network.py --modes=allreduce,ddp --rates=1gbit,100mbit --nodes=2,4   # the ring alone, and in DDP
sudo python bench_network.py --modes=pp,ddp --rates=100mbit --nodes=2,4   # a pipeline, a stage a node: activations
sudo python bench_network.py --modes=pp,pp-zbv --rates=100mbit --nodes=2,4 --n_layer=8   # zbv: two a node, in a V
sudo python bench_network.py --modes=pp,pp-shard,fsdp --rates=100mbit --nodes=4   # two pipelines, stages sharded
sudo python bench_network.py --modes=diloco-40,diloco-40-4,diloco-40-4-2 --rates=100mbit  # Streaming DiLoCo: 4
                                                     # fragments (then with 2 steps of overlap): a quarter of the peak
sudo python bench_network.py --modes=diloco-40,diloco-40-bf16 --rates=100mbit   # pseudo-gradients in bf16: half
"""

import itertools
import json
import math
import os
import re
import statistics
import sys
import time

import torch

from configurator import configure, quiet_interrupt
from data import read_meta
from decent import check_optimizers, fragment_of, mixing_rounds
from model import GPT, GPTConfig
from pipeline import stage_memory

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), 'launch'))
from cluster import Cluster, namespaces_work  # noqa: E402

quiet_interrupt()  # Ctrl-C: one line, no traceback (the cluster's namespaces are removed first)

# -----------------------------------------------------------------------------
modes = 'ddp,fsdp,zero2,zero3,pp,complete,ring,one-peer-exp,alternating-exp-ring,diloco-10,diloco-50'
rates = '1gbit,300mbit,100mbit'  # tc's notation; above a few Gbit/s the CPU, not the cap, limits gloo here
nodes = '2,4'
nproc_per_node = 1  # alternating-exp-ring needs 2 or more (it is skipped otherwise)
warmup = 5  # steps before the measured ones (start-up, first allocations)
steps = 50  # measured steps: a multiple of each DiLoCo H, so that the window holds whole outer steps
n_layer = 8  # ~25M parameters: compute measurable, communication that matters on a slow link
n_head = 8
n_embd = 512
block_size = 256
batch_size = 4  # sequences per rank per step (one micro-step)
dataset = 'data/shakespeare_char'
out_dir = 'bench_network'
threads = 1  # OMP threads per rank: the nodes share this machine's cores
straggler = 1  # > 1: the last node's link is this many times slower than the others' (a straggler)
quick = False  # a smoke run: ddp and diloco-4, 2 nodes at 100mbit, the tiny test model, 12 steps (flags win)
target_loss = 0.0  # > 0: each mode trains instead until an eval's val loss is this or less; reports the steps and
# the training time that took (the logged steps' times summed: the evals left out)
eval_every = 50  # with target_loss: steps between evals (a multiple of each DiLoCo H, so evals see θ_global)
max_steps = 5000  # with target_loss: a mode that has not reached it by then stops there
train_args = ''  # more flags for the entrypoints, e.g. the learning-rate schedule: '--learning_rate=1e-3 --min_lr=1e-4'
# -----------------------------------------------------------------------------
config, given = configure(globals())
if quick:  # its defaults, where a flag does not set the key
    smoke = dict(modes='ddp,diloco-4', rates='100mbit', nodes='2', steps=12, warmup=3, n_layer=2, n_head=2, n_embd=32,
                 block_size=32)
    config.update({k: v for k, v in smoke.items() if k not in given})
    globals().update(config)
SCRIPTS = {'ddp': ('train.py', []), 'fsdp': ('fsdp_train.py', []), 'zero2': ('ds_train.py', ['--zero_stage=2']),
           'zero3': ('ds_train.py', ['--zero_stage=3']), 'pp': ('pp_train.py', []),  # pp: one pipeline over all ranks
           'pp-zbv': ('pp_train.py', ['--pp_schedule=zbv']),  # its stages in a V, two a rank
           'pp-shard': ('pp_train.py', ['--dp_shard=True'])}  # two pipelines, each stage sharded over both
SCRIPTS.update({t: ('decent_train.py', [f'--topology={t}', '--grad_clip=0.0'])
                for t in ('complete', 'ring', 'one-peer-exp', 'alternating-exp-ring')})


def diloco_of(mode):
    """(H, F, τ, dtype) of diloco-H, diloco-H-F (Streaming DiLoCo's F fragments) or diloco-H-F-τ (τ steps of
    overlap), each with -bf16 after it for pseudo-gradients sent in bfloat16 (float32 without)."""
    m = re.fullmatch(r'diloco-(\d+)(?:-(\d+))?(?:-(\d+))?(-bf16)?', mode)
    if not m or int(m[1]) < 1:
        sys.exit(f"error: mode {mode}: give diloco-H (H >= 1 steps a window), then -F (fragments) and -τ (steps of "
                 f"overlap) or not, and -bf16 or not, e.g. diloco-40, diloco-40-4-2 or diloco-40-bf16")
    return int(m[1]), int(m[2] or 1), int(m[3] or 0), 'bfloat16' if m[4] else 'float32'


def script_of(mode):
    if mode.startswith('diloco-'):
        h, f, t, dtype = diloco_of(mode)
        return 'decent_train.py', [f'--diloco_steps={h}', f'--diloco_fragments={f}', f'--diloco_overlap={t}',
                                   f'--diloco_alpha={0.5 if t else 0}', f'--diloco_dtype={dtype}',
                                   '--grad_clip=0.0']  # the paper's α
    if mode not in SCRIPTS:
        sys.exit(f"error: unknown mode {mode!r}: use {', '.join(SCRIPTS)}, diloco-H, diloco-H-F, diloco-H-F-τ "
                 f"(each with -bf16 after it, or not) or allreduce")
    return SCRIPTS[mode]


def design_bytes(mode, sizes, n, per_node, b=4):
    """The bytes a node sends per step by the mode's design, in fp32 (b bytes a parameter) over a ring of the
    world's W ranks, node by node (one hop leaves each node per ring): an all-reduce 2(W-1)/W·P·b, a reduce-scatter
    or an all-gather half that; sizes are decent_train.py's buckets (the embeddings, then each block; P in all).
    Gossip: each rank of the node in a group that spans nodes all-reduces P within it, averaged over the cycle of
    rounds. Headers (Ethernet, IP, TCP: ~4.5% at a 1500-byte MTU) not counted. Returns the mean over steps and
    nodes, and the most node 0 sends in one step (its counters are read at every step): DiLoCo sends a window's
    bytes in one step, Streaming DiLoCo a fragment's at a time, in bfloat16 (-bf16) at 2 bytes a parameter."""
    w, n_params = n * per_node, sum(sizes)
    ring = (w - 1) / w * n_params * b  # a reduce-scatter, or an all-gather
    if mode in ('ddp', 'zero2'):
        return 2 * ring, 2 * ring  # the gradients' all-reduce; ZeRO-2: reduce-scatter of them, all-gather of params
    if mode in ('fsdp', 'zero3'):
        return 3 * ring, 3 * ring  # all-gather for the forward, again for the backward, reduce-scatter of gradients
    if mode == 'pp':
        # activations, not parameters: each of the step's w micro-batches crosses each of the n - 1 links between
        # nodes (consecutive stages) forward, and its gradient back; the tied embedding's gradient is all-reduced
        # between the first and the last stage, each sending it once. The mean over the nodes; the peak is node 0's
        # (its counters are the ones read every step), which sends the activations forward only
        acts, tied = w * batch_size * block_size * n_embd * b, vocab_size() * n_embd * b
        return ((n - 1) * 2 * acts + 2 * tied) / n, acts + tied
    if mode == 'pp-zbv':
        # down the nodes and back up: each link is crossed twice each way, and node 0 holds both ends of the tied
        # weight (no all-reduce), sending the first stage's activations and the last stage's gradient
        acts = w * batch_size * block_size * n_embd * b
        return (n - 1) * 4 * acts / n, 2 * acts
    if mode == 'pp-shard':
        # two pipelines of w/2 ranks, each running w/2 micro-batches: their activations cross between neighbouring
        # stages as in pp; each stage is gathered once a step and its gradients reduce-scattered after its last
        # backward, so over the two pipelines each rank sends the other half its stage's parameters each way (the
        # last stage's copy of the tied weight among them); each pipeline's first and last stage all-reduce their
        # halves of the tied gradient. Only what crosses between nodes counts
        pp, node = w // 2, lambda r: r // per_node
        acts, tied = w // 2 * batch_size * block_size * n_embd * b, vocab_size() * n_embd * b
        stage = [k * b for k, _ in stage_memory(GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                                                          block_size=block_size, vocab_size=vocab_size()), pp)]
        out = [0.0] * n
        for r in range(w):
            s, first = r % pp, r - r % pp
            peers = [(r + 1, acts)] * (s < pp - 1) + [(r - 1, acts)] * (s > 0) + [((r + pp) % w, stage[s])] + \
                [(first + pp - 1 if s == 0 else first, tied / 2)] * (pp > 1 and s in (0, pp - 1))
            out[node(r)] += sum(k for peer, k in peers if node(peer) != node(r))
        return sum(out) / n, out[0]
    if mode.startswith('diloco-'):
        h, f, _, dtype = diloco_of(mode)
        ring = (w - 1) / w * n_params * {'float32': 4, 'bfloat16': 2}[dtype]  # -bf16: 2 bytes a pseudo-gradient
        at = {}  # the parameters whose pseudo-gradients go out after a step, by its place in the window
        for size, k in zip(sizes, fragment_of(sizes, f)):
            at[k * h // f] = at.get(k * h // f, 0) + size
        return 2 * ring / h, 2 * ring * max(at.values()) / n_params  # one all-reduce of each fragment per window
    rounds = []
    for groups in mixing_rounds(mode, w, per_node):
        rounds.append(0.0)
        for g in groups:
            if len({r // per_node for r in g}) > 1:  # it crosses nodes: count node 0's ranks in it
                rounds[-1] += sum(r // per_node == 0 for r in g) * 2 * (len(g) - 1) / len(g) * n_params * b
    return sum(rounds) / len(rounds), max(rounds)


def iters_logged(path):
    """(the last iter logged, its rows) from a run's metrics.jsonl so far."""
    try:
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.endswith('\n')]
    except FileNotFoundError:
        return -1, []
    return max((r['iter'] for r in rows if 'ms' in r), default=-1), rows


def entrypoint_args(mode, out, n, iters, evals):
    script, extra = script_of(mode)
    extra = extra + [f'--pp_size={n * nproc_per_node // (2 if mode == "pp-shard" else 1)}'] * mode.startswith('pp')
    return [os.path.join(os.path.dirname(os.path.abspath(__file__)), script), *extra, f'--out_dir={out}',
            f'--dataset={os.path.abspath(dataset)}', '--device=cpu', '--compile=False', '--dtype=float32',
            f'--n_layer={n_layer}', f'--n_head={n_head}', f'--n_embd={n_embd}', f'--block_size={block_size}',
            f'--batch_size={batch_size}', f'--gradient_accumulation_steps={n * nproc_per_node}',
            f'--max_iters={iters}', f'--eval_interval={evals}', '--log_interval=1', '--always_save_checkpoint=False',
            '--dropout=0.0', *train_args.split()]


def time_to_loss(mode, rate, n):
    """Trains the mode on the cluster until an eval reaches target_loss (or max_steps): the steps it took, and
    the training time (the sum of the logged steps' times up to that eval, the evals left out)."""
    out = os.path.abspath(os.path.join(run_dir, f'{mode}-{rate}-{n}n'))
    os.makedirs(out)
    args = entrypoint_args(mode, out, n, max_steps, eval_every)
    reached = None
    with Cluster(n, rate) as c:
        procs = c.torchrun(args, nproc_per_node, env={**os.environ, 'OMP_NUM_THREADS': str(threads)}, logs=out,
                           cwd=out)
        while reached is None and all(p.poll() is None for p in procs):
            time.sleep(0.5)
            rows = iters_logged(os.path.join(out, 'metrics.jsonl'))[1]
            # a val loss that was not finite is logged null
            reached = next((r['iter'] for r in rows if (r.get('val_loss') or math.inf) <= target_loss), None)
        rows = iters_logged(os.path.join(out, 'metrics.jsonl'))[1]  # the cluster's end stops the run, if not done
    steps_ms = [r['ms'] for r in rows if 'ms' in r and (reached is None or r['iter'] < reached)]
    vals = [(r['iter'], r['val_loss']) for r in rows if 'val_loss' in r]
    if not steps_ms or not vals:
        raise RuntimeError(f"{mode} at {rate} on {n} nodes logged no steps or evals: see {out}/node*.log")
    return dict(mode=mode, rate=rate, nodes=n, target_loss=target_loss, reached_at=reached,
                train_seconds=sum(steps_ms) / 1000, ms=statistics.median(steps_ms), last_eval=vals[-1],
                load=os.getloadavg()[0])


def vocab_size():
    return read_meta(os.path.join(dataset, 'meta.pkl'))['vocab_size']


def bucket_sizes():
    """The model's parameters as decent_train.py buckets them: the embeddings (and final norm), then each block."""
    model = GPT(GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size,
                          vocab_size=vocab_size(), bias=False, dropout=0.0))
    blocks = [sum(p.numel() for p in block.parameters()) for block in model.transformer.h]
    return [sum(p.numel() for p in model.parameters()) - sum(blocks), *blocks]


def allreduce_alone(rate, n):
    """gloo's all-reduce of the model's parameters with no training around it (launch/allreduce.py), `steps`
    times: how near the ring comes to the link's rate. A row like a mode's, its steps the all-reduces."""
    out = os.path.abspath(os.path.join(run_dir, f'allreduce-{rate}-{n}n'))
    os.makedirs(out)
    n_params, warm = sum(bucket_sizes()), 2
    probe = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'launch', 'allreduce.py')
    with Cluster(n, rate) as c:
        before = c.counters(0)['tx_bytes']
        procs = c.torchrun([probe, f'--numel={n_params}', f'--iters={steps}', f'--warmup={warm}'], nproc_per_node,
                           env={**os.environ, 'OMP_NUM_THREADS': str(threads)}, logs=out, cwd=out)
        codes = [p.wait(timeout=3600) for p in procs]
        sent = (c.counters(0)['tx_bytes'] - before) / (steps + warm)  # the rendezvous and barriers in: ~KB
    if any(codes):
        raise RuntimeError(f"the all-reduce at {rate} on {n} nodes failed ({codes}): see {out}/node*.log")
    with open(os.path.join(out, 'node0.log')) as f:
        seconds = json.loads([line for line in f if line.startswith('{')][-1])['seconds']
    ms, mean_ms = statistics.median(seconds) * 1000, statistics.mean(seconds) * 1000
    design = design_bytes('ddp', [n_params], n, nproc_per_node)[0]
    link = bits_per_second(rate)
    return dict(mode='allreduce', rate=rate, nodes=n, straggler=straggler, params=n_params, ms=ms, mean_ms=mean_ms,
                bytes_per_step=sent, design_bytes=design, sent_over_design=sent / design, peak_bytes=sent,
                design_peak_bytes=design, link_use=8 * sent / (ms / 1000) / link if link else None, steps=steps,
                load=os.getloadavg()[0])


def measure(mode, rate, n):
    # DiLoCo sends in bursts, at the end of each window (Streaming DiLoCo: of each fragment's, F a window, each
    # on the wire for τ more steps): the counters are read half-way between two bursts, so that a burst falls
    # wholly inside the measured steps or wholly outside
    h, f, t, _ = diloco_of(mode) if mode.startswith('diloco-') else (1, 1, 0, None)
    start = warmup + ((h // f + t - 2) // 2 - warmup) % h
    measured = -(-steps // h) * h  # whole windows: at least `steps`
    out = os.path.abspath(os.path.join(run_dir, f'{mode}-{rate}-{n}n'))
    os.makedirs(out)  # new: a run here never resumes another
    args = [*entrypoint_args(mode, out, n, start + measured + 2, start + measured + 2), '--eval_iters=1']
    env = {**os.environ, 'OMP_NUM_THREADS': str(threads)}
    with Cluster(n, rate) as c:
        if straggler > 1:  # tc takes a rate in bit/s as NUMBERbit
            c.set_rate(n - 1, f'{int(bits_per_second(rate) / straggler)}bit')
        procs = c.torchrun(args, nproc_per_node, env=env, logs=out, cwd=out)
        marks = []  # (iter, node 0's tx bytes) as the run passes the start and the end of the measured steps
        steps_seen = []  # (iter, node 0's tx bytes) at each step logged in between: the most a step sends
        for target in (start, start + measured):
            while (last := iters_logged(os.path.join(out, 'metrics.jsonl'))[0]) < target:
                if any(p.poll() is not None for p in procs):
                    raise RuntimeError(f"{mode} at {rate} on {n} nodes exited early: see {out}/node*.log")
                if marks and last > steps_seen[-1][0]:
                    steps_seen.append((last, c.counters(0)['tx_bytes']))
                time.sleep(0.005)  # a read late by half a window (2 of DiLoCo's 12 ms steps) counts a burst wrongly
            marks.append((last, [node['tx_bytes'] for node in c.counters()]))
            if not steps_seen or last > steps_seen[-1][0]:
                steps_seen.append((last, marks[-1][1][0]))
        codes = [p.wait(timeout=3600) for p in procs]
    if any(codes):
        raise RuntimeError(f"{mode} at {rate} on {n} nodes failed ({codes}): see {out}/node*.log")
    (i0, tx0), (i1, tx1) = marks
    per_step = [(b - a) / (i1 - i0) for a, b in zip(tx0, tx1)]
    rows = iters_logged(os.path.join(out, 'metrics.jsonl'))[1]
    # the median is a step's time (for DiLoCo, one without communication); the mean counts the outer steps too
    window = [r['ms'] for r in rows if 'ms' in r and i0 < r['iter'] <= i1]
    ms, mean_ms = statistics.median(window), statistics.mean(window)
    sizes = bucket_sizes()
    n_params = sum(sizes)
    design, design_peak = design_bytes(mode, sizes, n, nproc_per_node)
    link = bits_per_second(rate)
    sent = statistics.mean(per_step)
    # per step logged (a poll that saw several counts their mean): steps much longer than a poll (~5 ms) make it
    # a step's bytes; with shorter ones it mixes neighbours
    peak = max((b - a) / (j - i) for (i, a), (j, b) in zip(steps_seen, steps_seen[1:]))
    return dict(mode=mode, rate=rate, nodes=n, straggler=straggler, params=n_params, ms=ms, mean_ms=mean_ms,
                bytes_per_step=sent, design_bytes=design, sent_over_design=sent / design if design else None,
                peak_bytes=peak, design_peak_bytes=design_peak,
                link_use=8 * sent / (mean_ms / 1000) / link if link else None, steps=i1 - i0,
                load=os.getloadavg()[0])


def bits_per_second(rate):
    """tc's rate (100mbit, 1gbit, 25000000bit) in bit/s; None for no cap."""
    if not rate or not rate.endswith('bit'):
        return None
    unit = rate[-4].lower()
    return float(rate[:-4]) * {'k': 1e3, 'm': 1e6, 'g': 1e9}[unit] if unit in 'kmg' else float(rate[:-3])


if __name__ == '__main__':
    # every flag checked before a node is made or a folder written: a typo was a row of failures (or a traceback)
    # after the runs before it, or a wait without end (no nodes)
    if not re.fullmatch(r'\d+(,\d+)*', nodes) or min(map(int, nodes.split(','))) < 2:
        sys.exit(f"error: --nodes={nodes}: give counts of 2 nodes or more, e.g. --nodes=2,4")
    for key, least in (('nproc_per_node', 1), ('steps', 1), ('warmup', 0)):
        if globals()[key] < least:
            sys.exit(f"error: --{key}={globals()[key]}: give {least} or more")
    for rate in rates.split(','):  # what bits_per_second reads; tc's mbps would be megabytes a second
        if not re.fullmatch(r'\d+(\.\d+)?[kKmMgG]?bit', rate) or not bits_per_second(rate) > 0:
            sys.exit(f"error: --rates={rates}: {rate!r} is not a rate in bits a second as tc writes it: give e.g. "
                     f"100mbit, 1gbit or 25000000bit")
    for mode in modes.split(','):
        if mode == 'allreduce':
            continue
        script, extra = script_of(mode)  # an unknown mode, or a diloco-H-F-τ not well formed, exits here
        if mode.startswith('diloco-'):  # the window, fragments and overlap as decent_train.py checks them
            h, f, t, dtype = diloco_of(mode)
            why = check_optimizers(dict(replica_optimizer='adamw', moment_accum_steps=1, diloco_steps=h,
                                        outer_optimizer='nesterov', outer_learning_rate=0.7, outer_momentum=0.9,
                                        diloco_fragments=f, diloco_overlap=t, diloco_alpha=0.5 if t else 0.0,
                                        diloco_dtype=dtype), n_layer)
            if why:
                sys.exit(f"error: mode {mode}: {why}")
        if script == 'decent_train.py' and not mode.startswith('diloco-') and \
                (mode != 'alternating-exp-ring' or nproc_per_node > 1):  # (which is skipped on one rank a node)
            for n in map(int, nodes.split(',')):
                try:
                    mixing_rounds(mode, n * nproc_per_node, nproc_per_node)
                except ValueError as e:  # its fix is the entrypoint's (--topology=...): here it is other nodes
                    sys.exit(f"error: mode {mode} on {n} nodes, {nproc_per_node} a node: {str(e).split(':')[0]}: "
                             f"give other --nodes, or drop it from --modes")
    why = namespaces_work()
    if why:
        sys.exit(f"error: {why}")
    if not os.path.exists(os.path.join(dataset, 'train.bin')):
        sys.exit(f"error: no {dataset}/train.bin: run `python prepare.py shakespeare_char` or give --dataset=FOLDER")
    for mode in [m for m in modes.split(',') if m in ('pp', 'pp-zbv', 'pp-shard')]:  # a block at least a stage
        most = max(int(n) for n in nodes.split(','))
        if mode == 'pp-shard' and any(int(n) * nproc_per_node % 2 for n in nodes.split(',')):
            sys.exit(f"error: pp-shard runs two pipelines, each stage sharded over both: give nodes x "
                     f"nproc_per_node that are even, not --nodes={nodes} --nproc_per_node={nproc_per_node}")
        stages = most * nproc_per_node * {'pp': 2, 'pp-zbv': 4, 'pp-shard': 1}[mode] // 2
        if n_layer < stages:
            sys.exit(f"error: {mode} on {most} nodes has {stages} stages, a block each at least: give "
                     f"--n_layer={stages} or more")
    # each invocation's runs in a new folder of its own, named by the time: one started in the same second gets -2
    run_dir = base = os.path.join(out_dir, time.strftime('%Y%m%d-%H%M%S'))
    for n in itertools.count(2):
        try:
            os.makedirs(run_dir)  # never an existing folder, which may hold another invocation's runs
            break
        except FileExistsError:
            run_dir = f'{base}-{n}'
    torch.set_num_threads(1)
    print(f"runs in {run_dir}; {os.cpu_count()} cores, torch {torch.__version__}", flush=True)
    print(f"straggler: the last node's link {straggler}x slower" if straggler > 1 else "no straggler", flush=True)
    if target_loss:
        print(f"| mode | link | nodes | steps to val loss {target_loss} | training s to it | median ms/step | "
              f"last eval (iter, val loss) | load |\n| --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    else:
        print("| mode | link | nodes | median ms/step | mean ms/step | MB sent/node/step | MB by design | "
              "sent/design | link use | load | peak MB sent in a step | peak MB by design |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    with open(os.path.join(run_dir, 'results.jsonl'), 'w') as log:
        for n in map(int, nodes.split(',')):
            for rate in rates.split(','):
                for mode in modes.split(','):
                    if mode == 'alternating-exp-ring' and nproc_per_node < 2:
                        continue  # it alternates within and across nodes: one rank per node has no within
                    try:
                        r = allreduce_alone(rate, n) if mode == 'allreduce' else \
                            (time_to_loss if target_loss else measure)(mode, rate, n)
                    except (RuntimeError, ValueError) as e:
                        print(f"| {mode} | {rate} | {n} | failed: {e} |", flush=True)
                        continue
                    log.write(json.dumps({**r, 'config': config}) + '\n')
                    log.flush()
                    if target_loss:
                        print(f"| {mode} | {rate} | {n} | {r['reached_at'] or f'not by {max_steps}'} | "
                              f"{r['train_seconds']:.0f} | {r['ms']:.0f} | {r['last_eval'][0]}, "
                              f"{r['last_eval'][1]:.4f} | {r['load']:.1f} |", flush=True)
                        continue
                    print(f"| {mode} | {rate} | {n} | {r['ms']:.0f} | {r['mean_ms']:.0f} | "
                          f"{r['bytes_per_step'] / 1e6:.3f} | {r['design_bytes'] / 1e6:.3f} | "
                          f"{r['sent_over_design']:.2f} | {r['link_use']:.2f} | {r['load']:.1f} | "
                          f"{r['peak_bytes'] / 1e6:.3f} | {r['design_peak_bytes'] / 1e6:.3f} |", flush=True)
