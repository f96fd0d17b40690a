"""The parameter server's key-value handling of one shard: aggregate, update, answer.

Workers push gradients and pull weights; each server holds a slice of every key
(``placement.place``). In **sync** mode (dist_sync) a key's pushes are added up in a
round; once every worker has pushed, the round closes and the key is updated once --
by the optimizer if a worker set one (``apply_update``), else the value becomes the
sum -- and the pulls that waited for the round are answered. In **async** mode
(dist_async) each push is applied the moment it arrives.

Read it in the textbook's order: ``Slot`` and ``Round``, ``apply_update``, then
``KVServer.push`` -> ``close`` -> ``update`` -> ``pull`` and the answer. Collaborators
handed in: whom a round waits for (``membership.py``: every worker, unless elastic),
the shard's replicas (``replication.py``), the workers' streams (``links.py``). The
process loop around it is ``serving.py``; the reasoning, docs/design/kv.md.
"""
import os

import torch

from .. import lines
from ..runtime import faults
from . import messages as M
from .links import Links
from .membership import Members
from .optimizers import Updater
from .replication import CHAIN_FIELDS, Chain, Changes

CHANGES = (M.INIT, M.OPTIMIZER, M.LEARNING_RATE, M.SET_STATE)   # requests that go down the chain


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
        """Add a pushed part to the sum: all its elements (a sparse key's rows: ``_add_rows``)."""
        if part.positions is not None:
            return self._add_rows(part, like)
        if self.sum is None:
            self.sum = part.value                        # the message's own memory, no copy
        else:
            self.sum.add_(part.value)                    # in place, while more pushes arrive
        self.touched = None                              # a dense push touches every row

    def _add_rows(self, part, like):
        """Add a sparse key's rows to the sum (into zeros ``like`` the value), marked touched."""
        if self.sum is None:
            self.sum = like.new_zeros(like.shape)
            self.touched = torch.zeros(like.shape, dtype=torch.bool)
        self.sum.index_add_(0, part.positions, part.value)
        if self.touched is not None:
            self.touched[part.positions] = True


def apply_update(updater, key, value, grad, positions=None, accumulate=False):
    """What a server does with ``grad``, the sum of a key's pushes; returns the new value.

    The optimizer (``updater``; None: none set, or a key made with optimizer=False)
    updates ``value`` in place; without one the sum becomes the value (sync) or is
    added to it (async: ``accumulate``). A sparse key's rows: ``apply_rows``.
    """
    if positions is not None:
        return apply_rows(updater, key, value, grad, positions, accumulate)
    if updater is not None:
        updater(key, value, grad)                         # the optimizer's step
    elif accumulate:
        value.add_(grad)                                  # async: the sum is added
    else:
        return grad                                       # the sum becomes the value
    return value


def apply_rows(updater, key, value, grad, positions, accumulate):
    """``apply_update`` of a sparse key's rows: only the elements at ``positions`` change
    (MXNet's lazy update; a sum that becomes the value is zero elsewhere)."""
    if updater is None and not accumulate:
        total = torch.zeros_like(value)                   # the sum, zero elsewhere
        total.view(-1)[positions] = grad.view(-1)
        return total
    if updater is None:
        value.view(-1).index_add_(0, positions, grad.view(-1))
    else:
        updater.update_rows(key, value.view(-1), positions, grad.view(-1))
    return value


class Waiting:
    """A request answered later: once the rounds it pushed into have closed (``keys``),
    and the last holder of the shard has every change the answer shows (``after``)."""

    def __init__(self, worker, rid, parts, keys, values=True, after=0):
        self.worker, self.rid, self.parts, self.keys = worker, rid, parts, keys
        self.values, self.after = values, after     # values: VALUES, else an ACK


class Answered(Exception):
    """A request refused, its error already sent."""


class KVServer:
    """The state of one shard (its keys, the open rounds, the requests waiting) and
    how a request changes it."""

    def __init__(self, node, shard=None, members=None, chain=None, links=None):
        self.node = node
        self.shard = int(node.id.split(':')[1]) if shard is None else shard
        self.store = {}        # key -> Slot
        self.rounds = {}       # key -> Round still open (sync mode)
        self.waiting = []      # [Waiting]: requests answered once their rounds close
        self.updater = None    # the optimizer, once a worker sets one
        self.lent = {}         # key -> [sent(), ...]: its value went out without a copy
        self.closed = 0        # rounds closed (async: pushes) on the first key (--fail)
        self.members = Members(node.peers('worker')) if members is None else members
        self.chain = Chain(node, self.shard, [node.id]) if chain is None else chain
        self.changes = Changes(self.chain, self.store, self.lend)
        self.links = Links(node) if links is None else links

    # -- the heart: push, close, update, pull, answer ---------------------------------------
    def push(self, msg, parts):
        """Add each pushed part into its key's round; a round every worker has pushed
        into closes (``pushed``); answer. False: not its round yet, it waits."""
        M.check_held(parts, self.store, 'pushed')
        if msg.get('sync') is False:
            return self.push_async(msg, parts)
        worker = msg.sender
        if any(worker in self.pushed_into(p.key) for p in parts) \
                or not self.members.may_count(msg, parts, self.rounds):
            return False                                 # its second push waits for the round
        self.agree(msg, parts)
        closed = []
        for p in self.uncounted(msg, parts):
            r = self.rounds.setdefault(p.key, Round())
            r.add(worker, p, self.store[p.key].value)
            r.numbers[worker] = msg.get('n')
            self.members.entered(msg, p.key, r)
            if self.pushed(p.key, r, worker):
                closed.append(p.key)
        self.changes.send_updates()
        self.answer_push(msg, parts)
        self.answer_ready(closed)
        return True

    def push_async(self, msg, parts):
        """dist_async: apply each pushed part at once (no round); answer."""
        for p in self.uncounted(msg, parts):
            self.update(p.key, p.value, p.positions, accumulate=True,
                        numbers={msg.sender: msg.get('n')})
            self.served(p.key, 'push')
        self.changes.send_updates()
        self.answer_push(msg, parts)
        self.answer_ready()
        return True

    def pushed(self, key, r, worker):
        """Count the worker's push in the round; when all have pushed, close it, True."""
        r.pushed.add(worker)
        if not self.members.waits_for(key, r) <= r.pushed:
            return False
        self.close(key, r)
        return True

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

    def update(self, key, grad, positions=None, accumulate=False, numbers=None):
        """Update the key from a sum of pushes (``apply_update``), on a copy of its value
        if that may still be on its way to a worker (``writable``); the shard's
        replicas get the update too (``numbers``: the pushes it counts)."""
        slot = self.store[key]
        slot.value = apply_update(self.updater if slot.optimizer else None, key,
                                  self.writable(key), grad, positions, accumulate)
        slot.counted.update(numbers or {})
        self.changes.made(key, grad, positions, accumulate, numbers or {})

    def pull(self, msg, parts):
        """Send the values asked for, once the rounds this worker pushed into have closed."""
        M.check_held(parts, self.store, 'pulled')
        self.waiting.append(Waiting(msg.sender, msg['id'], parts,
                                    self.open_rounds(msg.sender, parts)))
        self.answer_ready()

    def answer_push(self, msg, parts):
        """Ack a push at once; answer a pushpull with its values once its rounds have
        closed. (With replicas every push waits: its change must reach the last holder.)"""
        if msg.get('pull') or self.changes.replicated:
            self.waiting.append(Waiting(msg.sender, msg['id'], parts,
                                        self.open_rounds(msg.sender, parts),
                                        values=bool(msg.get('pull'))))
        else:
            self.ack(msg)

    def answer_ready(self, closed=()):
        """The rounds of keys ``closed`` have closed: answer the requests that now wait
        for nothing (no round open, every change they show at the last holder)."""
        for w in list(self.waiting):
            w.keys.difference_update(closed)
            if w.keys or not self.changes.shown(
                    max([w.after] + [self.store[p.key].changed for p in w.parts])):
                continue
            self.waiting.remove(w)
            if w.values:
                self.send_values(w.worker, w.rid, w.parts)
            else:
                self.node.send(w.worker, M.ACK, {'id': w.rid})

    def send_values(self, worker, rid, parts):
        """The values of whole slices, from their own memory (on the worker's stream if
        it has one); row parts: ``send_rows``."""
        if parts and isinstance(parts[0], M.RowPart):
            return self.send_rows(worker, rid, parts)
        heads, keys = [p.head() for p in parts], [p.key for p in parts]
        values = [self.store[k].value for k in keys]
        sent = self.links.send(worker, M.VALUES, {'id': rid, 'parts': heads},
                               [v.view(-1).numpy() for v in values])
        if sent is None:                                 # no stream to it: the van
            trackers = self.node.send(worker, M.VALUES, {'id': rid, 'parts': heads},
                                      M.data(values), track=True)
            sent = _all_done(trackers)
        self.lend(keys, sent)

    def send_rows(self, worker, rid, parts):
        """The values of row parts: copies of only those rows."""
        rows = [self.store[p.key].value[p.positions] for p in parts]
        self.node.send(worker, M.VALUES, {'id': rid, 'parts': [p.head() for p in parts]},
                       M.data(rows))

    # -- what the heart asks ----------------------------------------------------------------
    def pushed_into(self, key):
        """The workers in the open round of ``key`` (none open: nobody)."""
        return getattr(self.rounds.get(key), 'pushed', ())

    def open_rounds(self, worker, parts):
        """The keys of ``parts`` whose open round this worker has pushed into."""
        return {p.key for p in parts if worker in self.pushed_into(p.key)}

    def uncounted(self, msg, parts):
        """The parts not counted yet: a push sent again (to a replica made head) is
        counted once, by the numbers pushes carry."""
        n = msg.get('n')
        return [p for p in parts if not (isinstance(n, int) and
                                         n <= self.store[p.key].counted.get(msg.sender, 0))]

    def agree(self, msg, parts):
        """Every worker's n-th sync push here carries the same keys; if not, the rounds
        can never close: fail every worker waiting here instead of hanging."""
        error = self.members.disagree(msg.sender, msg.get('n'), [p.key for p in parts])
        if error is None:
            return
        for worker, rid in [(w.worker, w.rid) for w in self.waiting] + [
                (msg.sender, msg.get('id'))]:
            self.node.send(worker, M.ERROR, {'id': rid, 'error': error, 'disagree': True})
        self.waiting.clear()
        raise Answered()

    def served(self, key, what):
        """A round of ``key`` closed (async: a push applied): count those of the first key
        of this server's own shard, for d2l-launch --fail server:R@step=N."""
        if key == next(iter(self.store)) and self.node.id == f'server:{self.shard}':
            self.closed += 1
            faults.served(self.closed, what)

    def writable(self, key):
        """The key's value, copied first if the van or a stream may still be sending it
        (by the next update they have, as a rule: a worker's round trip lies between)."""
        slot = self.store[key]
        if not all(sent() for sent in self.lent.pop(key, ())):
            slot.value = slot.value.clone()
        return slot.value

    def lend(self, keys, sent):
        """The values of these keys are being sent from their own memory: until
        ``sent()``, an update must not write there (``writable`` copies first)."""
        for key in keys:
            self.lent.setdefault(key, []).append(sent)

    def ack(self, msg, **fields):
        self.node.send(msg.sender, M.ACK, dict(fields, id=msg.get('id')))

    # -- every request: handled, or refused ----------------------------------------------------
    def handle(self, msg):
        """Answer one request; False if it must wait until a round closes (or until
        this replica becomes the shard's head)."""
        if not self.chain.is_head:
            return False
        try:
            if msg.kind == M.PUSH:
                return self.push(msg, M.read_parts(msg, with_frames=True))
            if msg.kind != M.PULL:
                return self.handle_other(msg)
            self.pull(msg, M.read_parts(msg, with_frames=False))
        except Answered:
            pass
        except (M.KVError, KeyError, TypeError, ValueError) as e:   # refuse it, go on serving
            error = str(e) if isinstance(e, M.KVError) else \
                lines.clip(f'malformed request ({e!r})', 300)
            self.node.send(msg.sender, M.ERROR, {'id': msg.get('id'), 'error': error})
        return True

    def handle_other(self, msg):
        """As ``handle``, the requests beside a dense push and pull (rows, changes, INFO)."""
        if msg.kind == M.PUSH_ROWS:
            return self.push(msg, M.read_row_parts(msg, with_values=True))
        if msg.kind == M.PULL_ROWS:
            self.pull(msg, M.read_row_parts(msg, with_values=False))
        elif msg.kind in CHANGES:
            self.change(msg)
        elif msg.kind == M.INFO:
            self.ack(msg, keys=[M.Part(k, s.dtype, s.shape, s.start, s.stop).head()
                                for k, s in self.store.items()],
                     pid=os.getpid(), optimizer=self.updater and self.updater.name,
                     shard=self.shard, replicated=self.chain.bytes_sent)
        elif msg.kind == M.GET_STATE:
            self.get_state(msg)
        return True

    # -- the workers left (elastic), and a worker that starts anew ---------------------------
    def workers_changed(self, workers, membership):
        """The scheduler's news of the workers left (``Members.changed``): close the
        rounds that now have every push they wait for, and forget the requests of the
        workers gone. False if the news is malformed."""
        if not self.members.changed(workers, membership):
            return False
        self.waiting = [w for w in self.waiting if w.worker in self.members.workers]
        closed = [key for key, r in self.rounds.items()
                  if self.members.waits_for(key, r) <= r.pushed]
        for key in closed:
            self.close(key, self.rounds[key])
        self.changes.send_updates()
        self.answer_ready(closed)
        return True

    def forget(self, worker):
        """A worker starts anew: its requests and its pushes' numbers go."""
        self.waiting = [w for w in self.waiting if w.worker != worker]
        for slot in self.store.values():
            slot.counted.pop(worker, None)

    # -- the changes of a shard's state: made on its head, applied on its replicas ---------
    def change(self, msg):
        """Change the shard as the request says (KVError if refused); the change goes
        down the chain, and the request is acked once the last holder has it."""
        self.apply(msg.kind, msg)
        self.changes.send(msg.kind, {k: v for k, v in msg.header.items()
                                     if k not in CHAIN_FIELDS and k != 'id'}, msg.frames)
        self.waiting.append(Waiting(msg.sender, msg.get('id'), [], set(), False,
                                    self.chain.number))
        self.answer_ready()

    def apply(self, kind, msg):
        """Change this shard as a request (or its replicated copy) says; KVError if not."""
        {M.INIT: self.init, M.OPTIMIZER: self.set_optimizer, M.SET_STATE: self.set_state,
         M.LEARNING_RATE: self.set_learning_rate,
         M.UPDATE: lambda m: self.changes.take_updates(m, self.update)}[kind](msg)

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
            raise M.KVError(lines.clip(f'the learning rate must be a number, got {lr!r}',
                                       lines.NAME))
        self.updater.opt.hyper['lr'] = lr

    def get_state(self, msg):
        """Send the optimizer state of every key held: a checkpoint of this server."""
        entries, frames = M.state_entries(self.updater.states if self.updater else {})
        self.node.send(msg.sender, M.ACK, {'id': msg.get('id'), 'entries': entries,
                                           'optimizer': self.updater and self.updater.name,
                                           'shard': self.shard}, frames)

    def set_state(self, msg):
        """Restore optimizer states sent by a worker (tensors come as raw frames)."""
        if self.updater is None:
            raise M.KVError('set the optimizer before loading its states')
        sizes = {key: slot.stop - slot.start for key, slot in self.store.items()}
        for key, state in M.read_states(msg, sizes).items():
            self.updater.load_state(key, state, sizes[key])


def _rank_order(worker):
    """'worker:2' -> (2, 'worker:2'): the order a round adds its pushes in."""
    rank = worker.rpartition(':')[2]
    return int(rank) if rank.isdigit() else 1 << 62, worker


def _all_done(trackers):
    """``sent()`` of frames the van sends: true once ZeroMQ has let go of them all."""
    return lambda: all(t.done for t in trackers)
