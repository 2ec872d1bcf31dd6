"""The commands of the projects this one grew from (docs/coming-from.md), at tiny sizes: each runs as written or
ends in one line naming our command, so the page cannot go stale."""

import ast
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from configurator import configure
from conftest import REPO, TINY, env, one_line_error, run

DOC = REPO / 'docs' / 'coming-from.md'

SEED_DECENT_TOML = """log_dir = "./log"
dataset = "openwebtext"
data_dir = "./data/openwebtext"
in_memory = true
[log]
wandb_log = true
wandb_project = "gpt2-owt"
eval_interval = 1000
eval_steps = 200
[train]
backend = 'decentdp'
topology = 'alternating-exp-ring'
seed = 42
global_batch_size = 480
context_length = 1024
n_steps = 600000
grad_norm_clip = 1.0
compile = true
amp = true
[train.optim]
name = "AccumAdamW"
betas = [0.9, 0.98]
eps = 1e-08
weight_decay = 0.1
accum_steps = 8
[train.lr_schedule]
name = "cosine"
lr = 6e-04
warmup_steps = 2000
eta_min = 6e-05
[model]
n_layers = 12
n_heads = 12
n_embd = 768
dropout = 0.0
vocab_size = 50304
bias = false
"""


def script_defaults(script):
    """An entrypoint's config globals, read from its source without running it."""
    ns = {'__file__': script}
    for node in ast.parse((REPO / script).read_text()).body:
        if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
            try:
                ns[node.targets[0].id] = eval(compile(ast.Expression(node.value), script, 'eval'), {})
            except Exception:
                pass
    return ns


def config_of(script, argv):
    return configure(script_defaults(script), argv)[0]


def error_of(script, argv):
    with pytest.raises(SystemExit) as e:
        configure(script_defaults(script), argv)
    assert e.value.code not in (0, None) and '\n' not in str(e.value.code)
    return str(e.value.code)


def test_space_separated_values_and_bare_booleans():
    c = config_of('train.py', ['--n_layer', '48', '--n_head', '16', '--eval_only', '--bias', '--decay_lr',
                               '--compile', 'False', '--save_memory_interval', '50'])
    assert (c['n_layer'], c['n_head'], c['eval_only'], c['bias'], c['decay_lr'], c['compile']) == \
        (48, 16, True, True, True, False)
    assert 'needs a value' in error_of('train.py', ['--n_layer'])
    # DLRover's --compile is argparse's str: a bool's value in another spelling is named, not taken for a file
    msg = error_of('train.py', ['--compile', 'FALSE'])
    assert msg.startswith('error: --compile FALSE: compile takes True or False')
    assert 'needs a value' in error_of('train.py', ['--lr'])  # Decent-DP's name for learning_rate: it takes one
    assert "flag '--betas' needs a value" in error_of('train.py', ['--betas'])  # translated with checks of its own
    assert "flag '--global_batch_size' needs a value" in error_of('train.py', ['--global_batch_size'])
    assert config_of('train.py', ['--dtype=float32', '--amp'])['dtype'] == 'auto'  # and its bool, alone
    assert "unknown config key 'eval-only'; did you mean eval_only?" in error_of('train.py', ['--eval-only'])
    # a typo of a seed's flag: its name, not every key of ours
    assert "unknown config key 'epoch'; did you mean epochs?" in error_of('train.py', ['--epoch', '2'])
    assert "did you mean global_batch_size?" in error_of('train.py', ['--global_batch', '8'])  # Decent-DP's
    assert "unknown config key 'data-dir'; did you mean data_dir?" in error_of('fsdp_train.py', ['--data-dir', './'])
    # DLRover's launcher options after the script, where its command has them before it
    assert error_of('train.py', ['--data_dir', './', '--nproc_per_node=2']) == "error: --nproc_per_node=2: a " \
        "launcher's option (torchrun's, dlrover-run's, deepspeed's), not train.py's: give it before the script, as " \
        "in `torchrun --nproc_per_node=N train.py ...`"
    assert 'DEFAULT_PATH' not in error_of('train.py', ['--xyzzy=1'])
    # torch.distributed.launch's --local-rank=K is taken where LOCAL_RANK says the same (test_train.py), else named
    assert "the rank that torch.distributed.launch and the deepspeed launcher add" in \
        error_of('train.py', ['--local_rank=1'])


def test_two_names_of_one_key_on_the_command_line_say_which_one_the_run_takes(capsys):
    # a seed's name and ours for one key: the later wins, as argparse's would, and a line says so, since the seed's
    # line names the value of the first
    c = config_of('train.py', ['--lr', '1e-3', '--learning_rate', '1e-4', '--n_steps', '100', '--max_iters', '50'])
    assert (c['learning_rate'], c['max_iters'], c['lr_decay_iters']) == (1e-4, 50, 100)
    out = capsys.readouterr().out
    assert "note: --learning_rate 1e-4 sets learning_rate=0.0001 over --lr 1e-3 before it on the command line: the " \
        "later one wins" in out
    assert "note: --max_iters 50 sets max_iters=50 over --n_steps 100 before it" in out
    config_of('train.py', ['--learning_rate=1e-4', '--lr=1e-4', '--lr=1e-3', '--lr=2e-3'])  # the same value or name
    assert 'note:' not in capsys.readouterr().out


def test_a_flag_or_file_after_a_config_file_takes_what_it_replaces_out_of_the_files_line(capsys, tmp_path):
    # the file's line said the file's values of keys that flags after it replaced: n_steps is --max_iters=600000
    # beside --n_steps=6's own line (max_iters=6)
    toml = str(REPO / 'config' / 'decent-gpt2-small.toml')

    def file_line(argv):
        c = config_of('decent_train.py', argv)
        lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(toml)]
        assert len(lines) == 1, lines
        return c, lines[0]
    c, line = file_line([toml, '--n_steps=6', '--lr', '1e-3', '--out_dir=mine', '--beta2=0.95'])
    assert (c['max_iters'], c['lr_decay_iters'], c['learning_rate'], c['out_dir'], c['beta2']) == \
        (6, 6, 1e-3, 'mine', 0.95)
    assert 'n_steps is' not in line and 'lr is' not in line and 'log_dir' not in line, line
    # a key that sets two: the one a flag replaced is named so
    assert '; betas is --beta1=0.9 --beta2=0.98, its beta2 replaced by --beta2=0.95 after it;' in line, line
    assert '; eta_min is --min_lr=6e-05;' in line and '; warmup_steps is --warmup_iters=2000;' in line  # the rest
    # a flag before the file (the file wins), or after it with the file's own value: the line holds
    c, line = file_line(['--n_steps=6', toml, '--learning_rate=6e-4'])
    assert (c['max_iters'], c['learning_rate']) == (600000, 6e-4)
    assert '; n_steps is --max_iters=600000 --lr_decay_iters=600000;' in line and '; lr is --learning_rate=0.0006;' \
        in line, line
    # a file whose every seed's key a flag replaces has no line; a later file replaces as a flag does
    (tmp_path / 'steps.toml').write_text('n_steps = 100\n')
    config_of('train.py', [str(tmp_path / 'steps.toml'), '--max_iters=5', '--lr_decay_iters=5'])
    assert 'steps.toml' not in capsys.readouterr().out
    (tmp_path / 'ours.toml').write_text('max_iters = 5\n')
    config_of('train.py', [str(tmp_path / 'steps.toml'), str(tmp_path / 'ours.toml')])
    assert f"n_steps is --max_iters=100 --lr_decay_iters=100, its max_iters replaced by {tmp_path / 'ours.toml'}:1 " \
        f"after it" in capsys.readouterr().out


def test_another_entrypoints_key_names_that_entrypoint(tmp_path):
    # a mode's key given to another entrypoint: the user meant that mode, which the error names
    for script, argv, owner in (('train.py', ['--tp_size=2'], 'fsdp_train.py and pp_train.py'),
                                ('train.py', ['--zero_stage', '2'], 'ds_train.py'),
                                ('fsdp_train.py', ['--diloco_steps=4'], 'decent_train.py'),
                                ('ds_train.py', ['--pp_size=2'], 'pp_train.py'),
                                ('pp_train.py', ['--offload_optimizer=cpu'], 'ds_train.py')):
        key = argv[0][2:].split('=')[0]
        run = owner.split()[0]  # the first of the entrypoints that have the key
        assert f"{key} is a key of {owner}, not of {script}: run {run} in its place" in error_of(script, argv)
    (tmp_path / 'tp.py').write_text('n_layer = 2\ntp_size = 2\n')  # in a config file too, with its line
    tp = str(tmp_path / 'tp.py')
    assert f"{tp}:2: tp_size is a key of fsdp_train.py" in error_of('train.py', [tp])
    # a name the other scripts assign after their config is no key of theirs; a tool gets no entrypoint's advice
    assert "unknown config key 'iter_num'" in error_of('train.py', ['--iter_num=3'])
    assert "unknown config key 'zero_stage'" in error_of('sample.py', ['--zero_stage=2'])


def test_decent_dp_toml_as_published_takes_its_hyperparameters(tmp_path, monkeypatch):
    (tmp_path / 'decent.toml').write_text(SEED_DECENT_TOML)
    c = config_of('decent_train.py', [str(tmp_path / 'decent.toml')])
    assert c['gradient_accumulation_steps'] * c['batch_size'] == 480 and c['gradient_accumulation_steps'] == 16
    assert (c['max_iters'], c['lr_decay_iters'], c['beta1'], c['beta2'], c['replica_optimizer'],
            c['moment_accum_steps'], c['topology'], c['block_size'], c['learning_rate'], c['min_lr'],
            c['warmup_iters'], c['eval_iters'], c['n_layer'], c['seed']) == \
        (600000, 600000, 0.9, 0.98, 'accumadamw', 8, 'alternating-exp-ring', 1024, 6e-4, 6e-5, 2000, 200, 12, 42)
    for script in ('train.py', 'fsdp_train.py', 'ds_train.py', 'pp_train.py'):  # its AllReduce file, in every one
        c = config_of(script, [str(REPO / 'config' / 'gpt2-small.toml')])
        assert (c['beta2'], c['gradient_accumulation_steps'] * c['batch_size'], c['max_iters']) == (0.95, 480, 600000)
    # its 480 on 32 workers is 15 each: 16 micro-steps cannot split over 32 ranks, 32 of 15 sequences can
    monkeypatch.setenv('WORLD_SIZE', '32')
    c = config_of('train.py', [str(REPO / 'config' / 'gpt2-small.toml')])
    assert (c['gradient_accumulation_steps'], c['batch_size']) == (32, 15)
    monkeypatch.delenv('WORLD_SIZE')
    msg = error_of('train.py', [str(REPO / 'config' / 'decent-gpt2-small.toml')])
    assert "backend='decentdp'" in msg and 'decent_train.py /' in msg and msg.endswith('not train.py')


def test_decent_dp_global_batch_stays_the_sequences_a_step_beside_our_batch_size_or_accumulation(monkeypatch):
    # its global_batch_size is the step's sequences over all workers: a --batch_size (to fit a GPU's memory) or a
    # --gradient_accumulation_steps beside it splits those, in either order, as Megatron-LM's --global-batch-size does
    monkeypatch.setenv('WORLD_SIZE', '16')
    toml = str(REPO / 'config' / 'decent-gpt2-small.toml')
    for argv in ([toml, '--batch_size=10'], ['--batch_size=10', toml], ['--global_batch_size', '480',
                 '--batch_size=10'], ['--batch_size=10', '--global_batch_size', '480']):
        c = config_of('decent_train.py', argv)
        assert (c['gradient_accumulation_steps'], c['batch_size']) == (48, 10), argv
    c = config_of('decent_train.py', [toml, '--gradient_accumulation_steps=32'])
    assert (c['gradient_accumulation_steps'], c['batch_size']) == (32, 15)
    c = config_of('train.py', [str(REPO / 'config' / 'gpt2-small.toml'), '--batch_size=15',
                               '--gradient_accumulation_steps=32'])
    assert (c['gradient_accumulation_steps'], c['batch_size']) == (32, 15)  # both, and they agree
    # both of ours on the command line make the step (a file's global batch shrunk to try it), two flags disagree
    c = config_of('decent_train.py', [toml, '--batch_size=10', '--gradient_accumulation_steps=16'])
    assert (c['gradient_accumulation_steps'], c['batch_size']) == (16, 10)
    msg = error_of('decent_train.py', ['--global_batch_size=480', '--batch_size=10',
                                        '--gradient_accumulation_steps=16'])
    assert "global_batch_size=480 (sequences a step) is not --batch_size=10 x --gradient_accumulation_steps=16 = 160" \
        in msg and 'drop one of the two' in msg
    assert 'no whole number of micro-batches of batch_size=7' in error_of('decent_train.py', [toml, '--batch_size=7'])
    # Megatron-LM's --global-batch-size keeps a --gradient_accumulation_steps beside it too, by the micro-batch's size
    c = config_of('train.py', ['--global-batch-size', '64', '--gradient_accumulation_steps=16'])
    assert (c['gradient_accumulation_steps'], c['batch_size']) == (16, 4)
    # and a config file's batch is the one split where the command gives neither (config/train_gpt2.py's 12)
    c = config_of('train.py', [str(REPO / 'config' / 'train_gpt2.py'), '--global-batch-size', '960'])
    assert (c['gradient_accumulation_steps'], c['batch_size']) == (80, 12)


def test_decent_dp_log_dir_is_a_folder_per_job_and_config_that_its_restarts_share(monkeypatch, capsys, tmp_path):
    # Decent-DP starts each job afresh in log_dir/<slurm job id>/, and a run here resumes what its out_dir holds: the
    # two shipped configs (both log_dir = "./log") must not continue each other's model, in one job or in two
    monkeypatch.chdir(REPO)
    configs = [('train.py', 'config/gpt2-small.toml'), ('decent_train.py', 'config/decent-gpt2-small.toml')]

    def out_dirs(*argv, **environ):
        for key in ('SLURM_JOB_ID', 'TORCHELASTIC_RUN_ID'):
            monkeypatch.delenv(key, raising=False)
        for key, value in environ.items():
            monkeypatch.setenv(key, value)
        return [config_of(script, [config, *argv])['out_dir'] for script, config in configs]

    # every rank and every restart of a job sees its ids alike: a requeued SLURM job keeps its id, so resumes
    assert out_dirs(SLURM_JOB_ID='4242', TORCHELASTIC_RUN_ID='4242') == \
        ['./log/4242/config/gpt2-small', './log/4242/config/decent-gpt2-small']
    assert "log_dir is --out_dir=./log/4242/config/gpt2-small (SLURM job 4242's folder for this config file: a " \
        "requeued job resumes in it, another job or config starts afresh)" in capsys.readouterr().out
    # torchrun's, kept over its restarts; a launch under another id starts afresh, and the line says how to continue
    assert out_dirs(TORCHELASTIC_RUN_ID='a1-b2') == \
        ['./log/a1-b2/config/gpt2-small', './log/a1-b2/config/decent-gpt2-small']
    assert "starts afresh in another (--out_dir=./log/a1-b2/config/gpt2-small continues this one)" in \
        capsys.readouterr().out
    for environ in ({'TORCHELASTIC_RUN_ID': 'none'}, {}):  # a static rendezvous, or no launcher: the file names it
        assert out_dirs(**environ) == ['./log/config/gpt2-small', './log/config/decent-gpt2-small']
    assert out_dirs('--out_dir=mine') == ['mine'] * 2
    # a folder with a space: the lines' --out_dir are commands to copy
    (tmp_path / 'my log.toml').write_text('log_dir = "./my log"\n')
    config_of('train.py', [str(tmp_path / 'my log.toml')])
    assert "log_dir is --out_dir='./my log" in capsys.readouterr().out
    monkeypatch.setenv('TORCHELASTIC_RUN_ID', 'a1')
    config_of('train.py', ['--log_dir=./my log'])
    assert "starts afresh in another (--out_dir='./my log/a1' continues this one)" in capsys.readouterr().out
    monkeypatch.delenv('TORCHELASTIC_RUN_ID')
    # a sweep's files of one name in two folders, in one job: two runs, not one continuing the other
    monkeypatch.chdir(tmp_path)
    for lr in ('6e-4', '1e-3'):
        (tmp_path / 'sweep' / lr).mkdir(parents=True)
        (tmp_path / 'sweep' / lr / 'gpt2-small.toml').write_text(f'log_dir = "./log"\nlearning_rate = {lr}\n')
    assert [config_of('train.py', [f'sweep/{lr}/gpt2-small.toml'])['out_dir'] for lr in ('6e-4', '1e-3')] == \
        ['./log/sweep/6e-4/gpt2-small', './log/sweep/1e-3/gpt2-small']
    # a file outside the working folder: its whole path names the folder
    outside = tmp_path / 'sweep' / '6e-4' / 'gpt2-small.toml'
    monkeypatch.chdir(tmp_path / 'sweep' / '1e-3')
    assert config_of('train.py', [str(outside)])['out_dir'] == './log/' + str(outside.with_suffix('')).lstrip('/')
    monkeypatch.chdir(tmp_path)
    # a --log_dir flag: the command line's config file names the folder in the job's, as a file's log_dir does
    (tmp_path / 'mine.py').write_text('n_layer = 2\n')
    monkeypatch.setenv('SLURM_JOB_ID', '7')
    assert config_of('train.py', ['--log_dir', './log'])['out_dir'] == './log/7'
    assert config_of('train.py', ['mine.py', '--log_dir', './log'])['out_dir'] == './log/7/mine'
    monkeypatch.setenv('TORCHELASTIC_RUN_ID', 'x')
    monkeypatch.delenv('SLURM_JOB_ID')
    assert config_of('train.py', ['--log_dir', './log', 'mine.py'])['out_dir'] == './log/x/mine'
    for text in ('out_dir = "mine"\nlog_dir = "./log"\n', 'log_dir = "./log"\nout_dir = "mine"\n'):  # no order
        (tmp_path / 'both.toml').write_text(text)
        assert config_of('train.py', [str(tmp_path / 'both.toml')])['out_dir'] == 'mine'


def test_data_dir_is_a_path_that_decent_dps_dataset_label_does_not_replace(tmp_path, capsys):
    keys = ['dataset = "openwebtext"\n', 'data_dir = "./data/owt"\n']
    for text in (''.join(keys), ''.join(reversed(keys))):  # TOML keys have no order
        (tmp_path / 'data.toml').write_text(text)
        assert config_of('train.py', [str(tmp_path / 'data.toml')])['dataset'] == './data/owt'
        assert "dataset='openwebtext': a label there, unused (data_dir is the folder)" in capsys.readouterr().out
    # DLRover's --data_dir is always a folder's path (its prep's --output_dir mydata), never a name under data/
    assert config_of('train.py', ['--data_dir', 'mydata'])['dataset'] == './mydata'
    assert config_of('train.py', ['--dataset', 'mydata'])['dataset'] == 'mydata'


@pytest.mark.parametrize('script, argv, says', [
    ('train.py', ['--plan_ngpus=2', '--runtime_ngpus=4'],
     'torchrun --nproc_per_node=4 fsdp_train.py --tp_size=2 ... (each model split over 2 GPUs by tensor parallelism, '
     'the 2 groups data parallel'),
    ('fsdp_train.py', ['--plan_ngpus=4', '--runtime_ngpus=4'],
     '`torchrun --nproc_per_node=4 fsdp_train.py --tp_size=4 ... (one model split over 4 GPUs by tensor parallelism, '
     'no data parallel)` here'),
    ('train.py', ['--plan_ngpus', '1', '--runtime_ngpus', '4'], 'torchrun --nproc_per_node=4 train.py'),
    ('train.py', ['--use_nnscaler=True'], 'plain PyTorch'),
    ('train.py', ['--plan_ngpus=3', '--runtime_ngpus=4'], 'runtime_ngpus must be a multiple of plan_ngpus'),
    ('train.py', ['--plan_ngpus=0', '--runtime_ngpus=0'], 'a model is split over 1 GPU or more'),
    ('train.py', ['trainer_config.batch_size=128'], 'here --batch_size=128'),
    ('train.py', ['trainer_config.distributed_method=fsdp'], 'fsdp_train.py'),
    # it said 'here fsdp_train.py as the script torchrun runs' to a user running fsdp_train.py
    ('fsdp_train.py', ['trainer_config.distributed_method=fsdp'],
     'here nothing to set, fsdp_train.py is what it names: drop it'),
    ('fsdp_train.py', ['trainer_config.cpu_offload=True'], "(minGPT-DDP's): here --cpu_offload=True"),  # its fork's
    ('train.py', ['--topology=exp'], 'decent_train.py'),
    ('train.py', ['--lora_rank', '4'], 'no counterpart'),
    ('train.py', ['data_config.path=in.txt'], 'python prepare.py text --input=in.txt --tokenizer=char'),  # CharDataset
    # nnScaler's runtime_ngpus=-1 (its default) is torchrun's WORLD_SIZE: not a count of -1 GPUs
    ('train.py', ['--plan_ngpus', '2', '--runtime_ngpus', '-1'], '--runtime_ngpus=N is `torchrun --nproc_per_node=N '
     'fsdp_train.py --tp_size=2 ... (each model split over 2 GPUs'),
    ('fsdp_train.py', ['--plan_ngpus=1', '--runtime_ngpus=-1'], '`torchrun --nproc_per_node=N train.py'),
    ('train.py', ['--data_dir', './', '--use_fsdp'], "DLRover's --use_fsdp is fsdp_train.py here"),  # its README's
    # minGPT-DDP's Hydra keys written as flags without their section: ours, not 'did you mean max_iters?'
    ('train.py', ['--cpu_offload=True'], "cpu_offload is minGPT-DDP's trainer_config.cpu_offload: here fsdp_train.py "
     "--cpu_offload=True"),
    ('ds_train.py', ['--max_epochs', '2'], "max_epochs is minGPT-DDP's trainer_config.max_epochs: here --epochs=2"),
    ('train.py', ['--distributed_method', 'fsdp'], 'here fsdp_train.py as the script torchrun runs'),
])
def test_other_meanings_name_our_command(script, argv, says):
    assert says in error_of(script, argv)


# minGPT-DDP's gpt2_train_cfg.yaml, every key as its users override it (its FSDP fork's two keys besides)
MINGPT_YAML = ['data_config.path=input.txt', 'data_config.block_size=128', 'data_config.train_split=0.9',
               'data_config.truncate=0.05', 'gpt_config.n_layer=8', 'gpt_config.n_head=8', 'gpt_config.n_embd=512',
               'trainer_config.max_epochs=1', 'trainer_config.batch_size=64', 'trainer_config.data_loader_workers=4',
               'trainer_config.grad_norm_clip=1.0', 'trainer_config.snapshot_path=gpt_snapshot.pt',
               'trainer_config.save_every=4', 'optimizer_config.weight_decay=0.1',
               'optimizer_config.learning_rate=0.0003', 'hydra.run.dir=./', 'trainer_config.distributed_method=fsdp',
               'trainer_config.cpu_offload=True']


def test_every_key_of_mingpt_ddps_yaml_names_ours():
    for override in MINGPT_YAML:
        msg = error_of('train.py', [override])
        assert msg.startswith(f'error: {override} is a Hydra override') and 'keys are flags' not in msg, msg
    # with dashes, as our flags are written, and a typo of its key: its line, not an unknown key's
    assert error_of('train.py', ['--trainer_config.batch_size', '4']).endswith('Hydra override (minGPT-DDP\'s): here '
                                                                             '--batch_size=4')
    assert error_of('train.py', ['trainer_config.max_epoch=4']).endswith('did you mean trainer_config.max_epochs? '
                                                                        'here that is --epochs=4')
    assert config_of('train.py', ['--optim.name=adamw'])['n_layer'] == 12  # Decent-DP's table.key is no Hydra's
    # the file itself, given as a config: not read, and one line says how its keys are given
    assert error_of('train.py', ['gpt2_train_cfg.yaml']).startswith("error: gpt2_train_cfg.yaml is a YAML config "
                                                                    "(minGPT-DDP's Hydra file), which is not read here")
    assert error_of('train.py', ['data_config.train_split=0.9']).endswith('--tokenizer=char --val_fraction=0.1 (the '
                                                                         'share of the text for val.bin)')


def test_mingpt_ddps_main_py_and_launch_py_answer_with_our_command_which_trains(tmp_path, data_dir):
    # its two scripts, by their names, as its users type them: one line naming our command (they had none: python's
    # "can't open file"), its Hydra overrides our flags where they are flags, the rest said after it
    def line(script, *overrides):
        p = subprocess.run([sys.executable, REPO / script, *overrides], cwd=tmp_path, env=env(), capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 1 and p.stdout == '' and len(p.stderr.splitlines()) == 1, p.stderr
        return p.stderr.strip()
    msg = line('main.py', 'trainer_config.batch_size=4', 'trainer_config.distributed_method=fsdp',
               'gpt_config.n_layer=1', 'trainer_config.save_every=5')
    command = 'fsdp_train.py config/train_shakespeare_char.py --batch_size=4 --n_layer=1'
    assert msg == f"error: main.py is minGPT-DDP's entrypoint; here `torchrun --standalone --nproc_per_node=auto " \
        f"{command}` (a process per GPU, or `python {command}` for one); trainer_config.save_every=5: " \
        f"--save_storage_interval=STEPS (steps here, not epochs) (docs/coming-from.md)"
    assert line('launch.py').startswith("error: launch.py is minGPT-DDP's launcher; here `torchrun --standalone "
                                        "--nproc_per_node=auto train.py config/train_shakespeare_char.py`")
    assert 'runs as the script' not in line('main.py', 'trainer_config.distributed_method=deepspeed')  # said once
    assert line('main.py', 'trainer_config.batchsize=4').endswith('did you mean trainer_config.batch_size? here that '
                                                                  'is --batch_size=4')
    # its FSDP fork's README writes them as flags: the same answer
    assert line('main.py', '--trainer_config.distributed_method=fsdp', '--trainer_config.cpu_offload', 'True') == \
        line('main.py', 'trainer_config.distributed_method=fsdp', 'trainer_config.cpu_offload=True')
    assert line('launch.py', '--trainer_config.batch_size=4').startswith(
        "error: launch.py is minGPT-DDP's launcher; here `torchrun --standalone --nproc_per_node=auto train.py "
        "config/train_shakespeare_char.py --batch_size=4`")
    # the command it names trains (on the CPU, the recipe's model cut to the named layer and a few steps)
    p = run(*command.split(), f'--dataset={data_dir / "shakespeare_char"}', f'--out_dir={tmp_path / "o"}',
            '--max_iters=2', '--eval_iters=2', cwd=REPO)  # in the repo, where its users type it
    config = json.loads((tmp_path / 'o' / 'config.json').read_text())
    assert (config['batch_size'], config['n_layer']) == (4, 1) and 'iter 1:' in p.stdout


def test_nnscalers_train_nnscaler_py_runs_ours_with_its_flags(tmp_path, data_dir):
    # its script's name runs ours with the same arguments: fsdp_train.py where a model is split over plan_ngpus ranks
    args = [*TINY, f'--dataset={data_dir / "shakespeare_char"}', '--max_iters=2', '--eval_interval=2']
    p = run('train_nnscaler.py', *args, '--out_dir=tp', '--plan_ngpus', '2', '--runtime_ngpus=2', nproc=2,
            cwd=tmp_path)
    assert "nnScaler's --plan_ngpus=2 --runtime_ngpus=2 is --tp_size=2" in p.stdout, p.stdout
    config = json.loads((tmp_path / 'tp' / 'config.json').read_text())
    assert config['tp_size'] == 2 and 'iter 1:' in p.stdout
    # train.py for a whole model on each rank (its default plan_ngpus=1, or any without nnScaler: Lightning's DDP
    # there), the config path of its nanoGPT checkout answered as train.py answers it
    p = run('train_nnscaler.py', *args, '--out_dir=dp', '--plan_ngpus=2', '--use_nnscaler', 'False', nproc=2,
            cwd=tmp_path)
    assert "--plan_ngpus=2 is nnScaler's name: here unused with --use_nnscaler=False" in p.stdout
    assert json.loads((tmp_path / 'dp' / 'config.json').read_text())['world_size'] == 2 and 'tp_size' not in \
        json.loads((tmp_path / 'dp' / 'config.json').read_text())
    msg = one_line_error(run('train_nnscaler.py', 'nanoGPT/config/train_shakespeare_char.py', cwd=tmp_path,
                             check=False))
    assert msg.endswith(f"nanoGPT/config/train_shakespeare_char.py: No such file or directory: here "
                        f"{REPO / 'config' / 'train_shakespeare_char.py'}"), msg  # (run from another folder)


def test_nnscalers_plan_flags_are_taken_where_they_mean_what_ours_do(monkeypatch, capsys):
    # nnScaler's --plan_ngpus=1 (its default) over all of torchrun's ranks (runtime_ngpus=-1, its default) is train.py
    # itself: taken in one line; on another count of ranks it names the torchrun command that gives that count
    monkeypatch.setenv('WORLD_SIZE', '4')
    monkeypatch.delenv('RANK', raising=False)
    for argv in (['--plan_ngpus=1', '--runtime_ngpus=4'], ['--plan_ngpus', '1', '--runtime_ngpus', '-1'],
                 ['--runtime_ngpus', '4']):
        assert config_of('train.py', [*argv, '--n_layer=2'])['n_layer'] == 2
        assert capsys.readouterr().out == "nnScaler's --plan_ngpus=1 --runtime_ngpus=%s: nothing to set here: data " \
            "parallel, a whole model on each of the 4 ranks, is train.py\n" % (-1 if '-1' in argv else 4)
    assert '`torchrun --nproc_per_node=8 train.py ...' in error_of('train.py', ['--plan_ngpus=1', '--runtime_ngpus=8'])
    # --plan_ngpus=N on fsdp_train.py over these ranks is its --tp_size=N (its README's hybrid and model parallel)
    for argv, tp, runtime, dp in ((['--plan_ngpus=2', '--runtime_ngpus=4'], 2, 4,
                                   'the 2 groups data parallel with FSDP'),
                                  (['--runtime_ngpus', '-1', '--plan_ngpus', '4'], 4, -1, 'no data parallel')):
        assert config_of('fsdp_train.py', argv)['tp_size'] == tp
        assert capsys.readouterr().out == f"nnScaler's --plan_ngpus={tp} --runtime_ngpus={runtime} is --tp_size={tp} " \
            f"here: each model split over {tp} of the 4 ranks by tensor parallelism, {dp}\n"
    assert 'fsdp_train.py --tp_size=3' in error_of('fsdp_train.py', ['--plan_ngpus=3'])  # 4 ranks split in no 3s
    # our --tp_size beside it, in either order, may agree with it but not say another split than its line does
    assert config_of('fsdp_train.py', ['--plan_ngpus=2', '--runtime_ngpus=4', '--tp_size=2'])['tp_size'] == 2
    for argv in (['--plan_ngpus=2', '--runtime_ngpus=4', '--tp_size=1'], ['--tp_size', '4', '--plan_ngpus', '2']):
        msg = error_of('fsdp_train.py', argv)
        assert "nnScaler's --plan_ngpus=2 is --tp_size=2 here, and --tp_size" in msg and 'give one of them' in msg
    capsys.readouterr()
    # without nnScaler its script reads neither (Lightning's DDP on every rank): unused, in any order
    for argv, flag in ((['--use_nnscaler=False', '--plan_ngpus=2', '--runtime_ngpus=4'], '--plan_ngpus=2'),
                       (['--plan_ngpus', '2', '--use_nnscaler', 'false'], '--plan_ngpus 2')):
        config_of('fsdp_train.py', argv)
        assert f"{flag} is nnScaler's name: here unused with --use_nnscaler=False, as there" in capsys.readouterr().out


def test_use_nnscaler_false_is_what_every_entrypoint_is(capsys):
    for off in ('False', 'false', '0'):
        assert config_of('train.py', [f'--use_nnscaler={off}', '--n_layer=2'])['n_layer'] == 2
        assert 'plain PyTorch, nothing to set' in capsys.readouterr().out


def test_dlrover_and_mingpt_flags_of_fsdp_are_taken(capsys):
    # its --save_dir is the folder of its checkpoints, our out_dir; --use_fsdp is what fsdp_train.py is
    assert config_of('train.py', ['--save_dir', '/tmp/ck', '--use_native_ckpt'])['out_dir'] == '/tmp/ck'
    out = capsys.readouterr().out
    assert "--save_dir /tmp/ck is DLRover's name: here --out_dir=/tmp/ck" in out and "ckpt.pt is written" in out
    # fsdp_train.py writes no ckpt.pt unless told to (DLRover's saves shards whatever the flag): the line says so
    config_of('fsdp_train.py', ['--use_native_ckpt'])
    assert 'checkpoints are sharded, in out_dir/dcp/step-N' in capsys.readouterr().out
    config_of('fsdp_train.py', ['--use_native_ckpt', '--save_consolidated=True'])
    assert "out_dir's ckpt.pt is written with torch.save" in capsys.readouterr().out
    # its --out_dir beside it is unused there, in either order: the checkpoints go where the line says, not to ./out
    for argv in (['--save_dir', '/tmp/ck', '--out_dir', 'out'], ['--out_dir=out', '--save_dir=/tmp/ck']):
        assert config_of('train.py', ['--data_dir', './', *argv])['out_dir'] == '/tmp/ck'
        assert "out is unused beside --save_dir, DLRover's checkpoint folder" in capsys.readouterr().out
    assert config_of('fsdp_train.py', ['--use_fsdp', '--n_layer', '2'])['n_layer'] == 2
    assert "--use_fsdp is DLRover's name: here nothing to set (fsdp_train.py)" in capsys.readouterr().out
    # minGPT-DDP's distributed_method on the script it names, and its FSDP fork's cpu_offload where it is a key
    c = config_of('fsdp_train.py', ['--distributed_method=fsdp', '--cpu_offload=True'])
    assert c['cpu_offload'] is True and 'here nothing to set (fsdp_train.py)' in capsys.readouterr().out


def test_model_size_leaves_out_the_run_flags_of_dlrovers_fsdp_and_deepspeed_commands(capsys):
    # its fsdp_train.py's --cpu_offload, ds_train.py's --ds_config, its README's --use_fsdp: no shape, said in a line
    c = config_of('model_size.py', ['--data_dir', './', '--cpu_offload', '--use_fsdp', '--ds_config', 'ds.json'])
    assert (c['batch_size'], c['block_size']) == (32, 128)
    out = capsys.readouterr().out
    assert all(f"{flag} is DLRover's name: here not a size, left out" in out
               for flag in ('--cpu_offload', '--use_fsdp', '--ds_config ds.json'))


def test_a_dataset_name_finds_nnscalers_checkout_or_a_folder_here_in_its_error(tmp_path, monkeypatch):
    # nnScaler's script reads data/<dataset> inside its nanoGPT/ checkout: from there, its config's dataset name
    # names that folder as our --dataset, not only a prep of data/<dataset> afresh (55 GB for openwebtext)
    from data import find_bins
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'nanoGPT' / 'data' / 'owt').mkdir(parents=True)
    (tmp_path / 'nanoGPT' / 'data' / 'owt' / 'train.bin').write_bytes(b'\0' * 200)
    with pytest.raises(SystemExit) as e:
        find_bins('owt', 32)
    seed, ours = os.path.join('nanoGPT', 'data', 'owt'), os.path.join('data', 'owt')
    assert str(e.value.code) == f"error: {os.path.join(ours, 'train.bin')} not found, but {seed} holds one " \
        f"(nnScaler's nanoGPT checkout): give --dataset={seed}, or run `python prepare.py text --input=FILE " \
        f"--name=owt` for {ours}"
    # a folder here by that name (DLRover's `prepare.py --src_data_path data.txt --output_dir mydata`, then
    # `--dataset mydata`): it said only to prepare data/mydata
    (tmp_path / 'mydata').mkdir()
    (tmp_path / 'mydata' / 'train.bin').write_bytes(b'\0' * 200)
    with pytest.raises(SystemExit) as e:
        find_bins('mydata', 32)
    assert str(e.value.code).startswith(f"error: {os.path.join('data', 'mydata', 'train.bin')} not found, but "
                                        f"./mydata holds one (a folder here, where a name is one in data/): give "
                                        f"--dataset=./mydata, or run")
    # DLRover's --data_dir '' (its required flag, left empty): not data/ itself, nor a prep of no name
    with pytest.raises(SystemExit) as e:
        find_bins('', 32)
    assert str(e.value.code).startswith('error: dataset is empty: give --dataset=NAME')


def test_decent_dp_names_on_the_command_line():
    c = config_of('decent_train.py', ['--topology=exp', '--replica_optimizer=AccumAdamW', '--accum_steps', '8'])
    assert (c['topology'], c['replica_optimizer'], c['moment_accum_steps']) == ('one-peer-exp', 'accumadamw', 8)


def test_diloco_implementations_names_are_taken_or_name_ours(tmp_path, capsys):
    # the paper's and Prime's H in its section (space-separated, as its tests write it), the outer SGD's words
    keys = ('diloco_steps', 'outer_learning_rate', 'outer_optimizer', 'diloco_fragments', 'diloco_overlap',
            'diloco_alpha')
    c = config_of('decent_train.py', ['--diloco.inner_steps', '20', '--outer_lr', '0.5', '--nesterov', 'False'])
    assert [c[k] for k in keys[:3]] == [20, 0.5, 'sgd']
    assert '--diloco.inner_steps 20 is DiLoCo\'s and Prime\'s name: here --diloco_steps=20' in capsys.readouterr().out
    # torchft's Streaming DiLoCo (sync_every is each fragment's window, as H here), OpenDiLoCo's, torchtitan's
    c = config_of('decent_train.py', ['--sync_every=8', '--num_fragments=2', '--fragment_sync_delay=1',
                                      '--fragment_update_alpha=0.5', '--should_quantize=False', '--nesterov'])
    assert [c[k] for k in keys] == [8, 0.7, 'nesterov', 2, 1, 0.5]
    assert config_of('decent_train.py', ['--hv.local-steps', '500'])['diloco_steps'] == 500
    assert config_of('decent_train.py', ['--fault_tolerance.sync_steps=30', '--tau=2'])['diloco_overlap'] == 2
    # torchtitan's other --fault_tolerance keys: torchft's process group is our backend, its semi-sync methods
    # DiLoCo (at its sync_steps' default of 5 where none is given) or local SGD; the rest name what stands for them
    c = config_of('decent_train.py', ['--fault_tolerance.semi_sync_method=local_sgd',
                                      '--fault_tolerance.process_group', 'gloo'])
    assert [c[k] for k in ('diloco_steps', 'outer_optimizer', 'outer_learning_rate', 'outer_momentum', 'backend')] == \
        [5, 'sgd', 1.0, 0.0, 'gloo']
    (tmp_path / 'titan.toml').write_text('[fault_tolerance]\nsemi_sync_method = "diloco"\nsync_steps = 20\n')
    assert config_of('decent_train.py', [str(tmp_path / 'titan.toml')])['diloco_steps'] == 20
    assert '--max-restarts=N' in error_of('decent_train.py', ['--fault_tolerance.enable'])
    (tmp_path / 'ft.toml').write_text('[fault_tolerance]\nenable = true\n')
    assert 'ft.toml:2: torchft' in error_of('decent_train.py', [str(tmp_path / 'ft.toml')])
    assert 'give --diloco_fragments=F' in error_of('decent_train.py', [
        '--fault_tolerance.module_fqns_per_model_fragment=[["tok_embeddings"]]'])
    for key in ('replica_id=1', 'group_size=2', 'min_replica_size=1', 'process_group_timeout_ms=1000'):
        assert error_of('decent_train.py', [f'--fault_tolerance.{key}']).endswith('leave it out')
    assert 'use --backend=nccl or gloo' in error_of('decent_train.py', ['--fault_tolerance.process_group=mccl'])
    (tmp_path / 'prime.toml').write_text('[diloco]\ninner_steps = 50\nouter_lr = 0.7\n')  # its TOML's table
    assert config_of('decent_train.py', [str(tmp_path / 'prime.toml')])['diloco_steps'] == 50
    assert "prime.toml is in DiLoCo's and Prime's names; here: inner_steps is --diloco_steps=50" in \
        capsys.readouterr().out
    config_of('decent_train.py', [str(REPO / 'config' / 'decent-gpt2-small.toml')])  # Decent-DP's: one line still
    said = capsys.readouterr().out
    assert said.count("names; here") == 1 and "decent-gpt2-small.toml is in Decent-DP's names; here: log_dir" in said
    # what has no counterpart, and another entrypoint, in one line naming ours
    assert error_of('decent_train.py', ['--should_quantize']).endswith('--diloco_dtype=bfloat16 sends them in half '
                                                                        "float32's bytes")
    assert '--diloco_dtype=bfloat16' in error_of('decent_train.py', ['--diloco.compression=uint8'])
    assert 'leave it out' in error_of('decent_train.py', ['--hv.galaxy_size=2'])
    assert error_of('train.py', ['--inner_steps=5']).startswith('error: --inner_steps=5: diloco_steps is a key of '
                                                                'decent_train.py, not of train.py')
    assert 'outer_optimizer is a key of decent_train.py' in error_of('fsdp_train.py', ['--nesterov'])


def test_torchtitans_and_megatrons_pipeline_names_are_taken_or_name_ours(tmp_path, capsys, monkeypatch):
    # each was an unknown key or schedule; now pp_train.py takes them, saying once what each is here
    monkeypatch.delenv('RANK', raising=False)
    for theirs, ours in (('1F1B', '1f1b'), ('GPipe', 'gpipe'), ('Interleaved1F1B', 'interleaved-1f1b'),
                         ('InterleavedZeroBubble', 'interleaved-zb'), ('ZBVZeroBubble', 'zbv'),
                         ('DualPipeV', 'dualpipev')):
        assert config_of('pp_train.py', [f'--pp_schedule={theirs}'])['pp_schedule'] == ours
        assert capsys.readouterr().out == f"--pp_schedule={theirs} is torchtitan's name: here --pp_schedule={ours}\n"
    c = config_of('pp_train.py', ['--parallelism.pipeline_parallel_degree', '4', '--tensor_parallel_degree=2',
                                  '--pipeline_parallel_schedule=interleaved1f1b',
                                  '--pipeline_parallel_microbatch_size=3'])
    assert (c['pp_size'], c['tp_size'], c['pp_schedule'], c['batch_size']) == (4, 2, 'interleaved-1f1b', 3)
    assert "--parallelism.pipeline_parallel_degree 4 is torchtitan's name: here --pp_size=4\n" in \
        capsys.readouterr().out
    (tmp_path / 'titan.toml').write_text('[parallelism]\npipeline_parallel_degree = 2\n'
                                         'pipeline_parallel_schedule = "ZBVZeroBubble"\n')
    assert (config_of('pp_train.py', [str(tmp_path / 'titan.toml')])['pp_schedule']) == 'zbv'
    assert capsys.readouterr().out == f"{tmp_path / 'titan.toml'} is in torchtitan's names; here: " \
        "pipeline_parallel_degree is --pp_size=2; pipeline_parallel_schedule is --pp_schedule=zbv\n"
    # Megatron-LM's dashes; its layers a virtual stage are stages a rank, in the interleaved schedule it runs
    c = config_of('pp_train.py', ['--pipeline-model-parallel-size', '2', '--tensor-model-parallel-size=2',
                                  '--micro-batch-size', '3', '--num-layers', '8',
                                  '--num-layers-per-virtual-pipeline-stage', '2', '--global-batch-size', '12'])
    assert (c['pp_size'], c['tp_size'], c['batch_size'], c['pp_schedule'], c['stages_per_rank']) == \
        (2, 2, 3, 'interleaved-1f1b', 2)
    assert c['gradient_accumulation_steps'] == 4  # its global batch: micro-batches over all ranks, as ours
    out = capsys.readouterr().out
    assert "--num-layers-per-virtual-pipeline-stage 2 is Megatron-LM's name: here --stages_per_rank=2 " \
        "--pp_schedule=interleaved-1f1b (8 layers in 2 x 2 stages of 2)" in out
    assert "--global-batch-size 12 is Megatron-LM's name: here --gradient_accumulation_steps=4 (micro-batches of " \
        "--batch_size=3, over all ranks)" in out
    c = config_of('pp_train.py', ['--pp_schedule=InterleavedZeroBubble', '--num-virtual-stages-per-pipeline-rank=3'])
    assert (c['pp_schedule'], c['stages_per_rank']) == ('interleaved-zb', 3)  # the schedule named stays
    assert error_of('pp_train.py', ['--pipeline-model-parallel-size=4', '--num-layers-per-virtual-pipeline-stage=2']) \
        .endswith("n_layer=12 is no whole number of stages of 2 layers on each of pp_size=4 ranks: give "
                  "--stages_per_rank=S (S stages a rank, which need not hold equal layers)")
    assert "LoopedBFS has no counterpart here" in error_of('pp_train.py', ['--pp_schedule=LoopedBFS'])
    # a schedule the command names is not overruled: pp_train.py's own check (below) says what its stages need
    c = config_of('pp_train.py', ['--pp_schedule=1f1b', '--num-virtual-stages-per-pipeline-rank=2'])
    assert (c['pp_schedule'], c['stages_per_rank']) == ('1f1b', 2)
    # stages_per_rank beside a schedule that places its own stages was silently ignored: one line naming the fix
    p = run('pp_train.py', '--device=cpu', '--stages_per_rank=3', cwd=tmp_path, check=False)
    assert one_line_error(p) == "error: stages_per_rank=3 is the interleaved schedules' (1f1b runs one stage a " \
        "rank): add --pp_schedule=interleaved-1f1b (or interleaved-zb), or drop --stages_per_rank"
    # model_size.py takes Megatron-LM's --global-batch-size as every entrypoint does: a rank holds a micro-batch
    p = run('model_size.py', '--global-batch-size', '512', '--micro-batch-size=4', '--pp_size=2',
            '--pp_schedule=gpipe', cwd=tmp_path)
    assert "--global-batch-size 512 is Megatron-LM's name: here not a size, left out" in p.stdout
    p = run('model_size.py', '--pp_size=2', '--pp_schedule=zbv', '--stages_per_rank=3', cwd=tmp_path, check=False)
    assert one_line_error(p).startswith("error: stages_per_rank=3: zbv places two stages on each rank, in a V")
    assert error_of('train.py', ['--pipeline-model-parallel-size', '2']).startswith(
        "error: --pipeline-model-parallel-size 2: pp_size is a key of pp_train.py, not of train.py: run pp_train.py")


def test_torchtitans_and_megatrons_uneven_stage_splits_name_our_even_one(tmp_path, capsys, monkeypatch):
    # each was an unknown key (one of them "did you mean pipeline_parallel_degree?"): the blocks are shared out
    # evenly here, so a split by layers is one line naming --stages_per_rank, and a split that is even is nothing
    monkeypatch.delenv('RANK', raising=False)
    for argv in (['--parallelism.pipeline_parallel_layers_per_stage', '2'],
                 ['--parallelism.pipeline_parallel_first_stage_less_layers=1'],
                 ['--parallelism.module_fqns_per_model_part=[["tok_embeddings"]]'],
                 ['--decoder-first-pipeline-num-layers', '3'], ['--account-for-embedding-in-pipeline-split'],
                 ['--pipeline-model-parallel-layout=Et|tL']):
        msg = error_of('pp_train.py', argv)
        assert msg.startswith(f"error: {' '.join(argv)}: ") and 'shared out evenly' in msg and \
            msg.endswith('--stages_per_rank=S for S stages a rank'), msg
    (tmp_path / 'titan.toml').write_text('[parallelism]\npipeline_parallel_degree = 2\n'
                                         'pipeline_parallel_first_stage_less_layers = 0\n'
                                         'pipeline_parallel_last_stage_less_layers = 0\n')
    assert config_of('pp_train.py', [str(tmp_path / 'titan.toml')])['pp_size'] == 2
    assert "pipeline_parallel_first_stage_less_layers: nothing to set (the blocks are shared out evenly over the " \
        "stages)" in capsys.readouterr().out
    # its schedule from a file was "did you mean pipeline_parallel_schedule?": the schedules are torch's, by name
    assert error_of('pp_train.py', ['--parallelism.pipeline_parallel_schedule_csv=zb.csv']).endswith(
        "leave it out, and give --pp_schedule=NAME (gpipe, 1f1b, interleaved-1f1b, interleaved-zb, zbv or dualpipev)")
    (tmp_path / 'uneven.toml').write_text('[parallelism]\npipeline_parallel_layers_per_stage = 4\n')
    assert error_of('pp_train.py', [str(tmp_path / 'uneven.toml')]).startswith(
        f"error: {tmp_path / 'uneven.toml'}:2: torchtitan's pipeline_parallel_layers_per_stage")


def test_torchtitans_pipelined_local_batch_is_the_micro_batches_of_a_step(tmp_path, capsys, monkeypatch):
    # with a pipeline, torchtitan cuts each data-parallel rank's local_batch_size into micro-batches of
    # pipeline_parallel_microbatch_size; both set batch_size here, and the local batch was lost: its global batch
    # of -1 (a local batch a rank) gave 1 micro-batch of 2 where torchtitan runs 4, and without one, ours stood
    monkeypatch.delenv('RANK', raising=False)
    monkeypatch.setenv('WORLD_SIZE', '4')  # 2 pipelines of 2 stages
    titan = '[job]\ndump_folder = "out"\n[training]\nlocal_batch_size = 8\n{}[parallelism]\n' \
            'pipeline_parallel_degree = 2\npipeline_parallel_microbatch_size = 2\n'
    for line in ('global_batch_size = -1\n', ''):
        (tmp_path / 'pp.toml').write_text(titan.format(line))
        c = config_of('pp_train.py', [str(tmp_path / 'pp.toml')])
        assert (c['batch_size'], c['gradient_accumulation_steps']) == (2, 8)  # 4 micro-batches on each pipeline
        assert "--gradient_accumulation_steps=8 (micro-batches of --batch_size=2, over all ranks)" in \
            capsys.readouterr().out
    (tmp_path / 'local.toml').write_text(titan.format('').rsplit('pipeline_parallel_microbatch', 1)[0])  # a flag's
    c = config_of('pp_train.py', [str(tmp_path / 'local.toml'), '--parallelism.pipeline_parallel_microbatch_size', '2'])
    assert (c['batch_size'], c['gradient_accumulation_steps']) == (2, 8)
    c = config_of('pp_train.py', [str(tmp_path / 'pp.toml'), '--gradient_accumulation_steps=6'])  # the flag's count
    assert (c['batch_size'], c['gradient_accumulation_steps']) == (2, 6)
    (tmp_path / 'pp.toml').write_text(titan.format('global_batch_size = 32\n'))  # 2 accumulation steps
    assert config_of('pp_train.py', [str(tmp_path / 'pp.toml')])['gradient_accumulation_steps'] == 16
    (tmp_path / 'dp.toml').write_text('[job]\n[training]\nlocal_batch_size = 8\nglobal_batch_size = -1\n')
    c = config_of('train.py', [str(tmp_path / 'dp.toml')])  # no pipeline: a micro-batch of 8 a rank, as before
    assert (c['batch_size'], c['gradient_accumulation_steps']) == (8, 4)


@pytest.fixture(scope='module')
def here(tmp_path_factory, data_dir):
    """DLRover's layout: train.bin, val.bin and meta.pkl in the folder it runs in (and in mydata/, as its prep's
    --output_dir mydata writes them), train.bin cut to 64 tokens: an epoch of its loader at block_size 32 is the 32
    sequences that start at each offset."""
    d = tmp_path_factory.mktemp('dlrover')
    for folder in (d, d / 'mydata'):
        folder.mkdir(exist_ok=True)
        for name in ('val.bin', 'meta.pkl'):
            shutil.copy(data_dir / 'shakespeare_char' / name, folder / name)
        (folder / 'train.bin').write_bytes((data_dir / 'shakespeare_char' / 'train.bin').read_bytes()[:128])
    return d


@pytest.mark.parametrize('script, data', [('train.py', './'), ('fsdp_train.py', 'mydata')])
def test_dlrover_train_command_runs_as_written(here, script, data):
    out = here / f'out-{script}'
    p = run(script, '--n_layer', '2', '--n_head', '2', '--n_embd', '32', '--data_dir', data, '--epochs', '1',
            '--save_memory_interval', '50', '--save_storage_interval', '500', '--bias', '--decay_lr',
            '--device', 'cpu', '--compile', 'False', '--block_size', '32', '--batch_size', '4',
            '--gradient_accumulation_steps', '1', '--eval_iters', '2', '--out_dir', str(out), cwd=here)
    dataset = './' if data == './' else './mydata'  # a path, as there: not data/mydata
    assert f"--data_dir {data} is DLRover's and Decent-DP's name: here --dataset={dataset}" in p.stdout
    # DLRover's epoch: a sequence at each offset, 64 - 32 of them, at 4 a step (not the 64 tokens' 1 step of 128)
    assert '--max_iters=8 (1 epoch of train.bin\'s 32 sequences' in p.stdout  # it said '1 epochs'
    config = json.loads((out / 'config.json').read_text())
    assert config['max_iters'] == 8 and config['dataset'] == dataset and config['bias'] is True
    assert 'iter 7:' in p.stdout and 'iter 8:' not in p.stdout
    # what docs/coming-from.md says of DLRover's log line: our line, and the keys of its row in metrics.jsonl
    doc = next(line for line in DOC.read_text().splitlines() if line.startswith('| its log line `iter 0:'))
    assert re.search(r'^iter 7: loss [\d.]+, time [\d.]+ ms, [\d,]+ tok/s$', p.stdout, re.M)
    row = [json.loads(line) for line in (out / 'metrics.jsonl').read_text().splitlines() if '"loss"' in line][-1]
    assert set(re.findall(r'`(\w+)`', doc.split('metrics.jsonl')[1])) == set(row) and row['mfu'] is None


def test_dlrover_epochs_count_tokens_across_a_relaunch_at_another_world_size(here, tmp_path):
    """DLRover's default of a micro-step a rank makes the global batch the world size's: 2 ranks train 256 tokens an
    iteration, a relaunch on 1 rank 128. --epochs 2 of train.bin's 32 sequences (2,048 tokens) ends on the tokens
    trained (not on the iterations at the new batch: 16 there, 2,432 tokens), and the LR schedule, given in
    iterations of the first batch (8 of them), decays over the epochs without restarting warmup. A checkpoint saved
    before the count was kept resumes on its iterations at its own batch."""
    dlrover = ['--n_layer', '2', '--n_head', '2', '--n_embd', '32', '--data_dir', './', '--epochs', '2', '--device',
               'cpu', '--block_size', '32', '--batch_size', '4', '--eval_iters', '2', '--decay_lr', '--warmup_iters',
               '2', '--lr_decay_iters', '8', '--out_dir', str(tmp_path / 'out')]
    first = run('train.py', *dlrover, '--max_iters', '3', nproc=2, cwd=here)  # cut short: a node lost at iter 3
    assert 'world size 2, 1 micro-step per rank, 256 tokens per iteration' in first.stdout
    saved = torch.load(tmp_path / 'out' / 'ckpt.pt', weights_only=True)
    assert (saved['iter_num'], saved['tokens_trained'], saved['lr_batch']) == (3, 768, 256)
    shutil.copytree(tmp_path / 'out', tmp_path / 'old')
    saved.pop('tokens_trained'), saved.pop('lr_batch')
    saved['config']['out_dir'] = str(tmp_path / 'old')
    torch.save(saved, tmp_path / 'old' / 'ckpt.pt')  # as this project saved it before it counted tokens
    p = run('train.py', *dlrover, cwd=here)
    assert 'world size 1, 1 micro-step per rank, 128 tokens per iteration' in p.stdout
    assert '--epochs: 768 of their 2,048 tokens trained by iter 3: here --max_iters=13 at 128 tokens an iteration' \
        in p.stdout
    end = torch.load(tmp_path / 'out' / 'ckpt.pt', weights_only=True)
    trained = 3 * 256 + (end['iter_num'] - 3) * 128  # each launch's iterations at its own global batch
    assert trained == 2048 and end['tokens_trained'] == trained
    lrs = [row['lr'] for row in map(json.loads, (tmp_path / 'out' / 'metrics.jsonl').read_text().splitlines())
           if 'lr' in row]
    # warmup over the first 2 iterations, then down at every iteration, to within 2% of the range above min_lr (6e-5,
    # reached at iteration 8 of the first batch: the epochs' end) at the last one, and not before it
    assert len(lrs) == end['iter_num'] and lrs[2] == 6e-4 and all(a > b for a, b in zip(lrs[2:], lrs[3:]))
    assert 6e-5 < lrs[-1] < 6e-5 + 0.02 * (6e-4 - 6e-5)
    old = run('train.py', *dlrover[:-1], str(tmp_path / 'old'), cwd=here)
    assert "note: the checkpoint has no count of the tokens trained (saved before it had one): --epochs takes its 3 " \
           "iterations at its global batch of 256 tokens" in old.stdout
    assert torch.load(tmp_path / 'old' / 'ckpt.pt', weights_only=True)['tokens_trained'] == trained


def test_dlrover_command_takes_dlrover_defaults_for_what_it_leaves_out(here, tmp_path, monkeypatch, capsys):
    seed_dir = tmp_path / 'seed'  # here's train.bin at DLRover's block_size of 128: 1,000 tokens, 872 sequences
    shutil.copytree(here, seed_dir, ignore=shutil.ignore_patterns('out*', 'mydata'))
    (seed_dir / 'train.bin').write_bytes((here / 'val.bin').read_bytes()[:2000])
    monkeypatch.chdir(seed_dir)
    monkeypatch.setenv('WORLD_SIZE', '2')
    monkeypatch.delenv('RANK', raising=False)
    seed = ['--n_layer', '48', '--n_head', '16', '--n_embd', '1600', '--data_dir', './', '--epochs', '50',
            '--save_memory_interval', '50', '--save_storage_interval', '500']  # SEEDS.md's, as written
    c = config_of('ds_train.py', seed)
    assert (c['n_layer'], c['block_size'], c['batch_size'], c['gradient_accumulation_steps'], c['decay_lr'],
            c['compile'], c['save_memory_interval'], c['max_iters']) == (48, 128, 32, 2, False, False, 50, 682)
    assert "DLRover's command line (--data_dir, no config file): its nanoGPT example's defaults where it gives none, " \
        "so resume it with the same command: --block_size=128 --batch_size=32 --max_iters=2000 --decay_lr=False " \
        "--warmup_iters=0 --lr_decay_iters=10 --compile=False --gradient_accumulation_steps=2 (a micro-step a rank)" \
        in capsys.readouterr().out  # max_iters: 50 x 872 / 64 (the run says so once it knows the model's block_size)
    # its default given as a flag, 0: one micro-step a rank there, so as many in total here, not an error
    assert config_of('ds_train.py', [*seed, '--gradient_accumulation_steps', '0'])['gradient_accumulation_steps'] == 2
    assert "--gradient_accumulation_steps 0 is DLRover's default, one micro-step a rank" in capsys.readouterr().out
    # a command line with a config file is not DLRover's: ours (.py) never came from it, and Decent-DP's TOML names
    # data_dir itself; the file keeps its schedule and every key it leaves out keeps our default
    (tmp_path / 'c.py').write_text('batch_size = 8\n')
    c = config_of('train.py', [str(tmp_path / 'c.py'), '--data_dir', './'])
    assert (c['batch_size'], c['block_size'], c['max_iters'], c['save_storage_interval']) == (8, 1024, 600000, 0)
    c = config_of('train.py', [str(REPO / 'config' / 'train_shakespeare_char_cpu.py'), '--epochs=1', '--dataset=./'])
    assert (c['decay_lr'], c['warmup_iters'], c['lr_decay_iters'], c['save_memory_interval']) == (True, 100, 2000, 0)
    (tmp_path / 'c.toml').write_text('[model]\nn_layer = 2\n')
    assert config_of('train.py', [str(tmp_path / 'c.toml'), '--data_dir', './'])['block_size'] == 1024
    # --dataset is our name, with our defaults; --epochs alone is minGPT-DDP's max_epochs too (our Hydra hint's)
    assert config_of('train.py', ['--dataset=./'])['block_size'] == 1024
    c = config_of('train.py', ['--epochs', '1', '--dataset=./', '--block_size=32'])
    assert (c['n_layer'], c['batch_size'], c['decay_lr'], c['gradient_accumulation_steps']) == (12, 12, True, 40)


def test_torchrun_auto_on_cpu_names_the_accumulation_of_a_rank_a_core_which_trains(tmp_path, data_dir):
    # minGPT-DDP's `python launch.py` (a process per device) is torchrun's --nproc_per_node=auto, which without a GPU
    # starts a rank per core it may use: 2, pinned so here. The baby GPT's CPU recipe accumulates 1 micro-step,
    # which 2 ranks cannot share; one line names the value that keeps each rank's batch (nnScaler's way too)
    cores = sorted(os.sched_getaffinity(0))[:2]
    args = [REPO / 'config' / 'train_shakespeare_char.py', f'--dataset={data_dir / "shakespeare_char"}', '--out_dir=o',
            '--n_layer=1', '--max_iters=2', '--eval_iters=2']
    p = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=auto',
                        REPO / 'train.py', *args], cwd=tmp_path, env=env(), capture_output=True, text=True,
                       timeout=300, preexec_fn=lambda: os.sched_setaffinity(0, cores))
    if len(cores) == 1:  # a machine of one core: one rank, which takes the recipe as it is
        assert p.returncode == 0 and 'iter 1:' in p.stdout, p.stderr[-3000:]
        return
    msg = one_line_error(p, nproc=2)
    assert 'gradient_accumulation_steps=1 does not divide across 2' in msg and 'nnScaler' in msg and \
        msg.split(': ')[-1].startswith('--gradient_accumulation_steps=2 keeps each rank') and 'minGPT-DDP' in msg
    # the value it names, on the 2 ranks (started as torchrun starts them)
    p = run('train.py', *args, '--gradient_accumulation_steps=2', nproc=2, cwd=tmp_path)
    assert 'takes the CPU recipe' in p.stdout and 'world size 2, 1 micro-step per rank' in p.stdout
    config = json.loads((tmp_path / 'o' / 'config.json').read_text())
    assert (config['world_size'], config['n_embd'], config['device']) == (2, 128, 'cpu') and 'iter 1:' in p.stdout


def test_decent_toml_trains_at_tiny_size(tmp_path, data_dir):
    (tmp_path / 'decent.toml').write_text(SEED_DECENT_TOML)
    p = run('decent_train.py', 'decent.toml', *TINY, f'--dataset={data_dir / "shakespeare_char"}',
            '--wandb_log=False', '--topology=ring', '--gradient_accumulation_steps=2', '--max_iters=3',
            '--eval_interval=3', nproc=2, cwd=tmp_path)
    assert 'decent.toml is in Decent-DP' in p.stdout and 'iter 2:' in p.stdout
    # log_dir = "./log": this job's and config's folder in it, which both ranks named alike (the launcher gives no
    # run id; the suite may run inside a SLURM job)
    out = tmp_path / 'log' / os.environ.get('SLURM_JOB_ID', '') / 'decent'
    assert [*(tmp_path / 'log').rglob('best.pt')] == [out / 'best.pt']  # Decent-DP's best_model.pth
    config = json.loads((out / 'config.json').read_text())
    assert (config['replica_optimizer'], config['moment_accum_steps'], config['beta2']) == ('accumadamw', 8, 0.98)
    # what docs/coming-from.md says of Decent-DP's log line: our eval line, and the keys of its row in metrics.jsonl
    doc = next(line for line in DOC.read_text().splitlines() if line.startswith('| its log line `Step '))
    assert re.search(r'^step 3: train loss [\d.]+, val loss [\d.]+, consensus distance [\d.e+-]+$', p.stdout, re.M)
    row = [json.loads(line) for line in (out / 'metrics.jsonl').read_text().splitlines()][-1]
    assert set(re.findall(r'"(\w+)"', doc)) | {'consensus_distance'} == set(row) and 'consensus_distance' in doc


# torchtitan's train_configs/llama3_8b.toml, as published (its keys and values), and the newer names of its
# debug_model.toml (local_batch_size, global_batch_size, [lr_scheduler]'s decay, [compile], [validation])
TITAN_8B = """[job]
dump_folder = "./outputs"
description = "Llama 3 8B training"
[profiling]
enable_profiling = true
save_traces_folder = "profile_trace"
profile_freq = 100
[metrics]
log_freq = 10
enable_tensorboard = true
save_tb_folder = "tb"
[model]
name = "llama3"
flavor = "8B"
tokenizer_path = "./assets/tokenizer/original/tokenizer.model"
[optimizer]
name = "AdamW"
lr = 3e-4
eps = 1e-8
[lr_scheduler]
warmup_steps = 200
[training]
batch_size = 1
seq_len = 8192
max_norm = 1.0
steps = 1000
compile = false
dataset = "c4"
[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 1
pipeline_parallel_degree = 1
context_parallel_degree = 1
[checkpoint]
enable_checkpoint = false
folder = "checkpoint"
interval = 500
model_weights_only = false
export_dtype = "float32"
async_mode = "disabled"
[activation_checkpoint]
mode = 'selective'
selective_ac_option = 'op'
[float8]
enable_fsdp_float8_all_gather = false
precompute_float8_dynamic_scale_for_fsdp = false
filter_fqns = "output"
"""
TITAN_DEBUG = """[job]
dump_folder = "./outputs"
[model]
name = "llama3"
flavor = "debugmodel"
[optimizer]
lr = 8e-4
[lr_scheduler]
warmup_steps = 2
decay_ratio = 0.8
decay_type = "linear"
min_lr_factor = 0.1
[training]
local_batch_size = 8
global_batch_size = 32
seq_len = 2048
steps = 10
[compile]
enable = false
[validation]
enabled = false
freq = 5
steps = 10
"""


def test_torchtitans_toml_as_published_takes_what_maps_and_names_the_rest(tmp_path, capsys, monkeypatch):
    # only its [parallelism] was read: [job], [training], [model] ... were unknown keys (steps, seq_len, flavor)
    monkeypatch.delenv('RANK', raising=False)
    monkeypatch.setenv('WORLD_SIZE', '2')
    (tmp_path / 'llama3_8b.toml').write_text(TITAN_8B)
    toml, shape = str(tmp_path / 'llama3_8b.toml'), ['--n_layer=2', '--n_head=2', '--n_embd=32']
    assert error_of('fsdp_train.py', [toml]) == f"error: {toml}:14: torchtitan's llama3 '8B' is not built here (the " \
        "model is GPT-2's): give a shape after the file, --n_layer=32 --n_head=32 --n_embd=4096 (that flavor's " \
        "depth, heads and width)"
    assert error_of('fsdp_train.py', [toml, *shape]) == f"error: {toml}:28: torchtitan's dataset 'c4' is not " \
        "prepared here: prepare one (python prepare.py openwebtext) and give --dataset=NAME after the file"
    capsys.readouterr()
    for script in ('train.py', 'fsdp_train.py', 'pp_train.py'):
        c = config_of(script, [toml, *shape, '--dataset=shakespeare_char'])
        assert (c['out_dir'], c['batch_size'], c['block_size'], c['grad_clip'], c['max_iters'], c['lr_decay_iters'],
                c['learning_rate'], c['warmup_iters'], c['log_interval'], c['save_storage_interval'], c['n_layer']) == \
            ('./outputs', 1, 8192, 1.0, 1000, 1000, 3e-4, 200, 10, 500, 2)
        said = capsys.readouterr().out
        assert said.count('\n') == 1 and said.startswith(f"{toml} is in torchtitan's names; here: job.dump_folder is "
                                                         f"--out_dir=./outputs; job.description: nothing to set")
        assert 'training.steps is --max_iters=1000 --lr_decay_iters=1000' in said and \
            'unused here: profiling.save_traces_folder, profiling.profile_freq, metrics.save_tb_folder' in said
    assert config_of('train.py', ['--job.config_file', toml, *shape, '--dataset=x/y'])['block_size'] == 8192
    assert capsys.readouterr().out.startswith(f"--job.config_file {toml} is torchtitan's flag: here the file's path "
                                              f"alone, `{toml}`\n")
    # its selective mode: whole blocks in fsdp_train.py, the one that recomputes them
    assert config_of('fsdp_train.py', [toml, *shape, '--dataset=x/y'])['activation_checkpointing'] is True
    (tmp_path / 'debug_model.toml').write_text(TITAN_DEBUG)
    c = config_of('train.py', [str(tmp_path / 'debug_model.toml'), *shape, '--dataset=x/y'])
    assert (c['batch_size'], c['gradient_accumulation_steps'], c['decay_lr'], c['min_lr'], c['eval_interval'],
            c['eval_iters'], c['compile']) == (8, 4, True, pytest.approx(8e-5), 5, 10, False)
    said = capsys.readouterr().out
    assert "lr_scheduler.decay_type is --decay_lr=True (a cosine decay: linear is not built here)" in said
    assert "training.global_batch_size is --gradient_accumulation_steps=4 (micro-batches of --batch_size=8" in said
    # its "keep every checkpoint" is none of ours; its model named without a flavor is named so
    (tmp_path / 'k.toml').write_text('[job]\n[checkpoint]\nkeep_latest_k = 0\n[model]\nname = "llama3"\n')
    assert error_of('train.py', [str(tmp_path / 'k.toml'), *shape]) == f"error: {tmp_path / 'k.toml'}:3: " \
        "torchtitan's keep_latest_k = 0 keeps every checkpoint; here the newest keep_checkpoints states and the " \
        "best are kept: give keep_latest_k = N (N states), 1 or more"
    assert error_of('train.py', [str(tmp_path / 'k.toml'), '--keep_checkpoints=3']).startswith(
        f"error: {tmp_path / 'k.toml'}:5: torchtitan's llama3 is not built here (the model is GPT-2's)")
    (tmp_path / 'cp.toml').write_text('[job]\n[parallelism]\ncontext_parallel_degree = 2\n')
    assert "context_parallel_degree = 2 has no counterpart here" in error_of('pp_train.py', [str(tmp_path / 'cp.toml')])


def test_toml_with_our_keys_in_tables_and_its_errors_name_the_line(tmp_path):
    (tmp_path / 'ours.toml').write_text('[training]\nbatch_size = 4\n[model]\nn_layer = 3\nbias = true\n')
    c = config_of('train.py', [str(tmp_path / 'ours.toml'), '--n_layer', '5'])
    assert (c['batch_size'], c['n_layer'], c['bias']) == (4, 5, True)
    (tmp_path / 'typo.toml').write_text('[model]\nn_layer = 3\nn_heed = 2\n')
    assert f"{tmp_path / 'typo.toml'}:3: unknown config key 'n_heed'; did you mean n_head" in \
        error_of('train.py', [str(tmp_path / 'typo.toml')])
    (tmp_path / 'bad.toml').write_text('[model]\nn_layer = = 3\n')
    assert error_of('train.py', [str(tmp_path / 'bad.toml')]).startswith(f"error: {tmp_path / 'bad.toml'}:2: TOML:")
    (tmp_path / 'latin.toml').write_bytes(b'[model]\nn_layer = 3\n# caf\xe9\n')  # read as the .py files are
    assert error_of('train.py', [str(tmp_path / 'latin.toml')]) == \
        f"error: {tmp_path / 'latin.toml'}:3: not UTF-8 (byte 0xe9): save the config file as UTF-8"


def test_the_folder_of_decent_dps_log_dir_is_ignored_by_git():
    # its TOML files' log_dir = "./log" holds each job's checkpoints under the repo: `git add -A` must not take them
    import tomllib
    for toml in sorted((REPO / 'config').glob('*.toml')):
        log_dir = tomllib.loads(toml.read_text()).get('log_dir')
        if log_dir:
            path = os.path.join(log_dir, '12345', 'config', toml.stem, 'ckpt.pt')
            assert subprocess.run(['git', 'check-ignore', '-q', path], cwd=REPO).returncode == 0, path
