"""Files from elsewhere are data, never code: a planted pickle (a DCP folder's .metadata, a shard's non-tensor value,
a meta.pkl, a ckpt.pt) runs nothing in any script that reads it, which fails with one line instead, or passes it
over as damaged; damaged DCP folders give one line too, and a DCP folder's other files are not called damaged;
sample.py follows no path that a checkpoint names."""

import io
import os
import pickle
import shutil

import pytest
import torch

from conftest import TINY, one_line_error, run

SCRIPTS = ['train.py', 'fsdp_train.py', 'pp_train.py', 'ds_train.py', 'decent_train.py']


class Payload:
    """Unpickled, it runs a shell command that creates the marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f'touch {self.marker}',)


def call(module, name, arg):
    """A pickle that calls module.name(arg), written opcode by opcode: any name, importable here or not."""
    def text(s):
        return b'\x8c' + bytes([len(s.encode())]) + s.encode()
    return b'\x80\x04' + text(module) + text(name) + b'\x93' + text(arg) + b'\x85R.'


@pytest.fixture(scope='module')
def fsdp_run(tmp_path_factory, data_dir):
    """fsdp_train.py on one process, 4 steps: DCP folders at steps 2 and 4 (the one before is kept as a fallback),
    and the consolidated ckpt.pt."""
    tmp = tmp_path_factory.mktemp('fsdp_run')
    run('fsdp_train.py', *TINY, f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={tmp / "run"}',
        '--max_iters=4', '--eval_interval=2', '--gradient_accumulation_steps=1', '--save_consolidated=True', cwd=tmp)
    assert sorted(f for f in os.listdir(tmp / 'run' / 'dcp') if not f.startswith('best')) == [
        'latest', 'step-00000002', 'step-00000004']
    return tmp / 'run'


@pytest.fixture
def copy(fsdp_run, tmp_path):
    out = tmp_path / 'copy'
    shutil.copytree(fsdp_run, out)
    return out


def args(data_dir):
    return [*TINY, f'--dataset={data_dir / "shakespeare_char"}', '--gradient_accumulation_steps=1']


def test_real_dcp_metadata_reads_the_same_through_the_restricted_unpickler(fsdp_run):
    from checkpoint import read_dcp_metadata
    for step in ('step-00000002', 'step-00000004'):
        folder = fsdp_run / 'dcp' / step
        with open(folder / '.metadata', 'rb') as f:
            plain = pickle.load(f)  # our own file, just written: safe to read the ordinary way here
        restricted = read_dcp_metadata(folder)
        assert restricted == plain and len(restricted.state_dict_metadata) > 20


@pytest.mark.parametrize('module, name', [('os', 'system'), ('posix', 'system'), ('builtins', 'eval'),
                                          ('builtins', 'exec'), ('builtins', 'getattr'), ('subprocess', 'Popen'),
                                          ('torch', 'load'), ('torch.serialization', 'load'), ('pickle', 'loads'),
                                          ('nanogpt_missing_module', 'x')])
def test_dcp_metadata_unpickler_refuses_every_other_name(tmp_path, module, name):
    from checkpoint import read_dcp_metadata
    marker = tmp_path / 'MARKER'
    (tmp_path / '.metadata').write_bytes(call(module, name, f'touch {marker}'))
    with pytest.raises(pickle.UnpicklingError, match=f"it names {module}.{name}, which DCP's metadata never holds"):
        read_dcp_metadata(tmp_path)
    # protocol 0's GLOBAL opcode goes the same way
    (tmp_path / '.metadata').write_bytes(f'c{module}\n{name}\n(V{marker}\ntR.'.encode())
    with pytest.raises(pickle.UnpicklingError):
        read_dcp_metadata(tmp_path)
    assert not marker.exists()


def plant_metadata(copy, marker):
    (copy / 'dcp' / 'step-00000004' / '.metadata').write_bytes(pickle.dumps(Payload(marker)))


@pytest.mark.parametrize('script', ['sample.py', 'export_hf.py', *SCRIPTS])
def test_planted_dcp_metadata_runs_nothing(copy, tmp_path, data_dir, script):
    marker = tmp_path / 'MARKER'
    plant_metadata(copy, marker)
    folder = copy / 'dcp' / 'step-00000004'  # the step folder given: the run folder passes it over (below)
    if script == 'sample.py':
        p = run(script, f'--init_from={folder}', '--device=cpu', cwd=tmp_path, check=False)
    elif script == 'export_hf.py':
        p = run(script, f'--ckpt={folder}', f'--out={tmp_path / "hf"}', cwd=tmp_path, check=False)
    else:
        p = run(script, *args(data_dir), f'--init_from={folder}', f'--out_dir={tmp_path / "out"}', '--max_iters=1',
                cwd=tmp_path, check=False)
    msg = one_line_error(p)
    assert 'UnpicklingError: it names posix.system, which DCP' in msg and str(folder) in msg
    assert not marker.exists()
    assert not (tmp_path / 'hf').exists() and not (tmp_path / 'hf.tmp').exists() and not (tmp_path / 'out').exists()
    if script == 'sample.py':  # the run folder: its newest whole state, the export at the same step, as a resume
        from checkpoint import find_checkpoint
        assert find_checkpoint(str(copy)) == str(copy / 'ckpt.pt') and not marker.exists()


def test_the_files_of_a_sharded_checkpoint_are_not_called_corrupt(fsdp_run, tmp_path, data_dir):
    """A step folder's extra.pt, given as the checkpoint, is an intact file but no model checkpoint: the error says
    what to give, and never to delete it (the run's good state). The run's dcp/latest stands for the folder it names."""
    path = fsdp_run / 'dcp' / 'step-00000004' / 'extra.pt'
    msg = one_line_error(run('sample.py', f'--init_from={path}', '--device=cpu', cwd=tmp_path, check=False))
    assert msg.startswith(f'error: {path} is not a model checkpoint (') and 'delete' not in msg, msg
    assert msg.endswith('give a ckpt.pt, a run folder or a sharded checkpoint folder (dcp/step-N)')
    meta = f"--meta_path={data_dir / 'shakespeare_char' / 'meta.pkl'}"
    samples = [run('sample.py', f'--init_from={path}', '--num_samples=1', '--max_new_tokens=5', '--device=cpu',
                   meta, cwd=tmp_path).stdout for path in (fsdp_run / 'dcp' / 'latest', path.parent)]
    assert samples[0] == samples[1] and samples[0].strip()


def test_auto_resume_passes_a_planted_dcp_metadata_over_as_damaged(copy, tmp_path, data_dir):
    marker = tmp_path / 'MARKER'
    plant_metadata(copy, marker)
    (copy / 'ckpt.pt').unlink()  # the consolidated checkpoint at step 4 would be taken instead of step 2's folder
    p = run('fsdp_train.py', *args(data_dir), f'--out_dir={copy}', '--max_iters=6', '--eval_interval=2',
            cwd=tmp_path)
    assert f'warning: skipping the damaged {copy / "dcp" / "step-00000004"} (UnpicklingError: it names posix.system' \
        in p.stdout
    assert f'resuming from {copy / "dcp" / "step-00000002"} at iter 2' in p.stdout
    assert not marker.exists()


def test_planted_value_in_a_dcp_shard_runs_nothing(copy, tmp_path, data_dir):
    """DCP unpickles a shard's non-tensor values (the optimizer's settings) with torch.load(weights_only=False):
    one of them pointed at a planted pickle, in a .metadata that names only DCP's own types."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    marker = tmp_path / 'MARKER'
    folder = copy / 'dcp' / 'step-00000004'
    with open(folder / '.metadata', 'rb') as f:
        metadata = pickle.load(f)  # still our own file
    key = next(k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
    index = next(i for i in metadata.storage_data if i.fqn == key)
    info = metadata.storage_data[index]
    shard = folder / info.relative_path
    planted = io.BytesIO()
    torch.save(Payload(marker), planted)  # as DCP writes such a value: torch.save'd, appended to a shard
    info.offset, info.length = shard.stat().st_size, len(planted.getvalue())
    with open(shard, 'ab') as f:
        f.write(planted.getvalue())
    with open(folder / '.metadata', 'wb') as f:
        pickle.dump(metadata, f)
    p = run('fsdp_train.py', *args(data_dir), f'--out_dir={copy}', '--max_iters=6', '--eval_interval=2',
            cwd=tmp_path, check=False)
    msg = one_line_error(p)
    assert 'does not fit this model (UnpicklingError: it holds objects other than tensors and plain data' in msg
    assert 'weights_only' not in msg and not marker.exists()
    # an eval of it is told to restore it, not to move it aside (which would leave it nothing to evaluate)
    p = run('fsdp_train.py', *args(data_dir), f'--out_dir={copy}', '--eval_only=True', cwd=tmp_path, check=False)
    assert one_line_error(p).endswith('restore a good copy to evaluate it, or evaluate another checkpoint with '
                                      '--init_from') and not marker.exists()


def planted_dataset(tmp_path, data_dir, marker):
    data = tmp_path / 'data' / 'planted'
    data.mkdir(parents=True)
    for f in ('train.bin', 'val.bin'):
        shutil.copy(data_dir / 'shakespeare_char' / f, data / f)
    (data / 'meta.pkl').write_bytes(pickle.dumps(Payload(marker)))
    return data


@pytest.mark.parametrize('script', [*SCRIPTS, 'bench.py', 'sample.py'])
def test_planted_meta_pkl_runs_nothing(fsdp_run, tmp_path, data_dir, script):
    marker = tmp_path / 'MARKER'
    data = planted_dataset(tmp_path, data_dir, marker)
    if script == 'bench.py':
        p = run(script, '--real_data=True', '--dataset=planted', '--device=cpu', '--compile=False', '--n_layer=1',
                '--n_head=1', '--n_embd=16', '--block_size=16', '--batch_size=2', '--iters=1', '--warmup=0',
                cwd=tmp_path, check=False)
    elif script == 'sample.py':
        p = run(script, f'--out_dir={fsdp_run}', f'--meta_path={data / "meta.pkl"}', '--device=cpu', cwd=tmp_path,
                check=False)
    else:
        p = run(script, *TINY, '--dataset=planted', f'--out_dir={tmp_path / "out"}', '--max_iters=1', cwd=tmp_path,
                check=False)
    msg = one_line_error(p)
    assert 'meta.pkl is not a vocabulary (UnpicklingError: it names posix.system' in msg
    assert not marker.exists() and not (tmp_path / 'out').exists()


@pytest.mark.parametrize('dataset', ['../shared-run', 'ABSOLUTE'])
def test_sample_follows_no_dataset_path_that_a_checkpoint_names(fsdp_run, tmp_path, dataset):
    marker = tmp_path / 'MARKER'
    planted = tmp_path / 'shared-run'
    planted.mkdir()
    (planted / 'meta.pkl').write_bytes(pickle.dumps(Payload(marker)))
    dataset = str(planted) if dataset == 'ABSOLUTE' else dataset
    (tmp_path / 'data').mkdir()  # data/../shared-run is the planted folder
    c = torch.load(fsdp_run / 'ckpt.pt', weights_only=True)  # weights_only-clean, and it names the planted folder
    c['config']['dataset'] = dataset
    torch.save(c, tmp_path / 'ckpt.pt')
    p = run('sample.py', f'--init_from={tmp_path / "ckpt.pt"}', '--device=cpu', cwd=tmp_path, check=False)
    msg = one_line_error(p)
    assert f"the checkpoint's dataset {dataset!r} is a path, which is not followed" in msg
    # the file it names is the user's to pass (a DLRover or Decent-DP run's --data_dir ./ is ./meta.pkl)
    relative = '' if dataset.startswith('/') else ' (relative to the folder the run was started in)'
    assert msg.endswith(f"): pass --meta_path={dataset}/meta.pkl{relative}") and not marker.exists()


@pytest.mark.parametrize('script', ['train.py', 'sample.py', 'export_hf.py'])
def test_planted_ckpt_pt_runs_nothing_and_its_error_gives_no_advice_to_run_it(fsdp_run, tmp_path, data_dir, script):
    marker = tmp_path / 'MARKER'
    out = tmp_path / 'run'
    out.mkdir()
    c = torch.load(fsdp_run / 'ckpt.pt', weights_only=True)
    c['config'] = Payload(marker)
    torch.save(c, out / 'ckpt.pt')
    if script == 'sample.py':
        p = run(script, f'--out_dir={out}', '--device=cpu', cwd=tmp_path, check=False)
    elif script == 'export_hf.py':
        p = run(script, f'--ckpt={out}', f'--out={tmp_path / "hf"}', cwd=tmp_path, check=False)
    else:
        p = run(script, *args(data_dir), f'--out_dir={out}', '--init_from=resume', cwd=tmp_path, check=False)
    msg = one_line_error(p)
    assert 'UnpicklingError: it holds objects other than tensors and plain data (posix.system), refused unread' in msg
    assert 'weights_only' not in msg and 'can still be loaded' not in msg and 'trust' not in msg
    assert not marker.exists() and not (tmp_path / 'hf').exists() and os.listdir(out) == ['ckpt.pt']


DAMAGE = {  # how a DCP folder is damaged: the reason given for it
    'shard missing': 'ValueError: its shard __0_0.distcp is missing',
    'shard truncated': 'ValueError: __0_0.distcp holds 1000 bytes, not',
    'shard garbage': 'UnpicklingError: it is no pickle of tensors and plain data',
    '.metadata truncated': 'UnpicklingError: pickle data was truncated',
    '.metadata missing': 'ValueError: it has no .metadata, which DCP writes last',
}


def damage(folder, how):
    shard, meta = folder / '__0_0.distcp', folder / '.metadata'
    if how == 'shard missing':
        shard.unlink()
    elif how == 'shard truncated':
        shard.write_bytes(shard.read_bytes()[:1000])
    elif how == 'shard garbage':
        shard.write_bytes(b'x' * shard.stat().st_size)
    elif how == '.metadata truncated':
        meta.write_bytes(meta.read_bytes()[:meta.stat().st_size // 2])
    else:
        meta.unlink()


def test_a_long_reason_ends_with_a_whole_sentence(tmp_path):
    # a truncated ckpt.pt's torch error, cut at 200 characters, ended "...that your checkpoint file is)"
    from checkpoint import reason
    torch.save({'model': {'w': torch.zeros(1000)}}, tmp_path / 'ckpt.pt')
    (tmp_path / 'ckpt.pt').write_bytes((tmp_path / 'ckpt.pt').read_bytes()[:1000])
    with pytest.raises(Exception) as e:
        torch.load(tmp_path / 'ckpt.pt', weights_only=True)
    assert len(str(e.value)) > 200
    assert reason(e.value) == "RuntimeError: PytorchStreamReader failed reading zip archive: failed finding central " \
        "directory. This is an internal miniz error."
    assert reason(RuntimeError('x' * 300)) == 'RuntimeError: ' + 'x' * 200  # no sentence: cut as before


@pytest.mark.parametrize('how', DAMAGE)
def test_damaged_dcp_folder_raises_an_exception_with_its_reason(copy, how):
    # DCP's own CheckpointException is a BaseException: `except Exception` would let it through as a traceback
    from checkpoint import checkpoint_iter, load_checkpoint, reason
    folder = copy / 'dcp' / 'step-00000004'
    damage(folder, how)
    with pytest.raises(Exception) as e:
        load_checkpoint(str(folder))
    assert reason(e.value).startswith(DAMAGE[how])
    if how == '.metadata missing':
        assert checkpoint_iter(str(folder)) is None  # a save cut short, or not over yet: no checkpoint so far
    elif how != 'shard garbage':  # the resume search reads no tensors; resuming from it then fails with one line
        with pytest.raises(Exception) as e:
            checkpoint_iter(str(folder))
        assert reason(e.value).startswith(DAMAGE[how])


@pytest.mark.parametrize('script, how', [('sample.py', 'shard garbage'), ('export_hf.py', 'shard missing'),
                                         ('train.py', '.metadata truncated')])
def test_damaged_dcp_folder_gives_one_line(copy, tmp_path, data_dir, script, how):
    folder = copy / 'dcp' / 'step-00000004'
    damage(folder, how)
    if script == 'sample.py':
        p = run(script, f'--init_from={folder}', '--device=cpu', cwd=tmp_path, check=False)
        fix = 'restore a good copy'
    elif script == 'export_hf.py':
        p = run(script, f'--ckpt={folder}', f'--out={tmp_path / "hf"}', cwd=tmp_path, check=False)
        fix = 'restore a good copy'
    else:
        p = run(script, *args(data_dir), f'--init_from={folder}', f'--out_dir={tmp_path / "out"}', cwd=tmp_path,
                check=False)
        fix = 'restore a good copy'  # as the tools say it
    msg = one_line_error(p)
    assert str(folder) in msg and f'({DAMAGE[how]}' in msg and fix in msg
    assert not (tmp_path / 'hf').exists() and not (tmp_path / 'hf.tmp').exists() and not (tmp_path / 'out').exists()
