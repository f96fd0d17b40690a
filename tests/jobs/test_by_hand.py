"""A job started by hand, without d2l-launch: each role with its D2L_* variables, as a
cluster manager d2ldist does not know (Kubernetes, a batch system) would start it
(ARCHITECTURE.md, "Starting a job by hand"; MXNet's "Manually launching jobs").

The test is that cluster manager: it starts the scheduler, 2 servers and 2 workers as
five plain processes, and the workers reach the exact sums of tests/jobs/exact_sums.py.
"""
import os
import secrets
import subprocess
import sys

from conftest import ROOT, kill_tagged, new_tag, wait_no_survivors
from d2ldist.runtime.started import free_port

EXACT_SUMS = ROOT / 'tests' / 'jobs' / 'exact_sums.py'


def start(role, argv, common):
    """One process of the job: the variables every process gets, and its role."""
    env = {k: v for k, v in os.environ.items() if not k.startswith('D2L_')}
    env.update(common, D2L_ROLE=role, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED='1')
    return subprocess.Popen([sys.executable, *map(str, argv)], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_parameter_server_job_started_role_by_role():
    tag = new_tag()
    common = {'D2L_SCHEDULER_URI': '127.0.0.1', 'D2L_SCHEDULER_PORT': str(free_port()),
              'D2L_NUM_WORKER': '2', 'D2L_NUM_SERVER': '2',
              'D2L_JOB_SECRET': secrets.token_hex(32), 'D2L_TEST_TAG': tag}
    procs = [start('scheduler', ['-m', 'd2ldist.runtime.scheduler'], common)]
    procs += [start('server', ['-m', 'd2ldist.kv'], common) for _ in range(2)]
    procs += [start('worker', [EXACT_SUMS, 'kv'], common) for _ in range(2)]
    try:
        outputs = [p.communicate(timeout=150)[0] for p in reversed(procs)][::-1]
    finally:
        kill_tagged(tag)
    every = '\n'.join(outputs)
    assert [p.returncode for p in procs] == [0] * 5, every[-3000:]
    assert outputs[0].startswith('d2ldist: scheduler ready at tcp://127.0.0.1:'), outputs[0]
    # the scheduler gave the workers their ranks, in the order they registered
    assert sorted(line for out in outputs[3:] for line in out.splitlines()) == [
        'worker 0 of 2: kv sum on cpu exact', 'worker 1 of 2: kv sum on cpu exact'], every
    assert wait_no_survivors(tag) == []


def test_a_worker_the_scheduler_refuses_says_why_in_one_line():
    """A worker whose rank the job has not (5 of 2): the scheduler refuses it, and it
    ends in one line naming the refusal, not a traceback; the job goes on."""
    tag = new_tag()
    common = {'D2L_SCHEDULER_URI': '127.0.0.1', 'D2L_SCHEDULER_PORT': str(free_port()),
              'D2L_NUM_WORKER': '2', 'D2L_NUM_SERVER': '1',
              'D2L_JOB_SECRET': secrets.token_hex(32), 'D2L_TEST_TAG': tag}
    procs = [start('scheduler', ['-m', 'd2ldist.runtime.scheduler'], common),
             start('server', ['-m', 'd2ldist.kv'], common)]
    procs += [start('worker', [EXACT_SUMS, 'kv'], dict(common, D2L_RANK=str(r))) for r in (0, 1)]
    try:
        extra = start('worker', [EXACT_SUMS, 'kv'], dict(common, D2L_RANK='5'))
        refused = extra.communicate(timeout=150)[0]
        outputs = [p.communicate(timeout=150)[0] for p in reversed(procs)][::-1]
    finally:
        kill_tagged(tag)
    assert extra.returncode == 1 and 'Traceback' not in refused, refused
    assert refused.splitlines()[-1].startswith('d2ldist: worker:5: cannot register worker rank 5: '
                                              'expected 2 workers, have'), refused
    assert [p.returncode for p in procs] == [0] * 4, '\n'.join(outputs)[-3000:]
    assert wait_no_survivors(tag) == []
