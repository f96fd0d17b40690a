"""Benchmark: what replicated servers (d2l-launch --server-replicas R) cost per step.

    python benchmarks/replicas.py            # ResNet-18's gradients, 2 workers x 2 servers
    python benchmarks/replicas.py --quick    # an eighth of them

For R = 0 and R = 1 it starts a job with d2l-launch. In each, every worker times a
``kv.pushpull`` of ResNet-18's 62 gradient tensors (11.2 M float32 values, dist_sync,
SGD with momentum on the servers) and, alternating with it, torch.distributed's gloo
``all_reduce`` of the same bytes among the same workers. Worker 0 reports medians and
asks the servers how many bytes their chains sent on (``kv.server_info()``:
``replicated``). With R = 1 each update travels once more, server to server, as the
round's sum; the answer waits for it.
"""
import argparse
import json
import statistics

from common import launch, pushpull_and_all_reduce, result, worker_command   # benchmarks/common.py
from d2ldist.testing.comm_step import resnet18_shapes


def worker(args):
    """Inside the job: time pushpull and gloo's all_reduce; worker 0 prints the result."""
    import torch
    import torch.distributed as dist
    import d2ldist
    torch.set_num_threads(1)
    shapes = [(max(1, s[0] // args.scale),) + tuple(s[1:]) for s in resnet18_shapes()]
    kv = d2ldist.kv.create('dist_sync')
    grads, weights = [torch.ones(s) for s in shapes], [torch.zeros(s) for s in shapes]
    keys = list(range(len(shapes)))
    kv.init(keys, weights)
    kv.set_optimizer('sgd', lr=0.01, momentum=0.9)
    dist.init_process_group('gloo')
    flat = torch.ones(sum(g.numel() for g in grads))
    before = sum(v['replicated'] for v in kv.server_info().values())
    t_kv, t_gloo = pushpull_and_all_reduce(kv, keys, grads, weights, flat, args.steps,
                                           args.warmup)
    replicated = sum(v['replicated'] for v in kv.server_info().values()) - before
    if kv.rank == 0:
        print('RESULT ' + json.dumps({
            'bytes': 4 * flat.numel(), 'kv': statistics.median(t_kv),
            'gloo': statistics.median(t_gloo),
            'replicated': replicated / (args.warmup + args.steps)}), flush=True)
    dist.destroy_process_group()


def run_job(r, args):
    """One job with --server-replicas r: worker 0's result."""
    out = launch(['-n', 2, '-s', 2, '--server-replicas', r, '--timeout', 600],
                 worker_command(__file__, ['--scale', args.scale, '--steps', args.steps,
                                           '--warmup', args.warmup]), timeout=900)
    return result(out, f'R={r}')


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--quick', action='store_true', help='an eighth of the gradients, 5 steps')
    p.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
    p.add_argument('--scale', type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument('--steps', type=int, default=10, help='timed steps per job')
    p.add_argument('--warmup', type=int, default=2, help='untimed steps first')
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.scale, args.steps = 8, 5
    print('# 2 workers x 2 servers, ResNet-18 gradients, dist_sync with SGD on the servers')
    print(f'{"replicas":>8} {"MB pushed":>9} {"MB replicated":>13} {"kv step":>9} '
          f'{"gloo step":>9} {"kv/gloo":>7}')
    steps = {}
    for r in (0, 1):
        res = run_job(r, args)
        steps[r] = res['kv']
        pushed = 2 * res['bytes']              # per step: each worker pushes every value
        print(f'{r:>8} {pushed / 1e6:>9.1f} {res["replicated"] / 1e6:>13.1f} '
              f'{res["kv"] * 1e3:>7.1f}ms {res["gloo"] * 1e3:>7.1f}ms '
              f'{res["kv"] / res["gloo"]:>7.2f}', flush=True)
    print(f'R = 1 costs {steps[1] / steps[0]:.2f} x the step of R = 0 '
          '(MB replicated: each update once more, as its sum)')


if __name__ == '__main__':
    main()
