"""Where a key lives: the one rule that spreads a model over the servers (as in MXNet).

A value with fewer elements than the big-array bound lives whole on one server, picked
by a stable hash of its key, so many small keys spread evenly over the servers. A larger
value is cut into contiguous slices of its flattened elements, one slice per server, so
every server carries 1/n of its traffic: that is the O(m/n) of the chapter. The slices
are as even as can be (``runtime/split.py``: the first numel % n get one element more).

    key 'fc.weight', 2,000,000 elements, 2 servers  ->  [(0, 0, 1000000), (1, 1000000, 2000000)]
    key 'fc.bias',          10 elements, 2 servers  ->  [(1, 0, 10)]

Rows of a sparse key (``row_positions``) are found in those slices by the same
arithmetic on both sides, so a worker sends only row ids and the rows' values: row r
of a value with d elements per row is elements r*d .. (r+1)*d, and a row may straddle
two servers' slices, each getting its part.
"""
import zlib

from .. import config
from ..runtime.split import even_slices

DEFAULT_BIGARRAY_BOUND = 1_000_000


def bigarray_bound():
    """D2L_KVSTORE_BIGARRAY_BOUND, the size from which a value is split (default 10^6)."""
    bound = config.get().kvstore_bigarray_bound
    return DEFAULT_BIGARRAY_BOUND if bound is None else bound


def place(key: int | str, numel: int, num_servers: int,
          bound: int | None = None) -> list[tuple[int, int, int]]:
    """The parts of a value: a list of (server, start, stop) over its flattened elements."""
    bound = bigarray_bound() if bound is None else bound
    if numel < bound or num_servers == 1:
        # crc32 of the key's type and text: the same number in every process and run
        server = zlib.crc32(f'{type(key).__name__}:{key}'.encode()) % num_servers
        return [(server, 0, numel)]
    slices = even_slices(numel, num_servers)
    return [(s, start, stop) for s, (start, stop) in enumerate(slices) if start < stop]


def row_positions(rows, row_numel, start, stop):
    """The elements of ``rows`` (int64, increasing) inside the slice start..stop, in
    order, as (positions in the slice, mask over the rows' rows x row_numel elements)."""
    import torch                      # (this module stays light: servers import it first)
    elements = (rows.view(-1, 1) * row_numel + torch.arange(row_numel)).view(-1)
    mask = (elements >= start) & (elements < stop)
    return elements[mask] - start, mask
