"""Hosts that come and go in the middle of an elastic ring job (network namespaces with
sshd, as the ssh tests have them).

A host cut off the network for 10 s (``NetnsHosts.cut`` takes the bridge's end of its
link down, as if its cable were pulled).

tests/jobs/elastic_job.py trains on three workers, two on hostA (with the scheduler),
one on hostB, slowed down so that the job outlasts the cut. Per the options:

* the heartbeats may be silent longer than the cut (D2L_HEARTBEAT_TIMEOUT=30): the
  workers on hostA say who they wait for (the hang detector, D2L_HANG_WARN=3), and when
  hostB returns the job goes on and ends as if nothing happened;
* elastic (``--min-workers 2``, heartbeats 5 s): hostB's worker is left out, the two go
  on from their last commit, and when hostB returns its worker learns it is out and ends.

A host that a ``--host-discovery-script`` adds, then drops: a worker starts there and
joins at the workers' next commit, then is stopped, and the ring re-forms each time.

The weights are checked against elastic_job.py's replay of the same memberships, and
nothing of the job is left on any host.
"""
import re
import subprocess
import sys
import threading
import time

import pytest

from support import ROOT, hosts_for_tests, kill_leftovers, launch_argv, new_tag, \
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
                               'these tests need root to make network namespaces',
                               prefix='d2lcut', subnet='198.18.9')


@pytest.fixture
def clean(hosts):
    yield hosts
    hosts.mend('hostB')
    kill_leftovers(hosts)


class Launch:
    """d2l-launch --launcher ssh in the launcher's namespace, its output read on a thread."""

    def __init__(self, hosts, workers, *options):
        self.tag = new_tag()
        argv = ['ip', 'netns', 'exec', hosts.launcher_ns, *launch_argv(
            '--env', f'D2L_TEST_TAG={self.tag}', '--launcher', 'ssh', '--ssh-config',
            hosts.ssh_config, '-n', workers, '-s', 0, '--slow', 'worker:0=+250ms',
            '--timeout', 200, *options, 'python', JOB)]
        self.popen = subprocess.Popen([str(a) for a in argv], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        self.lines, self.new_line = [], threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.popen.stdout:
            with self.new_line:
                self.lines.append(line)
                self.new_line.notify_all()

    def wait_for(self, pattern, count=1, timeout=120):
        """Wait until ``count`` lines match ``pattern``."""
        with self.new_line:
            assert self.new_line.wait_for(
                lambda: sum(bool(re.search(pattern, x)) for x in self.lines) >= count,
                timeout), ''.join(self.lines)[-3000:]

    def end(self):
        """Wait for the launcher (kill it if it hangs): its return code, its output, and
        that output without the lines' hosts, as test_elastic's readers take it."""
        try:
            self.popen.wait(timeout=200)
        finally:
            if self.popen.poll() is None:
                self.popen.kill()
                self.popen.wait()
            self.reader.join(timeout=10)
        out = ''.join(self.lines)
        assert wait_no_survivors(self.tag) == []
        plain = re.sub(r'^\[(\w+(?: \d+)?)@host\w\]', r'[\1]', out, flags=re.M)
        return self.popen.returncode, out, plain


def cut_during_job(hosts, tmp_path, *options):
    """Three workers, two on hostA, one on hostB: cut hostB off for CUT s once all
    train; the launcher's return code, output, and output without hosts."""
    hostfile = hosts.hostfile(tmp_path / 'hosts', ['hostA slots=2', 'hostB slots=1'])
    job = Launch(hosts, 3, '--hostfile', hostfile, *options)
    try:
        job.wait_for('enters at batch 0', count=3)
        time.sleep(2)
        hosts.cut('hostB')
        time.sleep(CUT)
    finally:
        hosts.mend('hostB')
    return job.end()


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


def test_a_host_the_discovery_script_adds_then_drops_joins_then_leaves(clean, tmp_path):
    """horovodrun's --host-discovery-script: hostA alone, then hostB too (a worker starts
    there as rank 2 and joins), then hostA alone again (that worker is stopped)."""
    listed = tmp_path / 'listed'
    listed.write_text('hostA:2\n')
    script = tmp_path / 'discover.sh'
    script.write_text(f'#!/bin/sh\ncat {listed}\n')
    script.chmod(0o755)
    job = Launch(clean, 2, '--host-discovery-script', script, '--min-workers', 1,
                 '--max-workers', 3)
    job.wait_for('enters at batch 0', count=2)
    listed.write_text('hostA:2\nhostB:1\n')
    job.wait_for(r'worker 2: enters at batch \d+ as rank 2 of 3')
    time.sleep(1)
    listed.write_text('hostA:2\n')
    code, out, plain = job.end()
    assert code == 0, out[-4000:]
    for line in ('d2l-launch: hostB joins (host discovery): starting worker 2@hostB',
                 '[scheduler@hostA] d2ldist: worker 2 waits to join; the workers take it in '
                 'at their next commit',
                 '[scheduler@hostA] d2ldist: worker 2 joins; the ring re-forms with 3 workers '
                 '(round 1)',
                 'd2l-launch: hostB left the host discovery script: stopping worker 2@hostB'):
        assert line in out, out[-4000:]
    assert re.search(r'^\[scheduler@hostA\] d2ldist: worker 2 failed: .*; the ring re-forms '
                     r'with 2 workers \(round 2\)$', out, re.M), out[-4000:]
    for w in (0, 1):       # it joined at a commit: only its loss sent them back to one
        assert len(re.findall(rf'^\[worker {w}\b.*; back to the last commit$', out,
                              re.M)) == 1, out[-4000:]
    seen = entries(plain)
    assert [size for _, _, size in seen[0]] == [2, 3, 2], seen
    sizes = []
    for (batch, _, size), (until, _, _) in zip(seen[0], seen[0][1:] + [(STEPS, 0, 0)]):
        sizes += [size] * (until - batch)
    weights = finals(plain, 'done:')
    assert sorted(weights) == [0, 1] and weights[0] == weights[1]
    assert weights[0] == pytest.approx(replay(sizes), rel=1e-12, abs=1e-12)
