"""Data-parallel training with Horovod's API, on d2ldist's collectives.

    import d2ldist as hvd                 # or: import d2ldist.horovod as hvd
    hvd.init()
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=net.named_parameters())
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    ...  loss.backward(); optimizer.step()   # gradients averaged over all workers

How DistributedOptimizer overlaps communication with computation (``buckets.py``):
the gradients are packed into buckets of about ``bucket_cap_mb`` (tensor fusion: one
all-reduce per bucket, not per tensor), in reverse parameter order, the order in which
backward produces them. A hook on each parameter (``BackwardBuckets``) copies its
gradient into its bucket as soon as backward has computed it; when a bucket is full,
its all-reduce starts on the communication thread while backward goes on with the
earlier layers. ``step()`` waits for the last buckets, copies the averages back into
``.grad`` and then steps. (A parameter that gets no gradient -- an unused layer --
holds its bucket, and the later ones, back until ``step()``, which counts its
gradient as zero.)
"""
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch

from ..runtime import faults, spans
from ..runtime.staging import staged
from . import api, ops
from .buckets import BUCKET_CAP_MB, BackwardBuckets
from .ops import Average
from .world import size


def _broadcast_tensors_(tensors, root_rank):
    """Broadcast a list of tensors in place: one fused broadcast per dtype and device."""
    groups = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for (_, device), group in groups.items():
        with staged(group, device) as flat:
            api.broadcast_(flat, root_rank)


def broadcast_parameters(params: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                         root_rank: int = 0) -> None:
    """Give every worker worker ``root_rank``'s values of ``params``, in place.

    ``params``: ``net.state_dict()`` or ``net.named_parameters()``."""
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    _broadcast_tensors_([t for _, t in items if torch.is_tensor(t)], root_rank)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Give every worker worker ``root_rank``'s optimizer state and hyperparameters.

    Tensors (momenta, ...) by broadcast; every other setting of each parameter group
    and state -- numbers, bools such as ``nesterov``, None, strings, tuples such as
    Adam's ``betas`` -- in one object (``broadcast_object``)."""
    if size() == 1:
        return
    if not optimizer.state:   # make the state (momenta, ...) exist on every worker
        initialize_state(optimizer)
    tensors, settings = [], []   # settings: the dicts whose other entries are sent
    for group in optimizer.param_groups:
        settings.append(group)
        for p in group['params']:
            state = optimizer.state.get(p, {})
            tensors += [state[k] for k in sorted(state) if torch.is_tensor(state[k])]
            settings.append(state)
    _broadcast_tensors_(tensors, root_rank)
    values = [{k: v for k, v in d.items() if k != 'params' and not torch.is_tensor(v)}
              for d in settings]
    for d, theirs in zip(settings, api.broadcast_object(values, root_rank)):
        d.update(theirs)


@torch.no_grad()
def initialize_state(optimizer, params=None):
    """One step with zero gradients creates the state of ``params`` (default: those that
    train); they are restored and keep a zero gradient where they had none (as Horovod's:
    ``.grad`` is a tensor after)."""
    if params is None:
        params = [p for g in optimizer.param_groups for p in g['params']
                  if p.requires_grad and p.is_floating_point()]   # (integer ones have no grad)
    saved = [(p.clone(), p.grad) for p in params]
    inner = getattr(optimizer, 'optimizer', optimizer)
    sparse = isinstance(inner, torch.optim.SparseAdam)   # (it takes sparse gradients only)
    for p in params:
        p.grad = torch.zeros_like(p).to_sparse() if sparse else torch.zeros_like(p)
    inner.step()
    for p, (value, grad) in zip(params, saved):
        p.copy_(value)
        if grad is not None:
            p.grad = grad
        else:
            p.grad.zero_()


def _dense(grad):
    """A gradient as a dense tensor, as it travels in its bucket (embeddings' sparse ones)."""
    return grad.to_dense() if grad.is_sparse else grad


def _names(params, named):
    """Each parameter's name (Horovod's ``_parameter_names``): from ``named``, or made
    up by position when no names were given."""
    if named is None:
        return {p: f'allreduce.noname.{i}' for i, p in enumerate(params)}
    return {p: name for name, p in named}


# Horovod's words, which scripts and Horovod's tests look for (here the gradients are
# not averaged a second time, so it costs nothing; the warning is for portability)
STEP_AFTER_SYNCHRONIZE = (
    'optimizer.step() called without optimizer.skip_synchronize() context after '
    'optimizer.synchronize(). This can cause training slowdown. You may want to consider '
    'using optimizer.skip_synchronize() context if you use optimizer.synchronize() in '
    'your code.')


def metric_average(value: float | torch.Tensor, name: str | None = None) -> float:
    """The average of a number (a loss, an accuracy) over all workers, for logging."""
    return api.allreduce(torch.tensor(float(value), dtype=torch.float64), op=Average).item()


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer: gradients are averaged over all workers before each step.

    Horovod's keywords: ``backward_passes_per_step`` (accumulate that many backward
    passes locally, then all-reduce once), ``op`` and ``gradient_predivide_factor``
    (divide before the sum, multiply after), ``sparse_as_dense`` (accepted: sparse
    gradients travel dense here anyway, in their bucket; as Horovod's, ``.grad`` comes
    back sparse either way, holding the rows whose average is not zero), ``compression``
    (``Compression.fp16``: each bucket through 16 bits). ``groups`` / ``num_groups`` are accepted but the buckets are made
    by size (``bucket_cap_mb``, like DDP's)."""

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
                 compression: api.Cast | api.Identity | None = None,
                 backward_passes_per_step: int = 1, op: ops.ReduceOp = Average,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                 groups: object = None, sparse_as_dense: bool = False,
                 bucket_cap_mb: float = BUCKET_CAP_MB) -> None:
        self.compression, self.sparse_as_dense = compression, sparse_as_dense
        if int(backward_passes_per_step) < 1:
            raise ValueError('backward_passes_per_step must be 1 or more')
        self.optimizer, self.op = optimizer, ops.get(op)
        self.backward_passes_per_step = int(backward_passes_per_step)
        self._predivide = float(gradient_predivide_factor)
        if self._predivide != 1.0 and self.op is not Average:
            raise ValueError('gradient_predivide_factor needs op=Average')
        params = [p for g in optimizer.param_groups for p in g['params']]
        named = None if named_parameters is None else list(named_parameters)
        self._parameter_names = _names(params, named)
        if named is not None:   # Horovod's rule: every optimized one is named
            names = [name for name, _ in named]
            dups = sorted({n for n in names if names.count(n) > 1})
            if dups:
                raise ValueError(f'parameter names in named_parameters must be unique; '
                                 f'found duplicates: {", ".join(dups)}')
            unnamed = {id(p) for p in params} - {id(p) for _, p in named}
            if unnamed:
                raise ValueError('named_parameters was given, but one or more parameters '
                                 f'of the optimizer are not named ({len(unnamed)} of them)')
        self._params = [p for p in params if p.requires_grad]
        self._buckets = None
        self._synchronized, self._should_synchronize = False, True
        self.step_clock = faults.StepClock()      # for d2l-launch --slow / --fail
        if size() > 1:
            self._make_buckets(bucket_cap_mb)

    # the wrapped optimizer's state is this optimizer's state
    param_groups = property(lambda self: self.optimizer.param_groups)
    state = property(lambda self: self.optimizer.state)
    defaults = property(lambda self: self.optimizer.defaults)

    def _make_buckets(self, cap_mb):
        """Buckets in backward's order (buckets.py), each with one flat buffer of its gradients."""
        params = self._params
        self._buckets = BackwardBuckets(params, self._fill, self._start,
                                        [(p.dtype, p.device) for p in params], cap_mb,
                                        self.backward_passes_per_step)
        self._slots = [None] * len(params)      # parameter i's place in its bucket's buffer
        self._buffers = []
        for group in self._buckets.groups:
            first = params[group[0]]
            buffer = torch.zeros(sum(params[i].numel() for i in group), dtype=first.dtype,
                                 device=first.device)
            offset = 0
            for i in group:
                self._slots[i] = buffer[offset:offset + params[i].numel()].view_as(params[i])
                offset += params[i].numel()
            self._buffers.append(buffer)

    def _fill(self, i):
        """Parameter i's gradient (.grad: the sum of this step's passes) into its bucket."""
        self._slots[i].copy_(_dense(self._params[i].grad))

    def _start(self, b, indices):
        f = self._predivide
        return api.allreduce_async_(self._buffers[b], op=self.op, prescale_factor=1 / f,
                                    postscale_factor=f, compression=self.compression)

    @torch.no_grad()
    def synchronize(self) -> None:
        """Wait for every bucket's all-reduce and put the averages into ``.grad``.

        Called alone (to clip the averaged gradients, say), it must be followed by
        ``with optimizer.skip_synchronize(): optimizer.step()``."""
        if self._buckets is None or self._synchronized:
            return
        for i in self._buckets.missing():       # gradients that never came count 0,
            g = self._params[i].grad            # fewer passes than asked count as they are
            if g is not None and self._buckets.passes[i] > 0:
                self._fill(i)
            else:
                self._slots[i].zero_()
        self._buckets.wait()
        for p, slot in zip(self._params, self._slots):
            if p.grad is None:
                p.grad = slot.clone()
            elif p.grad.is_sparse:   # (nn.Embedding(sparse=True)'s: sparse again, for SparseAdam)
                p.grad = slot.to_sparse(p.grad.sparse_dim())
            else:
                p.grad.copy_(slot.view_as(p.grad))
        self._synchronized = True

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``with optimizer.skip_synchronize(): optimizer.step()`` after ``synchronize()``."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Average the gradients over all workers, then take the wrapped optimizer's step."""
        self.step_clock.computed()           # d2l-launch --slow / --fail, the timeline
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(STEP_AFTER_SYNCHRONIZE)
            with spans.span('synchronize', 'step'):
                self.synchronize()
        self._synchronized = False
        try:
            with spans.span('update', 'step'):
                return self.optimizer.step(closure)
        finally:
            self.step_clock.done()

    def forget_gradients(self) -> None:
        """Forget the gradients of a step cut short (elastic: its collective failed); the
        next step's compute is timed from here, not from the step before."""
        if self._buckets is not None:
            self._buckets._reset()
        self._synchronized = False
        self.step_clock.restart()

    def zero_grad(self, set_to_none: bool = True) -> None:
        return self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        return self.optimizer.load_state_dict(state_dict)

    def __repr__(self):
        return f'DistributedOptimizer({self.optimizer!r}, buckets={len(self._buckets or ())})'
