"""The ring all-reduce (after baidu-allreduce's RingAllreduce), over a link to the neighbours.

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
is being received and added (pipelining).

``Ring`` is the algorithm alone: the ``Link`` it is given (link.py) begins and ends a
call and sends and receives one chunk -- over the van or a stream, with the checks,
stale messages and membership changes kept out of sight. Why and how, with the
measurements behind ``CHUNK_BYTES``: docs/design/ring.md.
"""
from .. import config
from ..runtime.split import even_slices

CHUNK_BYTES = 4 * 1024 * 1024   # measured: docs/design/ring.md#the-chunk-size


class Ring:
    """Collectives among the workers of a job, between ring neighbours over ``link``."""

    def __init__(self, link, chunk_bytes=None):
        self.link, self.rank, self.size = link, link.rank, link.size
        self.chunk_bytes = chunk_bytes or config.get().ring_chunk or CHUNK_BYTES

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
            self.link.send(flat[a:b], 'rs', r, k)
        for s in range(N - 1):
            j = (r - s - 1) % N                        # the segment arriving now
            last = s == N - 2                          # then j is reduced: all-gather it
            self._relay(flat, 'rs', j, 'ag' if last else 'rs', op.reduce_)
        # All-gather: at step s, worker r receives the reduced segment r-s and copies it,
        # passing it on unless its right neighbour is the one that reduced it:
        #
        #   step 0   A   B   c0+c2      a0+a1 B  C         A   b1+b2 C
        #   step 1   A   B   C          A   B   C          A   B   C
        for s in range(N - 1):
            j = (r - s) % N
            self._relay(flat, 'ag', j, 'ag' if s < N - 2 else None)
        self.link.end()
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
            self.link.send(flat[a:b], 'rs', r, k)
        for s in range(N - 1):
            j = (r - s - 1) % N                       # at the last step j = r+1: reduced
            self._relay(flat, 'rs', j, 'rs' if s < N - 2 else None, op.reduce_)
        self.link.end()
        return flat

    def broadcast_(self, flat, root, call='broadcast', replay=None):
        """Copy ``flat`` of worker ``root`` into ``flat`` of every worker.

        The data goes down a pipelined chain root -> root+1 -> ... -> root-1; then a
        token goes once round the ring, from the last one to the root and on, so that
        no worker returns before every one has checked the call: one that names another
        root is seen by its right neighbour, and all hear of it."""
        whole = self._begin(flat, [(0, flat.numel())], call, replay, root)[0]
        last = (self.rank + 1) % self.size == root   # the end of the chain
        if self.rank == root:
            for k, (a, b) in enumerate(self.chunks(whole)):
                self.link.send(flat[a:b], 'bc', 0, k)
        else:                                      # the last one keeps what it gets
            self._relay(flat, 'bc', 0, None if last else 'bc')
        if last:
            self.link.send(flat[:0], 'end', 0, 0)
        self.link.recv(flat[:0], 'end', 0, 0)
        if not last:
            self.link.send(flat[:0], 'end', 0, 0)
        self.link.end()
        return flat

    def allgather_(self, flat, seg, call='allgather', replay=None):
        """Worker i holds ``flat[seg[i][0]:seg[i][1]]``; afterwards every worker holds all."""
        N, r = self.size, self.rank
        self._begin(flat, seg, call, replay)
        for k, (a, b) in enumerate(self.chunks(seg[r])):
            self.link.send(flat[a:b], 'ag', r, k)
        for s in range(N - 1):   # the all-gather phase of allreduce_, starting one earlier
            j = (r - s - 1) % N
            self._relay(flat, 'ag', j, 'ag' if s < N - 2 else None)
        self.link.end()
        return flat

    def pass_right_(self, x, into, call='pass_right', replay=None):
        """Send ``x`` to the right neighbour and receive the left neighbour's into
        ``into`` (1-D, of x's length): one step of the ring (ZeRO's shard replicas,
        shard_replica.py)."""
        self._begin(x, [(0, x.numel())], call, replay)
        for k, (a, b) in enumerate(self.chunks((0, x.numel()))):
            self.link.send(x[a:b], 'pr', 0, k)
        for k, (a, b) in enumerate(self.chunks((0, x.numel()))):
            self.link.recv(into[a:b], 'pr', 0, k)
        self.link.end()
        return into

    def _begin(self, flat, segs, call, replay, root=None):
        """Start a collective on ``flat`` cut into ``segs``; returns segs."""
        self._itemsize, self._segs = flat.element_size(), segs
        self.link.begin(call, flat.numel(), replay, root)
        return segs

    def chunks(self, segment):
        """Cut a segment (start, end) into chunks of at most chunk_bytes; one empty chunk
        if it is empty, so that every step sends something: a worker in join() learns of
        a collective from the first chunk its left neighbour sends, whatever the sizes."""
        a, b = segment
        step = max(1, self.chunk_bytes // self._itemsize)
        return [(i, min(i + step, b)) for i in range(a, b, step)] or [(a, a)]

    def _relay(self, flat, phase, j, forward, reduce_=None):
        """Receive segment j from the left chunk by chunk into ``flat`` (reduced with
        ``reduce_``, or copied), passing each chunk on to the right at once (as phase
        ``forward``) unless that is None."""
        for k, (a, b) in enumerate(self.chunks(self._segs[j])):
            self.link.recv(flat[a:b], phase, j, k, reduce_)
            if forward:
                self.link.send(flat[a:b], forward, j, k)
