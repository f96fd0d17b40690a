"""d2ldist: multi-machine data-parallel training, taught by code that really runs.

This file is the package's face: it gathers the names a user calls, and nothing
inside the package imports it. The layers, bottom up (ARCHITECTURE.md draws them):

- ``runtime/``: the van (authenticated messages over ZeroMQ), tensors on the wire,
  shared memory, the simulated link, the scheduler and a node's handle on the job;
- ``kv/``: the parameter server; ``collectives/``: the ring all-reduce and the other
  collectives among workers, on the ring or on torch.distributed, Horovod's
  DistributedOptimizer and ZeRO's ShardedOptimizer and shard_module;
- ``training/``: the seven steps of a batch (``Trainer``), the stores it talks to, the
  training loop, data split by worker, ResNet-18 and devices;
- ``launch/``: ``d2l-launch``, which starts, watches and stops whole jobs;
  ``notebook/``: ``%launch`` and its dashboard; ``report.py``: workers' progress lines;
  ``cost.py``: the book's one cost model of a step's communication (alpha-beta);
  ``book.py``: the chapters copied out of an installed package (``d2l-book DIR``).

``import d2ldist`` stays light (every process of a job imports it): torch loads only
when a collective, the parameter server or the training API is first used.
"""
from .collectives.world import (BACKENDS, barrier, cross_rank, cross_size,  # noqa: F401
                                init, is_initialized, local_rank, local_size, rank,
                                shutdown, size)
from . import cost  # noqa: F401  (pure arithmetic: light)
from .book import download_chapters  # noqa: F401
from .report import report  # noqa: F401
from .runtime.node import Node, PeerFailed  # noqa: F401

__version__ = '0.1.0'

# Names that need torch, loaded on first use (PEP 562) so that `import d2ldist` stays light.
_LAZY = {
    'allreduce': 'collectives.api', 'allreduce_': 'collectives.api',
    'allreduce_async_': 'collectives.api', 'broadcast': 'collectives.api',
    'broadcast_': 'collectives.api', 'broadcast_async_': 'collectives.api',
    'allgather': 'collectives.api', 'Handle': 'collectives.api',
    **{name: 'collectives.api' for name in (
        'allreduce_async', 'allgather_async', 'broadcast_async', 'poll', 'synchronize',
        'grouped_allreduce', 'grouped_allreduce_', 'grouped_allreduce_async',
        'grouped_allreduce_async_', 'broadcast_object', 'allgather_object',
        'grouped_allgather', 'grouped_allgather_async', 'sparse_allreduce_async',
        'reducescatter', 'reducescatter_async', 'grouped_reducescatter',
        'grouped_reducescatter_async', 'alltoall', 'Compression', 'join')},
    'HorovodInternalError': 'collectives.elastic',
    'SyncBatchNorm': 'collectives.sync_batchnorm',
    'Sum': 'collectives.ops', 'Average': 'collectives.ops',
    'Min': 'collectives.ops', 'Max': 'collectives.ops', 'Product': 'collectives.ops',
    'broadcast_parameters': 'collectives.distributed_optimizer',
    'broadcast_optimizer_state': 'collectives.distributed_optimizer',
    'DistributedOptimizer': 'collectives.distributed_optimizer',
    'metric_average': 'collectives.distributed_optimizer',
    'ShardedOptimizer': 'collectives.sharded', 'shard_module': 'collectives.sharded_module',
    'SplitSampler': 'training.data', 'load_data': 'training.data',
    'load_data_cifar10': 'training.data', 'load_data_digits': 'training.data',
    'resnet18': 'training.models',
    'cpu': 'training.devices', 'try_gpu': 'training.devices',
    'try_all_gpus': 'training.devices', 'split_and_load': 'training.devices',
    'parse_devices': 'training.devices',
    'AllreduceStore': 'training.stores', 'create_store': 'training.stores',
    'Trainer': 'training.trainer', 'train_batch': 'training.trainer',
    'evaluate_accuracy': 'training.loop', 'train': 'training.loop',
    'Checkpoint': 'training.checkpoint', 'CheckpointError': 'training.checkpoint',
    **{name: 'horovod' for name in (   # what Horovod was built with
        'nccl_built', 'gloo_built', 'mpi_built', 'mpi_enabled', 'ccl_built', 'cuda_built',
        'ddl_built')},
}
# The public names (also what pdoc documents, and what tests/unit/test_packaging.py checks
# for type hints); the modules (d2ldist.kv, d2ldist.horovod, ...) are documented apart.
__all__ = ['BACKENDS', 'barrier', 'cross_rank', 'cross_size', 'init', 'is_initialized',
           'local_rank', 'local_size', 'rank', 'shutdown', 'size', 'cost',
           'download_chapters', 'report', 'Node', 'PeerFailed', 'load_ipython_extension',
           *_LAZY]
_LAZY_MODULES = {'kv': 'kv', 'horovod': 'horovod', 'timeline': 'timeline',
                 'elastic': 'collectives.elastic',
                 'checkpoint': 'training.sharded_checkpoint'}
def __getattr__(name):
    """Load the heavy parts (torch) on first use, then keep them as module attributes."""
    import importlib
    if name in _LAZY_MODULES:
        value = importlib.import_module(f'.{_LAZY_MODULES[name]}', __name__)
    elif name in _LAZY:
        value = getattr(importlib.import_module(f'.{_LAZY[name]}', __name__), name)
    else:                       # (Horovod's names d2ldist does not have: says why)
        from .collectives.missing import missing
        raise missing(__name__, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_LAZY_MODULES))


def load_ipython_extension(ipython: object) -> None:
    """``%load_ext d2ldist``: register the ``%launch`` magic."""
    from .notebook.magic import LaunchMagics
    ipython.register_magics(LaunchMagics)
