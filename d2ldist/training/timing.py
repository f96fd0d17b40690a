"""The seven steps' times: each step's seconds per batch, less the steps timed inside it.

The Trainer (``trainer.py``) wraps each of its steps in ``StepTimes.timed``; its
``step_times`` are the means, which ``d2ldist.report`` sends to the dashboard's bars.
With overlap, backward's hooks time steps 2 to 4 of each bucket inside step 1: their time
counts for their own steps, not twice. Why a hook waits for no GPU:
docs/design/training.md.
"""
import time
from contextlib import contextmanager, nullcontext

import torch

from ..runtime import spans


class StepTimes:
    """Seconds spent in each step, summed over the batches, and the batches counted."""

    def __init__(self, labels, devices):
        self.labels, self.devices = labels, devices   # {step: its span's label}
        self._nested = []    # the timed blocks running now, innermost last: their inner time
        self.reset()

    def reset(self):
        """Start counting anew (``trainer.reset_step_times()``)."""
        self.sums = dict.fromkeys(self.labels, 0.0)
        self.counts = dict.fromkeys(self.labels, 0)

    @contextmanager
    def timed(self, step, count=True):
        """Add the block's time (waiting for the devices) to the step's total, less the
        time of the steps timed inside it (the hooks of overlapping buckets).

        count=False (the hooks in backward) does not wait for the devices: waiting in
        every hook would stall backward's GPU kernels; there the time is what the
        host spent starting the work, and the waiting shows in step 4.
        """
        start = time.perf_counter()
        self._nested.append(0.0)          # the time of the blocks nested in this one
        try:
            with spans.span(self.labels[step], 'step') if count else nullcontext():
                yield
        finally:
            for d in set(self.devices):
                if count and d.type == 'cuda':
                    torch.cuda.synchronize(d)
            elapsed, inner = time.perf_counter() - start, self._nested.pop()
            if self._nested:
                self._nested[-1] += elapsed
        self.sums[step] += elapsed - inner
        self.counts[step] += count

    def means(self):
        """Mean seconds per batch of each step, {1: ..., 7: ...} (None if not run yet)."""
        return {s: (self.sums[s] / n if n else None) for s, n in self.counts.items()}
