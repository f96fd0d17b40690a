"""One synchronous step of communication on ResNet-18's gradients, timed inside a job.

Each worker holds the 62 gradient tensors of ResNet-18 (``resnet18_shapes``: the
output channels divided by ``scale``) and times, after ``warmup`` untimed steps, each of
``steps`` steps (all workers start a step together):

* mode ``ps``: kv.pushpull of the tensors (dist_sync; the servers only sum);
* mode ``ring``: d2ldist's ring all-reduce of the same bytes as one fused buffer, then
  torch.distributed's gloo all_reduce of that buffer;
* mode ``both``: the two, in one job.

Every worker prints ``RESULT {method: [seconds of each step]}``; ``summarize`` turns a
job's output into each method's median step of the slowest worker. What a job's
workers run (``worker_argv``)::

    python -m d2ldist.testing.comm_step --mode both --scale 8 --steps 3
"""
import argparse
import json
import statistics
import sys
import time


def resnet18_shapes(scale=1):
    """The 62 parameter shapes of ResNet-18 (11.7 M values); output channels / scale."""
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    c_in = 64
    for c, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        for block in range(2):
            shapes += [(c, c_in if block == 0 else c, 3, 3), (c,), (c,), (c, c, 3, 3), (c,), (c,)]
            if block == 0 and (stride != 1 or c_in != c):
                shapes += [(c, c_in, 1, 1), (c,), (c,)]
        c_in = c
    shapes += [(1000, 512), (1000,)]
    return [(max(1, s[0] // scale),) + tuple(s[1:]) for s in shapes]


def worker_argv(mode, scale=1, steps=5, warmup=1):
    """The command each worker of a job runs (this module, with this Python)."""
    return [sys.executable, '-m', 'd2ldist.testing.comm_step', '--mode', mode,
            '--scale', str(scale), '--steps', str(steps), '--warmup', str(warmup)]


def summarize(stdout, m, steps):
    """{method: median over steps of the slowest worker's time}, from a job's output."""
    per_worker = [json.loads(line.split('RESULT ', 1)[1]) for line in stdout.splitlines()
                  if 'RESULT ' in line]
    if len(per_worker) != m:
        raise RuntimeError(f'{len(per_worker)} of {m} workers reported:\n{stdout[-3000:]}')
    return {method: statistics.median(max(w[method][i] for w in per_worker)
                                      for i in range(steps))
            for method in per_worker[0]}


# -- inside the job: what each worker runs --------------------------------------------------
def worker(mode, scale, steps, warmup):
    """Time the steps of ``mode`` on this worker and print them as one RESULT line."""
    import torch
    import torch.distributed as dist
    from .. import kv
    from ..collectives.api import allreduce_
    from ..collectives.ops import Sum
    from ..collectives.world import barrier, init, size
    torch.set_num_threads(1)
    shapes = resnet18_shapes(scale)
    grads = [torch.ones(s) for s in shapes]
    times = {}
    if mode in ('ps', 'both'):
        store = kv.create('dist_sync')
        weights = [torch.zeros(s) for s in shapes]
        keys = list(range(len(shapes)))
        store.init(keys, weights)
        times['ps'] = timed(store.barrier, lambda: store.pushpull(keys, grads, out=weights),
                            steps, warmup)
        assert all(bool((w == store.num_workers).all()) for w in weights), 'wrong sums'
    if mode in ('ring', 'both'):
        init()
        dist.init_process_group('gloo')
        flat = torch.ones(sum(g.numel() for g in grads))
        times['ring'] = timed(barrier, lambda: allreduce_(flat.fill_(1), op=Sum), steps, warmup)
        assert bool((flat == size()).all()), 'wrong sums'
        times['gloo'] = timed(dist.barrier, lambda: dist.all_reduce(flat), steps, warmup)
        dist.destroy_process_group()
    print('RESULT ' + json.dumps(times), flush=True)


def timed(barrier, step, steps, warmup):
    """This worker's time of each step after the warm-up ones (all start together)."""
    out = []
    for i in range(warmup + steps):
        barrier()
        t0 = time.perf_counter()
        step()
        if i >= warmup:
            out.append(time.perf_counter() - t0)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description='One worker of a job: time a communication step.')
    p.add_argument('--mode', choices=('ps', 'ring', 'both'), required=True)
    p.add_argument('--scale', type=int, default=1, help="divide ResNet-18's channels by this")
    p.add_argument('--steps', type=int, default=5, help='timed steps')
    p.add_argument('--warmup', type=int, default=1, help='untimed steps first')
    args = p.parse_args(argv)
    worker(args.mode, args.scale, args.steps, args.warmup)


if __name__ == '__main__':
    main()
