"""All-reduce bandwidth: d2ldist's ring against torch.distributed's gloo, same run.

    python benchmarks/allreduce.py                 # 4 KB .. 256 MB, 2 and 4 workers
    python benchmarks/allreduce.py --quick         # 4 KB .. 4 MB, 2 workers
    python benchmarks/allreduce.py --chunk-sweep   # the ring's chunk size, measured
    python benchmarks/allreduce.py --no-shm        # chunks over TCP, not shared memory
    python benchmarks/allreduce.py --reduce-scatter  # the first half alone, three ways

The table follows nccl-tests: for a tensor of S bytes taking t seconds,
algbw = S / t and busbw = algbw * 2(N-1)/N -- the bytes each worker actually
sends per second in a ring, comparable across N. Every size is timed for the ring
and for gloo in the same job, interleaved, on float32 with op Sum; the time is the
slowest worker's mean over the iterations; cpu is the CPU time (all threads) per
call, averaged over the workers. The last column is busbw(ring) / busbw(gloo).

``--reduce-scatter`` times the ring's first half (``reduce_scatter_flat``, as ZeRO uses it)
against gloo's ``reduce_scatter_single``, which all-reduces the whole tensor and keeps a
shard, and against the torch backend's reduce-scatter on gloo, one all-to-all (busbw =
algbw * (N-1)/N, as nccl-tests counts a reduce-scatter).

On one machine the van moves chunks of 256 KB and more through shared memory
(d2ldist/runtime/shm.py); ``--no-shm`` (D2L_SHM=0) sends them over TCP loopback, as between
machines. The title line says which path the table measured.

Measured with ``--no-shm -n 2,3,4`` on a quiet 2-core machine, the ring on its own TCP
streams (d2ldist/runtime/stream.py), busbw ring / gloo at 1, 4, 16 and 64 MB, eight runs in
two of the machine's states: 2 workers 2.12-2.93 / 1.67-2.06 / 1.19-1.72 / 1.28-1.51,
3 workers 0.86-1.44 / 0.81-1.19 / 0.84-1.07 / 0.81-1.15, 4 workers 1.07-1.50 / 0.70-1.05 /
0.90-1.11 / 0.89-1.14 (docs/performance.md says where the CPU goes).
"""
import argparse
import os
import sys
import time

from common import ROOT, launch, show, worker_command   # benchmarks/common.py

KB, MB = 1024, 1024 * 1024


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--quick', action='store_true', help='small sizes, 2 workers only')
    p.add_argument('-n', '--workers', default=None, help='worker counts (default 2,4)')
    p.add_argument('--min-bytes', type=int, default=4 * KB)
    p.add_argument('--max-bytes', type=int, default=256 * MB)
    p.add_argument('--factor', type=int, default=4, help='size step (nccl-tests -f)')
    p.add_argument('--seconds', type=float, default=0.5,
                   help='time budget per size and backend (more iterations for small sizes)')
    p.add_argument('--chunk-sweep', action='store_true',
                   help='time the ring with several chunk sizes instead of gloo')
    p.add_argument('--reduce-scatter', action='store_true',
                   help="reduce-scatter: the ring's, gloo's, and the torch backend's all-to-all")
    p.add_argument('--no-shm', action='store_true',
                   help='chunks over TCP loopback instead of shared memory (D2L_SHM=0)')
    p.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.max_bytes = min(args.max_bytes, 4 * MB)
        args.seconds = min(args.seconds, 0.2)
    args.workers = [int(n) for n in (args.workers or ('2' if args.quick else '2,4')).split(',')]
    return args


def sizes(args):
    s, out = args.min_bytes, []
    while s <= args.max_bytes:
        out.append(s)
        s *= args.factor
    return out


def human(nbytes):
    for unit, scale in (('GB', 1 << 30), ('MB', MB), ('KB', KB)):
        if nbytes >= scale:
            return f'{nbytes / scale:g} {unit}'
    return f'{nbytes} B'


# -- in each worker ----------------------------------------------------------------------
def timed(fn, X, seconds, dist):
    """The slowest worker's mean time of fn(X) and the workers' mean CPU time per call
    (all threads of the process: on a busy machine the CPU time is the steadier figure)."""
    import torch
    fn(X)
    dist.barrier()
    t0 = time.perf_counter()
    fn(X)
    once = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(once, dist.ReduceOp.MAX)        # everyone runs the same count
    iters = max(2, min(1000, int(seconds / max(float(once), 1e-6))))
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(iters):
        fn(X)
    mean = torch.tensor([(time.perf_counter() - t0) / iters])
    cpu = torch.tensor([(time.process_time() - c0) / iters])
    dist.all_reduce(mean, dist.ReduceOp.MAX)
    dist.all_reduce(cpu, dist.ReduceOp.SUM)
    return float(mean), float(cpu) / dist.get_world_size()


def worker(args):
    import torch
    import torch.distributed as dist

    import d2ldist
    from d2ldist.collectives import world
    d2ldist.init()
    dist.init_process_group('gloo', init_method='env://')
    r, N = d2ldist.rank(), d2ldist.size()
    ring = world.backend().ring
    bus = 2 * (N - 1) / N

    def d2l_ring(X):
        d2ldist.allreduce_(X, op=d2ldist.Sum)

    def gloo(X):
        dist.all_reduce(X, dist.ReduceOp.SUM)

    def row(*cells):
        if r == 0:
            print(''.join(f'{c:>13}' for c in cells), flush=True)

    if args.reduce_scatter:
        reduce_scatter(args, world, dist, row)
    elif args.chunk_sweep:
        chunks = [256 * KB, MB, 2 * MB, 4 * MB, 8 * MB]
        row('size', *[f'chunk {human(c)}' for c in chunks])
        row('', *['busbw/cpu ms'] * len(chunks))
        for nbytes in sizes(args):
            X = torch.ones(nbytes // 4)
            cells = []
            for c in chunks:
                ring.chunk_bytes = c
                t, cpu = timed(d2l_ring, X, args.seconds, dist)
                cells.append(f'{nbytes / t * bus / 1e9:.2f}/{cpu * 1e3:.0f}')
            row(human(nbytes), *cells)
    else:
        row('size', 'count', 'ring time', 'algbw', 'busbw', 'cpu', 'gloo time', 'algbw',
            'busbw', 'cpu', 'busbw ratio')
        row('', '(float32)', '(us)', '(GB/s)', '(GB/s)', '(us)', '(us)', '(GB/s)', '(GB/s)',
            '(us)', 'ring/gloo')
        for nbytes in sizes(args):
            X = torch.ones(nbytes // 4)
            t_ring, cpu_ring = timed(d2l_ring, X, args.seconds, dist)
            t_gloo, cpu_gloo = timed(gloo, X, args.seconds, dist)
            bw = [nbytes / t / 1e9 for t in (t_ring, t_gloo)]
            row(human(nbytes), X.numel(), f'{t_ring * 1e6:.0f}', f'{bw[0]:.3f}',
                f'{bw[0] * bus:.3f}', f'{cpu_ring * 1e6:.0f}', f'{t_gloo * 1e6:.0f}',
                f'{bw[1]:.3f}', f'{bw[1] * bus:.3f}', f'{cpu_gloo * 1e6:.0f}',
                f'{bw[0] / bw[1]:.2f}')
    dist.destroy_process_group()


def reduce_scatter(args, world, dist, row):
    """The table of --reduce-scatter: ring, gloo's reduce_scatter_single, all-to-all."""
    import torch

    import d2ldist
    from d2ldist.collectives.torch_backend import REDUCE_SCATTER, TorchBackend
    N, ring, torch_backend = dist.get_world_size(), world.backend(), TorchBackend()
    bus = (N - 1) / N

    def d2l_ring(X):
        world.run(ring.reduce_scatter_flat, X, d2ldist.Sum).wait()

    def gloo(X):
        REDUCE_SCATTER(torch.empty(X.numel() // N), X, dist.ReduceOp.SUM)

    def all_to_all(X):
        torch_backend.reduce_scatter_flat(X, d2ldist.Sum)

    row('size', 'ring time', 'busbw', 'gloo time', 'busbw', 'all-to-all', 'busbw',
        'ring/gloo', 'a2a/gloo')
    row('', '(us)', '(GB/s)', '(us)', '(GB/s)', '(us)', '(GB/s)', 'busbw', 'busbw')
    for nbytes in sizes(args):
        X = torch.ones(nbytes // 4 // N * N)
        times = [timed(fn, X, args.seconds, dist)[0] for fn in (d2l_ring, gloo, all_to_all)]
        bw = [X.numel() * 4 / t * bus / 1e9 for t in times]
        row(human(nbytes), *[c for t, b in zip(times, bw) for c in (f'{t * 1e6:.0f}', f'{b:.3f}')],
            f'{bw[0] / bw[1]:.2f}', f'{bw[2] / bw[1]:.2f}')


# -- the driver ------------------------------------------------------------------------------
def main(argv=None):
    args = parse(argv)
    if args.worker:
        return worker(args)
    if args.no_shm:
        os.environ['D2L_SHM'] = '0'
    sys.path.insert(0, str(ROOT))
    from d2ldist.config import Config
    from d2ldist.runtime.shm import enabled
    what = 'reduce-scatter' if args.reduce_scatter else 'all-reduce'
    print(f'# {what} busbw, d2ldist ring vs torch.distributed gloo, same job; '
          f'{os.cpu_count()} CPUs; loopback; ring chunks through '
          f'{"shared memory" if enabled(Config.from_env(os.environ)) else "TCP (D2L_SHM=0)"}')
    own = [a for a in (argv if argv is not None else sys.argv[1:]) if a != '--worker']
    for n in args.workers:
        print(f'\n# {n} workers')
        returncode = show(launch(['-n', n, '-s', 0], worker_command(__file__, own)))
        if returncode != 0:
            return returncode
    return 0


if __name__ == '__main__':
    sys.exit(main())
