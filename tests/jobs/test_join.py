"""hvd.join() in real jobs: workers with uneven numbers of batches (join_checks.py)."""
import re
import sys

import pytest

from support import ROOT, run_launch, wait_no_survivors

CHECKS = ROOT / 'tests' / 'jobs' / 'join_checks.py'
TORCH = ['--env', 'D2L_BACKEND=torch']


@pytest.mark.parametrize('mode,batches,env', [
    ('collectives', '1,3', []), ('collectives', '3,0,1', []),
    ('optimizer', '1,3', []), ('optimizer', '2,0,3', []),
    ('collectives', '3,0,1', ['--env', 'D2L_SHM=0']),     # (the ring's own TCP links)
    ('collectives', '3,0,1', TORCH), ('optimizer', '2,0,3', TORCH)],
    ids=['ring-1,3', 'ring-3,0,1', 'ring-opt-1,3', 'ring-opt-2,0,3', 'tcp-3,0,1',
         'torch-3,0,1', 'torch-opt-2,0,3'])
def test_workers_out_of_data_join(mode, batches, env):
    """Exact results on the workers still training (the joined give zeros, the op's
    identity, no rows), barriers, the last rank on every worker, two rounds; on the
    ring and on torch.distributed (each call says what it is first)."""
    n = len(batches.split(','))
    r = run_launch('-n', n, '-s', 0, '--timeout', 120, *env, sys.executable, CHECKS, mode,
                   batches, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    oks = re.findall(rf'worker \d of {n}: ok, last joined (\[.*\])', r.stdout)
    assert len(oks) == n and len(set(oks)) == 1, r.stdout[-3000:]
    assert wait_no_survivors(r.tag) == []


BROADCAST_FROM_JOINED = r'''
import torch
import d2ldist as hvd
torch.set_num_threads(1)
hvd.init()
r = hvd.rank()
if r == 1:
    try:
        hvd.broadcast(torch.ones(3), root_rank=0)
    except RuntimeError as e:
        print(f'worker 1: error: {e}', flush=True)
last = hvd.join()
assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [2.0, 2.0]
print(f'worker {r}: last {last}', flush=True)
'''


@pytest.mark.parametrize('env', [[], ['--env', 'D2L_SHM=0'], TORCH], ids=['shm', 'tcp', 'torch'])
def test_a_broadcast_from_a_joined_worker_fails_clearly(write_script, env):
    """Its root is out of data: an error in one line on the others, not a hang; the
    job goes on (the failed broadcast counts nowhere) and ends."""
    r = run_launch('-n', 2, '-s', 0, '--timeout', 60, *env, sys.executable,
                   write_script(BROADCAST_FROM_JOINED), timeout=90)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert 'worker 1: error: broadcast from worker 0, which has called join()' in r.stdout
    assert 'worker 0: last 1' in r.stdout and 'worker 1: last 1' in r.stdout, r.stdout
    assert wait_no_survivors(r.tag) == []


def test_a_worker_that_ends_without_join_fails_the_others_clearly(write_script):
    """Worker 1 never calls join(): worker 0, waiting in it, gets an error, not a hang."""
    script = write_script('import torch, d2ldist as hvd\n'
                          'hvd.init()\n'
                          'hvd.allreduce(torch.ones(2))\n'
                          'if hvd.rank() == 0:\n'
                          '    hvd.join()\n')
    r = run_launch('-n', 2, '-s', 0, '--timeout', 60, sys.executable, script, timeout=90)
    assert r.returncode != 0
    assert 'worker 1 ended without calling join() while worker 0 waited in it' \
        in r.stdout + r.stderr, r.stdout[-3000:] + r.stderr[-3000:]
    assert 'timed out' not in r.stdout + r.stderr
    assert wait_no_survivors(r.tag) == []


def test_on_torch_a_worker_that_ends_without_join_fails_the_others_clearly(write_script):
    """torch.distributed cannot say who: the one in join() says what happened, in a line."""
    script = write_script('import torch, d2ldist as hvd\n'
                          'hvd.init()\n'
                          'hvd.allreduce(torch.ones(2))\n'
                          'if hvd.rank() == 0:\n'
                          '    hvd.join()\n')
    r = run_launch('-n', 2, '-s', 0, '--timeout', 60, *TORCH, sys.executable, script,
                   timeout=90)
    assert r.returncode != 0
    assert 'RuntimeError: join(): a worker stopped while this one waited in it: every ' \
        'worker must call hvd.join() (torch.distributed: ' in r.stdout + r.stderr, \
        r.stdout[-3000:] + r.stderr[-3000:]
    assert 'timed out' not in r.stdout + r.stderr
    assert wait_no_survivors(r.tag) == []
