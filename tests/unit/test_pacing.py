"""The simulated network: units, the Pacer's model, and two vans over a paced link."""
import threading
import time

import pytest

from d2ldist import config
from d2ldist.config import Config
from d2ldist.runtime import pacing
from d2ldist.runtime.van import Van

SECRET = 'p' * 64


@pytest.mark.parametrize('text,rate', [
    ('1Gbit', 125e6), ('1Gbit/s', 125e6), ('100Mbit', 12.5e6), ('250Mbps', 31.25e6),
    ('100mbit', 12.5e6), ('800kbit', 1e5), ('100MB/s', 100e6), ('100MBps', 100e6),
    ('12.5MB', 12.5e6), ('1MiB/s', 2**20), ('2 GB/s', 2e9), ('1e9bit', 125e6),
    ('8b', 1.0), ('1Mb', 125e3)])
def test_bandwidth_units(text, rate):
    assert config.parse_bandwidth(text) == pytest.approx(rate)


@pytest.mark.parametrize('text,seconds', [
    ('0.5ms', 5e-4), ('200us', 2e-4), ('1s', 1.0), ('0', 0.0), ('2 ms', 2e-3), ('.5s', 0.5)])
def test_latency_units(text, seconds):
    assert config.parse_latency(text) == pytest.approx(seconds)


@pytest.mark.parametrize('text', ['1G', '100', 'fast', '0bit', '1Gbit/h', '-1MB/s', '1Gbpsps'])
def test_bad_bandwidths_are_refused(text):
    with pytest.raises(ValueError, match='bandwidth'):
        config.parse_bandwidth(text)


@pytest.mark.parametrize('text', ['5', '1 hour', '-1ms', 'ms'])
def test_bad_latencies_are_refused(text):
    with pytest.raises(ValueError, match='latency'):
        config.parse_latency(text)


def test_pacer_model():
    """Back-to-back messages queue on the link; latency is added once, not per message."""
    p = pacing.Pacer(rate=1e6, latency=0.1, burst=0)
    dues = [p.book(100_000, now=1000.0) for _ in range(5)]
    for i, (due, wait) in enumerate(dues, 1):
        assert due - 1000.0 == pytest.approx(0.1 * i + 0.1)   # i transmissions + latency
        assert wait == pytest.approx(0.1 * i)                 # no bucket: wait for the wire
    assert p.book(100_000, now=2000.0) == pytest.approx((2000.2, 0.1))   # an idle link
    bucket = pacing.Pacer(rate=1e6, latency=0, burst=300_000)
    waits = [bucket.book(100_000, now=1000.0)[1] for _ in range(5)]
    assert waits == pytest.approx([0, 0, 0, 0.1, 0.2], abs=1e-9)
    assert pacing.Pacer(rate=None, latency=0.01).book(10**9)[1] == 0   # latency only


@pytest.fixture
def paced_pair():
    def make(bandwidth, latency):
        link = Config.from_env({'D2L_BANDWIDTH': bandwidth, 'D2L_LATENCY': latency})
        a = Van('worker:0', SECRET, cfg=link)
        b = Van('worker:1', SECRET, cfg=Config())
        a.connect('worker:1', b.address)
        made.append((a, b))
        return a, b
    made = []
    yield make
    for a, b in made:
        a.close()
        b.close()


def received_late_enough(msgs, arrivals):
    """Whether every message arrived at its due time (sent + delay) or after, never before."""
    return all(t >= m['sent'] + m['delay'] - 1e-6 for m, t in zip(msgs, arrivals))


def test_paced_van_follows_the_model(paced_pair):
    """10 x 200 KB at 10 MB/s with 50 ms latency: 0.2 s on the wire + 0.05 s, once.

    What the link model says is checked exactly (each message's delivery time, from
    when it was sent); what a busy machine stretches -- how late a thread wakes -- only
    as an order: a message never arrives before its time, and not long after it."""
    a, b = paced_pair('10MB/s', '50ms')
    assert a.pacer is not None and b.pacer is None
    frame, msgs, arrivals = bytes(200_000), [], []

    def receive():
        for i in range(10):
            msgs.append(b.recv(timeout=5))
            arrivals.append(time.time())
            assert msgs[-1]['i'] == i
    receiver = threading.Thread(target=receive)
    t0 = time.time()
    receiver.start()
    for i in range(10):
        a.send('worker:1', 'bulk', {'i': i}, [frame])
    sent = time.time() - t0
    receiver.join(timeout=10)
    assert len(arrivals) == 10
    per = (200_000 + 256) / 10e6
    free = 0.0                                  # the link model, replayed from the send times
    for m in msgs:
        free = max(m['sent'], free) + per
        assert m['sent'] + m['delay'] == pytest.approx(free + 0.05, abs=1e-6)
    assert received_late_enough(msgs, arrivals)
    assert arrivals[-1] - t0 >= 10 * per + 0.05 - 1e-3       # the wire's pace, at least
    assert max(t - m['sent'] - m['delay'] for m, t in zip(msgs, arrivals)) < 0.5
    # the sender waits for its bucket only (0.2 s - 50 ms of burst), never for latency
    assert 10 * per - a.pacer.burst / 10e6 - 0.03 < sent < 10 * per - a.pacer.burst / 10e6 + 0.3


def test_latency_is_not_serialized(paced_pair):
    """Small messages in flight together all arrive one latency later, not 20 latencies."""
    a, b = paced_pair('1Gbit', '100ms')
    t0 = time.time()
    for i in range(20):
        a.send('worker:1', 'small', {'i': i})
    msgs, arrivals = [], []
    for _ in range(20):
        msgs.append(b.recv(timeout=5))
        arrivals.append(time.time())
    assert [m['i'] for m in msgs] == list(range(20))
    assert all(m['delay'] == pytest.approx(0.1, abs=1e-4) for m in msgs)   # latency, once each
    assert received_late_enough(msgs, arrivals)          # nothing before its time
    assert 0.1 <= arrivals[-1] - t0 < 0.1 + 0.5          # serialized would be 2 s


def test_unshaped_messages_overtake_held_ones(paced_pair):
    """Held messages wait for their time; a message from an unshaped van does not."""
    a, b = paced_pair('1Gbit', '200ms')
    c = Van('worker:2', SECRET, bind=False)
    c.connect('worker:1', b.address)
    try:
        a.send('worker:1', 'slow')
        time.sleep(0.02)
        c.send('worker:1', 'fast')
        assert b.recv(timeout=1).kind == 'fast'
        assert b.recv(timeout=1).kind == 'slow'
    finally:
        c.close()


def test_every_process_of_a_job_gets_the_link():
    """d2l-launch (and %launch, which uses the same parse and make_job) sets the link for
    the scheduler, every server and every worker, as plain numbers."""
    from d2ldist.launch import cli
    job = cli.make_job(cli.parse(['--bandwidth', '100MB/s', '--latency', '1ms', '-n', '2',
                                  '-s', '1', 'python', '-c', 'pass'], prog='%launch'))
    specs = [proc.spec for proc in job.procs]
    assert len(specs) == 4
    for spec in specs:
        assert pacing.pacer_of(Config.from_env(spec.env)).rate == 100e6
        assert pacing.pacer_of(Config.from_env(spec.env)).latency == pytest.approx(1e-3)
    assert pacing.pacer_of(Config()) is None
