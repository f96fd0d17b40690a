"""Checkpoints: what they cost a step, what a failure costs, and how often to take them.

    python benchmarks/checkpoint.py              # ResNet-18, 2 workers x 2 servers
    python benchmarks/checkpoint.py --quick      # fewer steps and intervals

1. Overhead. The ResNet-18 job on the digits (2 workers, 2 servers, dist_sync) takes a
   checkpoint every k steps with d2ldist (training/checkpoint.py: a snapshot in memory,
   written on a thread), and the same job on torch.distributed (the 'torch' store, gloo)
   saves the way torchrun's recipes do: rank 0 calls torch.save of the model and the
   optimizer in the loop, and waits for it. For each k: the mean time of a step (the
   slower worker's, after a warm-up) and its overhead against k = none; per checkpoint,
   the milliseconds worker 0's step waits for it and (d2ldist) the seconds its thread
   writes, and of these the CPU's (on 2 cores busy with training, taken from it); the
   last column is d2ldist's wait / torch's. In part 3 a checkpoint costs the wait and the
   thread's CPU time.
2. Recovery. The same job with ``--max-restarts 1`` and ``--fail worker:1@step=S``: the
   seconds from the last step before the kill to the first step after it (the launcher
   stops the job, starts it again, and the workers load the newest checkpoint), and the
   steps lost, for several S.
3. How often. Young (1974) and Daly (2006): with a checkpoint costing d seconds and a mean
   time between failures M, take one every sqrt(2 d M) seconds. We compare that rule,
   from the measured d, with the best interval of a simulated job: failures arrive at
   random (exponential, mean M), each costs the measured restart time and the steps
   since the last checkpoint, and we try every interval.
"""
import argparse
import json
import math
import os
import random
import re
import statistics
import sys
import tempfile
import time

from common import launch, worker_command   # benchmarks/common.py


# -- inside a job: train, checkpoint, time each step -----------------------------------------
def worker(args):
    import torch

    import d2ldist
    from d2ldist.training.checkpoint import Checkpoint

    torch.set_num_threads(1)
    d2ldist.init()
    store = d2ldist.create_store(args.store)
    train_iter, _ = d2ldist.load_data_digits(32, num_parts=store.num_workers,
                                             part_index=store.rank)
    torch.manual_seed(0)
    net = d2ldist.resnet18(10, in_channels=3, width=args.width)
    trainer = d2ldist.Trainer(net, 'sgd', {'lr': 0.05, 'momentum': 0.9}, kvstore=store)
    loss = torch.nn.CrossEntropyLoss(reduction='none')
    ckpt, at = None, {'step': 0, 'epoch': 0, 'batch': 0}
    if args.every and args.store != 'torch':
        ckpt = Checkpoint(args.dir, trainer, every=args.every, keep=2)
        at = ckpt.resume() or at                       # (after a restart: where it was)
    step, epoch, skip, times = at['step'], at['epoch'], at['batch'], []
    saved = os.path.join(args.dir, 'torch.pt')
    spent = {'snapshot': 0.0, 'write': 0.0, 'write cpu': 0.0, 'count': 0}   # torch.save: all
                                                                              # in the step
    while step < args.steps:
        train_iter.sampler.set_epoch(epoch, skip * 32)
        batches = iter(train_iter)
        if ckpt:
            ckpt.restore_rng()
        for i, (X, y) in enumerate(batches, start=skip):
            start = time.perf_counter()
            d2ldist.train_batch(X, y, net, loss, trainer, trainer.devices)
            step += 1
            if ckpt:
                ckpt.step_done(step, epoch, i + 1, {})
            elif args.every and step % args.every == 0 and store.rank == 0:
                begin = time.perf_counter()            # torchrun's recipe: wait for it
                torch.save({'model': net.state_dict(), 'optimizer': trainer.optimizer_states()},
                           saved)
                spent['snapshot'] += time.perf_counter() - begin
                spent['count'] += 1
            times.append(time.perf_counter() - start)
            print(f'STEP {step} {time.time():.3f}', flush=True)
            if step == args.steps:
                break
        epoch, skip = epoch + 1, 0
    if ckpt:
        ckpt.wait()
        spent = dict(ckpt.seconds, count=ckpt.writes)
        saved = next(iter(ckpt.steps()), (0, None))[1]
        saved = saved and ckpt.file(saved, 0)
    size = os.path.getsize(saved) if store.rank == 0 and args.every else 0
    print('RESULT ' + json.dumps({'rank': store.rank, 'times': times, 'bytes': size,
                                  'spent': spent}),
          flush=True)


# -- outside: the jobs and the tables -------------------------------------------------------
def run(args, store, every, steps, folder, extra=()):
    servers = 2 if store == 'dist_sync' else 0
    r = launch(['-n', 2, '-s', servers, '--timeout', 900, *extra],
               worker_command(__file__, ['--store', store, '--every', every, '--steps', steps,
                                         '--width', args.width, '--dir', folder]), timeout=1200)
    results = [json.loads(m) for m in re.findall(r'RESULT (.*)', r.stdout)]
    if r.returncode != 0 or len(results) != 2:
        sys.exit(f'benchmark job failed ({store}, every {every}):\n'
                 f'{r.stdout[-3000:]}{r.stderr[-2000:]}')
    return r, results


def step_time(results, warmup):
    """The mean over steps of the slower worker's time (a synchronous step waits for it)."""
    per_step = [max(t) for t in zip(*(r['times'] for r in results))][warmup:]
    return statistics.mean(per_step)


def overhead(args):
    print(f'# 1. Overhead: ResNet-18 (width {args.width}) on the digits, 2 workers, '
          f'{args.steps} steps (the first {args.warmup} untimed); per checkpoint: the time '
          'worker 0\'s step waits (d2ldist: the snapshot; torch: torch.save) and, d2ldist '
          'only, the write on its thread')
    print(f'{"every k":>7} {"d2ldist ms":>10} {"overhead":>8} {"waits ms":>8} {"thread s":>8} '
          f'{"of CPU":>6} '
          f'{"torch ms":>9} {"overhead":>8} {"waits ms":>8} {"waits d2ldist/torch":>19}')
    base, waits = {}, []
    for every in [0] + args.intervals:
        row = {}
        for name, store in (('d2ldist', 'dist_sync'), ('torch', 'torch')):
            with tempfile.TemporaryDirectory() as folder:
                _, results = run(args, store, every, args.steps, folder)
            row[name] = step_time(results, args.warmup)
            zero = next(x for x in results if x['rank'] == 0)
            row[name + ' bytes'], spent = zero['bytes'], zero['spent']
            count = max(1, spent['count'])
            row[name + ' waits'], row[name + ' write'], row[name + ' cpu'] = (
                spent['snapshot'] / count, spent['write'] / count, spent['write cpu'] / count)
        if not every:
            base = row
            print(f'{"none":>7} {row["d2ldist"] * 1e3:>10.0f} {"":>8} {"":>8} {"":>8} {"":>6} '
                  f'{row["torch"] * 1e3:>9.0f}', flush=True)
            continue
        o = {n: row[n] / base[n] - 1 for n in ('d2ldist', 'torch')}
        waits.append(row['d2ldist waits'] + row['d2ldist cpu'])
        print(f'{every:>7} {row["d2ldist"] * 1e3:>10.0f} {o["d2ldist"]:>8.1%} '
              f'{row["d2ldist waits"] * 1e3:>8.0f} {row["d2ldist write"]:>8.2f} '
              f'{row["d2ldist cpu"]:>6.2f} '
              f'{row["torch"] * 1e3:>9.0f} {o["torch"]:>8.1%} {row["torch waits"] * 1e3:>8.0f} '
              f'{row["d2ldist waits"] / row["torch waits"]:>19.2f}', flush=True)
    print(f'(worker 0\'s file: {row["d2ldist bytes"] / 1e6:.0f} MB, the weights, BatchNorm '
          f'statistics and momenta; torch.save\'s: {row["torch bytes"] / 1e6:.0f} MB, without '
          'fsync. The overheads are differences of noisy means)')
    return base['d2ldist'], statistics.median(waits)


def recovery(args, folder_every=5):
    print(f'\n# 2. Recovery: --max-restarts 1, a checkpoint every {folder_every} steps')
    print(f'{"killed at step":>14} {"resumed from":>12} {"steps lost":>10} '
          f'{"s from last step to next":>24}')
    seconds = []
    for fail in args.fail_steps:
        with tempfile.TemporaryDirectory() as folder:
            r, _ = run(args, 'dist_sync', folder_every, args.steps, folder,
                       ['--max-restarts', 1, '--fail', f'worker:1@step={fail}'])
        steps = [(int(s), float(t)) for s, t in
                 re.findall(r'\[worker 0\] STEP (\d+) ([\d.]+)', r.stdout)]
        resumed = int(re.search(r'resumed from \S+ \(step (\d+)', r.stdout).group(1))
        again = next(k for k, (s, _) in enumerate(steps) if k and s <= steps[k - 1][0])
        last_before, first_after = steps[again - 1], steps[again]
        seconds.append(first_after[1] - last_before[1])
        print(f'{fail:>14} {resumed:>12} {last_before[0] - resumed:>10} '
              f'{seconds[-1]:>24.1f}', flush=True)
    return statistics.median(seconds)


def simulate(total, step, every, cost, restart, mtbf, rng):
    """Seconds to finish ``total`` steps with a checkpoint every ``every`` steps and
    failures at random (exponential, mean ``mtbf`` s); each costs ``restart`` seconds
    and the steps since the last checkpoint."""
    clock, done, saved = 0.0, 0, 0
    next_failure = rng.expovariate(1 / mtbf)
    while done < total:
        work = step + (cost if (done + 1) % every == 0 else 0)
        if clock + work > next_failure:                  # lost: back to the checkpoint
            clock, done = next_failure + restart, saved
            next_failure = clock + rng.expovariate(1 / mtbf)
            continue
        clock, done = clock + work, done + 1
        if done % every == 0:
            saved = done
    return clock


def how_often(step, cost, restart, mtbf, total=20_000, runs=40):
    young = math.sqrt(2 * cost * mtbf) / step
    print(f'\n# 3. How often: a step {step:.2f} s, a checkpoint {cost:.2f} s, a restart '
          f'{restart:.0f} s, a failure every {mtbf / 60:.0f} min on average, {total} steps')
    print(f'{"every k steps":>13} {"hours, mean of " + str(runs) + " runs":>22}')
    results = {}
    for every in sorted({1, 2, 5, 10, 20, 50, 100, 200, 500, max(1, round(young))}):
        rng = random.Random(0)
        results[every] = statistics.mean(simulate(total, step, every, cost, restart, mtbf, rng)
                                         for _ in range(runs))
        mark = '   <- Young/Daly' if every == max(1, round(young)) else ''
        print(f'{every:>13} {results[every] / 3600:>22.3f}{mark}', flush=True)
    best = min(results, key=results.get)
    print(f'Young/Daly: every {young:.0f} steps (sqrt(2 x {cost:.2f} s x {mtbf:.0f} s) = '
          f'{young * step:.0f} s); best simulated: every {best} steps, '
          f'{results[max(1, round(young))] / results[best] - 1:.1%} slower at Young/Daly\'s')


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--quick', action='store_true', help='fewer steps and intervals')
    p.add_argument('--steps', type=int, default=30, help='steps per job')
    p.add_argument('--warmup', type=int, default=3, help='untimed steps first')
    p.add_argument('--width', type=int, default=64, help="ResNet-18's first channels")
    p.add_argument('--mtbf', type=float, default=3600, help='seconds between failures (part 3)')
    p.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
    p.add_argument('--store', default='dist_sync', help=argparse.SUPPRESS)
    p.add_argument('--every', type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument('--dir', default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    args.intervals = [10, 5, 2, 1] if args.quick else [20, 10, 5, 2, 1]
    args.fail_steps = [8, 12] if args.quick else [8, 12, 17, 23]
    if args.quick:
        args.steps = 20
    print(f'# {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}')
    step, cost = overhead(args)
    restart = recovery(args)
    how_often(step, cost, restart, args.mtbf)


if __name__ == '__main__':
    main()
