"""Gradient buckets: sum the gradients of the last layers while backward computes the first.

Backward produces the gradients from the last layer to the first. Group the
parameters, in that reverse order, into buckets of about ``BUCKET_CAP_MB``; as
soon as the last gradient of a bucket is ready, start its all-reduce on the
communication thread, and let backward go on with the earlier layers. Only
the last bucket's all-reduce (the first layers) is left to wait for after
backward. One all-reduce per bucket, not per tensor, is Horovod's *tensor
fusion*; starting them during backward is what DistributedDataParallel does.

Every worker must start the same all-reduces in the same order, so a bucket
starts only after all buckets before it, whatever order the hooks fire in.

``Buckets`` is the bookkeeping (which gradients are in, which bucket starts next);
``BackwardBuckets`` adds the hooks: each parameter's, when backward has produced its
gradient, puts it in its bucket and may start the bucket. Used by
``horovod.DistributedOptimizer`` and by the ``Trainer`` with the stores that are
all-reduces ('ring', 'torch').
"""
import torch

BUCKET_CAP_MB = 25   # as DDP's default


class Buckets:
    """Parameters 0..n-1 (forward order) in buckets, last layers first; ``ready(i)`` starts them.

    numels: elements of each parameter; kinds: what may not share a bucket (dtype,
    device), one per parameter; start(b, indices): start bucket b's all-reduce and
    return something with ``wait()``; finish(b, indices), if given: called in
    ``wait()`` as soon as bucket b's has ended, while the later ones may still run.
    """

    def __init__(self, numels, element_sizes, kinds, start, cap_mb=BUCKET_CAP_MB,
                 finish=None):
        self.start, self.finish, cap = start, finish, cap_mb * 1024 * 1024
        self.groups, current, nbytes = [], [], 0   # groups: lists of parameter indices
        for i in reversed(range(len(numels))):
            size = numels[i] * element_sizes[i]
            if current and (nbytes + size > cap or kinds[i] != kinds[current[0]]):
                self.groups.append(current)
                current, nbytes = [], 0
            current.append(i)
            nbytes += size
        if current:
            self.groups.append(current)
        self.bucket_of = {i: b for b, group in enumerate(self.groups) for i in group}
        self._reset()

    def __len__(self):
        return len(self.groups)

    def _reset(self):
        self.ready_ones = [set() for _ in self.groups]
        self.handles, self.next = [None] * len(self.groups), 0

    def ready(self, i):
        """Parameter i's gradient is in place: start every complete bucket, in order."""
        b = self.bucket_of[i]
        if i in self.ready_ones[b] or self.handles[b] is not None:
            raise RuntimeError('a gradient was computed twice before the step: one backward '
                               'per step (DistributedOptimizer: or call synchronize() in '
                               'between; ShardedOptimizer: stage 1 accumulates)')
        self.ready_ones[b].add(i)
        while self.next < len(self.groups) and \
                len(self.ready_ones[self.next]) == len(self.groups[self.next]):
            self.handles[self.next] = self.start(self.next, self.groups[self.next])
            self.next += 1

    def missing(self):
        """The parameters whose gradient never came this step (unused layers)."""
        return [i for b, group in enumerate(self.groups) for i in group
                if i not in self.ready_ones[b]]

    def wait(self):
        """Start what is left (call after filling ``missing()``), wait for every bucket."""
        for i in self.missing():
            self.ready(i)
        for b, handle in enumerate(self.handles):
            handle.wait()
            if self.finish is not None:
                self.finish(b, self.groups[b])
        self._reset()


class BackwardBuckets(Buckets):
    """The buckets of ``params``' gradients, started from backward's hooks.

    A hook on each parameter: when backward has produced its gradient (on the last of
    ``backward_passes`` passes, which add up in ``.grad``), ``fill(i)`` puts it in its
    bucket, and the bucket starts if it is complete (``ready(i)``). ``start``, ``kinds``,
    ``cap_mb`` and ``finish`` as ``Buckets``'. After backward: fill the gradients that
    never came (``missing()``), then ``wait()``.
    """

    def __init__(self, params, fill, start, kinds=None, cap_mb=BUCKET_CAP_MB,
                 backward_passes=1, finish=None):
        self.fill, self.backward_passes = fill, backward_passes
        super().__init__([p.numel() for p in params], [p.element_size() for p in params],
                         kinds or [None] * len(params), start, cap_mb, finish)
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(lambda p, i=i: self._produced(i))

    def _reset(self):
        """No gradient in, no bucket started, no backward pass counted."""
        super()._reset()
        self.passes = [0] * len(self.bucket_of)   # backward passes since the last wait()

    @torch.no_grad()
    def _produced(self, i):
        """Backward has produced parameter i's gradient: on its last pass, into its bucket."""
        self.passes[i] += 1
        if self.passes[i] >= self.backward_passes:
            self.fill(i)
            self.ready(i)
