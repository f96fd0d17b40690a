"""The store interface the Trainer talks to, and the stores that are all-reduces.

A *store* holds one value per key (here: one tensor per parameter of the
network, keys 0, 1, 2, ...) and is shared by all workers. What the Trainer needs:

- ``rank``, ``num_workers``: this worker's place in the job;
- ``init(keys, values)`` then ``pull(keys, out=values)``: start every worker
  from rank 0's values;
- ``pushpull(keys, values, out)``: push this worker's values and pull back the
  sum over all workers into ``out`` (an all-reduce; ``out`` may be ``values``).
  The Trainer's values are views of one flat CPU buffer, in key order
  (``trainer.flat_grads``), so a ring all-reduces that buffer at once;
- optionally ``allreduce_async_(tensor)``: start summing one slice of that buffer
  and return a handle to ``wait()`` on; the Trainer then starts the slices
  (buckets) during backward instead of calling ``pushpull``.

A store that can also run the optimizer itself (a parameter server does: the
servers update the weights they hold) has more; the Trainer then pushes
gradients and pulls back weights:

- ``set_optimizer(name, **hyper)``: the update rule, e.g. ``('sgd', lr=0.1)``
  (a name and numbers, so it can cross the network without pickling code);
- ``push(keys, values)`` and ``pull(keys, out)``: the two halves of a round,
  so that sending the gradients and waiting for the new weights are timed
  apart; ``pull`` returns the weights after all workers' gradients are applied;
- ``set_learning_rate(lr)``, for learning-rate schedules (optimizer states stay);
- ``is_async``: True if each worker's push updates the weights on its own
  (dist_async) instead of being summed with the others'.

The stores: ``d2ldist.kv.create(kind)`` for 'local' (one process) and the
parameter server ('dist_sync', 'dist_async', 'dist_sync_device'); here
``AllreduceStore`` for 'ring' (d2ldist's ring) and 'torch' (torch.distributed).
"""
import torch

OPTIMIZERS = {'sgd': 'SGD', 'adam': 'Adam', 'adamw': 'AdamW'}
# gluon's names for the same hyperparameters
GLUON_NAMES = {'learning_rate': 'lr', 'wd': 'weight_decay'}


def torch_hyper(params):
    """Hyperparameters with torch.optim's names (gluon's learning_rate, wd, beta1, beta2 too)."""
    params = {GLUON_NAMES.get(k, k): v for k, v in (params or {}).items()}
    if 'beta1' in params or 'beta2' in params:
        params['betas'] = (params.pop('beta1', 0.9), params.pop('beta2', 0.999))
    return params


def create_optimizer(name, params, tensors):
    """A torch.optim optimizer by name, e.g. ('sgd', {'lr': 0.1, 'momentum': 0.9}) over tensors.

    The fused implementation when torch has one for these tensors: one pass over the
    memory instead of one per operation (on a ResNet-18's 45 MB: 9 ms instead of 35).
    """
    if name.lower() not in OPTIMIZERS:
        raise ValueError(f'unknown optimizer {name!r}: use one of {sorted(OPTIMIZERS)}')
    cls, hyper = getattr(torch.optim, OPTIMIZERS[name.lower()]), torch_hyper(params)
    if 'fused' not in hyper and all(t.is_floating_point() for t in tensors):
        try:
            return cls(tensors, fused=True, **hyper)
        except (RuntimeError, ValueError, TypeError):   # no fused kernel for these
            pass
    return cls(tensors, **hyper)


class AllreduceStore:
    """kvstore='ring' or 'torch': no servers; the workers all-reduce the gradients.

    'ring' is d2ldist's ring all-reduce (``d2ldist/collectives/ring.py``);
    'torch' is ``torch.distributed.all_reduce`` on gloo (CPU) or NCCL (GPUs).
    Both sum the Trainer's flat gradient buffer in step 4; then every worker
    applies the same optimizer step to the same sum (step 5), so the weights
    stay identical without being sent. This is what DistributedDataParallel
    does too, and like DDP the Trainer starts all-reducing buckets of gradients
    while backward is still running (``allreduce_async_``). But DDP wraps one
    replica per process -- it cannot drive the several replicas of a worker the
    Trainer keeps. So 'torch' is torch.distributed's all-reduce in step 4, and
    ``benchmarks/train_throughput.py`` measures both against real DDP.
    """

    def __init__(self, kind='ring'):
        import d2ldist
        from .collectives import api
        if kind not in ('ring', 'torch'):
            raise ValueError(f"AllreduceStore runs 'ring' or 'torch', not {kind!r}")
        self.type = kind
        d2ldist.init()   # joins the job (the scheduler watches every worker's liveness)
        if kind == 'ring':
            if d2ldist._backend_name != 'ring':
                raise RuntimeError(f'kvstore ring: this worker already uses backend '
                                   f'{d2ldist._backend_name!r}')
            self._backend = api.backend()
            self._collective = api._submit   # on the communication thread, in order
        else:   # torch.distributed directly (it may run next to d2ldist's ring)
            from .collectives.torch_backend import TorchBackend
            self._backend = TorchBackend()
            self._collective = lambda method, *args: _Done(
                getattr(self._backend, method)(*args))
        self.rank, self.num_workers = self._backend.rank, self._backend.size
        self._values = {}

    def init(self, keys, values):
        """Give every worker rank 0's values (a broadcast), and remember them."""
        with _flat(values) as flat:
            self._collective('broadcast_', flat, 0).wait()
        self._values = dict(zip(keys, values))

    def pull(self, keys, out):
        """Copy the values (the same on every worker since init) into out."""
        for k, o in zip(keys, out):
            if o is not self._values[k]:
                o.copy_(self._values[k])

    def pushpull(self, keys, values, out):
        """Sum values over all workers into out: one all-reduce of the flat buffer."""
        from .collectives import ops
        with _flat(values) as flat:
            self._collective('allreduce_', flat, ops.Sum).wait()
        for v, o in zip(values, out):
            if o is not v:
                o.copy_(v)

    def allreduce_async_(self, tensor):
        """Start summing a contiguous tensor over all workers, in place; ``.wait()`` for it.

        The Trainer starts one per bucket of gradients during backward. 'ring' runs it on
        the communication thread, so backward goes on meanwhile; 'torch' finishes it here.
        """
        from .collectives import ops
        return self._collective('allreduce_', tensor, ops.Sum)

    def barrier(self):
        self._collective('barrier').wait()

    def __repr__(self):
        return f'<AllreduceStore {self.type}: worker {self.rank} of {self.num_workers}>'


class _Done:
    """A finished collective (what the communication thread's Handle gives)."""

    def __init__(self, result):
        self.result = result

    def wait(self):
        return self.result


class _flat:
    """``with _flat(values) as flat``: the one flat buffer ``values`` are views of, in order
    (the Trainer's case: no copy), else a concatenated copy, written back afterwards."""

    def __init__(self, values):
        self.values = values
        base = values[0]._base if values and values[0]._base is not None else None
        offset = 0
        for v in values:
            if base is None or v._base is not base or not v.is_contiguous() \
                    or v.data_ptr() != base.data_ptr() + offset * base.element_size():
                base = None
                break
            offset += v.numel()
        self.base = base if base is not None and offset == base.numel() \
            and base.dim() == 1 and base.is_contiguous() else None

    def __enter__(self):
        if self.base is not None:
            return self.base
        self.copy = torch.cat([v.detach().reshape(-1).cpu() for v in self.values])
        return self.copy

    def __exit__(self, *exc):
        if self.base is None and exc[0] is None:
            for v, c in zip(self.values, self.copy.split([v.numel() for v in self.values])):
                v.copy_(c.view_as(v))
        return False
