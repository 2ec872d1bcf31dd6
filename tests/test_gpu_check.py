"""tests/gpu_check.py, the one command that proves and measures every entrypoint on a GPU, run end to end on CPU at
tiny sizes (--dry_run), so that its own logic is proven before a GPU run relies on it. One entrypoint here: the
others go through the same lines of the script, and each has its own tests in this suite."""

import itertools
import json
import re
import subprocess
import sys
import tarfile

import pytest

from conftest import REPO, SHAKESPEARE, env, run


def gpu_check(tmp_path, *args):
    """tests/gpu_check.py --dry_run with args, started at once in tmp_path (its --out in tmp_path/out, its temporary
    folders in tmp_path/tmp): a Popen."""
    (tmp_path / 'tmp').mkdir()
    return subprocess.Popen([sys.executable, str(REPO / 'tests' / 'gpu_check.py'), '--dry_run', *args,
                             f'--input={SHAKESPEARE}', f'--out={tmp_path / "out"}'], cwd=tmp_path,
                            env={**env(), 'TMPDIR': str(tmp_path / 'tmp')},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finished(popen, timeout=600):
    try:
        stdout, stderr = popen.communicate(timeout=timeout)
    finally:
        popen.kill()
    return subprocess.CompletedProcess(popen.args, popen.returncode, stdout, stderr)


@pytest.fixture(scope='module')
def dry_runs(tmp_path_factory):
    """The two dry runs that take long, both started before either is waited for: each runs one process at a time
    (part A three, --jobs), on a CPU the other leaves half idle. {name: (its folder, its Popen)}."""
    runs = {'all': ['--entrypoints=train.py'],
            'only': ['--entrypoints=train.py', '--parts=ABL', '--only=zero_stage=3,bench.py batch,fused_qkv']}
    folders = {name: tmp_path_factory.mktemp(f'gpu_check-{name}') for name in runs}
    started = {name: (folders[name], gpu_check(folders[name], *args)) for name, args in runs.items()}
    yield started
    for _, popen in started.values():  # a test that failed early, or was not selected, leaves its run going
        popen.kill()
        popen.wait()


def test_gpu_check_dry_run_passes_every_part_and_prints_the_table(dry_runs):
    tmp_path, popen = dry_runs['all']
    p = finished(popen)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads((tmp_path / 'out' / 'table.json').read_text())
    checks = {what: (ok, figure) for part, what, ok, figure in rows}
    assert {part for part, *_ in rows} == {'A', 'B', 'L', 'C'}
    assert all(ok for ok, _ in checks.values()), rows
    # part B's profile says where the device's time went, and train.py's own log for config/train_gpt2.py was read
    assert checks['profile at batch 2'][1].startswith('busy ') and 'matmul ' in checks['profile at batch 2'][1]
    assert checks['train.py config/train_gpt2.py'][1].endswith(' tok/s')
    bf16 = ' --batch_size=8 --gradient_accumulation_steps=1 --autocast_residual=True --dtype=bfloat16'
    assert checks['train.py config/train_gpt2.py' + bf16][1].endswith(' tok/s')
    # part C's memory: the run's peak (on CPU the process's) beside model_size.py's estimate for the mode
    assert 'MiB (model_size.py: ' in checks['train.py speed'][1] and '; peak ' in checks['train.py speed'][1]
    assert re.fullmatch(r'fwd\+bwd [\d.]+ vs [\d.]+, AdamW [\d.]+ vs [\d.]+, clip [\d.]+ vs [\d.]+, '
                        r'AdamW on the shards [\d.]+',
                        checks['host ms per part, plain vs FSDP2'][1])
    # part C's trace of optimizer steps 20 to 30 (the device's share of the step, on CPU the ops'), before the host's
    trace = re.search(r'; in ops ([\d.]+) ms a step \((\d+)%\), (\d+) ops a step, most: (.+); host ',
                      checks['train.py speed'][1])
    assert trace and float(trace[1]) > 0 and int(trace[3]) > 50 and 'aten::' in trace[4], checks['train.py speed']
    # part C's host profile: py-spy on the worker as it ran, its main thread's busy share and the loop's frames
    host = checks['train.py speed'][1].split('; host ')[1]
    assert re.fullmatch(r'\d+% busy, \d+ samples: .+ \d+%', host) and re.search(r'train\.py:\d+ \d+%', host), host
    with tarfile.open(tmp_path / 'out' / 'logs-ABLC.tar.gz') as logs:
        assert {'./host-train.txt', './host-train-busy.txt', './host-train.log'} <= set(logs.getnames())
    # part L's levers ran against the plain step and trained to its loss (fp32 on CPU: to rounding)
    for lever in ('fused_qkv', 'loss_rows', 'autocast_residual'):
        loss, plain = (float(x) for x in checks[lever][1].split('loss ')[1].split(' vs '))
        assert abs(loss - plain) <= 1e-4 * plain, checks[lever]
    # the resume row compares the two runs' last losses: equal, and real numbers
    last, uninterrupted = checks['train.py exact resume'][1].replace('last loss ', '').split(' vs ')
    assert float(last) == float(uninterrupted) and 0 < float(last) < 10
    assert checks['SIGKILL under elastic torchrun'][1] == 'resumed from the memory snapshot'
    assert p.stdout.splitlines()[-len(rows) - 2:-len(rows)] == ['| part | check | result | figure |',
                                                                '| --- | --- | --- | --- |']  # the table comes last
    # a device call brings back at most 8 files from its output folder: the table, the logs in one archive, a trace
    assert sorted(f.name for f in (tmp_path / 'out').iterdir()) == ['bench_trace.tar.gz', 'logs-ABLC.tar.gz',
                                                                   'table.json']
    # and its runs' folder (data, checkpoints, logs) is gone from the temporary folder: each run left 3 MB there
    assert not list((tmp_path / 'tmp').glob('gpu_check-*')), list((tmp_path / 'tmp').iterdir())


def test_gpu_check_fails_where_a_check_fails(tmp_path):
    # a missing input text: prepare.py fails, and so does the check, in one line, before any run
    p = subprocess.run([sys.executable, str(REPO / 'tests' / 'gpu_check.py'), '--dry_run', '--entrypoints=train.py',
                        f'--input={tmp_path / "nope.txt"}', f'--out={tmp_path / "out"}'], cwd=tmp_path, env=env(),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode != 0 and p.stderr.strip().startswith('error: no ') and len(p.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize('limits', [['--parts=AL', '--deadline=1'], ['--parts=A:1,L:1']])
def test_gpu_check_keeps_its_deadline_and_still_prints_the_table(tmp_path, limits):
    # a GPU machine runs one command for at most 10 minutes: a part cut short by --deadline, or by its own seconds,
    # says which checks it did not reach, in the table, and fails
    p = subprocess.run([sys.executable, str(REPO / 'tests' / 'gpu_check.py'), '--dry_run', '--entrypoints=train.py',
                        *limits, f'--input={SHAKESPEARE}', f'--out={tmp_path / "out"}'],
                       cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    rows = json.loads((tmp_path / 'out' / 'table.json').read_text())
    assert {part for part, *_ in rows} == {'A', 'L'} and len(rows) == 7
    assert all(not ok and figure == 'not reached: the deadline came first' for _, _, ok, figure in rows), rows
    assert p.stdout.splitlines()[-1].startswith('| L | plain step')


@pytest.mark.parametrize('parts', ['ABX', 'A:1,Q:2', 'A:ten', 'AB:5'])
def test_gpu_check_refuses_parts_it_does_not_know_in_one_line(tmp_path, parts):
    p = subprocess.run([sys.executable, str(REPO / 'tests' / 'gpu_check.py'), '--dry_run', f'--parts={parts}',
                        f'--input={SHAKESPEARE}', f'--out={tmp_path / "out"}'], cwd=tmp_path, env=env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and p.stderr.strip().startswith(f'error: --parts={parts}: ') and \
        len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / 'out').exists()


def test_a_run_out_of_time_is_stopped_with_the_workers_torchrun_started_in_sessions_of_their_own(tmp_path):
    # gpu_check.py stops a run at its part's end or its deadline and then reads its output to the end: torchrun's
    # worker (its own session) and a process the worker started (as inductor's compile workers) must go too, or
    # they hold the pipe, and the GPU, until their run is done
    sys.path.insert(0, str(REPO / 'tests'))
    from proctree import stop
    (tmp_path / 'worker.py').write_text(
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)', sys.argv[0]])\n"
        "print('started', flush=True)\n"
        "time.sleep(300)\n")
    p = subprocess.Popen([sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node=1',
                          str(tmp_path / 'worker.py')], cwd=tmp_path, env=env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        for line in p.stdout:
            if 'started' in line:
                break
        stop(p.pid)
        p.communicate(timeout=30)  # the pipe closes: nothing that holds it is left
        ps = subprocess.run(['pgrep', '-f', str(tmp_path / 'worker.py')], capture_output=True, text=True)  # all 3
        assert ps.stdout == '' and p.returncode == -9
    finally:
        subprocess.run(['pkill', '-9', '-f', str(tmp_path)])
        p.kill()


def test_gpu_check_runs_only_the_checks_named(dry_runs):
    # a later GPU call runs what an earlier one did not reach, and nothing it did: here part B's bench.py alone (part
    # A's ZeRO-3 check is of ds_train.py, which --entrypoints leaves out), and of part L's levers one, against the
    # plain step timed before and after it, the first time by part B's run of its batch
    tmp_path, popen = dry_runs['only']
    p = finished(popen)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads((tmp_path / 'out' / 'table.json').read_text())
    assert [(part, what, ok) for part, what, ok, _ in rows] == [
        ('B', 'bench.py batch 2', True), ('L', 'plain step, batch 2', True), ('L', 'fused_qkv', True),
        ('L', 'plain step again (the spread)', True)]
    assert rows[0][3] == rows[1][3]  # one run's figure
    with tarfile.open(tmp_path / 'out' / 'logs-ABL.tar.gz') as logs:  # a log a run: these and no other
        assert sorted(logs.getnames()) == ['.', './bench-b2.log', './lever-fused_qkv.log', './lever-plain-again.log',
                                           './prepare.log']


def test_host_profile_counts_the_main_and_autograd_threads_samples_in_the_loops_lines_and_functions_each_once(
        tmp_path):
    sys.path.insert(0, str(REPO / 'tests'))
    from hostprofile import summary
    # py-spy record --threads -f raw: a stack a line, the thread first, the count last; the script run by a wrapper
    loop = 'thread (7): MainThread;<module> (peak_wrapper.py:5);run_path (<frozen runpy>:291);<module> (train.py:'
    (tmp_path / 'all.txt').write_text(
        f"{loop}340);backward (torch/_tensor.py:623);backward (torch/_tensor.py:600) 4\n"  # in it twice: once
        f"{loop}340);backward (torch/_tensor.py:623);post_backward (fsdp/_fsdp_param_group.py:400) 2\n"
        f"{loop}363) 3\n"  # .item() waits for the device: C under the loop's line
        f"{loop}336);_call_impl (torch/nn/modules/module.py:1789);forward (model.py:192) 1\n"
        "thread (7): MainThread;named_modules (torch/nn/modules/module.py:2881) 1\n"  # torn: in no line of the loop
        "thread (9): Thread-1 (beat);run (threading.py:982);beat (runlock.py:109) 40\n"  # Python's: not the host's
        # the autograd engine's thread (started in C++: no name), working while the main thread waits in backward
        "thread (11);apply (torch/autograd/function.py:317);post_backward (fsdp/_fsdp_param_group.py:400) 3\n"
        "thread (11) 5\n")  # idle: no frames
    (tmp_path / 'busy.txt').write_text(
        f"{loop}340);backward (torch/_tensor.py:623) 5\n"
        "thread (9): Thread-1 (beat);beat (runlock.py:109) 40\n"
        "thread (11);apply (torch/autograd/function.py:317);post_backward (fsdp/_fsdp_param_group.py:400) 3\n")
    total, busy, top = summary(tmp_path / 'all.txt', tmp_path / 'busy.txt', 'train.py')
    assert total == 11 and busy == (5 + 3) / 11  # the main thread's samples, busy in it or in the engine's
    # backward twice in a stack counts once; of _call_impl and forward, in the same stacks, the inner one is kept;
    # the engine's frames count where they are
    assert top == [('train.py:340', 6 / 11), ('backward (torch/_tensor.py)', 6 / 11),
                   ('post_backward (fsdp/_fsdp_param_group.py)', 5 / 11), ('train.py:363', 3 / 11),
                   ('apply (torch/autograd/function.py)', 3 / 11), ('train.py:336', 1 / 11),
                   ('forward (model.py)', 1 / 11)]


SCRIPTS = ['train.py', 'fsdp_train.py', 'ds_train.py', 'decent_train.py', 'pp_train.py', 'bench.py', 'sample.py',
           'eval_hellaswag.py']


@pytest.mark.parametrize('script', SCRIPTS)
def test_the_matmul_precision_a_script_sets_on_cuda_is_one_max_autotune_can_read(tmp_path, script):
    # inductor's max-autotune asks torch.get_float32_matmul_precision(), which raises once torch.backends' newer
    # fp32_precision settings were used (an H100 run of bench.py --compile_mode=max-autotune-no-cudagraphs died so).
    # The lines each script runs on CUDA alone are run here, on CPU, and then the getter.
    lines = (REPO / script).read_text().splitlines()
    start = lines.index("if device_type == 'cuda':") + 1
    block = [line.strip() for line in itertools.takewhile(lambda line: line.startswith('    '), lines[start:])]
    assert any('precision' in line for line in block), f"{script}: no matmul precision set under device_type == 'cuda'"
    # in a process of its own, forked from run()'s server: torch imported, none of its settings touched
    (tmp_path / 'cuda_lines.py').write_text('\n'.join(['import torch'] + block +
                                                      ['print(torch.get_float32_matmul_precision())']))
    r = run(tmp_path / 'cuda_lines.py', cwd=tmp_path)
    assert r.stdout.strip() == 'high'


def test_host_time_prints_each_parts_host_time_plain_and_under_fsdp(tmp_path):
    r = run('tests/host_time.py', '--n_layer=2', '--iters=3', cwd=tmp_path)
    lines = r.stdout.splitlines()
    rows = {line.split()[0]: [float(ms) for ms in line.split()[1:]] for line in lines[2:4]}
    assert list(rows) == ['plain', 'fsdp'] and all(len(ms) == 3 and all(t > 0 for t in ms) for ms in rows.values())
    assert re.fullmatch(r' +AdamW on its shards \(--adamw_on_shards=True\): [\d.]+', lines[4]) and len(lines) == 5
