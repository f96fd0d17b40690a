"""Reading a job's timeline: ``d2l-launch --timeline FILE`` (or ``%launch --timeline FILE``).

``d2ldist.timeline`` gives these names:

    tl = d2ldist.timeline.load('timeline.json')
    d2ldist.timeline.plot(tl, steps=3)         # the last 3 steps of every lane
    d2ldist.timeline.breakdown(tl, steps=3)    # seconds per category, per lane

The file is a Chrome trace (open it in Perfetto or chrome://tracing too): one lane per
worker and server (``launch/trace.py`` writes it, ``runtime/spans.py`` records
it). Categories: ``step`` (the seven steps, or a Horovod script's compute, synchronize
and update), ``comm`` (a collective, a push or a pull), ``wait`` (for a ring neighbour,
the servers' sync round, a barrier), ``data`` (between two steps: the next batch, a
report, an epoch's evaluation) and ``server`` (a request a server handles). A job's
instants, a restart or an elastic change ('worker 1 lost'), are spans of no duration in
the lane ``job`` (categories ``restart`` and ``change``), drawn as lines across all lanes.
"""
import json
from dataclasses import dataclass

from . import images

COLOURS = {'step': '#1976d2', 'comm': '#2e7d32', 'wait': '#c62828', 'data': '#9e9e9e',
           'server': '#ef6c00'}
JOB = 'job'                # the lane of the job's instants: restarts, elastic changes


@dataclass
class Span:
    lane: str        # 'worker 0 training', 'server 1 serving', ...
    name: str
    cat: str
    start: float     # seconds from the start of the file
    dur: float
    step: int
    args: dict


def load(source):
    """The spans of a timeline file (a path, or the dict already read), by start."""
    data = source if isinstance(source, dict) else json.load(open(source))
    names, threads = {}, {}
    for e in data['traceEvents']:
        if e.get('ph') == 'M' and e['name'] == 'process_name':
            names[e['pid']] = e['args']['name']
        elif e.get('ph') == 'M' and e['name'] == 'thread_name':
            threads[e['pid'], e['tid']] = e['args']['name']
    spans = [Span(f"{names[e['pid']]} {threads.get((e['pid'], e['tid']), e['tid'])}",
                  e['name'], e['cat'], e['ts'] / 1e6, e['dur'] / 1e6,
                  int(e['args'].get('step', 0)), e['args'])
             for e in data['traceEvents'] if e.get('ph') == 'X']
    spans += [Span(JOB, e['name'], e['cat'], e['ts'] / 1e6, 0.0, 0, {})
              for e in data['traceEvents'] if e.get('ph') == 'i']
    return sorted(spans, key=lambda s: s.start)


def last_steps(spans, steps):
    """The spans of every lane during the workers' last ``steps`` steps (all if None;
    a pair (first, last): from the first step to the last)."""
    spans = load(spans) if not isinstance(spans, list) else spans
    done = sorted({s.step for s in spans if s.cat == 'step'})
    if steps is None or not done:
        return spans
    chosen = set(range(steps[0], steps[1] + 1)) if isinstance(steps, tuple) \
        else set(done[-steps:])
    mine = [s for s in spans if s.cat == 'step' and s.step in chosen]
    if not mine:
        raise ValueError(f'no step {steps[0]} to {steps[1]} in the timeline: it has steps '
                         f'{done[0]} to {done[-1]}')
    t0, t1 = min(s.start for s in mine), max(s.start + s.dur for s in mine)
    return [s for s in spans if s.start + s.dur > t0 and s.start < t1]


def breakdown(spans, steps=None):
    """{lane: {category: seconds}} over the last ``steps`` steps (a wait inside a
    collective counts in both)."""
    table = {}
    for s in last_steps(spans, steps):
        if s.lane == JOB:
            continue
        lane = table.setdefault(s.lane, {})
        lane[s.cat] = lane.get(s.cat, 0.0) + s.dur
    return table


class Plot:
    """A drawn timeline: shows as a PNG in a notebook, and its caption as text."""

    def __init__(self, figure, caption):
        self.figure, self.caption = figure, caption

    def _repr_png_(self):
        return images.png(self.figure)

    def __repr__(self):
        return self.caption


def plot(spans, steps=3, width=10):
    """Draw every lane's spans in the last ``steps`` steps (or steps (first, last)): one
    row per lane, nested spans thinner on top of the span they are in, waits in red;
    the job's instants (a restart, a worker lost) a dashed line across, named."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    spans = last_steps(spans, steps)
    marks, spans = [s for s in spans if s.lane == JOB], [s for s in spans if s.lane != JOB]
    lanes = list(dict.fromkeys(s.lane for s in sorted(spans, key=_lane_key)))
    fig = Figure(figsize=(width, 0.45 * len(lanes) + 1.2), dpi=90)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    t0 = min((s.start for s in spans), default=0.0)
    for row, lane in enumerate(lanes):
        for s, depth in _depths([s for s in spans if s.lane == lane]):
            height = 0.8 * 0.6 ** depth
            ax.broken_barh([((s.start - t0) * 1e3, s.dur * 1e3)], (row - height / 2, height),
                           color=COLOURS.get(s.cat, '#607d8b'), alpha=0.85 if depth else 0.6,
                           edgecolor='white', linewidth=0.3)
    for m in marks:
        x = (m.start - t0) * 1e3
        ax.axvline(x, color='#424242', linestyle='--', linewidth=0.8)
        ax.annotate(m.name, (x, -0.5), xytext=(3, 2), textcoords='offset points',
                    fontsize=7, va='bottom', annotation_clip=False)
    ax.set_yticks(range(len(lanes)), lanes, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel('ms', fontsize=8)
    ax.tick_params(labelsize=7)
    cats = [c for c in COLOURS if any(s.cat == c for s in spans)]
    ax.legend(handles=[Patch(color=COLOURS[c], label=c) for c in cats], fontsize=7,
              ncol=len(cats), loc='upper center', bbox_to_anchor=(0.5, -0.18 if lanes else 0))
    fig.tight_layout()
    which = f'steps {steps[0]} to {steps[1]}' if isinstance(steps, tuple) else \
        'every step recorded' if steps is None else f'the last {steps} steps'
    caption = (f'timeline: {len(lanes)} lanes, {which}; steps blue, communication green, '
               'waiting red' + ''.join(f'; {m.name} (dashed)' for m in marks))
    return Plot(fig, caption)


def _depths(spans):
    """Each span with how deeply it is nested in the others of its lane."""
    open_ends, out = [], []
    for s in sorted(spans, key=lambda s: (s.start, -s.dur)):
        while open_ends and open_ends[-1] <= s.start:
            open_ends.pop()
        out.append((s, len(open_ends)))
        open_ends.append(s.start + s.dur)
    return out


def _lane_key(s):
    """Workers first, then servers, by rank; the training thread before the others."""
    role, rank, *thread = s.lane.split()
    return role != 'worker', int(rank) if rank.isdigit() else 0, thread != ['training']
