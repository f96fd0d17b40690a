"""Horovod's API on d2ldist's collectives: ``import d2ldist.horovod as hvd``.

    hvd.init()
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=net.named_parameters())
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

The same names are on ``d2ldist`` itself (``import d2ldist as hvd``). This module only
gathers them: the collectives are in ``collectives/api.py``, the optimizer and the
broadcasts in ``collectives/distributed_optimizer.py``, rank and size in
``collectives/world.py``.
"""
from .collectives.api import (Compression, Handle, allgather, allgather_async,  # noqa: F401
                              allgather_object, allreduce, allreduce_, allreduce_async,
                              allreduce_async_, broadcast, broadcast_, broadcast_async,
                              broadcast_async_, broadcast_object, grouped_allgather,
                              grouped_allgather_async, grouped_allreduce,
                              grouped_allreduce_, grouped_allreduce_async,
                              grouped_allreduce_async_, join, poll, reducescatter,
                              alltoall, sparse_allreduce_async, synchronize)
from .collectives.distributed_optimizer import (DistributedOptimizer,  # noqa: F401
                                                broadcast_optimizer_state,
                                                broadcast_parameters, metric_average)
from .collectives import elastic  # noqa: F401  (hvd.elastic.run, TorchState)
from .collectives.missing import missing
from .collectives.ops import Average, Max, Min, Product, Sum  # noqa: F401
from .collectives.sync_batchnorm import SyncBatchNorm  # noqa: F401
from .collectives.world import (barrier, cross_rank, cross_size, gloo_built,  # noqa: F401
                                init, is_initialized, local_rank, local_size, mpi_built,
                                mpi_enabled, nccl_built, rank, shutdown, size,
                                ccl_built, cuda_built, ddl_built)


def __getattr__(name):
    """Horovod's names that d2ldist does not have: a one-line error that says so."""
    raise missing(__name__, name)
