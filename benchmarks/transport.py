"""One frame from one process to another on this machine: the van's socket, the van's
shared memory, and torch.distributed's gloo send/recv, measured in the same job.

    python benchmarks/transport.py            # 64 KB .. 64 MB
    python benchmarks/transport.py --quick    # 256 KB .. 4 MB

Worker 0 sends a frame of S bytes to worker 1, which adds 1 to its first byte (so it has
the bytes in hand, as a tensor over the frame) and answers with an empty message. The
time is the mean round trip; "cpu/GB" is the CPU time of both processes (all threads)
per GB moved, the figure that matters when the processes share the cores with the
computation. Through the socket a frame is copied by the kernel into and out of TCP
loopback; through shared memory (d2ldist/runtime/shm.py) it is copied once, into a block the
receiver reads in place. This is how shm.SHM_MIN_BYTES was chosen.
"""
import argparse
import os
import sys
import time

from common import launch, show, worker_command   # benchmarks/common.py

KB, MB = 1024, 1024 * 1024


def human(nbytes):
    return f'{nbytes // MB} MB' if nbytes >= MB else f'{nbytes // KB} KB'


# -- in each worker ----------------------------------------------------------------------
def worker(args):
    import torch
    import torch.distributed as dist

    import d2ldist
    node = d2ldist.init()
    dist.init_process_group('gloo')
    torch.set_num_threads(1)
    peer = f'worker:{1 - node.rank}'

    def van_round_trips(X, iters):
        for _ in range(iters):
            if node.rank == 0:
                node.send(peer, 'frame', {}, [X.numpy().data])
                node.recv(['ack'])
            else:
                msg = node.recv(['frame'])
                torch.frombuffer(msg.frames[0], dtype=torch.uint8)[0] += 1
                del msg
                node.send(peer, 'ack')

    def gloo_round_trips(X, iters):
        for _ in range(iters):
            if node.rank == 0:
                dist.send(X, 1)
                dist.recv(X[:1], 1)
            else:
                dist.recv(X, 0)
                X[0] += 1
                dist.send(X[:1], 0)

    def timed(fn, X, iters):
        fn(X, 2)
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        fn(X, iters)
        wall, cpu = time.perf_counter() - t0, torch.tensor([time.process_time() - c0])
        dist.all_reduce(cpu)                   # both processes' CPU time
        return wall / iters, float(cpu) / iters

    def row(*cells):
        if node.rank == 0:
            print(''.join(f'{c:>12}' for c in cells), flush=True)

    row('size', 'socket', 'cpu/GB', 'shm', 'cpu/GB', 'gloo', 'cpu/GB', 'cpu socket')
    row('', '(us)', '(ms)', '(us)', '(ms)', '(us)', '(ms)', '/ cpu shm')
    address = node.book[peer]
    size = args.min_bytes
    while size <= args.max_bytes:
        X = torch.ones(size, dtype=torch.uint8)
        iters = max(3, min(300, int(args.seconds * 2e9 / size)))
        cells = []
        for same_host in (False, True):        # the same link, without and with shared memory
            node.van.connect(peer, address, same_host=same_host)
            cells.append(timed(van_round_trips, X, iters))
        cells.append(timed(gloo_round_trips, X, iters))
        row(human(size), *[f for t, cpu in cells for f in (f'{t * 1e6:.0f}',
                                                           f'{cpu / size * 1e12:.0f}')],
            f'{cells[0][1] / cells[1][1]:.2f}')
        size *= 4
    if node.rank == 0 and not node.van.shm_stats()['sent']:
        print('(shared memory is off here: D2L_SHM=0, a simulated link or not x86-64 Linux)')
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--quick', action='store_true', help='256 KB .. 4 MB')
    p.add_argument('--min-bytes', type=int, default=64 * KB)
    p.add_argument('--max-bytes', type=int, default=64 * MB)
    p.add_argument('--seconds', type=float, default=0.3, help='about this long per cell')
    p.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.min_bytes, args.max_bytes, args.seconds = 256 * KB, 4 * MB, 0.1
    if args.worker:
        return worker(args)
    print(f'# one frame, worker 0 -> worker 1 and an empty answer back; {os.cpu_count()} CPUs; '
          f'load {os.getloadavg()[0]:.1f}')
    proc = launch(['-n', 2, '-s', 0, '--timeout', 600], worker_command(__file__, [
        '--min-bytes', args.min_bytes, '--max-bytes', args.max_bytes, '--seconds', args.seconds]))
    return show(proc)


if __name__ == '__main__':
    sys.exit(main())
