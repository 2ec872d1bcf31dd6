"""What a resume finds in out_dir that it must not write over is kept, set aside under a name that says why: a step
folder of another run (copied in by hand) that latest names, in ds_train.py's out_dir/ds, which the run's save of
that step would otherwise remove."""

import shutil

from conftest import TINY, run


def launch(script, tmp_path, data_dir, out, *extra):
    return run(script, *TINY, '--eval_interval=2', '--gradient_accumulation_steps=1',
               f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={tmp_path / out}', *extra, cwd=tmp_path)


def test_another_runs_ds_step_folder_that_latest_names_is_set_aside_not_removed(tmp_path, data_dir):
    launch('ds_train.py', tmp_path, data_dir, 'run', '--max_iters=4')
    launch('ds_train.py', tmp_path, data_dir, 'other', '--max_iters=2', '--seed=7')
    ds = tmp_path / 'run' / 'ds'
    # another run's folder, copied in as the step this run saves next, and named latest by hand
    shutil.copytree(tmp_path / 'other' / 'ds' / 'step-00000002', ds / 'step-00000006')
    theirs = {f.name: f.read_bytes() for f in (ds / 'step-00000006').iterdir()}
    (ds / 'latest').write_text('step-00000006')
    p = launch('ds_train.py', tmp_path, data_dir, 'run', '--max_iters=6')
    aside = ds / 'other-run-step-00000006'
    assert {f.name: f.read_bytes() for f in aside.iterdir()} == theirs  # every byte of it kept
    assert f"{ds / 'step-00000006'} was saved by another run" in p.stdout
    assert f"resuming from {ds / 'step-00000004'} at iter 4" in p.stdout
    assert (ds / 'latest').read_text() == 'step-00000006'  # the run's own, saved at 6
