"""Checks of the Horovod-style API in a real job (d2l-launch -n 2 -s 0, either backend).

Prints one 'ok' line per worker, or exits non-zero at the first failed check.
"""
import sys
import time
import warnings

import torch
from torch import nn

import d2ldist as hvd
from d2ldist.collectives import world

hvd.init()
r, N = hvd.rank(), hvd.size()


def check(ok, what):
    if not ok:
        sys.exit(f'worker {r}: FAILED {what}')


# broadcast_parameters: different initial weights become worker 0's
torch.manual_seed(r)
net = nn.Sequential(nn.Linear(1, 1), nn.Linear(8, 300), nn.ReLU(), nn.Linear(300, 300),
                    nn.ReLU(), nn.Linear(300, 1))   # net[0] gets no gradient
hvd.broadcast_parameters(net.state_dict(), root_rank=0)
torch.manual_seed(0)
ref = nn.Sequential(nn.Linear(1, 1), nn.Linear(8, 300), nn.ReLU(), nn.Linear(300, 300),
                    nn.ReLU(), nn.Linear(300, 1))
check(all(torch.equal(a, b) for a, b in zip(net.state_dict().values(),
                                              ref.state_dict().values())),
      'broadcast_parameters gave worker 0 weights')

# broadcast_optimizer_state: worker 0's hyperparameters and (created) state
optimizer = torch.optim.Adam(net.parameters(), lr=0.01 if r == 0 else 0.5,
                             betas=(0.8, 0.9 + r / 100))
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=net.named_parameters(),
                                     bucket_cap_mb=0.3)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
check(optimizer.param_groups[0]['lr'] == 0.01 and optimizer.param_groups[0]['betas'] == (0.8, 0.9),
      f'broadcast_optimizer_state hyperparameters {optimizer.param_groups[0]}')
check(all(torch.equal(a, b) for a, b in zip(net.state_dict().values(),
                                              ref.state_dict().values())),
      'broadcast_optimizer_state left the weights alone')
check(len(optimizer._buckets) >= 3, f'several buckets ({len(optimizer._buckets)})')

# the all-reduce of the first buckets starts while backward is still running
started = []
submit = world.engine().run
world.engine().run = lambda fn, *a: (started.append(time.perf_counter()), submit(fn, *a))[1]
X = torch.randn(64, 8, generator=torch.Generator().manual_seed(r))
net[1:](X).pow(2).mean().backward()        # net[0] unused: its gradient never comes
t_end = time.perf_counter()
grads = {name: p.grad.clone() for name, p in net.named_parameters() if p.grad is not None}
during = sum(t < t_end for t in started)
check(during >= 1, f'no bucket started during backward ({len(started)} buckets)')
optimizer.step()
world.engine().run = submit
check(net[0].weight.grad is not None and torch.equal(net[0].weight.grad, torch.zeros(1, 1)),
      'an unused parameter gets a zero gradient')

# the gradients DistributedOptimizer used are the average of every worker's
for name, g in grads.items():
    expect = hvd.allreduce(g, op=hvd.Average)
    got = dict(net.named_parameters())[name].grad
    check(torch.allclose(got, expect, rtol=1e-5, atol=1e-7), f'averaged gradient {name}')
check(abs(hvd.metric_average(float(r)) - (N - 1) / 2) < 1e-12, 'metric_average')
check(hvd.allgather(torch.tensor([r] * (r + 1))).tolist()
      == [i for i in range(N) for _ in range(i + 1)], 'allgather of uneven first dims')

# -- issue 20: Horovod's semantics, as its own tests check them ---------------------
# gradients through the collectives (test_horovod_allreduce_grad, _broadcast_grad,
# _allgather_grad)
x = torch.full((3, 4), float(r), requires_grad=True)
hvd.allreduce(x, average=False).backward(torch.ones(3, 4))
check(torch.equal(x.grad, torch.full((3, 4), float(N))), f'allreduce Sum grad {x.grad}')
x.grad = None
hvd.allreduce(x, op=hvd.Average).backward(torch.ones(3, 4))
check(torch.equal(x.grad, torch.ones(3, 4)), 'allreduce Average grad')
x.grad = None
hvd.broadcast(x, root_rank=1).backward(torch.ones(3, 4))
check(torch.equal(x.grad, torch.full((3, 4), 1.0 if r == 1 else 0.0)), 'broadcast grad')
rows = [3, 2, 7, 4][:N]
x = torch.full((rows[r], 5), float(r), requires_grad=True)
gathered = hvd.allgather(x)
check(gathered.requires_grad and gathered.shape == (sum(rows), 5), 'allgather keeps the graph')
gathered.backward(torch.cat([torch.full((n, 5), float(i)) for i, n in enumerate(rows)]))
check(torch.equal(x.grad, torch.full((rows[r], 5), float(r))), f'allgather grad {x.grad}')
# names and keywords: average=, name=, prescale/postscale, Product, async, grouped
y = torch.tensor([1.0, 2.0]) * (r + 1)
check(torch.equal(hvd.allreduce(y, average=False, name='y'), torch.tensor([1.0, 2.0]) * N * (N + 1) / 2),
      'allreduce average=False is a sum')
check(torch.allclose(hvd.allreduce(y, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5),
                     hvd.allreduce(y, op=hvd.Sum)), 'prescale and postscale')
check(torch.equal(hvd.allreduce(torch.tensor([r + 1.0]), op=hvd.Product),
                  torch.tensor([float(torch.arange(1, N + 1).prod())])), 'Product')
handle = hvd.allreduce_async(y, op=hvd.Sum)
result = hvd.synchronize(handle)
check(hvd.poll(handle) and torch.equal(result, hvd.allreduce(y, op=hvd.Sum)), 'async, poll, synchronize')
check(torch.equal(hvd.synchronize(hvd.broadcast_async(y, root_rank=0)), torch.tensor([1.0, 2.0])),
      'broadcast_async')
check(torch.equal(hvd.synchronize(hvd.allgather_async(torch.tensor([r]))), torch.arange(N)),
      'allgather_async')
pair = hvd.grouped_allreduce([y, 2 * y], op=hvd.Sum)
check(torch.equal(pair[1], 2 * pair[0]) and torch.equal(pair[0], hvd.allreduce(y, op=hvd.Sum)),
      'grouped_allreduce')
try:
    hvd.allreduce(y, average=True, op=hvd.Sum)
    check(False, 'average and op together are refused')
except ValueError:
    pass
for dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
              torch.float32, torch.float64, torch.bool):
    got = hvd.allgather(torch.ones(r + 1, 2, dtype=dtype))
    check(got.dtype == dtype and got.shape == (N * (N + 1) // 2, 2), f'allgather of {dtype}')
# objects as JSON, never pickled
check(hvd.broadcast_object({'epoch': 3, 'name': f'w{r}', 'best': None}, root_rank=1)
      == {'epoch': 3, 'name': 'w1', 'best': None}, 'broadcast_object')
check(hvd.allgather_object({'rank': r, 'rows': [r] * r}) == [{'rank': i, 'rows': [i] * i}
                                                             for i in range(N)], 'allgather_object')
# broadcast_optimizer_state: non-tensor settings (nesterov: a bool) and integer
# parameters without gradients (it used to lose the first and crash on the second)
w, counter = nn.Parameter(torch.ones(3)), nn.Parameter(torch.zeros(2, dtype=torch.int64),
                                                        requires_grad=False)
sgd = torch.optim.SGD([w, counter], lr=0.1, momentum=0.9 if r == 0 else 0.5,
                      nesterov=r == 0, dampening=0.0)
hvd.broadcast_optimizer_state(sgd, root_rank=0)
check(sgd.param_groups[0]['nesterov'] is True and sgd.param_groups[0]['momentum'] == 0.9,
      f'broadcast_optimizer_state settings {sgd.param_groups[0]}')
# reducescatter: rows cut as evenly as can be, the first ones one longer
from d2ldist.runtime.split import even_slices
full = torch.arange(7 * 2, dtype=torch.float32).view(7, 2)
start, stop = even_slices(7, N)[r]
got = hvd.reducescatter(full * (r + 1), op=hvd.Sum)
check(torch.equal(got, full[start:stop] * N * (N + 1) / 2), f'reducescatter {got}')
check(torch.equal(hvd.reducescatter(full), full[start:stop]), 'reducescatter Average')
# alltoall: worker i sends i + j + 1 rows to worker j, each row holding (i, j)
splits = [r + j + 1 for j in range(N)]
sent = torch.cat([torch.tensor([[r, j]] * n) for j, n in enumerate(splits)])
received, counts = hvd.alltoall(sent, splits)
check(counts.tolist() == [i + r + 1 for i in range(N)] and
      torch.equal(received, torch.cat([torch.tensor([[i, r]] * (i + r + 1)) for i in range(N)])),
      f'alltoall {received.tolist()}')
# SyncBatchNorm: what one process's BatchNorm does with the whole batch
torch.manual_seed(5)
batch, weights = torch.randn(9, 3, 4) * 3 + 1, torch.randn(9, 3, 4)
mine = slice(*even_slices(9, N)[r])
bn, ref = hvd.SyncBatchNorm(3, momentum=0.3), nn.BatchNorm1d(3, momentum=0.3)
Xm, Xr = batch[mine].clone().requires_grad_(), batch.clone().requires_grad_()
Ym, Yr = bn(Xm), ref(Xr)
(Ym * weights[mine]).sum().backward()
(Yr * weights).sum().backward()
check(torch.allclose(Ym, Yr[mine], atol=1e-5), 'SyncBatchNorm forward')
check(torch.allclose(Xm.grad, Xr.grad[mine], atol=1e-5), 'SyncBatchNorm input gradient')
check(torch.allclose(hvd.allreduce(bn.weight.grad, op=hvd.Sum), ref.weight.grad, atol=1e-5),
      'SyncBatchNorm weight gradient, summed over workers')
check(torch.allclose(bn.running_mean, ref.running_mean, atol=1e-6) and
      torch.allclose(bn.running_var, ref.running_var, atol=1e-5), 'SyncBatchNorm running stats')
# DistributedOptimizer: Horovod's naming rule, skip_synchronize, accumulation
lin = nn.Linear(4, 1, bias=False)
hvd.broadcast_parameters(lin.state_dict(), root_rank=0)
try:
    hvd.DistributedOptimizer(torch.optim.SGD(list(lin.parameters()) + [nn.Parameter(torch.ones(1))], lr=0.1),
                             named_parameters=lin.named_parameters())
    check(False, 'an unnamed parameter is refused')
except ValueError:
    pass
opt = hvd.DistributedOptimizer(torch.optim.SGD(lin.parameters(), lr=0.1),
                               named_parameters=lin.named_parameters(), backward_passes_per_step=2)
Xs = [torch.full((2, 4), float(r + 1 + k)) for k in range(2)]   # two passes, accumulated
for X in Xs:
    lin(X).sum().backward()
expect = hvd.allreduce(sum(X.sum(0) for X in Xs).view(1, 4), op=hvd.Average)
opt.synchronize()
check(torch.allclose(lin.weight.grad, expect), f'two passes accumulated {lin.weight.grad} {expect}')
lin.weight.grad.clamp_(max=5.0)                   # e.g. clipping between synchronize and step
before = lin.weight.detach().clone()
with opt.skip_synchronize():
    opt.step()
check(torch.allclose(lin.weight, before - 0.1 * expect.clamp(max=5.0)), 'skip_synchronize step')
opt.zero_grad()
lin(Xs[0]).sum().backward()                       # one pass of two, then step: what it has
opt.step()
check(torch.isfinite(lin.weight).all(), 'a partial accumulation steps')
opt.zero_grad()
for X in Xs:
    lin(X).sum().backward()
opt.synchronize()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    opt.step()                                    # without skip_synchronize: a warning
check(any('skip_synchronize' in str(w.message) for w in caught), 'the warning')
check(hvd.is_initialized() and hvd.cross_size() == 1 and hvd.cross_rank() == 0
      and hvd.mpi_enabled() is False and type(hvd.nccl_built()) is int, 'world names')
hvd.barrier()
print(f'worker {r} of {N}: ok, {during} of {len(started)} buckets started during backward',
      flush=True)
