"""One tool starts every process: what the Slurm and MPI launchers share.

``srun`` and ``mpirun`` each start all of a job's processes at once, on the hosts
they are told, and merge their output into one stream with each line marked by the
task (the process) that printed it. The launcher then sees one child, the tool, and
must tell the job's processes apart by those marks. The pieces:

* a **task word** per process: its command and its own variables (role, rank), as one
  base64 word on the tool's command line; what every process shares (the job's secret
  among it) goes into the tool's own environment, which it hands to every task, never
  onto a command line;
* the **task side**, ``python -m d2ldist.launch.step --task WORD``: runs that command
  with those variables (with ``--label``, relaying its output a whole line at a time,
  each marked ``N: `` as srun's ``--label`` marks them, for a tool that cannot),
  forwards the signals it gets, and prints how the command ended
  (``d2ldist.task: exit N``, hidden by the launcher), so that a process that fails is
  named as the local launcher names it; the command dies with it (a parent-death
  signal), so no process outlives its task;
* ``StepJob``: a Job whose processes are the tasks of one tool process; a subclass says
  the tool's command line, how its lines are marked, which of its own words are noise,
  and how to cancel the step.
"""
import base64
import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time

from .. import config
from ..runtime.hosted import die_with_parent
from .job import Job, Proc
from .processes import ProcSpec, child_env, guarded, shared_env

EXIT = re.compile(r'd2ldist\.task: exit (\d+)')
CANCELLED = 143       # SIGTERM, which srun and mpirun send to every task of a step they end


def task_word(spec, shared):
    """One task's command and own variables, as one word."""
    own = {k: v for k, v in spec.env.items() if shared.get(k) != v}
    data = json.dumps({'argv': spec.argv, 'env': own}).encode()
    return base64.urlsafe_b64encode(data).decode()


def task_argv(spec, shared, python=sys.executable, label=False):
    """The command line that runs one process as a task of the tool (``label``: the
    task side marks its lines)."""
    return [python, '-m', 'd2ldist.launch.step', '--task', task_word(spec, shared),
            *(['--label'] if label else [])]


class StepSpec(ProcSpec):
    """The tool itself (srun, mpirun), as the job's output and failure report name it."""

    @property
    def label(self):
        return self.role


class StepJob(Job):
    """A Job whose processes are the tasks of one tool process; see the module docstring.

    A subclass gives ``tool`` (its name), ``step_argv()`` (its command line),
    ``task_line(line)`` ((task number, text), or None for the tool's own line),
    ``noise(text, own)`` (a line to keep out of the output; ``own``: the tool's, not a
    task's) and, if it
    can, ``cancel()`` (end the step through the cluster's manager)."""
    tool = 'step'
    kills_one = False                         # a task dies only with its step
    drop_env = ()                             # our variables the tool must not see
    tool_env = {}                             # and variables it must see (an allocation's)

    def __init__(self, specs, **kw):
        super().__init__(specs, **kw)
        self.step = None                      # the tool (under the guard), as a Proc
        self.stopping = False                 # stop_all() under way

    def _start_all(self):
        """Start the tool: every process at once."""
        shared = shared_env([p.spec for p in self.procs])
        argv = self.step_argv(shared)
        self.step = Proc(StepSpec(self.tool, 0, argv=argv, env=shared))
        env = {k: v for k, v in {**child_env(self.step.spec), **self.tool_env}.items()
               if k not in self.drop_env}
        self.step.popen = subprocess.Popen(
            guarded(argv), env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True)
        os.set_blocking(self.step.popen.stdout.fileno(), False)
        self._sel.register(self.step.popen.stdout, selectors.EVENT_READ, self.step)
        for p in self.procs:
            p.popen, p.file = self.step.popen, self._log_file(p)
            self._set_state(p, 'running')

    def _emit(self, p, line):
        """A line of the tool's: to the task that printed it, or the tool's own."""
        if p is not self.step:
            return super()._emit(p, line)
        marked = self.task_line(line)
        if self.noise(marked[1] if marked else line, own=marked is None):
            self.log.append((self.tool, line))
            return None
        if marked and marked[0] < len(self.procs):
            proc, text = self.procs[marked[0]], marked[1]
            if e := EXIT.fullmatch(text):
                return self._exited(proc, int(e[1]))
            if self.task_said(proc, text):
                return None
            return super()._emit(proc, text)
        self.step.tail.append(line)
        self.log.append((self.tool, line))
        self.out.write(f'[{self.tool}] {line}\n')
        self.out.flush()
        return None

    def task_said(self, proc, text):
        """A task's line meant for the launcher (True: taken, not shown)."""
        return False

    def _exited(self, p, code):
        """Task ``p``'s command ended with ``code``."""
        p.code, p.exited_at = code, time.monotonic()
        if p.state in ('stopped', 'finished'):
            self.on_state(p)
        elif code == 0:
            self._set_state(p, 'finished')
        elif code == CANCELLED:
            self._set_state(p, 'stopped')         # the step was ended under it
        else:
            self._set_state(p, 'failed')
            self.failure = self.failure or p

    def _reap(self):
        """Notice that the tool exited: the tasks that did not say how they ended, ended so."""
        step = self.step
        if step is None or not step.alive or step.popen.poll() is None:
            return
        self._drain(step)
        step.code = step.popen.returncode if step.popen.returncode >= 0 \
            else 128 - step.popen.returncode
        for p in self.procs:
            if p.alive:
                p.code, p.exited_at = CANCELLED if step.code else 0, time.monotonic()
                self._set_state(p, 'finished' if step.code == 0 and p.state != 'stopped'
                                else 'stopped')
        if step.code and self.failure is None and not self.stopping and not all(
                p.state == 'finished' for p in self.procs if p.spec.role == 'worker'):
            self.failure = step

    def cancel(self):
        """End the step through the cluster's manager, if there is one (Slurm: scancel)."""

    def stop_all(self, state='stopped'):
        """Cancel the step and wait for the tool to end; then stop its guard (SIGTERM,
        SIGKILL after a grace: the tool ends its tasks), and at last SIGKILL it."""
        for p in self.procs:
            if p.alive:
                self._set_state(p, state)
        step = self.step
        if step is None or not step.alive:
            return
        self.stopping = True
        try:
            self.cancel()
            grace = config.get().kill_grace
            for stop, wait in ((lambda: None, grace + 5), (lambda: self.terminate(step),
                                                           2 * grace + 5)):
                stop()
                deadline = time.monotonic() + wait
                while step.alive and time.monotonic() < deadline:
                    self._pump(0.05)
                    self._reap()
            if step.alive:
                os.killpg(step.popen.pid, signal.SIGKILL)
                step.popen.wait()
                self._reap()
        finally:
            self.stopping = False


# -- the task side ---------------------------------------------------------------------
def task_rank(environ=os.environ):
    """This task's number, as the tool that started it says it."""
    for name in ('SLURM_PROCID', 'OMPI_COMM_WORLD_RANK', 'PMI_RANK'):
        if environ.get(name, '').isdigit():
            return int(environ[name])
    return 0


def task_main(word, label=False):
    """Run one task's command with its own variables; print how it ended. ``label``:
    also print the command's output, each line marked 'N: ' with this task's number
    (where the tool cannot mark whole lines itself, as mpirun cannot)."""
    try:
        data = json.loads(base64.urlsafe_b64decode(word))
        argv, env = data['argv'], dict(os.environ, **data['env'])
    except (ValueError, KeyError, TypeError):
        sys.exit('d2ldist.task: --task takes a word written by d2l-launch '
                 '(--launcher slurm or mpi)')
    mark = f'{task_rank()}: ' if label else ''
    if os.environ.get('SLURM_PROCID') == '0':          # under srun: which step this is
        _line(f'd2ldist.task: step {os.environ.get("SLURM_JOB_ID")}.'
              f'{os.environ.get("SLURM_STEP_ID")}')
    try:
        child = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE if label else None,
                                 stderr=subprocess.STDOUT if label else None,
                                 preexec_fn=lambda: die_with_parent(signal.SIGKILL))
    except OSError as e:
        _line(f'{mark}d2l-launch: cannot start {argv[0]!r}: {e.strerror}',
              sys.stdout if label else sys.stderr)
        code = 127
    else:
        def forward(signum, frame):
            child.send_signal(signum)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, forward)
        if label:                                  # each whole line in one write
            for raw in iter(child.stdout.readline, b''):
                sys.stdout.buffer.write(mark.encode() + raw.rstrip(b'\n') + b'\n')
                sys.stdout.buffer.flush()
        code = child.wait()
        code = 128 - code if code < 0 else code
    _line(f'{mark}d2ldist.task: exit {code}')
    sys.exit(code)


def _line(text, stream=None):
    """Write a whole line in one write: print() writes the text and its newline apart
    when Python's output is unbuffered (PYTHONUNBUFFERED), and under mpirun another
    task's line could come between them."""
    stream = stream or sys.stdout
    stream.buffer.write(text.encode() + b'\n')
    stream.buffer.flush()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    label = argv[2:] == ['--label']
    if len(argv) != 2 + label or argv[0] != '--task':
        sys.exit('d2ldist.task: runs one task of d2l-launch --launcher slurm or mpi '
                 '(--task WORD [--label]); start jobs with d2l-launch')
    task_main(argv[1], label)


if __name__ == '__main__':
    main()
