import pickle

import pytest

from conftest import TINY, run


@pytest.fixture(scope='module')
def char_run(tmp_path_factory, data_dir):
    out = tmp_path_factory.mktemp('char_run')
    run('train.py', *TINY, f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={out}', '--max_iters=30',
        '--eval_interval=30', '--gradient_accumulation_steps=1', cwd=out)
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
    # the same seed gives the same text
    again = run('sample.py', f'--out_dir={char_run}', '--start=ROMEO:', '--num_samples=3', '--max_new_tokens=50',
                '--device=cpu', cwd=char_run)
    assert again.stdout == p.stdout


def test_sample_prompt_from_a_file(char_run):
    prompt = char_run / 'prompt.txt'
    prompt.write_text('KING HENRY:\nWhat')
    p = run('sample.py', f'--out_dir={char_run}', f'--start=FILE:{prompt}', '--num_samples=1', '--max_new_tokens=10',
            '--device=cpu', cwd=char_run)
    assert p.stdout.startswith('KING HENRY:\nWhat')


def test_sample_from_a_bpe_model(tmp_path, data_dir):
    run('train.py', *TINY, f'--dataset={data_dir / "shakespeare"}', f'--out_dir={tmp_path}', '--max_iters=2',
        '--eval_interval=2', '--gradient_accumulation_steps=1', cwd=tmp_path)
    p = run('sample.py', f'--out_dir={tmp_path}', '--start=To be', '--num_samples=2', '--max_new_tokens=20',
            '--device=cpu', cwd=tmp_path)
    samples = p.stdout.split('---------------\n')[:-1]
    assert len(samples) == 2 and all(s.startswith('To be') and len(s) > len('To be') + 5 for s in samples)


def test_sample_errors(char_run, tmp_path):
    for args, message in ((['--out_dir=none'], 'no checkpoint at'),
                          ([f'--out_dir={char_run}', '--start=\u00e9t\u00e9'], "characters the model's vocabulary lacks"),
                          ([f'--out_dir={char_run}', '--start=FILE:missing.txt'], 'cannot read the prompt file'),
                          (['--init_from=gpt3'], "unknown init_from='gpt3'"),
                          ([f'--init_from={tmp_path}'], 'no checkpoint at')):
        p = run('sample.py', *args, '--device=cpu', cwd=tmp_path, check=False)
        assert p.returncode != 0 and message in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1
