"""``d2l-launch``: start a job of one scheduler, S servers and N workers.

    d2l-launch -n 2 -s 2 python train.py --lr 0.1
    d2l-launch -n 4 -s 0 train.py              # a .py file runs with this Python
    d2l-launch -n 2 -s 2 -H hosts --launcher ssh --sync-dst-dir /tmp/job python train.py

The options follow MXNet's tools/launch.py. Everything after the options (or after
``--``) is the command each worker runs.
"""
import argparse
import faulthandler
import importlib.metadata
import os
import secrets
import shlex
import shutil
import signal
import sys
from pathlib import Path

from .. import config
from ..runtime import hang, pacing
from ..runtime.scheduler import MOST_WORKERS
from .job import Job, Terminated
from .processes import cores, local_specs, port_is_free, share_cores
from .progress import Progress


HELP = 'see d2l-launch --help'
MOST_SLOTS = 1024        # -H host:N above this is an ssh port (d2l-launch before 0.2)


class UsageError(Exception):
    """Bad input: reported in one line, exit code 2; ``hint``: the fix is an option, and
    the line ends with "see d2l-launch --help"."""

    def __init__(self, message, hint=False):
        super().__init__(message)
        self.hint = hint


class _Parser(argparse.ArgumentParser):
    def error(self, message):            # one line, not argparse's usage block
        raise UsageError(message, hint=True)


def version():
    """d2ldist's version: the installed package's, else the package's ``__version__``
    (read from the package already loaded: nothing inside d2ldist imports its face)."""
    try:
        return importlib.metadata.version('d2ldist')
    except importlib.metadata.PackageNotFoundError:
        return sys.modules[__name__.split('.')[0]].__version__


# The launcher's options, a group at a time: (flags, how argparse reads them, help).
# The order is the help's order; --interface takes its default from config when the
# parser is built (build_parser).
OPTIONS = {
    'the job': (
        ('-n --num-workers -np', dict(type=int, default=None),
         'number of worker processes (>= 1; -np as in horovodrun and mpirun; '
         "inside a Slurm allocation: its task count, SLURM_NTASKS, unless given)"),
        ('-s --num-servers', dict(type=int, default=None),
         'number of parameter servers (default: as many as workers, so -n 4 '
         'starts 4 workers, 4 servers and a scheduler; -s 0: no servers, the ring)'),
        ('--launcher', dict(choices=['local', 'ssh', 'slurm', 'mpi'], default=None),
         'how processes are started (default: local, but slurm inside a Slurm '
         'allocation of several nodes; slurm: as one srun step, inside an '
         "allocation of salloc or sbatch; mpi: by Open MPI's mpirun, on the hosts "
         'of -H or on this machine)'),
        ('--dry-run', dict(action='store_true'),
         'print the plan (every process: role, rank, host, and the command '
         "that starts it) and start nothing (mpirun's --display-map)"),
        ('--config-file', dict(default=None, metavar='FILE'),
         'read options from a TOML file: the long options as keys '
         '(num-workers = 4, env = ["A=1"]); the command line wins'),
        ('--version', dict(action='version', version=f'%(prog)s {version()}'),
         "print d2ldist's version and exit"),
    ),
    'slurm': (
        ('--partition', dict(default=None, metavar='P'),
         'slurm, outside an allocation: ask for one in partition P (salloc), '
         'run the job in it, and give it back when the job ends'),
        ('--nodes', dict(type=int, default=None, metavar='K'),
         'slurm, with --partition: the number of nodes to ask for'),
        ('--time', dict(default=None, metavar='T'),
         "slurm, with --partition: the allocation's time limit, salloc's --time "
         '(30, 2:00:00)'),
        ('--account', dict(default=None, metavar='A'),
         "slurm, with --partition: the account to charge, salloc's --account"),
        ('--gres', dict(default=None, metavar='G'),
         "slurm, with --partition: generic resources per node, salloc's --gres (gpu:4)"),
        ('--salloc-args', dict(default=None, metavar='"ARGS"'),
         'slurm, with --partition: more salloc options, in one word after = '
         '(--salloc-args="--qos=debug --mem=8G")'),
    ),
    'hosts (ssh, mpi)': (
        ('-H --hosts', dict(default=None, metavar='HOST:SLOTS,...'),
         'ssh, mpi: the hosts, each with its slots (workers), as in horovodrun '
         'and mpirun: h1:2,h2:2 (h1: one slot)'),
        ('--hostfile', dict(default=None, metavar='FILE'),
         'ssh, mpi: the hosts, a file of "host slots=N" lines (# comments)'),
        ('--host-discovery-script', dict(default=None, metavar='S'),
         'ssh, elastic (with --min-workers): instead of -H, a program that '
         'prints the hosts, host or host:slots per line (horovodrun\'s); it runs '
         'every second: workers start on hosts that appear and stop on hosts '
         'that go'),
        ('--sync-dst-dir', dict(default=None, metavar='DIR'),
         'ssh, mpi: first rsync the current directory to DIR on every host '
         '(without .git and .venv) and run there'),
        ('--sync-all', dict(action='store_true'),
         'ssh, mpi: with --sync-dst-dir, copy .git and .venv too'),
        ('--python', dict(default=None, metavar='PATH'),
         "ssh, mpi: the Python on the hosts (default: the launcher's, same path)"),
        ('--interface', dict(metavar='NAME'),
         'ssh, mpi: the network interface whose address the '
         'processes advertise (default: $D2L_INTERFACE, else the route '
         'to the scheduler)'),
        ('--ssh-config', dict(default=None, metavar='FILE'),
         'ssh, mpi: use this ssh config file (ssh -F FILE): where each '
         "host's user and port are set"),
        ('--ssh-port', dict(type=int, default=None, metavar='PORT'),
         'ssh: the port of every host (default: ssh\'s, or the ssh config\'s)'),
        ('--connect-timeout', dict(type=float, default=10, metavar='SECONDS'),
         'ssh, mpi: give up on a host that does not answer within this time'),
    ),
    'environment': (
        ('--env', dict(action='append', default=[], metavar='NAME=VALUE'),
         'set an environment variable in every process (repeatable)'),
        ('--env-server', dict(action='append', default=[], metavar='NAME=VALUE'),
         'set an environment variable in the servers only (repeatable; '
         "MXNet's NAME:VALUE too)"),
        ('--env-worker', dict(action='append', default=[], metavar='NAME=VALUE'),
         'set an environment variable in the workers only (repeatable; '
         "MXNet's NAME:VALUE too)"),
    ),
    'a simulated network, stragglers and failures': (
        ('--bandwidth', dict(default=None, metavar='RATE'),
         "simulate a network: pace each process's outgoing messages to "
         'RATE, in bits (1Gbit, 100Mbit/s, 250Mbps) or bytes (100MB/s, 12MiB/s)'),
        ('--latency', dict(default=None, metavar='TIME'),
         'simulate a network: deliver every message TIME after it has '
         'been sent (0.5ms, 200us, 1s)'),
        ('--slow', dict(action='append', default=[], metavar='worker:R=SLOW'),
         'make worker R a straggler: each compute step SLOW times as long '
         '(3x) or longer by a time (+200ms); repeatable'),
        ('--fail', dict(action='append', default=[], metavar='ROLE:R@WHEN'),
         'kill a process (SIGKILL, as a crash): worker R after its compute '
         'step N (worker:1@step=40), server R after its N-th sync round (in '
         'dist_async: push) (server:0@step=3), or either, or the scheduler, a '
         'time after it joined (server:0@30s, scheduler@5s); a worker that never '
         'joins through d2ldist (a plain torch.distributed script): the time counts '
         'from its start and the launcher kills it (local and ssh), and a step, '
         'which only d2ldist counts, is said at the end never to have fired, as '
         'is a fault of a worker that exited 0 first; repeatable'),
    ),
    'what a failure costs': (
        ('--max-restarts', dict(type=int, default=0, metavar='K'),
         'when a process fails, stop the job and start every process again, '
         'up to K times (default: 0); --fail and --slow act in the first '
         'attempt only'),
        ('--min-workers --min-np', dict(type=int, default=None, metavar='A'),
         'elastic workers: a lost worker does not stop the job while at '
         'least A workers remain; the ring re-forms without it (-s 0), or the '
         "servers' sync rounds count the workers left (-s 1 or more)"),
        ('--max-workers --max-np', dict(type=int, default=None, metavar='B'),
         'with --min-workers: at most B workers (B at least -n), as in '
         'horovodrun: those a --host-discovery-script adds, or --restart-lost '
         'starts again'),
        ('--restart-lost', dict(action='store_true'),
         'with --min-workers: a lost worker is started again, once, and joins '
         'the job, while fewer than --max-workers (default: -n) run'),
        ('--server-replicas', dict(type=int, default=0, metavar='R'),
         "each server's keys are also held by the next R servers (chain "
         'replication): a lost server does not stop the job, its replica answers '
         'for it (default: 0)'),
        ('--shard-replicas', dict(type=int, default=0, metavar='R'),
         "ZeRO stages 1-3 on the ring: 1 keeps each worker's shard of the "
         "optimizer's state also on its ring successor, so that with --min-workers "
         'a lost worker\'s shard is taken from there (default: 0)'),
        ('--checkpoint-dir', dict(default=None, metavar='DIR'),
         "a folder every worker can read, for the job's checkpoints: "
         'd2ldist.train saves them there and resumes from the newest; so do '
         'd2ldist.checkpoint.save(state) and load(state) in any way of training '
         '(Horovod, ZeRO, FSDP2)'),
        ('--checkpoint-every', dict(type=int, default=None, metavar='N'),
         'with --checkpoint-dir: steps between two checkpoints (default: 100)'),
        ('--checkpoint-keep', dict(type=int, default=None, metavar='K'),
         'with --checkpoint-dir: how many checkpoints to keep, the newest '
         '(default: 3)'),
    ),
    'watching the job': (
        ('--hang-warn', dict(default=None, metavar='SECONDS'),
         'a process that has waited this long for others (a collective, a '
         'barrier, a sync round) says for what and who is missing (default: 30)'),
        ('--hang-fail', dict(default=None, metavar='SECONDS'),
         '... and after this long the job fails with that message '
         '(default: wait on)'),
        ('--timeline', dict(default=None, metavar='FILE'),
         'record what every worker and server does (steps, collectives, '
         'push/pull, waits) into FILE, a Chrome trace (Perfetto, chrome://tracing)'),
        ('--timeline-steps', dict(default=None, metavar='FIRST-LAST'),
         'with --timeline: record only these training steps (20-40)'),
        ('--log-dir', dict(default=None, metavar='DIR'),
         "also write each process's output to a file of its own in DIR "
         '(scheduler.log, server-0.log, worker-1.log, ...), beside the merged '
         'output'),
        ('--local-ranks-filter', dict(default=None, metavar='RANKS'),
         "only these workers' lines reach the console (0 or 0,2-3; torchrun's); "
         'the scheduler and servers still do, and --log-dir keeps every line'),
    ),
    'the scheduler and the end': (
        ('--port', dict(type=int, default=None),
         "the scheduler's port (default: a free one)"),
        ('--timeout', dict(type=float, default=None, metavar='SECONDS'),
         'stop the whole job after this many seconds'),
        ('command', dict(nargs=argparse.REMAINDER),
         'the command each worker runs'),
    ),
}


def build_parser(prog='d2l-launch', loose=False):
    """The launcher's options (the %launch magic takes the same); ``loose``: no
    --help (the first look, for a --config-file)."""
    p = _Parser(prog=prog, add_help=not loose, description='Start a distributed job: one scheduler, '
                'S servers and N workers, with their output merged.')
    for rows in OPTIONS.values():
        for flags, how, text in rows:
            p.add_argument(*flags.split(), help=text, **how)
    p.set_defaults(interface=config.get().interface)
    return p


def parse(argv, prog='d2l-launch', environ=os.environ):
    """Parse and check the options; raise UsageError on bad input. ``environ``: the
    launcher's variables (a Slurm allocation's say the launcher and -n)."""
    try:               # our own D2L_* variables, which local processes inherit too
        config.get()
    except ValueError as e:
        raise UsageError(str(e)) from None
    args = _with_config_file(prog, argv)
    _in_allocation(args, environ)
    if args.num_workers < 1:
        raise UsageError(f'-n must be at least 1, got {args.num_workers}')
    if args.num_servers is None:
        args.num_servers = args.num_workers
    if args.num_servers < 0:
        raise UsageError(f'-s must be 0 or more, got {args.num_servers}')
    _check_hosts(args)
    _check_launcher(args, environ)
    _check_values(args)
    _set_environments(args)
    args.console_ranks = _ranks(args.local_ranks_filter, args.num_workers)
    if args.launcher == 'ssh' or args.hosts_given:   # the program need only exist on the hosts
        args.command = command_of(args.command, args.python or sys.executable, local=False)
    else:
        args.command = command_of(args.command)
    return args


def _in_allocation(args, environ):
    """Inside a Slurm allocation: the launcher (slurm, over several nodes) and -n (its
    tasks) unless given, and ``args.notice``, the line that says what was taken; outside,
    -n is needed. Under an srun of several tasks: refused."""
    from . import slurm
    try:
        launcher, tasks, where = slurm.inside(environ)
    except slurm.SlurmError as e:
        raise UsageError(str(e)) from None
    taken = []
    if args.launcher is None:
        args.launcher = launcher or 'local'
        if launcher == 'slurm':
            taken.append('--launcher slurm, one srun step over its nodes (--launcher '
                         'local keeps the job on this node)')
    if args.num_workers is None and tasks is None:
        raise UsageError('-n N, the number of workers, is needed' + (
            ' (inside a Slurm allocation, its SLURM_NTASKS)' if where is None else
            ': this Slurm allocation sets no SLURM_NTASKS (salloc or sbatch -n does)'),
            hint=True)
    if args.num_workers is None:
        args.num_workers = tasks
        taken.append(f'-n {tasks}, its SLURM_NTASKS')
    args.notice = f'{where}: {"; ".join(taken)}' if taken else None


def _check_launcher(args, environ):
    """The options that belong to a launcher are given with it, and its hosts answer."""
    if args.launcher not in ('ssh', 'mpi'):
        for name, value in (('-H/--hostfile', args.hosts or args.hostfile),
                            ('--sync-dst-dir', args.sync_dst_dir), ('--python', args.python)):
            if value is not None:
                raise UsageError(f'{name} needs --launcher ssh (or mpi)')
    elif not args.hosts_given and args.launcher == 'ssh' and not args.host_discovery_script:
        raise UsageError('--launcher ssh needs -H host1,host2 (or --hostfile FILE)', hint=True)
    elif not args.hosts_given and args.sync_dst_dir is not None \
            and not args.host_discovery_script:
        raise UsageError('--sync-dst-dir needs hosts to sync to: -H host1,host2 or '
                         '--hostfile FILE')
    if args.host_discovery_script is not None:
        _check_discovery(args)
    for name, value in (('--min-workers', args.min_workers),
                        ('--server-replicas', args.server_replicas or None)):
        if args.launcher in ('slurm', 'mpi') and value is not None:
            raise UsageError(f'{name} needs --launcher local or ssh: '
                             f'{"srun" if args.launcher == "slurm" else "mpirun"} ends every '
                             'process when one fails')
    if args.launcher != 'slurm' and (args.partition or args.nodes):
        raise UsageError(f'{"--partition" if args.partition else "--nodes"} needs '
                         '--launcher slurm')
    if args.nodes is not None and (args.nodes < 1 or not args.partition):
        raise UsageError('--nodes needs --partition P, and at least 1 node' if args.nodes >= 1
                         else f'--nodes must be at least 1, got {args.nodes}')
    _check_salloc(args)
    if args.launcher == 'slurm':
        from . import slurm
        try:
            slurm.check(args.partition, environ)
        except slurm.SlurmError as e:
            raise UsageError(str(e)) from None
    if args.launcher == 'mpi':
        from . import mpi
        try:
            mpi.hosts_of(args)
        except (mpi.MpiError, mpi.HostError) as e:
            raise UsageError(str(e)) from None


def _check_salloc(args):
    """--time, --account, --gres and --salloc-args go to the salloc of --partition;
    ``args.salloc_args``: the last as words."""
    for name in ('time', 'account', 'gres', 'salloc_args'):
        if getattr(args, name) is not None and not args.partition:
            raise UsageError(f'--{name.replace("_", "-")} is an option of salloc, for the '
                             'allocation that --partition P asks for (inside an allocation, '
                             'salloc or sbatch took it)', hint=True)
    try:
        args.salloc_args = shlex.split(args.salloc_args or '')
    except ValueError as e:
        raise UsageError(f'--salloc-args {args.salloc_args!r}: {e}') from None


def _with_config_file(prog, argv):
    """Parse ``argv``; with --config-file, the file's options first, so that the
    command line wins (options given more than once, as --env, take both)."""
    args, _ = build_parser(prog, loose=True).parse_known_args(argv)
    if args.config_file is not None:
        options = argv[:len(argv) - len(args.command)]
        argv = [*config_file_argv(args.config_file), *options, *args.command]
    return build_parser(prog).parse_args(argv)


def config_file_argv(path):
    """A --config-file's options as command-line words: ``name = value`` (TOML) as
    ``--name=value`` (a value may start with -); a list as the option repeated; true as
    the flag alone."""
    where = f'--config-file {path}'
    if Path(path).suffix in ('.yaml', '.yml'):
        raise UsageError(f'{where}: YAML needs PyYAML, which d2ldist does not install; '
                         'write the same keys as TOML (FILE.toml)')
    import tomllib
    try:
        with open(path, 'rb') as f:
            table = tomllib.load(f)
    except OSError as e:
        raise UsageError(f'{where}: {e.strerror}') from None
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f'{where}: not TOML: {e}') from None
    kinds = {flag: how.get('action', 'store') for rows in OPTIONS.values()
             for flags, how, _ in rows for flag in flags.split() if flag.startswith('--')}
    words = []
    for key, value in table.items():
        flag = '--' + key.replace('_', '-')
        if kinds.get(flag) in (None, 'version') or flag == '--config-file':
            raise UsageError(f'{where}: {key!r} is not an option of d2l-launch', hint=True)
        if kinds[flag] == 'store_true':
            words += [flag] if value is True else []
        else:
            words += [f'{flag}={v}' for v in (value if isinstance(value, list) else [value])]
    return words


def _check_hosts(args):
    """-H (hosts with slots) and --hostfile, apart; the old -H spellings, refused with
    the new one. ``args.hosts_given``: whether either names hosts."""
    if args.hosts is not None and args.hostfile is not None:
        raise UsageError('-H and --hostfile both list hosts: give one', hint=True)
    if args.hosts is not None and (os.path.isfile(args.hosts) or '/' in args.hosts):
        raise UsageError(f'-H {args.hosts}: a file of hosts is --hostfile {args.hosts} '
                         '(-H lists host:slots,...)', hint=True)
    for item in (args.hosts or '').split(','):
        slots = item.rpartition(':')[2] if ':' in item else ''
        if slots.isdigit() and int(slots) > MOST_SLOTS:
            raise UsageError(f'-H {item}: {slots} slots? -H takes host:slots (horovodrun\'s, '
                             f'mpirun\'s); an ssh port is --ssh-port {slots} or an ssh config '
                             '(--ssh-config FILE)', hint=True)
    if args.ssh_port is not None and not 0 < args.ssh_port < 65536:
        raise UsageError(f'--ssh-port must be between 1 and 65535, got {args.ssh_port}')
    if args.ssh_port is not None and args.launcher != 'ssh':
        raise UsageError('--ssh-port needs --launcher ssh (mpi: put the port in an ssh '
                         'config, --ssh-config FILE)', hint=True)
    args.hosts_given = args.hosts is not None or args.hostfile is not None


def _ranks(text, n):
    """--local-ranks-filter's worker ranks ('0', '0,2-3') as a set; None: all."""
    if text is None:
        return None
    ranks = set()
    for item in text.split(','):
        first, dash, last = item.strip().partition('-')
        if not first.isdigit() or (dash and not last.isdigit()):
            raise UsageError(f'--local-ranks-filter takes ranks as 0,2-3, got {text!r}')
        ranks.update(range(int(first), int(last if dash else first) + 1))
    if max(ranks) >= n:
        raise UsageError(f'--local-ranks-filter {text}: the workers are 0 to {n - 1}')
    return ranks


def _check_values(args):
    """The folders, times and numbers given are ones the job can use."""
    if args.log_dir is not None:   # (made when the job starts; a file there is refused)
        args.log_dir = os.path.abspath(args.log_dir)
        if os.path.exists(args.log_dir) and not os.path.isdir(args.log_dir):
            raise UsageError(f'--log-dir {args.log_dir}: not a folder')
    if args.sync_dst_dir is not None and not os.path.isabs(args.sync_dst_dir):
        raise UsageError(f'--sync-dst-dir needs an absolute path, got {args.sync_dst_dir!r}')
    if args.connect_timeout <= 0:
        raise UsageError(f'--connect-timeout must be positive, got {args.connect_timeout:g}')
    if args.timeout is not None and args.timeout <= 0:
        raise UsageError(f'--timeout must be positive, got {args.timeout:g}')
    if args.max_restarts < 0:
        raise UsageError(f'--max-restarts must be 0 or more, got {args.max_restarts}')
    if args.port is not None and not (0 < args.port < 65536 and (
            args.launcher != 'local' or port_is_free(args.port))):
        raise UsageError(f'port {args.port} is not free')


def _set_environments(args):
    """``args.env``, the variables every process gets, and ``args.process_env``, those of
    each process an option names, by (role, rank)."""
    args.env = dict(_name_value(item) for item in args.env)
    args.env.update(_network_env(args.bandwidth, args.latency))
    args.env.update(_watch_env(args))
    args.env.update(_checkpoint_env(args))
    args.env.update(_elastic_env(args))      # (reads the backend chosen with --env)
    args.env.update(_replicas_env(args))
    args.env.update(_shard_replicas_env(args))
    try:               # what every process will read: a bad --env value fails here, once
        config.Config.from_env(args.env)
    except ValueError as e:
        raise UsageError(f'--env {e}') from None
    args.process_env = _role_env(args)
    for process, env in _faults(args).items():
        args.process_env.setdefault(process, {}).update(env)


def _name_value(item, option='--env', mxnet=False):
    """'NAME=VALUE' -> (NAME, VALUE); ``mxnet``: 'NAME:VALUE' too, as MXNet's launch.py."""
    name, eq, value = item.partition('=')
    if not eq and mxnet:
        name, eq, value = item.partition(':')
    if not eq or not name.isidentifier():
        raise UsageError(f'{option} takes NAME=VALUE, got {item!r}')
    return name, value


def _role_env(args):
    """--env-server and --env-worker (MXNet's) as the variables of each process they name."""
    env = {}
    for option, role, count in (('--env-server', 'server', args.num_servers),
                                ('--env-worker', 'worker', args.num_workers)):
        items = getattr(args, option[2:].replace('-', '_'))
        values = dict(_name_value(item, option, mxnet=True) for item in items)
        try:
            config.Config.from_env(values)
        except ValueError as e:
            raise UsageError(f'{option} {e}') from None
        for rank in range(count if values else 0):
            env.setdefault((role, rank), {}).update(values)
    return env


def _faults(args):
    """--slow and --fail as the variables of the processes they name (runtime/faults.py)."""
    env = {}
    for option, items, sep, name, parse in (
            ('--slow', args.slow, '=', 'slow', config.parse_slow),
            ('--fail', args.fail, '@', 'fail', config.parse_fail)):
        for item in items:
            target, mark, value = item.partition(sep)
            role, _, rank = target.partition(':')
            if target == 'scheduler':           # the one scheduler: no rank needed
                rank = '0'
            count = {'worker': args.num_workers, 'server': args.num_servers,
                     'scheduler': 1}.get(role)
            roles = ('worker',) if option == '--slow' else ('worker', 'server', 'scheduler')
            if not mark or role not in roles or not rank.isdigit() or int(rank) >= count:
                raise UsageError(f'{option} takes {"worker:R=3x" if sep == "=" else "ROLE:R@step=N"}'
                                 f' with a rank of this job, got {item!r}')
            try:
                kind = parse(value)
            except ValueError as e:
                raise UsageError(f'{option} {item}: {e}') from None
            if option == '--fail' and role == 'scheduler' and kind[0] == 'step':
                raise UsageError(f'--fail {item}: the scheduler fails at a time (scheduler@5s)')
            env.setdefault((role, int(rank)), {}).update(config.env(**{name: value}))
    return env


def _watch_env(args):
    """--hang-warn, --hang-fail and --timeline as the processes read them (runtime/hang.py,
    runtime/spans.py)."""
    env = {}
    try:
        for option, name, value in (('--hang-warn', 'hang_warn', args.hang_warn),
                                    ('--hang-fail', 'hang_fail', args.hang_fail)):
            if value is not None:
                env.update(config.env(**{name: hang.parse_seconds(value, option)}))
        if args.timeline_steps is not None:
            if args.timeline is None:
                raise ValueError('--timeline-steps needs --timeline FILE')
            config.parse_window(args.timeline_steps)
            env.update(config.env(timeline_steps=args.timeline_steps))
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.timeline is not None:
        folder = Path(args.timeline).resolve().parent
        if not folder.is_dir():
            raise UsageError(f'--timeline {args.timeline}: no folder {folder}')
        env.update(config.env(timeline=True))
    return env


def _checkpoint_env(args):
    """--checkpoint-dir, --checkpoint-every and --checkpoint-keep as the workers read them.

    The folder is made absolute: here, from our directory; over ssh, from the one the
    processes run in (an absolute path stays as given, a path on the hosts)."""
    for option, value in (('--checkpoint-every', args.checkpoint_every),
                          ('--checkpoint-keep', args.checkpoint_keep)):
        if value is not None and args.checkpoint_dir is None:
            raise UsageError(f'{option} needs --checkpoint-dir DIR')
        if value is not None and value < 1:
            raise UsageError(f'{option} must be at least 1, got {value}')
    if args.checkpoint_dir is None:
        return {}
    if not args.checkpoint_dir.strip():
        raise UsageError('--checkpoint-dir needs a folder, got an empty name')
    if args.launcher == 'ssh' or args.hosts_given:    # a folder on the hosts
        folder = os.path.join(args.sync_dst_dir or os.getcwd(), args.checkpoint_dir)
    else:
        folder = os.path.abspath(args.checkpoint_dir)
        if os.path.exists(folder) and not os.path.isdir(folder):
            raise UsageError(f'--checkpoint-dir {args.checkpoint_dir}: not a folder')
    env = config.env(checkpoint_dir=folder)
    if args.checkpoint_every is not None:
        env.update(config.env(checkpoint_every=args.checkpoint_every))
    if args.checkpoint_keep is not None:
        env.update(config.env(checkpoint_keep=args.checkpoint_keep))
    return env


def _check_discovery(args):
    """--host-discovery-script: with the ssh launcher and --min-workers, not with -H."""
    script = args.host_discovery_script
    if args.launcher != 'ssh' or args.hosts_given or args.min_workers is None:
        raise UsageError('--host-discovery-script needs --launcher ssh and --min-workers A, '
                         'and takes the place of -H')
    if not (os.path.isfile(script) and os.access(script, os.X_OK)):
        raise UsageError(f'--host-discovery-script {script}: not an executable file')


def _elastic_env(args):
    """--min-workers, --max-workers and --restart-lost, checked; the scheduler reads
    D2L_MIN_WORKERS and D2L_MAX_WORKERS (set: workers may join), the workers
    D2L_MAX_WORKERS too."""
    low, high, n = args.min_workers, args.max_workers, args.num_workers
    if low is None:
        for option, value in (('--max-workers', high), ('--restart-lost', args.restart_lost)):
            if value:
                raise UsageError(f'{option} needs --min-workers A', hint=True)
        return {}
    if not 1 <= low <= n:
        raise UsageError(f'--min-workers must be between 1 and -n ({n}), got {low}')
    if high is not None and high < n:
        raise UsageError(f'--max-workers must be at least -n ({n}), got {high}')
    if high is not None and not (args.restart_lost or args.host_discovery_script):
        raise UsageError(f'--max-workers {high} bounds the workers that join, as horovodrun\'s '
                         '--max-np: to start a lost worker again, once, add --restart-lost',
                         hint=True)
    if args.env.get(config.variable('backend')) == 'torch':
        raise UsageError('--min-workers needs the ring backend or servers (-s): '
                         'torch.distributed cannot change its workers (use torchrun '
                         '--nnodes MIN:MAX)')
    if high is None and args.host_discovery_script is not None:
        high = MOST_WORKERS                 # (the hosts the script lists decide)
    elif high is None and args.restart_lost:
        high = n
    args.max_workers = high
    return config.env(min_workers=low, **({'max_workers': high} if high else {}))


def _replicas_env(args):
    """--server-replicas R, checked: a replica must be another server (R < -s)."""
    r, s = args.server_replicas, args.num_servers
    if r == 0:
        return {}
    if r < 0:
        raise UsageError(f'--server-replicas must be 0 or more, got {r}')
    if r >= s:
        raise UsageError(f'--server-replicas {r} needs at least {r + 1} servers (-s '
                         f'{r + 1}): a replica is another server; got -s {s}')
    return config.env(server_replicas=r)


def _shard_replicas_env(args):
    """--shard-replicas 0 or 1, checked: the replica goes to the ring successor."""
    r = args.shard_replicas
    if r == 0:
        return {}
    if r != 1:
        raise UsageError(f'--shard-replicas must be 0 or 1, got {r}')
    if args.env.get(config.variable('backend')) == 'torch':
        raise UsageError('--shard-replicas needs the ring backend: the replica is sent to '
                         'the ring successor')
    if args.max_workers:
        raise UsageError('--shard-replicas goes on without lost workers, and takes in no new '
                         'ones: not with --max-workers, --restart-lost or a discovery script')
    return config.env(shard_replicas=r)


def _network_env(bandwidth, latency):
    """The simulated network as the van reads it: bytes/s and seconds (see pacing.py)."""
    env = {}
    try:
        if bandwidth is not None:
            env.update(config.env(bandwidth=config.parse_bandwidth(bandwidth)))
        if latency is not None:
            env.update(config.env(latency=config.parse_latency(latency)))
    except ValueError as e:
        raise UsageError(f'--{e}') from None
    return env


def command_of(words, python=sys.executable, local=True):
    """The worker command, checked: ``x.py`` and ``python x.py`` run with our Python.

    ``local=False`` (ssh): the program is looked for on the hosts, not here."""
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
    if local and shutil.which(words[0]) is None:
        raise UsageError(f'cannot start {words[0]!r}: command not found')
    if Path(words[0]).name.startswith('python') and len(words) > 1 \
            and words[1].endswith('.py') and not Path(words[1]).is_file():
        raise UsageError(f'no such script: {words[1]}')
    return words


def make_job(args, out=None, notices=True, **job_options):
    """The Job that parsed options describe, ready to run (``%launch`` uses it too).

    With ``--launcher ssh`` the hosts are checked and the directory synced first; a
    host that fails raises UsageError (``--launcher slurm``: the allocation is read). ``notices``: say what the launcher chose for
    the user (OMP_NUM_THREADS; %launch does not, so that a chapter's outputs are
    the same on every machine). ``job_options`` go to the Job (see job.py)."""
    secret = secrets.token_hex(32)
    if args.notice:               # what a Slurm allocation chose (the launcher, -n)
        (out or sys.stdout).write(args.notice + '\n')
    job_options = dict(job_options, log_dir=args.log_dir, console_ranks=args.console_ranks)
    if args.log_dir is not None:
        try:
            os.makedirs(args.log_dir, exist_ok=True)
        except OSError as e:
            raise UsageError(f'--log-dir {args.log_dir}: {e.strerror}') from None
    link = pacing.pacer_of(config.Config.from_env(args.env))
    if link is not None:
        (out or sys.stdout).write(f'd2l-launch: simulated network: every process sends at '
                                  f'{pacing.describe(link.rate, link.latency)}\n')
    if args.launcher == 'ssh':
        from . import ssh
        try:
            return ssh.prepare(args, secret, out=out, notices=notices, **job_options)
        except ssh.HostError as e:
            raise UsageError(str(e)) from None
    if args.launcher == 'slurm':
        from . import slurm
        try:
            return slurm.prepare(args, secret, out=out, notices=notices, **job_options)
        except slurm.SlurmError as e:
            raise UsageError(str(e)) from None
    if args.launcher == 'mpi':
        from . import mpi
        try:
            return mpi.prepare(args, secret, out=out, notices=notices, **job_options)
        except (mpi.MpiError, mpi.HostError) as e:
            raise UsageError(str(e)) from None
    specs = local_specs(args.num_workers, args.num_servers, args.command, secret,
                        extra_env=args.env, process_env=args.process_env)
    notice = share_cores(specs, {spec.host: cores() for spec in specs})
    if notice and notices:
        (out or sys.stdout).write(notice + '\n')
    if args.port:
        specs[0].env.update(config.env(scheduler_port=args.port))
    return Job(specs, timeout=args.timeout, max_restarts=args.max_restarts, out=out,
               min_workers=args.min_workers, max_workers=args.max_workers,
               restart_lost=args.restart_lost, **job_options)


def dry_run(args, environ=os.environ):
    """The plan --dry-run prints (plan.py); a host or allocation that cannot be read
    raises UsageError."""
    from . import plan, slurm, ssh
    try:
        return (f'{args.notice}\n' if args.notice else '') + plan.plan(args, environ)
    except (ssh.HostError, slurm.SlurmError) as e:
        raise UsageError(str(e)) from None


def _terminate(signum, frame):
    raise Terminated()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGTERM, _terminate)
    # Ctrl-C (SIGINT) stops the job, also where the shell that started us ignores it: a
    # script's background job (cmd &) inherits SIGINT ignored, and would never stop
    signal.signal(signal.SIGINT, signal.default_int_handler)
    faulthandler.register(signal.SIGUSR1, all_threads=True)   # kill -USR1: where is it?
    progress = Progress()          # the job's model, and report lines as progress lines
    args = job = None
    try:
        args = parse(argv)
        if args.dry_run:
            sys.stdout.write(dry_run(args))
            return 0
        job = make_job(args, out=progress, on_line=progress.on_line,
                       on_state=progress.model.on_state, on_restart=progress.on_restart,
                       on_change=progress.model.on_change)
        return job.run()
    except UsageError as e:
        print(f'd2l-launch: error: {e}' + (f'; {HELP}' if e.hint else ''), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Terminated:
        return 143
    finally:
        if job is not None and job.attempt:      # it was restarted: how each attempt went
            progress.model.finish(*job.ending())
            progress.write(f'd2l-launch: {job.attempt + 1} attempts:\n'
                           + ''.join(f'  {line}\n' for line in
                                     progress.model.attempts_text().splitlines()))
        if args is not None and args.timeline:   # also, and above all, when the job failed
            write_timeline(progress.model.trace, args.timeline, sys.stdout)


def write_timeline(trace, path, out):
    """Write the job's timeline file and say so in one line."""
    spans = trace.write(path)
    out.write(f'd2l-launch: timeline of {spans} spans written to {path} (open it in '
              'Perfetto or chrome://tracing, or d2ldist.timeline.plot)\n')


if __name__ == '__main__':
    sys.exit(main())
