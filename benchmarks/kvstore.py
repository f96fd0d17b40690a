"""Benchmark: one pushpull step of the parameter server against gloo's all_reduce.

    python benchmarks/kvstore.py            # the full table (a few minutes)
    python benchmarks/kvstore.py --quick    # small sizes, two configurations
    python benchmarks/kvstore.py --no-shm   # big frames through TCP loopback, not shared memory

For each payload (ResNet-18's 62 parameter tensors, 11.2 M float32 values; one 64 MB
tensor) and each shape of job (workers x servers), it starts a job with d2l-launch. In
that job every worker times ``kv.pushpull`` of the whole payload (dist_sync, servers only
sum) and, alternating with it, torch.distributed's gloo ``all_reduce`` of a flat tensor
of the same bytes among the same workers (the launcher sets torchrun's variables).
Worker 0 reports medians; "GB/s" is payload bytes / step time for each worker.

On one machine the van moves big frames through shared memory (d2ldist/runtime/shm.py), as gloo
does not; ``--no-shm`` (D2L_SHM=0) sends them over TCP loopback like two machines would,
the comparison that carries across machines. The title line says which path was used.
"""
import argparse
import json
import os
import statistics

from common import launch, pushpull_and_all_reduce, result, worker_command   # benchmarks/common.py
from d2ldist.testing.comm_step import resnet18_shapes


def shm_enabled():
    """Whether the jobs' vans will use shared memory (the environment they inherit)."""
    from d2ldist.config import Config
    from d2ldist.runtime.shm import enabled
    return enabled(Config.from_env(os.environ))


def payload(name, scale):
    """The list of tensor shapes of a payload, divided by ``scale`` for --quick runs."""
    if name == 'resnet18':
        shapes = resnet18_shapes()
        return [(max(1, s[0] // scale),) + tuple(s[1:]) for s in shapes]
    return [(16 * 2**20 // scale,)]            # 64 MB of float32


# -- inside the job: what each worker runs --------------------------------------------------
def worker(args):
    import torch
    import torch.distributed as dist
    import d2ldist
    torch.set_num_threads(1)
    shapes = payload(args.payload, args.scale)
    kv = d2ldist.kv.create('dist_sync')
    grads = [torch.ones(s) for s in shapes]
    weights = [torch.zeros(s) for s in shapes]
    keys = list(range(len(shapes)))
    kv.init(keys, weights)
    dist.init_process_group('gloo')
    flat = torch.ones(sum(g.numel() for g in grads))
    t_kv, t_gloo = pushpull_and_all_reduce(kv, keys, grads, weights, flat, args.steps,
                                           args.warmup)
    assert all(bool((w == kv.num_workers).all()) for w in weights), 'wrong sums'
    if kv.rank == 0:
        nbytes = 4 * flat.numel()
        print('RESULT ' + json.dumps({'bytes': nbytes, 'tensors': len(shapes),
                                      'kv': statistics.median(t_kv),
                                      'gloo': statistics.median(t_gloo)}), flush=True)
    dist.destroy_process_group()


# -- outside: start the jobs and print the table ---------------------------------------------
def run_job(n, s, name, args):
    r = launch(['-n', n, '-s', s, '--timeout', 600], worker_command(__file__, [
        '--payload', name, '--scale', args.scale, '--steps', args.steps,
        '--warmup', args.warmup]), timeout=900)
    return result(r, f'{n}x{s} {name}')


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--quick', action='store_true', help='small payloads, two job shapes')
    p.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
    p.add_argument('--payload', default='resnet18', help=argparse.SUPPRESS)
    p.add_argument('--scale', type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument('--steps', type=int, default=10, help='timed steps per job')
    p.add_argument('--warmup', type=int, default=2, help='untimed steps first')
    p.add_argument('--jobs', default=None, metavar='NxS,...',
                   help='job shapes to run, e.g. 2x2,4x4 (default: all five)')
    p.add_argument('--payloads', default='resnet18,64MB', help='resnet18, 64MB or both')
    p.add_argument('--no-shm', action='store_true',
                   help='big frames over TCP loopback instead of shared memory (D2L_SHM=0)')
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.no_shm:
        os.environ['D2L_SHM'] = '0'
    print(f'# kv pushpull vs gloo all_reduce, loopback; big frames through '
          f'{"shared memory" if shm_enabled() else "TCP (D2L_SHM=0)"}')
    shapes = [(2, 1), (2, 2), (4, 1), (4, 2), (4, 4)]
    if args.quick:
        shapes, args.scale, args.steps = [(2, 1), (2, 2)], 8, 5
    if args.jobs:
        shapes = [tuple(int(x) for x in j.split('x')) for j in args.jobs.split(',')]
    print(f'{"payload":<22} {"workers":>7} {"servers":>7} {"kv step":>9} {"kv GB/s":>8} '
          f'{"gloo step":>9} {"gloo GB/s":>9} {"kv/gloo":>7}')
    target = None
    for name in args.payloads.split(','):
        for n, s in shapes:
            r = run_job(n, s, name, args)
            if (name, n, s) == ('resnet18', 2, 2):
                target = r['kv'] / r['gloo']
            label = f'{name} ({r["tensors"]} x, {r["bytes"] / 2**20:.0f} MB)'
            print(f'{label:<22} {n:>7} {s:>7} {r["kv"] * 1e3:>7.1f}ms '
                  f'{r["bytes"] / r["kv"] / 1e9:>8.2f} {r["gloo"] * 1e3:>7.1f}ms '
                  f'{r["bytes"] / r["gloo"] / 1e9:>9.2f} {r["kv"] / r["gloo"]:>7.2f}', flush=True)
    if target is not None:
        bar = 1.25 if shm_enabled() else 1.5        # (over TCP it moves 2x the ring's bytes)
        print(f'2 workers x 2 servers, ResNet-18: kv step = {target:.2f} x gloo all_reduce '
              f'(target <= {bar}; {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f})')


if __name__ == '__main__':
    main()
