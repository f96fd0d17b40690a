"""Horovod's API on d2ldist's collectives: ``import d2ldist.horovod as hvd``.

    hvd.init()
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=net.named_parameters())
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

The same names are on ``d2ldist`` itself (``import d2ldist as hvd``). This module
gathers them: the collectives are in ``collectives/api.py``, the optimizer and the
broadcasts in ``collectives/distributed_optimizer.py``, rank and size in
``collectives/world.py``. Only what Horovod says of its own build (``nccl_built``,
``mpi_built``, ...) is written here: it belongs to the face, not to the collectives.
"""
from .collectives.api import (Compression, Handle, allgather, allgather_async,  # noqa: F401
                              allgather_object, allreduce, allreduce_, allreduce_async,
                              allreduce_async_, broadcast, broadcast_, broadcast_async,
                              broadcast_async_, broadcast_object, grouped_allgather,
                              grouped_allgather_async, grouped_allreduce,
                              grouped_allreduce_, grouped_allreduce_async,
                              grouped_allreduce_async_, grouped_reducescatter,
                              grouped_reducescatter_async, join, poll, reducescatter,
                              reducescatter_async, alltoall, sparse_allreduce_async,
                              synchronize)
from .collectives.distributed_optimizer import (DistributedOptimizer,  # noqa: F401
                                                broadcast_optimizer_state,
                                                broadcast_parameters, metric_average)
from .collectives import elastic  # noqa: F401  (hvd.elastic.run, TorchState)
from .collectives.elastic import HorovodInternalError  # noqa: F401  (what elastic.run catches)
from .collectives.missing import missing
from .collectives.ops import Average, Max, Min, Product, Sum  # noqa: F401
from .collectives.sync_batchnorm import SyncBatchNorm  # noqa: F401
from .collectives.world import (barrier, cross_rank, cross_size, init,  # noqa: F401
                                is_initialized, local_rank, local_size, rank, shutdown,
                                size)

__all__ = [   # Horovod's names (pdoc's reference lists these; `missing` is none of them)
    'Compression', 'Handle', 'allgather', 'allgather_async', 'allgather_object', 'allreduce',
    'allreduce_', 'allreduce_async', 'allreduce_async_', 'broadcast', 'broadcast_',
    'broadcast_async', 'broadcast_async_', 'broadcast_object', 'grouped_allgather',
    'grouped_allgather_async', 'grouped_allreduce', 'grouped_allreduce_',
    'grouped_allreduce_async', 'grouped_allreduce_async_', 'grouped_reducescatter',
    'grouped_reducescatter_async', 'join', 'poll', 'reducescatter', 'reducescatter_async',
    'alltoall', 'sparse_allreduce_async', 'synchronize', 'DistributedOptimizer',
    'broadcast_optimizer_state', 'broadcast_parameters', 'metric_average', 'elastic',
    'HorovodInternalError', 'Average', 'Max', 'Min', 'Product', 'Sum', 'SyncBatchNorm',
    'barrier', 'cross_rank', 'cross_size', 'init', 'is_initialized', 'local_rank',
    'local_size', 'rank', 'shutdown', 'size', 'nccl_built', 'cuda_built', 'ccl_built',
    'ddl_built', 'gloo_built', 'mpi_built', 'mpi_enabled']


# -- what Horovod was built with: here, what torch and this machine have -----------------
# (torch is imported in each function, so that ``hvd.torch`` and ``hvd.dist`` are no names
# of this face: it has Horovod's names only)
def nccl_built() -> int:
    """NCCL's version code, as Horovod's (2.18.3: 21803), where torch.distributed has NCCL
    and a GPU is usable (backend 'torch' on GPUs); else 0."""
    import torch
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_nccl_available() and cuda_built()):
        return 0
    return _nccl_code(torch.cuda.nccl.version())


def _nccl_code(version):
    """NCCL's NCCL_VERSION_CODE for (major, minor, patch): before 2.9 1000/100/1, then
    10000/100/1 (2.8.4: 2804, 2.18.3: 21803)."""
    major, minor, patch = version[:3]
    return major * (1000 if major <= 2 and minor <= 8 else 10000) + minor * 100 + patch


def cuda_built() -> bool:
    """Whether torch has CUDA and a GPU is usable here (Horovod: built with CUDA)."""
    import torch
    return torch.version.cuda is not None and torch.cuda.is_available()


def ccl_built() -> bool:
    """d2ldist does not use oneCCL (False, as Horovod built without it)."""
    return False


def ddl_built() -> bool:
    """d2ldist does not use IBM's DDL (False, as Horovod built without it)."""
    return False


def gloo_built() -> bool:
    """Whether torch.distributed has gloo (Horovod: built with Gloo)."""
    import torch.distributed as dist
    return dist.is_available() and dist.is_gloo_available()


def mpi_built() -> bool:
    """d2ldist does not use MPI (False), as Horovod answers when built without it."""
    return False


mpi_enabled = mpi_built


def __getattr__(name):
    """Horovod's names that d2ldist does not have: a one-line error that says so."""
    raise missing(__name__, name)
