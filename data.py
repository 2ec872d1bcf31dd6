"""
The token data every entrypoint reads, as prepare.py (and nanoGPT) write it: data/<dataset>/train.bin and val.bin
(uint16 token ids) and, for a char-level vocabulary, meta.pkl (vocab_size, itos, stoi). Every file is read as data:
meta.pkl through an unpickler that admits no class, so a planted one runs no code.
"""

import pickle
import sys


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
        sys.exit(f"error: {path} is not a vocabulary ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                 f"): prepare the dataset again with prepare.py, or remove it for GPT-2's BPE")
    return meta
