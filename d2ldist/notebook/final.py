"""What a finished ``%launch`` leaves in the notebook: a text summary and one figure.

The live dashboard (``dashboard.py``) needs a kernel and ipywidgets, which most
readers of a chapter lack. So when a job ends, the magic shows its final form as plain
outputs every viewer shows: ``summary()``, a text table of the processes, the attempts
of a restarted job, the last reports and the time per step, and ``figure()``, a PNG of
the curves and the time per step (matplotlib, Agg; none when the workers never
reported). What is measured stands only in the last two tables, in a form
``notebooks/sanitize.cfg`` masks, so nbval compares the rest.

A summary, printed: docs/design/notebook.md, "What a finished job leaves".
"""

from ..launch.progress import bar
from . import images

METRICS = (('loss', 'loss', '{:.4f}'), ('acc', 'train acc', '{:.3f}'),
           ('test_acc', 'test acc', '{:.3f}'))
CELL = 10                    # characters per worker column


def header(model):
    """One line that stays: '%launch -n 2 -s 2 train.py: scheduler, 2 servers, 2 workers'."""
    roles = [r.role for r in model.rows.values()]
    parts = [_count(roles.count(role), role) for role in ('scheduler', 'server', 'worker')
             if role in roles]
    hosts = sorted({r.host for r in model.rows.values()})
    where = f' on {_count(len(hosts), "host")}' if hosts != ['localhost'] else ''
    return f'{model.title}: {", ".join(parts)}{where}'


def _count(n, what):
    return what if n == 1 and what == 'scheduler' else f'{n} {what}' + ('s' if n != 1 else '')


def summary(model):
    """The finished job as text: its processes, its attempts (if it was restarted), each
    worker's last report, its step times."""
    parts = [f'job {model.status()}\n' + process_table(model)]
    for table in (attempts_table(model), metrics_table(model), steps_table(model)):
        if table:
            parts.append(table)
    return '\n\n'.join(parts)


def process_table(model):
    """Every process: host, state, exit code, and how far it got (if it reported)."""
    rows = list(model.rows.values())
    progress = {r.label: _progress(r) for r in rows}
    lines = [['process', 'host', 'state', 'exit'] + (['progress'] if any(progress.values()) else [])]
    for r in rows:
        lines.append([r.label, r.host, r.state, '' if r.code is None else str(r.code),
                      progress[r.label]])
    widths = [max(len(line[i]) for line in lines) for i in range(4)]
    return '\n'.join(('  ' + '  '.join(c.ljust(w) for c, w in zip(line, widths))
                      + '  ' + ''.join(line[4:])).rstrip() for line in lines)


def _progress(row):
    """'|██████████| 100% epoch 2/2, batch 47/47', or '' before any epoch or batch."""
    m, parts = row.metrics, []
    for name, of in (('epoch', 'num_epochs'), ('batch', 'num_batches')):
        if name in m:
            total = m.get(of)
            parts.append(f'{name} {m[name]}' + (f'/{total}' if total else ''))
    done = row.done
    prefix = bar(done, width=10, ends='||', full='█', empty=' ') + ' ' if done is not None else ''
    return prefix + ', '.join(parts) if parts else ''


def attempts_table(model):
    """Each attempt of a restarted job: when it started, where it resumed, how it ended."""
    if len(model.attempts) < 2:
        return ''
    return '\n'.join('  ' + a.describe(model.started) for a in model.attempts)


def metrics_table(model):
    """Each worker's last loss, accuracies and samples/s: a column a worker."""
    workers = model.workers
    rows = [(title, [fmt.format(w.metrics[k]) if k in w.metrics else '-' for w in workers])
            for k, title, fmt in METRICS if any(k in w.metrics for w in workers)]
    if any(w.rate is not None for w in workers):
        rows.append(('samples/s', ['-' if w.rate is None else f'{w.rate:,.0f}' for w in workers]))
    return _table('last report', workers, rows)


def steps_table(model):
    """Each worker's milliseconds per batch in each step, in the order reported."""
    workers = [w for w in model.workers if w.metrics.get('step_times')]
    if not workers:
        return ''
    names = list(dict.fromkeys(n for w in workers for n in w.metrics['step_times']))
    rows = [(name, [_ms(w.metrics['step_times'][name]) if name in w.metrics['step_times']
                    else '-' for w in workers]) for name in names]
    return _table('time per batch', workers, rows)


def _ms(seconds):
    """'185.1 ms', '0.04 ms'."""
    ms = seconds * 1000
    return f'{ms:.1f} ms' if ms >= 1 or ms == 0 else f'{ms:.2f} ms'


def _table(title, workers, rows):
    """Rows of values under the workers' names, right-aligned ('' without rows)."""
    if not rows:
        return ''
    width = max(len(title), *(len(name) for name, _ in rows))
    cell = max(CELL, *(len(w.label) + 2 for w in workers))
    lines = [(title, [w.label for w in workers])] + rows
    return '\n'.join('  ' + name.ljust(width) + ''.join(v.rjust(cell) for v in values)
                     for name, values in lines)


# -- the figure ----------------------------------------------------------------------------
def panels(model):
    """Which panels the figure has: 'loss', 'accuracy', 'time per step' (those with data)."""
    points = [p for r in model.workers for p in r.history]
    found = []
    if any(p[1] is not None for p in points):
        found.append('loss')
    if any(p[2] is not None or p[3] is not None for p in points):
        found.append('accuracy')
    if any(r.metrics.get('step_times') for r in model.workers):
        found.append('time per step')
    return found


def caption(model):
    """The figure's words (its text/plain): 'loss, accuracy and time per step of each worker'."""
    names = panels(model)
    listed = ', '.join(names[:-1]) + ' and ' + names[-1] if len(names) > 1 else names[0]
    return f'{model.title}: {listed} of each worker'


def figure(model):
    """The curves and the time per step as PNG bytes (None if no worker reported any)."""
    names = panels(model)
    if not names:
        return None
    fig = _figure(3.2 * len(names), 2.5)
    axes = fig.subplots(1, len(names), squeeze=False)[0]
    draw = {'loss': _loss, 'accuracy': _accuracy, 'time per step': _steps}
    for ax, name in zip(axes, names):
        draw[name](ax, model.workers)
        ax.set_title(name, fontsize=9)
        ax.tick_params(labelsize=7)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    return _png(fig)


def _loss(ax, workers):
    for i, row in enumerate(workers):
        _curve(ax, row, 1, '-', f'C{i % 10}', row.label)
    _epochs(ax)


def _accuracy(ax, workers):
    for i, row in enumerate(workers):
        _curve(ax, row, 2, '-', f'C{i % 10}', f'{row.label} train')
        _curve(ax, row, 3, '--', f'C{i % 10}', f'{row.label} test', marker='.')
    _epochs(ax)


def _curve(ax, row, k, style, colour, label, marker=None):
    pts = [(p[0], p[k]) for p in row.history if p[k] is not None]
    if pts:
        ax.plot(*zip(*pts), style, color=colour, marker=marker, label=label)


def _epochs(ax):
    ax.set_xlabel('epoch', fontsize=8)
    ax.grid(alpha=0.3)


def _steps(ax, workers):
    """Milliseconds per batch in each step, one bar per worker."""
    workers = [r for r in workers if r.metrics.get('step_times')]
    names = list(dict.fromkeys(n for r in workers for n in r.metrics['step_times']))
    height = 0.8 / len(workers)
    for i, row in enumerate(workers):
        times = row.metrics['step_times']
        ax.barh([j + i * height for j in range(len(names))],
                [times.get(n, 0) * 1000 for n in names], height, color=f'C{i % 10}',
                label=row.label)
    ax.set_yticks([j + 0.4 - height / 2 for j in range(len(names))], names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel('ms per batch', fontsize=8)


def _figure(width, height):
    """A matplotlib figure drawn by Agg alone (no pyplot, no inline backend)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width, height), dpi=90)
    FigureCanvasAgg(fig)
    return fig


def _png(fig):
    fig.tight_layout()
    return images.png(fig)


# -- into the notebook ---------------------------------------------------------------------
def outputs(model, timeline=None):
    """The final form as display bundles: the summary, then the figure if there is one,
    then the last steps of the ``timeline`` file if one was written."""
    bundles = [{'text/plain': summary(model)}]
    try:
        png = figure(model)
        drawn = _timeline(timeline) if timeline and model.trace.count else None
    except ImportError:                   # no matplotlib: the text says it all
        png = drawn = None
    if png is not None:
        bundles.append({'image/png': png, 'text/plain': caption(model)})
    if drawn is not None:
        bundles.append({'image/png': drawn._repr_png_(), 'text/plain': repr(drawn)})
    return bundles


def _timeline(path):
    """The last steps of a timeline file, drawn (``d2ldist/timeline.py``); if the job
    restarted or lost a worker, every step recorded, to show what that cost."""
    from .timeline_view import JOB, load, plot
    spans = load(path)
    return plot(spans, steps=None if any(s.lane == JOB for s in spans) else 3)
