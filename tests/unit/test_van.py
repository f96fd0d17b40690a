"""The van and the wire format, in one process: what is accepted and what is dropped."""
import json
import os

import pytest
import torch
import zmq

from d2ldist.runtime.van import Van
from d2ldist.runtime.wire import DTYPES, pack, unpack

SECRET = 'a' * 64


@pytest.fixture
def pair():
    a, b = Van('worker:0', SECRET), Van('worker:1', SECRET)
    a.connect('worker:1', b.address)
    b.connect('worker:0', a.address)
    yield a, b
    a.close()
    b.close()


def test_a_message_with_tensors_arrives_intact(pair):
    a, b = pair
    tensors = [torch.arange(10.), torch.zeros(0), torch.ones(3, 4, dtype=torch.int64)[:, 1:],
               torch.randn(100_000), torch.tensor(7, dtype=torch.uint8)]
    metas, frames = zip(*(pack(t) for t in tensors))
    a.send('worker:1', 'push', {'key': 'w', 'metas': metas}, frames)
    msg = b.recv(timeout=5)
    assert (msg.kind, msg.sender, msg['key']) == ('push', 'worker:0', 'w')
    got = [unpack(m, f) for m, f in zip(msg['metas'], msg.frames)]
    for t, g in zip(tensors, got):
        assert g.dtype == t.dtype and torch.equal(g, t)
    got[3].add_(1)   # received frames are writable and shared, not copied
    assert torch.equal(unpack(msg['metas'][3], msg.frames[3]), tensors[3] + 1)


def test_a_peer_on_another_host_is_told_and_its_big_frames_tracked_until_they_left(pair):
    """leaves_host: the kv worker pushes to such servers in turn (van.wait_sent)."""
    a, b = pair                                     # (connected as if on other hosts)
    a.connect('worker:2', b.address, same_host=True)
    assert a.leaves_host('worker:1') and not a.leaves_host('worker:2')
    trackers = a.send('worker:1', 'push', {}, [bytes(10), bytes(1 << 20)], track=True)
    assert len(trackers) == 1                       # the big frame's (a small one is copied)
    assert b.recv(timeout=5).frames[1].nbytes == 1 << 20
    assert a.wait_sent(trackers, timeout=5)


def test_receiving_and_sending_have_io_threads_of_their_own(pair):
    a, _ = pair
    if a._ctx.get(zmq.IO_THREADS) < 2:     # (the first van of the process set the context)
        pytest.skip('this process made its ZeroMQ context with one I/O thread')
    assert a._router.get(zmq.AFFINITY) == 1
    assert a._peers['worker:1'].get(zmq.AFFINITY) == 2


def test_an_application_may_not_write_the_vans_own_header_fields(pair):
    a, b = pair
    for field in ('shm', 'sizes', 'delay', 'from'):
        with pytest.raises(ValueError, match=f"'{field}'.* the van's own"):
            a.send('worker:1', 'x', {field: 1})
    a.send('worker:1', 'x', {'key': 1})              # and it goes on sending
    assert b.recv(timeout=5)['key'] == 1


def test_payload_mac_mode_also_works():
    a = Van('worker:0', SECRET, mac_payload=True)
    b = Van('worker:1', SECRET, mac_payload=True)
    try:
        a.connect('worker:1', b.address)
        a.send('worker:1', 'x', {}, [pack(torch.arange(1000.))[1]])
        assert b.recv(timeout=5).kind == 'x'
    finally:
        a.close()
        b.close()


def test_every_dtype_round_trips():
    for dtype in DTYPES.values():
        t = (torch.arange(12) % 2).to(dtype).view(3, 4)
        meta, frame = pack(t)
        assert torch.equal(unpack(meta, memoryview(frame).cast('B')), t)


@pytest.mark.parametrize('meta, size', [
    ({'dtype': 'object', 'shape': [1]}, 8),
    ({'dtype': 'float32', 'shape': [3]}, 8),
    ({'dtype': 'float32', 'shape': [-1, -2]}, 8),
    ({'dtype': 'float32'}, 8),
    ({'dtype': 'float32', 'shape': 'abc'}, 8),
])
def test_unpack_refuses_bad_descriptions(meta, size):
    with pytest.raises(ValueError):
        unpack(meta, bytearray(size))


def _raw(b):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 1000)
    s.connect(b.address)
    return s


def test_forged_malformed_and_replayed_messages_are_dropped(pair):
    a, b = pair
    import hashlib
    import hmac
    raw = _raw(b)
    good = json.dumps({'kind': 'x', 'from': 'worker:0', 'seq': 1, 'session': 's',
                       'sizes': []}).encode()
    mac = hmac.new(SECRET.encode(), good, hashlib.sha256).digest()
    raw.send_multipart([mac, good])                      # valid, from a raw socket
    assert b.recv(timeout=5).kind == 'x'
    raw.send_multipart([mac, good])                      # the same again: a replay
    raw.send_multipart([b'x' * 32, good.replace(b'"seq":1', b'"seq":2')])   # wrong MAC
    bad_json = b'{"kind": '
    raw.send_multipart([hmac.new(SECRET.encode(), bad_json, hashlib.sha256).digest(), bad_json])
    lying = json.dumps({'kind': 'x', 'from': 'w', 'seq': 3, 'session': 's',
                        'sizes': [10]}).encode()         # says 10 bytes, sends 4
    raw.send_multipart([hmac.new(SECRET.encode(), lying, hashlib.sha256).digest(), lying,
                        b'abcd'])
    raw.send(b'lonely')                                  # one part only
    assert b.recv(timeout=1) is None
    assert b.dropped == 5
    a.send('worker:1', 'still', {})                      # and it keeps serving
    assert b.recv(timeout=5).kind == 'still'
    raw.close()


def test_empty_secret_is_refused():
    with pytest.raises(ValueError, match='secret'):
        Van('x', '')


def test_environment_yml_lists_the_same_dependencies():
    import re
    import tomllib
    from support import ROOT as root
    with open(os.path.join(root, 'pyproject.toml'), 'rb') as f:
        project = tomllib.load(f)['project']
    wanted = set(project['dependencies'])
    for extra in project['optional-dependencies'].values():
        wanted |= set(extra)
    text = open(os.path.join(root, 'environment.yml')).read()
    pip_section = text.split('- pip:', 1)[1]
    listed = set(re.findall(r'^\s+- (\S.*?)\s*$', pip_section, re.M))
    listed.discard('-e .')
    assert listed == wanted
