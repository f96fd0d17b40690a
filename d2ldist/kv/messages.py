"""What workers and servers of the key-value store say to each other.

Every request carries an ``id`` that its answer repeats, and a list of ``parts``:

    [key, dtype, shape, start, stop]   # elements start..stop of the flattened value of key

with, for INIT and PUSH, one data frame per part (the raw bytes of those elements).
A list of keys travels as ONE message per server, not one per key. A compressed PUSH
says how (``codec``: {'type': '2bit', 'threshold': 0.5}) and which parts (``coded``:
their indices); their frames hold the codec's bytes (``runtime/compression.py``).

A sparse key's rows travel as ``[key, dtype, shape, start, stop, count]`` with two frames
per part: the row ids (int64) and, for a push, the ``count`` values of those rows that
lie in the slice (``placement.row_positions`` says which); the answer to a PULL_ROWS
sends only the values.

Inside a program a part is a record, ``Part`` or (a sparse key's rows) ``RowPart``:
``head()`` writes the list a header carries, ``read_parts`` and ``read_row_parts`` read
it back, checked, so that workers and servers name the fields instead of counting them.

Where a server's answers to a worker would cross a socket, the worker offers it a stream
(``LINK``, runtime/stream.py) and the server sends its VALUES of whole slices on it: their
frames arrive ``Pending``, and the worker reads each straight into ``out``.
"""
import math
from typing import Any, NamedTuple

from .. import lines
from ..runtime import compression, stream, wire

INIT = 'kv_init'            # worker -> server: parts + frames, {optimizer}: initial values
PUSH = 'kv_push'            # worker -> server: parts + frames, {sync, pull}: gradients
PULL = 'kv_pull'            # worker -> server: parts: please send these values
OPTIMIZER = 'kv_optimizer'  # worker -> server: {name, hyper}: update on the server
LEARNING_RATE = 'kv_lr'     # worker -> server: {lr}: a new learning rate, states kept
INFO = 'kv_info'            # worker -> server: what do you hold?
GET_STATE = 'kv_get_state'  # worker -> server: your optimizer states (a checkpoint)
SET_STATE = 'kv_set_state'  # worker -> server: entries + frames: restore states
PUSH_ROWS = 'kv_push_rows'  # worker -> server: row parts + frames, {sync}: sparse gradients
PULL_ROWS = 'kv_pull_rows'  # worker -> server: row parts + row ids: please send these rows
ACK = 'kv_ack'              # server -> worker: done (and maybe a few header fields)
VALUES = 'kv_values'        # server -> worker: parts + frames: the values asked for
ERROR = 'kv_error'          # server -> worker: {error}: the request was refused
LINK = 'kv_link'            # worker -> server: {offer}: send your VALUES on this stream
HELLO = 'kv_hello'          # worker -> server: {address, host_id}: I join a running job
REPLICATE = 'kv_replicate'  # holder -> the next in its shard's chain: {shard, number,
                            #   change: a kind below or of REQUESTS, its fields} + frames
REPLICATED = 'kv_replicated'  # holder -> the one before: {shard, number}: I, and all
                            #   after me, have every change up to number
UPDATE = 'kv_update'        # a change: parts + their sums (+ row positions), {numbers:
                            #   [[worker, n]] the pushes counted, accumulate}: a round closed
REQUESTS = (INIT, PUSH, PULL, OPTIMIZER, LEARNING_RATE, INFO, GET_STATE, SET_STATE,
            PUSH_ROWS, PULL_ROWS)
ANSWERS = (ACK, VALUES, ERROR)

MAX_PARTS = 1000            # a longer list is sent as several messages (header <= 64 KB)


class KVError(ValueError):
    """A request the key-value store refuses: unknown key, wrong shape or dtype."""


class Part(NamedTuple):
    """Elements start..stop of the flattened value of ``key``, and their tensor, if any."""
    key: Any               # an int or a short string (check_key)
    dtype: str             # a name of wire.DTYPES: 'float32'
    shape: list            # the whole value's shape
    start: int
    stop: int
    value: Any = None      # a PUSH's, INIT's or VALUES' elements; None in a PULL
    positions = None       # (not a field) which elements: all of them

    def head(self):
        """The part as a header carries it: [key, dtype, shape, start, stop]."""
        return [self.key, self.dtype, list(self.shape), self.start, self.stop]


class RowPart(NamedTuple):
    """Some rows of a sparse key, within elements start..stop of its flattened value."""
    key: Any
    dtype: str
    shape: list
    start: int
    stop: int
    positions: Any         # the rows' elements in the slice (int64, increasing)
    value: Any = None      # those elements (a PUSH_ROWS', a VALUES'); None in a PULL_ROWS

    def head(self):
        """The part as a header carries it: [key, dtype, shape, start, stop, count]."""
        return [self.key, self.dtype, list(self.shape), self.start, self.stop,
                int(self.positions.numel())]


def keys_of(parts):
    """The keys of a header's parts, unchecked: to name a request in a message."""
    return [p[0] for p in parts if isinstance(p, list) and p]


def describe(dtype, shape):
    """'float32[3, 4]': how errors name a value."""
    return f'{dtype}{list(shape)}'


def check_key(key):
    """A key is an int or a short string (anything else came from a confused sender)."""
    if isinstance(key, bool) or not isinstance(key, (int, str)) or \
            (isinstance(key, str) and len(key) > 256):
        raise KVError(lines.clip(f'a key must be an int or a string, got {key!r}', lines.NAME))
    return key


def check_held(parts, store, what):
    """Refuse keys never initialised, and shapes, dtypes or slices that differ from the
    server's ``store`` (key -> its slot: dtype, shape, start, stop)."""
    for p in parts:
        slot = store.get(p.key)
        if slot is None:
            raise KVError(f'key {p.key!r} was never initialised (call kv.init first)')
        if (p.dtype, p.shape) != (slot.dtype, slot.shape):
            raise KVError(f'key {p.key!r}: {what} {describe(p.dtype, p.shape)} but the '
                          f'key holds {describe(slot.dtype, slot.shape)}')
        if (p.start, p.stop) != (slot.start, slot.stop):
            raise KVError(f'key {p.key!r}: elements {p.start}..{p.stop} are not the '
                          f'slice {slot.start}..{slot.stop} this server holds')


def data(tensors):
    """The tensors' memory as the van sends it (no copy)."""
    return [t.numpy().data if t.numel() else b'' for t in tensors]


def _fields(p, extra=0):
    """A part's fields, checked: key, dtype, shape (a list of ints), start, stop and
    ``extra`` more ints (a row part's count)."""
    try:
        key, dtype, shape, start, stop, *more = p
        shape = [int(n) for n in shape]
        start, stop, more = int(start), int(stop), [int(x) for x in more]
    except (TypeError, ValueError):
        raise KVError(lines.clip(f'malformed part {p!r}', lines.NAME)) from None
    check_key(key)
    if not 0 <= start <= stop or dtype not in wire.DTYPES or len(more) != extra:
        raise KVError(lines.clip(f'malformed part {p!r}', lines.NAME))
    return (key, dtype, shape, start, stop, *more)


def _tensor(key, dtype, numel, frame):
    """The frame as a tensor; a frame still in its stream (Pending) only checked."""
    if isinstance(frame, stream.Pending):
        if frame.nbytes != numel * wire.DTYPES[dtype].itemsize:
            raise KVError(f'key {key!r}: {numel} x {dtype} does not fit a frame of '
                          f'{frame.nbytes} bytes')
        return frame
    try:
        return wire.unpack({'dtype': dtype, 'shape': [numel]}, frame)
    except ValueError as e:
        raise KVError(f'key {key!r}: {e}') from None


def _codec(msg, coded):
    """The codec of a message's ``coded`` parts (None if none is coded), checked."""
    try:
        codec = compression.create(msg.get('codec')) if coded else None
    except ValueError as e:
        raise KVError(str(e)) from None
    if coded and (codec is None or not isinstance(coded, list)):
        raise KVError('malformed request: coded parts without a codec')
    return codec


def _decoded(codec, key, dtype, numel, frame):
    """A coded part's frame, decoded into a tensor."""
    try:
        return codec.decode(frame, numel, wire.DTYPES[dtype])
    except ValueError as e:
        raise KVError(f'key {key!r}: {e}') from None


def read_parts(msg, with_frames):
    """The parts of a received message as ``Part``s, their ``value`` the frame's tensor
    (or None); the parts listed in ``coded`` are decoded with the message's ``codec``."""
    parts, coded = msg.get('parts'), msg.get('coded') or []
    if not isinstance(parts, list) or (with_frames and len(parts) != len(msg.frames)):
        raise KVError('malformed request: parts do not match the frames')
    codec = _codec(msg, coded)
    out = []
    for i, p in enumerate(parts):
        key, dtype, shape, start, stop = _fields(p)
        value = None
        if with_frames and i in coded:
            value = _decoded(codec, key, dtype, stop - start, msg.frames[i])
        elif with_frames:
            value = _tensor(key, dtype, stop - start, msg.frames[i])
        out.append(Part(key, dtype, shape, start, stop, value))
    return out


def read_row_parts(msg, with_values, rows=None):
    """The row parts of a received message as ``RowPart``s: the positions of their rows
    in the slice, checked against the count, and ``with_values`` their values.

    Each part's frames are its row ids (int64, increasing) and its values; a VALUES
    answer leaves out the ids, for the worker knows which ``rows`` it asked for."""
    from .placement import row_positions
    parts, per = msg.get('parts'), int(rows is None) + int(with_values)   # frames a part
    if not isinstance(parts, list) or len(parts) * per != len(msg.frames):
        raise KVError('malformed request: row parts do not match the frames')
    out = []
    for i, p in enumerate(parts):
        key, dtype, shape, start, stop, count = _fields(p, extra=1)
        frames = msg.frames[i * per:(i + 1) * per]
        ids = rows if rows is not None else _tensor(key, 'int64', len(frames[0]) // 8,
                                                    frames[0])
        if not shape or ids.numel() and (ids[0] < 0 or ids[-1] >= shape[0]
                                         or (ids[1:] <= ids[:-1]).any()):
            raise KVError(f'key {key!r}: row ids must increase within the rows of {shape}')
        positions, _ = row_positions(ids, math.prod(shape[1:]), start, stop)
        if positions.numel() != count:
            raise KVError(f'key {key!r}: {count} values for {positions.numel()} elements')
        values = _tensor(key, dtype, count, frames[-1]) if with_values else None
        out.append(RowPart(key, dtype, shape, start, stop, positions, values))
    return out


def state_entries(states):
    """Optimizer states ({key: {name: tensor or number}}) as a message carries them:
    entries ``[key, name, dtype, None]`` with a frame each, or ``[key, name, None, number]``."""
    entries, frames = [], []
    for key, state in states.items():
        for name, v in state.items():
            is_tensor = not isinstance(v, (int, float))
            entries.append([key, name, wire.dtype_name(v.dtype) if is_tensor else None,
                            None if is_tensor else v])
            if is_tensor:
                frames.append(v.numpy().data)
    return entries, frames


def read_states(msg, sizes):
    """The optimizer states a message carries, checked: {key: {name: value}}; ``sizes``:
    key -> the elements held of it (KVError for a key not held, or a bad state)."""
    entries, frames, states = msg.get('entries'), iter(msg.frames), {}
    if not isinstance(entries, list):
        raise KVError('malformed state')
    for entry in entries:
        key, name, dtype, number = entry if isinstance(entry, list) and len(entry) == 4 \
            else (None,) * 4
        size = sizes.get(key)
        if size is None or not isinstance(name, str):
            raise KVError(f'state for a key this server does not hold: {key!r}')
        if dtype is None:
            if not isinstance(number, (int, float)):
                raise KVError(f'key {key!r}: bad state {name!r}')
            states.setdefault(key, {})[name] = number
            continue
        try:
            t = wire.unpack({'dtype': dtype, 'shape': [size]}, next(frames))
        except (ValueError, StopIteration) as e:
            raise KVError(f'key {key!r}: bad state {name!r}: {e}') from None
        states.setdefault(key, {})[name] = t.clone()
    return states
