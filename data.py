"""
The token data every entrypoint reads, as prepare.py (and nanoGPT) write it: data/<dataset>/train.bin and val.bin
(uint16 token ids) and, for a char-level vocabulary, meta.pkl (vocab_size, itos, stoi). Every file is read as data:
meta.pkl through an unpickler that admits no class, so a planted one runs no code.
"""

import os
import pickle
import sys

import numpy as np


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        # dicts, strings and ints need no class; anything that names one is code, not a vocabulary
        raise pickle.UnpicklingError(f"it names {module}.{name}, and a vocabulary holds only dicts, strings and ints")


def read_meta(path):
    """meta.pkl's dict, or a one-line error (and exit) where it is damaged, planted or lacks vocab_size."""
    try:
        with open(path, 'rb') as f:
            meta = _PlainUnpickler(f).load()
        if not isinstance(meta, dict) or type(meta.get('vocab_size')) is not int or meta['vocab_size'] < 1:
            raise ValueError("it holds no vocab_size")
    except Exception as e:
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}" if str(e) else type(e).__name__
        sys.exit(f"error: {path} is not a vocabulary ({why}): prepare the dataset again with prepare.py, or remove "
                 f"it for GPT-2's BPE")
    return meta


def data_dir(dataset):
    """The folder of a dataset: data/<dataset> for a name, as nanoGPT lays them out; the folder itself for a path,
    that is anything with a slash or '.' alone (./, ../x, data/openwebtext-10k, /abs/folder)."""
    is_path = os.sep in dataset or '/' in dataset or dataset in ('.', '..') or dataset.startswith('~')
    return os.path.expanduser(dataset) if is_path else os.path.join('data', dataset)


def find_bins(dataset, block_size):
    """({split: path}, {split: tokens}) of train.bin and val.bin in data_dir(dataset), or a one-line error where
    one is missing, is not whole uint16 tokens, or holds no block of block_size + 1."""
    folder = data_dir(dataset)
    paths, n_tokens = {}, {}
    for split in ('train', 'val'):
        path = paths[split] = os.path.join(folder, f'{split}.bin')
        if not os.path.isfile(path):
            if folder == os.path.join('data', dataset):
                sys.exit(f"error: {path} not found: run `python prepare.py {dataset}` "
                         f"(or `python prepare.py text --input=FILE --name={dataset}`) first")
            parent, name = os.path.split(os.path.normpath(os.path.abspath(folder)))
            sys.exit(f"error: {path} not found: run `python prepare.py text --input=FILE --out_root={parent} "
                     f"--name={name}` first, or give --dataset the folder that holds train.bin and val.bin")
        size = os.path.getsize(path)
        if size % 2:
            sys.exit(f"error: {path} holds {size} bytes, not a whole number of uint16 tokens: it was cut short or is "
                     f"no token file; prepare the dataset again with prepare.py")
        n_tokens[split] = size // 2
        if n_tokens[split] < block_size + 1:
            sys.exit(f"error: {path} holds {n_tokens[split]} tokens, fewer than block_size + 1 = {block_size + 1}: "
                     f"lower --block_size or prepare more data")
    return paths, n_tokens


def check_token_ids(paths, vocab_size):
    """A one-line error where a token id is outside the model's vocabulary (which would index past its embedding
    mid-run): data prepared with another tokenizer than the model's, or another dataset's meta.pkl. The files are
    read in chunks, so a corpus of any size takes a pass at disk speed and little memory."""
    for path in paths.values():
        data = np.memmap(path, dtype=np.uint16, mode='r')
        largest = max((int(data[i:i + CHUNK].max()) for i in range(0, len(data), CHUNK)), default=0)
        if largest >= vocab_size:
            sys.exit(f"error: {path} holds token id {largest}, past the model's vocabulary of {vocab_size}: prepare "
                     f"the data with the model's tokenizer (its meta.pkl for a char-level model), or train a new model")


CHUNK = 1 << 26  # tokens a chunk: 128 MB
