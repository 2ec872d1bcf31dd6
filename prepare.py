"""
Prepares a dataset as nanoGPT does: data/<name>/train.bin and val.bin, uint16 token ids, and for char-level
data a meta.pkl with the vocabulary, so nanoGPT's data folders and ours are interchangeable.

python prepare.py shakespeare_char              # tiny Shakespeare, characters  (--input=FILE for a local copy)
python prepare.py shakespeare                   # tiny Shakespeare, GPT-2 BPE   (--input=FILE)
python prepare.py openwebtext                   # OpenWebText, GPT-2 BPE        (--data_files=a.parquet,b.json)
python prepare.py openwebtext-10k               # its first 10k documents       (--data_files=...)
python prepare.py text --input=FILE [--tokenizer=char|gpt2] [--name=NAME]
python prepare.py hellaswag                     # HellaSwag's validation set, for eval_hellaswag.py  (--input=FILE)

A text file is one document, split as nanoGPT does: its first 90% of characters for train, the rest for val.
Document datasets (json, parquet) get an end-of-text token (50256) after each document and a random 0.05% of
documents for val. Token ids stream to disk: the corpus is never held in memory.
"""

import os
import pickle
import sys

import numpy as np

from configurator import configure

# -----------------------------------------------------------------------------
input = ''  # a local text file (for shakespeare*, instead of downloading it; for text, required)
data_files = ''  # comma-separated local json, jsonl, parquet or txt files for openwebtext* (instead of the hub)
text_column = 'text'  # the field that holds a document's text in data_files
tokenizer = 'gpt2'  # for text: 'char' or 'gpt2'
name = ''  # folder under out_root to write to; defaults to the dataset's name, or the input file's stem for text
out_root = 'data'
val_fraction = -1.0  # -1: 0.1 of a text file's characters, 0.0005 of a document dataset's documents
num_proc = max(1, (os.cpu_count() or 2) // 2)  # tokenizer workers
chunk_chars = 1 << 20  # characters of text tokenized at a time per worker
# -----------------------------------------------------------------------------

SHAKESPEARE_URL = 'https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt'
HUB = {'openwebtext': 'Skylion007/openwebtext', 'openwebtext-10k': 'stas/openwebtext-10k'}
DATASETS = ('shakespeare_char', 'shakespeare', 'openwebtext', 'openwebtext-10k', 'text', 'hellaswag')
HELLASWAG_URL = 'https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl'
EOT = 50256  # GPT-2's <|endoftext|>


def download(url, path):
    import requests
    print(f"downloading {url}")
    try:
        r = requests.get(url, timeout=60)
        r.raise_for_status()
    except requests.RequestException as e:
        sys.exit(f"error: could not download {url} ({type(e).__name__}): pass a local copy with --input=FILE")
    with open(path + '.tmp', 'wb') as f:
        f.write(r.content)
    os.replace(path + '.tmp', path)


def text_blocks(path, start, stop):
    """The characters [start, stop) of a text file, in blocks of chunk_chars."""
    with open(path, encoding='utf-8') as f:
        pos = 0
        while pos < stop:
            block = f.read(chunk_chars)
            if not block:
                break
            lo, hi = max(start - pos, 0), min(stop - pos, len(block))
            if lo < hi:
                yield block[lo:hi]
            pos += len(block)


def safe_pieces(blocks):
    """Regroups text blocks into pieces that end just before a whitespace character that follows a non-space one.
    No pre-token of GPT-2's tokenizer spans such a point, and a whitespace run is kept whole in the next piece,
    so encoding piece by piece gives the tokens of encoding the whole text at once."""
    buf = ''
    for block in blocks:
        buf += block
        cut = len(buf) - 1
        while cut > 0 and not (buf[cut].isspace() and not buf[cut - 1].isspace()):
            cut -= 1
        if cut > 0:
            yield buf[:cut]
            buf = buf[cut:]
    if buf:
        yield buf


def gpt2_encoding():
    import tiktoken
    try:
        return tiktoken.get_encoding('gpt2')
    except Exception as e:  # its first use downloads two files
        sys.exit(f"error: could not load the GPT-2 tokenizer ({type(e).__name__}): connect to the internet once, or "
                 f"point TIKTOKEN_CACHE_DIR at a folder that holds tiktoken's gpt2 files")


class Output:
    """A .bin written in appended pieces under a temporary name, renamed into place only when complete."""

    def __init__(self, path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.path, self.f, self.n = path, open(path + '.tmp', 'wb'), 0

    def write(self, ids):
        self.f.write(np.asarray(ids, dtype=np.uint16).tobytes())
        self.n += len(ids)

    def commit(self):
        self.f.close()
        os.replace(self.path + '.tmp', self.path)

    def discard(self):
        self.f.close()
        if os.path.exists(self.path + '.tmp'):
            os.remove(self.path + '.tmp')


def prepare_text(src, out_dir, kind):
    """A text file, as characters or GPT-2 BPE, split train/val by character position."""
    from tqdm import tqdm
    n_chars, chars = 0, set()
    try:
        for block in text_blocks(src, 0, float('inf')):
            n_chars += len(block)
            if kind == 'char':
                chars.update(block)
    except UnicodeDecodeError as e:
        sys.exit(f"error: {src} is not UTF-8 text ({e.reason} at byte {e.start}): convert it, e.g. with iconv")
    if n_chars == 0:
        sys.exit(f"error: {src} is empty: give a text file with some text in it")
    frac = 0.1 if val_fraction < 0 else val_fraction
    n_train = int(n_chars * (1 - frac))
    if kind == 'char':
        itos = sorted(chars)
        if len(itos) > 65536:
            sys.exit(f"error: {src} has {len(itos):,} distinct characters, more than uint16 token ids hold (65,536): "
                     f"use --tokenizer=gpt2")
        codepoints = np.array([ord(c) for c in itos], dtype=np.uint32)

        def encode(pieces):
            # vectorized: each character's code point looked up in the sorted vocabulary
            return [np.searchsorted(codepoints, np.frombuffer(p.encode('utf-32-le'), dtype=np.uint32)) for p in pieces]
    else:
        enc = gpt2_encoding()

        def encode(pieces):
            return enc.encode_ordinary_batch(pieces, num_threads=num_proc)  # Rust threads, GIL released
    outputs = {split: Output(os.path.join(out_dir, f'{split}.bin')) for split in ('train', 'val')}
    try:
        with tqdm(total=n_chars, unit='char', unit_scale=True, desc=f'tokenizing {os.path.basename(src)}') as bar:
            for split, (start, stop) in (('train', (0, n_train)), ('val', (n_train, n_chars))):
                batch = []
                for piece in safe_pieces(text_blocks(src, start, stop)):
                    batch.append(piece)
                    if len(batch) == num_proc * 4:
                        for ids in encode(batch):
                            outputs[split].write(ids)
                        bar.update(sum(map(len, batch)))
                        batch = []
                for ids in encode(batch):
                    outputs[split].write(ids)
                bar.update(sum(map(len, batch)))
        for split in ('train', 'val'):
            if outputs[split].n == 0:
                sys.exit(f"error: {src} is too short to give any {split} tokens: use a longer text")
        if kind != 'char' and os.path.exists(os.path.join(out_dir, 'meta.pkl')):
            os.remove(os.path.join(out_dir, 'meta.pkl'))  # an earlier char-level prep's: it would set the vocabulary
        if kind == 'char':
            meta = {'vocab_size': len(itos), 'itos': dict(enumerate(itos)), 'stoi': {c: i for i, c in enumerate(itos)}}
            with open(os.path.join(out_dir, 'meta.pkl.tmp'), 'wb') as f:
                pickle.dump(meta, f)
            os.replace(os.path.join(out_dir, 'meta.pkl.tmp'), os.path.join(out_dir, 'meta.pkl'))
        for out in outputs.values():
            out.commit()
    finally:
        for out in outputs.values():
            out.discard()
    vocab = f"{len(itos)} characters" if kind == 'char' else "GPT-2 BPE"
    print(f"{out_dir}: {outputs['train'].n:,} train and {outputs['val'].n:,} val tokens ({vocab})")


def prepare_documents(dataset, out_dir):
    """A document dataset (the hub's, or local json / parquet / txt files), GPT-2 BPE with EOT after each document."""
    import datasets
    if data_files:
        files = data_files.split(',')
        missing = [f for f in files if not os.path.exists(f)]
        if missing:
            sys.exit(f"error: --data_files names {missing[0]}, which does not exist")
        ext = os.path.splitext(files[0])[1].lstrip('.')
        builder = {'jsonl': 'json', 'json': 'json', 'parquet': 'parquet', 'txt': 'text'}.get(ext)
        if builder is None:
            sys.exit(f"error: --data_files of type .{ext}: give .json, .jsonl, .parquet or .txt files")
        ds = datasets.load_dataset(builder, data_files=files, split='train')
    else:
        try:
            ds = datasets.load_dataset(HUB[dataset], split='train', num_proc=num_proc)
        except Exception as e:
            sys.exit(f"error: could not load {HUB[dataset]} from the Hugging Face hub ({type(e).__name__}): "
                     f"download its files and pass --data_files=FILE[,FILE...]")
    if text_column not in ds.column_names:
        sys.exit(f"error: the documents have no '{text_column}' field (they have {ds.column_names}): "
                 f"set --text_column")
    frac = 0.0005 if val_fraction < 0 else val_fraction
    n_val = max(1, round(len(ds) * frac))
    if len(ds) < 2:
        sys.exit(f"error: {len(ds)} document(s): train and val need at least 2")
    split = ds.train_test_split(test_size=n_val, seed=2357, shuffle=True)
    enc = gpt2_encoding()

    def tokenize(example):
        ids = enc.encode_ordinary(example[text_column]) + [EOT]
        return {'ids': ids, 'len': len(ids)}

    for name_, dset in (('train', split['train']), ('val', split['test'])):
        # tokenized documents go to datasets' on-disk cache, not to memory; then stream into a memmap
        dset = dset.map(tokenize, remove_columns=dset.column_names, num_proc=num_proc, desc=f'tokenizing {name_}')
        total = int(np.sum(dset['len'], dtype=np.int64))
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, f'{name_}.bin')
        arr = np.memmap(path + '.tmp', dtype=np.uint16, mode='w+', shape=(total,))
        try:
            idx, n_shards = 0, min(1024, len(dset))
            for i in range(n_shards):
                shard = dset.shard(num_shards=n_shards, index=i, contiguous=True).with_format('numpy')
                ids = np.concatenate(shard['ids']) if len(shard) else np.zeros(0, dtype=np.uint16)
                arr[idx:idx + len(ids)] = ids
                idx += len(ids)
            arr.flush()
            del arr
            os.replace(path + '.tmp', path)
        finally:
            if os.path.exists(path + '.tmp'):
                os.remove(path + '.tmp')
        print(f"{path}: {total:,} tokens")
    if os.path.exists(os.path.join(out_dir, 'meta.pkl')):
        os.remove(os.path.join(out_dir, 'meta.pkl'))  # an earlier char-level prep's: it would set the vocabulary


def prepare_hellaswag(out_dir):
    """HellaSwag's validation set as data/hellaswag/hellaswag_val.jsonl, every example checked (hellaswag.py) before
    the file is put in place: a bad local copy is refused before anything is written."""
    import shutil
    from hellaswag import load_examples
    path = os.path.join(out_dir, 'hellaswag_val.jsonl')
    try:
        if input:
            n = len(load_examples(input))
            os.makedirs(out_dir, exist_ok=True)
            shutil.copyfile(input, path + '.tmp')
        else:
            os.makedirs(out_dir, exist_ok=True)
            download(HELLASWAG_URL, path + '.tmp')
            n = len(load_examples(path + '.tmp'))
        os.replace(path + '.tmp', path)
    except (ValueError, OSError) as e:
        if input:
            sys.exit(f"error: {e}")
        sys.exit(f"error: the download of {HELLASWAG_URL} is damaged ({e}); try again, or pass a local copy with "
                 f"--input=FILE")
    finally:
        if os.path.exists(path + '.tmp'):
            os.remove(path + '.tmp')
    print(f"{path}: {n:,} examples")


def main():
    if len(sys.argv) < 2 or sys.argv[1] not in DATASETS:
        given = sys.argv[1] if len(sys.argv) > 1 else 'nothing'
        sys.exit(f"error: unknown dataset {given!r}: use one of {', '.join(DATASETS)}")
    dataset = sys.argv[1]
    configure(globals(), sys.argv[2:])
    if tokenizer not in ('char', 'gpt2'):
        sys.exit(f"error: tokenizer={tokenizer!r}: use char or gpt2")
    if dataset == 'text' and not input:
        sys.exit("error: text needs --input=FILE, the text file to prepare")
    if input and not os.path.isfile(input):
        sys.exit(f"error: --input={input} is not a file")
    if data_files and dataset not in HUB:
        sys.exit(f"error: --data_files is for openwebtext and openwebtext-10k; use --input=FILE for {dataset}")
    folder = name or (os.path.splitext(os.path.basename(input))[0] if dataset == 'text' else dataset)
    out_dir = os.path.join(out_root, folder)
    if dataset in HUB:
        prepare_documents(dataset, out_dir)
        return
    if dataset == 'hellaswag':
        prepare_hellaswag(out_dir)
        return
    src = input
    if not src:  # tiny Shakespeare, downloaded once next to the data as nanoGPT does
        src = os.path.join(out_dir, 'input.txt')
        if not os.path.exists(src):
            os.makedirs(out_dir, exist_ok=True)
            download(SHAKESPEARE_URL, src)
    kind = 'char' if dataset == 'shakespeare_char' else 'gpt2' if dataset == 'shakespeare' else tokenizer
    prepare_text(src, out_dir, kind)


if __name__ == '__main__':
    main()
