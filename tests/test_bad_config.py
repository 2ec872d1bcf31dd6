"""Numbers, folders and data that cannot train: one validation step, shared by the five entrypoints, gives a
one-line error that names the fix before anything is written; a resume that fails leaves the run it would have
resumed as it was."""

import os
import pickle
import shutil

import pytest

import configurator
from conftest import TINY, one_line_error, run

SCRIPTS = ['train.py', 'fsdp_train.py', 'pp_train.py', 'decent_train.py', 'ds_train.py']


def fails(tmp_path, *args, script='train.py'):
    return one_line_error(run(script, *TINY, *args, cwd=tmp_path, check=False))


@pytest.mark.parametrize('key, value, says', [
    ('batch_size', 0, 'must be 1 or more'), ('block_size', 0, 'must be 1 or more'),
    ('eval_iters', 0, 'must be 1 or more'), ('eval_interval', 0, 'must be 1 or more'),
    ('log_interval', 0, 'must be 1 or more'), ('gradient_accumulation_steps', 0, 'must be 1 or more'),
    ('max_iters', -1, 'must be 0 or more'), ('learning_rate', -1e-3, 'must be 0 or more'),
    ('beta1', 1.0, 'must be at least 0 and below 1'), ('beta2', -0.1, 'must be at least 0 and below 1'),
    ('dropout', 1.0, 'must be at least 0 and below 1'), ('dropout', -0.1, 'must be at least 0 and below 1'),
    ('n_head', 0, 'must be 1 or more'), ('n_layer', 0, 'must be 1 or more'),
    ('weight_decay', -1.0, 'must be 0 or more'),
    ('grad_clip', -1.0, 'must be 0 or more (0 turns clipping off)'), ('save_memory_interval', -1, 'must be 0 or more'),
    ('max_nonfinite_steps', 0, 'must be 1 or more'), ('learning_rate', float('nan'), 'must be 0 or more'),
])
def test_each_number_has_a_range(key, value, says):
    with pytest.raises(SystemExit) as e:
        configurator.check_config({'n_embd': 64, 'n_head': 4, key: value})
    assert str(e.value.code).startswith(f'error: {key}={value} {says}')


def test_heads_must_split_the_width():
    with pytest.raises(SystemExit) as e:
        configurator.check_config({'n_embd': 100, 'n_head': 12})
    assert 'n_embd=100 is not a multiple of n_head=12' in str(e.value.code)
    configurator.check_config({'n_embd': 96, 'n_head': 12})  # and a multiple passes


@pytest.mark.parametrize('script', SCRIPTS)
def test_every_entrypoint_checks_before_it_writes(tmp_path, data_dir, script):
    data = f'--dataset={data_dir / "shakespeare_char"}'
    for bad, says in (('--eval_interval=0', 'eval_interval=0 must be 1 or more'),
                      ('--gradient_accumulation_steps=0', 'gradient_accumulation_steps=0 must be 1 or more')):
        assert says in fails(tmp_path, data, '--out_dir=out', bad, script=script)
    assert not (tmp_path / 'out').exists()


def test_device_and_out_dir(tmp_path, data_dir):
    data = f'--dataset={data_dir / "shakespeare_char"}'
    assert "device='banana' is not a device torch knows" in fails(tmp_path, data, '--out_dir=out', '--device=banana')
    (tmp_path / 'afile').write_text('x')
    assert 'out_dir=afile is a file, not a folder' in fails(tmp_path, data, '--out_dir=afile')
    assert 'would lie below' in fails(tmp_path, data, '--out_dir=afile/run') and 'which is a file' in \
        fails(tmp_path, data, '--out_dir=afile/run')
    assert 'out_dir is empty: give --out_dir=FOLDER' in fails(tmp_path, data, '--out_dir=')
    assert 'cannot write in /proc' in fails(tmp_path, data, '--out_dir=/proc/run')  # read-only, even for root
    (tmp_path / 'scratch').symlink_to(tmp_path / 'purged')  # a link to a folder not there, as the run's or above it
    for out_dir in ('scratch', 'scratch/run'):
        assert f"{tmp_path / 'scratch'} is a symbolic link to {tmp_path / 'purged'}, which does not exist: make " \
            "that folder" in fails(tmp_path, data, f'--out_dir={out_dir}')
    (tmp_path / 'scratch').unlink()
    # the folders above a new out_dir that a failed start made (a name too long for the filesystem; a checkpoint
    # it cannot start from, found once it holds the folder) are removed with it: nothing is left of that start
    assert 'File name too long' in fails(tmp_path, data, f'--out_dir=new/{"x" * 300}/run')
    assert 'afile is not a model checkpoint' in fails(tmp_path, data, '--out_dir=new/run', '--init_from=afile')
    (tmp_path / 'cf').mkdir()  # a NUL byte only a config file can give (os raises ValueError on it)
    for key, value in (('out_dir', 'run\\x00'), ('dataset', f'{data_dir / "shakespeare_char"}\\x00')):
        (tmp_path / 'cf' / f'{key}.py').write_text(f'{key} = "{value}"\n')
        assert f"{key}.py:1: {key}='{value}' holds a NUL byte" in fails(tmp_path, data, '--out_dir=out',
                                                                      str(tmp_path / 'cf' / f'{key}.py'))
    assert (tmp_path / 'afile').read_text() == 'x' and sorted(p.name for p in tmp_path.iterdir()) == ['afile', 'cf']


def test_an_out_dir_in_a_runs_checkpoint_folders_or_snapshots_is_refused(tmp_path):
    # a run started in RUN/dcp/step-N (meant as a resume of RUN) started afresh there, and RUN's next saves pruned
    # that step folder with the whole state of the run inside it
    (tmp_path / 'run' / 'dcp' / 'step-00000006').mkdir(parents=True)
    (tmp_path / 'run' / 'run_id').write_text('abc')
    for out in ('dcp/step-00000006', 'dcp', 'dcp/best-step-00000006/new', 'decent/step-00000004'):
        with pytest.raises(SystemExit) as e:
            configurator.check_out_dir(str(tmp_path / 'run' / out))
        assert f"where the run in {tmp_path / 'run'} keeps (and prunes) its checkpoints: to continue that run give " \
            f"--out_dir={tmp_path / 'run'}" in str(e.value.code), e.value.code
    # and through a link to one (ln -s RUN/dcp/step-N mine): RUN's pruning removed the run's whole folder all the same
    (tmp_path / 'mine').symlink_to(tmp_path / 'run' / 'dcp' / 'step-00000006')
    for out in ('mine', 'mine/new'):
        with pytest.raises(SystemExit) as e:
            configurator.check_out_dir(str(tmp_path / out))
        assert f"out_dir={tmp_path / out} lies in {tmp_path / 'run' / 'dcp'}, where the run" in str(e.value.code) \
            and f"give --out_dir={tmp_path / 'run'}" in str(e.value.code), e.value.code
    assert sorted(p.name for p in (tmp_path / 'run' / 'dcp').iterdir()) == ['step-00000006']
    (tmp_path / 'my run' / 'dcp').mkdir(parents=True)  # the command it names is quoted where the shell would split it
    (tmp_path / 'my run' / 'run_id').write_text('abc')
    with pytest.raises(SystemExit) as e:
        configurator.check_out_dir(str(tmp_path / 'my run' / 'dcp'))
    assert f"to continue that run give --out_dir='{tmp_path / 'my run'}';" in str(e.value.code), e.value.code
    for out in ('run/new', 'other/dcp', 'run/before-abc'):  # a run's own folder inside, and a dcp of no run's: taken
        configurator.check_out_dir(str(tmp_path / out))
    # nor in a run's memory snapshots in RAM (where its snapshots are resumed from, as the docs say), which the end
    # of that run removes
    (tmp_path / 'ram').symlink_to('/dev/shm/nanogpt-0123abc')
    for out in ('/dev/shm/nanogpt-0123abc', '/dev/shm/nanogpt-0123abc/run', str(tmp_path / 'ram')):
        with pytest.raises(SystemExit) as e:
            configurator.check_out_dir(out)
        assert "the memory snapshots of run 0123abc, which that run removes at its end: give that run's own " \
            "out_dir (whose run_id file holds 0123abc) to resume it" in str(e.value.code), e.value.code


def test_an_out_dir_named_as_a_runs_best_is_refused(tmp_path):
    # --out_dir=RUN/best (meant as a run from RUN's best): RUN/best was the new run's folder from then on, and
    # export_hf.py --ckpt=RUN/best, sample.py --init_from=best and --init_from=RUN/best read its newest checkpoint in
    # place of RUN's best, without a word
    (tmp_path / 'run').mkdir()
    (tmp_path / 'run' / 'run_id').write_text('abc')
    (tmp_path / 'mine').symlink_to(tmp_path / 'run' / 'best')
    for out in ('run/best', 'run/best/new', 'mine'):
        with pytest.raises(SystemExit) as e:
            configurator.check_out_dir(str(tmp_path / out))
        best = tmp_path / 'run' / 'best'
        assert f"{best}, which names the best checkpoint of the run in {tmp_path / 'run'} (sample.py, export_hf.py " \
            f"and --init_from read it there): to train from it give --init_from={best} and an --out_dir of its own" \
            in str(e.value.code), e.value.code
    assert os.listdir(tmp_path / 'run') == ['run_id']
    configurator.check_out_dir(str(tmp_path / 'best'))  # a folder named best in no run's folder: taken


def test_an_out_dir_that_is_a_checkpoint_folder_is_refused(tmp_path, data_dir):
    # a step folder copied out of a run to keep it (cp -r RUN/dcp/step-N kept), then given as out_dir to go on from
    # it: a new run started afresh there, its run_id written over the one the folder's files carry
    for kind, names in (('dcp', ['.metadata', '__0_0.distcp', 'extra.pt']), ('ds', ['mp_rank_00_model_states.pt']),
                        ('decent', ['rank-0.pt', 'rank-1.pt'])):
        kept = tmp_path / kind
        kept.mkdir()
        for name in names + ['run_id']:
            (kept / name).write_text(name)
        with pytest.raises(SystemExit) as e:
            configurator.check_out_dir(str(kept))
        assert str(e.value.code) == f"error: out_dir={kept} is a checkpoint's step folder ({names[0]} in it), not a " \
            f"run's out_dir: to train from it give --init_from={kept} and an --out_dir of its own", e.value.code
    before = (tmp_path / 'dcp' / 'run_id').read_text()
    assert 'is a checkpoint\'s step folder' in fails(tmp_path, f'--dataset={data_dir / "shakespeare_char"}',
                                                     f'--out_dir={tmp_path / "dcp"}')
    assert (tmp_path / 'dcp' / 'run_id').read_text() == before and len(os.listdir(tmp_path / 'dcp')) == 4


@pytest.fixture
def odd_data(tmp_path, data_dir):
    d = tmp_path / 'odd'
    shutil.copytree(data_dir / 'shakespeare_char', d)
    return d


def test_damaged_data(tmp_path, odd_data):
    data = f'--dataset={odd_data}'
    with open(odd_data / 'val.bin', 'ab') as f:
        f.write(b'\x01')  # half a token
    assert 'not a whole number of uint16 tokens' in fails(tmp_path, data, '--out_dir=out')
    (odd_data / 'val.bin').write_bytes((odd_data / 'val.bin').read_bytes()[:-1])
    (odd_data / 'meta.pkl').write_bytes((odd_data / 'meta.pkl').read_bytes()[:40])
    msg = fails(tmp_path, data, '--out_dir=out')
    assert 'meta.pkl is not a vocabulary' in msg and 'prepare the dataset again' in msg
    (odd_data / 'meta.pkl').write_bytes(pickle.dumps({'stoi': {}, 'itos': {}}))
    assert 'meta.pkl is not a vocabulary (ValueError: it holds no vocab_size)' in fails(tmp_path, data, '--out_dir=out')
    assert not (tmp_path / 'out').exists()


@pytest.mark.parametrize('script', ['train.py', 'fsdp_train.py', 'pp_train.py'])
def test_token_ids_past_the_vocabulary(tmp_path, odd_data, script):
    meta = pickle.loads((odd_data / 'meta.pkl').read_bytes())
    (odd_data / 'meta.pkl').write_bytes(pickle.dumps({**meta, 'vocab_size': 40}))  # tiny Shakespeare has 65 chars
    msg = fails(tmp_path, f'--dataset={odd_data}', '--out_dir=out', script=script)
    assert 'train.bin holds token id 64, past the model\'s vocabulary of 40' in msg and "model's tokenizer" in msg
    assert not (tmp_path / 'out').exists()


@pytest.fixture(scope='module')
def good_run(tmp_path_factory, data_dir):
    tmp = tmp_path_factory.mktemp('good')
    run('train.py', *TINY, f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={tmp / "run"}', '--max_iters=4',
        '--eval_interval=2', '--gradient_accumulation_steps=1', cwd=tmp)
    return tmp / 'run'


def test_a_resume_that_fails_leaves_the_run_as_it_was(tmp_path, data_dir, good_run, odd_data):
    out = tmp_path / 'run'
    shutil.copytree(good_run, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert before['metrics.jsonl'].count(b'\n') >= 6  # evals at 0, 2, 4 and four steps
    resume = [f'--out_dir={out}', '--init_from=resume', '--max_iters=8']
    msg = fails(tmp_path, f'--dataset={data_dir / "shakespeare_char"}', *resume, '--eval_interval=0')
    assert 'eval_interval=0 must be 1 or more' in msg
    # data whose ids the checkpoint's 65-token vocabulary cannot embed: a larger meta.pkl passes, the ids do not
    ids = (odd_data / 'train.bin').read_bytes()
    (odd_data / 'train.bin').write_bytes(ids[:-2] + (70).to_bytes(2, 'little'))
    msg = fails(tmp_path, f'--dataset={odd_data}', *resume)
    assert 'holds token id 70, past the model\'s vocabulary of 65' in msg
    # another vocabulary (the data prepared again from another text): its ids would stand for other characters
    (odd_data / 'train.bin').write_bytes(ids)
    meta = pickle.loads((odd_data / 'meta.pkl').read_bytes())
    (odd_data / 'meta.pkl').write_bytes(pickle.dumps({**meta, 'vocab_size': 46}))
    msg = fails(tmp_path, f'--dataset={odd_data}', *resume)
    assert msg.startswith(f"error: {odd_data} holds the ids of a 46-character vocabulary, but the run it would "
                          f"continue ({out / 'ckpt.pt'}) trained on the ids of a 65-character vocabulary: "), msg
    # as many characters, in another order: every id fits, and each stands for another character
    itos = [meta['itos'][i] for i in range(65)]
    itos[0], itos[1] = itos[1], itos[0]
    (odd_data / 'meta.pkl').write_bytes(pickle.dumps({**meta, 'itos': dict(enumerate(itos))}))
    assert f"{odd_data} holds the ids of another 65-character vocabulary, but the run" in fails(
        tmp_path, f'--dataset={odd_data}', *resume)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_resume_on_its_data_prepared_again_as_characters_is_refused(tmp_path, data_dir):
    # the run's folder prepared again with another tokenizer (prepare.py --force) keeps its name, and each character
    # id is within a GPT-2 model's vocabulary: the run went on, training its BPE model on character ids
    d = tmp_path / 'd'
    shutil.copytree(data_dir / 'shakespeare', d)
    run('train.py', *TINY, f'--dataset={d}', '--out_dir=run', '--max_iters=2', '--eval_interval=2', cwd=tmp_path)
    before = {p.name: p.read_bytes() for p in (tmp_path / 'run').iterdir()}
    for f in ('train.bin', 'val.bin', 'meta.pkl', 'prep.json'):
        shutil.copy(data_dir / 'shakespeare_char' / f, d / f)
    msg = fails(tmp_path, f'--dataset={d}', '--out_dir=run', '--max_iters=4')
    assert msg == f"error: {d} holds the ids of a 65-character vocabulary, but the run it would continue " \
                  f"(run/ckpt.pt) trained on GPT-2 BPE tokens: the data was prepared again or is another dataset; " \
                  f"prepare the run's data as it was, or give another --out_dir for a new run"
    assert {p.name: p.read_bytes() for p in (tmp_path / 'run').iterdir()} == before


@pytest.mark.parametrize('config, says', [
    ({'seed': 99999999999999999999}, 'error: seed=99999999999999999999 must be from 0 to 9223372036854775807'),
    ({'seed': -1}, 'error: seed=-1 must be from 0 to'),
    ({'backend': 'nccl', 'device': 'cpu'}, 'error: backend=nccl needs CUDA GPUs, and device=cpu has none'),
    ({'backend': 'mpi', 'device': 'cpu'}, 'error: backend=mpi but this torch was built without MPI'),
    ({'backend': 'gloo', 'device': 'mps'}, 'error: device=mps but this machine has no Apple GPU'),
    # a config file may set it (Decent-DP's TOML does): the fix is a flag that turns it off, not dropping one
    ({'wandb_log': True}, 'error: wandb_log=True but wandb is not installed: pip install wandb, or add '
                          '--wandb_log=False'),
])
def test_a_setting_this_machine_cannot_run_is_one_line(config, says):
    import importlib.util
    import torch
    import torch.distributed as dist
    if ('mpi' in says and dist.is_mpi_available() or 'mps' in says and torch.backends.mps.is_available()
            or 'wandb' in says and importlib.util.find_spec('wandb')):
        pytest.fail(f"this machine has what the case needs missing: {says}")  # never silently passes
    with pytest.raises(SystemExit) as e:
        configurator.check_config({'n_embd': 64, 'n_head': 4, **config})
    assert str(e.value.code).startswith(says)


def test_a_schedule_that_rises_or_never_warms_up_is_warned_about(capsys):
    keys = dict(decay_lr=True, learning_rate=6e-4, max_iters=10)
    configurator.check_config({**keys, 'warmup_iters': 50, 'lr_decay_iters': 2, 'min_lr': 1.0})
    out = capsys.readouterr().out.splitlines()  # on stdout, as every warning of a run: stderr is for its error
    assert [line.split(':')[1].split('=')[0].strip() for line in out] == ['warmup_iters', 'lr_decay_iters', 'min_lr']
    configurator.check_config({**keys, 'warmup_iters': 2, 'lr_decay_iters': 10, 'min_lr': 6e-5})
    assert capsys.readouterr().out == ''


@pytest.mark.parametrize('script', SCRIPTS[:4])
def test_a_model_too_big_for_the_machine_is_refused_before_it_is_built(tmp_path, data_dir, script):
    msg = fails(tmp_path, '--n_embd=1000000', '--n_head=1', f'--out_dir={tmp_path / "out"}',
                f'--dataset={data_dir / "shakespeare_char"}', script=script)
    assert msg.startswith('error: the model has 24,000,') and 'GiB free on cpu: make n_layer or n_embd smaller' in msg
