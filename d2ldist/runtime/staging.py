"""Staging: tensors copied between GPUs and host memory, and into the flat tensor a
collective runs on.

A copy between a GPU and host memory runs asynchronously (``non_blocking=True``: the
host goes on while the GPU's copy engine moves the bytes) only if the host memory is
*pinned* (page-locked). The host must then wait for the copy before it reads that
memory, or writes what the copy still reads. ``buffer`` makes such memory, ``copy_``
copies so and waits. Three places stage through them: the Trainer's flat buffers
(step 3 lands in pinned memory), the key-value store's worker (GPU values pushed and
pulled through pinned buffers), and ``staged``, below.

A collective runs on one 1-D contiguous tensor of one dtype on one device: the ring on
CPU memory (it sends the bytes), torch.distributed on gloo's CPU or NCCL's GPU memory, in
a dtype the backend has. What it is given differs only in how far it is from that: one
tensor of any shape, perhaps not contiguous, perhaps on a GPU (``d2ldist.allreduce_``); or
a list of tensors (the Trainer's gradients, views that lie back to back in one flat
buffer; the parameters ``broadcast_parameters`` sends). So one helper serves them all:
``staged(tensors, device, dtype)`` gives their own memory when it already is that flat
tensor -- the common case, no copy -- and otherwise a copy, written back afterwards.
"""
from contextlib import contextmanager

import torch


def buffer(shape, dtype, device='cpu', gpu=True):
    """An uninitialized tensor on ``device``; in host memory pinned if ``gpu`` (a GPU
    copies to or from it) and there is CUDA, so that those copies do not block."""
    device = torch.device(device)
    pin = gpu and device.type == 'cpu' and torch.cuda.is_available()
    return torch.empty(shape, dtype=dtype, device=device, pin_memory=pin)


@torch.no_grad()
def copy_(outs, tensors, wait=True):
    """Copy each tensor into its out: without blocking between a GPU and pinned memory;
    ``wait``: until those copies have landed (before the host uses the pinned memory)."""
    landing = set()   # the GPUs whose copies may still run
    for out, t in zip(outs, tensors):
        gpu, host = (t, out) if t.is_cuda else (out, t)
        non_blocking = gpu.is_cuda and not host.is_cuda and host.is_pinned()
        out.copy_(t, non_blocking=non_blocking)
        if non_blocking:
            landing.add(gpu.device)
    for device in landing if wait else ():
        landed(device)


def landed(device):
    """The host waits until the copies this thread queued on ``device`` (a GPU: its current
    stream, where ``copy_`` queues them) have landed; on the CPU, nothing to wait for."""
    device = torch.device(device)
    if device.type == 'cuda':
        torch.cuda.current_stream(device).synchronize()


@contextmanager
def staged(tensors, device, dtype=None):
    """``with staged(tensors, device, dtype) as flat``: the tensors' elements in order as one
    1-D contiguous tensor on ``device`` (of ``dtype``, default theirs); a copy if need be,
    written back into the tensors at the end (not after an error)."""
    tensors = [tensors] if torch.is_tensor(tensors) else list(tensors)
    device, dtype = torch.device(device), dtype or tensors[0].dtype
    flat = _back_to_back(tensors, device, dtype)
    if flat is not None:                  # their own memory: nothing to copy
        yield flat
        return
    # to the CPU from a GPU: through pinned memory, both ways
    flat = buffer(sum(t.numel() for t in tensors), dtype, device,
                  gpu=any(t.is_cuda for t in tensors))
    parts = _places(flat, tensors)
    copy_(parts, tensors)                 # (waits: the collective reads it next)
    yield flat
    # back to a GPU: no waiting (the allocator keeps the pinned copy until the copy has
    # run); back to host memory: the caller reads it next
    copy_(tensors, parts, wait=flat.is_cuda)


def _places(flat, tensors):
    """Each tensor's place in ``flat``, shaped like it."""
    offsets = [0]
    for t in tensors:
        offsets.append(offsets[-1] + t.numel())
    return [flat[a:b].view(t.shape) for t, a, b in zip(tensors, offsets, offsets[1:])]


def _back_to_back(tensors, device, dtype):
    """One 1-D view of the tensors' memory if they are contiguous, of ``dtype``, on
    ``device`` and lie back to back in one storage; else None."""
    first, end = tensors[0], tensors[0].data_ptr()
    storage = first.untyped_storage().data_ptr()
    for t in tensors:
        if t.device != device or t.dtype != dtype or not t.is_contiguous() \
                or t.data_ptr() != end or t.untyped_storage().data_ptr() != storage:
            return None
        end += t.numel() * t.element_size()
    # as_strided: a contiguous tensor of one element may carry any stride
    return first.detach().as_strided((sum(t.numel() for t in tensors),), (1,))
