"""Stragglers and failures on demand: d2l-launch --slow and --fail in real jobs."""
import json
import re
import sys

import pytest

from support import ROOT, run_launch, wait_no_survivors

JOB = ROOT / 'tests' / 'jobs' / 'straggler_job.py'


def stretch(stdout):
    """Each worker's step 1 against the same pass right after it, by rank: the median of
    step 1 / pass and of step 1 - pass over the steps (straggler_job.py)."""
    found = [json.loads(m) for m in re.findall(r'STEP1 (.*)', stdout)]
    return {f['rank']: (f['ratio'], f['added']) for f in found}


@pytest.mark.parametrize('slow,check', [
    ('3x', lambda ratio, added: 2.4 < ratio < 3.6),                  # the factor, within 20 %
    ('+200ms', lambda ratio, added: 0.16 < added < 0.24)])
def test_slow_stretches_one_workers_compute_step(slow, check):
    """--slow worker:1=... makes worker 1's step 1 take that much longer (also with a
    simulated network) than the same pass right after it; worker 0's is not stretched.
    Each worker is compared with itself, step by step, under the same load."""
    network = ['--bandwidth', '1Gbit'] if slow.startswith('+') else []
    r = run_launch('-n', 2, '-s', 0, '--slow', f'worker:1={slow}', *network, '--timeout', 90,
                   sys.executable, JOB, 'ring', 22, timeout=120)       # medians of 20 steps
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    found = stretch(r.stdout)
    assert sorted(found) == [0, 1] and check(*found[1]), found
    assert not check(*found[0]), found                 # worker 0 computes as before
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
