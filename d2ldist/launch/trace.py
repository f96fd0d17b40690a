"""The job's timeline: every process's spans merged into one Chrome trace-event file.

Each process prints its spans as ``@d2l/timeline {...}`` lines (``runtime/spans.py``).
The job model hands them here; ``Trace.write(path)`` makes the file Perfetto and
chrome://tracing open: one lane (a trace "process") per worker and server, a row in
it per thread (the training loop, the communication thread), times in microseconds
from the first span, on the scheduler's clock. The lines come from the job's
processes, over ssh too: they are parsed as JSON, and whatever is not a well-formed
span is dropped. Each restart of the job (``--max-restarts``) is an instant across all
lanes, named after the step it resumed from, at the launcher's time; so is each change
of an elastic job's processes (a worker lost, one started again: ``note``).
"""
import json
import math
import time

from ..lines import shown
from ..runtime.spans import PREFIX

MAX_SPANS = 1_000_000          # of the whole job; beyond it, lines are dropped
THREADS = {'MainThread': 'training', 'd2ldist-comm': 'communication'}   # (workers')


class Trace:
    """The spans of a job's processes, as they arrive."""

    def __init__(self):
        self.spans = {}           # process label -> [span dict]
        self.clock_error = {}     # process label -> microseconds
        self.count = 0
        self.marks = {}           # restart number (or a note's key) -> [unix us, name, cat]

    def on_line(self, label, line):
        """Take a timeline line of process ``label``; False if it is not one."""
        if not line.startswith(PREFIX):
            return False
        try:
            batch = json.loads(line[len(PREFIX):])
        except ValueError:
            return True
        if not isinstance(batch, dict) or not isinstance(batch.get('events'), list):
            return True
        if _number(batch.get('clock_error_us')):
            self.clock_error[label] = batch['clock_error_us']
        mine = self.spans.setdefault(label, [])
        for e in batch['events']:
            if self.count < MAX_SPANS and _well_formed(e):
                mine.append(e)
                self.count += 1
        return True

    def mark(self, restart, name):
        """Mark restart number ``restart`` (now, the first time) with ``name``."""
        self.marks.setdefault(restart, [time.time() * 1e6, name, 'restart'])[1] = name

    def note(self, name):
        """Mark now with ``name``: an elastic job's processes changed ('worker 1 lost')."""
        self.marks[('note', len(self.marks))] = [time.time() * 1e6, name, 'change']

    def window(self):
        """(first, last) microsecond of the workers' spans: servers are cut to it."""
        ends = [(e['ts'], e['ts'] + e['dur']) for label, spans in self.spans.items()
                if label.startswith('worker') for e in spans]
        return (min(a for a, _ in ends), max(b for _, b in ends)) if ends else None

    def events(self):
        """The trace events: lanes named and ordered, times from the first span."""
        labels = sorted(self.spans, key=_lane_order)
        window = self.window()
        spans = {label: [e for e in self.spans[label] if window is None or
                         label.startswith('worker') or window[0] <= e['ts'] <= window[1]]
                 for label in labels}
        start = min([e['ts'] for s in spans.values() for e in s]
                    + [ts for ts, *_ in self.marks.values()], default=0.0)
        out = []
        for pid, label in enumerate(labels, 1):
            out.append({'ph': 'M', 'name': 'process_name', 'pid': pid, 'tid': 0,
                        'args': {'name': shown(label)}})
            out.append({'ph': 'M', 'name': 'process_sort_index', 'pid': pid, 'tid': 0,
                        'args': {'sort_index': pid}})
            tids = {}
            for e in spans[label]:
                tid = tids.setdefault(e['tid'], len(tids) + 1)
                out.append({'name': e['name'], 'cat': e['cat'], 'ph': 'X', 'pid': pid,
                            'tid': tid, 'ts': round(e['ts'] - start, 1), 'dur': e['dur'],
                            'args': e['args']})
            for thread, tid in tids.items():
                name = 'serving' if label.startswith('server') else THREADS.get(thread, thread)
                out.append({'ph': 'M', 'name': 'thread_name', 'pid': pid, 'tid': tid,
                            'args': {'name': name}})
        for ts, name, cat in self.marks.values():  # global instants: a line across all lanes
            out.append({'name': name, 'cat': cat, 'ph': 'i', 's': 'g', 'pid': 0,
                        'tid': 0, 'ts': round(ts - start, 1)})
        return out, start

    def write(self, path):
        """Write the Chrome trace-event JSON file; returns the number of spans."""
        events, start = self.events()
        data = {'traceEvents': events, 'displayTimeUnit': 'ms', 'otherData': {
            'clock': "the scheduler's (each process's offset measured when it joined)",
            'start_unix_us': start, 'clock_error_us': self.clock_error}}
        with open(path, 'w') as f:
            json.dump(data, f, separators=(',', ':'))
        return sum(e['ph'] == 'X' for e in events)


def _number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _well_formed(e):
    """A span as runtime/spans.py makes it: names, finite times, simple arguments."""
    return (isinstance(e, dict) and isinstance(e.get('name'), str)
            and isinstance(e.get('cat'), str) and isinstance(e.get('tid'), str)
            and _number(e.get('ts')) and _number(e.get('dur')) and e['dur'] >= 0
            and isinstance(e.get('args'), dict) and len(e['name']) <= 200
            and all(isinstance(v, (str, int, float, bool, type(None)))
                    for v in e['args'].values()))


def _lane_order(label):
    """Workers first, then servers, each by rank ('worker 1')."""
    role, _, rank = label.partition(' ')
    return (role != 'worker', role, int(rank) if rank.isdigit() else 0)
