"""The production backend: the same collectives on torch.distributed.

gloo on CPU, NCCL when every worker has a GPU of its own (``choose``: the workers
compare their GPUs' UUIDs). The rendezvous is torch.distributed's env://: torchrun's
variables, which ``runtime/started.py`` fills from mpirun's or srun's own first. Rank 0
says in one line what was chosen and why:
'd2ldist: torch backend (gloo): 2 workers started by mpirun, CPU'.

* A reduce-scatter on gloo is one all-to-all, each worker adding up the parts it
  receives (half the bytes of gloo's own); ``wire_bytes_sent()`` counts what gloo's
  connections carried, as the kernel counts it.
* Hangs and calls that disagree: ``--hang-fail`` becomes the process group's timeout
  (and a monitored barrier on gloo), ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` compares the
  ranks' calls.
* ``hvd.join()``: the Horovod API's backend (``joinable``) begins each collective by
  all-reducing (max) a few integers that say what it is (``_said``); a worker in join()
  contributes zeros, learns the call from the result and takes part with the ring's
  stand-in. The Trainer's 'torch' store makes its backend without it.

Each of these, and what it costs: docs/design/collectives.md.
"""
import atexit
import glob
import math
import os
import socket
import struct
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import config
from ..lines import NAME, clip, say
from ..runtime import started
from ..runtime.hang import Disagree
from ..runtime.split import even_slices
from ..runtime.staging import staged
from ..runtime.wire import DTYPES, dtype_name
from . import ops
from .ring_backend import REFUSED, equal_shard, row_shape_code, stand_in

# the flat halves of an all-reduce (ZeRO, sharded.py): torch 2.14 renamed them (the
# benchmarks call torch's own through these names too)
REDUCE_SCATTER = getattr(dist, 'reduce_scatter_single', None) or dist.reduce_scatter_tensor
ALL_GATHER = getattr(dist, 'all_gather_single', None) or dist.all_gather_into_tensor


def _destroy():
    """End the process group this backend started, while the interpreter is whole.

    gloo's run-loop threads drop each finished operation, with its tensors, after the
    caller has its result, and dropping a tensor takes the GIL: a process that exits
    right after its last collective can abort ('terminate called without an active
    exception') when that happens during the interpreter's finalization. Destroying
    the group is not enough (torch._dynamo keeps a reference to it, so its threads
    live on), so we also wait, at most a second, until those threads are idle.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    _wait_idle('pt_gloo_runloop')


def _wait_idle(thread_name, timeout=1.0, interval=0.005):
    """Wait until this process's threads of that name sleep, twice in a row (Linux)."""
    def all_asleep():
        states = []
        for task in glob.glob('/proc/self/task/*'):
            try:
                with open(f'{task}/comm') as f:
                    if f.read().strip() != thread_name:
                        continue
                with open(f'{task}/stat') as f:
                    states.append(f.read().rsplit(')', 1)[1].split()[0])
            except OSError:          # the thread ended meanwhile
                continue
        return all(s == 'S' for s in states)
    deadline, quiet = time.monotonic() + timeout, 0
    while quiet < 2 and time.monotonic() < deadline:
        time.sleep(interval)         # (releases the GIL, which a dropping thread may need)
        quiet = quiet + 1 if all_asleep() else 0


# -- the bytes gloo sends ---------------------------------------------------------------
# A van counts the bytes of the data it sends (``van.bytes_sent``); gloo counts nothing we
# can read. The kernel counts, for each TCP connection: tcp_info's bytes_sent (Linux 4.19).
# The connections gloo opens as the group starts (a full mesh of pairs) are those that
# appear during init_process_group, the store's aside: ``_group_sockets`` keeps them.
_TCPI_BYTES_SENT = 200      # offset of tcpi_bytes_sent in struct tcp_info, then bytes_retrans
_group_sockets = None       # inodes of the connections the process group opened, or None


def _tcp_sockets():
    """This process's sockets: {inode: fd} (from /proc; empty where there is none)."""
    found = {}
    try:
        fds = os.listdir('/proc/self/fd')
    except OSError:
        return found
    for fd in fds:
        try:
            link = os.readlink(f'/proc/self/fd/{fd}')
        except OSError:             # (closed meanwhile, or the listing's own fd)
            continue
        if link.startswith('socket:['):
            found[int(link[8:-1])] = int(fd)
    return found


def _tcp_sent(fd):
    """(bytes the kernel has sent on TCP socket ``fd``, retransmissions aside, its two
    ports), or None if it is no TCP socket or the kernel does not count."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    with sock:
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET,
                                                                  socket.AF_INET6):
            return None
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCPI_BYTES_SENT + 16)
        if len(info) < _TCPI_BYTES_SENT + 16:
            return None             # (a kernel older than 4.19)
        sent, retransmitted = struct.unpack_from('QQ', info, _TCPI_BYTES_SENT)
        try:
            ports = {sock.getsockname()[1], sock.getpeername()[1]}
        except OSError:             # (a listener)
            ports = set()
        return sent - retransmitted, ports


def _note_group_sockets(before, store_port):
    """Keep the TCP connections opened since ``before`` (inodes), the store's aside."""
    global _group_sockets
    _group_sockets = set()
    for inode, fd in _tcp_sockets().items():
        if inode not in before and (got := _tcp_sent(fd)) is not None \
                and got[1] and store_port not in got[1]:
            _group_sockets.add(inode)


def wire_bytes_sent():
    """Bytes this process has sent on gloo's connections so far, as the kernel counts
    them (data and gloo's own headers and notices); None where unknown (NCCL, a group
    this backend did not start, a kernel that does not count). Only the connections
    opened when the group started: not those of groups made later, nor a lazy gloo's."""
    if _group_sockets is None or not dist.is_initialized() or dist.get_backend() != 'gloo':
        return None
    total = 0
    for inode, fd in _tcp_sockets().items():
        if inode in _group_sockets and (got := _tcp_sent(fd)) is not None:
            total += got[0]
    return total


def my_gpu(local_rank, *wanted):
    """The GPU this worker takes (the first of ``wanted`` that is one, else its local rank
    among the GPUs it sees), made its current one, and its UUID; (None, '') without one.
    Where each task sees only its own GPU (Slurm's --gpus-per-task, a CUDA_VISIBLE_DEVICES
    per task) that is GPU 0 of every task. (Current before it is asked about: CUDA then
    makes this process's context there, not on GPU 0 of every process.)"""
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return None, ''
    gpus = [torch.device(d) for d in wanted if d is not None and torch.device(d).type == 'cuda']
    index = gpus[0].index if gpus else local_rank % torch.cuda.device_count()
    index = torch.cuda.current_device() if index is None else index
    torch.cuda.set_device(index)
    return index, str(torch.cuda.get_device_properties(index).uuid)


def choose(gpus):
    """('nccl' or 'gloo', why) from every worker's GPU UUID ('' for none), rank by rank.

    NCCL needs a GPU of its own for every worker: it refuses two processes on one GPU
    ('Duplicate GPU detected'). A GPU's UUID names the device itself, whatever number
    a process sees it under, so the same answer on every worker is: NCCL if the UUIDs
    are all there and all different, else gloo (which takes GPU tensors through the CPU,
    ``runtime/staging.py``)."""
    n, without, distinct = len(gpus), sum(1 for g in gpus if not g), len(set(gpus))
    if without == n:
        return 'gloo', 'CPU'
    if without:
        return 'gloo', f'CPU ({without} of {n} have no GPU)'
    if distinct < n:
        return 'gloo', (f'sharing {distinct} GPU{"s" if distinct > 1 else ""} (NCCL needs '
                        'one each): tensors go through the CPU')
    return 'nccl', 'each with its own GPU'


def agree_on_gpus(store, rank, size, uuid):
    """Every worker's GPU UUID, rank by rank, exchanged through the rendezvous store."""
    prefix = f'd2ldist/gpu/{started.restarts()}/'
    store.set(f'{prefix}{rank}', uuid or '-')
    return [v if v != '-' else '' for v in
            (store.get(f'{prefix}{r}').decode() for r in range(size))]


# -- hvd.join(): what each collective says first, as integers all-reduced with max -------
CALLS = ('allreduce_', 'reducescatter', 'broadcast_', 'allgather', 'barrier',
         'reduce_scatter_flat', 'all_gather_flat_', 'alltoall')
_DTYPES, _OPS = list(DTYPES.values()), list(ops.OPS.values())
ACTIVE, CALL, DTYPE, OP, ROOT, ROWS, ROW, SHAPE, FIRST, JOINED = range(10)  # JOINED: 1 a worker
UNSUPPORTED = len(_DTYPES)       # the DTYPE a worker says for a dtype that none can send


def unsupported(dtype):
    """Why a collective refuses ``dtype``, in one line."""
    return f'd2ldist collectives do not support {dtype}; use one of {", ".join(sorted(DTYPES))}'


def _said(call, size, tensor=None, op=None, root=0):
    """What a worker still training says before collective ``call``: its integers."""
    code = [0] * (JOINED + size)
    code[ACTIVE], code[CALL], code[ROOT] = 1, CALLS.index(call) + 1, root
    code[OP] = _OPS.index(op) if op is not None else 0
    if tensor is not None:      # (a dtype the collectives refuse: UNSUPPORTED, said first)
        code[DTYPE] = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else UNSUPPORTED
        code[ROWS], code[ROW] = tensor.shape[0] if tensor.dim() else 1, \
            math.prod(tensor.shape[1:])
        code[SHAPE] = row_shape_code(tensor)   # ([17, 1311], [17, 23, 57]: same ROW)
    return code


def _heard(code, size):
    """(call, its arguments) for a worker in join() from the max of all workers' codes:
    the ring's stand-in tensor (zeros, the op's identity, no rows) and the op or root."""
    call = CALLS[code[CALL] - 1]
    if call == 'barrier':
        return call, ()
    method, tensor, args = stand_in({
        'method': call, 'dtype': dtype_name(_DTYPES[code[DTYPE]]), 'root': code[ROOT],
        'shape': [code[ROWS], code[ROW]], 'op': _OPS[code[OP]].name}, size)
    return method, (tensor, *args)


def _disagreement(call, heard, low):
    """What the workers still training disagree on, from the max (``heard``) and min
    (``low``) of their codes; None if they agree (the rows of an allgather may differ)."""
    fields = [('collective', CALL), ('dtype', DTYPE), ('op', OP), ('root', ROOT),
              ('row size', ROW)] + \
        ([] if call in ('allgather', 'alltoall') else [('rows', ROWS)]) + [('shape', SHAPE)]
    names = {CALL: lambda i: CALLS[i - 1], DTYPE: lambda i: _DTYPES[i], OP: lambda i: _OPS[i].name}
    for what, i in fields:
        if heard[i] != low[i]:
            if i == SHAPE:
                return 'shape: the same number of values in other dimensions'
            show = names.get(i, str)
            return f'{what}: {show(low[i])} on one worker, {show(heard[i])} on another'
    return None


def _refuse_if_joined(what, heard):
    """Horovod's rule: no broadcast or allgather while a worker is in join()."""
    joined = [i for i, j in enumerate((heard or [])[JOINED:]) if j]
    if joined:
        raise RuntimeError(f'{what}: worker {joined[0]} has called join() (it is out of '
                           f'data): no {what} while a worker is in join(), as Horovod')


class TorchBackend:
    """The collectives on torch.distributed (gloo on CPU, NCCL on a GPU per worker).

    ``joinable``: each collective first says what it is, for workers in join() (the
    Horovod API's backend, ``backend.make``); the Trainer's store and benchmarks need not.
    """

    name = 'torch'

    def __init__(self, joinable=False, device=None):
        self.joinable = joinable
        # NCCL sums on one GPU of this worker: ``device`` if it is one (the Trainer's first:
        # its gradients then never cross GPUs), else the group's bound one, else my_gpu's
        # by local rank; made current also where another made the group (perhaps without
        # set_device: current_device() would be GPU 0 on every worker)
        gpu = None
        if not dist.is_initialized():
            gpu = self._start(device)
        elif dist.get_backend() == 'nccl':
            bound = getattr(dist.group.WORLD, 'bound_device_id', None)
            gpu, _ = my_gpu(started.local_rank(), device, bound)
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.device = torch.device('cuda', gpu) if dist.get_backend() == 'nccl' \
            else torch.device('cpu')

    def _start(self, device=None):
        """Meet the others (torch.distributed's env:// rendezvous), agree on NCCL or gloo
        from every worker's GPU, start the process group; rank 0 says what it chose. Its
        GPU's number (None without one)."""
        start = started.rendezvous_env()
        fail = config.get().hang_fail   # --hang-fail: a collective gives up after it
        timeout = timedelta(seconds=fail) if fail else None
        store, rank, size = next(dist.rendezvous(
            'env://', timeout=timeout or dist.constants.default_pg_timeout))
        gpu, uuid = my_gpu(start.local_rank, device)
        kind, why = choose(agree_on_gpus(store, rank, size, uuid))
        before = _tcp_sockets()
        dist.init_process_group(kind, store=dist.PrefixStore('default_pg', store),
                                rank=rank, world_size=size, timeout=timeout)
        _note_group_sockets(before, getattr(store, 'port', None))
        # Ours to end: a group left to the interpreter's finalization can abort the
        # process (gloo's threads still hold tensors; 'terminate called without an
        # active exception', seen on a loaded machine).
        atexit.register(_destroy)
        if rank == 0:
            say(f'torch backend ({kind}): {start.who}, {why}', err=True)
        return gpu

    def allreduce_(self, tensor, op):
        self._say('allreduce_', tensor, op=op)
        return self._allreduce_(tensor, op)

    def broadcast_(self, tensor, root):
        heard = self._say('broadcast_', tensor, root=root)
        if heard is not None and heard[JOINED + root]:
            raise RuntimeError(f'broadcast from worker {root}, which has called join() '
                               '(it is out of data): broadcast from a worker still training')
        _refuse_if_joined('broadcast', heard)
        return self._broadcast_(tensor, root)

    def allgather(self, tensor):
        _refuse_if_joined('allgather', self._say('allgather', tensor))
        return self._allgather(tensor)

    def alltoall(self, tensor, counts):
        _refuse_if_joined('alltoall', self._say('alltoall', tensor))
        return self._alltoall(tensor, counts)

    def reducescatter(self, tensor, op):
        self._say('reducescatter', tensor, op=op)
        return self._reducescatter(tensor, op)

    def reduce_scatter_flat(self, flat, op):
        """This worker's equal shard of the 1-D ``flat`` (numel a multiple of size) reduced
        over all workers."""
        _refuse_if_joined('reduce_scatter_flat', self._say('reduce_scatter_flat', flat, op=op))
        return self._reduce_scatter_flat(flat, op)

    def all_gather_flat_(self, flat, shard):
        """Fill the 1-D ``flat`` with every worker's ``shard``, in rank order."""
        _refuse_if_joined('all_gather_flat', self._say('all_gather_flat_', flat))
        return self._all_gather_flat_(flat, shard)

    def barrier(self):
        self._say('barrier')
        self._barrier()

    def _say(self, call, tensor=None, **args):
        """Tell workers in join() which collective comes (if joinable), refusing it on
        every worker if they disagree; what all said (max), or None."""
        if not self.joinable or self.size == 1:
            return None
        heard, low = self._tell(_said(call, self.size, tensor, **args))
        if tensor is not None and tensor.dtype not in _DTYPES:
            raise TypeError(unsupported(tensor.dtype))  # (the others heard it: refused there)
        if heard[DTYPE] == UNSUPPORTED:
            raise Disagree(f'{call.strip("_")}: another worker called it on a dtype d2ldist '
                           'collectives do not support; all must use one of '
                           f'{", ".join(sorted(DTYPES))}')
        differ = _disagreement(call, heard, low)
        if differ:            # all workers see it: all refuse the call, and go on in step
            raise Disagree(f'{call.strip("_")}: the workers called different collectives '
                           f'({differ}); they must call the same collectives in the same '
                           'order on tensors of the same shape and dtype')
        return heard

    def _tell(self, code):
        """All-reduce the integers of every worker's ``code``: (their max, their min over
        the workers still training), as lists; one all-reduce (max) of code and -code."""
        low = [-c for c in code] if code[ACTIVE] else [-(1 << 62)] * len(code)
        if config.get().hang_fail and dist.get_backend() == 'gloo':
            self._barrier()   # (every worker, joined or not, comes here: a late one is named)
        X = torch.tensor(code + low, dtype=torch.int64, device=self.device)
        dist.all_reduce(X, dist.ReduceOp.MAX)
        X = X.tolist()
        return X[:len(code)], [-x for x in X[len(code):]]

    def _allreduce_(self, tensor, op):
        with staged(tensor, self.device, self._wider(tensor.dtype)) as X:
            if tensor.dtype == torch.bool:   # no bool sums in gloo and NCCL: any / all
                dist.all_reduce(X, dist.ReduceOp.MIN if op in (ops.Min, ops.Product)
                                else dist.ReduceOp.MAX)
            else:
                dist.all_reduce(X, getattr(dist.ReduceOp, op.torch_name))
                ops.finish_(X, op, self.size)
        return tensor

    def _broadcast_(self, tensor, root):
        with staged(tensor, self.device, self._wider(tensor.dtype)) as X:
            dist.broadcast(X, root)
        return tensor

    def _wider(self, dtype):
        """The dtype to run in: bool as uint8, and int16 as int32 on gloo (it has none)."""
        if dtype == torch.bool:
            return torch.uint8
        if dtype == torch.int16 and dist.get_backend() == 'gloo':
            return torch.int32
        return dtype

    def _allgather(self, tensor):
        """all_gather needs equal shapes: gather the row counts, pad, gather, trim (rows
        flat: a worker in join() knows their size, not their shape)."""
        X = tensor.reshape(tensor.shape[0], math.prod(tensor.shape[1:])).to(
            self.device, self._wider(tensor.dtype))
        rows = torch.tensor([X.shape[0]], device=self.device)
        counts = [torch.zeros_like(rows) for _ in range(self.size)]
        dist.all_gather(counts, rows)
        counts = [int(c) for c in counts]
        padded = X.new_zeros((max(counts), *X.shape[1:]), device=self.device)
        padded[:X.shape[0]] = X
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded)
        out = torch.cat([p[:c] for p, c in zip(parts, counts)])
        return out.reshape(out.shape[0], *tensor.shape[1:]).to(tensor.device, tensor.dtype)

    def _alltoall(self, tensor, counts):
        """Rows ``counts[rank][j]`` to worker j and ``counts[i][rank]`` from worker i, by
        one all_to_all_single: each row crosses the network once, where an allgather (the
        ring's way) would send every row to every worker. Nothing is added up, so the
        rows travel as bytes, whatever their dtype."""
        row = math.prod(tensor.shape[1:]) * tensor.element_size()    # bytes
        X = tensor.to(self.device).contiguous().view(torch.uint8).view(tensor.shape[0], row)
        receives = [sends[self.rank] for sends in counts]
        out = X.new_empty((sum(receives), row))
        dist.all_to_all_single(out, X, receives, counts[self.rank])
        return out.view(tensor.dtype).view(out.shape[0], *tensor.shape[1:]).to(tensor.device)

    def _reducescatter(self, tensor, op):
        """This worker's rows (``even_slices`` of dim 0) of the reduction over all workers:
        gloo's by an all-to-all (``_scatter_reduce``); NCCL's by an all-reduce, then the
        rows (NCCL has no uneven reduce-scatter)."""
        slices = even_slices(tensor.shape[0], self.size)
        a, b = slices[self.rank]
        if dist.get_backend() != 'gloo':
            out = tensor.clone()
            self._allreduce_(out, op)
            return out[a:b].clone()
        X = tensor.to(self.device, self._wider(tensor.dtype)).contiguous()
        out = self._scatter_reduce(X, [hi - lo for lo, hi in slices], op, tensor.dtype)
        return out.to(tensor.device, tensor.dtype)

    def _reduce_scatter_flat(self, flat, op):
        """This worker's equal shard of the reduction (the sum, then Average's division):
        torch's reduce-scatter on NCCL, an all-to-all on gloo (``_scatter_reduce``)."""
        a, b = equal_shard(flat, self.rank, self.size)
        X = flat.to(self.device, self._wider(flat.dtype)).contiguous()
        if dist.get_backend() == 'gloo':
            out = self._scatter_reduce(X, [b - a] * self.size, op, flat.dtype)
        else:
            out = torch.empty(b - a, dtype=X.dtype, device=self.device)
            REDUCE_SCATTER(out, X, getattr(dist.ReduceOp, op.torch_name))
            ops.finish_(out, op, self.size)
        return out.to(flat.device, flat.dtype)

    def _scatter_reduce(self, X, counts, op, dtype):
        """A reduce-scatter with the bytes of a ring's: (N-1)/N of ``X`` sent. Worker j gets
        rows ``counts[j]`` of every worker's X by one all-to-all and reduces them here, in
        rank order. (gloo's own reduce_scatter all-reduces the whole X, then keeps the
        rows: twice the bytes, measured by ``wire_bytes_sent``.) ``dtype``: the caller's,
        which X may widen (bool as uint8: any, or all for Min and Product)."""
        if dtype == torch.bool:
            op = ops.Min if op in (ops.Min, ops.Product) else ops.Max
        mine = counts[self.rank]
        parts = X.new_empty((self.size * mine, *X.shape[1:]))
        dist.all_to_all_single(parts, X, [mine] * self.size, counts)
        parts = parts.view(self.size, mine, *X.shape[1:])
        out = parts[0].clone()
        for part in parts[1:]:          # worker 1's, then 2's, ...
            op.reduce_(out, part)
        return out if dtype == torch.bool else ops.finish_(out, op, self.size)

    def _all_gather_flat_(self, flat, shard):
        """torch's all-gather into one tensor (the shard copied: it may be a view of flat)."""
        equal_shard(flat, self.rank, self.size)
        with staged(flat, self.device, self._wider(flat.dtype)) as X:
            ALL_GATHER(X, shard.to(self.device, X.dtype, copy=True))
        return flat

    def _barrier(self):
        """With --hang-fail on gloo, rank 0 names the ranks that did not come (monitored
        barrier); otherwise a plain barrier."""
        fail = config.get().hang_fail
        if fail and dist.get_backend() == 'gloo':
            dist.monitored_barrier(timeout=timedelta(seconds=fail), wait_all_ranks=True)
        else:
            dist.barrier()

    def join(self):
        """hvd.join(), as RingBackend.join: until every worker has joined, take part in
        the others' collectives, told each by its ``_say``; returns the last to join."""
        if not self.joinable:
            raise RuntimeError('join() needs the Horovod API (d2ldist.join), not a '
                               "Trainer's 'torch' store")
        if self.size == 1:
            return 0
        code = [0] * (JOINED + self.size)
        code[FIRST], code[JOINED + self.rank] = self.rank + 1, 1   # (FIRST: only once)
        while True:
            try:
                heard, low = self._tell(code)
            except RuntimeError as e:      # (gloo: 'Connection closed by peer ...')
                raise RuntimeError('join(): a worker stopped while this one waited in it: '
                                   'every worker must call hvd.join() (torch.distributed: '
                                   f'{clip(str(e).strip().splitlines()[0], NAME)})') from None
            if not heard[ACTIVE]:         # all are here: the last came in this round
                return heard[FIRST] - 1
            code[FIRST] = 0
            if heard[DTYPE] == UNSUPPORTED:        # refused by the others: so by this one
                continue
            call, args = _heard(heard, self.size)
            if _disagreement(call, heard, low):    # the others refuse it: so does this one
                continue
            if call not in REFUSED:                 # (those fail on the others)
                getattr(self, '_' + call)(*args)
