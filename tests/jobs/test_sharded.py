"""ZeRO in real jobs (issue 31): stages 1 and 2 (ShardedOptimizer) and 3 (shard_module),
one after the other in one job, on the ring with 2 and 3 workers and on
torch.distributed (gloo) with 2, where PyTorch's own fully_shard (FSDP2) and DDP follow;
each against one process training on the whole global batch, and on gloo against DDP
in the same job (tests/jobs/sharded_job.py).
Values and byte counts, never times."""
import json
import sys

import pytest
import torch

from support import ROOT, run_launch, wait_no_survivors

from d2ldist.collectives.sharded import paper_memory

JOB = ROOT / 'tests' / 'jobs' / 'sharded_job.py'
NUMELS = {1: [24, 7, 35], 2: [24, 7, 35],  # the buckets: Linear(7, 3) (21 + 3), 7, 35 values
          3: [42, 24]}                     # the units: Linear(5, 7), Linear(7, 3)
ITEMSIZE = 8                # float64
PSI = 66                    # the weights


def results(stdout):
    found = [json.loads(line.split('RESULT ', 1)[1]) for line in stdout.splitlines()
             if 'RESULT ' in line]
    return {(v['stage'], v['rank']): v for v in found}


def assert_close(weights, expected):
    """Weights (lists, per parameter) equal to ``expected`` up to float64 rounding."""
    for w, e in zip(weights, expected, strict=True):
        assert torch.allclose(torch.tensor(w, dtype=torch.float64),
                              torch.tensor(e, dtype=torch.float64), rtol=1e-10, atol=1e-13)


def peak_memory(stage, n):
    """The last step's peak bytes by kind: the paper's formulas (in float64) plus what
    tests/unit/test_sharded_units.py names (stage 2: the collectives overlap backward, so
    the gradients at the peak depend on how far they have got: see the test)."""
    padded = [-(-k // n) * n for k in NUMELS[stage]]
    shard = ITEMSIZE * sum(padded) // n
    paper = paper_memory(stage, NUMELS[stage], n, ITEMSIZE)
    extra = {1: {'weights': shard, 'gradients': shard}, 2: {'weights': shard},
             3: {'weights': ITEMSIZE * 42, 'gradients': ITEMSIZE * 42}}[stage]
    return {kind: paper[kind] + extra.get(kind, 0) for kind in paper}


def check_fsdp2(got, n):
    """PyTorch's fully_shard (FSDP2) on gloo, the same steps: the same weights; but each
    parameter is cut by rows, ceil(rows / N) to a worker (the last ones may get fewer),
    its shard kept padded to that, and Adam's state made for the rows held. (The peak
    here is the start's and the end's: FSDP2's gathered weights are its own, unseen.)"""
    assert_close(got['weights'], got['plain'])
    shapes = [(7, 5), (7, 1), (3, 7), (3, 1)]                 # (rows, columns)
    chunk = [-(-rows // n) for rows, _ in shapes]
    mine = [max(0, min(c, rows - got['rank'] * c)) for c, (rows, _) in zip(chunk, shapes)]
    assert got['state_bytes'] == 2 * ITEMSIZE * sum(m * cols for m, (_, cols) in
                                                    zip(mine, shapes))
    padded = ITEMSIZE * sum(c * cols for c, (_, cols) in zip(chunk, shapes))
    assert got['peak'] == {'weights': padded, 'gradients': padded,
                           'optimizer state': got['state_bytes']}


@pytest.mark.parametrize('n, backend', [(2, 'ring'), (3, 'ring'), (2, 'torch')])
def test_zero_is_adam_on_the_whole_batch_with_the_papers_bytes_and_memory(n, backend):
    env = ['--env', 'D2L_BACKEND=torch'] if backend == 'torch' else []
    stages = '123wfd' if backend == 'torch' else '123w'   # f: PyTorch's FSDP2, d: DDP
    r = run_launch('-n', n, '-s', 0, '--timeout', 150, *env, sys.executable, JOB, stages,
                   timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert wait_no_survivors(r.tag) == []
    found = results(r.stdout)
    assert sorted(found, key=str) == sorted(((int(s) if s.isdigit() else s, k)
                                             for s in stages for k in range(n)), key=str)
    for (stage, rank), got in found.items():
        if stage == 'f':
            check_fsdp2(got, n)
            continue
        if stage == 'd':          # DDP: every worker the same, and the whole batch's
            assert got['weights'] == found['d', 0]['weights']
            assert_close(got['weights'], got['plain'])
            continue
        if backend == 'torch':    # each stage ends with DDP's weights, on the same workers
            assert_close(got['weights'], found['d', rank]['weights'])
        limited, stage = stage == 'w', 2 if stage == 'w' else stage   # (w: 2, limited)
        padded = [-(-k // n) * n for k in NUMELS[stage]]
        assert got['backend'] == backend and got['size'] == n
        assert got['padded'] == padded
        assert got['weights'] == found['w' if limited else stage, 0]['weights']  # all alike
        assert_close(got['weights'], got['plain'])
        # Adam's two moments for this worker's 1/N of the padded buckets (or units)
        assert got['state_bytes'] == 2 * sum(padded) // n * ITEMSIZE
        assert got['grads_gone'] == (stage >= 2)
        expected = peak_memory(stage, n)
        if stage == 2:   # from the last bucket whole beside the others' shards (their
            # reduce-scatters kept up with backward) to every bucket whole (none had ended)
            low = ITEMSIZE * (sum(padded[:2]) // n + padded[2])
            high = ITEMSIZE * sum(padded)
            if limited:  # backward waited for each: one bucket whole at most, in any run
                assert got['peak'].pop('gradients') == low
            else:
                assert low <= got['peak'].pop('gradients') <= high
            expected.pop('gradients')
        assert got['peak'] == expected
        # stages 1-2: a reduce-scatter and an all-gather of each bucket, 2 (N-1)/N of it:
        # the all-reduce's bytes; stage 3: one more all-gather, 1.5 times that. The ring's
        # van counts them exactly; on gloo the kernel counts them with gloo's headers and
        # each call's check (the reduce-scatter an all-to-all, not gloo's all-reduce)
        values = (3 if stage == 3 else 2) * (n - 1) * sum(padded) // n * ITEMSIZE
        if backend == 'ring':
            assert got['sent'] == values
        else:
            calls = 3 * len(padded) if stage == 3 else 2 * len(padded)
            assert values < got['wire'] < values + 4096 * calls
            if stage != 3:                # stages 1, 2 and w: the same calls, the same bytes
                assert got['wire'] == found[1, rank]['wire']
