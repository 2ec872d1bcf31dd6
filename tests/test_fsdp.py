"""fsdp_train.py in real process groups on gloo, in fp32: parity with train.py on one process (FSDP, TP, 2-D),
exact resume, resume at another world size and mesh, interop with train.py's checkpoints, memory, bad input."""

import json
import shutil

import pytest
import torch

from conftest import REPO, TINY, counts_tokens, one_line_error, read_metrics, run

# the same global batch everywhere: 4 micro-steps of 4 sequences, shared out over the data-parallel ranks
BASE = ['--gradient_accumulation_steps=4', '--eval_interval=5', '--always_save_checkpoint=True']


def launch(script, tmp_path, data_dir, out, *extra, nproc=1, check=True):
    return run(script, *TINY, *BASE, f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={tmp_path / out}',
               *extra, nproc=nproc, cwd=tmp_path, check=check)


def assert_same_curve(a, b, iters, rel=1e-5):
    assert all(i in a and i in b for i in iters), (sorted(a), sorted(b))
    for i in iters:
        assert abs(a[i] - b[i]) <= rel * abs(a[i]), (i, a[i], b[i])


def assert_same_weights(a, b, atol=1e-5):
    wa = torch.load(a, map_location='cpu', weights_only=True)['model']
    wb = torch.load(b, map_location='cpu', weights_only=True)['model']
    assert wa.keys() == wb.keys()
    for k in wa:  # absolute: c_k's bias gets no gradient and holds only rounding noise that Adam scales up
        assert (wa[k] - wb[k]).abs().max().item() < atol, k


@pytest.fixture(scope='module')
def ref(shared_run):
    """train.py on one process, 10 steps: the curve every parallel layout must reproduce (test_ds.py's too)."""
    out = shared_run('train.py', *BASE, '--max_iters=10')
    losses, evals = read_metrics(out)
    assert losses[9] < losses[0] - 0.3  # it learns
    return out, losses


@pytest.fixture(scope='module')
def fsdp2(tmp_path_factory, data_dir):
    tmp = tmp_path_factory.mktemp('fsdp2')
    launch('fsdp_train.py', tmp, data_dir, 'run', '--max_iters=10', '--save_consolidated=True', nproc=2)
    return tmp / 'run', read_metrics(tmp / 'run')[0]


def test_fsdp_two_ranks_match_single_process(ref, fsdp2):
    assert_same_curve(ref[1], fsdp2[1], range(10))
    assert_same_weights(ref[0] / 'ckpt.pt', fsdp2[0] / 'ckpt.pt')  # the consolidated export
    assert (fsdp2[0] / 'dcp' / 'latest').read_text() == 'step-00000010'
    # begun by the run's id (mark_run): a save killed while extra.pt was written left no file that told the run
    assert (fsdp2[0] / 'dcp' / 'step-00000010' / 'run_id').read_text() == (fsdp2[0] / 'run_id').read_text().strip()


@pytest.mark.parametrize('nproc, tp', [(2, 2), (4, 2)], ids=['tp2', 'dp2xtp2'])
def test_tensor_parallel_matches_single_process(tmp_path, data_dir, ref, nproc, tp):
    p = launch('fsdp_train.py', tmp_path, data_dir, 'tp', '--max_iters=10', f'--tp_size={tp}',
               '--save_consolidated=True', nproc=nproc)
    assert_same_curve(ref[1], read_metrics(tmp_path / 'tp')[0], range(10))
    # the gradients' norm summed over both dimensions of the mesh in one all-reduce: DTensor ran one per dimension,
    # and every rank warned of it
    assert 'sequential all_reduce' not in p.stderr
    assert_same_weights(ref[0] / 'ckpt.pt', tmp_path / 'tp' / 'ckpt.pt')


TP_DROPOUT = """
import json, sys
sys.path.insert(0, {repo!r})
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint
from distributed import finish
from model import Block, GPTConfig
from distributed import restore_rng
from sharded import tensor_parallel
dist.init_process_group('gloo')
torch.manual_seed(0)
block = Block(GPTConfig(n_head=2, n_embd=16, dropout=0.5))
with torch.no_grad():  # both heads the same: a tp rank's head differs from the other's by its dropout mask alone
    for linear in (block.attn.c_q, block.attn.c_k, block.attn.c_v):
        linear.weight[8:] = linear.weight[:8]
        linear.bias[8:] = linear.bias[:8]
x = torch.randn(2, 8, 16)
mesh = init_device_mesh('cpu', (2,))
tensor_parallel(block, mesh)
heads = []
block.attn.c_proj.register_forward_pre_hook(lambda _, args: heads.append(args[0].detach()), prepend=True)
grads = []
for recompute in (False, True):  # activation checkpointing's recompute draws the same masks again
    torch.manual_seed(1)  # the same stream on both ranks, as the entrypoints seed a tp group
    out = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
    out.sum().backward()
    grads.append([getattr(p.grad, 'full_tensor', p.grad.clone)() for p in block.parameters()])
    block.zero_grad()
mine = dict(head=heads[0], out=out.detach(), rng=torch.get_rng_state(),
            recomputed=all(torch.equal(a, b) for a, b in zip(*grads)))
# a checkpoint of another layout, whose ranks 0 and 1 were two data-parallel ranks with streams of their own
restore_rng([{{'cpu': torch.Generator().manual_seed(r).get_state()}} for r in range(2)], tp_group=mesh.get_group())
mine['restored'] = torch.get_rng_state()
theirs = [None, None]
dist.all_gather_object(theirs, mine)
if dist.get_rank() == 0:
    a, b = theirs
    print(json.dumps(dict(heads=torch.equal(a['head'], b['head']), out=torch.equal(a['out'], b['out']),
                          rng=torch.equal(a['rng'], b['rng']), recomputed=a['recomputed'] and b['recomputed'],
                          restored=torch.equal(a['restored'], b['restored']))))
finish()
"""


def test_tensor_parallel_ranks_draw_their_heads_own_dropout_masks_and_share_the_replicated_ones(tmp_path):
    # a tp group's ranks run one stream for the activations that all of them hold (the residual dropouts after the
    # all-reduces): their masks must agree. Their heads' attention dropout (one head each, the same weights) draws
    # masks of its own on each rank, where one stream had given both heads the same; and the recompute of activation
    # checkpointing draws them again
    script = tmp_path / 'tp_dropout.py'
    script.write_text(TP_DROPOUT.format(repo=str(REPO)))
    got = json.loads(run(script, nproc=2, cwd=tmp_path).stdout.strip().splitlines()[-1])
    assert got['heads'] is False and got['out'] is True and got['rng'] is True and got['recomputed'] is True
    # a resume at another layout of the same world size: the tp group takes one stream again, its first rank's
    assert got['restored'] is True


def test_activation_checkpointing_gives_the_same_losses(tmp_path, data_dir, fsdp2):
    launch('fsdp_train.py', tmp_path, data_dir, 'ac', '--max_iters=10', '--activation_checkpointing=True', nproc=2)
    assert_same_curve(fsdp2[1], read_metrics(tmp_path / 'ac')[0], range(10), rel=1e-6)


def test_bf16_mixed_precision_with_cpu_offload_runs_and_learns(tmp_path, data_dir, ref):
    launch('fsdp_train.py', tmp_path, data_dir, 'mp', '--max_iters=10', '--dtype=bfloat16', '--cpu_offload=True',
           nproc=2)
    losses, _ = read_metrics(tmp_path / 'mp')
    assert losses[9] < losses[0] - 0.3
    assert all(abs(losses[i] - ref[1][i]) < 0.05 for i in range(10))  # bf16 matmuls: close, not equal


def test_fsdp_exact_resume(tmp_path, data_dir):
    # the RNG state has to come back too, on every rank: tensor parallel, each tp rank's heads with masks of their own
    args = ['--dropout=0.1', '--tp_size=2']
    launch('fsdp_train.py', tmp_path, data_dir, 'full', *args, '--max_iters=10', nproc=2)
    # resumed from its checkpoint of step 5, the newest there
    shutil.copytree(tmp_path / 'full', tmp_path / 'split')
    for f in [tmp_path / 'split' / 'metrics.jsonl', *(tmp_path / 'split' / 'dcp').glob('*-00000010')]:
        shutil.rmtree(f) if f.is_dir() else f.unlink()
    (tmp_path / 'split' / 'dcp' / 'latest').write_text('step-00000005')
    launch('fsdp_train.py', tmp_path, data_dir, 'split', *args, '--max_iters=10', '--init_from=resume', nproc=2)
    full, split = read_metrics(tmp_path / 'full')[0], read_metrics(tmp_path / 'split')[0]
    assert sorted(split) == list(range(5, 10))
    assert [split[i] for i in range(5, 10)] == [full[i] for i in range(5, 10)]  # bit for bit
    # another weight_decay and beta2 take effect: the sharded load had put the saved ones back (FSDP on both ranks)
    launch('fsdp_train.py', tmp_path, data_dir, 'split', '--dropout=0.1', '--max_iters=11', '--weight_decay=0.5',
           '--beta2=0.9', '--save_consolidated=True', nproc=2)
    saved = torch.load(tmp_path / 'split' / 'ckpt.pt', weights_only=True)
    groups = saved['optimizer']['param_groups']
    assert [(g['weight_decay'], tuple(g['betas'])) for g in groups] == [(0.5, (0.9, 0.9)), (0.0, (0.9, 0.9))]
    assert counts_tokens(saved) and counts_tokens(torch.load(tmp_path / 'split' / 'dcp' / 'step-00000011' / 'extra.pt',
                                                             weights_only=True))


def first_half(shared_run, nproc, tp):
    """fsdp_train.py stopped at iter 5, made once (shared_run): copy it before going on from it."""
    return shared_run('fsdp_train.py', *BASE, '--max_iters=5', f'--tp_size={tp}', nproc=nproc)


@pytest.mark.parametrize('first, second', [
    ((2, 1), (1, 1)),   # 2 ranks -> 1
    ((1, 1), (2, 1)),   # 1 -> 2
    ((4, 1), (4, 2)),   # 4 ranks FSDP -> 2x2 TP x FSDP
], ids=['2to1', '1to2', '4to2x2'])
def test_resume_at_another_world_size_and_mesh(tmp_path, data_dir, ref, shared_run, first, second):
    (n1, tp1), (n2, tp2) = first, second
    shutil.copytree(first_half(shared_run, n1, tp1), tmp_path / 'run')
    launch('fsdp_train.py', tmp_path, data_dir, 'run', '--max_iters=10', f'--tp_size={tp2}', '--init_from=resume',
           nproc=n2)
    assert_same_curve(ref[1], read_metrics(tmp_path / 'run')[0], range(10))


def test_blocks_grouped_into_fewer_units_give_the_same_curve_and_resume_a_run_of_one_block_a_unit(
        tmp_path, data_dir, ref, shared_run):
    # both of TINY's blocks in one unit, from a first half saved with a unit a block: the units are FSDP's
    # grouping of the same parameters, so the checkpoint and the curve are the same
    shutil.copytree(first_half(shared_run, 2, 1), tmp_path / 'run')
    log = launch('fsdp_train.py', tmp_path, data_dir, 'run', '--max_iters=10', '--blocks_per_unit=2',
                 '--init_from=resume', nproc=2)
    assert 'FSDP units: 1 of up to 2 blocks, and the root' in log.stdout
    assert_same_curve(ref[1], read_metrics(tmp_path / 'run')[0], range(10))


def test_adamw_stepped_on_each_ranks_shards_is_the_same_step(tmp_path, data_dir, shared_run, fsdp2):
    # the lever of the host's time: the fused AdamW on the local pieces, from the start (its first step makes the
    # state through DTensor as before) and on a resumed run's loaded state, bit for bit the step through DTensor
    launch('fsdp_train.py', tmp_path, data_dir, 'fresh', '--max_iters=10', '--adamw_on_shards=True', nproc=2)
    assert read_metrics(tmp_path / 'fresh')[0] == fsdp2[1]
    shutil.copytree(first_half(shared_run, 2, 1), tmp_path / 'run')
    launch('fsdp_train.py', tmp_path, data_dir, 'run', '--max_iters=10', '--adamw_on_shards=True',
           '--init_from=resume', nproc=2)
    assert read_metrics(tmp_path / 'run')[0] == fsdp2[1]


def test_adamw_on_shards_gives_a_parameter_its_state_at_its_first_gradient_as_the_optimizer_does():
    # a parameter without a gradient at the first step has no state after it; step_on_shards, which reads the
    # state, leaves the step that first gives it a gradient to optimizer.step(), which makes it (a KeyError before)
    from sharded import step_on_shards
    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 3) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.1, fused=True) for m in models]
    for i in range(3):
        for model, optimizer in zip(models, optimizers):
            model(torch.full((2, 4), i + 1.0)).square().sum().backward()
            if i == 0:
                model.bias.grad = None
            optimizer.step() if model is models[0] else step_on_shards(optimizer)
            optimizer.zero_grad(set_to_none=True)
    assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))


def test_train_checkpoint_into_fsdp_and_its_export_back_to_train_and_sample(tmp_path, data_dir, ref):
    # train.py writes ckpt.pt at step 5, fsdp_train.py continues it on 2 ranks (the data stream too), exports it
    launch('train.py', tmp_path, data_dir, 'run', '--max_iters=5')
    launch('fsdp_train.py', tmp_path, data_dir, 'run', '--max_iters=10', '--init_from=resume',
           '--save_consolidated=True', nproc=2)
    assert_same_curve(ref[1], read_metrics(tmp_path / 'run')[0], range(10))
    assert_same_weights(ref[0] / 'ckpt.pt', tmp_path / 'run' / 'ckpt.pt')
    # the export resumes under train.py (it holds the optimizer state by train.py's numbering) and samples
    shutil.rmtree(tmp_path / 'run' / 'dcp')
    launch('train.py', tmp_path, data_dir, 'run', '--max_iters=12', '--init_from=resume')
    losses = read_metrics(tmp_path / 'run')[0]
    assert sorted(losses) == list(range(12)) and losses[11] < losses[5]
    # the checkpoint names its dataset by a path, which sample.py does not follow: the vocabulary is given
    p = run('sample.py', f'--out_dir={tmp_path / "run"}', f'--meta_path={data_dir / "shakespeare_char" / "meta.pkl"}',
            '--num_samples=2', '--max_new_tokens=20', '--device=cpu', cwd=tmp_path)
    assert p.stdout.count('---------------') == 2


def test_a_tool_reads_the_newest_complete_step_folder_that_latest_does_not_name_yet(tmp_path, data_dir, shared_run):
    # a run killed after a step folder was complete (DCP wrote its .metadata) but before latest named it resumes from
    # that folder: a tool given the run folder said "no checkpoint at RUN/ckpt.pt" (none named yet), or read the
    # folder before it without a word. One cut short (no .metadata) is passed over
    from checkpoint import find_checkpoint
    run_dir = tmp_path / 'run'
    shutil.copytree(first_half(shared_run, 2, 1), run_dir)
    meta = f'--meta_path={data_dir / "shakespeare_char" / "meta.pkl"}'
    named = run('sample.py', f'--out_dir={run_dir}', meta, '--max_new_tokens=20', '--device=cpu', cwd=tmp_path)
    (run_dir / 'dcp' / 'latest').unlink()
    shutil.copytree(run_dir / 'dcp' / 'step-00000005', run_dir / 'dcp' / 'step-00000009')
    (run_dir / 'dcp' / 'step-00000009' / '.metadata').unlink()
    p = run('sample.py', f'--out_dir={run_dir}', meta, '--max_new_tokens=20', '--device=cpu', cwd=tmp_path)
    assert p.stdout == named.stdout and p.stderr == ''
    shutil.copytree(run_dir / 'dcp' / 'step-00000005', run_dir / 'dcp' / 'step-00000007')
    (run_dir / 'dcp' / 'latest').write_text('step-00000005')
    assert find_checkpoint(str(run_dir)) == str(run_dir / 'dcp' / 'step-00000007')


def test_a_tool_passes_over_a_step_folder_that_latest_names_but_is_not_whole_as_the_resume_does(tmp_path, data_dir,
                                                                                                   shared_run):
    # a save to the step that latest names, killed mid-write (or a shard cut short since): the resume goes on from
    # the newest complete folder before it, but a tool given the run folder read the one latest names and failed
    from checkpoint import find_checkpoint
    run_dir, dcp_dir = tmp_path / 'run', tmp_path / 'run' / 'dcp'
    shutil.copytree(first_half(shared_run, 2, 1), run_dir)
    meta = f'--meta_path={data_dir / "shakespeare_char" / "meta.pkl"}'
    sample = lambda: run('sample.py', f'--out_dir={run_dir}', meta, '--max_new_tokens=20', '--device=cpu',
                         cwd=tmp_path, check=False)
    before = sample()
    for step in ('step-00000007', 'step-00000009'):
        shutil.copytree(dcp_dir / 'step-00000005', dcp_dir / step)
    (dcp_dir / 'step-00000009' / '.metadata').unlink()
    (dcp_dir / 'latest').write_text('step-00000009')
    p = sample()
    assert p.returncode == 0 and p.stdout == before.stdout
    assert p.stderr.strip() == f"warning: passing over {dcp_dir / 'step-00000009'}, which {dcp_dir / 'latest'} " \
        f"names, as it is not whole (its save did not complete): reading {dcp_dir / 'step-00000007'}, the run's " \
        f"newest complete state, as its resume does"
    shard = next((dcp_dir / 'step-00000007').glob('*.distcp'))
    shard.write_bytes(shard.read_bytes()[:100])
    (dcp_dir / 'latest').write_text('step-00000007')
    assert find_checkpoint(str(run_dir)) == str(dcp_dir / 'step-00000005')
    (dcp_dir / 'step-00000005' / '.metadata').unlink()  # none whole: the error names the one latest names
    error = one_line_error(sample())
    assert error.startswith(f"error: checkpoint {dcp_dir / 'step-00000007'} is corrupt (ValueError: ") and \
        error.endswith("): move it aside (mv, to a name of your own) or restore a good copy"), error


def test_per_rank_state_with_two_ranks_is_at_most_0_6_of_one(shared_run, fsdp2):
    # one process without torchrun: fsdp_train.py makes its own group of one (the first half of the 1 -> 2 resume)
    one_process = first_half(shared_run, 1, 1)

    def total(out):
        with open(out / 'metrics.jsonl') as f:
            rows = [json.loads(line) for line in f]
        row = next(r for r in rows if 'param_bytes' in r)
        return row['param_bytes'] + row['grad_bytes'] + row['optim_bytes']
    one, two = total(one_process), total(fsdp2[0])
    assert one > 0 and two <= 0.6 * one, (one, two)


def test_bad_input(tmp_path, data_dir, fsdp2):
    def fails(*args, nproc=1):
        p = launch('fsdp_train.py', tmp_path, data_dir, 'bad', *args, nproc=nproc, check=False)
        return one_line_error(p, nproc)
    # under plain python it said 'does not divide the world size 1', and not how to start 2 ranks
    assert fails('--tp_size=2') == ('error: tp_size=2 needs 2 processes (or a multiple), and plain python starts '
                                    'one process: launch with `torchrun --nproc_per_node=2 fsdp_train.py ...`')
    assert 'tp_size=2 does not divide n_head=1' in fails('--tp_size=2', '--n_head=1', nproc=2)
    assert 'device=mps but this machine has no Apple GPU' in fails('--device=mps', '--cpu_offload=True')
    assert not (tmp_path / 'bad').exists()
    # a checkpoint of another shape
    msg = fails(f'--out_dir={fsdp2[0]}', '--init_from=resume', '--n_embd=64')
    assert "n_embd=64 contradicts the checkpoint's n_embd=32" in msg
