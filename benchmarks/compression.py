"""Gradient compression: bytes on the wire and time per step, each scheme against none.

    python benchmarks/compression.py                      # loopback
    python benchmarks/compression.py --bandwidth 1Gbit    # every d2ldist process paced
    python benchmarks/compression.py --quick

One job per row, 2 workers (and 2 servers for dist_sync), each training ResNet-18
(``--width`` channels in its first stage, 32x32 random inputs, batch 32, plain SGD)
with ``d2ldist.Trainer(..., compression_params=...)``: MXNet's 2-bit with error
feedback and fp16 on the parameter server, fp16 on the ring. The reference, in the
same run: torch's DDP on gloo, without and with torch's own fp16 communication hook
(``default_hooks.fp16_compress_hook``). ``--bandwidth`` paces d2ldist's van only; gloo
has its own sockets, so the DDP rows stay on the unshaped loopback (said in the table).

Bytes per step are what worker 1 sent (its van's count of data frames); for DDP the
ring's 2(N-1)/N of the gradient bytes (gloo does not count them). Time per step:
the mean over the timed steps of the slowest worker.

Measured on this 2-core machine, quiet, width 32 (2.80 M parameters, 11.2 MB), ms per step:

                       loopback   paced to 1 Gbit/s   (vs none at 1 Gbit/s)
    dist_sync none        172.3         357.4
    dist_sync fp16        181.9         313.6              1.14x
    dist_sync 2-bit       211.6         305.3              1.17x   (0.72 MB a step)
    ring none             181.7         266.8
    ring fp16             178.6         221.3              1.21x
    DDP none              206.3         205.3 (unpaced)
    DDP fp16 hook         200.9         196.3 (unpaced)

On the loopback (shared memory between processes) compression only costs CPU: 2-bit
is 0.81x; on a 1 Gbit/s link both codecs pay, 2-bit most on the parameter server.
"""
import argparse
import json
import os
import sys
import time

from common import launch   # benchmarks/common.py

ROWS = [('dist_sync', None), ('dist_sync', {'type': 'fp16'}),
        ('dist_sync', {'type': '2bit', 'threshold': 0.01}), ('ring', None),
        ('ring', {'type': 'fp16'}), ('ddp', None), ('ddp', {'type': 'fp16'})]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--quick', action='store_true', help='fewer steps')
    p.add_argument('--width', type=int, default=32, help="ResNet-18's first stage")
    p.add_argument('--steps', type=int, default=10, help='timed steps per job')
    p.add_argument('--bandwidth', default=None, help='simulated link of every d2ldist process')
    p.add_argument('--worker', nargs=2, metavar=('KIND', 'PARAMS'), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.steps = 4
    return args


# -- in each worker ----------------------------------------------------------------------------
def worker(args):
    import torch
    import torch.distributed as dist
    from torch import nn

    import d2ldist
    from d2ldist.runtime import node
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))
    kind, params = args.worker[0], json.loads(args.worker[1])
    torch.manual_seed(0)
    net = d2ldist.resnet18(10, width=args.width)
    X, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    if kind == 'ddp':
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from d2ldist.collectives.torch_backend import TorchBackend
        TorchBackend()
        ddp = nn.parallel.DistributedDataParallel(net)
        if params:
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        opt, loss = torch.optim.SGD(ddp.parameters(), lr=0.01), nn.CrossEntropyLoss()

        def step():
            opt.zero_grad(set_to_none=True)
            loss(ddp(X), y).backward()
            opt.step()
        rank, sent = dist.get_rank(), lambda: 0
    else:
        trainer = d2ldist.Trainer(net, 'sgd', {'lr': 0.01}, kvstore=kind,
                                  compression_params=params)
        loss = nn.CrossEntropyLoss(reduction='none')

        def step():
            d2ldist.train_batch(X, y, net, loss, trainer, trainer.devices)
        rank, sent = trainer.store.rank, lambda: node.current().van.bytes_sent
    for _ in range(2):                     # warm up (and the initial broadcast)
        step()
    before, start = sent(), time.perf_counter()
    for _ in range(args.steps):
        step()
    elapsed = time.perf_counter() - start
    print('RESULT ' + json.dumps({'rank': rank, 'seconds': elapsed / args.steps,
                                  'bytes': (sent() - before) / args.steps,
                                  'params': sum(p.numel() for p in net.parameters())}),
          flush=True)


# -- the driver ----------------------------------------------------------------------------------
def run_row(args, kind, params):
    options = ['-n', 2, '-s', 2 if kind == 'dist_sync' else 0]
    if args.bandwidth and kind != 'ddp':
        options += ['--bandwidth', args.bandwidth]
    command = [sys.executable, os.path.abspath(__file__), '--width', str(args.width),
               '--steps', str(args.steps), '--worker', kind, json.dumps(params)]
    proc = launch(options, command, timeout=900)
    results = [json.loads(line.split('RESULT ', 1)[1]) for line in proc.stdout.splitlines()
               if 'RESULT ' in line]
    if proc.returncode != 0 or len(results) != 2:
        sys.exit(f'{kind} {params}: the job failed\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}')
    by_rank = {r['rank']: r for r in results}
    return max(r['seconds'] for r in results), by_rank[1]['bytes'], by_rank[1]['params']


def main(argv=None):
    args = parse(argv)
    if args.worker:
        return worker(args)
    rows = [(kind, params, *run_row(args, kind, params)) for kind, params in ROWS]
    params = rows[0][4]
    link = f'every d2ldist process paced to {args.bandwidth}' if args.bandwidth else 'loopback'
    print(f'# gradient compression: ResNet-18 (width {args.width}, {params / 1e6:.2f} M '
          f'parameters, {4 * params / 1e6:.1f} MB of float32 gradients), 2 workers, batch 32; '
          f'{link}; {os.cpu_count()} CPUs; {args.steps} timed steps')
    print(f'{"store":>10} {"compression":<34}{"MB sent/step":>13}{"ms/step":>9}'
          f'{"vs none":>9}{"vs DDP":>8}')
    plain = {kind: seconds for kind, p, seconds, *_ in rows if p is None}
    for kind, p, seconds, sent, _ in rows:
        name = json.dumps(p) if p else 'none'
        if kind == 'ddp':                  # the ring's 2(N - 1)/N = 1 of its gradient bytes
            sent = (2 if p else 4) * params
            name = ('fp16_compress_hook' if p else 'none') + (' (unpaced)' if args.bandwidth
                                                              else '')
        sent_mb = sent / 1e6
        print(f'{kind:>10} {name:<34}{sent_mb:>13.2f}{seconds * 1e3:>9.1f}'
              f'{plain[kind] / seconds:>8.2f}x{plain["ddp"] / seconds:>7.2f}x')
    print('vs none: speed-up over the same store uncompressed; vs DDP: over DDP without '
          'compression, same run. DDP bytes: 2(N-1)/N of its gradient bytes (a model)')
    return 0


if __name__ == '__main__':
    sys.exit(main())
