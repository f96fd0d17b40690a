"""The Slurm launcher's parts that need no Slurm: the allocation read from SLURM_*
variables, the multi-prog file and what a task makes of its line, the refusals.

The same launcher against a real Slurm (munged, slurmctld, two slurmd) is
tests/system/test_slurm.py.
"""
import io
import os
import subprocess
import sys

import pytest

from support import launch_argv
from d2ldist.launch import slurm, step
from d2ldist.launch.job import Proc
from d2ldist.launch.processes import job_specs

ALLOCATION = {'SLURM_JOB_ID': '42', 'SLURM_JOB_NODELIST': 'node[01-04,07]',
              'SLURM_TASKS_PER_NODE': '2(x4),1', 'SLURM_JOB_CPUS_PER_NODE': '8(x5)'}


def test_the_allocation_is_read_with_its_ranges(monkeypatch):
    monkeypatch.setattr(slurm.shutil, 'which', lambda name: f'/usr/bin/{name}')
    assert slurm.allocation(ALLOCATION) == (
        '42', ['node01', 'node02', 'node03', 'node04', 'node07'], [2, 2, 2, 2, 1], [8] * 5)
    bad = dict(ALLOCATION, SLURM_JOB_NODELIST='node[01-')
    with pytest.raises(slurm.SlurmError, match=r"--launcher slurm: node list 'node\[01-'"):
        slurm.allocation(bad)
    short = dict(ALLOCATION, SLURM_TASKS_PER_NODE='2(x3)')
    with pytest.raises(slurm.SlurmError, match='5 nodes in SLURM_JOB_NODELIST but tasks'):
        slurm.allocation(short)
    monkeypatch.setattr(slurm.shutil, 'which', lambda name: None)
    with pytest.raises(slurm.SlurmError, match='in allocation 42, but srun is not on PATH'):
        slurm.allocation(ALLOCATION)


def test_workers_follow_the_allocations_tasks_per_node():
    """Two tasks per node: the workers fill node01's two slots, then node02's."""
    nodes, tasks = ['node01', 'node02'], [2, 2]
    specs = job_specs(4, 1, ['train'], 's' * 64, hosts=nodes, slots=tasks, remote=True,
                      addresses={'node01': '10.0.0.1', 'node02': '10.0.0.2'})
    assert [(s.label, s.env.get('LOCAL_RANK')) for s in specs] == [
        ('scheduler@node01', None), ('server 0@node02', None), ('worker 0@node01', '0'),
        ('worker 1@node01', '1'), ('worker 2@node02', '0'), ('worker 3@node02', '1')]
    argv = slurm.srun_argv(specs, '/tmp/x.conf', 'd2l-1')
    assert '--nodelist=node01,node02,node01,node01,node02,node02' in argv
    assert '--ntasks=6' in argv and '--nodes=2' in argv and argv[-2:] == ['--multi-prog',
                                                                           '/tmp/x.conf']


def test_a_task_runs_its_line_with_its_own_variables():
    """The multi-prog file's line of a task, run as srun runs it: that process's command
    with its own variables over the shared ones; the secret is in no line."""
    specs = job_specs(2, 1, [sys.executable, '-c', 'import os; print(os.environ["D2L_ROLE"],'
                             ' os.environ["D2L_RANK"], os.environ["WORLD_SIZE"], "a b")'],
                      'secret' * 10 + 'abcd', hosts=['n1'], addresses={'n1': '127.0.0.1'})
    shared = step.shared_env(specs)
    assert shared['D2L_JOB_SECRET'] == 'secret' * 10 + 'abcd' and 'D2L_ROLE' not in shared
    lines = slurm.multi_prog(specs, shared).splitlines()
    assert [line.split()[0] for line in lines] == ['0', '1', '2', '3']
    assert all(line.split()[1:5] == [sys.executable, '-m', 'd2ldist.launch.step', '--task']
               and len(line.split()) == 6 and 'secret' not in line for line in lines)
    word = lines[3].split()[5]
    env = dict(os.environ, **shared, SLURM_PROCID='3', SLURM_JOB_ID='7', SLURM_STEP_ID='0')
    r = subprocess.run([sys.executable, '-m', 'd2ldist.launch.step', '--task', word],
                       capture_output=True, text=True, env=env, timeout=60)
    assert (r.returncode, r.stdout) == (0, 'worker 1 2 a b\nd2ldist.task: exit 0\n'), r.stderr


def test_a_failing_task_reports_its_code_and_step_zero_its_step():
    spec, = [s for s in job_specs(1, 0, [sys.executable, '-c', 'raise SystemExit(3)'], 'x',
                                  hosts=['n1']) if s.role == 'worker']
    env = dict(os.environ, SLURM_PROCID='0', SLURM_JOB_ID='7', SLURM_STEP_ID='2')
    r = subprocess.run([sys.executable, '-m', 'd2ldist.launch.step', '--task',
                        step.task_word(spec, {})], capture_output=True, text=True, env=env,
                       timeout=60)
    assert (r.returncode, r.stdout) == (3, 'd2ldist.task: step 7.2\nd2ldist.task: exit 3\n')
    r = subprocess.run([sys.executable, '-m', 'd2ldist.launch.step', '--task', 'bad'],
                       capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stderr) == (1, 'd2ldist.task: --task takes a word written by '
                                           'd2l-launch (--launcher slurm or mpi)\n')


def test_outside_an_allocation_one_line_says_where_to_run():
    env = {k: v for k, v in os.environ.items() if not k.startswith('SLURM_')}
    r = subprocess.run(launch_argv('-n', '2', '--launcher', 'slurm', 'python', '-c', '1'),
                       capture_output=True, text=True, timeout=30, env=env)
    assert (r.returncode, r.stdout) == (2, '')
    assert r.stderr == ('d2l-launch: error: --launcher slurm runs inside a Slurm allocation '
                        '(SLURM_JOB_ID is not set): salloc -N 2 d2l-launch --launcher slurm '
                        '..., d2l-launch in an sbatch script, or --partition P to ask for '
                        'one\n')
    r = subprocess.run(launch_argv('-n', '1', '--launcher', 'slurm', '-H', 'a,b', 'python',
                                   '-c', '1'), capture_output=True, text=True, timeout=30,
                       env=env)
    assert (r.returncode, r.stderr) == (2, 'd2l-launch: error: -H/--hostfile needs '
                                           '--launcher ssh (or mpi)\n')


def test_srun_output_goes_to_its_tasks_and_names_the_failure():
    """srun --label's lines, fed as srun prints them: each task's under its label, the
    exit marks hidden and taken, srun's words on ended tasks hidden (and taken for a task
    that could not say), anything else srun says shown as [srun]."""
    out = io.StringIO()
    specs = job_specs(2, 1, ['train'], 'x', hosts=['n1', 'n2'], remote=True)
    job = slurm.SlurmJob(specs, '7', out=out)
    job.step = Proc(step.StepSpec('srun', 0))
    for p in [job.step, *job.procs]:
        p.popen = object()                        # running (no process needed here)
    for line in ['0: d2ldist.task: step 7.3', '2: hello from worker 0',
                 '3: d2ldist.task: exit 137', '1: d2ldist.task: exit 143',
                 'srun: error: n1: tasks 0,2: Exited with exit code 9',
                 'srun: launch/slurm: _step_signal: Terminating StepId=7.3',
                 '0: slurmstepd-n1: error: *** STEP 7.3 ON n1 CANCELLED AT 2026 ***',
                 'srun: error: Unable to create step for job 7: Invalid node name']:
        job._emit(job.step, line)
    assert job.step_id == '7.3'
    assert out.getvalue() == ('[worker 0@n1] hello from worker 0\n'
                              '[srun] srun: error: Unable to create step for job 7: '
                              'Invalid node name\n')
    assert [(p.label, p.state, p.code) for p in job.procs] == [
        ('scheduler@n1', 'failed', 9), ('server 0@n2', 'stopped', 143),
        ('worker 0@n1', 'failed', 9), ('worker 1@n2', 'failed', 137)]
    assert job.failure.label == 'worker 1@n2'


@pytest.mark.parametrize('args,env,says', [
    (['--launcher', 'slurm', '--partition', 'p'], {'SLURM_JOB_ID': '42'},
     '--partition p: already inside allocation 42, which the job uses as it is; leave out '
     '--partition'),
    (['--partition', 'p'], {}, '--partition needs --launcher slurm'),
    (['--launcher', 'slurm', '--nodes', '2'], {'SLURM_JOB_ID': '42'},
     '--nodes needs --partition P, and at least 1 node'),
    (['--launcher', 'slurm', '--partition', 'p', '--nodes', '0'], {},
     '--nodes must be at least 1, got 0'),
])
def test_asking_for_an_allocation_is_checked_in_one_line(args, env, says):
    """--partition asks for an allocation only outside one (tests/system/test_slurm.py
    asks a real Slurm)."""
    env = dict({k: v for k, v in os.environ.items() if not k.startswith('SLURM_')}, **env)
    r = subprocess.run(launch_argv('-n', '2', *args, 'python', '-c', '1'), capture_output=True,
                       text=True, timeout=60, env=env)
    assert (r.returncode, r.stdout, r.stderr) == (2, '', f'd2l-launch: error: {says}\n')


# -- Slurm's traps: the allocation decides what the user did not say ------------------------
SBATCH = {'SLURM_JOB_ID': '42', 'SLURM_JOB_NUM_NODES': '2', 'SLURM_NTASKS': '4',
          'SLURM_JOB_NODELIST': 'node[1-2]', 'SLURM_TASKS_PER_NODE': '2(x2)', 'PATH': '/usr/bin'}


def parsed(env, *options):
    from d2ldist.launch import cli
    return cli.parse([*map(str, options), 'python', '-c', '1'], environ=env)


def test_in_an_allocation_of_two_nodes_the_launcher_is_slurm_and_n_its_tasks(monkeypatch):
    """d2l-launch train.py in an sbatch script of 2 nodes, 4 tasks: one srun step of 4
    workers over both nodes, said in one line; the plan shows it, starting nothing."""
    from d2ldist.launch import cli
    monkeypatch.setattr('shutil.which', lambda name: f'/usr/bin/{name}')   # (srun)
    args = parsed(SBATCH, '-s', 0, '--dry-run')
    assert (args.launcher, args.num_workers) == ('slurm', 4)
    lines = cli.dry_run(args, SBATCH).splitlines()
    assert lines[0] == ('d2l-launch: inside Slurm allocation 42 of 2 nodes: --launcher slurm, '
                        'one srun step over its nodes (--launcher local keeps the job on this '
                        'node); -n 4, its SLURM_NTASKS')
    assert lines[1].endswith('4 workers; each a task of one srun step in allocation 42')
    assert [line.split()[:3] for line in lines[4:8]] == [
        ['worker', '0', 'node1'], ['worker', '1', 'node1'], ['worker', '2', 'node2'],
        ['worker', '3', 'node2']]
    # what the user says wins; one node (or SLURM_NNODES's older name) stays local
    local = parsed(SBATCH, '-n', 2, '--launcher', 'local')
    assert (local.launcher, local.num_workers, local.notice) == ('local', 2, None)
    one = parsed(dict(SBATCH, SLURM_JOB_NUM_NODES='1'), '-s', 0)
    assert (one.launcher, one.num_workers, one.notice) == (
        'local', 4, 'd2l-launch: inside Slurm allocation 42 of 1 node: -n 4, its SLURM_NTASKS')
    older = dict(SBATCH, SLURM_NNODES='2')
    del older['SLURM_JOB_NUM_NODES']
    assert parsed(older, '-n', 1).launcher == 'slurm'


def test_under_srun_of_several_tasks_d2l_launch_refuses_in_one_line():
    """srun -n 4 d2l-launch ... would start four whole jobs: one line names srun and
    what to run instead; srun -n1 (one task) runs."""
    env = dict(os.environ, **dict(SBATCH, PATH=os.environ['PATH']), SLURM_STEP_ID='0',
               SLURM_STEP_NUM_TASKS='4')
    r = subprocess.run(launch_argv('-n', '2', 'python', '-c', '1'), capture_output=True,
                       text=True, timeout=30, env=env)
    assert (r.returncode, r.stdout, r.stderr) == (
        2, '', 'd2l-launch: error: d2l-launch runs as one of 4 srun tasks, which would start '
        '4 whole jobs: run it once, in the allocation (d2l-launch --launcher slurm ..., which '
        'starts its own srun step), or srun -n1 d2l-launch ...\n')
    one = dict(env, SLURM_STEP_NUM_TASKS='1')
    assert parsed(one, '-n', 1, '--launcher', 'local').num_workers == 1


def test_n_is_needed_outside_an_allocation(capsys):
    from d2ldist.launch import cli
    with pytest.raises(cli.UsageError) as e:
        parsed({}, '-s', 0)
    assert (str(e.value), e.value.hint) == (
        '-n N, the number of workers, is needed (inside a Slurm allocation, its SLURM_NTASKS)',
        True)
    no_tasks = {k: v for k, v in SBATCH.items() if k != 'SLURM_NTASKS'}   # sbatch -N 2 alone
    with pytest.raises(cli.UsageError, match='^-n N, the number of workers, is needed: this '
                       'Slurm allocation sets no SLURM_NTASKS'):
        parsed(no_tasks, '-s', 0)


def test_partition_passes_time_account_gres_and_more_to_salloc(monkeypatch, tmp_path):
    from d2ldist.launch import cli
    monkeypatch.setattr('shutil.which', lambda name: f'/usr/bin/{name}')   # (salloc, srun)
    args = parsed({}, '-n', 2, '-s', 0, '--launcher', 'slurm', '--partition', 'gpu',
                  '--nodes', 2, '--time', '30', '--account', 'proj', '--gres', 'gpu:4',
                  '--salloc-args=--qos=debug --mem "8G"', '--dry-run')
    assert slurm.salloc_argv(args) == [
        'salloc', '--partition=gpu', '--ntasks=2', '--nodes=2', '--time=30', '--account=proj',
        '--gres=gpu:4', '--qos=debug', '--mem', '8G', '--quiet']
    assert ('  first: salloc --partition=gpu --ntasks=2 --nodes=2 --time=30 --account=proj '
            '--gres=gpu:4 --qos=debug --mem 8G --quiet (the allocation, given back when the '
            'job ends)') in cli.dry_run(args, {}).splitlines()
    config = tmp_path / 'job.toml'                 # a value that starts with a dash, too
    config.write_text('launcher = "slurm"\npartition = "gpu"\nsalloc-args = "--qos=debug"\n')
    assert parsed({}, '-n', 1, '--config-file', config).salloc_args == ['--qos=debug']
    for option in ('--time', '--salloc-args'):
        with pytest.raises(cli.UsageError, match=f'^{option} is an option of salloc, for the '
                           'allocation that --partition P asks for'):
            parsed(dict(SBATCH, SLURM_JOB_NUM_NODES='1'), '--launcher', 'slurm', option, '1')
