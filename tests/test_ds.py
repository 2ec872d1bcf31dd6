"""ds_train.py in real process groups on gloo, in fp32: ZeRO 0-3 against train.py on one process, on ranks started
as torchrun starts them and under the deepspeed launcher; ZeRO-Offload; exact resume; the consolidated export read
by sample.py and train.py; per-rank memory; bad input."""

import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import REPO, TINY, counts_tokens, env, free_port, one_line_error, read_metrics, run
import launcher

# the same global batch everywhere: 4 micro-steps of 4 sequences, shared out over the data-parallel ranks
BASE = ['--gradient_accumulation_steps=4', '--eval_interval=5', '--always_save_checkpoint=True']


def launch(script, tmp_path, data_dir, out, *extra, nproc=1, check=True):
    return run(script, *TINY, *BASE, f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={tmp_path / out}',
               *extra, nproc=nproc, cwd=tmp_path, check=check)


def deepspeed_launch(tmp_path, data_dir, out, *extra, nproc=2):
    """ds_train.py under `deepspeed --num_gpus N` (its module, on the CPU N processes), on a free port."""
    port = free_port()
    return launched([sys.executable, '-m', 'deepspeed.launcher.runner', f'--num_gpus={nproc}', f'--master_port={port}',
                     str(REPO / 'ds_train.py'), *TINY, *BASE, f'--dataset={data_dir / "shakespeare_char"}',
                     f'--out_dir={tmp_path / out}', *extra], tmp_path)


def dlrover_launch(tmp_path, data_dir, out, *extra):
    """ds_train.py as DLRover's nanoGPT example runs its DeepSpeed script, launcher and flags as written there
    (argparse's space-separated values, --data_dir, --epochs, a bare --decay_lr: DLRover's default, taken for what
    its flags leave out, is a constant rate), through launch/dlrover_run.py for dlrover-run."""
    shape = ('--n_layer', '--n_head', '--n_embd')  # given here as DLRover writes them
    return launched([sys.executable, str(REPO / 'launch' / 'dlrover_run.py'), '--nnodes=1', '--max_restarts=2',
                     '--nproc_per_node=2', str(REPO / 'ds_train.py'), '--n_layer', '2', '--n_head', '2', '--n_embd',
                     '32', '--data_dir', str(data_dir / 'shakespeare_char'), '--epochs', '1',
                     '--save_memory_interval', '3', '--save_storage_interval', '4', '--decay_lr',
                     *[a for a in TINY if a.split('=')[0] not in shape], *BASE, f'--out_dir={tmp_path / out}', *extra],
                    tmp_path)


def launched(cmd, tmp_path):
    p = subprocess.run(cmd, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"{' '.join(cmd)} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return p


def assert_same_curve(a, b, iters, rel=1e-5):
    assert all(i in a and i in b for i in iters), (sorted(a), sorted(b))
    for i in iters:
        assert abs(a[i] - b[i]) <= rel * abs(a[i]), (i, a[i], b[i])


def assert_same_state(a, b, atol=1e-5):
    """The weights and Adam moments of two train.py-format checkpoints, parameter by parameter."""
    a, b = (torch.load(p, map_location='cpu', weights_only=True) for p in (a, b))
    assert a['model'].keys() == b['model'].keys()
    for k in a['model']:  # absolute: c_k's bias gets no gradient and holds only rounding noise that Adam scales up
        assert (a['model'][k] - b['model'][k]).abs().max().item() < atol, k
    sa, sb = a['optimizer']['state'], b['optimizer']['state']
    assert sa.keys() == sb.keys() and all(sa[i]['step'] == sb[i]['step'] for i in sa)
    for i in sa:
        for k in ('exp_avg', 'exp_avg_sq'):
            assert (sa[i][k] - sb[i][k]).abs().max().item() < atol, (i, k)
    ga, gb = a['optimizer']['param_groups'], b['optimizer']['param_groups']
    assert [{**g, 'lr': round(g['lr'], 12)} for g in ga] == [{**g, 'lr': round(g['lr'], 12)} for g in gb]


def logged_state(out):
    with open(out / 'metrics.jsonl') as f:
        return next(r for r in map(json.loads, f) if 'param_bytes' in r)


@pytest.fixture(scope='module')
def cpu_adam_build():
    """DeepSpeed's CPU Adam (for the offload tests) takes minutes to build the first time on 2 cores: it builds in
    the background, into the session's TORCH_EXTENSIONS_DIR, while the tests before them run."""
    p = subprocess.Popen([sys.executable, '-c', 'from deepspeed.ops.op_builder.cpu import CPUAdamBuilder; '
                          'CPUAdamBuilder().load()'], env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True)
    yield p
    p.communicate()


@pytest.fixture(scope='module')
def cpu_adam(cpu_adam_build):
    _, err = cpu_adam_build.communicate(timeout=600)
    assert cpu_adam_build.returncode == 0, err[-3000:]


@pytest.fixture(scope='module')
def ref(shared_run, cpu_adam_build):  # the build starts before the first run
    """train.py on one process, 10 steps: the curve every ZeRO stage must reproduce (test_fsdp.py's too)."""
    out = shared_run('train.py', *BASE, '--max_iters=10')
    losses, _ = read_metrics(out)
    assert losses[9] < losses[0] - 0.3  # it learns
    return out, losses


@pytest.fixture(scope='module')
def stages(tmp_path_factory, data_dir, ref):
    """ds_train.py on 2 ranks at each ZeRO stage, 10 steps; stage 0 with DLRover's command under dlrover-run, stage 1
    under the deepspeed launcher, stage 2 in deterministic mode (which turns dropout off: the curve stays
    train.py's)."""
    tmp = tmp_path_factory.mktemp('stages')
    # stage 3 adds a user's DeepSpeed settings (read, of the right types, and none contradicting ours) from a file,
    # with "auto" (Hugging Face's word) for some of ours, which keeps them
    (tmp / 'ds.json').write_text(json.dumps({'steps_per_print': 1000, 'wall_clock_breakdown': False,
                                             'gradient_predivide_factor': 1, 'train_batch_size': 'auto',
                                             'gradient_clipping': 'auto', 'bf16': {'enabled': 'auto'},
                                             'zero_optimization': {'overlap_comm': False, 'stage': 'auto',
                                                                   'reduce_bucket_size': 'auto'}}))

    def one(stage):
        args = (f'--zero_stage={stage}', '--max_iters=10', *([f'--ds_config={tmp / "ds.json"}'] if stage == 3 else []))
        if stage == 0:
            return dlrover_launch(tmp, data_dir, f'zero{stage}', *args)
        if stage == 1:
            return deepspeed_launch(tmp, data_dir, f'zero{stage}', *args)
        return launch('ds_train.py', tmp, data_dir, f'zero{stage}', *args,
                      *(['--deterministic=True', '--dropout=0.1'] if stage == 2 else []), nproc=2)
    # the four runs at once: two start fresh interpreters under their launchers, which mostly wait: one after
    # another, they were 48 s of this file's 74 on an idle machine
    with ThreadPoolExecutor(4) as pool:
        runs = list(pool.map(one, (0, 1, 2, 3)))
    for stage, p in enumerate(runs):
        if stage == 0:
            # one epoch of train.bin's 1,003,822 sequences (one at each offset) at 16 an iteration; max_iters=10 ends
            assert "--epochs 1 is DLRover's name: here --max_iters=62739" in p.stdout
            assert 'max_iters=10 ends' in p.stdout
            assert 'running as dlrover-run --standalone' in p.stdout
            assert 'saving checkpoint to ' + str(tmp / 'zero0' / 'ds' / 'step-00000004') in p.stdout
        assert 'world size 2, 2 micro-steps per rank' in p.stdout
        assert ('deterministic: dropout 0.1 turned off' in p.stdout) == (stage == 2)
    assert json.loads((tmp / 'zero2' / 'config.json').read_text())['dropout'] == 0.0
    return {stage: tmp / f'zero{stage}' for stage in (0, 1, 2, 3)}


def test_zero_stages_on_two_ranks_match_train_py_on_one(ref, stages):
    for stage, out in stages.items():
        assert_same_curve(ref[1], read_metrics(out)[0], range(10))
        # the consolidated export: train.py's checkpoint, optimizer state and all
        assert_same_state(ref[0] / 'ckpt.pt', out / 'ckpt.pt')
        assert (out / 'ds' / 'latest').read_text() == 'step-00000010'
        # older ones removed, but the one before: a fallback should the newest turn out damaged
    assert sorted(p.name for p in (out / 'ds').glob('step-*')) == ['step-00000005', 'step-00000010']


def test_zero_buckets_are_the_models_size_unless_a_config_sets_them():
    # stage 2 above runs in deterministic mode, which fills each bucket DeepSpeed allocates every step: at its default
    # of 5e8 elements that was 0.49 s a step of a tiny model; a bucket of the model's size is the same one bucket
    from ds_state import bucket_sizes
    zero = {'stage': 2, 'allgather_bucket_size': 'auto'}
    bucket_sizes(zero, 30_000)
    assert zero == {'stage': 2, 'reduce_bucket_size': 30_000, 'allgather_bucket_size': 30_000}
    zero = {'reduce_bucket_size': 10**6}  # a user's, from --ds_config
    bucket_sizes(zero, 10**10)
    assert zero == {'reduce_bucket_size': 10**6, 'allgather_bucket_size': 5 * 10**8}
    zero = {}  # an odd count (n_embd=33): stages 1 and 2 assert that the all-gather's bucket is even
    bucket_sizes(zero, 1_687_389)
    assert zero == {'reduce_bucket_size': 1_687_390, 'allgather_bucket_size': 1_687_390}


def test_a_float16_overflow_at_deepspeeds_least_loss_scale_stops_in_one_line(tmp_path):
    # its own loss scaler, at min_loss_scale, raises as the engine's step would (a whole float16 run to that stop:
    # test_fault_single.py)
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from ds_state import step_or_stop
    scaler = DynamicLossScaler(init_scale=1, scale_window=1000, min_scale=1, delayed_shift=1,
                               consecutive_hysteresis=False, raise_error_at_min_scale=True, dtype=torch.half)
    model = type('Engine', (), {'step': lambda self: scaler.update_scale(True)})()
    with pytest.raises(SystemExit) as e:
        step_or_stop(model, 2, 7, str(tmp_path), 'run')
    assert e.value.code == (f"error: 3 steps in a row up to iter 7 had a non-finite gradient in float16 at "
                            f"DeepSpeed's min_loss_scale; {tmp_path} holds no state saved before the weights went bad: "
                            f"lower learning_rate, use bfloat16 rather than float16, or check the data")
    model.step = lambda: 1 / 0  # any other error is DeepSpeed's to raise
    with pytest.raises(ZeroDivisionError):
        step_or_stop(model, 0, 7, str(tmp_path), 'run')



def test_per_rank_optimizer_state_at_stage_1_and_up_is_at_most_0_6_of_stage_0(stages):
    mem = {stage: logged_state(out) for stage, out in stages.items()}
    assert mem[0]['optim_bytes'] > 0
    for stage in (1, 2, 3):
        assert mem[stage]['optim_bytes'] <= 0.6 * mem[0]['optim_bytes'], (stage, mem)
        # DeepSpeed 0.19.8 reduce-scatters the gradients into partitions from stage 1 on
        assert mem[stage]['grad_bytes'] <= 0.6 * mem[0]['grad_bytes'], (stage, mem)
    # ZeRO-3's parameter partitions come with fp32 master partitions, which stages 1 and 2 hold beside whole weights
    assert mem[3]['param_bytes'] < mem[1]['param_bytes'] == mem[2]['param_bytes']


@pytest.mark.parametrize('stage', [2, 3])
def test_a_zero_run_resumes_exactly_with_its_own_optimizer_settings_or_those_given(tmp_path, data_dir, stage):
    args = [f'--zero_stage={stage}', '--dropout=0.1']  # the RNG state has to come back too, on every rank
    # the run's own settings, which a resume that does not give them keeps; flags given to a resume take effect (the
    # engine's load put the saved ones back over them) and the export says so (it said the ones the run began with)
    settings = ['--weight_decay=0.2', '--beta2=0.9']
    with ThreadPoolExecutor(2) as pool:  # the whole run and the first half at once
        list(pool.map(lambda a: launch('ds_train.py', tmp_path, data_dir, *a, nproc=2),
                      [('full', *args, *settings, '--max_iters=10'), ('split', *args, *settings, '--max_iters=5')]))
    launch('ds_train.py', tmp_path, data_dir, 'split', *args, '--max_iters=10', '--init_from=resume', nproc=2)
    full, split = read_metrics(tmp_path / 'full')[0], read_metrics(tmp_path / 'split')[0]
    assert sorted(split) == list(range(10))
    assert [split[i] for i in range(10)] == [full[i] for i in range(10)]  # bit for bit
    launch('ds_train.py', tmp_path, data_dir, 'split', *args, '--max_iters=11', '--weight_decay=0.5', '--beta1=0.8',
           nproc=2)
    groups = torch.load(tmp_path / 'split' / 'ckpt.pt', weights_only=True)['optimizer']['param_groups']
    assert [(g['weight_decay'], tuple(g['betas'])) for g in groups] == [(0.5, (0.8, 0.9)), (0.0, (0.8, 0.9))]


def test_compiled_zero_stage_3_compiles_each_block_once_and_matches_train_py(ref, tmp_path, data_dir):
    # ZeRO-3's hooks on every module had dynamo compile each Linear apart, again for each shape and grad mode, and
    # their own frames once per module: 88 recompiles on 2 ranks in 7 steps, past the limit of 8 twice. With each Block
    # a ZeRO leaf its forward compiles once, then once more for the evals' no_grad (which came first). Dynamo decides
    # what recompiles: its graphs run in aot_eager (autograd traced, no inductor), 10 s of CPU cold where inductor's
    # C++ builds took 29. The ranks are forked as run() forks them, torch imported (fresh interpreters under torchrun
    # took 4.8 s more of CPU): what TORCH_LOGS=recompiles and TORCH_COMPILE_OVERRIDE_BACKENDS=">=0:aot_eager" set at
    # `import torch`, a script sets before it runs ds_train.py
    (tmp_path / 'compiled.py').write_text(
        "import runpy, sys, torch._dynamo, torch._logging\n"
        "torch._logging.set_logs(recompiles=True)\n"
        "torch._dynamo.config.debug_backend_override = '>=0:aot_eager'\n"
        f"sys.argv[0] = {str(REPO / 'ds_train.py')!r}\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    p = launcher.launch(str(tmp_path / 'compiled.py'), [*TINY, *BASE, '--compile=True', '--zero_stage=3',
                                                        '--max_iters=10', f'--dataset={data_dir / "shakespeare_char"}',
                                                        f'--out_dir={tmp_path / "out"}'], env(), tmp_path, nproc=2)
    assert p.returncode == 0, p.stderr[-3000:]
    assert 'recompile_limit' not in p.stderr
    recompiled = [line for line in p.stderr.splitlines() if 'Recompiling function' in line]
    assert len(recompiled) == 2 and all('model.py' in line for line in recompiled), recompiled
    assert_same_curve(ref[1], read_metrics(tmp_path / 'out')[0], range(10))
    assert_same_state(ref[0] / 'ckpt.pt', tmp_path / 'out' / 'ckpt.pt')


def test_a_ds_config_that_turns_off_bf16s_check_of_non_finite_gradients_is_refused_in_one_line(tmp_path, data_dir):
    # without it DeepSpeed in bf16 reads neither each gradient nor the global norm for a non-finite value: a step of a
    # finite loss and an inf gradient spoils the weights for good, and a save after it holds them
    (tmp_path / 'no_check.json').write_text(json.dumps({'bf16': {'check_grad_overflow': False}}))
    p = launch('ds_train.py', tmp_path, data_dir, 'bad', '--dtype=bfloat16', '--max_iters=1',
               f'--ds_config={tmp_path / "no_check.json"}', check=False)
    assert one_line_error(p).endswith("bf16.check_grad_overflow=false (true here): drop bf16.check_grad_overflow (a "
                                      "step of non-finite gradients would spoil the weights for good)")
    assert not (tmp_path / 'bad' / 'ds').exists()


def test_bad_input(tmp_path, data_dir, stages):
    def fails(*args):
        return one_line_error(launch('ds_train.py', tmp_path, data_dir, 'bad', *args, check=False))
    assert 'zero_stage=4 is not one of 0' in fails('--zero_stage=4')
    assert 'overflow_by_norm=True is for ZeRO stages 1 and 2 in bfloat16 or float16' in fails('--overflow_by_norm=True')
    (tmp_path / 'no_norm.json').write_text(json.dumps({'zero_optimization': {'compute_grad_norm': False}}))
    assert 'turns off (compute_grad_norm): drop one' in fails('--overflow_by_norm=True', '--dtype=bfloat16',
                                                            f'--ds_config={tmp_path / "no_norm.json"}')
    # DLRover's ds_config.json's settings (its batch for 16 ranks), an offload, and seven mistakes: every one refused
    # in one line, with the flags that make ours the file's. DeepSpeed itself would ignore the misspelt key, and fail
    # on the string only at the first step, after an eval; those inside a section it refuses at its start, one at a
    # time; the offload, taken from the file, was a traceback (our AdamW is no CPU Adam) and not in the run's layout,
    # and so were a string where DeepSpeed's reader takes a bool (TypeError) and a section it dropped (amp); a
    # monitor's mistake came only from deepspeed.initialize, on its own
    (tmp_path / 'ds.json').write_text(json.dumps({
        'zero_optimization': {'stage': 1, 'offload_optimizer': {'device': 'cpu'}, 'overlap_comm': True,
                              'reduce_bucket_size': 'auto', 'overlap_com': True, 'sub_group_size': 'big'},
        'gradient_accumulation_steps': 1, 'gradient_clipping': 0.1, 'train_batch_size': 256,
        'train_micro_batch_size_per_gpu': 16, 'steps_per_print': 'x', 'gradient_clippin': 0.5,
        'wall_clock_breakdown': 'yes', 'tensorboard': {'enabeld': True}, 'amp': {'enabled': True}}))
    assert fails(f'--ds_config={tmp_path / "ds.json"}') == (
        f"error: {tmp_path / 'ds.json'} contradicts the config in zero_optimization.stage=1 (2 here), "
        "zero_optimization.offload_optimizer={\"device\": \"cpu\"} (\"none\" here), "
        "gradient_accumulation_steps=1 (4 here), gradient_clipping=0.1 (1.0 here), train_batch_size=256 (16 here), "
        "train_micro_batch_size_per_gpu=16 (4 here): give `--zero_stage=1 --offload_optimizer=cpu --grad_clip=0.1 "
        "--batch_size=16 --gradient_accumulation_steps=16` and drop gradient_accumulation_steps (its 1 a rank fits 16 "
        "ranks, not 1: DeepSpeed derives it), or drop those settings from the file; it sets amp, which DeepSpeed "
        "refuses (NVIDIA Apex AMP integration has been removed. Use DeepSpeed 'fp16', 'bf16', or 'torch_autocast' "
        "instead. See https://github.com/deepspeedai/DeepSpeed/issues/8489.); it sets "
        "zero_optimization.sub_group_size=\"big\", which DeepSpeed refuses (Input should be a valid integer, unable to "
        "parse string as an integer); it sets 'zero_optimization.overlap_com', which DeepSpeed 0.19.8 does not read: "
        "check its spelling, or drop it; it sets 'tensorboard.enabeld', which DeepSpeed 0.19.8 does not read: check "
        "its spelling, or drop it; it sets steps_per_print=\"x\", but DeepSpeed takes a whole number there; it "
        "sets 'gradient_clippin', which DeepSpeed 0.19.8 does not read: check its spelling, or drop it; it sets "
        "wall_clock_breakdown=\"yes\", but DeepSpeed takes true or false there")
    assert not (tmp_path / 'bad').exists()
    # ZeRO's shards resume at the world size and stage that wrote them; elsewhere only a consolidated ckpt.pt does
    shutil.copytree(stages[3], tmp_path / 'shards')
    for name in ('ckpt.pt', 'ckpt.prev.pt'):
        (tmp_path / 'shards' / name).unlink()
    msg = fails(f'--out_dir={tmp_path / "shards"}', '--zero_stage=3')
    assert 'was written by 2 ranks at zero_stage=3, and ZeRO' in msg and 'use 2 ranks and --zero_stage=3' in msg


def test_without_deepspeed_a_one_line_error_says_how_to_install_it(tmp_path, data_dir):
    shim = tmp_path / 'shim'
    shim.mkdir()
    (shim / 'deepspeed.py').write_text("raise ImportError('No module named deepspeed')\n")
    # forked as run() forks it (its server has not imported deepspeed), its imports finding the shim first
    p = launcher.launch(str(REPO / 'ds_train.py'), [*TINY, f'--dataset={data_dir / "shakespeare_char"}',
                                                    f'--out_dir={tmp_path / "out"}'],
                        {**env(), 'PYTHONPATH': str(shim)}, tmp_path)
    assert 'pip install deepspeed==0.19.8' in one_line_error(p)
    assert not (tmp_path / 'out').exists()


@pytest.fixture(scope='module')
def offload(tmp_path_factory, data_dir, cpu_adam):
    """ZeRO-Offload on 2 ranks, 10 steps: stage 2 with the optimizer in CPU memory, and stage 3 with the parameters
    there too."""
    tmp = tmp_path_factory.mktemp('offload')
    with ThreadPoolExecutor(2) as pool:  # both at once
        list(pool.map(lambda a: launch('ds_train.py', tmp, data_dir, *a, '--max_iters=10', nproc=2),
                      [('zero2', '--zero_stage=2', '--offload_optimizer=cpu'),
                       ('zero3', '--zero_stage=3', '--offload_optimizer=cpu', '--offload_params=cpu')]))
    return {2: tmp / 'zero2', 3: tmp / 'zero3'}


def test_zero_offload_learns_and_matches_train_py(ref, offload):
    for out in offload.values():
        losses = read_metrics(out)[0]
        assert losses[9] < losses[0] - 0.3
        assert_same_curve(ref[1], losses, range(10))  # DeepSpeed's CPU Adam is AdamW too
        assert_same_state(ref[0] / 'ckpt.pt', out / 'ckpt.pt')
    # A resumed CPU Adam is not the uninterrupted one bit for bit: its C++ side multiplies up beta^step in float,
    # and takes pow(beta, step) after a restart. Exact resume is
    # test_a_zero_run_resumes_exactly_with_its_own_optimizer_settings_or_those_given's, in AdamW.


def test_the_run_folder_stands_for_its_export_which_samples_and_resumes_under_train_py(tmp_path, data_dir, offload):
    shutil.copytree(offload[2], tmp_path / 'run')
    # the checkpoint names its dataset by a path, which sample.py does not follow: the vocabulary is given
    s = run('sample.py', f'--out_dir={tmp_path / "run"}', f'--meta_path={data_dir / "shakespeare_char" / "meta.pkl"}',
            '--num_samples=2', '--max_new_tokens=20', '--device=cpu', cwd=tmp_path)
    assert s.stdout.count('---------------') == 2
    # an older step folder, ZeRO's shards, is read as the whole model saved with it: the export of its iteration
    texts = [run('sample.py', f'--init_from={tmp_path / "run" / name}', '--num_samples=1', '--max_new_tokens=20',
                 f'--meta_path={data_dir / "shakespeare_char" / "meta.pkl"}', '--device=cpu', cwd=tmp_path)
             for name in ('ds/step-00000005', 'ckpt.prev.pt', 'ckpt.pt')]
    assert f"note: reading {tmp_path / 'run' / 'ckpt.prev.pt'}, the whole model that ds_train.py saved with " \
        f"{tmp_path / 'run' / 'ds' / 'step-00000005'} (" in texts[0].stderr
    assert texts[0].stdout == texts[1].stdout != texts[2].stdout
    # as save_consolidated=False leaves a run: the step folders, no ckpt.pt or best.pt beside them
    shutil.copytree(tmp_path / 'run', tmp_path / 'shards',
                    ignore=lambda d, names: [n for n in names if n.endswith('.pt') and d == str(tmp_path / 'run')])
    p = run('sample.py', f'--out_dir={tmp_path / "shards"}', '--device=cpu', cwd=tmp_path, check=False)
    assert one_line_error(p) == f"error: {tmp_path / 'shards'} holds ds_train.py's step folders but no ckpt.pt " \
        f"(save_consolidated=False), and only ds_train.py reads ZeRO's shards: `ds_train.py --out_dir=" \
        f"{tmp_path / 'shards'} --save_consolidated=True --always_save_checkpoint=True`, with the run's other flags " \
        f"and ranks, writes {tmp_path / 'shards' / 'ckpt.pt'}: at once where the run has finished, else at its next " \
        f"save"
    shutil.rmtree(tmp_path / 'run' / 'ds')
    launch('train.py', tmp_path, data_dir, 'run', '--max_iters=12', '--init_from=resume')
    losses = read_metrics(tmp_path / 'run')[0]
    assert sorted(losses) == list(range(12)) and losses[11] < losses[5]


def test_a_finished_run_without_its_export_writes_it_when_run_again_with_save_consolidated(tmp_path, data_dir, stages):
    # what sample.py's error says to do for a run saved with save_consolidated=False, done at its end (max_iters as
    # before): the resumed eval skipped the folder it resumed from, and the export with it, so nothing was written
    shutil.copytree(stages[2], tmp_path / 'run', ignore=lambda d, names: [n for n in names if n.endswith('.pt')
                                                                           and d == str(stages[2])])
    assert not (tmp_path / 'run' / 'ckpt.pt').exists()
    # model_size.py read the shape from no ckpt.pt there: "neither a config file nor a checkpoint or a run folder"
    for path in (tmp_path / 'run', tmp_path / 'run' / 'ds', tmp_path / 'run' / 'ds' / 'step-00000010'):
        p = run('model_size.py', path, cwd=tmp_path)
        assert ' 2 layers, 2 heads, 32 wide, block 32, vocab 65' in p.stdout, p.stdout + p.stderr
    # a tool given a step folder was told to resume the finished run "with a larger --max_iters"
    p = run('sample.py', f"--init_from={tmp_path / 'run' / 'ds' / 'step-00000010'}", '--device=cpu', cwd=tmp_path,
            check=False)
    assert one_line_error(p).endswith(f"(save_consolidated=False): `ds_train.py --out_dir={tmp_path / 'run'} "
                                      f"--save_consolidated=True --always_save_checkpoint=True`, with the run's other "
                                      f"flags and ranks, writes {tmp_path / 'run' / 'ckpt.pt'}: at once where the run "
                                      f"has finished, else at its next save")
    # with an export older than the step folders (save_consolidated=False since), a tool reads it and its warning
    # names the same command: without --always_save_checkpoint=True it wrote nothing for this finished run
    shutil.copy(stages[2] / 'ckpt.prev.pt', tmp_path / 'run' / 'ckpt.pt')
    p = run('sample.py', f"--out_dir={tmp_path / 'run'}", f"--meta_path={data_dir / 'shakespeare_char' / 'meta.pkl'}",
            '--device=cpu', '--num_samples=1', '--max_new_tokens=2', cwd=tmp_path)
    assert f"(iter 10), which only ds_train.py reads back: continue it with `ds_train.py --out_dir=" \
           f"{tmp_path / 'run'} --save_consolidated=True --always_save_checkpoint=True` (its other flags and ranks " \
           f"as before) until it saves" in p.stderr
    # the run's own flags (config/train_shakespeare_char_cpu.py's always_save_checkpoint=False), then the message's:
    # the final eval, no new best, saved nothing without it
    launch('ds_train.py', tmp_path, data_dir, 'run', '--zero_stage=2', '--deterministic=True', '--max_iters=10',
           '--always_save_checkpoint=False', '--save_consolidated=True', '--always_save_checkpoint=True', nproc=2)
    assert torch.load(tmp_path / 'run' / 'ckpt.pt', weights_only=True)['iter_num'] == 10
    assert_same_state(stages[2] / 'ckpt.pt', tmp_path / 'run' / 'ckpt.pt', atol=1e-12)  # the same state
    assert sorted(p.name for p in (tmp_path / 'run' / 'ds').iterdir() if p.name.startswith('step')) == \
        sorted(p.name for p in (stages[2] / 'ds').iterdir() if p.name.startswith('step'))
    # and best.pt, of the step that ds/best names: a tool's warning for RUN/best names the same command, which wrote
    # none (no new best at that eval) while the folder stayed the run's only best
    assert (tmp_path / 'run' / 'ds' / 'best').read_text() == 'best-step-00000010'
    assert torch.load(tmp_path / 'run' / 'best.pt', weights_only=True)['iter_num'] == 10


def test_a_run_resumed_with_its_optimizer_offloaded_goes_on_from_its_export(tmp_path, data_dir, stages, cpu_adam):
    # DeepSpeed's CPU Adam took the engine's folder that a run without offload saved, and failed at its first step
    # (KeyError: 'bias_correction', a traceback): an offload is part of the layout that ZeRO's shards resume at
    shutil.copytree(stages[2], tmp_path / 'run')
    p = launch('ds_train.py', tmp_path, data_dir, 'run', '--zero_stage=2', '--offload_optimizer=cpu',
               '--deterministic=True', '--max_iters=12', nproc=2)
    assert 'was written by 2 ranks at zero_stage=2, offload_optimizer=none, not 2 at zero_stage=2, ' \
           'offload_optimizer=cpu: continuing from the consolidated' in p.stdout, p.stdout[-3000:]
    assert f"resuming from {tmp_path / 'run' / 'ckpt.pt'} at iter 10" in p.stdout
    assert sorted(read_metrics(tmp_path / 'run')[0]) == list(range(12))
    saved = torch.load(tmp_path / 'run' / 'ckpt.pt', weights_only=True)
    assert saved['iter_num'] == 12 and counts_tokens(saved)
    assert counts_tokens(torch.load(tmp_path / 'run' / 'ds' / 'step-00000012' / 'mp_rank_00_model_states.pt',
                                    weights_only=True))  # the engine's client state


def test_a_home_it_cannot_write_in_is_one_line_naming_torch_extensions_dir(tmp_path, data_dir):
    # DeepSpeed compiles its CPU collectives into ~/.cache/torch_extensions at start: a HOME that cannot be written
    # (a container's arbitrary user) was a traceback
    e = {**env(), 'HOME': '/proc'}
    e.pop('TORCH_EXTENSIONS_DIR', None)
    # forked as run() forks it: deepspeed finds its build folder from HOME when it builds, in the run, not at import
    p = launcher.launch(str(REPO / 'ds_train.py'), [*TINY, f'--dataset={data_dir / "shakespeare_char"}',
                                                    f'--out_dir={tmp_path / "run"}', '--max_iters=2'], e, tmp_path,
                        timeout=300)
    errors = [line for line in p.stderr.splitlines() if line.startswith('error: ')]
    assert p.returncode != 0 and 'Traceback' not in p.stderr, p.stderr[-3000:]
    assert errors and errors[0].endswith('set TORCH_EXTENSIONS_DIR to a folder this user can write in (its default, '
                                         '~/.cache/torch_extensions, is not)')
    assert not (tmp_path / 'run').exists()
