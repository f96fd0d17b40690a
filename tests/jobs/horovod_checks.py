"""Checks of the Horovod-style API in a real job (d2l-launch -n 2 -s 0, either backend).

Prints one 'ok' line per worker, or exits non-zero at the first failed check.
"""
import sys
import time

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
submit = world.engine().submit
world.engine().submit = lambda fn, *a: (started.append(time.perf_counter()), submit(fn, *a))[1]
X = torch.randn(64, 8, generator=torch.Generator().manual_seed(r))
net[1:](X).pow(2).mean().backward()        # net[0] unused: its gradient never comes
t_end = time.perf_counter()
grads = {name: p.grad.clone() for name, p in net.named_parameters() if p.grad is not None}
during = sum(t < t_end for t in started)
check(during >= 1, f'no bucket started during backward ({len(started)} buckets)')
optimizer.step()
world.engine().submit = submit
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
hvd.barrier()
print(f'worker {r} of {N}: ok, {during} of {len(started)} buckets started during backward',
      flush=True)
