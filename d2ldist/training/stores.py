"""The store interface the Trainer talks to, and the stores that are all-reduces.

A *store* holds one value per key (one tensor per parameter of the network) and is
shared by all workers. What the Trainer needs of every store:

- ``rank``, ``num_workers``: this worker's place in the job;
- ``init(keys, values)`` then ``pull(keys, out=values)``: start from rank 0's values;
  ``init(keys, values, optimizer=False)`` for keys that are not weights (only summed);
- ``pushpull(keys, values, out)``: the sum over all workers into ``out``;
- optionally ``device`` (where it sums) and ``allreduce_async_(tensor, after)`` (start
  summing one bucket during backward; a handle to ``wait()`` on).

A store that runs the optimizer itself (a parameter server) also has
``set_optimizer``, ``push`` and ``pull`` (the two halves of a round), ``set_learning_rate``,
``is_async`` and ``init(keys, values, optimizer=False, compress=True)``. Each is spelled
out in docs/design/training.md.

The stores: ``d2ldist.kv.create(kind)`` for 'local' (one process) and the parameter
server ('dist_sync', 'dist_async', 'dist_sync_device'); here ``AllreduceStore`` for
'ring' (d2ldist's ring) and 'torch' (torch.distributed).
"""

import torch

from ..collectives import compressed, ops
from ..collectives.engine import Handle
from ..runtime.staging import staged
from ..runtime import compression


class AllreduceStore:
    """kvstore='ring' or 'torch': no servers; the workers all-reduce the gradients.

    'ring' is d2ldist's ring all-reduce (``d2ldist/collectives/ring.py``); 'torch' is
    ``torch.distributed.all_reduce`` on gloo (CPU) or NCCL (GPUs). Both sum the Trainer's
    flat gradient buffer in step 4; then every worker applies the same optimizer step to
    the same sum (step 5), as DistributedDataParallel does (why not DDP itself:
    docs/design/training.md). ``device``: the Trainer's first, where NCCL sums if a GPU.
    """

    def __init__(self, kind: str = 'ring', device: torch.device | None = None) -> None:
        from ..collectives import world
        if kind not in ('ring', 'torch'):
            raise ValueError(f"AllreduceStore runs 'ring' or 'torch', not {kind!r}")
        self.type = kind
        world.init()   # joins the job (the scheduler watches every worker's liveness)
        if kind == 'ring':
            if world.name() != 'ring':
                raise RuntimeError(f'kvstore ring: this worker already uses backend '
                                   f'{world.name()!r}')
            self._backend = world.backend()
            self._run = world.run        # on the communication thread, in order
        else:   # torch.distributed directly (it may run next to d2ldist's ring), here
            from ..collectives.torch_backend import TorchBackend
            self._backend = TorchBackend(device=device)
            self._run = lambda fn, *args: Handle.finished(fn(*args))
        self.rank, self.num_workers = self._backend.rank, self._backend.size
        # where it sums: the ring on the CPU; torch.distributed there too on gloo, on the
        # worker's GPU on NCCL (the Trainer's gradients then never leave it). The ring
        # alone has nothing to sum: None, the gradients stay where they are (on a GPU,
        # no copy down to the host and up again)
        if kind == 'torch':
            self.device = self._backend.device
        else:
            self.device = torch.device('cpu') if self.num_workers > 1 else None
        self._values = {}
        self._codec = None        # fp16 / bf16 on the wire (set_gradient_compression)
        self._plain = set()       # keys that are not gradients: never compressed
        self.gradient_compression = None

    def init(self, keys: list[int], values: list[torch.Tensor],
             optimizer: bool = True) -> None:
        """Give every worker rank 0's values (a broadcast), and remember them.

        (``optimizer=False``: not gradients, so never compressed; pushpull only sums.)
        """
        with staged(values, self.device or values[0].device) as flat:
            self._run(self._backend.broadcast_, flat, 0).wait()
        self._values.update(zip(keys, values))
        if not optimizer:
            self._plain.update(keys)

    def pull(self, keys: list[int], out: list[torch.Tensor]) -> None:
        """Copy the values (the same on every worker since init) into out."""
        for k, o in zip(keys, out):
            if o is not self._values[k]:
                o.copy_(self._values[k])

    def set_gradient_compression(self, compression_params: dict) -> None:
        """Gradients through 16 bits: ``{'type': 'fp16'}`` or ``'bf16'`` (each hop of the
        ring adds in 16 bits, as Horovod's Compression.fp16). 2-bit needs servers: a
        ring adds on the way, and a sum of codes is no code."""
        codec = compression.create(compression_params)
        if codec is not None and codec.name == '2bit':
            raise ValueError(f"2-bit compression needs a parameter server (kvstore "
                             f"'dist_sync'); kvstore {self.type!r} takes fp16 or bf16")
        self._codec, self.gradient_compression = codec, codec and codec.params

    def pushpull(self, keys: list[int], values: list[torch.Tensor],
                 out: list[torch.Tensor]) -> None:
        """Sum values over all workers into out: one all-reduce of the flat buffer
        (through the codec, unless the keys were made with ``optimizer=False``)."""
        codec = None if self._plain.intersection(keys) else self._codec
        with staged(values, self.device or values[0].device) as flat:
            self._run(compressed.allreduce_, self._backend, flat, ops.Sum, codec).wait()
        for v, o in zip(values, out):
            if o is not v:
                o.copy_(v)

    def allreduce_async_(self, tensor: torch.Tensor,
                         after: torch.cuda.Event | None = None) -> Handle:
        """Start summing a contiguous tensor of gradients over all workers, in place;
        ``.wait()`` for it.

        The Trainer starts one per bucket of gradients during backward. 'ring' runs it on
        the communication thread, so backward goes on meanwhile; 'torch' finishes it here.
        ``after``: a CUDA event recorded behind the copies that fill ``tensor`` from a
        GPU; the thread that sums waits for it, so backward's thread never does.
        """
        return self._run(compressed.allreduce_, self._backend, tensor, ops.Sum, self._codec,
                         after)

    def barrier(self) -> None:
        self._run(self._backend.barrier).wait()

    def reform(self) -> None:
        """After a change of the workers (elastic, 'ring'): the ring made anew, rank, size."""
        from ..collectives import world
        self._backend = world.backend()
        self.rank, self.num_workers = self._backend.rank, self._backend.size

    def __repr__(self):
        return f'<AllreduceStore {self.type}: worker {self.rank} of {self.num_workers}>'


STORES = ('local', 'dist_sync', 'dist_async', 'dist_sync_device', 'ring', 'torch', 'dist')


def create_store(kvstore: 'str | object', device: torch.device | None = None) -> object:
    """A store from a name ('local', 'dist_sync', 'ring', 'torch', ...), or the store itself
    (``device``: the Trainer's first, for 'torch').

    'local', 'dist_sync', 'dist_async', 'dist_sync_device' and MXNet's other names for
    them ('device', 'dist_device_sync', ...): ``d2ldist.kv.create`` (one process, or the
    parameter server); 'dist' means 'dist_sync'. 'ring' and 'torch': the workers
    all-reduce the gradients (``AllreduceStore``).
    """
    from ..kv.worker import ALIASES, REFUSED
    if not isinstance(kvstore, str):
        return kvstore
    if kvstore not in STORES + tuple(ALIASES) + tuple(REFUSED):
        raise ValueError(f'unknown kvstore {kvstore!r}: use one of {", ".join(STORES)}')
    if kvstore in ('ring', 'torch'):
        return AllreduceStore(kvstore, device)
    from .. import kv
    return kv.create('dist_sync' if kvstore == 'dist' else kvstore)
