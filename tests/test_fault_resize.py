"""Runs resumed at another world size, or past a truncated newest checkpoint, continue the curve of the
uninterrupted run, in real processes: train.py, ds_train.py and decent_train.py from 2 ranks to 1 and from 1 to 2,
fsdp_train.py both ways past a truncated DCP checkpoint, and a truncated newest checkpoint in out_dir at the same
world size. No dropout, a storage checkpoint every 4 steps: each uninterrupted 12-step run and each first half (8
steps) is made once (shared_run), the reference or the starting point (copied) of every test that runs it."""

import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from conftest import read_metrics, run
from test_fault import KIND, assert_same_run, cut_short, tiny

RESUMED = ['--gradient_accumulation_steps=2', '--eval_interval=4', '--save_storage_interval=4']


def reference_and_first_half(shared_run, tmp_path, script, args, nproc):
    """The shared uninterrupted run of 12 steps, and a copy at tmp_path / 'ft' of the shared one stopped at iter 8,
    to go on from."""
    shutil.copytree(shared_run(script, *RESUMED, *args, '--max_iters=8', nproc=nproc), tmp_path / 'ft')
    return shared_run(script, *RESUMED, *args, '--max_iters=12', nproc=nproc)


# (script, world size and arguments of the first run, of the run that resumes it, what that one says it does).
# ds_train.py's engine checkpoints are cut for one world size and stage, so it goes on from its consolidated ckpt.pt
# (here also at another stage); decent_train.py's replicas do not reshard, so every rank starts from their average,
# which continues the curve where the algorithm does not depend on the world size: complete mixing with plain SGD.
DECENT_AS_DDP = ['--topology=complete', '--replica_optimizer=sgd', '--grad_clip=0.0', '--learning_rate=0.5',
                 '--min_lr=0.05']
RESHAPES = [('train.py', 2, [], 1, [], 'at iter 8'), ('train.py', 1, [], 2, [], 'at iter 8'),
            ('ds_train.py', 2, ['--zero_stage=3'], 1, ['--zero_stage=3'], 'continuing from the consolidated'),
            ('ds_train.py', 1, ['--zero_stage=2'], 2, ['--zero_stage=3'], 'continuing from the consolidated'),
            ('decent_train.py', 2, DECENT_AS_DDP, 1, DECENT_AS_DDP, 'every rank starts from their average'),
            ('decent_train.py', 1, DECENT_AS_DDP, 2, DECENT_AS_DDP,
             'holds the replica of 1 rank, not 2: every rank starts from their average')]


@pytest.mark.parametrize('script,first,first_args,then,then_args,says', RESHAPES)
def test_resumed_at_another_world_size_continues_the_curve(tmp_path, data_dir, shared_run, script, first, first_args,
                                                           then, then_args, says):
    ref_dir = reference_and_first_half(shared_run, tmp_path, script, first_args, first)
    eight = tmp_path / 'ft' / 'ds' / 'step-00000008'  # ds_train.py's first layout's newest folder
    first_eight = {f.name: f.read_bytes() for f in eight.iterdir()} if script == 'ds_train.py' else {}
    if script == 'ds_train.py' and first == 2:
        # a run whose best was at 4 (its val loss rose since), resumed at 8 on one rank and evaluated on other batches
        # (a new best at 8): the first layout's folder of that state is named best as it is, and best.pt holds it
        ds = eight.parent
        os.remove(ds.parent / 'best.pt')
        shutil.copy(ds.parent / 'ckpt.prev.pt', ds.parent / 'best.pt')
        shutil.rmtree(ds / 'best-step-00000008')
        shutil.copytree(ds / 'step-00000004', ds / 'best-step-00000004')
        (ds / 'best').write_text('best-step-00000004')
        p = run(script, *tiny(data_dir, tmp_path / 'ft', *RESUMED, *then_args, '--max_iters=8', '--eval_iters=2',
                              '--always_save_checkpoint=False'), cwd=tmp_path)
        assert 'saving consolidated checkpoint' in p.stdout, p.stdout  # a new best: always_save_checkpoint is off
        assert (ds / 'best').read_text() == 'best-step-00000008' and not (ds / 'best-step-00000004').exists()
        assert {f.name: f.read_bytes() for f in (ds / 'best-step-00000008').iterdir()} == first_eight
        assert torch.load(ds.parent / 'best.pt', weights_only=True)['iter_num'] == 8
    p = run(script, *tiny(data_dir, tmp_path / 'ft', *RESUMED, *then_args, '--max_iters=12'), nproc=then,
            cwd=tmp_path)
    assert 'auto-resume' in p.stdout and says in p.stdout and re.search(r'resuming from \S+ at iter 8\b', p.stdout)
    ref, ref_evals = read_metrics(ref_dir)
    ft, ft_evals = read_metrics(tmp_path / 'ft')
    assert sorted(ft) == list(range(12))
    for it in ref:
        assert abs(ft[it] - ref[it]) <= 1e-5 * abs(ref[it]), (it, ft[it], ref[it])
    assert abs(ft_evals[-1]['val_loss'] - ref_evals[-1]['val_loss']) <= 1e-5 * ref_evals[-1]['val_loss']
    if script == 'ds_train.py':  # the first layout's newest folder, whole, stays the fallback (keep_checkpoints=2)
        assert sorted(f.name for f in (tmp_path / 'ft' / 'ds').glob('step-*')) == ['step-00000008', 'step-00000012']
        # as it was: the resumed run's first eval (at 8, its step) saved that state again, and neither removed it to
        # write it anew (a failed write would have left latest naming a folder cut short) nor wrote files into it
        assert {f.name: f.read_bytes() for f in eight.iterdir()} == first_eight


@pytest.mark.parametrize('first,then', [(2, 1), (1, 2)])
def test_fsdp_resumed_at_another_world_size_past_a_truncated_checkpoint_continues_the_curve(tmp_path, data_dir,
                                                                                            shared_run, first, then):
    reference_and_first_half(shared_run, tmp_path, 'fsdp_train.py', [], first)
    # the reference is the run on one process: the curve that any world size has to continue
    ref_dir = shared_run('fsdp_train.py', *RESUMED, '--max_iters=12')
    newest = tmp_path / 'ft' / 'dcp' / 'step-00000008'
    assert (tmp_path / 'ft' / 'dcp' / 'step-00000004' / '.metadata').exists()  # the one before is kept
    shard = newest / '__0_0.distcp'
    cut_short(shard)
    p = run('fsdp_train.py', *tiny(data_dir, tmp_path / 'ft', *RESUMED, '--max_iters=12'), nproc=then, cwd=tmp_path)
    assert f'warning: skipping the damaged {newest} (ValueError: __0_0.distcp holds' in p.stdout, p.stdout[-3000:]
    assert 'auto-resume' in p.stdout and re.search(r'resuming from \S+/step-00000004 at iter 4\b', p.stdout)
    assert_same_run(ref_dir, tmp_path / 'ft')


# the file cut short in the newest storage checkpoint (iter 8) and what the run resumes from instead (iter 4):
# train.py's ckpt.pt and the ckpt.prev.pt kept beside it, renamed ckpt.pt once the damaged one is set aside as
# damaged-ckpt.pt (test_keep.py has why); a rank's file of ds_train.py's and decent_train.py's
# step folders (decent_train.py on two ranks: rank 0 checks the second rank's file too, and names the folder).
# ds_train.py names its default stage, as the test above does: the same runs, shared.
NEWEST = {'train.py': ('ckpt.pt', 'ckpt.pt'),
          'ds_train.py': ('ds/step-00000008/zero_pp_rank_0_mp_rank_00_optim_states.pt', 'ds/step-00000004'),
          'decent_train.py': ('decent/step-00000008/rank-1.pt', 'decent/step-00000004')}
STAGE = {'ds_train.py': ['--zero_stage=2']}


@pytest.mark.parametrize('script,nproc', [('train.py', 1), ('ds_train.py', 1), ('decent_train.py', 2)])
def test_a_truncated_newest_checkpoint_falls_back_to_the_one_before(tmp_path, data_dir, shared_run, script, nproc):
    args = [*RESUMED, *STAGE.get(script, [])]
    ref_dir = reference_and_first_half(shared_run, tmp_path, script, STAGE.get(script, []), nproc)
    damaged, before = NEWEST[script]
    cut_short(tmp_path / 'ft' / damaged)
    if script == 'ds_train.py':  # and its consolidated ckpt.pt of the same step, which it would resume from
        cut_short(tmp_path / 'ft' / 'ckpt.pt')
    p = run(script, *tiny(data_dir, tmp_path / 'ft', *args, '--max_iters=12'), nproc=nproc, cwd=tmp_path)
    newest = tmp_path / 'ft' / (damaged if script == 'train.py' else str(Path(damaged).parent))
    assert f'warning: skipping the damaged {newest} (' in p.stdout, p.stdout[-3000:]
    assert re.search(rf'resuming from \S+/ft/{before} at iter 4\b', p.stdout), p.stdout[-3000:]
    assert_same_run(ref_dir, tmp_path / 'ft', script, exact=script != 'ds_train.py')
    if script != 'train.py':  # step 8 written anew is the fallback now, not step 4
        assert sorted(f.name for f in (tmp_path / 'ft' / KIND[script]).glob('step-*')) == ['step-00000008',
                                                                                            'step-00000012']
