"""What a resume finds in out_dir that it must not write over is kept, set aside under a name that says why: a step
folder of another run (copied in by hand) that latest names, in ds_train.py's out_dir/ds, which the run's save of
that step would otherwise remove; and a failed save's error never calls such a folder intact."""

import shutil

import pytest
import torch

from conftest import TINY, run


def test_another_runs_ds_step_folder_that_latest_names_is_set_aside_not_removed(tmp_path, data_dir, shared_run):
    # (test_saved_state.py's shared run: steps 5 and 10)
    run_dir = tmp_path / 'run'
    shutil.copytree(shared_run('ds_train.py', '--gradient_accumulation_steps=1', '--max_iters=10', '--eval_interval=5'),
                    run_dir)
    ds = run_dir / 'ds'
    # another run's folder, copied in as the step this run saves next, and named latest by hand
    shutil.copytree(ds / 'step-00000010', ds / 'step-00000015')
    states = ds / 'step-00000015' / 'mp_rank_00_model_states.pt'
    torch.save({**torch.load(states, weights_only=True), 'run_id': 'another'}, states)
    theirs = {f.name: f.read_bytes() for f in (ds / 'step-00000015').iterdir()}
    (ds / 'latest').write_text('step-00000015')
    p = run('ds_train.py', *TINY, '--gradient_accumulation_steps=1', '--max_iters=15', '--eval_interval=5',
            f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={run_dir}', cwd=tmp_path)
    aside = ds / 'other-run-step-00000015'
    assert {f.name: f.read_bytes() for f in aside.iterdir()} == theirs  # every byte of it kept
    assert f"{ds / 'step-00000015'} was saved by another run (id another, not this run's" in p.stdout
    assert f"resuming from {ds / 'step-00000010'} at iter 10" in p.stdout
    assert (ds / 'latest').read_text() == 'step-00000015'  # the run's own, saved at 15
    assert torch.load(ds / 'step-00000015' / 'mp_rank_00_model_states.pt', weights_only=True)['run_id'] == \
        (run_dir / 'run_id').read_text().strip()


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
