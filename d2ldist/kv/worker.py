"""The worker's side of the key-value store (MXNet's kvstore API, PyTorch tensors).

    kv = d2ldist.kv.create('dist_sync')
    kv.init(3, w)                    # every worker, same value; rank 0's is stored
    kv.pushpull(3, grad, out=w)      # push gradients, pull the new weights

``local`` keeps everything in this process (several devices of one machine);
``dist_sync`` / ``dist_async`` talk to the servers of the job; ``dist_sync_device``
is dist_sync that sums a worker's own device copies on the device, not on the CPU.

With elastic workers (``d2l-launch --min-workers``) a worker lost, joined or finished
changes nothing here: the servers count the pushes of the workers left (server.py). A
worker that joins a running job (``kv.is_recovery``, ps-lite's name) finds the keys
on the servers: its ``init`` and ``set_optimizer`` send nothing and wait for nobody, and
its first pull brings the current values.

With replicated servers (``--server-replicas``) a request goes to the head of its
shard's chain (``node.head``). When a server is lost, what it has not answered is sent
again, as it was, to the replica that answers for its shard now; the numbers pushes
carry let that one count each push once (``server.py``).
"""
import itertools
import numbers
import time
import warnings

import torch

from .. import lines
from ..runtime import compression, hang, shm, spans, staging, stream
from ..runtime.node import Node, WorkersChanged
from . import messages as M
from .asking import InFlight
from .optimizers import Updater, torch_names
from .placement import place, row_positions
from .server import apply_update

KINDS = ('local', 'dist_sync', 'dist_async', 'dist_sync_device')
# MXNet's other names for these kinds. (On one machine MXNet's 'device' and the
# 'local_*' ones choose where copies are summed and updated; here 'local' sums on the
# CPU, or on the GPU through the Trainer, whose step 2 sums on devices[0].)
ALIASES = {'device': 'local', 'local_update_cpu': 'local', 'local_allreduce_cpu': 'local',
           'local_allreduce_device': 'local', 'dist_device_sync': 'dist_sync_device'}
REFUSED = {'nccl': "kvstore 'nccl' is not a parameter server: for NCCL all-reduce use "
                   "d2ldist.Trainer(..., kvstore='torch') (torch.distributed) or the "
                   "Horovod API with D2L_BACKEND=torch"}
CPU = torch.device('cpu')
Key = int | str | list[int | str]      # (type hints) a key, or a list of keys
Value = torch.Tensor | list            # a tensor, its copies on devices, or one per key


def sum_copies(copies, device=None, into_first=False):
    """Step 2: a value's copies (one per device) added up in order, on ``device``.

    ``device`` defaults to the first copy's; ``into_first``: add into the first copy
    itself (it must be on ``device``) instead of a new tensor. The Trainer sums its
    replicas' gradients with this too.
    """
    first = copies[0]
    device = first.device if device is None else device
    total = first if into_first else first.to(device, copy=True)
    for t in copies[1:]:
        total.add_(t.to(device, non_blocking=device.type != 'cpu'))   # to the CPU: wait
    return total


class KVStore:
    """What every kind shares: the API, argument checks and summing device copies.

    ``priority`` (MXNet's, an int, higher first; push, pull, pushpull, row_sparse_pull
    and broadcast take it) is checked and has no effect here: MXNet queues each call on
    its engine and runs the higher ones first, while a call of d2ldist is done when it
    returns, so calls run in the order they are made."""

    def __init__(self, kind: str) -> None:
        self.type = kind                       # MXNet's kv.type (kv.create: the name given)
        self.is_async = kind == 'dist_async'   # each push updates the weights on its own
        self._sum_on_device = kind == 'dist_sync_device'   # step 2 on the first copy's device
        self._meta = {}          # key -> (shape, dtype) given at init
        self.optimizer = None    # (name, hyperparameters) of the last set_optimizer
        self._pinned = {}        # ('push' or 'pull', key) -> pinned CPU buffer for CUDA
        self._plain = set()      # keys the optimizer does not update
        self._whole = set()      # keys whose pushes are never compressed
        self._codec = None       # gradient compression (runtime/compression.py), if any
        self.gradient_compression = None

    rank, num_workers, is_recovery = 0, 1, False

    # -- the API -------------------------------------------------------------------------
    def init(self, key: Key, value: Value, optimizer: bool = True,
             compress: bool | None = None) -> None:
        """Give keys their initial values (call it on every worker with the same values).

        ``optimizer=False``: the optimizer never updates these keys (the Trainer's
        BatchNorm statistics; the gradients of a Trainer that updates the weights itself):
        their pushes are summed (sync) or added (async) as if no optimizer were set.
        ``compress``: whether gradient compression codes their pushes (default: as
        ``optimizer``; statistics travel whole, gradients may be coded).
        """
        keys, values = _lists(key, value)
        for k, v in zip(keys, values):
            v = v[0] if isinstance(v, (list, tuple)) else v
            if k in self._meta:
                raise M.KVError(f'key {k!r} is already initialised')
            self._meta[k] = (tuple(v.shape), v.dtype)
            if not optimizer:
                self._plain.add(k)
            if not (optimizer if compress is None else compress):
                self._whole.add(k)
        self._init(keys, [self._to_cpu(k, _first(v)) for k, v in zip(keys, values)],
                   optimizer)

    def push(self, key: Key, value: Value, priority: int = 0) -> None:
        """Push values (a list of device copies is summed first); a sparse tensor's rows
        go by ``_push_sparse``. ``priority``: see the class."""
        _check_priority(priority)
        keys, values = _lists(key, value)
        dense = [(k, v) for k, v in zip(keys, values) if not _sparse(v)]
        if dense:
            self._push([k for k, _ in dense], [self._reduce(k, v) for k, v in dense])
        self._push_sparse(keys, values)

    def _push_sparse(self, keys, values):
        """Push the sparse values (the gradient of ``nn.Embedding(sparse=True)``): each
        sends only its rows, and the store updates only those rows."""
        for k, v in zip(keys, values):
            if _sparse(v):
                self._push_rows(k, *self._rows(k, v))

    def row_sparse_pull(self, key: Key, out: Value | None = None, priority: int = 0,
                        row_ids: Value | None = None) -> None:
        """Pull only rows ``row_ids`` of the key into ``out`` (its other rows stay as they
        are): MXNet's row_sparse_pull, in its order of arguments, for an embedding whose
        batch used a few rows."""
        _check_priority(priority, " (MXNet's order: row_sparse_pull(key, out, priority, "
                                  'row_ids); pass the rows by name, row_ids=...)')
        if out is None or row_ids is None:
            raise ValueError('row_sparse_pull needs out= and row_ids=')
        keys, outs = self._outputs(key, out)
        ids = row_ids if isinstance(key, (list, tuple)) else [row_ids]
        for k, o, r in zip(keys, outs, ids):
            rows = torch.as_tensor(r, dtype=torch.int64).view(-1).unique()   # sorted
            if rows.numel() and not 0 <= int(rows[0]) <= int(rows[-1]) < self._meta[k][0][0]:
                raise M.KVError(f'key {k!r}: row ids outside 0..{self._meta[k][0][0] - 1}')
            self._pull_rows(k, o, rows)

    def _rows(self, key, value):
        """A sparse value (or its device copies) as (row ids, their rows) on the CPU."""
        total = None
        for t in _as_list(value):
            if not _sparse(t) or tuple(t.shape) != self._meta[key][0] \
                    or t.dtype != self._meta[key][1]:
                raise M.KVError(f'key {key!r}: pushed {_describe(t.dtype, t.shape)}, '
                                f'sparse={t.is_sparse}, but the key holds '
                                f'{_describe(self._meta[key][1], self._meta[key][0])}')
            t = t.detach().cpu()
            total = t if total is None else total + t
        total = total.coalesce()
        return total.indices()[0].contiguous(), total.values().contiguous()

    def pull(self, key: Key, out: Value | None = None, priority: int = 0,
             ignore_sparse: bool = True) -> None:
        """Pull the current values into ``out`` (a tensor, or a list of device copies; a
        sparse one: ``_sparse_outs``). ``priority``: see the class."""
        _check_priority(priority)
        if out is None:
            raise ValueError('pull needs out= (a tensor or a list of device copies)')
        keys, outs = self._outputs(key, out)
        dense = {k: [t for t in _as_list(o) if not t.is_sparse] for k, o in zip(keys, outs)}
        sparse = self._sparse_outs(keys, outs, dense, ignore_sparse)
        pulls = [k for k in keys if dense[k]]
        if pulls:
            self._pull(pulls, [dense[k] for k in pulls])
        self._fill_sparse(sparse)

    def _sparse_outs(self, keys, outs, dense, ignore_sparse):
        """The sparse outputs of a pull (MXNet's row_sparse): left as they are when
        ``ignore_sparse``, as in MXNet, with a warning (pull their rows with
        row_sparse_pull); otherwise they get every row, pulled first into a dense tensor
        added to the key's ``dense`` outputs: [(a key's sparse outputs, that tensor)]."""
        sparse = []
        for k, o in zip(keys, outs):
            rows = [t for t in _as_list(o) if t.is_sparse]
            if rows and ignore_sparse:
                warnings.warn(f'kv.pull: key {k!r}: a sparse out is left as it is '
                              '(ignore_sparse=True); pull its rows with row_sparse_pull',
                              stacklevel=3)
            elif rows:
                dense[k].append(torch.empty(self._meta[k][0], dtype=self._meta[k][1]))
                sparse.append((rows, dense[k][-1]))
        return sparse

    def _fill_sparse(self, sparse):
        """Copy every row pulled into the sparse outputs (``_sparse_outs``)."""
        for rows, whole in sparse:
            for t in rows:
                t.copy_(whole.to_sparse(t.sparse_dim()).to(t.device))

    def pushpull(self, key: Key, value: Value, out: Value | None = None,
                 priority: int = 0) -> None:
        """Push, then pull the updated values: one round trip (into ``value`` when no ``out``).
        A sparse value: push its rows, then pull those rows into ``out``. ``priority``:
        see the class."""
        _check_priority(priority)
        keys, values = _lists(key, value)
        if any(_sparse(v) for v in values):
            if out is None:
                raise M.KVError('pushpull of a sparse value needs out= (the dense weights)')
            _, outs = self._outputs(key, out)
            for k, v, o in zip(keys, values, outs):
                if _sparse(v):
                    rows, rows_values = self._rows(k, v)
                    self._push_rows(k, rows, rows_values)
                    self._pull_rows(k, o, rows)
                else:
                    self._pushpull([k], [self._reduce(k, v)], [o])
            return
        _, outs = self._outputs(key, value if out is None else out)
        self._pushpull(keys, [self._reduce(k, v) for k, v in zip(keys, values)], outs)

    def broadcast(self, key: Key, value: Value, out: Value, priority: int = 0) -> None:
        """Initialise keys with rank 0's ``value`` and pull it into ``out`` on every worker."""
        _check_priority(priority)
        self.init(key, value)
        self.pull(key, out=out)

    def set_gradient_compression(self, compression_params: dict) -> None:
        """Compress what later pushes send (MXNet's): ``{'type': '2bit', 'threshold':
        0.5}`` (add ``'error_feedback': False`` to drop the residual), ``{'type': 'fp16'}``
        or ``'bf16'``; ``None`` for none. Pulls, sparse rows and keys made with
        ``optimizer=False`` travel whole (``runtime/compression.py``)."""
        self._codec = compression.create(compression_params)
        self.gradient_compression = self._codec and self._codec.params

    def _coded(self, key):
        """The codec for a push of ``key`` (None: whole)."""
        return None if key in self._whole else self._codec

    def compression_residuals(self) -> dict:
        """What 2-bit compression has kept back on this worker (error feedback), whole
        per key: {key: 1-D tensor}. Empty without it."""
        parts = {}
        for (key, start), residual in getattr(self._codec, 'residuals', {}).items():
            parts.setdefault(key, []).append((start, residual))
        return {key: torch.cat([r for _, r in sorted(p, key=lambda sr: sr[0])])
                for key, p in parts.items()}

    def set_compression_residuals(self, residuals: dict) -> None:
        """Take back what compression_residuals() gave, cut as today's servers hold the keys."""
        if residuals and not hasattr(self._codec, 'residuals'):
            raise M.KVError('these are residuals of 2-bit compression: set the same '
                            'gradient compression before loading them')
        for key, whole in residuals.items():
            for _, start, stop in place(key, whole.numel(), self._num_servers()):
                self._codec.residuals[(key, start)] = whole[start:stop].clone()

    def _num_servers(self):
        return 1

    def set_optimizer(self, name: str, **hyper: float) -> None:
        """Update the values with this optimizer on every push: a name and numbers, in
        torch.optim's names or gluon's (learning_rate, wd, beta1, beta2)."""
        hyper = torch_names(hyper)
        self._set_optimizer(name, hyper)
        self.optimizer = (name, hyper)

    def _outputs(self, key, out):
        """Keys and outputs as two lists, each output checked to fit its key."""
        keys, outs = _lists(key, out)
        for k, o in zip(keys, outs):
            for t in _as_list(o):
                self._check(k, t, 'pull into')
        return keys, outs

    # -- steps 2 and 3 of the pipeline: sum the copies of the devices, copy to the CPU -----
    def _reduce(self, key, value):
        """One CPU tensor: the sum of a value's copies (on the device for dist_sync_device)."""
        copies = _as_list(value)
        for t in copies:
            self._check(key, t, 'pushed')
        if len(copies) > 1:   # step 2: on the CPU (dist_sync_device: on the first copy's device)
            device = None if self._sum_on_device else CPU
            return self._to_cpu(key, sum_copies(copies, device))
        return self._to_cpu(key, copies[0])

    def _to_cpu(self, key, t):
        """A contiguous CPU tensor; from CUDA through a pinned buffer, non-blocking."""
        if t.device.type == 'cpu':
            return t.detach().contiguous()
        buf = self._pinned_buffer('push', key, t)
        staging.copy_([buf], [t])   # (waits: the copy must land before use)
        return buf

    def _fill(self, key, outs, value):
        """Copy a pulled CPU value into each output (CUDA outputs from pinned memory)."""
        for o in _as_list(outs):
            if o is value:
                continue
            if o.device.type == 'cpu':
                o.copy_(value)
            else:
                buf = self._pinned_buffer('pull', key, o)
                buf.copy_(value)
                staging.copy_([o], [buf])   # (waits: buf is reused next time)

    def _pinned_buffer(self, way, key, like):
        """The key's pinned CPU buffer for ``way`` ('push' or 'pull'), made like ``like``."""
        if (way, key) not in self._pinned:
            self._pinned[way, key] = staging.buffer(like.shape, like.dtype)
        return self._pinned[way, key]

    def _check(self, key, t, what):
        """A clear error naming the key and both shapes when a tensor does not fit."""
        M.check_key(key)
        if key not in self._meta:
            raise M.KVError(f'key {key!r} was never initialised (call kv.init first)')
        shape, dtype = self._meta[key]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise M.KVError(f'key {key!r}: {what} {_describe(t.dtype, t.shape)} but the key '
                            f'holds {_describe(dtype, shape)}')

    def save_optimizer_states(self, path: str) -> None:
        """Save the optimizer's states in one file (MXNet's name; tensors and numbers only)."""
        torch.save(self.optimizer_states(), path)

    def load_optimizer_states(self, path: str) -> None:
        """Load a file of save_optimizer_states (read with weights_only: nothing unpickled)."""
        self.set_optimizer_states(torch.load(path, weights_only=True))

    def barrier(self) -> None:
        """Wait for every worker (nothing to wait for in one process)."""

    def _barrier(self):
        """MXNet's name for barrier() (gluon's Trainer calls it): the same call."""
        self.barrier()

    def __repr__(self):
        return f'<KVStore {self.type}: worker {self.rank} of {self.num_workers}>'


class LocalKVStore(KVStore):
    """'local': the values and the optimizer live in this process."""

    def __init__(self, kind: str = 'local') -> None:
        super().__init__(kind)
        self._store, self._updater = {}, None

    def _set_optimizer(self, name, hyper):
        self._updater = Updater(name, **hyper)

    def set_learning_rate(self, lr: float) -> None:
        """A new learning rate; the optimizer's states (momentum, ...) stay."""
        if self._updater is None:
            raise M.KVError('set the optimizer before its learning rate')
        self._updater.opt.hyper['lr'] = lr

    def _init(self, keys, values, optimizer):
        for k, v in zip(keys, values):
            self._store[k] = v.clone()

    def _push(self, keys, values):
        for k, v in zip(keys, values):
            codec = self._coded(k)
            if codec is not None:             # what the servers would get
                flat = v.reshape(-1)             # (its residual kept as a dist one's)
                v = codec.decode(codec.encode((k, 0), flat), v.numel(), v.dtype).view_as(v)
            self._update(k, v)

    def _pull(self, keys, outs):
        for k, o in zip(keys, outs):
            self._fill(k, o, self._store[k])

    def _push_rows(self, key, rows, values):
        value = self._store[key]
        positions, _ = row_positions(rows, _numel(value.shape[1:]), 0, value.numel())
        self._update(key, values, positions)

    def _update(self, key, grad, positions=None):
        """Update as a server does when a round closes (``server.apply_update``); a sum
        that becomes the value is copied: it is the caller's tensor."""
        updater = None if key in self._plain else self._updater
        value = apply_update(updater, key, self._store[key], grad, positions)
        self._store[key] = value.clone() if value is grad else value

    def _pull_rows(self, key, out, rows):
        for o in _as_list(out):
            o[rows] = self._store[key][rows].to(o.device)

    def _pushpull(self, keys, values, outs):
        self._push(keys, values)
        self._pull(keys, outs)

    def optimizer_states(self) -> dict:
        """The optimizer's state of every key: {'optimizer': name, 'states': {key: {...}}}."""
        states = {k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in s.items()}
                  for k, s in (self._updater.states if self._updater else {}).items()}
        return {'optimizer': self._updater and self._updater.name, 'states': states}

    def set_optimizer_states(self, data: dict) -> None:
        """Take back what optimizer_states() gave."""
        if self._updater is None:
            raise M.KVError('set the optimizer before loading its states')
        for key, state in data['states'].items():
            self._updater.load_state(key, state, self._store[key].numel())


class DistKVStore(KVStore):
    """'dist_sync', 'dist_async', 'dist_sync_device': the values live on the servers."""

    def __init__(self, kind: str, node: Node) -> None:
        super().__init__(kind)
        self._node, self._ids = node, itertools.count(1)
        if node.num_servers < 1:
            raise RuntimeError(f"kvstore '{kind}' needs servers: start the job with "
                               f'd2l-launch -s 1 (or more)')
        self.rank, self.num_workers = node.rank, node.num_workers
        self.is_recovery = node.is_recovery     # joined a running job (elastic)
        self._sync = kind != 'dist_async'
        self._pushes = {}        # shard -> pushes sent to it (sync: it checks they agree)
        if self.is_recovery:     # the servers knew a worker of this rank elsewhere
            self._ask([(s, M.HELLO, {'address': node.van.address, 'host_id': shm.identity()},
                        []) for s in self._servers()], what='hello')
        self._offer_streams()

    def _offer_streams(self):
        """Where a server's answers would cross a socket (another host, D2L_SHM=0), offer
        it a stream to send the pulled values on: they are read straight into ``out``.
        Once a process (a second store finds the streams there)."""
        van = self._node.van
        for server in self._node.peers('server'):
            if van.through_socket(server) and not stream.listening(van, server):
                self._node.send(server, M.LINK, {'offer': stream.listen(van, server).offer()})

    def _num_servers(self):
        return self._node.num_servers

    def _shards(self):
        """The shards of the store, one per server (each asked of its chain's head)."""
        return range(self._node.num_servers)

    def _servers(self):
        """The server processes still in the job."""
        chains = self._node.chains
        return self._node.peers('server') if chains is None else sorted(
            {holder for chain in chains for holder in chain}, key=lambda s: int(s[7:]))

    def _set_optimizer(self, name, hyper):
        """Let the servers update the weights with this optimizer (chosen by name)."""
        Updater(name, **hyper)                  # bad names fail here, on every worker
        if self.is_recovery:                    # the servers have it, and its states
            return
        if self.rank == 0:
            self._ask([(s, M.OPTIMIZER, {'name': name, 'hyper': hyper}, [])
                       for s in self._shards()])
        self.barrier('kv.set_optimizer')

    def set_learning_rate(self, lr: float) -> None:
        """A new learning rate on the servers; the optimizer's states (momentum, ...) stay.

        Rank 0 sends it. In dist_sync it takes effect from the round after rank 0's
        last pull: that next round cannot close before rank 0 pushes, and a server
        handles each worker's requests in order.
        """
        if isinstance(lr, bool) or not isinstance(lr, (int, float)):
            raise ValueError(f'the learning rate must be a number, got {lr!r}')
        if self.rank == 0:
            self._ask([(s, M.LEARNING_RATE, {'lr': lr}, []) for s in self._shards()])

    def barrier(self, what: str = 'barrier()') -> None:
        """Wait until every worker has reached this point (elastic: every worker left)."""
        while True:
            try:
                return self._node.barrier('worker', what)
            except WorkersChanged:     # the scheduler forgot the barrier: enter it again
                continue

    # -- requests, one message per server ----------------------------------------------------
    def _init(self, keys, values, optimizer):
        if self.is_recovery:          # the keys are on the servers (MXNet: no barrier)
            return
        if self.rank == 0:
            self._ask(self._messages(M.INIT, keys, values, optimizer=optimizer))
        self.barrier(f'kv.init({_keys(keys)})')

    def _push(self, keys, values):
        self._ask(self._numbered(self._messages(M.PUSH, keys, values, sync=self._sync,
                                                pull=False, coded=True)), what='push')

    def _pull(self, keys, outs):
        self._ask(self._messages(M.PULL, keys), self._receiver(keys, outs), what='pull')

    def _pushpull(self, keys, values, outs):
        self._ask(self._numbered(self._messages(M.PUSH, keys, values, sync=self._sync,
                                                pull=True, coded=True)),
                  self._receiver(keys, outs), what='pushpull')

    def _push_rows(self, key, rows, values):
        self._ask(self._numbered(self._row_messages(M.PUSH_ROWS, key, rows, values,
                                                    sync=self._sync)), what='push rows')

    def _numbered(self, msgs):
        """Pushes carry their number per shard (a sync server checks that every worker's
        n-th push has the same keys; a replica counts a push sent again once) and the
        membership this worker knows (elastic: from which round a joiner counts)."""
        for shard, _, header, _ in msgs:
            header['n'] = self._pushes[shard] = self._pushes.get(shard, 0) + 1
            header['membership'] = self._node.round
        return msgs

    def _pull_rows(self, key, out, rows):
        """Ask each server for its part of the rows; write them into ``out`` only."""
        first = _as_list(out)[0]
        host = first if first.device.type == 'cpu' and first.is_contiguous() \
            else first.detach().to('cpu', copy=True).contiguous()

        def receive(msg):
            for p in M.read_row_parts(msg, with_values=True, rows=rows):
                host.view(-1)[p.start + p.positions] = p.value
        self._ask(self._row_messages(M.PULL_ROWS, key, rows), receive, what='pull rows')
        for o in _as_list(out):
            if o is not host:
                o[rows] = host[rows].to(o.device)

    def _row_messages(self, kind, key, rows, values=None, **header):
        """One message per server holding some of the rows: their ids (and values)."""
        shape, dtype = self._meta[key]
        row_numel = _numel(shape[1:])
        flat = values.reshape(-1) if values is not None else None
        msgs = []
        for s, start, stop in place(key, _numel(shape), self._node.num_servers):
            positions, mask = row_positions(rows, row_numel, start, stop)
            if not positions.numel() and not header.get('sync'):
                continue      # (a sync push goes to every server: each counts N pushes)
            mine = rows[mask.view(-1, row_numel).any(1)].contiguous()   # rows in the slice
            frames = [_bytes(mine)] + ([_bytes(flat[mask].contiguous())] if flat is not None
                                       else [])
            part = M.RowPart(key, M.wire.dtype_name(dtype), shape, start, stop, positions)
            msgs.append((s, kind, dict(header, parts=[part.head()]), frames))
        return msgs

    def _messages(self, kind, keys, values=None, coded=False, **header):
        """Cut the keys into their parts and group the parts by server: [(server, kind,
        header, frames)]. ``coded``: compress the values of the keys that may be."""
        by_server = {}
        for i, k in enumerate(keys):
            shape, dtype = self._meta[k]
            flat = values[i].view(-1) if values is not None else None
            codec = self._coded(k) if coded else None
            for s, start, stop in place(k, _numel(shape), self._node.num_servers):
                parts, frames, codes = by_server.setdefault(s, ([], [], []))
                parts.append(M.Part(k, M.wire.dtype_name(dtype), shape, start, stop).head())
                if codec is not None:                     # its own residual per slice
                    codes.append(len(parts) - 1)
                    frames.append(_bytes(codec.encode((k, start), flat[start:stop])))
                elif flat is not None:
                    frames.append(_bytes(flat[start:stop]))
        msgs = []
        for s, (parts, frames, codes) in sorted(by_server.items()):
            for c in range(0, len(parts), M.MAX_PARTS):      # a huge list: a few messages
                head = dict(header, parts=parts[c:c + M.MAX_PARTS])
                mine = [i - c for i in codes if c <= i < c + M.MAX_PARTS]
                if mine:                                     # which parts, and how
                    head.update(codec=self._codec.params, coded=mine)
                msgs.append((s, kind, head, frames[c:c + M.MAX_PARTS]))
        return msgs

    def _receiver(self, keys, outs):
        """What to do with a VALUES answer: copy each part into its place in a CPU tensor
        (``out`` itself if it is one); returns how to end: once a key's last part is in,
        fill its outputs (the parts still in a stream: ``_read_in_place``)."""
        targets = {}          # key -> [the CPU tensor, out, how many parts are to come]
        for k, o in zip(keys, outs):
            first = _as_list(o)[0]
            host = first if first.device.type == 'cpu' and first.is_contiguous() \
                else torch.empty(first.shape, dtype=first.dtype)
            targets[k] = [host, o, len(place(k, host.numel(), self._node.num_servers))]

        def receive(msg):
            parts = M.read_parts(msg, with_frames=True)
            for p in parts:
                if not isinstance(p.value, stream.Pending):
                    targets[p.key][0].view(-1)[p.start:p.stop].copy_(p.value)
            reading = _read_in_place(parts, targets)

            def end():
                reading.wait()
                for p in parts:
                    targets[p.key][2] -= 1
                    if targets[p.key][2] == 0:
                        self._fill(p.key, targets[p.key][1], targets[p.key][0])
            return end
        return receive

    def _ask(self, msgs, on_values=None, what='request'):
        """Send the requests and wait for every answer; raise the first error a server sends.

        ``msgs``: [(shard, or a server's id, kind, header, frames)]. ``on_values(msg)``
        takes each VALUES answer; what it returns is called once every answer has come."""
        keys = _keys([k for _, _, header, _ in msgs for k in M.keys_of(header.get('parts', []))])
        start, asked = time.time(), InFlight(self._node, keys, what)
        for to, kind, header, frames in msgs:
            asked.send(next(self._ids), to, kind, header, frames)
        answers, ends = [], []
        for msg in asked.answers():
            if msg.kind == M.ERROR:
                error = f'{lines.shown(msg.sender)}: {msg.get("error")}'
                raise hang.Disagree(error) if msg.get('disagree') else M.KVError(error)
            answers.append(msg)
            reads = msg.kind == M.VALUES and on_values is not None
            if reads:
                ends.append(on_values(msg) or (lambda: None))   # (maybe: how to end)
            asked.answered(msg, in_place=reads)
        for end in ends:                 # (wait() for the reads: they have ended)
            end()
        spans.record(what, 'comm', start, time.time(), keys=keys,   # (--timeline)
                     sent=sum(len(f) for *_, frames in msgs for f in frames),
                     received=sum(f.nbytes for m in answers for f in m.frames))
        return answers

    # -- looking inside the servers -----------------------------------------------------------
    def server_info(self) -> dict[str, dict]:
        """What each shard holds, by the server whose shard it is: {'server:0': {'keys':
        [[key, dtype, shape, start, stop]], 'pid' of the process answering for it,
        'optimizer', 'replicated': the bytes of its changes sent to its replicas}}."""
        answers = self._ask([(s, M.INFO, {}, []) for s in self._shards()])
        return {f'server:{m["shard"]}': {'keys': m['keys'], 'pid': m['pid'],
                                         'optimizer': m['optimizer'],
                                         'replicated': m['replicated']} for m in answers}

    def optimizer_states(self) -> dict:
        """The servers' optimizer states, gathered key by key as optimizer_states() of a
        'local' store gives them: whole tensors, whatever the number of servers."""
        answers = self._ask([(s, M.GET_STATE, {}, []) for s in self._shards()])
        states = {}
        for msg in answers:
            frames = iter(msg.frames)
            held = {}
            for key, name, dtype, number in msg['entries']:
                entry = states.setdefault(key, {})
                if dtype is None:
                    entry[name] = number
                    continue
                shape, kdtype = self._meta[key]
                full = entry.setdefault(name, torch.empty(shape, dtype=kdtype))
                start, stop = held.setdefault(key, self._slice_on(key, msg.get('shard')))
                full.view(-1)[start:stop].copy_(M.wire.unpack(
                    {'dtype': dtype, 'shape': [stop - start]}, next(frames)))
        optimizer = next((m['optimizer'] for m in answers if m['optimizer']), None)
        return {'optimizer': optimizer, 'states': states}

    def set_optimizer_states(self, data: dict) -> None:
        """Send states back to the servers, cut by today's placement (so a job with
        another number of servers takes them too). Every worker calls it; rank 0 sends
        its ``data`` (the others may pass None), and all wait until the servers have them.
        A worker that joins a running job sends nothing: the servers' states are newer."""
        if self.is_recovery:
            return
        if self.rank == 0:
            msgs = {}
            for key, state in data['states'].items():
                shape, _ = self._meta[key]
                for s, start, stop in place(key, _numel(shape), self._node.num_servers):
                    entries, frames = msgs.setdefault(s, ([], []))
                    for name, v in state.items():
                        if isinstance(v, torch.Tensor):
                            entries.append([key, name, M.wire.dtype_name(v.dtype), None])
                            frames.append(_bytes(v.contiguous().view(-1)[start:stop]))
                        else:
                            entries.append([key, name, None, v])
            self._ask([(s, M.SET_STATE, {'entries': e}, f) for s, (e, f) in msgs.items()])
        self.barrier('kv.set_optimizer_states')

    def _slice_on(self, key, shard):
        shape, _ = self._meta[key]
        for s, start, stop in place(key, _numel(shape), self._node.num_servers):
            if s == shard:
                return start, stop
        raise M.KVError(f'shard {shard} sent state for key {key!r} it should not hold')


# -- small helpers ---------------------------------------------------------------------------
def _read_in_place(parts, targets):
    """Start reading the parts still in their stream straight into place, on the
    stream's thread (``stream.read_later``), so that all servers' answers come in at once."""
    return stream.read_later([(p.value, targets[p.key][0].view(-1)[p.start:p.stop]
                               .view(torch.uint8).numpy())
                              for p in parts if isinstance(p.value, stream.Pending)])


def _lists(key, value):
    """Keys and values as two lists of the same length (one key and value, or lists)."""
    if isinstance(key, (list, tuple)):
        if not isinstance(value, (list, tuple)) or len(value) != len(key):
            raise ValueError(f'{len(key)} keys need a list of {len(key)} values')
        if len(set(key)) != len(key):
            raise ValueError(lines.clip(f'a key appears twice in {list(key)!r}', lines.NAME))
        return [M.check_key(k) for k in key], list(value)
    return [M.check_key(key)], [value]


def _check_priority(priority, hint=''):
    """MXNet's priority is an int (higher first); anything else, a one-line error."""
    if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
        raise TypeError(f'priority must be an int (higher first, as in MXNet), got '
                        f'{type(priority).__name__}{hint}')


def _keys(keys):
    """A short text of a list of keys: "'w', 'b' and 60 more"."""
    keys = list(dict.fromkeys(keys))
    text = ', '.join(map(repr, keys[:3]))
    return text + (f' and {len(keys) - 3} more' if len(keys) > 3 else '')


def _sparse(value):
    """Whether a value (or its first device copy) is a sparse tensor."""
    first = _as_list(value)[0]
    return isinstance(first, torch.Tensor) and first.is_sparse


def _as_list(value):
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _first(value):
    return _as_list(value)[0]


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def _describe(dtype, shape):
    return M.describe(M.wire.dtype_name(dtype), shape)


def _bytes(t):
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    return t.view(torch.uint8).numpy().data if t.numel() else b''
