"""``d2l-launch --dry-run``: the plan of a job, printed, with nothing started.

Every process with its role, rank and host, and the command that starts it: on this
machine, over ssh, as a task of one srun step, or as an app context of one mpirun (as
mpirun's ``--display-map`` shows its map). The processes are the ones the launchers
place (``processes.job_specs``); what a launcher learns only by starting something (a
host's address and free port, the nodes salloc will give) is left out or named so.
"""
import os
import shlex
import sys

from .processes import job_specs
from .ssh import Ssh, discover, hosts_from, remote_command, remote_pythonpath

SECRET = '-'                       # (the job's secret is made when it starts)


def plan(args, environ):
    """The plan's text for parsed ``args`` (``environ``: the launcher's variables)."""
    how = {'local': _local, 'ssh': _ssh, 'slurm': _slurm, 'mpi': _mpi}[args.launcher]
    head, specs, commands, tail = how(args, environ)
    counts = (f'1 scheduler, {args.num_servers} server{"s" * (args.num_servers != 1)}, '
              f'{args.num_workers} worker{"s" * (args.num_workers != 1)}')
    rows = [('role', 'rank', 'host', 'command')] + [
        (s.role, '-' if s.role == 'scheduler' else str(s.rank), s.host, c)
        for s, c in zip(specs, commands)]
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    table = ['  ' + '  '.join(c.ljust(w) for c, w in zip(r, width + [0])).rstrip()
             for r in rows]
    return '\n'.join([f'd2l-launch: dry run, nothing started: {counts}; {head}', *table,
                      *tail]) + '\n'


def _specs(args, hosts=('localhost',), slots=None, remote=False, python=sys.executable,
           extra_env=()):
    return job_specs(args.num_workers, args.num_servers, args.command, SECRET, hosts=hosts,
                     slots=slots, addresses={h: h for h in hosts},
                     free_ports={h: 1 for h in hosts},
                     python=python, remote=remote, extra_env=extra_env,
                     process_env=args.process_env)


def _local(args, environ):
    specs = _specs(args)
    return 'each a process on this machine', specs, [shlex.join(s.argv) for s in specs], []


def _ssh(args, environ):
    """Each process through its own ssh (the hosts are not reached: no preflight)."""
    script = args.host_discovery_script
    hosts = discover(script) if script else hosts_from(args)
    python = args.python or sys.executable
    workdir = args.sync_dst_dir or os.getcwd()
    pythonpath = remote_pythonpath(environ.get('PYTHONPATH'), os.getcwd(), workdir)
    ssh = Ssh(args.ssh_config, args.connect_timeout, args.ssh_port)
    by_label = {h.label: h for h in hosts}
    specs = _specs(args, list(by_label), _slots(hosts), remote=True, python=python)
    commands = [shlex.join(ssh.argv(by_label[s.host], remote_command(s, python, workdir,
                                                                     pythonpath)))
                for s in specs]
    sync = [f'  first: rsync the current directory to {args.sync_dst_dir} on every host']
    return ('each over ssh (the job runs in ' + workdir + ')', specs, commands,
            sync if args.sync_dst_dir else [])


def _slurm(args, environ):
    """The tasks of one srun step, on the allocation's nodes (with --partition: the
    nodes salloc gives, named node1, node2, ...)."""
    from . import slurm
    first = []
    if args.partition:
        nodes = [f'node{i}' for i in range(1, (args.nodes or 1) + 1)]
        tasks, where = None, f'in an allocation salloc asks for in partition {args.partition}'
        first = [f'  first: {shlex.join(slurm.salloc_argv(args))} (the allocation, given '
                 'back when the job ends)']
    else:
        job, nodes, tasks, _ = slurm.allocation(environ)
        where = f'in allocation {job}'
    specs = _specs(args, nodes, tasks, remote=True)
    srun = slurm.srun_argv(specs, 'TASKS', 'd2l-launch')
    return (f'each a task of one srun step {where}', specs, [shlex.join(s.argv) for s in specs],
            [*first, f'  started by: {shlex.join(srun)} (TASKS: a --multi-prog file, task N '
             'the Nth process above)'])


def _mpi(args, environ):
    """The app contexts of one mpirun, on the hosts of -H or --hostfile or here."""
    hosts = hosts_from(args)
    labels = [h.label for h in hosts] if hosts else ['localhost']
    specs = _specs(args, labels, _slots(hosts or []), remote=True)
    commands = [shlex.join(['-np', '1', '--host', s.host, *s.argv]) for s in specs]
    return ('each an app context of one mpirun', specs, commands,
            ['  started by: mpirun --oversubscribe --bind-to none '
             + ('--mca plm_rsh_no_tree_spawn 1 ' if hosts else '')
             + '(app contexts above, joined by :)'])


def _slots(hosts):
    return [h.slots or 1 for h in hosts] if any(h.slots for h in hosts) else None
