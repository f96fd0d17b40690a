"""MXNet gluon's Trainer on a dist_sync kvstore, written out: the calls it makes, with
its arguments (priority=-i, so the first layers' weights come first; kv._barrier();
row_sparse_pull in MXNet's order), on torch's tensors, the import the one line changed.

    d2l-launch -n 2 -s 2 python tests/jobs/gluon_style.py

Each worker prints its losses and final weights (GLUON {json}) for
tests/jobs/test_gluon_style.py to compare with SGD on both workers' batches at once.
"""
import json

import torch
from torch import nn

from d2ldist import kv as kvstore   # MXNet: from mxnet import kvstore

STEPS, BATCH, LR = 10, 8, 0.1
torch.set_num_threads(1)
torch.manual_seed(0)                                     # the same start on every worker
embedding = nn.Embedding(10, 4, sparse=True).double()    # gluon: sparse_grad=True
dense = nn.Linear(4, 1).double()
params = [embedding.weight, dense.weight, dense.bias]

kv = kvstore.create('dist_sync')
kv.set_optimizer('sgd', learning_rate=LR, rescale_grad=1.0 / (BATCH * kv.num_workers))
for i, p in enumerate(params):                           # Trainer._init_params
    kv.init(i, p.data)
    if i > 0:                                            # (row_sparse: pulled by rows)
        kv.pull(i, out=p.data, priority=-i)
kv._barrier()

g = torch.Generator().manual_seed(kv.rank)               # this worker's batch
tokens = torch.randint(0, 10, (BATCH,), generator=g)
y = torch.randn(BATCH, 1, generator=g, dtype=torch.float64)
losses = []
for step in range(STEPS):
    kv.row_sparse_pull(0, embedding.weight.data, 0, tokens.unique())   # its rows only
    for p in params:
        p.grad = None
    loss = ((dense(embedding(tokens)) - y) ** 2).sum()
    loss.backward()
    losses.append(loss.item())
    for i, p in enumerate(params):                       # Trainer._allreduce_grads
        if p.grad.is_sparse:                             # sparse: push; rows pulled above
            kv.push(i, p.grad, priority=-i)
        elif i == 1:                                     # (older gluon: push, then pull)
            kv.push(i, p.grad, priority=-i)
            kv.pull(i, out=p.data, priority=-i)
        else:
            kv.pushpull(i, p.grad, out=p.data, priority=-i)

kv._barrier()
kv.pull(0, out=embedding.weight.data, priority=0)        # every row, for the check
print('GLUON', json.dumps({'losses': losses,
                           'weights': [p.detach().reshape(-1).tolist() for p in params]}),
      flush=True)
