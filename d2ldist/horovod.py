"""Data-parallel training with Horovod's API, on d2ldist's collectives.

    import d2ldist as hvd                 # or: import d2ldist.horovod as hvd
    hvd.init()
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=net.named_parameters())
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    ...  loss.backward(); optimizer.step()   # gradients averaged over all workers

How DistributedOptimizer overlaps communication with computation: the gradients are
packed into buckets of about ``bucket_cap_mb`` (tensor fusion: one all-reduce per
bucket, not per tensor). Buckets are filled in reverse parameter order, the order in
which backward produces the gradients. A hook on each parameter copies its gradient
into its bucket as soon as backward has computed it; when a bucket is full, its
all-reduce starts on the communication thread while backward goes on with the
earlier layers. ``step()`` waits for the last buckets, copies the averages back into
``.grad`` and then steps. Buckets start in a fixed order, so every worker runs the
same all-reduces in the same order. (A parameter that gets no gradient -- an unused
layer -- holds its bucket, and the later ones, back until ``step()``, which counts
its gradient as zero.)
"""
import torch

from . import init, local_rank, local_size, rank, size  # noqa: F401  (Horovod's names)
from .collectives import api, ops
from .collectives.ops import Average, Max, Min, Sum  # noqa: F401

BUCKET_CAP_MB = 25   # as DDP's default


def _broadcast_tensors_(tensors, root_rank):
    """Broadcast a list of tensors in place: one fused broadcast per dtype and device."""
    groups = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for group in groups.values():
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        api.broadcast_(flat, root_rank)
        offset = 0
        with torch.no_grad():
            for t in group:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()


def broadcast_parameters(params, root_rank=0):
    """Give every worker worker ``root_rank``'s values of ``params``, in place.

    ``params``: ``net.state_dict()`` or ``net.named_parameters()``."""
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    _broadcast_tensors_([t for _, t in items if torch.is_tensor(t)], root_rank)


def broadcast_optimizer_state(optimizer, root_rank=0):
    """Give every worker worker ``root_rank``'s optimizer state and hyperparameters."""
    if size() == 1:
        return
    if not optimizer.state:   # make the state (momenta, ...) exist on every worker
        _initialize_state(optimizer)
    tensors, numbers = [], []   # numbers: (dict, key, type) of each scalar entry
    for group in optimizer.param_groups:
        numbers += _numbers(group, exclude='params')
        for p in group['params']:
            state = optimizer.state.get(p, {})
            tensors += [state[k] for k in sorted(state) if torch.is_tensor(state[k])]
            numbers += _numbers(state)
    _broadcast_tensors_(tensors, root_rank)
    values = api.broadcast(torch.tensor([float(_get(d, k)) for d, k, _ in numbers],
                                        dtype=torch.float64), root_rank)
    for (d, k, kind), v in zip(numbers, values.tolist()):
        _set(d, k, kind(v))


def _numbers(d, exclude=None):
    """(dict, key, type) of the int/float entries of d, and of numbers in tuples."""
    out = []
    for key in sorted(d, key=str):
        v = d[key]
        if key == exclude or isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            out.append((d, key, type(v)))
        elif isinstance(v, tuple) and all(isinstance(x, (int, float)) for x in v):
            out += [(d, (key, i), type(x)) for i, x in enumerate(v)]   # Adam's betas
    return out


def _get(d, key):
    return d[key[0]][key[1]] if isinstance(key, tuple) else d[key]


def _set(d, key, value):
    if isinstance(key, tuple):
        name, i = key
        d[name] = d[name][:i] + (value,) + d[name][i + 1:]
    else:
        d[key] = value


@torch.no_grad()
def _initialize_state(optimizer):
    """One step with zero gradients creates the state; the parameters are restored."""
    params = [p for g in optimizer.param_groups for p in g['params']]
    saved = [(p.clone(), p.grad) for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    getattr(optimizer, 'optimizer', optimizer).step()
    for p, (value, grad) in zip(params, saved):
        p.copy_(value)
        p.grad = grad


def metric_average(value, name=None):
    """The average of a number (a loss, an accuracy) over all workers, for logging."""
    return api.allreduce(torch.tensor(float(value), dtype=torch.float64), Average).item()


class _Bucket:
    """Gradients fused into one flat buffer, all-reduced with one call."""

    def __init__(self, params):
        self.params, self.ready, self.handle = params, set(), None
        self.offsets, n = {}, 0
        for p in params:
            self.offsets[p] = (n, n + p.numel())
            n += p.numel()
        self.buffer = torch.zeros(n, dtype=params[0].dtype, device=params[0].device)

    def slot(self, p):
        a, b = self.offsets[p]
        return self.buffer[a:b].view_as(p)


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer: gradients are averaged over all workers before each step."""

    def __init__(self, optimizer, named_parameters=None, bucket_cap_mb=BUCKET_CAP_MB,
                 op=Average):
        self.optimizer, self.op = optimizer, ops.get(op)
        params = [p for g in optimizer.param_groups for p in g['params']]
        if named_parameters is not None:
            named = list(named_parameters)
            names = [name for name, _ in named]
            if len(set(names)) != len(names):
                raise ValueError('named_parameters has duplicate names')
            known = {id(p) for p in params}
            missing = [name for name, p in named if id(p) not in known]
            if missing:
                raise ValueError(f'parameters not in the optimizer: {", ".join(missing)}')
        self._buckets, self._bucket_of, self._hooks, self._next = [], {}, [], 0
        if size() > 1:
            self._make_buckets([p for p in params if p.requires_grad], bucket_cap_mb)

    # the wrapped optimizer's state is this optimizer's state
    param_groups = property(lambda self: self.optimizer.param_groups)
    state = property(lambda self: self.optimizer.state)
    defaults = property(lambda self: self.optimizer.defaults)

    def _make_buckets(self, params, cap_mb):
        """Reverse parameter order (backward's order), at most cap_mb per bucket."""
        cap, current, nbytes = cap_mb * 1024 * 1024, [], 0
        for p in reversed(params):
            same_kind = not current or (p.dtype, p.device) == (current[0].dtype,
                                                               current[0].device)
            if current and (nbytes + p.numel() * p.element_size() > cap or not same_kind):
                self._buckets.append(_Bucket(current))
                current, nbytes = [], 0
            current.append(p)
            nbytes += p.numel() * p.element_size()
        if current:
            self._buckets.append(_Bucket(current))
        for bucket in self._buckets:
            for p in bucket.params:
                self._bucket_of[p] = bucket
                self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready))

    @torch.no_grad()
    def _grad_ready(self, p):
        """Backward has computed p.grad: copy it into its bucket; start full buckets."""
        bucket = self._bucket_of[p]
        if bucket.handle is not None or p in bucket.ready:
            raise RuntimeError('a gradient was computed twice before step(): call '
                               'optimizer.step() (or synchronize()) after each backward()')
        bucket.slot(p).copy_(p.grad)
        bucket.ready.add(p)
        self._start_full_buckets()

    def _start_full_buckets(self):
        """Start the all-reduce of every full bucket, in bucket order."""
        while self._next < len(self._buckets):
            bucket = self._buckets[self._next]
            if len(bucket.ready) < len(bucket.params):
                return
            bucket.handle = api.allreduce_async_(bucket.buffer, self.op)
            self._next += 1

    @torch.no_grad()
    def synchronize(self):
        """Wait for every bucket's all-reduce and put the averages into ``.grad``."""
        for bucket in self._buckets[self._next:]:   # gradients that never came count 0
            for p in bucket.params:
                if p not in bucket.ready:
                    bucket.slot(p).zero_()
                    bucket.ready.add(p)
        self._start_full_buckets()
        for bucket in self._buckets:
            bucket.handle.wait()
            for p in bucket.params:
                if p.grad is None:
                    p.grad = bucket.slot(p).clone()
                else:
                    p.grad.copy_(bucket.slot(p))
            bucket.ready, bucket.handle = set(), None
        self._next = 0

    def step(self, closure=None):
        """Average the gradients over all workers, then take the wrapped optimizer's step."""
        self.synchronize()
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none=True):
        return self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        return self.optimizer.load_state_dict(state_dict)

    def __repr__(self):
        return f'DistributedOptimizer({self.optimizer!r}, buckets={len(self._buckets)})'
