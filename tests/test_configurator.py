import pytest

from configurator import configure


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
    assert 'neither a config file' in fails(defaults(), ['batch_size=3'], capsys)
    assert 'cannot read config file' in fails(defaults(), ['nope.py'], capsys)


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
