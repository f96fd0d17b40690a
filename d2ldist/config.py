"""What a process is told: every ``D2L_*`` variable, typed, read once (``config.get()``).

d2l-launch starts each process of a job with variables that say its part in the job
(``D2L_ROLE``, ``D2L_RANK``, where the scheduler listens, the secret) and how to run
(the simulated link, ``--slow``, ``--fail``, the hang detector, the timeline, ...).
``Config`` is the one list of them: a field per variable (``role`` is ``D2L_ROLE``),
with its default, how its text is read, and what it means. ``get()`` reads this
process's variables the first time it is asked and returns the same frozen Config
ever after; every module reads its settings there, never ``os.environ``. A process
outside a job (run alone, or under torchrun) gets the defaults.

    >>> cfg = Config.from_env({'D2L_SLOW': '3x', 'D2L_HANG_WARN': '2'})
    >>> cfg.slow, cfg.hang_warn, cfg.role
    ((3.0, 0.0), 2.0, None)

A bad value is a ValueError that names the variable. The launcher writes the variables
of the processes it starts with ``env(...)``, and checks its options (``--bandwidth``,
``--slow``, ...) with the parsers below, the ones the processes read them with.

This module is the bottom layer: it imports nothing of d2ldist, so that everything,
``report.py`` included, may read it; no other module spells a D2L_* name
(``tests/unit/test_layers.py``). ARCHITECTURE.md's table of the variables is this list,
row for row (``tests/unit/test_config.py``).
"""
import math
import os
import re
from dataclasses import dataclass, field, fields

PREFIX = 'D2L_'
ROLES = ('scheduler', 'server', 'worker')


# -- how a variable's text is read --------------------------------------------------
def _whole(text):
    """'3' -> 3: a whole number, 0 or more."""
    if not text.isdigit():
        raise ValueError(f'{text!r} is not a whole number (0, 1, 2, ...)')
    return int(text)


def _positive_whole(text):
    """'4194304' -> 4194304: a whole number, 1 or more."""
    if _whole(text) < 1:
        raise ValueError(f'{text!r} is not 1 or more')
    return int(text)


def _seconds(text):
    """'1.5' -> 1.5: seconds, more than 0."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise ValueError(f'{text!r} is not a positive number of seconds')
    return seconds


def _seconds_or_never(text):
    """'30' -> 30.0, '0' -> None: seconds, or 0 for never."""
    try:
        if float(text) == 0:
            return None
    except ValueError:
        pass
    return _seconds(text)


def _flag(text):
    """'1' -> True, '0' -> False."""
    if text not in ('0', '1'):
        raise ValueError(f'{text!r} is neither 1 (on) nor 0 (off)')
    return text == '1'


def _role(text):
    """One of ROLES."""
    if text not in ROLES:
        raise ValueError(f'{text!r} is not one of {", ".join(ROLES)}')
    return text


def _text(text):
    """The text as it is (a name, an address, a path)."""
    return text


def _plain_or(text, parse):
    """A plain number as the launcher writes it (bytes/s, seconds), else with a unit."""
    try:
        value = float(text)
    except ValueError:
        return parse(text)
    if not 0 <= value < math.inf:
        raise ValueError(f'{text!r} is not a bandwidth or latency')
    return value


def _rate(text):
    """Bytes per second of the simulated link; 0 is None (no link)."""
    return _plain_or(text, parse_bandwidth) or None


def _delay(text):
    """Seconds of the simulated link's latency."""
    return _plain_or(text, parse_latency)


# -- the launcher's options, parsed as the processes read their variables -----------
_UNIT_PREFIX = {'': 1, 'k': 1e3, 'm': 1e6, 'g': 1e9, 't': 1e12,
           'ki': 2**10, 'mi': 2**20, 'gi': 2**30, 'ti': 2**40}
_RATE = re.compile(r'(?P<num>\d+(?:\.\d*)?(?:e[+-]?\d+)?|\.\d+)\s*'
                   r'(?P<prefix>[kKmMgGtT]i?|)'
                   r'(?P<unit>bits?|bps|b|bytes?|Bps|B)(?P<per>/s|ps)?')
_BITS = ('bit', 'bits', 'bps', 'b')
_TIME = re.compile(r'(?P<num>\d+(?:\.\d*)?(?:e[+-]?\d+)?|\.\d+)\s*(?P<unit>s|ms|us|µs|ns)')
_SECONDS = {'s': 1.0, 'ms': 1e-3, 'us': 1e-6, 'µs': 1e-6, 'ns': 1e-9}


def parse_bandwidth(text):
    """Bytes per second from '1Gbit', '100Mbit/s', '250Mbps', '100MB/s', '1.5GiB/s'."""
    m = _RATE.fullmatch(str(text).strip())
    if m is None or (m['unit'] in ('bps', 'Bps') and m['per']):
        raise ValueError(f'bandwidth {text!r}: give a number and a unit, e.g. 1Gbit, '
                         '100Mbit/s, 250Mbps (bits) or 100MB/s, 12.5MiB/s (bytes)')
    rate = float(m['num']) * _UNIT_PREFIX[m['prefix'].lower()]
    rate = rate / 8 if m['unit'] in _BITS else rate
    if not 0 < rate < math.inf:
        raise ValueError(f'bandwidth {text!r}: must be more than 0')
    return rate


def parse_latency(text):
    """Seconds from '0.5ms', '200us', '1s' (or '0')."""
    text = str(text).strip()
    if text in ('0', '0.0'):
        return 0.0
    m = _TIME.fullmatch(text)
    if m is None:
        raise ValueError(f'latency {text!r}: give a number and a unit: s, ms or us '
                         '(e.g. 0.5ms)')
    return float(m['num']) * _SECONDS[m['unit']]


def parse_slow(text):
    """'3x' -> (3.0, 0.0), '+200ms' -> (1.0, 0.2): a factor and seconds added."""
    try:
        if text.endswith('x'):
            factor = float(text[:-1])
            if factor >= 1:
                return factor, 0.0
        elif text.startswith('+'):
            return 1.0, parse_latency(text[1:])
    except ValueError:
        pass
    raise ValueError(f'slow takes a factor of at least 1 (3x) or a time (+200ms), got {text!r}')


def parse_fail(text):
    """'step=40' -> ('step', 40), '30s' -> ('time', 30.0): when to die."""
    try:
        if text.startswith('step='):
            step = int(text[5:])
            if step >= 1:
                return 'step', step
        else:
            return 'time', parse_latency(text)
    except ValueError:
        pass
    raise ValueError(f'fail takes step=N (N >= 1) or a time (30s), got {text!r}')


def parse_window(text):
    """'20-40' -> (20, 40), '7' -> (7, 7): the training steps to record."""
    first, _, last = str(text).partition('-')
    try:
        window = int(first), int(last or first)
    except ValueError:
        window = (0, -1)
    if not 1 <= window[0] <= window[1]:
        raise ValueError(f'timeline steps take FIRST-LAST (20-40), got {text!r}')
    return window


# -- the variables ------------------------------------------------------------------
def _setting(default, parse, doc, job=False):
    """A field of Config: its default (when unset or empty), how its text is read, and
    what it means; ``job``: d2l-launch sets it for each process (the job's own)."""
    return field(default=default, metadata={'parse': parse, 'doc': doc, 'job': job})


@dataclass(frozen=True)
class Config:
    """The settings of one process, one field per D2L_* variable (``role``: D2L_ROLE)."""
    role: str | None = _setting(
        None, _role, '`scheduler`, `server` or `worker` (d2l-launch: every process)', job=True)
    rank: int | None = _setting(
        None, _whole, 'rank within the role, 0 .. count - 1 (d2l-launch: every process; '
        'unset: the scheduler gives the next free one)', job=True)
    num_worker: int | None = _setting(
        None, _whole, 'N, the number of workers (d2l-launch: every process)', job=True)
    num_server: int | None = _setting(
        None, _whole, 'S, the number of servers, 0 for none (d2l-launch: every process)',
        job=True)
    scheduler_uri: str | None = _setting(
        None, _text, "the scheduler's host address; set: the process is in a job "
        '(d2l-launch: every process)', job=True)
    scheduler_port: int | None = _setting(
        None, _whole, "the scheduler's port (d2l-launch: once the scheduler has chosen it, "
        'or `--port`; unset on the scheduler: a free one)', job=True)
    job_secret: str | None = _setting(
        None, _text, 'the key every message is authenticated with (d2l-launch: every '
        'process)', job=True)
    cross_rank: int | None = _setting(
        None, _whole, "this host's index among the hosts with workers, Horovod's cross rank "
        '(d2l-launch: workers)', job=True)
    cross_size: int | None = _setting(
        None, _positive_whole, 'the number of hosts with workers (d2l-launch: workers)',
        job=True)
    node_host: str | None = _setting(
        None, _text, 'the address the node advertises (d2l-launch over ssh; unset: its '
        'address on the route to the scheduler)', job=True)
    job_id: str | None = _setting(
        None, _text, "the job's id, which the ssh launcher's last clean-up looks for in "
        "a process group's environment (d2l-launch over ssh)", job=True)
    heartbeat_interval: float = _setting(
        1.0, _seconds, "seconds between a node's heartbeats")
    heartbeat_timeout: float = _setting(
        5.0, _seconds, 'seconds of silence after which the scheduler declares a node failed')
    kill_grace: float = _setting(
        2.0, _seconds, 'seconds from SIGTERM to SIGKILL when a process group is stopped '
        '(the guard, the launcher)')
    mac_payload: bool = _setting(
        False, _flag, '`1`: the MAC covers the data frames too, not only the headers')
    zmq_io_threads: int = _setting(
        2, _positive_whole, "ZeroMQ's I/O threads (2: one receives, one sends)")
    shm: bool = _setting(
        True, _flag, '`0`: big frames between processes of one host go through sockets too '
        "(the ring's chunks and the servers' answers on streams)")
    bandwidth: float | None = _setting(
        None, _rate, "the simulated link's rate in bytes/s, or with a unit (`--bandwidth`)")
    latency: float = _setting(
        0.0, _delay, "the simulated link's latency in seconds, or with a unit (`--latency`)")
    kvstore_bigarray_bound: int | None = _setting(
        None, _whole, 'elements from which a value is split over all servers '
        '(unset: 1,000,000, kv/placement.py)')
    ring_chunk: int | None = _setting(
        None, _positive_whole, "bytes of a ring all-reduce's chunk (unset: 4 MB, "
        'collectives/ring.py)')
    backend: str | None = _setting(
        None, _text, "the collectives' backend, `ring` or `torch` (unset: ring; torch "
        'under torchrun)')
    slow: tuple | None = _setting(
        None, parse_slow, '`3x` or `+200ms`: each compute step that much slower '
        '(`--slow`, for the worker it names)')
    fail: tuple | None = _setting(
        None, parse_fail, '`step=N` or `30s`: die (SIGKILL) after compute step N (a server: '
        'its N-th sync round, or push in dist_async), or that long after joining (`--fail`, '
        'for the process it names)')
    restart: int = _setting(
        0, _whole, "which attempt of the job this is: 0 the first, then 1, 2, ... "
        '(d2l-launch `--max-restarts`; `--fail` and `--slow` act in attempt 0 only)', job=True)
    min_workers: int | None = _setting(
        None, _positive_whole, 'set: elastic workers: the scheduler re-forms the ring '
        'without a lost worker, or tells the servers whom their rounds wait for, while at '
        'least this many remain (`--min-workers`)')
    max_workers: int | None = _setting(
        None, _positive_whole, 'set: workers may join an elastic job (started again, or on '
        "a new host) while fewer run; the ring's commits then agree on taking them in "
        '(`--max-workers`; a host discovery script without it: 4096)')
    server_replicas: int = _setting(
        0, _whole, "each server's keys are also held by the next R servers, which take "
        'over when it is lost (`--server-replicas`; 0: no replicas)')
    shard_replicas: int = _setting(
        0, _whole, "ZeRO (stages 1-3) on the ring: each worker's shard of the optimizer's "
        'state is also kept, stepped alike, by its ring successor, so that under '
        '`--min-workers` a lost worker\'s shard is not gone (`--shard-replicas`; 0: none)')
    checkpoint_dir: str | None = _setting(
        None, _text, "a folder every worker can read, for the job's checkpoints; set: "
        "`d2ldist.train` saves them and resumes from the newest, as do "
        "`d2ldist.checkpoint.save(state)` and `load(state)` (`--checkpoint-dir`)")
    checkpoint_every: int = _setting(
        100, _positive_whole, 'steps between two checkpoints (`--checkpoint-every`)')
    checkpoint_keep: int = _setting(
        3, _positive_whole, 'checkpoints kept, the newest ones (`--checkpoint-keep`)')
    hang_warn: float | None = _setting(
        30.0, _seconds_or_never, 'seconds of waiting for others after which a node says '
        'who is missing, 0 for never (`--hang-warn`)')
    hang_fail: float | None = _setting(
        None, _seconds_or_never, 'seconds of waiting after which it raises `Hang`; unset '
        'or 0: never (`--hang-fail`)')
    timeline: bool = _setting(
        False, _flag, '`1`: record spans for the timeline (`--timeline`)')
    timeline_steps: tuple | None = _setting(
        None, parse_window, '`FIRST-LAST`: the workers record these training steps only '
        '(`--timeline-steps`)')
    server_script: str | None = _setting(
        None, _text, "a script the servers run instead of d2ldist's server "
        '(`--env D2L_SERVER_SCRIPT=ps.py`)')
    starter: str | None = _setting(
        None, _text, "where this host's starter listens, which forks the job's processes "
        'from an interpreter that has imported torch (d2l-launch, local jobs: the guards)',
        job=True)
    preload: bool = _setting(
        True, _flag, "the launcher's own: `0`: each process of a local job starts its own "
        'interpreter, without the starter (launch/starter.py)')
    interface: str | None = _setting(
        None, _text, "the launcher's own: the default of `--interface`, the network "
        'interface whose address the processes advertise over ssh')

    @classmethod
    def from_env(cls, environ):
        """The Config the variables of ``environ`` (a dict) give; unset or empty: the default."""
        values = {}
        for f in fields(cls):
            name = variable(f.name)
            text = environ.get(name)
            if text:
                try:
                    values[f.name] = f.metadata['parse'](text)
                except ValueError as e:
                    raise ValueError(f'{name}: {e}') from None
        return cls(**values)

    @property
    def in_job(self):
        """Whether d2l-launch started this process (D2L_SCHEDULER_URI is set)."""
        return self.scheduler_uri is not None

    def require(self, *names):
        """This Config, if the fields ``names`` are set; else KeyError(the first unset variable)."""
        for name in names:
            if getattr(self, name) is None:
                raise KeyError(variable(name))
        return self


_NAMES = frozenset(f.name for f in fields(Config))
_current = None   # this process's Config, once read


def get():
    """This process's Config: read from os.environ when first asked, the same one after."""
    global _current
    if _current is None:
        _current = Config.from_env(os.environ)
    return _current


def variable(name):
    """'D2L_ROLE' for the field 'role' (a KeyError for a field Config does not have)."""
    if name not in _NAMES:
        raise KeyError(f'Config has no field {name!r}')
    return PREFIX + name.upper()


def env(**values):
    """The variables that give a process these settings, as text:
    ``env(role='worker', timeline=True)`` -> {'D2L_ROLE': 'worker', 'D2L_TIMELINE': '1'}."""
    return {variable(name): ('1' if value is True else '0' if value is False else str(value))
            for name, value in values.items()}


# the job's own variables: d2l-launch sets them for each process (never forwards its own)
JOB_VARIABLES = tuple(variable(f.name) for f in fields(Config) if f.metadata['job'])
