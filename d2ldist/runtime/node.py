"""A node's place in the job (after ps-lite's Postoffice): rank, peers and barriers.

Every server and worker makes one ``Node``. ``start()`` registers with the scheduler
and waits for the address book; from then on the node can send to any peer by id
(``'worker:1'``, ``'server:0'``), receive, and wait at barriers. A background thread
sends the scheduler a heartbeat every second (with what the node is waiting for, for
the hang detector); if the scheduler announces that a peer failed, the next ``recv``
raises ``PeerFailed`` instead of waiting forever, and a wait that lasts too long says
who is missing (``hang.py``). With replicated servers (``--server-replicas``) the
scheduler may say that another server answers for a lost one's shard (``SERVERS``):
the node takes the new chains, and ``head(shard)`` names whom to ask from then on.
One message's plain path, and the reasoning: docs/design/runtime.md.
"""
import atexit
import itertools
import re
import secrets
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Collection, Sequence

from .. import config
from ..lines import NAME, clip, go_on, say, shown
from . import faults, hang, hosted, protocol, spans
from . import shm, started, stream
from .van import LINGER_SECONDS, Message, Van
from ..report import report


_current = None   # this process's node, once it has joined the job
ADDRESS = re.compile(r'tcp://(\[[0-9a-fA-F:.]+\]|[\w.-]+):\d{1,5}')   # where a node listens


def register(role='worker', start=None):
    """This process's node in the job, registered with the scheduler on the first call;
    None when run alone.

    A process started by d2l-launch (D2L_SCHEDULER_URI is set) joins once; every layer
    above (kv's stores, the collectives) asks here, so a process is one node. ``start``:
    one of several copies that srun, mpirun or torchrun started for the ring; it joins
    the scheduler rank 0 hosts (``hosted.py``).
    """
    global _current
    if _current is None and config.get().in_job:
        _current = Node.from_env(role=role).start()
    elif _current is None and start is not None and start.several:
        uri, secret = hosted.meeting_place(start)
        _current = Node(role, start.rank, start.size, 0, uri, secret).start()
    return _current


def current():
    """This process's node if it has joined a job, else None."""
    return _current


class PeerFailed(RuntimeError):
    """Another node of the job died or stopped answering."""


class WorkersChanged(PeerFailed):
    """The scheduler formed a new membership of the workers (elastic, ``--min-workers``):
    the collective in flight failed; ``lost`` names the worker left out, ``round`` the
    membership's number (Horovod's HorovodInternalError)."""

    def __init__(self, message: str, lost: str | None = None, round: int = 0) -> None:
        super().__init__(message)
        self.lost, self.round = lost, round


class Node:
    """This process as a node of a job: its van, its rank and the address book."""

    def __init__(self, role: str, rank: int | None, num_workers: int, num_servers: int,
                 scheduler: str, secret: str, host: str | None = None) -> None:
        self.role, self.rank = role, rank
        self.num_workers, self.num_servers = num_workers, num_servers
        self.scheduler, self.secret = scheduler, secret
        self.host = host or _address_towards(scheduler)
        node_id = f'{role}:{rank}' if rank is not None else f'{role}@{secrets.token_hex(4)}'
        self.van = Van(node_id, secret, host=self.host)
        self.van.connect('scheduler', scheduler)
        self.book = {}            # node id -> address
        self._stash = deque()     # messages received while waiting for others
        self._barriers = {}       # group -> barriers this node has entered
        self._stopped = threading.Event()
        self.doing = None         # (what, since) while in a watched wait (hang.py)
        self.counters = {}        # e.g. {'ring': collectives started}: sent with heartbeats
        self._questions = itertools.count(1)
        self._receiving = Inside()   # threads in recv() now (ZeroMQ sockets are not
                                     # thread-safe: stop() must not join them)
        self.members = None       # the live workers in rank order, after a membership change
        self.round = 0            # which membership (elastic: the scheduler's MEMBERS)
        self.joins_heard = 0      # elastic ring: workers the scheduler said wait to join
        self.joins_taken = 0      # ... of them, those the membership has taken in (or not)
        self.is_recovery = False  # joined a job already running (ps-lite's name)
        self.chains = None        # replicated servers, after a loss: each shard's holders

    @classmethod
    def from_env(cls, role: str | None = None) -> 'Node':
        """The node the launcher's variables describe (see ARCHITECTURE.md, config.py)."""
        cfg = config.get()
        try:
            cfg.require('scheduler_uri', 'scheduler_port', *([] if role else ['role']),
                        'num_worker', 'num_server', 'job_secret')
        except KeyError as e:
            raise RuntimeError(f'{e.args[0]} is not set: start the job with d2l-launch') from None
        return cls(role or cfg.role, cfg.rank, cfg.num_worker, cfg.num_server,
                   f'tcp://{cfg.scheduler_uri}:{cfg.scheduler_port}', cfg.job_secret,
                   cfg.node_host)

    @property
    def id(self) -> str:
        return self.van.node_id

    def start(self, timeout: float = 60.0) -> 'Node':
        """Register with the scheduler and wait for the address book, ``timeout`` s at most."""
        report_in_one_line()             # from here on, a StartError is one line
        load_torch_late_parts()          # before the scheduler counts our heartbeats
        me = shm.identity()
        self.van.send('scheduler', protocol.REGISTER, {'role': self.role, 'rank': self.rank,
                                                       'address': self.van.address,
                                                       'host_id': me})
        msg = self.recv([protocol.ADDRESS_BOOK, protocol.ERROR, protocol.JOINING],
                        timeout=timeout)
        joins = msg is not None and msg.kind == protocol.JOINING   # elastic ring: it waits
        if joins:                                                    # for the others' commit
            msg = self.recv([protocol.ADDRESS_BOOK, protocol.ERROR], timeout=timeout)
        if msg is None:                  # (both end the process in one line: ONE_LINE)
            raise started.StartError(_unanswered(self, timeout, joins))
        if msg.kind == protocol.ERROR:   # e.g. a worker started again too late to join
            raise started.StartError(f'{self.id}: {msg["error"]}')
        self.van.node_id = msg['you']
        self.rank = int(msg['you'].split(':')[1])
        self._take_chains(msg.get('chains'))
        if isinstance(msg.get('members'), list) and isinstance(msg.get('round'), int):
            self.members, self.round = [str(w) for w in msg['members']], msg['round']  # joins
            self.is_recovery = True
            if isinstance(msg.get('joins'), int):
                self.joins_heard = self.joins_taken = msg['joins']
        self.book, identities = dict(msg['nodes']), dict(msg.get('host_ids') or {})
        for peer, address in self.book.items():
            if peer != self.id:
                shares = me is not None and identities.get(peer) == me   # same processes
                self.van.connect(peer, address, same_host=shares and shm.same_host(
                    self.van.address, address))
        threading.Thread(target=self._heartbeat, daemon=True,
                         name='d2ldist-heartbeat').start()
        atexit.register(self.stop)
        faults.arm()                 # d2l-launch --fail ROLE:RANK@30s
        if config.get().timeline:
            self.sync_clock()
        return self

    def sync_clock(self, exchanges: int = 5) -> None:
        """Put the timeline on the scheduler's clock: of a few exchanges, the offset
        of the one with the shortest round trip (off by at most half of it)."""
        best = None
        for i in range(exchanges):
            sent = time.time()
            self.send('scheduler', protocol.CLOCK, {'id': i})
            msg = self._recv([protocol.CLOCK], timeout=2.0)
            got = time.time()
            if msg is None or not isinstance(msg.get('time'), float):
                continue
            if best is None or got - sent < best[1]:
                best = (msg['time'] - (sent + got) / 2, got - sent)
        if best is not None:
            spans.set_clock(best[0], best[1] / 2)

    def host_of(self, peer: str) -> str:
        """The host a peer listens on, from the address book."""
        return _host(self.book[peer])

    def peers(self, role: str) -> list[str]:
        """The ids of the nodes with ``role``, in rank order."""
        count = self.num_workers if role == 'worker' else self.num_servers
        return [f'{role}:{r}' for r in range(count)]

    def head(self, shard: int) -> str:
        """The server that answers for ``shard`` (server ``shard``, unless it was lost and
        a replica took over)."""
        return self.chains[shard][0] if self.chains is not None else f'server:{shard}'

    def workers(self) -> list[str]:
        """The ids of the workers of the current membership, in rank order."""
        return list(self.members) if self.members is not None else self.peers('worker')

    def send(self, peer: str, kind: str, header: dict | None = None,
             frames: Sequence[bytes] = (), track: bool = False) -> object:
        """Send a message to a peer (``Van.send``)."""
        return self.van.send(peer, kind, header, frames, track=track)

    def recv(self, kinds: Collection[str] | None = None, timeout: float | None = None,
             wait: hang.Wait | None = None) -> Message | None:
        """The next message of one of ``kinds`` (others wait in a stash for later), or
        None after ``timeout`` seconds. ``wait``: what this node waits for (a ``hang.Wait``),
        watched by the hang detector (``_watched``) and a span on the timeline."""
        with self._receiving:
            if wait is None or timeout is not None:
                return self._recv(kinds, timeout)
            return self._watched(kinds, wait)

    def _recv(self, kinds, timeout):
        """recv, unwatched: a message stashed before, else the van's next (taking the
        scheduler's news on the way, and stashing those not of ``kinds``)."""
        msg = self._stashed(kinds)
        if msg is not None:
            return msg
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            msg = self.van.recv(timeout=left) if left is None or left > 0 else None
            if msg is None:
                return None
            if msg.sender == 'scheduler' and self._news(msg, kinds):
                continue                 # (only news, now taken)
            if kinds is None or msg.kind in kinds:
                return msg
            self._stash.append(msg)      # for a later recv of its kind

    def _stashed(self, kinds):
        """The oldest message of ``kinds`` in the stash, taken out; or None."""
        for msg in self._stash:
            if kinds is None or msg.kind in kinds:
                self._stash.remove(msg)
                return msg
        return None

    def put_back(self, msg: Message) -> None:
        """Return a message just received: the next recv of its kind gets it first."""
        self._stash.appendleft(msg)

    def _watched(self, kinds, wait):
        """_recv that names who is missing after D2L_HANG_WARN s, and raises hang.Hang
        after D2L_HANG_FAIL s."""
        start, wall = time.monotonic(), time.time()
        cfg = config.get()
        warn, fail = cfg.hang_warn, cfg.hang_fail
        deadlines = sorted({t for t in (warn, fail) if t} | {hang.LOOK})
        self.doing, warned = (wait.what, start), False
        try:
            while True:
                left = deadlines[0] - (time.monotonic() - start) if deadlines else None
                msg = self._recv(kinds, None if left is None else max(left, 0.0))
                if msg is not None:
                    spans.waited(wait.span, wall, what=wait.what)
                    if warned and self.role == 'worker':
                        report(waiting='')               # the dashboard's warning goes
                    return msg
                warned = self._overdue(wait, deadlines.pop(0), warn, fail) or warned
        finally:
            self.doing = None

    def _overdue(self, wait, waited, warn, fail):
        """A wait has lasted ``waited`` s: raise hang.Ended if all it waits for ended,
        hang.Hang at ``fail``; at ``warn``, say who is missing. Whether it warned."""
        missing = self.missing(wait)
        if missing and all(d.get('state') == 'ended' for _, d in missing):
            gone = ', '.join(shown(n) for n, _ in missing)
            raise hang.Ended(f'{shown(self.id)} waits {wait.what}, but {gone} ended without '
                             'coming: every worker must issue the same calls, as many times')
        if waited not in (warn, fail):
            return False                 # (the early look: nobody ended)
        line = (f'{shown(self.id)} has waited {waited:g} s '
                f'{wait.what}: {hang.sentence(missing)}')
        if waited == fail:
            raise hang.Hang(line)
        say(line)
        if self.role == 'worker':
            report(waiting=line)
        return True

    def missing(self, wait: hang.Wait) -> list[tuple[str, dict]]:
        """Ask whoever knows who has not arrived: [(node, what it is doing)]."""
        found = {}
        for peer, question in wait.questions:
            for node, doing in self.ask(peer, question):
                found.setdefault(node, {}).update(doing if isinstance(doing, dict) else {})
        unknown = [n for n, d in found.items() if 'what' not in d and 'state' not in d]
        if unknown:     # a server knows who is missing; the scheduler knows what they do
            for node, doing in self.ask('scheduler', {'nodes': unknown}):
                if node in found and isinstance(doing, dict):
                    found[node] = {**doing, **found[node]}
        return sorted(found.items())

    def ask(self, peer: str, question: object,
            timeout: float = 2.0) -> list[tuple[str, object]]:
        """One WHO question to ``peer``: its list of [node, doing] (empty if no answer)."""
        qid = next(self._questions)
        self.send(peer, protocol.WHO, {'id': qid, 'question': question})
        deadline = time.monotonic() + timeout
        while True:
            msg = self._recv([protocol.WHO_ANSWER], max(0.0, deadline - time.monotonic()))
            if msg is None:
                return []
            if msg.get('id') == qid and isinstance(msg.get('missing'), list):
                return [(str(m[0]), m[1]) for m in msg['missing']
                        if isinstance(m, list) and len(m) == 2]

    def _news(self, msg, kinds):
        """Take the scheduler's news of the job (a failure raises PeerFailed, a new
        membership WorkersChanged); True if ``msg`` was only news."""
        if msg.kind == protocol.FAILED:
            raise PeerFailed(f'{shown(msg.get("node", "a node"))} failed '
                             f'({msg.get("reason")}); {shown(self.id)} gives up')
        if msg.kind == protocol.MEMBERS:
            self._new_members(msg)
        if msg.kind == protocol.JOINING and (kinds is None or protocol.JOINING not in kinds):
            if isinstance(msg.get('joins'), int):      # (noted: the next commit asks)
                self.joins_heard = max(self.joins_heard, msg['joins'])
            return True
        if msg.kind == protocol.SERVERS:
            self._take_chains(msg.get('chains'), msg.get('lost'))
        return False

    def _new_members(self, msg):
        """The scheduler's new membership: take it, and fail what waits on the old one."""
        workers, rnd = msg.get('workers'), msg.get('round')
        if not isinstance(rnd, int) or rnd <= self.round or not isinstance(workers, list):
            return
        if self.id not in workers:     # declared lost (silent too long): it cannot go on
            raise PeerFailed(f'{shown(self.id)} was left out of the workers '
                             f'({msg.get("reason")})')
        self.members, self.round = [str(w) for w in workers], rnd
        self._barriers = {g: n for g, n in self._barriers.items() if g == 'server'}
        lost, joined, reason = msg.get('lost'), msg.get('joined'), msg.get('reason')
        if isinstance(msg.get('joins'), int):
            self.joins_taken = msg['joins']
            self.joins_heard = max(self.joins_heard, msg['joins'])
        joined = [j for j in joined if isinstance(j, list) and j[:1] and j[0] in workers] \
            if isinstance(joined, list) else []
        for newcomer in joined:
            self.meet(newcomer)
        said = reason                  # (a worker joins, or is started again)
        if isinstance(lost, str) and lost not in [j[0] for j in joined]:
            self.van.give_up_on(lost)
            said = f'{shown(lost)} was lost ({reason})' + ''.join(
                f', {shown(j[0])} joins' for j in joined)
        raise WorkersChanged(f'{said}; {go_on(len(workers))} (round {rnd})',
                             lost if isinstance(lost, str) else None, rnd)

    def _take_chains(self, chains, lost=None):
        """The scheduler's chains of holders (replicated servers), checked: one per shard."""
        if isinstance(chains, list) and len(chains) == self.num_servers and all(
                isinstance(c, list) and c and all(isinstance(h, str) and h.startswith(
                    'server:') for h in c) for c in chains):
            self.chains = [list(c) for c in chains]
            if isinstance(lost, str):
                self.van.give_up_on(lost)

    def meet(self, joined: list) -> None:
        """A worker joins the job (elastic): [its id, its address, its host's identity];
        ValueError for an address that is not tcp://HOST:PORT."""
        if isinstance(joined, list) and len(joined) == 3:
            peer, address, host = (str(j) for j in joined)
            if not ADDRESS.fullmatch(address):
                raise ValueError(f'{peer} gave a bad address {clip(address, 100)!r}')
            self.book[peer] = address
            self.van.connect(peer, address, same_host=host == shm.identity()
                             and shm.same_host(self.van.address, address))

    def take_news(self) -> None:
        """Take a new membership that came meanwhile, without waiting for anything else
        (elastic: a worker alone has no collective that would bring it)."""
        try:
            self._recv([protocol.MEMBERS], timeout=0.001)
        except WorkersChanged:
            pass                       # taken: self.round and self.members are the new ones

    def take_newcomers(self) -> None:
        """Elastic ring, at a commit that every worker agreed on: say READY, and wait
        for the membership that takes in the workers waiting to join."""
        self.send('scheduler', protocol.READY, {'round': self.round})
        try:
            while True:
                self._recv([protocol.MEMBERS], None)    # (an older one: wait on)
        except WorkersChanged:
            pass                       # taken: self.round and self.members are the new ones

    def barrier(self, group: str = 'worker', what: str = 'barrier()') -> None:
        """Wait until every node of ``group`` ('worker', 'server' or 'all') is here.

        ``what`` names the call (e.g. 'kv.init'): the scheduler fails every node of the
        group at once if two of them enter their n-th barrier from different calls."""
        n = self._barriers[group] = self._barriers.get(group, 0) + 1   # numbered per group
        self.van.send('scheduler', protocol.BARRIER, {'group': group, 'n': n, 'what': what,
                                                      'round': self.round})
        wait = hang.Wait(f'in {group} barrier {n} ({what})',
                         [('scheduler', {'barrier': [group, n]})], span='barrier')
        while True:
            msg = self.recv([protocol.BARRIER_DONE, protocol.BARRIER_DISAGREE], wait=wait)
            if msg.kind == protocol.BARRIER_DISAGREE:
                raise hang.Disagree(clip(msg.get('error')))
            if msg.get('group') == group and msg.get('n') == n \
                    and msg.get('round', 0) == self.round:
                return

    def passed_barrier(self, group: str, n: int) -> None:
        """Count barrier n of ``group`` as passed without entering it (a worker in
        hvd.join(): the scheduler counted it as there)."""
        if isinstance(group, str) and isinstance(n, int):
            self._barriers[group] = max(self._barriers.get(group, 0), n)

    def _heartbeat(self):
        """Tell the scheduler every second that this node is alive (own socket)."""
        van = Van(self.id, self.secret, bind=False, shaped=False)
        van.connect('scheduler', self.scheduler)
        while not self._stopped.wait(config.get().heartbeat_interval):
            doing = self.doing
            van.send('scheduler', protocol.HEARTBEAT, {
                'what': doing and doing[0], 'counters': dict(self.counters),
                'for': doing and round(time.monotonic() - doing[1], 1)})
        van.close()

    def stop(self) -> None:
        """Say goodbye to the scheduler, wait for its answer, and close the sockets.

        The answer matters: a message still queued in ZeroMQ when the process exits
        is lost (nothing terminates the ZeroMQ context at exit), and a goodbye lost
        after the heartbeats stopped would make the scheduler declare this node dead.
        The heartbeats go on until the answer came (or LINGER_SECONDS passed).
        If another thread is receiving (a collective cut short by an error), the
        goodbye goes out unanswered, as the sockets cannot be shared.
        """
        if self._stopped.is_set():
            return
        try:
            if _crashed and config.get().min_workers:   # elastic: the others go on
                self.van.send('scheduler', protocol.FAILED, {'reason': _crashed})
                return                  # (no goodbye: lost, the heartbeats' silence says it)
            self.van.send('scheduler', protocol.GOODBYE, {'counters': dict(self.counters)})
            # Workers wait: the scheduler counts their goodbyes. (Servers go when told
            # to shut down, by a scheduler that is gone by then.)
            if self.role == 'worker' and self._receiving.now == 0:
                self.recv([protocol.FAREWELL], timeout=LINGER_SECONDS)
        except PeerFailed:
            pass                        # the job is ending anyway
        finally:
            self._stopped.set()
            self.van.close()


class Inside:
    """How many threads are inside a ``with`` block now (``now``), counted under a lock."""

    def __init__(self):
        self.now, self._lock = 0, threading.Lock()

    def __enter__(self):
        with self._lock:
            self.now += 1

    def __exit__(self, *exc):
        with self._lock:
            self.now -= 1


# errors whose message says what happened where: uncaught, they end the process in one line
ONE_LINE = (PeerFailed, hang.Hang, hang.Disagree, stream.StreamBroken, started.StartError)
_one_line = False   # whether report_in_one_line() has hooked sys.excepthook
_crashed = None     # the uncaught error this process ends with, if any (stop() says so)


def report_in_one_line():
    """Let an uncaught error of ONE_LINE end the process with its message (one line that
    says what happened where), not a traceback; the first call hooks, the others do not."""
    global _one_line
    if _one_line:
        return
    _one_line, previous = True, sys.excepthook

    def hook(kind, value, tb):
        global _crashed
        _crashed = clip(f'{kind.__name__}: {value}', NAME)
        if issubclass(kind, WorkersChanged):       # the others may go on; this one cannot
            value = (f'{value}; not here: this script does not catch it (elastic training '
                     f'runs its loop under hvd.elastic.run or d2ldist.train)')
        if issubclass(kind, ONE_LINE):
            sys.stderr.write(f'd2ldist: {value}\n')   # one write: processes started
            sys.stderr.flush()                        # by mpirun may share the pipe
        else:
            previous(kind, value, tb)
    sys.excepthook = hook


def load_torch_late_parts():
    """Where the script has loaded torch, load now what torch loads on its first
    optimizer (``torch._dynamo``, and triton's 500 MB library with it). On a busy
    machine that import keeps the heartbeat thread from the GIL for seconds: once the
    scheduler counts our heartbeats, it would declare a working node dead. Before we
    register, nobody counts (docs/design/runtime.md, Heartbeats)."""
    if 'torch' in sys.modules:
        try:
            import torch._dynamo  # noqa: F401  (loaded for its time, not used here)
        except (ImportError, RuntimeError):   # (a torch without it: nothing to load)
            pass


def _host(uri):
    """'198.18.0.2' for 'tcp://198.18.0.2:5555'."""
    return uri.split('://')[-1].rsplit(':', 1)[0].strip('[]')


def _address_towards(uri):
    """This host's address on the route to ``uri`` (127.0.0.1 for a local job)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((_host(uri), 9))   # no packet is sent: this only asks for the route
        return s.getsockname()[0]


def _unanswered(node, timeout, joins):
    """The line a node ends with that waited ``timeout`` s to start: for the scheduler's
    answer, or, ``joins`` a running ring (hvd.elastic), as long again for the others'
    next commit to take it in."""
    if joins:
        return (f'{node.id}: waited {timeout:g} s to join the running job: the workers '
                'came to no commit (state.commit()) to take it in')
    return f'{node.id}: no answer from the scheduler at {node.scheduler} after {timeout:g} s'
