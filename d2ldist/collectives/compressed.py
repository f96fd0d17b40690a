"""One all-reduce through compression: compress, reduce, decompress, on the communication thread.

    world.run(compressed.allreduce_, backend, X, ops.Sum, Compression.fp16)

Horovod's ``compression=`` (``api.py``, ``DistributedOptimizer``) and the Trainer's
stores (``training/stores.py``, a bucket of gradients) both hand their tensor here: it is
cast to 16 bits, reduced as it is (each hop of the ring adds in 16 bits, as Horovod's
Compression.fp16) and cast back into X. The caller's thread only queues it. Why the
values are scaled on the wire, and why a store hands a CUDA event:
docs/design/collectives.md.
"""
import torch


def allreduce_(backend, tensor, op, compression=None, after=None, prescale_factor=1.0,
               postscale_factor=1.0):
    """``tensor`` reduced over the workers in place by ``backend``, through ``compression``
    (None: as it is); first waits for the CUDA event ``after``, if any (the copies that
    fill ``tensor`` from a GPU). (Its name is the timeline's: 'allreduce'.)"""
    if after is not None:
        # This thread's current device is GPU 0 unless set, and cudaEventSynchronize sets
        # none: make the event's GPU current, or CUDA opens a context on GPU 0 for us.
        with torch.cuda.device(after.device):
            after.synchronize()      # the host waits until the copies have landed
    wire, ctx = compression.compress(tensor) if compression is not None else (tensor, None)
    scale_(wire, prescale_factor)
    backend.allreduce_(wire, op)
    scale_(wire, postscale_factor)
    return tensor.copy_(compression.decompress(wire, ctx)) if wire is not tensor else tensor


def scale_(tensor, factor):
    """tensor *= factor, in place; integers in float64, then cast back (Horovod's)."""
    if factor == 1.0:
        return tensor
    if tensor.is_floating_point():
        return tensor.mul_(factor)
    return tensor.copy_(tensor.double() * factor)
