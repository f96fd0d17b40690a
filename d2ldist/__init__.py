"""d2ldist: multi-machine data-parallel training, taught by code that really runs.

The layers, bottom up (ARCHITECTURE.md draws them):
- ``van``: authenticated messages over ZeroMQ;
- ``scheduler`` and ``node``: registration, address book, barriers, liveness;
- ``server`` / ``kv``: the parameter server; ``ring``: all-reduce among workers;
- ``launch``: ``d2l-launch``, which starts and stops whole jobs;
- ``data``, ``models``, ``devices``, ``store``, ``trainer``: data split by worker,
  ResNet-18, devices and the seven steps of a training batch;
- ``report``: workers' progress lines; ``magic`` and ``dashboard``: ``%launch`` in notebooks.
"""
import os

from .node import Node, PeerFailed
from .report import report

__version__ = '0.1.0'

_node = None

# Names that need torch: imported on first use (PEP 562), so `import d2ldist` stays light.
_LAZY = {
    'SplitSampler': 'data', 'load_data': 'data', 'load_data_cifar10': 'data',
    'load_data_digits': 'data',
    'resnet18': 'models',
    'cpu': 'devices', 'try_gpu': 'devices', 'try_all_gpus': 'devices',
    'split_and_load': 'devices', 'parse_devices': 'devices',
    'LocalStore': 'store',
    'Trainer': 'trainer', 'train_batch': 'trainer', 'evaluate_accuracy': 'trainer',
}


_LAZY_MODULES = ('kv',)


def __getattr__(name):
    """Load the heavy parts (torch) on first use."""
    import importlib
    if name in _LAZY_MODULES:
        return importlib.import_module(f'.{name}', __name__)
    if name in _LAZY:
        return getattr(importlib.import_module(f'.{_LAZY[name]}', __name__), name)
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def init():
    """Join the job the launcher started; alone (rank 0 of 1) outside a job."""
    global _node
    if _node is None and 'D2L_SCHEDULER_URI' in os.environ:
        _node = Node.from_env(role='worker').start()
    return _node


def rank():
    """This worker's rank, 0 .. size() - 1."""
    return _node.rank if _node else 0


def size():
    """The number of workers in the job."""
    return _node.num_workers if _node else 1


def barrier():
    """Wait until every worker has reached this point."""
    if _node:
        _node.barrier('worker')


def load_ipython_extension(ipython):
    """``%load_ext d2ldist``: register the ``%launch`` magic."""
    from .magic import LaunchMagics
    ipython.register_magics(LaunchMagics)
