"""What workers and servers of the key-value store say to each other.

Every request carries an ``id`` that its answer repeats, and a list of ``parts``:

    [key, dtype, shape, start, stop]   # elements start..stop of the flattened value of key

with, for INIT and PUSH, one data frame per part (the raw bytes of those elements).
A list of keys travels as ONE message per server, not one per key.
"""

from ..runtime import wire

INIT = 'kv_init'            # worker -> server: parts + frames, {optimizer}: initial values
PUSH = 'kv_push'            # worker -> server: parts + frames, {sync, pull}: gradients
PULL = 'kv_pull'            # worker -> server: parts: please send these values
OPTIMIZER = 'kv_optimizer'  # worker -> server: {name, hyper}: update on the server
LEARNING_RATE = 'kv_lr'     # worker -> server: {lr}: a new learning rate, states kept
INFO = 'kv_info'            # worker -> server: what do you hold?
GET_STATE = 'kv_get_state'  # worker -> server: your optimizer states (a checkpoint)
SET_STATE = 'kv_set_state'  # worker -> server: entries + frames: restore states
ACK = 'kv_ack'              # server -> worker: done (and maybe a few header fields)
VALUES = 'kv_values'        # server -> worker: parts + frames: the values asked for
ERROR = 'kv_error'          # server -> worker: {error}: the request was refused
REQUESTS = (INIT, PUSH, PULL, OPTIMIZER, LEARNING_RATE, INFO, GET_STATE, SET_STATE)
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


def read_parts(msg, with_frames):
    """The parts of a received message as (key, dtype, shape, start, stop, tensor or None)."""
    parts = msg.get('parts')
    if not isinstance(parts, list) or (with_frames and len(parts) != len(msg.frames)):
        raise KVError('malformed request: parts do not match the frames')
    out = []
    for i, p in enumerate(parts):
        try:
            key, dtype, shape, start, stop = p
            shape = [int(n) for n in shape]
            start, stop = int(start), int(stop)
        except (TypeError, ValueError):
            raise KVError(f'malformed part {p!r}'[:200]) from None
        check_key(key)
        if not 0 <= start <= stop or dtype not in wire.DTYPES:
            raise KVError(f'malformed part {p!r}'[:200])
        t = None
        if with_frames:
            try:
                t = wire.unpack({'dtype': dtype, 'shape': [stop - start]}, msg.frames[i])
            except ValueError as e:
                raise KVError(f'key {key!r}: {e}') from None
        out.append((key, dtype, shape, start, stop, t))
    return out
