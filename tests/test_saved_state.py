"""A run's saved state is never lost to an ordinary mistake, in real processes: an eval_only run writes nothing
but its eval rows; an entrypoint never starts afresh over another's run; a checkpoint that cannot be written (a
full disk, from a small tmpfs mounted here) stops the run with a one-line error and the checkpoint before intact;
a damaged metrics.jsonl is set aside, never lost, and the run goes on; a start on a full disk leaves nothing
half-written. One finished 10-step run per entrypoint (evals at 5 and 10) is shared by the tests (shared_run)."""

import errno
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, TINY, begin, one_line_error, read_metrics, run
from launcher import finish

ARGS = ['--gradient_accumulation_steps=1', '--max_iters=10', '--eval_interval=5']


def start(tmp_path, data_dir, out, *args, script='train.py', check=True, nproc=1):
    return run(script, *TINY, f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={out}', *ARGS, *args,
               cwd=tmp_path, check=check, nproc=nproc)


def files(folder):
    """{path in folder: md5} of every file below folder."""
    return {str(p.relative_to(folder)): hashlib.md5(p.read_bytes()).hexdigest()
            for p in sorted(Path(folder).rglob('*')) if p.is_file()}


def iter_of(path):
    return torch.load(path, map_location='cpu', weights_only=True)['iter_num']


def copies(shared, a, b, in_ram):
    """A run folder copied to a and a to b (cp -r, to branch an experiment), and their shared snapshot folder."""
    shutil.copytree(shared, a)
    shutil.copytree(a, b)
    return in_ram(a)


@pytest.fixture
def in_ram():
    """in_ram(run_dir) -> the folder in /dev/shm of the memory snapshots of run_dir's run (its run_id), which the
    test may fill; each one named is removed at the end, however the test ends."""
    named = []

    def folder(run_dir):
        named.append(Path('/dev/shm') / f"nanogpt-{(run_dir / 'run_id').read_text().strip()}")
        return named[-1]
    yield folder
    for path in named:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def small_disk(tmp_path):
    """mount(size) -> a tmpfs of that size, mounted in tmp_path (the tests run as root); unmounted at the end."""
    mounted = []

    def mount(size):
        where = tmp_path / f'disk{len(mounted)}'
        where.mkdir()
        subprocess.run(['mount', '-t', 'tmpfs', '-o', f'size={size}', 'tmpfs', str(where)], check=True)
        mounted.append(where)
        return where
    try:
        yield mount
    finally:
        for where in mounted:
            subprocess.run(['umount', '-l', str(where)], check=False)


def fill(disk):
    """Fills the disk: a file takes every byte that is left."""
    with open(disk / 'filler', 'wb', buffering=0) as f:
        try:
            while True:
                f.write(b'\0' * 4096)
        except OSError:
            pass


@pytest.mark.parametrize('script', ['train.py', 'fsdp_train.py', 'pp_train.py'])
def test_eval_only_writes_nothing_but_its_rows_and_evaluates_the_runs_newest_state(tmp_path, data_dir, shared_run,
                                                                                    script):
    shutil.copytree(shared_run(script, *ARGS), tmp_path / 'run')
    before, lines = files(tmp_path / 'run'), (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()
    last_eval = read_metrics(tmp_path / 'run')[1][-1]
    p = start(tmp_path, data_dir, tmp_path / 'run', '--eval_only=True', script=script)  # init_from=scratch
    assert 'eval_only: evaluating the newest state of the run' in p.stdout and 'at iter 10' in p.stdout, p.stdout
    start(tmp_path, data_dir, tmp_path / 'run', '--eval_only=True', '--init_from=resume', script=script)
    # with --auto_resume=False it evaluated a new, untrained model, and logged that into the run's log
    error = one_line_error(start(tmp_path, data_dir, tmp_path / 'run', '--eval_only=True', '--auto_resume=False',
                                 script=script, check=False))
    assert error.startswith('error: eval_only with auto_resume=False evaluates a new, untrained model'), error
    # a mistyped out_dir evaluated a new, untrained model, whose loss was read as the run's, and exited 0
    error = one_line_error(start(tmp_path, data_dir, tmp_path / 'rn', '--eval_only=True', script=script, check=False))
    assert error == (f"error: eval_only: {tmp_path / 'rn'} holds no saved state of a run to evaluate: point --out_dir "
                     f"at a run's folder, or evaluate a checkpoint or GPT-2 with --init_from=PATH or --init_from=gpt2 "
                     f"(--auto_resume=False evaluates a new, untrained model)")
    assert not (tmp_path / 'rn').exists()
    if script == 'train.py':  # an untrained model's loss, asked for (find_resume decides it alike for all five)
        p = start(tmp_path, data_dir, tmp_path / 'new', '--eval_only=True', '--auto_resume=False', script=script)
        assert 'evaluating a new, untrained model' in p.stdout and 'val loss 4.' in p.stdout, p.stdout
    after = files(tmp_path / 'run')
    assert after.keys() == before.keys()  # no checkpoint, no ckpt.prev.pt rotated, no step folder
    assert all(after[k] == before[k] for k in before if k != 'metrics.jsonl')  # config.json, run_id, checkpoints
    now = (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()
    assert now[:len(lines)] == lines and len(now) == len(lines) + 2  # the log kept whole, two eval rows appended
    for row in map(json.loads, now[-2:]):  # the trained model's val loss, not an untrained one's
        assert row['iter'] == 10 and row['val_loss'] == pytest.approx(last_eval['val_loss'], abs=1e-6)
    if script == 'train.py':  # the log is runlog.py's in every entrypoint
        # a resume keeps them (it drops the rows from its iteration on, which it logs again, but not these), and
        # logs its own rows once
        start(tmp_path, data_dir, tmp_path / 'run', '--max_iters=12')
        log = (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()
        assert log[:len(lines) + 1] == lines[:-1] + now[-2:]  # the run's eval at 10 gone, logged again below
        # config.json says max_iters=12 now; the log keeps what the run was started with (config.json alone lost it)
        row = json.loads(log[len(lines) + 1])  # (out_dir too: the run was copied here)
        assert row['iter'] == 10 and row['settings_changed'].keys() == {'max_iters', 'out_dir'}, row
        assert row['settings_changed']['max_iters'] == [10, 12], row
        assert row['settings_changed']['out_dir'][1] == str(tmp_path / 'run'), row
        assert json.loads((tmp_path / 'run' / 'config.json').read_text())['max_iters'] == 12
        losses, evals = read_metrics(tmp_path / 'run')
        assert sorted(losses) == list(range(12)) and [r['iter'] for r in evals] == [0, 5, 10, 10, 10, 12]


def test_an_eval_of_a_run_whose_checkpoints_are_all_damaged_is_told_to_restore_one(tmp_path, data_dir, shared_run):
    # it was told to move them aside (the eval then scores a new, untrained model) or to use --auto_resume=False
    run_dir = tmp_path / 'run'
    shutil.copytree(shared_run('train.py', *ARGS), run_dir)
    for f in run_dir.glob('ckpt*.pt'):
        f.write_bytes(b'not a checkpoint')
    before = files(run_dir)
    error = one_line_error(start(tmp_path, data_dir, run_dir, '--eval_only=True', check=False))
    assert error.startswith(f"error: checkpoint {run_dir / 'ckpt.pt'} is corrupt or not a training checkpoint (") \
        and error.endswith("): restore a good copy to evaluate it, or evaluate another checkpoint with --init_from")
    assert files(run_dir) == before


def test_an_eval_of_a_checkpoint_that_does_not_fit_the_model_is_told_to_restore_it(tmp_path, data_dir, shared_run):
    # its weights do not fit the shape it was saved with (a file of another project, or edited): an eval was told
    # to move it aside, and would then have scored the version before as the run's newest
    run_dir = tmp_path / 'run'
    shutil.copytree(shared_run('train.py', *ARGS), run_dir)
    ckpt = torch.load(run_dir / 'ckpt.pt', weights_only=True)
    ckpt['model']['lm_head.weight'] = ckpt['model']['lm_head.weight'][:, :-1]
    (run_dir / 'ckpt.pt').unlink()  # a file of its own: best.pt is a link to it
    torch.save(ckpt, run_dir / 'ckpt.pt')
    before = files(run_dir)
    error = one_line_error(start(tmp_path, data_dir, run_dir, '--eval_only=True', check=False))
    assert error.startswith(f"error: checkpoint {run_dir / 'ckpt.pt'} is corrupt or not a training checkpoint (") \
        and error.endswith("): restore a good copy to evaluate it, or evaluate another checkpoint with --init_from")
    error = one_line_error(start(tmp_path, data_dir, run_dir, check=False))  # a resume may set it aside
    assert error.endswith("): move it aside (mv, to a name of your own) or restore a good copy"), error
    assert files(run_dir) == before


def test_an_eval_whose_checkpoint_the_live_run_prunes_meanwhile_is_told_to_run_again(tmp_path):
    # an eval_only run reads a live run's newest step folder without holding out_dir; where the run saved two more
    # and pruned it during the read, the error called it corrupt and advised moving the live run's folder aside
    from checkpoint import create_model
    out = tmp_path / 'run'
    (out / 'dcp' / 'step-00000001').mkdir(parents=True)
    (out / 'dcp' / 'latest').write_text('step-00000001')

    def read_as_the_run_prunes(path):
        shutil.rmtree(path)
        (out / 'dcp' / 'step-00000003').mkdir()
        (out / 'dcp' / 'latest').write_text('step-00000003')
        raise FileNotFoundError(2, 'No such file or directory')
    config = {'out_dir': str(out), 'eval_only': True}
    with pytest.raises(SystemExit) as e:
        create_model(str(out / 'dcp' / 'step-00000001'), read_as_the_run_prunes, 'scratch', {}, config, set())
    assert str(e.value) == f"error: the run in {out} saved a newer checkpoint and pruned " \
        f"{out / 'dcp' / 'step-00000001'} while this eval read it: run the eval again, which reads the newest (or " \
        f"evaluate a copy of one with --init_from)"
    with pytest.raises(SystemExit) as e:  # the folder latest still names, unreadable: damage, as before
        create_model(str(out / 'dcp' / 'step-00000003'), lambda path: torch.load(path), 'scratch', {}, config, set())
    assert 'is corrupt or not a training checkpoint' in str(e.value)


def test_an_eval_of_a_read_only_run_names_how_to_evaluate_it(tmp_path, data_dir, shared_run):
    # a run folder on a read-only mount: an eval_only run cannot log beside it, and the error says how to evaluate it
    shutil.copytree(shared_run('train.py', *ARGS), tmp_path / 'run')
    before, last_eval = files(tmp_path / 'run'), read_metrics(tmp_path / 'run')[1][-1]
    ro = tmp_path / 'ro'
    ro.mkdir()
    subprocess.run(['mount', '--bind', str(tmp_path / 'run'), str(ro)], check=True)
    try:
        subprocess.run(['mount', '-o', 'remount,ro,bind', str(ro)], check=True)
        said = one_line_error(start(tmp_path, data_dir, ro, '--eval_only=True', check=False))
        assert f"(Read-only file system): to evaluate its checkpoint, give it as --init_from={ro}, and a " in said
        start(tmp_path, data_dir, tmp_path / 'log', '--eval_only=True', f'--init_from={ro}')
    finally:
        subprocess.run(['umount', '-l', str(ro)], check=False)
    assert read_metrics(tmp_path / 'log')[1][-1]['val_loss'] == pytest.approx(last_eval['val_loss'], abs=1e-6)
    assert files(tmp_path / 'run') == before


def test_another_entrypoints_run_is_refused_in_one_line_and_left_as_it_was(tmp_path, data_dir, shared_run):
    fsdp = tmp_path / 'an fsdp run'  # a name the shell splits: the commands the errors name quote it
    shutil.copytree(shared_run('fsdp_train.py', *ARGS), fsdp)  # dcp/ only: no ckpt.pt to resume
    before = files(fsdp)
    for args in (['--max_iters=3'], ['--eval_only=True'], ['--auto_resume=False']):
        error = one_line_error(start(tmp_path, data_dir, fsdp, *args, check=False))
        assert 'holds a run of fsdp_train.py' in error and 'dcp/step-00000010, iter 10' in error, error
        # an eval was told to resume it, or to start a new run from its weights
        fix = f"`fsdp_train.py --out_dir='{fsdp}' --eval_only=True`" if 'eval' in args[0] else \
            f"--init_from='{fsdp}'"
        assert fix in error, error
        assert files(fsdp) == before  # no new run_id, its log whole, no ckpt.pt
    p = start(tmp_path, data_dir, fsdp, '--eval_only=True', script='fsdp_train.py')
    assert 'eval_only: evaluating the newest state of the run' in p.stdout and 'at iter 10' in p.stdout
    # its weights start a new run elsewhere, as the error says; a consolidated ckpt.pt as new resumes under train.py
    start(tmp_path, data_dir, tmp_path / 'new', f'--init_from={fsdp}', '--max_iters=1')
    start(tmp_path, data_dir, fsdp, '--init_from=resume', '--max_iters=10', '--save_consolidated=True',
          script='fsdp_train.py')
    p = start(tmp_path, data_dir, fsdp, '--max_iters=12')
    assert 'at iter 10' in p.stdout and iter_of(fsdp / 'ckpt.pt') == 12
    # the run's newest, for the tools, is now train.py's ckpt.pt, not the older step folder that dcp/latest names
    from checkpoint import find_checkpoint
    assert find_checkpoint(str(fsdp)) == str(fsdp / 'ckpt.pt')


def test_a_damaged_log_is_set_aside_and_the_run_goes_on(tmp_path, data_dir, shared_run):
    base = shared_run('train.py', *ARGS)
    shutil.copytree(base, tmp_path / 'run')
    log = tmp_path / 'run' / 'metrics.jsonl'
    bad = b'[1, 2]\n\xff\xfe not utf-8\n{"iter": 11, "lo'  # a JSON list, other bytes, a line cut short
    log.write_bytes(log.read_bytes() + bad)
    p = start(tmp_path, data_dir, tmp_path / 'run', '--max_iters=12')
    assert 'warning: 3 unreadable line(s)' in p.stderr and 'at iter 10' in p.stdout, p.stderr
    aside = list((tmp_path / 'run').glob('metrics.jsonl.damaged-*'))
    assert len(aside) == 1 and aside[0].read_bytes() == bad + b'\n'  # kept, not lost
    assert sorted(read_metrics(tmp_path / 'run')[0]) == list(range(12))
    # a folder in the log's place is moved aside whole
    shutil.copytree(base, tmp_path / 'run2')
    log = tmp_path / 'run2' / 'metrics.jsonl'
    log.unlink()
    log.mkdir()
    (log / 'kept.txt').write_text('mine')
    p = start(tmp_path, data_dir, tmp_path / 'run2', '--max_iters=12')
    assert 'was not a file' in p.stderr and 'at iter 10' in p.stdout
    aside = list((tmp_path / 'run2').glob('metrics.jsonl.damaged-*'))
    assert len(aside) == 1 and (aside[0] / 'kept.txt').read_text() == 'mine'
    assert sorted(read_metrics(tmp_path / 'run2')[0]) == [10, 11]


def test_the_last_eval_of_a_finished_run_is_kept_when_the_run_is_extended(tmp_path, data_dir, shared_run):
    # its eval at iter 10 came before its checkpoint at 10: a run resumed there logs it again only where it evaluates
    # at 10 once more (10 is on its eval_interval), and must not drop it where it does not (off eval_interval 3)
    for interval in ('3', '5'):
        shutil.copytree(shared_run('train.py', *ARGS), tmp_path / interval)
        start(tmp_path, data_dir, tmp_path / interval, '--max_iters=10')  # the same command again: evaluates at 10
        p = start(tmp_path, data_dir, tmp_path / interval, '--max_iters=12', f'--eval_interval={interval}')
        assert 'at iter 10' in p.stdout
        assert [row['iter'] for row in read_metrics(tmp_path / interval)[1]] == [0, 5, 10, 12]
        assert sorted(read_metrics(tmp_path / interval)[0]) == list(range(12))


def test_a_checkpoint_that_cannot_be_written_stops_the_run_with_the_one_before_intact(tmp_path, data_dir,
                                                                                      shared_run, small_disk):
    size = (shared_run('train.py', *ARGS) / 'ckpt.pt').stat().st_size
    disk = small_disk(int(size * 1.6) + 65536)  # room for one checkpoint, not for the next beside it
    out = disk / 'run'
    p = start(tmp_path, data_dir, out, '--max_iters=40', check=False)
    # the save at 10 failed in its thread; a step after it learned so (the ranks' verdict, read a step late) and the
    # run stopped, long before its end (its steps take ~5 ms: how many passed depends on the thread's scheduling)
    error = one_line_error(p)
    assert f'writing the checkpoint {out / "ckpt.pt"} failed' in error and 'No space left on device' in error
    assert 'iter 30' not in p.stdout and iter_of(out / 'ckpt.pt') == 5
    assert not list(out.glob('*.tmp')) and not (out / 'ckpt.prev.pt').exists()
    subprocess.run(['mount', '-o', 'remount,size=8m', str(disk)], check=True)
    p = start(tmp_path, data_dir, out, '--max_iters=14')  # space again: it resumes from the intact one
    assert f'resuming from {out / "ckpt.pt"} at iter 5' in p.stdout and iter_of(out / 'ckpt.pt') == 14


def test_a_failed_sharded_save_stops_every_rank(tmp_path, data_dir, small_disk):
    disk = small_disk('96k')
    p = start(tmp_path, data_dir, disk / 'run', '--gradient_accumulation_steps=2', script='fsdp_train.py', nproc=2,
              check=False)
    assert p.returncode != 0 and 'Traceback' not in p.stderr, p.stderr[-3000:]
    assert f'error: writing the checkpoint {disk / "run" / "dcp" / "step-00000005"} failed' in p.stderr
    assert 'No space left on device' in p.stderr, p.stderr[-3000:]  # what DCP's serializer says does not tell
    assert 'step 10' not in p.stdout and not list((disk / 'run' / 'dcp').iterdir())  # what it wrote of it, gone


@pytest.mark.parametrize('script,kind,nproc', [('fsdp_train.py', 'dcp', 2), ('ds_train.py', 'ds', 1)])
def test_a_sharded_save_that_cannot_begin_stops_every_rank_in_one_line(tmp_path, data_dir, shared_run, small_disk,
                                                                       script, kind, nproc):
    # 16 KiB left: the resume starts (its hold and log rows fit), but not even what goes first: the step folder's
    # extra.pt, which rank 0 writes before the shards, or DeepSpeed's zero_to_fp32.py (first copied here, as on a
    # new disk), which its engine copied in the loop's thread. Each was a traceback (and a hang of the other ranks)
    disk = small_disk('4m')
    shutil.copytree(shared_run(script, *ARGS), disk / 'run')
    for script_copy in (disk / 'run' / kind).glob('zero_to_*.py'):
        script_copy.unlink()
    fill(disk)
    os.truncate(disk / 'filler', (disk / 'filler').stat().st_size - 16384)
    more = ['--max_iters=15', f'--gradient_accumulation_steps={nproc}']  # a micro-step for each rank
    # ds_train.py's ckpt.pt export is written beside its step folder, by a thread of its own: whichever of the two
    # finds the disk full first is the one named, so only the step folder is written here
    more += ['--save_consolidated=False'] * (script == 'ds_train.py')
    p = start(tmp_path, data_dir, disk / 'run', *more, script=script, nproc=nproc, check=False)
    error = one_line_error(p, nproc=2)
    assert f'writing the checkpoint {disk / "run" / kind / "step-00000015"}' in error, p.stderr[-3000:]
    assert 'No space left on device' in error and 'Traceback' not in p.stderr
    assert (disk / 'run' / kind / 'latest').read_text() == 'step-00000010'
    assert not (disk / 'run' / kind / 'step-00000015').exists()  # what was made of it, gone
    assert [f.name for f in (disk / 'run' / kind).iterdir() if f.is_file() and f.name not in ('latest', 'best')] \
        in ([], ['zero_to_torch.py'])  # no script half-copied, no temporary file
    os.remove(disk / 'filler')
    p = start(tmp_path, data_dir, disk / 'run', *more, script=script, nproc=nproc)
    assert 'resuming from' in p.stdout and 'at iter 10' in p.stdout


def test_a_damaged_step_folder_that_a_run_resumes_past_is_kept_aside(tmp_path, data_dir, shared_run):
    # dcp/step-10 with a shard cut short (its other shards good): the run resumed from step-5, and its save at 10
    # removed the damaged folder to write its own there
    run_dir = tmp_path / 'run'
    shutil.copytree(shared_run('fsdp_train.py', *ARGS), run_dir)
    shard = next((run_dir / 'dcp' / 'step-00000010').glob('*.distcp'))
    os.truncate(shard, shard.stat().st_size // 2)
    before = files(run_dir / 'dcp' / 'step-00000010')
    p = start(tmp_path, data_dir, run_dir, script='fsdp_train.py')
    assert f'resuming from {run_dir / "dcp" / "step-00000005"} at iter 5' in p.stdout, p.stdout[-2000:]
    assert files(run_dir / 'dcp' / 'damaged-step-00000010') == before
    assert (run_dir / 'dcp' / 'latest').read_text() == 'step-00000010'  # its own save at 10, written anew


@pytest.mark.parametrize('name', ['ckpt.pt', 'best.pt', 'dcp/latest', 'ds/best'])
def test_a_checkpoint_path_that_is_a_folder_is_refused_at_the_start(tmp_path, data_dir, name):
    # best.pt, or a latest or best file beside step folders, was let through: the run trained until its first save
    (tmp_path / 'run' / name).mkdir(parents=True)
    (tmp_path / 'run' / name / 'mine').write_text('kept')
    error = one_line_error(start(tmp_path, data_dir, tmp_path / 'run', check=False))
    assert f'{name} is a folder' in error
    assert files(tmp_path / 'run') == {f'{name}/mine': hashlib.md5(b'kept').hexdigest()}  # nothing moved or added


def test_a_start_or_resume_on_a_full_disk_is_one_line_and_leaves_nothing_half_written(tmp_path, data_dir,
                                                                                     shared_run, small_disk):
    disk = small_disk('64k')
    fill(disk)
    error = one_line_error(start(tmp_path, data_dir, disk / 'new', check=False))
    assert 'No space left on device' in error and 'error: cannot write' in error
    assert not (disk / 'new').exists() or not list((disk / 'new').iterdir())  # no run_id.tmp, no empty log
    p = start(tmp_path, data_dir, disk / 'new2', '--gradient_accumulation_steps=2', nproc=2, check=False)
    assert 'error: cannot write' in one_line_error(p, nproc=2) and 'Traceback' not in p.stderr  # both ranks stop
    base = shared_run('train.py', *ARGS)
    disk = small_disk('2m')
    shutil.copytree(base, disk / 'run')
    fill(disk)
    before = files(disk / 'run')
    error = one_line_error(start(tmp_path, data_dir, disk / 'run', '--max_iters=12', check=False))
    assert 'No space left on device' in error
    assert files(disk / 'run') == before  # its log whole, no temporary file


def test_a_start_afresh_whose_records_do_not_fit_puts_the_earlier_run_back(tmp_path, data_dir, shared_run,
                                                                           small_disk):
    # the earlier run stayed in before-RUN_ID/ once the start settled it, though the start was refused before it
    # trained: a plain restart (space freed) started a new run in place of resuming it
    disk = small_disk('2m')
    shutil.copytree(shared_run('train.py', *ARGS), disk / 'run')
    before = files(disk / 'run')
    (disk / 'room').write_bytes(b'\0' * 4096)  # a page left once the disk is full: the run's hold fits, not its run_id
    fill(disk)
    (disk / 'room').unlink()
    error = one_line_error(start(tmp_path, data_dir, disk / 'run', '--max_iters=12', '--auto_resume=False',
                                 check=False))
    assert 'No space left on device' in error and not list((disk / 'run').glob('before-*')), error
    assert files(disk / 'run') == before  # all of it back where it was, nothing of the new run's
    (disk / 'filler').unlink()
    p = start(tmp_path, data_dir, disk / 'run', '--max_iters=12')
    assert f"resuming from {disk / 'run' / 'ckpt.pt'} at iter 10" in p.stdout, p.stdout[-2000:]


PRIVATE_SHM = '''import ctypes, os, runpy, subprocess, sys
# this process alone in a mount namespace of its own (unshare -m: it has no other threads yet), its mounts private,
# and there a /dev/shm mounted with the options given (tests/own_shm.py binds a node's folder there instead)
if ctypes.CDLL(None, use_errno=True).unshare(0x00020000) != 0:  # CLONE_NEWNS
    sys.exit(f'unshare: {os.strerror(ctypes.get_errno())}')
subprocess.run(['mount', '--make-rprivate', '/'], check=True)
subprocess.run(['mount', '-t', 'tmpfs', '-o', sys.argv[1], 'tmpfs', '/dev/shm'], check=True)
sys.argv = sys.argv[2:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))  # the repo, as for the script run alone
runpy.run_path(sys.argv[0], run_name='__main__')
'''


@pytest.mark.parametrize('script,shm', [('train.py', 'size=16k'), ('train.py', 'ro'), ('fsdp_train.py', 'ro'),
                                        ('pp_train.py', 'ro'), ('ds_train.py', 'ro'), ('decent_train.py', 'ro')])
def test_a_memory_snapshot_that_cannot_be_written_is_a_warning(tmp_path, data_dir, script, shm):
    # a /dev/shm of 16 KiB, or a read-only one where not even the run's snapshot folder can be made, in a mount
    # namespace of the run's own (unmounted as it ends): its snapshots fail, its storage checkpoint not. Forked
    # (run()), as `unshare -m` would start it: a fresh interpreter's start-up was most of this test's time
    (tmp_path / 'private_shm.py').write_text(PRIVATE_SHM)
    p = run(tmp_path / 'private_shm.py', f'size=16k,{shm}', REPO / script, *TINY,
            f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={tmp_path / "run"}', *ARGS, '--max_iters=4',
            '--save_memory_interval=2', *(['--save_consolidated=True'] if script in ('fsdp_train.py', 'pp_train.py')
                                          else []), cwd=tmp_path)
    assert 'warning: the memory snapshot' in p.stderr and 'training goes on' in p.stderr
    assert iter_of(tmp_path / 'run' / 'ckpt.pt') == 4


def test_a_run_resumed_from_a_snapshot_past_a_lowered_max_iters_saves_it_before_it_frees_it(tmp_path, data_dir,
                                                                                            shared_run, in_ram):
    # killed at 12 with its snapshot at 12 and its checkpoint at 10, resumed with --max_iters=11: the run ended at
    # once, with no eval and so no save, and its end removed the snapshot, its newest state
    run_dir = tmp_path / 'run'
    shutil.copytree(shared_run('train.py', *ARGS), run_dir)
    start(tmp_path, data_dir, run_dir, '--max_iters=12')
    snapshots = in_ram(run_dir)
    snapshots.mkdir()
    shutil.copy(run_dir / 'ckpt.pt', snapshots / 'ckpt.pt')  # its snapshot at 12
    (run_dir / 'ckpt.prev.pt').replace(run_dir / 'ckpt.pt')  # its checkpoint at 10
    p = start(tmp_path, data_dir, run_dir, '--max_iters=11')
    assert f'resuming from {snapshots / "ckpt.pt"} at iter 12' in p.stdout, p.stdout[-2000:]
    assert iter_of(run_dir / 'ckpt.pt') == 12 and iter_of(run_dir / 'ckpt.prev.pt') == 10
    # with --always_save_checkpoint=False (the CPU recipe's) an eval that is no new best saved nothing, and the end
    # freed the snapshot all the same
    snapshots.mkdir()
    state = torch.load(run_dir / 'ckpt.pt', weights_only=True)
    torch.save({**state, 'best_val_loss': 0.0}, snapshots / 'ckpt.pt')  # a best that no eval beats
    (run_dir / 'ckpt.prev.pt').replace(run_dir / 'ckpt.pt')
    p = start(tmp_path, data_dir, run_dir, '--max_iters=11', '--always_save_checkpoint=False')
    assert f'resuming from {snapshots / "ckpt.pt"} at iter 12' in p.stdout, p.stdout[-2000:]
    assert iter_of(run_dir / 'ckpt.pt') == 12 and iter_of(run_dir / 'ckpt.prev.pt') == 10


def test_a_copy_of_a_run_folder_never_resumes_the_others_memory_snapshot_a_moved_one_does(tmp_path, data_dir,
                                                                                          shared_run, in_ram):
    # the copy holds the same run_id, which names the snapshot folder in /dev/shm: run A resumed the snapshot that
    # its copy B left there (killed), a state A never trained, and its saves then pushed A's own checkpoints out
    a, b = tmp_path / 'a', tmp_path / 'b'
    snapshots = copies(shared_run('train.py', *ARGS), a, b, in_ram)
    start(tmp_path, data_dir, b, '--max_iters=15', '--learning_rate=0.1')
    snapshots.mkdir()
    shutil.copy(b / 'ckpt.pt', snapshots / 'ckpt.pt')  # what B's snapshot held when it was killed
    p = start(tmp_path, data_dir, a, '--max_iters=12')
    assert f'resuming from {a / "ckpt.pt"} at iter 10' in p.stdout, p.stdout[-2000:]
    assert f'passing over the memory snapshot {snapshots / "ckpt.pt"}, which a run in {b} saved' in p.stdout
    # B's snapshot, its newest state, was neither replaced by A's snapshots nor removed at A's end: kept in B
    kept_as = b / f"snapshots.kept-{snapshots.name[len('nanogpt-'):]}-{socket.gethostname()}"
    assert f"the copy's memory snapshots moved from {snapshots} (RAM) to {kept_as}, where the run in {b} resumes " \
        f"them" in p.stdout, p.stdout[-2000:]
    assert iter_of(kept_as / 'ckpt.pt') == 15
    # B renamed (mv b c) is B still, which resumes its own snapshot
    b.rename(tmp_path / 'c')
    snapshots.mkdir(exist_ok=True)  # A's finish freed it, its own in it only
    shutil.copy(tmp_path / 'c' / 'ckpt.pt', snapshots / 'ckpt.pt')  # its snapshot at 15
    p = start(tmp_path, data_dir, tmp_path / 'c', '--max_iters=16', '--learning_rate=0.1')
    assert f'resuming from {snapshots / "ckpt.pt"} at iter 15' in p.stdout, p.stdout[-2000:]
    # C deleted after its snapshot (at 16): A is not C moved (another inode), so it resumes its own state still
    snapshots.mkdir(exist_ok=True)
    shutil.copy(tmp_path / 'c' / 'ckpt.pt', snapshots / 'ckpt.pt')
    shutil.rmtree(tmp_path / 'c')
    p = start(tmp_path, data_dir, a, '--max_iters=13')
    assert f'resuming from {a / "ckpt.pt"} at iter 12' in p.stdout, p.stdout[-2000:]
    copy_as = a / f"snapshots.copy-{snapshots.name[len('nanogpt-'):]}-{socket.gethostname()}"
    assert iter_of(copy_as / 'ckpt.pt') == 16  # C's, kept in A: C's folder is gone
    # a copy of them cut short by a crash (its .tmp) is left as it is, and they are kept under another name
    snapshots.mkdir(exist_ok=True)
    torch.save({**torch.load(a / 'ckpt.pt', weights_only=True), 'out_dir': str(tmp_path / 'd'),
                'out_dir_ino': tmp_path.stat().st_ino}, snapshots / 'ckpt.pt')  # another copy's, D's
    cut = a / f"{copy_as.name}.2.tmp"
    cut.mkdir()
    p = start(tmp_path, data_dir, a, '--max_iters=14')
    assert f"moved from {snapshots} (RAM) to {copy_as}.3" in p.stdout, p.stdout[-2000:]
    assert cut.is_dir() and iter_of(a / f"{copy_as.name}.3" / 'ckpt.pt') == 13



def test_a_copys_snapshot_found_as_a_run_starts_afresh_is_kept_apart_from_the_earlier_runs(tmp_path, data_dir,
                                                                                         shared_run, in_ram):
    # B (a copy of A) killed with its snapshot at 15, then A started afresh: the snapshot went with A's earlier run
    # into A/before-RUN_ID/snapshots.before-*, and going back to that run resumed B's state as its own
    a, b = tmp_path / 'a', tmp_path / 'b'
    snapshots = copies(shared_run('train.py', *ARGS), a, b, in_ram)
    run_id = (a / 'run_id').read_text().strip()
    start(tmp_path, data_dir, b, '--max_iters=15', '--learning_rate=0.1')
    snapshots.mkdir()
    shutil.copy(b / 'ckpt.pt', snapshots / 'ckpt.pt')
    p = start(tmp_path, data_dir, a, '--max_iters=2', '--auto_resume=False')
    kept_as = b / f'snapshots.kept-{run_id}-{socket.gethostname()}'  # in B, which resumes it
    assert f"the copy's memory snapshots moved from {snapshots} (RAM) to {kept_as}" in p.stdout, p.stdout[-2000:]
    assert iter_of(kept_as / 'ckpt.pt') == 15 and not list((a / f'before-{run_id}').glob('snapshots.*'))
    p = start(tmp_path, data_dir, a / f'before-{run_id}', '--max_iters=12')
    assert f"resuming from {a / f'before-{run_id}' / 'ckpt.pt'} at iter 10" in p.stdout, p.stdout[-2000:]


def test_a_copys_snapshot_passed_over_is_kept_in_the_copys_folder_which_resumes_it(tmp_path, data_dir, shared_run,
                                                                                    in_ram):
    # B (a copy of A) killed at 15 with its checkpoint at 10, then A resumed on that node: B's snapshot was kept in A,
    # and B's next start went on from its checkpoint at 10
    a, b = tmp_path / 'a', tmp_path / 'b'
    snapshots = copies(shared_run('train.py', *ARGS), a, b, in_ram)
    start(tmp_path, data_dir, b, '--max_iters=15', '--learning_rate=0.1')
    snapshots.mkdir()
    shutil.copy(b / 'ckpt.pt', snapshots / 'ckpt.pt')
    (b / 'ckpt.prev.pt').replace(b / 'ckpt.pt')  # its checkpoint at 10
    start(tmp_path, data_dir, a, '--max_iters=12')
    kept_as = b / f"snapshots.kept-{snapshots.name[len('nanogpt-'):]}-{socket.gethostname()}"
    p = start(tmp_path, data_dir, b, '--max_iters=16', '--learning_rate=0.1')
    assert f"resuming from {kept_as / 'ckpt.pt'} at iter 15" in p.stdout, p.stdout[-2000:]
    assert iter_of(b / 'ckpt.pt') == 16 and iter_of(kept_as / 'ckpt.pt') == 15

def test_a_copy_with_the_same_inode_number_on_another_filesystem_never_resumes_the_others_snapshot(tmp_path,
                                                                                                   data_dir,
                                                                                                   shared_run, in_ram):
    # a btrfs or ZFS snapshot (or clone) of a run folder keeps its inode numbers on another device: B, such a copy of
    # A, left its snapshot at 15, which A took for its own by the inode alone
    a, b = tmp_path / 'a', tmp_path / 'b'
    snapshots = copies(shared_run('train.py', *ARGS), a, b, in_ram)
    start(tmp_path, data_dir, b, '--max_iters=15', '--learning_rate=0.1')
    snapshots.mkdir()
    state = torch.load(b / 'ckpt.pt', weights_only=True)
    torch.save({**state, 'out_dir_ino': a.stat().st_ino, 'out_dir_dev': a.stat().st_dev + 1},
               snapshots / 'ckpt.pt')  # as B's snapshot holds them, on its filesystem
    p = start(tmp_path, data_dir, a, '--max_iters=12')
    assert f'resuming from {a / "ckpt.pt"} at iter 10' in p.stdout, p.stdout[-2000:]
    assert iter_of(next(b.glob('snapshots.kept-*')) / 'ckpt.pt') == 15  # kept in B, which resumes it


def test_a_copys_snapshots_that_do_not_fit_in_out_dir_are_left_whole_in_ram(tmp_path, data_dir, shared_run,
                                                                           small_disk, in_ram):
    # run A's disk has no room to keep its copy B's snapshot (iter 15) that A passes over: that was a warning, and
    # then A's own snapshots replaced it in the shared folder in /dev/shm, and A's end removed the folder
    a, b = small_disk('2m') / 'a', tmp_path / 'b'
    snapshots = copies(shared_run('train.py', *ARGS), a, b, in_ram)
    start(tmp_path, data_dir, b, '--max_iters=15', '--learning_rate=0.1')
    snapshots.mkdir()
    shutil.copy(b / 'ckpt.pt', snapshots / 'ckpt.pt')  # what B's snapshot held when it was killed
    shutil.rmtree(b)  # deleted since: its snapshot is kept in A (in B, where B's next start would resume it, else)
    before = files(snapshots)
    fill(a.parent)
    os.truncate(a.parent / 'filler', (a.parent / 'filler').stat().st_size - 65536)  # A's log rows fit
    # a learning rate of 0: its evals at 10 and 12 are no better, so A saves no checkpoint either
    p = start(tmp_path, data_dir, a, '--max_iters=12', '--save_memory_interval=1', '--learning_rate=0',
              '--min_lr=0', '--always_save_checkpoint=False')
    assert f'resuming from {a / "ckpt.pt"} at iter 10' in p.stdout, p.stdout[-2000:]
    assert f"the copy's memory snapshots stay in {snapshots}" in p.stdout and 'No space left' in p.stdout
    assert 'this run takes no memory snapshots of its own' in p.stdout, p.stdout[-2000:]
    assert files(snapshots) == before and not list(a.glob('snapshots.*'))


def test_a_run_resuming_its_own_snapshot_keeps_the_copys_beside_it_in_out_dir(tmp_path, data_dir, shared_run, in_ram):
    # fsdp_train.py's two files a rank: A (killed) left its own newest, and its copy B's snapshot shares the folder
    # (both ran at once). A resumed from its own and kept B's in place, where A's next snapshot replaced it
    a, b = tmp_path / 'a', tmp_path / 'b'
    snapshots = copies(shared_run('fsdp_train.py', *ARGS), a, b, in_ram)
    mine, theirs = snapshots / 'rank-0-of-1x1.pt', snapshots / 'rank-0-of-1x1.prev.pt'
    killed, started = begin('fsdp_train.py', *TINY, f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={a}',
                            *ARGS, '--max_iters=100000', '--save_memory_interval=1', cwd=tmp_path)
    try:
        while not theirs.exists():
            assert killed.exitcode is None
            time.sleep(0.01)
        killed.kill()
        finish(started)
        state = torch.load(theirs, weights_only=True)  # A's snapshot before its newest, made B's
        torch.save({**state, 'out_dir': str(b), 'out_dir_ino': b.stat().st_ino}, theirs)
        before, newest = files(snapshots), iter_of(mine)
        p = start(tmp_path, data_dir, a, f'--max_iters={newest + 2}', '--save_memory_interval=1',
                  script='fsdp_train.py')
        assert f'resuming from {mine} at iter {newest}' in p.stdout, p.stdout[-2000:]
        kept_as = next(b.glob('snapshots.kept-*'))  # in B, which resumes it
        assert files(kept_as) == {theirs.name: before[theirs.name]}  # B's, as it was; A's own stayed for A
        assert not snapshots.exists()  # A's end freed its own
    finally:
        killed.kill()


def test_a_copys_snapshot_of_another_layout_is_passed_over_and_kept(tmp_path, data_dir, shared_run, in_ram):
    # B, a copy of A's folder, killed at 2 ranks: A at 1 rank was refused, B's snapshot named as "this run's newest
    # state", and told to resume at B's layout or to start afresh
    a, b = tmp_path / 'a', tmp_path / 'b'
    snapshots = copies(shared_run('fsdp_train.py', *ARGS), a, b, in_ram)
    snapshots.mkdir()
    theirs = {'iter_num': 15, 'run_id': snapshots.name[8:], 'out_dir': str(b), 'out_dir_ino': b.stat().st_ino}
    torch.save(theirs, snapshots / 'rank-0-of-2x1.pt')  # what B's rank 0 left (its shards are not needed here)
    before = files(snapshots)
    p = start(tmp_path, data_dir, a, '--max_iters=12', script='fsdp_train.py')
    assert f'resuming from {a / "dcp" / "step-00000010"} at iter 10' in p.stdout, p.stdout[-2000:]
    assert files(next(b.glob('snapshots.kept-*'))) == before and not snapshots.exists()  # kept in B


@pytest.mark.parametrize('afresh', [False, True])
def test_a_copy_started_beside_its_running_original_leaves_the_originals_snapshots_alone(tmp_path, data_dir,
                                                                                        shared_run, afresh, in_ram):
    # A and its copy B at once on one node, one snapshot folder in RAM: B moved A's live snapshots into its own
    # out_dir, then each replaced the other's, and B's end removed the folder with A's newest state in it. B started
    # afresh (--auto_resume=False) took that folder for an earlier run's, moved it into B/snapshots.before-* and
    # removed it from RAM while A still wrote there
    a, b = tmp_path / 'a', tmp_path / 'b'
    snapshots = copies(shared_run('train.py', *ARGS), a, b, in_ram)
    running, started = begin('train.py', *TINY, f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={a}', *ARGS,
                             '--max_iters=100000', '--save_memory_interval=1', cwd=tmp_path)
    try:
        while not (snapshots / 'ckpt.pt').exists():
            assert running.exitcode is None
            time.sleep(0.01)
        p = start(tmp_path, data_dir, b, '--max_iters=14', '--save_memory_interval=1',
                  *['--auto_resume=False'] * afresh)
        assert f'{snapshots} is in use by a run of a copy of this run' in p.stdout, p.stdout[-2000:]
        if afresh:  # a new run, under an id and with snapshots of its own
            assert (b / 'run_id').read_text() != (a / 'run_id').read_text()
        else:
            assert 'this run takes no memory snapshots of its own while that run lasts' in p.stdout
        assert running.exitcode is None and not list(b.glob('snapshots.*')) and not list(b.glob('*/snapshots.*'))
        assert torch.load(snapshots / 'ckpt.pt', weights_only=True)['out_dir'] == str(a)  # A's, and A's only
        assert (snapshots / 'run.lock').exists()  # A's hold, still
    finally:
        running.kill()
        finish(started)


def test_a_copy_run_with_a_relative_out_dir_from_its_own_folder_never_resumes_the_originals_snapshot(tmp_path,
                                                                                                    data_dir,
                                                                                                    shared_run, in_ram):
    # a project folder copied whole (cp -r p1 p2), each run as --out_dir=out from its own folder: the snapshot's
    # config names `out`, which from p2 is p2/out, so p2 took p1's snapshot (iter 15) for its own
    p1, p2 = tmp_path / 'p1', tmp_path / 'p2'
    shutil.copytree(shared_run('train.py', *ARGS), p1 / 'out')
    shutil.copytree(p1, p2)
    start(p1, data_dir, 'out', '--max_iters=15', '--learning_rate=0.1')
    snapshots = in_ram(p1 / 'out')
    snapshots.mkdir()
    shutil.copy(p1 / 'out' / 'ckpt.pt', snapshots / 'ckpt.pt')  # what p1's snapshot held when it was killed
    p = start(p2, data_dir, 'out', '--max_iters=12')
    assert 'resuming from out/ckpt.pt at iter 10' in p.stdout, p.stdout[-2000:]
    assert iter_of(next((p1 / 'out').glob('snapshots.kept-*')) / 'ckpt.pt') == 15  # p1's, kept where p1 resumes it


def test_a_copy_of_a_deepspeed_run_folder_never_resumes_the_others_memory_snapshot(tmp_path, data_dir, shared_run,
                                                                                   in_ram):
    # DeepSpeed's snapshots are folders of the engine's files, our state among them; here the run's own folder's
    # snapshot at 10 (its out_dir the shared run's), beside the copy's checkpoint at 10
    shared = shared_run('ds_train.py', *ARGS)
    copy = tmp_path / 'copy'
    shutil.copytree(shared, copy)
    snapshots = in_ram(copy)
    snapshots.mkdir()
    shutil.copytree(shared / 'ds' / 'step-00000010', snapshots / 'step-00000010')
    (snapshots / 'latest').write_text('step-00000010')
    p = start(tmp_path, data_dir, copy, '--max_iters=12', script='ds_train.py')
    assert f'resuming from {copy / "ds" / "step-00000010"} at iter 10' in p.stdout, p.stdout[-2000:]
    assert f'passing over the memory snapshot {snapshots / "step-00000010"}, which a run in {shared}' in p.stdout


def test_a_deepspeed_run_at_another_stage_never_goes_on_from_an_export_older_than_its_newest_folder(tmp_path,
                                                                                                     data_dir,
                                                                                                     shared_run):
    # save_consolidated=False after 10: the ckpt.pt export stays at 10, ds/step-15 (ZeRO-2) is the newest state. At
    # another stage the run went on from the export at 10, and its save at 15 replaced that folder
    run_dir = tmp_path / 'run'
    shutil.copytree(shared_run('ds_train.py', *ARGS), run_dir)
    start(tmp_path, data_dir, run_dir, '--max_iters=15', '--save_consolidated=False', script='ds_train.py')
    before = files(run_dir / 'ds')
    p = start(tmp_path, data_dir, run_dir, '--max_iters=20', '--zero_stage=3', script='ds_train.py', check=False)
    error = one_line_error(p)
    assert f"the run's newest state, {run_dir / 'ds' / 'step-00000015'}, was written by 1 ranks at zero_stage=2" \
        in error and 'use 1 ranks and --zero_stage=2' in error, error
    assert 'auto-resume' not in p.stdout, p.stdout  # not announced as going on, then refused
    assert files(run_dir / 'ds') == before and iter_of(run_dir / 'ckpt.pt') == 10
    # what it says to do: under a config's always_save_checkpoint=False the finished run's final eval, no new best,
    # saved no export without --always_save_checkpoint=True (test_ds.py runs these flags on a finished run)
    flags = error.split('use 1 ranks and ')[1].split(' until')[0].split()
    assert flags == ['--zero_stage=2', '--save_consolidated=True', '--always_save_checkpoint=True'], error


def test_a_deepspeed_save_to_the_step_of_its_whole_folder_keeps_the_folder_and_records_a_new_best(tmp_path, data_dir,
                                                                                                   shared_run, in_ram):
    # a run killed after its ds/step-10 and its memory snapshot of step 10, resumed from the snapshot: its eval at 10
    # removed the folder that latest names to write it again, and a crash meanwhile left the step in RAM alone. Here
    # that eval is a new best (the snapshot saved before its loss was known): the engine's model-states file, which
    # holds our state and so the best's val loss, is the one file written again, whole or not at all
    from checkpoint import where_saved
    from ds_state import DS_SAFE_GLOBALS  # here: it imports DeepSpeed
    run_dir = tmp_path / 'run'
    shutil.copytree(shared_run('ds_train.py', *ARGS), run_dir)
    folder, snapshots = run_dir / 'ds' / 'step-00000010', in_ram(run_dir)
    shutil.copytree(folder, snapshots / 'step-00000010')
    (snapshots / 'latest').write_text('step-00000010')
    states = lambda folder: folder / 'mp_rank_00_model_states.pt'

    def load(path):
        with torch.serialization.safe_globals(DS_SAFE_GLOBALS):
            return torch.load(path, weights_only=True)
    saved = load(states(folder))
    torch.save({**saved, **where_saved(run_dir), 'best_val_loss': 1e9}, states(snapshots / 'step-00000010'))
    (folder / 'marker').touch()  # gone if the folder is removed to be written again
    kept = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.iterdir() if p != states(folder)}
    # that file's write fails (a folder in place of its temporary file): the run stops in one line, the folder whole
    (run_dir / 'best.pt').unlink()  # its val loss would be the best so far
    (folder / 'mp_rank_00_model_states.pt.tmp').mkdir()
    error = one_line_error(start(tmp_path, data_dir, run_dir, script='ds_train.py', check=False))
    assert f"the newest complete one, {folder}, is intact" in error, error
    (folder / 'mp_rank_00_model_states.pt.tmp').rmdir()
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.iterdir() if p != states(folder)} == kept
    assert load(states(folder))['val_loss'] == saved['val_loss']
    (run_dir / 'best.pt').unlink()  # its export's, which the failed save wrote
    p = start(tmp_path, data_dir, run_dir, script='ds_train.py')
    assert f'resuming from {snapshots / "step-00000010"} at iter 10' in p.stdout, p.stdout[-2000:]
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.iterdir() if p != states(folder)} == kept
    assert (run_dir / 'ds' / 'latest').read_text() == 'step-00000010'
    assert (run_dir / 'ds' / 'best').read_text() == 'best-step-00000010'
    val_loss = read_metrics(run_dir)[1][-1]['val_loss']
    for state in (load(states(folder)), load(states(run_dir / 'ds' / 'best-step-00000010'))):
        assert state['val_loss'] == state['best_val_loss'] == pytest.approx(val_loss, abs=1e-6)
        assert state['iter_num'] == 10 and torch.equal(state['data_rng'], saved['data_rng'])
        assert all(torch.equal(a, b) for a, b in zip(state['module'].values(), saved['module'].values()))


def test_a_deepspeed_run_at_another_layout_never_goes_on_past_its_newer_memory_snapshot(tmp_path, data_dir,
                                                                                       shared_run, in_ram):
    # the engine's snapshot at 10 (ZeRO-2, 1 rank), out_dir's newest state at 5: at ZeRO-3 the run went on from the
    # export at 5 without a word, and its end removed the snapshot with the steps since (with no export, it started
    # afresh under a new id and left the snapshot in RAM, which nothing names any more)
    from checkpoint import where_saved
    from ds_state import DS_SAFE_GLOBALS  # here: it imports DeepSpeed
    run_dir = tmp_path / 'run'
    shutil.copytree(shared_run('ds_train.py', *ARGS), run_dir)
    snapshots = in_ram(run_dir)
    snapshots.mkdir()
    shutil.move(run_dir / 'ds' / 'step-00000010', snapshots / 'step-00000010')
    (snapshots / 'latest').write_text('step-00000010')
    states = snapshots / 'step-00000010' / 'mp_rank_00_model_states.pt'
    with torch.serialization.safe_globals(DS_SAFE_GLOBALS):
        state = torch.load(states, weights_only=True)
    state.update(where_saved(run_dir))  # saved for this folder, as the run's own snapshot is
    torch.save(state, states)
    (run_dir / 'ds' / 'latest').write_text('step-00000005')
    os.replace(run_dir / 'ckpt.prev.pt', run_dir / 'ckpt.pt')  # the export of iter 5
    before = files(snapshots)
    error = one_line_error(start(tmp_path, data_dir, run_dir, '--max_iters=12', '--zero_stage=3',
                                 script='ds_train.py', check=False))
    assert f"the run's newest state, {snapshots / 'step-00000010'}, was written by 1 ranks at zero_stage=2" \
        in error and 'use 1 ranks and --zero_stage=2' in error, error
    assert files(snapshots) == before and iter_of(run_dir / 'ckpt.pt') == 5
    # an eval of it was told to train with that layout until it saved an export
    error = one_line_error(start(tmp_path, data_dir, run_dir, '--zero_stage=3', '--eval_only=True',
                                 script='ds_train.py', check=False))
    assert error.endswith("ZeRO's shards load only so: evaluate it with 1 ranks and --zero_stage=2"), error
    assert files(snapshots) == before and iter_of(run_dir / 'ckpt.pt') == 5
    p = start(tmp_path, data_dir, run_dir, '--eval_only=True', script='ds_train.py')
    assert f"evaluating the newest state of the run in {run_dir}, {snapshots / 'step-00000010'} at iter 10" in p.stdout


def test_a_deepspeed_run_resumed_in_another_dtype_goes_on_from_its_export(tmp_path, data_dir, shared_run):
    # DeepSpeed's bf16 optimizer looked for files of its own in the folder saved in fp32, and the run stopped calling
    # that good checkpoint corrupt ("move it aside"): the dtype is part of the layout that ZeRO's shards resume at
    run_dir = tmp_path / 'run'
    shutil.copytree(shared_run('ds_train.py', *ARGS), run_dir)
    p = start(tmp_path, data_dir, run_dir, '--max_iters=12', '--dtype=bfloat16', script='ds_train.py')
    assert 'was written by 1 ranks at zero_stage=2, dtype=float32, not 1 at zero_stage=2, dtype=bfloat16: ' \
           f"continuing from the consolidated {run_dir / 'ckpt.pt'}" in p.stdout, p.stdout[-3000:]
    assert iter_of(run_dir / 'ckpt.pt') == 12


@pytest.mark.parametrize('writer,saved', [
    ('train.py', {'ckpt.pt': 15}), ('decent_train.py', {'rank-0-of-1.pt': 15}),
    # two ranks, rank 1 killed as it wrote step 15: whole at 10 only, which the run's ckpt.pt holds too
    ('decent_train.py', {'rank-0-of-2.pt': 15, 'rank-0-of-2.prev.pt': 10, 'rank-1-of-2.pt': 10,
                         'rank-1-of-2.prev.pt': 5})], ids=['train.py', 'decent_train.py', 'decent_train.py-cut'])
def test_another_entrypoint_never_goes_on_past_the_runs_newer_memory_snapshot(tmp_path, data_dir, shared_run, writer,
                                                                              saved, in_ram):
    # train.py killed with its snapshot at 15 and its ckpt.pt at 10: fsdp_train.py, started over the run, went on
    # from the ckpt.pt at 10 without a word, and its end removed the snapshot with the steps since. decent_train.py's
    # was refused, as another layout's, and the error had fsdp_train.py resume "with the layout in its name": none.
    # A snapshot of several ranks counts at the newest step that they all hold: the cut one was refused as at 15
    from checkpoint import where_saved
    run_dir = tmp_path / 'run'
    shutil.copytree(shared_run('train.py', *ARGS), run_dir)
    snapshots = in_ram(run_dir)
    snapshots.mkdir()
    state = torch.load(run_dir / 'ckpt.pt', weights_only=True)
    if writer == 'decent_train.py':  # its key in the config names it
        state['config'] = {**state['config'], 'topology': 'complete'}
    for name, it in saved.items():
        torch.save({**state, **where_saved(run_dir), 'iter_num': it}, snapshots / name)
    before = files(run_dir), files(snapshots)
    p = start(tmp_path, data_dir, run_dir, '--max_iters=12', script='fsdp_train.py', check=False)
    if len(saved) > 1:
        assert f'resuming from {run_dir / "ckpt.pt"} at iter 10' in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
        return
    error, snapshot = one_line_error(p), next(iter(saved))
    assert f"newest state (iter 15) is the memory snapshot {snapshots / snapshot} of {writer}" in error \
        and f'continue the run with `{writer} --out_dir={run_dir}`' in error, error
    assert (files(run_dir), files(snapshots)) == before
    # an eval was told the same, or to start afresh with --auto_resume=False: an eval of a new, untrained model
    p = start(tmp_path, data_dir, run_dir, '--eval_only=True', script='fsdp_train.py', check=False)
    assert one_line_error(p).endswith(f"of {writer}, which fsdp_train.py does not read: evaluate it with `{writer} "
                                      f"--out_dir={run_dir} --eval_only=True` (under torchrun as before)")
    assert (files(run_dir), files(snapshots)) == before
    if writer == 'train.py':  # as it says (decent_train.py's here is train.py's state under its name)
        p = start(tmp_path, data_dir, run_dir, '--eval_only=True', script=writer)
        assert f'evaluating the newest state of the run in {run_dir}, {snapshots / snapshot} at iter 15' in p.stdout



def test_another_entrypoint_never_goes_on_past_the_runs_newer_snapshot_kept_in_its_folder(tmp_path, data_dir,
                                                                                          shared_run):
    # the same, with train.py's snapshot kept in the run's folder (a start afresh over it kept it there, and this is
    # the return to it, --out_dir=RUN/before-RUN_ID): fsdp_train.py went on from the ckpt.pt at 10 without a word
    run_dir = tmp_path / 'run'
    shutil.copytree(shared_run('train.py', *ARGS), run_dir)
    kept = run_dir / f"snapshots.before-{(run_dir / 'run_id').read_text().strip()}-node1"
    kept.mkdir()
    torch.save({**torch.load(run_dir / 'ckpt.pt', weights_only=True), 'iter_num': 15}, kept / 'ckpt.pt')
    before = files(run_dir)
    p = start(tmp_path, data_dir, run_dir, '--max_iters=12', script='fsdp_train.py', check=False)
    error = one_line_error(p)
    assert f"newest state (iter 15) is the memory snapshot {kept / 'ckpt.pt'} of train.py" in error, error
    assert files(run_dir) == before
    p = start(tmp_path, data_dir, run_dir, '--max_iters=16')  # as it says
    assert f"resuming from {kept / 'ckpt.pt'} at iter 15" in p.stdout, p.stdout[-2000:]

def test_a_deepspeed_run_resuming_its_own_snapshot_keeps_the_copys_newer_one(tmp_path, data_dir, shared_run, in_ram):
    # A's snapshot at 12 (latest names it) beside its copy B's at 15, which the listing up to latest leaves out:
    # A's snapshot at 15 removed B's folder to write its own there
    a, b = tmp_path / 'a', tmp_path / 'b'
    snapshots = copies(shared_run('ds_train.py', *ARGS), a, b, in_ram)
    start(tmp_path, data_dir, a, '--max_iters=12', script='ds_train.py')
    start(tmp_path, data_dir, b, '--max_iters=15', script='ds_train.py')
    snapshots.mkdir()
    shutil.copytree(a / 'ds' / 'step-00000012', snapshots / 'step-00000012')  # A's own, where it was killed
    shutil.copytree(b / 'ds' / 'step-00000015', snapshots / 'step-00000015')  # B's, killed as it saved latest
    (snapshots / 'latest').write_text('step-00000012')
    before = files(snapshots / 'step-00000015')
    p = start(tmp_path, data_dir, a, '--max_iters=16', '--save_memory_interval=1', script='ds_train.py')
    assert f'resuming from {snapshots / "step-00000012"} at iter 12' in p.stdout, p.stdout[-2000:]
    assert files(next(a.glob('snapshots.copy-*')) / 'step-00000015') == before


def test_a_run_started_afresh_keeps_the_killed_earlier_runs_snapshots_in_out_dir_and_frees_the_ram(tmp_path,
                                                                                                   data_dir):
    out = tmp_path / 'run'
    earlier, started = begin('train.py', *TINY, f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={out}',
                             '--gradient_accumulation_steps=1', '--max_iters=100000', '--eval_interval=100000',
                             '--save_memory_interval=1', cwd=tmp_path)
    run_id = None
    while run_id is None or not list(Path(f'/dev/shm/nanogpt-{run_id}').glob('*.pt')):
        assert earlier.exitcode is None
        run_id = (out / 'run_id').read_text().strip() if (out / 'run_id').exists() else None
        time.sleep(0.01)
    earlier.kill()
    finish(started)
    snapshots = Path(f'/dev/shm/nanogpt-{run_id}')
    before, config = files(snapshots), (out / 'config.json').read_bytes()
    p = start(tmp_path, data_dir, out, '--max_iters=2', '--auto_resume=False')
    name = f'snapshots.before-{run_id}-{socket.gethostname()}'
    assert f"the earlier run's memory snapshots moved from {snapshots} (RAM) to {out / name}" in p.stdout
    # they are the run's only saved state, so they join its config.json and log in before-RUN_ID/
    kept_as = out / f'before-{run_id}'
    assert f"{out} holds an earlier run's saved states: kept, as they were, in {kept_as}" in p.stdout
    before.pop('run.lock')  # the killed run's hold on the folder, which the new run took over: no saved state
    assert not snapshots.exists() and files(kept_as / name) == before and before
    assert (kept_as / 'config.json').read_bytes() == config and (kept_as / 'run_id').read_text().strip() == run_id
    assert (out / 'run_id').read_text().strip() != run_id
    assert not os.path.exists(f"/dev/shm/nanogpt-{(out / 'run_id').read_text().strip()}")  # its own, freed at the end
    # a tool given that run's folder names them (it said: no checkpoint), and going back to the run
    # (--out_dir=RUN/before-RUN_ID) resumes them, its only saved state (it started afresh over them)
    p = run('sample.py', f'--out_dir={kept_as}', '--device=cpu', cwd=tmp_path, check=False)
    assert one_line_error(p).startswith(f"error: {kept_as} holds no checkpoint yet, only memory snapshots of the run, "
                                        f"kept in {kept_as / name}: give {kept_as / name / 'ckpt.pt'}, or resume")
    newest = max(iter_of(kept_as / name / 'ckpt.pt'), iter_of(kept_as / name / 'ckpt.prev.pt')
                 if (kept_as / name / 'ckpt.prev.pt').exists() else 0)
    p = start(tmp_path, data_dir, kept_as, f'--max_iters={newest + 1}')
    assert f'at iter {newest}' in p.stdout and f'resuming from {kept_as / name}' in p.stdout, p.stdout[-2000:]
    assert iter_of(kept_as / 'ckpt.pt') == newest + 1 and files(kept_as / name) == before
    # they stay there, whole, once the run has saved past them, and its next resume goes on from its newer checkpoint
    p = start(tmp_path, data_dir, kept_as, f'--max_iters={newest + 2}')
    assert f"resuming from {kept_as / 'ckpt.pt'} at iter {newest + 1}" in p.stdout, p.stdout[-2000:]
    assert files(kept_as / name) == before



def test_only_a_runs_own_kept_snapshot_folder_is_read_as_memory_snapshots(tmp_path):
    # a user's run folder that happens to have such a name holds checkpoints: read as snapshots, pp_train.py would
    # load its DCP folder as one rank's stages
    from runlock import is_snapshot
    run = tmp_path / 'snapshots.before-2024-runs'
    (run / 'dcp' / 'step-00000010').mkdir(parents=True)
    (run / 'run_id').write_text('abc')
    assert not is_snapshot(run / 'ckpt.pt') and not is_snapshot(run / 'dcp' / 'step-00000010')
    kept = run / 'snapshots.before-abc-node1.example.com'
    (kept / 'step-00000011').mkdir(parents=True)
    assert is_snapshot(kept / 'rank-0-of-2x1.pt') and is_snapshot(kept / 'step-00000011')
    assert is_snapshot(kept / 'step-00000011' / 'mp_rank_00_model_states.pt')
    assert not is_snapshot(run / 'snapshots.before-abd-node1' / 'rank-0-of-2x1.pt')  # another run's id
    assert not is_snapshot(run / 'snapshots.before-abc-node1.tmp' / 'rank-0-of-2x1.pt')  # a copy cut short

KEEP_SNAPSHOTS = '''import os, runpy, sys
# the entrypoint run as it is, but its end leaves its memory snapshots in RAM, as a run killed after them would
sys.path.insert(0, os.path.dirname(sys.argv[1]))
import checkpoint
checkpoint.remove_snapshots = lambda *args, **kwargs: None
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name='__main__')
'''


@pytest.mark.parametrize('script', ['fsdp_train.py', 'ds_train.py', 'pp_train.py'])
def test_going_back_to_a_run_set_aside_resumes_its_memory_snapshots_kept_beside_it(tmp_path, data_dir, shared_run,
                                                                                    script, in_ram):
    # a run killed at 12 with its checkpoint at 10 and its snapshots of 10 and 11 in RAM, started afresh over: they
    # moved into before-RUN_ID/ with its checkpoints, and --out_dir=RUN/before-RUN_ID resumed the checkpoint at 10
    out = tmp_path / 'run'
    shutil.copytree(shared_run(script, *ARGS), out)
    (tmp_path / 'keep_snapshots.py').write_text(KEEP_SNAPSHOTS)
    run(tmp_path / 'keep_snapshots.py', REPO / script, *TINY, f'--dataset={data_dir / "shakespeare_char"}',
        f'--out_dir={out}', *ARGS, '--max_iters=12', '--save_memory_interval=1', cwd=tmp_path)
    snapshots = in_ram(out)
    shutil.rmtree(out)
    shutil.copytree(shared_run(script, *ARGS), out)  # its storage as it was at 10: killed before its save at 12
    run_id, before = (out / 'run_id').read_text().strip(), files(snapshots)
    start(tmp_path, data_dir, out, '--max_iters=2', '--auto_resume=False', script=script)
    kept_as = out / f'before-{run_id}' / f'snapshots.before-{run_id}-{socket.gethostname()}'
    assert not snapshots.exists() and files(kept_as) == {k: v for k, v in before.items() if k != 'run.lock'}
    p = run('sample.py', f'--out_dir={kept_as.parent}', '--device=cpu', '--num_samples=1', '--max_new_tokens=2',
            f'--meta_path={data_dir / "shakespeare_char" / "meta.pkl"}', cwd=tmp_path)  # a tool reads its checkpoint,
    # and says which newer state only the run reads back
    assert re.search(rf"\(iter 10\), an older state than the run's memory snapshot {re.escape(str(kept_as))}/\S+ "
                     rf"\(iter 11\), which only {script} reads back", p.stderr), p.stderr
    p = start(tmp_path, data_dir, kept_as.parent, '--max_iters=13', script=script)
    assert re.search(rf'resuming from {re.escape(str(kept_as))}/\S+ at iter 11\b', p.stdout), p.stdout[-2000:]
    assert 'iter 11:' in p.stdout and 'iter 10:' not in p.stdout  # the steps from there to 13


@pytest.mark.parametrize('script', ['train.py', 'fsdp_train.py'])
def test_a_run_started_afresh_over_another_keeps_that_runs_states_whole_beside_it(tmp_path, data_dir, shared_run,
                                                                                     script):
    """--auto_resume=False over a finished run: its checkpoints, best, step folders, config.json and log move, byte
    for byte, into before-RUN_ID/, where no rotation, pruning or worse best of the new run reaches them."""
    shutil.copytree(shared_run(script, *ARGS), tmp_path / 'run')
    out = tmp_path / 'run'
    earlier, before = (out / 'run_id').read_text().strip(), files(out)
    p = start(tmp_path, data_dir, out, '--max_iters=6', '--auto_resume=False', script=script)
    kept_as = out / f'before-{earlier}'
    assert f"{out} holds an earlier run's saved states: kept, as they were, in {kept_as}" in p.stdout
    assert files(kept_as) == before  # all of it, unchanged
    assert (out / 'run_id').read_text().strip() != earlier and 'at iter' not in p.stdout
    newest = out / 'ckpt.pt' if script == 'train.py' else out / 'dcp' / 'step-00000006'
    assert newest.exists() and not (out / 'dcp' / 'step-00000010').exists()
    # a second fresh start keeps the first one's states beside, under a name of their own
    second = (out / 'run_id').read_text().strip()
    start(tmp_path, data_dir, out, '--max_iters=2', '--auto_resume=False', script=script)
    assert files(kept_as) == before and (out / f'before-{second}').is_dir()
    # a new run there from the weights there: they are read where they were moved to
    third = (out / 'run_id').read_text().strip()
    p = start(tmp_path, data_dir, out, '--max_iters=2', '--auto_resume=False', f'--init_from={out}', script=script)
    assert f'initializing from the weights of {out / f"before-{third}"}' in p.stdout, p.stdout[-2000:]


def test_a_users_own_folder_named_as_a_checkpoint_folder_stays_where_it_is_at_a_start_afresh(tmp_path, data_dir,
                                                                                              shared_run):
    # a dcp/, ds/ or decent/ of the user's own (notes, another tool's output: no step folder in it) was taken for a
    # run's state and moved into before-*/, also at a first start with no earlier run, said to be an earlier run's
    out = tmp_path / 'run'
    shutil.copytree(shared_run('train.py', *ARGS), out)
    earlier, before = (out / 'run_id').read_text().strip(), files(out)
    for kind in ('dcp', 'ds', 'decent'):
        (out / kind / 'theirs').mkdir(parents=True)
        (out / kind / 'theirs' / 'notes.txt').write_text(kind)
    mine = files(out / 'ds')
    start(tmp_path, data_dir, out, '--max_iters=2', '--auto_resume=False')
    assert files(out / f'before-{earlier}') == before  # the earlier run's, all of it
    assert all(files(out / kind) == {'theirs/notes.txt': hashlib.md5(kind.encode()).hexdigest()}
               for kind in ('dcp', 'ds', 'decent')) and files(out / 'ds') == mine
    fresh = tmp_path / 'fresh'
    (fresh / 'dcp').mkdir(parents=True)
    (fresh / 'dcp' / '.metadata').write_text('another tool')
    p = start(tmp_path, data_dir, fresh, '--max_iters=2')
    assert "earlier run" not in p.stdout and not list(fresh.glob('before-*'))
    assert files(fresh / 'dcp') == {'.metadata': hashlib.md5(b'another tool').hexdigest()}


def test_a_start_afresh_that_its_launcher_restarts_resumes_its_own_run(tmp_path, data_dir, shared_run, monkeypatch):
    # a SLURM requeue (or torchrun's restart of its workers) of a job started with --auto_resume=False started afresh
    # again: each restart set aside the steps since and trained from step 0
    shutil.copytree(shared_run('train.py', *ARGS), tmp_path / 'run')
    out = tmp_path / 'run'
    monkeypatch.setenv('SLURM_JOB_ID', '4242')
    start(tmp_path, data_dir, out, '--max_iters=6', '--auto_resume=False')  # the job's first run: afresh over the run
    first = (out / 'run_id').read_text()
    monkeypatch.setenv('SLURM_RESTART_COUNT', '1')
    p = start(tmp_path, data_dir, out, '--max_iters=8', '--auto_resume=False')  # the job requeued
    assert f"resuming from {out / 'ckpt.pt'} at iter 6" in p.stdout and "its launcher has restarted it" in p.stdout
    assert (out / 'run_id').read_text() == first and len(list(out.glob('before-*'))) == 1
    monkeypatch.delenv('SLURM_RESTART_COUNT')  # a second command of the job, no restart: afresh, as it says
    p = start(tmp_path, data_dir, out, '--max_iters=2', '--auto_resume=False')
    assert 'resuming' not in p.stdout and (out / 'run_id').read_text() != first
    assert len(list(out.glob('before-*'))) == 2
    # on Kubernetes, a container that the kubelet restarts in its pod runs torchrun again with no restart count, and
    # a static rendezvous names no launch: it started afresh, setting aside hours of training. The pod's uid
    # (POD_UID, from the downward API in k8s/'s manifests) names it; a job made anew has pods of its own
    monkeypatch.delenv('SLURM_JOB_ID')
    monkeypatch.setenv('POD_UID', 'pod-a')
    afresh, earlier = ['--gradient_accumulation_steps=2', '--auto_resume=False'], (out / 'run_id').read_text()

    def saved():  # the iteration of the new run's newest checkpoint, 0 while it has none
        try:
            return iter_of(out / 'ckpt.pt') if (out / 'run_id').read_text() != earlier else 0
        except FileNotFoundError:  # the earlier run is being moved aside, or the new one has saved nothing yet
            return 0
    killed, started = begin('train.py', *TINY, f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={out}', *ARGS,
                            '--max_iters=100000', '--save_storage_interval=3', *afresh, cwd=tmp_path)
    while saved() < 3:
        assert killed.exitcode is None
        time.sleep(0.01)
    killed.kill()  # the container fails, and its hold is left behind
    finish(started)
    job, at = (out / 'run_id').read_text(), iter_of(out / 'ckpt.pt')
    assert len(list(out.glob('before-*'))) == 3
    p = start(tmp_path, data_dir, out, '--max_iters=12', *afresh)  # the same pod again: its container restarted
    assert f"resuming from {out / 'ckpt.pt'} at iter {at}" in p.stdout, p.stdout[-2000:]
    assert "its pod pod-a runs it again" in p.stdout and (out / 'run_id').read_text() == job
    # one pod of a 2-pod job restarted in place (rank 1's), the other made anew by the operator (rank 0's): the
    # restarted pod alone knows the launch
    (tmp_path / 'pods.py').write_text(PODS)
    monkeypatch.setenv('POD_UIDS', 'pod-b,pod-a')
    p = run(tmp_path / 'pods.py', REPO / 'train.py', *TINY, f'--dataset={data_dir / "shakespeare_char"}',
            f'--out_dir={out}', *ARGS, '--max_iters=14', *afresh, nproc=2, cwd=tmp_path)
    assert "at iter 12" in p.stdout and "its pod pod-a runs it again" in p.stdout, p.stdout[-2000:]
    assert (out / 'run_id').read_text() == job and len(list(out.glob('before-*'))) == 3
    assert json.loads((out / 'config.json').read_text())['pods'] == ['pod-a', 'pod-b']
    # the job deleted and made again under its name (new pods): a new launch, afresh as it says, the run kept aside
    monkeypatch.setenv('POD_UID', 'pod-c')
    p = start(tmp_path, data_dir, out, '--max_iters=2', *afresh)
    assert 'resuming' not in p.stdout and (out / 'run_id').read_text() != job
    assert (out / f'before-{job.strip()}').is_dir() and len(list(out.glob('before-*'))) == 4


PODS = '''import os, runpy, sys
os.environ['POD_UID'] = os.environ['POD_UIDS'].split(',')[int(os.environ['RANK'])]  # each rank's own pod
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))  # the repo, as for the script run alone
runpy.run_path(sys.argv[0], run_name='__main__')
'''


KILLED_MIDWAY = '''import os, runpy, sys
moved, real = [], os.rename
def rename(src, dst):  # dies as a SIGKILL would, with two of the earlier run's names moved aside
    if os.path.basename(os.path.dirname(dst)).startswith('before-'):
        moved.append(dst)
        if len(moved) == 3:
            os._exit(9)
    real(src, dst)
os.rename = rename
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))  # the repo, as for the script run alone
runpy.run_path(sys.argv[0], run_name='__main__')
'''


def test_a_start_killed_as_it_keeps_an_earlier_run_leaves_that_run_whole(tmp_path, data_dir, shared_run):
    # it left the run in two parts, before-RUN_ID/ and out_dir: a resume went on without its best.pt, and the next
    # fresh start kept the rest in a second folder, before-RUN_ID.2/
    shutil.copytree(shared_run('train.py', *ARGS), tmp_path / 'run')
    out, killed = tmp_path / 'run', tmp_path / 'killed_midway.py'
    killed.write_text(KILLED_MIDWAY)
    earlier, before = (out / 'run_id').read_text().strip(), files(out)
    afresh = [*TINY, f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={out}', *ARGS, '--max_iters=6',
              '--auto_resume=False']
    assert run(killed, REPO / 'train.py', *afresh, cwd=tmp_path, check=False).returncode == 9
    assert not (out / 'best.pt').exists()  # killed midway
    p = start(tmp_path, data_dir, out, '--max_iters=10')  # a resume, as if that start had never begun
    assert f"resuming from {out / 'ckpt.pt'} at iter 10" in p.stdout
    assert not list(out.glob('before-*')) and files(out).keys() == before.keys()
    assert f"put back in {out}, as they were" in p.stdout
    before = files(out)
    # a start afresh refused after it set the run aside (init_from's shape contradicts a flag) left it in before-*/:
    # the next plain start, meant to resume it, started a new run over it
    p = run(REPO / 'train.py', *afresh, f'--init_from={out}', '--n_layer=3', cwd=tmp_path, check=False)
    assert one_line_error(p).startswith('error: n_layer=3 contradicts') and files(out) == before
    assert run(killed, REPO / 'train.py', *afresh, cwd=tmp_path, check=False).returncode == 9
    start(tmp_path, data_dir, out, '--max_iters=6', '--auto_resume=False')  # the same start again: kept whole
    assert [f.name for f in out.glob('before-*')] == [f'before-{earlier}']
    assert files(out / f'before-{earlier}') == before


def test_only_what_keep_earlier_run_moves_is_put_back(tmp_path):
    # a folder of the user's own named before-*.tmp is no half-kept run: nothing of it leaves
    from checkpoint import put_back_earlier_run
    (tmp_path / 'before-abc.tmp').mkdir()
    for name in ('ckpt.pt', 'notes.txt'):
        (tmp_path / 'before-abc.tmp' / name).write_text(name)
    put_back_earlier_run(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ['before-abc.tmp', 'ckpt.pt']
    assert os.listdir(tmp_path / 'before-abc.tmp') == ['notes.txt']


def test_an_export_folder_or_a_run_file_that_is_a_folder_is_refused_at_the_start(tmp_path, data_dir):
    """A folder holding a Hugging Face export: its config.json is no run's, and a run would write over it. A run_id
    that is a folder: the first save of the run's records would fail after a model was built and evaluated."""
    hf = tmp_path / 'hf'
    hf.mkdir()
    (hf / 'config.json').write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    (hf / 'model.safetensors').write_bytes(b'weights')
    before = files(hf)
    error = one_line_error(start(tmp_path, data_dir, hf, check=False))
    assert error == f"error: {hf / 'config.json'} is not a run's config.json (a Hugging Face export's?), and a run " \
                    f"would write over it: move it out of {hf} (nothing was changed)", error
    assert files(hf) == before and sorted(os.listdir(hf)) == ['config.json', 'model.safetensors']
    (tmp_path / 'run' / 'run_id').mkdir(parents=True)
    error = one_line_error(start(tmp_path, data_dir, tmp_path / 'run', check=False))
    assert error.startswith(f"error: {tmp_path / 'run' / 'run_id'} is a folder, where the run's run_id goes"), error
    assert sorted(os.listdir(tmp_path / 'run')) == ['run_id']


def test_a_run_whose_out_dir_is_named_as_a_checkpoint_folder_is_not_taken_by_a_run_in_its_parent(tmp_path, data_dir):
    """A run in out/ds (out/dcp, out/decent: a name for a DeepSpeed run, say), then one in out, the default: the
    start in out took out/ds for its own ds_train.py state, moved it into out/before-*/ (under it, where it was still
    training), and out/ds was refused from then on as out's checkpoint folder."""
    for outer, inner in ((tmp_path / 'out', tmp_path / 'out' / 'ds'),  # and a folder of such runs in one:
                         (tmp_path / 'runs', tmp_path / 'runs' / 'decent' / 'zero2')):
        start(tmp_path, data_dir, inner)
        before = files(outer)
        for script, args in (('train.py', []), ('train.py', ['--auto_resume=False']), ('fsdp_train.py', [])):
            error = one_line_error(start(tmp_path, data_dir, outer, *args, script=script, check=False))
            inside = '' if inner.parent == outer else f', inside {inner.parent}'
            assert error == f"error: {inner} is another run's out_dir (its config.json says so){inside}, where a run " \
                            f"in {outer} keeps its checkpoints: move it out of {outer} (nothing was changed)", error
            assert files(outer) == before and os.listdir(outer) == [inner.relative_to(outer).parts[0]]


CRASH_AT_RENAME = '''import os, sys
sys.path.insert(0, os.getcwd())  # the repo, which it runs in
from checkpoint import atomic_save
real = os.replace
def replace(src, dst):  # dies as a SIGKILL would, just before the new checkpoint takes the newest name
    if src.endswith('ckpt.pt.tmp'):
        os._exit(9)
    real(src, dst)
os.replace = replace
atomic_save({'iter_num': 2}, sys.argv[1], keep=3)
'''


def test_a_crash_as_a_checkpoint_is_renamed_leaves_the_newest_name_whole(tmp_path):
    folder = tmp_path / 'run'  # beside the script below
    folder.mkdir()
    path = folder / 'ckpt.pt'
    from checkpoint import atomic_save
    atomic_save({'iter_num': 0}, str(path), keep=3)
    atomic_save({'iter_num': 1}, str(path), keep=3)
    (tmp_path / 'crash_at_rename.py').write_text(CRASH_AT_RENAME)
    p = run(tmp_path / 'crash_at_rename.py', path, cwd=REPO, check=False)  # forked, as the entrypoints are
    assert p.returncode == 9, p.stderr[-2000:]
    # ckpt.pt still names the newest whole state, which every tool reads; its versions moved down beside it
    assert [iter_of(folder / f) for f in ('ckpt.pt', 'ckpt.prev.pt', 'ckpt.prev2.pt')] == [1, 1, 0]
    # the next save finds the versions moved down already: it replaces ckpt.pt alone, and leaves no .tmp
    atomic_save({'iter_num': 2}, str(path), keep=3)
    assert sorted(os.listdir(folder)) == ['ckpt.prev.pt', 'ckpt.prev2.pt', 'ckpt.pt']
    assert [iter_of(folder / f) for f in ('ckpt.pt', 'ckpt.prev.pt', 'ckpt.prev2.pt')] == [2, 1, 0]


@pytest.mark.parametrize('keep', [1, 2])
def test_saves_in_a_run_of_float16_overflows_keep_the_state_before_it_until_a_step_is_taken(tmp_path, keep):
    """Saves made after skipped steps (float16's overflows: iters 5-7) hold the weights of the step before them: each
    replaces the one of the same weights before it, and none pushes out the newest state from before them, which a
    stop there names; the first save after a taken step prunes it, back to keep versions."""
    from checkpoint import atomic_save, kept
    from keep import keeping
    path = str(tmp_path / 'ckpt.pt')

    def save(it, skipped=0):
        atomic_save({'iter_num': it, 'run_id': 'r', 'skipped': skipped}, path, keeping(keep, skipped))
    for it in (2, 4):
        save(it)
    save(6, skipped=1)
    save(8, skipped=3)
    assert [iter_of(f) for f in kept(path)] == [8, 4, 2][:keep + 1]
    save(10)
    assert [iter_of(f) for f in kept(path)] == [10, 8][:keep]


def test_a_save_on_a_full_disk_without_hard_links_leaves_no_temporary_file(small_disk, monkeypatch):
    # vfat, exFAT and some FUSE mounts of cloud buckets have no hard links: the versions move down by copies, and a
    # copy that did not fit left a half-written ckpt.prev.pt.tmp and the whole new ckpt.pt.tmp, holding the space
    from checkpoint import atomic_save

    def no_links(*args, **kwargs):
        raise PermissionError(1, 'Operation not permitted')
    monkeypatch.setattr(os, 'link', no_links)
    path = small_disk('800k') / 'ckpt.pt'
    state = {'iter_num': 1, 'w': torch.zeros(60000)}  # 240 KB: three fit, not four
    atomic_save(state, str(path), keep=2, best=str(path.parent / 'best.pt'))
    with pytest.raises(OSError, match='No space left on device'):
        atomic_save({**state, 'iter_num': 2}, str(path), keep=2, best=str(path.parent / 'best.pt'))
    assert sorted(os.listdir(path.parent)) == ['best.pt', 'ckpt.pt'] and iter_of(path) == 1
    # a step folder kept as the best is copied file by file: one that did not fit leaves no best.tmp behind
    from checkpoint import point_latest
    step = path.parent / 'dcp' / 'step-00000002'
    step.mkdir(parents=True)
    torch.save({'iter_num': 2, 'w': torch.zeros(50000)}, step / 'extra.pt')  # 200 KB: fits once, not twice
    with pytest.raises(OSError, match='No space left on device'):
        point_latest(str(step), iter_of=lambda folder: 2, best=True)
    assert sorted(os.listdir(step.parent)) == ['latest', 'step-00000002']


def test_a_best_name_left_unrenamed_never_stops_the_saves_after_it(tmp_path, monkeypatch):
    # point_latest copies the best's folder into best.tmp, the temporary name the best file is written under too: a
    # kill between that write and its rename (or a rename refused: chattr +i on best) left a best.tmp file, and every
    # later new best stopped its run ("Not a directory: best.tmp"), a rerun too, at its first new best
    from checkpoint import point_latest, write_name
    root = tmp_path / 'ds'
    (root / 'latest').mkdir(parents=True)
    (root / 'latest' / 'x').write_text('')  # a name that no rename replaces: the write's file is not left behind
    with pytest.raises(OSError):
        write_name(str(root / 'latest'), 'step-00000002')
    assert sorted(os.listdir(root)) == ['latest']
    shutil.rmtree(root / 'latest')
    (root / 'best.tmp').write_text('best-step-00000002')  # as a kill leaves it
    step = root / 'step-00000004'
    step.mkdir()
    torch.save({'iter_num': 4}, step / 'extra.pt')
    point_latest(str(step), iter_of=lambda folder: 4, best=True)
    assert (root / 'best').read_text() == 'best-step-00000004' and (root / 'best-step-00000004' / 'extra.pt').exists()
    assert sorted(os.listdir(root)) == ['best', 'best-step-00000004', 'latest', 'step-00000004']
    # the folder's copy, left by a kill before its rename, was best.tmp too: the best file could not be written beside
    # it (IsADirectoryError), as a resume that moves another run's best aside writes it, at every start until the next
    # best. It has a name of its own, which the next best removes
    real = os.replace

    def killed(src, dst):
        if os.path.isdir(src):
            raise KeyboardInterrupt  # a kill before the copy is renamed: nothing cleans up
        real(src, dst)
    step = root / 'step-00000006'
    step.mkdir()
    torch.save({'iter_num': 6}, step / 'extra.pt')
    monkeypatch.setattr(os, 'replace', killed)
    with pytest.raises(KeyboardInterrupt):
        point_latest(str(step), iter_of=lambda folder: 6, best=True)
    monkeypatch.undo()
    write_name(str(root / 'best'), 'best-step-00000004')
    point_latest(str(step), iter_of=lambda folder: 6, best=True)
    assert (root / 'best').read_text() == 'best-step-00000006' and not (root / 'best-copy.tmp').exists()


@pytest.mark.parametrize('kind, file', [('decent', 'rank-0.pt'), ('ds', 'mp_rank_00_model_states.pt')])
def test_a_failed_export_names_the_step_folder_saved_before_it_as_intact(tmp_path, monkeypatch, kind, file):
    # decent_train.py and ds_train.py write their step folder, then the ckpt.pt export: where the export did not fit,
    # the error said "no checkpoint was complete before" (ds_train.py's: the older ckpt.pt was "the newest complete
    # one") while the folder was complete and newer, and the next start resumed it
    import checkpoint
    out = tmp_path / 'run'
    step = out / kind / 'step-00000005'
    step.mkdir(parents=True)
    torch.save({'iter_num': 5, 'rng': [None]}, step / file)
    (out / kind / 'latest').write_text('step-00000005')
    monkeypatch.setattr(checkpoint.dist, 'barrier', lambda: None)
    monkeypatch.setattr(checkpoint, '_failed', [(str(out / 'ckpt.pt'), 'No space left on device')])
    for before in (None, 3):  # no ckpt.pt yet, or the one of an older save still in its place
        if before:
            torch.save({'iter_num': before}, out / 'ckpt.pt')
        with pytest.raises(SystemExit) as e:
            checkpoint.exit_after_failed_save()
        assert f"the newest complete one, {step}, is intact" in str(e.value), e.value


@pytest.mark.parametrize('kind, file', [('decent', 'rank-0.pt'), ('dcp', '__0_0.distcp')])
def test_a_first_step_folder_that_did_not_fit_names_the_export_beside_it_as_intact(tmp_path, monkeypatch, kind, file):
    # the first save's step folder failed on a full disk, then its ckpt.pt export fitted in the space freed: the error
    # said "no checkpoint was complete before", and the next start resumed from that export at the same iteration
    import checkpoint
    out = tmp_path / 'run'
    (out / kind).mkdir(parents=True)
    torch.save({'iter_num': 5}, out / 'ckpt.pt')
    path = out / kind / 'step-00000005' / file
    monkeypatch.setattr(checkpoint.dist, 'barrier', lambda: None)
    monkeypatch.setattr(checkpoint, '_failed', [(str(path), 'No space left on device')])
    with pytest.raises(SystemExit) as e:
        checkpoint.exit_after_failed_save()
    assert f"so the run stopped; the newest complete one, {out / 'ckpt.pt'}, is intact: free space" in str(e.value)
    (out / 'ckpt.pt').unlink()  # and where the export did not fit either
    with pytest.raises(SystemExit) as e:
        checkpoint.exit_after_failed_save()
    assert "so the run stopped; no checkpoint was complete before: free space" in str(e.value), e.value


@pytest.mark.parametrize('kind, file', [('decent', 'rank-0.pt'), ('ds', 'mp_rank_00_model_states.pt')])
def test_a_step_folder_that_did_not_fit_names_what_the_next_start_resumes(tmp_path, monkeypatch, kind, file):
    # step-10's folder failed on a full disk and its export fitted: ds_train.py's (and pp_train.py's) next start
    # resumed that ckpt.pt at iter 10 while the error named step-5; decent_train.py's resumes step-5 (its ckpt.pt is
    # the replicas' average)
    import checkpoint
    out = tmp_path / 'run'
    (out / kind / 'step-00000005').mkdir(parents=True)
    torch.save({'iter_num': 5, 'rng': [None]}, out / kind / 'step-00000005' / file)
    (out / kind / 'latest').write_text('step-00000005')
    torch.save({'iter_num': 10}, out / 'ckpt.pt')
    monkeypatch.setattr(checkpoint.dist, 'barrier', lambda: None)
    monkeypatch.setattr(checkpoint, '_failed', [(str(out / kind / 'step-00000010' / file), 'No space left on device')])
    with pytest.raises(SystemExit) as e:
        checkpoint.exit_after_failed_save()
    intact = out / kind / 'step-00000005' if kind == 'decent' else out / 'ckpt.pt'
    assert f"so the run stopped; the newest complete one, {intact}, is intact: free space" in str(e.value), e.value


def test_a_log_row_on_a_full_disk_is_a_warning_and_never_left_half_written(small_disk, capsys):
    # it was a traceback out of the loop, with the row cut short in metrics.jsonl; the checkpoints, not the log,
    # decide whether the run stops (a save that fails stops it, in one line)
    from runlog import open_log
    out = small_disk('64k') / 'run'
    log = open_log(str(out), 'abc', {'out_dir': str(out)})
    for i in range(2000):  # far more than fit
        log(i, loss=1.0, note='x' * 100)
    assert capsys.readouterr().err.count('warning: cannot write') == 1
    rows = (out / 'metrics.jsonl').read_bytes().split(b'\n')
    assert rows[-1] == b'' and 100 < len(rows) < 2000  # whole rows only, up to the one that did not fit
    assert [json.loads(row)['iter'] for row in rows[:-1]] == list(range(len(rows) - 1))


def test_each_resume_that_changes_the_settings_logs_what_they_were(tmp_path, monkeypatch):
    # every resume wrote its own flags over config.json: the settings a run was started with were lost
    from runlog import open_log
    out = str(tmp_path / 'run')
    for resumed_at, max_iters in ((None, 10), (10, 20), (20, 20), (5, 30)):  # the last from an older checkpoint
        monkeypatch.setenv('TORCHELASTIC_RUN_ID', f'{max_iters}-{resumed_at}')  # each start a launch of its own
        log = open_log(out, 'abc', {'out_dir': out, 'max_iters': max_iters, 'batch': [1, 2]}, resumed_at=resumed_at)
        for i in range(resumed_at or 0, max_iters, 5):
            log(i, loss=1.0)
    rows = [json.loads(line) for line in (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()]
    changes = [r for r in rows if 'settings_changed' in r]  # none where nothing changed; kept past a resume at 5
    assert changes == [{'iter': 10, 'settings_changed': {'max_iters': [10, 20]}},
                       {'iter': 5, 'settings_changed': {'max_iters': [20, 30]}}], rows
    assert [r['iter'] for r in rows if 'loss' in r] == [0, 5, 10, 15, 20, 25]
    assert json.loads((tmp_path / 'run' / 'config.json').read_text())['max_iters'] == 30
    # a file the user may not replace (another user's, in a sticky shared folder) named a full disk, and another
    # --out_dir, which starts the run afresh there
    def refused(src, dst):
        raise PermissionError(errno.EPERM, 'Operation not permitted', src, None, dst)
    before = files(tmp_path / 'run')
    monkeypatch.setattr(os, 'replace', refused)
    with pytest.raises(SystemExit) as e:
        open_log(out, 'abc', {'out_dir': out, 'max_iters': 40}, resumed_at=25)(25, loss=1.0)
    monkeypatch.undo()
    assert str(e.value) == f"error: cannot write {out}/run_id (Operation not permitted): let this user replace the " \
        f"run's files there, and run the same command again"
    assert files(tmp_path / 'run') == before  # nothing left of the start


def test_run_best_names_the_newer_best_where_another_entrypoint_continued_the_run(tmp_path, data_dir, shared_run):
    from checkpoint import find_checkpoint
    shutil.copytree(shared_run('train.py', *ARGS), tmp_path / 'run')  # best.pt at 10
    start(tmp_path, data_dir, tmp_path / 'run', '--max_iters=20', script='fsdp_train.py')  # a better one at 15 or 20
    best = find_checkpoint(str(tmp_path / 'run' / 'best'))
    assert best.startswith(str(tmp_path / 'run' / 'dcp' / 'best-step-000000')) and int(best[-8:]) > 10, best


def test_a_tool_reads_the_version_before_a_damaged_or_missing_ckpt_pt(tmp_path, data_dir, shared_run):
    """sample.py and export_hf.py given a run folder take its newest ckpt.pt that loads, as a resume does, with a
    warning; where none loads, the one-line error."""
    shutil.copytree(shared_run('train.py', *ARGS), tmp_path / 'run')  # ckpt.pt at 10, ckpt.prev.pt at 5
    ckpt = tmp_path / 'run' / 'ckpt.pt'
    ckpt.write_bytes(ckpt.read_bytes()[:100000])  # truncated
    meta = f'--meta_path={data_dir / "shakespeare_char" / "meta.pkl"}'
    p = run('sample.py', f'--out_dir={tmp_path / "run"}', '--device=cpu', '--num_samples=1', '--max_new_tokens=5',
            meta, cwd=tmp_path)
    assert f"warning: {ckpt} is damaged" in p.stderr and f"reading {ckpt.parent / 'ckpt.prev.pt'} (iter 5)" in p.stderr
    p = run('model_size.py', str(tmp_path / 'run'), cwd=tmp_path)  # the shape, from the version before
    assert f"warning: {ckpt} is damaged" in p.stderr and ' 2 layers, 2 heads, 32 wide' in p.stdout, p.stdout
    # and a run started from its weights names that file, not ckpt.pt
    p = start(tmp_path, data_dir, tmp_path / 'new', f"--init_from={tmp_path / 'run'}", '--max_iters=1')
    assert f"initializing from the weights of {ckpt.parent / 'ckpt.prev.pt'}\n" in p.stdout, p.stdout[-2000:]
    ckpt.unlink()
    p = run('export_hf.py', f'--ckpt={tmp_path / "run"}', f'--out={tmp_path / "hf"}', cwd=tmp_path)
    assert f"reading {ckpt.parent / 'ckpt.prev.pt'} (iter 5)" in p.stderr and (tmp_path / 'hf' / 'config.json').exists()
    assert f"wrote {tmp_path / 'hf'} from {ckpt.parent / 'ckpt.prev.pt'} (iter 5): " in p.stdout, p.stdout
    (tmp_path / 'run' / 'ckpt.prev.pt').write_bytes(b'damaged')  # none left that loads: the one line
    error = one_line_error(run('sample.py', f'--out_dir={tmp_path / "run"}', '--device=cpu', meta, cwd=tmp_path,
                               check=False))
    assert error.startswith(f"error: checkpoint {ckpt.parent / 'ckpt.prev.pt'} is corrupt"), error


def test_another_runs_ds_step_folder_that_latest_names_is_set_aside_not_removed(tmp_path, data_dir, shared_run):
    # the shared run (steps 5 and 10) resumed past another run's folder that latest names: its save of that step
    # removed the folder to write its own there
    run_dir = tmp_path / 'run'
    shutil.copytree(shared_run('ds_train.py', *ARGS), run_dir)
    ds = run_dir / 'ds'
    # another run's folder, copied in as the step this run saves next, and named latest by hand
    shutil.copytree(ds / 'step-00000010', ds / 'step-00000015')
    states = ds / 'step-00000015' / 'mp_rank_00_model_states.pt'
    torch.save({**torch.load(states, weights_only=True), 'run_id': 'another'}, states)
    theirs = {f.name: f.read_bytes() for f in (ds / 'step-00000015').iterdir()}
    (ds / 'latest').write_text('step-00000015')
    p = start(tmp_path, data_dir, run_dir, '--max_iters=15', script='ds_train.py')
    aside = ds / 'other-run-step-00000015'
    assert {f.name: f.read_bytes() for f in aside.iterdir()} == theirs  # every byte of it kept
    assert f"{ds / 'step-00000015'} was saved by another run (id another, not this run's" in p.stdout
    assert f"resuming from {ds / 'step-00000010'} at iter 10" in p.stdout
    assert (ds / 'latest').read_text() == 'step-00000015'  # the run's own, saved at 15
    assert torch.load(ds / 'step-00000015' / 'mp_rank_00_model_states.pt', weights_only=True)['run_id'] == \
        (run_dir / 'run_id').read_text().strip()
    # begun by the run's id (mark_run): a save SIGKILLed before the engine's files were whole left none that told the
    # run, set aside at every resume as unknown-run-step-N, out of pruning's reach, one more at each crash
    assert (ds / 'step-00000015' / 'run_id').read_text() == (run_dir / 'run_id').read_text().strip()


def test_a_resume_sets_aside_another_runs_best_and_folders_that_tell_no_run_and_latest_names_the_runs_whole_one(
        tmp_path):
    # another run's best-step-N (named best) was left among the run's, which a new best replaced or pruned; its step
    # folder copied in without its rank-0.pt, or a DCP or DeepSpeed one without the file that tells its run, was
    # taken for the run's own, to be pruned or written over; latest, where it named a folder set aside, then named
    # the folder before it, one cut short among them
    from checkpoint import set_aside_others

    def folder(kind, name, files):
        (tmp_path / kind / name).mkdir(parents=True)
        for file, content in files.items():
            torch.save(content, tmp_path / kind / name / file) if isinstance(content, dict) else \
                (tmp_path / kind / name / file).write_bytes(content)
    ranks = lambda step, run_id, of=(0, 1): {f'rank-{r}.pt': {'iter_num': step, 'rng': [0, 0], 'run_id': run_id}
                                              for r in of}
    (tmp_path / 'run_id').write_text('mine')
    folder('decent', 'step-00000002', ranks(2, 'mine'))
    folder('decent', 'best-step-00000002', ranks(2, 'mine'))
    folder('decent', 'step-00000004', ranks(4, 'mine', of=(1,)))  # the run's own, cut short: left as it is
    folder('decent', 'step-00000005', ranks(5, 'theirs', of=(1,)))  # another run's, without its rank-0.pt
    folder('decent', 'step-00000006', ranks(6, 'theirs'))
    folder('decent', 'best-step-00000007', ranks(7, 'theirs'))
    (tmp_path / 'decent' / 'latest').write_text('step-00000006')
    (tmp_path / 'decent' / 'best').write_text('best-step-00000007')
    folder('dcp', 'step-00000003', {'.metadata': b'theirs', '__0_0.distcp': b'theirs'})  # without its extra.pt
    folder('ds', 'step-00000003', {'zero_pp_rank_0_mp_rank_00_optim_states.pt': b'theirs'})  # nor model states
    before = files(tmp_path)
    set_aside_others(str(tmp_path), 'mine', str(tmp_path / 'decent' / 'step-00000002'))
    moved = {'decent/step-00000005': 'decent/other-run-step-00000005',
             'decent/step-00000006': 'decent/other-run-step-00000006',
             'decent/best-step-00000007': 'decent/other-run-best-step-00000007',
             'dcp/step-00000003': 'dcp/unknown-run-step-00000003', 'ds/step-00000003': 'ds/unknown-run-step-00000003'}
    renamed = lambda path: next((to + path[len(at):] for at, to in moved.items() if path.startswith(at + '/')), path)
    after = files(tmp_path)
    assert after == {renamed(p): md5 for p, md5 in before.items() if p not in ('decent/latest', 'decent/best')} | \
        {'decent/latest': after['decent/latest'], 'decent/best': after['decent/best']}  # every byte kept
    assert (tmp_path / 'decent' / 'latest').read_text() == 'step-00000002'  # whole and the run's, not step 4
    assert (tmp_path / 'decent' / 'best').read_text() == 'best-step-00000002'


def test_a_resume_sets_aside_another_runs_ckpt_pt_and_best_pt_and_closes_the_gap(tmp_path):
    # another run's ckpt.pt copied in by hand (to go on from it) was passed over by the resume, unsaid, then moved
    # down the versions and out at the second save; its best.pt was replaced at the run's next best
    from checkpoint import set_aside_damaged
    state = lambda it, run_id: {'iter_num': it, 'run_id': run_id}
    (tmp_path / 'run_id').write_text('mine')
    for name, saved in (('ckpt.pt', state(15, 'theirs')), ('ckpt.prev.pt', state(10, 'mine')),
                        ('ckpt.prev2.pt', state(5, '')), ('best.pt', state(15, 'theirs'))):
        torch.save(saved, tmp_path / name)
    before = files(tmp_path)
    moved = set_aside_damaged(str(tmp_path), [], 'mine', str(tmp_path / 'ckpt.prev.pt'))
    assert moved == {str(tmp_path / 'ckpt.prev.pt'): str(tmp_path / 'ckpt.pt'),
                     str(tmp_path / 'ckpt.prev2.pt'): str(tmp_path / 'ckpt.prev.pt')}  # (no id: any run's)
    renamed = {'ckpt.pt': 'other-run-ckpt.pt', 'best.pt': 'other-run-best.pt', 'ckpt.prev.pt': 'ckpt.pt',
               'ckpt.prev2.pt': 'ckpt.prev.pt'}
    assert files(tmp_path) == {renamed.get(p, p): md5 for p, md5 in before.items()}  # every byte kept
    # the state resumed is never set aside (init_from=resume over a run that has none of its own)
    (tmp_path / 'adopted').mkdir()
    torch.save(state(15, 'theirs'), tmp_path / 'adopted' / 'ckpt.pt')
    assert set_aside_damaged(str(tmp_path / 'adopted'), [], 'mine', str(tmp_path / 'adopted' / 'ckpt.pt')) == {}
    assert os.listdir(tmp_path / 'adopted') == ['ckpt.pt']


def test_a_failed_save_into_the_damaged_folder_that_latest_names_never_calls_it_intact(tmp_path, monkeypatch):
    # ds_train.py removes the folder that latest names where it is damaged, to write the step anew there: where that
    # write fails, the error called the folder, cut short and removed, "the newest complete one, ..., is intact"
    import checkpoint
    ds = tmp_path / 'run' / 'ds'
    for step in ('step-00000002', 'step-00000004'):
        (ds / step).mkdir(parents=True)
    torch.save({'iter_num': 2}, ds / 'step-00000002' / 'mp_rank_00_model_states.pt')
    (ds / 'step-00000004' / 'zero_pp_rank_0_mp_rank_00_optim_states.pt').write_bytes(b'cut short')
    (ds / 'latest').write_text('step-00000004')
    monkeypatch.setattr(checkpoint.dist, 'barrier', lambda: None)
    path = ds / 'step-00000004' / 'mp_rank_00_model_states.pt'
    monkeypatch.setattr(checkpoint, '_failed', [(str(path), 'No space left on device')])
    with pytest.raises(SystemExit) as e:
        checkpoint.exit_after_failed_save()
    assert str(e.value) == f"error: writing the checkpoint {path} failed (No space left on device), so the run " \
        f"stopped; {ds / 'step-00000004'}, which latest names, is not whole (it was damaged, and this save was " \
        f"writing it anew); the newest complete one before it, {ds / 'step-00000002'}, is intact: free space (or " \
        f"fix the folder) and run the same command again to resume"
    (ds / 'step-00000002' / 'mp_rank_00_model_states.pt').unlink()  # and with none before it
    with pytest.raises(SystemExit) as e:
        checkpoint.exit_after_failed_save()
    assert "is not whole (it was damaged, and this save was writing it anew); none before it is complete: " \
        in str(e.value), e.value


def test_a_background_save_writes_the_tied_head_once_and_a_later_copy_never_merges_two_tensors(tmp_path):
    """GPT-2's head is its token embedding: the state dict names one tensor twice. The host copy a background save
    writes shares it as the live state does, so ckpt.pt holds it once (147 MiB less for GPT-2 124M), and reading it
    back gives the tied pair again. An earlier copy's shared tensor is not reused for two tensors apart now."""
    from checkpoint import host_copy, save_in_background, wait_for_saves
    from model import GPT, GPTConfig
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=64, dropout=0.0))
    state = {'model': model.state_dict(), 'iter_num': 1}
    save_in_background(state, str(tmp_path / 'ckpt.pt'), slot='tied')
    wait_for_saves('tied')
    sd = torch.load(tmp_path / 'ckpt.pt', weights_only=True)['model']
    head, wte = sd['lm_head.weight'], sd['transformer.wte.weight']
    assert head.untyped_storage().data_ptr() == wte.untyped_storage().data_ptr()
    assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items())
    plain = tmp_path / 'plain.pt'
    torch.save(state, plain)
    assert os.path.getsize(tmp_path / 'ckpt.pt') <= os.path.getsize(plain)
    a, b = torch.arange(4.), torch.arange(4.) + 10
    earlier = host_copy({'x': a, 'y': a})
    assert earlier['x'] is earlier['y']
    now = host_copy({'x': a, 'y': b}, earlier)
    assert torch.equal(now['x'], a) and torch.equal(now['y'], b)
