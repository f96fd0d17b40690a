"""The live view of a job in a notebook: one row per process, curves, step times, the log.

Two layers, so the logic can be tested without a browser:

* ``JobModel`` holds what we know: each process's state and exit code, each
  worker's latest report and its history, the merged log. The launcher's hooks
  feed it (``set_state``, ``add_report``, ``add_log``); it renders itself as text.
* ``Dashboard`` shows a model with ipywidgets. It is displayed once, when the cell
  starts, and afterwards only its widgets' values change (no ``clear_output``, no
  output capture, no display updates), at most every ``rows_every`` seconds for the
  rows and every ``plots_every`` seconds for the matplotlib curves, so that drawing
  never slows the job down. Front ends without widgets show its text form instead.
"""
import html
import io
import time
from dataclasses import dataclass, field

from .report import Rate, format_progress, fraction_done

FINAL = ('finished', 'failed', 'stopped')
COLOURS = {'starting': '#757575', 'running': '#1976d2', 'finished': '#2e7d32',
           'failed': '#c62828', 'stopped': '#ef6c00'}
BAR_STYLES = {'starting': 'info', 'running': 'info', 'finished': 'success',
              'failed': 'danger', 'stopped': 'warning'}
MAX_POINTS = 1000           # history points kept per worker (halved when full)


class Throttle:
    """Let an action through at most once every ``interval`` seconds."""

    def __init__(self, interval, clock=time.monotonic):
        self.interval, self.clock, self.last = interval, clock, None

    def ready(self, force=False):
        now = self.clock()
        if force or self.last is None or now - self.last >= self.interval:
            self.last = now
            return True
        return False


@dataclass
class Row:
    """One process of the job, as the dashboard shows it."""
    label: str
    role: str
    rank: int
    host: str
    state: str = 'starting'
    code: int = None
    metrics: dict = field(default_factory=dict)   # the latest value of every field
    history: list = field(default_factory=list)   # (epochs done, loss, acc, test_acc)
    rate: float = None                            # samples per second
    reports: int = 0

    @property
    def done(self):
        """How far the worker is, 0 .. 1 (None before its first report)."""
        return fraction_done(self.metrics)


class JobModel:
    """What the dashboard shows, kept up to date by the launcher's hooks."""

    def __init__(self, specs, title='job', clock=time.monotonic):
        self.title, self.clock = title, clock
        self.rows = {s.label: Row(s.label, s.role, s.rank, s.host) for s in specs}
        self.log = []             # the merged log, as printed
        self.outcome = 'starting'
        self.message = ''
        self.started, self.ended = clock(), None
        self.version = 0          # bumped by every change: views redraw when it moves
        self.plot_version = 0     # bumped when a curve or step time changes
        self._rates = {}

    @property
    def workers(self):
        return [r for r in self.rows.values() if r.role == 'worker']

    def set_state(self, label, state, code=None):
        """A process changed state (or its exit code became known)."""
        row = self.rows[label]
        if row.state in FINAL and state != row.state:
            return False          # final states stay: a stopped process that exits is stopped
        row.state = state
        row.code = code if code is not None else row.code
        if self.outcome == 'starting' and state == 'running':
            self.outcome = 'running'
        self.version += 1
        return True

    def add_report(self, label, r):
        """A worker reported progress (a parsed report line)."""
        row = self.rows[label]
        row.metrics.update(r)
        row.reports += 1
        if 'samples' in r:
            row.rate = self._rates.setdefault(label, Rate()).add(r.get('time', self.clock()),
                                                                 r['samples'])
        if any(k in r for k in ('loss', 'acc', 'test_acc')):
            m = row.metrics
            x = (m.get('epoch', 1) - 1 + m.get('batch', 0) / m['num_batches']
                 if m.get('num_batches') else float(row.reports))
            row.history.append((x, r.get('loss'), r.get('acc'), r.get('test_acc')))
            if len(row.history) > MAX_POINTS:
                del row.history[::2]
            self.plot_version += 1
        if 'step_times' in r:
            self.plot_version += 1
        self.version += 1

    def add_log(self, text):
        """Lines the launcher printed (the workers' output and its own messages)."""
        self.log.extend(text.splitlines())
        self.version += 1

    def finish(self, outcome, message=''):
        """The job ended: 'finished', 'failed', 'stopped' or 'timeout'."""
        self.outcome, self.message, self.ended = outcome, message, self.clock()
        self.version += 1

    @property
    def elapsed(self):
        return (self.ended or self.clock()) - self.started

    def status(self):
        """'running, 3.2 s' or 'failed after 4.0 s: worker 1 failed (exit code 3)'."""
        if self.ended is None:
            return f'{self.outcome}, {self.elapsed:.1f} s'
        text = f'{self.outcome} after {self.elapsed:.1f} s'
        return f'{text}: {self.message}' if self.message else text

    def text(self):
        """The dashboard as text, for front ends without widgets."""
        lines = [f'{self.title}: {self.status()}']
        width = max(len(label) for label in self.rows)
        for row in self.rows.values():
            code = '' if row.code is None else f'exit {row.code}'
            line = f'  {row.label:<{width}}  {row.host:<10} {row.state:<9} {code:<8}'
            if row.role == 'worker' and row.reports:
                done = row.done
                if done is not None:
                    filled = round(done * 10)
                    line += f" |{'█' * filled}{' ' * (10 - filled)}| {done:4.0%}"
                line += ' ' + format_progress(row.metrics, row.rate)
            lines.append(line.rstrip())
        return '\n'.join(lines)

    __repr__ = text


# -- the widget view -----------------------------------------------------------------------
COLUMNS = ['process', 'host', 'state', 'exit', 'progress', '', 'samples/s', 'loss', 'acc']


class Dashboard:
    """The ipywidgets view of a ``JobModel``; call ``refresh()`` as often as you like."""

    def __init__(self, model, rows_every=0.25, plots_every=1.0, log_lines=8,
                 clock=time.monotonic):
        import ipywidgets as w
        self.model, self.log_lines, self.plots_every = model, log_lines, plots_every
        self.rows_throttle = Throttle(rows_every, clock)
        self.plots_throttle = Throttle(plots_every, clock)
        self.log_throttle = Throttle(2.0, clock)     # the full log can be long: not so often
        self._logged = None
        self.redraws = self.plot_redraws = 0
        self._seen, self._plotted = None, 0
        self.header = w.HTML()
        self.cells = {}
        grid = [w.HTML(f'<b>{c}</b>') for c in COLUMNS]
        for row in model.rows.values():
            cells = {name: w.HTML() for name in ('process', 'host', 'state', 'exit', 'detail',
                                                 'rate', 'loss', 'acc')}
            cells['process'].value = f'<b>{html.escape(row.label)}</b>'
            cells['host'].value = html.escape(row.host)
            if row.role == 'worker':
                cells['bar'] = w.FloatProgress(value=0, min=0, max=1, bar_style='info',
                                               layout=w.Layout(width='120px'))
            else:
                cells['bar'] = w.HTML()
            self.cells[row.label] = cells
            grid += [cells[n] for n in ('process', 'host', 'state', 'exit', 'bar', 'detail',
                                        'rate', 'loss', 'acc')]
        self.table = w.GridBox(grid, layout=w.Layout(
            grid_template_columns='repeat(4, max-content) 120px repeat(4, max-content)',
            grid_gap='0 10px', align_items='center', overflow='auto'))
        self.curves = w.Image(format='png', layout=w.Layout(display='none', max_width='100%'))
        self.steps = w.Image(format='png', layout=w.Layout(display='none', max_width='100%'))
        self.tail = w.HTML()
        self.full_log = w.HTML()
        self.log_box = w.Accordion([self.full_log], selected_index=None)
        plots = w.HBox([self.curves, self.steps], layout=w.Layout(flex_flow='row wrap'))
        self.box = w.VBox([self.header, self.table, plots,
                           self.tail, self.log_box])
        self.box.add_class('d2l-dashboard')
        self.refresh(force=True)

    def refresh(self, force=False):
        """Show the model's changes, at most every ``rows_every`` s (plots: ``plots_every``)."""
        m = self.model
        if m.plot_version != self._plotted and self.plots_throttle.ready(force):
            self._plotted = m.plot_version        # plots first: the final header comes last
            self.plot_redraws += 1
            self._draw_plots()
        if m.version != self._seen and self.rows_throttle.ready(force):
            self._seen = m.version
            self.redraws += 1
            self._draw_rows()
            if len(m.log) != self._logged and self.log_throttle.ready(force):
                self._logged = len(m.log)
                self.full_log.value = _pre(m.log[-2000:], 'd2l-log-full', scroll=True)
                self.log_box.set_title(0, f'full log ({len(m.log)} lines)')

    def _draw_rows(self):
        m = self.model
        colour = COLOURS.get(m.outcome, COLOURS['failed'])
        self.header.value = (f'<b>{html.escape(m.title)}</b> &nbsp; <span style="color:'
                             f'{colour}"><b>{html.escape(m.status())}</b></span>')
        for row in m.rows.values():
            c = self.cells[row.label]
            c['state'].value = (f'<span class="d2l-state-{row.state}" style="color:'
                                f'{COLOURS[row.state]}"><b>{row.state}</b></span>')
            c['exit'].value = '' if row.code is None else str(row.code)
            if row.role != 'worker':
                continue
            done = row.done
            c['bar'].value = done or 0.0
            c['bar'].bar_style = BAR_STYLES[row.state]
            r = row.metrics
            detail = []
            if 'epoch' in r:
                detail.append(f"epoch {r['epoch']}/{r.get('num_epochs', '?')}")
            if 'batch' in r:
                detail.append(f"batch {r['batch']}/{r.get('num_batches', '?')}")
            c['detail'].value = f"<span style='white-space:nowrap'>{' · '.join(detail)}</span>"
            c['rate'].value = '' if row.rate is None else f'{row.rate:,.0f}'
            c['loss'].value = f"{r['loss']:.4f}" if 'loss' in r else ''
            acc = [f"{r['acc']:.3f}"] if 'acc' in r else []
            if 'test_acc' in r:
                acc.append(f"test {r['test_acc']:.3f}")
            c['acc'].value = ' · '.join(acc)
        self.tail.value = _pre(m.log[-self.log_lines:], 'd2l-log-tail')

    def _draw_plots(self):
        start = time.perf_counter()
        curves = plot_curves(self.model)
        if curves:
            self.curves.value, self.curves.layout.display = curves, ''
        steps = plot_steps(self.model)
        if steps:
            self.steps.value, self.steps.layout.display = steps, ''
        took = time.perf_counter() - start   # drawing may take at most a tenth of the time
        self.plots_throttle.interval = max(self.plots_every, 10 * took)

    def _repr_mimebundle_(self, **kwargs):
        bundle = self.box._repr_mimebundle_(**kwargs)
        bundle['text/plain'] = self.model.text()
        return bundle

    def __repr__(self):
        return self.model.text()


def _pre(lines, cls, scroll=False):
    style = 'margin:0;font-size:12px;line-height:1.3;white-space:pre-wrap'
    if scroll:
        style += ';max-height:300px;overflow-y:auto'
    return f'<pre class="{cls}" style="{style}">' + html.escape('\n'.join(lines)) + '</pre>'


# -- the pictures -------------------------------------------------------------------------
def _figure(width, height):
    """A matplotlib figure drawn by Agg alone (no pyplot, no inline backend)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width, height), dpi=80)
    FigureCanvasAgg(fig)
    return fig


def _png(fig):
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format='png')
    return buf.getvalue()


def plot_curves(model):
    """Loss and accuracy per worker against epochs, as PNG bytes (None without data)."""
    workers = [r for r in model.workers if r.history]
    if not workers:
        return None
    fig = _figure(6.0, 2.4)
    loss_ax, acc_ax = fig.subplots(1, 2)
    for i, row in enumerate(workers):
        colour = f'C{i % 10}'
        for ax, k, style, name in ((loss_ax, 1, '-', 'loss'), (acc_ax, 2, '-', 'train'),
                                   (acc_ax, 3, '--', 'test')):
            pts = [(p[0], p[k]) for p in row.history if p[k] is not None]
            if pts:
                ax.plot(*zip(*pts), style, color=colour, marker='.' if k == 3 else None,
                        label=f'{row.label} {name}' if ax is acc_ax else row.label)
    for ax, name in ((loss_ax, 'loss'), (acc_ax, 'accuracy')):
        ax.set_xlabel('epoch')
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    return _png(fig)


def plot_steps(model):
    """Seconds per batch in each step, one bar per worker, as PNG bytes (None without data)."""
    workers = [r for r in model.workers if r.metrics.get('step_times')]
    if not workers:
        return None
    names = list(workers[0].metrics['step_times'])
    fig = _figure(4.0, 2.4)
    ax = fig.subplots()
    height = 0.8 / len(workers)
    for i, row in enumerate(workers):
        times = row.metrics['step_times']
        ys = [j + i * height for j in range(len(names))]
        ax.barh(ys, [times.get(n, 0) * 1000 for n in names], height, color=f'C{i % 10}',
                label=row.label)
    ax.set_yticks([j + 0.4 - height / 2 for j in range(len(names))], names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel('ms per batch')
    ax.set_title('time per step', fontsize=10)
    ax.legend(fontsize=7)
    return _png(fig)
