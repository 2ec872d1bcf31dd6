"""HellaSwag: our scoring against an independent one through transformers on the exported model, on made-up examples
in HellaSwag's format; 2 FSDP ranks against 1; the standalone evaluation, prepare.py hellaswag, and bad input."""

import json
import os
import pickle
import random
import re
import runpy
import shutil
import sys
import uuid
from contextlib import nullcontext

import pytest
import torch

from conftest import REPO, TINY, env, free_port, one_line_error, run
from launcher import finish, launch, start
from test_untrusted import Payload

os.environ.update(TIKTOKEN_CACHE_DIR=env()['TIKTOKEN_CACHE_DIR'], HF_HUB_OFFLINE='1')
import hellaswag  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

BLOCK = 64
WORDS = ('the man woman dog ball rope kitchen slowly then picks up throws runs across field camera shows a her his '
         'it water bowl knife onion cuts into pieces stands walks away smiles at crowd cheers while holding '
         'bike ramp jumps lands falls café "quickly" again, and.').split()


def made_up_examples(n, seed=0):
    """HellaSwag-shaped rows (the real file's keys) with random words: a few contexts far longer than BLOCK tokens,
    endings of 1 to 15 words so that summed and mean losses disagree."""
    rng = random.Random(seed)

    def words(k):
        return ' '.join(rng.choice(WORDS) for _ in range(k))
    rows = []
    for i in range(n):
        ctx_a, ctx_b = words(rng.choice((4, 9, 60, 90) if i % 3 == 0 else (4, 9, 14))), words(rng.randint(1, 5))
        rows.append({'ind': 1000 + i, 'activity_label': 'Made up', 'ctx_a': ctx_a, 'ctx_b': ctx_b,
                     'ctx': ctx_a + ' ' + ctx_b.capitalize(), 'split': 'val', 'split_type': 'indomain',
                     'label': rng.randint(0, 3), 'endings': [words(rng.randint(1, 15)) for _ in range(4)],
                     'source_id': f'made-up~{i}'})
    return rows


def write_jsonl(path, rows):
    path.write_text(''.join((r if isinstance(r, str) else json.dumps(r)) + '\n' for r in rows))
    return path


def make_checkpoint(folder, bias, seed):
    """A random GPT-2 BPE model saved as train.py saves it. Its weights are spread wider than at init, so that its
    predictions are far from uniform and the endings' losses far apart."""
    torch.manual_seed(seed)
    args = dict(n_layer=2, n_head=2, n_embd=32, block_size=BLOCK, bias=bias, vocab_size=50304, dropout=0.0)
    model = GPT(GPTConfig(**args))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if '.ln_' in name and name.endswith('.weight') else 0.0, 0.3)
    folder.mkdir()
    torch.save({'model': model.state_dict(), 'model_args': args, 'iter_num': 0, 'config': {'dataset': 'made_up'}},
               folder / 'ckpt.pt')
    return model.eval()


def with_zero_biases(model, folder):
    """The bias=False model as a bias=True one whose biases are 0, the same function, which export_hf.py can write
    (GPT2LMHeadModel always has biases)."""
    args = {**{k: getattr(model.config, k) for k in ('n_layer', 'n_head', 'n_embd', 'block_size', 'vocab_size')},
            'bias': True, 'dropout': 0.0}
    twin = GPT(GPTConfig(**args))
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    missing, unexpected = twin.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all(k.endswith('.bias') for k in missing)
    folder.mkdir()
    torch.save({'model': twin.state_dict(), 'model_args': args, 'iter_num': 0}, folder / 'ckpt.pt')


def reference_losses(hf_folder, examples):
    """The same scoring written independently: Hugging Face's tokenizer and GPT2LMHeadModel from the export, one
    ending per forward, the row cut to the model's window from the left, log-softmax over the ending's tokens."""
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(hf_folder)
    hf = transformers.GPT2LMHeadModel.from_pretrained(hf_folder).eval()
    out = []
    for ex in examples:
        sums, means = [], []
        for ending in ex['endings']:
            ctx_ids, end_ids = tok(ex['ctx'])['input_ids'], tok(' ' + ending)['input_ids']
            ids = (ctx_ids + end_ids)[-(BLOCK + 1):]
            k = min(len(end_ids), len(ids) - 1)
            with torch.no_grad():
                logp = torch.log_softmax(hf(torch.tensor([ids[:-1]])).logits[0].double(), dim=-1)
            nll = -logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])][-k:]
            sums.append(nll.sum().item())
            means.append(nll.mean().item())
        out.append((sums, means))
    return out


def answers(losses):
    return [min(range(4), key=s.__getitem__) for s in losses]


def export(ckpt, out):
    """export_hf.py as from the command line, but in this process: a process of its own would spend seconds
    importing torch and transformers again."""
    argv = sys.argv
    sys.argv = ['export_hf.py', f'--ckpt={ckpt}', f'--out={out}']
    try:
        runpy.run_path(str(REPO / 'export_hf.py'), run_name='__main__')
    finally:
        sys.argv = argv
    assert (out / 'model.safetensors').exists() and (out / 'vocab.json').exists()


@pytest.fixture(scope='module')
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp('hellaswag')
    rows = made_up_examples(12)
    data = write_jsonl(tmp / 'made_up.jsonl', rows)
    models = {'bias': make_checkpoint(tmp / 'bias', True, 1), 'nobias': make_checkpoint(tmp / 'nobias', False, 2)}
    with_zero_biases(models['nobias'], tmp / 'nobias_twin')
    for ckpt, out in (('bias', 'hf_bias'), ('nobias_twin', 'hf_nobias')):
        export(tmp / ckpt, tmp / out)
    return tmp, data, hellaswag.load_examples(data), models


def test_load_examples_reads_the_real_format(setup):
    tmp, data, examples, _ = setup
    rows = made_up_examples(12)
    assert examples == [{'ctx': r['ctx'], 'endings': r['endings'], 'label': r['label']} for r in rows]
    assert sorted({e['label'] for e in examples}) == [0, 1, 2, 3]


def test_long_contexts_keep_their_last_tokens_and_the_ending_whole(setup):
    _, _, examples, _ = setup
    enc = hellaswag.encoding()
    trimmed = 0
    for ex in examples:
        ctx = enc.encode(ex['ctx'])
        for (tokens, scored), ending in zip(hellaswag.render(ex, BLOCK, enc), ex['endings']):
            end = enc.encode(' ' + ending)
            assert tokens[len(tokens) - len(end):] == end and sum(scored) == len(end)
            kept = len(tokens) - len(end)
            assert tokens[:kept] == ctx[len(ctx) - kept:] and len(tokens) == min(len(ctx) + len(end), BLOCK + 1)
            trimmed += kept < len(ctx)
    assert trimmed >= 8  # of the 48 rows, enough are cut to test the cut


@pytest.mark.parametrize('kind', ['bias', 'nobias'])
def test_scores_equal_transformers_on_the_exported_model(setup, kind):
    tmp, _, examples, models = setup
    model = models[kind]
    ours = [[t.tolist() for t in hellaswag.ending_losses(model, ex, 'cpu', nullcontext(), BLOCK)] for ex in examples]
    theirs = reference_losses(tmp / f'hf_{kind}', examples)
    worst = max(abs(a - b) for o, t in zip(ours, theirs) for i in (0, 1) for a, b in zip(o[i], t[i]))
    assert worst < 1e-4, worst
    for i in (0, 1):  # the same answers by sum and by mean, and those are not near ties that a rounding could flip
        assert answers([o[i] for o in ours]) == answers([t[i] for t in theirs])
        gaps = [sorted(o[i])[1] - sorted(o[i])[0] for o in ours]
        assert min(gaps) > 1e-3, gaps
    # the losses are far from uniform, and sum and mean pick differently somewhere, so both counts are tested
    assert max(max(o[0]) - min(o[0]) for o in ours) > 10
    by_sum, by_mean = answers([o[0] for o in ours]), answers([o[1] for o in ours])
    assert by_sum != by_mean
    scores = hellaswag.evaluate(model, examples, 'cpu', nullcontext(), BLOCK)
    labels = [ex['label'] for ex in examples]
    assert scores == {'n': 12, 'acc': sum(a == y for a, y in zip(answers([t[0] for t in theirs]), labels)) / 12,
                      'acc_norm': sum(a == y for a, y in zip(answers([t[1] for t in theirs]), labels)) / 12}
    assert 0 < scores['acc'] + scores['acc_norm'] and model.training is False


FSDP_SCRIPT = """
import json, sys
from contextlib import nullcontext
sys.path.insert(0, {repo!r})
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
import hellaswag
from checkpoint import load_checkpoint
from distributed import finish
dist.init_process_group('gloo')
model, _ = load_checkpoint({ckpt!r}, dropout=0.0)
mesh = init_device_mesh('cpu', (dist.get_world_size(),))
for block in model.transformer.h:
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
examples = hellaswag.load_examples({data!r})
out = [hellaswag.evaluate(model, examples[:n], 'cpu', nullcontext(), {block}, dist.get_rank(), 2) for n in (4, 7, 1)]
sys.stdout.write(json.dumps(out) + '\\n')  # one write: print's two would let the other rank's line in between
finish()  # the end the entrypoints use: left to the interpreter's teardown, gloo has aborted a finished run
"""


def test_two_fsdp_ranks_give_the_counts_of_one(setup):
    # under FSDP every forward gathers the weights from both ranks: 7 examples and 1 leave one rank a padding
    # forward, without which the other would wait for it for ever; 4 share out evenly
    tmp, data, examples, models = setup
    script = tmp / 'fsdp_eval.py'
    script.write_text(FSDP_SCRIPT.format(repo=str(REPO), ckpt=str(tmp / 'bias'), data=str(data), block=BLOCK))
    p = launch(str(script), [], env(), tmp, nproc=2, timeout=180)  # forked, as torchrun starts its ranks
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [json.loads(line) for line in p.stdout.splitlines() if line.startswith('[')]
    assert len(lines) == 2 and lines[0] == lines[1]  # both ranks hold the all-reduced counts
    one = [hellaswag.evaluate(models['bias'], examples[:n], 'cpu', nullcontext(), BLOCK) for n in (4, 7, 1)]
    assert lines[0] == one and [s['n'] for s in one] == [4, 7, 1]


def test_eval_hellaswag_on_two_ranks_prints_the_counts_of_one(setup):
    tmp, data, examples, models = setup
    ref = hellaswag.evaluate(models['nobias'], examples[:11], 'cpu', nullcontext(), BLOCK)
    p = run('eval_hellaswag.py', f'--ckpt={tmp / "nobias"}', f'--input={data}', '--limit=11', '--device=cpu', nproc=2,
            cwd=tmp)
    want = f"hellaswag: 11 examples, acc {ref['acc']:.4f}, acc_norm {ref['acc_norm']:.4f}"
    assert p.stdout.strip().splitlines()[-1] == want and p.stdout.count('hellaswag:') == 1
    # two ranks by env:// alone (no launcher, no LOCAL_RANK: a PyTorchJob's plain `python`): the group met where
    # the ranks had met to learn their places on the host, whose port that store holds (EADDRINUSE)
    port = free_port()
    ranks = [start(str(REPO / 'eval_hellaswag.py'), [f'--ckpt={tmp / "nobias"}', f'--input={data}', '--limit=11',
                                                    '--device=cpu'],
                   {**env(), 'RANK': str(r), 'WORLD_SIZE': '2', 'MASTER_ADDR': '127.0.0.1', 'MASTER_PORT': str(port)},
                   tmp) for r in range(2)]
    p = [finish(r, 180) for r in ranks]
    assert [q.returncode for q in p] == [0, 0], p[0].stderr[-2000:] + p[1].stderr[-2000:]
    assert p[0].stdout.strip().splitlines()[-1] == want and p[1].stdout.count('hellaswag:') == 0


def test_the_first_line_names_the_state_read_a_killed_runs_newer_memory_snapshot(setup, tmp_path):
    """A run killed past its last checkpoint is evaluated at its newer memory snapshot (train.py's, a whole
    ckpt.pt): the line that names the model names that file, not the older checkpoint."""
    from checkpoint import snapshot_dir, where_saved
    tmp, data, _, _ = setup
    out, run_id = tmp_path / 'killed', f'test-{uuid.uuid4().hex}'
    shutil.copytree(tmp / 'bias', out)
    (out / 'run_id').write_text(run_id)
    shm = snapshot_dir(run_id)
    os.mkdir(shm)
    try:
        state = torch.load(out / 'ckpt.pt', weights_only=True)
        torch.save({**state, **where_saved(out), 'iter_num': 5}, os.path.join(shm, 'ckpt.pt'))
        p = run('eval_hellaswag.py', f'--ckpt={out}', f'--input={data}', '--limit=1', '--device=cpu', cwd=tmp_path)
        assert p.stdout.startswith(f"{os.path.join(shm, 'ckpt.pt')}: "), p.stdout
    finally:
        shutil.rmtree(shm)


def test_bad_input_is_a_one_line_error(setup, tmp_path):
    tmp, data, examples, _ = setup
    good = [json.dumps(r) for r in made_up_examples(3)]
    bad = write_jsonl(tmp_path / 'bad.jsonl', good[:2] + ['{"ctx": "a man", "endings": ["x", "y"], "label": 0}'])
    p = run('eval_hellaswag.py', f'--ckpt={tmp / "bias"}', f'--input={bad}', cwd=tmp_path, check=False)
    assert one_line_error(p) == f"error: {bad}:3: endings must be a list of 4 strings, got [\"x\", \"y\"]: fix the line"
    # what the script and the training loops call, in this process
    with pytest.raises(SystemExit) as e:
        hellaswag.load_or_exit(str(tmp_path / 'none.jsonl'))
    assert str(e.value).startswith(f"error: no HellaSwag file at {tmp_path / 'none.jsonl'}: run python prepare.py "
                                   f"hellaswag")
    # a folder in the file's place (the one prepare.py wrote it into) was "[Errno 21] Is a directory", no fix named
    with pytest.raises(SystemExit) as e:
        hellaswag.load_or_exit(str(tmp_path))
    assert str(e.value) == f"error: {tmp_path} is a folder, not HellaSwag's jsonl: give the file, e.g. " \
                           f"{tmp_path / 'hellaswag_val.jsonl'}"
    # a char-level model cannot read the examples' tokens
    with pytest.raises(SystemExit) as e:
        hellaswag.load_or_exit(str(data), vocab_size=65)
    assert str(e.value).startswith("error: HellaSwag needs a model with GPT-2's BPE vocabulary (50257 tokens or "
                                   "more), and this one has 65")
    char = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=16, vocab_size=65))
    with pytest.raises(ValueError, match='this one has 65'):
        hellaswag.evaluate(char, examples, 'cpu', nullcontext(), 16)


def test_init_from_a_folder_that_is_no_intact_hugging_face_model_is_one_line(setup, tmp_path):
    """A run folder (which --ckpt takes), a planted pickle beside a good config.json (refused unread, and torch's
    advice to read it as code is not passed on), a cut-short model.safetensors, and a Hugging Face folder given to
    --ckpt (of eval_hellaswag.py, and of export_hf.py): one line each, naming the fix."""
    tmp, data, _, _ = setup
    planted, cut = tmp_path / 'planted', tmp_path / 'cut'
    planted.mkdir()
    shutil.copy(tmp / 'hf_bias' / 'config.json', planted)
    (planted / 'pytorch_model.bin').write_bytes(pickle.dumps(Payload(tmp_path / 'MARKER'), protocol=2))
    shutil.copytree(tmp / 'hf_bias', cut)
    (cut / 'model.safetensors').write_bytes((tmp / 'hf_bias' / 'model.safetensors').read_bytes()[:3000])
    latest = tmp_path / 'fsdp' / 'dcp' / 'latest'  # the file that names a sharded run's newest step folder
    (latest.parent / 'step-00000002').mkdir(parents=True)
    latest.write_text('step-00000002\n')
    for folder, says in ((tmp / 'bias', f'is a checkpoint file or a run folder, not a Hugging Face folder: evaluate '
                                        f'a checkpoint of this repo with --ckpt={tmp / "bias"}'),
                         (latest, f'is a checkpoint file or a run folder, not a Hugging Face folder: evaluate a '
                                  f'checkpoint of this repo with --ckpt={latest}'),  # not --init_from=its folder
                         (planted, 'is not an intact Hugging Face GPT-2 folder (UnpicklingError: it holds objects '
                                   'other than tensors and plain data (posix.system), refused unread): give a folder'),
                         (cut, 'is not an intact Hugging Face GPT-2 folder (SafetensorError: '),
                         (cut / 'config.json', f'is a file, and --init_from takes a Hugging Face folder: give the '
                                               f'folder that holds it, --init_from={cut}')):
        p = run('eval_hellaswag.py', f'--init_from={folder}', f'--input={data}', '--device=cpu', cwd=tmp_path,
                check=False)
        assert one_line_error(p).startswith(f'error: {folder} {says}')
        assert 'weights_only' not in p.stderr
    assert not (tmp_path / 'MARKER').exists()
    # and the other way: an export given to --ckpt
    p = run('eval_hellaswag.py', f'--ckpt={tmp / "hf_bias"}', f'--input={data}', '--device=cpu', cwd=tmp_path,
            check=False)
    assert one_line_error(p) == (f'error: {tmp / "hf_bias"} is a Hugging Face folder, not a checkpoint of this repo: '
                                 f'evaluate it with --init_from={tmp / "hf_bias"}')
    p = run('export_hf.py', f'--ckpt={tmp / "hf_bias"}', f'--out={tmp_path / "again"}', cwd=tmp_path, check=False)
    assert one_line_error(p) == (f'error: {tmp / "hf_bias"} is a Hugging Face folder already: transformers reads it as '
                                 f'it is, and so do sample.py and every entrypoint with --init_from={tmp / "hf_bias"}')
    assert not (tmp_path / 'again').exists()


@pytest.mark.parametrize('line, message', [
    ('{"ctx": "a", "endings": ["a", "b", "c", "d"], "label": 0', 'not a JSON object'),
    ('["a", "b"]', 'an object with ctx, endings and label was expected'),
    ('{"ctx": "a", "endings": ["a", "b", "c"], "label": 0}', 'endings must be a list of 4 strings'),
    ('{"ctx": "a", "endings": ["a", "b", "c", 4], "label": 0}', 'endings must be a list of 4 strings'),
    ('{"ctx": "a", "endings": ["a", "b", "c", "d"], "label": 4}', 'label must be 0, 1, 2 or 3'),
    ('{"ctx": "a", "endings": ["a", "b", "c", "d"], "label": -1}', 'label must be 0, 1, 2 or 3'),
    ('{"ctx": "a", "endings": ["a", "b", "c", "d"]}', 'label must be 0, 1, 2 or 3'),
    ('{"ctx": "", "endings": ["a", "b", "c", "d"], "label": 1}', 'ctx must be a non-empty string'),
    ('[' * 200000 + ']' * 200000, 'not a HellaSwag example (nested too deep to read)'),  # was a RecursionError
])
def test_a_bad_line_is_named_by_file_and_line(tmp_path, line, message):
    good = [json.dumps(r) for r in made_up_examples(4)]
    path = write_jsonl(tmp_path / 'x.jsonl', good[:3] + [''] + [line] + good[3:])
    with pytest.raises(ValueError) as e:
        hellaswag.load_examples(path)
    assert str(e.value).startswith(f"{path}:5: {message}") and '\n' not in str(e.value)
    # Hugging Face's copy writes the label as a string, which is read as its number
    row = dict(made_up_examples(1)[0], label='2')
    assert hellaswag.load_examples(write_jsonl(tmp_path / 'y.jsonl', [row]))[0]['label'] == 2


def test_prepare_hellaswag_checks_the_file_and_writes_it_whole(setup, tmp_path):
    _, data, _, _ = setup
    p = run('prepare.py', 'hellaswag', f'--input={data}', f'--out_root={tmp_path / "data"}', cwd=tmp_path)
    out = tmp_path / 'data' / 'hellaswag' / 'hellaswag_val.jsonl'
    assert out.read_bytes() == data.read_bytes() and '12 examples' in p.stdout
    assert os.listdir(out.parent) == ['hellaswag_val.jsonl']
    # other examples (a subset) were put in its place without a word, under the scores that runs had logged on it
    subset = write_jsonl(tmp_path / 'subset.jsonl', data.read_text().splitlines()[:3])
    p = run('prepare.py', 'hellaswag', f'--input={subset}', f'--out_root={tmp_path / "data"}', cwd=tmp_path,
            check=False)
    assert one_line_error(p).startswith(f"error: {out} holds other examples") and '--force=True' in p.stderr
    assert out.read_bytes() == data.read_bytes() and os.listdir(out.parent) == ['hellaswag_val.jsonl']
    run('prepare.py', 'hellaswag', f'--input={subset}', f'--out_root={tmp_path / "data"}', '--force=True', cwd=tmp_path)
    assert out.read_bytes() == subset.read_bytes()
    bad = write_jsonl(tmp_path / 'bad.jsonl', [json.dumps(r) for r in made_up_examples(3)] + ['{"ctx": 1}'])
    p = run('prepare.py', 'hellaswag', f'--input={bad}', f'--out_root={tmp_path / "fresh"}', cwd=tmp_path, check=False)
    assert one_line_error(p).startswith(f"error: {bad}:4: ctx must be a non-empty string")
    assert not (tmp_path / 'fresh').exists()


@pytest.fixture(scope='module')
def in_the_loop(tmp_path_factory, data_dir):
    """The made-up file where the entrypoints look for it (data/hellaswag/ below their working folder), and the
    arguments of a 1-step run on GPT-2 BPE data that evaluates HellaSwag at steps 0 and 1. The loss evals, which
    these tests do not read, take one batch: each is a forward of the 50304-word head, as a step's are."""
    tmp = tmp_path_factory.mktemp('loop')
    (tmp / 'data' / 'hellaswag').mkdir(parents=True)
    write_jsonl(tmp / 'data' / 'hellaswag' / 'hellaswag_val.jsonl', made_up_examples(7, seed=3))
    args = [a for a in TINY if not a.startswith('--block_size')] + [
        '--block_size=64', f'--dataset={data_dir / "shakespeare"}', '--max_iters=1', '--eval_interval=1',
        '--hellaswag_interval=1', '--gradient_accumulation_steps=2', '--eval_iters=1']
    return tmp, args


def hellaswag_rows(out):
    rows = [json.loads(line) for line in (out / 'metrics.jsonl').read_text().splitlines()]
    return {r['iter']: (r['hellaswag_acc'], r['hellaswag_acc_norm']) for r in rows if 'hellaswag_acc' in r}


def train_py_rows(tmp, args):
    """train.py's HellaSwag scores on one process at steps 0 and 1 (run once a module)."""
    if not (tmp / 'ref' / 'metrics.jsonl').exists():
        p = run('train.py', *args, f'--out_dir={tmp / "ref"}', cwd=tmp)
        assert 'step 0: hellaswag acc' in p.stdout and '(7 examples)' in p.stdout
    ref = hellaswag_rows(tmp / 'ref')
    assert sorted(ref) == [0, 1] and all(0 <= a <= 1 for pair in ref.values() for a in pair)
    return ref


@pytest.mark.parametrize('script, nproc, extra', [
    ('fsdp_train.py', 2, []), ('fsdp_train.py', 2, ['--tp_size=2']), ('ds_train.py', 2, ['--zero_stage=3']),
    ('decent_train.py', 2, [])])
def test_every_entrypoint_scores_hellaswag_as_train_py_does(in_the_loop, script, nproc, extra):
    """At step 0 every entrypoint holds the same model (the same seed), sharded, replicated or split as its mode
    does: the counts over the ranks must be train.py's on one process (pp_train.py's in the test below)."""
    tmp, args = in_the_loop
    ref = train_py_rows(tmp, args)
    name = script.split('.')[0] + ''.join(extra).replace('--', '-').replace('=', '')
    run(script, *args, *extra, f'--out_dir={tmp / name}', nproc=nproc, cwd=tmp)
    rows = hellaswag_rows(tmp / name)
    assert sorted(rows) == [0, 1] and rows[0] == ref[0]


def test_a_pipeline_scores_hellaswag_as_train_py_does_sending_each_tokens_loss_not_the_logits(in_the_loop):
    # each example's logits are 4 x T x 50304 floats (120 MB at GPT-2's T), and they crossed the pipeline to every
    # rank; the scores need one loss a token, which the last stage computes
    from test_pp import COUNT_BROADCASTS
    tmp, args = in_the_loop
    ref = train_py_rows(tmp, args)
    (tmp / 'count_broadcasts.py').write_text(COUNT_BROADCASTS)
    p = launch(str(tmp / 'count_broadcasts.py'), [str(REPO / 'pp_train.py'), *args, '--pp_size=2',
                                                 f'--out_dir={tmp / "pp"}'], env(), tmp, nproc=2)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = hellaswag_rows(tmp / 'pp')
    assert sorted(rows) == [0, 1] and rows[0] == ref[0]
    sizes = [int(n) for n in re.findall(r'^pipeline broadcast (\d+)$', p.stdout, re.M)]
    # both ranks, steps 0 and 1: the loss of each split's batch (eval_iters 1), then each of the 7 examples' losses,
    # 4 endings x at most block_size tokens
    assert len(sizes) == 2 * 2 * (2 + 7) and sizes.count(1) == 2 * 2 * 2, p.stdout[-3000:]
    assert max(sizes) <= 4 * 64, sizes


def test_a_run_that_cannot_load_the_tokenizer_stops_before_it_trains_in_one_line(in_the_loop, tmp_path):
    """HellaSwag's evals render the examples with GPT-2's BPE, whose first use downloads it: offline, with no copy
    (an unreachable proxy fails the download, with a network or without), as on a cluster's node, the run stops at
    its start with the line that names the fix, not a traceback at its first eval."""
    tmp, args = in_the_loop
    (tmp_path / 'empty').mkdir()
    offline = dict(env(), TIKTOKEN_CACHE_DIR=str(tmp_path / 'empty'), HTTPS_PROXY='http://127.0.0.1:9',
                   https_proxy='http://127.0.0.1:9')
    p = launch(str(REPO / 'train.py'), [*args, f'--out_dir={tmp_path / "out"}'], offline, tmp)
    assert p.returncode == 1 and one_line_error(p).startswith("error: could not load the GPT-2 tokenizer ("), \
        p.stderr[-3000:]
    assert 'step 0' not in p.stdout and not (tmp_path / 'out').exists(), p.stdout  # nothing made in out_dir either


def test_a_damaged_model_in_the_hugging_face_cache_is_one_line(setup, tmp_path):
    """init_from=gpt2 offline, with the hub cache holding a cut-short model.safetensors under gpt2's name: one line
    that says where the cached copy is to be deleted, not a traceback."""
    tmp, data, _, _ = setup
    snapshot = tmp_path / 'hf_home' / 'hub' / 'models--gpt2' / 'snapshots' / ('0' * 40)
    shutil.copytree(tmp / 'hf_bias', snapshot)
    (snapshot / 'model.safetensors').write_bytes((tmp / 'hf_bias' / 'model.safetensors').read_bytes()[:3000])
    (tmp_path / 'hf_home' / 'hub' / 'models--gpt2' / 'refs').mkdir()
    (tmp_path / 'hf_home' / 'hub' / 'models--gpt2' / 'refs' / 'main').write_text('0' * 40)
    # forked as run() forks it (the server has not imported huggingface_hub, which reads HF_HOME at its import)
    p = launch(str(REPO / 'eval_hellaswag.py'), ['--init_from=gpt2', f'--input={data}', '--device=cpu'],
               dict(env(), HF_HOME=str(tmp_path / 'hf_home'), HF_HUB_OFFLINE='1'), tmp_path, timeout=300)
    assert one_line_error(p).startswith('error: gpt2 from the Hugging Face hub does not load (SafetensorError: '), \
        p.stderr[-3000:]
