"""``--fail`` as the launcher watches it: fired, fired by the launcher, or never fired.

A d2ldist process fails itself (``runtime/faults.py``): at its compute step N, or a
time after it joined, which it says to the launcher in a hidden line (``JOINED``).
A plain torch.distributed script never joins, so nothing in it counts. For such a
worker the launcher counts ``--fail worker:R@TIME`` from the process's start, and
has its guard SIGKILL it then; a step it cannot see. At the job's end it says in one
line each fault that never fired, and why, rather than finish as if none was asked:
one of a worker that never joined, or of a worker that joined and ended first (the
job had fewer steps, or the script steps an optimizer d2ldist does not see).
"""
import time

from .. import config
from ..runtime.faults import FIRED, JOINED


class FailWatch:
    """The workers' ``--fail`` of a job's first attempt, as the launcher watches them.

    ``kills``: whether the launcher can kill one process of the job (not one task of
    an srun or mpirun step)."""

    def __init__(self, specs, kills=True):
        self.kills = kills
        self.planned = {}                 # (role, rank) -> (the --fail text, its kind)
        for s in specs:
            value = s.env.get(config.variable('fail'))
            if s.role == 'worker' and value and s.env.get(config.variable('restart')) == '0':
                self.planned[s.role, s.rank] = (value, config.parse_fail(value))
        self.started, self.joined, self.fired = {}, set(), set()
        self.ended = set()                # joined or not: exited 0 by itself, its fault held

    def _first(self, p):
        """Whether ``p`` is a planned worker in the first attempt, its --fail set (not
        one started again, without it)."""
        return (p.spec.role, p.spec.rank) in self.planned and \
            p.spec.env.get(config.variable('restart')) == '0' and \
            bool(p.spec.env.get(config.variable('fail')))

    def start(self, p):
        """Process ``p`` has just been started."""
        if self._first(p):
            self.started.setdefault((p.spec.role, p.spec.rank), time.monotonic())

    def said(self, p, line):
        """Whether ``line`` is ``p``'s word that it joined (then hidden); its word that it
        fails on purpose (shown) is noted: it fired."""
        key = (p.spec.role, p.spec.rank)
        if FIRED.fullmatch(line):         # (a wrapper script may exit 0 when it fired)
            self.fired.add(key)
        if line != JOINED:
            return False
        self.joined.add(key)
        return True

    def exited(self, p):
        """Process ``p`` has exited 0 by itself (not stopped by the launcher)."""
        if self._first(p):
            self.ended.add((p.spec.role, p.spec.rank))

    def due(self, procs):
        """The processes to kill now, each with the launcher's line on it."""
        now = time.monotonic()
        for p in procs:
            key = (p.spec.role, p.spec.rank)
            value, (kind, seconds) = self.planned.get(key, (None, (None, None)))
            if kind == 'time' and self.kills and p.alive and self._first(p) and key in \
                    self.started and key not in self.joined | self.fired and \
                    now - self.started[key] >= seconds:
                self.fired.add(key)
                yield p, (f'{p.label} fails on purpose {seconds:g} s after it started '
                          '(--fail; it never joined through d2ldist, so the launcher kills it)')

    def never_fired(self):
        """One line for each --fail that did not fire: in a worker that never joined, or
        in one that joined and then exited 0 (said whether the job succeeded or not). A
        joined worker that failed or was stopped gets none: the launcher cannot tell."""
        for (role, rank), (value, (kind, at)) in self.planned.items():
            key = (role, rank)
            # sure: a fault is a SIGKILL, so an exit 0 never fired (a SIGKILL may be our stop)
            if key in self.fired or key in self.joined and key not in self.ended:
                continue
            if key in self.joined:
                why = (f'{role} {rank} ended before its step {at} (d2ldist counts only its '
                       "Trainer's and optimizers' steps)" if kind == 'step' else
                       f'{role} {rank} ended less than {at:g} s after it joined')
            elif kind == 'time' and self.kills:
                why = f'{role} {rank} ended before then'
            else:
                why = f'{role} {rank} never joined through d2ldist' + (
                    ' (a step is a d2ldist training step)' if kind == 'step' else
                    ', and the launcher cannot kill one task of srun or mpirun alone')
            yield f'--fail {role}:{rank}@{value} never fired: {why}'
