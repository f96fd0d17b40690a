"""Horovod's join on the ring: a worker out of data takes part in the others' collectives.

It has no collective of its own to call, so it learns each one the others call from
the first chunk that reaches it -- a call's first chunk on each link describes it --
and takes part with a stand-in (zeros, the op's identity: ring_backend.py), until the
scheduler says every worker has joined (JOIN_DONE). What it cannot take part in (a
broadcast, an allgather: ``Refused``) fails on every worker. ``Join`` works through
the ``Link`` (link.py) it is given. Why and how: docs/design/ring.md.
"""
import time

from ..lines import NAME, clip, shown
from ..runtime import hang, protocol
from .link import DISAGREE, JOINED, RING, drain, is_stale


class Refused(ValueError):
    """A collective that a worker in join() takes no part in (Horovod refuses it)."""


class Join:
    """hvd.join() and the refusals of a worker, over ``link``."""

    def __init__(self, link):
        self.link, self.node = link, link.node

    def join(self, take_part):
        """Take part in the collectives the other workers call, with nothing of this
        worker's own: ``take_part(replay)`` for each, with the description its first
        chunk carries; until every worker has joined. Returns the last one's rank."""
        link = self.link
        if not link.opened:
            link.open(hang.Wait('in join(), opening the ring',
                                [('scheduler', {'counter': 'ring', 'n': 1})]))
        # The scheduler first, and the others only once it has counted this one: a worker
        # that joins because it heard of this one then comes after it there too ('last').
        self.node.send('scheduler', protocol.JOIN, {'calls': link.calls})
        self.node.recv([protocol.JOIN_NOTED], wait=hang.Wait(
            'in join(), for the scheduler', [('scheduler', {'counter': 'ring', 'n': 1})]))
        link.tell_all(JOINED, {'round': link.joins + 1})
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
                return self.all_joined(msg)
            if is_stale(msg, link.failed):
                drain(msg)
            elif msg.kind == RING and msg.get('joins') != link.joins:
                later.append(msg)
            else:
                self._serve(msg, take_part)

    def _serve(self, msg, take_part):
        """One message to a worker in join(): a collective begins, a note, a barrier."""
        link = self.link
        if msg.kind == RING:                       # a collective's first chunk: take part
            self.node.put_back(msg)                # (the collective itself reads it)
            try:
                take_part(msg.get('replay'))
            except Refused as e:
                self.refuse(f'{self.node.id} has called join() (it is out of data): '
                            f'{clip(msg.get("call"), NAME)} refused: {e}')
            except hang.Disagree:      # the call failed on every worker: wait on in join()
                pass
            except ValueError as e:
                link.disagree(f'{self.node.id} in join() cannot take part in '
                              f'{clip(msg.get("call"), NAME)}: {e}')
        elif msg.kind == JOINED:
            link.joined[msg.sender] = msg.get('round')
        elif msg.kind == protocol.BARRIER_DONE:    # the scheduler counted this one there
            self.node.passed_barrier(msg.get('group'), msg.get('n'))
        elif msg.get('n') == link.calls + 1:       # the next call failed before it came
            link.calls += 1
            link.mark_failed()
        else:
            raise hang.Disagree(f'{shown(self.node.id)} stops: {clip(msg.get("error"))}')

    def refuse(self, error):
        """Make the next collective fail on every other worker (they may have begun it),
        and count it as failed here too: its chunks are dropped when they come, and the
        notices of workers that refused it too."""
        link = self.link
        if not link.opened:                     # (the others wait for this one's link)
            link.open(hang.Wait('refusing a collective, opening the ring',
                                [('scheduler', {'counter': 'ring', 'n': 1})]))
        link.calls += 1
        self.node.counters['ring'] = link.calls
        link.mark_failed()
        link.tell_all(DISAGREE, {'error': error, 'n': link.calls})

    def all_joined(self, msg):
        """The scheduler's word that every worker has joined: the last one's rank. It also
        says how many collectives the last one counted; any this worker has not seen
        failed (a worker in join() takes part in every one that does not), and their
        notices may still be on the way: count them failed now, so that the next call
        has the same number on every worker and the late notices are dropped."""
        link = self.link
        link.joins += 1
        if msg.get('error') or not isinstance(msg.get('last'), int):
            raise RuntimeError(f'join(): {clip(msg.get("error"))}')
        calls = msg.get('calls')
        while isinstance(calls, int) and link.calls < calls:
            link.calls += 1
            link.mark_failed()
        self.node.counters['ring'] = link.calls
        return msg.get('last')
