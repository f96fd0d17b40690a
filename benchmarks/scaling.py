"""The scaling study: parameter servers and the ring on a simulated network.

    python benchmarks/scaling.py                    # ResNet-18 gradients, 1 Gbit/s, m = 2, 4, 8
    python benchmarks/scaling.py --quick            # 1/8 of the size, 250 Mbit/s, m = 2, 4
    python benchmarks/scaling.py --bandwidth 10Gbit --latency 50us --png out.png

Every process's outgoing link is paced to ``--bandwidth`` (d2l-launch --bandwidth, see
d2ldist/runtime/pacing.py). For m workers it times one synchronous step of communication
(what each worker runs: d2ldist/testing/comm_step.py, which the tests measure with too):

* ``PS n=1``, ``PS n=m/2``, ``PS n=m``: kv.pushpull of the 62 gradient tensors
  (dist_sync; the servers only sum) with 1, m/2 and m servers;
* ``ring``: d2ldist's ring all-reduce of the same bytes as one fused buffer;
* ``gloo``: torch.distributed's gloo all_reduce of that buffer, in the ring's job,
  NOT shaped (gloo has its own sockets): the reference of an unshaped machine.

One job per (m, n); the ring and gloo run in the n = m job (its servers sit idle).

The model is the book's one cost model, ``d2ldist/cost.py`` (M bytes, B per outgoing
link, alpha a message): PS ``(1 + m/n) M/B + 2 alpha`` with even shares (``ps_time_placed``
uses the real placement), ring ``2(N-1) (M/(N B) + alpha)``.

Scaling efficiency (as in the Horovod paper) needs a compute time: each step computes
for ``--compute-ms`` and then communicates (no overlap), so
efficiency = compute / (compute + comm) and throughput = m batch / (compute + comm).
"""
import argparse
import os
import sys

from common import launch   # benchmarks/common.py
from d2ldist import config, cost    # (light: no torch)
from d2ldist.kv.placement import DEFAULT_BIGARRAY_BOUND
from d2ldist.runtime import pacing
from d2ldist.testing.comm_step import resnet18_shapes, summarize, worker_argv

BIGARRAY_BOUND = DEFAULT_BIGARRAY_BOUND   # MXNet's: a value this big is split over all servers


# -- outside: start the jobs ------------------------------------------------------------------
def run_job(m, n, mode, args):
    """Run one job; {method: median over steps of the slowest worker's time}."""
    bound = max(1, BIGARRAY_BOUND // args.scale)
    options = ['-n', m, '-s', n, '--bandwidth', args.bandwidth, '--timeout', args.job_timeout,
               '--env', f'D2L_KVSTORE_BIGARRAY_BOUND={bound}']
    if args.latency:
        options += ['--latency', args.latency]
    r = launch(options, worker_argv(mode, args.scale, args.steps, args.warmup),
               timeout=args.job_timeout + 30)
    if r.returncode != 0:
        raise RuntimeError(f'job {m} workers x {n} servers ({mode}) failed:\n'
                           f'{r.stdout[-3000:]}{r.stderr[-2000:]}')
    return summarize(r.stdout, m, args.steps)


def measure(args, log=print):
    """Every configuration of the study: a list of result rows (dicts)."""
    rate = config.parse_bandwidth(args.bandwidth)
    latency = config.parse_latency(args.latency) if args.latency else 0.0
    shapes = resnet18_shapes(args.scale)
    nbytes = 4 * sum(cost.numel(s) for s in shapes)
    bound = max(1, BIGARRAY_BOUND // args.scale)
    rows, wanted = [], set(args.only or ('ps', 'ring'))
    for m in args.workers:
        chosen = {{'1': 1, 'm/2': max(1, m // 2), 'm': m}[c] for c in args.servers}
        for n in sorted(chosen | {m}):           # the ring runs in the n = m job
            ps = 'ps' in wanted and n in chosen
            ring = 'ring' in wanted and n == m
            if not (ps or ring):
                continue
            mode = 'both' if ps and ring else 'ps' if ps else 'ring'
            got = run_job(m, n if mode != 'ring' else 0, mode, args)
            for method, t in got.items():
                label = {'ps': f'PS n={n}', 'ring': 'ring', 'gloo': 'gloo (unshaped)'}[method]
                kinds = [label] if method != 'ps' else \
                    [k for k, size in (('PS n=1', 1), ('PS n=m/2', max(1, m // 2)),
                                       ('PS n=m', m)) if size == n]
                model = cost.ps_time_placed(shapes, m, n, rate, latency, bound) \
                    if method == 'ps' else \
                    cost.ring_time(nbytes, m, rate, latency) if method == 'ring' else None
                row = dict(workers=m, servers=n, method=label, kinds=kinds, comm=t, model=model,
                           bytes=nbytes)
                row['efficiency'] = args.compute_ms / (args.compute_ms + 1e3 * t)
                row['throughput'] = m * args.batch_size / (args.compute_ms / 1e3 + t)
                rows.append(row)
                log(format_row(row))
    return rows


def header():
    return (f'{"workers":>7} {"method":<16} {"comm ms":>9} {"model ms":>9} {"ratio":>6} '
            f'{"efficiency":>10} {"img/s":>8}')


def format_row(r):
    model = f'{r["model"] * 1e3:9.1f}' if r['model'] else f'{"-":>9}'
    ratio = f'{r["comm"] / r["model"]:6.2f}' if r['model'] else f'{"-":>6}'
    return (f'{r["workers"]:>7} {r["method"]:<16} {r["comm"] * 1e3:9.1f} {model} {ratio} '
            f'{r["efficiency"]:>9.0%} {r["throughput"]:8.0f}')


# -- the plot ---------------------------------------------------------------------------------
KINDS = ['PS n=1', 'PS n=m/2', 'PS n=m', 'ring', 'gloo (unshaped)']   # n=1 is m/2 for m=2
COLORS = {'PS n=1': '#d62728', 'PS n=m/2': '#ff7f0e', 'PS n=m': '#2ca02c',
          'ring': '#1f77b4', 'gloo (unshaped)': '#7f7f7f'}


def plot(rows, title='', path=None):
    """Bars: throughput; lines: scaling efficiency (as in the Horovod paper). Right:
    communication time per step, measured (points) and the model's (dashed)."""
    import matplotlib
    if path is not None:
        matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    ms = sorted({r['workers'] for r in rows})
    kinds = [k for k in KINDS if any(k in r['kinds'] for r in rows)]
    fig, (ax, ax_t) = plt.subplots(1, 2, figsize=(11, 4.2))
    eff = ax.twinx()
    width = 0.8 / len(kinds)
    for i, k in enumerate(kinds):
        xs, tp, ef, model_t, xs_t, comm = [], [], [], [], [], []
        for j, m in enumerate(ms):
            r = next((r for r in rows if r['workers'] == m and k in r['kinds']), None)
            if r is None:
                continue
            xs.append(j + (i - (len(kinds) - 1) / 2) * width)
            tp.append(r['throughput'])
            ef.append(r['efficiency'])
            xs_t.append(m)
            comm.append(r['comm'] * 1e3)
            model_t.append(r['model'] * 1e3 if r['model'] else None)
        hatch = '//' if 'gloo' in k else None
        ax.bar(xs, tp, width, color=COLORS[k], alpha=0.6, hatch=hatch, label=k)
        eff.plot(xs, ef, 'o-', color=COLORS[k])
        ax_t.plot(xs_t, comm, 'o-', color=COLORS[k], label=k)
        if all(v is not None for v in model_t):
            ax_t.plot(xs_t, model_t, '--', color=COLORS[k], alpha=0.7)
    ax.set_xticks(range(len(ms)), [f'{m} workers' for m in ms])
    ax.set_ylabel('throughput (images/s, bars)')
    eff.set_ylabel('scaling efficiency (lines)')
    eff.set_ylim(0, 1.05)
    eff.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.legend(loc='upper left', fontsize=8)
    ax.set_title('throughput and efficiency')
    ax_t.set_xlabel('workers m')
    ax_t.set_xticks(ms)
    ax_t.set_ylabel('communication per step (ms)')
    ax_t.set_title('measured (points) and model (dashed)')
    ax_t.set_ylim(bottom=0)
    ax_t.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
        plt.close(fig)
    return fig


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--quick', action='store_true',
                   help='1/8 of ResNet-18, 250 Mbit/s, 2 and 4 workers (about a minute)')
    p.add_argument('--bandwidth', default=None, help='each link (default 1Gbit)')
    p.add_argument('--latency', default=None, help='each link (default none)')
    p.add_argument('-n', '--workers', default=None, help='worker counts (default 2,4,8)')
    p.add_argument('--scale', type=int, default=None, help='divide the channels by this')
    p.add_argument('--steps', type=int, default=None, help='timed steps per job (default 5)')
    p.add_argument('--warmup', type=int, default=1, help='untimed steps first')
    p.add_argument('--only', default=None, help='ps or ring: run only those jobs')
    p.add_argument('--servers', default='1,m/2,m',
                   help='server counts for the parameter server (default 1,m/2,m)')
    p.add_argument('--compute-ms', type=float, default=200.0,
                   help='compute time of a step, for efficiency and throughput (default 200: '
                   'ResNet-18 with batch 128 on one modern GPU, roughly)')
    p.add_argument('--batch-size', type=int, default=128, help='per worker, for throughput')
    p.add_argument('--png', default='scaling.png', help='where to draw the plot')
    p.add_argument('--job-timeout', type=float, default=600)
    args = p.parse_args(argv)
    args.bandwidth = args.bandwidth or ('250Mbit' if args.quick else '1Gbit')
    args.scale = args.scale or (8 if args.quick else 1)
    args.steps = args.steps or (3 if args.quick else 5)
    args.workers = [int(w) for w in (args.workers or ('2,4' if args.quick else '2,4,8'))
                    .split(',')]
    args.only = args.only.split(',') if args.only else None
    args.servers = args.servers.split(',')
    if not set(args.servers) <= {'1', 'm/2', 'm'}:
        p.error(f'--servers takes 1, m/2 and m, got {",".join(args.servers)}')
    return args


def main(argv=None):
    args = parse(argv)
    try:
        rate = config.parse_bandwidth(args.bandwidth)
        if args.latency:
            config.parse_latency(args.latency)
    except ValueError as e:
        sys.exit(f'scaling.py: error: {e}')
    nbytes = 4 * sum(cost.numel(s) for s in resnet18_shapes(args.scale))
    title = (f'{len(resnet18_shapes(args.scale))} tensors, {nbytes / 1e6:.1f} MB of gradients, '
             f'{pacing.describe(rate, config.parse_latency(args.latency or "0"))} per link')
    print(f'# {title}; compute {args.compute_ms:g} ms/step, batch {args.batch_size}; '
          f'{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}')
    print(header())
    rows = measure(args)
    plot(rows, title, args.png)
    print(f'# plot: {args.png}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
