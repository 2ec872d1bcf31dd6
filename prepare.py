"""
Prepares a dataset as nanoGPT does: data/<name>/train.bin and val.bin, uint16 token ids, and for char-level
data a meta.pkl with the vocabulary, so nanoGPT's data folders and ours are interchangeable.

python prepare.py shakespeare_char              # tiny Shakespeare, characters  (--input=FILE for a local copy)
python prepare.py shakespeare                   # tiny Shakespeare, GPT-2 BPE   (--input=FILE)
python prepare.py openwebtext                   # OpenWebText, GPT-2 BPE        (--data_files=a.json,dir/*.jsonl)
python prepare.py openwebtext-10k               # its first 10k documents       (--data_files=...)
python prepare.py fineweb-edu                   # FineWeb-Edu's sample-10BT     (--data_files=a.parquet,...)
python prepare.py fineweb                       # FineWeb's sample-10BT         (--data_files=a.parquet,...)
python prepare.py text --input=FILE [--tokenizer=char|gpt2] [--name=NAME]
python prepare.py hellaswag                     # HellaSwag's validation set, for eval_hellaswag.py  (--input=FILE)
python data/shakespeare_char/prepare.py         # nanoGPT's layout: each data/<name>/prepare.py prepares <name>
                                                # into its own folder, from anywhere, with these flags
python prepare.py --src_data_path=data.txt      # DLRover's: text --input=data.txt --tokenizer=char, beside it

A text file is one document, split as nanoGPT does: its first 90% of characters for train, the rest for val.
Document datasets (json, parquet; txt files, each a document) get an end-of-text token (50256) after each
document and a random 0.05% of documents for val. Token ids stream to disk: the corpus is never held in memory.
FineWeb's samples (~10B tokens) stream from their parquet files instead, with a fixed val split: the first val_docs
documents (files in sorted order). An interrupted prep of them resumes where it stopped; a text or document prep
would write over its partial files, and is refused unless --force.
A folder's prep.json records its prep's input and settings: the same prep again is not redone, and a finished prep
of other input or settings is kept and the new one refused, unless --force=True.
"""

import errno
import glob
import hashlib
import json
import mmap
import os
import pickle
import sys
import tempfile
import unicodedata

import numpy as np

import seeds
from configurator import configure, outside_runs_or_exit, quiet_interrupt
from data import RECORD, gpt2_encoding_or_exit, read_record
from runlock import hold, let_go

# -----------------------------------------------------------------------------
input = ''  # a local text file (for shakespeare*, instead of downloading it; for text, required)
data_files = ''  # local json, jsonl, parquet or txt files (a .txt a document), or patterns (shards/*.jsonl), by commas
text_column = 'text'  # the field that holds a document's text in data_files
tokenizer = 'gpt2'  # for text: 'char' or 'gpt2'
name = ''  # folder under out_root to write to; defaults to the dataset's name, or the input file's stem for text
out_root = 'data'
out_dir = ''  # the folder to write into, instead of out_root/name
val_fraction = -1.0  # -1: 0.1 of a text file's characters, 0.0005 of a document dataset's documents
num_proc = max(1, (os.cpu_count() or 2) // 2)  # tokenizer workers
chunk_chars = 1 << 20  # characters of text tokenized at a time per worker
val_docs = 100_000  # fineweb*: the first N documents are val: ~100M tokens if they average ~1,000 tokens
chunk_docs = 1024  # fineweb*: documents read, tokenized, written and recorded as done at a time
force = False  # prepare again a folder that holds a finished prep (of any input), or start an interrupted one over
# -----------------------------------------------------------------------------

SHAKESPEARE_URL = 'https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt'
HUB = {'openwebtext': 'Skylion007/openwebtext', 'openwebtext-10k': 'stas/openwebtext-10k'}
FINEWEB = {'fineweb-edu': 'HuggingFaceFW/fineweb-edu', 'fineweb': 'HuggingFaceFW/fineweb'}  # hub repos
FINEWEB_CONFIG = 'sample-10BT'  # each repo's ~10B-token sample
DATASETS = ('shakespeare_char', 'shakespeare', 'openwebtext', 'openwebtext-10k', 'text', 'hellaswag') + tuple(FINEWEB)
HELLASWAG_URL = 'https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl'
EOT = 50256  # GPT-2's <|endoftext|>
DOCS_A_BATCH = 1024  # openwebtext*: the most documents read at a time (fewer where they are long)
created = []  # the folders this run made, deepest first: a failed run removes those still empty


def make_out_dir(out_dir, settings=None):
    """Creates out_dir once the inputs have passed their checks, tries writing in it before any tokenizing, and
    holds it. True where, by the time it is held, another prepare.py has finished the prep of these settings there:
    already_prepared again, as a prep of other settings finished since the first look would be replaced."""
    outside_runs_or_exit(out_dir, '--out_dir')  # (in a run's step folder, the bins went with its pruning)
    d = out_dir
    while d and not os.path.isdir(d):
        created.append(d)
        d = os.path.dirname(d)
    try:
        os.makedirs(out_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as e:
        sys.exit(f"error: cannot write in {out_dir} ({e.strerror}): choose a writable --out_root")
    hold(out_dir, 'another prepare.py', collective=False)  # two preps of one folder would mix their files
    return settings is not None and already_prepared(out_dir, settings)


def write_failed(out_dir, e):
    where = f": {e.filename}" if e.filename else ''  # a write's error names no file
    sys.exit(f"error: writing in {out_dir} failed ({e.strerror}{where}): free some space or choose another --out_root")


def download(url, path):
    import requests
    print(f"downloading {url}")
    try:
        r = requests.get(url, timeout=60)
        r.raise_for_status()
    except requests.RequestException as e:
        sys.exit(f"error: could not download {url} ({type(e).__name__}): pass a local copy with --input=FILE")
    try:
        with open(path + '.tmp', 'wb') as f:
            f.write(r.content)
        os.replace(path + '.tmp', path)
    except OSError as e:  # a full disk: no partial file left to take the space
        if os.path.exists(path + '.tmp'):
            os.remove(path + '.tmp')
        write_failed(os.path.dirname(path) or '.', e)


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
    """Regroups text blocks into pieces that end where no pre-token of GPT-2's tokenizer spans, so that encoding
    piece by piece gives the tokens of encoding the whole text at once: just before a whitespace character that
    follows a non-space one (a whitespace run is kept whole in the next piece), or, in a block with none (digits, a
    minified line, text without spaces), where letters, digits and other characters meet (not after an apostrophe:
    's is one pre-token). A piece stays within two blocks, so memory stays flat whatever the text: where even a
    block and what is left of the one before hold no such point (a run of a million digits), they go as one piece."""
    buf = ''
    for block in blocks:
        looked = max(len(buf), 1)  # the cuts before this block were looked for already: each character once
        buf += block
        cut = safe_cut(buf, looked)
        if cut == 0 and len(buf) > len(block):
            cut = len(buf)
        if cut > 0:
            yield buf[:cut]
            buf = buf[cut:]
    if buf:
        yield buf


def safe_cut(buf, start):
    """The last point of safe_pieces' in buf[start:] (one with a character on each side), or 0 where there is none."""
    for i in range(len(buf) - 1, start - 1, -1):
        if buf[i].isspace() and not buf[i - 1].isspace():
            return i
    kind = [('S' if c.isspace() else 'L' if unicodedata.category(c)[0] == 'L' else
             'N' if unicodedata.category(c)[0] == 'N' else 'P') for c in buf[start - 1:]]
    for i in range(len(buf) - 1, start - 1, -1):
        a, b = kind[i - start], kind[i - start + 1]
        if a != b and 'S' not in (a, b) and buf[i - 1] != "'":
            return i
    return 0


class Output:
    """A .bin written in appended pieces under a temporary name, renamed into place by commit(). With keep,
    an interrupted prep's temporary file is cut back to the keep bytes that it recorded, and appended to."""

    def __init__(self, path, keep=0):
        self.path, self.n = path, keep // 2
        self.f = open(path + '.tmp', 'r+b' if keep else 'wb')
        self.f.truncate(keep)  # tokens written after the last record of progress, by a prep killed in between
        self.f.seek(keep)

    def write(self, ids):
        self.f.write(np.asarray(ids, dtype=np.uint16).tobytes())
        self.n += len(ids)

    def sync(self):
        """Puts the tokens on disk, so that a record of progress written after this never counts tokens a crash lost."""
        self.f.flush()
        os.fsync(self.f.fileno())

    def shut(self):
        """Closes the file whatever happened: on a full disk its last flush fails again, an error already reported."""
        try:
            self.f.close()
        except OSError:
            pass

    def discard(self):
        self.shut()
        if os.path.exists(self.path + '.tmp'):
            os.remove(self.path + '.tmp')


def already_prepared(out_dir, settings):
    """True (and a line that says so) where out_dir holds a finished prep of these settings, so there is nothing to
    do. A finished prep of other settings, or one that records none (an older prepare.py's, or nanoGPT's), may be
    what a trained model needs (its meta.pkl): a one-line error, unless --force. False where there is none to keep:
    no train.bin and val.bin nor meta.pkl (a folder whose .bin files were removed to save space still holds the
    vocabulary of a model trained on it), or a prep stopped while its files were put in place (redone without
    --force), or the same prep with a .bin file missing (made again, meta.pkl as it was)."""
    bins = all(os.path.exists(os.path.join(out_dir, f'{split}.bin')) for split in ('train', 'val'))
    if force or not bins and not os.path.exists(os.path.join(out_dir, 'meta.pkl')):
        return False
    record = read_record(out_dir)
    if record is not None and record.get('complete') is not True:
        return False
    if record and record.get('settings') == settings:
        if not bins:
            return False
        print(f"{out_dir} is already prepared from this input with these settings: pass --force=True to prepare it "
              f"again")
        return True
    old = record.get('settings') if record else None
    if isinstance(old, dict):
        # a long string (a sha256) cut short inside its quotes
        changed = ', '.join(f"{k}={(v[:12] + '…' if isinstance(v, str) and len(v) > 40 else v)!r:.60}"
                            for k, v in old.items() if settings.get(k) != v)
        what = f"of other input or settings ({changed[:300] or 'other keys'})"
    else:
        what = "that records no settings (an older prepare.py's, or nanoGPT's)"
    sys.exit(f"error: {out_dir} holds a finished prep {what}, which a model trained on it may need: pass --force=True "
             f"to replace it, or prepare into another folder (--name, --out_root or --out_dir)")


def interrupted_prep(out_dir, drop=False):
    """A text or document prep writes the train.bin.tmp and val.bin.tmp that an interrupted FineWeb prep in out_dir
    resumes from (its progress.json counts their tokens): refused in one line, unless --force. drop (under the
    hold, before those files are written over): --force's prep removes that record first, so that a kill after it
    never leaves a record that counts this prep's tokens as the FineWeb prep's."""
    path = os.path.join(out_dir, 'progress.json')
    if os.path.exists(path) and not force:
        sys.exit(f"error: {out_dir} holds an interrupted FineWeb prep (progress.json), whose partial files this prep "
                 f"would overwrite: run the same fineweb command again to resume it, pass --force=True to replace "
                 f"it, or prepare into another folder (--name, --out_root or --out_dir)")
    for p in (path, path + '.tmp') if drop else ():
        if os.path.exists(p):
            os.remove(p)


def commit(out_dir, settings, bins, meta=None, drop=()):
    """Puts a prep's files in place: each of bins from its .tmp, meta.pkl written for a char vocabulary or else
    removed (an earlier char prep's would set the vocabulary), then the record of settings. A kill may stop this
    between any two steps, so the record goes first, marked incomplete: until it is rewritten complete at the end,
    data.py's readers refuse the folder (it may pair a new meta.pkl with old tokens, or a new split with an old one)
    and a rerun prepares it again without --force. Before that first rename the old prep is whole, after the last
    the new one. drop: files of the prep in progress (FineWeb's progress.json), removed inside that window."""
    meta_path = os.path.join(out_dir, 'meta.pkl')
    if meta is not None:
        with open(meta_path + '.tmp', 'wb') as f:
            pickle.dump(meta, f)
    # on the disk before any record counts them: a power cut must not leave a record of complete, empty files
    on_disk(*[path + '.tmp' for path in bins], *([meta_path + '.tmp'] if meta is not None else []))
    write_json(os.path.join(out_dir, RECORD), {'settings': settings, 'complete': False})
    for path in drop:
        os.remove(path)
    for path in bins:
        os.replace(path + '.tmp', path)
    if meta is not None:
        os.replace(meta_path + '.tmp', meta_path)
    elif os.path.exists(meta_path):
        os.remove(meta_path)
    on_disk(out_dir)  # the renames, before the record that says they are done
    write_json(os.path.join(out_dir, RECORD), {'settings': settings, 'complete': True})


def file_sha256(path):
    with open(path, 'rb') as f:
        return hashlib.file_digest(f, 'sha256').hexdigest()


def prepare_text(src, out_dir, kind):
    """A text file, as characters or GPT-2 BPE, split train/val by character position."""
    from tqdm import tqdm
    frac = 0.1 if val_fraction < 0 else val_fraction
    # the text by its content, not its path: the same text from another copy is the same prep
    settings = {'input_sha256': file_sha256(src), 'tokenizer': kind, 'val_fraction': frac}
    if already_prepared(out_dir, settings):
        return
    interrupted_prep(out_dir)
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
    n_train = int(n_chars * (1 - frac))
    if n_train in (0, n_chars):
        sys.exit(f"error: {src}'s {n_chars} characters split at val_fraction={frac} leave none for "
                 f"{'train' if n_train == 0 else 'val'}: use a longer text or another --val_fraction")
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
        enc = gpt2_encoding_or_exit()

        def encode(pieces):
            return enc.encode_ordinary_batch(pieces, num_threads=num_proc)  # Rust threads, GIL released
    if make_out_dir(out_dir, settings):
        return
    outputs = {}
    try:
        interrupted_prep(out_dir, drop=True)  # again under the hold: one interrupted since the first look is kept too
        for split in ('train', 'val'):
            outputs[split] = Output(os.path.join(out_dir, f'{split}.bin'))
        with tqdm(total=n_chars, unit='char', unit_scale=True, desc=f'tokenizing {os.path.basename(src)}') as bar:
            for split, (start, stop) in (('train', (0, n_train)), ('val', (n_train, n_chars))):
                batch = []
                # a character is a token: any block boundary cuts the text as well as another
                blocks = text_blocks(src, start, stop)
                for piece in blocks if kind == 'char' else safe_pieces(blocks):
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
        for out in outputs.values():
            out.f.close()
        meta = None
        if kind == 'char':
            meta = {'vocab_size': len(itos), 'itos': dict(enumerate(itos)), 'stoi': {c: i for i, c in enumerate(itos)}}
        commit(out_dir, settings, [out.path for out in outputs.values()], meta)
    except OSError as e:
        write_failed(out_dir, e)
    finally:
        for out in outputs.values():
            out.discard()
        if os.path.exists(os.path.join(out_dir, 'meta.pkl.tmp')):
            os.remove(os.path.join(out_dir, 'meta.pkl.tmp'))
    vocab = f"{len(itos)} characters" if kind == 'char' else "GPT-2 BPE"
    print(f"{out_dir}: {outputs['train'].n:,} train and {outputs['val'].n:,} val tokens ({vocab})")


def first_bad_line(files):
    """'file:line' of the first line of JSON-lines files that is not a JSON object, or None."""
    for path in files:
        with open(path, 'rb') as f:
            for n, line in enumerate(f, 1):
                try:
                    row = json.loads(line) if line.strip() else {}
                except ValueError:  # a JSONDecodeError, or a UnicodeDecodeError of bytes that are not UTF-8
                    return f"{path}:{n}"
                if not isinstance(row, dict):
                    return f"{path}:{n}"
    return None


def cache_full(e):
    """A one-line error (and exit) where e, or an error it wraps, is a full disk or quota: a document prep's first step
    writes the documents into datasets' cache as Arrow files (3.1 MB for 3.2 MB of JSON lines), kept there after it."""
    import datasets
    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            sys.exit(f"error: writing in datasets' cache {datasets.config.HF_DATASETS_CACHE} failed ({e.strerror}): "
                     f"it takes a copy of the documents; free some space there, or point HF_DATASETS_CACHE at a "
                     f"disk with room")
        e = e.__cause__ or e.__context__


def load_local(files, builder):
    """Local document files as a dataset, or a one-line error that names what is wrong with them."""
    import datasets
    # its progress bars and logged errors would come before the one-line error: quiet while reading local files
    verbosity, bars_off = datasets.logging.get_verbosity(), datasets.are_progress_bars_disabled()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    datasets.disable_progress_bars()
    print(f"reading {len(files)} {builder} file(s)")
    try:
        # a text file is one document, its line breaks kept (the text reader's default is a document a line, each
        # line's break dropped and an end-of-text token after it)
        by_file = {'sample_by': 'document'} if builder == 'text' else {}
        return datasets.load_dataset(builder, data_files=files, split='train', **by_file)
    except Exception as e:
        cache_full(e)
        bad = first_bad_line(files) if files[0].endswith('.jsonl') else None
        if bad:
            sys.exit(f"error: {bad}: not a JSON object: each line of a .jsonl file must be one document such as "
                     f"{{\"{text_column}\": \"...\"}}; fix or remove that line")
        while e.__cause__ is not None:  # datasets wraps the reader's error in its own
            e = e.__cause__
        reason = str(e).splitlines()[0][:200] if str(e) else ''
        sys.exit(f"error: cannot read --data_files as {builder} ({type(e).__name__}: {reason}): check that they are "
                 f"{builder} files, each holding documents")
    finally:
        datasets.logging.set_verbosity(verbosity)
        if not bars_off:
            datasets.enable_progress_bars()


def prepare_documents(dataset, out_dir):
    """A document dataset (the hub's, or local json / parquet / txt files), GPT-2 BPE with EOT after each document."""
    import datasets
    from tqdm import tqdm
    builder = None  # the hub's
    if data_files:
        files = data_files.split(',')
        ext = os.path.splitext(files[0])[1].lstrip('.')
        builder = {'jsonl': 'json', 'json': 'json', 'parquet': 'parquet', 'txt': 'text'}.get(ext)
        if builder is None:
            sys.exit(f"error: --data_files of type .{ext}: give .json, .jsonl, .parquet or .txt files")
        for f in files:
            if not os.path.isfile(f):
                problem = 'is not a file' if os.path.exists(f) else 'does not exist'
                sys.exit(f"error: --data_files names {f}, which {problem}")
            if os.path.splitext(f)[1].lstrip('.') != ext:
                sys.exit(f"error: --data_files mixes .{ext} and {os.path.splitext(f)[1] or 'no extension'} files: "
                         f"give files of one type")
            if os.path.getsize(f) == 0:
                sys.exit(f"error: --data_files names {f}, which is empty: give files that hold documents")
    frac = 0.0005 if val_fraction < 0 else val_fraction
    source = sorted(os.path.abspath(f) for f in data_files.split(',')) if data_files else HUB[dataset]
    settings = {'documents': source, 'text_column': text_column, 'val_fraction': frac,
                **({'document': 'a .txt file'} if builder == 'text' else {})}
    if already_prepared(out_dir, settings):
        return
    interrupted_prep(out_dir)
    if data_files:
        ds = load_local(files, builder)
    else:
        try:
            ds = datasets.load_dataset(HUB[dataset], split='train', num_proc=num_proc)
        except Exception as e:
            cache_full(e)
            sys.exit(f"error: could not load {HUB[dataset]} from the Hugging Face hub ({type(e).__name__}): "
                     f"download its files and pass --data_files=FILE[,FILE...]")
    if text_column not in ds.column_names:
        sys.exit(f"error: the documents have no '{text_column}' field (they have {ds.column_names}): "
                 f"set --text_column")
    # checked on the column as a whole, before any tokenizing: a bad document would fail it deep in a worker
    if getattr(ds.features[text_column], 'dtype', None) not in ('string', 'large_string'):
        sys.exit(f"error: the documents' '{text_column}' field is not text in each of them (its type is "
                 f"{ds.features[text_column]}): make it a string in every document, or set --text_column")
    nulls = ds.data.column(text_column).null_count
    if nulls:
        sys.exit(f"error: {nulls} document(s) have a null '{text_column}': give each one a string, or remove them")
    cached = [f['filename'] for f in ds.cache_files]  # the documents, as datasets' Arrow files, in order
    try:
        if data_files:  # the json reader keeps bytes that are not UTF-8 as they are (a full pass: local files only)
            for mapped, texts in cached_batches(cached):
                texts.validate(full=True)
                mapped.madvise(mmap.MADV_DONTNEED)
    except Exception as e:
        bad = first_bad_line(files) if files[0].endswith('.jsonl') else None
        sys.exit(f"error: {bad or 'a document'}: its '{text_column}' is not UTF-8 text ({str(e)[:100]}): convert the "
                 f"files to UTF-8, e.g. with iconv")
    if len(ds) < 2:
        sys.exit(f"error: {len(ds)} document(s): train and val need at least 2" + (
            " (a .txt file is one): give more files, or split one by characters with prepare.py text --input=FILE"
            if builder == 'text' else ''))
    n_val = min(max(1, round(len(ds) * frac)), len(ds) - 1)  # at least one document each
    # the documents that datasets' train_test_split(seed=2357) draws for val, as nanoGPT's prep does; each split is
    # then written in the documents' order, which reads the files once from start to end
    val = np.zeros(len(ds), dtype=bool)
    val[np.random.default_rng(2357).permutation(len(ds))[:n_val]] = True
    enc = gpt2_encoding_or_exit()
    if make_out_dir(out_dir, settings):
        return
    interrupted_prep(out_dir, drop=True)  # again under the hold: one interrupted since the first look is kept too
    paths = {name_: os.path.join(out_dir, f'{name_}.bin') for name_ in ('train', 'val')}
    outputs = {}
    try:
        # a batch of documents at a time, straight into the .bin: no tokenized copy in datasets' cache (8 bytes a
        # token, kept there after the prep: 0.9 GB for 202 MB of JSON lines). Appended, as the text prep's: a full
        # disk is an OSError here, where a memmap's page would kill the process
        for name_ in paths:
            outputs[name_] = Output(paths[name_])
        with tqdm(total=len(ds), desc='tokenizing', unit='doc') as bar:
            for texts, is_val in document_batches(cached, val):
                for name_, part in (('train', ~is_val), ('val', is_val)):
                    for ids in document_tokens([text for text, take in zip(texts, part) if take], enc):
                        outputs[name_].write(ids)
                bar.update(len(texts))
        for out in outputs.values():
            out.f.close()
        commit(out_dir, settings, paths.values())
    except OSError as e:
        write_failed(out_dir, e)
    finally:
        for out in outputs.values():
            out.discard()
    for name_, path in paths.items():
        print(f"{path}: {outputs[name_].n:,} tokens")


def batch_chars():
    """Characters of text tokenized at a time: those of a text prep's batch of pieces."""
    return num_proc * 4 * chunk_chars


def cached_batches(files):
    """(the map, the texts) of each record batch of datasets' Arrow files, in order, read through a map of each file
    whose pages the reader drops (madvise) once it is done with them: datasets' own map of the files, held for the
    whole prep, keeps every page read through it, so a prep's RSS grew by the size of its documents."""
    import pyarrow as pa
    for path in files:
        with open(path, 'rb') as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        for batch in pa.ipc.open_stream(pa.py_buffer(mapped)):
            yield mapped, batch.column(text_column)


def document_batches(files, val):
    """(texts, which of them are val) of the documents in datasets' Arrow files, in order, a batch at a time of about
    batch_chars() characters (at most DOCS_A_BATCH documents): fewer documents a batch where they are long, so that
    the texts held at once do not grow with their length, nor the pages mapped with the files' size."""
    i, texts, chars = 0, [], 0
    for mapped, column in cached_batches(files):
        for text in column:
            texts.append(text.as_py())
            chars += len(texts[-1])
            if chars >= batch_chars() or len(texts) == DOCS_A_BATCH:
                mapped.madvise(mmap.MADV_DONTNEED)  # the texts are copies; a page read again comes from the file
                yield texts, val[i:i + len(texts)]
                i, texts, chars = i + len(texts), [], 0
    if texts:
        yield texts, val[i:i + len(texts)]


def document_tokens(texts, enc):
    """The GPT-2 tokens of texts, an EOT after each, as uint16 arrays of about batch_chars() characters' worth. A
    document longer than chunk_chars goes in safe_pieces, whose tokens are the whole text's: a token is a Python
    int of about 36 bytes until it is in an array, so a batch of long documents tokenized whole held 9 bytes a
    character."""
    pieces, chars = [], 0
    for text in texts:
        blocks = (text[i:i + chunk_chars] for i in range(0, len(text), chunk_chars))
        for piece in [*(safe_pieces(blocks) if len(text) > chunk_chars else [text] if text else []), None]:
            pieces.append(piece)  # None: the document's end, its EOT
            chars += len(piece or '')
            if chars >= batch_chars():
                yield encode_pieces(pieces, enc)
                pieces, chars = [], 0
    if pieces:
        yield encode_pieces(pieces, enc)


def encode_pieces(pieces, enc):
    ids = iter(enc.encode_ordinary_batch([p for p in pieces if p is not None], num_threads=num_proc))  # Rust threads
    return np.concatenate([np.asarray(next(ids) if p is not None else [EOT], dtype=np.uint16) for p in pieces])


def prepare_hellaswag(out_dir):
    """HellaSwag's validation set as data/hellaswag/hellaswag_val.jsonl, every example checked (hellaswag.py) before
    the file is put in place: a bad local copy is refused before anything is written. Other examples there (another
    --input's, a subset of the user's), which the runs' logged scores counted, are kept and the prep refused, unless
    --force."""
    import filecmp
    import shutil
    from hellaswag import load_examples
    path = os.path.join(out_dir, 'hellaswag_val.jsonl')
    try:
        if input:
            n = len(load_examples(input))
            make_out_dir(out_dir)
            shutil.copyfile(input, path + '.tmp')
        else:
            make_out_dir(out_dir)  # a failed download removes the folders it made
            download(HELLASWAG_URL, path + '.tmp')
            n = len(load_examples(path + '.tmp'))
        if os.path.isfile(path) and not force and not filecmp.cmp(path, path + '.tmp', shallow=False):
            sys.exit(f"error: {path} holds other examples, on which the HellaSwag scores logged so far were counted: "
                     f"pass --force=True to replace them, or prepare into another folder (--name, --out_root or "
                     f"--out_dir)")
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


def write_json(path, obj):
    with open(path + '.tmp', 'w') as f:
        json.dump(obj, f)
    on_disk(path + '.tmp')
    os.replace(path + '.tmp', path)  # whole or not at all, whenever the prep is killed
    on_disk(os.path.dirname(path) or '.')


def on_disk(*paths):
    """fsync of each file or folder (a folder's: the renames in it), so that what a later write counts on has
    reached the disk before it."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fineweb_files(dataset, progress_path, out_dir):
    """The parquet files of a FineWeb sample, sorted so that val is the same however they are listed, and the fix
    to name if one of them cannot be read. From the hub: those that an interrupted or finished prep in out_dir
    read, if any (the hub's files at the revision it started on), with no call to the hub."""
    if data_files:
        files = sorted(os.path.abspath(f) for f in data_files.split(','))
        for f in files:
            if not f.endswith('.parquet'):
                sys.exit(f"error: --data_files names {f}: {dataset} takes .parquet files, the format of the hub's")
            if not os.path.isfile(f):
                problem = 'is not a file' if os.path.exists(f) else 'does not exist'
                sys.exit(f"error: --data_files names {f}, which {problem}")
        return files, "give parquet files that hold documents"
    fix = "check the connection, or download the files and pass --data_files=FILE[,FILE...]"
    if os.path.exists(progress_path) and not force:
        try:  # a resumed prep reads the files of the commit it started on, whatever the repo holds now
            with open(progress_path) as f:
                files = json.load(f)['settings']['files']
            if files[0].startswith('hf://'):
                return files, fix
        except (ValueError, KeyError, TypeError, IndexError):
            pass
    elif not force:
        try:  # a finished prep from the hub is the same prep again, offline too, whatever the repo holds now
            settings = read_record(out_dir)['settings']
            if settings['dataset'] == dataset and settings['files'][0].startswith('hf://'):
                return settings['files'], fix
        except (KeyError, TypeError, IndexError):
            pass
    import datasets
    try:
        builder = datasets.load_dataset_builder(FINEWEB[dataset], FINEWEB_CONFIG)
        return sorted(builder.config.data_files['train']), fix  # hf://datasets/REPO@COMMIT/PATH
    except Exception as e:
        sys.exit(f"error: could not list {FINEWEB[dataset]} ({FINEWEB_CONFIG}) on the Hugging Face hub "
                 f"({type(e).__name__}): download its parquet files and pass --data_files=FILE[,FILE...]")


def count_documents(files, fix):
    """The documents in the files, from their parquet footers (the rows stay unread), once their text column is
    checked."""
    import fsspec
    import pyarrow as pa
    import pyarrow.parquet as pq
    total = 0
    for path in files:
        try:
            with fsspec.open(path, 'rb') as f:
                meta = pq.read_metadata(f)
        except Exception as e:
            reason = str(e).splitlines()[0][:200] if str(e) else ''
            sys.exit(f"error: cannot read {path} as parquet ({type(e).__name__}: {reason}): {fix}")
        schema = meta.schema.to_arrow_schema()
        if text_column not in schema.names:
            sys.exit(f"error: {path} has no '{text_column}' column (it has {schema.names}): set --text_column")
        kind = schema.field(text_column).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
            sys.exit(f"error: the '{text_column}' column of {path} holds {kind}, not text: set --text_column")
        total += meta.num_rows
    return total


def text_chunks(files, start):
    """(file, row in it, texts as an arrow array) for up to chunk_docs documents at a time, from document `start`
    of the files on. Only the text column is read, a MiB at a time, so memory stays flat whatever the size of the
    row groups; whole row groups before `start` are not read at all."""
    import fsspec
    import pyarrow.parquet as pq
    for path in files:
        try:
            with fsspec.open(path, 'rb') as f:
                pf = pq.ParquetFile(f, pre_buffer=False, buffer_size=1 << 20)
                rows = [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)]
                group, row = 0, 0
                while group < len(rows) and row + rows[group] <= start:
                    row += rows[group]
                    group += 1
                start -= row
                if group == len(rows):  # the whole file comes before `start`
                    continue
                for batch in pf.iter_batches(chunk_docs, row_groups=range(group, len(rows)), columns=[text_column]):
                    texts = batch.column(0)[start:]
                    row, start = row + min(start, batch.num_rows), max(0, start - batch.num_rows)
                    if len(texts):
                        yield path, row, texts
                        row += len(texts)
        except Exception as e:  # a connection that broke, a damaged file: what was done stays done
            reason = str(e).splitlines()[0][:200] if str(e) else ''
            sys.exit(f"error: reading {path} failed ({type(e).__name__}: {reason}): fix that, then run the same "
                     f"command again to resume")


def load_progress(path, settings, outputs):
    """An interrupted prep's record of progress, or None if there is none or its partial files fall short of it."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            progress = json.load(f)
        old, sizes = progress['settings'], progress['bytes']
        if old != settings:
            changed = ', '.join(f"{k}={v!r}" for k, v in old.items() if settings.get(k) != v)
            sys.exit(f"error: {os.path.dirname(path)} holds a prep interrupted with other input or settings "
                     f"({changed[:300]}): give those to resume it, or pass --force=True to start over")
        if all(os.path.getsize(p + '.tmp') >= sizes[split] for split, p in outputs.items()):
            return progress
    except (OSError, ValueError, KeyError, TypeError):  # a partial file gone, a record from an older version
        pass
    return None


def prepare_fineweb(dataset, out_dir):
    """A FineWeb sample from its parquet files, the hub's or local ones, streamed chunk by chunk into val.bin (its
    first val_docs documents) and train.bin (the rest), GPT-2 BPE with EOT after each document. After each chunk
    progress.json records the documents done and the bytes that the partial files then held: a rerun resumes there."""
    from tqdm import tqdm
    paths = {split: os.path.join(out_dir, f'{split}.bin') for split in ('val', 'train')}
    progress_path = os.path.join(out_dir, 'progress.json')
    files, fix = fineweb_files(dataset, progress_path, out_dir)
    settings = {'dataset': dataset, 'files': files, 'text_column': text_column, 'val_docs': val_docs}
    if not os.path.exists(progress_path) and already_prepared(out_dir, settings):
        return
    total = count_documents(files, fix)
    if val_docs >= total:
        sys.exit(f"error: val_docs={val_docs:,} but the files hold {total:,} documents: lower --val_docs to leave "
                 f"some for train")
    enc = gpt2_encoding_or_exit()
    if make_out_dir(out_dir, None if os.path.exists(progress_path) else settings):
        return
    progress = None if force else load_progress(progress_path, settings, paths)  # read under the hold
    if progress is None and os.path.exists(progress_path) and not force:
        # starting over, as from no record, must not replace a finished prep of other settings: looked for as then
        if already_prepared(out_dir, settings):
            return
        print(f"{progress_path} does not match the partial files beside it: starting over")
    done = progress['docs'] if progress else 0
    if progress:
        print(f"resuming: {done:,} documents already done")
    outputs = {}

    def abandon(message):  # the input is bad, so what was made of it is dropped
        for out in outputs.values():
            out.discard()
        if os.path.exists(progress_path):
            os.remove(progress_path)
        sys.exit(message)

    try:
        for split, path in paths.items():
            outputs[split] = Output(path, progress['bytes'][split] if progress else 0)
        tokens = sum(out.n for out in outputs.values())
        with tqdm(initial=tokens, total=round(tokens / done * total) if done else None, unit='tok', unit_scale=True,
                  desc=f'tokenizing {dataset}') as bar:
            for path, row, texts in text_chunks(files, done):
                if texts.null_count:
                    first = row + texts.is_null().to_pylist().index(True)
                    abandon(f"error: {path}: row {first} has a null '{text_column}': give each document a string, "
                            f"or remove it")
                try:
                    texts.validate(full=True)
                except Exception as e:
                    abandon(f"error: {path}: rows {row} to {row + len(texts) - 1} hold a '{text_column}' that is not "
                            f"UTF-8 text ({str(e)[:100]}): convert the files to UTF-8")
                ids = enc.encode_ordinary_batch(texts.to_pylist(), num_threads=num_proc)  # Rust threads, GIL released
                n_val = min(max(val_docs - done, 0), len(ids))
                for split, docs in (('val', ids[:n_val]), ('train', ids[n_val:])):
                    flat = []
                    for doc in docs:
                        flat += doc
                        flat.append(EOT)
                    outputs[split].write(flat)
                    outputs[split].sync()
                done += len(ids)
                write_json(progress_path, {'settings': settings, 'docs': done,
                                           'bytes': {split: out.n * 2 for split, out in outputs.items()}})
                tokens = sum(out.n for out in outputs.values())
                bar.total = round(tokens / done * total)  # estimated from the documents so far, for the ETA
                bar.set_postfix_str(f'{done:,}/{total:,} documents', refresh=False)
                bar.update(tokens - bar.n)
        for out in outputs.values():
            out.f.close()
        # progress.json goes inside commit's window: once it is gone, a kill leaves a prep that starts over (its
        # record incomplete), never one taken as done
        commit(out_dir, settings, paths.values(), drop=[progress_path])
    except OSError as e:
        write_failed(out_dir, e)
    finally:
        for out in outputs.values():
            out.shut()
    print(f"{out_dir}: {outputs['train'].n:,} train and {outputs['val'].n:,} val tokens (val: the first "
          f"{val_docs:,} of {total:,} documents)")


def matching_files(given):
    """--data_files's files, each glob pattern in it (shards/*.jsonl) replaced by the files it matches, sorted: a few
    thousand paths overrun one argument's 128 KB. A pattern that matches none is a one-line error."""
    files = []
    for f in given.split(','):
        if glob.has_magic(f):
            found = sorted(glob.glob(os.path.expanduser(f)))
            if not found:
                sys.exit(f"error: --data_files={f} matches no file: check the pattern")
            files += found
        else:
            files.append(f)
    return files


def prepare_here(script):
    """What data/<name>/prepare.py runs, as nanoGPT lays data out: <name> prepared into the script's own folder,
    whatever the working folder, with this script's flags after it."""
    folder = os.path.dirname(os.path.abspath(script))
    rel = os.path.relpath(folder)  # data/<name> from the repo root; the whole path from elsewhere, to be clear
    shown = folder if rel.startswith(os.pardir) or rel == os.curdir else rel
    main([os.path.basename(folder), f'--out_dir={shown}', *sys.argv[1:]])


def main(argv=None):
    global data_files  # its patterns expanded
    quiet_interrupt()  # Ctrl-C: one line, no traceback
    argv = sys.argv[1:] if argv is None else argv
    argv = seeds.prepare_args(argv) or argv  # DLRover's --src_data_path FILE, as ours
    if argv[:1] in (['-h'], ['--help']):
        configure(globals(), argv[:1])  # this docstring and the keys with their defaults, as every script's -h
    if not argv or argv[0] not in DATASETS:
        given = argv[0] if argv else 'nothing'
        sys.exit(f"error: unknown dataset {given!r}: use one of {', '.join(DATASETS)} (or DLRover's "
                 f"--src_data_path=FILE)")
    dataset = argv[0]
    _, set_keys = configure(globals(), argv[1:])
    if tokenizer not in ('char', 'gpt2'):
        sys.exit(f"error: tokenizer={tokenizer!r}: use char or gpt2")
    if dataset == 'text' and not input:
        sys.exit("error: text needs --input=FILE, the text file to prepare")
    if input and not os.path.isfile(input):
        sys.exit(f"error: --input={input} is not a file")
    if data_files and dataset not in HUB and dataset not in FINEWEB:
        sys.exit(f"error: --data_files is for openwebtext*, fineweb and fineweb-edu; use --input=FILE for {dataset}")
    data_files = ','.join(matching_files(data_files)) if data_files else ''
    if dataset in FINEWEB and 'val_fraction' in set_keys:
        sys.exit(f"error: {dataset}'s val is its first --val_docs documents, a fixed split: set val_docs, not "
                 f"val_fraction")
    misplaced = sorted(set_keys & {'val_docs', 'chunk_docs'})
    if dataset not in FINEWEB and misplaced:
        sys.exit(f"error: {', '.join(misplaced)} is for fineweb and fineweb-edu only: leave it out for {dataset}")
    for key in ('num_proc', 'chunk_chars', 'val_docs', 'chunk_docs'):
        if globals()[key] < 1:
            sys.exit(f"error: {key}={globals()[key]} must be 1 or more")
    if val_fraction != -1 and not 0 < val_fraction < 1:
        sys.exit(f"error: val_fraction={val_fraction} must be above 0 and below 1 (e.g. 0.1), or -1 for the default: "
                 f"train and val both need tokens")
    if name and (os.path.basename(name) != name or name in ('.', '..')):
        sys.exit(f"error: name={name!r} must be a folder name, not a path: set --out_root for where it goes")
    if out_dir and ({'out_root', 'name'} & set_keys):
        sys.exit("error: out_dir names the folder itself: leave out out_root and name, or out_dir")
    folder = name or (os.path.splitext(os.path.basename(input))[0] if dataset == 'text' else dataset)
    out = out_dir or os.path.join(out_root, folder)
    above = out  # the folder is made only once the inputs pass, but one that cannot be fails before the loading
    while above and not os.path.exists(above):
        above = os.path.dirname(above)
    above = above or '.'
    if not os.path.isdir(above):
        sys.exit(f"error: cannot write in {out}: {above} is a file: choose another --out_dir, --out_root or --name")
    if not os.access(above, os.W_OK | os.X_OK):
        sys.exit(f"error: cannot write in {out}: {above} is not writable: choose another --out_root")
    try:
        prepare(dataset, out)
    except BaseException:
        let_go(out)
        for d in created:  # a folder that now holds something (a downloaded input.txt) stays
            try:
                os.rmdir(d)
            except OSError:
                pass
        raise


def prepare(dataset, out_dir):
    if dataset in FINEWEB:
        prepare_fineweb(dataset, out_dir)
        return
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
            interrupted_prep(out_dir)  # before input.txt is written beside its files
            make_out_dir(out_dir)
            download(SHAKESPEARE_URL, src)
    kind = 'char' if dataset == 'shakespeare_char' else 'gpt2' if dataset == 'shakespeare' else tokenizer
    prepare_text(src, out_dir, kind)


if __name__ == '__main__':
    main()
