"""Checkpoints: what they cost a step, what a failure costs, and how often to take them.

    python benchmarks/checkpoint.py                  # parts 1-4
    python benchmarks/checkpoint.py --part resnet    # parts 1-3: ResNet-18 (2 workers x 2 servers)
    python benchmarks/checkpoint.py --part sharded   # part 4: sharded checkpoints against DCP
    python benchmarks/checkpoint.py --quick          # fewer steps and intervals, a smaller MLP

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
4. Sharded checkpoints. An MLP (float32; its state: the weights and Adam's two moments)
   trained a step, saved by N workers with ``d2ldist.checkpoint.save`` and loaded by M
   with ``d2ldist.checkpoint.load`` (N -> M: 2 -> 2, 3 -> 2 resharded), for ZeRO stages
   1, 2 and 3 on the ring and FSDP2 on the torch backend (DCP's format); and in the
   torch backend's jobs, the same FSDP2 model saved and loaded with plain
   ``torch.distributed.checkpoint`` (gloo). Per row: the bytes written (the busiest
   worker's, all), the seconds of a save and of a load (the slowest worker's, after a
   barrier; the median of the repeats after an untimed one), their ratio to DCP's, and
   whether the SHA-256 lines at save and at load agree (d2ldist prints them; for plain
   DCP the benchmark takes the same hash: docs/design/sharded_checkpoints.md).
   Measured on the quiet 2-core machine (50 MB): save 1.7-2.7 and load 1.8-6.2 times
   DCP's, mostly the whole state gathered and hashed for that line (docs/performance.md).
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


# -- part 4, inside a job: an MLP saved, or loaded, in each way, timed ----------------------
LAYERS = 4                                  # Linear(width, width) each, ReLU between
NAMES = {'1': 'ZeRO-1', '2': 'ZeRO-2', '3': 'ZeRO-3', 'fsdp2': 'FSDP2', 'dcp': 'torch DCP'}


def mlp_state(way, width):
    """{'model', 'optimizer', 'step'} of part 4's MLP trained in ``way`` (ZeRO's stage '1',
    '2', '3', or 'fsdp2'), the same first weights on every worker; and its state's bytes
    (the weights and Adam's two moments)."""
    import torch
    from torch import nn

    import d2ldist
    torch.manual_seed(0)
    net = nn.Sequential(*[m for _ in range(LAYERS)
                          for m in (nn.Linear(width, width), nn.ReLU())][:-1])
    size = 3 * sum(p.numel() * p.element_size() for p in net.parameters())
    if way == 'fsdp2':
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh('cpu', (d2ldist.size(),))
        for layer in [*net[::2], net]:
            fully_shard(layer, mesh=mesh)
    elif way == '3':
        net = d2ldist.shard_module(net)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    if way in ('1', '2'):
        opt = d2ldist.ShardedOptimizer(opt, net.named_parameters(), stage=int(way))
    return {'model': net, 'optimizer': opt, 'step': 0}, size


def train_step(state, width):
    """One step of Adam on a batch of random inputs (each worker its own): moments to save."""
    import torch

    import d2ldist
    X = torch.randn(32, width, generator=torch.Generator().manual_seed(d2ldist.rank()))
    state['optimizer'].zero_grad()
    state['model'](X).pow(2).mean().backward()
    state['optimizer'].step()
    state['step'] += 1


def dcp_save(state, folder):
    """PyTorch's recipe: the state dicts of the FSDP2 model and its optimizer, dcp.save."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model, optim = get_state_dict(state['model'], state['optimizer'])
    dcp.save({'model': model, 'optimizer': optim, 'step': state['step']}, checkpoint_id=folder)


def dcp_load(state, folder):
    """PyTorch's recipe: dcp.load into the state dicts, set_state_dict."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    net, opt = state['model'], state['optimizer']
    model, optim = get_state_dict(net, opt)
    loaded = {'model': model, 'optimizer': optim, 'step': 0}
    dcp.load(loaded, checkpoint_id=folder)
    set_state_dict(net, opt, model_state_dict=loaded['model'],
                   optim_state_dict=loaded['optimizer'])
    state['step'] = loaded['step']


def timed(call):
    """Seconds of ``call()`` on this worker, started together on every worker."""
    import d2ldist
    d2ldist.barrier()
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def sharded_worker(args):
    import gc

    import torch

    import d2ldist
    from d2ldist.training.dcp_checkpoint import whole_sha256

    torch.set_num_threads(1)
    d2ldist.init()
    verb = d2ldist.checkpoint.save if args.job == 'save' else d2ldist.checkpoint.load
    for way in args.ways.split(','):
        state, size = mlp_state(way, args.mlp_width)
        if args.job == 'save':
            train_step(state, args.mlp_width)
        calls = {way: lambda: verb(state, os.path.join(args.dir, way))}
        if way == 'fsdp2':                  # plain DCP of the same model, interleaved
            plain = dcp_save if args.job == 'save' else dcp_load
            calls['dcp'] = lambda: plain(state, os.path.join(args.dir, 'dcp'))
        seconds = {k: [] for k in calls}
        for repeat in range(1 + args.repeats):          # the first: a warm-up, untimed
            for k, call in calls.items():
                took = timed(call)
                if repeat:
                    seconds[k].append(took)
        sha = whole_sha256(state) if 'dcp' in calls else None    # (after DCP's last call)
        print('RESULT ' + json.dumps({'rank': d2ldist.rank(), 'seconds': seconds,
                                      'bytes': size, 'dcp sha': sha}), flush=True)
        del state, calls
        gc.collect()
    d2ldist.barrier()


# -- part 4, outside: the jobs and the table -------------------------------------------------
def sharded_job(args, job, n, ways, folder):
    """A save or load job of n workers over ``ways`` (FSDP2 on the torch backend); its
    output and, by way, the slowest worker's seconds of each repeat and the sha256 lines."""
    extra = ['--env', 'D2L_BACKEND=torch'] if ways == ['fsdp2'] else []
    r = launch(['-n', n, '-s', 0, '--timeout', 600, *extra],
               worker_command(__file__, ['--job', job, '--ways', ','.join(ways), '--dir', folder,
                                         '--mlp-width', args.mlp_width,
                                         '--repeats', args.repeats]), timeout=900)
    results = [json.loads(m) for m in re.findall(r'RESULT (.*)', r.stdout)]
    if r.returncode != 0 or len(results) != n * len(ways):
        sys.exit(f'benchmark job failed ({job}, {n} workers, {ways}):\n'
                 f'{r.stdout[-3000:]}{r.stderr[-2000:]}')
    verb = 'saved in' if job == 'save' else 'loaded from'
    lines = re.findall(rf'd2ldist: checkpoint {verb} (\S+) .*state sha256 ([0-9a-f]{{64}})',
                       r.stdout)
    found = {}
    for way in ways + (['dcp'] if 'fsdp2' in ways else []):
        mine = [x for x in results if way in x['seconds']]
        dcp_sha = [x['dcp sha'] for x in mine if x['dcp sha']][:1]
        found[way] = {
            'seconds': statistics.median(max(s) for s in zip(*(x['seconds'][way] for x in mine))),
            'bytes': mine[0]['bytes'],
            'sha': dcp_sha if way == 'dcp' else
                   [sha for at, sha in lines if at == os.path.join(folder, way)]}
    return found


def written(folder):
    """(bytes of the busiest worker's files, of all) in a checkpoint's folder: worker r's
    shard-r-of-N.ckpt or __r_0.distcp, and worker 0's manifest and DCP's .metadata."""
    by_worker = {}
    for name in os.listdir(folder):
        owner = re.match(r'(?:shard-|__)(\d+)[-_]', name)
        r = int(owner.group(1)) if owner else 0
        by_worker[r] = by_worker.get(r, 0) + os.path.getsize(os.path.join(folder, name))
    return max(by_worker.values()), sum(by_worker.values())


def sharded(args):
    print(f'\n# 4. Sharded checkpoints: an MLP of {LAYERS} Linear({args.mlp_width}, '
          f'{args.mlp_width}), float32, Adam; ZeRO on the ring, FSDP2 and torch DCP on the '
          f'torch backend (gloo); seconds: the slowest worker\'s, median of {args.repeats} after a '
          'warm-up')
    print(f'{"way":<9} {"N -> M":>6} {"state MB":>8} {"busiest MB":>10} {"total MB":>8} '
          f'{"save s":>6} {"load s":>6} {"sha equal":>9} {"save/DCP":>8} {"load/DCP":>8}')
    groups = [['1', '2', '3'], ['fsdp2']]
    with tempfile.TemporaryDirectory() as root:
        saved = {}
        for n in sorted({n for n, _ in args.pairs}):
            folder = os.path.join(root, f'by-{n}')
            saved[n] = {k: v for ways in groups
                        for k, v in sharded_job(args, 'save', n, ways, folder).items()}
            for way, row in saved[n].items():
                row['written'] = written(os.path.join(folder, way))
        for n, m in args.pairs:
            folder = os.path.join(root, f'by-{n}')
            loaded = {k: v for ways in groups
                      for k, v in sharded_job(args, 'load', m, ways, folder).items()}
            torch_ = saved[n]['dcp']['seconds'], loaded['dcp']['seconds']
            for way, row in saved[n].items():
                (busiest, total), load = row['written'], loaded[way]
                same = len(row['sha']) >= 1 and len(load['sha']) >= 1 and \
                    set(row['sha']) == set(load['sha'])
                ratios = '' if way == 'dcp' else \
                    f'{row["seconds"] / torch_[0]:>8.2f} {load["seconds"] / torch_[1]:>8.2f}'
                print(f'{NAMES[way]:<9} {f"{n} -> {m}":>6} {row["bytes"] / 1e6:>8.1f} '
                      f'{busiest / 1e6:>10.1f} {total / 1e6:>8.1f} {row["seconds"]:>6.2f} '
                      f'{load["seconds"]:>6.2f} {"sha equal" if same else "DIFFERENT":>9} '
                      f'{ratios}'.rstrip(), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--quick', action='store_true', help='fewer steps and intervals')
    p.add_argument('--steps', type=int, default=30, help='steps per job')
    p.add_argument('--warmup', type=int, default=3, help='untimed steps first')
    p.add_argument('--width', type=int, default=64, help="ResNet-18's first channels")
    p.add_argument('--mtbf', type=float, default=3600, help='seconds between failures (part 3)')
    p.add_argument('--part', choices=['all', 'resnet', 'sharded'], default='all',
                   help='resnet: parts 1-3; sharded: part 4')
    p.add_argument('--mlp-width', type=int, default=None,
                   help="part 4: the MLP's width (default 1024; --quick 256)")
    p.add_argument('--repeats', type=int, default=None,
                   help='part 4: saves and loads timed per job (default 3; --quick 1)')
    p.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
    p.add_argument('--store', default='dist_sync', help=argparse.SUPPRESS)
    p.add_argument('--every', type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument('--dir', default=None, help=argparse.SUPPRESS)
    p.add_argument('--job', choices=['save', 'load'], help=argparse.SUPPRESS)
    p.add_argument('--ways', default='', help=argparse.SUPPRESS)
    args = p.parse_args()
    args.mlp_width = args.mlp_width if args.mlp_width is not None else 256 if args.quick else 1024
    args.repeats = args.repeats if args.repeats is not None else 1 if args.quick else 3
    if args.mlp_width < 1 or args.repeats < 1:
        p.error('--mlp-width and --repeats must be at least 1')
    if args.worker:
        return sharded_worker(args) if args.job else worker(args)
    args.intervals = [10, 5, 2, 1] if args.quick else [20, 10, 5, 2, 1]
    args.fail_steps = [8, 12] if args.quick else [8, 12, 17, 23]
    args.pairs = [(2, 2), (3, 2)]
    if args.quick:
        args.steps = 20
    print(f'# {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}')
    if args.part in ('all', 'resnet'):
        step, cost = overhead(args)
        restart = recovery(args)
        how_often(step, cost, restart, args.mtbf)
    if args.part in ('all', 'sharded'):
        sharded(args)


if __name__ == '__main__':
    main()
