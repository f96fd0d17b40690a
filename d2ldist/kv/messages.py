"""What workers and servers of the key-value store say to each other.

Every request carries an ``id`` that its answer repeats, and a list of ``parts``:

    [key, dtype, shape, start, stop]   # elements start..stop of the flattened value of key

with, for INIT and PUSH, one data frame per part (the raw bytes of those elements).
A list of keys travels as ONE message per server, not one per key. A compressed PUSH
says how (``codec``: {'type': '2bit', 'threshold': 0.5}) and which parts (``coded``:
their indices); their frames hold the codec's bytes (``runtime/compression.py``).

A sparse key's rows travel as ``[key, dtype, shape, start, stop, count]`` with two frames
per part: the row ids (int64) and, for a push, the ``count`` values of those rows that
lie in the slice (``placement.row_positions`` says which).

Where a server's answers to a worker would cross a socket, the worker offers it a stream
(``LINK``, runtime/stream.py) and the server sends its VALUES of whole slices on it: their
frames arrive ``Pending``, and the worker reads each straight into ``out``.
"""
import math

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
REQUESTS = (INIT, PUSH, PULL, OPTIMIZER, LEARNING_RATE, INFO, GET_STATE, SET_STATE,
            PUSH_ROWS, PULL_ROWS)
ANSWERS = (ACK, VALUES, ERROR)

MAX_PARTS = 1000            # a longer list is sent as several messages (header <= 64 KB)


class KVError(ValueError):
    """A request the key-value store refuses: unknown key, wrong shape or dtype."""


def describe(dtype, shape):
    """'float32[3, 4]': how errors name a value."""
    return f'{dtype}{list(shape)}'


def check_key(key):
    """A key is an int or a short string (anything else came from a confused sender)."""
    if isinstance(key, bool) or not isinstance(key, (int, str)) or \
            (isinstance(key, str) and len(key) > 256):
        raise KVError(f'a key must be an int or a string, got {key!r}'[:200])
    return key


def _fields(p, extra=0):
    """A part's fields, checked: key, dtype, shape (a list of ints), start, stop and
    ``extra`` more ints (a row part's count)."""
    try:
        key, dtype, shape, start, stop, *more = p
        shape = [int(n) for n in shape]
        start, stop, more = int(start), int(stop), [int(x) for x in more]
    except (TypeError, ValueError):
        raise KVError(f'malformed part {p!r}'[:200]) from None
    check_key(key)
    if not 0 <= start <= stop or dtype not in wire.DTYPES or len(more) != extra:
        raise KVError(f'malformed part {p!r}'[:200])
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


def read_parts(msg, with_frames):
    """The parts of a received message as (key, dtype, shape, start, stop, tensor or None);
    the parts listed in ``coded`` are decoded with the message's ``codec``."""
    parts, coded = msg.get('parts'), msg.get('coded') or []
    if not isinstance(parts, list) or (with_frames and len(parts) != len(msg.frames)):
        raise KVError('malformed request: parts do not match the frames')
    try:
        codec = compression.create(msg.get('codec')) if coded else None
    except ValueError as e:
        raise KVError(str(e)) from None
    if coded and (codec is None or not isinstance(coded, list)):
        raise KVError('malformed request: coded parts without a codec')
    out = []
    for i, p in enumerate(parts):
        key, dtype, shape, start, stop = _fields(p)
        t = None
        if with_frames and i in coded:
            try:
                t = codec.decode(msg.frames[i], stop - start, wire.DTYPES[dtype])
            except ValueError as e:
                raise KVError(f'key {key!r}: {e}') from None
        elif with_frames:
            t = _tensor(key, dtype, stop - start, msg.frames[i])
        out.append((key, dtype, shape, start, stop, t))
    return out


def read_row_parts(msg, with_values):
    """The row parts of a received message as (key, dtype, shape, start, stop, positions,
    values or None): positions in the slice, checked against the rows and the count."""
    from .placement import row_positions
    parts, per = msg.get('parts'), 2 if with_values else 1
    if not isinstance(parts, list) or len(parts) * per != len(msg.frames):
        raise KVError('malformed request: row parts do not match the frames')
    out = []
    for i, p in enumerate(parts):
        key, dtype, shape, start, stop, count = _fields(p, extra=1)
        frame = msg.frames[i * per]
        rows = _tensor(key, 'int64', len(frame) // 8, frame)
        if not shape or rows.numel() and (rows[0] < 0 or rows[-1] >= shape[0]
                                          or (rows[1:] <= rows[:-1]).any()):
            raise KVError(f'key {key!r}: row ids must increase within the rows of {shape}')
        positions, _ = row_positions(rows, math.prod(shape[1:]), start, stop)
        if positions.numel() != count:
            raise KVError(f'key {key!r}: {count} values for {positions.numel()} elements')
        values = _tensor(key, dtype, count, msg.frames[i * 2 + 1]) if with_values else None
        out.append((key, dtype, shape, start, stop, positions, values))
    return out
