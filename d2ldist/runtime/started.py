"""Who started this process, and its place among the processes started with it.

A d2ldist script runs unchanged under any tool that starts N copies of a program; each
tells its processes their rank and number in variables of its own:

    tool          rank, size                               local rank, local size
    d2l-launch    RANK, WORLD_SIZE (and D2L_*)             LOCAL_RANK, LOCAL_WORLD_SIZE
    torchrun      RANK, WORLD_SIZE                         LOCAL_RANK, LOCAL_WORLD_SIZE
    mpirun        OMPI_COMM_WORLD_RANK, _SIZE (Open MPI)   OMPI_COMM_WORLD_LOCAL_RANK, _SIZE
                  PMI_RANK, PMI_SIZE (MPICH, Intel MPI)    MPI_LOCALRANKID, MPI_LOCALNRANKS
    srun          SLURM_PROCID, SLURM_NTASKS (in a step)   SLURM_LOCALID, SLURM_TASKS_PER_NODE

``detect()`` reads them into a ``Start``; ``Start.rendezvous()`` says where rank 0
listens, or raises ``StartError`` naming what is missing. This module is the one place
that reads (and, for torch.distributed's env://, fills) other tools' variables: the
collectives ask it (``local_rank``, ``group_rank``, ``restarts``, ``rendezvous_env``).
Where the processes meet, and why: docs/design/collectives.md.

    >>> s = detect({'OMPI_COMM_WORLD_RANK': '1', 'OMPI_COMM_WORLD_SIZE': '2',
    ...             'OMPI_COMM_WORLD_LOCAL_RANK': '1', 'OMPI_COMM_WORLD_LOCAL_SIZE': '2'})
    >>> s.who, s.rank, s.rendezvous()
    ('2 workers started by mpirun', 1, ('127.0.0.1', 29500))
"""
import os
import random
import re
import socket
from dataclasses import dataclass

from .. import config

DEFAULT_PORT = 29500   # where rank 0 listens when MASTER_PORT is unset (torchrun's default)


class StartError(RuntimeError):
    """This process was started as one of several but cannot find the others: what is missing."""


@dataclass(frozen=True)
class Start:
    """Who started this process ('' for no one: run alone) and its place among the others."""
    tool: str = ''
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    node: int | None = None        # this host's index among the job's hosts, if known
    addr: str | None = None        # where rank 0 listens for the others (MASTER_ADDR)
    port: int = DEFAULT_PORT       # 0: any free one (a job of one)
    missing: str = ''              # why addr is None: what to set

    @property
    def several(self):
        """Whether a tool other than d2l-launch started this process as one of several."""
        return self.size > 1 and self.tool not in ('', 'd2l-launch')

    @property
    def who(self):
        """'2 workers started by mpirun', or '1 worker run alone'."""
        workers = f'{self.size} worker{"s" if self.size != 1 else ""}'
        return f'{workers} started by {self.tool}' if self.tool else f'{workers} run alone'

    def rendezvous(self):
        """(address, port) where rank 0 listens; StartError when they cannot be found."""
        if self.addr is None:
            raise StartError(f'{self.who}, but {self.missing}')
        return self.addr, self.port or free_port()

    def torchrun_env(self):
        """torchrun's variables for this process (torch.distributed's env:// reads them)."""
        addr, port = self.rendezvous()
        names = dict(RANK=self.rank, WORLD_SIZE=self.size, LOCAL_RANK=self.local_rank,
                     LOCAL_WORLD_SIZE=self.local_size, MASTER_ADDR=addr, MASTER_PORT=port)
        if self.node is not None:
            names['GROUP_RANK'] = self.node
        return {name: str(value) for name, value in names.items()}


def detect(env=os.environ, cfg=None):
    """The Start that ``env``'s variables describe (``cfg``: the D2L_* ones, config.get())."""
    cfg = cfg or config.get()
    try:
        if cfg.in_job:
            return _torchrun(env, 'd2l-launch')
        if 'RANK' in env or 'WORLD_SIZE' in env:
            return _torchrun(env, 'torchrun' if 'TORCHELASTIC_RUN_ID' in env
                             else 'RANK and WORLD_SIZE')
        if 'OMPI_COMM_WORLD_SIZE' in env:
            return _mpi(env, 'mpirun', 'OMPI_COMM_WORLD_RANK', 'OMPI_COMM_WORLD_SIZE',
                        'OMPI_COMM_WORLD_LOCAL_RANK', 'OMPI_COMM_WORLD_LOCAL_SIZE')
        if 'PMI_SIZE' in env:
            return _mpi(env, 'mpiexec (PMI)', 'PMI_RANK', 'PMI_SIZE',
                        'MPI_LOCALRANKID', 'MPI_LOCALNRANKS')
        if 'SLURM_STEP_ID' in env and 'SLURM_PROCID' in env:   # a task of srun (not the
            return _slurm(env)                                  # batch script itself)
    except ValueError as e:
        raise StartError(str(e)) from None
    return Start(addr='127.0.0.1', port=_port(env) if 'MASTER_PORT' in env else 0)


def local_rank(env=os.environ):
    """This process's rank among those on its host: LOCAL_RANK, else srun's SLURM_LOCALID; 0."""
    return int(env.get('LOCAL_RANK', env.get('SLURM_LOCALID', 0)))


def local_size(env=os.environ):
    """The number of processes on this host: LOCAL_WORLD_SIZE; 1."""
    return int(env.get('LOCAL_WORLD_SIZE', '1'))


def group_rank(env=os.environ):
    """This host's index among the job's hosts: torchrun's GROUP_RANK; 0."""
    return int(env.get('GROUP_RANK', 0))


def restarts(env=os.environ):
    """How many times torchrun has restarted the job, as it writes it: '0' at first."""
    return env.get('TORCHELASTIC_RESTART_COUNT', '0')


def rendezvous_env(env=os.environ):
    """Fill torchrun's variables (RANK, ..., MASTER_PORT), which torch.distributed's env://
    reads, where the tool that started this process set its own (mpirun, srun); the Start."""
    start = detect(env)
    for name, value in start.torchrun_env().items():
        env.setdefault(name, value)
    return start


def child_env(**names):
    """This process's variables with ``names`` added: a child's (the scheduler rank 0 hosts)."""
    return dict(os.environ, **names)


def _number(env, name, default=None):
    """The whole number in env[name] (``default`` when unset); a ValueError naming it."""
    text = env.get(name)
    if text is None and default is not None:
        return default
    if text is None or not text.strip().isdigit():
        raise ValueError(f'{name}={text!r} is not a whole number' if text is not None
                         else f'{name} is not set')
    return int(text)


def _port(env):
    """MASTER_PORT, or DEFAULT_PORT."""
    port = _number(env, 'MASTER_PORT', DEFAULT_PORT)
    if not 0 < port < 65536:
        raise ValueError(f'MASTER_PORT={port} is not a port (1 .. 65535)')
    return port


def _checked(start, rank_name, size_name):
    """``start`` if its rank is below its size; else a ValueError naming the variables."""
    if not 0 <= start.rank < start.size or not 0 <= start.local_rank < start.local_size:
        raise ValueError(f'{rank_name}={start.rank} does not fit {size_name}={start.size} '
                         f'(local rank {start.local_rank} of {start.local_size})')
    return start


def _torchrun(env, tool):
    """torchrun's names (also set by d2l-launch for its workers, or by hand)."""
    size = _number(env, 'WORLD_SIZE')
    addr = env.get('MASTER_ADDR') or ('127.0.0.1' if size == 1 else None)
    start = Start(tool, _number(env, 'RANK', 0 if size == 1 else None), size,
                  _number(env, 'LOCAL_RANK', 0), _number(env, 'LOCAL_WORLD_SIZE', 1),
                  node=_number(env, 'GROUP_RANK') if 'GROUP_RANK' in env else None,
                  addr=addr, port=_port(env),
                  missing="MASTER_ADDR is not set: set it to rank 0's host")
    return _checked(start, 'RANK', 'WORLD_SIZE')


def _mpi(env, tool, rank, size, local_rank, local_size):
    """An MPI launcher's names; all on this host: meet at 127.0.0.1, else at MASTER_ADDR."""
    n = _number(env, size)
    local_n = _number(env, local_size, 0)       # 0: the launcher does not say
    addr = env.get('MASTER_ADDR') or ('127.0.0.1' if local_n == n else None)
    where = 'they are on several hosts' if local_n else f'{local_size} is not set'
    start = Start(tool, _number(env, rank), n, _number(env, local_rank, 0), local_n or 1,
                  addr=addr, port=_port(env),
                  missing=f"MASTER_ADDR is not set and {where}: set it to rank 0's host "
                          '(mpirun -x MASTER_ADDR=HOST)')
    return _checked(start, rank, size)


def _slurm(env):
    """srun's names; rank 0 runs on the first host of the step's node list."""
    size = _number(env, 'SLURM_STEP_NUM_TASKS', 0) or _number(env, 'SLURM_NTASKS')
    node = _number(env, 'SLURM_NODEID', 0)
    per_node = env.get('SLURM_STEP_TASKS_PER_NODE') or env.get('SLURM_TASKS_PER_NODE')
    local_n = tasks_per_node(per_node)[node] if per_node else \
        int(env.get('SLURM_NTASKS_PER_NODE', '1').split('(')[0])
    nodelist = next((env[n] for n in ('SLURM_STEP_NODELIST', 'SLURM_JOB_NODELIST',
                                      'SLURM_NODELIST') if env.get(n)), None)
    addr = env.get('MASTER_ADDR') or (expand_nodelist(nodelist)[0] if nodelist else None)
    start = Start('srun', _number(env, 'SLURM_PROCID'), size, _number(env, 'SLURM_LOCALID', 0),
                  local_n, node=node, addr=addr, port=_port(env),
                  missing="neither MASTER_ADDR nor SLURM_JOB_NODELIST is set: set "
                          "MASTER_ADDR to rank 0's host")
    return _checked(start, 'SLURM_PROCID', 'SLURM_NTASKS')


def expand_nodelist(text):
    """Slurm's host list, expanded: 'node[01-03,07],gpu1' -> node01 node02 node03 node07 gpu1."""
    items = re.findall(r'(?:[^,\[\]]|\[[^\]]*\])+', text)
    if not items or ','.join(items) != text.strip():
        raise ValueError(f'node list {text!r}: expected names like node[01-04,07],gpu1')
    return [host for item in items for host in _expand(item, text)]


def _expand(item, text):
    """'rack[1-2]n[01-02]' -> rack1n01 rack1n02 rack2n01 rack2n02 (numbers keep their width)."""
    m = re.fullmatch(r'([^\[]*)\[([^\]]*)\](.*)', item)
    if m is None:
        return [item]
    prefix, ranges, rest = m.groups()
    hosts = []
    for part in ranges.split(','):
        r = re.fullmatch(r'(\d+)(?:-(\d+))?', part.strip())
        if r is None:
            raise ValueError(f'node list {text!r}: {part!r} is not N or N-M')
        width = len(r[1])
        hosts += [f'{prefix}{n:0{width}d}{tail}'
                  for n in range(int(r[1]), int(r[2] or r[1]) + 1) for tail in _expand(rest, text)]
    return hosts


def tasks_per_node(text):
    """Slurm's tasks per node, expanded: '2(x3),1' -> [2, 2, 2, 1]."""
    counts = []
    for part in text.split(','):
        m = re.fullmatch(r'(\d+)(?:\(x(\d+)\))?', part.strip())
        if m is None:
            raise ValueError(f'tasks per node {text!r}: expected N or N(xM), e.g. 2(x3),1')
        counts += [int(m[1])] * int(m[2] or 1)
    return counts


def free_port(host='127.0.0.1'):
    """A TCP port free on ``host`` now, for a listener that starts a moment later (the
    scheduler, torch.distributed's store). Not one that bind(0) gives: that comes from the
    range the kernel takes the ports of outgoing connections from, and any program's next
    connection could take it meanwhile. A port just below that range, free now, chosen at
    random (another job choosing at the same moment is ten thousand times less likely)."""
    below = range(max(1024, ephemeral_ports()[0] - 10_000), ephemeral_ports()[0])
    for port in random.sample(below, min(100, len(below))):
        if port_is_free(port, host):
            return port
    with socket.socket() as s:            # (all taken: the kernel's choice, as before)
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(port, host='127.0.0.1'):
    """Whether a TCP listener could bind ``port`` on ``host`` now."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def ephemeral_ports():
    """(first, last) of the ports the kernel gives outgoing connections (Linux's
    ip_local_port_range; elsewhere its default, below the IANA range's 49152)."""
    try:
        with open('/proc/sys/net/ipv4/ip_local_port_range') as f:
            first, last = (int(x) for x in f.read().split())
        return first, last
    except (OSError, ValueError):
        return 32768, 60999
