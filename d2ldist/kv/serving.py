"""A server process's loop: receive each message and hand it to the shard it names.

A server holds its own shard (a ``KVServer``) and, with replicated servers
(``d2l-launch --server-replicas R``), replicas of the R shards before it, each a
``KVServer`` of its own (``runtime/replicas.py`` says which). The loop hands each
request to its shard, keeping each worker's requests in order: one that must wait
for a round waits here, with those after it. It also takes the scheduler's news (the
workers left, the new chains), a worker that joins (HELLO), a stream a worker offers
(LINK), a worker's question of who is missing (WHO, ``runtime/hang.py``), and a shard
sent whole to this server, its new holder (``copies.py``). One thread does everything,
so each key changes atomically; the van receives the next messages meanwhile.
More: docs/design/kv.md.
"""
from collections import deque

from .. import config, lines
from ..runtime import protocol, replicas, spans
from . import messages as M
from .copies import Copies
from .links import Links
from .membership import Members
from .replication import COPY, Chain
from .server import KVServer


class ServerLoop:
    """The shards one server process holds, and the loop that serves them."""

    def __init__(self, node):
        self.node, self.links, self.copies = node, Links(node), Copies(node)
        self.own = int(node.id.split(':')[1])
        r = config.get().server_replicas             # each shard's chain of holders
        chains = replicas.chains(node.num_servers, r) if r else None
        held = {self.own: [node.id] if chains is None else chains[self.own]}
        held.update({s: holders for s, holders in enumerate(chains or ())
                     if node.id in holders[1:]})     # the replicas it holds
        self.shards, self.deferred = {}, {}           # deferred: shard -> worker -> its
        for s, holders in held.items():              # requests waiting
            self.hold(s, holders, Members(node.peers('worker')))

    def serve(self):
        """Answer requests until the scheduler says the job is over."""
        while self.dispatch(self.node.recv()):         # raises PeerFailed if a node died
            pass

    def dispatch(self, msg):
        """Hand a request to the shard it names (this server's own, or a replica it
        holds); anything else goes to ``other``. False once the job is over."""
        if msg.kind == protocol.SHUTDOWN:
            return False
        shard = msg.get('shard', self.own)
        if msg.kind not in M.REQUESTS:
            self.other(msg)
        elif isinstance(shard, int) and shard in self.shards:
            self.receive(self.shards[shard], msg)
        return True

    def receive(self, shard, msg):
        """A request for one shard: handled now, or kept waiting, behind this worker's
        earlier requests, until a round it waits for closes (``retry``)."""
        queue = self.deferred[shard.shard].setdefault(msg.sender, deque())
        with spans.span(msg.kind[3:], 'server', worker=msg.sender,
                        bytes=sum(memoryview(f).nbytes for f in msg.frames)):
            if queue or not shard.handle(msg):         # keep each worker's order
                queue.append(msg)
            self.retry(shard)
        spans.tick()

    def other(self, msg):
        """What is not a request: the scheduler's news, a stream offered, a worker that
        joins (for all shards); a question or a change of its chain (for one shard)."""
        if msg.sender == 'scheduler' and msg.kind in (protocol.WORKERS, protocol.SERVERS):
            for shard in self.shards.values():         # the workers left; the chains now
                self.news(shard, msg)
        elif msg.kind == M.LINK:                       # a worker offers a stream
            self.links.offer(msg)
        elif msg.kind == M.HELLO:                      # a worker joins the running job
            self.hello(msg)
        elif msg.kind == COPY:                         # a shard whole: hold it from now
            self.copied(msg)
        else:
            question = msg.get('question') if msg.kind == protocol.WHO else None
            shard = (question if isinstance(question, dict) else msg.header).get(
                'shard', self.own)
            if isinstance(shard, int) and shard in self.shards:
                self.chain_or_question(self.shards[shard], msg)

    def chain_or_question(self, shard, msg):
        """A message for one shard that is not a request: a question, or a change of its chain."""
        if msg.kind == protocol.WHO:                   # a worker has waited long (hang.py)
            self.who(shard, msg)
        elif msg.kind == M.REPLICATE:                  # a change from the holder before
            try:
                shard.chain.received(msg, shard.apply)
            except (M.KVError, KeyError, TypeError, ValueError, StopIteration) as e:
                lines.say(lines.clip(f'{lines.shown(self.node.id)}: a change of shard '
                                     f'{shard.shard} could not be applied ({e!r}); it no '
                                     'longer follows its head', 291))   # (300 with 'd2ldist: ')
        elif msg.kind == M.REPLICATED:                 # the holders after have changes
            shard.chain.acknowledged(msg)
            shard.answer_ready()

    def retry(self, shard):
        """Handle the requests waiting whose turn has come (a round they waited for closed)."""
        progress = True
        while progress:
            progress = False
            for queue in self.deferred[shard.shard].values():
                while queue and shard.handle(queue[0]):
                    queue.popleft()
                    progress = True

    def news(self, shard, msg):
        """The workers left (elastic), or the chains of holders after a server's loss."""
        deferred = self.deferred[shard.shard]
        if msg.kind == protocol.WORKERS:
            if shard.workers_changed(msg.get('workers'), msg.get('round')):
                for gone in set(deferred) - shard.members.workers:
                    deferred.pop(gone)
        elif self.node.chains is not None and shard.chain.changed(
                self.node.chains[shard.shard], _copying(msg.get('copying'), shard.shard)):
            lines.say(f'{lines.shown(self.node.id)} answers for shard {shard.shard} now: its '
                      f'replica has every change up to {shard.chain.number}')
        if shard.chain.owed:                           # a new holder after it: first the
            self.copies.send(shard)                    # shard whole, then what follows
        self.retry(shard)
        shard.answer_ready()

    def hello(self, msg):
        """A worker joins the running job (a lost one started again, say): answer it at
        its new address, on a new stream if it offers one; every shard forgets it."""
        worker, address, host = msg.sender, msg.get('address'), msg.get('host_id')
        if not isinstance(address, str) or not worker.startswith('worker:'):
            return
        try:
            self.node.meet([worker, address, host if isinstance(host, str) else None])
        except ValueError as e:                       # refuse it, go on serving
            self.node.send(worker, M.ERROR, {'id': msg.get('id'), 'error': str(e)})
            return
        self.links.forget(worker)
        for shard in self.shards.values():
            self.deferred[shard.shard].pop(worker, None)
            shard.forget(worker)
        self.node.send(worker, M.ACK, {'id': msg.get('id')})

    def who(self, shard, msg):
        """Answer a worker that has waited long: who has not pushed into the rounds
        its request ``id`` waits for (hang.py)."""
        question = msg.get('question')
        rid = question.get('request') if isinstance(question, dict) else None
        keys = set()
        for w in shard.waiting:
            if w.worker == msg.sender and w.rid == rid:
                keys |= w.keys
        for m in self.deferred[shard.shard].get(msg.sender, ()):
            if m.get('id') == rid and isinstance(m.get('parts'), list):
                keys |= {k for k in M.keys_of(m['parts']) if msg.sender in shard.pushed_into(k)}
        missing = {}
        for key in sorted(keys, key=str):
            r = shard.rounds.get(key)
            for w in sorted(shard.members.waits_for(key, r) - r.pushed if r else (),
                            key=lambda w: int(w.split(':')[1])):
                missing.setdefault(w, []).append(key)
        self.node.send(msg.sender, protocol.WHO_ANSWER, {'id': msg.get('id'), 'missing': [
            [w, {'note': f'has not pushed {", ".join(map(repr, ks[:3]))} to '
                         f'{lines.shown(self.node.id)}'}] for w, ks in missing.items()]})

    def copied(self, msg):
        """A shard whole, from the holder before this server in its chain, that the
        scheduler made it a new holder of after a loss (``copies.py``)."""
        s, holders, chains = msg.get('shard'), msg.get('holders'), self.node.chains
        if not (isinstance(s, int) and 0 <= s < self.node.num_servers and
                isinstance(holders, list) and self.node.id in holders
                and all(isinstance(h, str) for h in holders)):
            return
        if s not in self.shards:                       # (its chain, if the news came first)
            self.hold(s, chains[s] if chains and self.node.id in chains[s] else holders,
                      self.shards[self.own].members.follower())
        try:
            self.copies.take(self.shards[s], msg)
        except (M.KVError, KeyError, TypeError, ValueError) as e:
            lines.say(lines.clip(f'{lines.shown(self.node.id)}: the copy of shard {s} '
                                 f'could not be taken ({e!r})', 291))

    def hold(self, s, holders, members):
        """Hold shard ``s`` (its own, a replica, or a new copy): a ``KVServer`` of its own."""
        self.shards[s] = KVServer(self.node, s, members, Chain(self.node, s, holders),
                                  self.links)
        self.deferred[s] = {}

def _copying(pairs, shard):
    """The new holders of ``shard`` still copying it, from the scheduler's [[shard, server]]."""
    return {p[1] for p in pairs if isinstance(p, list) and len(p) == 2 and p[0] == shard} \
        if isinstance(pairs, list) else set()
