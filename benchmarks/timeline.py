"""What recording a timeline costs: training throughput with and without --timeline.

    python benchmarks/timeline.py              # ResNet-18 (width 16), 2 workers, 2 servers
    python benchmarks/timeline.py --quick

The recording is on or off for a whole process (d2l-launch --timeline sets it), so
this runs benchmarks/train_throughput.py's job twice per round, without and with
``--timeline`` (every step recorded: the most it can cost), alternating, so that
both see the same load. Each job trains with the Trainer on dist_sync and on the
ring, and with torch's DDP on gloo, taking turns: DDP records no spans, so its own
change between the two jobs is the noise floor of the measurement. The table gives
images/s of each, the change the timeline makes, and the ratio to DDP in the same
job. The target: at most 3 % fewer images/s with the timeline on.

Measured on this 2-core machine, --rounds 3 (other work running now and then):

      kind  images/s    traced   change   vs DDP  traced vs DDP
 dist_sync     946.7     983.9     3.9%    0.95x          1.02x
      ring    1034.5    1016.8    -1.7%    1.04x          1.05x
       ddp     996.4     963.9    -3.3%    1.00x          1.00x

The changes are within the noise (DDP's own, untraced, is 3.3 %). Where the cost is:
a span takes 3 us to record and 1.4 us to print (timeline.py, measured alone); a
step of this job records about 25 in a worker (1,122 spans for 2 x 2 processes and
~20 steps), 0.1 ms against a step of about 65 ms: 0.2 %.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from common import launch, worker_command   # benchmarks/common.py

KINDS = ('dist_sync', 'ring', 'ddp')
JOB = Path(__file__).with_name('train_throughput.py')


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--quick', action='store_true', help='fewer rounds and steps')
    p.add_argument('--rounds', type=int, default=4, help='pairs of jobs (without, with)')
    p.add_argument('--steps', type=int, default=8, help='timed steps per turn in a job')
    p.add_argument('--width', type=int, default=16, help="ResNet-18's first stage")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 2, 4
    return args


def run_job(args, timeline=None):
    """One job of train_throughput.py; its images/s by kind (and the timeline's size)."""
    options = ['-n', 2, '-s', 2] + (['--timeline', timeline] if timeline else [])
    command = worker_command(JOB, ['--width', args.width, '--steps', args.steps,
                                   '--rounds', 2])
    proc = launch(options, command, timeout=900)
    for line in proc.stdout.splitlines():
        if line.startswith('[worker 0] RESULT '):
            return json.loads(line[len('[worker 0] RESULT '):])['images_per_s']
    sys.exit(f'the job failed:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}')


def main(argv=None):
    args = parse(argv)
    runs = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / 'timeline.json'
        for _ in range(args.rounds):
            for traced in (False, True):
                runs[traced].append(run_job(args, path if traced else None))
        size, spans = path.stat().st_size, sum(
            e['ph'] == 'X' for e in json.loads(path.read_text())['traceEvents'])
    median = {traced: {k: statistics.median(r[k] for r in runs[traced]) for k in KINDS}
              for traced in runs}
    print(f'# the timeline\'s cost: ResNet-18 (width {args.width}), batch 32 per worker, '
          f'2 workers, 2 servers; {os.cpu_count()} CPUs; {args.rounds} pairs of jobs, '
          f'medians; one traced job wrote {spans} spans ({size / 1e3:.0f} kB)')
    print(f'{"kind":>10}{"images/s":>10}{"traced":>10}{"change":>9}{"vs DDP":>9}'
          f'{"traced vs DDP":>15}')
    for k in KINDS:
        off, on = median[False][k], median[True][k]
        print(f'{k:>10}{off:>10.1f}{on:>10.1f}{(on / off - 1) * 100:>8.1f}%'
              f'{off / median[False]["ddp"]:>8.2f}x{on / median[True]["ddp"]:>14.2f}x')
    print('target: with the timeline, dist_sync and ring lose at most 3 % of images/s '
          '(ddp records nothing: its change is the noise)')
    return 0


if __name__ == '__main__':
    sys.exit(main())
