"""The parameter server: a key-value store sharded over the servers of a job.

    kv = d2ldist.kv.create('dist_sync')   # or 'local', 'dist_async', 'dist_sync_device'

* ``placement.py`` -- which server holds which key (the one rule);
* ``store.py``     -- the worker's side: init, push, pull, pushpull, set_optimizer;
* ``server.py``    -- the server's loop: receive, aggregate, update, answer;
* ``optimizers.py``-- the optimizers servers run, chosen by name;
* ``messages.py``  -- what workers and servers say to each other.
"""
from .messages import KVError
from .placement import place
from .store import KINDS, DistKVStore, KVStore, LocalKVStore


def create(kind='local'):
    """A key-value store of the given kind (MXNet's ``mx.kv.create``)."""
    if kind not in KINDS:
        raise ValueError(f'unknown kvstore kind {kind!r}; choose one of {", ".join(KINDS)}')
    if kind == 'local':
        return LocalKVStore()
    import d2ldist
    node = d2ldist.init()
    if node is None:
        raise RuntimeError(f"kvstore '{kind}' runs in a job: start it with "
                           f'd2l-launch -n N -s S python your_script.py')
    return DistKVStore(kind, node)
