"""Which processes a job has, where each runs, and the command and environment of each.

This is the one place that decides placement and builds the command line of a
process, so that the ssh launcher only adds "which host" and "how to get there".
"""
import os
import sys
from collections import Counter
from dataclasses import dataclass, field

from .. import config
from ..runtime.started import free_port, port_is_free   # noqa: F401 (cli, mpi, slurm)

ROLES = ('scheduler', 'server', 'worker')
# what d2ldist's own processes run (a worker runs the user's command)
MODULES = {'scheduler': 'd2ldist.runtime.scheduler', 'server': 'd2ldist.kv'}


@dataclass
class ProcSpec:
    """One process of a job: its role and rank, its host, its command and environment."""
    role: str
    rank: int
    host: str = 'localhost'
    argv: list = field(default_factory=list)
    env: dict = field(default_factory=dict)
    remote: bool = False

    @property
    def label(self):
        """How the process is named in the merged output: 'worker 1' or 'worker 1@hostB'."""
        name = 'scheduler' if self.role == 'scheduler' else f'{self.role} {self.rank}'
        return f'{name}@{self.host}' if self.remote else name


def assign_hosts(num_workers, num_servers, hosts=('localhost',), slots=None):
    """The (role, rank, host) of every process.

    The scheduler goes on the first host; then servers and workers are dealt
    round-robin over the hosts, in that order. With ``slots`` (workers per host, as in
    an MPI hostfile) the workers instead fill the first host's slots, then the next
    host's, and so on, starting again at the first host once all slots are taken.
    """
    roles = [('scheduler', 0)] + [('server', r) for r in range(num_servers)] \
        + [('worker', r) for r in range(num_workers)]
    placed = [(role, rank, hosts[i % len(hosts)]) for i, (role, rank) in enumerate(roles)]
    if slots:
        by_slot = [h for h, n in zip(hosts, slots) for _ in range(n)]
        placed = [(role, rank, by_slot[rank % len(by_slot)] if role == 'worker' else host)
                  for role, rank, host in placed]
    return placed


def job_env(role, rank, *, num_workers, num_servers, scheduler_host, secret,
            master_addr, master_port, local_rank=0, local_world_size=1, cross_rank=0,
            cross_size=1, extra=()):
    """The environment contract of one process (the table in ARCHITECTURE.md; the
    names and how they are read: config.py)."""
    env = config.env(role=role, rank=rank, num_worker=num_workers, num_server=num_servers,
                     scheduler_uri=scheduler_host, job_secret=secret, restart=0)
    env['PYTHONUNBUFFERED'] = '1'
    if role == 'worker':   # torchrun's names, so torch.distributed works unchanged
        env.update(RANK=str(rank), WORLD_SIZE=str(num_workers), LOCAL_RANK=str(local_rank),
                   LOCAL_WORLD_SIZE=str(local_world_size), MASTER_ADDR=master_addr,
                   MASTER_PORT=str(master_port), GROUP_RANK=str(cross_rank),
                   NODE_RANK=str(cross_rank))   # the host's index: torchrun's, Lightning's
        env.update(config.env(cross_rank=cross_rank, cross_size=cross_size))
    env.update(dict(extra))
    return env


def node_argv(role, command, python=sys.executable):
    """What a process runs: d2ldist's own module for scheduler and servers, else the command."""
    if role == 'worker':
        return list(command)
    return [python, '-m', MODULES[role]]


def local_specs(num_workers, num_servers, command, secret, extra_env=(), process_env=None):
    """The processes of a job on this machine."""
    return job_specs(num_workers, num_servers, command, secret, extra_env=extra_env,
                     process_env=process_env)


def job_specs(num_workers, num_servers, command, secret, hosts=('localhost',), slots=None,
              addresses=None, free_ports=None, extra_env=(), host_env=None,
              python=sys.executable, remote=False, process_env=None):
    """The processes of a job: placed on ``hosts``, each with its command and environment.

    ``addresses`` maps a host to the address the others reach it at, ``free_ports`` a
    host to a port free there (default: this machine's); ``host_env`` maps a host to
    variables only its processes get, ``process_env`` a (role, rank) to variables only
    that process gets (--slow, --fail). The scheduler listens on the first host;
    torch.distributed's rendezvous (MASTER_ADDR:MASTER_PORT) is on worker 0's host.
    """
    placed = assign_hosts(num_workers, num_servers, hosts, slots)
    addresses = addresses or {h: '127.0.0.1' for h in hosts}
    workers_on = {}                          # host -> its workers' ranks, for LOCAL_RANK
    for role, rank, host in placed:
        if role == 'worker':
            workers_on.setdefault(host, []).append(rank)
    master_host = next(host for role, rank, host in placed if (role, rank) == ('worker', 0))
    master_port = (free_ports or {}).get(master_host) or free_port()
    specs = []
    for role, rank, host in placed:
        local = workers_on.get(host, [])
        env = job_env(role, rank, num_workers=num_workers, num_servers=num_servers,
                      scheduler_host=addresses[hosts[0]], secret=secret,
                      master_addr=addresses[master_host], master_port=master_port,
                      local_rank=local.index(rank) if role == 'worker' else 0,
                      local_world_size=len(local),
                      cross_rank=list(workers_on).index(host) if role == 'worker' else 0,
                      cross_size=len(workers_on), extra=extra_env)
        env.update((host_env or {}).get(host, {}))
        env.update((process_env or {}).get((role, rank), {}))
        specs.append(ProcSpec(role, rank, host, node_argv(role, command, python), env, remote))
    return specs


def cores():
    """The cores this machine lets this process run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:        # (not Linux)
        return os.cpu_count() or 1


def share_cores(specs, cores_of, environ=os.environ):
    """Give each process OMP_NUM_THREADS = its host's cores over its host's processes (at
    least 1), as torchrun does, where the user set none (``environ``: the launcher's own
    variables; ``--env``: the spec's); ``cores_of`` maps a host to its cores. Without it
    torch runs a thread per core in every process: 5 processes on 2 cores took 68 ms a
    step instead of 9.5 ms. Returns the one line that says so, or None."""
    if 'OMP_NUM_THREADS' in environ:
        return None
    on_host = Counter(s.host for s in specs)
    threads = {host: max(1, cores_of[host] // n) for host, n in on_host.items()}
    set_on = {}
    for s in specs:
        if 'OMP_NUM_THREADS' not in s.env:
            s.env['OMP_NUM_THREADS'] = set_on[s.host] = str(threads[s.host])
    if not set_on:
        return None
    if len(on_host) == 1:
        (host, n), = on_host.items()
        where = f'{cores_of[host]} cores, {n} processes on this host'
        return (f'd2l-launch: OMP_NUM_THREADS={threads[host]} for each process ({where}), '
                'so that they do not overload it; set it (--env OMP_NUM_THREADS=N) to tune')
    hosts = ', '.join(f'{host} {t}' for host, t in set_on.items())
    return (f"d2l-launch: OMP_NUM_THREADS for each process, its host's cores over its "
            f'processes: {hosts}; set it (--env OMP_NUM_THREADS=N) to tune')


def guarded(argv, python=sys.executable, remote=False):
    """``argv`` run under the guard, which ends its process group when the job ends.

    ``remote``: the guard reads the environment from stdin (see guard.py)."""
    return [python, '-m', 'd2ldist.launch.guard', *(['--remote'] if remote else []), '--', *argv]


def shared_env(specs):
    """The variables every process has, with the same value (a tool hands them to all)."""
    first, *rest = (s.env for s in specs)
    return {k: v for k, v in first.items() if all(e.get(k) == v for e in rest)}


def child_env(spec):
    """The full environment of a local child: ours, then the job's."""
    env = dict(os.environ)
    env.update(spec.env)
    return env
