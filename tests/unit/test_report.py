"""The report-line protocol: the writer, the parser (robust to garbage) and d2l-launch's progress."""
import io
import json
import time

import pytest

import d2ldist
from d2ldist.launch.processes import ProcSpec
from d2ldist.launch.progress import Progress
from d2ldist.report import PREFIX, Rate, fraction_done, parse_report


def test_report_writes_one_versioned_line(capsys, use_config):
    use_config({'D2L_ROLE': 'worker'})
    d2ldist.report(epoch=1, num_epochs=3, batch=7, num_batches=10, loss=0.5, acc=0.75,
                   samples=448, step_times={'push': 0.002, 'pull': 0.001})
    out = capsys.readouterr().out
    assert out.count('\n') == 1 and out.startswith('@d2l/1 {')
    record = parse_report(out.rstrip('\n'))
    assert abs(record.pop('time') - time.time()) < 5      # the worker's clock, for rates
    assert record == {
        'epoch': 1, 'num_epochs': 3, 'batch': 7, 'num_batches': 10, 'loss': 0.5,
        'acc': 0.75, 'samples': 448, 'step_times': {'push': 0.002, 'pull': 0.001}}


def test_report_alone_prints_for_people(capsys, use_config):
    use_config({})
    d2ldist.report(epoch=2, num_epochs=5, loss=0.25)
    assert capsys.readouterr().out == 'epoch 2/5 loss 0.250\n'


def test_report_rejects_unknown_fields():
    with pytest.raises(TypeError, match='lsos'):
        d2ldist.report(lsos=1.0)


@pytest.mark.parametrize('line', [
    '', 'hello', '@d2l/1', '@d2l/1 ', '@d2l/1 {', '@d2l/1 [1, 2]', '@d2l/1 "x"', '@d2l/1 null',
    '@d2l/2 {"epoch": 1}', ' @d2l/1 {"epoch": 1}', '@d2l/1 {"epoch": 1}}}',
    PREFIX + '{"a": ' * 100000, '\x00\xff@d2l/1 {}', None, 42,
])
def test_parser_ignores_garbage(line):
    assert parse_report(line) is None


def test_parser_keeps_only_good_fields():
    line = PREFIX + json.dumps({
        'epoch': 2, 'num_epochs': '5', 'batch': 3.0, 'num_batches': 2.5, 'loss': 'NaN',
        'acc': True, 'test_acc': 0.5, 'samples': -1, 'extra': 1, 'step_times': [0.1, 'x', -1, 2]})
    assert parse_report(line) == {'epoch': 2, 'batch': 3, 'test_acc': 0.5, 'samples': -1,
                                  'step_times': {'step 1': 0.1, 'step 4': 2.0}}
    assert parse_report(PREFIX + '{"loss": Infinity, "acc": NaN}') == {}
    assert parse_report(PREFIX + '{"step_times": {"a": "b"}}') == {}


def test_fraction_done_and_rate():
    assert fraction_done({'epoch': 1, 'num_epochs': 4, 'batch': 5, 'num_batches': 10}) == 0.125
    assert fraction_done({'epoch': 4, 'num_epochs': 4}) == 1.0
    assert fraction_done({'batch': 3}) is None
    rate = Rate(window=5)
    assert rate.add(0.0, 0) is None
    assert rate.add(1.0, 100) == 100
    assert rate.add(2.0, 300) == 150
    assert rate.add(3.0, 50) is None            # the count restarted
    assert rate.add(4.0, 150) == 100


def test_rates_use_the_workers_clock_not_arrival_times():
    now = [0.0]
    out = io.StringIO()
    progress = Progress(out, tty=False, clock=lambda: now[0])
    w0 = FakeProc('worker 0')
    for batch in range(1, 11):          # sent 0.1 s apart, all read at once
        progress.on_line(w0, report_line(epoch=1, num_epochs=1, batch=batch, num_batches=10,
                                         samples=64 * batch, time=1000 + 0.1 * batch))
    assert out.getvalue().splitlines()[-1].endswith(' 640 samples/s')


class FakeProc:
    """What the launcher's hooks get: a process's label and spec."""
    def __init__(self, label):
        role, rank = label.split()
        self.label, self.spec = label, ProcSpec(role, int(rank))


def report_line(**fields):
    return PREFIX + json.dumps(fields)


def test_progress_plain_lines_are_throttled():
    now = [0.0]
    out = io.StringIO()
    progress = Progress(out, tty=False, clock=lambda: now[0])
    w0 = FakeProc('worker 0')
    assert progress.on_line(w0, 'hello') == 'hello'
    for batch in range(1, 11):                  # 10 reports in one second, one epoch
        now[0] += 0.1
        assert progress.on_line(w0, report_line(epoch=1, num_epochs=2, batch=batch,
                                                num_batches=10, samples=64 * batch)) is None
    lines = out.getvalue().splitlines()
    assert len(lines) == 2                      # the first report and the epoch's end
    assert lines[0].startswith('[worker 0] [#') and 'epoch 1/2 batch 1/10' in lines[0]
    assert ' 50% epoch 1/2 batch 10/10' in lines[1] and '640 samples/s' in lines[1]
    progress.on_line(w0, report_line(test_acc=0.5))   # merged with what came before
    assert 'batch 10/10' in out.getvalue().splitlines()[-1]
    assert 'test_acc 0.500' in out.getvalue().splitlines()[-1]


def test_progress_in_a_terminal_redraws_in_place():
    out = io.StringIO()
    progress = Progress(out, tty=True)
    w0, w1 = FakeProc('worker 0'), FakeProc('worker 1')
    progress.on_line(w0, report_line(epoch=1, num_epochs=1, batch=1, num_batches=2))
    progress.on_line(w1, report_line(epoch=1, num_epochs=1, batch=1, num_batches=2))
    progress.write('[worker 0] a log line\n')
    progress.on_line(w0, report_line(epoch=1, num_epochs=1, batch=2, num_batches=2))
    screen = out.getvalue()
    # each redraw moves up over the block and erases it; the log line lands above the block
    assert screen.count('\x1b[1F\x1b[J') == 1 and screen.count('\x1b[2F\x1b[J') == 2
    last = screen.rsplit('\x1b[J', 1)[1]
    assert last.splitlines() == ['[worker 0] [################] 100% epoch 1/1 batch 2/2',
                                 '[worker 1] [########--------]  50% epoch 1/1 batch 1/2']
    assert '[worker 0] a log line\n[worker 0] [' in screen
