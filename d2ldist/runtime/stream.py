"""Streams: a TCP connection of its own between two nodes, for bulk bytes (after gloo's pairs).

A receiver that knows where a message's bytes belong (the ring's chunks, a pull's
answer) reads them with one ``recv_into`` there: no copy, no thread hop. A stream is
one-way: the receiver listens (``listen``) and sends an offer (a port, a nonce) over
the van; the sender connects (``connect``) and proves the job's secret in a hello. Then
every message is

    [header length: 4 bytes][payload length: 8 bytes][MAC: 32 bytes][JSON header][payload]

with a MAC over the nonce, the message's number and the header, so none can be forged,
replayed or reordered. The receiving end is one of the van's sources: ``Van.recv``
delivers its messages like any other, their frames ``Pending`` (``read_into``,
``discard``, ``read_later``). The reasoning: docs/design/runtime.md, "Streams".
"""
import hashlib
import hmac
import json
import queue
import secrets
import socket
import struct
import threading

from ..lines import clip, shown
from .van import Message, encoded

PREFIX = struct.Struct('!IQ')     # header length, payload length
MAC_BYTES = 32
HELLO = b'd2ldist stream 1'       # what the hello's MAC covers first
MAX_HEADER_BYTES = 64 * 1024
MAX_ID_BYTES = 255
MAX_HELLOS = 16                   # connections waiting to say hello, at most
MAX_FRAMES = 4096                 # frames in one message (the van's limit)
MAX_IOV = 512                     # buffers handed to one sendmsg call
CONNECT_SECONDS = 10.0
READ = 'stream_read'              # from the van itself: a read_later of this peer's ended


class StreamBroken(ConnectionError):
    """A stream's connection broke, or carried a message that failed its checks."""


def _mac(key, *parts):
    return hmac.new(key, b''.join(parts), hashlib.sha256)


def _hello_mac(key, nonce, sender, receiver):
    return _mac(key, HELLO, nonce, sender.encode(), b'\0', receiver.encode()).digest()


def _message_mac(key, nonce, number, prefix, head_bytes):
    """The MAC of a message's first part, to be fed its payload next (D2L_MAC_PAYLOAD)."""
    return _mac(key, nonce, number.to_bytes(8, 'big'), prefix, head_bytes)


def _head_digest(key, nonce, number, prefix, head_bytes):
    """The MAC of a message's first part when the payload is not covered: one call."""
    return hmac.digest(key, b''.join((nonce, number.to_bytes(8, 'big'), prefix, head_bytes)),
                       'sha256')


def _as_bytes(buffer):
    """A writable or readable buffer (a tensor's numpy view, bytes) as flat bytes."""
    return memoryview(buffer).cast('B')


# -- the receiving end ------------------------------------------------------------------
class Pending:
    """A received message's frame, still in the socket: ``read_into`` reads it."""

    def __init__(self, receiver, nbytes, index):
        self.receiver, self.nbytes, self.index, self.read = receiver, nbytes, index, False

    def read_into(self, buffer):
        """Read the frame into ``buffer`` (exactly nbytes, writable), after the message's
        frames before it; returns buffer."""
        self.receiver._read_frame(self._claim(buffer, self.receiver._next))
        return buffer

    def _claim(self, buffer, next_index):
        """``buffer`` as bytes, if it may take this frame when ``next_index`` is next."""
        view = _as_bytes(buffer)
        if view.nbytes != self.nbytes or self.read or next_index != self.index:
            raise ValueError(f'frame {self.index} of {self.nbytes} bytes is read once, in '
                             f'order, into as many (got {view.nbytes}; read before: '
                             f'{self.read}; next to read: {next_index})')
        self.read = True
        return view


def read_later(reads):
    """Start reading frames of one message, ``[(Pending, buffer), ...]`` in order, on a
    thread of their own; ``.wait()`` for them (raises StreamBroken if the stream broke)."""
    return Reading(reads[0][0].receiver, reads) if reads else Reading(None, [])


class Reading:
    """Frames of one message being read into place by a thread (``read_later``)."""

    def __init__(self, receiver, reads):
        self.receiver, self.error, self.done = receiver, None, False
        self._views = [frame._claim(buffer, receiver._next + i)
                       for i, (frame, buffer) in enumerate(reads)]
        self._thread = None
        if receiver is not None:
            receiver._reading = self
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name=f'd2ldist-read-{receiver.peer}')
            self._thread.start()

    def _run(self):
        try:
            for view in self._views:
                self.receiver._read_next(view)
        except StreamBroken as e:
            self.error = e
        finally:
            self.done = True
            self.receiver._wake()         # the van may wait on this stream's next message

    def wait(self):
        """Until every frame is in place; raises StreamBroken if the stream broke."""
        if self._thread is None:
            return
        self._thread.join()
        self.receiver._done_reading(self)


def discard(msg):
    """Read and drop what is left of a message's frames on its stream (an answer that is
    no longer awaited), so that the stream's next message can come."""
    for frame in msg.frames:
        if isinstance(frame, Pending) and not frame.read:
            frame.read_into(bytearray(frame.nbytes))


class Receiver:
    """The receiving end of one stream from ``peer``: a listener, then one connection."""

    def __init__(self, van, peer):
        self.van, self.peer = van, peer
        self.nonce = secrets.token_bytes(16)
        self._listener = socket.create_server((van.host, 0))
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._hellos = {}        # connections not yet authenticated -> bytes so far
        self._conn = None        # the authenticated connection
        self._number = 0         # messages received on it
        self._unread = None      # the last message's frames, while not all read
        self._next = 0           # the index of its next frame to read
        self.received = 0        # messages delivered
        self._reading = None     # the Reading of its frames on a thread, if any
        self._wake_r, self._wake_w = socket.socketpair()   # that thread: 'done'
        self._wake_r.setblocking(False)
        van.add_stream(self)

    def offer(self):
        """What the sender needs to connect: the port and the nonce (sent over the van)."""
        return {'port': self.port, 'nonce': self.nonce.hex()}

    def fds(self):
        """The sockets ``Van.recv`` waits on: the listener and hellos, or the connection
        (not while a payload is unread: the next message comes after it)."""
        if self._conn is not None:
            if self._reading is not None:     # a thread reads the frames: wait for it
                return [self._wake_r]
            return [] if self._unread is not None else [self._conn]
        return [self._listener, *self._hellos]

    def receive(self, sock):
        """``sock`` is readable: accept, read a hello, or read a message's header.
        Returns a Message (its frame ``Pending``) or None."""
        if sock is self._listener:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, OSError):
                return None
            conn.setblocking(False)
            self._hellos[conn] = b''
            if len(self._hellos) > MAX_HELLOS:       # a flood: the longest silent goes
                self._refuse(next(iter(self._hellos)),
                             f'more than {MAX_HELLOS} connections waiting to say hello')
        elif sock in self._hellos:
            self._hello(sock)
        elif sock is self._wake_r and self._reading is not None:
            if self._done_reading(self._reading, quiet=True):
                return Message(READ, self.peer, {}, [])
        elif sock is self._conn:
            return self._message()
        return None

    def _hello(self, conn):
        """Read what a new connection sent; keep it if its hello proves the secret.
        The hello is [id length: 2 bytes][id][MAC]; what follows it is the first message."""
        got = self._hellos[conn]
        size = 2 if len(got) < 2 else 2 + int.from_bytes(got[:2], 'big') + MAC_BYTES
        if size > 2 + MAX_ID_BYTES + MAC_BYTES:
            return self._refuse(conn, 'a hello with an id too long')
        try:
            more = conn.recv(size - len(got))
        except BlockingIOError:
            return
        except OSError:
            more = b''
        if not more:
            return self._refuse(conn, 'a connection closed before its hello')
        got = self._hellos[conn] = got + more
        if len(got) < 2 or len(got) < 2 + int.from_bytes(got[:2], 'big') + MAC_BYTES:
            return                               # the rest of the hello is on its way
        n = int.from_bytes(got[:2], 'big')
        sender, mac = got[2:2 + n].decode(errors='replace'), got[2 + n:]
        if sender != self.peer or not hmac.compare_digest(
                mac, _hello_mac(self.van.mac_key, self.nonce, sender, self.van.node_id)):
            return self._refuse(conn, f'a hello from {clip(sender, 40)!r} failed the check '
                                      '(wrong job secret?)')
        del self._hellos[conn]
        conn.setblocking(True)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._conn = conn
        for other in list(self._hellos):          # the peer is here: no one else is heard
            other.close()
        self._hellos.clear()
        self._listener.close()

    def _refuse(self, conn, why):
        self._hellos.pop(conn, None)
        conn.close()
        self.van.drop(f'stream from {self.peer}: {why}')

    def _message(self):
        """The next message's prefix and header, checked; its payload stays Pending."""
        try:
            first = self._recv_exactly(PREFIX.size + MAC_BYTES, eof_ok=True)
            if first is None:                     # the sender closed the stream: it ended
                return self.close()
            prefix, mac = first[:PREFIX.size], first[PREFIX.size:]
            head_len, nbytes = PREFIX.unpack(prefix)
            if head_len > MAX_HEADER_BYTES:
                raise StreamBroken('oversized header')
            head_bytes = self._recv_exactly(head_len)
        except StreamBroken as e:
            return self._lost(str(e))
        self._number += 1
        key, number = self.van.mac_key, self._number
        if self.van.mac_payload:                  # (the payload's MAC goes on from here)
            self._mac = _message_mac(key, self.nonce, number, prefix, head_bytes)
            expected = self._mac.digest()
        else:
            expected = _head_digest(key, self.nonce, number, prefix, head_bytes)
        if not hmac.compare_digest(mac, expected):
            return self._lost('bad MAC (wrong job secret?)')
        try:
            head = json.loads(head_bytes)
            kind, sizes = head['kind'], head['sizes']
        except (ValueError, KeyError, TypeError):
            return self._lost('malformed header')
        if not (isinstance(kind, str) and isinstance(sizes, list) and len(sizes) <= MAX_FRAMES
                and all(type(n) is int and n >= 0 for n in sizes) and sum(sizes) == nbytes):
            return self._lost('malformed header')
        frames = [Pending(self, n, i) for i, n in enumerate(sizes)]
        self._unread, self._next, self.received = frames, 0, self.received + 1
        if not frames:                            # (nothing to read: the MAC's tail only)
            self._read_frame(memoryview(b''))
        return Message(kind, self.peer, head, frames)

    def _read_frame(self, view):
        """``_read_next``, and if the stream broke, close it and say so in one line."""
        try:
            self._read_next(view)
        except StreamBroken as e:
            self._broke(e)

    def _read_next(self, view):
        """Read the next pending frame into ``view``; after the last, check the payload's
        MAC if the job MACs payloads. Raises StreamBroken if the connection broke or
        the check failed."""
        if view.nbytes:
            self._recv_exactly_into(view)
        if self.van.mac_payload:
            self._mac.update(view)
        self._next += 1
        if self._next >= len(self._unread):
            if self.van.mac_payload and not hmac.compare_digest(
                    self._recv_exactly(MAC_BYTES), self._mac.digest()):
                raise StreamBroken('bad payload MAC')
            self._unread = None

    def _wake(self):
        try:
            self._wake_w.send(b'.')
        except OSError:                   # (closed meanwhile)
            pass

    def _done_reading(self, reading, quiet=False):
        """On the van's thread, once ``reading``'s thread ended: the stream goes on, or,
        if it broke, is closed (and ``wait()`` says so; the van's wake-up does not).
        Whether it had ended."""
        try:
            while self._wake_r.recv(64):
                pass
        except OSError:
            pass
        if not reading.done:               # (a wake-up from an earlier reading)
            return False
        if self._reading is reading:
            self._reading = None
        if reading.error is not None and not quiet:
            self._broke(reading.error)
        return True

    def _broke(self, error):
        self._lost(str(error))
        raise StreamBroken(f'the stream from {shown(self.peer)} broke: {error}') from None

    def _recv_exactly(self, n, eof_ok=False):
        buf = bytearray(n)
        if self._recv_exactly_into(memoryview(buf), eof_ok) is None:
            return None
        return bytes(buf)

    def _recv_exactly_into(self, view, eof_ok=False):
        got = 0
        while got < view.nbytes:
            try:
                n = self._conn.recv_into(view[got:], view.nbytes - got, socket.MSG_WAITALL)
            except OSError as e:
                raise StreamBroken(str(e)) from None
            if n == 0:
                if got == 0 and eof_ok:
                    return None
                raise StreamBroken('the connection closed in the middle of a message')
            got += n
        return view

    def _lost(self, why):
        """A message failed a check, or the connection broke: it can't go on."""
        self.van.drop(f'stream from {self.peer}: {why}; its connection is closed')
        self.close()

    def close(self):
        """Close every socket; the van stops waiting on this stream."""
        for s in [self._listener, self._conn, *self._hellos, self._wake_r, self._wake_w]:
            if s is not None:
                s.close()
        self._hellos.clear()
        self._conn = self._unread = None
        self.van.remove_stream(self)


def listen(van, peer):
    """The receiving end of a stream from ``peer``; send it ``receiver.offer()``."""
    return Receiver(van, peer)


def listening(van, peer):
    """Whether the van already has a stream from ``peer``, or listens for one."""
    return any(isinstance(s, Receiver) and s.peer == peer for s in van.streams)


# -- the sending end --------------------------------------------------------------------
class Sender:
    """The sending end of one stream to ``peer``: a connection written by its own thread."""

    def __init__(self, van, peer, host, offer):
        self.van, self.peer = van, peer
        try:
            self.nonce, port = bytes.fromhex(offer['nonce']), int(offer['port'])
            self._sock = socket.create_connection((host, port), timeout=CONNECT_SECONDS)
        except (KeyError, TypeError, ValueError) as e:
            raise StreamBroken(f'a bad stream offer from {shown(peer)}: {e}') from None
        except OSError as e:
            raise StreamBroken(f'cannot open a stream to {shown(peer)} at {host}:{port}: '
                               f'{e}') from None
        self._sock.settimeout(None)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        me = van.node_id.encode()
        self._sock.sendall(len(me).to_bytes(2, 'big') + me +
                           _hello_mac(van.mac_key, self.nonce, van.node_id, peer))
        self._number, self.error = 0, None
        self._written = 0                 # messages the thread has written
        self._progress = threading.Condition()
        self._queue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write, daemon=True,
                                        name=f'd2ldist-stream-{peer}')
        self._thread.start()
        van.add_stream(self)

    def fds(self):
        return []                     # (nothing to receive)

    def send(self, kind, header, frames):
        """Send one message: its header and its frames, without a copy. What the socket
        takes at once is written here; the rest by the stream's thread, so the frames'
        memory must stay as it is until ``flush()``, or until the function returned says
        True (it has been written, or can no longer be)."""
        if self.error is not None:
            raise self.error
        if {'kind', 'sizes'} & set(header):
            raise ValueError("header fields 'kind' and 'sizes' are the stream's own")
        payload = [_as_bytes(f) for f in frames]
        sizes = [f.nbytes for f in payload]
        head_bytes = encoded(dict(header, kind=kind, sizes=sizes))
        prefix = PREFIX.pack(len(head_bytes), sum(sizes))
        self._number += 1
        key, number = self.van.mac_key, self._number
        if self.van.mac_payload:          # the thread feeds it the payload, then sends it
            mac = _message_mac(key, self.nonce, number, prefix, head_bytes)
            digest = mac.digest()
        else:
            digest = _head_digest(key, self.nonce, number, prefix, head_bytes)
        with self.van.send_lock:
            self.van.bytes_sent += sum(sizes)
        parts = [prefix + digest + head_bytes, *payload]
        sent = lambda: self._written >= number or self.error is not None  # noqa: E731
        if self.van.mac_payload:          # hashing the payload is the thread's work
            self._queue.put((parts, mac))
            return sent
        with self._progress:
            idle = self._written == self._number - 1     # the socket is ours now
        if idle:
            parts = self._write_some(parts)
            if not parts:
                with self._progress:
                    self._written += 1
                return sent
        self._queue.put((parts, None))
        return sent

    def _write_some(self, parts):
        """Write what the socket takes now without waiting; the parts left to write."""
        try:
            n = self._sock.sendmsg(parts[:MAX_IOV], [], socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError:
            return parts                  # (the thread will meet the error and say it)
        left = []
        for part in parts:
            if n >= len(part):
                n -= len(part)
            else:
                left.append(memoryview(part)[n:])
                n = 0
        return left

    def flush(self):
        """Wait until every message is in the kernel's hands; raises if the stream broke."""
        with self._progress:
            self._progress.wait_for(lambda: self._written == self._number or self.error)
        if self.error is not None:
            raise self.error

    def _write(self):
        """The stream's thread: write what is left of each queued message, in order."""
        while True:
            item = self._queue.get()
            if item is None:
                return
            parts, mac = item
            try:
                if mac is not None:           # the payload's MAC goes after it
                    for frame in parts[1:]:   # (hashlib lets go of the GIL for big buffers)
                        mac.update(frame)
                    parts.append(mac.digest())
                for part in parts:
                    self._sock.sendall(part)
            except OSError as e:
                self.error = StreamBroken(f'the stream to {shown(self.peer)} broke: {e}')
            with self._progress:
                self._written += 1
                self._progress.notify_all()

    def close(self):
        """Let queued messages go (their senders waited for them), then close."""
        self._queue.put(None)
        self._thread.join(timeout=2.0)
        self._sock.close()
        self.van.remove_stream(self)


def connect(van, peer, host, offer):
    """The sending end of a stream to ``peer`` at ``host``, with the receiver's offer."""
    return Sender(van, peer, host, offer)
