"""Debian's Open MPI ``mpirun``: scripts it starts without d2l-launch, and
``d2l-launch --launcher mpi``, which starts a whole job with it (issue 32).

A d2ldist script started as ``mpirun -np 2 python train.py`` must run as one job of two
workers on the torch backend, reaching the exact sums of ``tests/jobs/exact_sums.py``;
a process started as one of several that cannot find the others fails in one line,
never running as a job of one. ``--launcher mpi`` runs the scheduler, servers and
workers (a parameter-server job and a ring job) as one mpirun and reaches the same
sums; a failure or Ctrl-C ends every process. On this host, and across two hosts
(network namespaces with sshd, as the ssh tests have them) where mpirun starts the
processes over ssh. Nothing of the job is left afterwards (its tag, and every host's
process table).
"""
import os
import re
import secrets
import signal
import subprocess
import sys
import time

import pytest

from support import (ROOT, hosts_for_tests, kill_leftovers, launch_argv, new_tag,
                     read_until_ready, run_group, run_launch, run_mpirun, wait_no_survivors)
from d2ldist.runtime.started import free_port

pytestmark = pytest.mark.timeout(240)

EXACT_SUMS = ROOT / 'tests' / 'jobs' / 'exact_sums.py'


def test_plain_mpirun_runs_one_job_on_the_torch_backend():
    """Two processes, one job: rank and size from OMPI_COMM_WORLD_*, met at 127.0.0.1
    (every process on this host), gloo; rank 0 says so once."""
    r = run_mpirun(sys.executable, EXACT_SUMS, 'ring', env={'MASTER_PORT': str(free_port())})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert sorted(re.findall(r'worker \d of \d: ring sum on cpu \w+', r.stdout)) == [
        'worker 0 of 2: ring sum on cpu exact', 'worker 1 of 2: ring sum on cpu exact']
    assert r.stdout.count('torch.distributed on gloo') == 2
    assert r.stderr.splitlines() == [
        'd2ldist: torch backend (gloo): 2 workers started by mpirun, CPU']
    assert wait_no_survivors(r.tag) == []


def test_plain_mpirun_runs_one_job_on_the_ring_whose_scheduler_rank_0_hosts():
    """D2L_BACKEND=ring and the job's secret: rank 0 starts the scheduler at 127.0.0.1,
    the rendezvous port + 1, and says so once; both reach the exact sums; nothing is left."""
    port = free_port()
    r = run_mpirun(sys.executable, EXACT_SUMS, 'ring', options=['-x', 'D2L_BACKEND', '-x',
                                                                 'D2L_JOB_SECRET'],
                   env={'D2L_BACKEND': 'ring', 'D2L_JOB_SECRET': secrets.token_hex(16),
                        'MASTER_PORT': str(port)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert sorted(re.findall(r'worker \d of \d: ring sum on cpu \w+', r.stdout)) == [
        'worker 0 of 2: ring sum on cpu exact', 'worker 1 of 2: ring sum on cpu exact']
    assert r.stderr.splitlines() == [
        'd2ldist: ring backend: 2 workers started by mpirun; rank 0 hosts the scheduler at '
        f'tcp://127.0.0.1:{port + 1}']
    assert 'torch.distributed' not in r.stdout
    assert wait_no_survivors(r.tag) == []


ALONE_IS_WRONG = "import d2ldist\nd2ldist.init()\nprint('ran as a job of', d2ldist.size())\n"

# What each process of two says, and how it was made to miss its piece: as on two hosts
# (each process its host's only one, as mpirun on two hosts tells them) without
# MASTER_ADDR; the ring backend asked for; a port that is not one; a parameter-server
# store ('script': KV_ALONE_IS_WRONG), which needs d2l-launch's scheduler and servers.
MISSING = {
    'two hosts, no MASTER_ADDR': (
        ['sh', '-c', 'OMPI_COMM_WORLD_LOCAL_RANK=0 OMPI_COMM_WORLD_LOCAL_SIZE=1 exec "$@"',
         'sh'], {},
        "d2ldist: 2 workers started by mpirun, but MASTER_ADDR is not set and they are on "
        "several hosts: set it to rank 0's host (mpirun -x MASTER_ADDR=HOST)"),
    'the ring backend without the secret': (
        [], {'D2L_BACKEND': 'ring'},
        "d2ldist: 2 workers started by mpirun: backend 'ring' needs the same D2L_JOB_SECRET "
        'in every process (export D2L_JOB_SECRET=$(python -c "import secrets; '
        'print(secrets.token_hex(16))"); mpirun: -x D2L_JOB_SECRET)'),
    'a bad MASTER_PORT': (
        [], {'MASTER_PORT': '29500x'},
        "d2ldist: MASTER_PORT='29500x' is not a whole number"),
    'a parameter-server store': (
        [], {'script': 'kv'},
        "d2ldist: 2 workers started by mpirun, but kvstore 'dist_sync' runs in a job of "
        "d2l-launch (it starts the scheduler and the servers): d2l-launch -n N -s S "
        "python your_script.py"),
}
KV_ALONE_IS_WRONG = ("import d2ldist\nkv = d2ldist.kv.create('dist_sync')\n"
                     "print('ran as a job of', kv.num_workers)\n")


@pytest.mark.parametrize('case', MISSING)
def test_a_process_that_cannot_find_the_others_fails_in_one_line(write_script, case):
    wrapper, env, line = MISSING[case]
    env = dict(env)
    script = write_script(KV_ALONE_IS_WRONG if env.pop('script', '') else ALONE_IS_WRONG)
    r = run_mpirun(*wrapper, sys.executable, script, env=env, timeout=120)
    assert r.returncode != 0 and 'ran as a job of' not in r.stdout, r.stdout + r.stderr
    ours = [x for x in r.stderr.splitlines() if x.startswith('d2ldist')]
    assert ours, r.stderr[-3000:]
    # every process that ended before mpirun stopped the others said the same one line
    assert set(ours) == {line} and 'Traceback' not in r.stderr, r.stderr[-3000:]
    assert wait_no_survivors(r.tag) == []


# -- across hosts: mpirun starts the processes over ssh ---------------------------------
@pytest.fixture(scope='module')
def hosts():
    """Two hosts as network namespaces with sshd (d2ldist/testing/netns_hosts.py), apart
    from the ssh tests' own (another prefix and subnet)."""
    yield from hosts_for_tests(('hostA', 'hostB'), ('ip', 'ssh', 'ssh-keygen', 'mpirun'),
                               'mpirun across hosts needs root to make network namespaces',
                               prefix='d2lmpi', subnet='198.18.9')


@pytest.fixture
def across(hosts):
    """mpirun in the launcher's namespace, one process on each host, through the test
    sshd; afterwards no process is left on any host."""
    def run(*argv, env=()):
        return run_mpirun(
            *argv, netns=hosts.launcher_ns, timeout=180, options=[
                '--host', f'{hosts.addr["hostA"]},{hosts.addr["hostB"]}',
                '--mca', 'plm_rsh_agent', f'ssh -F {hosts.ssh_config}',
                '--mca', 'plm_rsh_no_tree_spawn', '1',
                '--mca', 'oob_tcp_if_include', f'{hosts.subnet}.0/24',
                *[x for name, value in env for x in ('-x', f'{name}={value}')]])
    yield run
    kill_leftovers(hosts)


def test_mpirun_across_two_hosts_meets_at_master_addr(hosts, across):
    """Rank 0 on hostA, rank 1 on hostB: they meet at MASTER_ADDR (gloo on the hosts'
    eth0) and reach the exact sums."""
    r = across(sys.executable, EXACT_SUMS, 'ring',
               env=[('MASTER_ADDR', hosts.addr['hostA']), ('MASTER_PORT', '29500'),
                    ('GLOO_SOCKET_IFNAME', 'eth0')])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert sorted(re.findall(r'worker \d of \d: ring sum on cpu \w+', r.stdout)) == [
        'worker 0 of 2: ring sum on cpu exact', 'worker 1 of 2: ring sum on cpu exact']
    assert [x for x in r.stderr.splitlines() if x.startswith('d2ldist')] == [
        'd2ldist: torch backend (gloo): 2 workers started by mpirun, CPU']
    assert wait_no_survivors(r.tag) == []


def test_mpirun_across_two_hosts_without_master_addr_fails_in_one_line(across, write_script):
    r = across(sys.executable, write_script(ALONE_IS_WRONG))
    assert r.returncode != 0 and 'ran as a job of' not in r.stdout, r.stdout + r.stderr
    assert set(x for x in r.stderr.splitlines() if x.startswith('d2ldist')) == {
        MISSING['two hosts, no MASTER_ADDR'][2]}, r.stderr[-3000:]
    assert 'Traceback' not in r.stderr and wait_no_survivors(r.tag) == []


# -- d2l-launch --launcher mpi ------------------------------------------------------------
SLEEPER = """\
import time
import d2ldist
kv = d2ldist.kv.create('dist_sync')
print(f'worker {kv.rank} ready', flush=True)
time.sleep(300)
"""


def mpi_argv(hosts, *args, tag):
    """d2l-launch --launcher mpi on both hosts, run in the launcher's namespace."""
    return ['ip', 'netns', 'exec', hosts.launcher_ns, *launch_argv(
        '--env', f'D2L_TEST_TAG={tag}', '--launcher', 'mpi', '--connect-timeout', '5',
        '--ssh-config', hosts.ssh_config, '-H', ','.join(hosts.names), *map(str, args))]


def run_launch_mpi(hosts, *args, timeout=180):
    tag = new_tag()
    r = run_group(mpi_argv(hosts, *args, tag=tag), env=dict(os.environ, PYTHONPATH=str(ROOT)),
                  cwd=ROOT, timeout=timeout)
    r.tag = tag
    return r


def sums(out, what, hosts=r'\w+'):
    return sorted(re.findall(rf'^\[worker (\d)@{hosts}\] worker \1 of 2: {what} sum on cpu '
                             rf'(\w+)$', out, re.M))


@pytest.mark.parametrize('what,servers', [('kv', 2), ('ring', 0)])
def test_launcher_mpi_on_this_host(what, servers):
    """Without -H: one mpirun on this machine starts the whole job."""
    r = run_launch('--launcher', 'mpi', '-n', 2, '-s', servers, sys.executable, EXACT_SUMS,
                   what, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert sums(r.stdout, what, 'localhost') == [('0', 'exact'), ('1', 'exact')], r.stdout
    assert '[mpirun]' not in r.stdout and 'd2ldist.task' not in r.stdout, r.stdout
    assert wait_no_survivors(r.tag) == []


@pytest.fixture
def clean(hosts):
    """Afterwards no process is left on any host, whatever happened."""
    yield hosts
    kill_leftovers(hosts)


@pytest.mark.parametrize('what,servers', [('kv', 2), ('ring', 0)])
def test_launcher_mpi_across_two_hosts(clean, what, servers):
    """The scheduler on hostA, the servers and workers dealt over both hosts, as the ssh
    launcher places them; mpirun starts them all over ssh."""
    hosts = clean
    r = run_launch_mpi(hosts, '-n', 2, '-s', servers, sys.executable, EXACT_SUMS, what)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert sums(r.stdout, what, 'host[AB]') == [('0', 'exact'), ('1', 'exact')], out[-3000:]
    where = dict(re.findall(r'^\[(\w+(?: \d+)?)@(host[AB])\] ', r.stdout, re.M))
    assert where['scheduler'] == 'hostA' and {where['worker 0'], where['worker 1']} == {
        'hostA', 'hostB'}, where
    assert f'scheduler ready at tcp://{hosts.addr["hostA"]}:' in r.stdout
    assert '[mpirun]' not in out and 'Traceback' not in out, out[-3000:]
    assert wait_no_survivors(r.tag) == [] and hosts.wait_no_leftovers() == {}


def test_launcher_mpi_names_a_killed_worker_and_ends_the_rest(clean, tmp_path):
    """--fail worker:1@2s: SIGKILL 2 s after it joined; mpirun ends the others at once,
    the failure is named in one line, and nothing is left on either host."""
    hosts = clean
    script = tmp_path / 'sleeper.py'
    script.write_text(SLEEPER)
    start = time.monotonic()
    r = run_launch_mpi(hosts, '-n', 2, '-s', 2, '--fail', 'worker:1@2s', sys.executable, script)
    assert time.monotonic() - start < 120, 'the job was not ended: the sleepers slept on'
    out = r.stdout + r.stderr
    assert r.returncode == 137, out[-3000:]
    failed = [x for x in out.splitlines() if x.startswith('d2l-launch: worker 1')]
    assert failed == ['d2l-launch: worker 1@hostA failed (killed by SIGKILL (exit code 137)); '
                      'the job was stopped.'], out[-3000:]
    assert 'Traceback' not in out and '[mpirun]' not in out, out[-3000:]
    assert wait_no_survivors(r.tag) == [] and hosts.wait_no_leftovers() == {}


@pytest.mark.parametrize('sig,code', [(signal.SIGINT, 130), (signal.SIGKILL, -9)],
                         ids=['ctrl-c', 'kill-9'])
def test_launcher_mpi_ctrl_c_or_a_killed_launcher_leaves_nothing(clean, tmp_path, sig, code):
    """While the job runs on both hosts, d2l-launch gets SIGINT or dies (SIGKILL): its
    guard ends mpirun, mpirun its daemons, and every process of the job goes."""
    hosts = clean
    script = tmp_path / 'sleeper.py'
    script.write_text(SLEEPER)
    tag = new_tag()
    launcher = subprocess.Popen(mpi_argv(hosts, '-n', 2, '-s', 1, sys.executable, script,
                                         tag=tag),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                                start_new_session=True)
    lines, ready = read_until_ready(launcher, 2)
    try:
        assert ready.wait(120), ''.join(lines)
        os.kill(launcher.pid, sig)          # (ip netns exec became d2l-launch)
        assert launcher.wait(timeout=60) == code, ''.join(lines)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert wait_no_survivors(tag, timeout=30) == [], ''.join(lines)
    assert hosts.wait_no_leftovers(30) == {}

