"""Gradient compression in real jobs: accuracy kept, and the bytes on the wire counted.

The digits with a small network (compression_job.py), 2 workers: MXNet's 2-bit with
error feedback (parameter servers) ends within 2 points of the uncompressed accuracy
while sending 1/16 of the bytes (per slice, rounded up to whole bytes); fp16 halves
them, on the servers and on the ring; Horovod's Compression.fp16 runs through
allreduce and DistributedOptimizer.
"""
import json
import sys

import pytest

from support import ROOT, run_launch, wait_no_survivors

JOB = ROOT / 'tests' / 'jobs' / 'compression_job.py'
EPOCHS = 8


def by_rank(stdout, tag):
    """The JSON each worker printed after ``tag``, by its rank."""
    found = [json.loads(line.split(tag, 1)[1]) for line in stdout.splitlines() if tag in line]
    return {v['rank']: v for v in found}


def run(kvstore, params, servers=2):
    r = run_launch('-n', 2, '-s', servers, '--timeout', 150, sys.executable, JOB, kvstore,
                   json.dumps(params), EPOCHS, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert wait_no_survivors(r.tag) == []
    results = by_rank(r.stdout, 'RESULT ')
    assert sorted(results) == [0, 1]
    assert results[0]['acc'] == results[1]['acc']           # the same weights everywhere
    return results


def test_two_bit_keeps_the_accuracy_and_sends_a_sixteenth():
    """Worker 1 sends only its pushes (rank 0 also sent the initial weights)."""
    whole = run('dist_sync', None)
    two_bit = run('dist_sync', {'type': '2bit', 'threshold': 0.01})
    fp16 = run('dist_sync', {'type': 'fp16'})
    steps, params = whole[1]['steps'], whole[1]['params']
    assert whole[1]['sent'] == steps * 4 * params
    # the network's four parameters (192 x 128, 128, 128 x 10, 10), each on one server
    # (below the big-array bound): four values a byte, each key rounded up
    assert two_bit[1]['sent'] == steps * sum((n + 3) // 4 for n in (24576, 128, 1280, 10))
    assert 15.9 < whole[1]['sent'] / two_bit[1]['sent'] <= 16
    assert fp16[1]['sent'] == steps * 2 * params
    assert whole[0]['acc'] > 0.9
    assert abs(two_bit[0]['acc'] - whole[0]['acc']) <= 0.02, (two_bit[0], whole[0])
    assert abs(fp16[0]['acc'] - whole[0]['acc']) <= 0.01, (fp16[0], whole[0])


def test_fp16_on_the_ring_halves_the_bytes():
    whole, fp16 = run('ring', None, servers=0), run('ring', {'type': 'fp16'}, servers=0)
    steps, params = whole[1]['steps'], whole[1]['params']
    # 2 workers: each sends 2 (N - 1) / N = 1 times the gradients each step, and the
    # BatchNorm-free network has no other pushpull; rank 0's broadcast is the extra
    assert whole[1]['sent'] == steps * 4 * params
    assert fp16[1]['sent'] == steps * 2 * params
    assert abs(fp16[0]['acc'] - whole[0]['acc']) <= 0.01


HOROVOD = r'''
import json, torch
import d2ldist as hvd
torch.set_num_threads(1)
hvd.init()
r = hvd.rank()
x = torch.tensor([1.0, 1 / 3, 1000.0 + r])
avg = hvd.allreduce(x, compression=hvd.Compression.fp16)
grouped = hvd.grouped_allreduce([x, x.double()], compression=hvd.Compression.fp16)
torch.manual_seed(0)
net = torch.nn.Linear(4, 2)
opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                               named_parameters=net.named_parameters(),
                               compression=hvd.Compression.fp16)
net(torch.full((3, 4), float(r + 1))).sum().backward()
opt.step()
print('HVD ' + json.dumps({'rank': r, 'avg': avg.tolist(), 'dtype': str(avg.dtype),
                           'grouped': [g.dtype == t.dtype for g, t in zip(grouped, [x, x.double()])],
                           'w': net.weight.flatten().tolist()}), flush=True)
'''


def test_horovod_fp16_compression_through_allreduce_and_the_optimizer(write_script):
    r = run_launch('-n', 2, '-s', 0, '--timeout', 60, sys.executable, write_script(HOROVOD),
                   timeout=90)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    got = by_rank(r.stdout, 'HVD ')
    assert sorted(got) == [0, 1]
    for v in got.values():
        # the average in fp16 (1/3 rounds to 0.33325, 1000.5 is exact), back in float32
        assert v['avg'] == [1.0, 0.333251953125, 1000.5] and v['dtype'] == 'torch.float32'
        assert v['grouped'] == [True, True]
    assert got[0]['w'] == got[1]['w']                       # the same averaged gradient
    assert wait_no_survivors(r.tag) == []
