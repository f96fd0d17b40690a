"""The timeline: what every process did, and when (``d2l-launch --timeline FILE``).

Each process records *spans* (a name, a category, a start and a duration): the seven
steps of each batch, each collective, push and pull, each wait for another node, and a
server's requests. Every step (or second) it prints the new spans as one line
``@d2l/timeline {...}`` on its stdout; the launcher merges them into one Chrome
trace-event file (``launch/trace.py``). Every span is on the scheduler's clock
(``set_clock``, after ``Node.sync_clock``) and carries the training step (``step()``,
``step_done``, ``resume``).

Off unless ``D2L_TIMELINE=1`` (set by ``--timeline``); then a span costs two clock
reads and a small dict. ``D2L_TIMELINE_STEPS=20-40`` records steps 20 to 40 only.
The reasoning: docs/design/runtime.md, "The timeline".
"""
import atexit
import json
import sys
import threading
import time
from contextlib import contextmanager

from .. import config

PREFIX = '@d2l/timeline '
MAX_EVENTS = 100_000      # per process; past it, nothing more is recorded
MIN_WAIT = 100e-6         # shorter waits are not worth a span (seconds)
FLUSH_EVERY = 1.0         # print the spans at least this often (seconds)


_lock = threading.Lock()
_events, _recorded = [], 0
_steps_done = 0                  # training steps this process has finished
_offset, _error = 0.0, None      # seconds to add to time.time(); half the best round trip
_last_flush = time.monotonic()


def step():
    """The training step in progress, counted from 1: one more than those finished."""
    return _steps_done + 1


def step_done():
    """A training step has ended (train_batch; faults.StepClock: the optimizers' step):
    its spans go."""
    global _steps_done
    _steps_done += 1
    if config.get().timeline:
        flush()


def resume(steps_done):
    """The job resumed from the checkpoint taken after ``steps_done`` steps."""
    global _steps_done
    _steps_done = steps_done


def recording():
    """Whether spans are recorded now (on, within the window, below the cap)."""
    cfg = config.get()
    if not cfg.timeline or _recorded >= MAX_EVENTS:
        return False
    window = cfg.timeline_steps if cfg.role == 'worker' else None   # servers: every span
    return window is None or window[0] <= step() <= window[1]


def tick():
    """Print the spans if many have piled up or a second has passed."""
    if config.get().timeline and (len(_events) > 500
                                  or time.monotonic() - _last_flush > FLUSH_EVERY):
        flush()


@contextmanager
def span(name, cat, **args):
    """Record the block as a span (when recording)."""
    if not recording():
        yield
        return
    start = time.time()
    try:
        yield
    finally:
        _add(name, cat, start, time.time(), args)


def waited(name, start, **args):
    """A wait that began at ``start`` (time.time()) has just ended."""
    now = time.time()
    if now - start >= MIN_WAIT and recording():
        _add(name, 'wait', start, now, args)


def record(name, cat, start, end, **args):
    """A span that is over: from ``start`` to ``end`` (time.time())."""
    if recording():
        _add(name, cat, start, end, args)


def _add(name, cat, start, end, args):
    """One span, on the scheduler's clock, in microseconds."""
    global _recorded
    event = {'name': name, 'cat': cat, 'ts': round((start + _offset) * 1e6, 1),
             'dur': round((end - start) * 1e6, 1), 'tid': threading.current_thread().name,
             'args': dict(args, step=step())}
    with _lock:
        _events.append(event)
        _recorded += 1


def set_clock(offset, error):
    """The offset to the scheduler's clock (seconds) and its error bound."""
    global _offset, _error
    _offset, _error = offset, error


def flush():
    """Print the spans recorded since the last flush as one line."""
    global _events, _last_flush
    with _lock:
        batch, _events = _events, []
    _last_flush = time.monotonic()
    if batch:
        clock = None if _error is None else round(_error * 1e6, 1)
        sys.stdout.write(PREFIX + json.dumps({'events': batch, 'clock_error_us': clock},
                                             separators=(',', ':')) + '\n')
        sys.stdout.flush()


atexit.register(flush)   # the spans still here when the process ends (none: nothing)
