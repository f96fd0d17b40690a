"""The server of the key-value store: receive, aggregate, update, answer.

Each server holds a slice of the model (``placement.place`` says which). Workers push
gradients and pull weights. In **sync** mode (dist_sync) a server adds up the pushes of
a key and, only when all N workers have pushed it this round, updates the key once --
with the optimizer if a worker set one, else the value becomes the sum -- and answers
every pull that waited for that round. Keys initialised with ``optimizer=False`` (the
Trainer's BatchNorm statistics) are never given to the optimizer. In **async** mode (dist_async) each push is
applied the moment it arrives: nobody waits for anybody.

Elastic workers (``d2l-launch --min-workers``): the scheduler tells the servers which
workers are left (``WORKERS``) whenever one is lost, joins or finishes, and a sync round
then waits for those only. Which pushes count: every push that has **arrived** is in the
round's sum, and counts once (a worker's second push waits for the next round). So the
round open when a worker dies counts its push if it came before the death, and closes
without it if not; the rounds after count the workers left. A worker that joins says
where it listens (``HELLO``) and pulls the current values. Its pushes must count from
the same round on every server, yet the scheduler's word reaches each server at its own
moment; so the pushes decide: each carries the newest membership its sender knew, and
a round waits for the joiner from the first round where one of the others' pushes knew
of it (``waits_for``). Until then the joiner's push waits; a push that knows more than
this server waits for the scheduler's word.

Replicated servers (``d2l-launch --server-replicas R``): a server holds its own shard
and replicas of the R shards before it, each a ``KVServer`` of its own; the loop hands
each message to the shard it names. A replica only applies the changes its chain sends
(``replication.py``) until the scheduler makes it the head, when it answers the workers.
Every change goes down the chain before the answer that shows it; so a push is answered
only after its round has closed and reached the last holder. A worker sends what was
unanswered again to the new head, and pushes are numbered: one already counted there
is not counted twice (``Slot.counted``).

One thread does everything, so each key changes atomically; the van receives the next
messages in its own I/O thread while we add tensors up.
"""
import os
from collections import deque

import torch

from .. import config
from ..runtime import faults, protocol, replicas, spans, stream
from . import messages as M
from .optimizers import Updater
from .replication import CHAIN_FIELDS, Chain


class Slot:
    """This server's slice of one key: elements start..stop of the flattened value."""

    def __init__(self, dtype, shape, start, stop, value, optimizer=True):
        self.dtype, self.shape, self.start, self.stop, self.value = dtype, shape, start, stop, value
        self.optimizer = optimizer     # False: the optimizer never updates this key
        self.changed = 0               # the chain's number of its last change (replicas)
        self.counted = {}              # worker -> the number of its last push in the value


class Round:
    """The pushes of one key in the current sync round: their sum and who pushed, and,
    while only rows were pushed (a sparse key), which elements they touched.

    The sum adds the parts in the workers' rank order, whatever order they arrive in
    (in floating point (a + b) + c is not (a + c) + b to the last bit): a part is added at
    once if every lower rank's is in, else held until then, or until the round closes. So
    two runs, or a replica that sums the pushes sent again after its head was lost, get
    the same bits."""

    def __init__(self):
        self.sum, self.pushed, self.touched = None, set(), None
        self.numbers = {}              # worker -> the number of its push in this round
        self.membership = 0            # the newest membership its pushes knew (elastic)
        self.held = {}                 # worker -> a part that came before a lower rank's
        self.next = 0                  # the lowest rank not in the sum yet

    def add(self, worker, part, like):
        """Take the worker's part: into the sum now if it is the next rank's."""
        self.held[worker] = part
        while f'worker:{self.next}' in self.held:
            self._add(self.held.pop(f'worker:{self.next}'), like)
            self.next += 1

    def total(self, like):
        """The sum, with the parts still held (a lower rank did not push: it was lost,
        or has finished) added in rank order."""
        for worker in sorted(self.held, key=_rank_order):
            self._add(self.held.pop(worker), like)
        return self.sum

    def _add(self, part, like):
        """Add a pushed part to the sum: all its elements, or a sparse key's rows (into
        zeros ``like`` the key's value)."""
        if part.positions is None:
            if self.sum is None:
                self.sum = part.value                    # the message's own memory, no copy
            else:
                self.sum.add_(part.value)                # in place, while more pushes arrive
            self.touched = None                          # a dense push touches every row
            return
        if self.sum is None:
            self.sum = like.new_zeros(like.shape)
            self.touched = torch.zeros(like.shape, dtype=torch.bool)
        self.sum.index_add_(0, part.positions, part.value)
        if self.touched is not None:
            self.touched[part.positions] = True


class Answered(Exception):
    """A request refused, its error already sent."""


class Waiting:
    """A request answered later: once the rounds it pushed into have closed (``keys``),
    and the last holder of the shard has every change the answer shows (``after``)."""

    def __init__(self, worker, rid, parts, keys, values=True, after=0):
        self.worker, self.rid, self.parts, self.keys = worker, rid, parts, keys
        self.values, self.after = values, after     # values: VALUES, else an ACK


def apply_update(updater, key, value, grad, positions=None, accumulate=False):
    """What a server does with ``grad``, the sum of a key's pushes; returns the new value.

    The optimizer (``updater``; None: none set, or a key made with optimizer=False)
    updates ``value`` in place; without one the sum becomes the value (sync) or is
    added to it (async: ``accumulate``). A sparse key's rows: ``grad`` holds the
    elements at ``positions`` of the flattened value, and only they change (the MXNet
    optimizer's lazy update; a sum that becomes the value is zero elsewhere).
    """
    if updater is None and not accumulate and positions is None:
        return grad                                       # the sum becomes the value
    if updater is None and not accumulate:
        total = torch.zeros_like(value)                   # ... and is zero elsewhere
        total.view(-1)[positions] = grad.view(-1)
        return total
    if updater is None and positions is None:
        value.add_(grad)                                  # async: the sum is added
    elif updater is None:
        value.view(-1).index_add_(0, positions, grad.view(-1))
    elif positions is None:
        updater(key, value, grad)                         # the optimizer's step
    else:
        updater.update_rows(key, value.view(-1), positions, grad.view(-1))
    return value


class KVServer:
    """The parameter server's state of one shard, and the server's loop."""

    def __init__(self, node, shard=None, links=None):
        self.node = node
        self.shard = int(node.id.split(':')[1]) if shard is None else shard
        self.store = {}        # key -> Slot
        self.rounds = {}       # key -> Round still open (sync mode)
        self.waiting = []      # [Waiting]: requests answered once their rounds close
        self.deferred = {}     # worker -> deque of its requests that must wait for a round
        self.updater = None    # the optimizer, once a worker sets one
        self.lent = {}         # key -> [sent(), ...]: its value went out without a copy
        self.nth = {}          # n -> (first worker, its keys, workers seen): sync push n
        self.links = {} if links is None else links   # worker -> the stream its VALUES
        self.closed = 0        # rounds closed (async: pushes) on the first key (--fail)
        self.workers = set(node.peers('worker'))   # whom a sync round waits for
        self.membership = 0    # the scheduler's number of that membership (elastic)
        self.joining = {}      # worker that joined -> (membership it joined in, keys entered)
        self.numbered = set(self.workers)          # whose push numbers agree() compares
        r = config.get().server_replicas           # this shard's chain of holders
        self.chain = Chain(node, self.shard, replicas.chains(node.num_servers, r)[self.shard]
                           if r else [node.id])
        self.updates = []      # [(key, sum, positions, accumulate, numbers)]: to replicate
        self.shards = {self.shard: self}   # and the replicas this server holds (serve)

    def serve(self):
        """Answer requests until the scheduler says the job is over."""
        self.hold_replicas()
        while self.dispatch(self.node.recv()):         # raises PeerFailed if a node died
            pass

    def hold_replicas(self):
        """Replicated servers: a KVServer for each shard this server holds a replica of."""
        r, me = config.get().server_replicas, self.node.id
        for shard, holders in enumerate(replicas.chains(self.node.num_servers, r) if r else []):
            if me in holders[1:]:
                self.shards[shard] = KVServer(self.node, shard, self.links)

    def dispatch(self, msg):
        """Hand a message to the shard it names (this server's own, or a replica it
        holds), or act on it for all; False once the job is over."""
        if msg.kind == protocol.SHUTDOWN:
            return False
        if msg.sender == 'scheduler' and msg.kind in (protocol.WORKERS, protocol.SERVERS):
            for shard in self.shards.values():         # the workers left; the chains now
                shard.news(msg)
        elif msg.kind == M.LINK:                       # a worker offers a stream
            self.link(msg)
        elif msg.kind == M.HELLO:                      # a worker joins the running job
            if self.hello(msg):
                for shard in self.shards.values():
                    shard is self or shard.forget(msg.sender)
        else:
            question = msg.get('question') if msg.kind == protocol.WHO else None
            shard = (question if isinstance(question, dict) else msg.header).get(
                'shard', self.shard)
            if isinstance(shard, int) and shard in self.shards:
                self.shards[shard].receive(msg)
        return True

    def receive(self, msg):
        """A message for this shard: a request, a question, or a change of its chain."""
        if msg.kind == protocol.WHO:                   # a worker has waited long (hang.py)
            self.who(msg)
        elif msg.kind == M.REPLICATE:                  # a change from the holder before
            try:
                self.chain.received(msg, self.apply)
            except (M.KVError, KeyError, TypeError, ValueError, StopIteration) as e:
                print(f'd2ldist: {self.node.id.replace(":", " ")}: a change of shard '
                      f'{self.shard} could not be applied ({e!r}); it no longer follows '
                      'its head'[:300], flush=True)
        elif msg.kind == M.REPLICATED:                 # the holders after have changes
            self.chain.acknowledged(msg)
            self.answer_ready()
        elif msg.kind in M.REQUESTS:
            queue = self.deferred.setdefault(msg.sender, deque())
            with spans.span(msg.kind[3:], 'server', worker=msg.sender,
                               bytes=sum(memoryview(f).nbytes for f in msg.frames)):
                if queue or not self.handle(msg):      # keep each worker's order
                    queue.append(msg)
                self.retry_deferred()
            spans.tick()

    def handle(self, msg):
        """Answer one request; False if it must wait until a round closes (or until
        this replica becomes the shard's head)."""
        if not self.chain.is_head:
            return False
        try:
            if msg.kind == M.PUSH:
                return self.push(msg, M.read_parts(msg, with_frames=True))
            if msg.kind == M.PUSH_ROWS:
                return self.push(msg, M.read_row_parts(msg, with_values=True))
            if msg.kind == M.PULL:
                self.pull(msg, M.read_parts(msg, with_frames=False))
            elif msg.kind == M.PULL_ROWS:
                self.pull(msg, M.read_row_parts(msg, with_values=False))
            elif msg.kind in (M.INIT, M.OPTIMIZER, M.LEARNING_RATE, M.SET_STATE):
                self.apply(msg.kind, msg)              # raises KVError if refused
                self.replicate(msg.kind, {k: v for k, v in msg.header.items()
                                          if k not in CHAIN_FIELDS and k != 'id'}, msg.frames)
                self.answer_later(Waiting(msg.sender, msg.get('id'), [], set(), False,
                                          self.chain.number))
                self.answer_ready()
            elif msg.kind == M.INFO:
                self.ack(msg, keys=[M.Part(k, s.dtype, s.shape, s.start, s.stop).head()
                                    for k, s in self.store.items()],
                         pid=os.getpid(), optimizer=self.updater and self.updater.name,
                         shard=self.shard, replicated=self.chain.bytes_sent)
            elif msg.kind == M.GET_STATE:
                self.get_state(msg)
        except Answered:
            pass
        except (M.KVError, KeyError, TypeError, ValueError) as e:   # refuse it, go on serving
            error = str(e) if isinstance(e, M.KVError) else f'malformed request ({e!r})'[:300]
            self.node.send(msg.sender, M.ERROR, {'id': msg.get('id'), 'error': error})
        return True

    # -- the heart: push, aggregate, update --------------------------------------------------
    def push(self, msg, parts):
        """Aggregate (sync) or apply (async) the pushed values -- of a sparse key, only
        the rows pushed; answer or ack."""
        self.check(parts, 'pushed')
        sync, worker, n = msg.get('sync') is not False, msg.sender, msg.get('n')
        if sync and any(worker in self.rounds.get(p.key, Round()).pushed for p in parts):
            return False                                 # its second push waits for the round
        knew = msg.get('membership') if isinstance(msg.get('membership'), int) else 0
        if sync and not self.may_count(worker, knew, parts):
            return False                                 # (elastic: not its round yet)
        if sync:
            self.agree(msg, parts)
        closed = []
        for p in parts:
            if isinstance(n, int) and n <= self.store[p.key].counted.get(worker, 0):
                continue                                 # sent again: counted already
            if not sync:                                 # async: apply on arrival
                self.update(p.key, p.value, p.positions, accumulate=True, numbers={worker: n})
                self.served(p.key, 'push')
                continue
            r = self.rounds.setdefault(p.key, Round())
            r.add(worker, p, self.store[p.key].value)
            r.numbers[worker], r.membership = n, max(r.membership, knew)
            if worker in self.joining:
                self.joining[worker][1].add(p.key)
            if self.pushed(p.key, r, worker):
                closed.append(p.key)
        self.replicate_updates()
        if msg.get('pull') or self.chain.holders[1:]:    # (replicas: once it is theirs)
            self.answer_later(Waiting(worker, msg['id'], parts, self.open_rounds(worker, parts),
                                      values=bool(msg.get('pull'))))
        else:
            self.ack(msg)
        self.answer_ready(closed)
        return True

    def pushed(self, key, r, worker):
        """Count the worker's push in the round; when all have pushed, update, True."""
        r.pushed.add(worker)
        if not self.waits_for(key, r) <= r.pushed:
            return False
        self.close(key, r)
        return True

    # Elastic: which round a worker that joined pushes into first. Every server must
    # choose the same one, and only the pushes reach them all alike: each push says which
    # membership its sender knew. The first round of a key where a push knew of the
    # joiner waits for it, and so do all after; its pushes wait until then.
    def waits_for(self, key, r):
        """The workers the round ``r`` of ``key`` waits for: the workers left, a worker
        that joined only once it entered the key's rounds or a push knew of it."""
        return {w for w in self.workers if w not in self.joining or key in self.joining[w][1]
                or r.membership >= self.joining[w][0]}

    def may_count(self, worker, knew, parts):
        """May this sync push count now? Not if it knew a newer membership than this
        server (the scheduler's word is on its way); from a worker that joined, only
        into rounds that wait for it (or with no one else left to decide)."""
        if knew > self.membership:
            return False
        if worker not in self.joining or not self.workers - set(self.joining):
            return True
        since, entered = self.joining[worker]
        return all(p.key in entered or getattr(self.rounds.get(p.key), 'membership', 0) >= since
                   for p in parts)

    def close(self, key, r):
        """Every worker has pushed into the key's round: update the key once."""
        total = r.total(self.store[key].value)
        if r.touched is None:
            self.update(key, total, numbers=r.numbers)
        else:                                        # only rows: update only them
            positions = r.touched.nonzero().view(-1)
            self.update(key, total[positions], positions, numbers=r.numbers)
        del self.rounds[key]
        self.served(key, 'sync round')

    def served(self, key, what):
        """A round of ``key`` closed (async: a push applied): count those of the first key
        of this server's own shard, for d2l-launch --fail server:R@step=N."""
        if key == next(iter(self.store)) and self.node.id == f'server:{self.shard}':
            self.closed += 1
            faults.served(self.closed, what)

    def update(self, key, grad, positions=None, accumulate=False, numbers=None):
        """Update the key from a sum of pushes (``apply_update``), on a copy of its value
        if that may still be on its way to a worker (``writable``); and keep the update
        for the shard's replicas (``numbers``: the pushes it counts)."""
        slot = self.store[key]
        slot.value = apply_update(self.updater if slot.optimizer else None, key,
                                  self.writable(key), grad, positions, accumulate)
        slot.counted.update(numbers or {})
        if self.chain.is_head and self.chain.holders[1:]:
            self.updates.append((key, grad, positions, accumulate, numbers or {}))

    def replicate_updates(self):
        """Send the updates made since the last call down the chain, as one change."""
        if not self.updates:
            return
        entries, frames = [], []
        for key, grad, positions, accumulate, numbers in self.updates:
            entries.append([key, None if positions is None else int(positions.numel()),
                            accumulate, [[w, n] for w, n in numbers.items()
                                         if isinstance(n, int)]])
            frames.append(_data([grad.contiguous()])[0])
            if positions is not None:
                frames.append(_data([positions.contiguous()])[0])
        keys, self.updates = [u[0] for u in self.updates], []
        self.replicate(M.UPDATE, {'updates': entries}, frames, keys)

    def replicate(self, kind, header, frames, keys=()):
        """A change made here goes down the chain (at once done, without replicas); the
        keys it changed are answered only once the last holder has it."""
        number, trackers = self.chain.change(kind, header, frames)
        for key in keys:
            self.store[key].changed = number
        self.lend(keys, lambda: all(t.done for t in trackers))

    def pull(self, msg, parts):
        """Send the values asked for, once the rounds this worker pushed into have closed."""
        self.check(parts, 'pulled')
        self.answer_later(Waiting(msg.sender, msg['id'], parts,
                                  self.open_rounds(msg.sender, parts)))
        self.answer_ready()

    def open_rounds(self, worker, parts):
        """The keys of ``parts`` whose open round this worker has pushed into."""
        return {p.key for p in parts if worker in getattr(self.rounds.get(p.key), 'pushed', ())}

    def answer_later(self, waiting):
        """Answer a request once its rounds have closed and its changes are replicated."""
        self.waiting.append(waiting)

    def answer_ready(self, closed=()):
        """The rounds of keys ``closed`` have closed: answer the requests that now wait
        for nothing (no round open, every change they show at the last holder)."""
        for w in list(self.waiting):
            w.keys.difference_update(closed)
            if w.keys or max([w.after] + [self.store[p.key].changed for p in w.parts]) \
                    > self.chain.done:
                continue
            self.waiting.remove(w)
            if w.values:
                self.send_values(w.worker, w.rid, w.parts)
            else:
                self.node.send(w.worker, M.ACK, {'id': w.rid})

    def retry_deferred(self):
        """Handle deferred requests whose turn has come (a round they waited for closed)."""
        progress = True
        while progress:
            progress = False
            for queue in self.deferred.values():
                while queue and self.handle(queue[0]):
                    queue.popleft()
                    progress = True

    # -- calls that disagree, and waits that last ---------------------------------------------
    def agree(self, msg, parts):
        """Sync pushes are numbered per worker and server: every worker's n-th push here
        must carry the same keys. If not, the rounds can never close: fail every worker
        waiting here, naming both sides, instead of hanging."""
        n, keys = msg.get('n'), [p.key for p in parts]
        if not isinstance(n, int) or msg.sender not in self.numbered:   # (one that joined)
            return
        first, firsts_keys, seen = self.nth.setdefault(n, (msg.sender, keys, set()))
        seen.add(msg.sender)
        if keys != firsts_keys:
            (a, keys_a), (b, keys_b) = sorted([(first, firsts_keys), (msg.sender, keys)],
                                              key=lambda p: int(p[0].split(':')[1]))
            error = (f'push {n} of {a.replace(":", " ")} carried keys {keys_a!r}, push {n} '
                     f'of {b.replace(":", " ")} keys {keys_b!r}; in dist_sync every worker '
                     'must push the same keys in the same order')[:600]
            for worker, rid in [(w.worker, w.rid) for w in self.waiting] + [
                    (msg.sender, msg.get('id'))]:
                self.node.send(worker, M.ERROR, {'id': rid, 'error': error, 'disagree': True})
            self.waiting.clear()
            raise Answered()
        if seen >= self.numbered:
            del self.nth[n]

    # -- the scheduler's news: elastic workers, replicated servers --------------------------
    def news(self, msg):
        """The workers left (elastic), or the chains of holders after a server's loss."""
        if msg.kind == protocol.WORKERS:
            self.workers_changed(msg.get('workers'), msg.get('round'))
        elif self.node.chains is not None and self.chain.changed(self.node.chains[self.shard]):
            print(f'd2ldist: {self.node.id.replace(":", " ")} answers for shard {self.shard} '
                  f'now: its replica has every change up to {self.chain.number}', flush=True)
        self.retry_deferred()
        self.answer_ready()

    def workers_changed(self, workers, membership):
        """The workers left are ``workers`` (membership number ``membership``): close the
        rounds that now have every push they wait for, and forget the requests of the
        workers gone; a worker new here joined (``waits_for``)."""
        if not isinstance(workers, list) or not all(isinstance(w, str) for w in workers) \
                or not isinstance(membership, int):
            return
        self.joining = {w: j for w, j in self.joining.items() if w in workers}
        self.joining.update({w: (membership, set()) for w in set(workers) - self.workers})
        self.membership = max(self.membership, membership)
        self.workers, self.numbered = set(workers), self.numbered & set(workers)
        for gone in set(self.deferred) - self.workers:
            self.deferred.pop(gone)
        self.waiting = [w for w in self.waiting if w.worker in self.workers]
        self.nth = {n: entry for n, entry in self.nth.items() if not entry[2] >= self.numbered}
        closed = [key for key, r in self.rounds.items() if self.waits_for(key, r) <= r.pushed]
        for key in closed:
            self.close(key, self.rounds[key])
        self.replicate_updates()
        self.answer_ready(closed)

    def hello(self, msg):
        """A worker joins the running job (a lost one started again, say): answer it at
        its new address, on a new stream if it offers one; True if it was met."""
        worker, address, host = msg.sender, msg.get('address'), msg.get('host_id')
        if not isinstance(address, str) or not worker.startswith('worker:'):
            return False
        try:
            self.node.meet([worker, address, host if isinstance(host, str) else None])
        except ValueError as e:                       # refuse it, go on serving
            self.node.send(worker, M.ERROR, {'id': msg.get('id'), 'error': str(e)})
            return False
        self.forget(worker)
        self.ack(msg)
        return True

    def forget(self, worker):
        """A worker starts anew: its stream, its requests and its pushes' numbers go."""
        self.links.pop(worker, None)
        self.deferred.pop(worker, None)
        self.waiting = [w for w in self.waiting if w.worker != worker]
        for slot in self.store.values():
            slot.counted.pop(worker, None)

    def who(self, msg):
        """Answer a worker that has waited long: who has not pushed into the rounds
        its request ``id`` waits for (hang.py)."""
        question = msg.get('question')
        rid = question.get('request') if isinstance(question, dict) else None
        keys = set()
        for w in self.waiting:
            if w.worker == msg.sender and w.rid == rid:
                keys |= w.keys
        for m in self.deferred.get(msg.sender, ()):
            if m.get('id') == rid and isinstance(m.get('parts'), list):
                keys |= {k for k in M.keys_of(m['parts'])
                         if msg.sender in getattr(self.rounds.get(k), 'pushed', ())}
        missing = {}
        for key in sorted(keys, key=str):
            r = self.rounds.get(key)
            for w in sorted(self.waits_for(key, r) - r.pushed if r else (),
                            key=lambda w: int(w.split(':')[1])):
                missing.setdefault(w, []).append(key)
        self.node.send(msg.sender, protocol.WHO_ANSWER, {'id': msg.get('id'), 'missing': [
            [w, {'note': f'has not pushed {", ".join(map(repr, ks[:3]))} to '
                         f'{self.node.id.replace(":", " ")}'}] for w, ks in missing.items()]})

    # -- helpers ----------------------------------------------------------------------------
    def check(self, parts, what):
        """Refuse keys never initialised, and shapes, dtypes or slices that differ."""
        for p in parts:
            slot = self.store.get(p.key)
            if slot is None:
                raise M.KVError(f'key {p.key!r} was never initialised (call kv.init first)')
            if (p.dtype, p.shape) != (slot.dtype, slot.shape):
                raise M.KVError(f'key {p.key!r}: {what} {M.describe(p.dtype, p.shape)} but the '
                                f'key holds {M.describe(slot.dtype, slot.shape)}')
            if (p.start, p.stop) != (slot.start, slot.stop):
                raise M.KVError(f'key {p.key!r}: elements {p.start}..{p.stop} are not the '
                                f'slice {slot.start}..{slot.stop} this server holds')

    def writable(self, key):
        """The key's value, copied first if the van or a stream may still be sending it
        (by the next update they have, as a rule: a worker's round trip lies between)."""
        slot = self.store[key]
        if not all(sent() for sent in self.lent.pop(key, ())):
            slot.value = slot.value.clone()
        return slot.value

    def send_values(self, worker, rid, parts):
        """The values of whole slices; for row parts, only those rows'."""
        heads = [p.head() for p in parts]
        if parts and isinstance(parts[0], M.RowPart):
            frames = [self.store[p.key].value[p.positions] for p in parts]   # copies: not lent
            self.node.send(worker, M.VALUES, {'id': rid, 'parts': heads}, _data(frames))
            return
        keys = [p.key for p in parts]
        frames = [self.store[k].value for k in keys]
        if worker in self.links:                      # read in place on arrival
            try:
                sent = self.links[worker].send(M.VALUES, {'id': rid, 'parts': heads},
                                               [f.view(-1).numpy() for f in frames])
                return self.lend(keys, sent)
            except stream.StreamBroken as e:          # (the worker is gone, most likely)
                self.unlink(worker, e)
        trackers = self.node.send(worker, M.VALUES, {'id': rid, 'parts': heads},
                                  _data(frames), track=True)
        self.lend(keys, lambda: all(t.done for t in trackers))

    def lend(self, keys, sent):
        """The values of these keys are being sent from their own memory: until
        ``sent()``, an update must not write there (``writable`` copies first)."""
        for key in keys:
            self.lent.setdefault(key, []).append(sent)

    def link(self, msg):
        """Send this worker's VALUES of whole slices on the stream it offers, where
        they would cross a socket; if it cannot be opened, they go through the van."""
        worker, offer = msg.sender, msg.get('offer')
        if not (self.node.van.through_socket(worker) and isinstance(offer, dict)):
            return
        try:
            self.links[worker] = stream.connect(self.node.van, worker,
                                                self.node.host_of(worker), offer)
        except stream.StreamBroken as e:
            self.unlink(worker, e)

    def unlink(self, worker, error):
        """The stream to a worker could not open, or broke: say so; the van carries on."""
        self.links.pop(worker, None)
        print(f'd2ldist: {self.node.id.replace(":", " ")}: {error}; its answers go through '
              'the van', flush=True)

    def ack(self, msg, **fields):
        self.node.send(msg.sender, M.ACK, dict(fields, id=msg.get('id')))

    # -- the changes of a shard's state: made on its head, applied on its replicas ---------
    def apply(self, kind, msg):
        """Change this shard as a request (or its replicated copy) says; KVError if not."""
        {M.INIT: self.init, M.OPTIMIZER: self.set_optimizer, M.SET_STATE: self.set_state,
         M.LEARNING_RATE: self.set_learning_rate, M.UPDATE: self.apply_updates}[kind](msg)

    def init(self, msg):
        parts = M.read_parts(msg, with_frames=True)
        for p in parts:
            if p.key in self.store:
                raise M.KVError(f'key {p.key!r} is already initialised')
        optimizer = msg.get('optimizer') is not False
        for p in parts:        # (a copy: the message's memory may still go down the chain)
            self.store[p.key] = Slot(p.dtype, p.shape, p.start, p.stop, p.value.clone(),
                                     optimizer)

    def set_optimizer(self, msg):
        try:
            self.updater = Updater(str(msg.get('name')), **dict(msg.get('hyper') or {}))
        except (ValueError, TypeError) as e:
            raise M.KVError(str(e)) from None

    def set_learning_rate(self, msg):
        """A new learning rate for the optimizer; its states (momentum, ...) stay."""
        lr = msg.get('lr')
        if self.updater is None:
            raise M.KVError('set the optimizer before its learning rate')
        if isinstance(lr, bool) or not isinstance(lr, (int, float)):
            raise M.KVError(f'the learning rate must be a number, got {lr!r}'[:200])
        self.updater.opt.hyper['lr'] = lr

    def get_state(self, msg):
        """Send the optimizer state of every key held: a checkpoint of this server."""
        entries, frames = [], []
        for key, state in (self.updater.states.items() if self.updater else ()):
            for name, v in state.items():
                is_tensor = not isinstance(v, (int, float))
                entries.append([key, name, M.wire.dtype_name(v.dtype) if is_tensor else None,
                                None if is_tensor else v])
                if is_tensor:
                    frames.append(v.numpy().data)
        self.node.send(msg.sender, M.ACK, {'id': msg.get('id'), 'entries': entries,
                                           'optimizer': self.updater and self.updater.name,
                                           'shard': self.shard}, frames)

    def set_state(self, msg):
        """Restore optimizer states sent by a worker (tensors come as raw frames)."""
        if self.updater is None:
            raise M.KVError('set the optimizer before loading its states')
        entries, frames, states = msg.get('entries'), iter(msg.frames), {}
        if not isinstance(entries, list):
            raise M.KVError('malformed state')
        for entry in entries:
            key, name, dtype, number = entry if isinstance(entry, list) and len(entry) == 4 \
                else (None,) * 4
            slot = self.store.get(key)
            if slot is None or not isinstance(name, str):
                raise M.KVError(f'state for a key this server does not hold: {key!r}')
            if dtype is None:
                if not isinstance(number, (int, float)):
                    raise M.KVError(f'key {key!r}: bad state {name!r}')
                states.setdefault(key, {})[name] = number
                continue
            try:
                t = M.wire.unpack({'dtype': dtype, 'shape': [slot.stop - slot.start]}, next(frames))
            except (ValueError, StopIteration) as e:
                raise M.KVError(f'key {key!r}: bad state {name!r}: {e}') from None
            states.setdefault(key, {})[name] = t.clone()
        for key, state in states.items():
            slot = self.store[key]
            self.updater.load_state(key, state, slot.stop - slot.start)

    def apply_updates(self, msg):
        """(a replica) The updates its head made: the same sums through the same
        optimizer, so its copy and the optimizer's state end with the head's bits."""
        frames = iter(msg.frames)
        for key, rows, accumulate, numbers in msg.get('updates'):
            slot = self.store[key]
            count = rows if isinstance(rows, int) else slot.stop - slot.start
            grad = M.wire.unpack({'dtype': slot.dtype, 'shape': [count]}, next(frames)).clone()
            positions = M.wire.unpack({'dtype': 'int64', 'shape': [count]}, next(frames)) \
                if isinstance(rows, int) else None
            self.update(key, grad, positions, accumulate is True,
                        {str(w): n for w, n in numbers if isinstance(n, int)})


def _rank_order(worker):
    """'worker:2' -> (2, 'worker:2'): the order a round adds its pushes in."""
    rank = worker.rpartition(':')[2]
    return int(rank) if rank.isdigit() else 1 << 62, worker


def _data(frames):
    """The tensors' memory as the van sends it (no copy)."""
    return [f.numpy().data if f.numel() else b'' for f in frames]
