"""The MPI launcher's parts that need no mpirun: its command line, what a task marks
and how the launcher reads mpirun's output, the refusals.

The same launcher with Debian's Open MPI, on this host and across two namespace hosts,
is tests/system/test_mpi.py.
"""
import io
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from support import launch_argv
from d2ldist.launch import mpi, step
from d2ldist.launch.job import Proc
from d2ldist.launch.processes import job_specs


def specs_on(hosts, workers=2, servers=1):
    return job_specs(workers, servers, ['train'], 'secret' * 10 + 'abcd', hosts=hosts,
                     remote=True, addresses={h: f'10.0.0.{i + 1}' for i, h in enumerate(hosts)})


def test_mpirun_starts_one_app_context_per_process_on_its_host():
    """MPMD: task N is process N of the placement, on its host; the shared variables
    are exported by name in every context; the secret is on no command line."""
    specs = specs_on(['hostA', 'hostB'])
    shared = step.shared_env(specs)
    argv = mpi.mpirun_argv(specs, shared, hosts=['hostA', 'hostB'], ssh_config='/x/cfg',
                           workdir='/job', as_root=False)
    assert argv[:4] == ['mpirun', '--oversubscribe', '--bind-to', 'none']
    assert '--allow-run-as-root' not in argv
    assert ['--mca', 'plm_rsh_agent', 'ssh -F /x/cfg'] == argv[argv.index('plm_rsh_agent') - 1:
                                                                 argv.index('plm_rsh_agent') + 2]
    contexts = ' '.join(argv).split(' : ')
    assert len(contexts) == len(specs) == 4
    for context, spec in zip(contexts, specs):
        words = context.split()
        assert words[words.index('-np') + 1] == '1'
        assert words[words.index('--host') + 1] == spec.host
        assert words[-6:-2] == [sys.executable, '-m', 'd2ldist.launch.step', '--task']
        assert words[-1] == '--label'
        exported = {words[i + 1] for i, w in enumerate(words) if w == '-x'}
        assert exported == set(shared) and 'D2L_JOB_SECRET' in exported
    assert 'secret' not in ' '.join(argv)
    assert '--allow-run-as-root' in mpi.mpirun_argv(specs, shared, as_root=True)


def test_a_labelled_task_marks_each_whole_line_with_its_number():
    """--label: the command's output (stdout and stderr) relayed a line at a time, each
    marked 'N: ' with the task's number from OMPI_COMM_WORLD_RANK, then the exit mark."""
    spec, = [s for s in job_specs(1, 0, [sys.executable, '-c',
                                         'import sys; print("out"); sys.stderr.write("err\\n");'
                                         'sys.stdout.write("no end"); raise SystemExit(4)'],
                                  'x', hosts=['n1']) if s.role == 'worker']
    env = dict(os.environ, OMPI_COMM_WORLD_RANK='3')
    r = subprocess.run(step.task_argv(spec, {}, label=True), capture_output=True, text=True,
                       env=env, timeout=60)
    assert r.returncode == 4, r.stderr
    assert sorted(r.stdout.splitlines()[:3]) == ['3: err', '3: no end', '3: out']
    assert r.stdout.splitlines()[3:] == ['3: d2ldist.task: exit 4']


def job_on(hosts, out):
    job = mpi.MpiJob(specs_on(hosts), hosts=hosts, out=out)
    job.step = Proc(step.StepSpec('mpirun', 0))
    for p in [job.step, *job.procs]:
        p.popen = object()                        # running (no process needed here)
    return job


def test_mpirun_output_goes_to_its_tasks_and_names_the_failure():
    """Each task's marked line under its label; the exit marks taken; mpirun's banners
    kept out of the output, the first failed process it names taken where that process
    could not say; anything else mpirun says shown as [mpirun]."""
    out = io.StringIO()
    job = job_on(['hostA', 'hostB'], out)
    for line in ['2: hello from worker 0', '2: ' + '-' * 30, '2: a task line, not a banner',
                 '1: d2ldist.task: exit 143',
                 '-' * 74, 'Primary job  terminated normally, but 1 process returned',
                 'a non-zero exit code. Per user-direction, the job has been aborted.', '-' * 74,
                 '-' * 74, 'mpirun detected that one or more processes exited with non-zero '
                 'status, thus causing', 'the job to be terminated. The first process to do so '
                 'was:', '', '  Process name: [[14231,1],3]', '  Exit code:    9', '-' * 74,
                 '[vm:16795] plm:rsh: Warning: setpgid(16801,16801) failed in parent with '
                 'errno=Permission denied(13)',
                 'ssh: connect to host hostC port 22: Connection refused']:
        job._emit(job.step, line)
    assert out.getvalue() == ('[worker 0@hostA] hello from worker 0\n'
                              f'[worker 0@hostA] {"-" * 30}\n'
                              '[worker 0@hostA] a task line, not a banner\n'
                              '[mpirun] ssh: connect to host hostC port 22: Connection refused\n')
    assert [(p.label, p.state, p.code) for p in job.procs] == [
        ('scheduler@hostA', 'starting', None), ('server 0@hostB', 'stopped', 143),
        ('worker 0@hostA', 'starting', None), ('worker 1@hostB', 'failed', 9)]
    assert job.failure.label == 'worker 1@hostB'
    assert sum(who == 'mpirun' for who, _ in job.log) == 17 - 4     # all but the tasks'


@pytest.mark.parametrize('args,says', [
    (['-H', 'me@hostA,hostB'], "--launcher mpi: host 'me@hostA': mpirun reaches hosts by name "
                               'only; put the user and port in an ssh config (--ssh-config FILE)'),
    (['-H', 'hostA:2222'], "-H hostA:2222: 2222 slots? -H takes host:slots (horovodrun's, "
                           "mpirun's); an ssh port is --ssh-port 2222 or an ssh config "
                           '(--ssh-config FILE); see d2l-launch --help'),
    (['--min-workers', '1', '-s', '0'], '--min-workers needs --launcher local or ssh: mpirun '
                                        'ends every process when one fails'),
    (['--sync-dst-dir', '/tmp/x'], '--sync-dst-dir needs hosts to sync to: -H host1,host2 or '
                                   '--hostfile FILE'),
])
def test_what_mpi_cannot_do_is_refused_in_one_line(args, says):
    r = subprocess.run(launch_argv('-n', '2', '--launcher', 'mpi', *args, 'python', '-c', '1'),
                       capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout, r.stderr) == (2, '', f'd2l-launch: error: {says}\n')


def test_without_mpirun_one_line_says_what_to_install(monkeypatch):
    monkeypatch.setattr(mpi.shutil, 'which', lambda name: None)
    with pytest.raises(mpi.MpiError, match="--launcher mpi needs Open MPI's mpirun on PATH "
                                           r'\(Debian: openmpi-bin\)'):
        mpi.hosts_of(SimpleNamespace(hosts=None, hostfile=None))


def test_a_task_writes_each_line_of_its_own_in_one_write():
    """Under PYTHONUNBUFFERED print() writes a line's text and its newline apart, and
    mpirun may put another task's line between the two (a fresh-clone CI saw
    'd2ldist.task: exit 01: d2ldist.task: exit 0'): the task side writes whole lines."""
    class Raw(io.RawIOBase):
        def __init__(self):
            self.writes = []

        def writable(self):
            return True

        def write(self, b):
            self.writes.append(bytes(b))
            return len(b)
    printed, written = Raw(), Raw()
    print('1: d2ldist.task: exit 0', file=io.TextIOWrapper(printed, write_through=True),
          flush=True)
    step._line('1: d2ldist.task: exit 0', io.TextIOWrapper(written, write_through=True))
    assert printed.writes == [b'1: d2ldist.task: exit 0', b'\n']
    assert written.writes == [b'1: d2ldist.task: exit 0\n']
