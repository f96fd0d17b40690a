"""Replicated servers in one process: the option, the chains, the scheduler promoting a
replica, a chain sending on after a loss, two servers that lose one in the middle of a
round, a new replica made after a loss (re-replication) and three servers that lose two,
one after the other (tests/jobs/test_replicas.py runs jobs); and a worker that joins a
running ring, never taken in, fails after a bound."""
import threading
from types import SimpleNamespace

import pytest
import torch

from d2ldist.kv import messages as M
from d2ldist.kv.copies import Copies
from d2ldist.kv.membership import Members
from d2ldist.kv.optimizers import Updater
from d2ldist.kv.replication import COPY, Chain
from d2ldist.kv.server import KVServer, Slot
from d2ldist.kv.serving import ServerLoop
from d2ldist.launch import cli
from d2ldist.runtime import node as nodes
from d2ldist.runtime import protocol, replicas
from d2ldist.runtime.started import StartError
from d2ldist.runtime.van import Message, Van
from fakes import FakeVan, message, scheduler


# -- the option ---------------------------------------------------------------------------
@pytest.mark.parametrize('options,error', [
    (['-s', '2', '--server-replicas', '2'], '--server-replicas 2 needs at least 3 servers '
     '(-s 3): a replica is another server; got -s 2'),
    (['-s', '0', '--server-replicas', '1'], '--server-replicas 1 needs at least 2 servers '
     '(-s 2): a replica is another server; got -s 0'),
    (['-s', '2', '--server-replicas', '-1'], '--server-replicas must be 0 or more, got -1'),
])
def test_bad_replica_options_are_one_line_errors(options, error):
    with pytest.raises(cli.UsageError) as e:
        cli.parse(['-n', '2', *options, 'python', '-c', 'pass'])
    assert str(e.value) == error


def test_the_option_reaches_every_process():
    args = cli.parse(['-n', '2', '-s', '3', '--server-replicas', '2', 'python', '-c', 'pass'])
    assert args.env['D2L_SERVER_REPLICAS'] == '2'
    assert 'D2L_SERVER_REPLICAS' not in cli.parse(['-n', '2', 'python', '-c', 'pass']).env


# -- the chains -----------------------------------------------------------------------------
def test_each_shard_is_held_by_its_server_and_the_next_r_around_the_ring():
    assert replicas.chains(3, 1) == [['server:0', 'server:1'], ['server:1', 'server:2'],
                                     ['server:2', 'server:0']]
    assert replicas.chains(2, 0) == [['server:0'], ['server:1']]
    left = replicas.without(replicas.chains(3, 1), 'server:1')
    assert left == [['server:0'], ['server:2'], ['server:2', 'server:0']]
    assert replicas.takes_over(replicas.chains(3, 1), left, 'server:1') == \
        'server 2 answers for shard 1'
    assert replicas.without(left, 'server:2') is None           # shard 1 has nobody left


# -- the scheduler ------------------------------------------------------------------------
def replicated_scheduler(servers=2, r=1):
    s = scheduler(2)
    s.num_servers, s.chains, s.replicas = servers, replicas.chains(servers, r), r
    s.nodes.update({f'server:{i}': f'tcp://s{i}' for i in range(servers)})
    s.starts.update({f'server:{i}': 1 for i in range(servers)})
    return s


def test_the_scheduler_makes_the_replica_the_head_and_tells_everybody(capsys):
    s = replicated_scheduler()
    s.handle(message(protocol.ENDED, 'launcher', node='server:0', start=1, how='killed'))
    sent = [(peer, h['chains'], h['lost']) for peer, kind, h in s.van.sent
            if kind == protocol.SERVERS]
    chains = [['server:1'], ['server:1']]
    assert sorted(sent) == [('server:1', chains, 'server:0'), ('worker:0', chains, 'server:0'),
                            ('worker:1', chains, 'server:0')]
    assert not [k for _, k, _ in s.van.sent if k == protocol.FAILED]
    assert s.van.given_up == ['server:0'] and s.members('server') == ['server:1']
    assert capsys.readouterr().out == ('d2ldist: server 0 failed: its process ended, killed; '
                                       'server 1 answers for shard 0\n')
    s.handle(message(protocol.ENDED, 'launcher', node='server:1', start=1, how='killed'))
    assert {peer for peer, kind, _ in s.van.sent if kind == protocol.FAILED} == {
        'worker:0', 'worker:1'}                  # shard 0 and 1 have nobody left: the job fails


def test_without_replicas_a_lost_server_still_fails_the_job():
    s = replicated_scheduler()
    s.chains = None
    s.handle(message(protocol.ENDED, 'launcher', node='server:0', start=1, how='killed'))
    assert {peer for peer, kind, _ in s.van.sent if kind == protocol.FAILED} == {
        'server:1', 'worker:0', 'worker:1'}


# -- a chain of three holders ---------------------------------------------------------------
class Net:
    """Nodes that hand their messages to each other's inboxes."""

    def __init__(self):
        self.inbox = {}

    def node(self, node_id, **more):
        self.inbox[node_id] = []

        def send(peer, kind, header=None, frames=(), track=False):
            self.inbox.setdefault(peer, []).append(Message(kind, node_id, dict(header or {}),
                                                           [bytearray(f) for f in frames]))
            return []
        return SimpleNamespace(id=node_id, send=send, **more)

    def take(self, node_id):
        msgs, self.inbox[node_id] = self.inbox.get(node_id, []), []
        return msgs


def test_a_chain_sends_on_after_its_middle_holder_is_lost():
    net, holders = Net(), ['server:0', 'server:1', 'server:2']
    head, middle, tail = (Chain(net.node(h), 0, holders) for h in holders)
    applied = {1: [], 2: []}
    for n in (1, 2):
        head.change('kv_update', {'what': n}, [b'x'])
    assert (head.number, head.done, list(head.in_flight)) == (2, 0, [1, 2])
    for msg in net.take('server:1'):                   # the middle applies both, sends on
        middle.received(msg, lambda kind, m: applied[1].append(m['what']))
    tail_has = net.take('server:2')
    tail.received(tail_has[0], lambda kind, m: applied[2].append(m['what']))   # only 1
    middle.acknowledged(net.take('server:1')[0])       # the tail has 1: so does the head
    head.acknowledged(net.take('server:0')[0])
    assert (head.done, list(head.in_flight), applied) == (1, [2], {1: [1, 2], 2: [1]})
    # the middle is lost with change 2 on its way: the head sends 2 on to the tail
    for chain in (head, tail):
        assert chain.changed(['server:0', 'server:2']) is False
    again = net.take('server:2')
    assert [m['number'] for m in again] == [2]
    for msg in again:
        tail.received(msg, lambda kind, m: applied[2].append(m['what']))
    for msg in net.take('server:0'):
        head.acknowledged(msg)
    assert (head.done, list(head.in_flight), applied[2]) == (2, [], [1, 2])
    # a change sent twice (the tail had it) is applied once and said done again
    tail.received(again[0], lambda kind, m: applied[2].append(m['what']))
    assert applied[2] == [1, 2] and [m['number'] for m in net.take('server:0')] == [2]
    # the head is lost: the tail answers now, and has every change
    assert tail.changed(['server:2']) is True and (tail.is_head, tail.done) == (True, 2)


# -- two servers, a loss in the middle of a round -----------------------------------------
def two_servers(net, use_config):
    use_config({'D2L_SERVER_REPLICAS': '1'})
    servers = []
    for i in (0, 1):
        node = net.node(f'server:{i}', num_servers=2, chains=None,
                        peers=lambda role: [f'{role}:0', f'{role}:1'])
        servers.append(ServerLoop(node))
    return servers


def request(kind, worker, rid, shard=0, frames=(), **header):
    return Message(kind, worker, dict(header, id=rid, shard=shard),
                   [bytearray(f) for f in frames])


def deliver(net, servers, rounds=10):
    """Hand every server its messages until none are left (``rounds`` at most)."""
    for _ in range(rounds):
        for server in servers:
            for msg in net.take(server.node.id):
                server.dispatch(msg)


def answers(net, worker):
    out = []
    for msg in net.take(worker):
        value = torch.frombuffer(msg.frames[0], dtype=torch.float64).item() \
            if msg.kind == M.VALUES else None
        out.append((msg.kind, msg['id'], value))
    return out


X = [['x', 'float64', [1], 0, 1]]


def push(worker, n):
    """Worker r's n-th push of 1000**r to 'x', asking for the round's value."""
    value = torch.tensor([1000.0 ** int(worker[-1])], dtype=torch.float64)
    return request(M.PUSH, worker, 100 + n, frames=[value.numpy().tobytes()], parts=X,
                   sync=True, pull=True, n=n)


def started(net, servers):
    """'x' on shard 0, SGD with a learning rate of -1 (the value adds each round's sum)."""
    servers[0].dispatch(request(M.INIT, 'worker:0', 1, parts=X, frames=[bytes(8)]))
    assert answers(net, 'worker:0') == []              # not before its replica has it
    deliver(net, servers)
    servers[0].dispatch(request(M.OPTIMIZER, 'worker:0', 2, name='sgd', hyper={'lr': -1.0}))
    deliver(net, servers)
    assert answers(net, 'worker:0') == [(M.ACK, 1, None), (M.ACK, 2, None)]
    for w in ('worker:0', 'worker:1'):
        servers[0].dispatch(push(w, 1))
    assert answers(net, 'worker:1') == []              # the round closed; not replicated yet
    deliver(net, servers)
    assert answers(net, 'worker:1') == [(M.VALUES, 101, 1001.0)]
    assert answers(net, 'worker:0') == [(M.VALUES, 101, 1001.0)]


@pytest.mark.parametrize('replica_had_it', [True, False], ids=['update-applied', 'update-lost'])
def test_the_round_in_flight_at_a_loss_is_counted_once_by_the_replica(use_config,
                                                                      replica_had_it):
    net = Net()
    servers = two_servers(net, use_config)
    started(net, servers)
    for w in ('worker:0', 'worker:1'):                 # round 2 closes on server 0 ...
        servers[0].dispatch(push(w, 2))
    update = net.take('server:1')
    assert [m['change'] for m in update] == [M.UPDATE]
    if replica_had_it:                                 # ... its replica applies it, and
        servers[1].dispatch(update[0])                 # server 0 dies before the answers
    net.take('server:0')
    replica = servers[1].shards[0]
    replica.node.chains = [['server:1'], ['server:1']]
    servers[1].dispatch(message(protocol.SERVERS, 'scheduler'))
    assert replica.chain.is_head
    for w in ('worker:0', 'worker:1'):                 # the workers send round 2 again
        servers[1].dispatch(push(w, 2))
    assert answers(net, 'worker:0') == [(M.VALUES, 102, 2002.0)]   # once, not 3003
    assert answers(net, 'worker:1') == [(M.VALUES, 102, 2002.0)]
    for w in ('worker:0', 'worker:1'):
        servers[1].dispatch(push(w, 3))
    assert answers(net, 'worker:0') == [(M.VALUES, 103, 3003.0)]


def test_a_request_to_a_replica_not_yet_head_waits_until_it_is(use_config):
    net = Net()
    servers = two_servers(net, use_config)
    started(net, servers)
    servers[1].dispatch(request(M.PULL, 'worker:0', 7, parts=X))   # (the news is late)
    assert answers(net, 'worker:0') == []
    servers[1].shards[0].node.chains = [['server:1'], ['server:1']]
    servers[1].dispatch(message(protocol.SERVERS, 'scheduler'))
    assert answers(net, 'worker:0') == [(M.VALUES, 7, 1001.0)]


# -- re-replication: a new holder after a loss, so that a second loss loses nothing --------
def test_a_shard_that_lost_a_holder_gets_the_next_live_server_and_a_copying_one_is_no_holder():
    left = replicas.without(replicas.chains(3, 1), 'server:0')
    chains, new = replicas.renewed(left, {'server:1', 'server:2'}, 1)
    assert chains == [['server:1', 'server:2'], ['server:1', 'server:2'],
                      ['server:2', 'server:1']]
    assert new == [(0, 'server:2'), (2, 'server:1')]
    assert replicas.copies(new) == (', server 2 gets a copy of shard 0, server 1 gets a '
                                    'copy of shard 2')
    # server 1 lost before server 2 has its copy of shard 0: shard 0 has no holder left
    assert replicas.without(chains, 'server:1', set(new)) is None
    # ... once both copies came, the second loss leaves every shard on server 2
    assert replicas.without(chains, 'server:1', set()) == [['server:2']] * 3
    # with two servers there is nobody to copy to
    assert replicas.renewed([['server:1'], ['server:1']], {'server:1'}, 1)[1] == []


def test_the_scheduler_names_the_new_holders_and_counts_them_once_their_copy_came(capsys):
    s = replicated_scheduler(servers=3)
    s.handle(message(protocol.ENDED, 'launcher', node='server:0', start=1, how='killed'))
    news = [h for peer, kind, h in s.van.sent if kind == protocol.SERVERS]
    assert {tuple(map(tuple, h['copying'])) for h in news} == {((0, 'server:2'),
                                                               (2, 'server:1'))}
    assert capsys.readouterr().out == (
        'd2ldist: server 0 failed: its process ended, killed; server 1 answers for shard 0, '
        'server 2 gets a copy of shard 0, server 1 gets a copy of shard 2\n')
    s.handle(message(protocol.HOLDS, 'server:2', shard=0))
    s.handle(message(protocol.HOLDS, 'server:2', shard=[0]))      # (malformed: ignored)
    assert s.copying == {(2, 'server:1')}
    assert capsys.readouterr().out == 'd2ldist: server 2 holds shard 0 now: its copy has come\n'
    s.van.sent.clear()
    s.handle(message(protocol.ENDED, 'launcher', node='server:1', start=1, how='killed'))
    assert s.chains == [['server:2']] * 3 and s.copying == set()
    assert not [k for _, k, _ in s.van.sent if k == protocol.FAILED]


def test_a_second_loss_before_the_copy_came_fails_the_job_saying_why(capsys):
    s = replicated_scheduler(servers=3)
    for server in ('server:0', 'server:1'):
        s.handle(message(protocol.ENDED, 'launcher', node=server, start=1, how='killed'))
    assert {peer for peer, kind, _ in s.van.sent if kind == protocol.FAILED} == {
        'server:2', 'worker:0', 'worker:1'}
    assert capsys.readouterr().out.splitlines()[1:] == [
        'd2ldist: server 1 held the last copy of shard 0: with --server-replicas 1 a shard '
        'outlives 1 lost at once, and one more only once a new replica has its copy (a '
        'server outside its chain: -s 3 at least)',
        'd2ldist: server 1 failed: its process ended, killed; telling the others']


def test_a_chain_owes_a_new_next_holder_the_shard_whole_then_sends_it_what_follows():
    net = Net()
    head, new = Chain(net.node('server:1'), 0, ['server:0', 'server:1']), None
    head.number = 4                                    # it applied changes 1..4 as a replica
    assert head.changed(['server:1', 'server:2'], {'server:2'}) is True
    assert (head.owed, head.done) == ('server:2', 4)
    head.send_copy({'parts': []}, [b'abc'])
    assert head.owed is None and head.bytes_sent == 3
    copy, = net.take('server:2')
    assert (copy.kind, copy['number'], copy['holders']) == (COPY, 4, ['server:1', 'server:2'])
    taken = []
    new = Chain(net.node('server:2'), 0, copy['holders'])
    late = Message(COPY, 'server:0', dict(copy.header), copy.frames)
    assert new.copied(late, taken.append) is False and taken == []   # not the one before
    assert new.copied(copy, taken.append) is True and taken == [copy] and new.number == 4
    head.acknowledged(net.take('server:1')[0])          # it says it has 4
    head.change('kv_update', {}, [b'x'])                # change 5 follows as to any holder
    assert [(m.kind, m['number']) for m in net.take('server:2')] == [(M.REPLICATE, 5)]
    assert (head.done, list(head.in_flight)) == (4, [5])


def test_a_copy_carries_the_shard_whole_and_both_holders_update_to_the_same_bits():
    """Adam on half-precision weights (its float32 masters), a key without optimizer, the
    pushes counted: the new holder's next update is the old one's, bit for bit."""
    net, holders, workers = Net(), ['server:1', 'server:2'], ['worker:0', 'worker:1']
    old, new = (KVServer(net.node(h), 0, Members(workers), Chain(net.node(h), 0, holders),
                         links=None) for h in holders)
    old.updater = Updater('adam', lr=0.1, weight_decay=0.01, multi_precision=True)
    old.store.update({'w': Slot('float16', [2, 3], 0, 6, torch.zeros(6, dtype=torch.float16)),
                      'count': Slot('float64', [1], 0, 1, torch.zeros(1, dtype=torch.float64),
                                    optimizer=False)})
    grads = [torch.randn(6, generator=torch.Generator().manual_seed(n)).half()
             for n in range(3)]
    for n, grad in enumerate(grads[:2], 1):
        old.update('w', grad, numbers={'worker:0': n, 'worker:1': n})
        old.update('count', torch.full((1,), 1001.0, dtype=torch.float64))
    old.chain.owed = 'server:2'
    Copies(old.node).send(old)
    copy, = net.take('server:2')
    Copies(new.node).take(new, copy)
    assert [(m.kind, m['shard']) for m in net.take('scheduler')] == [(protocol.HOLDS, 0)]
    assert [(k, s.dtype, s.shape, s.optimizer, s.counted) for k, s in new.store.items()] == \
        [(k, s.dtype, s.shape, s.optimizer, s.counted) for k, s in old.store.items()]
    assert (new.updater.name, new.updater.opt.hyper['lr']) == ('adam', 0.1)
    assert new.updater.states['w']['step'] == old.updater.states['w']['step'] == 2
    assert new.updater.masters['w'].equal(old.updater.masters['w'])
    for server in (old, new):
        server.update('w', grads[2].clone())
    assert new.store['w'].value.equal(old.store['w'].value)
    assert new.updater.states['w']['exp_avg_sq'].equal(old.updater.states['w']['exp_avg_sq'])
    assert new.store['count'].value.item() == 1001.0


def three_servers(net, use_config):
    use_config({'D2L_SERVER_REPLICAS': '1'})
    return [ServerLoop(net.node(f'server:{i}', num_servers=3, chains=None,
                                peers=lambda role: [f'{role}:0', f'{role}:1']))
            for i in range(3)]


def lose(net, servers, lost, chains, copying=()):
    """The scheduler's news of ``lost``: the new chains, and who copies what."""
    net.take(lost)
    left = replicas.without(chains, lost, set(copying))
    live = {s.node.id for s in servers if s.node.id != lost}
    chains, new = replicas.renewed(left, live, 1)
    for server in servers:
        if server.node.id in live:
            server.node.chains = chains
            server.dispatch(message(protocol.SERVERS, 'scheduler', lost=lost,
                                    copying=[list(n) for n in new]))
    return chains, new


def test_two_losses_one_after_the_other_with_a_new_replica_between_lose_nothing(use_config):
    """Shard 0 on servers 0 and 1, SGD with momentum: server 0 lost, server 1 sends
    server 2 the shard whole, the rounds go on; server 1 lost: server 2 answers, with
    the values and the momentum a single server would have."""
    net = Net()
    servers = three_servers(net, use_config)
    servers[0].dispatch(request(M.INIT, 'worker:0', 1, parts=X, frames=[bytes(8)]))
    servers[0].dispatch(request(M.OPTIMIZER, 'worker:0', 2, name='sgd',
                                hyper={'lr': -1.0, 'momentum': 0.5}))
    deliver(net, servers)
    assert answers(net, 'worker:0') == [(M.ACK, 1, None), (M.ACK, 2, None)]
    expected, w, buf = [], 0.0, None
    for n in range(1, 7):                              # w += buf; buf = 0.5 buf + 1001
        buf = 1001.0 if buf is None else 0.5 * buf + 1001.0
        w += buf
        expected.append(w)
    got = []

    def round_on(server, n):
        for worker in ('worker:0', 'worker:1'):
            server.dispatch(push(worker, n))
        deliver(net, servers)
        values = answers(net, 'worker:0')
        assert answers(net, 'worker:1') == values
        got.extend(v for _, _, v in values)

    for n in (1, 2):
        round_on(servers[0], n)
    chains, new = lose(net, servers, 'server:0', replicas.chains(3, 1))
    deliver(net, servers)
    assert new == [(0, 'server:2'), (2, 'server:1')]
    holds = [(m.sender, m['shard']) for m in net.take('scheduler') if m.kind == protocol.HOLDS]
    assert sorted(holds) == [('server:1', 2), ('server:2', 0)]
    copy, head = servers[2].shards[0], servers[1].shards[0]
    assert not copy.chain.is_head and copy.chain.number == head.chain.number
    assert copy.store['x'].value.equal(head.store['x'].value)
    assert copy.store['x'].counted == head.store['x'].counted == {'worker:0': 2, 'worker:1': 2}
    assert copy.updater.states['x']['momentum_buffer'].equal(
        head.updater.states['x']['momentum_buffer'])
    for n in (3, 4):
        round_on(servers[1], n)                        # its new replica follows them
    lose(net, servers, 'server:1', chains)
    assert copy.chain.is_head
    for n in (5, 6):
        round_on(servers[2], n)
    assert got == expected


# -- a worker that joins a running ring waits for the others' commit, not forever -----------
def test_a_joining_worker_that_is_never_taken_in_fails_in_one_line(monkeypatch):
    monkeypatch.setattr(nodes, 'report_in_one_line', lambda: None)
    scheduler_van = Van('scheduler', 'secret')
    joiner = nodes.Node('worker', 2, 2, 0, scheduler_van.address, 'secret', host='127.0.0.1')

    def the_scheduler():               # it says the joiner waits, then never takes it in
        msg = scheduler_van.recv(timeout=10)
        scheduler_van.connect(msg.sender, msg['address'])
        scheduler_van.send(msg.sender, protocol.JOINING, {'joins': 1})
    thread = threading.Thread(target=the_scheduler)
    thread.start()
    try:
        with pytest.raises(StartError) as e:
            joiner.start(timeout=0.5)
    finally:
        thread.join()
        for van in (joiner.van, scheduler_van):
            van.close()
    assert str(e.value) == ('worker:2: waited 0.5 s to join the running job: the workers '
                            'came to no commit (state.commit()) to take it in')
