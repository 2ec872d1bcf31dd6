"""Running out of memory: one line that says what ran out, where, what was asked for and how to fit it; a non-zero
exit; and nothing a run saved lost. The allocations fail for real: a rank may map only TEST_AS_MARGIN bytes more than
it had when it started (RLIMIT_AS, set by launcher.py), and what runs out asks for more than that (a batch's
activations, at once, or a model's state, a save's copy of it, a checkpoint read back), whatever the machine's RAM."""

import shutil
import sys

import pytest
import torch

from conftest import REPO, TINY, one_line_error, run

MARGIN = 1 << 30
HUGE = ['--batch_size=524288', '--eval_iters=2', '--max_iters=4']  # an activation of 2 GiB, its tokens' 0.14 GiB


@pytest.fixture
def limited(monkeypatch):
    monkeypatch.setenv('TEST_AS_MARGIN', str(MARGIN))


@pytest.mark.parametrize('script, nproc', [('train.py', 1), ('fsdp_train.py', 1), ('ds_train.py', 1),
                                           ('decent_train.py', 2), ('pp_train.py', 2), ('bench.py', 1)])
def test_running_out_of_memory_is_one_line_that_names_the_fix(tmp_path, data_dir, limited, script, nproc):
    args = ['--compile=False', '--device=cpu', '--n_layer=2', '--n_head=2', '--n_embd=32', '--block_size=32',
            '--batch_size=524288', '--warmup=0', '--iters=1'] if script == 'bench.py' else \
        [*TINY, f'--dataset={data_dir / "shakespeare_char"}', '--out_dir=out', '--gradient_accumulation_steps=2', *HUGE]
    p = run(script, *args, nproc=nproc, cwd=tmp_path, check=False)
    line = one_line_error(p, nproc)
    assert 'Traceback' not in p.stderr, p.stderr[-3000:]
    where = 'a training step' if script == 'bench.py' else 'an eval'
    assert line.startswith(f"error: out of host RAM{' of rank ' if nproc > 1 else ''}"), line
    assert f" in {where}, asking " in line and "batch_size=524288 x block_size=32 tokens" in line, line
    assert "n_layer=2, n_head=2, n_embd=32" in line and "a larger --gradient_accumulation_steps" in line, line
    assert ("--activation_checkpointing=True" in line) == (script == 'fsdp_train.py'), line
    assert "python model_size.py --n_layer=2 --n_head=2 --n_embd=32 " in line, line


def test_a_batch_whose_eval_fits_but_whose_step_does_not_names_the_first_step(tmp_path, data_dir, limited):
    # an eval keeps one layer's activations at a time, a training step all 8 layers' for the backward
    p = run('train.py', *TINY, f'--dataset={data_dir / "shakespeare_char"}', '--out_dir=out', '--n_layer=8',
            '--batch_size=2048', '--eval_iters=1', '--gradient_accumulation_steps=1', cwd=tmp_path, check=False)
    line = one_line_error(p)
    assert line.startswith("error: out of host RAM in the first training step, asking "), line
    assert "with batch_size=2048 x block_size=32 tokens a micro-step a rank" in line, line


def test_a_resume_that_runs_out_of_memory_leaves_the_checkpoint_as_it_was(tmp_path, data_dir, shared_run, limited):
    out = tmp_path / 'run'
    shutil.copytree(shared_run('train.py', '--max_iters=2', '--eval_interval=2'), out)
    before = (out / 'ckpt.pt').read_bytes()
    p = run('train.py', *TINY, f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={out}', '--eval_interval=2',
            *HUGE, cwd=tmp_path, check=False)
    assert one_line_error(p).startswith("error: out of host RAM in an eval, asking "), p.stderr[-3000:]
    assert (out / 'ckpt.pt').read_bytes() == before
    assert not list(out.glob('*.tmp'))


@pytest.mark.parametrize('short', [1, 0])
def test_a_rank_that_runs_out_says_so_and_the_other_stops_with_a_line_not_a_traceback(tmp_path, data_dir, limited,
                                                                                       monkeypatch, short):
    # one rank alone is short of memory (a smaller GPU, a busier host): it leaves, the other's next collective fails
    # ("Connection closed by peer"), and that rank names the rank that ran out rather than print gloo's traceback;
    # rank 0 too, though it hosted the group's store
    monkeypatch.setenv('TEST_AS_MARGIN', str(80 << 20))  # less than the 6M-parameter model's state (~125 MiB)
    monkeypatch.setenv('TEST_AS_RANKS', str(short))
    p = run('train.py', *TINY, f'--dataset={data_dir / "shakespeare_char"}', '--out_dir=out', '--n_embd=512',
            '--gradient_accumulation_steps=2', '--max_iters=2', nproc=2, cwd=tmp_path, check=False)
    assert p.returncode != 0 and 'Traceback' not in p.stderr, p.stderr[-3000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith('error: ')]
    assert len(errors) == 2 and errors[0].startswith(f"error: out of host RAM of rank {short} on "), p.stderr[-3000:]
    assert "n_embd=512 (6.36M parameters)" in errors[0] and "model_size.py" in errors[0], errors[0]
    assert errors[1] == f"error: rank {1 - short} stopped: rank {short} ran out of memory (its line above says how " \
                        f"to fit the run)"


# a 25M-parameter model trains in a margin of 0.8 GiB (weights, gradients, AdamW's moments), but a save's copy of
# weights and moments in host memory needs 0.3 GiB more, and reading them back at a resume does not fit 0.4 GiB
BIG = ['--n_embd=1024', '--gradient_accumulation_steps=1', '--eval_interval=2', '--eval_iters=1']


def test_a_resume_short_of_memory_for_its_checkpoint_says_so_and_never_calls_it_damaged(tmp_path, data_dir,
                                                                                         monkeypatch):
    # the failed read was taken for damage: "checkpoint out/ckpt.pt is corrupt ...: move it aside", of a good one
    big = [*TINY, f'--dataset={data_dir / "shakespeare_char"}', '--out_dir=out', *BIG]
    run('train.py', *big, '--max_iters=2', cwd=tmp_path)
    files = {f.name: f.read_bytes() for f in (tmp_path / 'out').iterdir() if f.is_file() and f.suffix == '.pt'}
    monkeypatch.setenv('TEST_AS_MARGIN', str(400 << 20))
    p = run('train.py', *big, '--max_iters=4', cwd=tmp_path, check=False)
    line = one_line_error(p)
    assert line.startswith("error: out of host RAM in the start (building the model, loading the state)"), line
    assert "the model's state does not fit, whatever the batch" in line, line
    assert {f.name: f.read_bytes() for f in (tmp_path / 'out').iterdir() if f.is_file() and f.suffix == '.pt'} == files
    monkeypatch.setenv('TEST_AS_MARGIN', str(200 << 20))  # a tool reading it alike: its weights and moments, 0.3 GiB
    p = run('sample.py', '--out_dir=out', '--device=cpu', '--num_samples=1', '--max_new_tokens=8',
            f'--meta_path={data_dir / "shakespeare_char" / "meta.pkl"}', cwd=tmp_path, check=False)
    assert one_line_error(p).startswith("error: out of host RAM in the start (building the model, loading the state)"
                                        ", asking "), p.stderr[-3000:]
    assert "sampling from the model, whose fp32 weights do not fit: free host RAM, or a smaller model" in p.stderr


def test_a_save_whose_host_copy_runs_out_stops_the_run_naming_host_ram(tmp_path, data_dir, monkeypatch):
    # the run's last save, which no step runs beside (a step's allocations, beside the copy, could run out first)
    monkeypatch.setenv('TEST_AS_MARGIN', str(800 << 20))
    p = run('train.py', *TINY, f'--dataset={data_dir / "shakespeare_char"}', '--out_dir=out', *BIG, '--max_iters=2',
            cwd=tmp_path, check=False)
    line = one_line_error(p)
    assert line.startswith("error: writing the checkpoint out/ckpt.pt failed (out of host RAM copying the state "
                           "for it, asking "), line
    assert "no checkpoint was complete before: free host RAM" in line, line
    assert not (tmp_path / 'out' / 'ckpt.pt').exists() and not list((tmp_path / 'out').glob('*.tmp'))


def test_the_line_names_the_step_that_ran_out():
    # the runs above run out at their first eval, which comes before any step: the loop's own steps, by its counters
    sys.path.insert(0, str(REPO))
    from oom import where

    def traceback_of(fail):
        try:
            fail()
        except RuntimeError as e:
            return e.__traceback__

    def forward():
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 99 bytes")
    tb = traceback_of(forward)
    assert where(tb, {'local_iter_num': 0, 'iter_num': 30}) == 'the first training step'
    assert where(tb, {'local_iter_num': 5, 'iter_num': 35}) == 'training step 35'
    assert where(tb, {}) == 'the start (building the model, loading the state)'

    def estimate_loss():
        forward()
    assert where(traceback_of(estimate_loss), {'local_iter_num': 5, 'iter_num': 35}) == 'an eval'


SAVING_WHEN_IT_RUNS_OUT = '''
import sys, time, torch
sys.path.insert(0, sys.argv[1])
import checkpoint
from oom import explain_oom
batch_size, block_size = 8, 16
explain_oom(globals())
save = torch.save
def slow_save(obj, f, *args, **kwargs):  # a big state's write, still going when the step runs out
    time.sleep(2)
    return save(obj, f, *args, **kwargs)
torch.save = slow_save
checkpoint.save_in_background({'iter_num': 7, 'w': torch.ones(4)}, 'ckpt.pt')
torch.empty(2 << 30, dtype=torch.uint8)  # beyond what the process may map
'''


def test_a_save_in_flight_when_memory_runs_out_is_written_whole_before_the_exit(tmp_path, limited):
    (tmp_path / 'saving.py').write_text(SAVING_WHEN_IT_RUNS_OUT)
    p = run(tmp_path / 'saving.py', REPO, cwd=tmp_path, check=False)
    assert one_line_error(p).startswith("error: out of host RAM in the start (building the model, loading the "
                                        "state), asking 2.0 GiB more, with batch_size=8 x block_size=16"), p.stderr
    assert torch.load(tmp_path / 'ckpt.pt', weights_only=True)['iter_num'] == 7
    assert not list(tmp_path.glob('*.tmp'))


def test_a_gpus_out_of_memory_names_the_gpu_and_the_size_torch_gives():
    # no GPU here: torch's CUDA error as its caching allocator words it, raised where an eval would run out
    sys.path.insert(0, str(REPO))
    from oom import is_oom, oom_line

    def estimate_loss():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total capacity of "
                                     "79.19 GiB of which 1.06 GiB is free.")
    try:
        estimate_loss()
    except torch.OutOfMemoryError as e:
        g = {'device': 'cuda:0', 'batch_size': 64, 'gradient_accumulation_steps': 8, 'activation_checkpointing': False,
             'model_args': dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304, bias=False)}
        assert is_oom(e) and oom_line(e, e.__traceback__, g).startswith(
            "error: out of cuda:0's memory in an eval, asking 2.50 GiB more, with batch_size=64 x block_size=1024 "
            "tokens a micro-step a rank and a model of n_layer=12, n_head=12, n_embd=768 (124.")
        assert "--gradient_accumulation_steps, which keeps the tokens per step, or --activation_checkpointing=True, " \
            "and size a run first with `python model_size.py --n_layer=12 --n_head=12 --n_embd=768 " \
            "--vocab_size=50304 --block_size=1024 --batch_size=N --world_size=1`" in oom_line(e, e.__traceback__, g)
    assert not is_oom(RuntimeError("Expected all tensors to be on the same device"))  # a bug keeps its traceback
