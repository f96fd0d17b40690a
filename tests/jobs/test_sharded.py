"""ZeRO's ShardedOptimizer in real jobs (issue 31): stages 1 and 2, on the ring with 2 and
3 workers and on torch.distributed (gloo) with 2, each against one process training on
the whole global batch (tests/jobs/sharded_job.py). Values and byte counts, never times."""
import json
import sys

import pytest
import torch

from conftest import ROOT, run_launch, wait_no_survivors

JOB = ROOT / 'tests' / 'jobs' / 'sharded_job.py'
NUMELS = [24, 7, 35]        # the job's buckets: Linear(7, 3) (21 + 3), 7, 35 values
ITEMSIZE = 8                # float64


def results(stdout):
    found = [json.loads(line.split('RESULT ', 1)[1]) for line in stdout.splitlines()
             if 'RESULT ' in line]
    return {v['rank']: v for v in found}


@pytest.mark.parametrize('stage', [1, 2])
@pytest.mark.parametrize('n, backend', [(2, 'ring'), (3, 'ring'), (2, 'torch')])
def test_sharded_adam_is_adam_on_the_whole_batch(stage, n, backend):
    env = ['--env', 'D2L_BACKEND=torch'] if backend == 'torch' else []
    r = run_launch('-n', n, '-s', 0, '--timeout', 150, *env, sys.executable, JOB, stage,
                   timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert wait_no_survivors(r.tag) == []
    by_rank = results(r.stdout)
    assert sorted(by_rank) == list(range(n)), r.stdout[-3000:]
    padded = [-(-k // n) * n for k in NUMELS]
    for rank, got in by_rank.items():
        assert got['backend'] == backend and got['size'] == n
        assert got['padded'] == padded
        assert got['weights'] == by_rank[0]['weights']          # every worker the same
        for w, p in zip(got['weights'], got['plain']):
            assert torch.allclose(torch.tensor(w, dtype=torch.float64),
                                  torch.tensor(p, dtype=torch.float64), rtol=1e-10, atol=1e-13)
        # Adam's two moments for this worker's 1/N of the padded buckets
        assert got['state_bytes'] == 2 * sum(padded) // n * ITEMSIZE
        assert got['grads_gone'] == (stage == 2)
        if backend == 'ring':     # a reduce-scatter and an all-gather: 2 (N-1)/N each bucket
            assert got['sent'] == 2 * (n - 1) * sum(padded) // n * ITEMSIZE
