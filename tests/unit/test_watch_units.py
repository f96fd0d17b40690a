"""The hang detector's, the disagreement checks' and the timeline's pieces in one process
(tests/jobs/test_watch.py runs them in real jobs)."""
import json
from types import SimpleNamespace

import pytest
import torch

from d2ldist import config
from d2ldist.kv.server import Slot
from d2ldist.kv.serving import ServerLoop
from d2ldist.kv import messages as M
from d2ldist.launch import cli
from d2ldist.launch.trace import Trace
from d2ldist.report import format_progress, parse_report
from d2ldist.runtime import hang, protocol, spans
from d2ldist.runtime.van import Message
from d2ldist.timeline import breakdown, load, plot
from fakes import FakeVan, message, scheduler


@pytest.mark.parametrize('argv,error', [
    (['--hang-warn', '0'], '--hang-warn takes a positive number of seconds'),
    (['--hang-fail', 'soon'], "--hang-fail takes a positive number of seconds, got 'soon'"),
    (['--timeline-steps', '3-6'], '--timeline-steps needs --timeline FILE'),
    (['--timeline', 't.json', '--timeline-steps', '6-3'], 'FIRST-LAST (20-40)'),
    (['--timeline', '/no/such/folder/t.json'], 'no folder /no/such/folder')])
def test_bad_watch_options_are_one_line_errors(argv, error):
    with pytest.raises(cli.UsageError) as e:
        cli.parse(['-n', '2', *argv, 'python', '-c', 'pass'])
    assert error in str(e.value) and '\n' not in str(e.value)


def test_watch_options_reach_every_process_as_variables(tmp_path):
    args = cli.parse(['-n', '2', '--hang-warn', '2', '--hang-fail', '5.5', '--timeline',
                      str(tmp_path / 't.json'), '--timeline-steps', '20-40', 'python', '-c',
                      'pass'])
    assert {k: args.env[k] for k in args.env if k.startswith('D2L_')} == {
        'D2L_HANG_WARN': '2.0', 'D2L_HANG_FAIL': '5.5', 'D2L_TIMELINE': '1',
        'D2L_TIMELINE_STEPS': '20-40'}
    read = config.Config.from_env(args.env)
    assert (read.hang_warn, read.hang_fail, read.timeline, read.timeline_steps) == \
        (2.0, 5.5, True, (20, 40))
    assert (config.Config().hang_warn, config.Config().hang_fail) == (30.0, None)


@pytest.mark.parametrize('text,window', [('20-40', (20, 40)), ('7', (7, 7)), ('', None)])
def test_timeline_windows(text, window):
    assert config.Config.from_env({'D2L_TIMELINE_STEPS': text}).timeline_steps == window


@pytest.mark.parametrize('text', ['0-3', '5-2', 'a-b', '-3'])
def test_timeline_windows_refused(text):
    with pytest.raises(ValueError, match='D2L_TIMELINE_STEPS: timeline steps take FIRST-LAST'):
        config.Config.from_env({'D2L_TIMELINE_STEPS': text})


def test_one_count_of_steps_for_the_spans_and_fail(monkeypatch, use_config):
    """train_batch, DistributedOptimizer.step(), ShardedOptimizer.step() and a torch
    optimizer's step over shard_module's shards each end a step of the one count
    (spans.step()); --fail step=2 dies at the end of step 2's compute on every path. A
    torch optimizer over other parameters counts nothing (faults.counted says which)."""
    import d2ldist
    from d2ldist.runtime import faults
    use_config({'D2L_FAIL': 'step=2'})
    died = []
    monkeypatch.setattr(faults, 'die', died.append)
    net, loss = torch.nn.Linear(4, 2), torch.nn.CrossEntropyLoss(reduction='none')
    X, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    trainer = d2ldist.Trainer(net, 'sgd', {'lr': 0.1})
    optimizer = d2ldist.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))

    sharded = d2ldist.ShardedOptimizer(torch.optim.Adam(net.parameters()), stage=1)
    stage_3 = d2ldist.shard_module(torch.nn.Linear(4, 2))
    over_shards = torch.optim.Adam(stage_3.parameters())
    plain = torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=0.1)

    def optimizer_step(optimizer, net=net):
        loss(net(X), y).sum().backward()
        optimizer.step()
    assert [faults.counted(o) for o in (optimizer, sharded, over_shards, plain)] == \
        [True, True, True, False]
    monkeypatch.setattr(spans, '_steps_done', 0)
    optimizer_step(plain)
    assert (spans.step(), died) == (1, [])
    for step in (lambda: d2ldist.train_batch(X, y, net, loss, trainer, trainer.devices),
                 lambda: optimizer_step(optimizer), lambda: optimizer_step(sharded),
                 lambda: optimizer_step(over_shards, stage_3)):
        monkeypatch.setattr(spans, '_steps_done', 0)
        died.clear()
        assert spans.step() == 1
        step()
        assert (spans.step(), died) == (2, [])
        step()
        assert (spans.step(), died) == (3, ['after its compute step 2'])


def test_the_hang_line_names_the_missing_and_what_they_do():
    assert hang.sentence([]).startswith('every node it waits for has arrived')
    one = hang.sentence([('worker:2', {'counter': 3})])
    assert one == ('worker 2 has not arrived (it has started 3 collectives; it is '
                   'computing, or in its own code)')
    two = hang.sentence([('worker:1', {'note': "has not pushed 'w' to server 0",
                                       'what': 'in worker barrier 3 (kv.init)', 'for': 12.4}),
                         ('worker:2', {'state': 'failed'})])
    assert two == ("worker 1 (has not pushed 'w' to server 0; it is waiting in worker "
                   "barrier 3 (kv.init) for 12 s); worker 2 (it has failed) have not arrived")


def test_barriers_from_different_calls_fail_every_member_naming_both_in_rank_order():
    s = scheduler()
    s.handle(message(protocol.BARRIER, 'worker:2', group='worker', n=1, what="kv.init('w')"))
    s.handle(message(protocol.BARRIER, 'worker:0', group='worker', n=1, what='barrier()'))
    sent = [(p, h['error']) for p, kind, h in s.van.sent if kind == protocol.BARRIER_DISAGREE]
    assert [p for p, _ in sent] == ['worker:0', 'worker:1', 'worker:2']
    assert sent[0][1] == ("worker barrier 1: worker 0 entered it from barrier(), worker 2 "
                          "from kv.init('w'); every node of the group must call the same "
                          'barriers in the same order')


def test_the_scheduler_says_who_is_missing_from_barriers_heartbeats_and_counters():
    s = scheduler()
    s.handle(message(protocol.BARRIER, 'worker:0', group='worker', n=1, what='barrier()'))
    s.handle(message(protocol.HEARTBEAT, 'worker:1', what='in allreduce(...) for worker 0',
                     counters={'ring': 7}, **{'for': 3.0}))
    s.handle(message(protocol.HEARTBEAT, 'worker:2', what=None, counters={'ring': 8}))
    s.handle(message(protocol.WHO, 'worker:0', id=5, question={'barrier': ['worker', 1]}))
    s.handle(message(protocol.WHO, 'worker:0', id=6, question={'counter': 'ring', 'n': 8}))
    s.handle(message(protocol.WHO, 'worker:0', id=7, question='nonsense'))
    answers = {h['id']: h['missing'] for p, kind, h in s.van.sent if kind == protocol.WHO_ANSWER}
    assert [m for m, _ in answers[5]] == ['worker:1', 'worker:2']
    assert answers[5][0][1]['what'] == 'in allreduce(...) for worker 0'
    assert answers[5][0][1]['for'] >= 3.0
    (node, doing), = answers[6]                   # worker 2 has started collective 8
    assert node == 'worker:1' and doing['counter'] == 7
    assert answers[7] == []


def test_a_server_names_who_has_not_pushed_and_refuses_pushes_in_another_order():
    van = FakeVan()
    node = SimpleNamespace(num_workers=2, id='server:0', send=van.send,
                           peers=lambda role: ['worker:0', 'worker:1'])
    loop = ServerLoop(node)
    server = loop.shards[0]
    for key in ('w', 'b'):
        server.store[key] = Slot('float32', [2], 0, 2, torch.zeros(2))

    def push(worker, key, rid):        # the n-th (here: first) sync pushpull of a worker
        return Message(M.PUSH, worker, {'parts': [[key, 'float32', [2], 0, 2]], 'sync': True,
                                        'pull': True, 'id': rid, 'n': 1},
                       [bytearray(torch.ones(2).numpy().tobytes())])
    assert server.handle(push('worker:0', 'w', 11))
    loop.dispatch(Message(protocol.WHO, 'worker:0', {'id': 3, 'question': {'request': 11}}, []))
    assert van.sent[-1] == ('worker:0', protocol.WHO_ANSWER, {
        'id': 3, 'missing': [['worker:1', {'note': "has not pushed 'w' to server 0"}]]})
    server.handle(push('worker:1', 'b', 21))
    errors = {p: h for p, kind, h in van.sent if kind == M.ERROR}
    assert sorted(errors) == ['worker:0', 'worker:1'] and errors['worker:0']['disagree']
    assert errors['worker:1']['error'] == (
        "push 1 of worker 0 carried keys ['w'], push 1 of worker 1 keys ['b']; in dist_sync "
        'every worker must push the same keys in the same order')


def test_a_waiting_report_shows_and_clears():
    r = parse_report('@d2l/1 ' + json.dumps({'waiting': 'worker 0 has waited 30 s ...'}))
    assert r == {'waiting': 'worker 0 has waited 30 s ...'}
    assert 'waiting too long' in format_progress(r)
    assert parse_report('@d2l/1 {"waiting": 3}') == {}
    assert 'waiting' not in format_progress({'waiting': ''})


def span(name, cat='step', ts=0.0, dur=10.0, tid='MainThread', step=1, **args):
    return {'name': name, 'cat': cat, 'ts': ts, 'dur': dur, 'tid': tid,
            'args': dict(args, step=step)}


def test_the_trace_keeps_well_formed_spans_and_drops_the_rest(tmp_path):
    t = Trace()
    assert not t.on_line('worker 0', 'an ordinary line')
    assert t.on_line('worker 0', spans.PREFIX + '{not json')
    assert t.on_line('worker 0', spans.PREFIX + json.dumps({'events': [
        span('1 forward, backward', ts=1000.0, dur=500.0),
        span('allreduce', 'comm', ts=1200.0, dur=100.0, tid='d2ldist-comm', bytes=40),
        span('bad', ts=float('nan')), span('bad', dur=-1), {'name': 3},
        span('nested', args_ok=None) | {'args': {'x': [1, 2]}}],
        'clock_error_us': 80.0}))
    assert t.on_line('server 0', spans.PREFIX + json.dumps({'events': [
        span('push', 'server', ts=1100.0, dur=50.0), span('pull', 'server', ts=9000.0)]}))
    assert t.count == 4
    path = tmp_path / 't.json'
    assert t.write(path) == 3                         # the server's late span is cut
    data = json.loads(path.read_text())
    names = [e['args']['name'] for e in data['traceEvents'] if e['name'] == 'process_name']
    assert names == ['worker 0', 'server 0']          # workers first
    threads = sorted(e['args']['name'] for e in data['traceEvents']
                     if e['name'] == 'thread_name')
    assert threads == ['communication', 'serving', 'training']
    assert min(e['ts'] for e in data['traceEvents'] if e['ph'] == 'X') == 0
    assert data['otherData']['clock_error_us'] == {'worker 0': 80.0}
    read = load(path)
    assert [s.lane for s in read] == ['worker 0 training', 'server 0 serving',
                                      'worker 0 communication']
    assert breakdown(path)['worker 0 training'] == {'step': 500e-6}
    drawn = plot(path, steps=1)
    assert drawn._repr_png_().startswith(b'\x89PNG') and '3 lanes' in repr(drawn)
