"""The requests of one call of a worker, in flight: sent to their shards' heads, and
their answers matched.

What the wait brings besides an answer is handled here, so that ``DistKVStore._ask``
reads as the textbook's send-then-wait: a new membership of the workers (elastic: the
servers count the workers left), a server's loss (what it has not answered goes again,
as it was, to the replica that answers for its shard now), a stream's word that an
answer's values are read in place, and a late answer to a call that failed. A long
wait asks the servers who is missing (``runtime/hang.py``).
"""
from .. import lines
from ..runtime import hang, protocol, stream
from ..runtime.node import WorkersChanged
from . import messages as M


class InFlight:
    """The requests one call has sent, by id, until each is answered."""

    def __init__(self, node, keys, what):
        self.node, self.keys, self.what = node, keys, what
        self.sent = {}         # id -> (shard or server, kind, header, frames)
        self.waiting = {}      # id -> the server asked, until it answers
        self.reading = {}      # server -> ids of answers being read in place, in order
        self.leaving = []      # the trackers of the last request's frames

    def send(self, rid, to, kind, header, frames):
        """Send one request, ``to`` a shard's head (or to the server named)."""
        self.sent[rid] = (to, kind, dict(header, id=rid, **_shard_of(to)), frames)
        # Between hosts, to the servers in turn (cost.py): the first server's answer comes
        # while the next one's push is on the wire. (On one host: all at once.)
        self.node.van.wait_sent(self.leaving, hang.LOOK)
        self.waiting[rid], self.leaving = self._send(*self.sent[rid])

    def answers(self):
        """Each answer to these requests, once, until all have come (``answered``)."""
        while self.waiting:
            msg = self._receive()
            if msg is not None:
                yield msg

    def answered(self, msg, in_place=False):
        """An answer has come; ``in_place``: values still in their stream are read into
        place meanwhile, and the request is done at the stream's READ."""
        if in_place and any(isinstance(f, stream.Pending) for f in msg.frames):
            self.reading.setdefault(msg.sender, []).append(msg.get('id'))
        else:
            del self.waiting[msg.get('id')]

    def _receive(self):
        """The next answer to one of these requests; None after anything else."""
        try:
            msg = self.node.recv([M.ACK, M.VALUES, M.ERROR, stream.READ, protocol.SERVERS],
                                 wait=self._hang_wait())
        except WorkersChanged:          # elastic: the servers count the workers left
            return None
        if msg.kind == protocol.SERVERS:
            self._resend()                              # a server lost: ask its replica
        elif msg.kind == stream.READ:
            self._read(msg)                             # an answer's values are in place
        elif self.waiting.get(msg.get('id')) is None:
            stream.discard(msg)                         # the answer to a request that failed
        else:
            return msg
        return None

    def _hang_wait(self):
        """How a long wait asks the servers who is missing (``runtime/hang.py``)."""
        servers = sorted(set(self.waiting.values()))
        return hang.Wait(f'for the answer to {self.what} of {self.keys} from '
                         f'{", ".join(lines.shown(s) for s in servers)}',
                         [(s, {'request': rid, **_shard_of(self.sent[rid][0])})
                          for rid, s in self.waiting.items()], span='wait for servers')

    def _resend(self):
        """A server was lost: what it has not answered goes again, as it was, to the
        replica that answers for its shard now."""
        for rid, server in self.waiting.items():
            if isinstance(self.sent[rid][0], int) and \
                    server != self.node.head(self.sent[rid][0]):
                self.waiting[rid], _ = self._send(*self.sent[rid])

    def _read(self, msg):
        """A stream's word that an answer's values are in place: its request is done."""
        if self.reading.get(msg.sender):
            self.waiting.pop(self.reading[msg.sender].pop(0), None)

    def _send(self, to, kind, header, frames):
        """Send one request to the head of its shard (or to a server named): to whom, and
        (to another host) the trackers of the big frames ZeroMQ may still be sending."""
        server = self.node.head(to) if isinstance(to, int) else to
        track = self.node.van.leaves_host(server)
        return server, self.node.send(server, kind, header, frames, track=track)


def _shard_of(to):
    """The header field that names a request's shard (none for a request to a server)."""
    return {'shard': to} if isinstance(to, int) else {}
