"""Stragglers and failures on demand: d2l-launch --slow and --fail in real jobs."""
import json
import re
import sys

import pytest

from conftest import ROOT, run_launch, wait_no_survivors

JOB = ROOT / 'tests' / 'jobs' / 'straggler_job.py'


def step1_times(stdout):
    """Each worker's mean step-1 time (forward and backward), by rank."""
    found = [json.loads(m) for m in re.findall(r'STEP1 (.*)', stdout)]
    return {f['rank']: f['step1'] for f in found}


@pytest.mark.parametrize('slow,check', [
    ('3x', lambda fast, slow: 2.4 < slow / fast < 3.6),              # the factor, within 20 %
    ('+200ms', lambda fast, slow: 0.16 < slow - fast < 0.24)])
def test_slow_stretches_one_workers_compute_step(slow, check):
    """--slow worker:1=... makes worker 1's step 1 take that much longer (also with a
    simulated network); worker 0 computes as before and waits for it."""
    network = ['--bandwidth', '1Gbit'] if slow.startswith('+') else []
    r = run_launch('-n', 2, '-s', 0, '--slow', f'worker:1={slow}', *network, '--timeout', 90,
                   sys.executable, JOB, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    times = step1_times(r.stdout)
    assert sorted(times) == [0, 1] and check(times[0], times[1]), times
    assert wait_no_survivors(r.tag) == []


def test_fail_kills_a_worker_at_its_step_and_the_job_stops():
    r = run_launch('-n', 2, '-s', 0, '--fail', 'worker:1@step=3', '--timeout', 90,
                   sys.executable, JOB, timeout=120)
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert 'worker 1 fails on purpose after its compute step 3 (--fail)' in out
    assert 'd2l-launch: worker 1 failed (killed by SIGKILL' in out
    assert 'STEP1' not in out                      # nobody went on to the end
    assert wait_no_survivors(r.tag) == []


def test_fail_kills_a_server_at_a_time_and_the_job_stops():
    r = run_launch('-n', 2, '-s', 2, '--fail', 'server:1@1s', '--timeout', 90,
                   sys.executable, JOB.with_name('slow_kv_job.py'), timeout=120)
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert 'server 1 fails on purpose 1 s after it joined (--fail)' in out
    assert 'd2l-launch: server 1 failed (killed by SIGKILL' in out
    assert wait_no_survivors(r.tag) == []
