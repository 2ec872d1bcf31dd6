"""DiLoCo in decent_train.py (--diloco_steps=H), in real process groups on gloo, in fp32: at H=1 with an outer SGD
step of learning rate 1 and no momentum it is the complete topology, in one fragment or several; a resume in the
middle of a window repeats the uninterrupted run bit for bit, with Streaming DiLoCo's outer step in flight too; at
another world size every replica starts from θ_global; Streaming DiLoCo's fragments take turns (the bytes of each
step) and an outer step in flight lands τ steps late, merged by α, or at once in the last eval and ckpt.pt of a run
that ends before it lands (with one copy of its buckets, bit for bit torch's step, no α); ckpt.pt holds θ_global and
goes through sample.py and export_hf.py; bad DiLoCo keys are one-line errors."""

import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import TINY, one_line_error, read_metrics, run
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves

from decent import Bucket, check_optimizers, fragment_of, global_model, make_outer, outer_state, restore_outer
from test_fault import killed_past


def launch(tmp_path, data_dir, out, *extra, nproc=1, check=True):
    return run('decent_train.py', *TINY, f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={tmp_path / out}',
               *extra, nproc=nproc, cwd=tmp_path, check=check)


def flat(state):
    """A model's state dict as one vector, each parameter once (lm_head.weight is the token embedding)."""
    return torch.cat([state[k].flatten().double() for k in sorted(state) if k != 'lm_head.weight'])


def load(path):
    return torch.load(path, map_location='cpu', weights_only=True)


def sent(out_dir):
    """{iter: the bytes of pseudo-gradient that rank 0 put into all-reduces after that step} from metrics.jsonl."""
    rows = [json.loads(line) for line in open(out_dir / 'metrics.jsonl')]
    return {r['iter']: r['outer_bytes'] for r in rows if 'outer_bytes' in r}


def test_one_step_windows_with_outer_sgd_at_lr_1_are_the_complete_topology(tmp_path, data_dir):
    # θ_global - mean(θ_global - θ_i) = mean(θ_i): the outer step lands on the replicas' average, which is what
    # complete mixing gives after every step; the inner AdamW and its moments are each rank's own either way. With
    # one-step windows every fragment of Streaming DiLoCo takes its outer step after every step as well
    args = ['--gradient_accumulation_steps=4', '--max_iters=10', '--eval_interval=10']
    launch(tmp_path, data_dir, 'complete', *args, '--topology=complete', nproc=2)
    outer = ['--diloco_steps=1', '--outer_optimizer=sgd', '--outer_learning_rate=1', '--outer_momentum=0']
    says = [launch(tmp_path, data_dir, 'diloco', *args, *outer, nproc=2).stdout,
            launch(tmp_path, data_dir, 'streaming', *args, *outer, '--diloco_fragments=3', nproc=2).stdout]
    # the counts in its words: one fragment is the whole model, and one step is singular
    assert "an outer sgd step every 1 step on the whole model, landing 0 steps later" in says[0]
    assert "an outer sgd step every 1 step on each of 3 fragments, landing 0 steps later" in says[1]
    ref, ref_evals = read_metrics(tmp_path / 'complete')
    assert sorted(ref) == list(range(10)) and ref[9] < ref[0] - 0.3
    for run_ in ('diloco', 'streaming'):
        ours, our_evals = read_metrics(tmp_path / run_)
        assert sorted(ours) == list(range(10))
        for i in range(10):
            assert abs(ref[i] - ours[i]) <= 1e-5 * ref[i], (run_, i, ref[i], ours[i])
        assert abs(ref_evals[-1]['val_loss'] - our_evals[-1]['val_loss']) <= 1e-5 * ref_evals[-1]['val_loss']
        assert our_evals[-1]['consensus_distance'] < 1e-7  # the window just ended: every replica is θ_global
        export = flat(load(tmp_path / run_ / 'ckpt.pt')['model'])
        assert (export - flat(load(tmp_path / 'complete' / 'ckpt.pt')['model'])).abs().max() < 1e-5


ARGS = ['--diloco_steps=3', '--dropout=0.1', '--grad_clip=0.0', '--gradient_accumulation_steps=2', '--eval_interval=4']


@pytest.fixture(scope='module')
def windows(tmp_path_factory, data_dir):
    """2 ranks, windows of 3 steps (outer Nesterov steps after steps 2 and 5), 8 steps at once and in two runs
    split at iter 4, in the middle of the second window."""
    return full_and_split(tmp_path_factory.mktemp('diloco'), data_dir, ARGS)


def assert_split_is_full(tmp):
    (full, full_evals), (split, split_evals) = read_metrics(tmp / 'full'), read_metrics(tmp / 'split')
    assert sorted(split) == list(range(8)) and full[7] < full[0] - 0.1
    assert [split[i] for i in range(8)] == [full[i] for i in range(8)]  # bit for bit
    assert [e['val_loss'] for e in split_evals] == [e['val_loss'] for e in full_evals]


def full_and_split(tmp, data_dir, args):
    """8 steps on 2 ranks at once ('full'), and in two runs split at iter 4 ('split'; 'at4' keeps the first)."""
    launch(tmp, data_dir, 'full', *args, '--max_iters=8', nproc=2)
    launch(tmp, data_dir, 'split', *args, '--max_iters=4', nproc=2)
    shutil.copytree(tmp / 'split', tmp / 'at4')
    launch(tmp, data_dir, 'split', *args, '--max_iters=8', '--init_from=resume', nproc=2)
    return tmp


def test_resume_in_the_middle_of_a_window_repeats_the_uninterrupted_run_exactly(windows):
    assert_split_is_full(windows)
    # at iter 4 the replicas had left θ_global (a step into the window): the resume had to restore all three
    saved = [load(windows / 'at4' / 'decent' / 'step-00000004' / f'rank-{r}.pt') for r in range(2)]
    outer = torch.cat([t.double() for t in saved[0]['diloco']['outer']])
    assert all(torch.equal(o, p) for o, p in zip(saved[0]['diloco']['outer'], saved[1]['diloco']['outer']))
    replicas = [torch.cat([p.flatten().double() for p in s['model'].values()]) for s in saved]
    assert (replicas[0] - replicas[1]).abs().max() > 1e-5
    assert saved[0]['diloco']['outer_optimizers'][0]['state'][0]['momentum_buffer'].abs().max() > 0
    for r in range(2):
        last = f'decent/step-00000008/rank-{r}.pt'
        a, b = load(windows / 'full' / last), load(windows / 'split' / last)
        assert torch.equal(flat(a['model']), flat(b['model']))
        assert all(torch.equal(x, y) for x, y in zip(a['diloco']['outer'], b['diloco']['outer']))
    assert outer.abs().max() > 0


def test_at_another_world_size_every_replica_starts_from_the_global_model(tmp_path, data_dir, windows):
    # the 2-rank checkpoint at iter 4 (mid-window) resumed on one rank with the inner learning rate at 0 and no
    # window ending (step 4 is the second of 3): the replica it saves at 5 is the one it started from
    shutil.copytree(windows / 'at4', tmp_path / 'run')
    p = launch(tmp_path, data_dir, 'run', *ARGS, '--max_iters=5', '--eval_interval=5', '--learning_rate=0',
               '--min_lr=0', '--init_from=resume')
    # it said 'from their average', where the replicas then start from θ_global
    assert "holds the replicas of 2 ranks, not 1: every rank starts from DiLoCo's global model θ_global" in p.stdout
    assert 'at iter 4' in p.stdout
    assert 'saving the global model θ_global to' in p.stdout  # it said 'the averaged model': ckpt.pt holds θ_global
    saved = [load(tmp_path / 'run' / 'decent' / 'step-00000004' / f'rank-{r}.pt') for r in range(2)]
    template = saved[0]['model']
    outer, sizes = torch.cat(saved[0]['diloco']['outer']), [t.numel() for t in saved[0]['diloco']['outer']]
    start = torch.cat([p.flatten() for p in load(tmp_path / 'run' / 'decent' / 'step-00000005' / 'rank-0.pt')
                       ['model'].values()])
    average = (torch.cat([p.flatten() for p in saved[0]['model'].values()]) +
               torch.cat([p.flatten() for p in saved[1]['model'].values()])) / 2
    assert (average - start).abs().max() > 1e-5  # not the replicas' average: θ_global, bucket by bucket
    # the buckets' order: the embeddings, tied head and final LayerNorm, then each block
    first = [k for k in template if not k.startswith('transformer.h.') and k != 'lm_head.weight']
    blocks = [[k for k in template if k.startswith(f'transformer.h.{i}.')] for i in range(2)]
    model = load(tmp_path / 'run' / 'decent' / 'step-00000005' / 'rank-0.pt')['model']
    for keys, bucket in zip([first, *blocks], outer.split(sizes)):
        assert torch.equal(torch.cat([model[k].flatten() for k in keys]), bucket)


def test_a_diloco_run_resumed_without_diloco_steps_is_refused_and_kept(tmp_path, data_dir, windows):
    # it would go on as a gossip run, and its first eval would write the replicas' average over ckpt.pt's θ_global
    shutil.copytree(windows / 'at4', tmp_path / 'run')
    before = {f: f.read_bytes() for f in (tmp_path / 'run').rglob('*') if f.is_file() and f.name != 'run.lock'}
    p = launch(tmp_path, data_dir, 'run', *[a for a in ARGS if 'diloco' not in a], '--max_iters=8', check=False)
    assert one_line_error(p).endswith(f"holds a DiLoCo run (diloco_steps=3): resume with its --diloco_steps, or start "
                                      f"a gossip run from its global model with --init_from="
                                      f"{tmp_path / 'run' / 'ckpt.pt'} and another --out_dir")
    assert {f: f.read_bytes() for f in (tmp_path / 'run').rglob('*') if f.is_file() and f.name != 'run.lock'} == before
    shutil.rmtree(tmp_path / 'run' / 'decent')  # its step folders lost: ckpt.pt (θ_global, the outer momentum) resumes
    before = {f: f.read_bytes() for f in (tmp_path / 'run').rglob('*') if f.is_file() and f.name != 'run.lock'}
    p = launch(tmp_path, data_dir, 'run', *[a for a in ARGS if 'diloco' not in a], '--max_iters=8', check=False)
    assert 'holds a DiLoCo run (diloco_steps=3): resume with its --diloco_steps' in one_line_error(p)  # it went on
    assert {f: f.read_bytes() for f in (tmp_path / 'run').rglob('*') if f.is_file() and f.name != 'run.lock'} == before


def test_an_eval_of_a_diloco_run_without_diloco_steps_names_the_flag_that_evaluates_it(tmp_path, data_dir, windows):
    # it was told to resume with its --diloco_steps (or --replica_optimizer) or to start a gossip run elsewhere:
    # neither is an eval
    shutil.copytree(windows / 'at4', tmp_path / 'run')
    before = {f: f.read_bytes() for f in (tmp_path / 'run').rglob('*') if f.is_file() and f.name != 'run.lock'}
    gossip = [a for a in ARGS if 'diloco' not in a]
    p = launch(tmp_path, data_dir, 'run', *gossip, '--max_iters=8', '--eval_only=True', check=False)
    assert one_line_error(p) == (f"error: {tmp_path / 'run' / 'decent' / 'step-00000004'} holds a DiLoCo run "
                                 f"(diloco_steps=3): evaluate it with --diloco_steps=3 (the eval is then of its global "
                                 f"model)")
    assert {f: f.read_bytes() for f in (tmp_path / 'run').rglob('*') if f.is_file() and f.name != 'run.lock'} == before
    p = launch(tmp_path, data_dir, 'run', *ARGS, '--replica_optimizer=sgd', '--max_iters=8', '--eval_only=True',
               check=False)
    assert one_line_error(p).endswith("holds the state of replica_optimizer=adamw: evaluate it with "
                                      "--replica_optimizer=adamw")
    p = launch(tmp_path, data_dir, 'run', *gossip, '--diloco_steps=3', '--max_iters=8', '--eval_only=True')
    assert 'eval_only: evaluating the newest state of the run' in p.stdout and 'at iter 4' in p.stdout


def test_a_resume_without_n_layer_checks_diloco_fragments_against_the_checkpoints_depth(tmp_path, data_dir, windows):
    # the model's depth came from the checkpoint (2 blocks), and the fragments were checked against the default
    # n_layer=12: 5 fragments of 3 buckets went on as 3, each on a fifth of the window
    shutil.copytree(windows / 'at4', tmp_path / 'run')
    before = {f: f.read_bytes() for f in (tmp_path / 'run').rglob('*') if f.is_file() and f.name != 'run.lock'}
    p = run('decent_train.py', *[a for a in TINY if a != '--n_layer=2'], f'--dataset={data_dir / "shakespeare_char"}',
            f'--out_dir={tmp_path / "run"}', *ARGS, '--diloco_fragments=5', '--max_iters=8', cwd=tmp_path, check=False)
    assert one_line_error(p) == ("error: diloco_fragments=5: from 1 to the 3 buckets of the model (the embeddings, "
                                 "then each of its 2 blocks)")
    assert {f: f.read_bytes() for f in (tmp_path / 'run').rglob('*') if f.is_file() and f.name != 'run.lock'} == before


def test_a_diloco_memory_snapshot_resumed_without_diloco_steps_names_a_fix_that_works(tmp_path, data_dir):
    # a run SIGKILLed with its state in memory snapshots only: the refusal named --init_from=out_dir/ckpt.pt, which no
    # run had written yet (or, past a storage checkpoint, an older state than the snapshot's)
    out = tmp_path / 'run'
    args = [*TINY, f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={out}', *ARGS, '--eval_interval=1000',
            '--save_memory_interval=2']
    shm = killed_past('decent_train.py', *args, '--max_iters=100000', out_dir=out, iters=5, cwd=tmp_path)
    try:
        assert not (out / 'ckpt.pt').exists() and list(shm.glob('rank-0-of-1*.pt'))
        before = {f: f.read_bytes() for f in out.rglob('*') if f.is_file() and f.name != 'run.lock'}
        gossip = [a for a in args if not a.startswith('--diloco')]
        r = run('decent_train.py', *gossip, '--max_iters=8', cwd=tmp_path, check=False)
        assert one_line_error(r).endswith(f"holds a DiLoCo run (diloco_steps=3): resume with its --diloco_steps, or "
                                          f"once a resume has saved it to {out} (SIGTERM does) start a gossip run "
                                          f"from its global model with --init_from={out / 'ckpt.pt'} and another "
                                          f"--out_dir")
        assert {f: f.read_bytes() for f in out.rglob('*') if f.is_file() and f.name != 'run.lock'} == before
        # the fix it names: the resume saves ckpt.pt (at its end here), which starts the gossip run
        r = run('decent_train.py', *args, '--max_iters=8', cwd=tmp_path)
        assert 'resuming from ' + str(shm) in r.stdout and load(out / 'ckpt.pt')['iter_num'] == 8
        elsewhere = [a for a in gossip if not a.startswith('--out_dir')] + [f'--out_dir={tmp_path / "gossip"}']
        run('decent_train.py', *elsewhere, '--max_iters=9', f'--init_from={out / "ckpt.pt"}', cwd=tmp_path)
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_ckpt_pt_holds_the_global_model_for_sample_and_export(tmp_path, data_dir, windows):
    out = windows / 'full'
    export = load(out / 'ckpt.pt')
    rank0 = load(out / 'decent' / 'step-00000008' / 'rank-0.pt')
    assert export['iter_num'] == 8 and 'outer_optimizers' in export['diloco']
    # iter 8 is in the middle of a window: the replica has moved on from θ_global, the export has not
    model = rank0['model']
    first = [k for k in model if not k.startswith('transformer.h.') and k != 'lm_head.weight']
    blocks = [[k for k in model if k.startswith(f'transformer.h.{i}.')] for i in range(2)]
    for keys, bucket in zip([first, *blocks], rank0['diloco']['outer']):
        assert torch.equal(torch.cat([export['model'][k].flatten() for k in keys]), bucket)
        assert not torch.equal(torch.cat([model[k].flatten() for k in keys]), bucket)
    s = run('sample.py', f'--out_dir={out}', f'--meta_path={data_dir / "shakespeare_char" / "meta.pkl"}',
            '--num_samples=2', '--max_new_tokens=20', '--device=cpu', cwd=tmp_path)
    assert s.stdout.count('---------------') == 2
    # a rank's own file is its replica: the tool says so, and where the global model is
    replica = out / 'decent' / 'step-00000008' / 'rank-0.pt'
    s = run('sample.py', f'--init_from={replica}', f'--meta_path={data_dir / "shakespeare_char" / "meta.pkl"}',
            '--num_samples=1', '--max_new_tokens=5', '--device=cpu', cwd=tmp_path)
    assert f"note: {replica} is one rank's own replica, not the run's model, which is DiLoCo's global model" in s.stderr
    run('export_hf.py', f'--ckpt={out}', f'--out={tmp_path / "hf"}', cwd=tmp_path)
    hf = load_file(tmp_path / 'hf' / 'model.safetensors')
    assert torch.equal(hf['transformer.wte.weight'], export['model']['transformer.wte.weight'])


@pytest.mark.parametrize('flags, message', [
    ('--diloco_steps=-1', 'diloco_steps=-1: give the inner steps per outer step, or 0 to mix every step'),
    ('--outer_optimizer=adam', "unknown outer_optimizer='adam': use nesterov or sgd"),
    ('--outer_momentum=0', 'above 0 for nesterov (or use outer_optimizer=sgd)'),
    ('--outer_learning_rate=0', 'outer_learning_rate=0.0 must be above 0'),
    ('--diloco_steps=4 --diloco_fragments=4', 'diloco_fragments=4: from 1 to the 3 buckets of the model'),
    ('--diloco_fragments=2', 'diloco_fragments and diloco_overlap take effect with diloco_steps > 0 only'),
    ('--diloco_steps=4 --diloco_overlap=4', 'diloco_overlap=4: from 0 to diloco_steps - 1 (3)'),
    ('--diloco_steps=4 --diloco_alpha=1.0', 'diloco_alpha=1.0: in [0, 1)'),
    # keys that would be ignored: a misspelt topology under DiLoCo, and DiLoCo's outer keys without it (a few steps:
    # the run that went on without a word ends)
    ('--diloco_steps=4 --topology=bogus --max_iters=2', "unknown topology='bogus', which diloco_steps=4 would not use "
     "anyway (DiLoCo averages over all ranks once a window): drop it, or use complete, ring, one-peer-exp, "
     "alternating-exp-ring for gossip"),
    ('--outer_learning_rate=0.5 --diloco_alpha=0.5 --max_iters=2',
     'diloco_alpha and outer_learning_rate take effect with diloco_steps > 0 only: give diloco_steps'),
])
def test_bad_diloco_keys_are_one_line_errors(tmp_path, data_dir, flags, message):
    assert message in one_line_error(launch(tmp_path, data_dir, 'bad', *flags.split(), check=False))
    assert not (tmp_path / 'bad').exists()


def test_a_known_topology_beside_diloco_steps_is_a_warning_and_the_run_goes_on(tmp_path, data_dir):
    # a config file's topology (config/decent-gpt2-small.toml's) with --diloco_steps given after it: a mistake to
    # point out, not a command to refuse
    p = launch(tmp_path, data_dir, 'run', '--topology=alternating-exp-ring', '--diloco_steps=2', '--max_iters=1')
    assert "warning: topology alternating-exp-ring is not used: DiLoCo averages over all ranks once a window (drop " \
           "--diloco_steps for gossip)" in p.stdout
    assert 'warning: topology' not in launch(tmp_path, data_dir, 'plain', '--diloco_steps=2', '--max_iters=1').stdout


def test_a_diloco_dtype_other_than_float32_or_bfloat16_or_without_diloco_steps_is_refused():
    # checked in process, as decent_train.py does before it starts the group (its launch: the cases above)
    keys = dict(replica_optimizer='adamw', moment_accum_steps=4, diloco_steps=4, outer_optimizer='nesterov',
                outer_learning_rate=0.7, outer_momentum=0.9, diloco_fragments=1, diloco_overlap=0, diloco_alpha=0.0)
    assert check_optimizers({**keys, 'diloco_dtype': 'bfloat16'}, 2) is None
    assert check_optimizers({**keys, 'diloco_dtype': 'float16'}, 2) == ("unknown diloco_dtype='float16': use float32 "
                                                                        "or bfloat16")
    assert check_optimizers({**keys, 'diloco_dtype': 'bfloat16', 'diloco_steps': 0}, 2) == (
        "diloco_dtype takes effect with diloco_steps > 0 only: give diloco_steps")


def test_fragments_are_contiguous_runs_of_buckets_of_near_equal_size():
    # GPT-2 124M: the embeddings (the tied head, wpe, ln_f) weigh 5.6 blocks; F=2 cuts after the third block, into
    # 60.7M and 63.7M parameters
    gpt2 = [50304 * 768 + 1024 * 768 + 768] + [12 * 768 * 768 + 2 * 768] * 12
    assert fragment_of(gpt2, 1) == [0] * 13
    assert fragment_of(gpt2, 2) == [0] * 4 + [1] * 9
    # the embeddings alone (39.4M, more than a quarter), then the blocks four by four (28.3M each)
    assert fragment_of(gpt2, 4) == [0] + [1] * 4 + [2] * 4 + [3] * 4
    assert fragment_of(gpt2, 13) == list(range(13))  # as many fragments as buckets: one each
    for f in range(1, 14):
        of = fragment_of(gpt2, f)
        assert of[0] == 0 and of[-1] == f - 1 and all(b - a in (0, 1) for a, b in zip(of, of[1:])), (f, of)
    assert fragment_of([3168, 12704, 12704], 2) == [0, 0, 1]  # the tiny test model's


# Streaming DiLoCo: 2 fragments of a 4-step window (the first after steps 3 and 7, the second after 1 and 5), each
# landing one step late (at 5 and 9, at 3 and 7) and merged half and half with the replica; the pseudo-gradients
# travel in bfloat16 (plain DiLoCo's above in float32)
STREAMING = ['--diloco_steps=4', '--diloco_fragments=2', '--diloco_overlap=1', '--diloco_alpha=0.5', '--dropout=0.1',
             '--grad_clip=0.0', '--gradient_accumulation_steps=2', '--eval_interval=4', '--diloco_dtype=bfloat16']


@pytest.fixture(scope='module')
def streaming(tmp_path_factory, data_dir):
    """2 ranks, 8 steps at once and in two runs split at iter 4, where the first fragment's outer step is in flight
    (its all-reduce started after step 3, in bfloat16; it lands before step 5)."""
    return full_and_split(tmp_path_factory.mktemp('streaming'), data_dir, STREAMING)


def test_streaming_resume_with_an_outer_step_in_flight_repeats_the_uninterrupted_run_exactly(streaming):
    assert_split_is_full(streaming)
    at4 = load(streaming / 'at4' / 'decent' / 'step-00000004' / 'rank-0.pt')['diloco']
    assert [p is not None for p in at4['pending']] == [True, True, False]  # the first fragment's, still to land
    # the first run ended there: its ckpt.pt took it landed, its step folder kept it in flight for the resume
    assert load(streaming / 'at4' / 'ckpt.pt')['diloco']['pending'] == [None] * 3
    assert at4['lands_at'][:2] == [5, 5] and at4['pending'][0].abs().max() > 0
    # the ranks' bfloat16 sum, saved in float32 (exactly: it lands the same after the resume)
    assert all(g.dtype == torch.float32 and torch.equal(g, g.bfloat16().float()) for g in at4['pending'][:2])
    for r in range(2):
        last = f'decent/step-00000008/rank-{r}.pt'
        a, b = load(streaming / 'full' / last), load(streaming / 'split' / last)
        assert torch.equal(flat(a['model']), flat(b['model']))
        assert all(torch.equal(x, y) for x, y in zip(a['diloco']['outer'], b['diloco']['outer']))


def test_a_sigkilled_streaming_run_resumes_from_its_memory_snapshot_with_an_outer_step_in_flight_exactly(tmp_path,
                                                                                                        data_dir):
    # one rank, a snapshot every 2 steps: each holds one fragment's outer step in flight (its window ended after step
    # 3 or 1 of the 4, it lands 1 step later), which the resume has to land on time
    args = [*TINY, f'--dataset={data_dir / "shakespeare_char"}', *STREAMING, '--save_memory_interval=2',
            '--eval_interval=1000']  # no checkpoint in out_dir before the kill
    run('decent_train.py', *args, f'--out_dir={tmp_path / "full"}', '--max_iters=12', cwd=tmp_path)
    out = tmp_path / 'ft'
    shm = killed_past('decent_train.py', *args, f'--out_dir={out}', '--max_iters=100000', out_dir=out, iters=7,
                      cwd=tmp_path)
    try:
        held = load(shm / 'rank-0-of-1.pt')['diloco']
        assert sum(g is not None for g in held['pending']) in (1, 2) and not (out / 'decent').exists()
        r = run('decent_train.py', *args, f'--out_dir={out}', '--max_iters=12', cwd=tmp_path)
        assert 'resuming from ' + str(shm) in r.stdout
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    (full, full_evals), (ft, ft_evals) = read_metrics(tmp_path / 'full'), read_metrics(out)
    assert sorted(ft) == list(range(12)) and [ft[i] for i in range(12)] == [full[i] for i in range(12)]
    assert ft_evals[-1]['val_loss'] == full_evals[-1]['val_loss']
    a, b = load(tmp_path / 'full' / 'ckpt.pt'), load(out / 'ckpt.pt')
    assert torch.equal(flat(a['model']), flat(b['model'])) and a['iter_num'] == b['iter_num'] == 12


def test_streaming_fragments_take_turns_with_the_same_bytes_per_window(streaming, windows):
    # bf16 pseudo-gradients, 2 bytes a parameter: the embeddings and the first block make the first fragment, the
    # second block the second
    saved = load(streaming / 'full' / 'decent' / 'step-00000008' / 'rank-0.pt')['diloco']
    sizes = [t.numel() * 2 for t in saved['outer']]
    first, second, model = sizes[0] + sizes[1], sizes[2], sum(sizes)
    streamed = sent(streaming / 'full')
    assert streamed == {0: 0, 1: second, 2: 0, 3: first, 4: 0, 5: second, 6: 0, 7: first}
    # plain DiLoCo (windows of 3, fp32: twice the bytes) sends the whole model at each window's end: the same
    # parameters per window, all at once
    assert sent(windows / 'full') == {0: 0, 1: 0, 2: 2 * model, 3: 0, 4: 0, 5: 2 * model, 6: 0, 7: 0}
    assert max(streamed.values()) < 0.6 * model and sum(streamed.values()) == 2 * model


def test_a_run_that_ends_with_an_outer_step_in_flight_lands_it_in_its_last_eval_and_export(tmp_path, data_dir,
                                                                                           streaming):
    # the fixture's 8 steps end with the first fragment's last outer step in flight (its window ended after step 7,
    # it lands at 9): the step folder keeps it so, for a longer run to land on time, and the last eval and ckpt.pt
    # take it as it lands (no inner step moves θ_global meanwhile), where they used to leave it out
    full = streaming / 'full'
    saved = load(full / 'decent' / 'step-00000008' / 'rank-0.pt')['diloco']
    assert [p is not None for p in saved['pending']] == [True, True, False] and saved['lands_at'][:2] == [9, 9]
    export = load(full / 'ckpt.pt')
    model = export['model']
    first = [k for k in model if not k.startswith('transformer.h.') and k != 'lm_head.weight']
    blocks = [[k for k in model if k.startswith(f'transformer.h.{i}.')] for i in range(2)]
    # at iter 8, with the data position and the replicas' moments of 8, and the outer state past that step: a resume
    # from ckpt.pt alone (its step folders lost) does not take it again
    assert export['iter_num'] == 8 and export['diloco']['pending'] == [None] * 3
    for i, keys in enumerate([first, *blocks]):
        old, g, state = saved['outer'][i], saved['pending'][i], saved['outer_optimizers'][i]
        landed = old.clone()
        if g is not None:  # the saved outer step replayed: Nesterov SGD (lr 0.7, momentum 0.9) on the saved state
            outer = torch.optim.SGD([landed], lr=0.7, momentum=0.9, nesterov=True)
            outer.load_state_dict(state)
            landed.grad = g
            outer.step()
            state = outer.state_dict()
            assert (landed - old).abs().max() > 1e-4
        assert torch.equal(torch.cat([model[k].flatten() for k in keys]), landed)
        momentum = export['diloco']['outer_optimizers'][i]['state'][0]['momentum_buffer']
        assert torch.equal(momentum, state['state'][0]['momentum_buffer'])
    # the same run resumed from its step folder for τ = 1 more step lands it on time: its last eval and export are
    # the same, bit for bit (the second fragment's θ_global waits for its window ending after step 9)
    shutil.copytree(full, tmp_path / 'run')
    launch(tmp_path, data_dir, 'run', *STREAMING, '--max_iters=9', '--init_from=resume', nproc=2)
    longer = load(tmp_path / 'run' / 'ckpt.pt')
    assert longer['iter_num'] == 9 and longer['diloco']['pending'] == [None] * 3
    assert torch.equal(flat(longer['model']), flat(model))
    assert all(torch.equal(a['state'][0]['momentum_buffer'], b['state'][0]['momentum_buffer'])
               for a, b in zip(longer['diloco']['outer_optimizers'], export['diloco']['outer_optimizers']))
    evals, longer_evals = read_metrics(full)[1], read_metrics(tmp_path / 'run')[1]
    assert longer_evals[-1]['iter'] == 9 and longer_evals[-1]['val_loss'] == evals[-1]['val_loss']
    assert longer_evals[-2]['iter'] == 8 and longer_evals[-2]['val_loss'] != evals[-1]['val_loss']  # in flight


class Allocations(TorchDispatchMode):
    """The bytes of the new tensors that the ops run inside it return (not views, not ones written in place)."""
    bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if torch.is_tensor(t)}
        self.bytes += sum(t.untyped_storage().nbytes() for t in tree_leaves(out) if torch.is_tensor(t)
                          and t.untyped_storage().data_ptr() not in given)
        return out


def same(a, b):
    """Whether two optimizer states are equal, bit for bit."""
    (x, tree), (y, other) = tree_flatten(a), tree_flatten(b)
    return tree == other and all(torch.equal(u, v) if torch.is_tensor(u) else u == v for u, v in zip(x, y))


@pytest.mark.parametrize('optimizer, momentum', [('nesterov', 0.9), ('sgd', 0.9), ('sgd', 0.0)])
def test_landing_the_outer_steps_in_flight_at_a_runs_end_takes_one_copy_of_their_buckets(optimizer, momentum):
    # the last eval and ckpt.pt take the outer steps in flight as they will land, while the step folder keeps them in
    # flight: a copy of each outer optimizer took θ_global, its gradient and its momentum (three copies of the buckets
    # in flight, of the whole model in plain DiLoCo). Now θ_global lands into the replica's place (put aside by then)
    # and only the momentum is new, bit for bit torch's step, with a momentum already or the first step's none
    torch.manual_seed(0)
    buckets = [Bucket([], torch.randn(n)) for n in (3000, 5000, 7000)]
    make_outer(buckets, 4, 1, optimizer, 0.7, momentum, 0.5, 'float32')
    # their single-tensor step on every device (not CUDA's foreach kernels), the ops that landed() takes, also where a
    # checkpoint from before saved foreach=None
    restore_outer(buckets, outer_state(buckets) | {'outer_optimizers': [{
        'state': {}, 'param_groups': [{**b.outer_optimizer.param_groups[0], 'foreach': None, 'params': [0]}]}
        for b in buckets]}, True, optimizer, 0.7, momentum)
    assert all(b.outer_optimizer.param_groups[0]['foreach'] is False for b in buckets)
    for i, bucket in enumerate(buckets):
        bucket.outer.normal_()
        if i == 1:  # a window before: a momentum to take up
            bucket.outer.grad = torch.randn_like(bucket.outer)
            bucket.outer_optimizer.step()
        bucket.outer.grad = torch.randn_like(bucket.outer) if i < 2 else None  # the last bucket's has landed
    in_flight = 4 * (3000 + 5000)
    saved = [(b.outer.clone(), b.outer.grad, copy.deepcopy(b.outer_optimizer.state_dict())) for b in buckets]
    own = [b.flat.clone() for b in buckets]
    with Allocations() as new:
        assert global_model(buckets, land=True, own=own) is own
    assert new.bytes == in_flight * (momentum > 0)  # each bucket's momentum, given back before the next's
    with Allocations() as new:
        export = outer_state(buckets, land=True)
    assert new.bytes == in_flight * (momentum > 0)
    assert export['pending'] == [None] * 3 and 'outer' not in export
    for bucket, (outer, g, state), mine in zip(buckets, saved, export['outer_optimizers']):
        steps = copy.deepcopy(bucket.outer_optimizer)  # what wait_for will do when the step lands
        if g is not None:
            steps.step()
        assert torch.equal(bucket.flat, steps.param_groups[0]['params'][0])
        assert same(mine, steps.state_dict())
        # and the outer state itself is the one still in flight
        assert torch.equal(bucket.outer, outer) and bucket.outer.grad is g
        assert same(bucket.outer_optimizer.state_dict(), state)


def test_an_outer_step_in_flight_lands_late_merged_with_the_replica(tmp_path, data_dir, streaming):
    # the 2-rank checkpoint at iter 4 resumed on one rank with the inner learning rate at 0: the replica starts from
    # θ_global and stays there, the first fragment's outer step (Nesterov, on the saved mean pseudo-gradient) lands
    # at iter 5, and the replica's fragment becomes the mean of its own and the new θ_global (alpha 0.5). The run
    # sent its pseudo-gradients in bfloat16 and resumes in float32, as a resume may change any DiLoCo key: the one
    # that was in flight lands as it was saved
    shutil.copytree(streaming / 'at4', tmp_path / 'run')
    p = launch(tmp_path, data_dir, 'run', *STREAMING, '--max_iters=5', '--eval_interval=5', '--learning_rate=0',
               '--min_lr=0', '--init_from=resume', '--diloco_dtype=float32')
    assert 'pseudo-gradients sent in float32' in p.stdout
    assert 'holds the replicas of 2 ranks, not 1' in p.stdout
    before = load(tmp_path / 'run' / 'decent' / 'step-00000004' / 'rank-0.pt')['diloco']
    after = load(tmp_path / 'run' / 'decent' / 'step-00000005' / 'rank-0.pt')
    sizes, model = [t.numel() for t in before['outer']], after['model']
    first = [k for k in model if not k.startswith('transformer.h.') and k != 'lm_head.weight']
    blocks = [[k for k in model if k.startswith(f'transformer.h.{i}.')] for i in range(2)]
    for i, keys in enumerate([first, *blocks]):
        old, new, mine = before['outer'][i], after['diloco']['outer'][i], torch.cat([model[k].flatten() for k in keys])
        assert mine.numel() == sizes[i]
        if i == 2:  # the second fragment: nothing in flight, θ_global unmoved and the replica on it
            assert torch.equal(new, old) and torch.equal(mine, old) and after['diloco']['pending'][i] is None
            continue
        g = before['pending'][i]
        buf = before['outer_optimizers'][i]['state'].get(0, {}).get('momentum_buffer')
        buf = g if buf is None else 0.9 * buf + g  # SGD's first step takes the gradient as the momentum
        expected = old - 0.7 * (g + 0.9 * buf)  # Nesterov
        assert (new - expected).abs().max() < 1e-6 and (new - old).abs().max() > 1e-4
        assert (mine - (old + new) / 2).abs().max() < 1e-6 and after['diloco']['pending'][i] is None


def test_an_outer_step_in_flight_lands_when_a_resume_with_another_window_ends_one_first(tmp_path, data_dir,
                                                                                        streaming):
    # at iter 4 the first fragment's outer step is in flight (it lands at 5); resumed with windows of 5, that
    # fragment's window ends after step 4, before it landed: the saved pseudo-gradient lands then, not dropped for
    # the new one (inner learning rate 0, one rank: the replica starts from θ_global and stays there)
    shutil.copytree(streaming / 'at4', tmp_path / 'run')
    args = [a for a in STREAMING if not a.startswith(('--diloco_steps', '--eval_interval'))]
    launch(tmp_path, data_dir, 'run', *args, '--diloco_steps=5', '--max_iters=5', '--eval_interval=5',
           '--learning_rate=0', '--min_lr=0', '--init_from=resume')
    before = load(tmp_path / 'run' / 'decent' / 'step-00000004' / 'rank-0.pt')['diloco']
    after = load(tmp_path / 'run' / 'decent' / 'step-00000005' / 'rank-0.pt')['diloco']
    for i in (0, 1):  # the first fragment's buckets: θ_global took the saved Nesterov step
        old, g = before['outer'][i], before['pending'][i]
        buf = before['outer_optimizers'][i]['state'].get(0, {}).get('momentum_buffer')
        buf = g if buf is None else 0.9 * buf + g
        assert (after['outer'][i] - (old - 0.7 * (g + 0.9 * buf))).abs().max() < 1e-6
        # and the new window's pseudo-gradient is in flight: the replica, merged half-way, against the new θ_global
        assert after['lands_at'][i] == 6 and after['pending'][i].abs().max() > 1e-5
    assert torch.equal(after['outer'][2], before['outer'][2])  # the second fragment had nothing in flight
