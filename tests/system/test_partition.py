"""A host cut off the network for 10 s, in the middle of a ring job across two hosts
(network namespaces with sshd, as the ssh tests have them; ``NetnsHosts.cut`` takes the
bridge's end of its link down, as if its cable were pulled).

tests/jobs/elastic_job.py trains on three workers, two on hostA (with the scheduler),
one on hostB, slowed down so that the job outlasts the cut. Per the options:

* the heartbeats may be silent longer than the cut (D2L_HEARTBEAT_TIMEOUT=30): the
  workers on hostA say who they wait for (the hang detector, D2L_HANG_WARN=3), and when
  hostB returns the job goes on and ends as if nothing happened;
* elastic (``--min-workers 2``, heartbeats 5 s): hostB's worker is left out, the two go
  on from their last commit, and when hostB returns its worker learns it is out and ends.

The weights are checked against elastic_job.py's replay of the same memberships, and
nothing of the job is left on any host.
"""
import re
import subprocess
import sys
import threading
import time

import pytest

from conftest import ROOT, hosts_for_tests, kill_leftovers, launch_argv, new_tag, \
    wait_no_survivors

sys.path.insert(0, str(ROOT / 'tests' / 'jobs'))     # the elastic jobs' script and readers
from elastic_job import STEPS, replay  # noqa: E402
from test_elastic import entries, finals  # noqa: E402

pytestmark = pytest.mark.timeout(240)

JOB = ROOT / 'tests' / 'jobs' / 'elastic_job.py'
CUT = 10.0                  # seconds hostB is off the network


@pytest.fixture(scope='module')
def hosts():
    yield from hosts_for_tests(('hostA', 'hostB'), ('ip', 'ssh', 'ssh-keygen'),
                               'the partition tests need root to make network namespaces',
                               prefix='d2lcut', subnet='198.18.9')


@pytest.fixture
def clean(hosts):
    yield hosts
    hosts.mend('hostB')
    kill_leftovers(hosts)


def cut_during_job(hosts, tmp_path, *options):
    """Run the job, cut hostB off for CUT s once every worker trains; the launcher's
    return code, its output, and that output with the lines' hosts left out (as
    test_elastic's readers take it: '[worker 2] ...')."""
    hostfile = hosts.hostfile(tmp_path / 'hosts', ['hostA slots=2', 'hostB slots=1'])
    tag = new_tag()
    argv = ['ip', 'netns', 'exec', hosts.launcher_ns, *launch_argv(
        '--env', f'D2L_TEST_TAG={tag}', '--launcher', 'ssh', '--ssh-config', hosts.ssh_config,
        '-H', hostfile, '-n', 3, '-s', 0, '--slow', 'worker:0=+250ms', '--timeout', 200,
        *options, 'python', JOB)]
    launcher = subprocess.Popen([str(a) for a in argv], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    lines, training = [], threading.Event()

    def read():
        for line in launcher.stdout:
            lines.append(line)
            if sum('enters at batch 0' in x for x in lines) == 3:
                training.set()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert training.wait(120), ''.join(lines)[-3000:]
        time.sleep(2)
        hosts.cut('hostB')
        time.sleep(CUT)
        hosts.mend('hostB')
        launcher.wait(timeout=200)
    finally:
        hosts.mend('hostB')
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        reader.join(timeout=10)
    out = ''.join(lines)
    assert wait_no_survivors(tag) == []
    plain = re.sub(r'^\[(\w+(?: \d+)?)@host\w\]', r'[\1]', out, flags=re.M)
    return launcher.returncode, out, plain


def test_a_host_cut_off_for_less_than_the_heartbeat_timeout_is_named_and_the_job_goes_on(
        clean, tmp_path):
    code, out, plain = cut_during_job(clean, tmp_path, '--env', 'D2L_HEARTBEAT_TIMEOUT=30',
                                      '--env', 'D2L_HANG_WARN=3')
    assert code == 0, out[-4000:]
    assert re.search(r'^\[worker [01]@hostA\] d2ldist: worker [01] has waited 3 s .*worker 2',
                     out, re.M), out[-4000:]
    weights = finals(plain, 'done:')
    assert sorted(weights) == [0, 1, 2] and weights[0] == weights[1] == weights[2]
    assert weights[0] == pytest.approx(replay([3] * STEPS), rel=1e-12, abs=1e-12)
    assert 'failed' not in out and 're-forms' not in out, out[-4000:]


def test_elastic_a_host_cut_off_longer_than_the_heartbeat_timeout_is_left_out(clean, tmp_path):
    code, out, plain = cut_during_job(clean, tmp_path, '--min-workers', 2)
    assert code == 0, out[-4000:]
    assert re.search(r'^\[scheduler@hostA\] d2ldist: worker 2 failed: no heartbeat for 5 s; '
                     r'the ring re-forms with 2 workers \(round 1\)$', out, re.M), out[-4000:]
    # back on the network, worker 2 learns that it is out, and ends in one line
    assert re.search(r'^\[worker 2@hostB\] d2ldist: worker 2 was left out of the workers '
                     r'\(no heartbeat for 5 s\)$', out, re.M), out[-4000:]
    assert re.search(r'^d2l-launch: worker 2@hostB failed \(exit code 1\); 2 workers go on '
                     r'\(--min-workers 2\)$', out, re.M), out[-4000:]
    seen = entries(plain)
    k = seen[0][1][0]
    assert seen[0] == [(0, 0, 3), (k, 0, 2)] and seen[1] == [(0, 1, 3), (k, 1, 2)]
    weights = finals(plain, 'done:')
    assert sorted(weights) == [0, 1] and weights[0] == weights[1]
    assert weights[0] == pytest.approx(replay([3] * k + [2] * (STEPS - k)), rel=1e-12, abs=1e-12)
