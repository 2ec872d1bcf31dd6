"""
Exports any checkpoint of this repo to a Hugging Face folder: config.json and model.safetensors that
transformers.GPT2LMHeadModel loads, plus GPT-2's tokenizer files where the model uses GPT-2's BPE, so that a
text-generation pipeline runs from the folder as it is.

python export_hf.py --ckpt=out --out=hf-model       # a run folder, a ckpt.pt or a sharded checkpoint folder
python export_hf.py --ckpt=out/best --out=hf-best   # the run's best by val loss
python -c "from transformers import pipeline; print(pipeline('text-generation', model='hf-model')('Hello')[0])"
"""

import json
import os
import re
import shutil
import sys
import tempfile

import torch

from checkpoint import RUN_NAMES, checkpoint_or_exit, hf_folder, reason
from configurator import configure, outside_runs_or_exit, quiet_interrupt
from runlock import abandoned, let_go, try_hold

quiet_interrupt()  # Ctrl-C: one line, no traceback

# -----------------------------------------------------------------------------
ckpt = 'out'  # a run's out_dir (its newest checkpoint), out_dir/best, a ckpt.pt, or a sharded checkpoint folder
out = 'hf-model'  # the folder to write; it must not exist yet
crop_vocab = True  # drop the padding rows a GPT-2 BPE model trained here carries (50304 -> 50257 tokens)
# -----------------------------------------------------------------------------
configure(globals())

GPT2_VOCAB = 50257
BPE_FILES = {  # tiktoken's sources of GPT-2's BPE, which Hugging Face's tokenizer reads under other names
    'vocab.json': 'https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json',
    'merges.txt': 'https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe',
}


def hf_state_dict(model):
    """This repo's GPT as Hugging Face's GPT2LMHeadModel lays it out: q, k, v fused into c_attn, and the
    Linear weights transposed, since Hugging Face keeps them as Conv1D. A model without biases (bias=False) gets
    zero ones, which GPT2LMHeadModel always has: a missing bias adds nothing, as a zero one does."""
    sd = dict(model.state_dict())
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.LayerNorm)) and module.bias is None and name != 'lm_head':
            sd[name + '.bias'] = torch.zeros(module.weight.shape[0], dtype=module.weight.dtype)
    out = {}
    for k, v in sd.items():
        if '.attn.c_k.' in k or '.attn.c_v.' in k or k == 'lm_head.weight':
            continue  # folded into c_attn below; lm_head is tied to wte, and Hugging Face ties it back
        if '.attn.c_q.' in k:
            k = k.replace('c_q', 'c_attn')
            v = torch.cat([v, sd[k.replace('c_attn', 'c_k')], sd[k.replace('c_attn', 'c_v')]])
        if k.endswith(('attn.c_attn.weight', 'attn.c_proj.weight', 'mlp.c_fc.weight', 'mlp.c_proj.weight')):
            v = v.t()
        out[k] = v.contiguous().clone()
    return out


def remove_dead_exports(parent, name):
    """Removes the folders in parent that an export to name was writing when it was killed: only those named as
    mkdtemp names ours, and held by an export that is gone (runlock). Those that nobody holds are named in a note."""
    for leftover in sorted(os.listdir(parent)):
        path = os.path.join(parent, leftover)
        if not re.fullmatch(rf'\.{re.escape(name)}\.[a-z0-9_]{{8}}\.tmp', leftover) or os.path.islink(path) \
                or not os.path.isdir(path):
            continue
        if abandoned(path):
            shutil.rmtree(path, ignore_errors=True)
            print(f"removed {path}, what an export to {name} wrote before it was killed")
        else:
            print(f"note: {path} is another export's to {name}, running or killed: remove it once none runs",
                  file=sys.stderr)


def main():
    if os.path.lexists(out):  # a link too, to a folder not made yet: the name is taken
        sys.exit(f"error: {out} exists: give a new folder with --out=PATH")
    outside_runs_or_exit(out, '--out')  # (beside its checkpoint in RUN/dcp/step-N, it was pruned with it)
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        sys.exit(f"error: cannot write {out}: {parent} is not a writable folder; give --out=PATH in one")
    # in a run's folder, a name that the run or the tools read: RUN/best would hide the run's best from
    # --init_from=best and --ckpt=RUN/best, RUN/dcp would be taken for a run's step folders
    name = os.path.basename(os.path.abspath(out))
    if (name == 'best' or RUN_NAMES.fullmatch(name)) and any(os.path.isfile(os.path.join(parent, f))
                                                             for f in ('run_id', 'ckpt.pt')):
        sys.exit(f"error: {out} is a name that the run in {parent} uses for its own state: give --out another "
                 f"name, e.g. --out={os.path.join(os.path.dirname(out), 'hf-' + name)}")
    if hf_folder(ckpt):  # it said "no checkpoint at FOLDER/ckpt.pt"
        sys.exit(f"error: {ckpt} is a Hugging Face folder already: transformers reads it as it is, and so do sample.py "
                 f"and every entrypoint with --init_from={ckpt}")
    model, checkpoint, read = checkpoint_or_exit(ckpt,
                                                 "give --ckpt=a run folder, a ckpt.pt or a sharded checkpoint folder")
    try:
        from transformers import GPT2Config, GPT2LMHeadModel  # after the checks: it takes seconds to import
        from transformers.utils.logging import disable_progress_bar
        disable_progress_bar()  # its "Writing model shards" bar on stderr: the line below says what was written
    except ImportError:
        sys.exit("error: export_hf.py needs Hugging Face transformers: pip install transformers")
    cfg = model.config
    bpe = cfg.vocab_size >= GPT2_VOCAB  # a char-level model has a vocabulary of its own, with no tokenizer here
    vocab_size = GPT2_VOCAB if bpe and crop_vocab else cfg.vocab_size
    eot = GPT2_VOCAB - 1 if bpe else None  # GPT-2's <|endoftext|>; a char-level vocabulary has no such token
    hf_config = GPT2Config(vocab_size=vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd, n_layer=cfg.n_layer,
                           n_head=cfg.n_head, activation_function='gelu_new', resid_pdrop=0.0, embd_pdrop=0.0,
                           attn_pdrop=0.0, layer_norm_epsilon=1e-5, tie_word_embeddings=True,
                           bos_token_id=eot, eos_token_id=eot)
    hf_model = GPT2LMHeadModel(hf_config)
    model.crop_vocab_size(vocab_size)
    missing, unexpected = hf_model.load_state_dict(hf_state_dict(model), strict=False)
    # only the causal-mask buffers (and the tied lm_head) may be missing
    missing = [k for k in missing if not k.endswith(('.attn.bias', '.attn.masked_bias')) and k != 'lm_head.weight']
    if missing or unexpected:
        sys.exit(f"error: the exported weights do not fit GPT2LMHeadModel (missing {missing}, unexpected {unexpected})")
    hf_model.tie_weights()
    # the text-generation pipeline's default, 256 new tokens, runs past a shorter window (an IndexError in the
    # position embeddings): at most half the window, the rest left to the prompt (GPT-2's 1024: the same 256)
    hf_model.generation_config.max_new_tokens = min(256, cfg.block_size // 2)
    files = {}  # GPT-2's tokenizer, as Hugging Face names its files
    if bpe:
        import tiktoken.load
        try:
            for name, url in BPE_FILES.items():
                files[name] = tiktoken.load.read_file_cached(url)  # from tiktoken's cache, else downloaded once
        except Exception as e:
            sys.exit(f"error: could not get GPT-2's tokenizer files ({type(e).__name__}): connect to the internet "
                     f"once, or point TIKTOKEN_CACHE_DIR at a folder that holds tiktoken's gpt2 files")
        files['tokenizer_config.json'] = json.dumps({
            'tokenizer_class': 'GPT2Tokenizer', 'model_max_length': cfg.block_size, 'bos_token': '<|endoftext|>',
            'eos_token': '<|endoftext|>', 'unk_token': '<|endoftext|>'}).encode()
    # a folder of our own beside out, never one whose name a user may have taken (out.tmp): only it is removed
    remove_dead_exports(parent, name)
    tmp = tempfile.mkdtemp(prefix=f'.{name}.', suffix='.tmp', dir=parent)
    try_hold(tmp, 'export_hf.py')  # until it is complete: a later export removes it where this one is killed
    umask = os.umask(0o22)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would otherwise become out's
    try:
        hf_model.save_pretrained(tmp, safe_serialization=True)
        for name, data in files.items():
            with open(os.path.join(tmp, name), 'wb') as f:
                f.write(data)
        let_go(tmp)  # the hold is no part of the export (unheld, a later export leaves it be)
        if os.path.lexists(out):  # made while we wrote: never replaced
            raise FileExistsError(f"{out} appeared meanwhile")
        os.replace(tmp, out)  # the folder appears only when complete
    except (Exception, KeyboardInterrupt) as e:  # a full disk raises safetensors' own error, not an OSError
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, KeyboardInterrupt):
            sys.exit(f"error: interrupted; {out} not written")
        sys.exit(f"error: cannot write {out} ({reason(e)}): give --out=PATH in a writable folder with room")
    what = 'with GPT-2 tokenizer files' if bpe else "no tokenizer written (the vocabulary is the dataset's own)"
    # which of the run's states it is (a run folder's newest, RUN/best's best), as the path and step that name it
    it = checkpoint.get('iter_num')
    source = f"{read} (iter {it})" if isinstance(it, int) else read
    print(f"wrote {out} from {source}: {model.get_num_params() / 1e6:.2f}M parameters, {vocab_size} tokens, {what}")


if __name__ == '__main__':
    main()
