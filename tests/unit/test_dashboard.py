"""The job's model (states, reports, text form), its throttled widget view, the final
form a finished %launch leaves (summary and figure), and that d2l-launch's terminal view
reads the same model."""
import io
import json
import re

import pytest

from d2ldist.launch.job import Proc
from d2ldist.launch.processes import local_specs
from d2ldist.launch.progress import JobModel, Progress, Throttle
from d2ldist.notebook import final
from d2ldist.report import PREFIX


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def job_model(clock, n=2, s=1):
    return JobModel(local_specs(n, s, ['true'], 'secret'), title='%launch -n 2 job.py',
                    clock=clock)


def test_states_move_forward_only():
    model = job_model(Clock())
    assert [r.state for r in model.rows.values()] == ['starting'] * 4
    assert model.outcome == 'starting'
    assert model.set_state('worker 0', 'running')
    assert model.outcome == 'running'
    assert model.set_state('worker 0', 'finished', 0)
    assert not model.set_state('worker 0', 'running')        # final states stay
    assert model.rows['worker 0'].state == 'finished'
    model.set_state('server 0', 'stopped')                   # stopped by the launcher ...
    assert model.set_state('server 0', 'stopped', 143)      # ... its exit code comes later
    assert (model.rows['server 0'].state, model.rows['server 0'].code) == ('stopped', 143)
    assert not model.set_state('server 0', 'failed', 1)


def test_reports_merge_and_build_history():
    clock = Clock()
    model = job_model(clock)
    v = model.plot_version
    model.add_report('worker 1', {'epoch': 1, 'num_epochs': 2, 'batch': 5, 'num_batches': 10,
                                  'loss': 1.5, 'acc': 0.4, 'samples': 320})
    clock.now += 2
    model.add_report('worker 1', {'epoch': 1, 'num_epochs': 2, 'batch': 10, 'num_batches': 10,
                                  'loss': 1.0, 'acc': 0.6, 'samples': 640})
    model.add_report('worker 1', {'test_acc': 0.55})
    row = model.rows['worker 1']
    assert row.metrics['loss'] == 1.0 and row.metrics['test_acc'] == 0.55
    assert row.done == 0.5 and row.rate == 160
    assert row.history == [(0.5, 1.5, 0.4, None), (1.0, 1.0, 0.6, None), (1.0, None, None, 0.55)]
    assert model.plot_version == v + 3
    model.add_report('worker 1', {'samples': 700})                 # no new point to plot
    assert model.plot_version == v + 3


def test_text_form_reads_like_a_progress_bar():
    clock = Clock()
    model = job_model(clock)
    for label in model.rows:
        model.set_state(label, 'running')
    model.add_report('worker 0', {'epoch': 2, 'num_epochs': 2, 'batch': 5, 'num_batches': 10,
                                  'loss': 0.25, 'acc': 0.875})
    clock.now += 3.25
    text = model.text()
    lines = text.splitlines()
    assert lines[0] == '%launch -n 2 job.py: running, 3.2 s'
    assert lines[3].split() == ['worker', '0', 'localhost', 'running', '|████████', '|', '75%',
                                'epoch', '2/2', 'batch', '5/10', 'loss', '0.250', 'acc', '0.875']
    assert lines[4].split() == ['worker', '1', 'localhost', 'running']
    model.set_state('worker 1', 'failed', 3)
    model.finish('failed', 'worker 1 failed (exit code 3)')
    assert repr(model).splitlines()[0] == \
        '%launch -n 2 job.py: failed after 3.2 s: worker 1 failed (exit code 3)'
    assert 'failed    exit 3' in repr(model).splitlines()[4]


def test_throttle():
    clock = Clock()
    throttle = Throttle(0.5, clock)
    assert throttle.ready()
    clock.now += 0.3
    assert not throttle.ready()
    assert throttle.ready(force=True)
    clock.now += 0.49
    assert not throttle.ready()
    clock.now += 0.01
    assert throttle.ready()


def test_view_redraws_are_throttled():
    pytest.importorskip('ipywidgets')
    from d2ldist.notebook.dashboard import Dashboard
    clock = Clock()
    model = job_model(clock)
    view = Dashboard(model, rows_every=0.25, plots_every=1.0, clock=clock)
    assert view.redraws == 1 and view.plot_redraws == 0
    for i in range(1, 191):                   # 190 reports in 1.9 s, refreshed after each
        clock.now += 0.01
        model.add_report('worker 0', {'epoch': 1, 'num_epochs': 1, 'batch': i,
                                      'num_batches': 190, 'loss': 1 / i, 'acc': i / 190})
        view.refresh()
    assert 7 <= view.redraws <= 9
    # plots: every 1 s at most, less often if drawing takes more than a tenth of that
    assert 1 <= view.plot_redraws <= 2 and view.plots_throttle.interval >= 1.0
    assert view.cells['worker 0']['bar'].value < 1.0        # the last report is not shown yet
    view.refresh()
    assert view.redraws <= 9                                 # nothing due yet
    clock.now += 0.25
    view.refresh()                                           # the pending change is shown
    assert view.cells['worker 0']['bar'].value == 1.0
    assert '>epoch 1/1 · batch 190/190<' in view.cells['worker 0']['detail'].value
    n = view.redraws
    clock.now += 10
    view.refresh()
    assert view.redraws == n                                 # no change, no redraw


def test_view_shows_states_and_colours_and_no_log():
    pytest.importorskip('ipywidgets')
    from d2ldist.notebook.dashboard import Dashboard
    model = job_model(Clock())
    view = Dashboard(model)
    model.set_state('worker 0', 'finished', 0)
    model.set_state('worker 1', 'failed', 3)
    model.add_report('worker 0', {'epoch': 1, 'num_epochs': 1})
    model.add_log(''.join(f'[worker 1] line {i}\n' for i in range(20)))
    model.finish('failed', 'worker 1 failed (exit code 3)')
    view.refresh(force=True)
    assert view.cells['worker 0']['bar'].bar_style == 'success'
    assert view.cells['worker 1']['bar'].bar_style == 'danger'
    assert 'd2l-state-failed' in view.cells['worker 1']['state'].value
    assert view.cells['worker 1']['exit'].value == '3'
    texts = [getattr(w, 'value', '') for w in view.widgets()]
    assert not any('line' in t for t in texts if isinstance(t, str))   # the log is the cell's
    bundle = view._repr_mimebundle_()
    assert 'application/vnd.jupyter.widget-view+json' in bundle
    assert bundle['text/plain'] == '%launch -n 2 job.py: scheduler, 1 server, 2 workers'


def test_progress_columns_come_with_the_first_report():
    pytest.importorskip('ipywidgets')
    from d2ldist.notebook.dashboard import Dashboard
    model = job_model(Clock())
    view = Dashboard(model)
    assert len(view.table.children) == 4 * (1 + 4)          # header and 4 processes, 4 columns
    assert view.cells['worker 0']['bar'] not in view.table.children
    model.add_report('worker 1', {'epoch': 1, 'num_epochs': 2})
    view.refresh(force=True)
    assert len(view.table.children) == 9 * (1 + 4)
    assert view.cells['worker 1']['bar'].value == 0.5


def test_a_worker_waiting_too_long_shows_on_its_row_until_it_goes_on():
    pytest.importorskip('ipywidgets')
    from d2ldist.notebook.dashboard import Dashboard
    model = job_model(Clock())
    view = Dashboard(model)
    line = 'worker 0 has waited 30 s in barrier 3: worker 1 has not arrived (<it>)'
    model.add_report('worker 0', {'epoch': 1, 'num_epochs': 2, 'waiting': line})
    view.refresh(force=True)
    assert "class='d2l-waiting'" in view.cells['worker 0']['detail'].value
    assert '(&lt;it&gt;)' in view.cells['worker 0']['detail'].value        # escaped
    assert 'waiting too long' in model.text()
    model.add_report('worker 0', {'waiting': ''})
    view.refresh(force=True)
    assert 'd2l-waiting' not in view.cells['worker 0']['detail'].value


def test_timeline_lines_are_kept_for_the_file_and_never_shown():
    model, out = job_model(Clock()), io.StringIO()
    progress = Progress(out=out, tty=False, model=model)
    spec = local_specs(1, 0, ['true'], 's')[1]
    proc = Proc(spec)
    line = '@d2l/timeline ' + json.dumps({'events': [
        {'name': 'push', 'cat': 'comm', 'ts': 1.0, 'dur': 2.0, 'tid': 'MainThread',
         'args': {'step': 1}}]})
    assert progress.on_line(proc, line) is None and out.getvalue() == ''
    assert model.trace.count == 1 and spec.label == 'worker 0'


class Handle:
    def update(self, obj, raw=False):
        self.shown = obj


def test_finish_leaves_the_header_and_closes_every_widget():
    pytest.importorskip('ipywidgets')
    from d2ldist.notebook.dashboard import Dashboard
    model = job_model(Clock())
    view, handle = Dashboard(model), Handle()
    model.add_report('worker 0', {'epoch': 1, 'num_epochs': 1})
    view.refresh(force=True)
    view.finish(handle)
    assert handle.shown == {'text/plain': '%launch -n 2 job.py: scheduler, 1 server, 2 workers'}
    assert all(w.comm is None for w in view.widgets())     # closed: nothing left to save


def finished_model(clock, loss=0.25, rate_step=2.0, ms=0.01):
    """Two workers that trained one epoch of 3 batches, with these measured numbers."""
    model = job_model(clock)
    for rank in (0, 1):
        for b in range(1, 4):
            clock.now += rate_step
            model.add_report(f'worker {rank}', {'epoch': 1, 'num_epochs': 1, 'batch': b,
                                                'num_batches': 3, 'loss': loss / b, 'acc': b / 3,
                                                'samples': 64 * b, 'time': clock.now,
                                                'step_times': {'compute': ms, 'push': ms / 5}})
        model.add_report(f'worker {rank}', {'test_acc': 0.5})
    for label in model.rows:
        model.set_state(label, 'finished', 0)
    model.finish('finished')
    return model


def test_summary_is_a_table_of_processes_reports_and_steps():
    text = final.summary(finished_model(Clock()))
    assert text.splitlines()[:3] == [
        'job finished after 12.0 s',
        '  process    host       state     exit  progress',
        '  scheduler  localhost  finished  0']
    assert '  worker 1   localhost  finished  0     |██████████| 100% epoch 1/1, batch 3/3' in text
    assert text.split('\n\n')[1:] == [
        '  last report  worker 0  worker 1\n'
        '  loss           0.0833    0.0833\n'
        '  train acc       1.000     1.000\n'
        '  test acc        0.500     0.500\n'
        '  samples/s          32        32',
        '  time per batch  worker 0  worker 1\n'
        '  compute          10.0 ms   10.0 ms\n'
        '  push              2.0 ms    2.0 ms']


def test_no_reports_no_progress_column_and_no_figure():
    model = job_model(Clock())
    for label in model.rows:
        model.set_state(label, 'finished', 0)
    model.finish('finished')
    assert final.summary(model).splitlines()[1] == '  process    host       state     exit'
    assert final.outputs(model) == [{'text/plain': final.summary(model)}]


def test_sanitized_summaries_of_two_runs_are_equal():
    """nbval compares the summary through notebooks/sanitize.cfg: only measured numbers differ."""
    nbval = pytest.importorskip('nbval.plugin')
    from support import ROOT
    rules = nbval.get_sanitize_patterns((ROOT / 'notebooks' / 'sanitize.cfg').read_text())

    def sanitized(model):
        text = final.summary(model)
        for regex, replace in rules:
            text = re.sub(regex, replace, text)
        return text
    one = finished_model(Clock())
    other = finished_model(Clock(), loss=12.5, rate_step=0.01, ms=1.234)
    assert final.summary(one) != final.summary(other)
    assert sanitized(one) == sanitized(other)
    assert 'loss MEASURED' in sanitized(one) and '  compute T T' in sanitized(one)
    other.rows['worker 1'].state = 'failed'
    assert sanitized(one) != sanitized(other)                # states are compared


def test_figure_is_one_png_of_the_panels_with_data():
    pytest.importorskip('matplotlib')
    model = job_model(Clock())
    assert final.figure(model) is None and final.panels(model) == []
    model = finished_model(Clock())
    assert final.panels(model) == ['loss', 'accuracy', 'time per step']
    png = final.figure(model)
    assert png[:8] == b'\x89PNG\r\n\x1a\n' and len(png) > 5000
    summary, figure = final.outputs(model)
    assert figure == {'image/png': png, 'text/plain': '%launch -n 2 job.py: loss, accuracy '
                                                      'and time per step of each worker'}


def test_terminal_and_notebook_views_read_one_model():
    """The launcher's hooks feed one model; d2l-launch's line, the text form and the
    widgets show the same progress and rate from it."""
    clock = Clock()
    model = job_model(clock)
    out = io.StringIO()
    progress = Progress(out, tty=False, clock=clock, model=model)
    procs = {s.label: Proc(s) for s in local_specs(2, 1, ['true'], 'secret')}
    for p in procs.values():
        p.state = 'running'
        model.on_state(p)
    w1 = procs['worker 1']
    assert progress.on_line(w1, 'hello') == 'hello'
    for batch, when in ((5, 1000.0), (10, 1002.0)):
        line = PREFIX + json.dumps({'epoch': 1, 'num_epochs': 2, 'batch': batch,
                                    'num_batches': 10, 'loss': 1.0, 'samples': 64 * batch,
                                    'time': when})
        assert progress.on_line(w1, line) is None                 # the model took it
    words = 'epoch 1/2 batch 10/10 loss 1.000 160 samples/s'
    assert out.getvalue().splitlines()[-1] == f'[worker 1] [########--------]  50% {words}'
    state, shown = model.text().splitlines()[4].split(None, 4)[3:]
    assert (state, shown) == ('running', f'|█████     |  50% {words}')
    assert model.rows['worker 1'].rate == 160 and len(model.rows['worker 1'].history) == 2
    pytest.importorskip('ipywidgets')
    from d2ldist.notebook.dashboard import Dashboard
    cells = Dashboard(model).cells['worker 1']
    assert (cells['bar'].value, cells['rate'].value, cells['loss'].value) == (0.5, '160', '1.0000')


def test_a_model_made_empty_meets_processes_through_the_hooks():
    model = JobModel()
    assert model.text().startswith('job: starting, ')         # no process yet
    worker = Proc(local_specs(1, 0, ['true'], 'secret')[1])
    assert model.on_line(worker, PREFIX + '{"epoch": 1}') is None
    worker.state, worker.code = 'failed', 3
    model.on_state(worker)
    row = model.rows['worker 0']
    assert (row.role, row.rank, row.state, row.code, row.metrics) == \
        ('worker', 0, 'failed', 3, {'epoch': 1})


def test_a_finished_jobs_figure_is_a_png_of_64_colours_a_third_of_the_bytes():
    pytest.importorskip('matplotlib')
    from PIL import Image
    from d2ldist.notebook import images
    fig = final._figure(8, 2.5)
    ax = fig.add_subplot()
    for k in range(4):
        ax.plot([x * x * k for x in range(50)], label=f'worker {k}')
    ax.legend()
    full = io.BytesIO()
    fig.savefig(full, format='png')
    light = images.png(fig)
    image = Image.open(io.BytesIO(light))
    assert image.mode == 'P' and len(image.getcolors()) <= 64
    assert image.size == Image.open(full).size and len(light) < len(full.getvalue()) / 2
