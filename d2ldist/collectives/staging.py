"""Staging: what a collective is given, as the one flat tensor it runs on, and back.

A collective runs on one 1-D contiguous tensor of one dtype on one device: the ring on
CPU memory (it sends the bytes), torch.distributed on gloo's CPU or NCCL's GPU memory, in
a dtype the backend has. What it is given differs only in how far it is from that: one
tensor of any shape, perhaps not contiguous, perhaps on a GPU (``d2ldist.allreduce_``); or
a list of tensors (the Trainer's gradients, views that lie back to back in one flat
buffer; the parameters ``broadcast_parameters`` sends). So one helper serves them all:
``staged(tensors, device, dtype)`` gives their own memory when it already is that flat
tensor -- the common case, no copy -- and otherwise a copy, written back afterwards.
"""
import torch


class staged:
    """``with staged(tensors, device, dtype) as flat``: the tensors' elements in order as one
    1-D contiguous tensor on ``device`` (of ``dtype``, default theirs); a copy if need be,
    written back into the tensors at the end (not after an error)."""

    def __init__(self, tensors, device, dtype=None):
        self.tensors = [tensors] if torch.is_tensor(tensors) else list(tensors)
        self.device = torch.device(device)
        self.dtype = dtype or self.tensors[0].dtype

    def __enter__(self):
        self.flat = _back_to_back(self.tensors, self.device, self.dtype)
        self.copied = self.flat is None
        if self.copied:
            # to the CPU from a GPU: through pinned memory, so both copies run asynchronously
            self.pinned = self.device.type == 'cpu' and any(t.is_cuda for t in self.tensors)
            self.flat = torch.empty(sum(t.numel() for t in self.tensors), dtype=self.dtype,
                                    device=self.device, pin_memory=self.pinned)
            for t, part in zip(self.tensors, self._parts()):
                part.copy_(t.detach(), non_blocking=self.pinned)
            for d in {t.device for t in self.tensors if self.pinned and t.is_cuda}:
                torch.cuda.current_stream(d).synchronize()   # the collective reads it next
        return self.flat

    def __exit__(self, *exc):
        if self.copied and exc[0] is None:
            with torch.no_grad():
                for t, part in zip(self.tensors, self._parts()):
                    t.copy_(part, non_blocking=self.pinned and t.is_cuda)
        return False

    def _parts(self):
        """Each tensor's place in ``flat``, shaped like it."""
        offsets = [0]
        for t in self.tensors:
            offsets.append(offsets[-1] + t.numel())
        return [self.flat[a:b].view(t.shape)
                for t, a, b in zip(self.tensors, offsets, offsets[1:])]


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
