"""hvd.join() in a real job: workers with different numbers of batches.

    d2l-launch -n 3 -s 0 python tests/jobs/join_checks.py collectives 3,0,1
    d2l-launch -n 2 -s 0 python tests/jobs/join_checks.py optimizer 1,3

Worker r runs batches[r] batches, then calls hvd.join(); then the same again with the
batches reversed (a second round). ``collectives``: every batch runs each collective and
checks its exact result (a worker that has joined gives zeros -- the op's identity for
Min and Max -- counts at barriers; a broadcast, allgather or alltoall fails on every
worker still training, as Horovod's). ``optimizer``: DistributedOptimizer's averaged gradients, and
broadcast_parameters from the rank join() returned. Prints one 'ok' line per worker.
"""
import sys

import torch
from torch import nn

import d2ldist as hvd

torch.set_num_threads(1)
hvd.init()
r, N = hvd.rank(), hvd.size()


def check(ok, what):
    if not ok:
        sys.exit(f'worker {r}: FAILED {what}')


def value(rank, b):
    """What worker ``rank`` contributes at batch b: distinct digits, exact in float64."""
    return float((b + 1) * 10 ** rank)


def full(x, shape=(2, 3), dtype=torch.float64):
    return torch.full(shape, x, dtype=dtype)


def collectives(b, training):
    """One batch of collectives among the workers in ``training`` (the others joined)."""
    x, total = full(value(r, b)), sum(value(i, b) for i in training)
    check(torch.equal(hvd.allreduce(x, op=hvd.Sum), full(total)), f'Sum at batch {b}')
    check(torch.equal(hvd.allreduce(x, op=hvd.Average), full(total / N)),
          'Average divides by all workers, as Horovod')
    smallest = min(value(i, b) for i in training)
    check(torch.equal(hvd.allreduce(x, op=hvd.Min), full(smallest)),
          'Min: a joined worker gives the largest value')
    check(torch.equal(hvd.allreduce(full(r - 5, (4,), torch.int32), op=hvd.Max),
                      full(max(training) - 5, (4,), torch.int32)), 'Max of int32')
    one = hvd.allreduce(torch.tensor(r + 1), op=hvd.Sum)       # fewer values than workers
    check(one.item() == sum(i + 1 for i in training), 'a one-element all-reduce')
    mine = hvd.reducescatter(full(value(r, b), (N, 2)), op=hvd.Sum)
    check(torch.equal(mine, full(total, (1, 2))), 'reducescatter')
    root = training[-1]
    if len(training) == N:
        check(hvd.broadcast(torch.tensor([float(r)]), root_rank=root).item() == root,
              'broadcast')
        rows = hvd.allgather(torch.full((r + 1, 2), r))[:, 0].tolist()
        check(rows == [i for i in range(N) for _ in range(i + 1)], f'allgather: rows {rows}')
    hvd.barrier()
    if len(training) < N:      # Horovod's test_horovod_join_broadcast, _join_allgather
        for refused in (lambda: hvd.broadcast(torch.tensor([float(r)]), root_rank=root),
                        lambda: hvd.allgather(torch.full((r + 1, 2), r)),
                        lambda: hvd.alltoall(torch.zeros(N, 1))):
            try:
                refused()
                check(False, 'broadcast, allgather, alltoall while a worker is in join()')
            except RuntimeError as e:
                check('called join()' in str(e), f'refused: {e}')


def optimizer_steps(batches):
    """DistributedOptimizer: the gradients are the sum over the workers still training
    divided by N; after join(), broadcast_parameters from the last one makes all equal."""
    torch.manual_seed(0)
    net = nn.Linear(4, 1).double()
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                   named_parameters=net.named_parameters())
    for b in range(batches[r]):
        training = [i for i in range(N) if batches[i] > b]
        want = sum(local_gradient(net, i, b) for i in training) / N
        opt.zero_grad()
        loss(net, r, b).backward()
        opt.step()
        got = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
        check(torch.allclose(got, want, rtol=1e-12, atol=1e-14), f'averaged gradient {b}')
    last = hvd.join()
    hvd.broadcast_parameters(net.state_dict(), root_rank=last)
    flat = torch.cat([p.detach().reshape(1, -1) for p in net.parameters()], 1)
    check((hvd.allgather(flat) == flat).all().item(), 'weights equal after the broadcast')
    return last


def loss(net, i, b):
    g = torch.Generator().manual_seed(100 * i + b)
    X = torch.randn(8, 4, generator=g, dtype=torch.float64)
    y = torch.randn(8, 1, generator=g, dtype=torch.float64)
    return ((net(X) - y) ** 2).mean()


def local_gradient(net, i, b):
    """Worker i's gradient at batch b on these weights (as worker i computes it)."""
    ref = nn.Linear(4, 1).double()
    ref.load_state_dict(net.state_dict())
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss(ref, i, b),
                                                                 list(ref.parameters()))])


def one_round(mode, batches):
    if mode == 'optimizer':
        return optimizer_steps(batches)
    for b in range(batches[r]):
        collectives(b, [i for i in range(N) if batches[i] > b])
    return hvd.join()


mode, batches = sys.argv[1], [int(n) for n in sys.argv[2].split(',')]
check(len(batches) == N, f'{len(batches)} batch counts for {N} workers')
lasts = []
for round_batches in (batches, batches[::-1]):
    lasts.append(one_round(mode, round_batches))
    want = max(range(N), key=lambda i: round_batches[i])
    check(lasts[-1] == want, f'join() returned {lasts[-1]}, the last to join was {want}')
    back = hvd.allreduce(torch.ones(3), op=hvd.Sum).tolist()
    check(back == [N] * 3, f"all back after join: {back}")
print(f'worker {r} of {N}: ok, last joined {lasts}', flush=True)
