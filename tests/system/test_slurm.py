"""Jobs under a real Slurm: plain ``srun``, and ``d2l-launch --launcher slurm`` (issue 32).

The cluster (``slurm_cluster`` in tests/conftest.py, ``d2ldist/testing/slurm_cluster.py``)
is Debian's munged, slurmctld and two slurmd, node1 and node2, each in a network and UTS
namespace of its own; srun and salloc run in the controller's namespace. Each job must
reach the exact sums of ``tests/jobs/exact_sums.py`` with processes on both nodes; after
each, the queue is empty and no process of the job is left (its tag, and the nodes'
process tables).
"""
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import time

import pytest

from support import ROOT, kill_pids, new_tag, read_until_ready, run_group, tagged_pids, \
    wait_no_survivors

pytestmark = pytest.mark.timeout(300)

EXACT_SUMS = ROOT / 'tests' / 'jobs' / 'exact_sums.py'
SLEEPER = '''\
import time
import d2ldist
kv = d2ldist.kv.create('dist_sync')
print(f'worker {kv.rank} ready', flush=True)
time.sleep(300)
'''


@pytest.fixture
def slurm(slurm_cluster):
    """The cluster, and afterwards: the queue empty, nothing left on the nodes."""
    yield slurm_cluster
    left = slurm_cluster.wait_queue_empty(30)
    tasks = slurm_cluster.wait_no_tasks(15)
    kill_pids(tasks)
    if left:
        slurm_cluster.run('scancel', *[line.split()[0] for line in left])
    assert left == [] and tasks == {}, f'left by the test: jobs {left}, processes {tasks}'


def job_env(tag):
    """The environment of srun/salloc: no D2L_* variable of ours, this tree first, tagged."""
    return dict({k: v for k, v in os.environ.items() if not k.startswith('D2L_')},
                PYTHONPATH=str(ROOT), D2L_TEST_TAG=tag)


def run_slurm(cluster, *argv, timeout=240, env=None):
    """Run a Slurm client command line (srun, salloc ...) to its end, tagged; .tag.
    ``env``: variables to add (srun passes them on to the tasks)."""
    tag = new_tag()
    r = run_group(cluster.argv(*argv), cluster.env(dict(job_env(tag), **(env or {}))), ROOT,
                  timeout)
    r.tag = tag
    return r


def in_allocation(cluster, *launch_args, timeout=240):
    """``salloc -N 2 d2l-launch --launcher slurm ARGS`` to its end."""
    return run_slurm(cluster, 'salloc', '-N', '2', '-n', '2', '--quiet', sys.executable, '-m',
                     'd2ldist.launch', '--launcher', 'slurm', *launch_args, timeout=timeout)


def test_plain_srun_runs_one_job_on_the_torch_backend(slurm):
    """srun -N 2 -n 2: rank and size from SLURM_*, met at node1 (the node list's first),
    gloo; one task on each node; rank 0 says which backend once."""
    r = run_slurm(slurm, 'srun', '-N', '2', '-n', '2', '--label', 'sh', '-c',
                  'echo "on $(hostname)" && exec "$@"', 'sh', sys.executable, EXACT_SUMS, 'ring')
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert sorted(re.findall(r'^\d: on \w+$', r.stdout, re.M)) == ['0: on node1', '1: on node2']
    assert sorted(re.findall(r'^\d: worker \d of \d: ring sum on cpu \w+$', r.stdout, re.M)) == [
        '0: worker 0 of 2: ring sum on cpu exact', '1: worker 1 of 2: ring sum on cpu exact']
    assert r.stdout.count('torch.distributed on gloo') == 2
    assert [x for x in r.stderr.splitlines() if 'd2ldist' in x] == [
        '0: d2ldist: torch backend (gloo): 2 workers started by srun, CPU']
    assert wait_no_survivors(r.tag) == []


def test_plain_srun_runs_one_job_on_the_ring_whose_scheduler_rank_0_hosts(slurm):
    """D2L_BACKEND=ring and the job's secret (srun passes the environment on): rank 0,
    on node1, starts the scheduler there; the task on node2 meets it; exact sums."""
    r = run_slurm(slurm, 'srun', '-N', '2', '-n', '2', '--label', sys.executable, EXACT_SUMS,
                  'ring', env={'D2L_BACKEND': 'ring', 'D2L_JOB_SECRET': secrets.token_hex(16)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert sorted(re.findall(r'^\d: worker \d of \d: ring sum on cpu \w+$', r.stdout, re.M)) == [
        '0: worker 0 of 2: ring sum on cpu exact', '1: worker 1 of 2: ring sum on cpu exact']
    assert re.fullmatch(r'0: d2ldist: ring backend: 2 workers started by srun; rank 0 hosts '
                        r'the scheduler at tcp://[\d.]+:29501',
                        '\n'.join(x for x in r.stderr.splitlines() if 'd2ldist' in x)), r.stderr
    assert wait_no_survivors(r.tag) == []


@pytest.mark.parametrize('kvstore,env', [
    ('torch', {}), ('ring', {'D2L_BACKEND': 'ring', 'D2L_JOB_SECRET': secrets.token_hex(16)})],
    ids=['torch', 'ring'])
def test_the_concise_chapters_script_under_plain_srun(slurm, tmp_path, kvstore, env):
    """The concise chapter's command, as its prose gives it: the script its %%writefile
    cell writes, unchanged, trains on two nodes; both workers end at the same accuracy."""
    from nbtools import written_script
    script = tmp_path / 'concise_d2l.py'
    script.write_text(written_script('concise.ipynb', 'concise_d2l.py'))
    r = run_slurm(slurm, 'sh', '-c', f'cd {tmp_path} && exec "$@"', 'sh', 'srun', '-N', '2',
                  '-n', '2', '--label', sys.executable, script, '--kvstore', kvstore, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    done = dict(re.findall(r'^(\d): worker \1: test loss [\d.]+, test acc ([\d.]+)$',
                           r.stdout, re.M))
    assert sorted(done) == ['0', '1'] and done['0'] == done['1'], r.stdout[-3000:]
    assert float(done['0']) > 0.9
    assert (tmp_path / f'concise_{kvstore}_split.json').exists()
    assert wait_no_survivors(r.tag) == []


def placed(stdout):
    """{'worker 1': 'node2', ...}: where each process printed from."""
    return dict(re.findall(r'^\[(\w+(?: \d+)?)@(node\d)\] ', stdout, re.M))


@pytest.mark.parametrize('what,workers,servers', [('kv', 2, 2), ('ring', 2, 0)])
def test_launcher_slurm_runs_the_job_as_one_step(slurm, what, workers, servers):
    r = in_allocation(slurm, '-n', workers, '-s', servers, sys.executable, EXACT_SUMS, what)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    assert re.search(r'^d2l-launch: one srun step in allocation \d+ \(2 nodes: node1, node2\)',
                     out, re.M), out
    sums = sorted(re.findall(rf'^\[worker (\d)@node\d\] worker \1 of 2: {what} sum on cpu (\w+)$',
                             out, re.M))
    assert sums == [('0', 'exact'), ('1', 'exact')], out[-3000:]
    where = placed(out)
    assert where['scheduler'] == 'node1' and {where['worker 0'], where['worker 1']} == {
        'node1', 'node2'}, where
    assert '[srun]' not in out and 'Traceback' not in out + r.stderr, out + r.stderr
    assert wait_no_survivors(r.tag) == []


def test_inside_an_allocation_it_is_slurm_and_srun_of_many_tasks_is_refused(slurm):
    """salloc -N 2 -n 2: d2l-launch without --launcher or -n plans one srun step of 2
    workers over node1 and node2, and says so in one line (--dry-run: nothing starts);
    srun of 2 tasks running d2l-launch: each task refuses in one line that names srun."""
    py, launch = shlex.quote(sys.executable), f'{shlex.quote(sys.executable)} -m d2ldist.launch'
    r = run_slurm(slurm, 'salloc', '-N', '2', '-n', '2', '--quiet', 'sh', '-c',
                  f'{launch} --dry-run -s 0 {py} -c pass; echo "dry run: $?"; '
                  f'srun --label {launch} -s 0 {py} -c pass; echo "srun: $?"', timeout=60)
    out = r.stdout.splitlines()
    assert re.fullmatch(r'd2l-launch: inside Slurm allocation \d+ of 2 nodes: --launcher '
                        r'slurm, one srun step over its nodes \(--launcher local keeps the job '
                        r'on this node\); -n 2, its SLURM_NTASKS', out[0]), r.stdout + r.stderr
    assert out[1].endswith(' 2 workers; each a task of one srun step in allocation '
                           f'{out[0].split()[4]}'), out
    assert [line.split()[:3] for line in out[4:6]] == [['worker', '0', 'node1'],
                                                       ['worker', '1', 'node2']], out
    assert 'dry run: 0' in out and re.fullmatch(r'srun: [1-9]\d*', out[-1]), out
    refusals = sorted(line for line in r.stderr.splitlines() if 'd2l-launch' in line)
    assert refusals == [f'{task}: d2l-launch: error: d2l-launch runs as one of 2 srun tasks, '
                        'which would start 2 whole jobs: run it once, in the allocation '
                        '(d2l-launch --launcher slurm ..., which starts its own srun step), '
                        'or srun -n1 d2l-launch ...' for task in (0, 1)], r.stderr
    assert wait_no_survivors(r.tag) == []


def test_in_a_batch_script_d2l_launch_takes_the_allocation_unasked(slurm, tmp_path):
    """The issue's trap: ``d2l-launch train.py`` in an sbatch script of 2 nodes ran
    everything on the batch node; now its plan is one srun step over both, -n from the
    allocation, said in one line (the batch step is no srun of several tasks)."""
    script, out = tmp_path / 'job.sbatch', tmp_path / 'job.out'
    script.write_text(f'#!/bin/sh\n#SBATCH --nodes=2 --ntasks=2\n'
                      f'exec {sys.executable} -m d2ldist.launch --dry-run -s 0 '
                      f'{sys.executable} -c pass\n')
    r = run_slurm(slurm, 'sbatch', '--wait', '--quiet', f'--output={out}', script, timeout=60)
    lines = out.read_text().splitlines() if out.exists() else []
    assert r.returncode == 0, r.stderr[-3000:] + '\n'.join(lines)
    assert re.fullmatch(r'd2l-launch: inside Slurm allocation \d+ of 2 nodes: --launcher '
                        r'slurm, .*; -n 2, its SLURM_NTASKS', lines[0]), lines
    assert [line.split()[:3] for line in lines[4:6]] == [['worker', '0', 'node1'],
                                                         ['worker', '1', 'node2']], lines


def test_a_killed_worker_cancels_the_step(slurm, tmp_path):
    """--fail worker:1@2s: SIGKILL 2 s after it joined; the step is cancelled, the
    failure named in one line, and nothing is left."""
    script = tmp_path / 'sleeper.py'
    script.write_text(SLEEPER)
    start = time.monotonic()
    r = in_allocation(slurm, '-n', 2, '-s', 2, '--fail', 'worker:1@2s', sys.executable, script)
    assert time.monotonic() - start < 120, 'the step was not cancelled: the sleepers slept on'
    out = r.stdout + r.stderr
    assert r.returncode == 137, out[-3000:]
    failed = [x for x in out.splitlines() if x.startswith('d2l-launch: worker 1')]
    assert failed == ['d2l-launch: worker 1@node2 failed (killed by SIGKILL (exit code 137)); '
                      'the job was stopped.'], out[-3000:]
    assert 'Traceback' not in out and '[srun]' not in out, out[-3000:]
    assert 'never fired' not in out, out[-3000:]
    assert slurm.wait_queue_empty(30) == []
    assert wait_no_survivors(r.tag) == []


def test_a_fail_a_joined_task_never_reached_is_said_at_the_end(slurm):
    """--fail worker:1@step=3 on exact_sums.py, whose sums by hand d2ldist does not count
    as steps: the step's tasks join and finish, and the job's end says that it never fired."""
    r = in_allocation(slurm, '-n', 2, '-s', 0, '--fail', 'worker:1@step=3', sys.executable,
                      EXACT_SUMS, 'ring')
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    never = [x for x in r.stdout.splitlines() if 'never fired' in x]
    assert len(never) == 1 and never[0].startswith(
        'd2l-launch: --fail worker:1@step=3 never fired: worker 1 ended before its step 3'), \
        out[-3000:]
    assert slurm.wait_queue_empty(30) == []
    assert wait_no_survivors(r.tag) == []


def comm(pid):
    try:
        return open(f'/proc/{pid}/comm').read().strip()
    except OSError:
        return None


def wait_for(check, timeout):
    """check()'s first true answer within ``timeout`` seconds, else its last answer."""
    deadline = time.monotonic() + timeout
    while not (answer := check()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return answer


@pytest.mark.parametrize('sig,says', [
    (signal.SIGINT, 'd2l-launch: interrupted: stopping the job\n'),    # Ctrl-C
    (signal.SIGKILL, ''),              # the launcher dies: srun's guard ends srun, and the step
], ids=['ctrl-c', 'kill-9'])
def test_ctrl_c_or_a_killed_launcher_ends_the_step(slurm, tmp_path, sig, says):
    """While the job runs, d2l-launch gets SIGINT or SIGKILL; the allocation stays (its
    shell sleeps on), but the step is gone, and every process of the job with it."""
    script = tmp_path / 'sleeper.py'
    script.write_text(SLEEPER)
    tag = new_tag()
    salloc = subprocess.Popen(
        slurm.argv('salloc', '-N', '2', '-n', '2', '--quiet', 'sh', '-c',
                   '"$@"; echo "launcher ended $?"; exec sleep 120', 'sh', sys.executable,
                   '-m', 'd2ldist.launch', '--launcher', 'slurm', '-n', '2', '-s', '1',
                   sys.executable, script),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        env=slurm.env(job_env(tag)), start_new_session=True)
    lines, ready = read_until_ready(salloc, 2)
    try:
        assert ready.wait(120), ''.join(lines)
        launcher = [pid for pid in tagged_pids(tag) if open(f'/proc/{pid}/cmdline', 'rb')
                    .read().startswith(f'{sys.executable}\0-m\0d2ldist.launch\0'.encode())]
        assert len(launcher) == 1, launcher
        os.kill(launcher[0], sig)
        ended = f'launcher ended {128 + sig if sig == signal.SIGKILL else 130}\n'
        assert wait_for(lambda: ended in lines, 60), ''.join(lines)
        assert says in ''.join(lines), ''.join(lines)
        # the allocation is still there, its step is not; nothing of the job runs but
        # salloc and its shell
        assert len(slurm.queue()) == 1
        steps = wait_for(lambda: slurm.run('squeue', '-h', '-s').stdout == '', 30)
        assert steps, slurm.run('squeue', '-h', '-s').stdout
        assert wait_for(lambda: {comm(pid) for pid in tagged_pids(tag)} <= {
            'salloc', 'sh', 'sleep'}, 15), [(p, comm(p)) for p in tagged_pids(tag)]
        for pid in tagged_pids(tag):
            if comm(pid) == 'sleep':
                os.kill(pid, signal.SIGKILL)      # the shell ends; salloc gives back the nodes
        salloc.wait(timeout=30)
    finally:
        if salloc.poll() is None:
            os.killpg(salloc.pid, signal.SIGKILL)
            salloc.wait()
    assert slurm.wait_queue_empty(30) == []
    assert wait_no_survivors(tag, timeout=15) == []


def test_launcher_slurm_in_an_sbatch_script(slurm, tmp_path):
    """docs/cluster.md's batch script: two nodes of two tasks each, a 4 × 2 job; the
    workers fill node1's two tasks, then node2's, and reach the exact sums."""
    script, out = tmp_path / 'job.sbatch', tmp_path / 'job.out'
    script.write_text(f'#!/bin/sh\n#SBATCH --nodes=2 --ntasks-per-node=2\n'
                      f'exec {sys.executable} -m d2ldist.launch --launcher slurm -n 4 -s 2 '
                      f'{sys.executable} {EXACT_SUMS} kv\n')
    r = run_slurm(slurm, 'sbatch', '--wait', '--quiet', f'--output={out}', script)
    text = out.read_text() if out.exists() else ''
    assert r.returncode == 0, r.stderr[-3000:] + text[-3000:]
    sums = sorted(re.findall(r'^\[worker (\d)@(node\d)\] worker \1 of 4: kv sum on cpu (\w+)$',
                             text, re.M))
    assert sums == [('0', 'node1', 'exact'), ('1', 'node1', 'exact'),
                    ('2', 'node2', 'exact'), ('3', 'node2', 'exact')], text[-3000:]
    assert '[srun]' not in text and 'Traceback' not in text, text[-3000:]
    assert wait_no_survivors(r.tag) == []


def test_launcher_slurm_asks_for_its_own_allocation(slurm):
    """Outside any allocation (a login node), --partition test --nodes 2: salloc asks for
    the allocation, the job runs as one step in it, and it is given back at the end."""
    r = run_slurm(slurm, sys.executable, '-m', 'd2ldist.launch', '--launcher', 'slurm',
                  '--partition', 'test', '--nodes', '2', '-n', '2', '-s', '2',
                  sys.executable, EXACT_SUMS, 'kv')
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert out.splitlines()[0] == ('d2l-launch: asking Slurm for 2 tasks in partition test on '
                                   '2 nodes (salloc) ...'), out[-3000:]
    assert re.search(r'^d2l-launch: one srun step in allocation \d+ \(2 nodes: node1, node2\)',
                     out, re.M), out[-3000:]
    sums = sorted(re.findall(r'^\[worker (\d)@node\d\] worker \1 of 2: kv sum on cpu (\w+)$',
                             out, re.M))
    assert sums == [('0', 'exact'), ('1', 'exact')], out[-3000:]
    assert '[srun]' not in out and 'Traceback' not in out, out[-3000:]
    assert slurm.wait_queue_empty(30) == []
    assert wait_no_survivors(r.tag) == []


def test_its_own_allocation_is_given_back_when_the_launcher_is_killed(slurm, tmp_path):
    """SIGKILL to d2l-launch while its job runs in the allocation it asked for: the
    guards end srun and salloc, and Slurm takes the allocation back."""
    script = tmp_path / 'sleeper.py'
    script.write_text(SLEEPER)
    tag = new_tag()
    launcher = subprocess.Popen(
        slurm.argv(sys.executable, '-m', 'd2ldist.launch', '--launcher', 'slurm',
                   '--partition', 'test', '--nodes', '2', '-n', '2', '-s', '1',
                   sys.executable, script),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        env=slurm.env(job_env(tag)), start_new_session=True)
    lines, ready = read_until_ready(launcher, 2)
    try:
        assert ready.wait(120), ''.join(lines)
        assert len(slurm.queue()) == 1
        os.killpg(launcher.pid, signal.SIGKILL)     # the launcher (and nsenter before it)
        launcher.wait(timeout=30)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert slurm.wait_queue_empty(60) == []
    assert wait_no_survivors(tag, timeout=30) == []


MAGIC = '''\
import sys
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
shell.run_line_magic('load_ext', 'd2ldist')
shell.run_line_magic('launch', '--launcher slurm -n 2 -s 2 ' + ' '.join(sys.argv[1:]))
result = shell.user_ns['_launch']
print('outcome:', result.outcome, sorted(result.exit_codes.items()))
'''


def test_percent_launch_takes_launcher_slurm(slurm, tmp_path):
    """%launch (here in a terminal IPython, inside salloc) runs the same step."""
    script = tmp_path / 'magic.py'
    script.write_text(MAGIC)
    r = run_slurm(slurm, 'salloc', '-N', '2', '-n', '2', '--quiet', sys.executable, script,
                  sys.executable, EXACT_SUMS, 'kv')
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for rank in (0, 1):
        assert re.search(rf'^\[worker {rank}@node\d\] worker {rank} of 2: kv sum on cpu exact$',
                         r.stdout, re.M), r.stdout[-3000:]
    assert r.stdout.splitlines()[-1] == (
        "outcome: finished [('scheduler@node1', 0), ('server 0@node2', 0), "
        "('server 1@node1', 0), ('worker 0@node1', 0), ('worker 1@node2', 0)]"), r.stdout[-3000:]
    assert wait_no_survivors(r.tag) == []


def test_percent_launch_asks_slurm_for_its_allocation_in_a_real_kernel(slurm, tmp_path):
    """A notebook on a login node (outside any allocation): in a real kernel (nbconvert
    --execute, where srun and salloc run), %launch --launcher slurm --partition test asks
    for the allocation, runs the job as one step, shows the dashboard and leaves its
    summary: every worker on its node, its progress at 100 %; the allocation is given back."""
    pytest.importorskip('nbconvert')
    from nbtools import JOB_SCRIPT, notebook, stream_text
    import nbformat
    line = ('%launch --launcher slurm --partition test --nodes 2 -n 2 -s 2 '
            'progress_job.py 2 5 0.02 -1')
    nb = notebook('%load_ext d2ldist', '%%writefile progress_job.py\n' + JOB_SCRIPT, line)
    nbformat.write(nb, tmp_path / 'login.ipynb')
    r = run_slurm(slurm, 'sh', '-c', f'cd {tmp_path} && exec "$@"', 'sh', sys.executable, '-m',
                  'jupyter', 'nbconvert', '--to', 'notebook', '--execute', '--output',
                  'executed.ipynb', 'login.ipynb')
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    launch = nbformat.read(tmp_path / 'executed.ipynb', as_version=4).cells[2]
    out = stream_text(launch)
    assert out.startswith('d2l-launch: asking Slurm for 2 tasks in partition test on 2 nodes '
                          '(salloc) ...\n'), out[-3000:]
    for rank in (0, 1):
        assert re.search(rf'^\[worker {rank}@node\d\] worker {rank} done$', out, re.M), out
    shown = [o.data['text/plain'] for o in launch.outputs if o.output_type == 'display_data']
    assert shown[0] == f'{line}: scheduler, 2 servers, 2 workers on 2 hosts'   # its header
    summary = next(s for s in shown if s.startswith('job finished after ')).splitlines()
    workers = [row.split() for row in summary if row.split()[:1] == ['worker']]
    assert [(w[1].split('@')[0], w[2] in ('node1', 'node2'), w[1].endswith('@' + w[2]),
             w[3], w[4], w[6]) for w in workers] == [            # worker 0@node1  node1 ...
        ('0', True, True, 'finished', '0', '100%'),
        ('1', True, True, 'finished', '0', '100%')], summary
    assert slurm.wait_queue_empty(30) == []
    assert wait_no_survivors(r.tag) == []
