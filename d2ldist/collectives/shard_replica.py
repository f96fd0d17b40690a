"""A copy of each ZeRO shard on the ring successor: ZeRO (stages 1-3) that loses a worker
without a disk (``d2l-launch --shard-replicas 1 --min-workers A``).

Worker r keeps, besides its own shards, a replica of its ring predecessor's (worker
r-1 mod N): that worker's shards of the weights and a second optimizer of the same kind
over them (``ShardReplica``). Each step, once the weights are gathered, the owner sends
its averaged gradient shards to its right neighbour (``RingBackend.pass_right``: P/N
values, against the 2(N-1)/N P of the reduce-scatter and the all-gather), on the
communication thread while the next step computes; the successor steps the replica with
them when it needs it (``settle``: at its next step, or a commit): the same arithmetic
on the same numbers, so the replica equals the owner's shard bit for bit.

When a worker is lost (``hvd.elastic.run``, ``TorchState``), every survivor goes back to
the same commit (the replica's too), and ``recover`` gathers each bucket's whole state
from the owners left and, for a lost one, from its successor's replica, then cuts it
again for the workers left (``ShardedOptimizer.reshard``) and makes the replicas of the
new ring. Two ring neighbours lost at once: their shard is gone (one line).

Stage 3 (``shard_module``) is the same with each unit for a bucket (``NetShards``, made by
``TorchState``): the user's optimizer steps the shards, and its step post-hook sends the
gradient shards right; the weights' shards exist once, so the replica keeps its owner's
(``NetReplica``), commits save them, and ``recover`` gathers them as one more state.

Why and what it costs: docs/design/zero.md#a-replica-of-each-shard.
"""
import weakref

import torch

from ..runtime import faults
from . import world

WEIGHTS = '(weights)'        # stage 3: the shard's weights, recovered as its state is
_HOLDERS = weakref.WeakKeyDictionary()   # stage 3: each optimizer's NetShards, weakly


class ShardReplica:
    """The ring predecessor's shards of the weights and of its optimizer's state, stepped
    alike each step; ``wholes``: (recover's) each bucket's whole state to cut it from."""

    def __init__(self, sharded, wholes=None):
        self.sharded, self.pending = sharded, None
        self.owner = (sharded.rank - 1) % sharded.size      # whose shards these are
        self.shards = self.weights(wholes)
        inner = sharded.optimizer
        groups = [{**settings(g), 'params': [s for mine, s in zip(sharded.shards, self.shards)
                                             if any(mine is p for p in g['params'])]}
                  for g in inner.param_groups]
        self.optimizer = type(inner)(groups, **inner.defaults)
        for bucket, shard, whole in zip(sharded.buckets, self.shards, wholes or ()):
            give_state(self.optimizer, shard, cut(whole, bucket, self.owner))

    def weights(self, wholes):
        """The predecessor's shards of the weights, cut from the parameters (whole here)."""
        return [bucket.pack(bucket.params)[slice(*span(bucket, self.owner))].clone()
                for bucket in self.sharded.buckets]

    def send(self):
        """Start sending this step's averaged gradient shards to the successor (on the
        communication thread), and receiving the predecessor's; settle() steps with them."""
        self.settle()
        self.pending = ([world.run(world.backend().pass_right, shard.grad.clone())
                         for shard in self.sharded.shards],
                        [settings(g) for g in self.sharded.param_groups])

    @torch.no_grad()
    def settle(self):
        """The predecessor's gradient shards of its last step, once received: step the
        replica with them, with the settings its owner stepped with."""
        if self.pending is None:
            return
        (handles, groups), self.pending = self.pending, None
        for shard, handle in zip(self.shards, handles):
            shard.grad = handle.wait()
        for mine, owners in zip(self.optimizer.param_groups, groups):
            mine.update(owners)
        self.optimizer.step()
        for shard in self.shards:
            shard.grad = None

    @torch.no_grad()
    def refresh(self):
        """The replica's weights cut again from the parameters (after a restore: a
        step not yet settled is dropped)."""
        self.pending = None
        for bucket, shard in zip(self.sharded.buckets, self.shards):
            shard.copy_(bucket.pack(bucket.params)[slice(*span(bucket, self.owner))])

    @torch.no_grad()
    def fetch(self):
        """The predecessor's weights and optimizer state anew, its state sent one step
        right (every worker calls it: after a checkpoint's load)."""
        self.refresh()
        for mine, theirs in zip(self.sharded.shards, self.shards):
            state = self.sharded.optimizer.state.get(mine, {})
            got = {name: world.run(world.backend().pass_right, value).wait()
                   if torch.is_tensor(value) and value.dim() > 0 else _copy(value)
                   for name, value in sorted(state.items())}
            self.optimizer.state.pop(theirs, None)
            if got:
                self.optimizer.state[theirs] = got

    def state_dict(self):
        self.settle()
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict)


def _copy(value):
    return value.clone() if torch.is_tensor(value) else value


def settings(group):
    """A parameter group's settings (learning rate, ...), without its parameters."""
    return {k: v for k, v in group.items() if k != 'params'}


def span(bucket, r):
    """(start, end) of worker r's shard in a bucket's (or a stage 3 unit's) flat vector."""
    return r * bucket.shard_numel, (r + 1) * bucket.shard_numel


def give_state(optimizer, shard, state):
    """``optimizer``'s state of ``shard``: a cut state less the weights (stage 3's), if any."""
    state.pop(WEIGHTS, None)
    if state:
        optimizer.state[shard] = state


def cut(whole, bucket, rank):
    """Worker ``rank``'s shard, in ``bucket``'s layout, of a bucket's whole state
    (``{name: a flat tensor, or a value every shard shares}``). The elements keep their
    places in the flat bucket whatever N is: only the padding at its end differs."""
    a, b = span(bucket, rank)
    found = {}
    for name, value in whole.items():
        if torch.is_tensor(value) and value.dim() > 0:
            padded = value.new_zeros(bucket.padded)
            n = min(bucket.padded, value.numel())
            padded[:n] = value[:n]
            found[name] = padded[a:b].clone()
        else:
            found[name] = _copy(value)
    return found


def providers(table, old_size):
    """Which pieces each survivor gives, by its rank now: ``table[i]`` = (the old rank
    whose shard survivor i owns, the one whose replica it holds or -1); an owner first,
    else a replica. RuntimeError (one line) if a shard is held by no one."""
    given = {}
    for how in (0, 1):
        for i, row in enumerate(table):
            if row[how] >= 0:
                given.setdefault(row[how], (i, how))
    gone = [r for r in range(old_size) if r not in given]
    if gone:
        raise RuntimeError(f'ZeRO shard(s) {gone} of {old_size} are lost with their replicas '
                           '(two ring neighbours lost at once): the job cannot go on; '
                           'resume from a checkpoint')
    return given


def recover(sharded):
    """After a worker was lost and the ring re-formed: each bucket's whole optimizer
    state from the shards left (a lost owner's: its successor's replica), cut again for
    the workers in the ring now; the new ring's replicas made."""
    old_rank, old_size, replica = sharded.rank, sharded.size, sharded.replica
    mine = [old_rank, replica.owner if replica is not None else -1]
    table = gather(torch.tensor([mine], dtype=torch.int64)).tolist()
    given = providers(table, old_size)
    me = world.backend().rank
    order = [r for i in range(len(table)) for r in sorted(given) if given[r][0] == i]
    wholes = []
    for bucket, pair in zip(sharded.buckets, held(sharded)):
        whole = {}
        for name, value in sorted(pair[0].items()):
            if torch.is_tensor(value) and value.dim() > 0:
                rows = [pair[how][name] for r in order for i, how in [given[r]] if i == me]
                pieces = gather(torch.stack(rows) if rows
                                else value.new_zeros((0, bucket.shard_numel)))
                flat = value.new_zeros(bucket.padded)
                for r, piece in zip(order, pieces):
                    flat[slice(*span(bucket, r))] = piece
                whole[name] = flat
            else:
                whole[name] = value
        wholes.append(whole)
    sharded.reshard(wholes)
    for bucket, shard, whole in zip(sharded.buckets, sharded.shards, wholes):
        give_state(sharded.optimizer, shard, cut(whole, bucket, sharded.rank))
    kind = NetReplica if isinstance(sharded, NetShards) else ShardReplica
    sharded.replica = kind(sharded, wholes) if sharded.size > 1 else None


def held(sharded):
    """Bucket by bucket, what this worker holds of its state: its own shard's, its
    replica's (stage 3: the weights too, as ``WEIGHTS``)."""
    replica, pairs = sharded.replica, []
    for b, shard in enumerate(sharded.shards):
        own = dict(sharded.optimizer.state.get(shard, {}))
        theirs = dict(replica.optimizer.state.get(replica.shards[b], {})) if replica else {}
        if isinstance(sharded, NetShards):
            own[WEIGHTS] = shard.detach()
            if replica:
                theirs[WEIGHTS] = replica.shards[b]
        pairs.append((own, theirs))
    return pairs


class NetShards:
    """Stage 3's shards (``shard_module``), stepped by the user's own optimizer, seen as
    ShardedOptimizer's by ShardReplica and ``recover``: each unit a bucket. The replica
    steps after the user's optimizer (its step post-hook)."""

    def __init__(self, units, optimizer):
        if world.backend().name != 'ring':
            raise ValueError('--shard-replicas needs the ring backend, not '
                             f'{world.backend().name!r}')
        self.buckets, self.optimizer = units, optimizer
        self.rank, self.size = world.backend().rank, world.backend().size
        self.replica = NetReplica(self) if self.size > 1 else None
        if self.replica is not None and optimizer.state:     # (it stepped before)
            self.replica.fetch()
        optimizer.register_step_post_hook(self.stepped)

    @classmethod
    def of(cls, units, optimizer):
        """The NetShards of ``optimizer``, made at its first TorchState and the same for any
        later one (a second would send each gradient shard twice and keep two replicas)."""
        holder = _HOLDERS.get(optimizer, lambda: None)()
        if holder is None:
            holder = cls(units, optimizer)
            _HOLDERS[optimizer] = weakref.ref(holder)     # (the optimizer's hook keeps it)
        return holder

    def stepped(self, optimizer, args, kwargs):
        """(The user's optimizer's step post-hook) the gradient shards sent right."""
        idle = [repr(unit) for unit in self.buckets if unit.shard.grad is None]
        if self.replica is not None and idle:     # (the optimizer skipped it: no gradient)
            raise RuntimeError(f'--shard-replicas: {idle[0]} got no gradient in this step, and '
                               'its replica cannot skip the step alike: use every unit each '
                               'step')
        if self.replica is not None:
            self.replica.send()

    shards = property(lambda self: [unit.shard for unit in self.buckets])
    param_groups = property(lambda self: self.optimizer.param_groups)

    def reshard(self, wholes):
        """Each unit cut again for the workers in the ring now, from its whole weights."""
        self.rank, self.size = world.backend().rank, world.backend().size
        self.optimizer.state.clear()
        for unit, whole in zip(self.buckets, wholes):
            unit.reshard(whole[WEIGHTS], self.rank, self.size)

    def refresh_shards(self):
        """(After a restore) the step pending on the replica dropped."""
        if self.replica is not None:
            self.replica.refresh()

    def forget_gradients(self):
        """Drop a step's gradients (an elastic restore after a failed step); the next
        step's compute is timed from here."""
        for shard in self.shards:
            shard.grad = None
        clock = faults.watched(self.optimizer)
        if clock is not None:
            clock.restart()


class NetReplica(ShardReplica):
    """Stage 3's replica: the predecessor's shards of the weights are nowhere else, so
    they come from it (or from ``recover``'s whole weights), and commits keep them."""

    @torch.no_grad()
    def weights(self, wholes):
        """The predecessor's shards: cut from the whole weights, or sent one step right."""
        if wholes:
            return [cut({WEIGHTS: whole[WEIGHTS]}, unit, self.owner)[WEIGHTS]
                    for unit, whole in zip(self.sharded.buckets, wholes)]
        return [world.run(world.backend().pass_right, shard.detach().clone()).wait()
                for shard in self.sharded.shards]

    def refresh(self):
        """(After a restore: the weights came back with the commit.)"""
        self.pending = None

    def state_dict(self):
        return {'optimizer': super().state_dict(), 'weights': [s.clone() for s in self.shards]}

    @torch.no_grad()
    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict['optimizer'])
        for shard, saved in zip(self.shards, state_dict['weights']):
            shard.copy_(saved)


def gather(rows):
    """Every worker's rows, in rank order (one allgather)."""
    return world.run(world.backend().allgather, rows).wait()
