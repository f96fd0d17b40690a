"""The scheduler: node bookkeeping for one job (after ps-lite's scheduler node).

It does four things and nothing else (and tells the time, for the timeline):
1. registration: every server and worker says who it is and where it listens; once
   all have come, each gets the address book (who is where);
2. barriers over a group (``worker``, ``server`` or ``all``), checked to be the same
   call on every node, and hvd.join() (a worker out of data counts as there);
3. liveness: every node sends a heartbeat each second; one that falls silent, or
   dies (the launcher says so at once where it started the process: ``ended``), is
   announced to everybody else, so that nobody waits for it forever; the
   heartbeats say what each node waits for, so that a node that has waited too long
   can ask who is missing (``hang.py``);
4. the end: when every worker has said goodbye, the servers are told to shut down;
5. elastic workers (``--min-workers``): a lost worker is left out of a new membership
   (``reform``), while enough remain; the servers learn whom their rounds wait for;
   a worker that joins the ring waits until the others are at a commit (``admit``);
6. replicated servers (``--server-replicas``): a lost server leaves the chains of the
   shards it held, and the next holder of each answers for it (``promote``).

Run as ``python -m d2ldist.runtime.scheduler`` by the launcher; the environment says the job's
shape (see ARCHITECTURE.md). It prints ``d2ldist: scheduler ready at <address>`` once
it listens, which is how the launcher learns the port it chose.
"""
import sys
import time

from .. import config
from ..lines import NAME, clip, say, shown
from . import faults, protocol, replicas
from .van import Van

GROUPS = ('worker', 'server', 'all')
MOST_WORKERS = 1 << 12     # elastic: the ranks a worker that joins may have


class Scheduler:
    """Registration, address book, barriers and liveness of one job."""

    def __init__(self, van, num_workers, num_servers, heartbeat_timeout=5.0,
                 min_workers=None, server_replicas=0, max_workers=None):
        self.van, self.num_workers, self.num_servers = van, num_workers, num_servers
        self.heartbeat_timeout = heartbeat_timeout
        self.nodes = {}          # node id -> address, in registration order
        self.host_ids = {}       # node id -> who can share its memory (shm.identity())
        self.book_sent = False
        self.last_seen = {}      # node id -> time of its last message
        self.finished = set()    # nodes that said goodbye
        self.barriers = {}       # (group, n) -> {node id that arrived: from which call}
        self.doing = {}          # node id -> its last heartbeat: what it waits for, counters
        self.failed = set()      # nodes announced as failed
        self.joined = []         # workers in hvd.join(), in the order they called it
        self.join_calls = 0      # the most ring collectives a worker in join() had counted
        self.min_workers = min_workers   # set: elastic workers (reform)
        self.max_workers = max_workers   # set: workers may join (admit), up to this many
        self.lost = set()        # workers left out of the membership
        self.round = 0           # memberships formed since the first
        self.starts = {}         # node id -> its registrations: 1, then 2 if started again
        self.newcomers = {}      # elastic ring: workers waiting to join -> (address, host)
        self.joins = 0           # ... how many were announced to the workers, ever
        self.ready = set()       # ... the workers at a commit, ready to take them in
        self.chains = replicas.chains(num_servers, server_replicas) if server_replicas \
            else None            # replicated servers: the holders of each shard, head first
        self.replicas = server_replicas
        self.copying = set()     # ... (shard, server): a new holder its copy has not reached

    def members(self, group):
        return [n for n in self.nodes if n not in self.lost
                and (group == 'all' or n.startswith(group + ':'))]

    def serve(self):
        """Answer messages until the workers are done; return the exit code."""
        while True:
            msg = self.van.recv(timeout=0.5)
            if msg is not None:
                if msg.sender in self.nodes:
                    self.last_seen[msg.sender] = time.monotonic()
                done = self.handle(msg)
                if done:
                    return 0
            dead = self.silent_node()
            reason = f'no heartbeat for {self.heartbeat_timeout:g} s'
            if dead and self.survive(dead, reason):
                continue
            if dead:
                self.fail(dead, reason)
                return 1

    def handle(self, msg):
        """Act on one message; True when the job is over."""
        if msg.kind == protocol.REGISTER:
            self.register(msg)
        elif msg.kind == protocol.HEARTBEAT and msg.sender in self.nodes:
            self.heard(msg)
        elif msg.kind == protocol.BARRIER and msg.sender in self.nodes \
                and msg.get('round', 0) == self.round:       # (not one left by a reform)
            self.barrier(msg.sender, msg.get('group'), msg.get('n'), clip(msg.get('what'), NAME))
        elif msg.kind == protocol.WHO and msg.sender in self.nodes:
            self.van.send(msg.sender, protocol.WHO_ANSWER, {
                'id': msg.get('id'), 'missing': self.missing(msg.sender, msg.get('question'))})
        elif msg.kind == protocol.CLOCK and msg.sender in self.nodes:
            self.van.send(msg.sender, protocol.CLOCK, {'id': msg.get('id'), 'time': time.time()})
        elif msg.kind == protocol.FAILED and msg.sender in self.nodes \
                and msg.sender not in self.lost:      # (one left out says so as it ends)
            self.lose(msg.sender, clip(msg.get('reason', 'failed'), NAME))
        elif msg.kind == protocol.ENDED and msg.sender == 'launcher':
            self.ended(msg.get('node'), msg.get('start'), clip(msg.get('how'), NAME))
        elif msg.kind == protocol.READY and msg.sender in self.members('worker') \
                and msg.get('round') == self.round:
            self.ready.add(msg.sender)
            if self.ready >= set(self.live_workers()):
                self.form(self.welcome())
        elif msg.kind == protocol.HOLDS and isinstance(msg.get('shard'), int) \
                and (msg['shard'], msg.sender) in self.copying:     # (a new holder)
            self.copying.discard((msg['shard'], msg.sender))
            say(f'{shown(msg.sender)} holds shard {msg["shard"]} now: its copy has come')
        elif msg.kind == protocol.JOIN and msg.sender in self.members('worker'):
            self.join(msg.sender, msg.get('calls'))
        elif msg.kind == protocol.GOODBYE and msg.sender in self.nodes:
            counters = msg.get('counters')      # its final counts: a call it never made
            if isinstance(counters, dict):      # is one a waiting node can be told of
                self.doing.setdefault(msg.sender, {})['counters'] = counters
            self.finished.add(msg.sender)
            self.refuse_newcomers(msg.sender)
            self.end_join()
            self.van.send(msg.sender, protocol.FAREWELL)
            if msg.sender.startswith('worker:') and self.min_workers is not None:
                self.tell_servers()        # elastic: rounds and barriers no longer
                for group, n in list(self.barriers):     # wait for it
                    self.release(group, n)
            if self.book_sent and set(self.members('worker')) <= self.finished:
                for server in self.members('server'):
                    self.van.send(server, protocol.SHUTDOWN)
                return True
        return False

    def register(self, msg):
        role, rank, address = msg.get('role'), msg.get('rank'), msg.get('address')
        if role not in ('worker', 'server') or not isinstance(address, str):
            return
        count = self.num_workers if role == 'worker' else self.num_servers
        if rank is None:   # started by hand without D2L_RANK: take the next free rank
            taken = {int(n.split(':')[1]) for n in self.members(role)}
            rank = min(set(range(count)) - taken, default=None)
        node = f'{role}:{rank}'
        self.van.connect(msg.sender, address)
        if self.book_sent and self.min_workers and role == 'worker' \
                and isinstance(rank, int) and 0 <= rank < MOST_WORKERS:   # (a new host's
            return self.admit(node, address, msg.get('host_id'))           # may be above -n)
        if self.book_sent or not isinstance(rank, int) or not 0 <= rank < count \
                or node in self.nodes:
            self.van.send(msg.sender, protocol.ERROR, {
                'error': f'cannot register {role} rank {rank}: expected {count} {role}s, '
                         f'have {sorted(self.nodes)}'})
            return
        if msg.sender != node:
            self.van.connect(node, address)
        self.nodes[node] = address
        self.starts[node] = 1
        self.host_ids[node] = msg.get('host_id') if isinstance(msg.get('host_id'), str) else None
        if len(self.nodes) == self.num_workers + self.num_servers:
            for n in self.nodes:
                self.van.send(n, protocol.ADDRESS_BOOK,
                              {'nodes': self.nodes, 'host_ids': self.host_ids, 'you': n})
                self.last_seen[n] = time.monotonic()   # heartbeats start with the book
            self.book_sent = True

    def barrier(self, node, group, n, what):
        """A node entered barrier n of a group: all there, let them go; called from
        another place than the first one (``what``), fail them all, naming both."""
        if group not in GROUPS or not isinstance(n, int):
            return
        arrived = self.barriers.setdefault((group, n), {})
        first = next(iter(arrived.items()), None)
        arrived[node] = what
        if first is not None and first[1] != what:
            (a, from_a), (b, from_b) = sorted([first, (node, what)], key=_by_rank)
            error = (f'{group} barrier {n}: {shown(a)} entered it from {from_a}, '
                     f'{shown(b)} from {from_b}; every node of the group must '
                     'call the same barriers in the same order')
            say(error)
            for member in self.members(group):
                self.van.send(member, protocol.BARRIER_DISAGREE, {'error': error})
        else:
            self.release(group, n)

    def release(self, group, n):
        """Let barrier n of ``group`` go if everybody it waits for has arrived."""
        waits_for = self.members(group)
        if self.min_workers is not None:       # elastic: not for a worker that finished
            waits_for = [m for m in waits_for if m not in self.finished]
        if set(self.barriers[(group, n)]) | set(self.joined) >= set(waits_for):
            for member in waits_for:
                self.van.send(member, protocol.BARRIER_DONE, {'group': group, 'n': n,
                                                              'round': self.round})
            del self.barriers[(group, n)]

    def join(self, worker, calls=None):
        """A worker called hvd.join(): it counts as there at barriers (it takes part in
        the others' collectives); once all have joined, each learns who came last, and
        how many collectives the last one had counted (``calls``)."""
        if worker not in self.joined:
            self.joined.append(worker)
        self.van.send(worker, protocol.JOIN_NOTED)
        if isinstance(calls, int) and not isinstance(calls, bool) and 0 <= calls < 2 ** 62:
            self.join_calls = max(self.join_calls, calls)
        for (group, n), arrived in list(self.barriers.items()):   # the ones it held up
            if group != 'server':
                self.barrier(worker, group, n, next(iter(arrived.values())))
        self.end_join()

    def end_join(self):
        """Let the workers in hvd.join() go: all have joined (who came last?), or one
        ended without joining (an error: they would wait for it forever)."""
        workers = self.members('worker')
        gone = [w for w in workers if w in self.finished and w not in self.joined]
        if self.joined and gone:
            waiting = ', '.join(shown(j) for j in self.joined)
            error = (f'{shown(gone[0])} ended without calling join() while '
                     f'{waiting} waited in it: every worker must call hvd.join()')
            for worker in self.joined:
                self.van.send(worker, protocol.JOIN_DONE, {'error': error})
        elif self.joined and set(self.joined) >= set(workers):
            last = int(self.joined[-1].split(':')[1])
            for worker in workers:
                self.van.send(worker, protocol.JOIN_DONE, {'last': last,
                                                           'calls': self.join_calls})
        else:
            return
        self.joined, self.join_calls = [], 0

    def heard(self, msg):
        """A heartbeat: what the node is waiting for (if anything), and its counters."""
        what, counters = msg.get('what'), msg.get('counters')
        self.doing[msg.sender] = {
            'what': clip(what, NAME) if what else None,
            'for': float(msg.get('for')) if isinstance(msg.get('for'), (int, float)) else 0.0,
            'counters': counters if isinstance(counters, dict) else {},
            'at': time.monotonic()}

    def missing(self, asker, question):
        """Who has not arrived where ``asker`` waits: [[node, what it is doing]]."""
        if not isinstance(question, dict):
            return []
        if 'barrier' in question:
            group, n = (list(question['barrier']) + [None, None])[:2]
            arrived = self.barriers.get((group, n)) if group in GROUPS else None
            nodes = [m for m in self.members(group) if m not in arrived
                     and m not in self.joined] if arrived else []
        elif 'counter' in question:             # e.g. the ring's collectives: started fewer
            name, n = str(question['counter']), question.get('n')
            nodes = [m for m in self.members('worker') if m != asker and isinstance(n, int)
                     and self.counter(m, name) < n]
        else:
            nodes = [str(m) for m in question.get('nodes') or [] if str(m) in self.nodes]
        return [[m, self.describe(m, question.get('counter'))] for m in nodes]

    def counter(self, node, name):
        value = self.doing.get(node, {}).get('counters', {}).get(name, 0)
        return value if isinstance(value, int) else 0

    def describe(self, node, counter=None):
        """What ``node`` is doing, as its last heartbeat said (see hang.describe)."""
        if node in self.finished:      # (its script ended, well or not, or it died)
            return {'state': 'failed' if node in self.failed else 'ended'}
        d = self.doing.get(node, {})
        described = {'what': d.get('what'),
                     'for': d.get('for', 0) + time.monotonic() - d.get('at', time.monotonic())}
        if counter:
            described['counter'] = self.counter(node, str(counter))
        return described

    def silent_node(self):
        """A registered node that has stopped sending heartbeats, if any."""
        now = time.monotonic()
        for node, seen in self.last_seen.items():
            if node not in self.finished and now - seen > self.heartbeat_timeout:
                return node
        return None

    # Elastic workers: a lost worker is not a lost job. The survivors are told the new
    # membership (the workers left, in their old order, are ranks 0..N'-1) with a new
    # round number: their collective in flight fails, and the chunks of the old ring
    # that come late are dropped. Barriers half entered are forgotten: every survivor
    # left its own, and counts the barriers of the new round from 1. Fewer than
    # --min-workers left, or a server lost: the job fails. A worker that joins the ring
    # (started again, or on a new host) is not let in at once: the others are told that
    # it waits (JOINING), go on with their step, and at their next commit all agree to
    # take it (hvd.elastic) and say READY; then it gets the book and they a membership
    # with it, as Horovod adds hosts at a commit. With servers it joins at once: the
    # servers' rounds take it in (kv/server.py). The servers hear of every change of
    # the workers left, a finished one too (tell_servers): a sync round waits for
    # those only.
    def reform(self, node, reason):
        """Form a membership without the lost worker ``node``; False where the job fails."""
        left = [w for w in self.live_workers() if w != node]
        if self.min_workers is None or not node.startswith('worker:') or not self.book_sent \
                or node in self.lost or len(left) < self.min_workers:
            return False
        self.leave_out(node)
        said = f'{shown(node)} failed: {reason}' + (
            f', and {self.welcome()}' if self.newcomers else '')
        self.form(said, lost=node, reason=reason)
        self.van.send(node, protocol.MEMBERS, {      # (the lost one too: if it is only
            'round': self.round, 'workers': self.live_workers(),   # cut off, it learns
            'lost': node, 'reason': reason})                       # it is out, and ends)
        self.van.give_up_on(node)        # (at the end, nobody waits for it to take that)
        return True

    def form(self, said, lost=None, reason=None):
        """A new membership: the workers left and every newcomer; the newcomers get the
        book, the others the membership, and the servers whom their rounds wait for."""
        joined = [[n, address, host] for n, (address, host) in self.newcomers.items()]
        for n, address, host in joined:
            self.enter(n, address, host)
        self.newcomers = {}
        workers = self.next_round()
        say(f'{said}; {self.going_on(workers)}')
        for n, _, _ in joined:
            self.van.send(n, protocol.ADDRESS_BOOK, {
                'nodes': self.nodes, 'host_ids': self.host_ids, 'you': n, 'members': workers,
                'round': self.round, 'chains': self.chains, 'joins': self.joins})
        news = {'round': self.round, 'workers': workers, 'reason': reason or said,
                'lost': lost, 'joined': joined, 'joins': self.joins}
        for other in workers:
            if other not in {n for n, _, _ in joined}:
                self.van.send(other, protocol.MEMBERS, news)
        self.tell_servers()

    def leave_out(self, node):
        """``node`` is lost and the job goes on: no membership, barrier or end waits for it."""
        self.lost.add(node)
        self.finished.add(node)
        self.failed.add(node)

    def going_on(self, workers):
        """How the job goes on with ``workers``, in words."""
        if self.num_servers:
            return f"the servers' rounds count {len(workers)} workers (round {self.round})"
        return f'the ring re-forms with {len(workers)} workers (round {self.round})'

    def tell_servers(self):
        """Elastic: tell the servers which workers are left, so that a sync round
        waits for those only (a worker lost, joined or done; one that joins tells
        them where it listens itself: kv HELLO)."""
        if self.min_workers is not None and self.book_sent:
            for server in self.members('server'):
                self.van.send(server, protocol.WORKERS, {'workers': self.live_workers(),
                                                         'round': self.round})

    def live_workers(self):
        """The workers of the membership that have not finished, in rank order."""
        return sorted((w for w in self.members('worker') if w not in self.finished),
                      key=lambda w: _by_rank((w,)))

    def next_round(self):
        """A new membership: its number, half-entered barriers forgotten; its workers."""
        self.round += 1
        self.ready = set()
        self.barriers = {key: arrived for key, arrived in self.barriers.items()
                         if key[0] == 'server'}
        return self.live_workers()

    def admit(self, node, address, host_id):
        """Elastic: a worker started again, or on a new host, joins: in place of the one
        it was, if that one's loss has not been noticed yet (at once: the others'
        collective fails anyway); with servers, at once; on the ring, at the others'
        next commit (it waits, and they are told)."""
        replaced = node in self.members('worker') and node not in self.finished
        self.van.connect(node, address)
        ended = [w for w in self.members('worker') if w in self.finished - self.failed
                 and w != node]
        others = [w for w in self.live_workers() + list(self.newcomers) if w != node]
        if ended:                      # the others have left their training: too late
            error = f'the job is ending ({shown(ended[0])} has finished)'
        elif self.max_workers is None:
            error = 'the job takes no new workers (d2l-launch --max-workers B)'
        elif len(others) >= self.max_workers:
            error = f'the job has its {self.max_workers} workers (--max-workers)'
        else:
            error = None
        if error:
            self.van.send(node, protocol.ERROR, {'error': f'cannot join: {error}'})
            return
        self.newcomers[node] = (address, host_id if isinstance(host_id, str) else None)
        if replaced or self.num_servers:
            said = f'{shown(node)} {"was started again" if replaced else "joins"}'
            self.form(said, lost=node if replaced else None)
            return
        self.joins += 1
        say(f'{shown(node)} waits to join; the workers take it in at their next commit')
        for n in [node] + self.live_workers():
            self.van.send(n, protocol.JOINING, {'joins': self.joins})

    def welcome(self):
        """Every worker is at a commit: in words, who joins now."""
        if not self.newcomers:         # (it ended meanwhile: a membership all the same)
            return 'nobody joins after all'
        names = [shown(n) for n in self.newcomers]
        return f'{", ".join(names)} join{"s" if len(names) == 1 else ""}'

    def enter(self, node, address, host_id):
        """A worker that joins, in the books: its address, a start more, heard from now."""
        self.nodes[node], self.host_ids[node] = address, host_id
        self.starts[node] = self.starts.get(node, 0) + 1
        self.lost.discard(node)
        self.finished.discard(node)
        self.failed.discard(node)
        self.last_seen[node] = time.monotonic()

    def refuse_newcomers(self, finished):
        """A worker has finished: those still waiting to join come too late."""
        if finished.startswith('worker:'):
            for n in self.newcomers:
                self.van.send(n, protocol.ERROR, {'error': f'cannot join: the job is ending '
                                                           f'({shown(finished)} '
                                                           'has finished)'})
            self.newcomers = {}

    def ended(self, node, start, how):
        """The launcher saw the process of ``node`` end (elastic): it is lost now, not
        after its heartbeats have been missed for seconds. Not if ``start`` (which of its
        processes ended: 1, or 2 if started again) is not the one registered now."""
        if node in self.newcomers and start == self.starts.get(node, 0) + 1:
            del self.newcomers[node]   # (it waited to join: nobody waits for it)
        elif node in self.nodes and node not in self.finished \
                and self.starts.get(node) == start:
            self.lose(node, f'its process ended, {how}')

    def lose(self, node, reason):
        """``node`` is gone: the others go on without it, or are told it failed."""
        if not self.survive(node, reason):
            self.fail(node, reason)

    def survive(self, node, reason):
        """Go on without ``node``: a worker left out (reform), a server's shards taken
        over by their replicas (promote); False where the job cannot."""
        return self.reform(node, reason) or self.promote(node, reason)

    def promote(self, node, reason):
        """Replicated servers: the lost server ``node`` leaves every chain, the next
        holder of each of its shards answers for it, and the next live server becomes a
        new holder (``replicas.renewed``); False if a shard has no holder left.
        Everybody hears the new chains: the workers send what is unanswered again, to
        the new heads; a holder whose next one was lost sends what it had forwarded on,
        or, to a new one, the shard whole (it says HOLDS once it has it)."""
        if self.chains is None or not node.startswith('server:') or node in self.lost \
                or not self.book_sent:
            return False
        left = replicas.without(self.chains, node, self.copying)
        if left is None:
            say(replicas.last_copy(self.chains, node, self.copying, self.replicas))
            return False
        chains = self.chains
        self.leave_out(node)
        self.chains, new = replicas.renewed(left, set(self.members('server')), self.replicas)
        self.copying = {(s, h) for s, h in self.copying if h != node} | set(new)
        say(f'{shown(node)} failed: {reason}; {replicas.takes_over(chains, left, node)}'
            f'{replicas.copies(new)}')
        for other in self.nodes:
            if other not in self.finished:
                self.van.send(other, protocol.SERVERS, {
                    'chains': self.chains, 'lost': node, 'reason': reason,
                    'copying': sorted([s, h] for s, h in self.copying)})
        self.van.give_up_on(node)
        return True

    def fail(self, node, reason):
        """Tell every other node that ``node`` is gone, so that nobody waits for it."""
        say(f'{shown(node)} failed: {reason}; telling the others')
        for other in self.nodes:
            if other != node and other not in self.finished:
                self.van.send(other, protocol.FAILED, {'node': node, 'reason': reason})
        self.van.give_up_on(node)
        self.finished.add(node)
        self.failed.add(node)
        for n in self.newcomers:         # (they wait in their start: no longer)
            self.van.send(n, protocol.ERROR, {'error': f'cannot join: {node} failed'})
        self.newcomers = {}


def _by_rank(pair):
    """(node id, ...) in role and rank order: 'server:0' < 'worker:0' < 'worker:10'."""
    role, _, rank = pair[0].partition(':')
    return role, int(rank) if rank.isdigit() else 0


def main():
    try:
        cfg = config.get().require('num_worker', 'num_server', 'job_secret')
    except KeyError as e:
        sys.exit(f'd2ldist.scheduler: {e.args[0]} is not set (start jobs with d2l-launch)')
    except ValueError as e:
        sys.exit(f'd2ldist.scheduler: {e}')
    try:
        van = Van('scheduler', cfg.job_secret, host=cfg.scheduler_uri or '127.0.0.1',
                  port=cfg.scheduler_port or 0, max_message_bytes=1 << 20)
    except Exception as e:   # e.g. the port is taken
        sys.exit(f'd2ldist.scheduler: cannot listen: {e}')
    say(f'scheduler ready at {van.address}')
    faults.arm()                 # d2l-launch --fail scheduler@5s
    code = Scheduler(van, cfg.num_worker, cfg.num_server, cfg.heartbeat_timeout,
                     cfg.min_workers, cfg.server_replicas, cfg.max_workers).serve()
    if van.dropped:
        say(f'the scheduler dropped {van.dropped} invalid messages')
    van.close()
    van.terminate()   # the last farewells and shutdowns leave before the process does
    sys.exit(code)


if __name__ == '__main__':
    main()
