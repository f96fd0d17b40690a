"""Data-parallel training with the Horovod-style API: one script, any backend.

    python examples/horovod_mlp.py                               # alone
    d2l-launch -n 2 -s 0 python examples/horovod_mlp.py          # d2ldist's ring
    d2l-launch -n 2 -s 0 --env D2L_BACKEND=torch python examples/horovod_mlp.py
    torchrun --nproc_per_node=2 examples/horovod_mlp.py          # torch.distributed

Every worker trains on its own shard of a synthetic regression data set; the
gradients are averaged by DistributedOptimizer, so all workers keep the same
weights. Worker 0 prints the averaged loss of each epoch and a checksum of the
final weights, which is the same whichever backend ran the job.
"""
import argparse

import torch
from torch import nn

import d2ldist as hvd

parser = argparse.ArgumentParser()
parser.add_argument('--bucket-mb', type=float, default=0.001,
                    help='tensor fusion bucket size (tiny here, to get several buckets)')
args = parser.parse_args()

hvd.init()
torch.manual_seed(0)   # the same data set everywhere; each worker takes its shard
num_examples, batch_size, lr, num_epochs = 512, 32, 0.02, 3
true_w = torch.randn(20, 1, dtype=torch.float64)
X = torch.randn(num_examples, 20, dtype=torch.float64)
y = X @ true_w + 0.01 * torch.randn(num_examples, 1, dtype=torch.float64)
X, y = X[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]

torch.manual_seed(1 + hvd.rank())   # different initial weights: the broadcast fixes that
net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 1)).double()
optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
hvd.broadcast_parameters(net.state_dict(), root_rank=0)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=net.named_parameters(),
                                     bucket_cap_mb=args.bucket_mb)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
loss = nn.MSELoss()

for epoch in range(num_epochs):
    total, num_batches = 0.0, 0
    for i in range(0, len(X), batch_size // hvd.size()):
        X_batch, y_batch = X[i:i + batch_size // hvd.size()], y[i:i + batch_size // hvd.size()]
        optimizer.zero_grad()
        l = loss(net(X_batch), y_batch)
        l.backward()
        optimizer.step()
        total, num_batches = total + l.item(), num_batches + 1
    avg = hvd.metric_average(total / num_batches, 'loss')
    if hvd.rank() == 0:
        print(f'epoch {epoch + 1}, loss {avg:.6f}')

checksum = sum(p.double().sum() for p in net.parameters()).item()
same = hvd.allreduce(torch.tensor([checksum]), op=hvd.Max) - \
    hvd.allreduce(torch.tensor([checksum]), op=hvd.Min)
if hvd.rank() == 0:
    print(f'{hvd.size()} workers, weights checksum {checksum:.12f}, '
          f'spread between workers {same.item():.3g}')
