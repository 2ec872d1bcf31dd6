"""pp_train.py in real process groups on gloo, in fp32: parity with train.py on one process (pp 2, pp 4, pp 2 x dp 2,
each schedule), the tied embedding, exact resume with dropout, resume at another layout and in fsdp_train.py."""

import shutil

import pytest
import torch

from conftest import TINY, read_metrics, run
from model import GPTConfig
from pipeline import stage_memory

# 8 blocks, so that pp 4 with two stages per rank has one block a stage; the global batch of test_fsdp.py
BASE = ['--n_layer=8', '--gradient_accumulation_steps=4', '--eval_interval=4', '--always_save_checkpoint=True']
STEPS = 6


def launch(script, tmp_path, data_dir, out, *extra, nproc=1):
    return run(script, *TINY, *BASE, f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={tmp_path / out}',
               *extra, nproc=nproc, cwd=tmp_path)


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


@pytest.mark.parametrize('nproc, pp, schedule', [
    (2, 2, 'gpipe'), (2, 2, '1f1b'), (2, 2, 'interleaved-1f1b'),
    (4, 4, 'gpipe'), (4, 4, '1f1b'), (4, 4, 'interleaved-1f1b'),
    (4, 2, 'gpipe'), (4, 2, '1f1b'), (4, 2, 'interleaved-1f1b'),
], ids=['pp2-gpipe', 'pp2-1f1b', 'pp2-interleaved', 'pp4-gpipe', 'pp4-1f1b', 'pp4-interleaved',
        'dp2xpp2-gpipe', 'dp2xpp2-1f1b', 'dp2xpp2-interleaved'])
def test_pipeline_matches_single_process(tmp_path, data_dir, ref, nproc, pp, schedule):
    launch('pp_train.py', tmp_path, data_dir, 'pp', f'--max_iters={STEPS}', f'--pp_size={pp}',
           f'--pp_schedule={schedule}', '--save_consolidated=True', nproc=nproc)
    losses, evals = read_metrics(tmp_path / 'pp')
    assert_same_curve(ref[1], losses, range(STEPS))
    # the evals go through the pipeline too
    assert [e['iter'] for e in evals] == [e['iter'] for e in ref[2]]
    for mine, theirs in zip(evals, ref[2]):
        assert abs(mine['val_loss'] - theirs['val_loss']) <= 1e-5 * theirs['val_loss']
    # the consolidated checkpoint: train.py's weights; its head is the last stage's copy of the tied weight and its
    # token embedding the first stage's, which their summed gradients keep bit-identical
    sd = torch.load(tmp_path / 'pp' / 'ckpt.pt', map_location='cpu', weights_only=True)['model']
    ours = torch.load(ref[0] / 'ckpt.pt', map_location='cpu', weights_only=True)['model']
    assert sd.keys() == ours.keys()
    for k in sd:
        assert (sd[k] - ours[k]).abs().max().item() < 1e-5, k
    assert torch.equal(sd['lm_head.weight'], sd['transformer.wte.weight'])
