"""The van: how nodes of a job send each other messages (after ps-lite's Van).

Every node binds one ZeroMQ ROUTER socket and receives everything there; to talk to
a peer it connects a DEALER socket to the peer's ROUTER. A message on the wire is

    [mac, header, frame 0, frame 1, ...]

``header`` is UTF-8 JSON: the ``kind``, the sender (``from``), a per-sender sequence
number (``seq``), the byte size of each frame (``sizes``) and the application's own
fields. The frames are raw tensor bytes, sent and received without copies. ``mac`` is
HMAC-SHA256 of the header under the job's secret: nobody without it can forge or replay
a message. A message that fails a check is dropped with a log line.

``Van.send`` and ``Van.recv`` are the plain path. Beside it: big frames to a peer on
this host go through shared memory (shm.py), a simulated link holds messages until they
would arrive (pacing.py), and a stream (stream.py) is one more source ``recv`` waits on.
The reasoning: docs/design/runtime.md.
"""
import ctypes
import hashlib
import hmac
import itertools
import json
import platform
import secrets
import sys
import threading
import time

import zmq

from .. import config
from . import shm
from .pacing import Held, pacer_of

MAX_HEADER_BYTES = 64 * 1024   # a header is small: kinds, keys, shapes
MAX_FRAMES = 4096              # data frames in one message
MAC_BYTES = 32                 # HMAC-SHA256
# The header fields the van writes itself; an application's header may not use them
VAN_FIELDS = frozenset({'kind', 'from', 'seq', 'session', 'sizes', 'shm', 'sent', 'delay'})
LINGER_SECONDS = 2.0           # how long close() lets queued messages leave


_compact = json.JSONEncoder(separators=(',', ':')).encode   # (made once, not per message)


def encoded(head):
    """A message's header as it goes on the wire: compact JSON."""
    return _compact(head).encode()


# the van's fields every message received must have, with their types (header_of)
HEADER = {'kind': str, 'from': str, 'seq': int, 'session': str}


def header_of(head_bytes):
    """A received header's JSON if it is an object with the HEADER fields, else None."""
    try:
        head = json.loads(head_bytes)
    except ValueError:                      # (not UTF-8, not JSON)
        return None
    if isinstance(head, dict) and all(isinstance(head.get(f), t) for f, t in HEADER.items()):
        return head
    return None


def mac_of(key, head_bytes, frames=()):
    """The MAC of a message: HMAC-SHA256 of its header (and of ``frames``, if given)."""
    if not frames:                          # one call into OpenSSL
        return hmac.digest(key, head_bytes, 'sha256')
    mac = hmac.new(key, head_bytes, hashlib.sha256)
    for f in frames:
        mac.update(f)
    return mac.digest()


_kept = False   # keep_freed_memory() has run in this process


def keep_freed_memory():
    """Ask glibc to keep freed message buffers for the next ones (elsewhere: nothing).

    ZeroMQ mallocs a fresh buffer for every received frame and frees it once used. By
    default glibc serves a big block with a fresh mmap and unmaps it on free, so every
    message faults in all its pages again and the kernel zeroes them: thousands of page
    faults a step, 5-10 % of the CPU in a profile. Serving blocks up to 32 MB from the
    heap and not trimming it reuses the same pages instead.
    """
    global _kept
    if not _kept and platform.system() == 'Linux' and platform.libc_ver()[0] == 'glibc':
        _kept = True
        libc = ctypes.CDLL(None)
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)      # the largest glibc accepts
        libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)


class Message:
    """One message: its kind, its sender, the header fields and raw data frames."""

    def __init__(self, kind, sender, header, frames):
        self.kind, self.sender, self.header, self.frames = kind, sender, header, frames

    def __getitem__(self, name):
        return self.header[name]

    def get(self, name, default=None):
        return self.header.get(name, default)

    def __repr__(self):
        return f'Message({self.kind!r} from {self.sender!r}, {len(self.frames)} frames)'


class Van:
    """Authenticated messages between the nodes of one job, over ZeroMQ.

    ``cfg``: the settings it follows (the MAC, ZeroMQ's threads, the simulated link,
    shared memory); by default this process's, ``config.get()``."""

    def __init__(self, node_id, secret, host='127.0.0.1', port=0, bind=True,
                 max_message_bytes=-1, mac_payload=None, shaped=True, cfg=None):
        cfg = config.get() if cfg is None else cfg
        self.node_id = node_id
        # the job's secret: the key of every MAC, the van's and its streams' (stream.py)
        self.mac_key = secret.encode() if isinstance(secret, str) else bytes(secret)
        if not self.mac_key:
            raise ValueError('the job secret is empty (set D2L_JOB_SECRET)')
        self.mac_payload = cfg.mac_payload if mac_payload is None else mac_payload
        keep_freed_memory()   # received frames reuse the same pages (once a process)
        # ZeroMQ's I/O threads do the socket calls, and so the kernel's copies of every
        # byte in and out. With two, one receives (the ROUTER) and one sends (the
        # DEALERs), so a ring worker's copies in and out run on two cores at once, as
        # gloo's receiving and sending threads do. D2L_ZMQ_IO_THREADS=1: one does both.
        self._ctx = zmq.Context.instance(io_threads=cfg.zmq_io_threads)
        both = self._ctx.get(zmq.IO_THREADS) >= 2      # (the first van set the context)
        self._affinity = {'receive': 1 if both else 0, 'send': 2 if both else 0}
        self._session = secrets.token_hex(4)   # tells this van's sequence apart
        self._seq = itertools.count(1)
        self.send_lock = threading.Lock()      # one sender at a time keeps seq in order
        self._peers = {}                       # peer id -> connected DEALER socket
        self._last_seq = {}                    # (sender, session) -> last seq seen
        self._dropped, self._last_log = 0, 0.0
        self.bytes_sent = self.bytes_received = 0   # data frames only (headers aside)
        # the simulated link (None: the real network only) and the messages held
        # until their simulated delivery time: a heap of (due, arrival, message)
        self.pacer = pacer_of(cfg) if shaped else None
        self._held = Held()
        # shared memory with peers on this host (not under a simulated link: it must
        # carry the bytes): our blocks, the peers that may use them, others' blocks
        self.shm = shm.Pool() if shm.enabled(cfg) and self.pacer is None else None
        self._shm_peers, self._shm_maps = set(), shm.Mapper()
        self._near = set()                     # the peers on this host (shm or not)
        self.streams = []                      # stream.py's ends (the ring's, kv's links)
        self._poller = self._polled = None   # recv's poller while the streams' sockets stay
        self.host, self.port, self._router = host, None, None
        if bind:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.setsockopt(zmq.AFFINITY, self._affinity['receive'])
            self._router.setsockopt(zmq.RCVHWM, 0)
            self._router.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
            if port:
                self._router.bind(f'tcp://{host}:{port}')
                self.port = port
            else:
                self.port = self._router.bind_to_random_port(f'tcp://{host}')

    @property
    def address(self):
        """The address peers connect to."""
        return f'tcp://{self.host}:{self.port}'

    # -- sending ---------------------------------------------------------------
    def connect(self, peer_id, address, same_host=False):
        """Open (or replace) the link to a peer's ROUTER; ``same_host``: big frames to
        it may go through shared memory."""
        with self.send_lock:
            self._shm_peers.discard(peer_id)
            self._near.discard(peer_id)
            if same_host:
                self._near.add(peer_id)
            if same_host and self.shm is not None:
                self._shm_peers.add(peer_id)
            old = self._peers.pop(peer_id, None)
            if old is not None:
                old.close(linger=0)
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, int(LINGER_SECONDS * 1000))   # let goodbyes leave
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.AFFINITY, self._affinity['send'])
            sock.connect(address)
            self._peers[peer_id] = sock

    def give_up_on(self, peer_id):
        """A peer is gone (elastic: lost): what is still queued for it is dropped when the
        van closes, instead of holding the process LINGER_SECONDS for nobody."""
        with self.send_lock:
            if peer_id in self._peers:
                self._peers[peer_id].setsockopt(zmq.LINGER, 0)

    def is_connected(self, peer_id):
        return peer_id in self._peers

    def leaves_host(self, peer_id):
        """Whether messages to the peer cross a link to another host (which then limits
        them, rather than this host's copies)."""
        return peer_id not in self._near and self.pacer is None

    def through_socket(self, peer_id):
        """Whether big frames to the peer cross a real socket: not through shared
        memory, not over a simulated link (where a stream may carry them instead)."""
        return peer_id not in self._shm_peers and self.pacer is None

    def add_stream(self, stream):
        """Wait on a stream's sockets in recv (stream.py), and close it with the van."""
        self.streams.append(stream)

    def remove_stream(self, stream):
        if stream in self.streams:
            self.streams.remove(stream)

    def send(self, peer_id, kind, header=None, frames=(), track=False):
        """Send a message to a peer; frames are bytes-like (tensor memory, no copy).
        ``track=True``: the trackers of the frames sent without a copy (``wait_sent``:
        once they are done, the caller may overwrite that memory)."""
        frames = [memoryview(f).cast('B') for f in frames]
        taken = VAN_FIELDS.intersection(header or ())
        if taken:
            raise ValueError(f'header fields {sorted(taken)} are the van\'s own: rename them')
        with self.send_lock:
            head = dict(header or {}, kind=kind, seq=next(self._seq),
                        session=self._session, sizes=[f.nbytes for f in frames])
            self.bytes_sent += sum(head['sizes'])
            head['from'] = self.node_id
            if peer_id in self._shm_peers:   # big frames: copied to shared memory
                frames = self._share(frames, head)
            wait = self.pacer.stamp(head) if self.pacer is not None else 0.0  # simulated link
            trackers = self._put(self._peers[peer_id], encoded(head), frames, track)
        if wait > 0:                     # the token bucket is empty: wait for tokens
            time.sleep(wait)
        return trackers

    def _put(self, sock, head_bytes, frames, track):
        """Put one message on a peer's socket; the trackers of its big frames if ``track``."""
        sock.send(self._mac(head_bytes, frames), zmq.SNDMORE)
        sock.send(head_bytes, zmq.SNDMORE if frames else 0)
        trackers = []
        for i, f in enumerate(frames):
            small = f.nbytes < 64 * 1024   # copying small frames is cheaper
            more = zmq.SNDMORE if i < len(frames) - 1 else 0
            tracker = sock.send(f, more, copy=small, track=track and not small)
            if track and not small:
                trackers.append(tracker)
        return trackers

    @staticmethod
    def wait_sent(trackers, timeout):
        """Wait until the frames of a ``send(track=True)`` have left for the kernel, in
        order; False once one has not left ``timeout`` seconds after the one before (a
        peer that stopped reading is the hang detector's business, not this wait's)."""
        try:
            for tracker in trackers:
                tracker.wait(timeout)
        except zmq.NotDone:
            return False
        return True

    def _share(self, frames, head):
        """Put the big frames in shared memory, and where they lie in ``head['shm']``:
        the frames to send (those shared go empty)."""
        frames, where = self.shm.share(frames)
        if where:
            head['shm'] = where
        return frames

    def _mac(self, head_bytes, frames):
        return mac_of(self.mac_key, head_bytes, frames if self.mac_payload else ())

    # -- receiving -------------------------------------------------------------
    def recv(self, timeout=None):
        """The next valid message, or None after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if self._held:               # a simulated link: the first one due goes first
                msg, left = self._held.first(left)
                if msg is not None:
                    return msg
            msg = self._next(None if left is None else int(left * 1000))
            if msg is None:
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                continue
            self.bytes_received += sum(f.nbytes for f in msg.frames)
            if 'delay' not in msg.header and not self._held:
                return msg               # the real network only: deliver now
            self._held.hold(msg)         # until it would arrive over the simulated link

    def _next(self, ms):
        """Wait up to ``ms`` milliseconds for the ROUTER socket (and the streams); the
        message that came (checked), or None."""
        if self.streams:
            return self._next_of_all(ms)
        return self._from_router() if self._router.poll(ms) else None

    def _next_of_all(self, ms):
        """_next with the streams' sockets polled beside the ROUTER socket."""
        socks = [(stream, sock) for stream in self.streams for sock in stream.fds()]
        if not socks:                    # (no stream has anything to read now)
            return self._from_router() if self._router.poll(ms) else None
        if self._poller is None or self._polled != socks:   # (kept while they stay)
            self._poller, self._polled = zmq.Poller(), socks
            self._poller.register(self._router, zmq.POLLIN)
            for _, sock in socks:
                self._poller.register(sock, zmq.POLLIN)
        events = dict(self._poller.poll(ms))
        if self._router in events:
            return self._from_router()
        for stream, sock in socks:
            if sock.fileno() in events:
                return stream.receive(sock)   # (None if it was a connection or a hello)
        return None

    def _from_router(self):
        parts = self._router.recv_multipart(copy=False)
        return self._check(parts[1:])    # parts[0] is ZeroMQ's routing id

    def _check(self, parts):
        """The Message if ``parts`` are a valid message, else None (dropped with a log
        line): the MAC first, then the header, its sequence number and the frames."""
        if len(parts) < 2 or len(parts) > 2 + MAX_FRAMES:
            return self.drop(f'{len(parts)} parts')
        mac, head_bytes, frames = parts[0].bytes, parts[1].bytes, parts[2:]
        if len(head_bytes) > MAX_HEADER_BYTES:
            return self.drop('oversized header')
        data = [memoryview(f.buffer) for f in frames]
        if not hmac.compare_digest(mac, self._mac(head_bytes, data)):
            return self.drop('bad MAC (wrong job secret?)')
        head = header_of(head_bytes)
        if head is None:
            return self.drop('malformed header')
        kind, sender, seq, session = head['kind'], head['from'], head['seq'], head['session']
        if seq <= self._last_seq.get((sender, session), 0):
            return self.drop(f'replayed message from {sender}')
        if 'shm' in head:                  # frames in shared memory (checked after replay:
            try:                           # a replayed descriptor must not map anything)
                data = self._shm_maps.frames(head['shm'], data)
            except ValueError as e:
                return self.drop(f'bad shared-memory descriptor: {e}')
        if head.get('sizes') != [f.nbytes for f in data]:
            return self.drop('header does not match its frames')
        self._last_seq[(sender, session)] = seq
        return Message(kind, sender, head, data)

    def shm_stats(self):
        """Shared-memory counters: blocks and bytes of our pool, frames sent and received."""
        stats = self.shm.stats() if self.shm is not None else \
            {'blocks': 0, 'bytes': 0, 'sent': 0, 'created': 0, 'fallbacks': 0}
        return dict(stats, received=self._shm_maps.received)

    def drop(self, why):
        """Log a dropped message (at most one line a second) and go on."""
        self._dropped += 1
        now = time.monotonic()
        if now - self._last_log >= 1.0:
            print(f'd2ldist.van: {self.node_id} dropped a message: {why} '
                  f'({self._dropped} dropped so far)', file=sys.stderr, flush=True)
            self._last_log = now
        return None

    @property
    def dropped(self):
        """How many received messages failed the checks."""
        return self._dropped

    def terminate(self):
        """After close(), in a process whose only van this is: end ZeroMQ's context,
        which gives queued messages LINGER_SECONDS to leave (nothing waits at exit)."""
        self._ctx.term()

    def close(self):
        """Close every socket (queued messages get two seconds to leave, and their
        receivers as long to map the shared blocks they name)."""
        if self.shm is not None:
            deadline = time.monotonic() + LINGER_SECONDS
            while self.shm.unmapped() and time.monotonic() < deadline:
                time.sleep(0.005)
        for stream in list(self.streams):
            stream.close()
        with self.send_lock:
            for sock in self._peers.values():
                sock.close()
            self._peers.clear()
            if self._router is not None:
                self._router.close(linger=0)
                self._router = None
            if self.shm is not None:   # receivers' mappings keep what they still use
                self.shm.close()


class Notice:
    """Messages one way to one node, in the van's format, from a process that is not a
    node of the job (the launcher tells the scheduler of a process it saw end). It has
    a ZeroMQ context of its own, so that it touches nothing of the process it runs in
    (a notebook's kernel)."""

    def __init__(self, sender, secret, address):
        self.sender, self.mac_key = sender, secret.encode()
        self._ctx = zmq.Context(io_threads=1)
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 500)    # (a receiver already gone: not long)
        self._sock.connect(address)
        self._session, self._seq = secrets.token_hex(4), itertools.count(1)

    def send(self, kind, header):
        head = dict(header, kind=kind, seq=next(self._seq), session=self._session, sizes=[])
        head['from'] = self.sender
        head_bytes = encoded(head)
        self._sock.send_multipart([mac_of(self.mac_key, head_bytes), head_bytes])

    def close(self):
        self._sock.close()
        self._ctx.term()
