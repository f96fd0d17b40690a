"""The collectives on d2ldist's own ring: the backend ``api.py`` runs them on by default.

``RingBackend`` turns each call (a tensor of any shape and dtype, an op) into what
``Ring`` (ring.py) moves: one flat CPU tensor, cut into segments. Every call is
described twice for the other workers: as a string to compare (``_call``: two workers
that call different collectives fail at once) and as JSON for a worker in ``join()``,
which has no call of its own and takes part with a stand-in (``_describe``,
``stand_in``; the torch backend's join() takes part with the same stand-ins).
"""
import math
import zlib

import torch

from ..lines import NAME, clip
from ..runtime.split import even_slices
from ..runtime.staging import staged
from ..runtime.wire import DTYPES, dtype_name
from . import ops
from .join import Join, Refused
from .link import Link
from .ring import Ring


def _call(name, tensor, detail):
    """What a collective was asked, for the ring to compare: 'allreduce(Sum, float32, [2, 3])'."""
    return f'{name}({detail}, {str(tensor.dtype).replace("torch.", "")}, {list(tensor.shape)})'


def row_shape_code(tensor):
    """A number for the shape of ``tensor``'s rows and its number of dimensions: what the
    workers compare where they may have different numbers of rows (allgather), so that
    [4, 6] and [4, 2, 3] are refused as Horovod refuses them."""
    return zlib.crc32(repr((tensor.dim(), *tensor.shape[1:])).encode())


# -- hvd.join(): what a worker out of data needs to take part in a collective ----------
_STAND_INS = ('allreduce_', 'reducescatter', 'broadcast_', 'allgather',   # its methods
              'reduce_scatter_flat', 'all_gather_flat_', 'alltoall', 'pass_right')


def _describe(method, tensor, **args):
    """The backend ``method`` called on ``tensor`` with ``args``, as JSON for stand_in."""
    return {'method': method, 'dtype': dtype_name(tensor.dtype), 'shape': list(tensor.shape),
            **args}


def stand_in(replay, size):
    """(method, tensor, args) for a worker in join() to take part in the collective
    ``replay`` describes: the op's identity to reduce, zeros to pass a broadcast on, no
    rows to gather; ValueError if it describes none."""
    what = replay if isinstance(replay, dict) else {}
    method, shape = what.get('method'), what.get('shape')
    dtype = DTYPES.get(str(what.get('dtype')))
    if method not in _STAND_INS or dtype is None or not isinstance(shape, list) \
            or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise ValueError(f'no collective described: {clip(replay, NAME)}')
    if method in ('allgather', 'alltoall'):
        return method, torch.zeros((0, *shape[1:]), dtype=dtype), ()
    if method == 'pass_right':
        return method, torch.zeros(shape, dtype=dtype), ()
    if method == 'all_gather_flat_':
        return method, torch.zeros(shape, dtype=dtype), (torch.zeros(0, dtype=dtype),)
    if method == 'broadcast_':
        root = what.get('root')
        if not isinstance(root, int) or not 0 <= root < size:
            raise ValueError(f'no broadcast root {root!r} among {size} workers')
        return method, torch.zeros(shape, dtype=dtype), (root,)
    op = ops.get(what.get('op'))
    return method, torch.full(shape, ops.identity(op, dtype), dtype=dtype), (op,)


# what a worker in join() makes fail (Horovod's); the flat halves too: a worker out of
# data has no shard of its own (ZeRO, sharded.py)
REFUSED = ('broadcast_', 'allgather', 'reduce_scatter_flat', 'all_gather_flat_', 'alltoall',
           'pass_right')


def equal_shard(flat, rank, size):
    """(start, end) of worker ``rank``'s equal shard of the 1-D ``flat``; ValueError if
    it cannot be cut in ``size`` equal shards."""
    if flat.dim() != 1 or flat.numel() % size:
        raise ValueError(f'the flat collectives need a 1-D tensor whose length is a multiple '
                         f'of the {size} workers, not {list(flat.shape)}')
    n = flat.numel() // size
    return rank * n, (rank + 1) * n


def equal_segments(flat, size):
    """The ``size`` equal shards of ``flat`` as the ring's segments."""
    return [equal_shard(flat, r, size) for r in range(size)]


# -- d2ldist's own backend -------------------------------------------------------------
class RingBackend:
    """The collectives on d2ldist's ring (alone when there is no job)."""

    name = 'ring'

    def __init__(self, node):
        self.dtypes = list(DTYPES.values())    # the wire's; allgather sends a dtype's index
        self.node = node
        workers = node.workers() if node is not None else []
        self.ring = self.joining = None        # the ring, and hvd.join() on its link
        if len(workers) > 1:
            link = Link(node)
            self.ring, self.joining = Ring(link), Join(link)
        self.rank, self.size = (workers.index(node.id), len(workers)) if node else (0, 1)

    def allreduce_(self, tensor, op):
        self._check(tensor)
        if self.ring is not None:
            with staged(tensor, 'cpu') as flat:
                self.ring.allreduce_(flat, op, _call('allreduce', tensor, op.name),
                                     _describe('allreduce_', tensor, op=op.name))
                ops.finish_(flat, op, self.size)
        return tensor

    def alltoall(self, tensor, counts):
        """Through allgather: the ring passes data to neighbours only, so every worker
        receives every row and keeps those sent to it (N times the bytes of a direct
        exchange; fine for the small tensors of teaching, such as tokens routed to experts)."""
        everything, r = self.allgather(tensor), self.rank
        start, parts = 0, []
        for row in counts:                 # worker i's rows, cut as counts[i] says
            first = start + sum(row[:r])
            parts.append(everything[first:first + row[r]])
            start += sum(row)
        return torch.cat(parts)

    def broadcast_(self, tensor, root):
        self._check(tensor)
        if self.ring is not None:
            with staged(tensor, 'cpu') as flat:
                self.ring.broadcast_(flat, root, _call('broadcast', tensor, f'root {root}'),
                                     _describe('broadcast_', tensor, root=root))
        return tensor

    def allgather(self, tensor):
        self._check(tensor)
        if self.ring is None:
            return tensor.clone()
        rows, row = tensor.shape[0], math.prod(tensor.shape[1:])
        # first every worker learns every worker's number of rows (and checks the rest)
        N, r = self.size, self.rank
        info = torch.zeros(4 * N, dtype=torch.int64)
        info[4 * r:4 * r + 4] = torch.tensor([rows, row, self.dtypes.index(tensor.dtype),
                                              row_shape_code(tensor)])
        self.ring.allgather_(info, [(4 * i, 4 * i + 4) for i in range(N)], 'allgather',
                             _describe('allgather', tensor))
        info = info.view(N, 4)
        if (info[:, 1:] != info[r, 1:]).any():
            other = int((info[:, 1:] != info[r, 1:]).any(1).nonzero()[0])
            raise RuntimeError(
                f'allgather: worker {r} has rows of {tuple(tensor.shape[1:])} '
                f'{tensor.dtype}, worker {other} rows of {int(info[other, 1])} '
                f'{self.dtypes[int(info[other, 2])]} values (maybe in another shape); '
                'all workers need the same row shape and dtype')
        ends = (info[:, 0] * row).cumsum(0).tolist()
        segs = [(0 if i == 0 else ends[i - 1], ends[i]) for i in range(N)]
        out = torch.empty((int(info[:, 0].sum()), *tensor.shape[1:]), dtype=tensor.dtype)
        flat = out.view(-1)
        flat[segs[r][0]:segs[r][1]] = tensor.reshape(-1).cpu()
        self.ring.allgather_(flat, segs, 'allgather rows')
        return out.to(tensor.device)

    def reducescatter(self, tensor, op):
        """This worker's rows (``even_slices`` of dim 0) of the reduction over all workers."""
        self._check(tensor)
        rows = even_slices(tensor.shape[0], self.size)[self.rank]
        if self.ring is None:
            return tensor.clone()
        row = math.prod(tensor.shape[1:])
        seg = [(a * row, b * row) for a, b in even_slices(tensor.shape[0], self.size)]
        flat = tensor.detach().reshape(-1).to('cpu', copy=True)
        self.ring.reducescatter_(flat, seg, op, _call('reducescatter', tensor, op.name),
                                 _describe('reducescatter', tensor, op=op.name))
        out = flat[seg[self.rank][0]:seg[self.rank][1]].view(rows[1] - rows[0],
                                                              *tensor.shape[1:])
        return ops.finish_(out, op, self.size).to(tensor.device)

    def reduce_scatter_flat(self, flat, op):
        """This worker's equal shard of the 1-D ``flat`` (numel a multiple of size) reduced
        over all workers: the ring's first half alone, (N-1)/N of ``flat`` sent."""
        self._check(flat)
        a, b = equal_shard(flat, self.rank, self.size)
        if self.ring is not None:
            with staged(flat, 'cpu') as X:
                self.ring.reducescatter_(X, equal_segments(flat, self.size), op,
                                         _call('reduce_scatter_flat', flat, op.name),
                                         _describe('reduce_scatter_flat', flat, op=op.name))
                ops.finish_(X[a:b], op, self.size)
        return flat[a:b]

    def all_gather_flat_(self, flat, shard):
        """Fill the 1-D ``flat`` with every worker's ``shard``, in rank order: the ring's
        second half alone, (N-1)/N of ``flat`` sent."""
        self._check(flat)
        a, b = equal_shard(flat, self.rank, self.size)
        flat[a:b] = shard
        if self.ring is not None:
            with staged(flat, 'cpu') as X:
                self.ring.allgather_(X, equal_segments(flat, self.size),
                                     _call('all_gather_flat', flat, 'equal shards'),
                                     _describe('all_gather_flat_', flat))
        return flat

    def pass_right(self, tensor):
        """The left neighbour's ``tensor`` (1-D, of this one's length and dtype): each
        worker sends its own to the right, one step of the ring (ZeRO's shard replicas,
        shard_replica.py); alone, a copy of its own. Not a Horovod collective."""
        self._check(tensor)
        if self.ring is None:
            return tensor.clone()
        x = tensor.detach().reshape(-1).cpu().contiguous()
        return self.ring.pass_right_(x, torch.empty_like(x),
                                     _call('pass_right', tensor, 'to the right'),
                                     _describe('pass_right', tensor)).to(tensor.device)

    def barrier(self):
        if self.node is not None:
            self.node.barrier('worker')

    def join(self):
        """hvd.join() on the ring: until every worker has joined, this one gives the
        op's identity to the others' all-reduces and reduce-scatters (zeros for Sum and
        Average, as Horovod's joined ranks; Average still divides by all workers, as
        Horovod's); their broadcasts and allgathers fail on every worker, as Horovod's
        (this one has no data: ``REFUSED``), and it waits on; a barrier counts it as
        there. Alone: 0."""
        return 0 if self.ring is None else self.joining.join(self._take_part)

    def _take_part(self, replay):
        """Take part, with nothing of our own, in the collective ``replay`` describes."""
        method, tensor, args = stand_in(replay, self.size)
        if method in REFUSED:
            raise Refused(f'no {method.strip("_")} while a worker is in join(), as Horovod')
        collective = {'allreduce_': self.allreduce_, 'reducescatter': self.reducescatter,
                      'broadcast_': self.broadcast_, 'allgather': self.allgather}[method]
        collective(tensor, *args)

    def _check(self, tensor):
        """Refuse a dtype the wire cannot carry. The others may have a dtype it can and be
        waiting in this call: it counts on the ring as a failed call, and they hear why."""
        if tensor.dtype not in self.dtypes:
            error = (f'd2ldist collectives do not support {tensor.dtype}; use one '
                     f'of {", ".join(sorted(DTYPES))}')
            if self.ring is not None:
                self.joining.refuse(f'{self.node.id} refused the call: {error}')
            raise TypeError(error)
