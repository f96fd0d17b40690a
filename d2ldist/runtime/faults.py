"""Stragglers and failures on demand: ``d2l-launch --slow worker:1=3x --fail worker:0@step=40``.

To see, without editing a script, that synchronous training runs at its slowest
worker's pace, and what a failure looks like. The launcher gives the process it names

* ``D2L_SLOW``: ``3x`` (each compute step takes 3 times as long) or ``+200ms`` (200 ms
  longer): the process sleeps after its real work, so the others wait for it;
* ``D2L_FAIL``: ``step=40`` (it dies after its 40th compute step; a server after the
  40th sync round it closed on the first key it holds, in dist_async the 40th push it
  applied there) or ``30s`` (30 s after it joined the job; servers and the scheduler too).
  On joining, the process says so to the launcher (``JOINED``, a hidden line): a worker
  that never joins is the launcher's to kill (``launch/failwatch.py``), and one that
  ends before its fault fires is named at the job's end.

(``config.py`` reads both; the steps are the timeline's count, ``spans.step()``.) Both
act in the job's first attempt only (``D2L_RESTART=0``): a restart (``d2l-launch
--max-restarts``) replays the job without them.

A compute step is what d2ldist sees of a script's work: the forward and backward pass
of ``train_batch`` (step 1 of the seven), and the time between two ``step()`` calls of
DistributedOptimizer or ShardedOptimizer (``StepClock``), or of a torch optimizer over
stage 3's shards (``shard_module``: ``watch``, by torch's global step hooks). Dying
is a SIGKILL, as a crash would be: no goodbye and no clean-up, so the others must
notice (the heartbeats, the launcher).
"""
import functools
import os
import re
import signal
import threading
import time

from .. import config
from ..lines import say
from . import spans

JOINED = 'd2ldist.fail: joined'     # this process counts its own --fail (hidden by the launcher)
FIRED = re.compile(r'd2ldist: [\w ]+ fails on purpose .*\(--fail\)')   # die()'s line, as read

def computed(seconds):
    """The compute of this training step has just ended, after ``seconds``: stretch it
    (D2L_SLOW), and die if this is the step D2L_FAIL names (steps: spans.step())."""
    cfg = config.get()
    if cfg.restart != 0:             # a restart replays the job without its faults
        return
    if cfg.slow:
        factor, extra = cfg.slow
        time.sleep((factor - 1) * seconds + extra)
    if cfg.fail == ('step', spans.step()):
        die(f'after its compute step {spans.step()}')


class StepClock:
    """An optimizer's steps as --slow, --fail and the timeline see them: its compute is
    the time since the last step ended (data, forward, backward). ``computed()`` at the
    start of ``step()``, ``done()`` at its end; ``restart()`` after a step cut short."""

    def __init__(self):
        self.restart()

    def restart(self):
        """The next step's compute is timed from now."""
        self.since = time.perf_counter()

    def computed(self):
        """The compute has ended: its span (the timeline), then --slow and --fail."""
        seconds = time.perf_counter() - self.since
        now = time.time()
        spans.record('compute', 'step', now - seconds, now)
        computed(seconds)

    def done(self):
        """The step has ended: one more in the count (spans.step_done)."""
        spans.step_done()
        self.restart()


def watch(clock, params):
    """Count on ``clock`` the steps of any torch optimizer that steps ``params`` (stage 3's:
    the user's own optimizer, which d2ldist does not wrap; torch's global step hooks)."""
    for p in params:
        p.step_clock = clock
    _hook_torch()


@functools.cache
def _hook_torch():
    """(Once in a process) torch's global hooks before and after every optimizer's step."""
    from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                       register_optimizer_step_pre_hook)
    register_optimizer_step_pre_hook(lambda optimizer, args, kwargs:
                                     _tick(optimizer, StepClock.computed))
    register_optimizer_step_post_hook(lambda optimizer, args, kwargs:
                                      _tick(optimizer, StepClock.done))


def _tick(optimizer, what):
    """``what`` on the clock of the watched parameters ``optimizer`` steps, if any."""
    clock = watched(optimizer)
    if clock is not None:
        what(clock)


def watched(optimizer):
    """The StepClock ``watch`` gave the parameters ``optimizer`` steps; None if none."""
    return next((p.step_clock for g in optimizer.param_groups for p in g['params']
                 if hasattr(p, 'step_clock')), None)


def counted(optimizer):
    """Whether d2ldist counts ``optimizer``'s steps itself (its own optimizers', and a torch
    optimizer's over stage 3's shards); a script counts the others' (spans.step_done)."""
    return isinstance(getattr(optimizer, 'step_clock', None), StepClock) or \
        watched(optimizer) is not None


def served(rounds, what='sync round'):
    """A server has closed ``rounds`` sync rounds of its first key (dist_async: applied
    that many pushes, ``what='push'``): die if D2L_FAIL names it."""
    cfg = config.get()
    if cfg.restart == 0 and cfg.fail == ('step', rounds):
        die(f'after its {what} {rounds}')


def arm():
    """When a process joins the job: say so to the launcher, and start the timer of
    D2L_FAIL='30s', if any."""
    kind, seconds = config.get().fail or (None, None)
    if kind is not None and config.get().restart == 0:
        print(JOINED, flush=True)
    if kind == 'time' and config.get().restart == 0:
        timer = threading.Timer(seconds, die, args=(f'{seconds:g} s after it joined',))
        timer.daemon = True
        timer.start()


def die(when):
    """Fail on purpose, as a crash: one line, then SIGKILL (no goodbye, no clean-up;
    only the timeline's spans so far are printed, so that it shows the steps done)."""
    cfg = config.get()
    rank = '' if cfg.rank is None or cfg.role == 'scheduler' else cfg.rank
    who = f"{cfg.role or 'process'} {rank}".strip()
    say(f'{who} fails on purpose {when} (--fail)', err=True)
    spans.flush()
    os.kill(os.getpid(), signal.SIGKILL)
