"""BatchNorm's running statistics in step 7: averaged over a worker's replicas, then over
all workers through the store.

Each replica normalizes its own slice with that slice's statistics, and updates its
running mean and variance (buffers, not parameters: no gradient, no optimizer) from that
slice alone. Left so, workers holding the same weights would report different test
accuracies. So the Trainer's step 7 averages the floating-point buffers over its
replicas, then over the workers through the store, under one key of their own that the
servers' optimizer does not touch ('trainer0.buffers'). Why the mean rather than rank
0's, and what it costs: docs/design/training.md.
"""
import torch


class RunningStatistics:
    """The floating-point buffers of a Trainer's replicas (``buffers``: one list per
    replica), shared over ``store`` under ``key``; integer ones stay local."""

    def __init__(self, buffers, store, key):
        self.buffers, self.store, self.key = buffers, store, key

    def init(self):
        """The host copy of the floating-point buffers, one flat tensor; with several
        workers, rank 0's, from the store (at the Trainer's init)."""
        b0 = self.buffers[0]
        self.floats = [i for i, b in enumerate(b0) if b.is_floating_point()]
        self.shared = self.store.num_workers > 1 and bool(self.floats)
        if not self.shared:
            return
        if len({b0[i].dtype for i in self.floats}) != 1:
            raise ValueError('all floating-point buffers must have the same dtype')
        self.flat = torch.cat([b0[i].detach().reshape(-1).cpu() for i in self.floats])
        self._host = [v.view_as(b0[i]) for v, i in zip(
            self.flat.split([b0[i].numel() for i in self.floats]), self.floats)]
        self.store.init([self.key], [self.flat], optimizer=False)
        self.store.pull([self.key], out=[self.flat])
        self._pulled = self.flat.clone()    # what the store held last
        with torch.no_grad():
            for h, i in zip(self._host, self.floats):
                b0[i].copy_(h)

    def average(self, over_workers=True):
        """The mean of the replicas' running statistics, on the first device; over_workers:
        then the mean over all workers', through the store (into the first replica's)."""
        buffers, floats = self.buffers, self.floats
        if len(buffers) > 1:
            for i in floats:
                b0 = buffers[0][i]
                b0.copy_(torch.stack([b[i].to(b0.device) for b in buffers]).mean(0))
        if not (over_workers and self.shared):
            return
        for h, i in zip(self._host, floats):
            h.copy_(buffers[0][i])
        if getattr(self.store, 'is_async', False):
            self.flat.sub_(self._pulled)                 # servers add each worker's change
        else:
            self.flat.div_(self.store.num_workers)       # the store sums the N shares
        self.store.pushpull([self.key], [self.flat], out=[self.flat])
        self._pulled.copy_(self.flat)
        for h, i in zip(self._host, floats):
            buffers[0][i].copy_(h, non_blocking=True)
