"""Exact sums through the parameter server or the ring, for jobs that cross hosts.

    d2l-launch -n 2 -s 2 python tests/jobs/exact_sums.py kv
    d2l-launch -n 3 -s 0 python tests/jobs/exact_sums.py ring
    d2l-launch -n 2 -s 2 python tests/jobs/exact_sums.py kv cuda     # tensors on the GPU
    d2l-launch -n 1 --env D2L_BACKEND=torch python tests/jobs/exact_sums.py ring cuda   # NCCL

Worker r contributes (r + 1) * [0, 1, 2, ...]; with N workers the sum is
N(N + 1)/2 * [0, 1, 2, ...], exact in float32 at these sizes. A big key (over the
big-array bound) is split over all servers; a small one lives on one.

Each line is one write (``say``): under torchrun or mpirun the workers share one pipe,
and with PYTHONUNBUFFERED print's text and its newline are two writes, which another
worker's line can come between.
"""
import sys

import torch

import d2ldist

BIG = 1_000_003


def say(line):
    """Print ``line`` in one write (it cannot be cut by another worker's)."""
    sys.stdout.write(line + '\n')
    sys.stdout.flush()


what = sys.argv[1]
device = torch.device(sys.argv[2] if len(sys.argv) > 2 else 'cpu')
if what == 'kv':
    kv = d2ldist.kv.create('dist_sync')
    rank, n = kv.rank, kv.num_workers
    kv.init(['small', 'big'], [torch.zeros(5), torch.zeros(BIG)])
    out = [torch.empty(5, device=device), torch.empty(BIG, device=device)]
    kv.pushpull(['small', 'big'], [torch.arange(5., device=device) * (rank + 1),
                                   torch.arange(float(BIG), device=device) * (rank + 1)], out=out)
    want = [torch.arange(5.) * n * (n + 1) / 2, torch.arange(float(BIG)) * n * (n + 1) / 2]
else:
    d2ldist.init()
    rank, n = d2ldist.rank(), d2ldist.size()
    out = [d2ldist.allreduce(torch.arange(float(BIG), device=device) * (rank + 1),
                             op=d2ldist.Sum)]
    want = [torch.arange(float(BIG)) * n * (n + 1) / 2]
    if d2ldist.collectives.world.name() == 'torch':
        say(f'worker {rank}: torch.distributed on {torch.distributed.get_backend()}')
ok = all(o.device.type == device.type and torch.equal(o.cpu(), w) for o, w in zip(out, want))
say(f'worker {rank} of {n}: {what} sum on {device.type} {"exact" if ok else "WRONG"}')
sys.exit(0 if ok else 1)
