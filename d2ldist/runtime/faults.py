"""Stragglers and failures on demand: ``d2l-launch --slow worker:1=3x --fail worker:0@step=40``.

To see, without editing a script, that synchronous training runs at its slowest
worker's pace, and what a failure looks like. The launcher gives the process it names

* ``D2L_SLOW``: ``3x`` (each compute step takes 3 times as long) or ``+200ms`` (200 ms
  longer): the process sleeps after its real work, so the others wait for it;
* ``D2L_FAIL``: ``step=40`` (it dies after its 40th compute step) or ``30s`` (30 s after
  it joined the job; servers too).

A compute step is what d2ldist sees of a script's work: the forward and backward pass
of ``train_batch`` (step 1 of the seven), and the time between two
``DistributedOptimizer.step()`` calls. Dying is a SIGKILL, as a crash would be: no
goodbye and no clean-up, so the others must notice (the heartbeats, the launcher).
"""
import functools
import os
import signal
import sys
import threading
import time

from .pacing import parse_latency

_steps = 0   # compute steps of this process so far


@functools.lru_cache(maxsize=None)
def parse_slow(text):
    """'3x' -> (3.0, 0.0), '+200ms' -> (1.0, 0.2): a factor and seconds added."""
    try:
        if text.endswith('x'):
            factor = float(text[:-1])
            if factor >= 1:
                return factor, 0.0
        elif text.startswith('+'):
            return 1.0, parse_latency(text[1:])
    except ValueError:
        pass
    raise ValueError(f'slow takes a factor of at least 1 (3x) or a time (+200ms), got {text!r}')


@functools.lru_cache(maxsize=None)
def parse_fail(text):
    """'step=40' -> ('step', 40), '30s' -> ('time', 30.0): when to die."""
    try:
        if text.startswith('step='):
            step = int(text[5:])
            if step >= 1:
                return 'step', step
        else:
            return 'time', parse_latency(text)
    except ValueError:
        pass
    raise ValueError(f'fail takes step=N (N >= 1) or a time (30s), got {text!r}')


def computed(seconds):
    """A compute step of ``seconds`` has just ended here: stretch it (D2L_SLOW), count
    it, and die if it is the step D2L_FAIL names."""
    global _steps
    slow = os.environ.get('D2L_SLOW')
    if slow:
        factor, extra = parse_slow(slow)
        time.sleep((factor - 1) * seconds + extra)
    _steps += 1
    fail = os.environ.get('D2L_FAIL')
    if fail and parse_fail(fail) == ('step', _steps):
        die(f'after its compute step {_steps}')


def arm():
    """When a process joins the job: the timer of D2L_FAIL='30s', if any."""
    fail = os.environ.get('D2L_FAIL')
    if fail and parse_fail(fail)[0] == 'time':
        seconds = parse_fail(fail)[1]
        timer = threading.Timer(seconds, die, args=(f'{seconds:g} s after it joined',))
        timer.daemon = True
        timer.start()


def die(when):
    """Fail on purpose, as a crash: one line, then SIGKILL (no goodbye, no clean-up)."""
    who = f"{os.environ.get('D2L_ROLE', 'process')} {os.environ.get('D2L_RANK', '')}".strip()
    print(f'd2ldist: {who} fails on purpose {when} (--fail)', file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
