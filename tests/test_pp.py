"""pp_train.py in real process groups on gloo, in fp32: parity with train.py on one process (each schedule, at pp 2 x
dp 2 or pp 2; pp 4; pp 2 x tp 2), the tied embedding, every rank's memory against model_size.py, exact resume with
dropout, resume at another layout and in fsdp_train.py; and sharded in bf16, against fsdp_train.py's bf16."""

import json
import os
import re
import shutil
import signal
import time

import pytest
import torch

from checkpoint import previous, snapshot_dir
from conftest import REPO, TINY, env, one_line_error, read_metrics, run
from launcher import finish, launch as launch_ranks, start
from model import GPT, GPTConfig
from pipeline import Part, stage_memory
from test_fault import logged_iters

# 8 blocks, so that pp 4 with two stages per rank has one block a stage; the global batch of test_fsdp.py
BASE = ['--n_layer=8', '--gradient_accumulation_steps=4', '--eval_interval=4', '--always_save_checkpoint=True']
STEPS = 6
SHAPE = dict(n_layer=8, n_head=2, n_embd=32, block_size=32, vocab_size=65)  # TINY's, with BASE's layers


def launch(script, tmp_path, data_dir, out, *extra, nproc=1, check=True):
    return run(script, *TINY, *BASE, f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={tmp_path / out}',
               *extra, nproc=nproc, cwd=tmp_path, check=check)


def assert_same_curve(a, b, iters, rel=1e-5):
    assert all(i in a and i in b for i in iters), (sorted(a), sorted(b))
    for i in iters:
        assert abs(a[i] - b[i]) <= rel * abs(a[i]), (i, a[i], b[i])


@pytest.fixture(scope='module')
def ref(shared_run):
    """train.py on one process: the curve every pipeline layout must reproduce."""
    out = shared_run('train.py', *BASE, f'--max_iters={STEPS}')
    losses, evals = read_metrics(out)
    assert losses[STEPS - 1] < losses[0] - 0.2  # it learns
    return out, losses, evals


@pytest.fixture(scope='module')
def sizes(tmp_path_factory):
    """sizes(pp, schedule, tp) -> model_size.py's rows for the model of these tests at pp_train.py's default
    stages_per_rank (one run per layout)."""
    done, tmp = {}, tmp_path_factory.mktemp('sizes')

    def size(pp, schedule, tp):
        if (pp, schedule, tp) not in done:
            p = run('model_size.py', *[f'--{k}={x}' for k, x in SHAPE.items()], '--bias=True', f'--pp_size={pp}',
                    f'--pp_schedule={schedule}', *['--stages_per_rank=2'] * schedule.startswith('interleaved'),
                    *[f'--tp_size={tp}'] * (tp > 1), cwd=tmp)
            done[pp, schedule, tp] = json.loads(p.stdout.strip().splitlines()[-1])
        return done[pp, schedule, tp]
    return size


@pytest.mark.parametrize('nproc, pp, schedule, shard, tp', [
    # each schedule once on two pipelines (dp 2 x pp 2: a pipeline's own steps and its gradients summed over the
    # data-parallel ranks), and once on one (pp 2: GPipe, and DualPipeV, which needs its 4 micro-batches on one)
    (2, 2, 'gpipe', False, 1), (4, 2, '1f1b', False, 1), (4, 2, 'interleaved-1f1b', False, 1),
    (4, 2, 'interleaved-zb', False, 1), (4, 2, 'zbv', False, 1), (2, 2, 'dualpipev', False, 1),
    # a middle rank, neither end's (4 ranks of one stage, or of two)
    (4, 4, '1f1b', False, 1), (4, 4, 'interleaved-1f1b', False, 1),
    # one rank holding both ends of the tied weight: torch's schedules divided its gradient by the micro-batches twice;
    # and torch 2.11's schedules sent to the rank itself, neighbouring stages on one rank (as in zbv's V), which gloo
    # cannot (pipeline.make_schedule)
    (1, 1, 'interleaved-1f1b', False, 1),
    # each stage sharded over the 2 pipelines (FSDP): a rank holds half its stages' state
    (4, 2, '1f1b', True, 1), (4, 2, 'interleaved-1f1b', True, 1),
    # and in zbv's V, whose first rank holds both ends of the tied weight: its first stage's FSDP root owns it
    (4, 2, 'zbv', True, 1),
    # each stage tensor parallel over 2 ranks (3-D: dp 1 x pp 2 x tp 2), stopped and resumed below
    (4, 2, '1f1b', False, 2),
    # and sharded over 2 pipelines besides (FSDP over TP stages, 2-D DTensors: dp 2 x pp 2 x tp 2), the same
    (8, 2, '1f1b', True, 2),
], ids=['pp2-gpipe', 'dp2xpp2-1f1b', 'dp2xpp2-interleaved', 'dp2xpp2-zero-bubble', 'dp2xpp2-zbv', 'pp2-dualpipev',
        'pp4-1f1b', 'pp4-interleaved', 'pp1-interleaved', 'sharded-dp2xpp2-1f1b', 'sharded-dp2xpp2-interleaved',
        'sharded-dp2xpp2-zbv', 'pp2xtp2-1f1b', 'sharded-dp2xpp2xtp2'])
def test_pipeline_matches_single_process(tmp_path, data_dir, ref, sizes, nproc, pp, schedule, shard, tp):
    launch('pp_train.py', tmp_path, data_dir, 'pp', f'--max_iters={STEPS}', f'--pp_size={pp}',
           f'--pp_schedule={schedule}', '--save_consolidated=True', f'--dp_shard={shard}', f'--tp_size={tp}',
           nproc=nproc)
    losses, evals = read_metrics(tmp_path / 'pp')
    assert_same_curve(ref[1], losses, range(STEPS))
    # the evals go through the pipeline too
    assert [e['iter'] for e in evals] == [e['iter'] for e in ref[2]]
    for mine, theirs in zip(evals, ref[2]):
        assert abs(mine['val_loss'] - theirs['val_loss']) <= 1e-5 * theirs['val_loss']
    # the consolidated checkpoint: train.py's weights; its head is the last stage's copy of the tied weight and its
    # token embedding the first stage's, which their summed gradients keep bit-identical
    ckpt, theirs = (torch.load(out / 'ckpt.pt', map_location='cpu', weights_only=True) for out in (tmp_path / 'pp',
                                                                                                    ref[0]))
    sd, ours = ckpt['model'], theirs['model']
    assert sd.keys() == ours.keys()
    for k in sd:
        assert (sd[k] - ours[k]).abs().max().item() < 1e-5, k
    # and AdamW's moments, numbered as train.py numbers the parameters (sharded, a copy of the tied weight had made
    # one name too many in the first stage's count)
    moments, ours = ckpt['optimizer']['state'], theirs['optimizer']['state']
    assert moments.keys() == ours.keys()
    for i in moments:
        for k in ('exp_avg', 'exp_avg_sq'):
            assert moments[i][k].shape == ours[i][k].shape and (moments[i][k] - ours[i][k]).abs().max() < 1e-6, (i, k)
    if (nproc, pp, schedule) == (2, 2, 'gpipe'):  # the tools read a pipeline run as any other
        run('sample.py', f'--out_dir={tmp_path / "pp"}', '--device=cpu', '--num_samples=1', '--max_new_tokens=5',
            f'--meta_path={data_dir / "shakespeare_char" / "meta.pkl"}', cwd=tmp_path)
        run('export_hf.py', f'--ckpt={tmp_path / "pp" / "ckpt.pt"}', f'--out={tmp_path / "hf"}', cwd=tmp_path)
        assert (tmp_path / 'hf' / 'model.safetensors').exists()
    assert torch.equal(sd['lm_head.weight'], sd['transformer.wte.weight'])
    # every rank's memory (its stages' parameters, gradients and AdamW state; the end stages hold the embeddings and
    # the head): model_size.py's estimate for its place in the pipeline. The state is counted exactly: 1%, as 10%
    # would not tell this tiny model's end stages from its middle ones. Sharded, the pipelines' ranks of a stage
    # hold it between them, about half each; tensor parallel, a tp group's ranks each hold their pieces of the blocks'
    # matrices and the rest whole
    with open(tmp_path / 'pp' / 'metrics.jsonl') as f:
        measured = next(row for row in map(json.loads, f) if 'rank_state_bytes' in row)['rank_state_bytes']
    assert len(measured) == nproc
    estimate = sizes(pp, schedule, tp)
    for rank, got in enumerate(measured):  # the pipelines are consecutive ranks: pp_rank = rank // tp % pp
        row = estimate[f'PP {pp}{f" x TP {tp}" * (tp > 1)} rank {rank // tp % pp}']
        whole = row['param_bytes'] + row['grad_bytes'] + row['optim_bytes']
        if shard:
            assert abs(got - whole / 2) <= 0.1 * got, (rank, got, row)
            got = sum(measured[rank % (pp * tp)::pp * tp])  # the stage's ranks of this tp rank
        assert abs(got - whole) <= 0.01 * got, (rank, got, row)
    if tp > 1 or shard and schedule == 'zbv':
        # stopped at step 4 (its checkpoint there: the tp groups' pieces of the matrices, as DTensors; in the V the
        # tied weight's shards once, the first stage's) and resumed: in its own layout bit for bit, and in a pipeline
        # of 2 ranks, neither tensor parallel nor sharded, on train.py's curve
        for out, n, flags in (('again', nproc, [f'--tp_size={tp}', f'--dp_shard={shard}',
                                                f'--pp_schedule={schedule}']), ('whole', 2, [])):
            shutil.copytree(tmp_path / 'pp', tmp_path / out)
            for f in [*(tmp_path / out).glob('*.pt'), *(tmp_path / out / 'dcp').glob('*-00000006')]:
                shutil.rmtree(f) if f.is_dir() else f.unlink()
            (tmp_path / out / 'dcp' / 'latest').write_text('step-00000004')
            launch('pp_train.py', tmp_path, data_dir, out, f'--max_iters={STEPS}', f'--pp_size={pp}', *flags,
                   '--init_from=resume', nproc=n)
        again, whole = read_metrics(tmp_path / 'again'), read_metrics(tmp_path / 'whole')
        scores = lambda rows: [(e['iter'], e['train_loss'], e['val_loss']) for e in rows]
        assert again[0] == losses and scores(again[1]) == scores(evals)
        assert_same_curve(ref[1], whole[0], range(STEPS))
        assert abs(whole[1][-1]['val_loss'] - ref[2][-1]['val_loss']) <= 1e-5 * ref[2][-1]['val_loss']


# Each rank prints the size of every tensor that pipeline.py broadcasts over its pipeline, then runs the script
COUNT_BROADCASTS = '''
import os, runpy, sys
import torch.distributed as dist
sys.path.insert(0, os.path.dirname(sys.argv[1]))
broadcast = dist.broadcast
def counted(tensor, *args, **kwargs):
    if sys._getframe(1).f_code.co_filename.endswith('pipeline.py'):
        print('pipeline broadcast', tensor.numel(), flush=True)
    return broadcast(tensor, *args, **kwargs)
dist.broadcast = counted
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name='__main__')
'''


def test_an_eval_sends_the_last_stages_loss_across_the_pipeline_not_its_logits(tmp_path, data_dir):
    # an eval batch's logits are batch x block x vocab, 2.5 GB in fp32 at GPT-2's 12 x 1024 x 50304, and the eval
    # needs the loss alone: they crossed the pipeline once a batch (here 4 x 32 x 65)
    wrapper = tmp_path / 'count_broadcasts.py'
    wrapper.write_text(COUNT_BROADCASTS)
    p = launch_ranks(str(wrapper), [str(REPO / 'pp_train.py'), *TINY, '--pp_size=2', '--gradient_accumulation_steps=2',
                                    '--max_iters=0', f'--dataset={data_dir / "shakespeare_char"}',
                                    f'--out_dir={tmp_path / "pp"}'], env(), tmp_path, nproc=2)
    assert p.returncode == 0, p.stderr[-3000:]
    sizes = [int(n) for n in re.findall(r'^pipeline broadcast (\d+)$', p.stdout, re.M)]
    assert len(sizes) == 2 * 2 * 4, p.stdout[-3000:]  # both ranks, both splits, eval_iters batches
    assert set(sizes) == {1}


@pytest.mark.parametrize('schedule', ['interleaved-1f1b', 'zbv'])
def test_pipeline_exact_resume_with_dropout(tmp_path, data_dir, schedule):
    args = ['--dropout=0.1', '--pp_size=2', f'--pp_schedule={schedule}']  # every rank's RNG has to come back
    launch('pp_train.py', tmp_path, data_dir, 'full', *args, f'--max_iters={STEPS}', nproc=2)
    launch('pp_train.py', tmp_path, data_dir, 'split', *args, '--max_iters=4', nproc=2)
    launch('pp_train.py', tmp_path, data_dir, 'split', *args, f'--max_iters={STEPS}', '--init_from=resume', nproc=2)
    full, split = read_metrics(tmp_path / 'full')[0], read_metrics(tmp_path / 'split')[0]
    assert sorted(split) == list(range(STEPS))
    assert [split[i] for i in range(STEPS)] == [full[i] for i in range(STEPS)]  # bit for bit
    # another weight_decay and beta2 take effect: the sharded load had put the saved ones back
    launch('pp_train.py', tmp_path, data_dir, 'split', *args, f'--max_iters={STEPS + 1}', '--weight_decay=0.5',
           '--beta2=0.9', '--save_consolidated=True', nproc=2)
    groups = torch.load(tmp_path / 'split' / 'ckpt.pt', weights_only=True)['optimizer']['param_groups']
    assert [(g['weight_decay'], tuple(g['betas'])) for g in groups] == [(0.5, (0.9, 0.9)), (0.0, (0.9, 0.9))]


def test_sharded_stages_in_bf16_gather_as_fsdp_train_does_and_resume_exactly_with_adamw_on_shards(
        tmp_path, data_dir, shared_run):
    # dp 2 x pp 2, each stage sharded over the 2 pipelines in bf16: parameters gathered in bf16 and gradients reduced
    # in fp32, as by fsdp_train.py's MixedPrecisionPolicy. So the first step's forward is fsdp_train.py's, the same
    # bf16 kernels on the same numbers: its loss equal, and the evals of step 0 to a float32 sum's rounding (gathered
    # in fp32 under autocast, as the unsharded stages compute, the residual stream stayed fp32: 6e-6 off). After it
    # the tied embedding's gradient alone is rounded otherwise (fsdp_train.py adds its two uses in bf16, the
    # pipeline each in fp32, across its end stages): 2.8e-5 at most over these steps on the 2-core machine
    sharded = ['--pp_size=2', '--dp_shard=True', '--dtype=bfloat16']
    launch('pp_train.py', tmp_path, data_dir, 'full', *sharded, f'--max_iters={STEPS}', '--save_consolidated=True',
           nproc=4)
    losses, evals = read_metrics(tmp_path / 'full')
    theirs, their_evals = read_metrics(shared_run('fsdp_train.py', *BASE, f'--max_iters={STEPS}', '--dtype=bfloat16',
                                                  nproc=2))
    assert losses[0] == theirs[0]
    assert abs(evals[0]['val_loss'] - their_evals[0]['val_loss']) <= 1e-6 * their_evals[0]['val_loss']
    assert_same_curve(theirs, losses, range(STEPS), rel=1e-4)
    # the master weights stay fp32 (what checkpoints save), the tie's two copies bit-identical
    sd = torch.load(tmp_path / 'full' / 'ckpt.pt', map_location='cpu', weights_only=True)['model']
    assert {t.dtype for t in sd.values()} == {torch.float32}
    assert torch.equal(sd['lm_head.weight'], sd['transformer.wte.weight'])
    # AdamW stepped on each rank's own pieces (its first step through DTensor, which makes the state), stopped at
    # step 4 and resumed on the loaded state: bit for bit the plain step's run
    launch('pp_train.py', tmp_path, data_dir, 'split', *sharded, '--max_iters=4', '--adamw_on_shards=True', nproc=4)
    launch('pp_train.py', tmp_path, data_dir, 'split', *sharded, f'--max_iters={STEPS}', '--adamw_on_shards=True',
           '--init_from=resume', nproc=4)
    assert read_metrics(tmp_path / 'split')[0] == losses


def test_a_stages_forward_without_gradients_leaves_the_rng_as_it_was():
    """torch 2.11's schedules infer the shapes a stage sends by such a forward in their first step; with dropout it
    drew on the RNG, and the exact resume above failed there (a resume takes its first step later)."""
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=32, dropout=0.1))
    first, last = Part(gpt, [0], True, False), Part(gpt, [1], False, True)
    ids = torch.randint(0, 32, (2, 8))
    state = torch.get_rng_state()
    with torch.no_grad():
        x = first(ids)
        last(x)
    assert torch.equal(torch.get_rng_state(), state)
    a, b = first(ids), first(ids)  # a training forward draws its masks as before
    assert not torch.equal(a, b) and not torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize('first, second', [
    (('pp_train.py', 4, 4), ('pp_train.py', 4, 2)),    # pp 4 -> dp 2 x pp 2
    (('pp_train.py', 4, 4), ('fsdp_train.py', 2, 0)),  # pp 4 -> FSDP on 2 ranks
    (('fsdp_train.py', 2, 0), ('pp_train.py', 2, 2)),  # FSDP on 2 ranks -> pp 2
    (('train.py', 1, 0), ('pp_train.py', 2, 2)),  # train.py's ckpt.pt (as pp_train.py's consolidated one) -> pp 2
    (('pp_train.py', 4, 4), ('pp_train.py', 2, 2, 'zbv')),  # pp 4 -> zbv's V: its first rank takes both ends
    (('pp_train.py', 4, 4), ('pp_train.py', 4, 2, '1f1b', True)),  # pp 4 -> each stage sharded over 2 pipelines
    (('pp_train.py', 4, 2, 'interleaved-1f1b', True), ('pp_train.py', 2, 2)),  # and back: shards saved, whole read
], ids=['pp4-to-dp2xpp2', 'pp4-to-fsdp', 'fsdp-to-pp2', 'train-to-pp2', 'pp4-to-zbv', 'pp4-to-sharded',
        'sharded-to-pp2'])
def test_resume_at_another_layout_and_in_fsdp(tmp_path, data_dir, ref, shared_run, first, second):
    def layout(script, pp, schedule='1f1b', shard=False):
        return [f'--pp_size={pp}', f'--pp_schedule={schedule}'] + ['--dp_shard=True'] * shard \
            if script == 'pp_train.py' else []
    (script1, n1, *pp1), (script2, n2, *pp2) = first, second
    shutil.copytree(shared_run(script1, *BASE, '--max_iters=4', *layout(script1, *pp1), nproc=n1), tmp_path / 'run')
    launch(script2, tmp_path, data_dir, 'run', f'--max_iters={STEPS}', *layout(script2, *pp2), '--init_from=resume',
           nproc=n2)
    assert_same_curve(ref[1], read_metrics(tmp_path / 'run')[0], range(STEPS))


def test_model_size_gives_each_pipeline_rank_the_parameters_its_stages_hold(tmp_path):
    # model_size.py's arithmetic against pipeline.stage_memory, which counts the modules of the stages themselves
    shape = dict(SHAPE, bias=False)
    for pp, v, v_shape in ((2, 1, False), (4, 1, False), (2, 2, False), (4, 2, True)):  # zbv's two a rank in a V
        p = run('model_size.py', *[f'--{k}={x}' for k, x in shape.items()], f'--pp_size={pp}',
                f'--stages_per_rank={v}', *['--pp_schedule=zbv'] * v_shape, cwd=tmp_path)
        rows = json.loads(p.stdout.strip().splitlines()[-1])
        counted = stage_memory(GPTConfig(**shape), pp, v, v_shape)
        for r in range(pp):
            assert rows[f'PP {pp} rank {r}']['param_bytes'] == 4 * counted[r][0], (pp, v, r)
    # --dp_shard: each stage's state over the world size / pp pipelines
    p = run('model_size.py', *[f'--{k}={x}' for k, x in shape.items()], '--pp_size=2', '--world_size=8',
            '--dp_shard=True', cwd=tmp_path)
    rows = json.loads(p.stdout.strip().splitlines()[-1])
    counted = stage_memory(GPTConfig(**shape), 2)
    assert [rows[f'PP 2 rank {r}']['optim_bytes'] for r in range(2)] == [8 * counted[r][0] / 4 for r in range(2)]


def test_a_crashed_runs_snapshots_at_another_layout_are_refused_not_stranded(tmp_path, data_dir):
    """A pp 2 run SIGKILLed with its newest state in memory snapshots only (no checkpoint in out_dir yet), restarted
    at pp 1: it used to start afresh under a new run id, stranding the snapshots in /dev/shm. It is refused, with
    nothing written, and the layout that wrote them resumes them. At pp 2 with interleaved-1f1b (other stages on each
    rank) the error said to delete them: it names the flags that resume them."""
    out = tmp_path / 'run'
    args = [*TINY, *BASE, f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={out}', '--eval_interval=1000',
            '--save_memory_interval=2', '--max_iters=100000']
    # its 2 ranks forked as torchrun starts them (launcher.py), and the other one stopped as torchrun stops it
    started = start(str(REPO / 'pp_train.py'), [*args, '--pp_size=2'], env(), tmp_path, nproc=2)
    ranks = started[0]
    try:
        deadline = time.time() + 120
        while not (logged_iters(out) and logged_iters(out)[-1] >= 5):
            assert all(rank.exitcode is None for rank in ranks) and time.time() < deadline
            time.sleep(0.01)
        os.kill(ranks[0].pid, signal.SIGKILL)
        finish(started, timeout=60)
    finally:
        for rank in ranks:
            rank.kill()
    # the kill mid-round: one rank's snapshot of a step that the other's never reached (made so where it left none)
    files = [os.path.join(snapshot_dir((out / 'run_id').read_text().strip()), f'rank-{r}-of-1x2pp.pt') for r in (0, 1)]
    held = [torch.load(f, weights_only=True) for f in files]
    if held[0]['iter_num'] == held[1]['iter_num']:
        os.replace(files[1], previous(files[1]))
        torch.save({**held[1], 'iter_num': held[1]['iter_num'] + 1}, files[1])
    before = {f: f.read_bytes() for f in out.rglob('*') if f.is_file() and f.name != 'run.lock'}
    assert not (out / 'dcp').exists()
    # the refused runs stop before any step; the last one resumes and takes 2 steps past the newest snapshot
    bounded = [a for a in args if 'max_iters' not in a] + [f"--max_iters={max(h['iter_num'] for h in held) + 2}"]
    r = run('pp_train.py', *bounded, '--pp_size=1', nproc=2, cwd=tmp_path, check=False)
    assert "is the memory snapshot" in one_line_error(r, nproc=2) and 'of another layout' in r.stderr
    assert 'resume with the layout in its name (2 ranks and --pp_size=2) and let it save' in r.stderr  # not 1x2pp
    assert "of another layout lacks some ranks' of that step, cut short by a kill" in r.stdout  # not 'a node lost'
    from checkpoint import launch_of  # fsdp_train.py's DPxTP and decent_train.py's world size alike
    assert launch_of('2x2') == '4 ranks and --tp_size=2' and launch_of('4') == '4 ranks'
    assert launch_of('1x2x2pp') == '4 ranks and --pp_size=2 --tp_size=2'  # pp_train.py's with tensor parallel stages
    assert {f: f.read_bytes() for f in out.rglob('*') if f.is_file() and f.name != 'run.lock'} == before
    # an eval of it was told to start afresh, which evaluates a new model and keeps nothing in out_dir
    r = run('pp_train.py', *bounded, '--pp_size=1', '--eval_only=True', nproc=2, cwd=tmp_path, check=False)
    assert 'evaluate it with the layout in its name (2 ranks and --pp_size=2, the same flags)' in \
        one_line_error(r, nproc=2) and 'auto_resume' not in r.stderr
    assert {f: f.read_bytes() for f in out.rglob('*') if f.is_file() and f.name != 'run.lock'} == before
    # the same layout, with another schedule's stages on each rank: the snapshot's flags, never "delete it"
    r = run('pp_train.py', *bounded, '--pp_size=2', '--pp_schedule=interleaved-1f1b', nproc=2, cwd=tmp_path,
            check=False)
    assert "resume with these flags" in one_line_error(r, nproc=2) and 'delete' not in r.stderr
    assert "holds the stages that --pp_schedule=1f1b place on this rank" in r.stderr
    r = run('pp_train.py', *bounded, '--pp_size=2', '--dp_shard=True', nproc=2, cwd=tmp_path, check=False)  # shards
    assert one_line_error(r, nproc=2).endswith("--pp_schedule=1f1b --dp_shard=False place on this "
                                               "rank: resume with these flags, and let it save a checkpoint to "
                                               f"{out} (SIGTERM does) before changing them")
    r = run('pp_train.py', *bounded, '--pp_size=2', '--pp_schedule=interleaved-1f1b', '--eval_only=True', nproc=2,
            cwd=tmp_path, check=False)  # an eval of it was told to resume and save a checkpoint
    assert one_line_error(r, nproc=2).endswith("--pp_schedule=1f1b place on this rank: evaluate it "
                                               "with these flags")
    assert {f: f.read_bytes() for f in out.rglob('*') if f.is_file() and f.name != 'run.lock'} == before
    r = run('pp_train.py', *bounded, '--pp_size=2', nproc=2, cwd=tmp_path)
    assert int(re.search(r'resuming from \S+/nanogpt-\w+/\S+ at iter (\d+)', r.stdout)[1]) >= 4


def test_stages_per_rank_below_one_is_a_one_line_error(tmp_path, data_dir):
    # it was an IndexError in the stages' placement, after the process group had started
    p = launch('pp_train.py', tmp_path, data_dir, 'out', '--pp_schedule=interleaved-1f1b', '--stages_per_rank=0',
               check=False)
    assert one_line_error(p) == "error: stages_per_rank=0 must be 1 or more"


def test_a_rank_of_four_sharded_stages_keeps_them_gathered_on_train_pys_curve(tmp_path, data_dir, ref):
    # torch's plan keeps 3 of a rank's stages gathered, and let the first go (its FSDP root gathers the tied weight)
    # while the last still computed with it: a DTensor error in the head (it was refused). Now all stay gathered
    launch('pp_train.py', tmp_path, data_dir, 'pp', f'--max_iters={STEPS}', '--pp_size=1',
           '--pp_schedule=interleaved-1f1b', '--stages_per_rank=4', '--dp_shard=True')
    assert_same_curve(ref[1], read_metrics(tmp_path / 'pp')[0], range(STEPS))


@pytest.mark.parametrize('nproc, args, message', [
    # torch's ValueError traceback, after the process group had started
    (2, ['--pp_schedule=interleaved-1f1b', '--gradient_accumulation_steps=5'],
     "error: interleaved-1f1b does not run 5 micro-batches per pipeline (torch's runs them in 2 rounds of equal size): "
     "set --gradient_accumulation_steps=4 or --gradient_accumulation_steps=6, or use --pp_schedule=gpipe"),
    (4, ['--pp_schedule=interleaved-1f1b', '--gradient_accumulation_steps=10'],
     "error: interleaved-1f1b does not run 5 micro-batches per pipeline (torch's runs them in 2 rounds of equal size): "
     "set --gradient_accumulation_steps=8 or --gradient_accumulation_steps=12 (counted over the 2 pipelines), or use "
     "--pp_schedule=gpipe"),
    # it said "set gradient_accumulation_steps to 4 or more", and 5 does not divide over 2 pipelines; and
    # '1 micro-batches'
    (4, ['--pp_schedule=1f1b', '--gradient_accumulation_steps=2'],
     "error: 1f1b does not run 1 micro-batch per pipeline (it fills the pipeline before its first backward, so it "
     "needs at least pp_size=2): set --gradient_accumulation_steps=4 (counted over the 2 pipelines), or use "
     "--pp_schedule=gpipe"),
    # a traceback from torch (the backward of a compiled block cannot be split), after the group had started
    (2, ['--pp_schedule=interleaved-zb', '--compile=True'],
     "error: interleaved-zb computes a stage's input gradients and its weights' apart, which torch.compile'd blocks "
     "cannot: add --compile=False, or use --pp_schedule=interleaved-1f1b"),
    (2, ['--pp_schedule=zbv', '--compile=True'],
     "error: zbv computes a stage's input gradients and its weights' apart, which torch.compile'd blocks cannot: add "
     "--compile=False, or use --pp_schedule=interleaved-1f1b"),
    # DualPipeV's plan needs a micro-batch for each of its stages: torch's ValueError after the group had started
    (2, ['--pp_schedule=dualpipev', '--compile=False', '--gradient_accumulation_steps=2'],
     "error: dualpipev does not run 2 micro-batches per pipeline (it needs one for each of its 4 stages at least): set "
     "--gradient_accumulation_steps=4, or use --pp_schedule=gpipe"),
    # plain python: it said 'does not divide the world size 1', and not how to start 2 ranks
    (1, [], "error: pp_size=2 needs 2 processes (or a multiple), and plain python starts one process: launch with "
     "`torchrun --nproc_per_node=2 pp_train.py ...`"),
    # AdamW on the shards of plain stages: they have none
    (2, ['--adamw_on_shards=True'],
     "error: adamw_on_shards=True steps AdamW on the shards of dp_shard=True: add --dp_shard=True, or drop it"),
    # tensor parallel stages: over the ranks of a stage
    (2, ['--tp_size=2'], "error: tp_size=2 does not divide world size / pp_size = 1: use a divisor of it"),
    # TP stages take --dp_shard=True, and AdamW on its shards
    (2, ['--tp_size=2', '--adamw_on_shards=True'],
     "error: adamw_on_shards=True steps AdamW on the shards of dp_shard=True: add --dp_shard=True, or drop it"),
], ids=['interleaved-pp2', 'interleaved-dp2xpp2', '1f1b-dp2xpp2', 'zero-bubble-compiled', 'zbv-compiled',
        'dualpipev-micro-batches', 'plain-python', 'adamw-on-shards-unsharded', 'tp-world',
        'tp-adamw-on-shards'])
def test_micro_batches_a_schedule_cannot_run_are_a_one_line_error_naming_counts_it_runs(tmp_path, data_dir, nproc,
                                                                                        args, message):
    p = launch('pp_train.py', tmp_path, data_dir, 'out', '--pp_size=2', *args, nproc=nproc, check=False)
    assert one_line_error(p, nproc=nproc) == message
    assert set(p.stderr.splitlines()) == {message}  # every rank's, and nothing else
    assert not (tmp_path / 'out').exists()


def test_model_size_divides_sharded_tensor_parallel_stages_over_the_pipelines(tmp_path):
    # --dp_shard with --tp_size (8 ranks: dp 2 x pp 2 x tp 2): each rank's row of the TP stages over the 2 pipelines
    rows = [json.loads(run('model_size.py', *[f'--{k}={x}' for k, x in SHAPE.items()], '--pp_size=2', '--tp_size=2',
                           '--world_size=8', *shard, cwd=tmp_path).stdout.strip().splitlines()[-1])
            for shard in ([], ['--dp_shard=True'])]
    for r in range(2):
        whole, sharded = (row[f'PP 2 x TP 2 rank {r}'] for row in rows)
        halves = all(sharded[k] == whole[k] / 2 for k in ('param_bytes', 'grad_bytes', 'optim_bytes'))
        assert halves, (r, whole, sharded)
