"""ZeRO, stages 1 and 2: each worker keeps the optimizer's state of only 1/N of the weights.

``ShardedOptimizer`` wraps a torch optimizer. The parameters go into buckets in
backward's order (``buckets.py``), each bucket one flat vector padded to a multiple of
N and cut into N equal shards (FSDP's flat parameters); worker r owns shard r of every
bucket, and the wrapped optimizer's groups hold the shards only. A step reduce-scatters
each bucket's gradients (stage 2: during backward, each full ``.grad`` dropped once in
its bucket), steps the shards, and all-gathers them into every worker's weights: an
all-reduce cut in its two halves (``ring.py``), the same bytes, Adam's state 1/N.

A parameter that gets no gradient in a step counts as zero there (as in
DistributedOptimizer's buckets). Each worker's ``state_dict()`` is its own shard's;
``d2ldist.checkpoint`` saves every worker's, and loads them on any number of workers.
With ``replicas=1`` (``d2l-launch --shard-replicas 1``) each worker also keeps its ring
predecessor's shard, stepped alike, so that an elastic job goes on without a lost worker
(``shard_replica.py``). Stage 3, the weights sharded too, is ``sharded_module.py``. At the
end of this file, what a worker holds: counted (``memory_by_kind``, ``MemoryPeak``), and
as the paper counts it (``paper_memory``).

Why shard, and one step drawn: docs/design/zero.md.
"""
from collections.abc import Callable, Iterable

import torch

from .. import config
from ..runtime import faults
from . import shard_replica, world
from .buckets import BUCKET_CAP_MB, BackwardBuckets, Buckets
from .distributed_optimizer import DistributedOptimizer
from .ops import Average

STAGES = (1, 2)


class Bucket:
    """One bucket's layout: its parameters back to back, padded, cut into n equal shards."""

    def __init__(self, params, indices, n, group=0):
        self.params, self.indices, self.group = [params[i] for i in indices], indices, group
        self.numel = sum(p.numel() for p in self.params)
        self.padded = -(-self.numel // n) * n           # rounded up to a multiple of n
        self.shard_numel = self.padded // n

    def shard(self, r):
        """(start, end) of worker r's shard in the flat vector."""
        return r * self.shard_numel, (r + 1) * self.shard_numel

    def places(self, flat):
        """Each parameter's place in the flat vector ``flat``, shaped like it."""
        views, offset = [], 0
        for p in self.params:
            views.append(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return views

    def zeros(self):
        """A flat vector of the bucket's dtype and device, padded, all zeros."""
        first = self.params[0]
        return torch.zeros(self.padded, dtype=first.dtype, device=first.device)

    @torch.no_grad()
    def pack(self, tensors):
        """The tensors (one per parameter; None counts as zeros) as one padded flat vector."""
        flat = self.zeros()
        for place, t in zip(self.places(flat), tensors):
            if t is not None:
                place.copy_(t)
        return flat

    def __repr__(self):
        return f'Bucket(parameters {self.indices}, {self.numel} -> {self.padded} elements)'


def plan(params, n, cap_mb=BUCKET_CAP_MB, kinds=None):
    """The layout among ``n`` workers: ``Buckets``' grouping (backward's order, about
    ``cap_mb`` each; ``kinds``: what may not share a bucket, (dtype, device, param group))."""
    kinds = kinds or [(p.dtype, p.device, 0) for p in params]
    groups = Buckets([p.numel() for p in params], [p.element_size() for p in params],
                     kinds, None, cap_mb).groups
    return layout(params, groups, n, kinds)


def layout(params, groups, n, kinds):
    """A Bucket for each group of parameter indices (its param group: its kinds' third)."""
    return [Bucket(params, g, n, kinds[g[0]][2]) for g in groups]


def check(optimizer, named_parameters, stage):
    """Refuse, in one line, what ShardedOptimizer cannot shard."""
    if stage not in STAGES:
        raise ValueError(f'stage must be 1 or 2, not {stage!r} (stage 3, the weights '
                         'sharded too, is d2ldist.shard_module)')
    if not isinstance(optimizer, torch.optim.Optimizer) \
            or isinstance(optimizer, (DistributedOptimizer, ShardedOptimizer)):
        raise TypeError(f'ShardedOptimizer wraps a torch.optim optimizer, not '
                        f'{type(optimizer).__name__}')
    if optimizer.state:
        raise ValueError('the optimizer already has state (it has stepped): wrap it in '
                         'ShardedOptimizer before the first step')
    mine = {id(p) for g in optimizer.param_groups for p in g['params']}
    left_out = [name for name, p in named_parameters or () if p.requires_grad
                and id(p) not in mine]
    if left_out:
        raise ValueError(f'{len(left_out)} parameters of the model are not in the optimizer '
                         f'({", ".join(left_out[:3])}): give them all to it, or freeze them')


class ShardedOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer: ZeRO stage 1 (its state sharded over the workers) or 2 (the
    gradients too), on the backend in use (the module's docstring says how).

    Mixed dtypes (and devices) are bucketed separately. Start every worker with the same
    weights (``broadcast_parameters``); then ``loss.backward(); optimizer.step()``."""

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
                 stage: int = 1, bucket_cap_mb: float = BUCKET_CAP_MB,
                 max_whole_buckets: int | None = None, replicas: int | None = None) -> None:
        check(optimizer, None if named_parameters is None else list(named_parameters), stage)
        if max_whole_buckets is not None and (stage != 2 or not isinstance(
                max_whole_buckets, int) or max_whole_buckets < 1):
            raise ValueError('max_whole_buckets is for stage 2, a whole number from 1, '
                             f'got {max_whole_buckets!r} at stage {stage}')
        self.replicas = config.get().shard_replicas if replicas is None else replicas
        if self.replicas not in (0, 1):
            raise ValueError(f'replicas is 0 or 1 (a copy on the ring successor), got '
                             f'{self.replicas!r}')
        if self.replicas and world.backend().name != 'ring':
            raise ValueError('replicas=1 (--shard-replicas) needs the ring backend, not '
                             f'{world.backend().name!r}')
        self.optimizer, self.stage = optimizer, stage
        self.max_whole_buckets = max_whole_buckets    # stage 2: None, as many as backward
        self._in_flight = []                          # gets ahead of the reduce-scatters
        self.rank, self.size = world.backend().rank, world.backend().size
        self.step_clock = faults.StepClock()              # d2l-launch --slow / --fail
        owned = [(g, p) for g, group in enumerate(optimizer.param_groups)
                 for p in group['params'] if p.requires_grad]
        self._params = [p for _, p in owned]
        kinds = [(p.dtype, p.device, g) for g, p in owned]
        if stage == 2:     # the hooks of backward group the parameters as plan() would
            self._hooks = BackwardBuckets(self._params, self._fill, self._start, kinds,
                                          bucket_cap_mb)
            self.buckets = layout(self._params, self._hooks.groups, self.size, kinds)
            self._grads = [None] * len(self.buckets)      # the buckets being filled
            self._sending = [None] * len(self.buckets)    # and those being reduce-scattered
        else:
            self.buckets = plan(self._params, self.size, bucket_cap_mb, kinds)
        self._kinds = kinds
        self._cut()
        self.replica = shard_replica.ShardReplica(self) if self.replicas and self.size > 1 \
            else None            # the ring predecessor's shards, kept here too

    def _cut(self):
        """This worker's shards of the buckets; the optimizer sees shards only."""
        self.shards = [self._my_shard(bucket) for bucket in self.buckets]
        for g, group in enumerate(self.optimizer.param_groups):
            group['params'] = [s for b, s in zip(self.buckets, self.shards) if b.group == g]

    def reshard(self, wholes: list[dict] | None = None) -> None:
        """Cut the buckets again for the workers in the ring now (after one was lost):
        the same groups of parameters, new shards of the weights from the parameters, no
        optimizer state (``shard_replica.recover`` brings it, and ``wholes``, unused here:
        the weights are whole on every worker)."""
        self.rank, self.size = world.backend().rank, world.backend().size
        self.buckets = layout(self._params, [b.indices for b in self.buckets], self.size,
                              self._kinds)
        self.optimizer.state.clear()
        self._cut()

    # the wrapped optimizer's state is this optimizer's state
    param_groups = property(lambda self: self.optimizer.param_groups)
    state = property(lambda self: self.optimizer.state)
    defaults = property(lambda self: self.optimizer.defaults)

    def _my_shard(self, bucket):
        """This worker's shard of the bucket's weights, a flat tensor of its own."""
        a, b = bucket.shard(self.rank)
        return bucket.pack(bucket.params)[a:b].clone()

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Average the gradients into this worker's shards, step them, gather the weights."""
        self.step_clock.computed()           # (a step cut short by a failure: not counted)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            self._reduce_scatter_gradients()
            self.optimizer.step()
            peak_moment(self)            # (every kind at its fullest: see memory_by_kind)
            self._all_gather_weights()
            if self.replica is not None:  # (sent while the next step computes)
                self.replica.send()
        self.step_clock.done()
        return loss

    def _reduce_scatter_gradients(self):
        """Each shard's averaged gradient in its ``.grad``: stage 1 reduce-scatters every
        bucket now; stage 2 began during backward and waits for the last ones."""
        if self.stage == 2:
            self._hooks.wait()                # (starts the buckets of unused parameters)
            return
        handles = []
        for b, bucket in enumerate(self.buckets):
            flat = bucket.pack([p.grad for p in bucket.params])
            handles.append(world.run(self._reduce_scatter, b, flat))
        for handle in handles:
            handle.wait()

    def _reduce_scatter(self, b, flat):
        """(On the communication thread) bucket b's gradients averaged into shard b's grad."""
        shard = world.backend().reduce_scatter_flat(flat, Average)
        self.shards[b].grad = shard.clone()   # (not a view: the bucket's memory goes)
        if self.stage == 2:
            self._sending[b] = None           # (now it does)

    def _all_gather_weights(self):
        """Every worker's updated shards into the full weights, written into the parameters."""
        flats = [bucket.zeros() for bucket in self.buckets]
        handles = [world.run(world.backend().all_gather_flat_, flat, shard)
                   for flat, shard in zip(flats, self.shards)]
        for bucket, flat, handle in zip(self.buckets, flats, handles):
            handle.wait()
            for p, value in zip(bucket.params, bucket.places(flat)):
                p.copy_(value)

    # -- stage 2: backward's hooks ---------------------------------------------------
    def _fill(self, i):
        """Parameter i's gradient into its bucket; its full ``.grad`` is dropped."""
        b, p = self._hooks.bucket_of[i], self._params[i]
        bucket = self.buckets[b]
        if self._grads[b] is None:
            self._make_room()
            self._grads[b] = bucket.zeros()
        bucket.places(self._grads[b])[bucket.indices.index(i)].copy_(p.grad)
        p.grad = None

    def _start(self, b, indices):
        """Bucket b is complete: its reduce-scatter starts on the communication thread."""
        peak_moment(self)                      # (a whole bucket of gradients held)
        flat, self._grads[b] = self._grads[b], None
        if flat is None:                       # (no gradient came: zeros)
            flat = self.buckets[b].zeros()
        self._sending[b] = flat                # whole until its reduce-scatter is done
        handle = world.run(self._reduce_scatter, b, flat)
        self._in_flight.append(handle)
        return handle

    def _make_room(self):
        """Before a bucket is made (``max_whole_buckets``): while as many are whole, wait
        for the oldest reduce-scatter. With 1, one bucket of gradients at most is whole,
        and backward waits for the communication where it would have gone ahead."""
        while self.max_whole_buckets is not None and self._in_flight \
                and len(self.filling) >= self.max_whole_buckets:
            self._in_flight.pop(0).wait()
        self._in_flight = [h for h in self._in_flight if not h.done()]

    @property
    def filling(self) -> list[torch.Tensor]:
        """The gradient buckets held whole (stage 2): being filled by backward, or waiting
        for their reduce-scatter; memory_by_kind counts them."""
        return [flat for flat in getattr(self, '_grads', ()) + getattr(self, '_sending', ())
                if flat is not None]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's: the parameters' gradients (and the shards') to None, or to zeros."""
        for p in self._params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def refresh_shards(self) -> None:
        """This worker's shards of the weights cut again from the parameters (after new
        values were loaded into them: ``d2ldist.checkpoint.load``, an elastic restore)."""
        for bucket, shard in zip(self.buckets, self.shards):
            shard.copy_(self._my_shard(bucket))
        if self.replica is not None:
            self.replica.refresh()

    def forget_gradients(self) -> None:
        """Drop a step's gradients half summed (an elastic restore after a failed step); the
        next step's compute is timed from here."""
        if self.stage == 2:
            self._hooks._reset()
            self._grads = [None] * len(self.buckets)
            self._sending = [None] * len(self.buckets)
        self._in_flight = []
        for t in self._params + self.shards:
            t.grad = None
        self.step_clock.restart()

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        return self.optimizer.load_state_dict(state_dict)

    def __repr__(self):
        return (f'ShardedOptimizer({type(self.optimizer).__name__}, stage={self.stage}, '
                f'buckets={len(self.buckets)}, shard {self.rank} of {self.size})')


# -- memory: the bytes of live tensors by kind, at a step's highest moment -------------------
KINDS = ('weights', 'gradients', 'optimizer state')
_watchers = []            # MemoryPeak's samplers, called at the library's peak moments


def peak_moment(owner):
    """Where a step's memory may peak (stage 1-2: the optimizer stepped; stage 2: a whole
    bucket of gradients; stage 3: a unit gathered): the MemoryPeak watching ``owner`` (an
    optimizer or a module of its net) counts now."""
    for watcher in list(_watchers):
        watcher(owner)


def nbytes(tensors):
    """The bytes of memory under the tensors, each storage counted once (a freed one: 0;
    a DTensor, FSDP2's: this worker's part)."""
    storages = {}
    for t in tensors:
        if t is not None:
            storage = getattr(t, '_local_tensor', t).untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def memory_by_kind(module, optimizer=None):
    """The bytes a training step holds now, by kind: ``weights`` (the module's parameters and
    the optimizer's: ShardedOptimizer's shards; stage 3's shards and the unit gathered),
    ``gradients`` (their ``.grad``; stage 2's buckets being filled; stage 3's gathered
    gradient) and ``optimizer state`` (its tensors, the step counters aside). Stage 2's
    buckets count until their reduce-scatter has ended (on the communication thread:
    if it falls behind backward, they wait whole). The buffers that live only inside a
    collective, and the activations, are not counted."""
    params = list(module.parameters())
    if optimizer is not None:
        params += [p for group in optimizer.param_groups for p in group['params']]
    weights, grads = list(params), [p.grad for p in params]
    for m in module.modules():
        unit = getattr(m, 'sharded_unit', None)           # (sharded_module.py's)
        if unit is not None:
            weights.append(unit.full)
            grads.append(unit.grad)
    grads += getattr(optimizer, 'filling', [])
    state = [t for s in (optimizer.state.values() if optimizer is not None else ())
             for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    return dict(zip(KINDS, map(nbytes, (weights, grads, state))))


class MemoryPeak:
    """``with MemoryPeak(net, optimizer) as peak:`` a step; then ``peak.bytes`` is
    memory_by_kind at the step's highest moment: the library's peak moments (of this net
    or optimizer), the start and the end, and ``peak.sample()`` where you call it."""

    def __init__(self, module, optimizer=None):
        self.module, self.optimizer, self.bytes = module, optimizer, None
        self.owners = {id(m) for m in module.modules()} | {id(optimizer)}

    def sample(self):
        now = memory_by_kind(self.module, self.optimizer)
        if self.bytes is None or sum(now.values()) > sum(self.bytes.values()):
            self.bytes = now

    def _moment(self, owner):
        if id(owner) in self.owners:
            self.sample()

    def __enter__(self):
        _watchers.append(self._moment)
        self.sample()
        return self

    def __exit__(self, *exc):
        _watchers.remove(self._moment)
        self.sample()


def paper_memory(stage, numels, n, itemsize=4):
    """Bytes per worker by kind for Adam, as the ZeRO paper counts them (Rajbhandari et al.
    2020, section 5), in one dtype of ``itemsize`` bytes rather than mixed precision: weights
    and gradients once each, Adam's two moments twice; stage 1 shards the state, 2 the
    gradients too, 3 the weights too (stage 0: data parallelism). ``numels``: the sizes of
    the flat vectors cut into shards (buckets, units), each padded to a multiple of n."""
    whole = sum(numels) * itemsize
    shard = sum(-(-k // n) for k in numels) * itemsize      # 1/n of the padded vectors
    return {'weights': shard if stage >= 3 else whole,
            'gradients': shard if stage >= 2 else whole,
            'optimizer state': 2 * (shard if stage >= 1 else whole)}
