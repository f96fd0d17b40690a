"""ZeRO stage 2 under hvd.elastic with its shards replicated, for test_shard_replicas.py.

An MLP in float64 learns from STEPS global batches of BATCH samples with Adam, each worker
its part of a batch (``elastic.part``), a commit after every step. Each worker prints where
it entered ``train`` (the batch, its rank among how many) and the SHA-256 of its final
weights. ``d2l-launch --fail worker:W@step=13`` kills worker W at the start of its 13th
``step()`` (batch 12's), after its backward, the reduce-scatters under way.

    d2l-launch -n 3 -s 0 --min-workers 2 --shard-replicas 1 --fail worker:1@step=13 \\
        python tests/jobs/shard_replicas_job.py

The replay of a membership change, without elastic: ``--stop-at K --save DIR`` trains
batches 0..K-1 and saves a checkpoint (d2ldist.checkpoint.save); ``--resume DIR`` loads it,
on any number of workers, and trains to the end.
"""
import argparse
import hashlib
import os

import torch
import torch.nn.functional as F
from torch import nn

STEPS, BATCH = 30, 12


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * BATCH, 8, generator=g, dtype=torch.float64)
    return x, (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4:].sum(1) > 0).long()


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()


def sha(net):
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def step(hvd, net, opt, x, y, batch):
    """One global batch: this worker's part of it, the mean loss over the whole batch."""
    from d2ldist.collectives.elastic import part
    a, b = part(BATCH)
    rows = slice(batch * BATCH + a, batch * BATCH + b)
    opt.zero_grad()
    (F.cross_entropy(net(x[rows]), y[rows], reduction='sum') * hvd.size() / BATCH).backward()
    opt.step()


def main():
    import d2ldist
    import d2ldist.horovod as hvd
    parser = argparse.ArgumentParser()
    parser.add_argument('--stop-at', type=int)
    parser.add_argument('--save')
    parser.add_argument('--resume')
    args = parser.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    me = os.environ.get('D2L_RANK', '0')
    x, y = data()
    net = model()
    opt = d2ldist.ShardedOptimizer(torch.optim.Adam(net.parameters(), lr=0.01),
                                   net.named_parameters(), stage=2)
    if args.save or args.resume:                   # the replay: a checkpoint between
        state = {'model': net, 'optimizer': opt, 'batch': 0}
        if args.resume:
            d2ldist.checkpoint.load(state, args.resume)
        for batch in range(state['batch'], args.stop_at or STEPS):
            step(hvd, net, opt, x, y, batch)
        if args.save:
            state['batch'] = args.stop_at
            d2ldist.checkpoint.save(state, args.save)
    else:
        state = hvd.elastic.TorchState(model=net, optimizer=opt, batch=0)

        @hvd.elastic.run
        def train(state):
            print(f'worker {me}: enters at batch {state.batch} as rank {hvd.rank()} of '
                  f'{hvd.size()}', flush=True)
            while state.batch < STEPS:
                step(hvd, net, opt, x, y, state.batch)
                state.batch += 1
                state.commit()
        train(state)
    print(f'worker {me} final weights: SHA-256 {sha(net)}', flush=True)


if __name__ == '__main__':
    main()
