"""The k8s/ manifests, checked offline (CI has no cluster): yamllint; built-in kinds with kubernetes-validate in
strict mode; Kubeflow's PyTorchJob and DLRover's ElasticJob against the openAPIV3Schema of their CRDs in
../shared/k8s-crds; TensorStack's PyTorchTrainingJob against the schema below; and every container's command
against the repo (the script exists, the launcher takes its options, the configurator takes its arguments).
Each broken manifest in the last tests is rejected by these same checks."""

import contextlib
import copy
import fnmatch
import io
import os
import re
import runpy
import shlex
import subprocess
import sys
from unittest import mock

import jsonschema
import kubernetes_validate
import pytest
import yaml
from yamllint import linter
from yamllint.config import YamlLintConfig

from conftest import REPO

sys.path.insert(0, str(REPO))
import configurator  # noqa: E402

CRDS = REPO.parent / 'shared' / 'k8s-crds'
MANIFESTS = sorted((REPO / 'k8s').glob('*.yaml'))
K8S_VERSION = kubernetes_validate.latest_version()
LINT = YamlLintConfig('{extends: default, rules: {line-length: {max: 120}, document-start: disable}}')
IMAGE = 'gpt-train:latest'
WORKDIR = '/workspace'  # k8s/Dockerfile's; the manifests name the repo's files relative to it

# TensorStack publishes no CRD for PyTorchTrainingJob. This schema holds the fields that its user manual's page
# on the kind shows (spec.torchrunConfig, spec.replicaSpecs[*], spec.runPolicy, spec.scheduler, spec.elastic),
# with the types and values the page gives, closed like the CRD schemas below so that a misspelt field is an
# error; the pod templates are checked as Kubernetes PodTemplateSpecs. spec.elastic (ElasticConfig) and
# spec.scheduler.t9kScheduler checked again on 2026-11-24 against the manual's page and its API reference.
COUNT = {'type': 'integer', 'minimum': 0}
T9K_SCHEMA = {
    'type': 'object', 'required': ['apiVersion', 'kind', 'metadata', 'spec'], 'additionalProperties': False,
    'properties': {
        'apiVersion': {'const': 'batch.tensorstack.dev/v1beta1'},
        'kind': {'const': 'PyTorchTrainingJob'},
        'metadata': {'type': 'object'},
        'spec': {'type': 'object', 'required': ['replicaSpecs'], 'additionalProperties': False, 'properties': {
            'torchrunConfig': {'type': 'object', 'required': ['enabled'], 'additionalProperties': False, 'properties': {
                'enabled': {'type': 'boolean'},
                'maxRestarts': COUNT,
                'procPerNode': {'type': 'string', 'pattern': '^([0-9]+|gpu)$'},  # a number, or one per GPU
                'rdzvBackend': {'enum': ['c10d', 'etcd', 'etcd-v2']},
                'extraOptions': {'type': 'array', 'items': {'type': 'string'}}}},
            'replicaSpecs': {'type': 'array', 'minItems': 1, 'items': {
                'type': 'object', 'required': ['type', 'replicas', 'template'], 'additionalProperties': False,
                'properties': {
                    'type': {'enum': ['worker']},
                    'replicas': {'type': 'integer', 'minimum': 1},
                    'restartPolicy': {'enum': ['Never', 'OnFailure', 'Always', 'ExitCode']},
                    'template': {'type': 'object'}}}},
            'runPolicy': {'type': 'object', 'additionalProperties': False, 'properties': {
                'backoffLimit': COUNT, 'activeDeadlineSeconds': {'type': 'integer', 'minimum': 1}}},
            'scheduler': {'type': 'object', 'additionalProperties': False, 'properties': {
                't9kScheduler': {'type': 'object', 'additionalProperties': False, 'properties': {
                    'queue': {'type': 'string'}, 'priority': {'type': 'integer'}}}}},
            'elastic': {'type': 'object', 'additionalProperties': False, 'properties': {
                'enabled': {'type': 'boolean'}, 'minReplicas': COUNT, 'maxReplicas': COUNT,
                'expectedReplicas': COUNT}}}}}}


def closed(schema):
    """A CRD schema in which every object with listed properties refuses others. The API server only drops
    unknown fields (or refuses them with strict field validation); a validator has to be told."""
    if isinstance(schema, dict):
        schema = {k: closed(v) for k, v in schema.items()}
        if ('properties' in schema and 'additionalProperties' not in schema
                and not schema.get('x-kubernetes-preserve-unknown-fields')):
            schema['additionalProperties'] = False
    elif isinstance(schema, list):
        schema = [closed(v) for v in schema]
    return schema


def crd_schema(name):
    crd = yaml.safe_load((CRDS / name).read_text())
    (version,) = [v for v in crd['spec']['versions'] if v['storage']]
    api_version = f"{crd['spec']['group']}/{version['name']}"
    return (api_version, crd['spec']['names']['kind']), closed(version['schema']['openAPIV3Schema'])


@pytest.fixture(scope='module')
def schemas():
    assert CRDS.is_dir(), f"{CRDS} is missing: the tests need ../shared beside the repo"
    found = dict(crd_schema(f) for f in ('kubeflow.org_pytorchjobs.yaml', 'elastic.iml.github.io_elasticjobs.yaml'))
    found[('batch.tensorstack.dev/v1beta1', 'PyTorchTrainingJob')] = T9K_SCHEMA
    return found


# -----------------------------------------------------------------------------
# the checks: each returns a list of problems, empty for a good manifest

def lint_problems(text):
    return [f"yamllint: line {p.line}: {p.desc} ({p.rule})" for p in linter.run(text, LINT)]


def schema_problems(doc, schemas):
    key = (doc.get('apiVersion'), doc.get('kind'))
    if key in schemas:
        errors = sorted(jsonschema.Draft202012Validator(schemas[key]).iter_errors(doc), key=str)
        found = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors]
        # the CRDs leave metadata to the API server: check it as an ObjectMeta
        return found + built_in_problems({'apiVersion': 'v1', 'kind': 'ConfigMap', 'metadata': doc.get('metadata')})
    return built_in_problems(doc)


def built_in_problems(doc):
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{'.'.join(map(str, e.path))}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [f"unknown kind: {e.message}"]
    return []


def pod_templates(doc):
    """(where, template, argv launcher override) of each pod a manifest describes."""
    spec, kind = doc.get('spec') or {}, doc.get('kind')
    if kind == 'Job':
        return [('spec.template', spec.get('template') or {}, None)]
    if kind == 'PyTorchJob':
        return [(f'spec.pytorchReplicaSpecs.{name}.template', r.get('template') or {}, None)
                for name, r in (spec.get('pytorchReplicaSpecs') or {}).items()]
    if kind == 'ElasticJob':
        return [(f'spec.replicaSpecs.{name}.template', r.get('template') or {}, None)
                for name, r in (spec.get('replicaSpecs') or {}).items()]
    if kind == 'PyTorchTrainingJob':
        torchrun = spec.get('torchrunConfig') or {}
        # with torchrun on, the controller runs `torchrun <its settings> <extraOptions> <args>`, not the command
        launcher = ['torchrun', *torchrun.get('extraOptions', [])] if torchrun.get('enabled') else None
        return [(f'spec.replicaSpecs[{i}].template', r.get('template') or {}, launcher)
                for i, r in enumerate(spec.get('replicaSpecs') or [])]
    return []


def pod_problems(where, template, launcher, kind, custom):
    found = []
    if custom:  # a built-in kind's pods were checked with it
        found += [f"{where}.{p.removeprefix('template.')}" for p in built_in_problems(
            {'apiVersion': 'v1', 'kind': 'PodTemplate', 'metadata': {'name': 'check'}, 'template': template})]
    spec = template.get('spec') or {}
    if kind == 'PyTorchJob' and 'pytorch' not in [c.get('name') for c in spec.get('containers') or []]:
        found.append(f"{where}: no container named pytorch, the one whose port the operator gives as MASTER_PORT")
    memory = {v.get('name') for v in spec.get('volumes') or [] if (v.get('emptyDir') or {}).get('medium') == 'Memory'}
    for c in spec.get('containers') or []:
        name = f"{where} container {c.get('name')}"
        if not any(m.get('mountPath') == '/dev/shm' and m.get('name') in memory for m in c.get('volumeMounts') or []):
            found.append(f"{name}: /dev/shm is not an in-memory emptyDir (NCCL needs more than the default 64 MB)")
        if c.get('image') != IMAGE:
            found.append(f"{name}: image {c.get('image')}, not k8s/Dockerfile's {IMAGE}")
        if c.get('workingDir', WORKDIR) != WORKDIR:
            found.append(f"{name}: workingDir {c['workingDir']}: the repo is at {WORKDIR}")
        argv = (launcher or c.get('command') or []) + (c.get('args') or [])
        env = {e.get('name') for e in c.get('env') or []}
        # the API server's check, which the schemas leave out: the fields that the downward API gives as a variable
        found += [f"{name}: env {e.get('name')}: {path} is not a field that the downward API gives a variable"
                  for e in c.get('env') or [] if (path := ((e.get('valueFrom') or {}).get('fieldRef') or {}).get(
                      'fieldPath')) and not re.fullmatch(DOWNWARD, path)]
        found += [f"{name}: {p}" for p in command_problems(argv, env, kind)]
    return found


# the pod's fields that a container's env may take (fieldRef), as Kubernetes' API reference lists them: no
# restart count of a container among them
DOWNWARD = (r"metadata\.(name|namespace|uid|(labels|annotations)\['[^']+'\])|spec\.(nodeName|serviceAccountName)"
            r"|status\.(hostIPs?|podIPs?)")

# what the operators set in every pod, which a command may refer to
INJECTED = {'PyTorchJob': {'MASTER_ADDR', 'MASTER_PORT', 'WORLD_SIZE', 'RANK'}, 'ElasticJob': {'NODE_NUM'}}
LAUNCHERS = ('python', 'python3', 'torchrun', 'dlrover-run')
DLROVER_OPTIONS = ('--network-check',)  # dlrover-run's own, on top of torchrun's


def split_command(argv):
    """(launcher, its options, script, the script's arguments, variables referred to) of a container's argv;
    a shell's -c string is split as the shell would."""
    if argv[:2] in (['/bin/bash', '-c'], ['bash', '-c'], ['sh', '-c']) and len(argv) == 3:
        refs = set(re.findall(r'\$\{?(\w+)', argv[2]))
        argv = shlex.split(argv[2])
    else:
        refs = {name for arg in argv for name in re.findall(r'\$\((\w+)\)', arg)}  # Kubernetes' $(VAR)
    launcher, rest = (argv or [''])[0], argv[1:]
    n_options = next((i for i, a in enumerate(rest) if not a.startswith('-')), len(rest))
    script, args = (rest[n_options:] or [''])[0], rest[n_options + 1:]
    return launcher, rest[:n_options], script, args, refs


class Configured(Exception):
    """What stops a script at its configure() call, with the config that call returned."""


def script_config(script, args):
    """The config that `python script *args` runs with. The script runs as itself, in this process, up to its
    configure() call (imports, defaults and, for prepare.py, its check of the dataset), which stops it with the
    config; bad arguments exit there with the script's one-line error."""
    def configure_and_stop(namespace, argv=None, **kwargs):
        raise Configured(real_configure(namespace, argv, **kwargs)[0])

    real_configure = configurator.configure
    with mock.patch.object(configurator, 'configure', configure_and_stop), \
            mock.patch.object(sys, 'argv', [str(script), *args]):
        try:
            runpy.run_path(str(script), run_name='__main__')
        except Configured as stopped:
            return stopped.args[0]
    raise AssertionError(f"{script} ran to its end without calling configure()")


def command_problems(argv, env, kind):
    """The launcher and its options, the script, and the script's arguments, as the configurator takes them."""
    launcher, options, script, args, refs = split_command(argv)
    found = [f"${r} is neither set in the container's env nor by the {kind} operator"
             for r in sorted(refs - env - INJECTED.get(kind, set()))]
    if launcher not in LAUNCHERS:
        return found + [f"command {launcher!r}: launch with one of {', '.join(LAUNCHERS)}"]
    if launcher in ('torchrun', 'dlrover-run'):
        from torch.distributed.run import get_args_parser
        torchrun_options = [o for o in options if launcher == 'torchrun' or o not in DLROVER_OPTIONS]
        usage = io.StringIO()
        try:
            with contextlib.redirect_stderr(usage):  # argparse's complaint, for the message
                get_args_parser().parse_args([*torchrun_options, 'script.py'])
        except SystemExit:
            found.append(f"{launcher} does not take {options}: {usage.getvalue().splitlines()[-1]} "
                         f"(write its options as --option=value)")
    elif options:
        found.append(f"python options {options}: name the script first")
    if not (REPO / script).is_file() or not script.endswith('.py'):
        return found + [f"{script!r} is not a script in the repo"]
    try:
        script_config(str(REPO / script), args)
    except SystemExit as e:
        found.append(f"{script}: {e.code}")
    return found


def doc_problems(docs, schemas):
    found = []
    for doc in docs:
        kind = doc.get('kind')
        custom = (doc.get('apiVersion'), kind) in schemas
        found += [f"{kind}: {p}" for p in schema_problems(doc, schemas)]
        for where, template, launcher in pod_templates(doc):
            found += [f"{kind}: {p}" for p in pod_problems(where, template, launcher, kind, custom)]
    return found


def load(path):
    text = path.read_text()
    return text, [d for d in yaml.safe_load_all(text) if d is not None]


# -----------------------------------------------------------------------------

@pytest.mark.parametrize('path', MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_manifest_passes_every_check(path, schemas, monkeypatch):
    monkeypatch.chdir(REPO)  # config files in the commands are relative to the image's working dir: the repo
    text, docs = load(path)
    assert docs, f"{path.name} holds no manifest"
    assert lint_problems(text) + doc_problems(docs, schemas) == []


def test_the_manifests_cover_each_launcher_and_share_one_volume():
    kinds = {(d['apiVersion'], d['kind']) for p in MANIFESTS for d in load(p)[1]}
    assert kinds == {('v1', 'PersistentVolumeClaim'), ('batch/v1', 'Job'), ('kubeflow.org/v1', 'PyTorchJob'),
                     ('elastic.iml.github.io/v1alpha1', 'ElasticJob'),
                     ('batch.tensorstack.dev/v1beta1', 'PyTorchTrainingJob')}
    docs = {p.name: load(p)[1][0] for p in MANIFESTS}
    assert docs['pytorchjob-elastic.yaml']['spec']['elasticPolicy']['rdzvBackend'] == 'c10d'
    assert docs['t9k-train.yaml']['spec']['torchrunConfig']['enabled'] is True
    rdma = docs['t9k-train-rdma.yaml']['spec']['replicaSpecs'][0]['template']['spec']['containers'][0]
    assert 'IPC_LOCK' in rdma['securityContext']['capabilities']['add']
    assert any(r.startswith('rdma/') for r in rdma['resources']['limits'])
    assert {'NCCL_IB_DISABLE', 'NCCL_IB_HCA'} <= {e['name'] for e in rdma['env']}
    # every volume the pods mount is the claim that k8s/pvc.yaml makes
    claims = {v['persistentVolumeClaim']['claimName'] for d in docs.values() for _, t, _ in pod_templates(d)
              for v in t['spec']['volumes'] if 'persistentVolumeClaim' in v}
    assert claims == {docs['pvc.yaml']['metadata']['name']}


def test_each_training_job_has_its_own_out_dir_and_resumes_from_it(monkeypatch):
    # a restarted pod runs the same command, and the entrypoint continues the run in its out_dir by itself
    # (auto_resume): two jobs on one out_dir would continue each other's runs
    monkeypatch.chdir(REPO)
    pairs = set()  # (job, out_dir), from every pod of every job
    for path in MANIFESTS:
        for doc in load(path)[1]:
            for _, template, launcher in pod_templates(doc):
                c = template['spec']['containers'][0]
                _, _, script, args, _ = split_command((launcher or c['command']) + c.get('args', []))
                if script != 'prepare.py':
                    config = script_config(script, args)
                    assert config['auto_resume'], (path.name, args)
                    # and a container restarted in its pod resumes the run that the pod trained, also where
                    # --auto_resume=False is put in (checkpoint.relaunched)
                    assert {'name': 'POD_UID', 'valueFrom': {'fieldRef': {'fieldPath': 'metadata.uid'}}} in c['env']
                    pairs.add((doc['metadata']['name'], config['out_dir']))
    jobs, out_dirs = {job for job, _ in pairs}, {d for _, d in pairs}
    assert len(jobs) == len(out_dirs) == len(pairs) == 11, sorted(pairs)  # one to one
    assert all(d.startswith('/mnt/gpt/out/') for d in out_dirs), out_dirs  # on the volume, not in the pod


def test_t9k_has_a_random_data_job_and_an_elastic_queued_one(monkeypatch):
    monkeypatch.chdir(REPO)
    docs = {p.name: load(p)[1][0] for p in MANIFESTS}
    random = first_container(docs['t9k-test-random-data.yaml'])
    config = script_config(random['args'][0], random['args'][1:])
    assert config['random_data'] is True and not any(a.startswith('--dataset') for a in random['args'])
    elastic = docs['t9k-elastic.yaml']['spec']
    assert elastic['torchrunConfig']['enabled'] is True  # T9k's elastic mode needs torchrun
    assert elastic['elastic'] == {'enabled': True, 'minReplicas': 1, 'maxReplicas': 2, 'expectedReplicas': 2}
    assert elastic['scheduler']['t9kScheduler']['queue'] and elastic['replicaSpecs'][0]['replicas'] == 2
    args = first_container(docs['t9k-elastic.yaml'])['args']
    config = script_config(args[0], args[1:])
    # the global batch's micro-steps divide over 1 or 2 pods of 8 ranks, and a restarted group has a snapshot
    assert config['gradient_accumulation_steps'] % 16 == 0 and config['save_memory_interval'] > 0


def test_dockerfile_puts_the_repo_where_the_manifests_run():
    lines = [line.split(maxsplit=1) for line in (REPO / 'k8s' / 'Dockerfile').read_text().splitlines()
             if line.strip() and not line.startswith('#')]
    steps = [(words[0], words[1] if len(words) > 1 else '') for words in lines if words[0].isupper()]
    assert ('WORKDIR', WORKDIR) in steps
    assert steps.index(('WORKDIR', WORKDIR)) < steps.index(('COPY', '. .'))
    assert ('RUN', 'pip install --no-cache-dir -r requirements.txt') in steps
    # nothing a manifest runs is left out of the image by .dockerignore
    ignored = [p for p in (REPO / '.dockerignore').read_text().split('\n') if p and not p.startswith('#')]
    needed = ['train.py', 'fsdp_train.py', 'ds_train.py', 'prepare.py', 'configurator.py', 'model.py', 'checkpoint.py',
              'data.py', 'config/train_gpt2.py', 'requirements.txt']
    assert not [(n, p) for n in needed for p in ignored if fnmatch.fnmatch(n, p) or n.startswith(p + '/')]


def test_every_documented_kubectl_command_runs_the_image_from_a_registry():
    # the manifests name the image as k8s/Dockerfile's tag, gpt-train:latest, which no node can pull: a command
    # that hands kubectl the file as it is leaves the pods in ImagePullBackOff; the docs' apply() puts the
    # registry in first (sed ... | kubectl apply -f -)
    given = []
    for path in [REPO / 'README.md', *sorted((REPO / 'docs').glob('*.md')), *MANIFESTS]:
        for line in path.read_text().splitlines():
            for command in re.findall(r'kubectl [^`|;&]*', line):
                given += [(path.name, command.strip(), name) for name in re.findall(r'-f (k8s/[\w.-]+\.yaml)', command)]
    assert given  # the docs do hand manifests to kubectl
    with_image = [(where, command) for where, command, name in given if IMAGE in (REPO / name).read_text()]
    assert with_image == [], with_image

# kubectl wait against a job whose true conditions are the lines of $JOB_CONDITIONS: it waits until its condition
# is one of them, or for --timeout=Ns (a longer one: for good; 0: it looks once), as kubectl waits on a cluster
FAKE_KUBECTL = """#!/bin/sh
[ "$1" = get ] && exit 0
for a; do case $a in --for=condition=*) c=${a#--for=condition=};; --timeout=*) t=${a#--timeout=};; esac; done
n=0
while ! grep -qix "$c" "$JOB_CONDITIONS"; do
  case $t in 0|*s) [ "$n" -ge "${t%s}" ] && { echo 'error: timed out waiting for the condition' >&2; exit 1; };; esac
  sleep 1; n=$((n + 1))
done
echo "$2 condition met"
"""


def test_the_documented_wait_for_the_data_job_ends_when_the_job_fails(tmp_path):
    """The docs waited for the data job with `kubectl wait --for=condition=complete --timeout=24h`: a job that failed
    (its backoffLimit spent) was waited for 24 hours. Each documented wait ends as the job does: 0 once it
    completes, 1 with a line saying so once it fails."""
    (tmp_path / 'bin').mkdir()
    (tmp_path / 'bin' / 'kubectl').write_text(FAKE_KUBECTL)
    (tmp_path / 'bin' / 'kubectl').chmod(0o755)
    e = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", JOB_CONDITIONS=str(tmp_path / 'job'))
    waits = [(path.name, line.lstrip('# ')) for path in (REPO / 'README.md', REPO / 'docs' / 'cluster.md',
                                                         REPO / 'k8s' / 'prepare-openwebtext.yaml')
             for line in path.read_text().splitlines() if 'wait' in line and 'job/prepare-openwebtext' in line]
    assert [where for where, _ in waits] == ['README.md', 'cluster.md', 'prepare-openwebtext.yaml'], waits
    for where, command in waits:
        for conditions, code, says in (('Complete', 0, ''), ('FailureTarget\nFailed', 1, 'failed')):
            (tmp_path / 'job').write_text(conditions + '\n')
            try:
                p = subprocess.run(['bash', '-c', command], cwd=REPO, env=e, capture_output=True, text=True,
                                   timeout=15)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{where}: {command} still waits for a job that ended ({conditions!r})")
            assert p.returncode == code and says in p.stderr, (where, command, p.stderr)
    (tmp_path / 'job').write_text('')  # running still: the time given is up
    p = subprocess.run(['k8s/wait-job.sh', 'job/prepare-openwebtext', '1s'], cwd=REPO, env=e, capture_output=True,
                       text=True, timeout=15)
    assert p.returncode == 1 and p.stderr == 'error: job/prepare-openwebtext has not ended in 1s: it runs on; wait ' \
        'again, or look with kubectl logs job/prepare-openwebtext\n', p.stderr


# -----------------------------------------------------------------------------
# broken manifests: a change a person could make by mistake, and the words the checks reject it with

def first_container(doc):
    return pod_templates(doc)[0][1]['spec']['containers'][0]


def replace_arg(old, new):
    def edit(doc):
        c = first_container(doc)
        key = 'args' if old in ' '.join(c.get('args') or []) else 'command'
        c[key] = [a.replace(old, new) for a in c[key]]
    return edit


BROKEN = {
    'pytorchjob replicas as a string': ('pytorchjob-train.yaml', "is not of type 'integer'",
                                        lambda d: d['spec']['pytorchReplicaSpecs']['Worker'].update(replicas='1')),
    'pytorchjob misspelt restartPolicy': ('pytorchjob-train.yaml', "'restartPolicyy' was unexpected",
                                          lambda d: d['spec']['pytorchReplicaSpecs']['Master'].update(
                                              restartPolicyy=d['spec']['pytorchReplicaSpecs']['Master'].pop(
                                                  'restartPolicy'))),
    'pytorchjob misspelt elasticPolicy field': ('pytorchjob-elastic.yaml', "'minReplica' was unexpected",
                                                lambda d: d['spec']['elasticPolicy'].update(minReplica=1)),
    'pytorchjob container renamed': ('pytorchjob-elastic.yaml', 'no container named pytorch',
                                     lambda d: first_container(d).update(name='trainer')),
    'pytorchjob misspelt metadata': ('pytorchjob-fsdp.yaml', "'nmae' was unexpected",
                                     lambda d: d['metadata'].update(nmae=d['metadata'].pop('name'))),
    'elasticjob replicas as a string': ('elasticjob-train.yaml', "is not of type 'integer'",
                                        lambda d: d['spec']['replicaSpecs']['worker'].update(replicas='2')),
    'elasticjob misspelt volumeMounts': ('elasticjob-train.yaml', "'volumeMount' was unexpected",
                                         lambda d: first_container(d).update(
                                             volumeMount=first_container(d).pop('volumeMounts'))),
    'job backoffLimit as a string': ('prepare-openwebtext.yaml', "is not of type 'integer'",
                                     lambda d: d['spec'].update(backoffLimit='3')),
    'job misspelt command': ('prepare-openwebtext-10k.yaml', "'comand' was unexpected",
                             lambda d: first_container(d).update(comand=first_container(d).pop('command'))),
    'pvc misspelt accessModes': ('pvc.yaml', "'accessMode' was unexpected",
                                 lambda d: d['spec'].update(accessMode=d['spec'].pop('accessModes'))),
    't9k replicas as a string': ('t9k-train.yaml', "is not of type 'integer'",
                                 lambda d: d['spec']['replicaSpecs'][0].update(replicas='2')),
    't9k misspelt torchrunConfig field': ('t9k-train.yaml', "'enable' was unexpected",
                                          lambda d: d['spec']['torchrunConfig'].update(
                                              enable=d['spec']['torchrunConfig'].pop('enabled'))),
    't9k misspelt pod field': ('t9k-train-rdma.yaml', "'securityContex' was unexpected",
                               lambda d: first_container(d).update(
                                   securityContex=first_container(d).pop('securityContext'))),
    't9k misspelt elastic field': ('t9k-elastic.yaml', "'minReplica' was unexpected",
                                   lambda d: d['spec']['elastic'].update(minReplica=d['spec']['elastic'].pop(
                                       'minReplicas'))),
    't9k misspelt queue field': ('t9k-elastic.yaml', "'queu' was unexpected",
                                 lambda d: d['spec']['scheduler']['t9kScheduler'].update(queu='default')),
    'no /dev/shm in memory': ('t9k-test-openwebtext-10k.yaml', '/dev/shm is not an in-memory emptyDir',
                              lambda d: pod_templates(d)[0][1]['spec']['volumes'][1]['emptyDir'].pop('medium')),
    'unknown config key': ('pytorchjob-train.yaml', "unknown config key 'bacth_size'",
                           replace_arg('--batch_size', '--bacth_size')),
    'wrong config type': ('t9k-test-openwebtext-10k.yaml', 'max_iters must be int',
                          replace_arg('--max_iters=200', '--max_iters=2e2')),
    'missing config file': ('pytorchjob-fsdp.yaml', 'cannot read config file config/train_gtp2.py',
                            replace_arg('config/train_gpt2.py', 'config/train_gtp2.py')),
    'missing script': ('elasticjob-train.yaml', "'trian.py' is not a script in the repo",
                       replace_arg(' train.py', ' trian.py')),
    'unknown dataset for prepare.py': ('prepare-openwebtext.yaml', "prepare.py: error: unknown dataset 'owt'",
                                       replace_arg('openwebtext', 'owt')),
    'misspelt torchrun option': ('pytorchjob-train.yaml', 'torchrun does not take',
                                 replace_arg('--nproc-per-node=8', '--nprocs-per-node=8')),
    'launcher option as two words': ('elasticjob-train.yaml', "'8' is not a script in the repo",
                                     replace_arg('--nproc_per_node=8', '--nproc_per_node 8')),
    'misspelt ds_train.py key': ('pytorchjob-ds.yaml', "unknown config key 'zero_stag'",
                                 replace_arg('--zero_stage', '--zero_stag')),
    'undefined variable': ('pytorchjob-train.yaml', '$MASTER_ADR is neither set',
                           replace_arg('$(MASTER_ADDR)', '$(MASTER_ADR)')),
    'restart count from the downward API': ('t9k-train.yaml', 'is not a field that the downward API gives',
                                            lambda d: first_container(d)['env'][0]['valueFrom']['fieldRef'].update(
                                                fieldPath='status.containerStatuses[0].restartCount')),
}


@pytest.mark.parametrize('case', BROKEN)
def test_a_broken_manifest_is_rejected(case, schemas, monkeypatch):
    monkeypatch.chdir(REPO)
    name, expected, edit = BROKEN[case]
    docs = copy.deepcopy(load(REPO / 'k8s' / name)[1])  # deep: the YAML's anchors share objects
    assert doc_problems(docs, schemas) == []
    edit(docs[0])
    found = doc_problems(docs, schemas)
    assert any(expected in p for p in found), found


def test_yamllint_rejects_a_duplicate_key_that_pyyaml_would_take():
    text = (REPO / 'k8s' / 'pvc.yaml').read_text().replace('  name: gpt-train\n', '  name: gpt-train\n  name: other\n')
    assert yaml.safe_load(text)['metadata']['name'] == 'other'  # PyYAML keeps the last one, silently
    assert any('duplication of key "name"' in p for p in lint_problems(text)), lint_problems(text)
