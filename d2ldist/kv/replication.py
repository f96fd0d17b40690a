"""Chain replication of a shard (``d2l-launch --server-replicas R``), after the Parameter
Server paper (Li et al., OSDI 2014) and van Renesse and Schneider's chain replication.

A shard's holders form a chain (``runtime/replicas.py``): the head answers the workers,
the others are its replicas. Every change of the shard's state -- a round's update, an
init, the optimizer, its learning rate or states -- is numbered by the head and sent
down the chain; each holder applies it and sends it on, and the last one says so back
up. The head answers a request only once the last holder has every change the answer
shows, so an answered pull is never lost with a server::

    worker --push--> head --change 7--> replica 1 --change 7--> replica 2 (the tail)
    worker <-values- head <--done 7---- replica 1 <--done 7----
                     (the head answers only here)

A round's update travels as the sum the round closed with, not as the new weights:
each holder's optimizer applies it to its own copy, as the head's did, and ends with
the same bits (the same code on the same numbers), and with the same optimizer state.

When a holder is lost, the one before it sends on again what the lost one had not
said done; a replica that becomes the head answers the workers from then on. A new
holder after a loss first gets the shard whole (``Chain.send_copy``, ``copies.py``).
``Changes`` is what a shard's server sees of this: ``made`` (an update),
``send_updates``, ``send`` and ``shown``. More: docs/design/kv.md.
"""
from collections import OrderedDict

from ..runtime.van import VAN_FIELDS
from . import messages as M

CHAIN_FIELDS = VAN_FIELDS | {'shard', 'number', 'change'}   # a change's own, as it travels
COPY = 'kv_copy'      # holder -> a new one after a loss: {shard, number, holders} and the
                      #   shard whole (copies.py: its fields and frames)


class Changes:
    """A shard's changes on their way to its replicas: the head keeps the updates it
    makes and sends them down its chain as one change; a request is answered once the
    last holder has every change it shows (at once, without replicas)."""

    def __init__(self, chain, store, lend):
        self.chain = chain
        self.store = store     # key -> its slot: the number of its last change (``changed``)
        self.lend = lend       # lend(keys, sent): their values go out from their own memory
        self.updates = []      # [(key, sum, positions, accumulate, numbers)]: to send

    @property
    def replicated(self):
        """Does this shard have replicas to wait for (its head's view)?"""
        return bool(self.chain.holders[1:])

    def made(self, key, grad, positions, accumulate, numbers):
        """A round closed (or an async push was applied) on the head: keep the update
        for the replicas (``numbers``: the pushes it counts)."""
        if self.chain.is_head and self.replicated:
            self.updates.append((key, grad, positions, accumulate, numbers))

    def send_updates(self):
        """Send the updates made since the last call down the chain, as one change."""
        if not self.updates:
            return
        entries, frames = [], []
        for key, grad, positions, accumulate, numbers in self.updates:
            entries.append([key, None if positions is None else int(positions.numel()),
                            accumulate, [[w, n] for w, n in numbers.items()
                                         if isinstance(n, int)]])
            frames += M.data([grad.contiguous()])
            if positions is not None:
                frames += M.data([positions.contiguous()])
        keys, self.updates = [u[0] for u in self.updates], []
        self.send(M.UPDATE, {'updates': entries}, frames, keys)

    def take_updates(self, msg, update):
        """(a replica) The updates its head made, each through ``update(key, sum,
        positions, accumulate, numbers)``: the same sums through the same optimizer,
        so its copy and the optimizer's state end with the head's bits."""
        frames = iter(msg.frames)
        for key, rows, accumulate, numbers in msg.get('updates'):
            slot = self.store[key]
            count = rows if isinstance(rows, int) else slot.stop - slot.start
            grad = M.wire.unpack({'dtype': slot.dtype, 'shape': [count]}, next(frames)).clone()
            positions = M.wire.unpack({'dtype': 'int64', 'shape': [count]}, next(frames)) \
                if isinstance(rows, int) else None
            update(key, grad, positions, accumulate is True,
                   {str(w): n for w, n in numbers if isinstance(n, int)})

    def send(self, kind, header, frames, keys=()):
        """A change made here goes down the chain (at once done, without replicas); the
        keys it changed are answered only once the last holder has it."""
        number, trackers = self.chain.change(kind, header, frames)
        for key in keys:
            self.store[key].changed = number
        self.lend(keys, lambda: all(t.done for t in trackers))

    def shown(self, number):
        """Has the last holder every change up to ``number``?"""
        return number <= self.chain.done


class Chain:
    """One shard's place in its chain: number and send changes on, apply what comes,
    and know which changes the last holder has (``done``)."""

    def __init__(self, node, shard, holders):
        self.node, self.shard, self.holders = node, shard, list(holders)
        self.number = 0                # the last change made (head) or applied (replica)
        self.done = 0                  # (head) the last change every holder has
        self.in_flight = OrderedDict()  # number -> (kind, header, frames): sent on, not done
        self.bytes_sent = 0            # the frames of the changes sent on: what replicas cost
        self.owed = None               # a new next holder, owed the shard whole (copies.py)

    @property
    def is_head(self):
        return self.holders[0] == self.node.id

    def _next(self):
        me = self.holders.index(self.node.id)
        return self.holders[me + 1] if me + 1 < len(self.holders) else None

    def _previous(self):
        me = self.holders.index(self.node.id)
        return self.holders[me - 1] if me > 0 else None

    def change(self, kind, header, frames=()):
        """(head) Number a change already made here and send it down the chain; its
        number, and the trackers of the frames sent (their memory is being read)."""
        self.number += 1
        if self._next() is None:       # no replica left (or none asked for): done now
            self.done = self.number
            return self.number, []
        return self.number, self._send_on(self.number, kind, header, frames)

    def _send_on(self, number, kind, header, frames):
        self.in_flight[number] = (kind, header, frames)
        self.bytes_sent += sum(memoryview(f).nbytes for f in frames)
        return self.node.send(self._next(), M.REPLICATE,
                              dict(header, shard=self.shard, number=number, change=kind),
                              frames, track=True)

    def received(self, msg, apply):
        """(replica) A change from the holder before: apply it (``apply(kind, msg)``)
        once, in order, and send it on or, the last, say it is done. Returns the
        trackers of what was sent on."""
        number, kind = msg.get('number'), msg.get('change')
        if msg.sender != self._previous() or not isinstance(number, int):
            return []                  # (a late one from a holder lost meanwhile)
        if number <= self.number:      # sent again after a loss: we have it
            if number not in self.in_flight:
                self._done(number)
            return []
        if number != self.number + 1:
            return []                  # (cannot happen: changes come in order)
        apply(kind, msg)
        self.number = number
        if self._next() is None:
            self._done(number)
            return []
        header = {k: v for k, v in msg.header.items() if k not in CHAIN_FIELDS}
        return self._send_on(number, kind, header, msg.frames)

    def acknowledged(self, msg):
        """The next holder has every change up to ``number``: so have all after it."""
        number = msg.get('number')
        if msg.sender == self._next() and isinstance(number, int):
            self._settle(number)

    def _settle(self, number):
        for n in [n for n in self.in_flight if n <= number]:
            del self.in_flight[n]
        if self.is_head:
            self.done = max(self.done, number)
        else:
            self._done(number)

    def _done(self, number):
        self.node.send(self._previous(), M.REPLICATED, {'shard': self.shard, 'number': number})

    def changed(self, holders, copying=()):
        """The scheduler's new holders after a loss: send again what the lost next one
        had not said done, or, now the last, count it done; a new next one (``copying``)
        is ``owed`` the shard whole instead. True if this holder has just become the head."""
        was_head, before = self.is_head, self._next()
        self.holders = list(holders)
        if self.node.id not in self.holders:
            return False
        promoted = self.is_head and not was_head
        if promoted:                   # what it sent on and has not heard back about
            self.done = min(self.in_flight, default=self.number + 1) - 1
        after = self._next()
        if after != before and after is None:
            self._settle(self.number)
        elif after != before and after in copying:
            self.owed = after
        elif after != before:
            for number, (kind, header, frames) in self.in_flight.items():
                self._send_on(number, kind, header, frames)
        return promoted

    def send_copy(self, header, frames):
        """(the holder before a new one) Send it the shard whole, as of this holder's last
        change: the changes after it follow, as to any holder."""
        to, self.owed = self.owed, None
        self.bytes_sent += sum(memoryview(f).nbytes for f in frames)
        self.node.send(to, COPY, dict(header, shard=self.shard, number=self.number,
                                         holders=self.holders), frames)

    def copied(self, msg, take):
        """(a new holder) The shard whole, as of change ``number`` of the holder before:
        ``take(msg)`` it, and send it on or, the last, say it is done. False if it came
        from another than the holder before (one lost since)."""
        number = msg.get('number')
        if msg.sender != self._previous() or not isinstance(number, int):
            return False
        take(msg)
        self.number, self.in_flight = number, OrderedDict()
        if self._next() is None:
            self._done(number)
        else:                          # (a second new holder after it)
            header = {k: v for k, v in msg.header.items() if k not in VAN_FIELDS}
            self.node.send(self._next(), COPY, dict(header, holders=self.holders),
                           msg.frames)
        return True
