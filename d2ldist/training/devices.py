"""Devices of one worker, and splitting a batch across them.

A worker (usually one machine) may drive several GPUs; each holds a replica of
the network and computes on its slice of the worker's batch. Without GPUs a
worker can still run several replicas on the CPU (``parse_devices('cpu:2')``),
so every step of the multi-device pipeline runs, and is tested, on a laptop.
"""
import torch

from ..runtime.split import even_sizes


def cpu() -> torch.device:
    """The CPU device."""
    return torch.device('cpu')


def indexed(device):
    """The device, a GPU by its number: torch.device('cuda') means the calling thread's
    current GPU, and backward's hooks run on threads each current on its own GPU."""
    device = torch.device(device)
    if device.type == 'cuda' and device.index is None:
        return torch.device('cuda', torch.cuda.current_device())
    return device


def try_gpu(i: int = 0) -> torch.device:
    """GPU i if it exists, else the CPU."""
    if torch.cuda.device_count() >= i + 1:
        return torch.device(f'cuda:{i}')
    return cpu()


def try_all_gpus() -> list[torch.device]:
    """All GPUs, or [cpu()] if there is none."""
    return [torch.device(f'cuda:{i}') for i in range(torch.cuda.device_count())] or [cpu()]


def parse_devices(spec: str) -> list[torch.device]:
    """Devices from a string: 'cpu', 'cpu:2' (two CPU replicas), 'gpu' (all GPUs), 'cuda:0,cuda:1'.

    Note that 'cpu:N' means N replicas on the CPU, not a device index.
    """
    spec = spec.strip()
    if spec == 'gpu':
        return try_all_gpus()
    if spec == 'cpu' or spec.startswith('cpu:'):
        count = spec[4:] or '1'
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"bad device list {spec!r}: 'cpu:N' needs a count N >= 1")
        return [cpu()] * int(count)
    devices = []
    for name in spec.split(','):
        name = name.strip()
        try:
            device = torch.device(name)
        except RuntimeError:
            raise ValueError(f'bad device {name!r} in {spec!r}: use cpu, cpu:N, gpu '
                             'or cuda:I,cuda:J') from None
        if device.type != 'cuda':
            raise ValueError(f'bad device {name!r} in {spec!r}: use cpu, cpu:N, gpu '
                             'or cuda:I,cuda:J')
        index = 0 if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise ValueError(f'device {name!r} does not exist '
                             f'({torch.cuda.device_count()} GPUs here)')
        devices.append(torch.device('cuda', index))
    return devices


def split_and_load(data: torch.Tensor, devices: list[torch.device]) -> list[torch.Tensor]:
    """Split data evenly along dim 0 into len(devices) slices, one on each device.

    n examples on k devices: every slice gets n // k examples, and the first
    n % k slices one more (``runtime/split.py``). CPU tensors bound for a GPU are
    pinned first, so the copies can run without blocking (asynchronously).
    """
    n, k = data.shape[0], len(devices)
    if n < k:
        raise ValueError(f'cannot split {n} examples across {k} devices')
    to_gpu = any(d.type == 'cuda' for d in devices)
    if to_gpu and data.device.type == 'cpu' and not data.is_pinned():
        data = data.pin_memory()
    return [part.to(device, non_blocking=device.type == 'cuda')
            for part, device in zip(torch.split(data, even_sizes(n, k)), devices)]
