"""decent_train.py in real process groups on gloo, in fp32: one process is train.py; two ranks of plain SGD on the
complete topology are one rank; every topology's rounds are doubly stochastic and their cycle contracts; the
consensus distance falls as the rounds predict; alternating-exp-ring on two nodes of two; AccumAdamW; exact
resume; the averaged export through sample.py and train.py; bad input."""

import json
import shutil
import subprocess

import pytest
import torch

from conftest import REPO, TINY, counts_tokens, env, free_port, one_line_error, read_metrics, run
from decent import AccumAdamW, mixing_rounds
from test_fault import TORCHRUN


def launch(tmp_path, data_dir, out, *extra, nproc=1, script='decent_train.py', check=True):
    return run(script, *TINY, f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={tmp_path / out}', *extra,
               nproc=nproc, cwd=tmp_path, check=check)


def launch_two_nodes(tmp_path, data_dir, out, *extra):
    """Two torchrun launches of 2 processes each, as the two nodes of one job on this machine (static rendezvous
    on a free port): each process sees LOCAL_WORLD_SIZE=2 in a world of 4."""
    port = free_port()
    args = [*TINY, f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={tmp_path / out}', *extra]
    # torchrun forking its workers (tests/test_fault.py's TORCHRUN): 2 interpreters' start-up in place of 6
    nodes = [subprocess.Popen([*TORCHRUN, '--nnodes=2', '--nproc_per_node=2', f'--node_rank={i}',
                               '--master_addr=127.0.0.1', f'--master_port={port}',
                               str(REPO / 'decent_train.py'), *args],
                              cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outputs = [node.communicate(timeout=600) for node in nodes]
    for node, (_, stderr) in zip(nodes, outputs):
        assert node.returncode == 0, stderr[-5000:]
    return outputs[0][0]




def mixing_matrix(groups, n):
    """W[i, j]: the weight of replica j in rank i's after the round; a group averages, a rank alone keeps its own."""
    w = torch.zeros(n, n, dtype=torch.float64)
    for g in groups:
        for i in g:
            w[i, g] = 1 / len(g)
    return w


def replicas_of(path):
    """A checkpoint's model as one vector, each parameter once (lm_head.weight is the token embedding)."""
    sd = torch.load(path, map_location='cpu', weights_only=True)['model']
    return torch.cat([sd[k].flatten().double() for k in sorted(sd) if k != 'lm_head.weight'])


def consensus_distance(x):
    """The mean over ranks (rows) of ||x_i - mean|| / ||mean||, as decent_train.py logs it."""
    mean = x.mean(0)
    return ((x - mean).norm(dim=1) / mean.norm()).mean().item()


# -----------------------------------------------------------------------------
# the topologies, without processes

SERVED = [('complete', n, n) for n in (2, 4, 8)] + [('ring', n, n) for n in (2, 3, 4, 5, 8)] + \
         [('one-peer-exp', n, n) for n in (2, 4, 8)] + \
         [('alternating-exp-ring', 4, 2), ('alternating-exp-ring', 8, 2), ('alternating-exp-ring', 8, 4)]


@pytest.mark.parametrize('topology, n, per_node', SERVED, ids=[f'{t}-{n}/{l}' for t, n, l in SERVED])
def test_rounds_are_doubly_stochastic_and_their_cycle_contracts(topology, n, per_node):
    rounds = mixing_rounds(topology, n, per_node)
    product = torch.eye(n, dtype=torch.float64)
    for groups in rounds:
        assert sorted(r for g in groups for r in g) == list(range(n)), groups  # every rank in exactly one group
        w = mixing_matrix(groups, n)
        assert (w >= 0).all()
        assert torch.allclose(w.sum(0), torch.ones(n, dtype=torch.float64))  # keeps the average
        assert torch.allclose(w.sum(1), torch.ones(n, dtype=torch.float64))  # a weighted mean of replicas
        product = w @ product
    # one cycle shrinks every deviation from the average by the product's largest singular value off the
    # consensus direction: the spectral gap 1 - sigma must be positive
    sigma = torch.linalg.matrix_norm(product - torch.full((n, n), 1 / n, dtype=torch.float64), ord=2).item()
    assert sigma < 1 - 1e-3, sigma
    if topology != 'ring' or n in (2, 4):
        assert sigma < 1e-12  # these reach the exact average within a cycle
    else:
        assert sigma > 0.2  # larger rings approach it: a ring of 8 halves the squared deviation per cycle


def test_rounds_pair_the_ranks_as_documented():
    assert mixing_rounds('ring', 4, 4) == [[[0, 1], [2, 3]], [[1, 2], [0, 3]]]
    assert mixing_rounds('one-peer-exp', 8, 8)[2] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # within the nodes, then rank j of node a with rank j of node b
    assert mixing_rounds('alternating-exp-ring', 4, 2) == [[[0, 1], [2, 3]], [[0, 2], [1, 3]]]
    assert len(mixing_rounds('alternating-exp-ring', 16, 4)) == 4  # 4 nodes: 2 rounds across, each after one within


@pytest.mark.parametrize('topology, n, per_node, message', [
    ('exp', 4, 4, "unknown topology='exp'"),
    ('one-peer-exp', 6, 6, 'power-of-2 world size, not 6'),
    ('alternating-exp-ring', 2, 2, 'not world size 2 with LOCAL_WORLD_SIZE=2'),  # one node
    ('alternating-exp-ring', 4, 1, 'LOCAL_WORLD_SIZE=1'),  # nodes of one rank
    ('alternating-exp-ring', 12, 4, '2, 4, 8, ... nodes'),  # 3 nodes
    # the fix is a flag: it said 'use ring', which a Decent-DP config's user sets as topology = 'ring'
    ('alternating-exp-ring', 2, 2, 'ranks per node: use --topology=ring'),
    # plain python (no RANK): how to start two nodes of two ranks, where it said 'not world size 1'
    ('alternating-exp-ring', 1, 1, 'plain python starts one process: launch with `torchrun --nnodes=2 '
                                   '--nproc_per_node=2'),
])
def test_topologies_refuse_world_sizes_they_cannot_serve(topology, n, per_node, message):
    with pytest.raises(ValueError, match=message.replace('(', r'\(').replace('.', r'\.')):
        mixing_rounds(topology, n, per_node)


def test_alternating_exp_ring_on_nodes_of_different_sizes_is_one_line_on_every_rank(tmp_path, data_dir):
    # torchrun lets each node start its own --nproc_per_node: nodes of 1, 1 and 2 ranks. Each rank built its rounds
    # from its own node's size, so ranks 2 and 3 (2 nodes of 2) went on to make groups that the others never made
    # (nodes of 2, 2 and 4 waited on each other with no end and no message)
    p = run('decent_train.py', *TINY, f'--dataset={data_dir / "shakespeare_char"}', '--out_dir=out',
            '--topology=alternating-exp-ring', '--gradient_accumulation_steps=4', nproc=4,
            nodes=[(tmp_path, 1), (tmp_path, 1), (tmp_path, 2)], cwd=tmp_path, check=False)
    errors = [line for line in p.stderr.splitlines() if line.startswith('error: ')]
    assert errors == ["error: topology=alternating-exp-ring needs as many ranks on every node, and torchrun's "
                      "--nproc_per_node differs between the nodes here: give every node the same, or use "
                      "--topology=ring"] * 4 and '[rank' not in p.stderr, p.stderr[-3000:]
    assert not (tmp_path / 'out').exists()


def test_accumadamw_is_adamw_at_one_step_and_feeds_its_moments_every_accum_steps():
    torch.manual_seed(0)
    x0, grads = torch.randn(5, 3), [torch.randn(5, 3) for _ in range(6)]
    a, b = torch.nn.Parameter(x0.clone()), torch.nn.Parameter(x0.clone())
    ours = AccumAdamW([a], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, accum_steps=1)
    adamw = torch.optim.AdamW([b], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    for g in grads:
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        adamw.step()
    assert (a - x0).abs().max() > 1e-2 and torch.allclose(a, b, rtol=0, atol=1e-7)
    # accum_steps=3: the parameters move every step; the moments change at steps 3 and 6 only, by the mean
    # gradient of the three steps before
    c = torch.nn.Parameter(x0.clone())
    opt = AccumAdamW([c], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, accum_steps=3)
    m = v = torch.zeros(5, 3)
    for t, g in enumerate(grads, 1):
        before = c.detach().clone()
        c.grad = g.clone()
        opt.step()
        assert not torch.equal(c, before)
        if t % 3 == 0:
            mean = sum(grads[t - 3:t]) / 3
            m, v = 0.9 * m + 0.1 * mean, 0.95 * v + 0.05 * mean ** 2
        state = opt.state[c]
        assert state['step'] == t // 3 and state['grads_summed'] == t % 3
        assert torch.allclose(state['exp_avg'], m, atol=1e-7) and torch.allclose(state['exp_avg_sq'], v, atol=1e-7)


# -----------------------------------------------------------------------------
# training runs

@pytest.fixture(scope='module')
def train_run(tmp_path_factory, data_dir):
    """train.py on one process, 4 steps: the reference, and a checkpoint to start from."""
    tmp = tmp_path_factory.mktemp('train_run')
    launch(tmp, data_dir, 'run', '--gradient_accumulation_steps=2', '--max_iters=4', '--eval_interval=4',
           script='train.py')
    return tmp / 'run'


def test_one_process_with_adamw_is_train_py(tmp_path, data_dir, train_run):
    # the same step, bucket by bucket: per-parameter AdamW and the rank's own clipping are train.py's on one rank
    launch(tmp_path, data_dir, 'run', '--gradient_accumulation_steps=2', '--max_iters=4', '--eval_interval=4',
           '--replica_optimizer=adamw')
    (ref, ref_evals), (ours, our_evals) = read_metrics(train_run), read_metrics(tmp_path / 'run')
    assert sorted(ref) == sorted(ours) == list(range(4)) and ref[3] < ref[0] - 0.1
    assert all(abs(ref[i] - ours[i]) <= 1e-6 * ref[i] for i in range(4)), (ref, ours)
    assert abs(ref_evals[-1]['val_loss'] - our_evals[-1]['val_loss']) <= 1e-6 * ref_evals[-1]['val_loss']


def test_complete_sgd_two_ranks_match_one_rank_with_twice_the_micro_steps(tmp_path, data_dir):
    # 4 micro-steps in a step either way: 4 on one rank, 2 on each of two. From equal replicas, the average of two
    # SGD steps is one step on the average gradient, so the runs agree to rounding
    args = ['--topology=complete', '--replica_optimizer=sgd', '--grad_clip=0.0', '--learning_rate=0.5', '--min_lr=0.05',
            '--gradient_accumulation_steps=4', '--max_iters=10', '--eval_interval=10']
    one_p, two_p = launch(tmp_path, data_dir, 'one', *args), launch(tmp_path, data_dir, 'two', *args, nproc=2)
    # alone, a topology has no replica to mix with: the run says that it trains a single model, and how to launch
    # ranks (it said 'topology complete, a cycle of 1 mixing round' and nothing more); with peers it warns of nothing
    assert "warning: one process: topology complete has no other replica to mix with, so this trains a single " \
        "model with no gossip; plain python starts one process: launch with `torchrun --nproc_per_node=2 " \
        "decent_train.py ...`\n" in one_p.stdout, one_p.stdout[:2000]
    assert 'warning' not in two_p.stdout + two_p.stderr, two_p.stdout[:2000]
    (one, one_evals), (two, two_evals) = read_metrics(tmp_path / 'one'), read_metrics(tmp_path / 'two')
    assert sorted(one) == sorted(two) == list(range(10))
    assert one[9] < one[0] - 0.3  # it learns
    for i in range(10):
        assert abs(one[i] - two[i]) <= 1e-5 * one[i], (i, one[i], two[i])
    assert abs(one_evals[-1]['val_loss'] - two_evals[-1]['val_loss']) <= 1e-5 * one_evals[-1]['val_loss']
    assert two_evals[-1]['consensus_distance'] < 1e-7  # complete mixing: every replica is the average
    assert (replicas_of(tmp_path / 'one' / 'ckpt.pt') - replicas_of(tmp_path / 'two' / 'ckpt.pt')).abs().max() < 1e-5


@pytest.fixture(scope='module')
def two_nodes(tmp_path_factory, data_dir):
    """alternating-exp-ring on 4 processes as 2 nodes of 2, 6 steps: a checkpoint of 4 replicas at step 6."""
    tmp = tmp_path_factory.mktemp('two_nodes')
    stdout = launch_two_nodes(tmp, data_dir, 'run', '--topology=alternating-exp-ring',
                              '--gradient_accumulation_steps=4', '--max_iters=6', '--eval_interval=3')
    return tmp / 'run', stdout


def test_alternating_exp_ring_runs_on_two_nodes_of_two(two_nodes):
    out, stdout = two_nodes
    config = json.loads((out / 'config.json').read_text())
    assert config['world_size'] == 4 and config['local_world_size'] == 2
    assert config['mixing_rounds'] == [[[0, 1], [2, 3]], [[0, 2], [1, 3]]]  # within nodes, then across
    losses, evals = read_metrics(out)
    assert sorted(losses) == list(range(6)) and losses[5] < losses[0] - 0.1
    # the replicas see different data, so they drift apart between mixings, but stay close
    assert evals[0]['consensus_distance'] < 1e-6 and all(1e-5 < e['consensus_distance'] < 0.05 for e in evals[1:])
    assert 'topology alternating-exp-ring, a cycle of 2 mixing rounds' in stdout
    # the export is the average of the four replicas
    folder = out / 'decent' / 'step-00000006'
    assert sorted(p.name for p in folder.iterdir()) == [f'rank-{r}.pt' for r in range(4)] + ['run_id']
    replicas = torch.stack([replicas_of(folder / f'rank-{r}.pt') for r in range(4)])
    assert (replicas - replicas.mean(0)).abs().max() > 1e-5
    assert (replicas_of(out / 'ckpt.pt') - replicas.mean(0)).abs().max() < 1e-6


def test_consensus_distance_falls_as_the_mixing_rounds_predict(tmp_path, data_dir, two_nodes):
    # four different replicas (GPTs from four seeds) in the 4-rank checkpoint, then ring steps with lr 0 on 4
    # processes: only the mixing moves them, so each replica is the rounds' product applied to the four
    from model import GPT, GPTConfig
    out = tmp_path / 'run'
    shutil.copytree(two_nodes[0], out)
    folder = out / 'decent' / 'step-00000006'
    for r in range(4):
        c = torch.load(folder / f'rank-{r}.pt', weights_only=True)
        torch.manual_seed(100 + r)
        c['model'] = GPT(GPTConfig(**c['model_args'])).state_dict()
        torch.save(c, folder / f'rank-{r}.pt')
    x = torch.stack([replicas_of(folder / f'rank-{r}.pt') for r in range(4)])
    args = ['--init_from=resume', '--topology=ring', '--learning_rate=0.0', '--min_lr=0.0',
            '--gradient_accumulation_steps=4', '--max_iters=9', '--eval_interval=1', '--always_save_checkpoint=False']
    launch(tmp_path, data_dir, 'run', *args, nproc=4)
    evals = [e for e in read_metrics(out)[1] if e['iter'] >= 6]
    assert [e['iter'] for e in evals] == [6, 7, 8, 9]
    rounds = mixing_rounds('ring', 4, 4)
    predicted = []
    for t in range(6, 10):
        predicted.append(consensus_distance(x))
        x = mixing_matrix(rounds[t % len(rounds)], 4) @ x  # step t's mixing
    measured = [e['consensus_distance'] for e in evals]
    assert predicted[0] > 0.1 and predicted[1] < 0.8 * predicted[0]  # far apart at first; the first round pulls in
    for p, m in zip(predicted, measured):
        assert abs(p - m) <= 1e-4 * p + 1e-5, (predicted, measured)
    # the mixing is doubly stochastic, so the average, which is what evals see, does not move
    assert max(e['val_loss'] for e in evals) - min(e['val_loss'] for e in evals) < 1e-5


def test_resume_repeats_the_uninterrupted_run_exactly(tmp_path, data_dir):
    # dropout on (every rank's RNG must come back), AccumAdamW stopped in the middle of its 3-step window (its
    # gradient sum must come back), and the updates from the backward hooks (no clipping)
    args = ['--replica_optimizer=accumadamw', '--moment_accum_steps=3', '--dropout=0.1', '--grad_clip=0.0',
            '--gradient_accumulation_steps=2', '--eval_interval=4']
    launch(tmp_path, data_dir, 'full', *args, '--max_iters=8', nproc=2)
    launch(tmp_path, data_dir, 'split', *args, '--max_iters=4', nproc=2)
    launch(tmp_path, data_dir, 'split', *args, '--max_iters=8', '--init_from=resume', nproc=2)
    (full, full_evals), (split, split_evals) = read_metrics(tmp_path / 'full'), read_metrics(tmp_path / 'split')
    assert sorted(split) == list(range(8))
    assert [split[i] for i in range(8)] == [full[i] for i in range(8)]  # bit for bit
    assert split_evals[-1] == {**full_evals[-1], 'time': split_evals[-1]['time']}
    for r in range(2):
        last = f'decent/step-00000008/rank-{r}.pt'
        assert torch.equal(replicas_of(tmp_path / 'full' / last), replicas_of(tmp_path / 'split' / last))
    # the one before is kept, the fallback should the newest turn out damaged (and the best, besides)
    assert sorted(p.name for p in (tmp_path / 'split' / 'decent').iterdir() if not p.name.startswith('best')) == [
        'latest', 'step-00000004', 'step-00000008']
    # a step folder (or the file that names it) is read as the whole model saved with it: the replicas averaged, its
    # export, of that iteration (the one before's is ckpt.prev.pt)
    split, meta = tmp_path / 'split', f"--meta_path={data_dir / 'shakespeare_char' / 'meta.pkl'}"
    texts = {}
    for given, read in (('decent/step-00000004', 'ckpt.prev.pt'), ('decent/latest', 'ckpt.pt'),
                        ('ckpt.prev.pt', None)):
        p = run('sample.py', f"--init_from={split / given}", '--device=cpu', '--num_samples=1', '--max_new_tokens=20',
                meta, cwd=tmp_path)
        assert read is None or f"note: reading {split / read}, the whole model that decent_train.py saved with " \
            f"{split / 'decent' / ('step-00000004' if '4' in given else 'step-00000008')} (" in p.stderr, p.stderr
        texts[given] = p.stdout
    assert texts['decent/step-00000004'] == texts['ckpt.prev.pt'] != texts['decent/latest']
    # another replica optimizer cannot take the replicas' state: the answer keeps them, and changes nothing
    before = {f: f.read_bytes() for f in (tmp_path / 'split').rglob('*') if f.is_file() and f.name != 'run.lock'}
    p = launch(tmp_path, data_dir, 'split', *args, '--max_iters=10', '--replica_optimizer=sgd', nproc=2, check=False)
    error = one_line_error(p, nproc=2)
    assert 'holds the state of replica_optimizer=accumadamw' in error and 'delete' not in error, error
    assert f"--init_from={tmp_path / 'split' / 'ckpt.pt'} and another --out_dir" in error, error
    assert {f: f.read_bytes() for f in (tmp_path / 'split').rglob('*') if f.is_file()} == before
    # another --moment_accum_steps (and weight_decay, beta2) takes effect (load_state_dict put the saved 3 back): its
    # window had summed 2 gradients at step 8, and the third goes past the new 2, so the moments take in the mean of
    # the 3 at once
    launch(tmp_path, data_dir, 'split', *args, '--max_iters=9', '--moment_accum_steps=2', '--weight_decay=0.5',
           '--beta2=0.9', nproc=2)
    saved = torch.load(tmp_path / 'split' / 'decent' / 'step-00000009' / 'rank-0.pt', weights_only=True)
    assert counts_tokens(saved)
    saved = saved['optimizers']
    at8 = torch.load(tmp_path / 'split' / 'decent' / 'step-00000008' / 'rank-0.pt', weights_only=True)['optimizers']
    assert [(g['accum_steps'], g['weight_decay'], tuple(g['betas'])) for g in saved[1]['param_groups']] == [
        (2, 0.5, (0.9, 0.9)), (2, 0.0, (0.9, 0.9))]
    assert at8[0]['state'][0]['grads_summed'] == 2 and saved[0]['state'][0]['grads_summed'] == 0
    assert saved[0]['state'][0]['step'] == at8[0]['state'][0]['step'] + 1
    # step 9's folder without rank 1's file (a crash, or the file removed): passed over by the resume, from step 8, and
    # kept whole when the run saves step 9 again, rank 0's file as it was (never written over)
    nine = tmp_path / 'split' / 'decent' / 'step-00000009'
    (nine / 'rank-1.pt').unlink()
    kept = (nine / 'rank-0.pt').read_bytes(), (nine / 'rank-0.pt').stat().st_ino
    p = launch(tmp_path, data_dir, 'split', *args, '--max_iters=9', '--moment_accum_steps=2', '--weight_decay=0.5',
               '--beta2=0.9', nproc=2)
    aside = tmp_path / 'split' / 'decent' / 'incomplete-step-00000009'
    assert f"{nine} lacks a rank's file (a save cut short, or a file removed): kept as {aside}" in p.stdout
    assert sorted(f.name for f in aside.iterdir()) == ['rank-0.pt', 'run_id']
    assert ((aside / 'rank-0.pt').read_bytes(), (aside / 'rank-0.pt').stat().st_ino) == kept
    assert sorted(f.name for f in nine.iterdir()) == ['rank-0.pt', 'rank-1.pt', 'run_id']
    # kept while step 9 is the newest; once a newer save of the run is whole, removed as pruning removes a step folder
    # of the run cut short (it never accumulated, one more each crash mid-save, until the disk filled)
    p = launch(tmp_path, data_dir, 'split', *args, '--max_iters=10', '--moment_accum_steps=2', '--weight_decay=0.5',
               '--beta2=0.9', nproc=2)
    ten = nine.parent / 'step-00000010'
    assert f"removed {aside}, a save of this run cut short: {ten}, newer, is whole" in p.stdout
    assert not aside.exists() and sorted(f.name for f in nine.iterdir()) == ['rank-0.pt', 'rank-1.pt', 'run_id']


def test_train_checkpoint_starts_the_replicas_and_their_average_goes_to_sample_and_train(tmp_path, data_dir,
                                                                                          train_run):
    out = tmp_path / 'run'
    shutil.copytree(train_run, out)
    train_eval = read_metrics(out)[1][-1]
    p = launch(tmp_path, data_dir, 'run', '--init_from=resume', '--replica_optimizer=accumadamw', '--max_iters=8',
               '--gradient_accumulation_steps=2', '--eval_interval=4', nproc=2)
    assert 'at iter 4' in p.stdout
    losses, evals = read_metrics(out)  # train.py's rows from iter 4 on were dropped: they are logged again
    assert sorted(losses) == list(range(8)) and [e['iter'] for e in evals] == [0, 4, 8]
    # the first eval saw train.py's weights in every replica
    assert abs(evals[1]['val_loss'] - train_eval['val_loss']) < 1e-6 and evals[1]['consensus_distance'] < 1e-7
    # the export: the model (a ring of 2 averages both replicas every step) and the moments, by train.py's numbering
    export = torch.load(out / 'ckpt.pt', weights_only=True)
    assert torch.equal(replicas_of(out / 'ckpt.pt'), replicas_of(out / 'decent' / 'step-00000008' / 'rank-1.pt'))
    assert export['iter_num'] == 8 and len(export['optimizer']['state']) == len(export['model']) - 1
    # the checkpoint names its dataset by a path, which sample.py does not follow: the vocabulary is given. With an
    # export older than the replicas (the newest killed mid-write) it reads that one, and names the command that
    # writes the newest: a finished run under always_save_checkpoint=False (a config's) wrote none without its flag
    shutil.copy(out / 'ckpt.prev.pt', out / 'ckpt.pt')
    s = run('sample.py', f'--out_dir={out}', f'--meta_path={data_dir / "shakespeare_char" / "meta.pkl"}',
            '--num_samples=2', '--max_new_tokens=20', '--device=cpu', cwd=tmp_path)
    assert s.stdout.count('---------------') == 2
    assert f"continue it with `decent_train.py --out_dir={out} --always_save_checkpoint=True` (its other flags and " \
        f"ranks as before) until it saves" in s.stderr, s.stderr
    launch(tmp_path, data_dir, 'run', '--replica_optimizer=accumadamw', '--max_iters=8', '--eval_interval=4',
           '--gradient_accumulation_steps=2', '--always_save_checkpoint=False', '--always_save_checkpoint=True',
           nproc=2)
    assert torch.equal(replicas_of(out / 'ckpt.pt'), replicas_of(out / 'decent' / 'step-00000008' / 'rank-1.pt'))
    # train.py resumes the export: its eval at 8 is decent_train.py's, on the same averaged model
    launch(tmp_path, data_dir, 'run', '--init_from=resume', '--max_iters=10', '--gradient_accumulation_steps=2',
           '--eval_interval=4', script='train.py')
    losses, train_evals = read_metrics(out)
    assert sorted(losses) == list(range(10)) and [e['iter'] for e in train_evals] == [0, 4, 8, 10]
    assert abs(train_evals[2]['val_loss'] - evals[2]['val_loss']) < 1e-6


def fails(tmp_path, data_dir, *args, nproc=1):
    return one_line_error(launch(tmp_path, data_dir, 'bad', *args, nproc=nproc, check=False), nproc)


def test_bad_topologies_world_sizes_and_keys_are_one_line_errors(tmp_path, data_dir, two_nodes):
    assert "unknown topology='star': use complete, ring, one-peer-exp or alternating-exp-ring" in \
        fails(tmp_path, data_dir, '--topology=star')  # (exp is Decent-DP's name for one-peer-exp: taken)
    assert 'alternating-exp-ring needs 2, 4, 8, ... nodes of at least 2 ranks each, and plain python starts one ' \
        'process: launch with `torchrun --nnodes=2 --nproc_per_node=2 --rdzv-backend=c10d ' \
        '--rdzv-endpoint=HEAD:29500 decent_train.py ...` on each of 2 nodes' in \
        fails(tmp_path, data_dir, '--topology=alternating-exp-ring')
    assert 'one-peer-exp needs a power-of-2 world size, not 3' in \
        fails(tmp_path, data_dir, '--topology=one-peer-exp', nproc=3)
    msg = fails(tmp_path, data_dir, '--replica_optimizer=lamb')
    assert "unknown replica_optimizer='lamb': use adamw, accumadamw or sgd" in msg
    assert not (tmp_path / 'bad').exists()


def test_at_another_world_size_every_rank_starts_from_the_average_of_the_replicas(tmp_path, data_dir, two_nodes):
    # the 4 replicas of the 2-node run at step 6, resumed on 2 ranks: both start from their average, the model
    # that the 4-rank run's own eval at step 6 saw
    shutil.copytree(two_nodes[0], tmp_path / 'run')
    p = launch(tmp_path, data_dir, 'run', '--gradient_accumulation_steps=4', '--max_iters=6', nproc=2)
    assert 'holds the replicas of 4 ranks, not 2: every rank starts from their average' in p.stdout
    assert 'resuming from' in p.stdout and 'at iter 6' in p.stdout
    four, two = read_metrics(two_nodes[0])[1][-1], read_metrics(tmp_path / 'run')[1][-1]
    assert four['iter'] == two['iter'] == 6 and four['consensus_distance'] > 1e-4
    assert abs(two['val_loss'] - four['val_loss']) <= 1e-6 * four['val_loss'] and two['consensus_distance'] < 1e-7
    # on one rank, a new best there (an eval of other batches, --eval_iters=2): the four replicas stay as they were,
    # rather than rank 0's be replaced by their average (the step folder then a 1-rank one, the others left stale)
    folder = tmp_path / 'run' / 'decent' / 'step-00000006'
    before = {f.name: f.read_bytes() for f in folder.iterdir()}
    # best names step 3's folder, as where the eval at 6 (of other batches) was no best
    shutil.copytree(folder.parent / 'step-00000003', folder.parent / 'best-step-00000003')
    shutil.rmtree(folder.parent / 'best-step-00000006')
    (folder.parent / 'best').write_text('best-step-00000003')
    p = launch(tmp_path, data_dir, 'run', '--gradient_accumulation_steps=4', '--max_iters=6', '--eval_iters=2',
               '--always_save_checkpoint=False')
    assert 'saving the averaged model' in p.stdout  # a new best: always_save_checkpoint is off
    assert {f.name: f.read_bytes() for f in folder.iterdir()} == before
    # and named best as they are: the state whose average best.pt holds, which the tools read as the run's best
    assert (folder.parent / 'best').read_text() == 'best-step-00000006'
    assert not (folder.parent / 'best-step-00000003').exists()
    assert {f.name: f.read_bytes() for f in (folder.parent / 'best-step-00000006').iterdir()} == before
    assert torch.load(tmp_path / 'run' / 'best.pt', weights_only=True)['iter_num'] == 6


SET_ASIDE = '''
import os, sys
import torch.distributed as dist
sys.path.insert(0, sys.argv[2])  # the repo
from decent import set_aside_incomplete
dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)
root = os.path.join(sys.argv[1], 'decent')
set_aside_incomplete(os.path.join(root, 'step-00000009'), 'mine')
dist.destroy_process_group()
'''


def test_latest_never_names_a_folder_set_aside_as_incomplete(tmp_path):
    # step 9's folder lacking a rank's file, named by latest (its other file removed by hand): set aside before the
    # save of step 9, latest named that missing folder until the save was done, and for good where it failed; then it
    # named the folder just before, whatever it was: one cut short, or another run's copied in by hand
    root = tmp_path / 'decent'
    for step in (6, 7, 8, 9):
        (root / f'step-{step:08d}').mkdir(parents=True)
    for step, ranks, run_id in ((6, (0, 1), 'mine'), (7, (0, 1), 'theirs'), (8, (1,), 'mine')):
        for r in ranks:  # 6 whole, 7 another run's, 8 cut short (rank 0's file never written)
            torch.save({'iter_num': step, 'rng': [0, 0], 'run_id': run_id}, root / f'step-{step:08d}' / f'rank-{r}.pt')
    (tmp_path / 'run_id').write_text('mine')
    (root / 'step-00000009' / 'rank-1.pt').write_bytes(b'')
    (root / 'latest').write_text('step-00000009')
    (tmp_path / 'set_aside.py').write_text(SET_ASIDE)
    run(tmp_path / 'set_aside.py', tmp_path, REPO, cwd=tmp_path)
    assert sorted(f.name for f in root.iterdir()) == ['incomplete-step-00000009', 'latest', 'step-00000006',
                                                      'step-00000007', 'step-00000008', 'step-00000009']
    assert (root / 'latest').read_text() == 'step-00000006'
    # the save begun in step 9 tells its run from the start: SIGKILLed mid-write (temporaries alone), a resume took
    # it for no run's, set aside as unknown-run-step-9 at each crash (pruning never reached it) until the disk filled
    assert [f.name for f in (root / 'step-00000009').iterdir()] == ['run_id']
    (root / 'step-00000009' / 'rank-0.pt.tmp').write_bytes(b'cut short')
    from checkpoint import point_latest, set_aside_others
    set_aside_others(str(tmp_path), 'mine', str(root / 'step-00000006'))
    assert (root / 'step-00000009').is_dir() and not list(root.glob('unknown-run-*'))
    (root / 'step-00000010').mkdir()
    for r in (0, 1):
        torch.save({'iter_num': 10, 'rng': [0, 0], 'run_id': 'mine'}, root / 'step-00000010' / f'rank-{r}.pt')
    point_latest(str(root / 'step-00000010'), keep=2)
    assert not (root / 'step-00000009').exists()  # pruned as the run's own
    # then the folders set aside as incomplete before step 10 that hold this run's files alone: removed, as pruning
    # removed step 9; any other kept: another run's, one saved before runs had ids, one with a file put there by hand,
    # one no file tells the run of, one damaged (step 9's, its empty rank-1.pt) and one at step 10 itself
    from decent import prune_incomplete
    for name, files in (('00000008', {'rank-0.pt': 'mine', 'run_id': 'mine', 'rank-1.pt.tmp': 'cut short'}),
                        ('00000008.2', {'rank-1.pt': 'mine'}),  # a second one of step 8 (unused() names it so)
                        ('00000007', {'rank-0.pt': 'theirs', 'run_id': 'theirs'}), ('00000006', {'rank-0.pt': ''}),
                        ('00000005', {'rank-0.pt': 'mine', 'notes.txt': 'mine'}),
                        ('00000004', {'rank-0.pt.tmp': 'cut short'}), ('00000010', {'rank-0.pt': 'mine'})):
        folder = root / f'incomplete-step-{name}'
        folder.mkdir()
        for file, run_id in files.items():
            if file.endswith('.pt'):
                torch.save({'iter_num': 8, 'rng': [0, 0], 'run_id': run_id}, folder / file)
            else:
                (folder / file).write_text(run_id)
    prune_incomplete(str(root / 'step-00000010'), 'mine')
    assert sorted(f.name for f in root.glob('incomplete-*')) == [f'incomplete-step-{n:08d}'
                                                                 for n in (4, 5, 6, 7, 9, 10)]
