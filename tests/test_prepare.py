import json
import os
import pickle

import numpy as np
import pytest

from conftest import SHAKESPEARE, env, run


def tokens(path):
    return np.fromfile(path, dtype=np.uint16)


def test_char_prep_matches_nanogpt_and_round_trips(data_dir):
    d = data_dir / 'shakespeare_char'
    meta = pickle.loads((d / 'meta.pkl').read_bytes())
    train, val = tokens(d / 'train.bin'), tokens(d / 'val.bin')
    assert meta['vocab_size'] == 65 and (len(train), len(val)) == (1003854, 111540)  # nanoGPT's figures
    text = SHAKESPEARE.read_text()
    assert ''.join(meta['itos'][i] for i in train) + ''.join(meta['itos'][i] for i in val) == text


def test_bpe_prep_matches_nanogpt_and_round_trips(data_dir):
    os.environ.update(TIKTOKEN_CACHE_DIR=env()['TIKTOKEN_CACHE_DIR'])
    import tiktoken
    enc = tiktoken.get_encoding('gpt2')
    d = data_dir / 'shakespeare'
    train, val = tokens(d / 'train.bin'), tokens(d / 'val.bin')
    assert (len(train), len(val)) == (301966, 36059)  # nanoGPT's figures
    text = SHAKESPEARE.read_text()
    assert enc.decode(train.tolist()) + enc.decode(val.tolist()) == text
    assert not (d / 'meta.pkl').exists()


def test_bpe_in_small_pieces_gives_the_tokens_of_the_whole(tmp_path, data_dir):
    # 1000-character pieces cut the text in ~1000 places: each cut must leave the tokens as they were
    run('prepare.py', 'text', f'--input={SHAKESPEARE}', '--tokenizer=gpt2', '--chunk_chars=1000', '--name=pieces',
        '--num_proc=2', f'--out_root={tmp_path}', cwd=tmp_path)
    for split in ('train', 'val'):
        assert np.array_equal(tokens(tmp_path / 'pieces' / f'{split}.bin'), tokens(data_dir / 'shakespeare' / f'{split}.bin'))


def test_bpe_prep_over_a_char_folder_removes_its_vocabulary(tmp_path):
    src = tmp_path / 'poem.txt'
    src.write_text('the quick brown fox jumps over the lazy dog\n' * 50)
    run('prepare.py', 'text', f'--input={src}', '--tokenizer=char', f'--out_root={tmp_path}', cwd=tmp_path)
    assert (tmp_path / 'poem' / 'meta.pkl').exists()
    run('prepare.py', 'text', f'--input={src}', '--tokenizer=gpt2', f'--out_root={tmp_path}', cwd=tmp_path)
    assert not (tmp_path / 'poem' / 'meta.pkl').exists()  # else train.py would size the vocabulary from it


def test_text_prep_of_any_file_with_char_tokenizer(tmp_path):
    src = tmp_path / 'poem.txt'
    src.write_text('the quick brown fox jumps over the lazy dog\n' * 50)
    run('prepare.py', 'text', f'--input={src}', '--tokenizer=char', f'--out_root={tmp_path}', cwd=tmp_path)
    meta = pickle.loads((tmp_path / 'poem' / 'meta.pkl').read_bytes())
    ids = np.concatenate([tokens(tmp_path / 'poem' / 'train.bin'), tokens(tmp_path / 'poem' / 'val.bin')])
    assert ''.join(meta['itos'][i] for i in ids) == src.read_text()
    assert meta['vocab_size'] == len(set(src.read_text()))


def test_document_files_get_an_eot_after_each_document(tmp_path):
    docs = [f"document number {i} says hello {'world ' * (i % 7)}" for i in range(40)]
    src = tmp_path / 'docs.jsonl'
    src.write_text(''.join(json.dumps({'text': d}) + '\n' for d in docs))
    run('prepare.py', 'openwebtext-10k', f'--data_files={src}', '--val_fraction=0.1', '--name=owt',
        f'--out_root={tmp_path}', '--num_proc=1', cwd=tmp_path)
    os.environ.update(TIKTOKEN_CACHE_DIR=env()['TIKTOKEN_CACHE_DIR'])
    import tiktoken
    enc = tiktoken.get_encoding('gpt2')
    got = []
    for split, n_docs in (('train', 36), ('val', 4)):
        ids = tokens(tmp_path / 'owt' / f'{split}.bin').tolist()
        assert ids.count(50256) == n_docs and ids[-1] == 50256
        got += enc.decode(ids).split('<|endoftext|>')[:-1]
    assert sorted(got) == sorted(docs)


def test_vocab_larger_than_uint16_is_refused_without_output(tmp_path):
    src = tmp_path / 'wide.txt'
    src.write_text(''.join(chr(0x10000 + i) for i in range(70000)), encoding='utf-8')
    p = run('prepare.py', 'text', f'--input={src}', '--tokenizer=char', f'--out_root={tmp_path}/data', cwd=tmp_path,
            check=False)
    assert p.returncode != 0
    assert 'more than uint16' in p.stderr and '--tokenizer=gpt2' in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / 'data').exists()


def test_text_that_is_not_utf8(tmp_path):
    src = tmp_path / 'latin1.txt'
    src.write_bytes('caf\u00e9 au lait\n'.encode('latin-1') * 10)
    p = run('prepare.py', 'text', f'--input={src}', f'--out_root={tmp_path}/data', cwd=tmp_path, check=False)
    assert p.returncode != 0 and 'is not UTF-8 text' in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / 'data').exists()


@pytest.mark.parametrize('args, message', [
    (['nonsense'], "unknown dataset 'nonsense'"),
    (['text'], 'text needs --input=FILE'),
    (['text', '--input=/no/such/file.txt'], 'is not a file'),
    (['shakespeare', '--tokenizer=words'], "tokenizer='words'"),
    (['openwebtext', '--data_files=/no/such.parquet'], 'does not exist'),
])
def test_bad_prepare_arguments(tmp_path, args, message):
    p = run('prepare.py', *args, f'--out_root={tmp_path}/data', cwd=tmp_path, check=False)
    assert p.returncode != 0 and message in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / 'data').exists()
