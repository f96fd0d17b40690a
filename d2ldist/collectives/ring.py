"""The ring all-reduce (after baidu-allreduce's RingAllreduce), over the van.

The N workers stand in a ring in rank order: worker r sends only to its right
neighbour r+1 and receives only from its left neighbour r-1. The tensor is cut
into N segments. In the *reduce-scatter* phase (N-1 steps) each segment travels
once round the ring, every worker adding its own values on the way, so that each
worker ends up with one fully reduced segment; in the *all-gather* phase (N-1
more steps) the reduced segments travel round once more, every worker copying
them. Each worker sends 2(N-1)/N of the tensor, whatever N is: the ring is
bandwidth-optimal.

Segments are cut into chunks of ``CHUNK_BYTES``; a chunk is passed on to the right
as soon as it has been reduced, so that while one chunk is on the wire the next
is being received and added (pipelining), and a thread sends while Python adds.

Where chunks to the right neighbour cross a real socket (another host, or
``D2L_SHM=0``), they travel on a TCP stream of the ring's own (runtime/stream.py):
the right neighbour reads each chunk straight into its place -- the all-gather's into
the output, the reduce-scatter's into one reused buffer -- as gloo does. Elsewhere
(shared memory on one host, a simulated link) they go through the van.

Elastic workers (``d2l-launch --min-workers``): a Ring is made for one membership of the
workers (``node.workers()``, numbered ``node.round``); every message carries that number,
so when the scheduler forms a new one the collective in flight fails (``WorkersChanged``),
a new Ring is made, and what the old ring's workers still send is dropped.

A worker out of data calls ``join()`` (Horovod's): it has no collective of its own
to call, so it learns each one the others call from the first chunk that reaches it
-- a call's first chunk on each link describes it -- and takes part with zeros, until
all have joined.
"""
import time

import torch

from .. import config
from ..runtime import hang, protocol, stream
from ..runtime import node as node_module
from ..runtime.split import even_slices

RING = 'ring'             # the message kind of the ring's chunks
DISAGREE = 'ring_disagree'   # to every worker: two workers called different collectives
JOINED = 'ring_joined'       # to every other worker: {round}: this one called join()
LINK = 'ring_link'           # to the left neighbour: {offer}: where to open a stream
# Measured with benchmarks/allreduce.py --chunk-sweep (2 busy cores): CPU time per
# 64 MB all-reduce with 4 workers over ZeroMQ, chunks of 256 KB / 1 / 2 / 4 / 8 MB:
# 212 / 139 / 124 / 106 / 91 ms; with 2 workers 93 / 73 / 66 / 58 / 63 ms. Each
# chunk costs a message (JSON header, HMAC, wake-ups), so small chunks are dear;
# above 4 MB the gain stops and the pipeline gets short. On the ring's streams (--no-shm)
# 3 workers: 84 / 58 / 52 / 49 / 47 ms. Through shared memory (one host,
# d2ldist/runtime/shm.py) 148 / 74 / 56 / 44 / 41 ms with 4 workers and
# 71 / 42 / 32 / 26 / 22 ms with 2: 8 MB would save little more.
CHUNK_BYTES = 4 * 1024 * 1024


def _copy_(acc, x):
    return acc.copy_(x)


class Refused(ValueError):
    """A collective that a worker in join() takes no part in (Horovod refuses it)."""


def _drain(msg):
    """Read off the stream what ``msg`` still has there (the stream's next message waits
    behind it): a message that is dropped, or that ends in an error."""
    for frame in msg.frames:
        if isinstance(frame, stream.Pending) and not frame.read:
            frame.read_into(bytearray(frame.nbytes))


class Ring:
    """Collectives among the workers of a job, between ring neighbours over the van."""

    def __init__(self, node, chunk_bytes=None):
        self.node, self.members, self.round = node, node.workers(), node.round
        self.rank, self.size = self.members.index(node.id), len(self.members)
        self.left = self.members[(self.rank - 1) % self.size]
        self.right = self.members[(self.rank + 1) % self.size]
        self._newer = []      # messages of a newer membership, come before the news of it
        self.chunk_bytes = chunk_bytes or config.get().ring_chunk or CHUNK_BYTES
        self.calls = 0        # collectives so far: every chunk says which call it is from
        self._sent = []       # trackers of chunks ZeroMQ may still be reading
        self.joins = 0        # join() rounds ended (every worker calls join() once a round)
        self.joined = {}      # worker id -> the round in which it called join()
        self._replay = self._root = None
        self._failed = set()  # calls that failed on every worker: their late chunks go
        self._last_failed = 0   # the latest of them (every chunk says it)
        self._early = []      # kept for a later call: chunks that came before the news of
                              # this call's failure, notices of a later call's
        self._linked, self._out = False, None     # the stream to the right, if any
        self._buffer = torch.empty(0, dtype=torch.uint8)   # a reduced chunk lands here

    def allreduce_(self, flat, op, call='allreduce', replay=None):
        """Reduce the 1-D contiguous CPU tensor ``flat`` across all workers, in place.

        ``call`` says what the caller asked for (op, dtype, shape): a call's first chunk
        to the right carries it (the later ones, on the same ordered link, only their
        place), and a worker that receives another call than its own stops the job. That
        chunk also carries ``replay``: what a worker in join() needs to take part."""
        N, r = self.size, self.rank
        seg = self._begin(flat, even_slices(flat.numel(), N), call, replay)  # first n%N longer
        # Reduce-scatter, shown for N = 3 workers and segments a, b, c. At step s,
        # worker r sends segment r-s to the right and adds segment r-s-1 from the left:
        #
        #            worker 0           worker 1           worker 2
        #   start    a0  b0  c0         a1  b1  c1         a2  b2  c2
        #   step 0   a0  b0  c0+c2      a0+a1 b1 c1        a2  b1+b2 c2
        #   step 1   a0  B   c0+c2      a0+a1 b1 C         A   b1+b2 c2
        #
        # (A = a0+a1+a2, ...): worker r now holds the reduced segment r+1.
        for k, (a, b) in enumerate(self.chunks(seg[r])):
            self._send(flat[a:b], 'rs', r, k)
        for s in range(N - 1):
            j = (r - s - 1) % N                        # the segment arriving now
            last = s == N - 2                          # then j is reduced: all-gather it
            self._relay(flat, 'rs', j, op.reduce_, forward='ag' if last else 'rs')
        # All-gather: at step s, worker r receives the reduced segment r-s and copies it,
        # passing it on unless its right neighbour is the one that reduced it:
        #
        #   step 0   A   B   c0+c2      a0+a1 B  C         A   b1+b2 C
        #   step 1   A   B   C          A   B   C          A   B   C
        for s in range(N - 1):
            j = (r - s) % N
            self._relay(flat, 'ag', j, _copy_, forward='ag' if s < N - 2 else None)
        self._end()
        return flat

    def reducescatter_(self, flat, seg, op, call='reducescatter', replay=None):
        """The first half of allreduce_: afterwards worker r holds ``flat[seg[r][0]:seg[r][1]]``
        reduced over all workers (the rest of ``flat`` holds partial sums).

        The reduce-scatter leaves the reduced segment r+1 on worker r, so the ring's
        segments are the asked ones turned by one: ring segment j is seg[j-1]."""
        N, r = self.size, self.rank
        turned = [seg[(j - 1) % N] for j in range(N)]
        self._begin(flat, turned, call, replay)
        for k, (a, b) in enumerate(self.chunks(turned[r])):
            self._send(flat[a:b], 'rs', r, k)
        for s in range(N - 1):
            j = (r - s - 1) % N                       # at the last step j = r+1: reduced
            self._relay(flat, 'rs', j, op.reduce_, forward='rs' if s < N - 2 else None)
        self._end()
        return flat

    def broadcast_(self, flat, root, call='broadcast', replay=None):
        """Copy ``flat`` of worker ``root`` into ``flat`` of every worker.

        The data goes down a pipelined chain root -> root+1 -> ... -> root-1; then a
        token goes once round the ring, from the last one to the root and on, so that
        no worker returns before every one has checked the call: one that names another
        root is seen by its right neighbour, and all hear of it."""
        whole = self._begin(flat, [(0, flat.numel())], call, replay)[0]
        self._root = root
        self._check_root()                         # (a root in join() has nothing to send)
        last = self.right == self.members[root]    # the end of the chain
        if self.rank == root:
            for k, (a, b) in enumerate(self.chunks(whole)):
                self._send(flat[a:b], 'bc', 0, k)
        else:                                      # the last one keeps what it gets
            self._relay(flat, 'bc', 0, _copy_, forward=None if last else 'bc')
        if last:
            self._send(flat[:0], 'end', 0, 0)
        self._take(self._recv('end', 0, 0, 0), flat[:0])
        if not last:
            self._send(flat[:0], 'end', 0, 0)
        self._end()
        return flat

    def allgather_(self, flat, seg, call='allgather', replay=None):
        """Worker i holds ``flat[seg[i][0]:seg[i][1]]``; afterwards every worker holds all."""
        N, r = self.size, self.rank
        self._begin(flat, seg, call, replay)
        for k, (a, b) in enumerate(self.chunks(seg[r])):
            self._send(flat[a:b], 'ag', r, k)
        for s in range(N - 1):   # the all-gather phase of allreduce_, starting one earlier
            j = (r - s - 1) % N
            self._relay(flat, 'ag', j, _copy_, forward='ag' if s < N - 2 else None)
        self._end()
        return flat

    # -- chunks -----------------------------------------------------------------------
    def chunks(self, segment):
        """Cut a segment (start, end) into chunks of at most chunk_bytes; one empty chunk
        if it is empty, so that every step sends something: a worker in join() learns of
        a collective from the first chunk its left neighbour sends, whatever the sizes."""
        a, b = segment
        step = max(1, self.chunk_bytes // self._itemsize)
        return [(i, min(i + step, b)) for i in range(a, b, step)] or [(a, a)]

    # -- one chunk on the wire -------------------------------------------------------
    def _relay(self, flat, phase, j, combine, forward):
        """Receive segment j from the left chunk by chunk, combine it into ``flat``,
        and pass each chunk on to the right at once (as ``forward``) unless None."""
        for k, (a, b) in enumerate(self.chunks(self._segs[j])):
            self._take(self._recv(phase, j, k, b - a), flat[a:b], combine)
            if forward:
                self._send(flat[a:b], forward, j, k)

    def _send(self, x, phase, j, k):
        frame = x.view(torch.uint8).numpy()
        head = {'n': self.calls, 'failed': self._last_failed, 'numel': self._numel,
                'phase': phase, 'seg': j, 'k': k, 'joins': self.joins, 'membership': self.round}
        if not self._described:     # the call's description rides on its first chunk only:
            head.update(call=self._call, replay=self._replay)    # the link keeps the order
            self._described = True
        if self._out is not None:
            try:
                self._out.send(RING, head, [frame])
            except stream.StreamBroken:        # (its worker stopped, say)
                self._await_news()
                raise
        else:
            self._sent += self.node.send(self.right, RING, head, [frame], track=True)

    def _take(self, frame, y, combine=_copy_):
        """combine(y, the chunk in ``frame``). A chunk still in the stream is read straight
        into y if it is to be copied, else into a reused buffer."""
        if isinstance(frame, stream.Pending):
            if combine is _copy_:
                frame.read_into(y.view(torch.uint8).numpy())
                return
            if self._buffer.numel() < frame.nbytes:
                self._buffer = torch.empty(frame.nbytes, dtype=torch.uint8)
            frame = frame.read_into(self._buffer[:frame.nbytes].numpy())
        if y.numel():
            combine(y, torch.frombuffer(frame, dtype=y.dtype))

    def _recv(self, phase, j, k, numel):
        """The next chunk from the left, checked to be the one expected: its frame."""
        msg = self._next([RING, DISAGREE, JOINED], self._wait)
        if msg.kind == JOINED:                # another worker called join(): note, wait on
            self._note_joined(msg)
            self._check_root()
            return self._recv(phase, j, k, numel)
        if self._stale(msg) or self._ahead(msg) or self._later(msg):
            return self._recv(phase, j, k, numel)
        if msg.kind == DISAGREE:              # another worker saw two different calls
            self._fail(f'{self.node.id.replace(":", " ")} stops: '
                       f'{str(msg.get("error"))[:600]}')
        h, mine = msg.header, self._call
        if msg.sender == self.left and 'call' in h:      # the first chunk of the left's call
            theirs, self._heard = str(h['call'])[:200], True
            if theirs != mine:
                _drain(msg)
                self._disagree(f'{self.node.id} and {self.left} called different collectives '
                               f'as call {self.calls}: {mine} on {self.node.id}, {theirs} on '
                               f'{self.left}; the workers must call the same collectives in '
                               'the same order on tensors of the same shape and dtype')
        want = (self.calls, self._numel, phase, j, k)
        got = (h.get('n'), h.get('numel'), h.get('phase'), h.get('seg'), h.get('k'))
        if msg.sender != self.left or got != want or not self._heard or len(msg.frames) != 1 \
                or msg.frames[0].nbytes != numel * self._itemsize:
            _drain(msg)
            self._disagree(
                f'{self.node.id}: expected chunk (call, numel, phase, segment, chunk) '
                f'{want} of {mine} from {self.left}, got {got} from {msg.sender}'
                f'{"" if self._heard else " before the description of its call"}: the '
                'workers must call the same collectives in the same order on tensors '
                'of the same size')
        return msg.frames[0]

    def _next(self, kinds, wait):
        """The next message of this membership: older ones are dropped, newer ones kept
        until the news of their membership has come (WorkersChanged), then put back."""
        while True:
            try:
                msg = self.node.recv(kinds, wait=wait)
            except node_module.WorkersChanged:
                self._put_back_newer()
                raise
            membership = msg.get('membership', 0)
            if membership == self.round or not isinstance(membership, int):
                return msg
            if membership > self.round:
                self._newer.append(msg)
            else:
                _drain(msg)

    def _put_back_newer(self):
        """The messages of a newer membership, for the Ring made for it."""
        for newer in reversed(self._newer):
            self.node.put_back(newer)
        self._newer = []

    def _disagree(self, error):
        """Tell every other worker (each may be waiting for a chunk that never comes), then
        raise: every worker of the job fails with the same message."""
        self._tell_all(DISAGREE, {'error': error, 'n': self.calls})
        self._fail(error)

    def _tell_all(self, kind, head):
        """Send a notice to every other worker. To the right neighbour it goes the way the
        chunks go (on the stream, if there is one), so that it never overtakes a chunk
        sent before it, nor is overtaken by one sent after."""
        head = {**head, 'membership': self.round}
        for peer in self.members:
            if peer == self.right and self._out is not None:
                self._out.send(kind, head, [])
            elif peer != self.node.id:
                self.node.send(peer, kind, head)

    def _fail(self, error):
        """Raise Disagree for this call, which has failed on every worker: its chunks
        still on the way are dropped when they come, so the next call starts in step."""
        self._mark_failed()
        self._put_back_early()
        raise hang.Disagree(error)

    def _put_back_early(self):
        """The messages kept for a later call: back in the order they came, for it."""
        for msg in reversed(self._early):
            self.node.put_back(msg)
        self._early = []

    def _mark_failed(self):
        """The current call has failed on every worker."""
        self._failed.add(self.calls)
        self._last_failed = self.calls

    def _stale(self, msg):
        """Whether ``msg`` belongs to a call that failed (a late chunk, a second notice):
        then it is dropped, its frame read off the stream."""
        if msg.kind not in (RING, DISAGREE) or msg.get('n') not in self._failed:
            return False
        _drain(msg)
        return True

    def _later(self, msg):
        """Whether ``msg`` is a notice for a later call: a worker that finished this call
        sooner refused its next one. Kept for then (the call may begin, or be refused here
        too, when the notice is dropped as stale)."""
        n = msg.get('n')
        if msg.kind != DISAGREE or not isinstance(n, int) or n <= self.calls:
            return False
        self._early.append(msg)
        return True

    def _ahead(self, msg):
        """Whether ``msg`` is one of the left neighbour's next calls, sent after this call
        (and maybe the next ones) failed there -- it says the latest call that failed -- while
        the notice of the failure is still on its way: kept for the next call."""
        n, failed = msg.get('n'), msg.get('failed')
        if msg.kind != RING or msg.sender != self.left or not isinstance(n, int) \
                or not isinstance(failed, int) or failed < self.calls or n <= self.calls:
            return False
        self._early.append(msg)
        return True

    def _begin(self, flat, segs, call, replay=None):
        """Start a collective on ``flat`` cut into ``segs``; returns segs."""
        if self.node.round != self.round:     # the membership changed: make a new Ring
            self._put_back_newer()
            raise node_module.WorkersChanged(f'the workers changed (round {self.node.round}): '
                                             f'{self.node.id} called a collective on the old '
                                             'ring', round=self.node.round)
        self.calls += 1
        self._numel, self._itemsize, self._segs = flat.numel(), flat.element_size(), segs
        self._call, self._described, self._heard = call, False, False
        self._replay, self._root = replay, None       # (for join(); broadcast_ sets root)
        self.node.counters['ring'] = self.calls       # the heartbeats tell the scheduler
        left = self.left.replace(':', ' ')
        self._wait = hang.Wait(f'in {call} (collective {self.calls}) for {left}',
                               [('scheduler', {'counter': 'ring', 'n': self.calls})],
                               span=f'wait for {left}')
        if not self._linked:
            self._open_links(self._wait)
        return segs

    def _open_links(self, wait):
        """Once: where chunks to the right would cross a socket, open a stream to it.
        Each worker listens for its left neighbour and offers it, over the van, a port
        and a nonce (no offer where the van carries them); it connects to the right one's."""
        self._linked, van = True, self.node.van
        offer = None
        if van.through_socket(self.left):
            offer = stream.listen(van, self.left).offer()
        self.node.send(self.left, LINK, {'offer': offer, 'membership': self.round})
        msg = self._next([LINK], wait)
        if msg.get('offer') and van.through_socket(self.right):
            try:
                self._out = stream.connect(van, self.right, self.node.host_of(self.right),
                                           msg['offer'])
            except stream.StreamBroken:
                self._await_news()
                raise

    def _end(self):
        """Wait until every chunk is sent, so the caller may reuse the memory."""
        self._put_back_early()
        if self._out is not None:
            try:
                self._out.flush()
            except stream.StreamBroken:
                self._await_news()
                raise
        for tracker in self._sent:
            tracker.wait()
        self._sent = []

    def _await_news(self):
        """Elastic: the stream to the right broke, its worker may be lost: wait for the
        scheduler's word (WorkersChanged, or PeerFailed where the job fails)."""
        if config.get().min_workers:
            right = self.right.replace(':', ' ')
            self.node.recv([], wait=hang.Wait(f'for news of {right} (its stream broke)',
                                              [('scheduler', {'nodes': [self.right]})]))

    # -- join(): a worker out of data takes part in the others' collectives ---------------
    def join(self, take_part):
        """Take part in the collectives the other workers call, with nothing of this
        worker's own: ``take_part(replay)`` for each, with the description its first
        chunk carries; until every worker has joined. Returns the last one's rank."""
        if not self._linked:
            self._open_links(hang.Wait('in join(), opening the ring',
                                       [('scheduler', {'counter': 'ring', 'n': 1})]))
        # The scheduler first, and the others only once it has counted this one: a worker
        # that joins because it heard of this one then comes after it there too ('last').
        self.node.send('scheduler', protocol.JOIN, {'calls': self.calls})
        self.node.recv([protocol.JOIN_NOTED], wait=hang.Wait(
            'in join(), for the scheduler', [('scheduler', {'counter': 'ring', 'n': 1})]))
        self._tell_all(JOINED, {'round': self.joins + 1})
        later = []          # chunks from a worker that has left join() (the news is slower)
        while True:         # (waiting here is no hang: the heartbeats say where it is)
            self.node.doing = ("in join(), taking part in the others' collectives",
                               time.monotonic())
            msg = self.node.recv([RING, DISAGREE, JOINED, protocol.BARRIER_DONE,
                                  protocol.JOIN_DONE])
            if msg.kind == protocol.JOIN_DONE:
                self.node.doing = None
                for chunk in reversed(later):      # for this worker's next collective
                    self.node.put_back(chunk)
                return self._all_joined(msg)
            if self._stale(msg):
                continue
            if msg.kind == RING and msg.get('joins') != self.joins:
                later.append(msg)
            else:
                self._serve(msg, take_part)

    def _serve(self, msg, take_part):
        """One message to a worker in join(): a collective begins, a note, a barrier."""
        if msg.kind == RING:                       # a collective's first chunk: take part
            self.node.put_back(msg)                # (the collective itself reads it)
            try:
                take_part(msg.get('replay'))
            except Refused as e:
                self.refuse(f'{self.node.id} has called join() (it is out of data): '
                            f'{str(msg.get("call"))[:200]} refused: {e}')
            except hang.Disagree:      # the call failed on every worker: wait on in join()
                pass
            except ValueError as e:
                self._disagree(f'{self.node.id} in join() cannot take part in '
                               f'{str(msg.get("call"))[:200]}: {e}')
        elif msg.kind == JOINED:
            self._note_joined(msg)
        elif msg.kind == protocol.BARRIER_DONE:    # the scheduler counted this one there
            self.node.passed_barrier(msg.get('group'), msg.get('n'))
        elif msg.get('n') == self.calls + 1:       # the next call failed before it came
            self.calls += 1
            self._mark_failed()
        else:
            raise hang.Disagree(f'{self.node.id.replace(":", " ")} stops: '
                                f'{str(msg.get("error"))[:600]}')

    def refuse(self, error):
        """Make the next collective fail on every other worker (they may have begun it),
        and count it as failed here too: its chunks are dropped when they come, and the
        notices of workers that refused it too."""
        if not self._linked:                    # (the others wait for this one's link)
            self._open_links(hang.Wait('refusing a collective, opening the ring',
                                       [('scheduler', {'counter': 'ring', 'n': 1})]))
        self.calls += 1
        self.node.counters['ring'] = self.calls
        self._mark_failed()
        self._tell_all(DISAGREE, {'error': error, 'n': self.calls})

    def _all_joined(self, msg):
        """The scheduler's word that every worker has joined: the last one's rank. It also
        says how many collectives the last one counted; any this worker has not seen
        failed (a worker in join() takes part in every one that does not), and their
        notices may still be on the way: count them failed now, so that the next call
        has the same number on every worker and the late notices are dropped."""
        self.joins += 1
        if msg.get('error') or not isinstance(msg.get('last'), int):
            raise RuntimeError(f'join(): {str(msg.get("error"))[:600]}')
        calls = msg.get('calls')
        while isinstance(calls, int) and self.calls < calls:
            self.calls += 1
            self._mark_failed()
        self.node.counters['ring'] = self.calls
        return msg.get('last')

    def _note_joined(self, msg):
        """Another worker has called join() (in round ``msg['round']``)."""
        self.joined[msg.sender] = msg.get('round')

    def _check_root(self):
        """A broadcast from a worker in join() fails: it has no data to send."""
        root = self._root
        if root is not None and self.joined.get(self.members[root]) == self.joins + 1:
            self.calls -= 1                        # it never began: nothing was sent
            raise RuntimeError(f'broadcast from worker {root}, which has called join() '
                               '(it is out of data): broadcast from a worker still training')
