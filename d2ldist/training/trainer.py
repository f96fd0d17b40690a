"""The seven steps of multi-machine, multi-device training, and a Trainer that runs them.

Every batch, on every worker (one machine with several devices):

1. a batch is split across the devices; each replica of the network computes
   the loss and the gradients of its slice;
2. the replicas' gradients are summed on one device;
3. the sum is copied to the CPU;
4. the CPU pushes it to the store, whose servers sum it over all workers;
5. the summed gradient updates the weights, and the new weights come back (pull);
6. the weights are copied to one device;
7. and from there broadcast to all devices.

``train_batch`` does step 1, ``Trainer.step`` steps 2 to 7, on one page; each step is
timed (``trainer.step_times``). The store is anything with the small interface of
``training/stores.py`` ('local', 'dist_sync', 'dist_async', 'ring', 'torch', ...:
``create_store``). With 'ring' and 'torch' the Trainer overlaps: backward's hook runs
steps 2 and 3 of each gradient (``_gradient_ready``) and starts a full bucket's
all-reduce, step 4 (``_start_bucket``), while backward computes the earlier layers.

Why each step is where it is (the stores, overlap, where the buffers live, BatchNorm's
statistics): docs/design/training.md.
"""
import copy
import itertools
import time
from contextlib import AbstractContextManager
from typing import NamedTuple

import torch

from ..collectives.buckets import BUCKET_CAP_MB, BackwardBuckets
from ..runtime import faults, spans, staging
from ..kv import optimizers
from ..kv.optimizers import ON_SERVERS, torch_names
from ..kv.worker import sum_copies
from .devices import indexed, split_and_load
from .statistics import RunningStatistics
from .stores import create_store
from .timing import StepTimes


class Step(NamedTuple):
    """One of the seven steps: what it does, and its bar's label on the dashboard."""
    what: str
    label: str


# The seven steps (d2ldist.report's step_times are keyed by the labels, in this order)
STEPS = {1: Step('forward and backward on each device', '1 forward, backward'),
         2: Step('sum gradients on one device', '2 sum on device'),
         3: Step('copy gradients to the CPU', '3 copy to CPU'),
         4: Step('push gradients to the store', '4 push'),
         5: Step('update weights, pull them back', '5 update, pull'),
         6: Step('copy weights to one device', '6 copy to device'),
         7: Step('broadcast weights to all devices', '7 to all devices')}


class Trainer:
    """Trains the replicas of net on devices through a key-value store (after gluon.Trainer).

    ``net`` itself becomes the replica on ``devices[0]``; the other replicas are deep
    copies. The store is filled at the first step (``init()``), and each Trainer has keys
    of its own ('trainer0.0', 'trainer0.1', ...), so Trainers can share a store. With a
    store that runs the optimizer (``set_optimizer``) the update happens in the store;
    otherwise every worker applies the same update to the same sum. ``overlap``: start
    the all-reduce of finished buckets of about ``bucket_cap_mb`` during backward ('ring',
    'torch'). ``compression_params`` (gluon's): ``{'type': '2bit', 'threshold': 0.5}``
    (parameter servers) or ``{'type': 'fp16'}`` (every store). Step 7 averages BatchNorm's
    running statistics over all replicas of all workers (why: docs/design/training.md).
    """

    def __init__(self, net: torch.nn.Module, optimizer: str = 'sgd',
                 optimizer_params: dict | None = None, kvstore: object = 'local',
                 devices: list[torch.device] | None = None,
                 update_on_kvstore: bool | None = None, overlap: bool = True,
                 bucket_cap_mb: float = BUCKET_CAP_MB,
                 compression_params: dict | None = None) -> None:
        self.devices = [indexed(d) for d in devices] if devices else [
            next(net.parameters()).device]
        optimizer = optimizer.lower()
        self.replicas = [net.to(self.devices[0])] + [
            copy.deepcopy(net).to(d) for d in self.devices[1:]]
        self.params = [[p for p in r.parameters() if p.requires_grad] for r in self.replicas]
        self.buffers = [list(r.buffers()) for r in self.replicas]
        self.store = create_store(kvstore, self.devices[0])   # ('torch' on NCCL: sums there)
        if compression_params is not None:   # gluon's: {'type': '2bit', 'threshold': 0.5}
            self.store.set_gradient_compression(compression_params)
        self.update_on_kvstore = self._choose_update_on_kvstore(optimizer, update_on_kvstore)
        # Its own keys: several Trainers may share a store (made in the same order on
        # every worker, they number themselves alike).
        self.name = f'trainer{next(Trainer._made)}'
        self.keys = [f'{self.name}.{i}' for i in range(len(self.params[0]))]
        self._statistics = RunningStatistics(self.buffers, self.store, f'{self.name}.buffers')
        self.optimizer_params = torch_names(optimizer_params)   # torch.optim's, from here on
        self._optimizer_name = optimizer
        # One tensor per key, all views of one flat buffer (which a ring can all-reduce
        # in one go): step 3 lands in the gradients, step 5 in the weights. Where each
        # buffer lives: docs/design/training.md.
        if len({p.dtype for p in self.params[0]}) != 1:
            raise ValueError('all parameters must have the same dtype')
        numels = [p.numel() for p in self.params[0]]
        dtype, gpu = self.params[0][0].dtype, any(d.type == 'cuda' for d in self.devices)
        grads_at = getattr(self.store, 'device', 'cpu') or self.devices[0]   # None: anywhere
        weights_at = 'cpu' if self.update_on_kvstore else self.devices[0]
        self.flat_grads = staging.buffer(sum(numels), dtype, grads_at, gpu).zero_()
        self.flat_weights = staging.buffer(sum(numels), dtype, weights_at, gpu).zero_()
        # the summed gradients on the GPU the weights are on, when they are summed on the
        # host and the Trainer updates (step 5's copy up lands here)
        self._grads_up = None
        if not self.update_on_kvstore and self.flat_grads.device != self.flat_weights.device:
            self._grads_up = staging.buffer(sum(numels), dtype, weights_at)
        self._grads = [v.view_as(p) for v, p in zip(self.flat_grads.split(numels),
                                                    self.params[0])]
        self._weights = [v.view_as(p) for v, p in zip(self.flat_weights.split(numels),
                                                      self.params[0])]
        self._optimizer = None   # with update_on_kvstore: the store's, from init()
        if not self.update_on_kvstore:
            # One tensor for the optimizer: the flat buffer (the update is elementwise,
            # so this is the same step as over each parameter, in a few big operations).
            self._optimizer = optimizers.create(optimizer, self.optimizer_params,
                                                [self.flat_weights])
        self._buckets = None   # overlap: steps 2 to 4 of each gradient start in backward
        if overlap and hasattr(self.store, 'allreduce_async_') and not self.update_on_kvstore:
            # hooks on the last replica (its backward ends last); one kind of parameter,
            # in order: a bucket is a slice of flat_grads
            self._offsets = list(itertools.accumulate(numels, initial=0))
            self._buckets = BackwardBuckets(self.params[-1], self._gradient_ready,
                                            self._start_bucket, cap_mb=bucket_cap_mb,
                                            finish=self._bucket_summed)
        self._times = StepTimes({s: step.label for s, step in STEPS.items()}, self.devices)
        self.last_batch_end = None   # when train_batch last ended (for the timeline)
        self._initialized = False

    _made = itertools.count()   # Trainers made in this process

    def init(self) -> None:
        """Put the weights in the store and give every worker rank 0's: at the first step
        (``train_batch`` calls it before the forward pass), as gluon's Trainer does."""
        if self._initialized:
            return
        for w, p in zip(self._weights, self.params[0]):
            w.copy_(p.detach())
        if self.update_on_kvstore or not hasattr(self.store, 'set_optimizer'):
            self.store.init(self.keys, self._weights)
        else:   # the store only sums them, whatever optimizer another Trainer sets on it
            self.store.init(self.keys, self._weights, optimizer=False, compress=True)
        self.store.pull(self.keys, out=self._weights)
        if self.flat_weights.device == self.params[0][0].device:   # updated there: share it
            for p, w in zip(self.params[0], self._weights):
                p.data = w
        if self.update_on_kvstore:
            # The Trainer scales the gradients (step 2): the servers must not rescale.
            wanted = (self._optimizer_name, dict(self.optimizer_params, rescale_grad=1.0))
            held = getattr(self.store, 'optimizer', None)
            if held is None:
                self.store.set_optimizer(wanted[0], **wanted[1])
            elif held != wanted:   # (setting it again would reset the other's momenta)
                raise ValueError(f'the store already runs {held[0]} {held[1]} for another '
                                 f'Trainer: give this one its own store, the same optimizer, '
                                 'or update_on_kvstore=False')
        self._statistics.init()
        self._copy_to_device()                    # steps 6 and 7, without the workers:
        self._broadcast(over_workers=False)       # the store gave every worker rank 0's
        self._initialized = True

    def _choose_update_on_kvstore(self, optimizer, update_on_kvstore):
        """Update in the store if it can run this optimizer (dist_async must)."""
        can = hasattr(self.store, 'set_optimizer') and optimizer in ON_SERVERS
        must = getattr(self.store, 'is_async', False)
        if update_on_kvstore is None:
            update_on_kvstore = can
        if must and not (update_on_kvstore and can):
            raise ValueError(f'kvstore {self.store.type} updates the weights on the servers: '
                             f'use an optimizer they know ({", ".join(ON_SERVERS)}) and '
                             'update_on_kvstore=True')
        return update_on_kvstore

    def step(self, batch_size: int) -> None:
        """Steps 2 to 7: update every replica with the mean gradient of all workers' examples.

        batch_size: the number of examples this worker used (the same on every worker).
        With overlap the steps are the same, but steps 2 to 4 of each gradient started in
        backward, as soon as every device had it (``_gradient_ready``): here step 4 waits
        for them, and step 5 divides their sum by the examples.
        """
        self.init()   # (the first step, when train_batch has not done it)
        # Synchronous stores sum all workers' gradients: divide by all examples.
        # An asynchronous store applies each push alone: divide by ours.
        workers = 1 if getattr(self.store, 'is_async', False) else self.store.num_workers
        scale = 1.0 / (batch_size * workers)
        # 1. forward and backward on each device: done by the caller (train_batch)
        if self._buckets is None:
            with self.timed(2):   # 2. sum each gradient over the replicas, on devices[0]
                grads = [self._sum_replicas(i).mul_(scale) for i in range(len(self.keys))]
            with self.timed(3):   # 3. copy the sums to the CPU, into flat_grads
                staging.copy_(self._grads, grads)
        else:                     # 2. and 3. ran in backward, gradient by gradient
            self._times.counts[2] += 1
            self._times.counts[3] += 1
        with self.timed(4):       # 4. push them; the store sums them over all workers
            self._push()
        with self.timed(5):       # 5. the sum updates the weights; they come back (pull)
            self._update(scale)
        with self.timed(6):       # 6. copy the new weights to devices[0]
            self._copy_to_device()
        with self.timed(7):       # 7. and on to all devices, with BatchNorm's statistics
            self._broadcast()

    def _sum_replicas(self, i):
        """Step 2 for parameter i: the replicas' gradients summed into the first one's."""
        g0 = self.params[0][i].grad
        grads = [g0 if g0 is not None else torch.zeros_like(self.params[0][i])]
        grads += [ps[i].grad for ps in self.params[1:] if ps[i].grad is not None]
        return sum_copies(grads, into_first=True)

    def _gradient_ready(self, i):
        """With overlap, when backward has produced gradient i on every device: its steps
        2 and 3, now (``BackwardBuckets`` then starts its bucket's step 4 if complete)."""
        with self.timed(2, count=False):
            g = self._sum_replicas(i)                          # 2. (step 5 scales it)
        with self.timed(3, count=False):
            staging.copy_([self._grads[i]], [g], wait=False)   # 3. (the summing thread waits)

    def _start_bucket(self, b, indices):
        """Step 4 for one bucket: start all-reducing its slice of flat_grads (from a GPU,
        once step 3's copies have landed: the thread that sums waits for them, backward
        goes on)."""
        with self.timed(4, count=False):
            bucket = self.flat_grads[self._span(indices)]
            if self.devices[0].type != 'cuda' or bucket.device.type != 'cpu':
                return self.store.allreduce_async_(bucket)   # nothing to wait for
            # step 3 queued the copies down on devices[0]'s stream in this thread (devices
            # indexed: this thread is current on the last replica's GPU); the summer waits
            landed = torch.cuda.Event()
            landed.record(torch.cuda.current_stream(self.devices[0]))
            return self.store.allreduce_async_(bucket, after=landed)

    def _push(self):
        """Step 4: push the gradients to the store, which sums them over all workers (and
        runs the optimizer, if it updates). With overlap: wait for the buckets' all-reduces."""
        if self._buckets is not None:
            for i in self._buckets.missing():   # gradients that never came count as zero
                self._grads[i].zero_()
            self._buckets.wait()                # (starts the buckets they held back)
        elif self.update_on_kvstore:
            self.store.push(self.keys, self._grads)
        else:
            self.store.pushpull(self.keys, self._grads, out=self._grads)

    def _bucket_summed(self, b, indices):
        """When a bucket's sum is in (step 4 waits for it): from the host on to the GPU
        the weights are on, while the next bucket is still being summed."""
        if self._grads_up is not None:
            span = self._span(indices)
            staging.copy_([self._grads_up[span]], [self.flat_grads[span]], wait=False)

    def _span(self, indices):
        """The slice of flat_grads that holds parameters min(indices)..max(indices)."""
        return slice(self._offsets[min(indices)], self._offsets[max(indices) + 1])

    def _update(self, scale):
        """Step 5: the summed gradients update the weights; the new weights come back."""
        if self.update_on_kvstore:
            self.store.pull(self.keys, out=self._weights)
        else:                       # every worker: the same update of the same sum
            grad = self.flat_grads if self._grads_up is None else self._grads_moved()
            if self._buckets is not None:
                grad.mul_(scale)    # backward's hooks summed them before batch_size was known
            self.flat_weights.grad = grad
            self._optimizer.step()

    def _grads_moved(self):
        """The sums on the device the weights are on, where the store summed them on
        another (a GPU and the host): _grads_up, with buckets copied bucket by bucket as
        each was summed (_bucket_summed), else here."""
        if self._buckets is None:
            staging.copy_([self._grads_up], [self.flat_grads], wait=False)
        if self._grads_up.device.type == 'cpu':   # down from the store's GPU into pinned
            staging.landed(self.flat_grads.device)   # memory (up: queued behind, no wait)
        return self._grads_up

    @torch.no_grad()
    def _copy_to_device(self):
        """Step 6: the new weights to the first device (where they are its weights, as on
        the CPU, there is nothing to copy)."""
        for p, w in zip(self.params[0], self._weights):
            if p.data_ptr() != w.data_ptr():
                p.copy_(w, non_blocking=True)

    @torch.no_grad()
    def _broadcast(self, over_workers=True):
        """Step 7: the weights from the first device to all the others, with the BatchNorm
        statistics averaged over the replicas and (over_workers) the workers."""
        params, buffers = self.params, self.buffers
        for r in range(1, len(self.replicas)):
            for p, p0 in zip(params[r], params[0]):
                p.copy_(p0, non_blocking=True)
        self._statistics.average(over_workers)
        for r in range(1, len(self.replicas)):
            for b, b0 in zip(buffers[r], buffers[0]):
                b.copy_(b0, non_blocking=True)

    def timed(self, step: int, count: bool = True) -> AbstractContextManager[None]:
        """A block timed as step ``step``; ``count=False`` (a hook in backward) adds its
        time but not a batch, and waits for no device (``timing.StepTimes.timed``)."""
        return self._times.timed(step, count)

    def reset_step_times(self) -> None:
        self._times.reset()

    @property
    def step_times(self) -> dict[int, float | None]:
        """Mean seconds per batch of each step, {1: ..., 7: ...} (None if not run yet)."""
        return self._times.means()

    def step_times_report(self) -> dict[str, float]:
        """step_times by label, in order, as the dashboard's bars take them: {'1 forward,
        backward': seconds, ..., '7 to all devices': seconds} (d2ldist.report's)."""
        return {STEPS[s].label: t for s, t in self.step_times.items() if t is not None}

    @property
    def initialized(self) -> bool:
        """Whether the store has the weights (the first step, or init(), has run)."""
        return self._initialized

    @property
    def optimizer(self) -> 'torch.optim.Optimizer | None':
        """The torch optimizer the Trainer runs (None: the store runs it)."""
        return self._optimizer

    def forget_step(self) -> None:
        """Forget a step cut short (elastic): no bucket started, every replica takes the first
        one's weights and statistics (a commit's), init() again (on the new ring)."""
        if self._buckets is not None:
            self._buckets._reset()
        for replica in self.replicas[1:]:
            replica.load_state_dict(self.replicas[0].state_dict())
        self._initialized = False

    @property
    def learning_rate(self) -> float | None:
        return self.optimizer_params.get('lr')

    def set_learning_rate(self, lr: float) -> None:
        """Change the learning rate of the optimizer, wherever it runs (states stay)."""
        self.optimizer_params['lr'] = lr
        if self.update_on_kvstore:
            if self._initialized:            # (else init() sends it with the optimizer)
                self.store.set_learning_rate(lr)
        else:
            for group in self._optimizer.param_groups:
                group['lr'] = lr

    def optimizer_states(self) -> dict:
        """The optimizer's states (momenta, ...), wherever it runs: on the servers (the
        store gathers them; ask on rank 0 only) or here. Tensors and numbers only."""
        if self.update_on_kvstore:        # by parameter index: the keys' names may differ
            held = self.store.optimizer_states()
            return {'on': 'store', 'optimizer': held['optimizer'], 'states': {
                i: held['states'][k] for i, k in enumerate(self.keys) if k in held['states']}}
        return {'on': 'worker', 'states': self._optimizer.state_dict()}

    def set_optimizer_states(self, data: dict) -> None:
        """Take back what optimizer_states() gave, after init(); every worker calls it
        (on the servers, rank 0's ``data`` is sent)."""
        if self.update_on_kvstore:
            self.store.set_optimizer_states(data and {'optimizer': data['optimizer'], 'states': {
                self.keys[i]: state for i, state in data['states'].items()}})
        else:
            self._optimizer.load_state_dict(data['states'])

    def compression_residuals(self) -> dict:
        """What 2-bit gradient compression has kept back on this worker, by parameter
        index ({} without it): a resumed job needs them to go on bit for bit."""
        held = self.store.compression_residuals() \
            if hasattr(self.store, 'compression_residuals') else {}
        return {i: held[k] for i, k in enumerate(self.keys) if k in held}

    def set_compression_residuals(self, data: dict) -> None:
        """Take back what compression_residuals() gave."""
        if data:
            self.store.set_compression_residuals({self.keys[i]: r for i, r in data.items()})


def train_batch(X: torch.Tensor, y: torch.Tensor, net: torch.nn.Module, loss: torch.nn.Module,
                trainer: 'Trainer', devices: list[torch.device]) -> tuple[float, int]:
    """Train on one batch (steps 1 to 7); returns (sum of losses, number correct).

    loss must give one value per example, e.g. nn.CrossEntropyLoss(reduction='none').
    """
    if net is not trainer.replicas[0] or [indexed(d) for d in devices] != trainer.devices:
        raise ValueError("train_batch needs the trainer's net and devices")
    trainer.init()   # at the first batch: every worker starts from rank 0's weights
    if trainer.last_batch_end is not None:   # (d2l-launch --timeline: the time between)
        spans.record('between steps', 'data', trainer.last_batch_end, time.time())
    # Step 1: split the batch across the devices; each replica computes the
    # loss and gradients of its slice (on GPUs, all devices work at once).
    with trainer.timed(1):
        start = time.perf_counter()
        devices = trainer.devices
        X_shards, y_shards = split_and_load(X, devices), split_and_load(y, devices)
        losses, corrects = [], []
        for replica, X_shard, y_shard in zip(trainer.replicas, X_shards, y_shards):
            replica.train()
            replica.zero_grad(set_to_none=True)
            y_hat = replica(X_shard)
            l = loss(y_hat, y_shard)
            if l.dim() == 0:
                raise ValueError("loss must give one value per example "
                                 "(use reduction='none')")
            l.sum().backward()
            losses.append(l.detach().sum())
            corrects.append((y_hat.argmax(dim=1) == y_shard).sum())
        faults.computed(time.perf_counter() - start)   # d2l-launch --slow / --fail
    # Steps 2 to 7.
    trainer.step(X.shape[0])
    trainer.last_batch_end = time.time()
    spans.step_done()
    return sum(float(l) for l in losses), sum(int(c) for c in corrects)
