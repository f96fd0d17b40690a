"""The dashboard's model (states, reports, text form) and its throttled widget view."""
import pytest

from d2ldist.dashboard import JobModel, Throttle, plot_curves, plot_steps
from d2ldist.launch.placement import local_specs


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
    from d2ldist.dashboard import Dashboard
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


def test_view_shows_states_colours_and_log():
    pytest.importorskip('ipywidgets')
    from d2ldist.dashboard import Dashboard
    model = job_model(Clock())
    view = Dashboard(model)
    model.set_state('worker 0', 'finished', 0)
    model.set_state('worker 1', 'failed', 3)
    model.add_log(''.join(f'[worker 1] line {i}\n' for i in range(20)))
    model.finish('failed', 'worker 1 failed (exit code 3)')
    view.refresh(force=True)
    assert view.cells['worker 0']['bar'].bar_style == 'success'
    assert view.cells['worker 1']['bar'].bar_style == 'danger'
    assert 'd2l-state-failed' in view.cells['worker 1']['state'].value
    assert view.cells['worker 1']['exit'].value == '3'
    assert 'line 19' in view.tail.value and 'line 11' not in view.tail.value
    assert 'line 0\n' in view.full_log.value
    assert view.log_box.get_title(0) == 'full log (20 lines)' and view.log_box.selected_index is None
    bundle = view._repr_mimebundle_()
    assert 'application/vnd.jupyter.widget-view+json' in bundle
    assert bundle['text/plain'].startswith('%launch -n 2 job.py: failed after')


def test_plots_are_png():
    pytest.importorskip('matplotlib')
    model = job_model(Clock())
    assert plot_curves(model) is None and plot_steps(model) is None
    for rank in (0, 1):
        for b in range(1, 4):
            model.add_report(f'worker {rank}', {'epoch': 1, 'num_epochs': 1, 'batch': b,
                                                'num_batches': 3, 'loss': 1 / b, 'acc': b / 3,
                                                'step_times': {'compute': 0.01, 'push': 0.002}})
        model.add_report(f'worker {rank}', {'test_acc': 0.5})
    for png in (plot_curves(model), plot_steps(model)):
        assert png[:8] == b'\x89PNG\r\n\x1a\n' and len(png) > 5000
