"""ZeRO's three stages in a real job, each against one process on the whole batch.

    d2l-launch -n N -s 0 python sharded_job.py [STAGES] [STEPS]      (STAGES: 123, say)

(stage w: stage 2 with ``max_whole_buckets=1``, backward waiting for each bucket's
reduce-scatter; and under --env D2L_BACKEND=torch stage f, PyTorch's own fully_shard,
FSDP2, and stage d, PyTorch's DistributedDataParallel: plain data parallelism, the
reference)

A small MLP in float64, Adam. Stages 1 and 2 (ShardedOptimizer) use buckets of 30
values (three of them, two padded for N = 2 and 3); stage 3 (shard_module) one unit
per Linear (42 and 24 values). Each worker trains on its part of the same global
batches; alongside, in the same process and with no communication, a plain Adam trains
a copy on the whole global batch (what data parallelism computes). For each stage, one
after the other on a net of its own, each worker prints one RESULT line: its weights,
the plain copy's, the bytes its van sent during the last step (on torch.distributed,
``wire``: the bytes the kernel counted on gloo's connections), the bytes of the
optimizer's state (Adam's two moments; its step counters aside), whether every full
``.grad`` was gone after backward (stage 2; stage 3: the full weights too), and the last step's peak memory by kind
(MemoryPeak).
"""
import json
import sys

import torch
from torch import nn

import d2ldist
from d2ldist.collectives import world
from d2ldist.collectives.sharded import MemoryPeak
from d2ldist.collectives.sharded_module import full_weights, units_of
from d2ldist.collectives.torch_backend import wire_bytes_sent
from d2ldist.runtime import node

torch.set_num_threads(1)
stages = [int(s) if s.isdigit() else s for s in (sys.argv[1:] or ['123'])[0]]
steps = int((sys.argv[2:] or [5])[0])
d2ldist.init()
r, N = d2ldist.rank(), d2ldist.size()
CAP_MB, BATCH = 30 * 8 / 2 ** 20, 12          # 12: the same part for 2 and 3 workers
van = node.current().van if node.current() else None


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def loss_of(net, X):
    return net(X).pow(2).mean()


def zero(stage):
    """The net and optimizer of a stage, and its flat vectors' padded lengths (stage 'f':
    PyTorch's own FSDP2, fully_shard, on the torch backend: each parameter's rows cut)."""
    if stage == 'd':
        net = nn.parallel.DistributedDataParallel(mlp())
        return net, torch.optim.Adam(net.parameters(), lr=0.01), None
    if stage == 'f':
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        net, mesh = mlp(), init_device_mesh('cpu', (N,))
        for layer in (net[0], net[2], net):
            fully_shard(layer, mesh=mesh)
        return net, torch.optim.Adam(net.parameters(), lr=0.01), None
    if stage == 3:
        net = d2ldist.shard_module(mlp())
        return net, torch.optim.Adam(net.parameters(), lr=0.01), [
            u.padded for u in units_of(net)]
    net, limit = mlp(), {'max_whole_buckets': 1} if stage == 'w' else {}
    opt = d2ldist.ShardedOptimizer(torch.optim.Adam(net.parameters(), lr=0.01),
                                   net.named_parameters(), stage=2 if stage == 'w' else stage,
                                   bucket_cap_mb=CAP_MB, **limit)
    return net, opt, [b.padded for b in opt.buckets]


def full_gone(net, stage):
    """After backward: no full ``.grad`` (stage 2); no full weights nor gradient (stage 3)."""
    if stage in ('d', 'f'):
        return False                         # (DDP keeps them; FSDP2's are its own)
    if stage == 3:
        return all(u.grad is None and u.full.untyped_storage().nbytes() == 0
                   for u in units_of(net))
    return all(p.grad is None for p in net.parameters())


for stage in stages:
    (net, opt, padded), whole = zero(stage), mlp()
    plain = torch.optim.Adam(whole.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    grads_gone = True
    for step in range(steps):
        X = torch.randn(BATCH, 5, generator=g, dtype=torch.float64)
        sent, wire = van.bytes_sent if van else 0, wire_bytes_sent()
        with MemoryPeak(net, opt) as peak:
            opt.zero_grad()
            loss_of(net, X[r * BATCH // N:(r + 1) * BATCH // N]).backward()
            peak.sample()
            grads_gone &= full_gone(net, stage)
            opt.step()
        sent = (van.bytes_sent if van else 0) - sent
        wire = None if wire is None else wire_bytes_sent() - wire
        plain.zero_grad()
        loss_of(whole, X).backward()
        plain.step()

    weights = full_weights(net) if stage == 3 else dict(
        (net.module if stage == 'd' else net).named_parameters())
    if stage == 'f':              # DTensors: the whole, and this worker's part
        weights = {name: p.full_tensor() for name, p in weights.items()}
    state = sum(t.numel() * t.element_size() for s in opt.state.values()
                for k, t in s.items() if k != 'step' for t in [getattr(t, '_local_tensor', t)])
    print('RESULT ' + json.dumps({
        'stage': stage, 'rank': r, 'size': N, 'backend': world.name(), 'sent': sent,
        'wire': wire, 'state_bytes': state, 'grads_gone': grads_gone, 'padded': padded,
        'peak': peak.bytes,
        'weights': [weights[name].tolist() for name, _ in whole.named_parameters()],
        'plain': [p.tolist() for p in whole.parameters()]}), flush=True)
d2ldist.barrier()
