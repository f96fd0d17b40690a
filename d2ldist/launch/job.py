"""A running job: start its processes, merge their output, and stop them together.

``Job(specs).run()`` starts the scheduler, learns the port it listens on, starts
the servers and workers, and then loops: it copies every line any process prints
to our stdout with a ``[worker 0]`` prefix, and watches for exits. It ends when every
worker has exited 0, when any process fails, at the timeout, or on an interrupt;
``max_restarts``, ``min_workers``/``max_workers`` and replicated servers change what
a failure does. Each process runs under the guard (``guard.py``); the servers' and
workers' guards have the starter (``starter.py``) fork them from an interpreter that
has imported torch already, so a job pays for that import once.

When a job ends, and with what exit code: docs/design/launch.md, "A running job".
"""
import dataclasses
import os
import re
import secrets
import selectors
import signal
import subprocess
import sys
import time
from collections import deque

from .. import config
from ..lines import go_on
from ..runtime import protocol
from ..runtime.spans import PREFIX as TIMELINE
from . import starter
from .failwatch import FailWatch
from .guard import FAIL
from .processes import child_env, guarded, shared_env

# After the last worker, how long the servers and the scheduler get to leave by themselves
# (the scheduler's shutdown, then each van's linger of up to 2 s) before they are stopped
SETTLE = 5.0
READY = re.compile(r'd2ldist: scheduler ready at tcp://(\S+):(\d+)')


class Terminated(Exception):
    """The launcher received SIGTERM."""


class JobFailed(RuntimeError):
    """A process of the job failed; ``proc`` is the first one that did."""

    def __init__(self, message, proc=None):
        super().__init__(message)
        self.proc = proc


class Proc:
    """A process of the job as the launcher sees it; its ``state`` goes from 'starting'
    to 'running', then 'finished', 'failed' or 'stopped' (by us)."""

    def __init__(self, spec):
        self.spec, self.popen, self.state, self.code = spec, None, 'starting', None
        self.file = None                # its --log-dir file, while it runs
        self.tail = deque(maxlen=10)    # its last lines, for the failure report
        self.exited_at, self._buf = None, b''

    @property
    def label(self):
        return self.spec.label

    @property
    def alive(self):
        return self.popen is not None and self.code is None

    def __repr__(self):
        return f'<{self.label}: {self.state}, exit code {self.code}>'


def describe_exit(code):
    """'exit code 3', or 'killed by SIGKILL (exit code 137)'."""
    if code is None:
        return 'did not get ready'
    if code > 128:
        try:
            return f'killed by {signal.Signals(code - 128).name} (exit code {code})'
        except ValueError:
            pass
    return f'exit code {code}'


def what_failed(proc):
    """'worker 1 failed (exit code 3)', or '... (killed by SIGKILL (exit code 137))'."""
    return f'{proc.label} failed ({describe_exit(proc.code)})'


def failure_report(proc, last_lines=True):
    """'worker 1 failed (exit code 3); the job was stopped.', then its last lines."""
    text = f'{what_failed(proc)}; the job was stopped.'
    if last_lines and proc.tail:
        text += '\nIts last lines:\n' + '\n'.join(f'  | {line}' for line in proc.tail)
    return text


class Job:
    """Start a job's processes, merge their output, stop them all when it ends.

    ``last_lines=False``: the report of a failure is one line, without the failed
    process's last lines (%launch: they are in the cell's log just above)."""
    kills_one = True                      # it can kill one process alone (--fail)

    def __init__(self, specs, timeout=None, max_restarts=0, out=None, on_line=None,
                 on_state=None, on_tick=None, on_restart=None, on_change=None,
                 last_lines=True, log_dir=None, min_workers=None, max_workers=None,
                 restart_lost=False, console_ranks=None):
        self.procs = [Proc(s) for s in specs]
        self.log_dir = log_dir            # --log-dir: each process's lines in a file too
        self.console_ranks = console_ranks   # --local-ranks-filter: workers shown (None: all)
        self.last_lines = last_lines
        self.timeout, self.out = timeout, out or sys.stdout
        self.max_restarts, self.attempt = max_restarts, 0     # attempt: 0, then restarts
        self.min_workers = min_workers    # elastic: workers that may be lost, down to this
        self.lost = []                    # ... and those lost, in this attempt
        self.max_workers = max_workers    # elastic: at most this many workers run
        self.restart_lost = restart_lost  # ... and lost workers are started again, once
        self.again = set()                # ... the ranks started again
        self.on_line = on_line or (lambda proc, line: line)   # may hide or change a line
        self.on_state = on_state or (lambda proc: None)       # state or exit code changed
        self.on_tick = on_tick or (lambda: None)              # about every 0.1 s
        self.on_restart = on_restart or (lambda attempt, why: None)   # before it starts
        self.on_change = on_change or (lambda what: None)   # elastic: one lost, one again
        self.log = []                     # the merged output: (label, line)
        self.failure = None               # the first process that failed
        self.code = None
        self._sel = selectors.DefaultSelector()
        self.starter = None               # this host's starter, once the job starts
        self.scheduler_address = None     # tcp://host:port, once the scheduler is ready
        self.notice = None                # elastic: how we tell the scheduler of a loss
        self.fails = FailWatch(specs, self.kills_one)   # --fail: fired, or never

    # -- the main loop -------------------------------------------------------------
    def run(self):
        """Run the job to its end, starting it again after a failure (at most
        ``max_restarts`` times); return its exit code."""
        start = time.monotonic()
        try:
            self.code = self._run_attempt(start)
            while self.failure is not None and self.attempt < self.max_restarts:
                self._restart()
                self.code = self._run_attempt(start)
        except (KeyboardInterrupt, Terminated):
            self._say('interrupted: stopping the job')
            self.stop_all()
            self.code = 130
            raise
        finally:
            self.stop_all('finished' if self.code == 0 else 'stopped')
            if self.starter is not None:
                self.starter.stop()
            self._close_notice()
            self._sel.close()
            for p in self.procs:
                if p.file is not None:
                    p.file.close()
        if self.failure is not None:
            self._say(failure_report(self.failure, self.last_lines))
        for line in self.fails.never_fired():
            self._say(line)
        return self.code

    def _run_attempt(self, start):
        """Start every process and watch them until the attempt is over; its exit code."""
        self._start_all()
        code = None
        while code is None:
            self._pump(0.01 if self._ending() else 0.1)
            self._reap()
            self._fail_due()
            self.tick()
            self.on_tick()
            code = self._verdict(start)
        return code

    def tick(self):
        """About every 0.1 s in the main loop (the ssh launcher looks for new hosts)."""

    def _fail_due(self):
        """--fail on a worker that never joined through d2ldist: at its time from its
        start, its guard SIGKILLs it (guard.FAIL), as a crash would."""
        for p, line in self.fails.due(self.procs):
            self._say(line)
            try:
                p.popen.stdin.write(FAIL)
                p.popen.stdin.flush()
            except OSError:
                pass              # it has ended already

    def _ending(self):
        """Whether a process has closed its output and not yet been seen to end: look
        again soon, so that an elastic job's survivors hear of a loss without waiting."""
        reading = {key.fileobj for key in self._sel.get_map().values()}
        return any(p.alive and p.popen.stdout not in reading for p in self.procs)

    def _restart(self):
        """After a failure: stop every process, say so in one line, make them anew."""
        self.stop_all()
        self.attempt += 1
        why = what_failed(self.failure)
        self._say(f'{why}; restart {self.attempt} of {self.max_restarts}')
        self._close_pipes()
        self._close_notice()              # (the next attempt has a secret of its own)
        fresh = config.env(job_secret=secrets.token_hex(32), restart=self.attempt)
        self.procs = [Proc(p.spec) for p in self.procs]
        for p in self.procs:
            p.spec.env.update(fresh)
        self.failure = self.code = None
        self.lost, self.again = [], set()
        self.on_restart(self.attempt, why)

    def ending(self):
        """How the job ended, as JobModel.finish() takes it: (outcome, message)."""
        if self.code == 0:
            return 'finished', ''
        if self.failure is not None:
            return 'failed', what_failed(self.failure)
        if self.code == 124:
            return 'timeout', f'ran longer than --timeout {self.timeout:g} s'
        return 'stopped', 'interrupted; every process stopped'

    def _verdict(self, start):
        """The job's exit code once it is over, else None."""
        if self.failure is not None:
            code = self.failure.code      # None: it was still running (never got ready)
            return code if code and code > 0 else 1
        if self.timeout is not None and time.monotonic() - start > self.timeout:
            self._say(f'timeout: the job ran for more than {self.timeout:g} s; stopping it')
            return 124
        workers = [p for p in self.procs if p.spec.role == 'worker' and p not in self.lost]
        if self.again and not self.procs[0].alive:   # the scheduler has ended: a worker
            workers = [p for p in workers if p.spec.rank not in self.again   # started again
                       or not p.alive]                                      # came too late
        if all(p.state == 'finished' for p in workers):
            done = max(p.exited_at for p in workers)
            others = [p for p in self.procs if p.alive]
            if not others or time.monotonic() - done > SETTLE:
                return 0   # stop_all() ends servers and scheduler that still run
        return None

    # -- starting --------------------------------------------------------------------
    def _start_all(self):
        scheduler, others = self.procs[0], self.procs[1:]
        assert scheduler.spec.role == 'scheduler'
        if self.starter is None and config.get().preload and type(self).spawn is Job.spawn:
            # first, for it imports torch while the scheduler starts (which needs none)
            self.starter = starter.Starter({**os.environ, **shared_env([p.spec for p in others])})
        self._start(scheduler)
        port = self._wait_ready(scheduler)
        if port is None:
            return
        for p in others:
            p.spec.env.update(config.env(scheduler_port=port))
            self._start(p)

    def _start(self, p):
        p.file = self._log_file(p)
        p.popen = self.spawn(p.spec)
        self.fails.start(p)
        os.set_blocking(p.popen.stdout.fileno(), False)
        self._sel.register(p.popen.stdout, selectors.EVENT_READ, p)
        self._set_state(p, 'running')

    def _log_file(self, p):
        """--log-dir's file of this process: 'worker-1.log' ('worker-1.restart-2.log' in
        the third attempt; 'worker-1.again.log' started again to join), every line it
        prints, as printed; None without --log-dir."""
        if self.log_dir is None:
            return None
        os.makedirs(self.log_dir, exist_ok=True)
        name = p.spec.role if p.spec.role == 'scheduler' else f'{p.spec.role}-{p.spec.rank}'
        if self.attempt:
            name += f'.restart-{self.attempt}'
        if p.spec.role == 'worker' and p.spec.rank in self.again:
            name += '.again'                # (elastic: started again, to join)
        return open(os.path.join(self.log_dir, f'{name}.log'), 'w', buffering=1,
                    encoding='utf-8', errors='replace')

    def spawn(self, spec):
        """Start one process under the guard (the ssh launcher starts it on its host)."""
        env = child_env(spec)
        if self.starter is not None and spec.role != 'scheduler':
            env[config.variable('starter')] = self.starter.address
        return subprocess.Popen(
            guarded(spec.argv), env=env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)

    def _wait_ready(self, scheduler, timeout=30.0):
        """The port the scheduler listens on, from its first line."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self._pump(0.1):
                if line[0] is scheduler and (m := READY.search(line[1])):
                    self.scheduler_address = f'tcp://{m.group(1)}:{m.group(2)}'
                    return m.group(2)
            self._reap()
            if self.failure is not None or not scheduler.alive:
                self.failure = self.failure or scheduler
                return None
        self._say('the scheduler did not start within 30 s')
        self.failure = scheduler
        return None

    # -- output and exits ----------------------------------------------------------------
    def _pump(self, timeout):
        """Copy what the processes printed, a whole line at a time; return the lines."""
        lines = []
        for key, _ in self._sel.select(timeout):
            p = key.data
            try:
                data = os.read(key.fd, 1 << 16)
            except BlockingIOError:
                continue
            if not data:                       # EOF: the process closed its output
                self._sel.unregister(key.fileobj)
                data, p._buf = p._buf + b'\n' if p._buf else b'', b''
            *complete, p._buf = (p._buf + data).split(b'\n')
            if len(p._buf) > 1 << 20:          # a runaway line without an end
                complete.append(p._buf)
                p._buf = b''
            for raw in complete:
                line = raw.decode(errors='replace').rstrip('\r')
                lines.append((p, line))
                self._emit(p, line)
        return lines

    def _emit(self, p, line):
        if self.fails.said(p, line):      # a worker's word that it joined: not shown
            return
        if p.file is not None:             # --log-dir: every line, as the process printed it
            p.file.write(line + '\n')
        shown = self.on_line(p, line)
        if shown is not None or not line.startswith(TIMELINE):   # (spans: not kept twice)
            self.log.append((p.label, line))
        if shown is not None:
            p.tail.append(shown)           # hidden lines (progress reports) are not news
        if shown is not None and self._on_console(p):
            self.out.write(f'[{p.label}] {shown}\n')
            self.out.flush()

    def _on_console(self, p):
        """Whether ``p``'s lines reach the console (--local-ranks-filter names workers)."""
        return self.console_ranks is None or p.spec.role != 'worker' \
            or p.spec.rank in self.console_ranks

    def _reap(self):
        """Notice processes that exited."""
        for p in self.procs:
            if not p.alive or p.popen.poll() is None:
                continue
            self._drain(p)
            code = p.popen.returncode
            p.code = 128 - code if code < 0 else code
            p.exited_at = time.monotonic()
            if p.state in ('stopped', 'finished'):
                self.on_state(p)             # stopped by us: only the exit code is new
            elif p.code == 0:
                self._set_state(p, 'finished')
            elif self._lost(p):
                self.lost.append(p)
                self.on_change(f'{p.label} lost')
                self._set_state(p, 'failed')
                self._start_again(p)
            else:
                self._set_state(p, 'failed')
                self.failure = self.failure or p

    def _lost(self, p):
        """Elastic: whether the failed worker ``p`` is only lost (enough others remain),
        or a failed server whose shards have replicas; if so, say it in one line."""
        replicas = p.spec.env.get(config.variable('server_replicas'), '0')
        if p.spec.role == 'server' and replicas not in ('', '0'):
            self._say(f'{what_failed(p)}; its replicas take over (--server-replicas '
                      f'{replicas})')
            self._tell_scheduler(p)
            return True
        if self.min_workers is None or p.spec.role != 'worker':
            return False
        left = [q for q in self.procs if q.spec.role == 'worker' and q is not p
                and q not in self.lost and q.state in ('running', 'finished')]
        if len(left) < self.min_workers:
            return False
        self._say(f'{what_failed(p)}; {go_on(len(left))} (--min-workers '
                  f'{self.min_workers})')
        self._tell_scheduler(p)
        return True

    def _tell_scheduler(self, p):
        """Tell the scheduler that the lost worker's or server's process ``p`` has ended,
        so that the others go on now, not once its heartbeats have been missed for
        seconds (an authenticated message, as the nodes' are: runtime/van.py's Notice)."""
        if self.scheduler_address is None:
            return
        if self.notice is None:
            from ..runtime.van import Notice
            self.notice = Notice('launcher', p.spec.env[config.variable('job_secret')],
                                 self.scheduler_address)
        self.notice.send(protocol.ENDED, {'node': f'{p.spec.role}:{p.spec.rank}',
                                          'start': 2 if p.spec.rank in self.again else 1,
                                          'how': describe_exit(p.code)})

    def _close_notice(self):
        if self.notice is not None:
            self.notice.close()
            self.notice = None

    def _start_again(self, p):
        """Elastic, with --restart-lost: start the lost worker ``p`` once more, in its
        place, as a new process that joins the job (while fewer than --max-workers run)."""
        running = [q for q in self.procs if q.spec.role == 'worker' and q.alive]
        if not self.restart_lost or len(running) >= self.max_workers \
                or p.spec.rank in self.again:
            return
        self.again.add(p.spec.rank)
        drop = {config.variable('fail'), config.variable('slow')}
        again = Proc(dataclasses.replace(p.spec, env={
            k: v for k, v in p.spec.env.items() if k not in drop}))
        self.procs[self.procs.index(p)] = again
        if p.file is not None:
            p.file.close()
        self._say(f'starting {p.label} again, to join the job (--restart-lost, at most '
                  f'{self.max_workers} workers)')
        self.on_change(f'{p.label} started again')
        self._start(again)

    def _drain(self, p):
        """Read what an exited process left in its pipe."""
        deadline = time.monotonic() + 0.5
        while self._reading(p) and time.monotonic() < deadline:
            self._pump(0.05)

    def _reading(self, p):
        return any(k.fileobj is p.popen.stdout for k in self._sel.get_map().values())

    def _close_pipes(self):
        """Forget the pipes of an attempt's processes, all of which have ended."""
        for key in list(self._sel.get_map().values()):
            self._sel.unregister(key.fileobj)
        for p in self.procs:
            for pipe in ((p.popen.stdin, p.popen.stdout) if p.popen else ()) + (
                    (p.file,) if p.file else ()):
                try:
                    pipe.close()
                except OSError:
                    pass

    def _set_state(self, p, state):
        p.state = state
        if state == 'finished' and p.code == 0:
            self.fails.exited(p)          # by itself (stopped by us, its code is not known yet)
        self.on_state(p)

    def _say(self, text):
        self.out.write(f'd2l-launch: {text}\n')
        self.out.flush()

    # -- stopping ---------------------------------------------------------------------
    def stop_all(self, state='stopped'):
        """Stop every process still running: SIGTERM to its group, SIGKILL after a grace."""
        live = [p for p in self.procs if p.alive]
        for p in live:
            self._set_state(p, state)
            self.terminate(p)
        deadline = time.monotonic() + config.get().kill_grace + 2
        while any(p.alive for p in live) and time.monotonic() < deadline:
            self._pump(0.05)
            self._reap()
        for p in live:
            if p.alive:
                _signal_group(p.popen.pid, signal.SIGKILL)
                p.popen.wait()
                self._reap()

    def terminate(self, p):
        """Ask one process to stop: SIGTERM to its group, and close the guard's stdin."""
        _signal_group(p.popen.pid, signal.SIGTERM)
        try:
            p.popen.stdin.close()      # the guard's cue too
        except OSError:
            pass


def _signal_group(pgid, sig):
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
