"""What we know of a running job (``JobModel``), and d2l-launch's terminal view of it.

One model, fed by the launcher's hooks (see ``job.py``): ``on_state`` tells it each
process's state and exit code; ``on_line`` turns a worker's report line (see
``d2ldist/report.py``) into its merged latest metrics, a point of its history and its
samples per second, and keeps the line out of the log; what the launcher prints goes
to ``add_log``. Views only read the model:

* ``Progress`` here, ``d2l-launch``'s view: when stdout is a terminal, one line per
  worker at the bottom, redrawn in place::

      [worker 0] [######----------]  40% epoch 2/5 batch 40/98 loss 0.812 1530 samples/s

  (other lines are printed above it, so the log still scrolls normally); otherwise (a
  file, a pipe, CI) plain lines: a worker's report is printed when its epoch changes
  or ends, and at most every few seconds in between;
* ``JobModel.text()``, the same model as a table of every process;
* ``JobModel.attempts``: each start of the job's processes (``--max-restarts``): when,
  how it ended, and from the workers' reports (``step``, ``resumed_from``) the step it
  resumed from and the steps the failure cost;
* ``%launch``'s ipywidgets dashboard (``d2ldist/notebook/dashboard.py``).

Every text bar is drawn by ``bar()``.
"""
import shutil
import sys
import time
from dataclasses import dataclass, field

from ..report import Rate, format_progress, fraction_done, parse_report
from ..runtime.spans import PREFIX as TIMELINE
from .trace import Trace

FINAL = ('finished', 'failed', 'stopped')
MAX_POINTS = 1000    # history points kept per worker (halved when full)
PLAIN_EVERY = 2.0    # seconds between two plain progress lines of one worker


def bar(fraction, width=16, ends='[]', full='#', empty='-'):
    """'[######----------]  40%' (the table's: '|████      |  40%')."""
    filled = round(fraction * width)
    return f'{ends[0]}{full * filled}{empty * (width - filled)}{ends[1]} {fraction:4.0%}'


class Throttle:
    """Let an action through at most once every ``interval`` seconds."""

    def __init__(self, interval, clock=time.monotonic):
        self.interval, self.clock, self.last = interval, clock, None

    def ready(self, force=False):
        """True (and the clock restarts) if the action may run now."""
        now = self.clock()
        if force or self.last is None or now - self.last >= self.interval:
            self.last = now
            return True
        return False


@dataclass
class Row:
    """One process of the job: what we know of it."""
    label: str
    role: str
    rank: int
    host: str
    state: str = 'starting'
    code: int = None
    metrics: dict = field(default_factory=dict)   # the latest value of every field
    history: list = field(default_factory=list)   # (epochs done, loss, acc, test_acc)
    rate: float = None                            # samples per second
    reports: int = 0

    @property
    def done(self):
        """How far the worker is, 0 .. 1 (None before its first report)."""
        return fraction_done(self.metrics)

    def progress(self, **bar_style):
        """Its bar (once known) and latest report: '[##--]  40% epoch 2/5 ... 1530 samples/s'."""
        done = self.done
        prefix = bar(done, **bar_style) + ' ' if done is not None else ''
        return prefix + format_progress(self.metrics, self.rate)

    def restart(self):
        """Forget the live state of the attempt that ended (the curves stay)."""
        self.state, self.code, self.metrics, self.rate, self.reports = 'starting', None, {}, None, 0


@dataclass
class Attempt:
    """One start of every process of the job (``--max-restarts`` makes more)."""
    number: int                 # 0, then the restarts
    started: float              # on the model's clock
    before: int = None          # the highest step reported in the attempt before
    end: str = ''               # how it ended: 'worker 1 failed (exit code 3)', 'finished'
    resumed_from: int = None    # the checkpoint's step it resumed from (a worker's report)
    last_step: int = None       # the highest step a worker reported in it

    @property
    def begun_at(self):
        """The step it began at: where it resumed, or 0 if steps come without (None: unknown)."""
        if self.resumed_from is not None:
            return self.resumed_from
        return None if self.last_step is None else 0

    @property
    def steps_lost(self):
        """Steps of the attempt before that this one does again (None: unknown)."""
        if self.before is None or self.begun_at is None:
            return None
        return max(0, self.before - self.begun_at)

    @property
    def title(self):
        """'restart 1 (resumed from step 40)', as the timeline marks it."""
        if self.begun_at is None:
            return f'restart {self.number}'
        return f'restart {self.number} (resumed from step {self.begun_at})'

    def describe(self, since):
        """'attempt 1, started at 3.2 s, resumed from step 40 (3 steps lost): finished'."""
        text = f'attempt {self.number}, started at {self.started - since:.1f} s'
        if self.number and self.begun_at is not None:
            text += f', resumed from step {self.begun_at}'
            if self.steps_lost is not None:
                text += f' ({self.steps_lost} steps lost)'
        return f'{text}: {self.end or "running"}'


class JobModel:
    """What we know of every process of a job, kept up to date by the launcher's hooks.

    Made from the job's specs it has a row for each process from the start; made empty
    (as d2l-launch's is) it adds a process's row when a hook first names it."""

    def __init__(self, specs=(), title='job', clock=time.monotonic):
        self.title, self.clock = title, clock
        self.rows = {}
        for spec in specs:
            self.add(spec)
        self.log = []             # the merged log, as printed
        self.outcome = 'starting'
        self.message = ''
        self.started, self.ended = clock(), None
        self.version = 0          # bumped by every change: views redraw when it moves
        self.plot_version = 0     # bumped when a curve or step time changes
        self._rates = {}
        self.trace = Trace()      # the processes' timeline spans (d2l-launch --timeline)
        self.attempts = [Attempt(0, self.started)]

    def add(self, spec):
        """A process of the job (a ``ProcSpec``): its row, in the state 'starting'."""
        self.rows[spec.label] = Row(spec.label, spec.role, spec.rank, spec.host)
        return self.rows[spec.label]

    @property
    def workers(self):
        return [r for r in self.rows.values() if r.role == 'worker']

    # -- the launcher's hooks (Job(on_state=..., on_line=...)) ------------------------
    def on_state(self, proc):
        """Job's on_state hook: a process started or ended, or its exit code came."""
        self._meet(proc)
        self.set_state(proc.label, proc.state, proc.code)

    def on_line(self, proc, line):
        """Job's on_line hook: a report feeds the model and is hidden (None); other lines pass."""
        if self.trace.on_line(proc.label, line):    # spans for --timeline: kept, hidden
            return None
        r = parse_report(line)
        if r is None:
            return line
        self._meet(proc)
        self.add_report(proc.label, r)
        return None

    def on_restart(self, attempt, why):
        """Job's on_restart hook: the attempt before failed (``why``); every process starts anew."""
        before = self.attempts[-1]
        before.end = why
        self.attempts.append(Attempt(attempt, self.clock(), before=before.last_step))
        for row in self.rows.values():
            row.restart()
        self._rates.clear()
        self.trace.mark(attempt, self.attempts[-1].title)
        self.version += 1

    def on_change(self, what):
        """Job's on_change hook: an elastic job lost a process or started one again."""
        self.trace.note(what)
        self.version += 1

    def _meet(self, proc):
        """Add the row of a process the model has not heard of yet."""
        if proc.label not in self.rows:
            self.add(proc.spec)

    # -- what the hooks say -----------------------------------------------------------
    def set_state(self, label, state, code=None):
        """A process changed state (or its exit code became known)."""
        row = self.rows[label]
        if row.state in FINAL and state != row.state:
            return False          # final states stay: a stopped process that exits is stopped
        row.state = state
        row.code = code if code is not None else row.code
        if self.outcome == 'starting' and state == 'running':
            self.outcome = 'running'
        self.version += 1
        return True

    def add_report(self, label, r):
        """A worker reported progress (a parsed report line)."""
        row = self.rows[label]
        row.metrics.update(r)
        row.reports += 1
        if 'step' in r or 'resumed_from' in r:
            self._count_steps(r)
        if 'samples' in r:
            row.rate = self._rates.setdefault(label, Rate()).add(r.get('time', self.clock()),
                                                                 r['samples'])
        if any(k in r for k in ('loss', 'acc', 'test_acc')):
            m = row.metrics
            x = (m.get('epoch', 1) - 1 + m.get('batch', 0) / m['num_batches']
                 if m.get('num_batches') else float(row.reports))
            row.history.append((x, r.get('loss'), r.get('acc'), r.get('test_acc')))
            if len(row.history) > MAX_POINTS:
                del row.history[::2]
            self.plot_version += 1
        if 'step_times' in r:
            self.plot_version += 1
        self.version += 1

    def _count_steps(self, r):
        """A worker's step (cumulative over attempts) or the step its attempt resumed from."""
        attempt = self.attempts[-1]
        if 'resumed_from' in r:
            attempt.resumed_from = r['resumed_from']
        if 'step' in r:
            attempt.last_step = max(r['step'], attempt.last_step or 0)
        if attempt.number:
            self.trace.mark(attempt.number, attempt.title)

    def add_log(self, text):
        """Lines the launcher printed (the workers' output and its own messages)."""
        self.log.extend(text.splitlines())
        self.version += 1

    def finish(self, outcome, message=''):
        """The job ended: 'finished', 'failed', 'stopped' or 'timeout'."""
        self.outcome, self.message, self.ended = outcome, message, self.clock()
        self.attempts[-1].end = message or outcome
        self.version += 1

    # -- reading it ---------------------------------------------------------------------
    @property
    def elapsed(self):
        return (self.ended or self.clock()) - self.started

    def status(self):
        """'running, 3.2 s' or 'failed after 4.0 s: worker 1 failed (exit code 3)'."""
        if self.ended is None:
            return f'{self.outcome}, {self.elapsed:.1f} s'
        text = f'{self.outcome} after {self.elapsed:.1f} s'
        return f'{text}: {self.message}' if self.message else text

    def attempts_text(self):
        """Each attempt in a line: when it started, where it resumed, how it ended."""
        return '\n'.join(a.describe(self.started) for a in self.attempts)

    def text(self):
        """The job as a table of text, one process a line (the dashboard without widgets)."""
        lines = [f'{self.title}: {self.status()}']
        width = max(map(len, self.rows), default=0)
        for row in self.rows.values():
            code = '' if row.code is None else f'exit {row.code}'
            line = f'  {row.label:<{width}}  {row.host:<10} {row.state:<9} {code:<8}'
            if row.role == 'worker' and row.reports:
                line += ' ' + row.progress(width=10, ends='||', full='█', empty=' ')
            lines.append(line.rstrip())
        if len(self.attempts) > 1:
            lines += ['  ' + a.describe(self.started) for a in self.attempts]
        return '\n'.join(lines)

    __repr__ = text


class Progress:
    """d2l-launch's view of a JobModel: hides report lines and shows them as progress.

    It is the Job's ``out`` (log text is printed above the progress lines) and its
    ``on_line`` hook; ``model.on_state`` is the Job's ``on_state``."""

    def __init__(self, out=None, tty=None, clock=time.monotonic, model=None):
        self.out = out or sys.stdout
        self.tty = self.out.isatty() if tty is None else tty
        self.clock = clock
        self.model = JobModel(clock=clock) if model is None else model
        self.lines = {}          # label -> its progress line, in order of first report
        self.throttles, self.epochs = {}, {}   # per label: plain lines, the epoch printed
        self.drawn = 0           # how many progress lines are on the screen now

    def on_line(self, proc, line):
        """Job's on_line hook: the model takes a report (None hides it), other lines pass."""
        shown = self.model.on_line(proc, line)
        if shown is None and not line.startswith(TIMELINE):   # a report, not spans
            self._show(self.model.rows[proc.label])
        return shown

    def on_restart(self, attempt, why):
        """Job's on_restart hook: the model starts a new attempt; old progress lines go."""
        self.model.on_restart(attempt, why)
        self.lines.clear()
        self.epochs.clear()

    def _show(self, row):
        """Redraw the progress lines (a terminal) or print the row's line when due."""
        self.lines[row.label] = f'[{row.label}] {row.progress()}'
        if self.tty:
            self._redraw()
        elif self._plain_due(row.label, row.metrics):
            self.out.write(self.lines[row.label] + '\n')
            self.out.flush()

    def _plain_due(self, label, r):
        """Due when the worker's epoch changes or ends, else every PLAIN_EVERY seconds
        (a bare step count, before anything else, is bookkeeping: not shown)."""
        if set(r) <= {'step', 'time'}:
            return False
        throttle = self.throttles.setdefault(label, Throttle(PLAIN_EVERY, self.clock))
        ends = 'num_batches' in r and r.get('batch') == r['num_batches']
        if throttle.ready(force=ends or r.get('epoch') != self.epochs.get(label)):
            self.epochs[label] = r.get('epoch')
            return True
        return False

    # -- a file-like object for Job(out=...) ---------------------------------------------
    def write(self, text):
        """Print log text above the progress lines (and keep it in the model's log)."""
        self.model.add_log(text)
        if self.tty and self.drawn:
            self.out.write(f'\x1b[{self.drawn}F\x1b[J')   # up to the block's start, erase
            self.drawn = 0
            self.out.write(text)
            self._redraw()
        else:
            self.out.write(text)

    def flush(self):
        self.out.flush()

    def _redraw(self):
        if self.drawn:
            self.out.write(f'\x1b[{self.drawn}F\x1b[J')
        width = shutil.get_terminal_size().columns - 1      # no wrapping: one row each
        self.out.write(''.join(line[:width] + '\n' for line in self.lines.values()))
        self.drawn = len(self.lines)
        self.out.flush()
