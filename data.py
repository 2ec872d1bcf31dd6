"""
The token data every entrypoint reads, as prepare.py (and nanoGPT) write it: data/<dataset>/train.bin and val.bin
(uint16 token ids) and, for a char-level vocabulary, meta.pkl (vocab_size, itos, stoi). Every file is read as data:
meta.pkl through an unpickler that admits no class, so a planted one runs no code.
With random_data, a virtual token file of hashed GPT-2 ids stands in for both, for cluster bring-up and benchmarks.
A folder whose prep.json (prepare.py's record) is not marked complete is refused: its prep stopped half put in place.
"""

import hashlib
import json
import os
import pickle
import shlex
import sys

import numpy as np


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        # dicts, strings and ints need no class; anything that names one is code, not a vocabulary
        raise pickle.UnpicklingError(f"it names {module}.{name}, and a vocabulary holds only dicts, strings and ints")


def gpt2_encoding_or_exit():
    """tiktoken's GPT-2 BPE, or a one-line error: its first use downloads two files, which fails offline."""
    import tiktoken
    try:
        return tiktoken.get_encoding('gpt2')
    except Exception as e:
        sys.exit(f"error: could not load the GPT-2 tokenizer ({type(e).__name__}): connect to the internet once, or "
                 f"point TIKTOKEN_CACHE_DIR at a folder that holds tiktoken's gpt2 files")


RECORD = 'prep.json'  # what prepare.py prepared in a folder: {'settings': ..., 'complete': bool}


def read_record(folder):
    """prepare.py's record of the prep in folder, read as data: None where there is none (a folder prepared by an
    older prepare.py, or by nanoGPT's), {} where it is unreadable."""
    path = os.path.join(folder, RECORD)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding='utf-8') as f:
            record = json.load(f)
        return record if isinstance(record, dict) else {}
    except (OSError, ValueError):
        return {}


def check_whole(folder):
    """A one-line error (and exit) where prepare.py stopped while it put a prep's files in place (prepare.commit):
    the folder may pair a new vocabulary with old tokens, or a new split with an old one."""
    record = read_record(folder)
    if record is not None and record.get('complete') is not True:
        sys.exit(f"error: {folder} holds a prep that stopped while its files were put in place ({RECORD} is not "
                 f"marked complete), so its files may come from two preps: run that prep again with prepare.py")


def read_meta(path):
    """meta.pkl's dict, or a one-line error (and exit) where it is damaged, planted or lacks vocab_size, or its
    folder's prep is not whole."""
    check_whole(os.path.dirname(path) or '.')
    try:
        with open(path, 'rb') as f:
            meta = _PlainUnpickler(f).load()
        if not isinstance(meta, dict) or type(meta.get('vocab_size')) is not int or meta['vocab_size'] < 1:
            raise ValueError("it holds no vocab_size")
    except Exception as e:
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}" if str(e) else type(e).__name__
        if os.path.basename(path) != 'meta.pkl':  # another file given for one (sample.py --meta_path=RUN/ckpt.pt)
            sys.exit(f"error: {path} is not a vocabulary ({why}): give the meta.pkl that prepare.py wrote beside the "
                     f"dataset's train.bin, --meta_path=data/<dataset>/meta.pkl")
        sys.exit(f"error: {path} is not a vocabulary ({why}): prepare the dataset again with prepare.py, or remove "
                 f"it for GPT-2's BPE")
    return meta


def meta_vocab(dataset, random_data=False):
    """The vocabulary of the dataset's meta.pkl (a character-level prep's), or None where it has none (GPT-2's
    tokens: the model takes 50304) or random_data=True reads none of its files."""
    path = os.path.join(data_dir(dataset), 'meta.pkl')
    return read_meta(path)['vocab_size'] if os.path.exists(path) and not random_data else None


def vocabulary(dataset, random_data=False):
    """What the dataset's token ids stand for, as a run's checkpoints record it: 'gpt2' (no meta.pkl: GPT-2's BPE,
    as random_data's too) or 'char-N-' and a hash of meta.pkl's characters in id order. A folder prepared again
    with another tokenizer or text keeps its name but changes this, which a resume on it would not see otherwise."""
    path = os.path.join(data_dir(dataset), 'meta.pkl')
    return 'gpt2' if random_data or not os.path.exists(path) else vocabulary_of(read_meta(path))


def vocabulary_of(meta):
    """vocabulary()'s name of a meta.pkl's vocabulary (read_meta's dict)."""
    itos = meta.get('itos') if isinstance(meta.get('itos'), dict) else {}
    chars = [itos.get(i) for i in range(meta['vocab_size'])]
    return f"char-{meta['vocab_size']}-{hashlib.sha256(repr(chars).encode()).hexdigest()[:16]}"


def is_path(dataset):
    """Whether --dataset names a folder by its path: anything with a slash or '.' alone (./, ../x,
    data/openwebtext-10k, /abs/folder, ~/x); otherwise it is a folder's name under data/."""
    return os.sep in dataset or '/' in dataset or dataset in ('.', '..') or dataset.startswith('~')


def data_dir(dataset):
    """The folder of a dataset: data/<dataset> for a name, as nanoGPT lays them out; the folder itself for a path."""
    return os.path.expanduser(dataset) if is_path(dataset) else os.path.join('data', dataset)


class RandomTokens:
    """A stand-in for a token file (random_data=True): token i of a split is a hash of (split, i), a GPT-2 id. It is
    read at the offsets that the entrypoints draw from their seeded generator, as a real file is, so the stream is a
    function of the seed and the step alone and the same at any world size, and evals and resume work unchanged."""
    SIZE = 1 << 40  # tokens in each split: offsets never run out or repeat in practice
    VOCAB = 50257  # GPT-2's ids, so that a GPT-2-sized model sees every id and a smaller one is refused

    def __init__(self, split):
        self.salt = np.uint64({'train': 1, 'val': 2}[split] << 41)

    def __getitem__(self, index):
        # splitmix64 of the position: cheap, vectorized, and the same on every machine
        z = (np.asarray(index, dtype=np.uint64) + self.salt) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return ((z ^ (z >> np.uint64(31))) % np.uint64(self.VOCAB)).astype(np.uint16)


def read_rows(source, offsets, length):
    """Tokens [offset, offset + length) of a split for each of offsets, as int64 rows: from the file find_bins opened,
    a row a read, or from random_data's virtual file. Read, not memory-mapped: a map, even one made anew for each
    batch, holds each page-cache folio that a row touches (up to 2 MB on a recent kernel) in the run's RSS, 75 MB for
    64 rows of a 190 MB train.bin against 9 MB of a 47 MB one, and a file cut short under it is a SIGBUS."""
    if isinstance(source, RandomTokens):
        return source[np.asarray(offsets)[:, None] + np.arange(length)].astype(np.int64)
    size = 2 * length
    rows = b''.join([os.pread(source.fileno(), size, 2 * int(offset)) for offset in offsets])
    if len(rows) != size * len(offsets):
        sys.exit(f"error: {source.name} shrank while this run read it: it was written over in place (prepare.py "
                 f"renames a new prep in, leaving a run on the old files); start the run again once it is whole")
    return np.frombuffer(rows, dtype=np.uint16).reshape(len(offsets), length).astype(np.int64)


def find_bins(dataset, block_size, random_data=False):
    """({split: the file, open}, {split: tokens}) of data/<dataset>/train.bin and val.bin (dataset may be a folder's
    path), or a one-line error where one is missing, is not whole uint16 tokens, or holds no block of block_size + 1.
    A run reads them through these handles to its end: a prep forced over the folder meanwhile (prepare.py renames
    its new files in) leaves it on the tokens it began with, never another vocabulary's ids under its model.
    With random_data, ({split: RandomTokens}, {split: RandomTokens.SIZE}): no dataset is read."""
    if random_data:
        return ({split: RandomTokens(split) for split in ('train', 'val')},
                {split: RandomTokens.SIZE for split in ('train', 'val')})
    if not dataset:  # data/ itself, whose prepare.py line would name no dataset (`--data_dir ''`, `--dataset=`)
        sys.exit("error: dataset is empty: give --dataset=NAME (a folder under data/) or a folder's path (./mydata)")
    folder = data_dir(dataset)
    check_whole(folder)
    files, n_tokens = {}, {}
    for split in ('train', 'val'):
        path = os.path.join(folder, f'{split}.bin')
        if not os.path.isfile(path):
            others = sorted(f for f in os.listdir(folder) if f.endswith(('.bin', '.npy')) and
                            f not in ('train.bin', 'val.bin')) if os.path.isdir(folder) else []
            if others:  # shards, as llm.c and build-nanogpt write them: a prep's advice would read as a text's
                try:  # llm.c's headers, joined with cat, would be read as tokens
                    with open(os.path.join(folder, others[0]), 'rb') as f:
                        llmc = f.read(4) == LLMC_MAGIC
                except OSError:
                    llmc = False
                q, tmp = shlex.quote(folder), shlex.quote(f'{path}.tmp')
                join = (f"join each file's tokens after its 1,024-byte header (llm.c's): `for f in {q}/*{split}*.bin; "
                        f"do tail -c +1025 \"$f\"; done > {tmp} && mv {tmp} {shlex.quote(path)}`, and the same for "
                        f"the other split") if llmc else "join shards of headerless uint16 tokens with cat"
                sys.exit(f"error: {path} not found, and {folder} holds {len(others)} other token file(s) ({others[0]}"
                         f"{', ...' if len(others) > 1 else ''}): a run reads one train.bin and one val.bin; prepare "
                         f"the corpus with prepare.py, or {join}")
            from prepare import DATASETS  # here: only this error needs them
            name = os.path.basename(os.path.normpath(folder))
            known = name in DATASETS and name not in ('text', 'hellaswag')  # those that prepare.py NAME makes
            prep = dataset if known else f'text --input=FILE --name={dataset}'
            # nnScaler's layout (its nanoGPT checkout's data/), or a folder here by that name (DLRover's prep's
            # --output_dir mydata): a name without a / is a folder under data/, so the user gave it as a name
            for seed, whose in ((os.path.join('nanoGPT', 'data', dataset), "nnScaler's nanoGPT checkout"),
                                (os.path.join('.', dataset), "a folder here, where a name is one in data/")):
                if not is_path(dataset) and os.path.isfile(os.path.join(seed, f'{split}.bin')):
                    sys.exit(f"error: {path} not found, but {seed} holds one ({whose}): give --dataset="
                             f"{shlex.quote(seed)}, or run `python prepare.py {prep}` for {folder}")
            repo = os.path.dirname(os.path.abspath(__file__))
            if not is_path(dataset) and os.path.isfile(os.path.join(repo, path)):
                # a run started in another folder: data/ is the current folder's, as in nanoGPT, where a prep would
                # make a second copy of what the repo's data/ holds
                sys.exit(f"error: {path} not found: run `python prepare.py {prep}` here first, or use the repo's "
                         f"{os.path.join(repo, folder)}: run from {repo} (cd there), or give "
                         f"--dataset={shlex.quote(os.path.join(repo, folder))}")
            if not is_path(dataset):
                sys.exit(f"error: {path} not found: run `python prepare.py {prep}` first")
            # a path: prepare.py's --out_dir is the folder itself, absolute or relative, whatever data/ holds
            sys.exit(f"error: {path} not found: run `python prepare.py "
                     f"{name if known else 'text --input=FILE'} --out_dir={shlex.quote(folder)}` first, or give "
                     f"--dataset the folder that holds train.bin and val.bin")
        try:
            files[split] = open(path, 'rb')
        except OSError as e:
            sys.exit(f"error: cannot read {path} ({e.strerror}): give this user read access to it (chmod a+r)")
        size = os.fstat(files[split].fileno()).st_size
        if size % 2:
            sys.exit(f"error: {path} holds {size} bytes, not a whole number of uint16 tokens: it was cut short or is "
                     f"no token file; prepare the dataset again with prepare.py")
        n_tokens[split] = size // 2
        if n_tokens[split] < block_size + 1:
            sys.exit(f"error: {path} holds {n_tokens[split]} tokens, fewer than block_size + 1 = {block_size + 1}: "
                     f"lower --block_size or prepare more data")
    return files, n_tokens


def check_token_ids(paths, vocab_size):
    """A one-line error where a token id is outside the model's vocabulary (which would index past its embedding
    mid-run): data prepared with another tokenizer than the model's, or another dataset's meta.pkl. The files are
    read in chunks, so a corpus of any size takes a pass at disk speed and little memory."""
    if any(isinstance(source, RandomTokens) for source in paths.values()):
        if vocab_size < RandomTokens.VOCAB:
            sys.exit(f"error: random_data draws GPT-2 token ids (0 to {RandomTokens.VOCAB - 1}), past the model's "
                     f"vocabulary of {vocab_size}: use a model with GPT-2's vocabulary, or real data")
        return
    for source in paths.values():
        path = getattr(source, 'name', source)
        n = (os.fstat(source.fileno()).st_size if hasattr(source, 'fileno') else os.path.getsize(source)) // 2
        # a mapping a chunk, each dropped before the next: one over the whole file keeps every page it read, and
        # each rank's peak RSS would be the dataset's size (what a cluster's memory accounting kills a job for)
        largest = max((int(np.memmap(source, dtype=np.uint16, mode='r', offset=2 * i, shape=(min(CHUNK, n - i),)).max())
                       for i in range(0, n, CHUNK)), default=0)
        if largest >= vocab_size:
            sys.exit(f"error: {path} holds token id {largest}, past the model's vocabulary of {vocab_size}: prepare "
                     f"the data with the model's tokenizer (its meta.pkl for a char-level model), or train a new model")


CHUNK = 1 << 24  # tokens a chunk: 32 MB
LLMC_MAGIC = (20240520).to_bytes(4, 'little')  # the first int32 of llm.c's 256-int32 header of a token file
