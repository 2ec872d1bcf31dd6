"""Each bad input: a one-line error that names the fix, a non-zero exit, and nothing written."""

import argparse
import ctypes
import os
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from conftest import REPO, SHAKESPEARE, TINY, env, one_line_error, run


def fails(tmp_path, *args, nproc=1, script='train.py'):
    return one_line_error(run(script, *TINY, *args, nproc=nproc, cwd=tmp_path, check=False), nproc)


@pytest.fixture
def ckpt_run(tmp_path, data_dir):
    out = tmp_path / 'run'
    run('train.py', *TINY, f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={out}', '--max_iters=2',
        '--eval_interval=2', '--gradient_accumulation_steps=1', cwd=tmp_path)
    return out


def test_unknown_key_and_wrong_type(tmp_path, data_dir):
    msg = fails(tmp_path, f'--dataset={data_dir / "shakespeare_char"}', '--out_dir=out', '--max_iter=5')
    assert "unknown config key 'max_iter'" in msg and 'max_iters' in msg
    msg = fails(tmp_path, f'--dataset={data_dir / "shakespeare_char"}', '--out_dir=out', '--max_iters=five')
    assert 'max_iters must be int' in msg
    assert not (tmp_path / 'out').exists()

def test_ranks_failing_at_once_print_whole_lines_unbuffered(tmp_path):
    # the ranks of a job share one stderr; with PYTHONUNBUFFERED=1 a line was two writes (its text, its newline), so
    # two ranks' one-line errors ran together. Two processes that import the config module exit at one instant.
    start = time.time() + 2
    code = (f"import sys, time; sys.path.insert(0, {str(REPO)!r}); import configurator\n"
            f"time.sleep(max(0, {start} - time.time()))\n"
            f"sys.exit('error: ' + 'x' * 300 + ' use ring')")
    read, write = os.pipe()
    procs = [subprocess.Popen([sys.executable, '-c', code], env=env(), stderr=write)
             for _ in range(4)]
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    assert [p.wait() for p in procs] == [1] * 4
    assert text.splitlines() == ['error: ' + 'x' * 300 + ' use ring'] * 4, text


@pytest.mark.parametrize('dataset, folder', [
    ('nowhere', 'data/nowhere'),  # a folder's name: data/<name>
    ('shakespeare_char', 'data/shakespeare_char'),  # one that prepare.py makes by its name
    ('sub/mine', 'sub/mine'),  # a relative path
    ('ABS', 'abs/mine'),  # an absolute path (os.path.join('data', '/abs') is '/abs': its advice named two that failed)
])
def test_missing_data_names_a_prep_that_makes_it(tmp_path, dataset, folder):
    dataset = str(tmp_path / 'abs' / 'mine') if dataset == 'ABS' else dataset
    msg = fails(tmp_path, f'--dataset={dataset}', '--out_dir=out')
    shown = dataset if '/' in dataset else f'data/{dataset}'
    assert msg.startswith(f"error: {shown}/train.bin not found: run `python prepare.py "), msg
    assert not (tmp_path / 'out').exists()
    (tmp_path / 'small.txt').write_text(SHAKESPEARE.read_text()[:20000])
    command = msg.split('`')[1].replace('FILE', 'small.txt').split()
    # the advice as given, offline: a local copy of the text for a prep that would download it
    run(*command[1:], *([] if '--input=small.txt' in command else ['--input=small.txt']), cwd=tmp_path)
    assert (tmp_path / folder / 'train.bin').is_file() and (tmp_path / folder / 'val.bin').is_file()


def test_a_folder_of_shards_is_named_as_one(tmp_path):
    # llm.c's and build-nanogpt's layouts: the advice was a text prep of a FILE into the folder
    sys.path.insert(0, str(REPO))
    from data import find_bins
    for name in ('fineweb_val_000000.bin', 'fineweb_train_000001.bin', 'fineweb_train_000002.bin'):
        (tmp_path / name).write_bytes(b'\0' * 1024)
    with pytest.raises(SystemExit, match=f"error: {tmp_path}/train.bin not found, and {tmp_path} holds 3 other token "
                                         r"file\(s\) \(fineweb_train_000001.bin, ...\): a run reads one train.bin"):
        find_bins(str(tmp_path), 32)


def test_llm_c_shards_are_named_with_a_join_that_drops_their_headers(tmp_path):
    # each of llm.c's token files starts with a 1,024-byte header (256 int32: 20240520, version, count): the advice
    # to join them with cat put those words among the tokens
    sys.path.insert(0, str(REPO))
    from data import find_bins, read_rows
    folder = tmp_path / 'fine web'  # a name the shell must quote
    folder.mkdir()
    tokens = {}
    for name, n in (('fineweb_val_000000.bin', 300), ('fineweb_train_000001.bin', 500),
                    ('fineweb_train_000002.bin', 200)):
        header = np.zeros(256, dtype='<i4')
        header[:3] = 20240520, 1, n
        tokens[name] = np.arange(n, dtype=np.uint16) + len(tokens) * 1000
        (folder / name).write_bytes(header.tobytes() + tokens[name].tobytes())
    for split in ('train', 'val'):
        with pytest.raises(SystemExit) as e:
            find_bins(str(folder), 32)
        assert "join each file's tokens after its 1,024-byte header (llm.c's)" in str(e.value), e.value
        subprocess.run(['bash', '-c', str(e.value).split('`')[1]], check=True)  # the command, as given
    files, n = find_bins(str(folder), 32)
    for split, names in (('train', ['fineweb_train_000001.bin', 'fineweb_train_000002.bin']),
                         ('val', ['fineweb_val_000000.bin'])):
        assert read_rows(files[split], [0], n[split])[0].tolist() == np.concatenate([tokens[f] for f in names]).tolist()
    assert sorted(os.listdir(folder)) == sorted([*tokens, 'train.bin', 'val.bin'])  # no .tmp left


def test_a_run_started_outside_the_repo_is_pointed_at_the_repo_s_prepared_data(tmp_path, monkeypatch):
    # `python ~/gpt-train/train.py ~/gpt-train/config/...` from another folder: data/ is the current folder's, and the
    # advice to prepare the dataset again (there, another copy) missed the one the repo's data/ holds
    sys.path.insert(0, str(REPO))
    import data
    repo, elsewhere = tmp_path / 'repo', tmp_path / 'elsewhere'
    (repo / 'data' / 'mine').mkdir(parents=True)
    for split in ('train', 'val'):
        (repo / 'data' / 'mine' / f'{split}.bin').write_bytes(b'\1\0' * 100)
    elsewhere.mkdir()
    monkeypatch.setattr(data, '__file__', str(repo / 'data.py'))
    monkeypatch.chdir(elsewhere)
    with pytest.raises(SystemExit) as e:
        data.find_bins('mine', 32)
    assert str(e.value) == ("error: data/mine/train.bin not found: run `python prepare.py text --input=FILE "
                            f"--name=mine` here first, or use the repo's {repo}/data/mine: run from {repo} (cd there), "
                            f"or give --dataset={repo}/data/mine"), e.value
    assert data.find_bins(f'{repo}/data/mine', 32)[1] == {'train': 100, 'val': 100}  # the advice works
    monkeypatch.chdir(repo)
    assert data.find_bins('mine', 32)[1] == {'train': 100, 'val': 100}  # and so does the other


def test_a_missing_folder_with_a_space_is_quoted_in_the_prep_command(tmp_path):
    # the command the error names is pasted into a shell, which would split `--out_dir=my data`
    sys.path.insert(0, str(REPO))
    from data import find_bins
    with pytest.raises(SystemExit, match=f"run `python prepare.py text --input=FILE --out_dir='{tmp_path}/my data'` "
                                         "first"):
        find_bins(str(tmp_path / 'my data'), 32)


@pytest.mark.parametrize('script, flag', [('sample.py', '--out_dir'), ('export_hf.py', '--ckpt'),
                                          ('eval_hellaswag.py', '--ckpt')])
def test_a_tool_given_a_training_config_names_the_flag_for_its_run(tmp_path, script, flag):
    # nanoGPT's sample.py runs a training config as Python and samples from its out_dir; here it was "unknown config
    # key 'eval_interval'" and a list of keys: the step after training is to give the run, not the config
    config = REPO / 'config' / 'train_shakespeare_char_cpu.py'
    msg = one_line_error(run(script, config, cwd=tmp_path, check=False))
    assert msg.startswith(f"error: {config}:") and msg.endswith(
        f"is a key of training configs (train.py's), not of {script}, which reads the run such a config trained: "
        f"give {script} {flag}=out-shakespeare-char, the config's out_dir, in place of the config"), msg
    assert os.listdir(tmp_path) == []


def test_bin_shorter_than_a_block(tmp_path, data_dir):
    short = tmp_path / 'short'
    shutil.copytree(data_dir / 'shakespeare_char', short)
    (short / 'val.bin').write_bytes(b'\x01\x00' * 20)
    msg = fails(tmp_path, f'--dataset={short}', '--out_dir=out')
    assert 'val.bin holds 20 tokens, fewer than block_size + 1 = 33' in msg and 'lower --block_size' in msg
    assert not (tmp_path / 'out').exists()


def without_root_s_read_override():
    """Root reads any file; a run started here does not, as a plain user would not: CAP_DAC_OVERRIDE and
    CAP_DAC_READ_SEARCH leave the capability bounding set (prctl PR_CAPBSET_DROP), so the exec gets neither."""
    if os.geteuid() == 0:
        for cap in (1, 2):
            if ctypes.CDLL(None, use_errno=True).prctl(24, cap, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), 'prctl(PR_CAPBSET_DROP)')


def test_a_split_this_user_cannot_read(tmp_path, data_dir):
    unreadable = tmp_path / 'unreadable'
    shutil.copytree(data_dir / 'shakespeare_char', unreadable)
    (unreadable / 'val.bin').chmod(0)
    p = subprocess.run([sys.executable, str(REPO / 'train.py'), *TINY, f'--dataset={unreadable}', '--out_dir=out'],
                       cwd=tmp_path, env=env(), capture_output=True, text=True, preexec_fn=without_root_s_read_override)
    msg = one_line_error(p)
    assert 'cannot read' in msg and 'val.bin (Permission denied): give this user read access to it (chmod a+r)' in msg
    assert not (tmp_path / 'out').exists()


def test_missing_checkpoint(tmp_path, data_dir):
    msg = fails(tmp_path, f'--dataset={data_dir / "shakespeare_char"}', '--out_dir=out', '--init_from=resume')
    assert 'no checkpoint at out/ckpt.pt' in msg
    assert not (tmp_path / 'out').exists()


@pytest.mark.parametrize('damage', ['truncate', 'garbage', 'code', 'no model', 'wrong optimizer'])
def test_corrupt_checkpoint(tmp_path, data_dir, ckpt_run, damage):
    ckpt = ckpt_run / 'ckpt.pt'
    data = ckpt.read_bytes()
    if damage in ('truncate', 'garbage'):
        ckpt.write_bytes(data[:len(data) // 2] if damage == 'truncate' else b'not a checkpoint at all' * 100)
    else:
        c = torch.load(ckpt, weights_only=True)
        if damage == 'code':  # an object that only unpickling code could rebuild: weights_only refuses it
            c['config'] = argparse.Namespace(x=1)
        elif damage == 'no model':
            del c['model']
        else:
            c['optimizer']['param_groups'][0]['params'] = c['optimizer']['param_groups'][0]['params'][:2]
        torch.save(c, ckpt)
    before = {p.name: p.stat().st_mtime_ns for p in ckpt_run.iterdir()}
    msg = fails(tmp_path, f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={ckpt_run}', '--init_from=resume')
    assert ('is corrupt' in msg or 'does not fit this model' in msg) and 'restore a good copy' in msg
    assert {p.name: p.stat().st_mtime_ns for p in ckpt_run.iterdir()} == before


def test_model_key_that_contradicts_the_checkpoint(tmp_path, data_dir, ckpt_run):
    before = {p.name: p.stat().st_mtime_ns for p in ckpt_run.iterdir()}
    args = [f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={ckpt_run}', '--init_from=resume']
    msg = fails(tmp_path, *args, '--n_layer=3')
    assert "n_layer=3 contradicts the checkpoint's n_layer=2" in msg
    assert {p.name: p.stat().st_mtime_ns for p in ckpt_run.iterdir()} == before
    # the same value as the checkpoint's is no contradiction, and dropout is not part of the shape
    run('train.py', *TINY, *args, '--n_layer=2', '--dropout=0.1', '--max_iters=3', '--eval_interval=3',
        '--gradient_accumulation_steps=1', cwd=tmp_path)


def test_resume_takes_the_shape_from_the_checkpoint(tmp_path, data_dir, ckpt_run):
    # no model keys given at all, not even block_size: the checkpoint's 2 layers and 32 positions are used
    args = [a for a in TINY if not a.startswith(('--n_layer', '--n_head', '--n_embd', '--block_size'))]
    p = run('train.py', *args, f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={ckpt_run}',
            '--init_from=resume', '--max_iters=3', '--eval_interval=3', '--gradient_accumulation_steps=1', cwd=tmp_path)
    assert 'at iter 2' in p.stdout
    c = torch.load(ckpt_run / 'ckpt.pt', weights_only=True)
    assert c['iter_num'] == 3 and c['config']['block_size'] == 32 and c['config']['n_layer'] == 2


@pytest.mark.parametrize('script', ['train.py', 'fsdp_train.py', 'ds_train.py', 'decent_train.py'])
def test_batch_that_does_not_divide_across_ranks(tmp_path, data_dir, script):
    # under torchrun (nthreads=None): the forked ranks of run() start too much in step to show the race below
    p = run(script, *TINY, f'--dataset={data_dir / "shakespeare_char"}', '--out_dir=out',
            '--gradient_accumulation_steps=3', nproc=2, cwd=tmp_path, check=False, nthreads=None)
    msg = one_line_error(p, 2)
    assert 'gradient_accumulation_steps=3 does not divide across 2 data-parallel ranks' in msg
    assert 'multiple of 2' in msg
    # each rank stops at the check with its line, none with a traceback in a collective that the other's exit cut
    # short (fsdp_train.py's mesh, ds_train.py's and decent_train.py's groups were made first)
    errors = [line for line in p.stderr.splitlines() if line.startswith('error: ')]
    assert len(errors) == 2 and '[rank' not in p.stderr, p.stderr[-3000:]
    assert not (tmp_path / 'out').exists()


def test_unknown_init_from(tmp_path, data_dir):
    msg = fails(tmp_path, f'--dataset={data_dir / "shakespeare_char"}', '--out_dir=out', '--init_from=gpt3')
    assert "unknown init_from='gpt3'" in msg and 'scratch' in msg
    assert not (tmp_path / 'out').exists()
    # a path that names nothing is the tools' "no checkpoint at" (checkpoints.md), not an unknown name
    msg = fails(tmp_path, f'--dataset={data_dir / "shakespeare_char"}', '--out_dir=out',
                f'--init_from={tmp_path / "runs" / "a"}')
    assert msg == f"error: no checkpoint at {tmp_path / 'runs' / 'a'}: give a ckpt.pt, a sharded checkpoint or a run " \
        f"folder", msg
    assert not (tmp_path / 'out').exists()


@pytest.mark.parametrize('script', ['train.py', 'fsdp_train.py', 'pp_train.py', 'decent_train.py', 'ds_train.py'])
def test_negative_save_intervals_and_no_nonfinite_steps_allowed(tmp_path, data_dir, script):
    data = f'--dataset={data_dir / "shakespeare_char"}'
    msg = fails(tmp_path, data, '--out_dir=out', '--save_memory_interval=-1', script=script)
    assert 'save_memory_interval=-1 must be 0 or more' in msg
    msg = fails(tmp_path, data, '--out_dir=out', '--max_nonfinite_steps=0', script=script)
    assert 'max_nonfinite_steps=0 must be 1 or more' in msg
    assert not (tmp_path / 'out').exists()


def test_an_out_dir_data_or_settings_of_each_nodes_own_are_one_line_on_every_rank_before_training(tmp_path, data_dir):
    # two nodes of one rank, each in a folder of its own, and a relative out_dir: one folder by name, two on disk.
    # Trained on, FSDP's checkpoints had each node's shards on its disk, committed as whole on rank 0's (never loadable)
    nodes = [tmp_path / 'node0', tmp_path / 'node1']
    for node in nodes:
        node.mkdir()
    args = ['fsdp_train.py', *TINY, f'--dataset={data_dir / "shakespeare_char"}', '--out_dir=out', '--max_iters=2',
            '--eval_interval=2', '--gradient_accumulation_steps=2']
    p = run(*args, nproc=2, nodes=[(node, 1) for node in nodes], cwd=tmp_path, check=False)
    msg = one_line_error(p, 2)
    assert msg.startswith('error: out is not one folder on every node: what rank 1 wrote there on host ') and \
        msg.endswith('give a folder on a filesystem that every node shares (NFS, Lustre, a ReadWriteMany volume)'), msg
    assert '[rank' not in p.stderr and not any((node / 'out').exists() for node in nodes), p.stderr[-3000:]
    # the data under data/ on node 0 alone: every rank says which node lacks it (node 0's ranks went on to gloo's
    # traceback, "Connection closed by peer", the line in node 1's log alone). A name the repo's own data/ does not
    # hold, whose copy the error would name besides
    shutil.copytree(data_dir / 'shakespeare_char', nodes[0] / 'data' / 'node0_only')
    p = run(*args, '--dataset=node0_only', nproc=2, nodes=[(node, 1) for node in nodes], cwd=tmp_path, check=False)
    errors = [line for line in p.stderr.splitlines() if line.startswith('error: ')]
    assert errors == ['error: rank 1 on host ' + socket.gethostname() + ': data/node0_only/train.bin not found: '
                      'run `python prepare.py text --input=FILE --name=node0_only` first'] * 2 and \
        '[rank' not in p.stderr, p.stderr[-3000:]
    # a config file of one name that says another batch on each node (a copy of the repo per node, one edited): rank
    # 0's settings went into config.json, and the ranks trained on with no word
    for node, batch in zip(nodes, (4, 8)):
        (node / 'mine.py').write_text(f'batch_size = {batch}\n')
    p = run(*args, 'mine.py', nproc=2, nodes=[(node, 1) for node in nodes], cwd=tmp_path, check=False)
    errors = [line for line in p.stderr.splitlines() if line.startswith('error: ')]
    assert errors == ['error: rank 1 on host ' + socket.gethostname() + ' was started with --batch_size=8, rank 0 '
                      'with --batch_size=4: start every node with the same command and config file'] * 2 and \
        '[rank' not in p.stderr, p.stderr[-3000:]
    # one folder that both nodes see: the run trains, and leaves nothing of the check behind
    run(*args, nproc=2, nodes=[(tmp_path, 1), (tmp_path, 1)], cwd=tmp_path)
    assert (tmp_path / 'out' / 'dcp' / 'latest').exists() and not list((tmp_path / 'out').glob('.node-*'))
