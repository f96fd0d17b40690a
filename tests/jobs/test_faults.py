"""Stragglers and failures on demand: d2l-launch --slow and --fail in real jobs."""
import json
import re
import sys

import pytest

from support import ROOT, run_launch, wait_no_survivors

JOB = ROOT / 'tests' / 'jobs' / 'straggler_job.py'


def stretch(stdout):
    """Each worker's step 1 against the compute the Trainer measured in it, by rank: the
    median of step 1 / compute and of step 1 - compute over the steps (straggler_job.py)."""
    found = [json.loads(m) for m in re.findall(r'STEP1 (.*)', stdout)]
    return {f['rank']: (f['ratio'], f['added']) for f in found}


@pytest.mark.parametrize('slow,check', [
    ('3x', lambda ratio, added: 2.4 < ratio < 3.6),                  # the factor, within 20 %
    ('+200ms', lambda ratio, added: 0.16 < added < 0.24)])
def test_slow_stretches_one_workers_compute_step(slow, check):
    """--slow worker:1=... makes worker 1's step 1 take that much longer (also with a
    simulated network) than the compute it measured in that step; worker 0's is not
    stretched. Each step is compared with itself, so the load around it cancels."""
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
    assert 'never fired' not in out                # it did fire
    assert wait_no_survivors(r.tag) == []


def test_a_fail_past_the_jobs_last_step_is_said_never_to_have_fired():
    """--fail worker:1@step=400 in a job of 4 steps: both workers join and finish, the
    job succeeds, and its end says in one line that the fault never fired."""
    r = run_launch('-n', 2, '-s', 0, '--fail', 'worker:1@step=400', '--timeout', 90,
                   sys.executable, JOB, 'ring', 4, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert out.count('STEP1') == 2, out[-3000:]     # both trained to the end
    never = [line for line in r.stdout.splitlines() if 'never fired' in line]
    assert len(never) == 1 and never[0].startswith(
        'd2l-launch: --fail worker:1@step=400 never fired: worker 1 ended before its step '
        '400'), out[-3000:]
    assert wait_no_survivors(r.tag) == []


def test_fail_kills_a_server_at_a_time_and_the_job_stops():
    r = run_launch('-n', 2, '-s', 2, '--fail', 'server:1@1s', '--timeout', 90,
                   sys.executable, JOB.with_name('slow_kv_job.py'), timeout=120)
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert 'server 1 fails on purpose 1 s after it joined (--fail)' in out
    assert 'd2l-launch: server 1 failed (killed by SIGKILL' in out
    assert wait_no_survivors(r.tag) == []


# A plain torch.distributed script (PyTorch's DDP tutorial's shape, on the CPU): it never
# joins through d2ldist, so its --fail is the launcher's to fire
TORCH_JOB = '''
import time
import torch
import torch.distributed as dist
dist.init_process_group('gloo')
total = torch.zeros(1)
for step in range(30):                       # about 3 s
    x = torch.ones(1)
    dist.all_reduce(x)
    total += x
    time.sleep(0.1)
print(f'rank {dist.get_rank()} done: {total.item():g}', flush=True)
dist.destroy_process_group()
'''


def test_fail_on_a_plain_torch_script_counts_from_its_start(write_script):
    """--fail worker:1@2s on a script that never calls d2ldist: the launcher kills worker
    1 two seconds after it started, and the job, restarted, finishes; the step-based
    --fail on worker 0, which it cannot see, is said at the end never to have fired."""
    r = run_launch('-n', 2, '-s', 0, '--max-restarts', 1, '--fail', 'worker:1@2s',
                   '--fail', 'worker:0@step=2', '--timeout', 90, 'python',
                   write_script(TORCH_JOB), timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    lines = r.stdout.splitlines()
    said = lines.index('d2l-launch: worker 1 fails on purpose 2 s after it started (--fail; '
                       'it never joined through d2ldist, so the launcher kills it)')
    assert lines[said + 1:].count('d2l-launch: worker 1 failed (killed by SIGKILL (exit code '
                                  '137)); restart 1 of 1') == 1, out[-3000:]
    for rank in (0, 1):                        # the second attempt, to its end: 30 sums of 2
        assert lines.count(f'[worker {rank}] rank {rank} done: 60') == 1, out[-3000:]
    never = lines.index('d2l-launch: --fail worker:0@step=2 never fired: worker 0 never '
                        'joined through d2ldist (a step is a d2ldist training step)')
    assert lines[never + 1] == 'd2l-launch: 2 attempts:', out[-3000:]   # at the job's end
    assert 'd2ldist.fail' not in out                   # (the hidden word of d2ldist's own)
    assert wait_no_survivors(r.tag) == []
