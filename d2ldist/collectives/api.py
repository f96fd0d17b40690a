"""Collectives among the workers, with Horovod's names.

    d2ldist.allreduce(X, op=d2ldist.Average)   # a new tensor
    d2ldist.allreduce_(X, op=d2ldist.Sum)      # in place
    d2ldist.broadcast_(X, root_rank=0); d2ldist.allgather(X); d2ldist.barrier()

Two backends run them: ``RingBackend`` (``ring_backend.py``: d2ldist's own ring over
the van, the one to read) and ``TorchBackend`` (torch.distributed: gloo on CPU, NCCL on GPUs, for
production). ``d2ldist.init(backend=...)`` picks one (``world.py``). Outside a job
both are alone: size 1, and every collective leaves its tensor as it is.

Every collective runs on the communication thread (``engine.py``), in the order it was
asked for, so that the ``_async_`` variants (which return a ``Handle``) overlap
communication with computation -- DistributedOptimizer all-reduces gradients while
backward goes on -- and all workers still run the collectives in the same order. Each
is a call of the backend's method (``backend.py``), bound: ``world.run(b.broadcast_, X,
root)``; an all-reduce goes through ``compressed.allreduce_`` (scaled, compressed or not).
"""
import base64
import itertools
import json

import torch

from ..runtime.compression import Cast, Identity
from ..lines import clip
from . import compressed, ops, world
from .engine import Handle  # noqa: F401  (re-exported: what the _async_ variants return)
from .ops import Average, Max, Min, Product, Sum  # noqa: F401  (re-exported)


# -- the API (Horovod's names and signatures) -----------------------------------------
# ``name`` is not needed: the workers run their collectives in the order they asked for
# them, and every chunk says which call it belongs to. As in Horovod, two operations in
# flight may not share a name: a second call with the name of one still in flight is
# refused, before anything is sent. In flight means: neither its handle nor that of an
# operation asked for after it has been waited for (the communication thread runs them
# in order, so the later one's end is its end too). That rule follows the program, not
# the clock, so every worker refuses the same calls and the workers stay in step.
_in_flight = {}   # name -> the number of the operation that holds it
_asked = itertools.count()   # the operations asked for here, numbered in order
_waited = -1      # the highest number waited for: every operation up to it has ended
# Horovod negotiates operations by name, so its barrier is not held by a named one that
# only this worker has asked for (the others may ask for it after the barrier). Here a
# named operation waits in ``_unstarted`` until the next collective asked here, or its
# own wait or poll, starts it: a barrier passes it by, and every worker still starts its
# collectives in the order it asked for them.
_unstarted = []


class Asked(Handle):
    """A collective asked for here; ``start()`` hands it to the communication thread.
    Calling it gives its result too (Horovod's ``sparse_allreduce_async`` returns a
    function to call)."""

    def __init__(self, fn, args, on_wait):
        super().__init__()
        self._call, self._on_wait, self._started = (fn, args), on_wait, None

    def start(self):
        fn, args = self._call
        self._started = world.run(fn, *args)
        self._started.on_wait = self._on_wait

    def done(self):
        _start_asked()
        return self._started.done()

    def wait(self):
        _start_asked()
        return self._started.wait()

    __call__ = wait


def _start_asked():
    """Start every operation asked for here and not started yet, in the order asked."""
    while _unstarted:
        _unstarted.pop(0).start()


def _run(name, fn, *args):
    """fn(*args), a collective asked for here (numbered): with ``name``, holding the name
    while in flight and waiting in ``_unstarted``; without, started at once."""
    number = next(_asked)
    if name is not None:
        _in_flight[name] = number
    handle = Asked(fn, args, lambda: _ended(number))
    _unstarted.append(handle)
    if name is None:
        _start_asked()
    return handle


def _check_name(name):
    """Refuse ``name`` while an operation that holds it is in flight."""
    if name is not None and _in_flight.get(name, -1) > _waited:
        raise ValueError(f'an operation named {name!r} is still in flight: synchronize '
                         'its handle before using the name again')


def _ended(number):
    """The operation ``number`` has been waited for: it and all before it have ended."""
    global _waited
    _waited = max(_waited, number)
    for name in [n for n, held in _in_flight.items() if held <= _waited]:
        del _in_flight[name]


def _reduction(average, op):
    """Horovod's two ways to name the reduction: ``op=``, or the older ``average=``."""
    if average is not None and op is not None:
        raise ValueError('allreduce: give op or average, not both')
    if average is not None:
        return ops.Average if average else ops.Sum
    return ops.get(ops.Average if op is None else op)


def _codec(compression):
    """``compression`` as ``compressed.allreduce_`` takes it: None for none."""
    return None if compression in (None, Compression.none) else compression


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None,
                     name: str | None = None, op: ops.ReduceOp | None = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     compression: Cast | Identity | None = None) -> Handle:
    """Start reducing ``tensor`` in place across workers; returns a Handle.

    (``compression``, not Horovod's here: what DistributedOptimizer's buckets go through.)"""
    op = _reduction(average, op)
    _check_name(name)
    return _run(name, compressed.allreduce_, world.backend(), tensor, op, _codec(compression),
                None, prescale_factor, postscale_factor)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: ops.ReduceOp | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` across all workers, in place (op: Sum, Average, Min, Max, Product)."""
    return allreduce_async_(tensor, average, name, op, prescale_factor,
                            postscale_factor).wait()


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: ops.ReduceOp | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0) -> Handle:
    """Start the reduction of ``tensor`` into a new tensor; ``synchronize(handle)`` gives it."""
    return allreduce_async_(tensor.detach().clone(), average, name, op, prescale_factor,
                            postscale_factor)


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Cast | Identity | None = None, op: ops.ReduceOp | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """The reduction of ``tensor`` across all workers, as a new tensor (differentiable);
    ``compression=Compression.fp16``: through 16 bits, back in the tensor's dtype."""
    op = _reduction(average, op)
    _check_name(name)
    if tensor.requires_grad and torch.is_grad_enabled():
        return _AllreduceGrad.apply(tensor, op, prescale_factor, postscale_factor, compression)
    return allreduce_async_(tensor.detach().clone(), name=name, op=op,
                            prescale_factor=prescale_factor,
                            postscale_factor=postscale_factor, compression=compression).wait()


def grouped_allreduce_async_(tensors: list[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: ops.ReduceOp | None = None,
                             prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0) -> Handle:
    """Start reducing a list of tensors in place, in one go; one Handle for all."""
    return _grouped_async_(tensors, _reduction(average, op), name, prescale_factor,
                           postscale_factor)


def _grouped_async_(tensors, op, name, prescale_factor, postscale_factor, compression=None):
    """grouped_allreduce_async_, each tensor through ``compression``."""
    _check_name(name)
    backend, codec = world.backend(), _codec(compression)

    def reduce_all():
        return [compressed.allreduce_(backend, t, op, codec, None, prescale_factor,
                                      postscale_factor) for t in tensors]
    return _run(name, reduce_all)


def grouped_allreduce_(tensors: list[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: ops.ReduceOp | None = None,
                       prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reduce every tensor of a list in place; returns the list."""
    return grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                    postscale_factor).wait()


def grouped_allreduce_async(tensors: list[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: ops.ReduceOp | None = None,
                            prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0) -> Handle:
    return grouped_allreduce_async_([t.detach().clone() for t in tensors], average, name,
                                    op, prescale_factor, postscale_factor)


def grouped_allreduce(tensors: list[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: Cast | Identity | None = None,
                      op: ops.ReduceOp | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """The reductions of a list of tensors, as new tensors (through ``compression``);
    differentiable, then one all-reduce per tensor."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        _check_name(name)
        return [allreduce(t, average, None, compression, op, prescale_factor,
                          postscale_factor) for t in tensors]
    return _grouped_async_([t.detach().clone() for t in tensors], _reduction(average, op),
                           name, prescale_factor, postscale_factor, compression).wait()


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None = None,
                           op: ops.ReduceOp = Average) -> Handle:
    """Start reducing a sparse tensor (an ``nn.Embedding(sparse=True)`` gradient): every
    worker's rows are gathered and added up (Average: divided by the workers). As
    Horovod's, returns a function to call for the sparse result (``synchronize`` takes it
    too). Only the rows travel."""
    op = ops.get(op)
    if op not in (ops.Sum, ops.Average) or not _tensor(tensor).is_sparse:
        raise ValueError('sparse_allreduce_async: a sparse tensor, op Sum or Average')
    _check_name(name)
    mine, gather, workers = tensor.detach().coalesce(), world.backend().allgather, \
        world.backend().size

    def sparse_allreduce():
        indices = gather(mine.indices().t().contiguous()).t()
        values = gather(mine.values())
        if op is ops.Average:
            values = values / workers
        # indices from other workers, checked: one out of range is an error, not a crash
        return torch.sparse_coo_tensor(indices, values, mine.shape,
                                       check_invariants=True).coalesce()
    return _run(name, sparse_allreduce)


def broadcast_async_(tensor: torch.Tensor, root_rank: int = 0,
                     name: str | None = None) -> Handle:
    """Start copying worker ``root_rank``'s tensor into ``tensor``; returns a Handle."""
    root = _check_root(root_rank)
    _check_name(name)
    return _run(name, world.backend().broadcast_, _tensor(tensor), root)


def broadcast_(tensor: torch.Tensor, root_rank: int = 0,
               name: str | None = None) -> torch.Tensor:
    """Overwrite ``tensor`` with worker ``root_rank``'s, in place."""
    return broadcast_async_(tensor, root_rank, name).wait()


def broadcast_async(tensor: torch.Tensor, root_rank: int = 0,
                    name: str | None = None) -> Handle:
    return broadcast_async_(_tensor(tensor).detach().clone(), root_rank, name)


def broadcast(tensor: torch.Tensor, root_rank: int = 0,
              name: str | None = None) -> torch.Tensor:
    """Worker ``root_rank``'s ``tensor``, as a new tensor on every worker (differentiable)."""
    if _tensor(tensor).requires_grad and torch.is_grad_enabled():
        _check_name(name)
        return _BroadcastGrad.apply(tensor, _check_root(root_rank))
    return broadcast_(tensor.detach().clone(), root_rank, name)


def _tensor(x):
    """``x``, if it is a tensor; else a TypeError in one line (e.g. a ``.grad`` still None)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f'the collectives take a tensor, got {type(x).__name__}')
    return x


def allgather_async(tensor: torch.Tensor, name: str | None = None) -> Handle:
    """Start an allgather; ``synchronize(handle)`` gives its result."""
    _check_rows(tensor, 'allgather')
    _check_name(name)
    return _run(name, world.backend().allgather, tensor.detach())


def grouped_allgather_async(tensors: list[torch.Tensor], name: str | None = None) -> Handle:
    """Start allgathers of a list of tensors, in one go; one Handle for all the results."""
    for t in tensors:
        if _tensor(t).dim() == 0:
            raise ValueError('allgather needs tensors with at least one dimension')
    _check_name(name)
    gather = world.backend().allgather

    def grouped_allgather():
        return [gather(t) for t in tensors]
    return _run(name, grouped_allgather)


def grouped_allgather(tensors: list[torch.Tensor],
                      name: str | None = None) -> list[torch.Tensor]:
    """Every worker's tensors, each concatenated along dim 0 in rank order (differentiable)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        _check_name(name)
        return [allgather(t) for t in tensors]
    return grouped_allgather_async([t.detach() for t in tensors], name).wait()


def allgather(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Every worker's ``tensor`` concatenated along dim 0 in rank order (dim 0 may differ)."""
    if _tensor(tensor).requires_grad and torch.is_grad_enabled():
        _check_name(name)
        return _AllgatherGrad.apply(tensor)
    return allgather_async(tensor, name).wait()


def broadcast_object(obj: object, root_rank: int = 0, name: str | None = None) -> object:
    """Worker ``root_rank``'s ``obj`` on every worker, never pickled (``encode_object``):
    None, bools, ints, floats, str, bytes, lists, tuples, sets and dicts of them, any keys.
    An object that cannot be sent is a TypeError on every worker, not only the root."""
    root = _check_root(root_rank)
    data, failed = _encoded(obj) if world.backend().rank == root else (b'', False)
    length = int(broadcast_(torch.tensor([-len(data) if failed else len(data)]), root))
    buffer = torch.zeros(abs(length), dtype=torch.uint8)   # (negative: the error's text)
    if data:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    data = bytes(broadcast_(buffer, root).numpy())
    if length < 0:
        raise TypeError(data.decode(errors='replace'))
    return decode_object(data)


def allgather_object(obj: object, name: str | None = None) -> list[object]:
    """Every worker's ``obj`` in rank order, as a list (encoded as by ``broadcast_object``);
    one that cannot be sent is a TypeError on every worker."""
    data, failed = _encoded(obj)
    lengths = allgather(torch.tensor([-len(data) if failed else len(data)])).tolist()
    everything = allgather(torch.frombuffer(bytearray(data), dtype=torch.uint8)
                           if data else torch.zeros(0, dtype=torch.uint8)).numpy()
    ends = [sum(abs(n) for n in lengths[:i + 1]) for i in range(len(lengths))]
    parts = [bytes(everything[end - abs(n):end]) for n, end in zip(lengths, ends)]
    for i, n in enumerate(lengths):
        if n < 0:
            raise TypeError(f'worker {i}: {parts[i].decode(errors="replace")}')
    return [decode_object(part) for part in parts]


def _encoded(obj):
    """(``obj`` encoded, False), or (why it cannot be, as bytes, True): the others wait
    for this worker's bytes, so they are told too."""
    try:
        return encode_object(obj), False
    except TypeError as e:
        return str(e).encode(), True


# -- objects on the wire: JSON with tags, never pickle --------------------------------
# None, bools, ints, floats and str are JSON's own; each container is an object with one
# tag: {"list": [...]}, {"tuple": [...]}, {"set": [...]}, {"frozenset": [...]},
# {"bytes": "base64"}, {"dict": [[key, value], ...]} (so keys keep their type: 0 comes back
# as 0, not '0'). Decoding builds only these types.
SEQUENCES = {kind.__name__: kind for kind in (list, tuple, set, frozenset)}


def _tag(obj):
    """``obj`` as JSON-ready values with tags."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    for kind in SEQUENCES.values():
        if isinstance(obj, kind):
            return {kind.__name__: [_tag(x) for x in obj]}
    if isinstance(obj, bytes):
        return {'bytes': base64.b64encode(obj).decode()}
    if isinstance(obj, dict):
        return {'dict': [[_tag(k), _tag(v)] for k, v in obj.items()]}
    raise TypeError(f'd2ldist sends objects without pickle: None, bool, int, float, str, '
                    f'bytes, list, tuple, set, frozenset and dict only, not '
                    f'{type(obj).__name__}')


def _untag(value):
    """The object ``_tag`` made ``value`` from; ValueError for anything else."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict) and len(value) == 1:
        (tag, inner), = value.items()
        if tag in SEQUENCES and isinstance(inner, list):
            return SEQUENCES[tag](_untag(x) for x in inner)
        if tag == 'bytes' and isinstance(inner, str):
            return base64.b64decode(inner, validate=True)
        if tag == 'dict' and isinstance(inner, list) and all(
                isinstance(p, list) and len(p) == 2 for p in inner):
            return {_untag(k): _untag(v) for k, v in inner}
    raise ValueError(f'not an encoded object: {clip(value, 100)}')


def encode_object(obj):
    """``obj`` as bytes (tagged JSON), for ``decode_object`` on another worker."""
    return json.dumps(_tag(obj), allow_nan=True).encode()


def decode_object(data):
    """The object ``encode_object`` made ``data`` from (nothing is evaluated)."""
    try:
        return _untag(json.loads(data))
    except TypeError as e:               # (a list as a dict key: unhashable)
        raise ValueError(f'not an encoded object: {e}') from None


def reducescatter_async(tensor: torch.Tensor, op: ops.ReduceOp | None = None,
                        name: str | None = None, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0,
                        compression: Cast | Identity | None = None) -> Handle:
    """Start a reducescatter (see ``reducescatter``); ``synchronize(handle)`` gives its rows."""
    _check_rows(tensor, 'reducescatter')
    op = _reduction(None, op)
    _check_name(name)
    return _run(name, _reducescatter, world.backend(), tensor.detach(), op,
                _codec(compression), prescale_factor, postscale_factor)


def reducescatter(tensor: torch.Tensor, op: ops.ReduceOp | None = None,
                  name: str | None = None, compression: Cast | Identity | None = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` over the workers and give each its rows: dim 0 cut as evenly as
    can be (the first ones get one more), rank r the r-th part (op: Average by default;
    integers scaled in float64). Differentiable, as Horovod's (``_ReducescatterGrad``)."""
    op = _reduction(None, op)
    _check_name(name)
    if _tensor(tensor).requires_grad and torch.is_grad_enabled():
        return _ReducescatterGrad.apply(tensor, op, prescale_factor, postscale_factor,
                                        compression)
    return reducescatter_async(tensor, op, name, prescale_factor, postscale_factor,
                               compression).wait()


def grouped_reducescatter_async(tensors: list[torch.Tensor], op: ops.ReduceOp | None = None,
                                name: str | None = None, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0,
                                compression: Cast | Identity | None = None) -> Handle:
    """Start reducescatters of a list of tensors, in one go; one Handle for all the rows."""
    for t in tensors:
        _check_rows(t, 'reducescatter')
    op, backend, codec = _reduction(None, op), world.backend(), _codec(compression)
    _check_name(name)
    tensors = [t.detach() for t in tensors]

    def grouped_reducescatter():
        return [_reducescatter(backend, t, op, codec, prescale_factor, postscale_factor)
                for t in tensors]
    return _run(name, grouped_reducescatter)


def grouped_reducescatter(tensors: list[torch.Tensor], op: ops.ReduceOp | None = None,
                          name: str | None = None, compression: Cast | Identity | None = None,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """This worker's rows of each tensor's reduction (differentiable: then one
    reducescatter per tensor)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        _check_name(name)
        return [reducescatter(t, op, None, compression, prescale_factor, postscale_factor)
                for t in tensors]
    return grouped_reducescatter_async(tensors, op, name, prescale_factor, postscale_factor,
                                       compression).wait()


def _check_rows(tensor, what):
    if _tensor(tensor).dim() == 0:
        raise ValueError(f'{what} needs a tensor with at least one dimension')


def _reducescatter(backend, tensor, op, codec, prescale_factor, postscale_factor):
    """This worker's rows of ``tensor``'s reduction by ``backend`` (``tensor`` is left as
    it is), scaled before and after, through ``codec`` (None: as it is)."""
    wire, ctx = codec.compress(tensor) if codec is not None else (tensor, None)
    if prescale_factor != 1.0:
        wire = compressed.scale_(wire.clone(), prescale_factor)
    rows = compressed.scale_(backend.reducescatter(wire, op), postscale_factor)
    return codec.decompress(rows, ctx) if codec is not None else rows


def alltoall(tensor: torch.Tensor, splits: torch.Tensor | list[int] | None = None,
             name: str | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Send rows ``splits[i]`` of ``tensor`` (in order) to worker i; the rows every worker
    sent here, in rank order. As Horovod's: with ``splits``, also how many came from each
    (``(rows, received_splits)``); without, dim 0 is cut in equal parts, one per worker.
    Differentiable: the gradient goes back the way its rows came.

    (On the ring, through allgather: every worker receives all rows, N times the bytes of
    a direct exchange, as the ring passes data to neighbours only; fine for the small
    tensors it is used with in teaching, e.g. routing tokens to experts. On the torch
    backend, one all_to_all_single: each row crosses the network once.)"""
    counts = _alltoall_splits(tensor, splits)
    if tensor.requires_grad and torch.is_grad_enabled():
        received, got = _AlltoallGrad.apply(tensor, counts)
    else:
        received, got = _alltoall(tensor.detach(), counts)
    if splits is None:
        return received
    return received, got.to(splits.dtype if torch.is_tensor(splits) else torch.int32)


def _alltoall_splits(tensor, splits):
    """How many rows go to each worker, as int64, checked as Horovod checks them."""
    N = world.backend().size
    if tensor.dim() == 0:
        raise ValueError('alltoall needs a tensor with at least one dimension')
    rows = tensor.shape[0]
    if splits is None:
        if rows % N:
            raise ValueError(f'alltoall without splits cuts dim 0 in {N} equal parts: '
                             f'{rows} rows cannot be')
        return torch.full((N,), rows // N, dtype=torch.int64)
    splits = torch.as_tensor(splits)
    if splits.is_floating_point() or splits.is_complex() or splits.dtype == torch.bool:
        raise ValueError(f'alltoall: splits must be integers, not {splits.dtype}')
    splits = splits.reshape(-1).to(torch.int64)
    if splits.numel() != N or int(splits.sum()) != rows or (splits < 0).any():
        raise ValueError(f'alltoall: splits must be {N} counts adding up to {rows}')
    return splits


def _alltoall(tensor, splits):
    """(the rows sent here, in rank order; how many came from each worker)."""
    N, r = world.backend().size, world.backend().rank
    counts = allgather(splits.view(1, N))                   # counts[i, j]: i sends to j
    if counts.shape[0] != N:                                # (a worker in join(): no rows)
        raise RuntimeError('alltoall: a worker has called join(); all must take part')
    counts = counts.view(N, N)
    received = _run(None, world.backend().alltoall, tensor, counts.tolist()).wait()
    return received, counts[:, r].clone()


class Compression:
    """Horovod's gradient compression: ``Compression.none``, ``Compression.fp16`` (the
    codecs of ``runtime/compression.py``, with Horovod's compress and decompress)."""
    none = Identity()
    fp16 = Cast('fp16')


def poll(handle: Handle) -> bool:
    """Whether the asynchronous collective of ``handle`` has finished."""
    return handle.done()


def synchronize(handle: Handle) -> object:
    """Wait for the asynchronous collective of ``handle``; returns its result."""
    return handle.wait()


def join(device: int = -1) -> int:
    """This worker is out of data (Horovod's join): until every worker has called join(),
    it takes part in the collectives the others still call, with nothing of its own
    (RingBackend.join says how; TorchBackend.join does the same). Returns, on every
    worker, the rank of the last worker to call it. ``device`` is accepted, not needed."""
    return _run(None, world.backend().join).wait()


def _check_root(root_rank):
    size = world.backend().size
    if not isinstance(root_rank, int) or not 0 <= root_rank < size:
        raise ValueError(f'root_rank must be a rank 0 .. {size - 1}, got {root_rank!r}')
    return root_rank


# -- gradients through the collectives (as Horovod's: the backward of a collective is
# -- a collective of the gradients) ---------------------------------------------------
class _AllreduceGrad(torch.autograd.Function):
    """y = reduce(x) over the workers; dL/dx = the same reduction of dL/dy."""

    @staticmethod
    def forward(ctx, tensor, op, prescale_factor, postscale_factor, compression):
        if op not in (ops.Sum, ops.Average):
            raise RuntimeError(f'allreduce: no gradient through {op.name}; use Sum or Average')
        ctx.op, ctx.scale, ctx.compression = op, prescale_factor * postscale_factor, compression
        return allreduce_async_(tensor.detach().clone(), op=op, prescale_factor=prescale_factor,
                                postscale_factor=postscale_factor,
                                compression=compression).wait()

    @staticmethod
    def backward(ctx, grad):
        summed = allreduce_async_(grad.clone(), op=ctx.op, postscale_factor=ctx.scale,
                                  compression=ctx.compression).wait()
        return summed, None, None, None, None


class _BroadcastGrad(torch.autograd.Function):
    """y = x of the root; dL/dx = the average of dL/dy on the root, zero elsewhere."""

    @staticmethod
    def forward(ctx, tensor, root_rank):
        ctx.root = root_rank
        return broadcast_(tensor.detach().clone(), root_rank)

    @staticmethod
    def backward(ctx, grad):
        grad = allreduce_(grad.clone(), op=ops.Average)
        return (grad if world.backend().rank == ctx.root else grad.zero_()), None


class _AllgatherGrad(torch.autograd.Function):
    """y = [x_0; x_1; ...]; dL/dx_r = rows r of the average of dL/dy over the workers."""

    @staticmethod
    def forward(ctx, tensor):
        ctx.rows = tensor.shape[0]
        return allgather_async(tensor).wait()

    @staticmethod
    def backward(ctx, grad):
        grad = allreduce_(grad.contiguous().clone(), op=ops.Average)
        rows = allgather_async(torch.tensor([ctx.rows])).wait().tolist()
        start = sum(rows[:world.backend().rank])
        return grad[start:start + ctx.rows]


class _ReducescatterGrad(torch.autograd.Function):
    """y = this worker's rows of reduce(x); dL/dx = every worker's dL/dy gathered in rank
    order, times the scale factors, and times the workers for Sum (as Horovod's: the
    gradient of Sum is Average's times the workers, as in allreduce)."""

    @staticmethod
    def forward(ctx, tensor, op, prescale_factor, postscale_factor, compression):
        if op not in (ops.Sum, ops.Average):
            raise RuntimeError(f'reducescatter: no gradient through {op.name}; use Sum or '
                               'Average')
        workers = world.backend().size if op is ops.Sum else 1
        ctx.scale = prescale_factor * postscale_factor * workers
        return reducescatter_async(tensor, op, None, prescale_factor, postscale_factor,
                                   compression).wait()

    @staticmethod
    def backward(ctx, grad):
        return allgather_async(grad.contiguous() * ctx.scale).wait(), None, None, None, None


class _AlltoallGrad(torch.autograd.Function):
    """y = the rows each worker sent here; dL/dx = dL/dy sent back where its rows came from."""

    @staticmethod
    def forward(ctx, tensor, splits):
        received, counts = _alltoall(tensor.detach(), splits)
        ctx.counts = counts
        ctx.mark_non_differentiable(counts)
        return received, counts

    @staticmethod
    def backward(ctx, grad, _):
        return _alltoall(grad.contiguous(), ctx.counts)[0], None
