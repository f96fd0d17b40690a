"""Replicated servers, for test_replicas.py: a job whose weights say whether a server's
loss lost or doubled anything.

Each worker trains an MLP on its own random batches; the servers update its weights
with SGD with momentum and weight decay (the optimizer's state lives on the servers,
and must survive with them). An embedding's gradient is sparse: only the rows a batch
used travel, and only they change. D2L_KVSTORE_BIGARRAY_BOUND=1000 (the test sets it)
cuts the first layer over both servers. Beside them, the key 'count' has no optimizer:
every step each worker pushes ``1000 ** rank`` to it. In dist_sync its value after a
round is that round's sum, so it must be 1001 every time with two workers, 1001001 with
three (each push counted once: a 2 would be a push counted twice, a 0 one lost); in
dist_async pushes are added as they come, and after the last barrier it counts every
push of every worker. With three workers or more the weights are the same bits in
every run only because a server adds a round's pushes in rank order (kv/server.py).

    d2l-launch -n 2 -s 2 --server-replicas 1 --fail server:0@step=20 python replicas_job.py
"""
import hashlib
import os
import time

import torch
from torch import nn

import d2ldist
from d2ldist.runtime import faults, spans

STEPS, BASE = 40, 1000


def main():
    kind = os.environ.get('KV', 'dist_sync')
    kv = d2ldist.kv.create(kind)
    torch.manual_seed(0)
    emb, net = nn.Embedding(50, 8, sparse=True), nn.Sequential(
        nn.Linear(8, 200), nn.ReLU(), nn.Linear(200, 10))
    params = list(net.parameters())
    count, mine = torch.zeros(1, dtype=torch.float64), torch.full(
        (1,), float(BASE ** kv.rank), dtype=torch.float64)
    kv.init(list(range(len(params))) + ['emb'], [p.data for p in params] + [emb.weight.data])
    kv.init('count', count, optimizer=False)
    kv.set_optimizer('sgd', lr=0.1, momentum=0.9, wd=1e-4)
    kv.pull(list(range(len(params))) + ['emb'], out=[p.data for p in params] + [emb.weight.data])
    g = torch.Generator().manual_seed(kv.rank)
    counts = []
    for _ in range(STEPS):
        rows, y = torch.randint(0, 50, (16,), generator=g), torch.randint(0, 10, (16,), generator=g)
        loss = nn.functional.cross_entropy(net(emb(rows)), y)
        net.zero_grad()
        emb.zero_grad()
        loss.backward()
        time.sleep(0.01)
        faults.computed(0.01)            # (d2l-launch --fail worker:R@step=N counts these)
        spans.step_done()
        kv.push('emb', emb.weight.grad)
        kv.row_sparse_pull('emb', out=emb.weight.data, row_ids=rows)
        kv.pushpull(list(range(len(params))) + ['count'], [p.grad for p in params] + [mine],
                    out=[p.data for p in params] + [count])
        counts.append(int(count.item()))
    kv.barrier()
    kv.pull(['count', 'emb'], out=[count, emb.weight.data])
    weights = b''.join(t.numpy().tobytes() for t in [p.data for p in params] + [emb.weight.data])
    if kind == 'dist_sync':
        every = sum(BASE ** r for r in range(kv.num_workers))
        assert counts == [every] * STEPS, counts         # each round: every push, once
        weights_of = hashlib.sha256(weights).hexdigest()[:16]
        print(f'worker {kv.rank} weights {weights_of}', flush=True)
    print(f'worker {kv.rank} count {int(count.item())}', flush=True)


if __name__ == '__main__':
    main()
