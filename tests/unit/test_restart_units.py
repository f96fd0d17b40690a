"""Restarts (d2l-launch --max-restarts) in one process: the options, the faults that act
in attempt 0 only, and the job model's attempts (tests/jobs/test_restarts.py runs jobs)."""
import json
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from support import ROOT
from d2ldist.kv import messages as M
from d2ldist.kv.server import KVServer, Slot
from d2ldist.launch import cli
from d2ldist.launch.processes import local_specs
from d2ldist.launch.progress import JobModel
from d2ldist.notebook import final
from d2ldist.runtime import faults
from d2ldist.runtime.van import Message
from fakes import FakeVan


def parse(*options, launcher=()):
    return cli.parse(['-n', '2', '-s', '1', *launcher, *map(str, options), 'python', '-c', 'pass'])


# -- the options ----------------------------------------------------------------------
@pytest.mark.parametrize('options,error', [
    (['--max-restarts', '-1'], '--max-restarts must be 0 or more, got -1'),
    (['--max-restarts', 'two'], "argument --max-restarts: invalid int value: 'two'"),
    (['--checkpoint-every', '10'], '--checkpoint-every needs --checkpoint-dir DIR'),
    (['--checkpoint-dir', 'ck', '--checkpoint-keep', '0'], '--checkpoint-keep must be at least 1'),
    (['--checkpoint-dir', 'ck', '--checkpoint-every', '-5'], '--checkpoint-every must be at least 1'),
    (['--checkpoint-dir', ''], '--checkpoint-dir needs a folder'),
    (['--fail', 'scheduler@step=3'], 'the scheduler fails at a time (scheduler@5s)'),
    (['--fail', 'scheduler:1@5s'], "--fail takes ROLE:R@step=N with a rank of this job"),
    (['--fail', 'server:1@step=3'], "--fail takes ROLE:R@step=N with a rank of this job"),
    (['--slow', 'scheduler=3x'], '--slow takes worker:R=3x'),
])
def test_bad_restart_options_are_one_line_errors(options, error):
    with pytest.raises(cli.UsageError) as e:
        parse(*options)
    assert error in str(e.value) and '\n' not in str(e.value)


def test_a_bad_max_restarts_exits_2_in_one_line():
    r = subprocess.run([sys.executable, '-m', 'd2ldist.launch', '-n', '1', '--max-restarts',
                        '-1', 'python', '-c', 'pass'], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert (r.returncode, r.stdout) == (2, '')
    assert r.stderr == 'd2l-launch: error: --max-restarts must be 0 or more, got -1\n'


def test_restart_and_checkpoint_options_become_every_processs_variables(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = parse('--max-restarts', 2, '--checkpoint-dir', 'ck', '--checkpoint-every', 50,
                 '--checkpoint-keep', 2, '--fail', 'server:0@step=3', '--fail', 'scheduler@5s')
    assert args.max_restarts == 2
    assert {k: v for k, v in args.env.items() if k.startswith('D2L_CHECK')} == {
        'D2L_CHECKPOINT_DIR': str(tmp_path / 'ck'), 'D2L_CHECKPOINT_EVERY': '50',
        'D2L_CHECKPOINT_KEEP': '2'}
    assert args.process_env == {('server', 0): {'D2L_FAIL': 'step=3'},
                                ('scheduler', 0): {'D2L_FAIL': '5s'}}
    assert parse().max_restarts == 0 and 'D2L_CHECKPOINT_DIR' not in parse().env
    specs = local_specs(2, 1, ['true'], 'secret')
    assert {s.env['D2L_RESTART'] for s in specs} == {'0'}          # every process, attempt 0


def test_over_ssh_the_checkpoint_folder_is_a_path_on_the_hosts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ssh = ['--launcher', 'ssh', '-H', 'hostA,hostB']
    folder = lambda *more: parse('--checkpoint-dir', *more, launcher=ssh).env['D2L_CHECKPOINT_DIR']
    assert folder('/shared/ck') == '/shared/ck'                    # as given
    assert folder('ck') == str(tmp_path / 'ck')                    # where the processes run
    assert folder('ck', '--sync-dst-dir', '/tmp/job') == '/tmp/job/ck'


# -- the faults act in attempt 0 only ----------------------------------------------------
@pytest.mark.parametrize('attempt', [0, 1])
def test_fail_and_slow_act_in_the_first_attempt_only(monkeypatch, use_config, attempt):
    died, slept = [], []
    monkeypatch.setattr(faults, 'die', died.append)
    monkeypatch.setattr(faults.time, 'sleep', slept.append)
    monkeypatch.setattr(faults.spans, 'step', lambda: 4)
    use_config({'D2L_FAIL': 'step=4', 'D2L_SLOW': '+200ms', 'D2L_RESTART': str(attempt)})
    faults.computed(0.1)
    faults.served(4)
    expected = ['after its compute step 4', 'after its sync round 4'] if attempt == 0 else []
    assert (died, slept) == (expected, [pytest.approx(0.2)] if attempt == 0 else [])


def test_a_server_fails_after_its_nth_round_on_the_first_key(monkeypatch, use_config):
    use_config({'D2L_FAIL': 'step=2', 'D2L_ROLE': 'server', 'D2L_RANK': '0'})
    died = []
    monkeypatch.setattr(faults, 'die', died.append)
    node = SimpleNamespace(num_workers=2, id='server:0', send=FakeVan().send,
                           peers=lambda role: ['worker:0', 'worker:1'])
    server = KVServer(node)
    for key in ('w', 'b'):
        server.store[key] = Slot('float32', [2], 0, 2, torch.zeros(2))

    def push(worker, key, n):
        return Message(M.PUSH, worker, {'parts': [[key, 'float32', [2], 0, 2]], 'sync': True,
                                        'id': n, 'n': n},
                       [bytearray(torch.ones(2).numpy().tobytes())])
    rounds = []
    for n, key in enumerate(['w', 'b', 'b', 'w'], 1):     # rounds of 'w': the 1st and 4th push
        for worker in ('worker:0', 'worker:1'):
            assert server.handle(push(worker, key, n))
        rounds.append(list(died))
    assert rounds == [[], [], [], ['after its sync round 2']]


# -- the job model's attempts ----------------------------------------------------------
class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def report(model, rank, **fields):
    model.add_report(f'worker {rank}', fields)


def test_attempts_count_the_steps_lost_from_the_workers_reports():
    clock = Clock()
    model = JobModel(local_specs(2, 1, ['true'], 'secret'), clock=clock)
    model.set_state('worker 0', 'running')
    report(model, 0, epoch=1, batch=10, num_batches=20, loss=1.0, step=10)
    report(model, 1, step=12)                      # the highest step of attempt 0
    report(model, 0, step=11)
    model.set_state('worker 1', 'failed', 137)
    clock.now = 104.0
    model.on_restart(1, 'worker 1 failed (killed by SIGKILL (exit code 137))')
    first, second = model.attempts
    assert (first.number, first.started, first.end, first.last_step) == \
        (0, 100.0, 'worker 1 failed (killed by SIGKILL (exit code 137))', 12)
    assert (second.number, second.started, second.before) == (1, 104.0, 12)
    assert (second.resumed_from, second.steps_lost, second.title) == (None, None, 'restart 1')
    # every row starts anew; the curves stay
    assert {(r.state, r.code, r.reports) for r in model.rows.values()} == {('starting', None, 0)}
    assert model.rows['worker 0'].metrics == {} and len(model.rows['worker 0'].history) == 1
    report(model, 1, resumed_from=10)              # from the checkpoint of step 10
    report(model, 1, step=11)
    assert (second.resumed_from, second.begun_at, second.steps_lost) == (10, 10, 2)
    assert second.title == 'restart 1 (resumed from step 10)'
    # a second restart, without a checkpoint: the steps came from 0
    clock.now = 110.5
    model.on_restart(2, 'server 0 failed (exit code 1)')
    report(model, 0, step=3)
    third = model.attempts[2]
    assert (third.before, third.resumed_from, third.begun_at, third.steps_lost) == (11, None, 0, 11)
    model.finish('finished')
    assert model.attempts_text().splitlines() == [
        'attempt 0, started at 0.0 s: worker 1 failed (killed by SIGKILL (exit code 137))',
        'attempt 1, started at 4.0 s, resumed from step 10 (2 steps lost): '
        'server 0 failed (exit code 1)',
        'attempt 2, started at 10.5 s, resumed from step 0 (11 steps lost): finished']
    assert model.attempts_text() in final.summary(model).replace('\n  ', '\n')
    assert 'attempt 2, started at 10.5 s' in model.text()


def test_a_job_never_restarted_lists_no_attempts():
    model = JobModel(local_specs(1, 0, ['true'], 'secret'), clock=Clock())
    report(model, 0, step=5)
    model.finish('finished')
    assert len(model.attempts) == 1 and model.attempts[0].steps_lost is None
    assert 'attempt' not in final.summary(model) and 'attempt' not in model.text()


def test_the_timeline_marks_each_restart(tmp_path):
    model = JobModel(local_specs(1, 0, ['true'], 'secret'), clock=Clock())
    model.on_restart(1, 'worker 0 failed (exit code 3)')
    report(model, 0, resumed_from=40)
    path = tmp_path / 't.json'
    model.trace.write(path)
    (mark,) = [e for e in json.loads(path.read_text())['traceEvents'] if e['ph'] == 'i']
    assert (mark['name'], mark['s'], mark['ts']) == ('restart 1 (resumed from step 40)', 'g', 0)


def test_an_elastic_change_is_an_instant_the_drawing_names_and_the_sums_leave_out(tmp_path):
    from d2ldist.timeline import breakdown, last_steps, load, plot
    model = JobModel(local_specs(2, 0, ['true'], 'secret'), clock=Clock())
    now = time.time() * 1e6                        # (an instant is marked at the launcher's now)
    model.trace.on_line('worker 0', '@d2l/timeline ' + json.dumps({'events': [
        {'name': '1 forward, backward', 'cat': 'step', 'tid': 'MainThread', 'dur': 1000.0,
         'ts': now - 4000 + 1000 * k, 'args': {'step': k}} for k in (1, 2, 3)]}))
    model.on_change('worker 1 lost')
    path = tmp_path / 't.json'
    model.trace.write(path)
    (mark,) = [e for e in json.loads(path.read_text())['traceEvents'] if e['ph'] == 'i']
    assert (mark['name'], mark['cat'], mark['s']) == ('worker 1 lost', 'change', 'g')
    spans = load(path)
    assert [(s.lane, s.name, s.dur) for s in spans if s.lane == 'job'] == [
        ('job', 'worker 1 lost', 0.0)]
    assert breakdown(spans) == {'worker 0 training': {'step': 3000e-6}}
    assert [s.step for s in last_steps(spans, (2, 3)) if s.lane != 'job'] == [2, 3]
    with pytest.raises(ValueError, match=r'^no step 7 to 9 in the timeline: it has steps 1 '
                                         r'to 3$'):
        last_steps(spans, (7, 9))
    drawn = plot(spans, steps=None)
    assert repr(drawn).endswith('every step recorded; steps blue, communication green, '
                                'waiting red; worker 1 lost (dashed)')
    assert drawn._repr_png_().startswith(b'\x89PNG')


def test_a_resumed_job_counts_its_steps_on_from_the_checkpoint():
    from d2ldist.runtime import spans
    before = spans._steps_done
    try:
        spans.resume(20)
        assert spans.step() == 21
        spans.step_done()
        assert spans.step() == 22
    finally:
        spans._steps_done = before


def test_the_dashboard_lists_the_attempts_once_restarted():
    pytest.importorskip('ipywidgets')
    from d2ldist.notebook.dashboard import Dashboard
    clock = Clock()
    model = JobModel(local_specs(2, 0, ['true'], 'secret'), clock=clock)
    view = Dashboard(model)
    model.set_state('worker 1', 'failed', 3)
    view.refresh(force=True)
    assert view.attempts.value == '' and 'd2l-state-failed' in view.cells['worker 1']['state'].value
    clock.now += 2
    model.on_restart(1, 'worker 1 failed (exit code 3)')
    report(model, 0, resumed_from=20)
    view.refresh(force=True)
    assert 'd2l-state-starting' in view.cells['worker 1']['state'].value
    assert view.attempts.value.count("class='d2l-attempt'") == 2
    assert 'attempt 1, started at 2.0 s, resumed from step 20: running' in view.attempts.value
    assert view.attempts in view.widgets()
