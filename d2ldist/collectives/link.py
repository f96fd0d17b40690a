"""The ring's link to its neighbours: a call's begin and end, one chunk sent, one received.

``Ring`` (ring.py) moves chunks; a ``Link`` carries them for one membership of the
workers: to the right neighbour (on a TCP stream of its own where chunks would cross a
socket, else through the van) and from the left one, checked to be the chunk expected.
Around that plain path it keeps the messages that do not belong to this call: of a call
that failed (dropped), of a later call or membership (kept for then), notices that a
worker joined; ``classify`` says which a message is, ``_next`` acts on it. Two workers
that call different collectives fail on every worker with the same error.
Why and how: docs/design/ring.md.
"""
import contextlib

import torch

from .. import config
from ..lines import NAME, clip, shown
from ..runtime import hang, stream
from ..runtime.node import WorkersChanged

RING = 'ring'                # the message kind of the ring's chunks
DISAGREE = 'ring_disagree'   # to every worker: two workers called different collectives
JOINED = 'ring_joined'       # to every other worker: {round}: this one called join()
LINK = 'ring_link'           # to the left neighbour: {offer}: where to open a stream

# what a message is to a link (classify)
CURRENT, NEWER, STALE, EARLY, NOTICE = 'current', 'newer', 'stale', 'early', 'notice'


def is_stale(msg, failed):
    """Whether ``msg`` belongs to a call that failed on every worker (a late chunk, a
    second notice): ``failed`` holds those calls' numbers."""
    return msg.kind in (RING, DISAGREE) and msg.get('n') in failed


def classify(msg, round, calls, failed, left):
    """What ``msg`` is to a link of membership ``round`` in call ``calls``, its left
    neighbour ``left``: CURRENT, NEWER (a newer membership's), STALE (an older one's, or
    of a failed call), EARLY (a later call's: a notice that it failed, or the left's chunk
    sent after this call failed there), or NOTICE (a worker joined). Changes nothing."""
    membership, n = msg.get('membership', 0), msg.get('n')
    if isinstance(membership, int) and membership > round:
        return NEWER
    if isinstance(membership, int) and membership < round or is_stale(msg, failed):
        return STALE
    if msg.kind == JOINED:
        return NOTICE
    if isinstance(n, int) and n > calls and (msg.kind == DISAGREE or (
            msg.kind == RING and msg.sender == left
            and isinstance(msg.get('failed'), int) and msg.get('failed') >= calls)):
        return EARLY
    return CURRENT


def drain(msg):
    """Read off the stream what ``msg`` still has there (the stream's next message waits
    behind it): a message that is dropped, or that ends in an error."""
    for frame in msg.frames:
        if isinstance(frame, stream.Pending) and not frame.read:
            frame.read_into(bytearray(frame.nbytes))


class Link:
    """A worker's link to its ring neighbours, for one membership (``node.round``)."""

    def __init__(self, node):
        self.node, self.members, self.round = node, node.workers(), node.round
        self.rank, self.size = self.members.index(node.id), len(self.members)
        self.left = self.members[(self.rank - 1) % self.size]
        self.right = self.members[(self.rank + 1) % self.size]
        self.calls = 0         # collectives so far: every chunk says which call it is from
        self.failed = set()    # calls that failed on every worker: their late chunks go
        self.last_failed = 0   # the latest of them (every chunk says it)
        self.joins = 0         # join() rounds ended (every worker calls join() once a round)
        self.joined = {}       # worker id -> the round in which it called join()
        self.opened, self.out = False, None     # the stream to the right, if any
        self._sent = []        # trackers of chunks ZeroMQ may still be reading
        self._newer = []       # messages of a newer membership, come before the news of it
        self._early = []       # kept for a later call
        self._buffer = torch.empty(0, dtype=torch.uint8)   # a reduced chunk lands here
        self._root = None

    # -- the plain path: begin, send, recv, end ------------------------------------------
    def begin(self, call, numel, replay=None, root=None):
        """Start collective ``call`` on ``numel`` values. Its first chunk to the right
        carries ``call`` and ``replay`` (what a worker in join() needs to take part);
        ``root``: a broadcast's, which must not be in join()."""
        self._check_membership()
        self.calls += 1
        self._numel, self._call, self._replay = numel, call, replay
        self._described = self._heard = False
        self._wait = self._watched(call)
        self.open(self._wait)               # (the stream to the right, on the first call)
        self._root = root
        self._check_root()                  # (a root in join() has nothing to send)

    def send(self, x, phase, j, k):
        """Send chunk k of segment j (the 1-D tensor ``x``) to the right, in ``phase``."""
        head = {'n': self.calls, 'failed': self.last_failed, 'numel': self._numel,
                'phase': phase, 'seg': j, 'k': k, 'joins': self.joins, 'membership': self.round}
        if not self._described:     # the call's description rides on its first chunk only:
            head.update(call=self._call, replay=self._replay)    # the link keeps the order
            self._described = True
        frame = x.view(torch.uint8).numpy()
        if self.out is None:
            self._sent += self.node.send(self.right, RING, head, [frame], track=True)
            return
        with self._stream_news():
            self.out.send(RING, head, [frame])

    def recv(self, y, phase, j, k, reduce_=None):
        """Receive chunk k of segment j from the left into ``y``: ``reduce_(y, chunk)``,
        or copied where ``reduce_`` is None. The chunk is node.recv's next message of this
        call; ``_next`` keeps the others aside (or drops them)."""
        msg = self._next([RING, DISAGREE, JOINED], self._wait)
        if msg.kind == DISAGREE:              # another worker saw two different calls
            self._fail(f'{shown(self.node.id)} stops: {clip(msg.get("error"))}')
        self._check(msg, phase, j, k, y.numel() * y.element_size())
        self._take(msg.frames[0], y, reduce_)

    def end(self):
        """Wait until every chunk is sent, so the caller may reuse the memory."""
        self._put_back(self._early)
        if self.out is not None:
            with self._stream_news():
                self.out.flush()
        for tracker in self._sent:
            tracker.wait()
        self._sent = []

    # -- one chunk: checked, then taken ---------------------------------------------------
    def _check(self, msg, phase, j, k, nbytes):
        """Stop the job on every worker unless ``msg`` is the chunk expected."""
        h, mine = msg.header, self._call
        if msg.sender == self.left and 'call' in h:      # the first chunk of the left's call
            theirs, self._heard = clip(h['call'], NAME), True
            if theirs != mine:
                drain(msg)
                self.disagree(f'{self.node.id} and {self.left} called different collectives '
                              f'as call {self.calls}: {mine} on {self.node.id}, {theirs} on '
                              f'{self.left}; the workers must call the same collectives in '
                              'the same order on tensors of the same shape and dtype')
        want = (self.calls, self._numel, phase, j, k)
        got = (h.get('n'), h.get('numel'), h.get('phase'), h.get('seg'), h.get('k'))
        if msg.sender != self.left or got != want or not self._heard or len(msg.frames) != 1 \
                or msg.frames[0].nbytes != nbytes:
            drain(msg)
            self.disagree(
                f'{self.node.id}: expected chunk (call, numel, phase, segment, chunk) '
                f'{want} of {mine} from {self.left}, got {got} from {msg.sender}'
                f'{"" if self._heard else " before the description of its call"}: the '
                'workers must call the same collectives in the same order on tensors '
                'of the same size')

    def _take(self, frame, y, reduce_):
        """reduce_(y, the chunk in ``frame``), or a copy. A chunk still in the stream is
        read straight into y if it is to be copied, else into a reused buffer."""
        if isinstance(frame, stream.Pending):
            if reduce_ is None:
                frame.read_into(y.view(torch.uint8).numpy())
                return
            if self._buffer.numel() < frame.nbytes:
                self._buffer = torch.empty(frame.nbytes, dtype=torch.uint8)
            frame = frame.read_into(self._buffer[:frame.nbytes].numpy())
        if y.numel():
            (reduce_ or torch.Tensor.copy_)(y, torch.frombuffer(frame, dtype=y.dtype))

    # -- the messages that are not this call's ----------------------------------------------
    def _next(self, kinds, wait):
        """The next message of this call; the others are kept for later (a newer
        membership's until the news of it, WorkersChanged, has come), dropped, or noted."""
        while True:
            try:
                msg = self.node.recv(kinds, wait=wait)
            except WorkersChanged:
                self._put_back(self._newer)
                raise
            what = classify(msg, self.round, self.calls, self.failed, self.left)
            if what == CURRENT:
                return msg
            if what == NEWER:
                self._newer.append(msg)
            elif what == EARLY:
                self._early.append(msg)
            elif what == STALE:
                drain(msg)
            else:                             # another worker called join(): note, wait on
                self.joined[msg.sender] = msg.get('round')
                self._check_root()

    def _check_membership(self):
        """A collective on the ring of an old membership fails: make a new Ring."""
        if self.node.round != self.round:
            self._put_back(self._newer)
            raise WorkersChanged(f'the workers changed (round {self.node.round}): '
                                 f'{self.node.id} called a collective on the old ring',
                                 round=self.node.round)

    def _watched(self, call):
        """The wait for the left neighbour's chunks, watched for hangs: the heartbeats
        tell the scheduler how many collectives this worker has started."""
        self.node.counters['ring'] = self.calls
        left = shown(self.left)
        return hang.Wait(f'in {call} (collective {self.calls}) for {left}',
                         [('scheduler', {'counter': 'ring', 'n': self.calls})],
                         span=f'wait for {left}')

    def _put_back(self, kept):
        """Messages kept for later: back in the order they came."""
        for msg in reversed(kept):
            self.node.put_back(msg)
        kept.clear()

    def _check_root(self):
        """A broadcast from a worker in join() fails: it has no data to send."""
        root = self._root
        if root is not None and self.joined.get(self.members[root]) == self.joins + 1:
            self.calls -= 1                        # it never began: nothing was sent
            raise RuntimeError(f'broadcast from worker {root}, which has called join() '
                               '(it is out of data): broadcast from a worker still training')

    # -- failure: disagreement, a failed call, a broken stream ------------------------------
    def disagree(self, error):
        """Tell every other worker (each may be waiting for a chunk that never comes), then
        raise: every worker of the job fails with the same message."""
        self.tell_all(DISAGREE, {'error': error, 'n': self.calls})
        self._fail(error)

    def tell_all(self, kind, head):
        """Send a notice to every other worker. To the right neighbour it goes the way the
        chunks go (on the stream, if there is one), so that it never overtakes a chunk
        sent before it, nor is overtaken by one sent after."""
        head = {**head, 'membership': self.round}
        for peer in self.members:
            if peer == self.right and self.out is not None:
                self.out.send(kind, head, [])
            elif peer != self.node.id:
                self.node.send(peer, kind, head)

    def _fail(self, error):
        """Raise Disagree for this call, which has failed on every worker: its chunks
        still on the way are dropped when they come, so the next call starts in step."""
        self.mark_failed()
        self._put_back(self._early)
        raise hang.Disagree(error)

    def mark_failed(self):
        """The current call has failed on every worker."""
        self.failed.add(self.calls)
        self.last_failed = self.calls

    def open(self, wait):
        """Once: where chunks to the right would cross a socket, open a stream to it.
        Each worker listens for its left neighbour and offers it, over the van, a port
        and a nonce (no offer where the van carries them); it connects to the right one's."""
        if self.opened:
            return
        self.opened, van = True, self.node.van
        offer = None
        if van.through_socket(self.left):
            offer = stream.listen(van, self.left).offer()
        self.node.send(self.left, LINK, {'offer': offer, 'membership': self.round})
        msg = self._next([LINK], wait)
        if msg.get('offer') and van.through_socket(self.right):
            with self._stream_news():
                self.out = stream.connect(van, self.right, self.node.host_of(self.right),
                                          msg['offer'])

    @contextlib.contextmanager
    def _stream_news(self):
        """Elastic: where the stream to the right breaks (its worker stopped, say), that
        worker may be lost: wait for the scheduler's word (WorkersChanged, or PeerFailed
        where the job fails); else the StreamBroken goes on."""
        try:
            yield
        except stream.StreamBroken:
            if config.get().min_workers:
                right = shown(self.right)
                self.node.recv([], wait=hang.Wait(f'for news of {right} (its stream broke)',
                                                  [('scheduler', {'nodes': [self.right]})]))
            raise
