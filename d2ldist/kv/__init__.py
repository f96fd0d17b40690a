"""The parameter server: a key-value store sharded over the servers of a job.

    kv = d2ldist.kv.create('dist_sync')   # or 'local', 'dist_async', 'dist_sync_device'

* ``placement.py`` -- which server holds which key (the one rule);
* ``worker.py``    -- the worker's side: init, push, pull, pushpull, set_optimizer;
* ``asking.py``    -- a worker's requests in flight, their answers matched;
* ``server.py``    -- one shard: aggregate, update, answer; its update rule
  (``apply_update``) is the local store's too;
* ``serving.py``   -- a server process's loop: the shards it holds, the scheduler's news;
* ``membership.py``-- whom a round waits for (every worker, unless elastic);
* ``replication.py``-- a shard's changes down its chain of replicas;
* ``links.py``     -- the streams a server answers some workers on;
* ``optimizers.py``-- the optimizers by name (the one table, the one factory ``create``),
  those servers run, and the one vocabulary of hyperparameters (torch.optim's);
* ``messages.py``  -- what workers and servers say to each other (``Part``, ``RowPart``);
* ``__main__.py``  -- a server process (``python -m d2ldist.kv``, started by d2l-launch).
"""
import importlib

from ..runtime.node import register
from .placement import place  # noqa: F401  (light: no torch)

# The rest needs torch: loaded on first use, so that a server process
# (``python -m d2ldist.kv``) starts fast and can refuse a bad D2L_SERVER_SCRIPT at once.
_LAZY = {'KVError': 'messages', 'KINDS': 'worker', 'KVStore': 'worker',
         'DistKVStore': 'worker', 'LocalKVStore': 'worker'}
_MODULES = ('placement', 'worker', 'server', 'optimizers', 'messages')
__all__ = ['create', 'place', *_LAZY]


def __getattr__(name):
    """KVError, KVStore, ... and the modules (kv.optimizers): imported on first use."""
    if name in _MODULES:
        return importlib.import_module(f'.{name}', __name__)
    if name not in _LAZY:
        raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
    value = getattr(importlib.import_module(f'.{_LAZY[name]}', __name__), name)
    globals()[name] = value
    return value


def create(name: str = 'local') -> 'KVStore':
    """A key-value store of the given kind (MXNet's ``mx.kv.create``; its names too)."""
    from .worker import ALIASES, KINDS, REFUSED, DistKVStore, LocalKVStore
    if name in REFUSED:
        raise ValueError(REFUSED[name])
    kind = ALIASES.get(name, name)
    if kind not in KINDS:
        raise ValueError(f'unknown kvstore kind {name!r}; choose one of {", ".join(KINDS)} '
                         f'(or MXNet\'s {", ".join(ALIASES)})')
    if kind == 'local':
        store = LocalKVStore()
    else:
        node = register('worker')
        if node is None:
            _refuse_outside_a_job(name)
        store = DistKVStore(kind, node)
    store.type = name                                 # MXNet reports the name it was given
    return store


def _refuse_outside_a_job(name):
    """A dist store needs d2l-launch's scheduler and servers: say so in one line (StartError
    ends the process so), naming the tool that started several copies without them."""
    from ..runtime import node, started
    node.report_in_one_line()
    start = started.detect()
    who = f'{start.who}, but ' if start.several else ''
    raise started.StartError(f"{who}kvstore '{name}' runs in a job of d2l-launch (it starts "
                             'the scheduler and the servers): d2l-launch -n N -s S python '
                             'your_script.py')
