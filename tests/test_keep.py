"""Never a worse state in place of a good one, in real processes of every entrypoint: keep_checkpoints keeps the
newest K states and prunes older ones, the best by val loss is kept besides (and survives later, worse evals);
a diverged run (a learning rate of 1e30) saves nothing at its NaN eval, sets aside what it saved after its weights
went bad, and its error names the last good state, from which the next run resumes; a save to the step of a whole
DCP folder of the run keeps that folder, and one to the step folder a run resumed from that is a new best names it
the best. One base run per entrypoint (10 steps, an eval every 2,
keep_checkpoints=3) is shared by the tests."""

import json
import os
import re
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from checkpoint import load_checkpoint, point_latest, step_folders
from conftest import REPO, counts_tokens, one_line_error, read_metrics, run
from model import GPT, GPTConfig
from test_fault import KIND, final_weights, same_weights, tiny

SCRIPTS = ['train.py', 'fsdp_train.py', 'pp_train.py', 'ds_train.py', 'decent_train.py']
BASE = ['--max_iters=10', '--eval_interval=2', '--keep_checkpoints=3']


@pytest.fixture(scope='module')
def base(tmp_path_factory, data_dir):
    done = {}

    def made(script):
        if script not in done:
            out = tmp_path_factory.mktemp('keep') / 'base'
            p = run(script, *tiny(data_dir, out, *BASE), cwd=out.parent)
            done[script] = out, [float(v) for v in re.findall(r'val loss (\S+?),?\s', p.stdout)]
        return done[script]
    return made


def iter_of(path):
    return load_checkpoint(str(path))[1]['iter_num']


def logged_in_its_wandb_run(calls, out):
    """Whether a resumed launch (--wandb_log=True, conftest's stand-in for wandb) went on with its run's own wandb
    run, its id the run_id that the run's first launch wrote and took too, and logged its evals there."""
    (call, kwargs), *logs = calls
    return (call, kwargs['id'], kwargs['resume']) == ('init', (out / 'run_id').read_text().strip(), 'allow') and \
        logs and all(call == 'log' and 'val/loss' in row for call, row in logs)


def kept_iters(script, out):
    """The iterations of the states kept in out_dir: train.py's ckpt.pt and its versions, the others' step
    folders (and the versions of their consolidated ckpt.pt, where they write one)."""
    files = sorted(out.glob('ckpt*.pt'))
    folders = [] if script == 'train.py' else sorted(int(f.name[5:]) for f in (out / KIND[script]).glob('step-*'))
    return sorted(iter_of(f) for f in files), folders


@pytest.mark.parametrize('script', SCRIPTS)
def test_keep_checkpoints_keeps_the_newest_k_and_the_best(base, script):
    out, val = base(script)
    files, folders = kept_iters(script, out)
    # saves at 2, 4, 6, 8, 10; the newest 3 are kept
    assert files == ([] if KIND.get(script) == 'dcp' else [6, 8, 10]), files
    assert folders == ([] if script == 'train.py' else [6, 8, 10]), folders
    best_iter = 2 * min(range(1, len(val)), key=lambda i: val[i])  # the eval at 0 saves nothing
    assert iter_of(out / 'best') == best_iter  # best.pt, or for fsdp_train.py and pp_train.py the folder dcp/best names
    if script != 'train.py':  # beside the step folders, a copy of the best one that pruning never removes
        assert (out / KIND[script] / 'best').read_text() == f'best-step-{best_iter:08d}'
        assert [f.name for f in (out / KIND[script]).glob('best-*')] == [f'best-step-{best_iter:08d}']


@pytest.mark.parametrize('script', ['train.py', 'fsdp_train.py'])
def test_best_survives_worse_evals_and_pruning_and_every_tool_reads_it(base, tmp_path, data_dir, script):
    out = tmp_path / 'worse'
    shutil.copytree(base(script)[0], out)
    best = load_checkpoint(str(out / 'best'))
    # a learning rate that makes the loss rise, finite: evals at 12, 14 and 16 are worse and saved, the best (10)
    # is not, and survives the pruning of what was saved at 10
    run(script, *tiny(data_dir, out, *BASE, '--max_iters=16', '--learning_rate=0.1', '--warmup_iters=0',
                      '--min_lr=0'), cwd=tmp_path)
    assert kept_iters(script, out) == (([12, 14, 16], []) if script == 'train.py' else ([], [12, 14, 16]))
    newest = load_checkpoint(str(out))[1]
    assert newest['iter_num'] == 16 and newest['val_loss'] > best[1]['val_loss'] == newest['best_val_loss']
    again = load_checkpoint(str(out / 'best'))
    assert again[1]['iter_num'] == 10 and same_weights(again[0].state_dict(), best[0].state_dict())
    meta = data_dir / 'shakespeare_char' / 'meta.pkl'
    p = run('sample.py', f'--out_dir={out}', '--init_from=best', '--num_samples=1', '--max_new_tokens=5',
            '--device=cpu', f'--meta_path={meta}', cwd=tmp_path)
    assert p.stdout.strip()
    again = run('sample.py', f'--init_from={out}/best', '--num_samples=1', '--max_new_tokens=5', '--device=cpu',
                f'--meta_path={meta}', cwd=tmp_path)  # RUN/best as a path, as export_hf.py and train.py take it
    assert again.stdout == p.stdout
    run('export_hf.py', f'--ckpt={out}/best', f'--out={tmp_path / "hf"}', cwd=tmp_path)
    assert (tmp_path / 'hf' / 'model.safetensors').exists()
    p = run('train.py', *tiny(data_dir, tmp_path / 'new', '--max_iters=1', f'--init_from={out}/best'), cwd=tmp_path)
    best_file = 'best.pt' if script == 'train.py' else 'dcp/best-step-00000010'
    assert f'initializing from the weights of {out}/{best_file}\n' in p.stdout


@pytest.mark.parametrize('script', SCRIPTS)
def test_a_diverged_run_leaves_its_last_good_state_newest(base, tmp_path, data_dir, script):
    base_dir, _ = base(script)
    out = tmp_path / 'diverged'
    shutil.copytree(base_dir, out)
    # the step at 10 sends the weights to ~1e30; the state saved at 11 (storage and memory) holds them, and the
    # steps from 11 on are NaN: 5 in a row stop the run at 15, whose eval is NaN
    p = run(script, *tiny(data_dir, out, *BASE, '--max_iters=40', '--eval_interval=5', '--learning_rate=1e30',
                          '--warmup_iters=0', '--save_storage_interval=1', '--save_memory_interval=1'),
            cwd=tmp_path, check=False)
    newest = out / KIND[script] / "step-00000010" if KIND.get(script) == 'dcp' else out / "ckpt.pt"
    assert one_line_error(p).startswith("error: 5 steps in a row up to iter 15 had a non-finite loss"), p.stderr
    assert f"{newest} (iter 10) holds the last good state" in p.stderr
    assert "step 15: train loss nan, val loss nan" in p.stdout
    assert 'bfloat16' not in one_line_error(p)  # a float32 run: no advice to leave float16
    # standard JSON, which has no NaN: the NaN eval is logged null
    lines = (out / 'metrics.jsonl').read_text().splitlines()
    rows = [json.loads(line, parse_constant=lambda word: pytest.fail(f'{word} in metrics.jsonl')) for line in lines]
    assert any(r['iter'] == 15 and 'val_loss' in r and r['val_loss'] is None for r in rows)

    assert "the eval's loss is not finite: nothing saved" in p.stdout
    files, folders = kept_iters(script, out)
    # 11's set aside, nothing saved after it; 6 pruned when 11 was saved (keep 3), and 10's save again at the
    # resume took the place of the one before rather than pushing 8 out
    assert (files, folders) == ([] if KIND.get(script) == 'dcp' else [8, 10], [] if script == 'train.py' else [8, 10])
    set_aside = [f.name for f in out.rglob('diverged-*')]
    assert set_aside and all('11' in name for name in set_aside), set_aside
    assert same_weights(final_weights(script, out), final_weights(script, base_dir))
    if script in ('train.py', 'fsdp_train.py'):  # a file and a folder of a step: the code that sets both aside
        # the same command again, as a requeued job would: it diverges at 11 again, and that second state is set
        # aside beside the first, not over it, nor left as the newest
        p = run(script, *tiny(data_dir, out, *BASE, '--max_iters=40', '--eval_interval=5', '--learning_rate=1e30',
                              '--warmup_iters=0', '--save_storage_interval=1', '--save_memory_interval=1'),
                cwd=tmp_path, check=False)
        assert f"{newest} (iter 10) holds the last good state" in one_line_error(p), p.stderr[-3000:]
        again = [f.name for f in out.rglob('diverged-*')]
        assert len(again) == 2 * len(set_aside) and set(set_aside) < set(again), again
        assert same_weights(final_weights(script, out), final_weights(script, base_dir))
    p = run(script, *tiny(data_dir, out, *BASE, '--max_iters=12'), cwd=tmp_path)
    assert re.search(r'resuming from \S+ at iter 10\b', p.stdout), p.stdout[-2000:]
    assert all(torch.isfinite(v).all() for v in load_checkpoint(str(out))[0].state_dict().values())


def copy_with_a_damaged_ckpt(base_dir, out):
    """A copy of a base run in out whose ckpt.pt is cut short (a new file: best.pt may be a link to the old one);
    returns the damaged bytes."""
    shutil.copytree(base_dir, out)
    damaged = (out / 'ckpt.pt').read_bytes()[:1000]
    (out / 'ckpt.pt').unlink()
    (out / 'ckpt.pt').write_bytes(damaged)
    return damaged


def test_a_resume_from_before_the_best_keeps_it_best(base, tmp_path, data_dir, wandb_calls):
    # the newest step folder moved away by hand (or damaged): the run resumed from 8 with 8's best_val_loss, and
    # its eval at 10 replaced the best kept at 10 whatever that best's loss (here made lower than any eval's)
    out = tmp_path / 'run'
    shutil.copytree(base('pp_train.py')[0], out)
    best = out / 'dcp' / (out / 'dcp' / 'best').read_text()
    extra = torch.load(best / 'extra.pt', weights_only=True)
    (best / 'extra.pt').unlink()  # a file of its own, not the step folder's (a hard link)
    torch.save({**extra, 'val_loss': 0.5}, best / 'extra.pt')
    shutil.move(out / 'dcp' / 'step-00000010', tmp_path / 'aside')
    p = run('pp_train.py', *tiny(data_dir, out, *BASE, '--log_interval=3', '--wandb_log=True'), cwd=tmp_path)
    assert re.search(rf'resuming from {out}/dcp/step-00000008 at iter 8\b', p.stdout), p.stdout[-3000:]
    assert logged_in_its_wandb_run(wandb_calls(), out)
    assert [it for it in read_metrics(out)[0] if it >= 8] == [8, 9]  # a launch's first step logged alone
    assert (out / 'dcp' / 'best').read_text() == best.name
    assert torch.load(best / 'extra.pt', weights_only=True)['val_loss'] == 0.5
    extra = torch.load(out / 'dcp' / 'step-00000010' / 'extra.pt', weights_only=True)
    assert extra['best_val_loss'] == 0.5 and counts_tokens(extra)  # pp_train.py's, resumed at 8


def test_a_damaged_newest_checkpoint_takes_no_good_state_s_place_among_the_kept(base, tmp_path, data_dir,
                                                                                  wandb_calls):
    # ckpt.pt (10) damaged: the run resumes from ckpt.prev.pt (8). Moved down with the versions, the damaged file
    # would push 6 out at the first save and 8 at the next; it is kept aside, and the good ones move up in its place
    base_dir, _ = base('train.py')
    out = tmp_path / 'run'
    damaged = copy_with_a_damaged_ckpt(base_dir, out)
    p = run('train.py', *tiny(data_dir, out, *BASE), cwd=tmp_path)
    assert kept_iters('train.py', out) == ([6, 8, 10], [])
    assert re.search(rf'resuming from {out}/ckpt.pt at iter 8\b', p.stdout), p.stdout[-3000:]
    assert (out / 'damaged-ckpt.pt').read_bytes() == damaged
    assert same_weights(final_weights('train.py', out), final_weights('train.py', base_dir))
    # a start stopped between those renames (ckpt.pt set aside, the others not yet moved up), or a version deleted
    # by hand, leaves a gap: it closes at the next start, or a save would move 8 onto 6 with ckpt.pt's slot empty
    shutil.rmtree(out)
    shutil.copytree(base_dir, out)
    (out / 'ckpt.pt').rename(out / 'damaged-ckpt.pt')
    p = run('train.py', *tiny(data_dir, out, *BASE, '--log_interval=3', '--wandb_log=True'), cwd=tmp_path)
    assert kept_iters('train.py', out) == ([6, 8, 10], [])
    assert 'ckpt.prev.pt is renamed' in p.stdout and re.search(rf'resuming from {out}/ckpt.pt at iter 8\b', p.stdout)
    assert logged_in_its_wandb_run(wandb_calls(), out)
    # a launch's first step (its compilation, on a GPU) is timed alone, never averaged into the next ones' ms and MFU
    assert [it for it in read_metrics(out)[0] if it >= 8] == [8, 9]


def test_a_damaged_export_beside_good_step_folders_takes_no_good_versions_place(base, tmp_path, data_dir):
    # decent_train.py resumes from its step folders (10); its ckpt.pt export (10) damaged, with good versions
    # before it (8, 6), was no reason to stop it, but moved down with them it pushed 8 out at the second save
    base_dir, _ = base('decent_train.py')
    out = tmp_path / 'run'
    damaged = copy_with_a_damaged_ckpt(base_dir, out)
    p = run('decent_train.py', *tiny(data_dir, out, '--max_iters=12', '--eval_interval=2', '--keep_checkpoints=3',
                                     '--log_interval=4'), cwd=tmp_path)
    assert re.search(r'resuming from \S+step-00000010 at iter 10\b', p.stdout), p.stdout[-3000:]
    assert [it for it in read_metrics(out)[0] if it >= 10] == [10]  # a launch's first step logged alone
    assert (out / 'damaged-ckpt.pt').read_bytes() == damaged
    assert kept_iters('decent_train.py', out) == ([8, 10, 12], [8, 10, 12])


@pytest.mark.parametrize('script', ['fsdp_train.py', 'ds_train.py', 'decent_train.py'])
def test_the_first_eval_of_a_run_resumed_from_its_step_folder_that_is_a_new_best_names_that_folder_the_best(
        base, tmp_path, data_dir, script, wandb_calls):
    # resumed from the step folder of a save between evals (SIGTERM's, save_storage_interval's), whose step's eval is
    # a new best: the save found the folder there and wrote nothing, and best went on naming the older best, whose
    # folder pruning keeps while the better one is pruned
    out, val = base(script)
    kind, state = tmp_path / 'run' / KIND[script], {'fsdp_train.py': 'extra.pt', 'decent_train.py': 'rank-0.pt',
                                                    'ds_train.py': 'mp_rank_00_model_states.pt'}[script]
    shutil.copytree(out, tmp_path / 'run')
    assert val[5] < val[3]  # the eval at 10 is better than the one at 6
    for old in kind.glob('best-*'):
        shutil.rmtree(old)
    (tmp_path / 'run' / 'best.pt').unlink(missing_ok=True)
    shutil.copytree(kind / 'step-00000006', kind / 'best-step-00000006', copy_function=os.link)
    (kind / 'best').write_text('best-step-00000006')
    path = kind / 'step-00000010' / state
    if script == 'ds_train.py':
        from ds_state import DS_SAFE_GLOBALS  # here: it imports DeepSpeed
    with torch.serialization.safe_globals(DS_SAFE_GLOBALS if script == 'ds_train.py' else []):
        saved = torch.load(path, weights_only=True)
    os.remove(path)  # a file of its own: best-step-N's links keep theirs
    torch.save({**saved, 'val_loss': None, 'best_val_loss': 1e9}, path)  # saved before the eval at 10
    p = run(script, *tiny(data_dir, tmp_path / 'run', *BASE, '--wandb_log=True'), cwd=tmp_path)
    assert re.search(r'resuming from \S+step-00000010 at iter 10\b', p.stdout), p.stdout[-3000:]
    assert (kind / 'best').read_text() == 'best-step-00000010'
    assert logged_in_its_wandb_run(wandb_calls(), tmp_path / 'run')
    assert sorted(f.name for f in kind.glob('best-*')) == ['best-step-00000010']
    if script != 'fsdp_train.py':  # and the export's best.pt
        assert iter_of(tmp_path / 'run' / 'best.pt') == 10


SAVE_TWICE = '''
import os, sys
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[2])  # the repo
from checkpoint import wait_for_saves
from sharded import save_dcp
dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)
path = os.path.join(sys.argv[1], 'dcp', 'step-00000004')
extra = {'iter_num': 4, 'run_id': 'a' * 32}
save_dcp({'w': torch.arange(4.0)}, extra, path, None)
wait_for_saves()
open(os.path.join(path, 'marker'), 'w').close()  # gone if the folder is removed and written again
save_dcp({'w': torch.arange(4.0)}, extra, path, None)  # resumed from a memory snapshot of step 4: its first eval
wait_for_saves()
print('kept' if os.path.exists(os.path.join(path, 'marker')) else 'rewritten')
save_dcp({'w': torch.arange(4.0)}, {**extra, 'val_loss': 1.0}, path, None, best=True)  # a new best: its extra.pt
wait_for_saves()
print('kept' if os.path.exists(os.path.join(path, 'marker')) else 'rewritten')
os.remove(os.path.join(path, '.metadata'))  # a save cut short: written again
save_dcp({'w': torch.arange(4.0)}, extra, path, None)
wait_for_saves()
print('whole' if os.path.isfile(os.path.join(path, '.metadata')) else 'cut short')
save_dcp({'w': torch.arange(4.0)}, {**extra, 'val_loss': 0.5}, path, path, best=True)  # resumed from it: a new best
wait_for_saves()
dist.destroy_process_group()
'''


def test_a_save_to_the_step_of_a_whole_dcp_folder_of_the_run_keeps_it(tmp_path):
    # a run killed after its step-4 folder and its memory snapshot of step 4, resumed from the snapshot: its first
    # eval left the folder that latest names removed while it wrote it again (also where that eval was a new best,
    # whose extra.pt, with its val loss, is now the one file written)
    (tmp_path / 'save_twice.py').write_text(SAVE_TWICE)
    p = run(tmp_path / 'save_twice.py', tmp_path, REPO, cwd=tmp_path)
    assert [line for line in p.stdout.splitlines() if not line.startswith('saving')] == ['kept', 'kept', 'whole']
    assert (tmp_path / 'dcp' / 'latest').read_text() == 'step-00000004'
    # the last, a run resumed from that folder whose first eval is a new best, named no best and recorded no loss
    assert (tmp_path / 'dcp' / 'best').read_text() == 'best-step-00000004'
    assert torch.load(tmp_path / 'dcp' / 'best-step-00000004' / 'extra.pt', weights_only=True)['val_loss'] == 0.5


@pytest.mark.filterwarnings('ignore:torch.distributed is disabled')  # DCP's note on a save in one process
def test_a_crash_as_a_best_saved_again_is_replaced_leaves_best_naming_a_whole_folder(tmp_path, monkeypatch):
    # a step saved as the best twice (resumed from its memory snapshot): best-step-N was removed before its new copy
    # was renamed in, and a crash between left best naming a folder that was not there, for every tool and resume
    args = dict(n_layer=1, n_head=1, n_embd=8, block_size=8, bias=False, vocab_size=16, dropout=0.0)
    run_dir, dcp_dir = tmp_path / 'run', tmp_path / 'run' / 'dcp'

    def save(step, val_loss):  # a step folder as fsdp_train.py writes it: DCP's shards and .metadata, and extra.pt
        folder = dcp_dir / f'step-{step:08d}'
        shutil.rmtree(folder, ignore_errors=True)
        model = GPT(GPTConfig(**args))
        dcp.save({'model': model.state_dict()}, checkpoint_id=str(folder), no_dist=True)
        torch.save({'model_args': args, 'iter_num': step, 'val_loss': val_loss}, folder / 'extra.pt')
        return str(folder), model
    point_latest(save(4, 2.0)[0], best=True)
    folder, model = save(4, 1.5)  # the same step again, a lower val loss
    real = os.replace

    def killed(src, dst):  # as the new copy is renamed in
        if src.endswith('best-copy.tmp') and os.path.isdir(src):
            raise RuntimeError('killed')
        real(src, dst)
    monkeypatch.setattr(os, 'replace', killed)
    with pytest.raises(RuntimeError, match='killed'):
        point_latest(folder, best=True)
    monkeypatch.undo()
    for best in (run_dir / 'best', dcp_dir / 'best'):  # whole, and the new state
        read, saved = load_checkpoint(str(best))
        assert saved['val_loss'] == 1.5 and same_weights(read.state_dict(), model.state_dict())
    # the run goes on: its saves prune no folder that best names, and the next best takes its place
    for step in (6, 8):
        point_latest(save(step, 3.0)[0], keep=2)
    assert load_checkpoint(str(run_dir / 'best'))[1]['iter_num'] == 4
    point_latest(save(10, 1.0)[0], keep=2, best=True)
    assert sorted(p.name for p in dcp_dir.iterdir()) == ['best', 'best-step-00000010', 'latest', 'step-00000008',
                                                         'step-00000010']
    assert load_checkpoint(str(run_dir / 'best'))[1]['iter_num'] == 10


def test_pruning_removes_only_the_runs_own_folders_never_another_runs_or_one_whose_run_no_file_tells(tmp_path):
    # another run's folders copied in by hand without the file that tells a folder's run (decent_train.py's rank-0.pt,
    # DCP's extra.pt): pruning took them for the run's own, counted them among its fallbacks and removed them; a
    # new best removed the best-step-N of another run that its best file (copied in beside it) named
    def folder(kind, step, files):
        (tmp_path / kind / f'step-{step:08d}').mkdir(parents=True, exist_ok=True)
        for name, content in files.items():
            path = tmp_path / kind / f'step-{step:08d}' / name
            torch.save(content, path) if isinstance(content, dict) else path.write_bytes(content)
        return str(tmp_path / kind / f'step-{step:08d}')
    replica = lambda step, run_id: {'iter_num': step, 'rng': [0, 0], 'run_id': run_id}
    for step in (2, 4):
        folder('decent', step, {f'rank-{r}.pt': replica(step, 'mine') for r in (0, 1)})
    folder('decent', 3, {'rank-1.pt': replica(3, 'theirs')})  # another run's, without its rank 0's file
    folder('decent', 1, {'notes.txt': b'a file that tells no run'})
    folder('decent', 5, {})  # empty: nothing in it to keep
    shutil.copytree(folder('decent', 0, {f'rank-{r}.pt': replica(0, 'theirs') for r in (0, 1)}),
                    tmp_path / 'decent' / 'best-step-00000000')  # another run's best, and its best file
    (tmp_path / 'decent' / 'best').write_text('best-step-00000000')
    # a user's copies of the run's own folders beside them: a resume read step-N.bak as a step folder, pruning
    # counted one among the fallbacks and removed the other
    shutil.copytree(tmp_path / 'decent' / 'step-00000002', tmp_path / 'decent' / 'step-00000002.bak')
    shutil.copytree(tmp_path / 'decent' / 'step-00000004', tmp_path / 'decent' / 'step-00000004 keep')
    theirs = {p: p.read_bytes() for p in (tmp_path / 'decent').rglob('*') if p.is_file() and
              re.search(r'step-0000000([013]|2\.bak|4 keep)', str(p))}
    point_latest(folder('decent', 6, {f'rank-{r}.pt': replica(6, 'mine') for r in (0, 1)}), keep=2, best=True)
    assert sorted(p.name for p in (tmp_path / 'decent').iterdir()) == [
        'best', 'best-step-00000000', 'best-step-00000006', 'latest', 'step-00000000', 'step-00000001',
        'step-00000002.bak', 'step-00000003', 'step-00000004', 'step-00000004 keep', 'step-00000006']  # the run's
    assert {p: p.read_bytes() for p in theirs} == theirs  # step 4, its one fallback, and none of theirs or the user's
    assert [os.path.basename(f) for f in step_folders(str(tmp_path / 'decent'))] == [
        'step-00000006', 'step-00000004', 'step-00000003', 'step-00000001', 'step-00000000']  # what a resume reads
    # a DCP folder of another run without its extra.pt: shards and .metadata tell no run
    folder('dcp', 3, {'.metadata': b'theirs', '__0_0.distcp': b'theirs'})
    for step in (4, 6):
        point_latest(folder('dcp', step, {'extra.pt': {'iter_num': step, 'run_id': 'mine'}}), keep=1)
    assert sorted(p.name for p in (tmp_path / 'dcp').iterdir()) == ['latest', 'step-00000003', 'step-00000006']
