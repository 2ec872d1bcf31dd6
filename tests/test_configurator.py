import os

import pytest

from configurator import check_model_shape, check_optimizer, configure
from conftest import REPO


def defaults():
    return dict(batch_size=12, learning_rate=6e-4, device='auto', compile=True, out_dir='out', n_layer=12)


def fails(ns, argv, capsys):
    with pytest.raises(SystemExit) as e:
        configure(ns, argv)
    assert e.value.code not in (0, None)
    return str(e.value.code)


def test_flags_and_files_override_in_order_with_type_checks(tmp_path):
    cfg_file = tmp_path / 'c.py'
    cfg_file.write_text("import math\nbatch_size = 4\nlearning_rate = 1\nn_layer = 12  # same as the default\n")
    ns = defaults()
    config, given = configure(ns, [str(cfg_file), '--compile=False', '--device=cpu', '--batch_size=6'])
    assert ns['batch_size'] == 6 and ns['compile'] is False and ns['device'] == 'cpu'
    assert ns['learning_rate'] == 1.0 and type(ns['learning_rate']) is float  # an int where a float is due
    assert config['out_dir'] == 'out'
    assert given == {'batch_size', 'learning_rate', 'n_layer', 'compile', 'device'}


def test_a_file_after_a_flag_overrides_it_and_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv('RANK', raising=False)
    cfg_file = tmp_path / 'c.py'
    cfg_file.write_text("batch_size = 4\ncompile = False\n")
    ns = defaults()
    configure(ns, ['--batch_size=6', '--compile=False', str(cfg_file), '--device=cpu'])
    assert ns['batch_size'] == 4  # nanoGPT's order, kept; the same value (compile) needs no word
    assert capsys.readouterr().out == f"note: {cfg_file}:1 sets batch_size=4 over --batch_size=6 before it on the " \
        f"command line: the later one wins (arguments apply in order); give the flag after the file to keep its value\n"
    configure(defaults(), [str(cfg_file), '--batch_size=6'])
    assert capsys.readouterr().out == ''


def test_help_shows_the_scripts_docstring_and_its_keys(capsys):
    with pytest.raises(SystemExit) as e:
        configure({**defaults(), '__doc__': 'Trains a GPT.'}, ['--batch_size=3', '-h'])
    out = capsys.readouterr().out
    assert e.value.code in (0, None) and out.startswith('Trains a GPT.\n') and '  --batch_size=12\n' in out


def test_string_keys_take_any_text():
    ns = defaults()
    configure(ns, ['--out_dir=2024', "--device='cuda:1'"])
    assert ns['out_dir'] == '2024' and ns['device'] == 'cuda:1'


def test_unknown_key_lists_the_closest_valid_keys(capsys):
    msg = fails(defaults(), ['--batch_sise=3'], capsys)
    assert "unknown config key 'batch_sise'" in msg and 'batch_size' in msg and '\n' not in msg


def test_wrong_type_names_the_expected_type(capsys):
    msg = fails(defaults(), ['--batch_size=3.5'], capsys)
    assert 'batch_size must be int' in msg
    msg = fails(defaults(), ['--n_layer=True'], capsys)  # a bool is not an int here
    assert 'n_layer must be int' in msg
    msg = fails(defaults(), ['--compile=1'], capsys)
    assert 'compile must be bool' in msg


def test_a_float_key_takes_finite_numbers_only(tmp_path, capsys):
    # 1e999 reads as inf and a file may give nan: AdamW would take either and turn every weight to nan
    msg = fails(defaults(), ['--learning_rate=1e999'], capsys)
    assert msg == "error: --learning_rate=1e999: learning_rate=inf is not a finite number: give one like its " \
        "default 0.0006"
    (tmp_path / 'nan.toml').write_text('learning_rate = nan\n')
    assert 'learning_rate=nan is not a finite number' in fails(defaults(), [str(tmp_path / 'nan.toml')], capsys)


def test_an_int_key_takes_a_step_number_as_a_folder_name_writes_it():
    # fsdp.md: --max_iters at the N of dcp/latest, which names step-00000006; Python's syntax refuses 00000006
    ns = defaults()
    configure(ns, ['--batch_size=00000006', '--n_layer=0'])
    assert ns['batch_size'] == 6 and type(ns['batch_size']) is int and ns['n_layer'] == 0


def test_config_file_errors_name_the_file_and_line(tmp_path, capsys):
    bad = tmp_path / 'bad.py'
    bad.write_text("batch_size = 4\n\nn_layer = undefined_name\n")
    msg = fails(defaults(), [str(bad)], capsys)
    assert f'{bad}:3' in msg and 'NameError' in msg
    syntax = tmp_path / 'syntax.py'
    syntax.write_text("batch_size = 4\nn_layer = = 3\n")
    msg = fails(defaults(), [str(syntax)], capsys)
    assert f'{syntax}:2' in msg and 'SyntaxError' in msg
    unknown = tmp_path / 'unknown.py'
    unknown.write_text("bach_size = 4\n")
    msg = fails(defaults(), [str(unknown)], capsys)
    assert f'{unknown}:1' in msg and "unknown config key 'bach_size'" in msg and 'batch_size' in msg
    typed = tmp_path / 'typed.py'
    typed.write_text("batch_size = 4\n\ncompile = 'yes'\n")
    msg = fails(defaults(), [str(typed)], capsys)
    assert f'{typed}:3' in msg and 'compile must be bool' in msg


def test_malformed_arguments(capsys):
    assert 'needs a value' in fails(defaults(), ['--batch_size'], capsys)
    # a misspelt bool flag alone is an unknown key, as a misspelt key with a value is
    assert "unknown config key 'compiel'; did you mean compile?" in fails(defaults(), ['--compiel', '--n_layer=2'],
                                                                         capsys)
    assert 'neither a config file' in fails(defaults(), ['batch_size=3'], capsys)
    assert 'write it as --batch_size=3' in fails(defaults(), ['batch_size=3'], capsys)  # Hydra's habit, our key
    assert 'write it as --batch_size=3' in fails(defaults(), ['-batch_size=3'], capsys)  # one dash, our key
    assert 'write cfg.py without --config' in fails(defaults(), ['--config', 'cfg.py'], capsys)
    # minGPT-DDP's gpt2_train_cfg.yaml: not "write it without --config", which is then no config file either
    assert 'first: a *.py or *.toml one (a YAML' in fails(defaults(), ['--config', 'gpt2_train_cfg.yaml'], capsys)
    assert 'cannot read config file' in fails(defaults(), ['nope.py'], capsys)
    # nnScaler's path to nanoGPT's config (its checkout beside): ours of that name
    msg = fails(defaults(), ['nanoGPT/config/train_shakespeare_char.py'], capsys)
    assert msg.endswith(f"here {os.path.join(REPO, 'config', 'train_shakespeare_char.py')}") or \
        msg.endswith(': here config/train_shakespeare_char.py'), msg


def test_help_alone_prints_the_keys_and_a_value_of_h_is_a_value(capsys):
    with pytest.raises(SystemExit) as e:
        configure(defaults(), ['--n_layer=2', '-h'])
    assert e.value.code == 0 and '--n_layer=12' in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:  # --help takes no value: the file after it is not one
        configure(defaults(), ['--help', 'config/train_shakespeare_char.py'])
    assert e.value.code == 0 and '--n_layer=12' in capsys.readouterr().out
    ns = defaults()
    configure(ns, ['--out_dir', '-h'])
    assert ns['out_dir'] == '-h'


def test_bool_values_in_lower_case_as_argparse_users_write_them():
    ns = dict(defaults(), eval_only=False, bias=True)
    configure(ns, ['--compile', 'false', '--eval_only=true', '--bias', 'False'])
    assert (ns['compile'], ns['eval_only'], ns['bias']) == (False, True, False)


def test_config_file_may_run_another_by_its_own_path(tmp_path):
    # config/train_shakespeare_char.py takes the CPU recipe's file this way when there is no GPU
    (tmp_path / 'small.py').write_text("batch_size = 2\ncompile = False\n")
    cfg_file = tmp_path / 'auto.py'
    cfg_file.write_text("import os\nn_layer = 4\n_small = os.path.join(os.path.dirname(__file__), 'small.py')\n"
                        "with open(_small) as _f:\n    exec(_f.read())\n")
    ns = defaults()
    config, given = configure(ns, [str(cfg_file)])
    assert (ns['batch_size'], ns['compile'], ns['n_layer']) == (2, False, 4)
    assert given == {'batch_size', 'compile', 'n_layer'}


def test_config_file_that_is_not_utf8_names_its_line(tmp_path, capsys):
    latin = tmp_path / 'latin.py'
    latin.write_bytes("batch_size = 4\nout_dir = 'caf\u00e9'\n".encode('latin-1'))
    msg = fails(defaults(), [str(latin)], capsys)
    assert msg == f"error: {latin}:2: not UTF-8 (byte 0xe9): save the config file as UTF-8"
    bom = tmp_path / 'bom.py'  # a byte-order mark, as some editors write, is UTF-8 all the same
    bom.write_bytes(b'\xef\xbb\xbfbatch_size = 4\n')
    ns = defaults()
    configure(ns, [str(bom)])
    assert ns['batch_size'] == 4


@pytest.mark.parametrize('body, code', [("import sys\nsys.exit(0)\n", '0'), ("exit()\n", 'None'),
                                        ("raise SystemExit('bye')\n", "'bye'")])
def test_config_file_that_exits_is_an_error_not_a_finished_run(tmp_path, capsys, body, code):
    cfg = tmp_path / 'exits.py'
    cfg.write_text("batch_size = 4\n" + body)
    msg = fails(defaults(), [str(cfg)], capsys)
    line = body.count('\n') + 1
    assert msg == (f"error: {cfg}:{line}: the config file calls sys.exit({code}): a config file only sets keys; "
                   f"remove the exit")


def test_exception_with_a_multi_line_message_stays_one_line(tmp_path, capsys):
    cfg = tmp_path / 'multi.py'
    cfg.write_text("raise ValueError('first\\nsecond')\n")
    assert fails(defaults(), [str(cfg)], capsys) == f"error: {cfg}:1: ValueError: first"


def check_fails(check, config):
    with pytest.raises(SystemExit) as e:
        check(config)
    assert e.value.code not in (0, None) and '\n' not in str(e.value.code)
    return str(e.value.code)


@pytest.mark.parametrize('config, message', [
    (dict(n_layer=0), 'error: n_layer=0 must be 1 or more'),
    (dict(n_head=-2), 'error: n_head=-2 must be 1 or more'),
    (dict(n_head=0, n_embd=32), 'error: n_head=0 must be 1 or more'),  # before the modulo that would divide by 0
    (dict(n_embd=0), 'error: n_embd=0 must be 1 or more'),
    (dict(block_size=-1), 'error: block_size=-1 must be 1 or more'),
    (dict(vocab_size=0), 'error: vocab_size=0 must be 1 or more'),
    (dict(n_embd=100, n_head=12), 'error: n_embd=100 is not a multiple of n_head=12: each head takes n_embd / n_head '
                                  'channels; use n_embd=96, or an n_head that divides 100'),
    (dict(n_embd=5, n_head=12), 'use n_embd=12,'),
    (dict(dropout=1.0), 'error: dropout=1.0 must be at least 0 and below 1'),
    (dict(dropout=-0.1), 'error: dropout=-0.1 must be at least 0 and below 1'),
    (dict(dropout=float('nan')), 'error: dropout=nan must be'),
])
def test_check_model_shape_names_the_key_and_the_fix(config, message):
    assert message in check_fails(check_model_shape, config)


def test_check_model_shape_passes_good_shapes_and_ignores_missing_keys():
    check_model_shape(dict(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=65, dropout=0.0, bias=True))
    check_model_shape(dict(n_embd=100))  # no n_head here to divide it
    check_model_shape({})


@pytest.mark.parametrize('config, message', [
    (dict(learning_rate=-1e-3), 'error: learning_rate=-0.001 must be 0 or more'),
    (dict(weight_decay=-0.1), 'error: weight_decay=-0.1 must be 0 or more'),
    (dict(grad_clip=-1.0), 'error: grad_clip=-1.0 must be 0 or more (0 turns clipping off)'),
    (dict(beta1=1.0), 'error: beta1=1.0 must be at least 0 and below 1'),
    (dict(beta2=-0.5), 'error: beta2=-0.5 must be at least 0 and below 1'),
])
def test_check_optimizer_names_the_key_and_the_fix(config, message):
    assert message in check_fails(check_optimizer, config)
    check_optimizer(dict(learning_rate=0.0, weight_decay=0.0, grad_clip=0.0, beta1=0.0, beta2=0.99))


def test_a_path_from_home_is_the_home_folder_s_not_a_folder_named_tilde(tmp_path, monkeypatch):
    # bash expands ~ only at a word's start or in an assignment: --out_dir=~/runs/x reaches the script as it is
    monkeypatch.setenv('HOME', str(tmp_path))
    cfg_file = tmp_path / 'c.py'
    cfg_file.write_text("init_from = '~/runs/a/ckpt.pt'\n")
    ns = dict(defaults(), init_from='scratch', wandb_run_name='gpt2')
    configure(ns, ['--out_dir=~/runs/x', str(cfg_file), '--wandb_run_name=~x'])
    assert (ns['out_dir'], ns['init_from']) == (f'{tmp_path}/runs/x', f'{tmp_path}/runs/a/ckpt.pt')
    assert ns['wandb_run_name'] == '~x'  # not a path from a home
