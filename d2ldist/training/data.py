"""Data for data-parallel training: one part of every epoch per worker.

In data parallelism each worker reads a *different* part of the data. We do not
split the data by the number of devices but by the number of workers (usually
machines); each worker then splits its own batches across its devices
(``split_and_load``). Every part must have the same length: in synchronous
training a worker that runs out of batches early would leave the others waiting
at the next push for a gradient that never comes.

Data sets:
- ``load_data_cifar10``: CIFAR-10 through torchvision, from files on disk;
- ``load_data_digits``: scikit-learn's bundled 8x8 digits (1797 images, no
  network needed) scaled to 3x32x32, so that the same ResNet-18 trains on them;
- ``load_data``: CIFAR-10 when it is on disk, the digits otherwise.
"""
import os
import random

import torch
from torch.utils import data

CIFAR10_MEAN, CIFAR10_STD = [0.4914, 0.4822, 0.4465], [0.2023, 0.1994, 0.2010]
CIFAR10_FILES = ['data_batch_1', 'data_batch_2', 'data_batch_3', 'data_batch_4',
                 'data_batch_5', 'test_batch', 'batches.meta']


class SplitSampler:
    """Sample the part `part_index` of `num_parts` equal parts of a data set.

    Every epoch all workers draw the same random permutation of all ``length``
    indices (the seed is ``seed + epoch``, so call ``set_epoch`` before each
    epoch), and worker ``part_index`` takes the slice ``[start, end)`` of it.
    So the parts are disjoint, and each epoch gives every worker new examples.

    When ``length`` is not a multiple of ``num_parts`` an even split
    (``runtime/split.py``) would give parts that differ by one example. We keep
    them equal instead, in one of two ways:
    - ``drop_last=False`` (default): the permutation is padded by wrapping
      around to its start, so every example is seen each epoch and at most
      ``num_parts - 1`` examples are seen twice;
    - ``drop_last=True``: the tail of the permutation is dropped, so at most
      ``num_parts - 1`` examples (different ones each epoch) are skipped.
    """

    def __init__(self, length: int, num_parts: int = 1, part_index: int = 0,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        if not 0 <= part_index < num_parts:
            raise ValueError(f'part_index must be in [0, {num_parts}), got {part_index}')
        if length < num_parts:
            raise ValueError(f'cannot split {length} examples into {num_parts} parts')
        self.length, self.num_parts, self.part_index = length, num_parts, part_index
        self.shuffle, self.seed, self.drop_last, self.epoch = shuffle, seed, drop_last, 0
        if drop_last:
            self.part_len = length // num_parts
        else:
            self.part_len = (length + num_parts - 1) // num_parts
        self.start = self.part_len * part_index
        self.end = self.start + self.part_len
        self.skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """Use the permutation of this epoch (the same on every worker); ``skip``: leave
        out the first examples of this worker's part (a job resumed in mid-epoch)."""
        if not 0 <= skip <= self.part_len:
            raise ValueError(f'skip must be in [0, {self.part_len}], got {skip}')
        self.epoch, self.skip = epoch, skip

    def __iter__(self):
        indices = list(range(self.length))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(indices)
        total = self.part_len * self.num_parts
        indices += indices[:total - self.length]   # pad by wrapping (no-op if dropping)
        return iter(indices[self.start + self.skip:self.end])

    def __len__(self):
        return self.part_len - self.skip


def _train_loader(dataset, batch_size, num_parts, part_index, seed, num_workers,
                  pin_memory):
    """A loader over this worker's part; the short last batch is dropped.

    Dropping it keeps the number of batches per epoch equal on every worker
    and avoids a batch of one example, which BatchNorm cannot normalize.
    """
    sampler = SplitSampler(len(dataset), num_parts, part_index, shuffle=True, seed=seed)
    if len(sampler) < batch_size:
        raise ValueError(f'batch size {batch_size} is larger than this worker\'s '
                         f'part of the data ({len(sampler)} examples)')
    return data.DataLoader(dataset, batch_size, sampler=sampler, drop_last=True,
                           num_workers=num_workers, pin_memory=pin_memory)


def cifar10_on_disk(root):
    """Whether the CIFAR-10 files (python version) are in root/cifar-10-batches-py."""
    folder = os.path.join(os.path.expanduser(root), 'cifar-10-batches-py')
    return all(os.path.isfile(os.path.join(folder, f)) for f in CIFAR10_FILES)


def load_data_cifar10(batch_size: int, root: str = '../data', num_parts: int = 1,
                      part_index: int = 0, download: bool = False, verify: bool = True,
                      seed: int = 0, num_workers: int = 0,
                      pin_memory: bool = False) -> tuple[data.DataLoader, data.DataLoader]:
    """CIFAR-10 as (train_iter, test_iter); the train set is split into parts.

    Training images are augmented as in d2l: a random 32x32 crop of the image
    padded by 4 pixels, a random horizontal flip; both sets are normalized per
    channel. ``verify=False`` skips torchvision's MD5 check of the files (for
    small sets written in CIFAR-10's format, as the tests do). Note that the
    files are Python pickles: load only files you trust, never received ones.
    """
    transforms = _torchvision().transforms
    normalize = transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD)
    transform_train = transforms.Compose([
        transforms.RandomCrop(32, padding=4),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), normalize])
    transform_test = transforms.Compose([transforms.ToTensor(), normalize])
    root = os.path.expanduser(root)
    if not download and not cifar10_on_disk(root):
        raise FileNotFoundError(f'CIFAR-10 is not in {root}/cifar-10-batches-py '
                                '(pass download=True to fetch it)')
    cifar10 = _torchvision().datasets.CIFAR10 if verify else _unchecked_cifar10()
    train_ds = cifar10(root, train=True, transform=transform_train, download=download)
    test_ds = cifar10(root, train=False, transform=transform_test)
    train_iter = _train_loader(train_ds, batch_size, num_parts, part_index, seed,
                               num_workers, pin_memory)
    test_iter = data.DataLoader(test_ds, batch_size, shuffle=False,
                                num_workers=num_workers, pin_memory=pin_memory)
    return train_iter, test_iter


def _torchvision():
    """torchvision, which only CIFAR-10 needs: the extra d2ldist[vision]; without it, say so."""
    try:
        import torchvision
    except ImportError:
        raise ImportError("CIFAR-10 is read through torchvision, which is not installed: "
                          "pip install 'd2ldist[vision]'") from None
    return torchvision


def _unchecked_cifar10():
    """torchvision's CIFAR10 with the MD5 sums removed (the files must still exist)."""
    torchvision = _torchvision()

    class UncheckedCIFAR10(torchvision.datasets.CIFAR10):
        train_list = [[name, None] for name, _ in torchvision.datasets.CIFAR10.train_list]
        test_list = [[name, None] for name, _ in torchvision.datasets.CIFAR10.test_list]
        meta = dict(torchvision.datasets.CIFAR10.meta, md5=None)

    return UncheckedCIFAR10


def digits_tensors(num_test=297, seed=0):
    """scikit-learn's digits as normalized 3x32x32 tensors: (X_train, y_train, X_test, y_test).

    The 8x8 images (gray levels 0..16) are scaled up 4x with bilinear
    interpolation, normalized with the mean and standard deviation of the
    training images, and repeated over 3 channels. The split into 1500
    training and 297 test images is a fixed random permutation by `seed`.
    """
    from sklearn.datasets import load_digits
    digits = load_digits()
    X = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16
    X = torch.nn.functional.interpolate(X, size=(32, 32), mode='bilinear',
                                        align_corners=False)
    y = torch.tensor(digits.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    test_idx, train_idx = perm[:num_test], perm[num_test:]
    mean, std = X[train_idx].mean(), X[train_idx].std()
    X = ((X - mean) / std).expand(-1, 3, -1, -1).contiguous()
    return X[train_idx], y[train_idx], X[test_idx], y[test_idx]


def load_data_digits(batch_size: int, num_parts: int = 1, part_index: int = 0, seed: int = 0,
                     num_test: int = 297,
                     pin_memory: bool = False) -> tuple[data.DataLoader, data.DataLoader]:
    """The digits as (train_iter, test_iter) of 3x32x32 images; the train set is split.

    The train/test split is fixed (seed 0); `seed` only seeds the shuffling.
    """
    X_train, y_train, X_test, y_test = digits_tensors(num_test, seed=0)
    train_iter = _train_loader(data.TensorDataset(X_train, y_train), batch_size,
                               num_parts, part_index, seed, 0, pin_memory)
    test_iter = data.DataLoader(data.TensorDataset(X_test, y_test), batch_size,
                                shuffle=False, pin_memory=pin_memory)
    return train_iter, test_iter


def load_data(name: str, batch_size: int, root: str = '../data', num_parts: int = 1,
              part_index: int = 0, verbose: bool = True,
              **kwargs: object) -> tuple[data.DataLoader, data.DataLoader]:
    """Load 'cifar10', 'digits', or 'auto' (CIFAR-10 when it is on disk, else the digits)."""
    if name == 'auto':
        name = 'cifar10' if cifar10_on_disk(root) else 'digits'
    if name == 'cifar10':
        loaded = load_data_cifar10(batch_size, root, num_parts, part_index, **kwargs)
        where = f'CIFAR-10 from {os.path.expanduser(root)}'
    elif name == 'digits':
        loaded = load_data_digits(batch_size, num_parts, part_index, **kwargs)
        where = "scikit-learn's digits (8x8 scaled to 3x32x32)"
    else:
        raise ValueError(f"unknown data set {name!r}: use 'cifar10', 'digits' or 'auto'")
    if verbose:
        train_iter, test_iter = loaded
        print(f'data: {where}, {len(train_iter.sampler)} training examples on this '
              f'worker (part {part_index + 1} of {num_parts}), '
              f'{len(test_iter.dataset)} test examples', flush=True)
    return loaded
