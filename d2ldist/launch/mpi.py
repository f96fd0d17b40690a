"""The MPI launcher: a job's processes started by Open MPI's ``mpirun``, as MXNet's was.

``d2l-launch --launcher mpi -H hosts -n 2 -s 2 python train.py`` does what the ssh
launcher does, but lets ``mpirun`` start the processes, for sites where MPI is how
jobs start: the ssh launcher's preflight checks the hosts (and ``--sync-dst-dir``
syncs them), then one mpirun runs one app context per process (MPMD), each command the
task side of ``step.py``, so that task N is process N of the placement. The task side
marks each whole line, shown as ``[worker 1@hostB] ...``; mpirun ends every process
when one fails, and the launcher ends mpirun when the job ends otherwise.

The steps one by one: docs/design/launch.md, "Under MPI".
"""
import os
import re
import shutil
import sys

from .. import config
from .processes import cores, free_port, job_specs, share_cores
from .ssh import HostError, checked_hosts, forwarded_env, hosts_from, placement_table
from .step import StepJob, task_argv

LABEL = re.compile(r'(\d+): (.*)')                  # the task side's mark, as srun's
# mpirun's report of the first process that failed, inside one of its banners
FIRST_FAILED = re.compile(r'\s*Process name:\s*\[\[\d+,\d+\],(\d+)\]')
EXIT_CODE = re.compile(r'\s*Exit code:\s*(\d+)')
RULE = re.compile(r'-{20,}')                                     # a banner's top or bottom
# a race in mpirun's ssh starter, harmless: the daemon it started had already exec'd
SETPGID = re.compile(r'\[[^\]]+\] plm:rsh: Warning: setpgid\(\d+,\d+\) failed in parent')


class MpiError(Exception):
    """mpirun is missing, or a host cannot be reached the way mpirun reaches hosts."""


def hosts_of(args):
    """The hosts of ``-H`` or ``--hostfile`` (mpirun reaches them by name alone), or
    None: this machine."""
    if shutil.which('mpirun') is None:
        raise MpiError("--launcher mpi needs Open MPI's mpirun on PATH (Debian: openmpi-bin)")
    hosts = hosts_from(args)
    for h in hosts or ():
        if h.user or h.port:
            written = f'{h.user}@{h.label}' if h.user else h.label
            raise MpiError(f'--launcher mpi: host {written!r}: mpirun reaches hosts by name '
                           'only; put the user and port in an ssh config (--ssh-config FILE)')
    return hosts


def mpirun_argv(specs, shared, hosts=None, ssh_config=None, workdir=None,
                python=sys.executable, as_root=None):
    """mpirun's command line: one app context per process, on its spec's host."""
    as_root = os.geteuid() == 0 if as_root is None else as_root
    argv = ['mpirun', '--oversubscribe', '--bind-to', 'none']
    if as_root:
        argv.append('--allow-run-as-root')
    if hosts is not None:                   # over ssh: each daemon started from here
        argv += ['--mca', 'plm_rsh_no_tree_spawn', '1']
        if ssh_config:
            argv += ['--mca', 'plm_rsh_agent', f'ssh -F {ssh_config}']
        argv += ['--wdir', workdir or os.getcwd()]
    exported = [x for name in sorted(shared) for x in ('-x', name)]   # (each context's own)
    contexts = [['-np', '1', '--host', s.host, *exported,
                 *task_argv(s, shared, python, label=True)] for s in specs]
    for i, context in enumerate(contexts):
        argv += ([':'] if i else []) + context
    return argv


class MpiJob(StepJob):
    """A Job whose processes are started by one mpirun; see the module docstring."""
    tool = 'mpirun'

    def __init__(self, specs, hosts=None, ssh_config=None, workdir=None,
                 python=sys.executable, **kw):
        super().__init__(specs, **kw)
        self.hosts, self.ssh_config = hosts, ssh_config
        self.workdir, self.python = workdir, python
        self.banner = None                  # the lines of mpirun's banner being read

    def step_argv(self, shared):
        return mpirun_argv([p.spec for p in self.procs], shared, self.hosts, self.ssh_config,
                           self.workdir, self.python)

    def task_line(self, line):
        m = LABEL.fullmatch(line)
        return (int(m[1]), m[2]) if m else None

    def noise(self, line, own=True):
        """mpirun's own banners (between two rules), and a harmless warning of its ssh
        starter: kept in the log, not shown; a banner that names the first process to
        fail names it, where that process could not say. A task's lines are never noise."""
        if not own:
            return False
        if SETPGID.match(line):
            return True
        if RULE.fullmatch(line.strip()):
            if self.banner is None:
                self.banner = []
            else:
                self._banner_read(self.banner)
                self.banner = None
            return True
        if self.banner is not None:
            self.banner.append(line)
            return True
        return False

    def cancel(self):
        """End mpirun now (through its guard): it ends every process it started."""
        self.terminate(self.step)

    def _banner_read(self, lines):
        rank = next((int(m[1]) for x in lines if (m := FIRST_FAILED.match(x))), None)
        code = next((int(m[1]) for x in lines if (m := EXIT_CODE.match(x))), None)
        if rank is not None and rank < len(self.procs) and self.procs[rank].alive \
                and not self.stopping:
            self._exited(self.procs[rank], code if code is not None else 1)


# -- putting it together -------------------------------------------------------------
def prepare(args, secret, out=None, notices=True, **job_options):
    """The job of the parsed ``args`` with ``--launcher mpi``."""
    out = out or sys.stdout
    hosts = hosts_of(args)
    python = args.python or sys.executable
    extra_env = {**args.env}
    if hosts is None:                                   # this machine: as the local launcher
        labels, slots, workdir = ['localhost'], None, None
        addresses, ports = {'localhost': '127.0.0.1'}, {'localhost': free_port()}
        host_env, host_cores = {}, {'localhost': cores()}
    else:
        at = checked_hosts(hosts, args, python)
        labels, slots, workdir, addresses, ports, host_env, host_cores = (
            at.labels, at.slots, at.workdir, at.addresses, at.ports, at.host_env, at.cores)
        extra_env.update(forwarded_env())
        if at.pythonpath:
            extra_env['PYTHONPATH'] = at.pythonpath
    port = args.port or ports[labels[0]]       # the scheduler's; torch's elsewhere
    specs = job_specs(args.num_workers, args.num_servers, args.command, secret,
                      hosts=labels, slots=slots, addresses=addresses,
                      free_ports={h: p for h, p in ports.items() if p != port},
                      host_env=host_env, python=python, remote=True,
                      extra_env={**extra_env, **config.env(scheduler_port=port)},
                      process_env=args.process_env)
    notice = share_cores(specs, host_cores)
    if notice and notices:
        out.write(notice + '\n')
    out.write(f'd2l-launch: one mpirun, the scheduler at {addresses[labels[0]]}:{port}; '
              f'placement:\n{placement_table(specs)}\n')
    out.flush()
    return MpiJob(specs, hosts=hosts, ssh_config=args.ssh_config, workdir=workdir, python=python,
                  timeout=args.timeout, max_restarts=args.max_restarts, out=out,
                  **job_options)


__all__ = ['HostError', 'MpiError', 'MpiJob', 'mpirun_argv', 'prepare']
