"""``d2l-launch``: start a job of one scheduler, S servers and N workers.

    d2l-launch -n 2 -s 2 python train.py --lr 0.1
    d2l-launch -n 4 -s 0 train.py              # a .py file runs with this Python

The options follow MXNet's tools/launch.py. Everything after the options (or after
``--``) is the command each worker runs.
"""
import argparse
import secrets
import shlex
import shutil
import signal
import sys
from pathlib import Path

from .job import Job, Terminated
from .placement import local_specs, port_is_free
from .progress import Progress


class UsageError(Exception):
    """Bad input: reported in one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):            # one line, not argparse's usage block
        raise UsageError(message)


def build_parser(prog='d2l-launch'):
    """The launcher's options (the %launch magic takes the same)."""
    p = _Parser(prog=prog, description='Start a distributed job: one scheduler, '
                'S servers and N workers, with their output merged.')
    p.add_argument('-n', '--num-workers', type=int, required=True,
                   help='number of worker processes (>= 1)')
    p.add_argument('-s', '--num-servers', type=int, default=None,
                   help='number of parameter servers (default: as many as workers; '
                   '0 for jobs without servers)')
    p.add_argument('--launcher', choices=['local'], default='local',
                   help='how processes are started (default: local)')
    p.add_argument('-H', '--hostfile', default=None,
                   help='the hosts to run on (for --launcher ssh)')
    p.add_argument('--env', action='append', default=[], metavar='NAME=VALUE',
                   help='set an environment variable in every process (repeatable)')
    p.add_argument('--port', type=int, default=None,
                   help="the scheduler's port (default: a free one)")
    p.add_argument('--timeout', type=float, default=None, metavar='SECONDS',
                   help='stop the whole job after this many seconds')
    p.add_argument('command', nargs=argparse.REMAINDER,
                   help='the command each worker runs')
    return p


def parse(argv, prog='d2l-launch'):
    """Parse and check the options; raise UsageError on bad input."""
    args = build_parser(prog).parse_args(argv)
    if args.num_workers < 1:
        raise UsageError(f'-n must be at least 1, got {args.num_workers}')
    if args.num_servers is None:
        args.num_servers = args.num_workers
    if args.num_servers < 0:
        raise UsageError(f'-s must be 0 or more, got {args.num_servers}')
    if args.hostfile is not None and args.launcher == 'local':
        raise UsageError('-H/--hostfile needs --launcher ssh')
    if args.timeout is not None and args.timeout <= 0:
        raise UsageError(f'--timeout must be positive, got {args.timeout:g}')
    if args.port is not None and not (0 < args.port < 65536 and port_is_free(args.port)):
        raise UsageError(f'port {args.port} is not free')
    args.env = dict(_name_value(item) for item in args.env)
    args.command = command_of(args.command)
    return args


def _name_value(item):
    name, eq, value = item.partition('=')
    if not eq or not name.isidentifier():
        raise UsageError(f'--env takes NAME=VALUE, got {item!r}')
    return name, value


def command_of(words, python=sys.executable):
    """The worker command, checked: ``x.py`` and ``python x.py`` run with our Python."""
    if words[:1] == ['--']:
        words = words[1:]
    if len(words) == 1 and ' ' in words[0]:   # MXNet style: "python train.py" quoted
        words = shlex.split(words[0])
    if not words:
        raise UsageError('no command given: d2l-launch -n N [options] command ...')
    if words[0].endswith('.py'):
        words = [python, *words]
    elif words[0] in ('python', 'python3'):   # the launcher's own Python, as in MXNet
        words = [python, *words[1:]]
    if shutil.which(words[0]) is None:
        raise UsageError(f'cannot start {words[0]!r}: command not found')
    if Path(words[0]).name.startswith('python') and len(words) > 1 \
            and words[1].endswith('.py') and not Path(words[1]).is_file():
        raise UsageError(f'no such script: {words[1]}')
    return words


def job_specs(args):
    """The processes of the job that parsed options describe (``%launch`` uses it too)."""
    specs = local_specs(args.num_workers, args.num_servers, args.command,
                        secrets.token_hex(32), extra_env=args.env)
    if args.port:
        specs[0].env['D2L_SCHEDULER_PORT'] = str(args.port)
    return specs


def _terminate(signum, frame):
    raise Terminated()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse(argv)
    except UsageError as e:
        print(f'd2l-launch: error: {e}', file=sys.stderr)
        return 2
    specs = job_specs(args)
    signal.signal(signal.SIGTERM, _terminate)
    progress = Progress()          # report lines become progress lines
    job = Job(specs, timeout=args.timeout, out=progress, on_line=progress.on_line)
    try:
        return job.run()
    except KeyboardInterrupt:
        return 130
    except Terminated:
        return 143


if __name__ == '__main__':
    sys.exit(main())
