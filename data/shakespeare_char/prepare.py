"""
shakespeare_char: tiny Shakespeare as characters (train.bin, val.bin, meta.pkl).
Written into this folder, as nanoGPT lays data out: `python data/shakespeare_char/prepare.py` from the repo root, or
`python prepare.py` here. The repo's prepare.py does the work and takes the same flags.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..'))  # the repo's prepare.py
from prepare import prepare_here  # noqa: E402

prepare_here(__file__)
