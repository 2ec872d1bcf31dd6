"""Bad input to the tools beside training (model_size.py, bench.py, bench_pipeline.py, bench_checkpoint.py, plot.py):
a one-line error that names the fix, a non-zero exit, and nothing written."""

import json
import os

import pytest
import torch

from checkpoint import tensors
from conftest import one_line_error, run

SMALL = ['--n_layer=2', '--n_head=2', '--n_embd=32', '--block_size=32']
BENCH = ['--device=cpu', '--compile=False', *SMALL, '--batch_size=4', '--warmup=1', '--iters=2']


def fails(tmp_path, script, *args):
    return one_line_error(run(script, *args, cwd=tmp_path, check=False))


@pytest.mark.parametrize('args, message', [
    (['--n_layer=0'], 'error: n_layer=0 must be 1 or more'),
    (['--n_layer=-1'], 'error: n_layer=-1 must be 1 or more'),
    (['--n_head=0'], 'error: n_head=0 must be 1 or more'),
    (['--n_embd=-32'], 'error: n_embd=-32 must be 1 or more'),
    (['--n_embd=33'], 'error: n_embd=33 is not a multiple of n_head=2: each head takes n_embd / n_head channels; '
                      'use n_embd=32'),
    (['--block_size=0'], 'error: block_size=0 must be 1 or more'),
    (['--vocab_size=-5'], 'error: vocab_size=-5 must be 1 or more'),
    (['--batch_size=0'], 'error: batch_size=0 must be 1 or more'),
    (['--world_size=0'], 'error: world_size=0 must be 1 or more'),
    (['--tp_size=-1'], 'error: tp_size=-1 must be 2 or more, or 0 to choose one from world_size'),
    (['--tp_size=3'], 'error: world_size=2 is not a multiple of tp_size=3'),
    (['--world_size=4', '--tp_size=4'], 'error: n_head=2 is not a multiple of tp_size=4'),
    (['--dtype=float64'], "error: dtype='float64': use bfloat16, float16 or float32"),
    (['--model=gpt2'], 'error: model=gpt2 sets n_layer, n_head and n_embd, so n_embd, n_head, n_layer would be '
                       'ignored'),
    (['/nowhere'], 'error: /nowhere is neither a config file (*.py, *.toml) nor a checkpoint or a run folder with a '
                   'ckpt.pt'),
    (['gpt_config.n_layer=8'], "error: gpt_config.n_layer=8 is a Hydra override (minGPT-DDP's): here --n_layer=8"),
    # pp_train.py's sharded stages: none without a pipeline
    (['--dp_shard=True'], "error: dp_shard=True shards the stages of pp_train.py's pipelines: give --pp_size too"),
    (['--dp_shard=True', '--pp_size=2', '--tp_size=2'],  # sharded TP stages: pipelines of pp_size x tp_size ranks
     "error: dp_shard=True shards each stage over world_size / (pp_size x tp_size) pipelines, and pp_size=2 x "
     "tp_size=2 does not divide world_size=2"),
])
def test_model_size_refuses_shapes_that_make_no_model(tmp_path, args, message):
    msg = fails(tmp_path, 'model_size.py', *SMALL, '--vocab_size=65', '--world_size=2', *args)
    assert msg.startswith(message), msg
    assert not any(tmp_path.iterdir())


def test_model_size_shows_the_tensor_parallel_size_asked_for(tmp_path):
    p = run('model_size.py', *SMALL, '--vocab_size=65', '--world_size=4', '--tp_size=2', cwd=tmp_path)
    sizes = json.loads(p.stdout.strip().splitlines()[-1])
    assert sizes['FSDP 2 x TP 2']['param_bytes'] < sizes['DDP']['param_bytes']


@pytest.mark.parametrize('args, message', [
    (['--n_layer=-1'], 'error: n_layer=-1 must be 1 or more'),  # it ran and timed a model of no layers
    (['--n_head=0'], 'error: n_head=0 must be 1 or more'),
    (['--n_embd=33'], 'error: n_embd=33 is not a multiple of n_head=2'),
    (['--block_size=0'], 'error: block_size=0 must be 1 or more'),
    (['--batch_size=-1'], 'error: batch_size=-1 must be 1 or more'),
    (['--gradient_accumulation_steps=0'], 'error: gradient_accumulation_steps=0 must be 1 or more'),
    (['--iters=0'], 'error: iters=0 must be 1 or more'),
    (['--warmup=-1'], 'error: warmup=-1 must be 0 or more'),
    (['--dropout=1.0'], 'error: dropout=1.0 must be at least 0 and below 1'),
    (['--learning_rate=-1.0'], 'error: learning_rate=-1.0 must be 0 or more'),
    (['--grad_clip=-1.0'], 'error: grad_clip=-1.0 must be 0 or more (0 turns clipping off)'),
    (['--beta2=1.5'], 'error: beta2=1.5 must be at least 0 and below 1'),
    (['--dtype=float64'], "error: dtype='float64': use auto, float32, bfloat16 or float16"),
    (['--device=nonsense'], "error: device='nonsense' cannot be used here (RuntimeError: "),
    (['--model=gpt2'], 'error: model=gpt2 sets n_layer, n_head and n_embd, so n_embd, n_head, n_layer would be '
                       'ignored'),
    (['--seed=99999999999999999999'], 'error: seed=99999999999999999999 must be from 0 to '
                                      '9223372036854775807'),
    (['--n_layer=1000000', '--n_embd=4096'], 'error: the model has 201,334,990,180,352 parameters'),  # 750 TiB
    (['--sdpa=fast'], "error: sdpa='fast': use auto, cudnn, flash, efficient, math"),
    (['--loss_rows=-1'], 'error: loss_rows=-1 must be 0 (the loss at once) or more'),
    (['--compile=True', '--compile_mode=fast'], "error: compile_mode='fast': Unrecognized mode=fast, should be one of"),
])
def test_bench_refuses_bad_settings_before_building_a_model(tmp_path, args, message):
    p = run('bench.py', *BENCH, *args, cwd=tmp_path, check=False)
    msg = one_line_error(p)
    assert msg.startswith(message), msg
    assert 'parameters' not in p.stdout  # refused before the model was built, let alone timed
    assert not any(tmp_path.iterdir())


def test_bench_on_too_little_real_data_or_with_nowhere_to_profile(tmp_path):
    (tmp_path / 'data' / 'tiny').mkdir(parents=True)
    (tmp_path / 'data' / 'tiny' / 'train.bin').write_bytes(b'\x01\x00' * 20)
    msg = fails(tmp_path, 'bench.py', *BENCH, '--real_data=True', '--dataset=tiny')
    assert msg == ('error: data/tiny/train.bin holds 20 tokens, fewer than block_size + 1 = 33: lower --block_size '
                   'or prepare more data')
    (tmp_path / 'bench_log').write_text('a file where the trace folder goes')
    msg = fails(tmp_path, 'bench.py', *BENCH, '--profile=True')
    assert msg.startswith('error: cannot create ./bench_log for the trace (File exists)'), msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ['bench_log', 'data']


@pytest.mark.parametrize('nproc, args, message', [
    # each was a traceback: RANK unset, int('x'), torch's interleaved schedule handed one stage, or 5 micro-batches
    (1, [], 'error: bench_pipeline.py runs a pipeline stage on each rank, and plain python starts one process: '
            'launch with `torchrun --nproc_per_node=2 bench_pipeline.py ...`'),
    (2, ['--microbatches=2,x'], "error: microbatches='2,x' must be counts of 1 or more, comma-separated: e.g. "
                                "--microbatches=1,2,4,8"),
    (2, ['--microbatches=0'], "error: microbatches='0' must be counts of 1 or more, comma-separated: e.g. "
                              "--microbatches=1,2,4,8"),
    (2, ['--stages_per_rank=0'], 'error: stages_per_rank=0 must be 1 or more'),
    (2, ['--steps=0'], 'error: steps=0 must be 1 or more'),
    (2, ['--microbatches=2,5'], "error: microbatches='2,5': interleaved 1F1B on 2 ranks does not run 5 (torch's "
                                "runs them in 2 rounds of equal size): use 4 or 6 instead"),
], ids=['no-torchrun', 'not-a-count', 'zero', 'stages_per_rank', 'steps', 'interleaved-rounds'])
def test_bench_pipeline_refuses_bad_settings_in_one_line(tmp_path, nproc, args, message):
    p = run('bench_pipeline.py', '--forward_ms=0', '--steps=1', *args, nproc=nproc, cwd=tmp_path, check=False)
    assert one_line_error(p, nproc) == message
    assert set(p.stderr.splitlines()) == {message} and p.stdout == ''  # every rank's, before anything was timed


def test_bench_pipeline_runs_the_interleaved_schedules_with_one_stage_per_rank(tmp_path):
    # a TypeError: the interleaved schedule was handed a stage, not the list of one it takes
    p = run('bench_pipeline.py', '--forward_ms=0', '--steps=1', '--microbatches=2,4', '--stages_per_rank=1', nproc=2,
            cwd=tmp_path)
    rows = {(line.split()[0], int(line.split()[1])): line.split() for line in p.stdout.splitlines()[2:]}
    assert sorted(rows) == sorted((s, m) for s in ('1f1b', 'gpipe', 'interleaved-1f1b', 'interleaved-zb', 'zbv',
                                                   'dualpipev') for m in (2, 4))
    # DualPipeV from m = 2p only, a micro-batch for each of its stages: its row at m = 2 was left out without a word
    assert ' '.join(rows['dualpipev', 2]) == 'dualpipev 2 - - - not run: it needs m >= 2p = 4, a micro-batch for ' \
        'each of its stages'
    # the theories: 1F1B's (p - 1) / (m + p - 1), zero bubble's third of its idle time, (p - 1) / (3m + p - 1), and
    # none for ZBV where m is below 2p (its plan is not full), nor for DualPipeV's plan
    assert [rows[s, 2][-1] for s in ('interleaved-1f1b', 'interleaved-zb', 'zbv')] == ['0.333', '0.143', '-']
    assert rows['zbv', 4][-1] == '0.040' and rows['dualpipev', 4][-1] == '-'  # zbv: v = 2, 1 / (3·2·4 + 1)


@pytest.fixture
def metrics(tmp_path):
    """A run folder whose metrics.jsonl holds the rows given, one JSON object (or raw text) a line."""
    def write(*rows):
        run_dir = tmp_path / 'run'
        run_dir.mkdir(exist_ok=True)
        text = ''.join((r if isinstance(r, str) else json.dumps(r)) + '\n' for r in rows)
        (run_dir / 'metrics.jsonl').write_text(text)
        return run_dir
    return write


STEP = {'iter': 0, 'loss': 4.2, 'lr': 1e-3, 'time': 0.5}


@pytest.mark.parametrize('rows, message', [
    ([STEP, {'loss': 4.0, 'time': 1.0}], "run/metrics.jsonl:2: a row with 'loss' lacks a number for 'iter'"),
    ([STEP, {'iter': 1, 'loss': 4.0}], "run/metrics.jsonl:2: a row with 'loss' lacks a number for 'time'"),
    ([STEP, {'iter': 1, 'val_loss': 'high', 'time': 1.0}],
     "run/metrics.jsonl:2: a row with 'val_loss' lacks a number for 'val_loss'"),
    ([STEP, '{"iter": 1, "loss": 4.'], 'run/metrics.jsonl:2: not a JSON line ('),
    ([STEP, '[1, 2]'], 'run/metrics.jsonl:2: not a JSON object'),
    ([{'iter': 0, 'param_bytes': 100, 'time': 0.1}], 'run/metrics.jsonl holds no logged step or eval yet'),
])
def test_plot_names_the_bad_line_of_a_metrics_file(tmp_path, metrics, rows, message):
    run_dir = metrics(*rows)
    msg = fails(tmp_path, 'plot.py', run_dir, f'--out={tmp_path / "loss.png"}')
    assert msg.startswith('error: ') and message in msg, msg
    assert not (tmp_path / 'loss.png').exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ['run']


@pytest.mark.parametrize('out, message', [
    ('', 'error: --out is empty: name the image to write, e.g. --out=loss.png'),
    ('run', 'is a folder: name a file in it, e.g. --out='),
    ('run/metrics.jsonl/loss.png', 'run/metrics.jsonl is not a folder: create that folder or choose another --out'),
    ('no/such/loss.png', 'no/such does not exist: create that folder or choose another --out'),
    ('loss.xyz', 'matplotlib cannot write .xyz files: end it in one of '),
    ('/proc/loss.png', 'error: cannot write /proc/loss.png ('),  # a folder no one can write in, root included
])
def test_plot_refuses_an_output_it_cannot_write(tmp_path, metrics, out, message):
    run_dir = metrics(STEP)
    msg = fails(tmp_path, 'plot.py', run_dir, f'--out={tmp_path / out}' if out and out[0] != '/' else f'--out={out}')
    assert message in msg, msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ['run']
    assert sorted(p.name for p in run_dir.iterdir()) == ['metrics.jsonl']


def test_plot_never_writes_an_image_over_a_file_with_no_extension(tmp_path, metrics):
    # --out=RUN/run_id (no extension: a PNG) replaced the run's id, which its resume then could not read
    run_dir = metrics(STEP)
    (run_dir / 'run_id').write_text('abc')
    msg = fails(tmp_path, 'plot.py', run_dir, f'--out={run_dir / "run_id"}')
    assert msg == f"error: --out={run_dir / 'run_id'} is a file with no extension, which plot.py would replace by an " \
        f"image: name the image with its format's extension, e.g. --out={run_dir / 'run_id'}.png"
    assert (run_dir / 'run_id').read_text() == 'abc'
    assert sorted(p.name for p in run_dir.iterdir()) == ['metrics.jsonl', 'run_id']


def test_plot_a_format_whose_backend_is_missing_is_one_line_and_leaves_nothing(tmp_path, metrics):
    import os
    import subprocess
    import sys
    from conftest import REPO, env
    run_dir = metrics(STEP)
    # .pgf needs a TeX (xelatex) on PATH, and a PATH of python's own folder has none
    p = subprocess.run([sys.executable, str(REPO / 'plot.py'), str(run_dir), f'--out={tmp_path / "loss.pgf"}'],
                       cwd=tmp_path, env=dict(env(), PATH=os.path.dirname(sys.executable)), capture_output=True,
                       text=True, timeout=300)
    assert 'matplotlib cannot write' in one_line_error(p) and 'choose another format' in p.stderr, p.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ['run']  # its temporary file removed


def test_plot_and_prepare_write_nothing_into_a_runs_step_folders(tmp_path, metrics):
    # an image or a prepared dataset in RUN/dcp/step-N (named, or through a link) went with the run's next prune
    run_dir = metrics(STEP)
    (run_dir / 'run_id').write_text('abc')
    (step := run_dir / 'dcp' / 'step-00000004').mkdir(parents=True)
    (tmp_path / 'mine').symlink_to(step)
    (tmp_path / 'in.txt').write_text('some text to prepare, ' * 50)
    for script, flag, out in (('plot.py', '--out', step / 'loss.png'), ('plot.py', '--out', 'mine/loss.png'),
                              ('prepare.py', '--out_dir', step / 'data'), ('prepare.py', '--out_dir', 'mine/data')):
        args = [run_dir] if script == 'plot.py' else ['text', '--input=in.txt', '--tokenizer=char']
        msg = fails(tmp_path, script, *args, f'{flag}={out}')
        assert msg == f"error: {flag}={out} lies in {run_dir / 'dcp'}, where the run in {run_dir} keeps (and prunes) " \
            f"its checkpoints, and what is written there goes with them: give {flag} a path outside it", msg
    assert os.listdir(step) == [] and sorted(os.listdir(tmp_path)) == ['in.txt', 'mine', 'run']
    run('plot.py', run_dir, f'--out={run_dir / "loss.png"}', cwd=tmp_path)  # beside the step folders: the run's own
    assert (run_dir / 'loss.png').exists()


@pytest.mark.parametrize('script', ['plot.py', 'prepare.py', 'model_size.py'])
def test_help_prints_what_the_script_does(tmp_path, script):
    p = run(script, '-h', cwd=tmp_path)
    assert p.stdout.split()[0] in ('Draws', 'Prepares', 'Sizes') and list(tmp_path.iterdir()) == [], p.stdout
    assert "its keys, with their defaults" in p.stdout and "\n  --" in p.stdout  # and the keys, as every script's


def test_plot_writes_the_format_its_extension_names(tmp_path, metrics):
    run_dir = metrics(STEP, '', {'iter': 1, 'loss': 4.0, 'time': 1.0}, {'iter': 1, 'val_loss': 4.1, 'time': 1.2})
    for name, magic in (('loss.pdf', b'%PDF'), ('loss.svg', b'<?xml'), ('loss', b'\x89PNG')):  # it wrote PNG always
        run('plot.py', run_dir, f'--out={tmp_path / name}', cwd=tmp_path)
        assert (tmp_path / name).read_bytes()[:len(magic)] == magic
    assert sorted(p.name for p in tmp_path.iterdir()) == ['loss', 'loss.pdf', 'loss.svg', 'run']
    # --key value, as everywhere: the value is no run (it said: flag '--out' needs a value: write it as ... --out VALUE)
    p = run('plot.py', '--out', tmp_path / 'spaced.png', run_dir, '--title', 'two words', cwd=tmp_path)
    assert p.stdout.startswith(f"wrote {tmp_path / 'spaced.png'}: 1 run(s)") and (tmp_path / 'spaced.png').exists()


def test_model_size_sizes_any_depth_without_building_it(tmp_path):
    from model import count_params
    p = run('model_size.py', '--n_layer=1000000000000', cwd=tmp_path)  # a meta model of 10^12 blocks never ends
    n = count_params(n_layer=10**12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304, bias=False)
    assert json.loads(p.stdout.splitlines()[-1])['params'] == n


def test_model_size_reads_a_training_config_and_a_run_folder(tmp_path, shared_run, data_dir):
    from conftest import REPO
    (tmp_path / 'data').symlink_to(data_dir)  # the config's dataset, data/shakespeare_char, and its meta.pkl
    p = run('model_size.py', str(REPO / 'config' / 'train_shakespeare_char_cpu.py'), cwd=tmp_path)
    # the config's shape, not the defaults, and its data's vocabulary: train.py's 0.80M parameters
    assert p.stdout.startswith('804,096 parameters') and ' 4 layers, 4 heads, 128 wide, block 64, vocab 65' in p.stdout
    # where its data is not prepared, the vocabulary of a character-level prep is unknown: GPT-2's, said in a line
    # (minGPT-DDP's and nnScaler's users size a config before they prepare; 7.2M parameters, not 0.8M, silently)
    (tmp_path / 'bare').mkdir()
    p = run('model_size.py', str(REPO / 'config' / 'train_shakespeare_char_cpu.py'), cwd=tmp_path / 'bare')
    assert p.stdout.startswith('note: data/shakespeare_char holds no prepared data (train.bin), so the vocabulary is '
                               "taken as GPT-2's 50304;") and ', vocab 50304' in p.stdout
    # train.py's ways: a TOML config (Decent-DP's names) and `--key value`
    p = run('model_size.py', str(REPO / 'config' / 'gpt2-small.toml'), '--n_layer', '2', cwd=tmp_path)
    assert ' 2 layers, 12 heads, 768 wide, block 1024, vocab 50304' in p.stdout
    assert ', batch 30x1024 ' in p.stdout  # its global_batch_size = 480 is 16 micro-steps of 30, as train.py runs it
    # DLRover's command (SEEDS.md's, its --data_dir folder holding meta.pkl), sized as train.py runs it: with its
    # defaults for the keys the command leaves out, batch 32 x 128 (and no error for its keys this tool lacks)
    p = run('model_size.py', '--n_layer', '48', '--n_head', '16', '--n_embd', '1600', '--data_dir', './',
            '--epochs', '50', '--save_memory_interval', '50', '--save_storage_interval', '500',  # the whole of it
            '--use_fsdp', cwd=data_dir / 'shakespeare_char')  # and its README's multi-node flag
    assert "--epochs 50 is DLRover's name: here not a size, left out" in p.stdout
    assert "--use_fsdp is DLRover's name: here not a size, left out" in p.stdout  # the table has FSDP's row
    assert ' 48 layers, 16 heads, 1600 wide, block 128, vocab 65' in p.stdout and ', batch 32x128 ' in p.stdout
    p = run('model_size.py', '--model', 'gpt2-xl', '--data_dir', './', cwd=data_dir / 'shakespeare_char')
    assert 'gives none: --block_size=128 --batch_size=32\n' in p.stdout and \
        ' 48 layers, 25 heads, 1600 wide, block 128, vocab 65' in p.stdout  # not DLRover's 6 layers (it said so)
    out = shared_run('train.py', '--max_iters=4', '--gradient_accumulation_steps=1')
    p = run('model_size.py', str(out), '--n_layer=3', cwd=tmp_path)
    assert ' 3 layers, 2 heads, 32 wide, block 32, vocab 65' in p.stdout  # the run's shape, a flag after it wins
    # its checkpoint figure is the tensor bytes the run's ckpt.pt holds (the tied head once), to 0.5%
    p = run('model_size.py', str(out), cwd=tmp_path)
    state = torch.load(out / 'ckpt.pt', map_location='cpu', weights_only=True)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for part in ('model', 'optimizer')
                for t in tensors(state[part])}
    estimate = json.loads(p.stdout.strip().splitlines()[-1])['checkpoint_bytes']
    assert abs(estimate - sum(storages.values())) <= 0.005 * sum(storages.values()), (estimate, storages)


@pytest.mark.parametrize('data, message', [
    (b'\x01\x00' * 40 + b'\x01', 'holds 81 bytes, not a whole number of uint16 tokens'),
    (b'\xff\xff' * 40, 'holds token id 65535, past the model\'s vocabulary of 50304'),
])
def test_bench_refuses_real_data_it_cannot_read_as_tokens(tmp_path, data, message):
    (tmp_path / 'data' / 'bad').mkdir(parents=True)
    for split in ('train', 'val'):
        (tmp_path / 'data' / 'bad' / f'{split}.bin').write_bytes(data)
    assert message in fails(tmp_path, 'bench.py', *BENCH, '--real_data=True', '--dataset=bad')


@pytest.mark.parametrize('args, message', [
    (['--what=saves'], "error: what='saves': use save, recovery or all"),  # was rc 0, nothing measured
    (['--dtype=fp32'], "error: dtype='fp32': use auto, float32, bfloat16 or float16"),
    (['--n_embd=33', '--n_head=2'], 'error: n_embd=33 is not a multiple of n_head=2'),
    (['--repeats=0'], 'error: repeats=0 must be 1 or more'),
    (['--kills=0'], 'error: kills=0 must be 1 or more'),
    (['--device=gpu'], "error: device='gpu' is not a device torch knows"),
])
def test_bench_checkpoint_refuses_bad_settings_before_making_its_folder(tmp_path, args, message):
    tiny = ['--n_layer=1', '--n_head=2', '--n_embd=32', '--vocab_size=64', '--block_size=16', '--repeats=1']
    assert fails(tmp_path, 'bench_checkpoint.py', '--what=save', *tiny, *args).startswith(message)
    assert not (tmp_path / 'bench_checkpoint').exists()
