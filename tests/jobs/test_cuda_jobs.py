"""Jobs whose workers compute on a GPU: the stores, the ring, torch.distributed, training.

Skipped without CUDA (CI's machines have none); run where a GPU is. On one GPU the
workers share it: the ring and the parameter server take its tensors through pinned
CPU memory, and torch.distributed runs on gloo, because NCCL refuses two processes on
one GPU; one worker per GPU runs on NCCL.
"""
import re
import sys

import pytest
import torch

from support import ROOT, run_launch, wait_no_survivors

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason='no GPU here')
JOBS = ROOT / 'tests' / 'jobs'
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize('args, backend', [
    (['-n', 2, '-s', 2, 'kv'], None),
    (['-n', 2, '-s', 2, '--env', 'D2L_SHM=0', 'kv'], None),   # answers on the workers' streams
    (['-n', 2, '-s', 0, 'ring'], None),
    (['-n', 2, '-s', 0, '--env', 'D2L_SHM=0', 'ring'], None),           # the ring's streams
    (['-n', 1, '-s', 0, '--env', 'D2L_BACKEND=torch', 'ring'], 'nccl'),
    (['-n', 2, '-s', 0, '--env', 'D2L_BACKEND=torch', 'ring'], 'nccl' if GPUS >= 2 else 'gloo'),
], ids=['kv', 'kv-tcp', 'ring', 'ring-tcp', 'torch-1', 'torch-2'])
def test_exact_sums_of_gpu_tensors(args, backend):
    """Every worker's result is exact and stays on the GPU it came from."""
    *launcher, what = args
    n = launcher[1]
    r = run_launch(*launcher, sys.executable, JOBS / 'exact_sums.py', what, 'cuda', timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for rank in range(n):
        assert f'worker {rank} of {n}: {what} sum on cuda exact' in r.stdout, r.stdout[-3000:]
        if backend:
            assert f'worker {rank}: torch.distributed on {backend}' in r.stdout, r.stdout
    assert wait_no_survivors(r.tag) == []


@pytest.mark.parametrize('kvstore', ['dist_sync', 'ring', 'torch'])
def test_training_script_on_two_replicas_of_a_gpu(kvstore):
    """The chapter's script, each worker with two replicas on the GPU: one epoch of the
    digits; both workers end with the same test accuracy (same weights, same BatchNorm
    statistics), and it learned."""
    r = run_launch('-n', 2, '-s', 2 if kvstore == 'dist_sync' else 0,
                   sys.executable, ROOT / 'examples' / 'multimachine_cifar10_train.py',
                   '--kvstore', kvstore, '--devices', 'cuda:0,cuda:0', '--epochs', '2',
                   '--width', '8', '--data', 'digits', '--root', '/nonexistent', timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert 'devices cuda:0,cuda:0' in r.stdout
    accs = re.findall(r'^\[worker (\d)\] epoch 2, .* test acc (\d\.\d{3})', r.stdout, re.M)
    assert sorted(rank for rank, _ in accs) == ['0', '1'], r.stdout[-3000:]
    assert accs[0][1] == accs[1][1] and float(accs[0][1]) > 0.5, accs
    assert wait_no_survivors(r.tag) == []
