"""d2ldist: multi-machine data-parallel training, taught by code that really runs.

The layers, bottom up (ARCHITECTURE.md draws them):
- ``van``: authenticated messages over ZeroMQ;
- ``scheduler`` and ``node``: registration, address book, barriers, liveness;
- ``server`` / ``kv``: the parameter server; ``collectives``: the ring all-reduce
  among workers, and the same API on torch.distributed;
- ``horovod``: a Horovod-style training API on top of the collectives;
- ``data``, ``models``, ``devices``, ``store``, ``trainer``: data split by worker,
  ResNet-18, devices and the seven steps of a training batch;
- ``report``: workers' progress lines; ``magic`` and ``dashboard``: ``%launch`` in notebooks;
- ``launch``: ``d2l-launch``, which starts and stops whole jobs.

``import d2ldist`` stays light (the scheduler imports it): torch loads only when a
collective, the parameter server or the training API is first used.
"""
import os
import sys

from .node import Node, PeerFailed
from .report import report

__version__ = '0.1.0'

BACKENDS = ('ring', 'torch')
_node = None
_backend_name = None

# Names that need torch, loaded on first use (PEP 562) so that `import d2ldist` stays light.
_LAZY = {
    'allreduce': 'collectives.api', 'allreduce_': 'collectives.api',
    'allreduce_async_': 'collectives.api', 'broadcast': 'collectives.api',
    'broadcast_': 'collectives.api', 'broadcast_async_': 'collectives.api',
    'allgather': 'collectives.api', 'Handle': 'collectives.api',
    'Sum': 'collectives.ops', 'Average': 'collectives.ops',
    'Min': 'collectives.ops', 'Max': 'collectives.ops',
    'broadcast_parameters': 'horovod', 'broadcast_optimizer_state': 'horovod',
    'DistributedOptimizer': 'horovod', 'metric_average': 'horovod',
    'SplitSampler': 'data', 'load_data': 'data', 'load_data_cifar10': 'data',
    'load_data_digits': 'data',
    'resnet18': 'models',
    'cpu': 'devices', 'try_gpu': 'devices', 'try_all_gpus': 'devices',
    'split_and_load': 'devices', 'parse_devices': 'devices',
    'AllreduceStore': 'store', 'create_store': 'trainer',
    'Trainer': 'trainer', 'train_batch': 'trainer', 'evaluate_accuracy': 'trainer',
}
_LAZY_MODULES = ('kv',)


def __getattr__(name):
    """Load the heavy parts (torch) on first use, then keep them as module attributes."""
    import importlib
    if name in _LAZY_MODULES:
        value = importlib.import_module(f'.{name}', __name__)
    elif name in _LAZY:
        value = getattr(importlib.import_module(f'.{_LAZY[name]}', __name__), name)
    else:
        raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
    globals()[name] = value
    return value


def init(backend=None):
    """Join the job; alone (rank 0 of 1) outside one.

    ``backend`` (or the environment variable D2L_BACKEND) is 'ring', d2ldist's own
    ring all-reduce (the default under d2l-launch), or 'torch', torch.distributed
    (the default under torchrun, where there is no d2ldist scheduler; under Slurm's
    srun set D2L_BACKEND=torch).
    """
    global _node, _backend_name
    name = _choose_backend(backend)
    if _backend_name is not None:
        if backend is not None and name != _backend_name:
            raise RuntimeError(f'd2ldist.init: already running with backend {_backend_name!r}')
        return _node
    if _node is None and 'D2L_SCHEDULER_URI' in os.environ:
        _node = Node.from_env(role='worker').start()   # also with 'torch': liveness
    if name == 'torch':
        from .collectives import api
        api.use(api.make_backend(name, _node))
    _backend_name = name   # the ring is made on first use (torch loads then)
    return _node


def _choose_backend(backend):
    launched = 'D2L_SCHEDULER_URI' in os.environ
    torchrun = not launched and int(os.environ.get('WORLD_SIZE', '1')) > 1
    name = backend or os.environ.get('D2L_BACKEND') or ('torch' if torchrun else 'ring')
    if name not in BACKENDS:
        raise ValueError(f'unknown backend {name!r}: use one of {", ".join(BACKENDS)}')
    if name == 'ring' and torchrun:
        raise RuntimeError("backend 'ring' needs a job started by d2l-launch; under "
                           "torchrun use backend 'torch'")
    return name


def rank():
    """This worker's rank, 0 .. size() - 1."""
    if _backend_name == 'torch':
        return _api()._backend.rank
    return _node.rank if _node else 0


def size():
    """The number of workers in the job."""
    if _backend_name == 'torch':
        return _api()._backend.size
    return _node.num_workers if _node else 1


def local_rank():
    """This worker's rank among the workers on its machine."""
    return int(os.environ.get('LOCAL_RANK', os.environ.get('SLURM_LOCALID', 0)))


def local_size():
    """The number of workers on this machine."""
    return int(os.environ.get('LOCAL_WORLD_SIZE', '1'))


def barrier():
    """Wait until every worker has reached this point."""
    api = _api()
    if api is not None and api.active():   # collectives run on their own thread
        api.barrier()
    elif _node:
        _node.barrier('worker')


def load_ipython_extension(ipython):
    """``%load_ext d2ldist``: register the ``%launch`` magic."""
    from .magic import LaunchMagics
    ipython.register_magics(LaunchMagics)


def _api():
    """The collectives' module if it has been loaded, else None (keeps torch out)."""
    return sys.modules.get(__name__ + '.collectives.api')
