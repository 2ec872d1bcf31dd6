import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

from checkpoint import snapshot_dir
from conftest import REPO, TINY, env, one_line_error, run
from launcher import launch
from test_fault import cut_short


@pytest.fixture(scope='module')
def char_run(tmp_path_factory, data_dir):
    """train.py, 30 steps, on data/shakespeare_char of its folder: the checkpoint names the dataset by that name,
    which sample.py (run in the same folder) follows to data/shakespeare_char/meta.pkl."""
    out = tmp_path_factory.mktemp('char_run')
    (out / 'data').mkdir()
    (out / 'data' / 'shakespeare_char').symlink_to(data_dir / 'shakespeare_char')
    run('train.py', *TINY, '--dataset=shakespeare_char', f'--out_dir={out}', '--max_iters=30', '--eval_interval=30',
        '--gradient_accumulation_steps=1', cwd=out)
    return out


def test_sample_writes_text_in_the_models_vocabulary(char_run, data_dir):
    p = run('sample.py', f'--out_dir={char_run}', '--start=ROMEO:', '--num_samples=3', '--max_new_tokens=50',
            '--device=cpu', cwd=char_run)
    samples = p.stdout.split('---------------\n')[:-1]
    assert len(samples) == 3
    vocab = set(pickle.loads((data_dir / 'shakespeare_char' / 'meta.pkl').read_bytes())['stoi'])
    for s in samples:
        assert s.startswith('ROMEO:') and len(s.rstrip('\n')) >= len('ROMEO:') + 40  # 50 new chars, some may be \n
        assert set(s) <= vocab
    # the same seed gives the same text (nanoGPT's --compile taken: True compiles the model, same text, checked by hand)
    again = run('sample.py', f'--out_dir={char_run}', '--start=ROMEO:', '--num_samples=3', '--max_new_tokens=50',
                '--device=cpu', '--compile=False', cwd=char_run)
    assert again.stdout == p.stdout


def test_sample_prompt_from_a_file(char_run):
    prompt = char_run / 'prompt.txt'
    prompt.write_text('KING HENRY:\nWhat')
    p = run('sample.py', f'--out_dir={char_run}', f'--start=FILE:{prompt}', '--num_samples=1', '--max_new_tokens=10',
            '--device=cpu', cwd=char_run)
    assert p.stdout.startswith('KING HENRY:\nWhat')


def test_sample_run_in_another_folder_names_the_checkpoints_dataset_in_its_meta_path_hint(char_run, tmp_path):
    # the checkpoint names its dataset, shakespeare_char: the hint was --meta_path=data/<dataset>/meta.pkl
    p = run('sample.py', f'--out_dir={char_run}', '--device=cpu', cwd=tmp_path, check=False)
    assert one_line_error(p) == ("error: the model's vocabulary has 65 tokens, but no meta.pkl was found "
                                 "(data/shakespeare_char/meta.pkl): pass --meta_path=data/shakespeare_char/meta.pkl "
                                 "(relative to the folder the run was started in)")
    p = run('sample.py', f'--out_dir={char_run}', f"--meta_path={char_run / 'data/shakespeare_char/meta.pkl'}",
            '--num_samples=1', '--max_new_tokens=5', '--device=cpu', cwd=tmp_path)  # as it says
    assert p.stdout.count('---------------') == 1


def test_sample_from_a_bpe_model(tmp_path, data_dir):
    run('train.py', *TINY, f'--dataset={data_dir / "shakespeare"}', f'--out_dir={tmp_path}', '--max_iters=2',
        '--eval_interval=2', '--gradient_accumulation_steps=1', cwd=tmp_path)
    p = run('sample.py', f'--out_dir={tmp_path}', '--start=To be', '--num_samples=2', '--max_new_tokens=20',
            '--device=cpu', cwd=tmp_path)
    samples = p.stdout.split('---------------\n')[:-1]
    assert len(samples) == 2 and all(s.startswith('To be') and len(s) > len('To be') + 5 for s in samples)
    # offline, with no copy of the tokenizer's files (an unreachable proxy fails the download here, with a network
    # or without): a requests traceback, where it now names the fix as export_hf.py and eval_hellaswag.py do
    (tmp_path / 'empty').mkdir()
    offline = dict(env(), TIKTOKEN_CACHE_DIR=str(tmp_path / 'empty'), HTTPS_PROXY='http://127.0.0.1:9',
                   https_proxy='http://127.0.0.1:9')
    p = launch(str(REPO / 'sample.py'), [f'--out_dir={tmp_path}', '--device=cpu'], offline, tmp_path)
    assert p.returncode == 1 and one_line_error(p).startswith("error: could not load the GPT-2 tokenizer (")
    assert one_line_error(p).endswith("point TIKTOKEN_CACHE_DIR at a folder that holds tiktoken's gpt2 files")
    # GPT-2 with the hub offline (HF_HUB_OFFLINE=1) and no copy cached: the fix is not to set what is set
    p = launch(str(REPO / 'sample.py'), ['--init_from=gpt2', '--device=cpu'],
               dict(offline, HF_HOME=str(tmp_path / 'empty'), HF_HUB_OFFLINE='1'), tmp_path)
    assert p.returncode == 1 and one_line_error(p).startswith("error: could not load gpt2 from the Hugging Face hub (")
    assert one_line_error(p).endswith("on a machine with the network, or give an export_hf.py folder"), p.stderr[-500:]


def hub_that_hangs_up():
    """A Hugging Face hub (its address) that takes each connection and closes it, as a node's proxy or firewall may,
    and the list of the requests it was sent."""
    server = socket.create_server(('127.0.0.1', 0))
    calls = []

    def serve():
        while True:
            conn, _ = server.accept()
            calls.append(conn.recv(200))
            conn.close()
    threading.Thread(target=serve, daemon=True).start()
    return f'http://127.0.0.1:{server.getsockname()[1]}', calls


def test_gpt2_in_the_hugging_face_cache_loads_without_asking_the_hub(tmp_path):
    """init_from=gpt2 on a node whose Hugging Face cache holds the model and whose hub cannot be reached: it asked the
    hub first (waiting out its retries, or for good on a hub that never answers) and then read the cache. It reads the
    cache and asks nothing. A model not in the cache is still fetched from the hub, and failing that is one line."""
    import transformers
    repo = tmp_path / 'hf_home' / 'hub' / 'models--gpt2'
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_positions=16, n_embd=16, n_layer=1, n_head=2)) \
        .save_pretrained(repo / 'snapshots' / ('0' * 40))
    (repo / 'refs').mkdir()
    (repo / 'refs' / 'main').write_text('0' * 40)
    hub, calls = hub_that_hangs_up()
    e = dict(env(), HF_HOME=str(tmp_path / 'hf_home'), HF_ENDPOINT=hub)
    e.pop('HF_HUB_OFFLINE', None)  # test_hellaswag.py sets it for the session: the hub is to be reachable here
    p = launch(str(REPO / 'sample.py'), ['--init_from=gpt2', '--device=cpu', '--num_samples=1', '--max_new_tokens=3'],
               e, tmp_path)
    assert p.returncode == 0 and p.stdout.count('---------------') == 1, p.stderr[-2000:]
    assert calls == [], calls
    p = launch(str(REPO / 'sample.py'), ['--init_from=gpt2-medium', '--device=cpu'], e, tmp_path)
    assert calls and one_line_error(p).startswith("error: could not load gpt2-medium from the Hugging Face hub (")
    assert one_line_error(p).endswith("check the network, or put the model in the local cache (HF_HOME, "
                                      "~/.cache/huggingface) on a machine with the network")


def test_sample_errors(char_run, tmp_path):
    for args, message in ((['--out_dir=none'], "no checkpoint at none: point --out_dir at a run's folder"),
                          ([f'--out_dir={char_run}', '--start=\u00e9t\u00e9'],
                           "characters the model's vocabulary lacks"),
                          ([f'--out_dir={char_run}', '--start=FILE:missing.txt'], 'cannot read the prompt file'),
                          (['--init_from=gpt3'], "unknown init_from='gpt3'"),
                          ([f'--init_from={tmp_path}'], 'no checkpoint at'),
                          # it said "point --out_dir at a run's folder", which was not given
                          ([f'--init_from={tmp_path / "a"}'], f"no checkpoint at {tmp_path / 'a'}: give --init_from=a "
                                                              f"ckpt.pt, a sharded checkpoint or a run folder")):
        p = run('sample.py', *args, '--device=cpu', cwd=char_run, check=False)
        assert p.returncode != 0 and message in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1


def test_a_file_that_is_no_model_checkpoint_is_never_called_corrupt(char_run, tmp_path):
    """Intact files that are simply not a model checkpoint (another tool's state, the run's config.json, the
    dataset's meta.pkl, given where a checkpoint or a vocabulary goes) are named as such, never as damaged. A
    ckpt.pt that torch cannot read is damaged, and is; even then the advice is to move it aside, not delete it."""
    torch.save({'module': {'w': torch.zeros(2)}, 'buffer_names': []}, tmp_path / 'mp_rank_00_model_states.pt')
    meta = char_run / 'data' / 'shakespeare_char' / 'meta.pkl'
    for flag, path in (('--out_dir', char_run / 'config.json'), ('--init_from', meta),
                       ('--init_from', tmp_path / 'mp_rank_00_model_states.pt')):  # DeepSpeed's, as it names it
        msg = one_line_error(run('sample.py', f'{flag}={path}', '--device=cpu', cwd=char_run, check=False))
        assert msg.startswith(f'error: {path} is not a model checkpoint (') and msg.endswith(
            '): give a ckpt.pt, a run folder or a sharded checkpoint folder (dcp/step-N)'), msg  # no torch warning
    (tmp_path / 'run').mkdir()
    (tmp_path / 'run' / 'ckpt.pt').write_bytes((char_run / 'ckpt.pt').read_bytes()[:3000])
    msg = one_line_error(run('sample.py', f'--out_dir={tmp_path / "run"}', '--device=cpu', cwd=char_run, check=False))
    assert msg.startswith(f'error: checkpoint {tmp_path / "run" / "ckpt.pt"} is corrupt (RuntimeError: ') and \
        msg.endswith('): move it aside (mv, to a name of your own) or restore a good copy')
    msg = one_line_error(run('sample.py', f'--out_dir={char_run}', f'--meta_path={char_run / "ckpt.pt"}',
                             '--device=cpu', cwd=char_run, check=False))
    assert msg.startswith(f'error: {char_run / "ckpt.pt"} is not a vocabulary (') and 'remove' not in msg and \
        msg.endswith("give the meta.pkl that prepare.py wrote beside the dataset's train.bin, "
                     "--meta_path=data/<dataset>/meta.pkl")


def test_a_step_folder_of_ds_or_decent_names_a_whole_model_that_is_there(tmp_path):
    """A tool given a step folder of ds_train.py or decent_train.py (ZeRO's shards, or the replicas) is sent to a
    whole model of the run that exists: its best for a best-step folder, and none where ds_train.py wrote none."""
    step, best = tmp_path / 'ds-run' / 'ds' / 'step-00000002', tmp_path / 'run' / 'decent' / 'best-step-00000004'
    step.mkdir(parents=True)
    best.mkdir(parents=True)
    (tmp_path / 'run' / 'best.pt').touch()  # only looked for
    msg = one_line_error(run('sample.py', f'--init_from={step}', '--device=cpu', cwd=tmp_path, check=False))
    assert msg.endswith(f"and {tmp_path / 'ds-run'} holds no whole model beside it (save_consolidated=False): "
                        f"`ds_train.py --out_dir={tmp_path / 'ds-run'} --save_consolidated=True "
                        f"--always_save_checkpoint=True`, with the run's other flags and ranks, writes "
                        f"{tmp_path / 'ds-run' / 'ckpt.pt'}: at once where the run has finished, else at its next "
                        f"save"), msg  # it said: give the run folder (its ckpt.pt): none
    msg = one_line_error(run('sample.py', f'--init_from={best}', '--device=cpu', cwd=tmp_path, check=False))
    assert msg.endswith(f": give its best, {tmp_path / 'run' / 'best.pt'}"), msg  # not its newest, ckpt.pt
    # decent_train.py's, whose export did not complete: it was told to run ds_train.py --save_consolidated=True
    replicas = tmp_path / 'run' / 'decent' / 'step-00000004'
    replicas.mkdir()
    msg = one_line_error(run('sample.py', f'--init_from={replicas}', '--device=cpu', cwd=tmp_path, check=False))
    assert msg.endswith(f"holds no whole model beside it (its export did not complete): give this step's rank-R.pt "
                        f"(one replica), or continue the run with `decent_train.py --out_dir={tmp_path / 'run'} "
                        f"--always_save_checkpoint=True` (its other flags and ranks as before), which exports at once "
                        f"where the run has finished, else at its next save"), msg
    # RUN/best, which names a run's best in every tool, of that ds_train.py run: it has no best.pt (it said: unknown
    # init_from, use resume, best, gpt2, ...)
    (step.parent / 'latest').write_text(step.name)
    msg = one_line_error(run('sample.py', f"--init_from={tmp_path / 'ds-run' / 'best'}", '--device=cpu', cwd=tmp_path,
                             check=False))
    assert msg.startswith(f"error: {tmp_path / 'ds-run'} holds ds_train.py's step folders but no best.pt "
                          f"(save_consolidated=False)"), msg


def test_a_folder_of_step_folders_names_its_run_folder(tmp_path):
    # RUN/dcp, RUN/ds or RUN/decent, the folder beside ckpt.pt that holds the step folders, was "no checkpoint at
    # RUN/dcp/ckpt.pt: give a run folder"
    for kind in ('dcp', 'ds', 'decent'):
        (tmp_path / kind / kind / 'step-00000002').mkdir(parents=True)
        (tmp_path / kind / kind / 'latest').write_text('step-00000002')
    (tmp_path / 'ds' / 'ckpt.pt').touch()  # only looked for: ds_train.py's export
    for kind, steps in (('dcp', ', or one of those step folders'), ('ds', ''), ('decent', '')):
        run_dir = tmp_path / kind
        for script, args in (('sample.py', [f'--init_from={run_dir / kind}', '--device=cpu']),
                             ('export_hf.py', [f'--ckpt={run_dir / kind}', f'--out={tmp_path / "hf"}'])):
            msg = one_line_error(run(script, *args, cwd=tmp_path, check=False))
            assert msg == f"error: {run_dir / kind} holds the step folders of the run in {run_dir}: give the run " \
                          f"folder {run_dir} (its newest state){steps}", msg
    assert not (tmp_path / 'hf').exists()
    (tmp_path / 'ds' / 'ckpt.pt').unlink()  # save_consolidated=False: what the run folder lacks is said
    msg = one_line_error(run('sample.py', f"--init_from={tmp_path / 'ds' / 'ds'}", '--device=cpu', cwd=tmp_path,
                             check=False))
    assert msg.startswith(f"error: {tmp_path / 'ds'} holds ds_train.py's step folders but no ckpt.pt"), msg


def test_a_run_folder_named_ds_dcp_or_decent_or_in_one_so_named_is_read_as_a_run_folder(char_run, tmp_path):
    """An out_dir named as a folder of step folders (x/dcp), or lying in one so named (runs/ds/a): the tools read it
    as the run folder it is, as what it holds tells, never as step folders or a step folder by the name."""
    named = tmp_path / 'dcp'
    shutil.copytree(char_run, named, symlinks=True)
    meta = f"--meta_path={named / 'data' / 'shakespeare_char' / 'meta.pkl'}"
    p = run('sample.py', f'--out_dir={named}', '--device=cpu', '--num_samples=1', '--max_new_tokens=5', meta,
            cwd=tmp_path)
    assert p.stdout.strip() and not p.stderr
    run('export_hf.py', f'--ckpt={named}', f'--out={tmp_path / "hf"}', cwd=tmp_path)
    assert (tmp_path / 'hf' / 'model.safetensors').exists()
    # a file of it is no latest file: it was taken for one, and for a checkpoint of this repo to give to --ckpt
    msg = one_line_error(run('eval_hellaswag.py', f"--init_from={named / 'config.json'}", cwd=tmp_path, check=False))
    assert msg.startswith(f"error: {named / 'config.json'} is a file, and --init_from takes a Hugging Face folder"), msg
    # runs in folders named ds and decent: one killed before its first save, one of ds_train.py's shards alone
    # (save_consolidated=False); each was "a step folder of ds_train.py (decent_train.py), and runs holds no whole
    # model beside it"
    killed, shards = tmp_path / 'ds' / 'killed', tmp_path / 'decent' / 'shards'
    (killed).mkdir(parents=True)
    (killed / 'run_id').write_text(f'test-{uuid.uuid4().hex}')
    (shards / 'ds' / 'step-00000002').mkdir(parents=True)
    (shards / 'ds' / 'latest').write_text('step-00000002')
    for script, flags in (('sample.py', ['--device=cpu', '--init_from=']), ('export_hf.py', ['--out=x', '--ckpt='])):
        msg = one_line_error(run(script, *flags[:-1], flags[-1] + str(killed), cwd=tmp_path, check=False))
        assert msg.startswith(f"error: no checkpoint at {killed / 'ckpt.pt'}: "), msg
        msg = one_line_error(run(script, *flags[:-1], flags[-1] + str(shards), cwd=tmp_path, check=False))
        assert msg.startswith(f"error: {shards} holds ds_train.py's step folders but no ckpt.pt"), msg
    assert not (tmp_path / 'x').exists()


NO_GPU = 'cuda' if not torch.cuda.is_available() else f'cuda:{torch.cuda.device_count()}'


@pytest.mark.parametrize('flag, message', [
    ('--temperature=-0.5', 'temperature=-0.5 is not a number from 0 up: give 0 (always the likeliest token) or more'),
    ('--top_k=-1', 'top_k=-1 is negative: give how many of the likeliest tokens to sample from, or 0 for all'),
    ('--num_samples=-2', 'num_samples=-2 is negative: give 0 or more'),
    ('--max_new_tokens=-1', 'max_new_tokens=-1 is negative: give 0 or more'),
    ('--dtype=float64', "unknown dtype='float64': use auto, float32, bfloat16, float16"),
    ('--device=gpu', "unknown device='gpu': use auto, cpu, cuda or cuda:N"),
    (f'--device={NO_GPU}', f'device={NO_GPU} but torch sees {torch.cuda.device_count()} GPUs here: use --device=cpu'),
    ('NAN_CONFIG', 'temperature=nan is not a finite number: give one like its default 0.8'),
    ('--seed=99999999999999999999', 'seed=99999999999999999999 must be from 0 to 9223372036854775807'),
    ('SMALL_META', "does not hold the vocabulary of this 65-token model (10 tokens): pass the --meta_path of the data"),
    # as many characters, two swapped: every id decodes, to the wrong character
    ('SWAPPED_META', "is not the vocabulary the model was trained on (its data was prepared again since, or it is "
                     "another dataset's): pass the --meta_path of the data the model was trained on"),
])
def test_sample_bad_input(char_run, tmp_path, flag, message):
    if flag == 'SMALL_META':  # a vocabulary of 10 characters for a model of 65: its ids 10 and up have no text
        chars = 'abcdefghij'
        meta = {'vocab_size': 10, 'itos': dict(enumerate(chars)), 'stoi': {c: i for i, c in enumerate(chars)}}
        (tmp_path / 'meta.pkl').write_bytes(pickle.dumps(meta))
        flag = f'--meta_path={tmp_path / "meta.pkl"}'
    if flag == 'SWAPPED_META':
        meta = pickle.loads((char_run / 'data' / 'shakespeare_char' / 'meta.pkl').read_bytes())
        meta['itos'][0], meta['itos'][1] = meta['itos'][1], meta['itos'][0]
        (tmp_path / 'meta.pkl').write_bytes(pickle.dumps(meta))
        flag = f'--meta_path={tmp_path / "meta.pkl"}'
    if flag == 'NAN_CONFIG':  # a value no flag can spell
        (tmp_path / 'nan.py').write_text("temperature = float('nan')\n")
        flag = str(tmp_path / 'nan.py')
    p = run('sample.py', f'--out_dir={char_run}', '--device=cpu', '--num_samples=1', '--max_new_tokens=5', flag,
            cwd=char_run, check=False)
    assert message in one_line_error(p)


def test_temperature_zero_takes_the_likeliest_token_every_time(char_run, data_dir):
    from checkpoint import load_checkpoint
    outs = [run('sample.py', f'--out_dir={char_run}', '--start=ROMEO:', '--num_samples=2', '--max_new_tokens=30',
                '--temperature=0', f'--seed={seed}', '--device=cpu', cwd=char_run).stdout for seed in (1, 2)]
    assert outs[0] == outs[1]  # no sampling: the seed changes nothing
    model, _ = load_checkpoint(str(char_run), dropout=0.0)
    meta = pickle.loads((data_dir / 'shakespeare_char' / 'meta.pkl').read_bytes())
    ids = [meta['stoi'][c] for c in 'ROMEO:']
    with torch.no_grad():
        for _ in range(30):
            ids.append(model.eval()(torch.tensor([ids[-32:]]))[0][0, -1].argmax().item())
    greedy = ''.join(meta['itos'][i] for i in ids)
    assert outs[0] == f'{greedy}\n---------------\n' * 2
    # a temperature near 0 samples the likeliest token too: in float16 autocast its logits overflowed to nan
    near, zero = (run('sample.py', f'--out_dir={char_run}', '--start=ROMEO:', '--num_samples=1', '--max_new_tokens=30',
                      f'--temperature={t}', '--dtype=float16', '--device=cpu', cwd=char_run).stdout for t in (1e-6, 0))
    assert near == zero and near.startswith('ROMEO:') and len(near) > 30
    # top_k=0 samples from every token
    p = run('sample.py', f'--out_dir={char_run}', '--top_k=0', '--num_samples=1', '--max_new_tokens=30',
            '--device=cpu', cwd=char_run)
    assert p.stdout.count('---------------') == 1 and p.stdout != outs[0]


def test_sample_into_a_pipe_whose_reader_left_ends_quietly(char_run):
    # `python sample.py | head -1`: the next sample's print raised BrokenPipeError, a traceback and exit 1
    p = subprocess.Popen([sys.executable, str(REPO / 'sample.py'), f'--out_dir={char_run}', '--device=cpu',
                          '--num_samples=1000', '--max_new_tokens=20', '--start=ROMEO:'], cwd=char_run, env=env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.readline().startswith(b'ROMEO:')  # the first sample has come
    p.stdout.close()  # as head does once it has its line
    err = p.stderr.read()
    assert p.wait(timeout=120) == 141 and err == b''


def test_export_hf_bad_input(char_run, tmp_path):
    (tmp_path / 'file').write_text('not a folder')
    (step := tmp_path / 'run' / 'dcp' / 'step-00000004').mkdir(parents=True)
    (tmp_path / 'run' / 'run_id').write_text('abc')
    for out, message in ((tmp_path / 'file' / 'hf', f"cannot write {tmp_path / 'file' / 'hf'}: {tmp_path / 'file'} "
                          "is not a writable folder; give --out=PATH in one"),
                         (tmp_path / 'file', f"{tmp_path / 'file'} exists: give a new folder with --out=PATH"),
                         # a link to a folder not made yet is the user's name too: it said "cannot write" at the end
                         (tmp_path / 'link', f"{tmp_path / 'link'} exists: give a new folder with --out=PATH"),
                         # it hid the run's best from sample.py --init_from=best and export_hf.py --ckpt=RUN/best
                         (tmp_path / 'run' / 'best', f"{tmp_path / 'run' / 'best'} is a name that the run in "
                          f"{tmp_path / 'run'} uses for its own state: give --out another name, e.g. "
                          f"--out={tmp_path / 'run' / 'hf-best'}"),
                         # beside its checkpoint, in the run's step folder: pruned with it at the run's next saves
                         (step / 'hf', f"{step / 'hf'} lies in {tmp_path / 'run' / 'dcp'}, where the run in "
                          f"{tmp_path / 'run'} keeps (and prunes) its checkpoints, and what is written there goes "
                          f"with them: give --out a path outside it")):
        (tmp_path / 'link').unlink(missing_ok=True)
        (tmp_path / 'link').symlink_to(tmp_path / 'later')
        p = run('export_hf.py', f'--ckpt={char_run}', f'--out={out}', cwd=tmp_path, check=False)
        assert message in one_line_error(p)
    assert sorted(f.name for f in tmp_path.iterdir()) == ['file', 'link', 'run']
    assert sorted(os.listdir(tmp_path / 'run')) == ['dcp', 'run_id']
    assert os.listdir(tmp_path / 'run' / 'dcp' / 'step-00000004') == []


def test_export_hf_removes_what_a_killed_export_to_its_out_left_and_nothing_else(char_run, tmp_path):
    """A SIGKILLed export_hf.py leaves its unfinished .NAME.XXXXXXXX.tmp/ beside --out, held (runlock) by a process
    that is gone: the next export to that --out removes it. One held by a live process, one nobody holds (an export
    just starting, or one of before the holds) and those of another name or of a user's name stay, named in a note
    where they look like an export's to this --out."""
    # an export killed while it writes (its save made to wait, so that the kill comes mid-write)
    stalled = "import sys, time, runpy, transformers; transformers.GPT2LMHeadModel.save_pretrained = lambda *a, **k: " \
        f"time.sleep(600); sys.argv = ['export_hf.py', '--ckpt={char_run}', '--out=hf']; sys.path.insert(0, " \
        f"'{REPO}'); runpy.run_path('{REPO / 'export_hf.py'}', run_name='__main__')"
    killed = subprocess.Popen([sys.executable, '-c', stalled], cwd=tmp_path, env=env(), stdout=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not list(tmp_path.glob('.hf.*.tmp/run.lock')) and killed.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    killed.kill()
    killed.wait()
    left, = tmp_path.glob('.hf.*.tmp')
    folders = {left.name: None, '.hf.l1ve0000.tmp': os.getpid(), '.hf.n0h0ld00.tmp': None,
               '.other.k1ll3d_0.tmp': killed.pid, '.hf.mine.tmp': killed.pid}
    for name, pid in list(folders.items())[1:]:
        (tmp_path / name).mkdir()
        (tmp_path / name / 'model.safetensors').write_bytes(b'half')
        if pid:
            (tmp_path / name / 'run.lock').write_text(json.dumps({'host': socket.gethostname(), 'pid': pid}))
    p = run('export_hf.py', f'--ckpt={char_run}', f'--out={tmp_path / "hf"}', cwd=tmp_path)
    assert f"removed {left}, what an export to hf wrote before it was killed" in p.stdout
    assert sorted(f.name for f in tmp_path.iterdir()) == sorted(['hf', *list(folders)[1:]])
    assert all((tmp_path / name / 'model.safetensors').read_bytes() == b'half' for name in list(folders)[1:])
    notes = [line for line in p.stderr.splitlines() if line.startswith('note: ')]
    assert notes == [f"note: {tmp_path / name} is another export's to hf, running or killed: remove it once none runs"
                     for name in ('.hf.l1ve0000.tmp', '.hf.n0h0ld00.tmp')], p.stderr
    assert sorted(os.listdir(tmp_path / 'hf')) == ['config.json', 'generation_config.json', 'model.safetensors']


def test_a_run_killed_before_its_first_save_names_its_memory_snapshots(char_run, tmp_path, data_dir):
    """A run folder whose run saved only memory snapshots (killed before its first checkpoint): the tools say where
    its state is, the whole ckpt.pt of train.py's snapshot to give, rather than that this is no run's folder."""
    out = tmp_path / 'killed'
    out.mkdir()
    run_id = f'test-{uuid.uuid4().hex}'
    (out / 'run_id').write_text(run_id)
    shm = Path(snapshot_dir(run_id))
    shm.mkdir()
    try:
        shutil.copy(char_run / 'ckpt.pt', shm / 'ckpt.pt')
        p = run('export_hf.py', f'--ckpt={out}', f'--out={tmp_path / "hf"}', cwd=tmp_path, check=False)
        says = f"error: {out} holds no checkpoint yet, only this node's memory snapshots of the run, in {shm}: give " \
            f"{shm / 'ckpt.pt'}, or resume the run (it starts from them) until it saves one: its command, flags and " \
            f"ranks, with --max_iters=1 saves the newest at once and ends (its own max_iters again trains on)"
        assert one_line_error(p) == says
        # and so does a fine-tuning run's --init_from (it said: give a run folder, which it was given)
        p = run('train.py', *TINY, f'--dataset={data_dir / "shakespeare_char"}', f'--init_from={out}',
                f'--out_dir={tmp_path / "ft"}', cwd=tmp_path, check=False)
        assert one_line_error(p) == says
        (shm / 'ckpt.pt').rename(shm / 'rank-0-of-1x1.pt')  # fsdp_train.py's: its shards, which only it reads
        p = run('sample.py', f'--out_dir={out}', '--device=cpu', cwd=tmp_path, check=False)
        assert one_line_error(p).endswith(f"in {shm}: resume the run (it starts from them) until it saves one: its "
                                          f"command, flags and ranks, with --max_iters=1 saves the newest at once and "
                                          f"ends (its own max_iters again trains on)")
        assert sorted(os.listdir(out)) == ['run_id'] and not (tmp_path / 'hf').exists()
    finally:
        shutil.rmtree(shm)


def test_a_sharded_memory_snapshot_given_to_a_tool_says_whose_it_is(tmp_path):
    """fsdp_train.py's, pp_train.py's and ds_train.py's memory snapshots (left in /dev/shm by a killed run) hold each
    rank's own shards, which only that run reads back: given to a tool, the error says so and names what to give,
    rather than that it is no model checkpoint (KeyError, IndexError) or no run folder."""
    run_id = f'test-{uuid.uuid4().hex}'
    shm = Path(snapshot_dir(run_id))
    (shm / 'step-00000010').mkdir(parents=True)
    try:
        (shm / 'latest').write_text('step-00000010')
        torch.save({'iter_num': 10}, shm / 'step-00000010' / 'mp_rank_00_model_states.pt')
        for name in ('rank-0-of-1x2.pt', 'rank-0-of-1x2pp.pt'):
            torch.save({'shards': {}, 'iter_num': 10, 'model_args': {}}, shm / name)
        fix = f"which only that run reads back as it resumes: resume the run (the out_dir whose run_id file holds " \
            f"{run_id}) until it saves, then give its out_dir (its command with --max_iters=1 saves the newest " \
            f"snapshot at once)"
        for tool, path, script in (('sample.py', shm / 'latest', 'ds_train.py'),
                                   ('export_hf.py', shm / 'step-00000010', 'ds_train.py'),
                                   ('sample.py', shm / 'rank-0-of-1x2.pt', 'fsdp_train.py'),
                                   ('export_hf.py', shm / 'rank-0-of-1x2pp.pt', 'pp_train.py')):
            flag = f'--out_dir={path}' if tool == 'sample.py' else f'--ckpt={path}'
            p = run(tool, flag, f'--out={tmp_path / "hf"}' if tool == 'export_hf.py' else '--device=cpu',
                    cwd=tmp_path, check=False)
            assert one_line_error(p) == f"error: {path} is {script}'s memory snapshot of a run, its ranks' own " \
                f"shards, {fix}"
        assert not (tmp_path / 'hf').exists()
        # kept in its out_dir by a start afresh over it (RUN/before-RUN_ID/snapshots.before-RUN_ID-HOST)
        out = tmp_path / f'before-{run_id}'
        out.mkdir()
        (out / 'run_id').write_text(run_id)
        shutil.copytree(shm, out / f'snapshots.before-{run_id}-node1')
        for path, script in ((out / f'snapshots.before-{run_id}-node1' / 'rank-0-of-1x2.pt', 'fsdp_train.py'),
                             (out / f'snapshots.before-{run_id}-node1' / 'step-00000010', 'ds_train.py')):
            p = run('sample.py', f'--out_dir={path}', '--device=cpu', cwd=tmp_path, check=False)
            assert one_line_error(p) == f"error: {path} is {script}'s memory snapshot of a run, its ranks' own " \
                f"shards, which only that run reads back as it resumes: resume the run (--out_dir={out}, where it " \
                f"is kept) until it saves, then give its out_dir (its command with --max_iters=1 saves the newest " \
                f"snapshot at once)"
    finally:
        shutil.rmtree(shm)


def test_a_run_killed_after_its_last_save_is_read_at_its_newer_memory_snapshot(char_run, tmp_path):
    """A run killed past its last checkpoint left a newer memory snapshot in /dev/shm: the tools and --init_from read
    that state (train.py's, a whole ckpt.pt) and name it, or warn that the checkpoint they read is older (another
    entrypoint's, its ranks' own shards), rather than an older state without a word. A copy of the run's folder,
    whose run_id names the same snapshots, reads its own checkpoint. Nothing in either folder is changed."""
    from checkpoint import where_saved
    out, copy = tmp_path / 'killed', tmp_path / 'copy'
    shutil.copytree(char_run, out, symlinks=True)
    run_id = f'test-{uuid.uuid4().hex}'
    (out / 'run_id').write_text(run_id)
    shutil.copytree(out, copy, symlinks=True)
    shm = Path(snapshot_dir(run_id))
    shm.mkdir()
    try:
        state = torch.load(out / 'ckpt.pt', weights_only=True)
        newer = {**state, 'model': {k: v * 1.5 for k, v in state['model'].items()}, **where_saved(out),
                 'iter_num': state['iter_num'] + 5}
        torch.save(newer, shm / 'ckpt.pt')
        before = sorted((f, f.stat().st_mtime_ns) for f in [*out.rglob('*'), *shm.rglob('*')])

        def sample(path, flag='--out_dir'):  # run in char_run, where data/shakespeare_char/meta.pkl is
            return run('sample.py', f'{flag}={path}', '--device=cpu', '--num_samples=1', '--max_new_tokens=40',
                       cwd=char_run)
        p, snapshot, older = sample(out), sample(shm / 'ckpt.pt', '--init_from'), sample(out / 'ckpt.pt', '--init_from')
        assert p.stdout == snapshot.stdout != older.stdout, (p.stderr, older.stdout)
        assert p.stderr == f"note: reading the run's memory snapshot {shm / 'ckpt.pt'} (iter {newer['iter_num']}), " \
            f"newer than {out / 'ckpt.pt'} (iter {state['iter_num']}): the run's newest state, which it has not " \
            f"saved since\n"
        # a new run initialized from the folder takes the same weights, and its log names the file it read
        p = run('train.py', *TINY, '--dataset=shakespeare_char', f'--out_dir={tmp_path / "new"}', f'--init_from={out}',
                '--max_iters=1', '--eval_interval=1', '--gradient_accumulation_steps=1', cwd=char_run)
        assert f"initializing from the weights of {shm / 'ckpt.pt'}\n" in p.stdout
        mirror = sample(copy)  # the snapshot was saved for the other folder
        assert mirror.stdout == older.stdout and mirror.stderr == ''
        # a snapshot whose weights a step spoilt is passed over for the good checkpoint, not refused as the run's
        torch.save({**newer, 'model': {k: v * float('nan') for k, v in state['model'].items()}}, shm / 'ckpt.pt')
        p = sample(out)
        assert p.stdout == older.stdout and p.stderr == f"warning: reading {out / 'ckpt.pt'} (iter " \
            f"{state['iter_num']}): the run's newer memory snapshot {shm / 'ckpt.pt'} (iter {newer['iter_num']}) " \
            f"does not load (ValueError: its weights hold inf or nan)\n"
        # fsdp_train.py's snapshot holds its ranks' shards: the older checkpoint is read, and the warning says so
        (shm / 'ckpt.pt').unlink()
        torch.save({**newer, 'config': {**state['config'], 'tp_size': 1}}, shm / 'rank-0-of-1x1.pt')
        before = [b for b in before if b[0].parent != shm] + [(shm / 'rank-0-of-1x1.pt',
                                                                (shm / 'rank-0-of-1x1.pt').stat().st_mtime_ns)]
        p = sample(out)
        assert p.stdout == older.stdout
        assert p.stderr == f"warning: reading {out / 'ckpt.pt'} (iter {state['iter_num']}), an older state than the " \
            f"run's memory snapshot {shm / 'rank-0-of-1x1.pt'} (iter {newer['iter_num']}), which only fsdp_train.py " \
            f"reads back: continue it with `fsdp_train.py --out_dir={out}` (its other flags and ranks as before) " \
            f"until it saves, for that state\n"
        assert sorted((f, f.stat().st_mtime_ns) for f in [*out.rglob('*'), *shm.rglob('*')]) == sorted(before)
    finally:
        shutil.rmtree(shm)


def test_a_memory_snapshot_replaced_while_a_tool_reads_it_is_named_at_the_step_read(char_run, tmp_path, monkeypatch,
                                                                                    capsys):
    """A run in progress replaces its memory snapshot every few steps: one replaced between the tool's look at it and
    its read was named at the step it had seen, not the one read."""
    import checkpoint
    from checkpoint import where_saved
    out = tmp_path / 'run'
    shutil.copytree(char_run, out, symlinks=True)
    run_id = f'test-{uuid.uuid4().hex}'
    (out / 'run_id').write_text(run_id)
    shm = Path(snapshot_dir(run_id))
    shm.mkdir()
    try:
        state = {**torch.load(out / 'ckpt.pt', weights_only=True), **where_saved(out)}
        torch.save({**state, 'iter_num': state['iter_num'] + 5}, shm / 'ckpt.pt')
        load = checkpoint._load

        def replaced_meanwhile(path, dropout):
            if path == str(shm / 'ckpt.pt'):
                torch.save({**state, 'iter_num': state['iter_num'] + 6}, path)
            return load(path, dropout)
        monkeypatch.setattr(checkpoint, '_load', replaced_meanwhile)
        _, read, path = checkpoint.checkpoint_or_exit(str(out), 'fix')
        assert read['iter_num'] == state['iter_num'] + 6 and path == str(shm / 'ckpt.pt')
        assert f"note: reading the run's memory snapshot {shm / 'ckpt.pt'} (iter {state['iter_num'] + 6}), newer " \
            f"than" in capsys.readouterr().err
    finally:
        shutil.rmtree(shm)


def test_a_deepspeed_run_saved_since_its_export_says_that_what_the_tool_reads_is_older(char_run, tmp_path):
    """A ds_train.py run continued with save_consolidated=False holds step folders newer than its ckpt.pt and best.pt,
    which only ds_train.py reads: a tool reads the export, and says that it is older and how to have the newest,
    rather than an older state without a word. The newest whole one: a folder that latest names and a file of which
    was cut short since (decent_train.py's too) is no newer state, and the one before is; nor is a whole one of
    another run (put there by hand), which the resume passes over too."""
    out = tmp_path / 'run'
    shutil.copytree(char_run, out, symlinks=True)
    saved = torch.load(out / 'ckpt.pt', weights_only=True, mmap=True)['iter_num']
    other = {'run_id': 'f' * 32}  # (the run's own id is another: read from out/run_id)
    assert (out / 'run_id').read_text() != other['run_id']
    for name in (f'step-{saved + 10:08d}', f'best-step-{saved + 10:08d}', f'step-{saved + 20:08d}',
                 f'step-{saved + 40:08d}'):
        (out / 'ds' / name).mkdir(parents=True)
        for file in ('mp_rank_00_model_states.pt', 'zero_pp_rank_0_mp_rank_00_optim_states.pt'):
            mine = not name.endswith(f'{saved + 40:08d}')
            torch.save({'iter_num': int(name.split('-')[-1]), **({} if mine else other)}, out / 'ds' / name / file)
    cut_short(out / 'ds' / f'step-{saved + 20:08d}' / 'zero_pp_rank_0_mp_rank_00_optim_states.pt')
    (out / 'ds' / 'latest').write_text(f'step-{saved + 40:08d}')
    (out / 'ds' / 'best').write_text(f'best-step-{saved + 10:08d}')
    for step in (saved + 30, saved + 50):  # its second rank's file cut short; another run's
        decent = out / 'decent' / f'step-{step:08d}'
        decent.mkdir(parents=True)
        for r in range(2):
            torch.save({'iter_num': step, 'rng': [None, None], **(other if step == saved + 50 else {})},
                       decent / f'rank-{r}.pt')
    cut_short(out / 'decent' / f'step-{saved + 30:08d}' / 'rank-1.pt')
    (out / 'decent' / 'latest').write_text(f'step-{saved + 30:08d}')
    for path, read, newer in ((out, 'ckpt.pt', 'latest'), (out / 'best', 'best.pt', 'best')):
        p = run('sample.py', f'--init_from={path}', '--device=cpu', '--num_samples=1', '--max_new_tokens=5',
                cwd=char_run)
        step = out / 'ds' / (f'step-{saved + 10:08d}' if newer == 'latest' else (out / 'ds' / newer).read_text())
        assert p.stderr == f"warning: reading {out / read} (iter {saved}), an older state than its step folder " \
            f"{step} (iter {saved + 10}), which only ds_train.py reads back: continue it with `ds_train.py " \
            f"--out_dir={out} --save_consolidated=True --always_save_checkpoint=True` (its other flags and ranks as " \
            f"before) until it saves, for that state\n"
