"""Splitting n things into k parts as evenly as can be: the one rule d2ldist cuts by.

Every part gets n // k things, and the n % k left over go one each to the first parts:

    10 into 3  ->  sizes [4, 3, 3], slices [(0, 4), (4, 7), (7, 10)]

The ring's segments of a tensor (``collectives/ring.py``), the servers' slices of a big
value (``kv/placement.py``) and a batch's slices over the devices (``split_and_load``)
are all cut so. (A worker's part of the data set is not: ``SplitSampler``'s parts must
be of equal length, so it pads or drops the remainder instead.)
"""


def even_sizes(n, k):
    """The sizes of k parts of n: n // k each, and one more for each of the first n % k."""
    size, left_over = divmod(n, k)
    return [size + 1] * left_over + [size] * (k - left_over)


def even_slices(n, k):
    """The k parts of ``even_sizes(n, k)`` as (start, stop) over 0 .. n, in order."""
    slices, start = [], 0
    for size in even_sizes(n, k):
        slices.append((start, start + size))
        start += size
    return slices
