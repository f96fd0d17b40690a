"""``--fail`` for a worker that never joins through d2ldist: the launcher's part.

A d2ldist process fails itself (``runtime/faults.py``): at its compute step N, or a
time after it joined, which it says to the launcher in a hidden line (``JOINED``).
A plain torch.distributed script never joins, so nothing in it counts. For such a
worker the launcher counts ``--fail worker:R@TIME`` from the process's start, and
has its guard SIGKILL it then; a step it cannot see, so at the job's end it says in
one line that the fault never fired, and why, rather than finish as if none was asked.
"""
import time

from .. import config
from ..runtime.faults import JOINED


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

    def start(self, p):
        """Process ``p`` has just been started."""
        if (p.spec.role, p.spec.rank) in self.planned and \
                p.spec.env.get(config.variable('fail')):     # (not a worker started again)
            self.started.setdefault((p.spec.role, p.spec.rank), time.monotonic())

    def said(self, p, line):
        """Whether ``line`` is ``p``'s word that it joined (then hidden)."""
        if line != JOINED:
            return False
        self.joined.add((p.spec.role, p.spec.rank))
        return True

    def due(self, procs):
        """The processes to kill now, each with the launcher's line on it."""
        now = time.monotonic()
        for p in procs:
            key = (p.spec.role, p.spec.rank)
            value, (kind, seconds) = self.planned.get(key, (None, (None, None)))
            if kind == 'time' and self.kills and p.alive and key not in self.joined | \
                    self.fired and key in self.started and now - self.started[key] >= seconds:
                self.fired.add(key)
                yield p, (f'{p.label} fails on purpose {seconds:g} s after it started '
                          '(--fail; it never joined through d2ldist, so the launcher kills it)')

    def never_fired(self):
        """One line for each --fail that did not fire in a worker that never joined."""
        for (role, rank), (value, (kind, seconds)) in self.planned.items():
            if (role, rank) in self.joined | self.fired:
                continue
            why = (f'{role} {rank} ended before then' if kind == 'time' and self.kills
                   else f'{role} {rank} never joined through d2ldist' + (
                       ' (a step is a d2ldist training step)' if kind == 'step' else
                       ', and the launcher cannot kill one task of srun or mpirun alone'))
            yield f'--fail {role}:{rank}@{value} never fired: {why}'
