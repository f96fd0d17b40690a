"""Tensors on the wire: a small JSON description in the header and one raw frame.

A tensor travels as {"dtype": "float32", "shape": [3, 4]} in the message header and
its bytes as one frame, without copies on either side. Only the dtypes listed here
are accepted from the network, and the description must match the frame's size.
"""
import torch


def dtype_name(dtype):
    """How a dtype is named on the wire: 'float32' for torch.float32."""
    return str(dtype).removeprefix('torch.')


# The dtypes d2ldist sends (the van, the parameter server, the ring), by their wire names
DTYPES = {dtype_name(dt): dt for dt in (
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)}


def pack(tensor):
    """Describe a CPU tensor and give its bytes without copying: (meta, frame)."""
    t = tensor.detach()
    if t.device.type != 'cpu':
        raise ValueError(f'the van sends CPU tensors, got one on {t.device}')
    t = t.contiguous()
    meta = {'dtype': dtype_name(t.dtype), 'shape': list(t.shape)}
    if t.numel() == 0:
        return meta, b''
    return meta, t.view(-1).view(torch.uint8).numpy().data


def unpack(meta, frame):
    """The tensor a (meta, frame) pair describes, sharing the frame's memory."""
    try:
        dtype, shape = DTYPES[meta['dtype']], [int(n) for n in meta['shape']]
    except (KeyError, TypeError, ValueError):
        raise ValueError(f'bad tensor description {meta!r}') from None
    numel = 1
    for n in shape:
        if n < 0:
            raise ValueError(f'bad tensor shape {shape}')
        numel *= n
    itemsize = torch.empty((), dtype=dtype).element_size()
    if numel * itemsize != len(frame):
        raise ValueError(f'{numel} x {dtype} does not fit a frame of {len(frame)} bytes')
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(frame, dtype=dtype).view(shape)
