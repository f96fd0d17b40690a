"""``%launch``: run a distributed job from a notebook cell and watch it live.

    %load_ext d2ldist
    %launch -n 2 -s 2 train.py --lr {lr}

The magic takes exactly ``d2l-launch``'s options (it asks the launcher's parser)
and runs the job with the launcher's ``Job``; it adds only the display: the
dashboard (``dashboard.py``), a view of the launcher's ``JobModel``, kept up to date
while the job runs; the processes' lines in the cell's output; and, when the job ends,
its final form after the log (``final.py``). A failed job raises ``JobFailed``; the
variable ``_launch`` then holds a ``LaunchResult`` for later cells.

What the magic shows and hides, and why the final form follows the log:
docs/design/notebook.md.
"""
import sys

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.display import display
from IPython.utils.process import arg_split

from ..launch import cli
from ..launch.job import READY, JobFailed, describe_exit, failure_report
from ..launch.progress import JobModel
from . import final


class LaunchResult:
    """What a finished ``%launch`` leaves behind (in the variable ``_launch``)."""

    def __init__(self, job, model):
        self.code = job.code                   # the job's exit code (0: success)
        self.outcome = model.outcome           # 'finished', 'failed', 'stopped', 'timeout'
        self.exit_codes = {p.label: p.code for p in job.procs}
        self.metrics = {r.rank: dict(r.metrics) for r in model.workers}  # final reports
        self.history = {r.rank: list(r.history) for r in model.workers}  # (epoch, loss, acc, test_acc)
        self.log = list(model.log)             # the merged log, as printed
        self.attempts = [a.describe(model.started) for a in model.attempts]   # --max-restarts
        self._text = final.summary(model)

    @property
    def ok(self):
        return self.code == 0

    def __repr__(self):
        return self._text


class _Out:
    """The job's output: to the cell (so every front end and executor keeps it) and the model."""

    def __init__(self, stream):
        self.model, self.stream = None, stream   # the model comes once the job is made

    def write(self, text):
        self.stream.write(text)
        if self.model is not None:
            self.model.add_log(text)

    def flush(self):
        self.stream.flush()


class _TextView:
    """The view without ipywidgets (terminal IPython): the header line, nothing live."""

    def __init__(self, model):
        self.model = model

    def refresh(self, force=False):
        pass

    def finish(self, handle):
        pass

    def __repr__(self):
        return final.header(self.model)


def widgets_possible(shell):
    """Whether ``shell`` can show ipywidgets: an IPython kernel's, which has comms.

    Asked of what the shell can do, not of its class's name: Colab's shell is a subclass
    of ipykernel's ZMQInteractiveShell, and a kernel of another make that has a comm
    manager carries widgets too. Terminal IPython has neither: it gets the text form."""
    if getattr(getattr(shell, 'kernel', None), 'comm_manager', None) is not None:
        return True
    zmqshell = sys.modules.get('ipykernel.zmqshell')    # a kernel's shell has loaded it
    return zmqshell is not None and isinstance(shell, zmqshell.ZMQInteractiveShell)


def _view(model, shell):
    """The dashboard where widgets can show, else the one-line text form."""
    if not widgets_possible(shell):
        return _TextView(model)
    try:
        from .dashboard import Dashboard
        return Dashboard(model)
    except ImportError:                        # ipywidgets or matplotlib missing
        return _TextView(model)


@magics_class
class LaunchMagics(Magics):
    """The ``%launch`` line magic (``%load_ext d2ldist`` registers it)."""

    @line_magic
    def launch(self, line):
        try:
            args = cli.parse(arg_split(line), prog='%launch')
            if args.dry_run:                   # the plan, nothing started
                sys.stdout.write(cli.dry_run(args))
                return None
        except cli.UsageError as e:
            raise UsageError(f'%launch: {e}') from None
        self._args = args
        out = _Out(sys.stdout)
        try:        # ssh: checks the hosts and syncs the directory first
            job = cli.make_job(args, out=out, notices=False,
                               on_line=lambda p, t: on_line(p, t),
                               on_state=lambda p: on_state(p),
                               on_restart=lambda n, why: on_restart(n, why),
                               on_change=lambda what: model.on_change(what),
                               on_tick=lambda: view.refresh(), last_lines=False)
        except cli.UsageError as e:
            raise UsageError(f'%launch: {e}') from None
        model = out.model = JobModel([p.spec for p in job.procs],
                                     title=f'%launch {line.strip()}')
        view = _view(model, self.shell)
        handle = display(view, display_id=True)

        def on_line(proc, line):
            if proc.spec.role == 'scheduler' and READY.search(line):
                return None                    # the port: kept in the log, not shown
            shown = model.on_line(proc, line)
            if shown is None:                  # a report: the model took it
                view.refresh()
            return shown

        def on_state(proc):
            model.on_state(proc)
            view.refresh()

        def on_restart(attempt, why):
            model.on_restart(attempt, why)
            view.refresh(force=True)

        try:
            job.run()
        except KeyboardInterrupt:
            _stop_for_sure(job)
            self._finish(job, model, view, handle, 'stopped', 'interrupted; every process stopped')
            raise
        if job.code == 0:
            self._finish(job, model, view, handle, 'finished')
            return None
        if job.failure is not None:
            p = job.failure
            message = f'{p.label} failed ({describe_exit(p.code)})'
            self._finish(job, model, view, handle, 'failed', message)
            raise JobFailed(failure_report(p), proc=p)
        message = f'ran longer than --timeout {args.timeout:g} s' if job.code == 124 \
            else f'exit code {job.code}'
        self._finish(job, model, view, handle, 'timeout' if job.code == 124 else 'failed', message)
        raise JobFailed(f'the job {message}; it was stopped')

    def _finish(self, job, model, view, handle, outcome, message=''):
        """The job ended: the dashboard goes, its final form follows the log (and the
        timeline of its last steps, with --timeline)."""
        model.finish(outcome, message)
        self.shell.user_ns['_launch'] = LaunchResult(job, model)
        path = self._args.timeline
        if path:
            cli.write_timeline(model.trace, path, sys.stdout)
        sys.stdout.flush()
        view.finish(handle)
        for bundle in final.outputs(model, timeline=path):
            display(bundle, raw=True)


def _stop_for_sure(job):
    """Stop every process even if the stop button is pressed again meanwhile."""
    while any(p.alive for p in job.procs):
        try:
            job.stop_all()
        except KeyboardInterrupt:
            continue


LaunchMagics.launch.__doc__ = (
    'Run a distributed job (the d2l-launch command) and show a live dashboard.\n\n'
    'A .py script runs with this kernel\'s Python; $var and {expr} are expanded.\n'
    'Afterwards the variable _launch holds the result: exit_codes, metrics, log.\n\n'
    + cli.build_parser('%launch').format_help())
