"""Reduction operations: how two workers' values combine into one.

Each op reduces *in place* into the accumulator (no temporary tensors in the
ring's inner loop). ``Average`` is a sum followed by one division by the number of
workers at the end; on integer tensors that division rounds toward zero, on bool
tensors Sum and Average mean "any" and Min means "all".
"""
import torch


class ReduceOp:
    """A named reduction: ``reduce_(acc, x)`` leaves op(acc, x) in ``acc``."""

    def __init__(self, name, reduce_, torch_name):
        self.name, self.reduce_, self.torch_name = name, reduce_, torch_name

    def __repr__(self):
        return f'd2ldist.{self.name}'


def _sum_(acc, x):
    if acc.dtype == torch.bool:
        return acc.logical_or_(x)
    return acc.add_(x)


def _min_(acc, x):
    return torch.minimum(acc, x, out=acc)


def _max_(acc, x):
    return torch.maximum(acc, x, out=acc)


def _prod_(acc, x):
    if acc.dtype == torch.bool:
        return acc.logical_and_(x)
    return acc.mul_(x)


Sum = ReduceOp('Sum', _sum_, 'SUM')
Average = ReduceOp('Average', _sum_, 'SUM')   # then divided by size(): see finish_
Min = ReduceOp('Min', _min_, 'MIN')
Max = ReduceOp('Max', _max_, 'MAX')
Product = ReduceOp('Product', _prod_, 'PRODUCT')
OPS = {op.name: op for op in (Sum, Average, Min, Max, Product)}


def get(op):
    """The ReduceOp for ``op`` (an op or its name); a clear error otherwise."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str) and op.capitalize() in OPS:
        return OPS[op.capitalize()]
    raise ValueError(f'unknown reduction {op!r}: use one of {", ".join(OPS)}')


def identity(op, dtype):
    """The value that leaves ``op``'s result as it is: what a worker that has joined
    (``hvd.join``) contributes. 0 for Sum and Average (Horovod's joined ranks give zeros;
    Average still divides by all workers), 1 for Product, the largest value for Min and
    the smallest for Max."""
    if op in (Sum, Average):
        return False if dtype == torch.bool else 0
    if op is Product:
        return True if dtype == torch.bool else 1
    if dtype == torch.bool:
        return op is Min
    if dtype.is_floating_point:
        return float('inf') if op is Min else float('-inf')
    return torch.iinfo(dtype).max if op is Min else torch.iinfo(dtype).min


def finish_(tensor, op, size):
    """The last touch after the reduction: Average divides the sum by ``size``."""
    if op is Average and size > 1 and tensor.dtype != torch.bool:
        if tensor.is_floating_point():
            tensor.div_(size)
        else:
            tensor.copy_(torch.div(tensor, size, rounding_mode='trunc'))
    return tensor
