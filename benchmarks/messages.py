"""What one message costs: the ring's chunk against raw bytes on a socket, same job.

    python benchmarks/messages.py              # 4 KB all-reduce, 2 workers, both paths
    python benchmarks/messages.py --bytes 1048576 -n 3
    python benchmarks/messages.py --strace     # and the system calls per message

An all-reduce of S bytes on N workers sends 2(N-1) messages from each worker to its
right neighbour and receives as many from its left one. Every row runs that exchange
many times and divides by the messages: "cpu" is the CPU time of the process (all its
threads) per message sent and received, "wall" the time per message, "calls" the
Python functions entered per message (``sys.setprofile``, on the calling thread: so
not for the rows whose work runs on another thread) and
"syscalls" the system calls per message (``strace -c`` on every thread).

The rows:
- **floor**: each worker sends the chunk's bytes to the right on a plain TCP socket and
  reads the left's with ``recv_into``: nothing but the kernel. Below it no message goes.
- **floor + poll**: the same, waiting in ``poll`` before each read, as a process that
  also waits for other things (the van waits on its ZeroMQ socket and its streams).
- **ring, here**: d2ldist's ring (``collectives/ring.py``) called on this thread.
- **ring, allreduce_**: ``d2ldist.allreduce_``: the ring on the communication thread
  (``collectives/engine.py``), one hand-off there and back per call.
- **gloo**: torch.distributed's all_reduce, divided by the same count of messages.

On one host, chunks go through the van (ZeroMQ; shared memory from 256 KB); between
hosts, and with ``--no-shm`` (D2L_SHM=0) here, on the ring's own TCP streams
(``runtime/stream.py``). The title says which path a table measured; without
``--path`` both are measured, each in a job of its own.
"""
import argparse
import os
import signal
import socket
import subprocess
import sys
import time

from common import ROOT, launch, show, worker_command   # benchmarks/common.py


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--bytes', type=int, default=4096, help='the all-reduced tensor (4 KB)')
    p.add_argument('-n', '--workers', type=int, default=2)
    p.add_argument('--seconds', type=float, default=1.0, help='time per row')
    p.add_argument('--path', choices=['van', 'stream'], help='one path only')
    p.add_argument('--strace', action='store_true', help='count system calls (strace -c)')
    p.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
    return p.parse_args(argv)


ELSEWHERE = {'ring, allreduce_', 'gloo'}   # rows whose work runs on other threads


# -- in each worker ----------------------------------------------------------------------
def raw_ring(chunk):
    """A plain TCP connection to the right neighbour and one from the left."""
    import torch.distributed as dist
    listener = socket.create_server(('127.0.0.1', 0))
    ports = [None] * dist.get_world_size()
    dist.all_gather_object(ports, listener.getsockname()[1])
    r, N = dist.get_rank(), dist.get_world_size()
    right = socket.create_connection(('127.0.0.1', ports[(r + 1) % N]))
    left, _ = listener.accept()
    for s in (left, right):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out, into = bytes(chunk), memoryview(bytearray(chunk))
    return left, right, out, into


def raw_exchange(left, right, out, into, poll):
    """Send a chunk to the right, read one from the left (waiting in poll first)."""
    import select
    right.sendall(out)
    if poll:
        select.select([left], [], [])
    got = 0
    while got < len(into):
        got += left.recv_into(into[got:], len(into) - got)


class Calls:
    """Count the Python functions entered on this thread (sys.setprofile)."""

    def __enter__(self):
        self.n = 0

        def count(frame, event, arg):
            if event in ('call', 'c_call'):
                self.n += 1
        sys.setprofile(count)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)


class Syscalls:
    """Count the system calls of every thread of this process (strace -c), if asked."""

    def __init__(self, on):
        self.on, self.n = on, None

    def __enter__(self):
        if self.on:
            tids = os.listdir(f'/proc/{os.getpid()}/task')
            self.out = f'/tmp/d2ldist-messages-{os.getpid()}.strace'
            self.proc = subprocess.Popen(['strace', '-c', '-o', self.out] +
                                         [a for t in tids for a in ('-p', t)],
                                         stderr=subprocess.DEVNULL)
            time.sleep(1.0)                  # (strace attaches to every thread)
        return self

    def __exit__(self, *exc):
        if self.on:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait()
            with open(self.out) as f:
                total = [line for line in f if line.strip().endswith('total')]
            os.unlink(self.out)
            self.n = int(total[0].split()[3]) if total else None


def measure(fn, messages, seconds, dist, strace):
    """Per message: (cpu us, wall us, Python calls, system calls); the workers' mean."""
    import torch
    for _ in range(20):
        fn()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(20):
        fn()
    once = torch.tensor([(time.perf_counter() - t0) / 20])
    dist.all_reduce(once, dist.ReduceOp.MAX)     # every worker runs as many
    iters = max(50, int(seconds / max(float(once), 1e-6)))
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(iters):
        fn()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    dist.barrier()
    with Calls() as calls:
        for _ in range(50):
            fn()
    dist.barrier()
    with Syscalls(strace) as sys_calls:
        for _ in range(iters if strace else 0):
            fn()
    dist.barrier()
    figures = torch.tensor([cpu / iters, wall / iters, calls.n / 50,
                            (sys_calls.n or 0) / iters], dtype=torch.float64)
    dist.all_reduce(figures)
    cpu, wall, calls, syscalls = (figures / dist.get_world_size() / messages).tolist()
    return cpu * 1e6, wall * 1e6, calls, syscalls if strace else None


def worker(args):
    import torch
    import torch.distributed as dist

    import d2ldist
    from d2ldist.collectives import ops, world
    d2ldist.init()
    dist.init_process_group('gloo', init_method='env://')
    torch.set_num_threads(1)
    N = dist.get_world_size()
    messages = 2 * (N - 1)
    X = torch.ones(args.bytes // 4)
    chunk = args.bytes // N
    ring = world.backend()
    left, right, out, into = raw_ring(chunk)
    rows = [
        ('floor', lambda: [raw_exchange(left, right, out, into, False)
                           for _ in range(messages)]),
        ('floor + poll', lambda: [raw_exchange(left, right, out, into, True)
                                  for _ in range(messages)]),
        ('ring, here', lambda: ring.allreduce_(X, ops.Sum)),
        ('ring, allreduce_', lambda: d2ldist.allreduce_(X, op=d2ldist.Sum)),
        ('gloo', lambda: dist.all_reduce(X)),
    ]
    figures = {name: measure(fn, messages, args.seconds, dist, args.strace)
               for name, fn in rows}
    if dist.get_rank() == 0:
        floor = figures['floor'][0]
        print(f'{"":<18}{"cpu":>9}{"wall":>9}{"calls":>9}{"syscalls":>10}{"cpu / floor":>13}')
        print(f'{"per message":<18}{"(us)":>9}{"(us)":>9}{"":>9}{"":>10}{"":>13}')
        for name, (cpu, wall, calls, syscalls) in figures.items():
            sc = '-' if syscalls is None else f'{syscalls:.1f}'
            py = '-' if name in ELSEWHERE else f'{calls:.0f}'
            print(f'{name:<18}{cpu:>9.1f}{wall:>9.1f}{py:>9}{sc:>10}'
                  f'{cpu / floor:>13.1f}', flush=True)
    for s in (left, right):
        s.close()
    dist.destroy_process_group()


# -- the driver ------------------------------------------------------------------------------
def main(argv=None):
    args = parse(argv)
    if args.worker:
        return worker(args)
    if args.strace and subprocess.run(['which', 'strace'], capture_output=True).returncode:
        sys.exit('messages.py: --strace needs strace (apt-get install strace)')
    own = [a for a in (argv if argv is not None else sys.argv[1:]) if a != '--worker']
    for path in [args.path] if args.path else ['van', 'stream']:
        where = ('the van (ZeroMQ; shared memory from 256 KB)' if path == 'van' else
                 "the ring's TCP streams (D2L_SHM=0)")
        print(f'\n# {args.bytes} B all-reduced by {args.workers} workers: '
              f'{2 * (args.workers - 1)} messages of {args.bytes // args.workers} B each '
              f'per worker per call; chunks through {where}; {os.cpu_count()} CPUs')
        returncode = show(launch(['-n', args.workers, '-s', 0], worker_command(__file__, own),
                                 env={'D2L_SHM': '0'} if path == 'stream' else None))
        if returncode != 0:
            return returncode
    return 0


if __name__ == '__main__':
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
