"""The live view of a job in a notebook: one row per process and the job's figure.

It is a view of the launcher's ``JobModel`` (``d2ldist/launch/progress.py``), the
model ``d2l-launch``'s terminal view reads too: the launcher's hooks feed the model
(each process's state and exit code, each worker's latest report, its history and
samples/s), and ``Dashboard`` shows it with ipywidgets. It is displayed once, when the
cell starts, and afterwards only its widgets' values change, at most every
``rows_every`` seconds for the rows and every ``plots_every`` seconds for the figure
(``final.figure``: curves and time per step), so that drawing never slows the job down.
The progress columns appear with a worker's first report: a script that never
reports shows only states and exit codes.

A job restarted (``--max-restarts``) shows its attempts under the header, one a line:
when each started, where it resumed (the workers' reports) and how it ended.

The log is not here: every line the processes print is in the cell's output below,
once. When the job ends, ``finish()`` replaces the dashboard by its one-line header
and closes its widgets, and the magic shows the job's final form (``final.py``).
"""
import html
import time

from ..launch.progress import Throttle
from .final import figure, header

COLOURS = {'starting': '#757575', 'running': '#1976d2', 'finished': '#2e7d32',
           'failed': '#c62828', 'stopped': '#ef6c00'}
BAR_STYLES = {'starting': 'info', 'running': 'info', 'finished': 'success',
              'failed': 'danger', 'stopped': 'warning'}
COLUMNS = ['process', 'host', 'state', 'exit']
REPORT_COLUMNS = ['progress', '', 'samples/s', 'loss', 'acc']


class Dashboard:
    """The ipywidgets view of a ``JobModel``; call ``refresh()`` as often as you like."""

    def __init__(self, model, rows_every=0.25, plots_every=1.0, clock=time.monotonic):
        import ipywidgets as w
        self.model, self.plots_every = model, plots_every
        self.rows_throttle = Throttle(rows_every, clock)
        self.plots_throttle = Throttle(plots_every, clock)
        self.redraws = self.plot_redraws = 0
        self._seen, self._plotted, self._reported = None, 0, False
        self.header = w.HTML()
        self.attempts = w.HTML()
        self.heads = [w.HTML(f'<b>{c}</b>') for c in COLUMNS + REPORT_COLUMNS]
        self.cells = {}
        for row in model.rows.values():
            cells = {name: w.HTML() for name in ('process', 'host', 'state', 'exit', 'detail',
                                                 'rate', 'loss', 'acc')}
            cells['process'].value = f'<b>{html.escape(row.label)}</b>'
            cells['host'].value = html.escape(row.host)
            cells['bar'] = (w.FloatProgress(value=0, min=0, max=1, bar_style='info',
                                            layout=w.Layout(width='120px'))
                            if row.role == 'worker' else w.HTML())
            self.cells[row.label] = cells
        self.table = w.GridBox(layout=w.Layout(grid_gap='0 10px', align_items='center',
                                               overflow='auto'))
        self._columns(reported=False)
        self.plot = w.Image(format='png', layout=w.Layout(display='none', max_width='100%'))
        self.box = w.VBox([self.header, self.attempts, self.table, self.plot])
        self.box.add_class('d2l-dashboard')
        self.refresh(force=True)

    def _columns(self, reported):
        """The table's cells: states and exit codes; the progress columns once reported."""
        grid = self.heads[:len(COLUMNS + (REPORT_COLUMNS if reported else []))]
        for cells in self.cells.values():
            grid += [cells[n] for n in ('process', 'host', 'state', 'exit')]
            if reported:
                grid += [cells[n] for n in ('bar', 'detail', 'rate', 'loss', 'acc')]
        self.table.children = grid
        self.table.layout.grid_template_columns = (
            'repeat(4, max-content)' + (' 120px repeat(4, max-content)' if reported else ''))
        self._reported = reported

    def refresh(self, force=False):
        """Show the model's changes, at most every ``rows_every`` s (plots: ``plots_every``)."""
        m = self.model
        if m.plot_version != self._plotted and self.plots_throttle.ready(force):
            self._plotted = m.plot_version        # plots first: the final header comes last
            self.plot_redraws += 1
            self._draw_plot()
        if m.version != self._seen and self.rows_throttle.ready(force):
            self._seen = m.version
            self.redraws += 1
            self._draw_rows()

    def _draw_rows(self):
        m = self.model
        colour = COLOURS.get(m.outcome, COLOURS['failed'])
        self.header.value = (f'<b>{html.escape(m.title)}</b> &nbsp; <span style="color:'
                             f'{colour}"><b>{html.escape(m.status())}</b></span>')
        if len(m.attempts) > 1:
            self.attempts.value = '<br>'.join(
                f"<span class='d2l-attempt'>{html.escape(a.describe(m.started))}</span>"
                for a in m.attempts)
        if not self._reported and any(r.reports for r in m.workers):
            self._columns(reported=True)
        for row in m.rows.values():
            c = self.cells[row.label]
            c['state'].value = (f'<span class="d2l-state-{row.state}" style="color:'
                                f'{COLOURS[row.state]}"><b>{row.state}</b></span>')
            c['exit'].value = '' if row.code is None else str(row.code)
            if row.role == 'worker':
                self._draw_progress(row, c)

    def _draw_progress(self, row, c):
        """A worker's bar, epoch and batch, samples/s, loss and accuracy."""
        c['bar'].value = row.done or 0.0
        c['bar'].bar_style = BAR_STYLES[row.state]
        r = row.metrics
        detail = []
        if 'epoch' in r:
            detail.append(f"epoch {r['epoch']}/{r.get('num_epochs', '?')}")
        if 'batch' in r:
            detail.append(f"batch {r['batch']}/{r.get('num_batches', '?')}")
        c['detail'].value = f"<span style='white-space:nowrap'>{' · '.join(detail)}</span>"
        if r.get('waiting'):          # the hang detector's line (runtime/hang.py)
            c['detail'].value += (f"<br><span class='d2l-waiting' style='color:#ef6c00'>"
                                  f"{html.escape(r['waiting'])}</span>")
        c['rate'].value = '' if row.rate is None else f'{row.rate:,.0f}'
        c['loss'].value = f"{r['loss']:.4f}" if 'loss' in r else ''
        acc = [f"{r['acc']:.3f}"] if 'acc' in r else []
        if 'test_acc' in r:
            acc.append(f"test {r['test_acc']:.3f}")
        c['acc'].value = ' · '.join(acc)

    def _draw_plot(self):
        start = time.perf_counter()
        png = figure(self.model)
        if png:
            self.plot.value, self.plot.layout.display = png, ''
        took = time.perf_counter() - start   # drawing may take at most a tenth of the time
        self.plots_throttle.interval = max(self.plots_every, 10 * took)

    def finish(self, handle):
        """The job ended: its header line takes the dashboard's place; the widgets close."""
        if handle is not None:
            handle.update({'text/plain': header(self.model)}, raw=True)
        for widget in self.widgets():
            widget.close()

    def widgets(self):
        """Every widget of the dashboard (closed when it is done)."""
        found = [self.box, self.header, self.attempts, self.table, self.plot, *self.heads]
        found += [c for cells in self.cells.values() for c in cells.values()]
        return list({id(x): x for x in found}.values())

    def _repr_mimebundle_(self, **kwargs):
        bundle = self.box._repr_mimebundle_(**kwargs)
        bundle['text/plain'] = header(self.model)
        return bundle

    def __repr__(self):
        return header(self.model)
