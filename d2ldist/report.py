"""Progress reports from a worker: one versioned line on stdout per report.

A worker calls ``d2ldist.report(epoch=1, num_epochs=5, batch=20, num_batches=98,
loss=1.52, acc=0.44)``. That prints one line::

    @d2l/1 {"epoch": 1, "num_epochs": 5, "batch": 20, "num_batches": 98, ...}

on the worker's stdout, which the launcher reads anyway: ``d2l-launch`` turns it into
a progress line, ``%launch`` into the dashboard's bars and curves (``parse_report``
reads it back). The protocol, version 1, field by field, and how a reader treats what
it does not know: docs/design/launch.md, "Progress reports".
"""
import json
import math
import sys
import time

from . import config
from .lines import clip

PREFIX = '@d2l/1 '
FIELDS = {'epoch': int, 'num_epochs': int, 'batch': int, 'num_batches': int,
          'loss': float, 'acc': float, 'test_acc': float, 'samples': int,
          'step_times': dict, 'time': float, 'waiting': str, 'step': int,
          'resumed_from': int}
MAX_LINE = 1 << 16


def report(**metrics: object) -> None:
    """Report this worker's progress to the launcher (one line on stdout)."""
    unknown = set(metrics) - set(FIELDS)
    if unknown:
        raise TypeError(f'report() got unknown fields: {", ".join(sorted(unknown))}')
    record = _clean({k: v for k, v in metrics.items() if v is not None})
    record['time'] = round(time.time(), 3)
    if config.get().role is not None:         # under the launcher: the protocol line
        line = PREFIX + json.dumps(record, separators=(',', ':'))
    elif set(record) <= {'step', 'time'}:     # alone, a bare step count tells nobody
        return
    else:                                     # alone: something a person can read
        line = format_progress(record)
    sys.stdout.write(line + '\n')
    sys.stdout.flush()


def parse_report(line):
    """The fields of a report line as a dict, or None if ``line`` is not one."""
    if not isinstance(line, str) or not line.startswith(PREFIX) or len(line) > MAX_LINE:
        return None
    try:
        record = json.loads(line[len(PREFIX):])
    except ValueError:
        return None
    return _clean(record) if isinstance(record, dict) else None


def _clean(record):
    """Only the known fields with values of the right type (numbers finite)."""
    clean = {}
    for name, kind in FIELDS.items():
        value = record.get(name)
        if kind is dict:
            value = _steps(value)
        elif kind is str:
            value = clip(value, 500) if isinstance(value, str) else None
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            value = None
        elif kind is int:
            value = int(value) if float(value).is_integer() else None
        elif not math.isfinite(value):
            value = None
        else:
            value = float(value)
        if value is not None:
            clean[name] = value
    return clean


def _steps(value):
    """step_times as {name: seconds}; a plain list gets the names 'step 1', 'step 2', ..."""
    if isinstance(value, (list, tuple)):
        value = {f'step {i}': t for i, t in enumerate(value, 1)}
    if not isinstance(value, dict):
        return None
    steps = {clip(k, 40): float(t) for k, t in list(value.items())[:16]
             if isinstance(t, (int, float)) and not isinstance(t, bool)
             and math.isfinite(t) and t >= 0}
    return steps or None


def fraction_done(r):
    """How far the run is, 0 .. 1, from epoch and batch (None if unknown)."""
    epochs, batches = r.get('num_epochs'), r.get('num_batches')
    if not epochs or 'epoch' not in r:
        return None
    within = r.get('batch', 0) / batches if batches else 1.0
    return min(1.0, max(0.0, (r['epoch'] - 1 + min(within, 1.0)) / epochs))


def format_progress(r, rate=None):
    """One compact line: 'epoch 2/5 batch 40/98 loss 0.812 acc 0.713 1530 samples/s'."""
    parts = []
    if 'epoch' in r:
        parts.append(f"epoch {r['epoch']}" + (f"/{r['num_epochs']}" if 'num_epochs' in r else ''))
    if 'batch' in r:
        parts.append(f"batch {r['batch']}" + (f"/{r['num_batches']}" if 'num_batches' in r else ''))
    if 'resumed_from' in r:
        parts.append(f"resumed from the checkpoint of step {r['resumed_from']}")
    elif 'step' in r and 'epoch' not in r:          # (with an epoch and batch: redundant)
        parts.append(f"step {r['step']}")
    for name in ('loss', 'acc', 'test_acc'):
        if name in r:
            parts.append(f'{name} {r[name]:.3f}')
    if rate is not None:
        parts.append(f'{rate:.0f} samples/s')
    if r.get('waiting'):
        parts.append('-- waiting too long (see its log line)')
    return ' '.join(parts) or 'progress'


class Rate:
    """Samples per second from a cumulative count, smoothed over the last reports."""

    def __init__(self, window=5.0):
        self.window, self.points = window, []

    def add(self, now, samples):
        """Add a (time, samples) point; return the current rate or None."""
        if self.points and samples < self.points[-1][1]:
            self.points = []                  # the count restarted
        self.points.append((now, samples))
        while len(self.points) > 2 and now - self.points[1][0] >= self.window:
            self.points.pop(0)
        (t0, s0), (t1, s1) = self.points[0], self.points[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else None
