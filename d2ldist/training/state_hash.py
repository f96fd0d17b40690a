"""The SHA-256 of a whole state, in one canonical order, whatever format holds it.

Each tensor whole, by name in sorted order: its name, dtype and shape as JSON, then its
bytes; then the plain values as JSON with sorted keys. d2ldist's own checkpoints
(``sharded_checkpoint.py``) and FSDP2's in DCP's format (``dcp_checkpoint.py``) print
it at save and at load: docs/design/sharded_checkpoints.md.
"""
import hashlib
import json

import torch


def state_sha256(tensors, values):
    """The SHA-256 of ``tensors`` ({name: (dtype name, shape, bytes)} or {name: tensor})
    and ``values`` (plain JSON)."""
    sha = hashlib.sha256()
    for key in sorted(tensors):
        dtype, shape, data = described(tensors[key])
        sha.update(json.dumps([key, dtype, list(shape)]).encode())
        sha.update(data)
    sha.update(json.dumps(values, sort_keys=True).encode())
    return sha.hexdigest()


def described(tensor):
    """(dtype name, shape, bytes) of a tensor; a triple as it is."""
    if isinstance(tensor, tuple):
        return tensor
    t = tensor.detach().cpu().contiguous()
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return str(t.dtype).removeprefix('torch.'), t.shape, data
