"""What a backend is: the collective operations that every backend carries out.

    RingBackend   (ring_backend.py)    d2ldist's own ring over the van: the one to read
    TorchBackend  (torch_backend.py)   torch.distributed: gloo on CPUs, NCCL on GPUs

``world.backend()`` is the one this worker uses. ``api.py`` (Horovod's names) and the
Trainer's ``AllreduceStore`` (``training/stores.py``) call these methods, bound, on the
communication thread (``engine.py``): a gradient goes from ``store.allreduce_async_``
to ``backend.allreduce_`` to ``Ring.allreduce_``, a call a reader (or a tool) can follow.
"""
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:                    # (names for the reader; torch loads with a collective)
    from torch import Tensor

    from .ops import ReduceOp


class Backend(Protocol):
    """The collectives over all workers; every call blocks until this worker's part is done."""

    name: str      # 'ring' or 'torch'
    rank: int      # this worker, 0 .. size - 1
    size: int      # the number of workers

    def allreduce_(self, tensor: 'Tensor', op: 'ReduceOp') -> 'Tensor':
        """Reduce ``tensor`` over all workers, in place."""

    def broadcast_(self, tensor: 'Tensor', root: int) -> 'Tensor':
        """Overwrite ``tensor`` with worker ``root``'s, in place."""

    def allgather(self, tensor: 'Tensor') -> 'Tensor':
        """Every worker's ``tensor`` concatenated along dim 0, in rank order."""

    def alltoall(self, tensor: 'Tensor', counts: 'list[list[int]]') -> 'Tensor':
        """The rows every worker sent here, in rank order: worker i sends its next
        ``counts[i][j]`` rows to worker j (every worker passes the same ``counts``)."""

    def reducescatter(self, tensor: 'Tensor', op: 'ReduceOp') -> 'Tensor':
        """This worker's rows (``even_slices`` of dim 0) of the reduction."""

    def reduce_scatter_flat(self, flat: 'Tensor', op: 'ReduceOp') -> 'Tensor':
        """This worker's equal shard of the 1-D ``flat`` (numel a multiple of size), reduced."""

    def all_gather_flat_(self, flat: 'Tensor', shard: 'Tensor') -> 'Tensor':
        """Fill the 1-D ``flat`` with every worker's equal ``shard``, in rank order."""

    def barrier(self) -> None:
        """Wait until every worker has called it."""

    def join(self) -> int:
        """Horovod's join(): take part with nothing until all have joined; the last rank."""


def make(name, node) -> Backend:
    """The backend called ``name``: 'ring' (over ``node``, or alone) or 'torch'."""
    if name == 'torch':
        from .torch_backend import TorchBackend
        return TorchBackend(joinable=True)   # (hvd.join(): each call says what it is)
    from .ring_backend import RingBackend
    return RingBackend(node)
