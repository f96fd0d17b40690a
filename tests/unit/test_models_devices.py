"""ResNet-18 for 32x32 inputs; devices and splitting a batch across them."""
import pytest
import torch

from d2ldist.training.devices import cpu, parse_devices, split_and_load, try_all_gpus, try_gpu
from d2ldist.training.models import resnet18


def test_resnet18_size_and_forward():
    net = resnet18(10)
    params = list(net.parameters())
    # d2l's blocks: every convolution has a bias; the 1x1 shortcuts have no BatchNorm.
    assert len(params) == 76 and sum(p.numel() for p in params) == 11_176_970
    assert net(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    small = resnet18(5, in_channels=1, width=8)
    assert small(torch.randn(2, 1, 32, 32)).shape == (2, 5)


def test_split_and_load_even_and_uneven():
    X = torch.arange(14.).view(7, 2)
    parts = split_and_load(X, [cpu(), cpu(), cpu()])
    assert [len(p) for p in parts] == [3, 2, 2]              # the first n % k get one more
    assert torch.equal(torch.cat(parts), X)
    assert [len(p) for p in split_and_load(X[:6], [cpu(), cpu()])] == [3, 3]
    with pytest.raises(ValueError, match='cannot split 1 examples across 2'):
        split_and_load(X[:1], [cpu(), cpu()])


def test_split_and_load_to_gpus_pins_and_copies():
    if not torch.cuda.is_available():
        pytest.skip('no GPU here')            # the CUDA path runs only where CUDA is
    parts = split_and_load(torch.ones(4, 3), try_all_gpus() * 2)
    assert all(p.device.type == 'cuda' for p in parts)


def test_parse_devices():
    assert parse_devices('cpu') == [cpu()]
    assert parse_devices('cpu:2') == [cpu(), cpu()]
    assert parse_devices('gpu') == try_all_gpus()
    assert try_gpu(torch.cuda.device_count()) == cpu()
    for bad in ('cpu:0', 'cpu:x', 'tpu', 'cuda:99'):
        with pytest.raises(ValueError):
            parse_devices(bad)
