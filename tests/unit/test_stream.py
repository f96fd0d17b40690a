"""Streams (the ring's own TCP links), in one process: what arrives, where, and what is
refused while the receiver goes on serving."""
import hashlib
import hmac
import socket
import threading
import time

import pytest
import torch

from d2ldist.runtime import stream
from d2ldist.runtime.van import Van

SECRET = 'a' * 64


@pytest.fixture
def vans():
    """Two vans, worker:0 and worker:1, not yet linked."""
    a, b = _vans()
    yield a, b
    a.close()
    b.close()


def _vans(mac_payload=False):
    a = Van('worker:0', SECRET, mac_payload=mac_payload)
    b = Van('worker:1', SECRET, mac_payload=mac_payload)
    return a, b


@pytest.fixture(params=[False, True], ids=['header MAC', 'payload MAC'])
def link(request):
    """worker:0 sends to worker:1 on a stream; also the ZeroMQ link, for other messages."""
    a, b = _vans(mac_payload=request.param)
    a.connect('worker:1', b.address)
    receiver = stream.listen(b, 'worker:0')
    sender = stream.connect(a, 'worker:1', b.host, receiver.offer())
    yield a, b, sender, receiver
    a.close()
    b.close()


def _recv(van, timeout=5):
    msg = van.recv(timeout=timeout)
    assert msg is not None, 'nothing arrived'
    return msg


def test_a_chunk_is_read_straight_into_its_place(link):
    a, b, sender, _ = link
    x = torch.arange(1_000_003, dtype=torch.float32)
    sender.send('ring', {'seg': 2, 'call': 'allreduce(Sum)'}, [x.view(torch.uint8).numpy()])
    msg = _recv(b)
    assert (msg.kind, msg.sender, msg['seg'], msg['call']) == ('ring', 'worker:0', 2,
                                                              'allreduce(Sum)')
    frame, = msg.frames
    assert isinstance(frame, stream.Pending) and frame.nbytes == x.nbytes
    out = torch.zeros(2_000_006)
    frame.read_into(out[1_000_003:].view(torch.uint8).numpy())   # into the output itself
    assert torch.equal(out[1_000_003:], x) and not out[:1_000_003].any()
    sender.flush()
    assert a.bytes_sent == b.bytes_received == x.nbytes


def test_messages_keep_their_order_and_the_next_waits_for_the_payload(link):
    _, b, sender, receiver = link
    chunks = [torch.full((n,), float(n)) for n in (0, 1, 70_000, 3, 2_000_000)]
    for i, x in enumerate(chunks):
        sender.send('ring', {'k': i}, [x.view(torch.uint8).numpy()])
    for i, x in enumerate(chunks):
        msg = _recv(b)
        assert msg['k'] == i
        assert receiver.fds() == []            # nothing more until this payload is read
        y = torch.empty_like(x)
        msg.frames[0].read_into(y.view(torch.uint8).numpy())
        assert torch.equal(x, y)
    sender.flush()
    assert b.recv(timeout=0.2) is None


def test_van_messages_and_stream_messages_arrive_side_by_side(link):
    a, b, sender, _ = link
    sender.send('ring', {'k': 0}, [torch.ones(10).view(torch.uint8).numpy()])
    a.send('worker:1', 'note', {'x': 1})
    kinds = set()
    for _ in range(2):
        msg = _recv(b)
        kinds.add(msg.kind)
        if msg.kind == 'ring':
            msg.frames[0].read_into(bytearray(40))
    assert kinds == {'ring', 'note'}


def test_a_payload_is_read_once_and_whole(link):
    _, b, sender, _ = link
    sender.send('ring', {}, [bytes(100)])
    frame = _recv(b).frames[0]
    with pytest.raises(ValueError, match='100 bytes'):
        frame.read_into(bytearray(99))
    frame.read_into(bytearray(100))
    with pytest.raises(ValueError, match='read before'):
        frame.read_into(bytearray(100))


def test_a_message_of_several_frames_is_read_frame_by_frame_in_order(link):
    _, b, sender, _ = link
    xs = [torch.arange(5.), torch.zeros(0), torch.full((300_000,), 2.),
          torch.ones(7, dtype=torch.int64)]
    sender.send('values', {'id': 3}, [x.view(torch.uint8).numpy() for x in xs])
    sender.send('values', {'id': 4}, [])                 # no frames at all
    msg = _recv(b)
    assert msg['id'] == 3 and [f.nbytes for f in msg.frames] == [x.nbytes for x in xs]
    with pytest.raises(ValueError, match='next to read: 0'):
        msg.frames[2].read_into(bytearray(xs[2].nbytes))
    for f, x in zip(msg.frames, xs):
        y = torch.empty_like(x)
        f.read_into(y.view(torch.uint8).numpy())
        assert torch.equal(x, y)
    assert _recv(b)['id'] == 4 and b.recv(timeout=0.2) is None


def test_an_answer_nobody_awaits_is_discarded_and_the_next_one_comes(link):
    _, b, sender, _ = link
    sender.send('values', {'id': 1}, [bytes(10), bytes(1 << 20)])
    sender.send('values', {'id': 2}, [b'abc'])
    msg = _recv(b)
    msg.frames[0].read_into(bytearray(10))              # half read, then given up
    stream.discard(msg)
    msg = _recv(b)
    assert msg['id'] == 2
    assert bytes(msg.frames[0].read_into(bytearray(3))) == b'abc'


def test_the_streams_own_header_fields_are_refused(link):
    _, _, sender, _ = link
    with pytest.raises(ValueError, match="the stream's own"):
        sender.send('x', {'sizes': [1]}, [b'a'])


def test_answers_of_two_streams_are_read_in_place_at_once(vans):
    """read_later: both answers' frames are read on threads while the van waits for the
    next message; the second message on a stream comes once its first is read."""
    a, b = vans
    c = Van('server:1', SECRET)
    try:
        senders = []
        for peer in (a, c):
            receiver = stream.listen(b, peer.node_id)
            senders.append(stream.connect(peer, 'worker:1', b.host, receiver.offer()))
        xs = [torch.randn(3_000_000), torch.randn(3_000_000)]      # 12 MB each
        for i, (sender, x) in enumerate(zip(senders, xs)):
            sender.send('values', {'i': i}, [x[:5].view(torch.uint8).numpy(),
                                             x[5:].view(torch.uint8).numpy()])
        senders[0].send('values', {'i': 2}, [b'next'])
        outs, readings, read, nexts = [torch.empty(3_000_000), torch.empty(3_000_000)], [], [], 0
        while len(read) < 2 or nexts < 1:
            msg = _recv(b)
            if msg.kind == stream.READ:    # the van says: a read_later of its peer ended
                read.append(msg.sender)
            elif msg['i'] == 2:            # (its stream's thread woke the van)
                assert bytes(msg.frames[0].read_into(bytearray(4))) == b'next'
                nexts += 1
            else:
                out = outs[msg['i']]
                readings.append(stream.read_later([
                    (msg.frames[0], out[:5].view(torch.uint8).numpy()),
                    (msg.frames[1], out[5:].view(torch.uint8).numpy())]))
        assert sorted(read) == ['server:1', 'worker:0'] and b.recv(timeout=0.2) is None
        for r in readings:
            r.wait()
        assert all(torch.equal(x, out) for x, out in zip(xs, outs))
    finally:
        c.close()


def test_a_stream_that_breaks_while_read_later_says_so_on_wait(vans):
    """A sender that ends in the middle of a payload: wait() raises in one line, the
    stream is closed, and the van goes on serving."""
    a, b = vans
    a.connect('worker:1', b.address)
    receiver = stream.listen(b, 'worker:0')
    raw, nonce = _raw_sender(b, receiver)
    head = b'{"kind":"values","sizes":[1000000]}'
    raw.sendall(_signed(nonce, 1, head, 1_000_000) + bytes(1000))   # 1000 of its bytes
    msg = _recv(b)
    reading = stream.read_later([(msg.frames[0], bytearray(1_000_000))])
    assert b.recv(timeout=0.3) is None     # a stalled sender: the van's wait times out
    raw.close()                            # (so a node's hang detector sees it), then
    assert _recv(b).kind == stream.READ    # the end of the reading is a message
    with pytest.raises(stream.StreamBroken, match='stream from worker 0 broke: the conn'):
        reading.wait()
    assert receiver not in b.streams and b.dropped == 1
    a.send('worker:1', 'note', {'x': 1})
    assert _recv(b).kind == 'note'


def test_flush_waits_until_a_big_message_is_written(vans):
    """A message larger than the socket takes at once is finished by the stream's
    thread, while the receiver reads; flush() returns after that."""
    a, b = vans
    receiver = stream.listen(b, 'worker:0')
    sender = stream.connect(a, 'worker:1', b.host, receiver.offer())
    x = torch.randn(16_000_000)                       # 64 MB
    sent = sender.send('ring', {}, [x.view(torch.uint8).numpy()])
    assert not sent()                                 # (the socket took a part only)
    got = {}

    def read():
        msg = _recv(b, timeout=20)
        y = torch.empty_like(x)
        msg.frames[0].read_into(y.view(torch.uint8).numpy())
        got['y'] = y
    reader = threading.Thread(target=read)
    reader.start()
    sender.flush()
    assert sent()                                     # its memory is free again
    reader.join(timeout=20)
    assert torch.equal(got['y'], x)


# -- what is refused -------------------------------------------------------------------
def _hello(sender_id, nonce, receiver_id, secret=SECRET):
    mac = stream._hello_mac(secret.encode(), nonce, sender_id, receiver_id)
    return len(sender_id).to_bytes(2, 'big') + sender_id.encode() + mac


def _raw_sender(van, receiver):
    """A hand-made sending end of the receiver's stream, past its hello: (socket, nonce)."""
    offer = receiver.offer()
    nonce = bytes.fromhex(offer['nonce'])
    raw = socket.create_connection((van.host, offer['port']))
    raw.sendall(_hello('worker:0', nonce, 'worker:1'))
    return raw, nonce


def _signed(nonce, number, head, nbytes):
    """Message ``number``'s prefix, MAC and header, for a payload of nbytes."""
    prefix = stream.PREFIX.pack(len(head), nbytes)
    return prefix + stream._message_mac(SECRET.encode(), nonce, number, prefix,
                                        head).digest() + head


def _closed(sock):
    """Whether the other side closed ``sock`` (a reset, if it left bytes unread)."""
    try:
        return sock.recv(10) == b''
    except ConnectionResetError:
        return True


def _serve_until(van, predicate, seconds=5):
    """Run the receiver's side (van.recv) until predicate() holds."""
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        van.recv(timeout=0.05)
    return predicate()


@pytest.mark.parametrize('hello', [
    lambda nonce: _hello('worker:0', nonce, 'worker:1', secret='b' * 64),   # wrong secret
    lambda nonce: _hello('worker:0', bytes(16), 'worker:1'),                # another nonce
    lambda nonce: _hello('worker:2', nonce, 'worker:1'),                    # another peer
    lambda nonce: b'\xff\xff' + bytes(100),                                 # an id too long
    lambda nonce: b'GET / HTTP/1.1\r\n\r\n',                               # a stranger
], ids=['wrong secret', 'replayed', 'other peer', 'oversized', 'stranger'])
def test_a_bad_hello_is_refused_and_the_listener_goes_on(vans, hello, capfd):
    a, b = vans
    receiver = stream.listen(b, 'worker:0')
    offer = receiver.offer()
    bad = socket.create_connection((b.host, offer['port']))
    bad.sendall(hello(bytes.fromhex(offer['nonce'])))
    assert _serve_until(b, lambda: b.dropped == 1)
    assert _closed(bad)
    assert 'dropped a message: stream from worker:0' in capfd.readouterr().err
    sender = stream.connect(a, 'worker:1', b.host, offer)     # the real peer still can
    sender.send('ring', {'k': 1}, [bytes(8)])
    msg = _recv(b)
    assert msg['k'] == 1 and msg.sender == 'worker:0'
    msg.frames[0].read_into(bytearray(8))


def test_a_silent_connection_does_not_stop_the_receiver(vans):
    """Someone connects and says nothing: the van still serves ZeroMQ and the peer."""
    a, b = vans
    a.connect('worker:1', b.address)
    receiver = stream.listen(b, 'worker:0')
    silent = socket.create_connection((b.host, receiver.port))
    a.send('worker:1', 'note', {'x': 1})
    assert _recv(b).kind == 'note'
    sender = stream.connect(a, 'worker:1', b.host, receiver.offer())
    sender.send('ring', {}, [bytes(4)])
    msg = _recv(b)
    assert msg.kind == 'ring'
    silent.close()


def test_a_flood_of_connections_is_refused_beyond_a_few_and_the_peer_gets_in(vans):
    a, b = vans
    receiver = stream.listen(b, 'worker:0')
    flood = [socket.create_connection((b.host, receiver.port))
             for _ in range(stream.MAX_HELLOS + 4)]
    assert _serve_until(b, lambda: b.dropped == 4)
    assert len(receiver._hellos) == stream.MAX_HELLOS
    sender = stream.connect(a, 'worker:1', b.host, receiver.offer())
    sender.send('ring', {'k': 7}, [bytes(3)])
    msg = _recv(b)
    assert msg['k'] == 7
    msg.frames[0].read_into(bytearray(3))
    assert receiver._hellos == {}                 # the peer is in: the rest are closed
    assert all(_closed(s) for s in flood)


def test_a_forged_message_closes_the_stream_and_the_van_goes_on(vans):
    """A message whose MAC fails (tampered in flight): logged, the stream is closed
    (it has lost its place), and the van keeps serving its other messages."""
    a, b = vans
    a.connect('worker:1', b.address)
    receiver = stream.listen(b, 'worker:0')
    offer = receiver.offer()
    raw = socket.create_connection((b.host, offer['port']))
    raw.sendall(_hello('worker:0', bytes.fromhex(offer['nonce']), 'worker:1'))
    head = b'{"kind":"ring","sizes":[4]}'
    prefix = stream.PREFIX.pack(len(head), 4)
    raw.sendall(prefix + hmac.new(b'b' * 64, head, hashlib.sha256).digest() + head + bytes(4))
    assert _serve_until(b, lambda: b.dropped == 1)
    assert receiver not in b.streams
    a.send('worker:1', 'note', {'x': 1})
    assert _recv(b).kind == 'note'
    raw.close()


def test_a_message_cannot_be_replayed_on_the_stream(vans):
    """The MAC covers the message's number: the same bytes sent twice fail the second time."""
    a, b = vans
    receiver = stream.listen(b, 'worker:0')
    raw, nonce = _raw_sender(b, receiver)
    raw.sendall(_signed(nonce, 1, b'{"kind":"ring","k":0,"sizes":[]}', 0) * 2)
    msg = _recv(b)
    assert msg['k'] == 0 and msg.frames == []
    assert _serve_until(b, lambda: b.dropped == 1)
    raw.close()


def test_a_sender_that_ends_closes_the_stream_quietly(link):
    a, b, sender, receiver = link
    sender.close()
    assert _serve_until(b, lambda: receiver not in b.streams)
    assert b.dropped == 0


def test_a_broken_stream_says_so_on_the_sending_side(vans):
    a, b = vans
    receiver = stream.listen(b, 'worker:0')
    sender = stream.connect(a, 'worker:1', b.host, receiver.offer())
    _serve_until(b, lambda: receiver._conn is not None)
    receiver.close()
    with pytest.raises(stream.StreamBroken, match='stream to worker 1 broke'):
        for _ in range(50):                       # until the kernel has said so
            sender.send('ring', {}, [bytes(1 << 20)])
            sender.flush()


def test_a_bad_offer_is_one_clear_error():
    a = Van('worker:0', SECRET)
    try:
        with pytest.raises(stream.StreamBroken, match='bad stream offer'):
            stream.connect(a, 'worker:1', '127.0.0.1', {'port': 'x'})
        with pytest.raises(stream.StreamBroken, match='cannot open a stream to worker 1'):
            stream.connect(a, 'worker:1', '127.0.0.1', {'port': 1, 'nonce': '00' * 16})
    finally:
        a.close()
