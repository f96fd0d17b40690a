"""Training throughput: the Trainer's seven steps on dist_sync and the ring against DDP.

    python benchmarks/train_throughput.py            # ResNet-18, batch 32 per worker
    python benchmarks/train_throughput.py --quick    # fewer steps (the same network)
    python benchmarks/train_throughput.py --device cuda --batch-size 128 -n 1 -s 1
    ... --save notebooks/data/gpu_h200.json         # also add the job's row to that file

One job of 2 workers and 2 servers (d2l-launch -n 2 -s 2). In that job every worker
trains d2l's ResNet-18 (32x32 random inputs, 10 classes, SGD with momentum) in
three ways, taking turns, round after round, so that all three see the same load:

- ``dist_sync``: d2ldist.Trainer with kvstore 'dist_sync' (the 2 servers update; with
                 ``--servers-sum`` they only sum, and each worker updates on its device,
                 as BytePS's summation service);
- ``ring``:      d2ldist.Trainer with kvstore 'ring' (d2ldist's ring all-reduce);
- ``ddp``:       torch's DistributedDataParallel on gloo, torch.optim.SGD (the plain
                 kernel, like the Trainer's, so that only the distribution differs).

images/s = images of all workers / the slowest worker's time. The ratio is to DDP
in the same run. For the Trainer the table also gives the mean time of each of the
seven steps (ms per batch): where the time goes. Each worker uses cores / workers
threads for computing.

Measured on a 2-core machine, quiet (nothing else running), --rounds 5:

     kvstore    images/s   vs DDP   ms per batch in steps 1..7
   dist_sync        56.6    0.99x    1025.2     4.9     9.2    33.5    56.4     0.1     0.0
        ring        58.2    1.02x    1046.1     2.2    10.0    25.1    15.7     0.1     0.0
         ddp        57.1    1.00x

On the 2-core machine of a later session, the defaults, four runs: dist_sync 0.98-1.01x,
ring 0.96-0.98x (the commit before that session gave the same: 0.98x and 0.96x), e.g.

   dist_sync        70.8    1.00x     825.7     4.1     7.0    24.0    37.8     0.0     4.9
        ring        68.9    0.98x     823.8     1.0     7.6    29.2    42.7     0.1    24.7
         ddp        70.6    1.00x

there the ring's optimizer step (step 5: torch.optim.SGD over 11 M weights) took 43-57
ms, not 16: what the target's last 2 % are made of on that machine.

Step 1 (forward and backward) is 93-95 % of a batch. The ring's step 4 is only the
wait for the buckets backward did not hide (the Trainer starts them during backward,
as DDP does); steps 2 and 3 run in backward's hooks and count their own time. The
d2ldist stores move big frames through shared memory on one machine (d2ldist/runtime/shm.py;
gloo, under DDP, does not): with D2L_SHM=0 their messages take TCP loopback instead,
and the same run gave dist_sync 0.97x, ring 1.01x.

With ``--device cuda`` each worker computes on GPU local rank % GPUs, takes its batch
from pinned CPU memory, and DDP runs on NCCL where each worker has a GPU of its own (on
gloo where workers share one: NCCL refuses that); a fourth row, ``torch``, is the
Trainer on the same torch.distributed. On one NVIDIA H200, batch 128 (the figures of
``benchmarks/on_gpu.sh``, which docs/performance.md quotes):

     kvstore    images/s   vs DDP   ms per batch in steps 1..7        (-n 1 -s 1, DDP on NCCL)
   dist_sync      1765.4    0.13x      10.3     0.7     1.1    41.0    17.8     1.4     0.0
        ring      9977.3    0.75x       8.2     0.2     0.6     2.4     1.2     0.0     0.0
       torch     12294.8    0.92x       8.5     0.2     0.7     0.4     0.3     0.0     0.0
         ddp     13344.2    1.00x
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

from common import launch, worker_command   # benchmarks/common.py

def kinds_of(args):
    """What runs: on a GPU also the Trainer on torch.distributed ('torch': NCCL where each
    worker has a GPU of its own, as DDP)."""
    return ('dist_sync', 'ring') + (('torch',) if args.device == 'cuda' else ()) + ('ddp',)



def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--quick', action='store_true', help='fewer rounds and steps')
    p.add_argument('--batch-size', type=int, default=32, help='images per worker per step')
    p.add_argument('--width', type=int, default=64, help="ResNet-18's first stage (64: d2l's)")
    p.add_argument('--rounds', type=int, default=3, help='turns of each kind')
    p.add_argument('--steps', type=int, default=5, help='timed steps per turn')
    p.add_argument('--threads', type=int, default=0, help='torch threads (0: cores / workers)')
    p.add_argument('--device', choices=['cpu', 'cuda'], default='cpu',
                   help="cuda: each worker's GPU is its local rank's (GPUs may be shared)")
    p.add_argument('--replicas', type=int, default=1,
                   help="replicas of the network per worker for the Trainer, on its device")
    p.add_argument('--servers-sum', action='store_true',
                   help="dist_sync's servers only sum; each worker's Trainer updates the "
                        "weights on its device (BytePS's summation service)")
    p.add_argument('-n', '--workers', type=int, default=2)
    p.add_argument('-s', '--servers', type=int, default=2)
    p.add_argument('--save', default=None, metavar='FILE',
                   help="add this job's figures to FILE (JSON; benchmarks/on_gpu.sh's results)")
    p.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device == 'cuda' and not args.worker:
        import torch
        if not torch.cuda.is_available():
            p.error('--device cuda: torch sees no GPU here')
    if args.quick:
        args.rounds, args.steps = min(args.rounds, 2), min(args.steps, 2)
    return args


# -- in each worker ----------------------------------------------------------------------------
def worker(args):
    import torch
    import torch.distributed as dist
    from torch import nn

    import d2ldist
    from d2ldist.collectives.torch_backend import TorchBackend
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // args.workers))
    d2ldist.init()
    device = d2ldist.cpu()
    if args.device == 'cuda':             # GPU local rank % GPUs: workers may share one
        device = torch.device('cuda', d2ldist.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    backend = TorchBackend()              # for DDP: NCCL if each worker has a GPU, else gloo
    rank, hyper = d2ldist.rank(), {'lr': 0.01, 'momentum': 0.9, 'weight_decay': 5e-4}
    g = torch.Generator().manual_seed(rank)
    # the batch comes from the CPU, as from a DataLoader (pinned where it goes to a GPU)
    X = torch.randn(args.batch_size, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (args.batch_size,), generator=g)
    if device.type == 'cuda':
        X, y = X.pin_memory(), y.pin_memory()
    loss = nn.CrossEntropyLoss(reduction='none')
    devices = [device] * args.replicas

    def net():
        torch.manual_seed(0)
        return d2ldist.resnet18(10, width=args.width)

    kinds = kinds_of(args)
    on_servers = {'dist_sync': not args.servers_sum}     # (the others: on the worker)
    trainers = {kind: d2ldist.Trainer(net(), 'sgd', hyper, kvstore=kind, devices=devices,
                                      update_on_kvstore=on_servers.get(kind))
                for kind in kinds if kind != 'ddp'}
    ddp = nn.parallel.DistributedDataParallel(
        net().to(device), device_ids=[device.index] if device.type == 'cuda' else None)
    # the Trainer's optimizer is torch's plain SGD (d2ldist.kv.optimizers.create): so is DDP's
    ddp_opt = torch.optim.SGD(ddp.parameters(), **hyper)
    mean_loss = nn.CrossEntropyLoss()

    def step(kind):
        if kind == 'ddp':
            ddp_opt.zero_grad(set_to_none=True)
            y_hat = ddp(X.to(device, non_blocking=True))
            mean_loss(y_hat, y.to(device, non_blocking=True)).backward()   # buckets overlap
            ddp_opt.step()
        else:
            t = trainers[kind]
            d2ldist.train_batch(X, y, t.replicas[0], loss, t, devices)

    for kind in kinds:                    # warm up (first steps allocate)
        step(kind)
    for t in trainers.values():
        t.reset_step_times()
    seconds = dict.fromkeys(kinds, 0.0)
    for _ in range(args.rounds):
        for kind in kinds:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                step(kind)
            if device.type == 'cuda':
                torch.cuda.synchronize(device)   # (DDP's last kernels may still run)
            elapsed = torch.tensor([time.perf_counter() - start], device=backend.device)
            dist.all_reduce(elapsed, dist.ReduceOp.MAX)   # the slowest worker
            seconds[kind] += float(elapsed)
    if rank == 0:
        images = args.rounds * args.steps * args.batch_size * d2ldist.size()
        print('RESULT ' + json.dumps({
            'images_per_s': {k: images / s for k, s in seconds.items()},
            'step_ms': {k: {s: round(v * 1e3, 1) for s, v in t.step_times.items()}
                        for k, t in trainers.items()},
            'params': sum(p.numel() for p in ddp.parameters()),
            'ddp_backend': dist.get_backend(),
            'device': torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu',
        }), flush=True)
    dist.barrier()


# -- the driver ----------------------------------------------------------------------------------
def main(argv=None):
    args = parse(argv)
    if args.worker:
        return worker(args)
    own = [a for a in (argv if argv is not None else sys.argv[1:]) if a != '--worker']
    proc = launch(['-n', args.workers, '-s', args.servers], worker_command(__file__, own))
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith('[worker 0] RESULT '):
            result = json.loads(line[len('[worker 0] RESULT '):])
    if proc.returncode != 0 or result is None:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-2000:])
        return proc.returncode or 1
    ips = result['images_per_s']
    print(f'# training throughput: ResNet-18 (width {args.width}, {result["params"] / 1e6:.1f} M '
          f'parameters), 32x32 random inputs, batch {args.batch_size} per worker, '
          f'{args.workers} workers, {args.servers} servers for dist_sync'
          f'{" (they only sum)" if args.servers_sum else ""}; {os.cpu_count()} CPUs; '
          f'{args.rounds} rounds x {args.steps} steps each')
    print(f'# device: {result["device"]}, {args.replicas} replica(s) per worker for the '
          f'Trainer; DDP on {result["ddp_backend"]}')
    print(f'{"kvstore":>12}{"images/s":>12}{"vs DDP":>9}   ms per batch in steps 1..7')
    for kind in kinds_of(args):
        steps = result['step_ms'].get(kind)
        detail = ' '.join(f'{v:7.1f}' for v in steps.values()) if steps else '(DDP: no steps)'
        print(f'{kind:>12}{ips[kind]:>12.1f}{ips[kind] / ips["ddp"]:>8.2f}x   {detail}')
    print('targets: ring >= 1.0x DDP, dist_sync >= 0.9x DDP')
    if args.save:
        save(args.save, args, result)
        print(f'# saved in {args.save}')
    return 0


def save(path, args, result):
    """Add this job's row to the results file ``path`` (made if new), which the scaling
    chapter reads: images/s of each kind and the ms of the Trainer's seven steps."""
    import datetime
    import torch
    path = Path(path)
    data = json.loads(path.read_text()) if path.exists() else {
        'measured': f'{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC '
                    f'by benchmarks/train_throughput.py (benchmarks/on_gpu.sh)',
        'device': result['device'], 'torch': torch.__version__.split('+')[0],
        'cuda': torch.version.cuda,
        'nccl': '.'.join(map(str, torch.cuda.nccl.version())) if args.device == 'cuda' else None,
        'setup': f'ResNet-18 (width {args.width}), 32x32 random inputs, batch '
                 f'{args.batch_size} per worker, {args.rounds} rounds x {args.steps} steps',
        'jobs': []}
    options = f'-n {args.workers} -s {args.servers}' + \
        (f' --replicas {args.replicas}' if args.replicas != 1 else '') + \
        (' --servers-sum' if args.servers_sum else '')
    data['jobs'] = [j for j in data['jobs'] if j['options'] != options] + [{
        'options': options, 'ddp_backend': result['ddp_backend'],
        'images_per_s': {k: round(v, 1) for k, v in result['images_per_s'].items()},
        'step_ms': {k: list(steps.values()) for k, steps in result['step_ms'].items()}}]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + '\n')


if __name__ == '__main__':
    sys.exit(main())
