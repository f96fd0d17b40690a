"""A job started by hand, without d2l-launch: each role with its D2L_* variables, as a
cluster manager d2ldist does not know (Kubernetes, a batch system) would start it
(ARCHITECTURE.md, "Starting a job by hand"; MXNet's "Manually launching jobs").

The test is that cluster manager: it starts the scheduler, 2 servers and 2 workers as
five plain processes, and the workers reach the exact sums of tests/jobs/exact_sums.py.
And it is a tool that starts N copies of a script on the ring (as mpirun does, with
its variables): rank 0 hosts the scheduler (d2ldist/runtime/hosted.py).
"""
import os
import re
import secrets
import subprocess
import sys

from support import ROOT, kill_tagged, new_tag, run_torchrun, wait_no_survivors
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
    ends in one line naming the refusal, not a traceback; the job goes on.

    The job's own workers start once the extra one has been refused: started together,
    the job could end (and its scheduler with it) before the extra one's registration
    came, on a busy machine, and it would wait for an answer nobody is left to give."""
    tag = new_tag()
    common = {'D2L_SCHEDULER_URI': '127.0.0.1', 'D2L_SCHEDULER_PORT': str(free_port()),
              'D2L_NUM_WORKER': '2', 'D2L_NUM_SERVER': '1',
              'D2L_JOB_SECRET': secrets.token_hex(32), 'D2L_TEST_TAG': tag}
    procs = [start('scheduler', ['-m', 'd2ldist.runtime.scheduler'], common),
             start('server', ['-m', 'd2ldist.kv'], common)]
    try:
        extra = start('worker', [EXACT_SUMS, 'kv'], dict(common, D2L_RANK='5'))
        refused = extra.communicate(timeout=150)[0]
        procs += [start('worker', [EXACT_SUMS, 'kv'], dict(common, D2L_RANK=str(r)))
                  for r in (0, 1)]
        outputs = [p.communicate(timeout=150)[0] for p in reversed(procs)][::-1]
    finally:
        kill_tagged(tag)
    assert extra.returncode == 1 and 'Traceback' not in refused, refused
    assert refused.splitlines()[-1].startswith('d2ldist: worker:5: cannot register worker rank 5: '
                                              'expected 2 workers, have'), refused
    assert [p.returncode for p in procs] == [0] * 4, '\n'.join(outputs)[-3000:]
    assert wait_no_survivors(tag) == []


def copies(n, tag, **env):
    """n copies of exact_sums.py on the ring, with the variables mpirun gives its processes."""
    common = dict(D2L_BACKEND='ring', MASTER_PORT=str(free_port()), D2L_TEST_TAG=tag,
                  OMPI_COMM_WORLD_SIZE=str(n), OMPI_COMM_WORLD_LOCAL_SIZE=str(n), **env)
    return [start('worker', [EXACT_SUMS, 'ring'], dict(
        common, OMPI_COMM_WORLD_RANK=str(r), OMPI_COMM_WORLD_LOCAL_RANK=str(r))) for r in range(n)]


def test_ring_copies_a_tool_started_meet_at_the_scheduler_rank_0_hosts():
    tag = new_tag()
    procs = copies(3, tag, D2L_JOB_SECRET=secrets.token_hex(32))
    try:
        outputs = [p.communicate(timeout=150)[0] for p in procs]
    finally:
        kill_tagged(tag)
    assert [p.returncode for p in procs] == [0] * 3, '\n'.join(outputs)[-3000:]
    assert outputs[0].splitlines()[0].startswith(
        'd2ldist: ring backend: 3 workers started by mpirun; rank 0 hosts the scheduler at '
        'tcp://127.0.0.1:'), outputs[0]
    assert [out.splitlines()[-1] for out in outputs] == [
        f'worker {r} of 3: ring sum on cpu exact' for r in range(3)]
    assert wait_no_survivors(tag) == []        # the scheduler too


def test_ring_copies_without_the_jobs_secret_fail_in_one_line():
    tag = new_tag()
    procs = copies(2, tag)
    try:
        outputs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        kill_tagged(tag)
    assert [p.returncode for p in procs] == [1, 1]
    assert [out.splitlines() for out in outputs] == [[
        "d2ldist: 2 workers started by mpirun: backend 'ring' needs the same D2L_JOB_SECRET "
        'in every process (export D2L_JOB_SECRET=$(python -c "import secrets; '
        'print(secrets.token_hex(16))"); mpirun: -x D2L_JOB_SECRET)']] * 2


def test_ring_copies_torchrun_started_meet_beside_its_own_store():
    """Under torchrun the rendezvous port is torchrun's own store's: the scheduler takes
    the next one, and the script runs unchanged."""
    tag = new_tag()
    r = run_torchrun(EXACT_SUMS, 'ring', env={'D2L_BACKEND': 'ring', 'D2L_TEST_TAG': tag,
                                              'D2L_JOB_SECRET': secrets.token_hex(32)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert sorted(re.findall(r'^worker \d of 2: ring sum on cpu \w+$', r.stdout, re.M)) == [
        'worker 0 of 2: ring sum on cpu exact', 'worker 1 of 2: ring sum on cpu exact']
    assert re.search(r'^d2ldist: ring backend: 2 workers started by torchrun; rank 0 hosts '
                     r'the scheduler at tcp://127\.0\.0\.1:\d+$', r.stderr, re.M), r.stderr
    assert wait_no_survivors(tag) == []
