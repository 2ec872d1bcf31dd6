"""One checkpoint everywhere: round trips between the entrypoints, Hugging Face export, loss plots, model sizing
and deterministic runs."""

import json
import math
import os
import shutil

import pytest
import torch

from conftest import TINY, one_line_error, read_metrics, run

BASE = ['--gradient_accumulation_steps=2', '--eval_interval=3', '--always_save_checkpoint=True']
NO_BLOCK_SIZE = [a for a in TINY if not a.startswith('--block_size=')]  # a model's own positions, where it has them


def launch(script, tmp_path, data_dir, out, *extra, nproc=1, dataset='shakespeare_char', check=True, nthreads=1):
    return run(script, *TINY, *BASE, f'--dataset={data_dir / dataset}', f'--out_dir={tmp_path / out}', *extra,
               nproc=nproc, cwd=tmp_path, check=check, nthreads=nthreads)


def weights(path):
    return torch.load(path, map_location='cpu', weights_only=True)['model']


@pytest.fixture(scope='module')
def trip(tmp_path_factory, data_dir):
    """train.py (3 steps) -> fsdp_train.py on 2 ranks (loads it, saves sharded and consolidated) -> train.py."""
    tmp = tmp_path_factory.mktemp('trip')
    launch('train.py', tmp, data_dir, 'a', '--max_iters=3')
    shutil.copytree(tmp / 'a', tmp / 'b')
    # a resume at its last iteration evaluates and saves (an eval_only run would write nothing), and says that it
    # trains nothing (the auto-resume line says that the run continues)
    done = 'at iter 3, at max_iters=3: the run evaluates and ends (raise --max_iters to train on)'
    p = launch('fsdp_train.py', tmp, data_dir, 'b', '--init_from=resume', '--max_iters=3', '--save_consolidated=True',
               nproc=2)
    assert done in p.stdout
    shutil.copytree(tmp / 'b', tmp / 'c')
    shutil.rmtree(tmp / 'c' / 'dcp')
    p = launch('train.py', tmp, data_dir, 'c', '--init_from=resume', '--max_iters=3')
    assert done in p.stdout
    return tmp


def test_train_fsdp_train_round_trip_keeps_the_weights_exactly(trip):
    a, b, c = (weights(trip / x / 'ckpt.pt') for x in 'abc')
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in a)
    assert (trip / 'b' / 'dcp' / 'latest').read_text() == 'step-00000003'


def test_train_decent_train_round_trip_keeps_the_weights_exactly(trip, data_dir, tmp_path):
    # decent_train.py starts every replica from train.py's checkpoint and exports their average: of equal
    # replicas, that is the weights themselves
    shutil.copytree(trip / 'a', tmp_path / 'd')
    launch('decent_train.py', tmp_path, data_dir, 'd', '--init_from=resume', '--max_iters=3', nproc=2)
    assert (tmp_path / 'd' / 'decent' / 'latest').exists()
    launch('train.py', tmp_path, data_dir, 'd', '--init_from=resume', '--max_iters=3')
    a, d = weights(trip / 'a' / 'ckpt.pt'), weights(tmp_path / 'd' / 'ckpt.pt')
    assert a.keys() == d.keys() and all(torch.equal(a[k], d[k]) for k in a)


def test_train_ds_train_round_trip_keeps_the_weights_and_adam_state_exactly(trip, data_dir, tmp_path):
    # ds_train.py resumes train.py's run, its weights and Adam's moments scattered over ZeRO-3's partitions on 2
    # ranks, and gathers them back into its consolidated ckpt.pt; train.py starts from that run's folder (a step at
    # learning rate 0 changes nothing)
    shutil.copytree(trip / 'a', tmp_path / 'ds')
    launch('ds_train.py', tmp_path, data_dir, 'ds', '--init_from=resume', '--max_iters=3', '--zero_stage=3', nproc=2)
    assert (tmp_path / 'ds' / 'ds' / 'latest').read_text() == 'step-00000003'
    launch('train.py', tmp_path, data_dir, 'back', f'--init_from={tmp_path / "ds"}', '--max_iters=1',
           '--learning_rate=0', '--decay_lr=False')
    a, ds = (torch.load(run / 'ckpt.pt', map_location='cpu', weights_only=True)
             for run in (trip / 'a', tmp_path / 'ds'))
    back = weights(tmp_path / 'back' / 'ckpt.pt')
    assert a['model'].keys() == ds['model'].keys() == back.keys()
    assert all(torch.equal(a['model'][k], ds['model'][k]) and torch.equal(a['model'][k], back[k]) for k in back)
    sa, sd = a['optimizer']['state'], ds['optimizer']['state']
    assert sa.keys() == sd.keys() and all(torch.equal(sa[i][k], sd[i][k]) for i in sa for k in sa[i])


def test_init_from_any_checkpoint_path(trip, data_dir, tmp_path):
    # the sharded folder fsdp_train.py wrote, read by train.py in one process: the same weights give the same
    # val loss as the run that saved them (evals use the same batches every time)
    val_at_3 = read_metrics(trip / 'a')[1][-1]['val_loss']
    for src in (trip / 'b' / 'dcp' / 'step-00000003', trip / 'b', trip / 'a' / 'ckpt.pt'):
        p = launch('train.py', tmp_path, data_dir, 'new', f'--init_from={src}', '--eval_only=True')
        assert 'initializing from the weights of' in p.stdout
        assert read_metrics(tmp_path / 'new')[1][-1]['val_loss'] == pytest.approx(val_at_3, abs=1e-6)  # appended
    p = launch('fsdp_train.py', tmp_path, data_dir, 'new2', f'--init_from={trip / "a" / "ckpt.pt"}', '--max_iters=3',
               nproc=2)
    losses, evals = read_metrics(tmp_path / 'new2')
    assert evals[0]['iter'] == 0 and evals[0]['val_loss'] == pytest.approx(val_at_3, abs=1e-6)  # a fresh run from them
    # and sample.py reads every kind
    for src in (trip / 'b' / 'dcp' / 'step-00000003', trip / 'c' / 'ckpt.pt'):
        s = run('sample.py', f'--init_from={src}', f'--meta_path={data_dir / "shakespeare_char" / "meta.pkl"}',
                '--num_samples=1', '--max_new_tokens=10', '--device=cpu', cwd=tmp_path)
        assert s.stdout.count('---------------') == 1


@pytest.mark.parametrize('script,nproc', [('train.py', 1), ('fsdp_train.py', 2)])
def test_a_run_started_from_a_checkpoint_counts_its_tokens_at_the_checkpoints_block_size(trip, data_dir, tmp_path,
                                                                                           script, nproc):
    # no --block_size: the model's 32 positions come from the checkpoint, not the default's 1024, and so do the
    # batches; the tokens an iteration (the log's tok/s, --epochs' count) were counted at 1024, 32 times too many
    # --epochs sized to 2 iterations of 8 sequences of the checkpoint's 32 positions, one at every offset of train.bin
    n = os.path.getsize(data_dir / 'shakespeare_char' / 'train.bin') // 2 - 32
    p = run(script, *NO_BLOCK_SIZE, *BASE, f'--dataset={data_dir / "shakespeare_char"}',
            f'--out_dir={tmp_path / "new"}', f'--init_from={trip / "a"}', f'--epochs={15 / n}', '--max_iters=100',
            nproc=nproc, cwd=tmp_path)
    assert f"{2 * 4 * 32:,} tokens per iteration" in p.stdout  # accumulation 2 x batch 4 x block 32
    # --epochs' line counts at the model's 32 positions too: it said the default's 1024 (the run's iterations were
    # counted at 32 after it, and this line agreed by chance with so many sequences)
    assert f"--epochs={15 / n} is DLRover's name: here --max_iters=2 ({15 / n} epochs of train.bin's {n:,} sequences " \
        f"of 32 tokens, one at each offset as DLRover's loader takes them, at 8 sequences an iteration)\n" in p.stdout
    assert '1024' not in p.stdout, p.stdout
    rows = [json.loads(line) for line in (tmp_path / 'new' / 'metrics.jsonl').read_text().splitlines()]
    steps = [r for r in rows if 'tokens_per_sec' in r]
    assert len(steps) == 2 and all(r['tokens_per_sec'] * r['ms'] / 1000 == pytest.approx(256, rel=1e-3) for r in steps)


def test_a_tool_reads_a_run_in_progress_whose_latest_moves_on_while_it_reads(trip, tmp_path, monkeypatch):
    """A run that saves often (fsdp_train.py with save_storage_interval=1) points latest at its new step folder and
    prunes the one before while a tool reads the run folder: every sample.py of such a run failed ("its save was cut
    short"). The tool reads the newest again."""
    import checkpoint
    out = tmp_path / 'run'
    for step in ('step-00000003', 'step-00000004'):
        shutil.copytree(trip / 'b' / 'dcp' / 'step-00000003', out / 'dcp' / step)
    (out / 'dcp' / 'latest').write_text('step-00000003')
    (out / 'dcp' / 'step-00000004' / '.metadata').rename(out / 'metadata')  # step 4 is being written
    load, read = checkpoint._load, []

    def load_as_the_run_moves_on(path, dropout):
        read.append(os.path.basename(path))
        if len(read) == 1:  # the run completes and commits step 4, and prunes step 3, as this read begins
            (out / 'metadata').rename(out / 'dcp' / 'step-00000004' / '.metadata')
            (out / 'dcp' / 'latest').write_text('step-00000004')
            shutil.rmtree(out / 'dcp' / 'step-00000003')
        return load(path, dropout)
    monkeypatch.setattr(checkpoint, '_load', load_as_the_run_moves_on)
    model, _ = checkpoint.load_checkpoint(str(out))
    assert read == ['step-00000003', 'step-00000004']
    a = weights(trip / 'b' / 'ckpt.pt')
    assert all(torch.equal(model.state_dict()[k], a[k]) for k in a)


def test_export_hf_gives_transformers_the_same_logits(tmp_path, data_dir):
    import transformers
    from checkpoint import load_checkpoint
    launch('train.py', tmp_path, data_dir, 'bpe', '--max_iters=3', dataset='shakespeare')
    p = run('export_hf.py', f'--ckpt={tmp_path / "bpe"}', f'--out={tmp_path / "hf"}', cwd=tmp_path)
    assert 'with GPT-2 tokenizer files' in p.stdout
    ours, _ = load_checkpoint(str(tmp_path / 'bpe'), dropout=0.0)
    theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / 'hf').eval()
    idx = torch.randint(50257, (2, 32))
    a = ours.eval()(idx, idx)[0][..., :50257]
    b = theirs(idx).logits
    assert b.shape == (2, 32, 50257) and (a - b).abs().max().item() < 1e-5
    generator = transformers.pipeline('text-generation', model=str(tmp_path / 'hf'), device='cpu')
    greedy = generator('To be', max_new_tokens=8, do_sample=False)[0]['generated_text']
    assert greedy.startswith('To be') and len(greedy) > len('To be')
    # as the README calls it: the pipeline's default of 256 new tokens ran past this model's 32 positions
    text = generator('To be')[0]['generated_text']
    assert text.startswith('To be') and len(text) > len('To be')
    # the folder goes back in, as init_from: sample.py's greedy text is the pipeline's (it was "no checkpoint at
    # hf/ckpt.pt"), and train.py starts from its weights (at learning rate 0, the step leaves them as they were)
    p = run('sample.py', f'--init_from={tmp_path / "hf"}', '--start=To be', '--temperature=0', '--num_samples=1',
            '--max_new_tokens=8', '--device=cpu', cwd=tmp_path)
    assert p.stdout == f'{greedy}\n---------------\n'
    # and its sampled text, for a seed, is the run's: the run's 47 padding rows, which have no text, are no token
    # to draw (torch.multinomial's draws hang on the length of the row, not on its probabilities alone)
    sampled = [run('sample.py', f'--init_from={path}', '--start=To be', '--num_samples=2', '--max_new_tokens=24',
                   '--top_k=0', '--device=cpu', cwd=tmp_path).stdout for path in (tmp_path / 'bpe', tmp_path / 'hf')]
    assert sampled[0] == sampled[1] and sampled[0].count('---------------') == 2
    # with no --block_size: the model's 32 positions, as from a checkpoint (it was "block_size=1024 is longer")
    p = run('train.py', *NO_BLOCK_SIZE, *BASE, f'--dataset={data_dir / "shakespeare"}', f'--out_dir={tmp_path / "ft"}',
            f'--init_from={tmp_path / "hf"}', '--max_iters=1', '--learning_rate=0', '--min_lr=0', cwd=tmp_path)
    assert f'initializing from the weights of the Hugging Face folder {tmp_path / "hf"}' in p.stdout
    assert "block_size=32: the model's positions" in p.stdout and f"{2 * 4 * 32:,} tokens per iteration" in p.stdout
    a, b = ours.state_dict(), weights(tmp_path / 'ft' / 'ckpt.pt')
    assert set(a) == set(b) and all(torch.equal(a[k][:50257], b[k]) for k in a)  # the padding rows cropped
    # the folder exists now: a second export refuses to write over it
    p = run('export_hf.py', f'--ckpt={tmp_path / "bpe"}', f'--out={tmp_path / "hf"}', cwd=tmp_path, check=False)
    assert p.returncode != 0 and 'exists' in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_export_hf_of_a_bias_free_char_model_gives_transformers_the_same_logits(tmp_path, data_dir):
    # bias=False, train.py's default: GPT2LMHeadModel always has biases, and zero ones add what none do
    import transformers
    from checkpoint import load_checkpoint
    launch('train.py', tmp_path, data_dir, 'run', '--max_iters=3', '--bias=False')
    p = run('export_hf.py', f'--ckpt={tmp_path / "run"}', f'--out={tmp_path / "hf"}', cwd=tmp_path)
    # it said '65 tokens, (a 65-token vocabulary: ...)', the count twice; and not which state of the run it wrote
    assert p.stdout.strip().startswith(f"wrote {tmp_path / 'hf'} from {tmp_path / 'run' / 'ckpt.pt'} (iter 3): ") and \
        p.stdout.strip().endswith("M parameters, 65 tokens, no tokenizer written (the vocabulary is the dataset's own)")
    ours, _ = load_checkpoint(str(tmp_path / 'run'), dropout=0.0)
    assert not any(k.endswith('.bias') for k in ours.state_dict())
    theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / 'hf').eval()
    biases = [v for k, v in theirs.state_dict().items() if k.endswith('.bias') and v.dtype.is_floating_point]
    assert len(biases) == 2 * 6 + 1 and all(not b.any() for b in biases)  # 6 a block (2 layers), ln_f's
    idx = torch.randint(65, (2, 32))
    a = ours.eval()(idx, idx)[0]
    b = theirs(idx).logits
    assert b.shape == (2, 32, 65) and (a - b).abs().max().item() < 1e-5 and a.abs().max().item() > 0.1
    # a char-level vocabulary has no GPT-2 <|endoftext|> (50256, outside its 65 ids) to begin or end with
    config = json.loads((tmp_path / 'hf' / 'config.json').read_text())
    assert config['bos_token_id'] is None and config['eos_token_id'] is None
    assert sorted(f.name for f in (tmp_path / 'hf').iterdir()) == ['config.json', 'generation_config.json',
                                                                   'model.safetensors']
    # transformers' progress bars ("Writing model shards", "Loading weights") were lines on stderr besides: before the
    # one-line error of a tool given the folder, and in an export that went well
    assert p.stderr == ''
    p = run('sample.py', f"--init_from={tmp_path / 'hf'}", '--device=cpu', cwd=tmp_path, check=False)
    assert one_line_error(p).startswith("error: the model's vocabulary has 65 tokens, but no meta.pkl was found")
    # a file of the folder given instead of the folder was "not a model checkpoint (KeyError: 'model_args'): give a
    # ckpt.pt, a run folder or a sharded checkpoint folder", never the folder that the user has
    for script, flag in (('sample.py', '--init_from'), ('export_hf.py', '--ckpt')):
        p = run(script, f"{flag}={tmp_path / 'hf' / 'model.safetensors'}", f"--out={tmp_path / 'again'}"
                if script == 'export_hf.py' else '--device=cpu', cwd=tmp_path, check=False)
        assert one_line_error(p) == f"error: {tmp_path / 'hf' / 'model.safetensors'} is a file of the Hugging Face " \
            f"folder {tmp_path / 'hf'}: give the folder, which sample.py and every entrypoint take with " \
            f"--init_from={tmp_path / 'hf'}, and transformers reads as it is"


@pytest.mark.parametrize('setting,value', [('activation_function', 'relu'), ('layer_norm_epsilon', 1e-3),
                                           ('scale_attn_weights', False), ('scale_attn_by_inverse_layer_idx', True),
                                           ('tie_word_embeddings', False), ('n_inner', 100)])
def test_a_hugging_face_gpt2_of_another_function_is_refused_never_loaded_as_another_model(tmp_path, setting, value):
    """A GPT-2 folder whose config makes another function than model.py's GPT (a setting save_pretrained keeps):
    it loaded without a word into a model whose logits were off by up to 1.06 (n_inner: an AssertionError called the
    folder not intact). The same config at GPT-2's values loads and gives Hugging Face's logits."""
    import transformers
    from checkpoint import pretrained_or_exit
    config = dict(n_positions=16, n_embd=32, n_layer=1, n_head=2, vocab_size=65)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(**config, **{setting: value})).save_pretrained(tmp_path / 'hf')
    with pytest.raises(SystemExit) as e:
        pretrained_or_exit(str(tmp_path / 'hf'))
    assert str(e.value) == f"error: {tmp_path / 'hf'} is a GPT-2 of another kind, which model.py's GPT does not " \
        f"compute ({setting}={value!r}): give a GPT-2 folder with GPT-2's settings (export_hf.py's)"
    theirs = transformers.GPT2LMHeadModel(transformers.GPT2Config(**config)).eval()
    theirs.save_pretrained(tmp_path / 'gpt2')
    idx = torch.randint(65, (2, 16))
    assert (pretrained_or_exit(str(tmp_path / 'gpt2')).eval()(idx, idx)[0] - theirs(idx).logits).abs().max() < 1e-5


def test_plot_draws_two_runs(trip, tmp_path):
    out = tmp_path / 'loss.png'
    (tmp_path / 'loss.png.tmp').write_text('a user file')  # no name of the user's is taken for a temporary file
    p = run('plot.py', trip / 'a', trip / 'b', '--labels=train.py,fsdp_train.py', f'--out={out}', cwd=tmp_path)
    assert 'wrote' in p.stdout
    assert (tmp_path / 'loss.png.tmp').read_text() == 'a user file'
    assert sorted(f.name for f in tmp_path.glob('loss.png*')) == ['loss.png', 'loss.png.tmp']
    data = out.read_bytes()
    assert data[:8] == b'\x89PNG\r\n\x1a\n' and len(data) > 20000
    # without matplotlib: a clear message, no file
    fake = tmp_path / 'no_mpl'
    (fake / 'matplotlib').mkdir(parents=True)
    (fake / 'matplotlib' / '__init__.py').write_text("raise ImportError('no matplotlib here')\n")
    env = dict(os.environ, PYTHONPATH=str(fake))
    import subprocess
    import sys
    from conftest import REPO
    q = subprocess.run([sys.executable, str(REPO / 'plot.py'), str(trip / 'a'), f'--out={tmp_path / "x.png"}'],
                       cwd=tmp_path, env=env, capture_output=True, text=True)
    assert q.returncode != 0 and 'pip install matplotlib' in q.stderr and not (tmp_path / 'x.png').exists()


def test_plot_puts_a_resumed_launch_after_the_one_before_in_wall_time(tmp_path):
    # each launch logs its time from 0; a run resumed at iter 2 must not be drawn back at the start of the time axis
    rows = [{'iter': 0, 'train_loss': 4.0, 'val_loss': 4.1, 'time': 0.5}, {'iter': 0, 'loss': 4.0, 'time': 1.0},
            {'iter': 1, 'loss': 3.9, 'time': 2.0}, {'iter': 2, 'param_bytes': 8, 'time': 0.1},
            {'iter': 2, 'loss': 3.8, 'time': 0.5}, {'iter': 4, 'train_loss': 3.0, 'val_loss': 3.1, 'time': 1.5},
            # a loss that was not finite: null now, NaN in older logs; either is drawn as a gap
            {'iter': 5, 'loss': None, 'time': 1.6}, {'iter': 6, 'loss': float('nan'), 'time': 1.7}]
    (tmp_path / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
    import plot
    steps, evals, _ = plot.read_run(str(tmp_path))
    assert [r['time'] for r in steps] == [1.0, 2.0, 2.5, 3.6, 3.7] and [r['time'] for r in evals] == [0.5, 3.5]
    assert all(math.isnan(r['loss']) for r in steps[3:])



def test_plot_holds_no_more_of_a_long_log_than_it_draws(tmp_path):
    # each logged row was kept whole (lr, ms, tokens/s, mfu...): a 600k-step run's log of 84 MB peaked at 762 MB
    row = {'loss': 4.1868, 'lr': 0.002, 'ms': 9.2933, 'tokens_per_sec': 110186.6978, 'mfu': None}
    with open(tmp_path / 'metrics.jsonl', 'w') as f:
        for i in range(20000):
            f.write(json.dumps({'iter': i, **row, 'time': i * 0.03}) + '\n')
    import tracemalloc
    import plot
    tracemalloc.start()
    steps, _, _ = plot.read_run(str(tmp_path))
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert len(steps) == 20000 and steps[-1]['loss'] == 4.1868 and steps[-1]['time'] == 599.97
    assert held < 400 * 20000, held / 20000  # bytes: a row's step, time and loss (about 260), not the row (about 1,000)


def logged_state(out):
    with open(out / 'metrics.jsonl') as f:
        return next(r for r in map(json.loads, f) if 'param_bytes' in r)


def test_model_size_matches_what_the_entrypoints_log(tmp_path, data_dir):
    launch('train.py', tmp_path, data_dir, 'ddp', '--max_iters=1', nproc=2)
    launch('fsdp_train.py', tmp_path, data_dir, 'fsdp', '--max_iters=1', nproc=2)
    p = run('model_size.py', '--n_layer=2', '--n_head=2', '--n_embd=32', '--block_size=32', '--vocab_size=65',
            '--bias=True', '--world_size=2', '--dtype=float32', cwd=tmp_path)
    sizes = json.loads(p.stdout.strip().splitlines()[-1])
    for row, out in (('DDP', tmp_path / 'ddp'), ('ZeRO-3 / FSDP', tmp_path / 'fsdp')):
        logged = logged_state(out)
        for k in ('param_bytes', 'grad_bytes', 'optim_bytes'):
            assert abs(sizes[row][k] - logged[k]) <= 0.05 * logged[k], (row, k, sizes[row][k], logged[k])
    assert sizes['ZeRO-1']['optim_bytes'] == sizes['DDP']['optim_bytes'] / 2


@pytest.mark.parametrize('script, nproc', [('train.py', 1), ('fsdp_train.py', 2), ('decent_train.py', 2)])
def test_deterministic_runs_repeat_exactly(tmp_path, data_dir, script, nproc):
    # on one process in torch's own threads (one per core, a fresh interpreter), where they could differ; ranks
    # forked as torchrun starts them, with the one thread each that torchrun gives them
    for out in ('one', 'two'):
        p = launch(script, tmp_path, data_dir, out, '--max_iters=4', '--deterministic=True', '--dropout=0.1',
                   nproc=nproc, nthreads=None if nproc == 1 else 1)
        assert 'dropout 0.1 turned off' in p.stdout
    one, two = read_metrics(tmp_path / 'one'), read_metrics(tmp_path / 'two')
    assert [one[0][i] for i in range(4)] == [two[0][i] for i in range(4)]
    assert [e['val_loss'] for e in one[1]] == [e['val_loss'] for e in two[1]]
    assert json.loads((tmp_path / 'one' / 'config.json').read_text())['dropout'] == 0.0
