"""Progress in a terminal: the workers' report lines (see ``d2ldist/report.py``) shown compactly.

``d2l-launch`` hands every line to ``Progress.on_line``. A report line is kept out
of the log; instead

* when stdout is a terminal, one line per worker at the bottom, redrawn in place::

      [worker 0] [######----------]  40% epoch 2/5 batch 40/98 loss 0.812 1530 samples/s

  (other lines are printed above it, so the log still scrolls normally);
* otherwise (a file, a pipe, CI) plain lines: a worker's report is printed when its
  epoch changes or ends, and at most every few seconds in between.
"""
import shutil
import sys
import time

from ..report import Rate, format_progress, fraction_done, parse_report

PLAIN_EVERY = 2.0    # seconds between two plain progress lines of one worker


def bar(fraction, width=16):
    """'[######----------]  40%'."""
    filled = round(fraction * width)
    return f"[{'#' * filled}{'-' * (width - filled)}] {fraction:4.0%}"


class Progress:
    """Wraps the launcher's output: hides report lines and shows them as progress."""

    def __init__(self, out=None, tty=None, clock=time.monotonic):
        self.out = out or sys.stdout
        self.tty = self.out.isatty() if tty is None else tty
        self.clock = clock
        self.lines = {}          # label -> its progress line, in order of first report
        self.metrics, self.rates, self.last = {}, {}, {}
        self.drawn = 0           # how many progress lines are on the screen now

    def on_line(self, proc, line):
        """Job's on_line hook: a report becomes progress (None hides it), other lines pass."""
        r = parse_report(line)
        if r is None:
            return line
        now, label = self.clock(), proc.label
        r = self.metrics.setdefault(label, {}) | r      # a report may carry a few fields only
        self.metrics[label] = r
        rate = self.rates.setdefault(label, Rate()).add(r.get('time', now), r['samples']) \
            if 'samples' in r else None
        done = fraction_done(r)
        text = (bar(done) + ' ' if done is not None else '') + format_progress(r, rate)
        self.lines[label] = f'[{label}] {text}'
        if self.tty:
            self._redraw()
        elif self._plain_due(label, r, now):
            self.out.write(self.lines[label] + '\n')
            self.out.flush()
        return None

    def _plain_due(self, label, r, now):
        last_time, last_epoch = self.last.get(label, (None, None))
        due = (last_time is None or now - last_time >= PLAIN_EVERY
               or r.get('epoch') != last_epoch
               or ('num_batches' in r and r.get('batch') == r['num_batches']))
        if due:
            self.last[label] = (now, r.get('epoch'))
        return due

    # -- a file-like object for Job(out=...) ---------------------------------------------
    def write(self, text):
        """Print log text above the progress lines."""
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
