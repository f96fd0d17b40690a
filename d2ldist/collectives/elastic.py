"""Elastic workers on the ring, with Horovod's API: ``hvd.elastic.run`` and ``TorchState``.

    state = hvd.elastic.TorchState(model=net, optimizer=optimizer, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        while state.batch < steps:
            ...                        # one step, on this worker's part of the batch
            state.batch += 1
            state.commit()             # a copy in memory: where a reset goes back to

    train(state)

Under ``d2l-launch --min-workers A`` a lost worker does not stop the job: the
collective in flight fails on every survivor with ``WorkersChanged`` (Horovod's
HorovodInternalError), and ``run`` catches it: each survivor goes back to its last
commit (``restore``), the ring is made anew (``world.reform``), the reset callbacks run,
every worker takes rank 0's state (``sync``) and ``train`` is called again. A worker
that joins (``--max-workers``) is taken in at a ``commit()`` (``HostsUpdatedInterrupt``).
A batch cut by ``hvd.rank()`` and ``hvd.size()`` from a position kept in the state is
cut anew after a reset (``part``, ``ElasticSampler``). ZeRO's shards have one copy each,
unless ``--shard-replicas 1`` keeps a second on each ring successor (stages 1-3,
``shard_replica.py``): then every survivor goes back to the same commit, and the lost
shard comes from its replica; without it, under --min-workers a TorchState of them is
refused in one line. The whole story: docs/design/ring.md#elastic-workers.
"""
import copy
import functools

import torch

from .. import config
from ..lines import say, shown
from ..runtime import node
from ..runtime.node import WorkersChanged
from ..runtime.split import even_slices
from . import ops, shard_replica, world

HorovodInternalError = WorkersChanged     # Horovod's name for a collective that failed


class HostsUpdatedInterrupt(RuntimeError):
    """The workers changed, seen at a commit (Horovod's): train again from the commit."""

    def __init__(self, skip_sync=False):
        super().__init__('the workers changed')
        self.skip_sync = skip_sync


class ElasticSampler(torch.utils.data.Sampler):
    """This worker's part of what is left of an epoch, cut anew after a reset (Horovod's):
    the samples not yet read, in ``hvd.size()`` interleaved parts, ``hvd.rank()``'s.

    Keep it in the state (``TorchState(..., sampler=sampler)``: its position goes back to
    the commit and comes from rank 0) and call ``record_batch(i, batch_size)`` after each
    batch: every worker has read ``batch_size`` more. Parts are of equal length, the last
    padded from the epoch's start, so that every worker has as many batches."""

    def __init__(self, dataset, shuffle=True, seed=0):
        self.n, self.shuffle, self.seed = len(dataset), shuffle, seed
        self.epoch = self.processed = 0
        self.reset()

    def set_epoch(self, epoch):
        self.epoch, self.processed = epoch, 0
        self.reset()

    def record_batch(self, batch_idx, batch_size):
        self.processed += batch_size * self.size

    def reset(self):
        """Cut what is left of the epoch for the current workers."""
        self.rank, self.size = world.rank(), world.size()
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(
            self.seed + self.epoch)).tolist() if self.shuffle else list(range(self.n))
        left = order[self.processed:]
        pad = -len(left) % self.size
        self.indices = (left + (order * (pad // max(self.n, 1) + 1))[:pad])[self.rank::self.size]

    def state_dict(self):
        return {'epoch': self.epoch, 'processed': self.processed}

    def load_state_dict(self, state):
        self.epoch, self.processed = int(state['epoch']), int(state['processed'])
        self.reset()

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


class State:
    """What a reset goes back to: ``commit()`` saves it, ``restore()`` returns to it,
    ``sync()`` gives every worker rank 0's; numbers kept as attributes (``state.epoch``)."""

    def __init__(self, **attrs):
        for name, value in attrs.items():
            if not isinstance(value, (int, float, ElasticSampler)):
                raise TypeError(f'TorchState({name}=...): only numbers and ElasticSamplers are '
                                f'kept (they go by broadcast), got {type(value).__name__}')
        self.__dict__.update(attrs)
        self._samplers = sorted(n for n, v in attrs.items() if isinstance(v, ElasticSampler))
        self._names = sorted(set(attrs) - set(self._samplers))
        self._callbacks = []
        self._membership = world.membership()
        self._saved = None

    def register_reset_callbacks(self, callbacks):
        """Functions to call after each reset, before the state is synced (Horovod's)."""
        self._callbacks.extend(callbacks)

    def on_reset(self):
        for callback in self._callbacks:
            callback()

    def commit(self):
        """Save the state in memory, then see whether the workers changed meanwhile."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self):
        """Raise HostsUpdatedInterrupt if the membership changed since the last sync, or
        take in the workers waiting to join first (then it has changed)."""
        me = node.current()
        if me is not None and config.get().max_workers:     # (workers may join)
            if world.size() == 1:                 # alone: no collective brings the news
                me.take_news()
            if _agreed_joins(me.joins_heard) > me.joins_taken:
                me.take_newcomers()
        if world.membership() != self._membership:
            raise HostsUpdatedInterrupt()

    def save(self):
        self._saved = {name: getattr(self, name) for name in self._names}
        self._saved_samplers = {n: getattr(self, n).state_dict() for n in self._samplers}

    def restore(self):
        """Go back to the last commit (to the start, if none)."""
        if self._saved is not None:
            self.__dict__.update(self._saved)
            for name, saved in self._saved_samplers.items():
                getattr(self, name).load_state_dict(saved)

    def sync(self):
        """Every worker takes rank 0's attributes (in two broadcasts: whole numbers and
        the others) and samplers' positions (cut anew for this membership), and commits."""
        for kind, dtype in ((int, torch.int64), (float, torch.float64)):
            names = [n for n in self._names if isinstance(getattr(self, n), kind)]
            values = _broadcast([getattr(self, n) for n in names], dtype)
            for name, value in zip(names, values):
                setattr(self, name, type(getattr(self, name))(value))
        for name in self._samplers:
            sampler = getattr(self, name)
            sampler.load_state_dict(dict(zip(('epoch', 'processed'), _broadcast(
                [sampler.epoch, sampler.processed], torch.int64))))
        self._membership = world.membership()
        self.save()


class TorchState(State):
    """A model's and an optimizer's state (copies in memory), and numbers."""

    def __init__(self, model=None, optimizer=None, **attrs):
        stage_3 = model is not None and _sharded(model, None)
        self.replicated = bool(getattr(optimizer, 'replicas', 0) or (  # ZeRO with a replica
            stage_3 and optimizer is not None and config.get().shard_replicas))
        if config.get().min_workers and _sharded(model, optimizer) and not self.replicated:
            say("--min-workers: ZeRO's shards (ShardedOptimizer, shard_module) have one copy "
                "each: a lost worker's is gone, and the others cannot go on without it; run "
                'without --min-workers, or with --shard-replicas 1', err=True)
            raise SystemExit(2)
        self.model, self.optimizer = model, optimizer
        self.holder = optimizer        # what holds ZeRO's shards and their replica
        if self.replicated and stage_3:
            from .sharded_module import units_of
            self.holder = shard_replica.NetShards.of(units_of(model), optimizer)
        self._model_saved = self._optimizer_saved = self._replica_saved = None
        self._commits, self._previous = 0, None
        super().__init__(**attrs)

    def save(self):
        replica = getattr(self.holder, 'replica', None)
        if replica is not None:        # its last step first (it may fail: nothing saved)
            replica.settle()
        if self.replicated:            # the commit before too: survivors may differ by one
            self._previous = self._commit()
        super().save()
        self._model_saved = _copy(self.model.state_dict()) if self.model else None
        self._optimizer_saved = _copy(self.optimizer.state_dict()) if self.optimizer else None
        self._replica_saved = _copy(replica.state_dict()) if replica else None
        self._commits += 1

    def _commit(self):
        return (self._saved, getattr(self, '_saved_samplers', None), self._model_saved,
                self._optimizer_saved, self._replica_saved)

    def restore(self):
        super().restore()
        if self.model is not None and self._model_saved is not None:
            self.model.load_state_dict(self._model_saved)
        if self.optimizer is not None and self._optimizer_saved is not None:
            self.optimizer.load_state_dict(_copy(self._optimizer_saved))
        replica = getattr(self.holder, 'replica', None)
        if replica is not None and self._replica_saved is not None:
            replica.load_state_dict(_copy(self._replica_saved))
        if hasattr(self.holder, 'refresh_shards'):     # ShardedOptimizer's weights
            self.holder.refresh_shards()
        if hasattr(self.holder, 'forget_gradients'):   # DistributedOptimizer's, ZeRO's
            self.holder.forget_gradients()

    def sync(self):
        from .distributed_optimizer import broadcast_optimizer_state, broadcast_parameters
        if self.replicated and world.membership() != self._membership:
            self._same_commit()
            shard_replica.recover(self.holder)        # the lost shard, from its replica
        if self.model is not None and not _sharded(self.model, None):  # (stage 3's: shards)
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None and not self.replicated:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        super().sync()

    def _same_commit(self):
        """Every survivor at the oldest commit any of them went back to: each holds a
        piece of ZeRO's state, and all pieces must be of one step (one commit apart at
        most: a worker ends a step's all-gather only once every one has begun it)."""
        oldest = -_agreed_max(-self._commits)
        if self._commits - oldest > 1 or (self._commits > oldest and self._previous is None):
            raise RuntimeError(f'the workers went back to commits {oldest} and '
                               f'{self._commits}: too far apart to join their ZeRO shards')
        if self._commits > oldest:
            (self._saved, self._saved_samplers, self._model_saved, self._optimizer_saved,
             self._replica_saved) = self._previous
            self._commits = oldest
            self.restore()


def _sharded(model, optimizer):
    """Whether ZeRO cut the model's weights or the optimizer's state into shards."""
    from .sharded import ShardedOptimizer
    from .sharded_module import units_of
    return isinstance(optimizer, ShardedOptimizer) or bool(model is not None and units_of(model))


def _broadcast(values, dtype):
    """Rank 0's ``values`` (a list of numbers), by one broadcast."""
    if not values or world.size() == 1:
        return values
    tensor = torch.tensor(values, dtype=dtype)
    world.run(world.backend().broadcast_, tensor, 0).wait()
    return tensor.tolist()


def _agreed_joins(heard):
    """The most joiners any worker has heard of (a Max all-reduce): every worker decides
    alike, at the same commit, whether to take them in (Horovod broadcasts rank 0's)."""
    return _agreed_max(heard)


def _agreed_max(number):
    """The largest of every worker's whole ``number`` (a Max all-reduce)."""
    if world.size() == 1:
        return number
    tensor = torch.tensor([number], dtype=torch.int64)
    world.run(world.backend().allreduce_, tensor, ops.Max).wait()
    return int(tensor[0])


def _copy(state_dict):
    """A copy that later steps do not change (tensors cloned)."""
    return copy.deepcopy(state_dict)


def run(func):
    """Horovod's ``hvd.elastic.run``: call ``func(state, ...)``; when the workers change,
    go back to the last commit, re-form the ring, and call it again."""
    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        world.init()
        if config.get().min_workers and world.name() != 'ring':
            raise RuntimeError('hvd.elastic.run under --min-workers needs the ring backend, '
                               f'not {world.name()!r}')
        reset, skip_sync = False, False
        while True:
            if reset:
                world.reform()
                state.on_reset()
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except WorkersChanged as e:
                state.restore()
                me = shown(node.current().id) if node.current() else 'worker'
                say(f'{me}: {e}; back to the last commit')
                skip_sync = False
            except HostsUpdatedInterrupt as e:
                skip_sync = e.skip_sync
            reset = True
    return wrapper


def part(batch_size, rank=None, size=None):
    """(start, stop) of this worker's part of a global batch of ``batch_size`` samples:
    ``even_slices`` by the current rank and size."""
    rank = world.rank() if rank is None else rank
    return even_slices(batch_size, world.size() if size is None else size)[rank]
