"""Scripts started by Debian's Open MPI ``mpirun``, without d2l-launch (issue 32).

A d2ldist script started as ``mpirun -np 2 python train.py`` must run as one job of two
workers on the torch backend, reaching the exact sums of ``tests/jobs/exact_sums.py``;
a process started as one of several that cannot find the others fails in one line,
never running as a job of one. On this host, and across two hosts (network namespaces
with sshd, as the ssh tests have them) where mpirun starts the processes over ssh.
Nothing of the job is left afterwards (its tag, and every host's process table).
"""
import re
import sys

import pytest

from conftest import ROOT, hosts_for_tests, kill_leftovers, run_mpirun, wait_no_survivors
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
    'the ring backend': (
        [], {'D2L_BACKEND': 'ring'},
        "d2ldist: 2 workers started by mpirun: backend 'ring' needs a job started by "
        "d2l-launch; use backend 'torch' (the default here)"),
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
