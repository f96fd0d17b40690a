"""Benchmark: what ZeRO's shard replicas (d2l-launch --shard-replicas 1) cost per step.

    python benchmarks/shard_replicas.py            # an MLP of 4.2 M float32 weights, Adam
    python benchmarks/shard_replicas.py --quick    # a quarter of it, fewer steps
    python benchmarks/shard_replicas.py --batch 32 # less compute per step: the replica's
                                                   # Adam step weighs more
    python benchmarks/shard_replicas.py --stage 3  # shard_module: the weights sharded too

For N = 2 and 3 it starts one job on the ring. Every worker holds two copies of the same
MLP, each with ZeRO stage 2 over Adam (or stage 3, ``shard_module``): one plain, one whose
shards are also kept on the ring successor (``replicas=1``, or ``NetShards`` at stage 3:
the averaged gradient shard sent one step right, the replica stepped alike). The two
train in turn, a block of 5 steps each (the replica's last step settled within its
block), so that a busy machine slows both alike. Worker 0 reports each one's median step
over the blocks, the median over the blocks of the two's ratio in the same block (the
machine's speed drifts; a pair of blocks shares it), and the bytes it sent per step (the
van's count of data frames). Plain ZeRO sends 2(N-1)/N of the padded weights per step;
the replica adds 1/N of them, one more N-th of plain ZeRO's bytes at N = 2 and half of
that at N = 3 (stage 3 sends 3(N-1)/N: the replica adds a third as much). Its time is the
clone and the send of the gradient shard, and the replica's optimizer step: as much work
as the owner's step on 1/N of the weights (docs/performance.md).
"""
import argparse
import json
import statistics
import time

from common import launch, result, worker_command   # benchmarks/common.py


def worker(args):
    """Inside the job: both optimizers, steps in turn; worker 0 prints the result."""
    import torch
    from torch import nn
    import d2ldist
    from d2ldist.collectives.shard_replica import NetShards
    from d2ldist.collectives.sharded_module import units_of
    from d2ldist.runtime import node
    torch.set_num_threads(1)
    d2ldist.init()
    width = 1024 // args.scale

    def make(replicas):
        """The net, its optimizer, and what holds the replica (None: none)."""
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width),
                            nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                            nn.Linear(width, width))
        if args.stage == 3:
            net = d2ldist.shard_module(net)
            adam = torch.optim.Adam(net.parameters(), lr=1e-3)
            return net, adam, NetShards(units_of(net), adam) if replicas else None
        opt = d2ldist.ShardedOptimizer(torch.optim.Adam(net.parameters(), lr=1e-3),
                                       stage=2, replicas=replicas)
        return net, opt, opt
    triples = [make(0), make(1)]
    X = torch.randn(args.batch, width, generator=torch.Generator().manual_seed(d2ldist.rank()))
    times, sent = [[], []], [0, 0]
    van = node.current().van
    for block in range(args.warmup + args.blocks):
        for k, (net, opt, holder) in enumerate(triples):
            d2ldist.barrier()
            before, start = van.bytes_sent, time.perf_counter()
            for _ in range(args.block):
                opt.zero_grad()
                net(X).pow(2).mean().backward()
                opt.step()
            if holder is not None and holder.replica is not None:
                holder.replica.settle()        # (the last step's replica, in this block)
            if block >= args.warmup:
                times[k].append((time.perf_counter() - start) / args.block)
                sent[k] += (van.bytes_sent - before) / args.block
    if d2ldist.rank() == 0:
        numel = 4 * (width * width + width)
        print('RESULT ' + json.dumps({'weights': 4 * numel,
                                      'ms': [1e3 * statistics.median(t) for t in times],
                                      'ratio': statistics.median(
                                          b / a for a, b in zip(*times)),
                                      'bytes': [s / args.blocks for s in sent]}), flush=True)


def run_job(n, args):
    """One job of n workers: worker 0's result."""
    out = launch(['-n', n, '-s', 0, '--timeout', 900],
                 worker_command(__file__, ['--scale', args.scale, '--batch', args.batch,
                                           '--stage', args.stage,
                                           '--blocks', args.blocks,
                                           '--block', args.block, '--warmup', args.warmup]),
                 timeout=1000)
    return result(out, f'N={n}')


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--quick', action='store_true', help='a quarter of the weights, 4 blocks')
    p.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
    p.add_argument('--scale', type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument('--batch', type=int, default=256, help="each worker's batch")
    p.add_argument('--stage', type=int, default=2, choices=(2, 3), help="ZeRO's stage")
    p.add_argument('--blocks', type=int, default=12, help='timed blocks of steps of each')
    p.add_argument('--block', type=int, default=5, help='steps in a block')
    p.add_argument('--warmup', type=int, default=1, help='untimed blocks first')
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.scale, args.blocks = 2, 4
    print(f'# ZeRO stage {args.stage} on the ring, Adam, an MLP of 4 square layers, a batch of '
          f'{args.batch} per worker; per worker and step')
    print(f'{"N":>2} {"weights MB":>10} {"plain MB":>9} {"replica MB":>10} {"bytes x":>8} '
          f'{"1 + 1/N":>7} {"plain ms":>9} {"replica ms":>10} {"time x":>7}')
    for n in (2, 3):
        res = run_job(n, args)
        (b0, b1), (t0, t1), ratio = res['bytes'], res['ms'], res['ratio']
        print(f'{n:>2} {res["weights"] / 1e6:>10.2f} {b0 / 1e6:>9.2f} {b1 / 1e6:>10.2f} '
              f'{b1 / b0:>8.3f} {1 + 1 / n:>7.3f} {t0:>9.1f} {t1:>10.1f} {ratio:>7.3f}',
              flush=True)


if __name__ == '__main__':
    main()
