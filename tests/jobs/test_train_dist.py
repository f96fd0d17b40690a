"""The seven steps in real jobs: the Trainer on the parameter server, the ring and torch.

Every job: 2 workers, each with two CPU replicas (devices [cpu, cpu]), a small CNN
with BatchNorm, a few steps of SGD with momentum and weight decay, and a learning
rate change half way (which must keep the momentum). The workers' scripts are in
``train_jobs.py``.

The reference is one process with FOUR replicas training on both workers' batches
together: ``split_and_load`` gives replica 2w+d exactly what device d of worker w
sees, so even BatchNorm (which normalizes each replica's slice with that slice's
statistics) sees the same numbers. What differs is only the order of float32
additions: the reference adds the four replicas' gradients on one device, a job
adds two on each worker and then the workers' sums (on a server or in the ring),
and scales each worker's part apart. Those roundings are of order 1e-7 relative
per step (measured with dist_sync after 4 steps: losses 1.8e-7 apart, weights
1.5e-8); we allow 1e-5 on the losses (values about 2.3) and 1e-5 relative +
1e-6 absolute on the weights, 50 times that. A real mistake -- a worker's
gradient missing or counted twice, the scale applied twice, a worker not starting
from rank 0's weights (rank 1 seeds its network differently on purpose), a lost
momentum at the learning-rate change -- moves losses and weights by 1e-2 or more.

BatchNorm's running statistics: the Trainer averages them over the replicas and
the workers in step 7, so both workers must hold the very same ones (bit for bit:
they pulled them from one store), equal to the reference's (which averages its four
replicas') to rounding. Without that exchange each worker keeps the statistics of
its own batches (measured: running means 1.6e-2 and variances 6.8e-3 apart).
"""
import json
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_jobs  # noqa: E402
from support import run_job  # noqa: E402

pytestmark = pytest.mark.timeout(180)
SCRIPT = str(Path(train_jobs.__file__))
LOSS_TOL, RTOL, ATOL = 1e-5, 1e-5, 1e-6


def train(n, s, *kinds):
    """Run train_jobs.py as every worker of a job; its RESULT lines by (kind, rank)."""
    r = run_job(n, s, sys.executable, SCRIPT, *kinds)
    results = {}
    for line in r.stdout.splitlines():
        m = re.match(r'\[worker (\d+)\] RESULT (.*)$', line)
        if m:
            v = json.loads(m.group(2))
            results[v['kind'], int(m.group(1))] = v
    assert sorted(results) == sorted((k, w) for k in kinds for w in range(n)), r.stdout[-3000:]
    return results


@pytest.fixture(scope='module')
def ref():
    return train_jobs.reference(num_workers=2, devices_per_worker=2)


def check_same_as_one_process(results, kind, ref, update_on_kvstore):
    ref_losses, ref_weights, ref_buffers = ref
    w0, w1 = results[kind, 0], results[kind, 1]
    assert w0['num_workers'] == 2 and w0['update_on_kvstore'] == update_on_kvstore
    # the loss of each step over both workers' batches = the reference's loss
    losses = [(a + b) / 2 for a, b in zip(w0['losses'], w1['losses'])]
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < LOSS_TOL, (losses, ref_losses)
    assert ref_losses[-1] != pytest.approx(ref_losses[0], abs=1e-2)      # it did train
    assert w0['buffers'] == w1['buffers']        # the workers share BatchNorm's statistics
    for w in (w0, w1):                       # both workers hold the reference's weights
        assert torch.allclose(torch.tensor(w['weights']), ref_weights, rtol=RTOL, atol=ATOL)
        # and the BatchNorm statistics of all four replicas, averaged
        assert torch.allclose(torch.tensor(w['buffers'], dtype=torch.float64), ref_buffers,
                              rtol=RTOL, atol=ATOL)
        # the devices of each worker held identical weights after every step
        assert w['identical'] is True
        # all seven steps were timed once per batch, and took time
        assert list(w['step_times']) == [str(s) for s in range(1, 8)]
        assert all(t > 0 for t in w['step_times'].values()), w['step_times']
        assert set(w['counts'].values()) == {train_jobs.STEPS}


def test_dist_sync_2_workers_2_servers_follows_one_process(ref):
    results = train(2, 2, 'dist_sync')
    check_same_as_one_process(results, 'dist_sync', ref, update_on_kvstore=True)


def test_ring_and_torch_follow_one_process(ref):
    """'ring' (d2ldist's ring), then 'torch' (gloo's all-reduce), in the same job."""
    results = train(2, 0, 'ring', 'torch')
    check_same_as_one_process(results, 'ring', ref, update_on_kvstore=False)
    check_same_as_one_process(results, 'torch', ref, update_on_kvstore=False)


def test_dist_sync_device_follows_one_process(ref):
    results = train(2, 1, 'dist_sync_device')
    check_same_as_one_process(results, 'dist_sync_device', ref, update_on_kvstore=True)


def test_dist_async_runs_and_learns():
    """Each worker's push updates the weights alone: no reference, but the loss on each
    worker's (fixed) batch must fall, and the replicas must stay identical."""
    results = train(2, 1, 'dist_async')
    for rank in (0, 1):
        w = results['dist_async', rank]
        assert w['update_on_kvstore'] is True and w['identical'] is True
        first, last = w['losses'][0], w['losses'][-1]
        assert last < 0.7 * first, w['losses']
        assert all(t > 0 for t in w['step_times'].values())


def test_training_script_in_a_dist_sync_job_reports_progress(tmp_path):
    """The chapter's script as 2 workers x 1 server (a tiny ResNet, one epoch): every
    worker prints its epoch line, and its report lines become the launcher's progress."""
    script = Path(__file__).resolve().parents[2] / 'examples' / 'multimachine_cifar10_train.py'
    r = run_job(2, 1, sys.executable, script, '--kvstore', 'dist_sync', '--data', 'digits',
                '--epochs', 1, '--width', 4, '--batch-size', 100, '--lr', 0.1, '--threads', 1,
                '--root', tmp_path)
    for w in (0, 1):
        assert f'[worker {w}] worker {w} of 2, kvstore dist_sync' in r.stdout
        assert re.search(rf'^\[worker {w}\] epoch 1, loss \d\.\d{{3}}, train acc \d\.\d{{3}}, '
                         r'test acc \d\.\d{3}, time \d+\.\d sec, lr 0\.1$', r.stdout, re.M)
        # 7 batches of 100 per worker: reports after batches 5 and 7 (the last)
        for b in (5, 7):
            assert re.search(rf'^\[worker {w}\] .*epoch 1/1 batch {b}/7 loss \d', r.stdout, re.M)
        assert '@d2l/1' not in r.stdout                     # report lines are not in the log
