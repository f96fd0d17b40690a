"""ZeRO's ShardedOptimizer in a real job, against one process on the whole batch.

    d2l-launch -n N -s 0 python sharded_job.py STAGE [STEPS]

A small MLP in float64, Adam, buckets of 30 values (three of them, two padded for
N = 2 and 3). Each worker trains on its part of the same global batches; alongside, in
the same process and with no communication, a plain Adam trains a copy on the whole
global batch (what data parallelism computes). Each worker prints one RESULT line: its
weights, the plain copy's, the bytes its van sent during the last step, the bytes of
the wrapped optimizer's state (Adam's two moments; its step counters aside) and
whether every full ``.grad`` was gone after backward (stage 2).
"""
import json
import sys

import torch
from torch import nn

import d2ldist
from d2ldist.collectives import world
from d2ldist.runtime import node

torch.set_num_threads(1)
stage, steps = int(sys.argv[1]), int((sys.argv[2:] or [5])[0])
d2ldist.init()
r, N = d2ldist.rank(), d2ldist.size()
CAP_MB, BATCH = 30 * 8 / 2 ** 20, 12          # 12: the same part for 2 and 3 workers


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def loss_of(net, X):
    return net(X).pow(2).mean()


net, whole = mlp(), mlp()
opt = d2ldist.ShardedOptimizer(torch.optim.Adam(net.parameters(), lr=0.01),
                               net.named_parameters(), stage=stage, bucket_cap_mb=CAP_MB)
plain = torch.optim.Adam(whole.parameters(), lr=0.01)
g = torch.Generator().manual_seed(1)
van = node.current().van if node.current() else None
grads_gone = True
for step in range(steps):
    X = torch.randn(BATCH, 5, generator=g, dtype=torch.float64)
    sent = van.bytes_sent if van else 0
    opt.zero_grad()
    loss_of(net, X[r * BATCH // N:(r + 1) * BATCH // N]).backward()
    grads_gone &= all(p.grad is None for p in net.parameters())
    opt.step()
    sent = (van.bytes_sent if van else 0) - sent
    plain.zero_grad()
    loss_of(whole, X).backward()
    plain.step()

state = sum(t.numel() * t.element_size() for s in opt.state.values()
            for k, t in s.items() if k != 'step')
print('RESULT ' + json.dumps({
    'rank': r, 'size': N, 'backend': world.name(), 'sent': sent,
    'state_bytes': state, 'grads_gone': grads_gone,
    'padded': [b.padded for b in opt.buckets],
    'weights': [p.tolist() for p in net.parameters()],
    'plain': [p.tolist() for p in whole.parameters()]}), flush=True)
d2ldist.barrier()
