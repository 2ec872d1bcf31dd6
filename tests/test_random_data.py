"""random_data=True: synthetic tokens in every entrypoint and bench.py, no dataset read. The stream is a function of
the seed and the step (data.py's RandomTokens read at the offsets the entrypoints draw), so 2 ranks give the curve
of 1 rank in every mode, evals run on it, and a char-sized model is refused in one line."""

import json

import numpy as np
import pytest

from conftest import REPO, TINY, one_line_error, read_metrics, run

# nothing under data/: the runs happen in an empty folder, with a dataset that does not exist
ARGS = [*TINY, '--random_data=True', '--dataset=nowhere', '--gradient_accumulation_steps=4', '--max_iters=4',
        '--eval_interval=4', '--learning_rate=1e-2']
DECENT = ['--topology=complete', '--replica_optimizer=sgd', '--grad_clip=0.0', '--learning_rate=0.5']


def curve(tmp_path, script, nproc, *extra):
    out = tmp_path / f'{script[:-3]}-{nproc}'
    run(script, *ARGS, f'--out_dir={out}', *extra, nproc=nproc, cwd=tmp_path)
    return read_metrics(out)


def assert_same(a, b, rel=1e-5):
    (la, ea), (lb, eb) = a, b
    assert sorted(la) == sorted(lb) == list(range(4))
    assert all(abs(la[i] - lb[i]) <= rel * la[i] for i in range(4)), (la, lb)
    assert abs(ea[-1]['val_loss'] - eb[-1]['val_loss']) <= rel * ea[-1]['val_loss'], (ea, eb)


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
    return curve(tmp_path_factory.mktemp('random'), 'train.py', 1)


def test_random_data_is_gpt2_ids_and_the_same_from_any_reader():
    import sys
    sys.path.insert(0, str(REPO))
    from data import RandomTokens, find_bins, read_rows
    paths, n = find_bins('nowhere', 32, random_data=True)
    offsets = np.arange(1_000_000) * 1000
    ids = read_rows(paths['train'], offsets, 3)  # as the entrypoints read a batch
    assert ids.max() == RandomTokens.VOCAB - 1 and ids.min() == 0
    # about uniform over the vocabulary: each id 3e6 / 50257 ~ 60 times
    assert 50 < np.bincount(ids.ravel(), minlength=RandomTokens.VOCAB).mean() < 70
    index = offsets[:, None] + np.arange(3)
    assert RandomTokens('train')[index].dtype == np.uint16  # the .bin files' ids
    assert np.array_equal(RandomTokens('train')[index], ids)  # a function of the position alone
    assert (read_rows(paths['val'], offsets, 3) != ids).mean() > 0.99  # the splits differ
    assert n['train'] - 32 > 1 << 39


def test_train_py_on_two_ranks_matches_one_rank(tmp_path, reference):
    losses, evals = reference
    assert 10.0 < losses[0] < 11.5  # ln 50304 = 10.83: a uniform guess over the vocabulary
    assert_same(reference, curve(tmp_path, 'train.py', 2))


@pytest.mark.parametrize('script', ['fsdp_train.py', 'ds_train.py'])
def test_every_mode_on_two_ranks_matches_train_py_on_one(tmp_path, reference, script):
    assert_same(reference, curve(tmp_path, script, 2))


def test_decent_train_on_two_ranks_matches_one_rank(tmp_path):
    assert_same(curve(tmp_path, 'decent_train.py', 1, *DECENT), curve(tmp_path, 'decent_train.py', 2, *DECENT))


def test_random_data_with_a_char_sized_model_is_refused_in_one_line():
    import sys
    sys.path.insert(0, str(REPO))
    from data import check_token_ids, find_bins
    with pytest.raises(SystemExit, match="random_data draws GPT-2 token ids .* past the model's vocabulary of 65"):
        check_token_ids(find_bins('nowhere', 32, random_data=True)[0], 65)
    check_token_ids(find_bins('nowhere', 32, random_data=True)[0], 50257)  # GPT-2's own: no error


def test_bench_takes_random_data_and_refuses_it_with_real_data(tmp_path):
    small = ['--device=cpu', '--compile=False', '--n_layer=1', '--n_head=2', '--n_embd=32', '--block_size=32',
             '--batch_size=2', '--iters=2', '--warmup=1']
    p = run('bench.py', *small, '--random_data=True', cwd=tmp_path)
    assert json.loads(p.stdout.splitlines()[-1])['random_data'] is True
    assert 'choose one' in one_line_error(run('bench.py', *small, '--random_data=True', '--real_data=True',
                                              cwd=tmp_path, check=False))
