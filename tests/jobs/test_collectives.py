"""The ring's collectives against torch.distributed's gloo, in real jobs.

Each job runs tests/jobs/collectives_vs_gloo.py: every dtype, op, odd and prime
length (0, 1, ..., 1,000,003), strided inputs, every broadcast root, uneven
all-gathers, reduce-scatters and all-to-alls, compared with gloo on the same inputs in the
same processes; and the bytes each worker sends for a reduce-scatter ((N-1)/N of the
tensor), an all-reduce (twice that) and an all-to-all ((N-1)/N on torch.distributed, N-1
times the tensor through the ring's allgather), counted by the van on the ring and by the
kernel on gloo's connections.
"""
import subprocess
import sys

import pytest

from support import ROOT, run_launch, wait_no_survivors

JOBS = ROOT / 'tests' / 'jobs'


def ok_lines(r, n):
    return [line for line in r.stdout.splitlines() if ': ok ' in line and f' of {n}:' in line]


@pytest.mark.parametrize('num_workers, chunk_bytes, through', [
    (2, None, 'shm'), (3, 65536, 'shm'), (4, 40004, 'shm'), (3, 40004, 'tcp')])
def test_ring_matches_gloo(num_workers, chunk_bytes, through):
    """With the default chunks, and with small odd ones, so that segments are cut;
    through shared memory (one host) and over TCP (as between hosts: the ring's own
    streams, each chunk read in place)."""
    chunk = ['--env', f'D2L_RING_CHUNK={chunk_bytes}'] if chunk_bytes else []
    if through == 'tcp':
        chunk += ['--env', 'D2L_SHM=0']
    r = run_launch('-n', num_workers, '-s', 0, '--timeout', 240, *chunk,
                   sys.executable, JOBS / 'collectives_vs_gloo.py', timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert len(ok_lines(r, num_workers)) == num_workers, r.stdout[-3000:]
    assert wait_no_survivors(r.tag) == []


def test_torch_backend_matches_gloo():
    """The same API on backend 'torch' (bool, int16, strided, uneven all-gather)."""
    r = run_launch('-n', 2, '-s', 0, '--timeout', 240, '--env', 'D2L_BACKEND=torch',
                   sys.executable, JOBS / 'collectives_vs_gloo.py', timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert len(ok_lines(r, 2)) == 2, r.stdout[-3000:]


@pytest.mark.parametrize('env', [[], ['--env', 'D2L_SHM=0']], ids=['shm', 'tcp'])
def test_mismatched_sizes_fail_clearly(write_script, env):
    """Workers that all-reduce tensors of different sizes get an error, not a hang."""
    script = write_script(
        'import torch, d2ldist\n'
        'd2ldist.init()\n'
        'd2ldist.allreduce(torch.ones(1000 + d2ldist.rank()))\n')
    r = run_launch('-n', 2, '-s', 0, '--timeout', 60, *env, sys.executable, script,
                   timeout=90)
    assert r.returncode != 0
    assert 'the workers must call the same collectives in the same order' in r.stdout + r.stderr
    assert 'timed out' not in r.stdout + r.stderr
    assert wait_no_survivors(r.tag) == []


KILLED_MID_RING = r'''
import os, signal, torch, d2ldist
d2ldist.init()
x = torch.ones(4_000_000)
for step in range(100_000):
    d2ldist.allreduce_(x.fill_(1), op=d2ldist.Sum)
    if step == 5 and d2ldist.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)        # its neighbours are mid-collective
'''


def test_a_worker_killed_between_hosts_stops_the_job_in_one_line(write_script):
    """Over TCP (the ring's streams): worker 0's stream to the dead worker breaks and
    worker 2's from it ends; the job fails naming worker 1, no traceback, no survivor."""
    r = run_launch('-n', 3, '-s', 0, '--timeout', 60, '--env', 'D2L_SHM=0', sys.executable,
                   write_script(KILLED_MID_RING), timeout=90)
    out = r.stdout + r.stderr
    assert r.returncode not in (0, 124), out[-3000:]
    assert 'd2l-launch: worker 1 failed (killed by SIGKILL' in out, out[-3000:]
    assert 'Traceback' not in out, out[-3000:]
    assert wait_no_survivors(r.tag) == []


STANDALONE = r'''
import sys
import d2ldist
d2ldist.init()
assert 'torch' not in sys.modules, 'init() alone must not import torch'
assert (d2ldist.rank(), d2ldist.size(), d2ldist.local_rank(), d2ldist.local_size()) == (0, 1, 0, 1)
import torch
X = torch.arange(12.).view(3, 4).t()          # non-contiguous
for op in (d2ldist.Sum, d2ldist.Average, d2ldist.Min, d2ldist.Max):
    assert torch.equal(d2ldist.allreduce(X, op=op), X)
assert torch.equal(d2ldist.allreduce_(X.clone()), X)
assert torch.equal(d2ldist.broadcast(X, root_rank=0), X)
assert torch.equal(d2ldist.allgather(X), X)
d2ldist.barrier()
errors = []
for bad in (lambda: d2ldist.allreduce(X, op='median'),
            lambda: d2ldist.allreduce(torch.ones(2, dtype=torch.complex64)),
            lambda: d2ldist.broadcast(X, root_rank=1),
            lambda: d2ldist.allgather(torch.tensor(1.0)),
            lambda: d2ldist.init(backend='mpi')):
    try:
        bad()
    except (ValueError, TypeError, RuntimeError) as e:
        errors.append(str(e))
assert len(errors) == 5, errors
assert all('\n' not in e for e in errors), errors
print('\n'.join(errors))
'''


def test_standalone_collectives_are_identity():
    """Outside a job: rank 0 of 1, collectives return their input; bad input, one line."""
    env = {k: v for k, v in __import__('os').environ.items()
           if not k.startswith('D2L_') and k not in ('RANK', 'WORLD_SIZE')}
    env['PYTHONPATH'] = str(ROOT)
    r = subprocess.run([sys.executable, '-c', STANDALONE], capture_output=True, text=True,
                       timeout=120, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert 'unknown reduction' in r.stdout and 'complex64' in r.stdout, r.stdout


DISAGREE = r'''
import sys
import torch
import d2ldist
d2ldist.init()
r, case = d2ldist.rank(), sys.argv[1]
odd = r == 2                                   # worker 2 disagrees, the others agree
try:
    if case == 'shape':                        # the same number of values
        d2ldist.allreduce(torch.ones((3, 2) if odd else (2, 3)))
    elif case == 'dtype':                      # the same number of bytes
        d2ldist.allreduce(torch.ones(6, dtype=torch.int32 if odd else torch.float32))
    elif case == 'op':
        d2ldist.allreduce(torch.ones(6), op=d2ldist.Max if odd else d2ldist.Sum)
    elif case == 'root':
        d2ldist.broadcast(torch.ones(6), root_rank=2 if odd else 0)
    elif case == 'kind':
        (d2ldist.allgather if odd else d2ldist.allreduce)(torch.ones(6))
    print(f'worker {r}: no error', flush=True)
except RuntimeError as e:
    print(f'worker {r}: error: {e}', flush=True)
d2ldist.barrier()                              # the job itself goes on to its end
'''


@pytest.mark.parametrize('case', ['shape', 'dtype', 'op', 'root', 'kind'])
def test_disagreeing_calls_fail_on_every_worker(write_script, case):
    """Horovod's test_horovod_allreduce_error & co.: workers that call different collectives
    (same byte count) all get an error naming the two sides, instead of wrong data."""
    script = write_script(DISAGREE)
    r = run_launch('-n', 3, '-s', 0, '--timeout', 60, sys.executable, script, case,
                   timeout=90)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    errors = [line for line in r.stdout.splitlines() if ': error: ' in line]
    assert len(errors) == 3, r.stdout[-3000:]
    for line in errors:
        assert 'different collectives' in line and 'worker:2' in line, line
    assert 'no error' not in r.stdout
    assert wait_no_survivors(r.tag) == []
