"""Data split by worker: SplitSampler, CIFAR-10 from its own file format, the digits."""
import pickle

import numpy as np
import pytest
import torch

from d2ldist.training.data import (CIFAR10_MEAN, CIFAR10_STD, SplitSampler, load_data,
                          load_data_cifar10, load_data_digits)


def parts(length, num_parts, **kwargs):
    return [SplitSampler(length, num_parts, i, **kwargs) for i in range(num_parts)]


@pytest.mark.parametrize('length', [12, 13, 17])
@pytest.mark.parametrize('num_parts', [1, 2, 3, 5])
def test_padded_parts_are_equal_cover_everything_and_overlap_only_by_padding(length, num_parts):
    samplers = parts(length, num_parts)
    lists = [list(s) for s in samplers]
    assert {len(s) for s in samplers} == {len(l) for l in lists} == {-(-length // num_parts)}
    flat = [i for l in lists for i in l]
    assert set(flat) == set(range(length))                   # every example, every epoch
    assert len(flat) - len(set(flat)) == len(flat) - length < num_parts   # repeats: the padding


@pytest.mark.parametrize('length', [12, 13, 17])
@pytest.mark.parametrize('num_parts', [1, 2, 3, 5])
def test_dropped_tail_parts_are_equal_and_disjoint(length, num_parts):
    samplers = parts(length, num_parts, drop_last=True)
    lists = [list(s) for s in samplers]
    assert {len(s) for s in samplers} == {len(l) for l in lists} == {length // num_parts}
    flat = [i for l in lists for i in l]
    assert len(set(flat)) == len(flat) == num_parts * (length // num_parts)
    assert set(flat) <= set(range(length))


def test_reshuffles_per_epoch_identically_on_every_worker():
    a, b = SplitSampler(100, 2, 0, seed=3), SplitSampler(100, 2, 0, seed=3)
    other = SplitSampler(100, 2, 1, seed=3)
    epoch0 = list(a)
    assert epoch0 == list(a) == list(b)                      # same epoch: same order
    a.set_epoch(1)
    other.set_epoch(1)
    epoch1 = list(a)
    assert epoch1 != epoch0 and set(epoch1) != set(epoch0)   # new order, new examples
    assert set(epoch1).isdisjoint(other)                     # still disjoint from part 1
    assert sorted(list(SplitSampler(10, 2, 1, shuffle=False))) == [5, 6, 7, 8, 9]


def test_sampler_rejects_bad_parts():
    with pytest.raises(ValueError, match='part_index'):
        SplitSampler(10, 2, 2)
    with pytest.raises(ValueError, match='cannot split'):
        SplitSampler(1, 2, 0)


def write_cifar10(root, per_batch=4, num_test=6, seed=0):
    """Write a small data set in CIFAR-10's python format (what torchvision reads)."""
    rng = np.random.default_rng(seed)
    folder = root / 'cifar-10-batches-py'
    folder.mkdir(parents=True)
    images = {}
    names = [f'data_batch_{i}' for i in range(1, 6)] + ['test_batch']
    for name in names:
        n = num_test if name == 'test_batch' else per_batch
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)   # rows: R, G, B planes
        labels = [int(x) for x in rng.integers(0, 10, size=n)]
        with open(folder / name, 'wb') as f:
            pickle.dump({'batch_label': name, 'data': data, 'labels': labels,
                         'filenames': [f'{name}_{i}.png' for i in range(n)]}, f)
        images[name] = (data, labels)
    with open(folder / 'batches.meta', 'wb') as f:
        pickle.dump({'label_names': ['airplane', 'automobile', 'bird', 'cat', 'deer', 'dog',
                                     'frog', 'horse', 'ship', 'truck'],
                     'num_cases_per_batch': per_batch, 'num_vis': 3072}, f)
    return images


def test_cifar10_loader_reads_the_cifar10_file_format(tmp_path):
    images = write_cifar10(tmp_path)
    train_iter, test_iter = load_data_cifar10(2, tmp_path, num_parts=2, part_index=1,
                                              verify=False)
    assert len(train_iter.sampler) == 10 and len(train_iter) == 5     # 20 images / 2 workers
    X, y = next(iter(train_iter))
    assert X.shape == (2, 3, 32, 32) and X.dtype == torch.float32 and y.dtype == torch.int64
    # The test images come back unaugmented: undo the normalization, compare pixels.
    X_test, y_test = next(iter(test_iter))
    data, labels = images['test_batch']
    mean, std = torch.tensor(CIFAR10_MEAN).view(3, 1, 1), torch.tensor(CIFAR10_STD).view(3, 1, 1)
    pixels = torch.tensor(data[:2], dtype=torch.float32).view(2, 3, 32, 32) / 255
    assert torch.allclose(X_test * std + mean, pixels, atol=1e-5)
    assert y_test.tolist() == labels[:2]
    # Training images are augmented: each view is a 32x32 crop of the image
    # padded by 4 black pixels, maybe flipped; and the views differ.
    torch.manual_seed(0)
    views = [train_iter.dataset[0][0] * std + mean for _ in range(20)]
    assert len({v.numpy().tobytes() for v in views}) > 1
    raw = torch.tensor(images['data_batch_1'][0][0], dtype=torch.float32).view(3, 32, 32) / 255
    padded = torch.nn.functional.pad(raw, (4, 4, 4, 4))
    crops = [c for i in range(9) for j in range(9)
             for c in (padded[:, i:i + 32, j:j + 32], padded[:, i:i + 32, j:j + 32].flip(-1))]
    assert all(any(torch.allclose(v, c, atol=1e-5) for c in crops) for v in views)


def test_cifar10_loader_checks_files(tmp_path):
    with pytest.raises(FileNotFoundError, match='CIFAR-10 is not in'):
        load_data_cifar10(2, tmp_path)
    write_cifar10(tmp_path)
    with pytest.raises(RuntimeError, match='corrupted'):    # MD5 sums of the real files
        load_data_cifar10(2, tmp_path, verify=True)


def test_digits_loader_shapes_and_split():
    train_iter, test_iter = load_data_digits(64, num_parts=2, part_index=0)
    assert len(train_iter.sampler) == 750 and len(train_iter) == 750 // 64
    assert len(train_iter.dataset) == 1500 and len(test_iter.dataset) == 297
    X, y = next(iter(train_iter))
    assert X.shape == (64, 3, 32, 32) and y.shape == (64,)
    assert torch.equal(X[:, 0], X[:, 2])                      # gray, replicated
    X_all = train_iter.dataset.tensors[0]
    assert abs(float(X_all.mean())) < 1e-3 and abs(float(X_all.std()) - 1) < 1e-3
    assert set(test_iter.dataset.tensors[1].tolist()) == set(range(10))
    # The split is fixed: the same test set whatever the shuffling seed.
    other = load_data_digits(64, seed=5)[1]
    assert torch.equal(other.dataset.tensors[0], test_iter.dataset.tensors[0])


def test_load_data_uses_cifar10_when_on_disk_else_digits(tmp_path, capsys):
    train_iter, _ = load_data('auto', 4, root=tmp_path)
    assert 'digits' in capsys.readouterr().out and len(train_iter.dataset) == 1500
    write_cifar10(tmp_path)
    train_iter, _ = load_data('auto', 4, root=tmp_path, verify=False)
    assert 'CIFAR-10' in capsys.readouterr().out and len(train_iter.dataset) == 20
    with pytest.raises(ValueError, match='unknown data set'):
        load_data('mnist', 4)
