"""Elastic workers in one process: the options, the scheduler's new membership, a node
taking it, the ring keeping its own membership's messages, and TorchState with run()
(tests/jobs/test_elastic.py runs jobs)."""
import re
import sys
from types import SimpleNamespace

import pytest
import torch

from d2ldist import config
from d2ldist.collectives import elastic, world
from d2ldist.collectives.link import Link
from d2ldist.collectives.ring import Ring
from d2ldist.launch import cli
from d2ldist.runtime import protocol
from d2ldist.runtime.node import Node, PeerFailed, WorkersChanged
from fakes import message, scheduler


# -- the options ------------------------------------------------------------------------
def parse(*options, servers=0):
    return cli.parse(['-n', '3', '-s', str(servers), *map(str, options), 'python', '-c', 'pass'])


@pytest.mark.parametrize('options,servers,error', [
    (['--min-workers', 4], 0, '--min-workers must be between 1 and -n (3), got 4'),
    (['--min-workers', 0], 0, '--min-workers must be between 1 and -n (3), got 0'),
    (['--min-workers', 2, '--max-workers', 2], 0, '--max-workers must be at least -n (3), got 2'),
    (['--max-workers', 5], 0, '--max-workers needs --min-workers A'),
    (['--min-workers', 2, '--env', 'D2L_BACKEND=torch'], 0, '--min-workers needs the ring '
     'backend or servers (-s): torch.distributed cannot change its workers (use torchrun '
     '--nnodes MIN:MAX)'),
    (['--min-np', 'two'], 0, "argument --min-workers/--min-np: invalid int value: 'two'"),
])
def test_bad_elastic_options_are_one_line_errors(options, servers, error):
    with pytest.raises(cli.UsageError) as e:
        parse(*options, servers=servers)
    assert str(e.value) == error


def test_min_workers_and_its_horovod_alias_reach_every_process():
    for option in ('--min-workers', '--min-np'):
        args = parse(option, 2, '--max-np', 4, '--restart-lost')
        assert (args.min_workers, args.max_workers, args.env['D2L_MIN_WORKERS']) == (2, 4, '2')
        assert args.env['D2L_MAX_WORKERS'] == '4'      # (workers may join: commits ask)
    assert 'D2L_MIN_WORKERS' not in parse().env
    assert 'D2L_MAX_WORKERS' not in parse('--min-workers', 2).env
    assert parse('--min-workers', 2, servers=2).env['D2L_MIN_WORKERS'] == '2'   # the servers'


# -- the scheduler's new membership -------------------------------------------------------
def elastic_scheduler(workers=3, min_workers=2, order=None, max_workers=4):
    s = scheduler(workers)
    s.min_workers, s.max_workers = min_workers, max_workers
    if order:                                  # registration order is not rank order
        s.nodes = {f'worker:{r}': s.nodes[f'worker:{r}'] for r in order}
    return s


def ready(s, *workers):
    """``workers`` at their commit say READY (the ring takes in who waits to join)."""
    for w in workers:
        s.handle(message(protocol.READY, w, round=s.round))


def members_sent(s):
    return [(peer, h['round'], h['workers'], h['lost']) for peer, kind, h in s.van.sent
            if kind == protocol.MEMBERS]


def test_a_lost_worker_leaves_the_others_a_new_membership_in_rank_order():
    s = elastic_scheduler(order=[2, 0, 1])
    assert s.reform('worker:1', 'no heartbeat for 5 s')
    assert members_sent(s) == [('worker:0', 1, ['worker:0', 'worker:2'], 'worker:1'),
                               ('worker:2', 1, ['worker:0', 'worker:2'], 'worker:1'),
                               ('worker:1', 1, ['worker:0', 'worker:2'], 'worker:1')]
    assert s.members('worker') == ['worker:2', 'worker:0'] and s.round == 1
    assert s.van.given_up == ['worker:1']        # (its queue is not waited for at the end)
    assert not [k for _, k, _ in s.van.sent if k == protocol.FAILED]


def test_below_min_workers_or_without_it_a_loss_fails_the_job():
    s = elastic_scheduler()
    assert s.reform('worker:0', 'gone')
    assert not s.reform('worker:2', 'gone')         # 1 left < 2: the caller fails the job
    assert s.round == 1 and len(members_sent(s)) == 3     # (2 survivors, the lost one)
    assert not elastic_scheduler(min_workers=None).reform('worker:0', 'gone')
    assert not elastic_scheduler(min_workers=3).reform('worker:0', 'gone')


def test_a_failed_message_from_a_worker_re_forms_and_barriers_count_the_survivors():
    s = elastic_scheduler()
    s.handle(message(protocol.BARRIER, 'worker:0', group='worker', n=1, what='barrier()'))
    s.handle(message(protocol.FAILED, 'worker:1', reason='ValueError: bad'))
    assert members_sent(s)[0][2] == ['worker:0', 'worker:2']
    # the half-entered barrier was forgotten, one of the old round is not counted, and
    # the survivors count the new round's barriers from 1
    s.handle(message(protocol.BARRIER, 'worker:2', group='worker', n=1, what='barrier()'))
    for w in ('worker:0', 'worker:2'):
        s.handle(message(protocol.BARRIER, w, group='worker', n=1, what='b()', round=1))
    done = [(peer, h['n'], h['round']) for peer, kind, h in s.van.sent
            if kind == protocol.BARRIER_DONE]
    assert done == [('worker:0', 1, 1), ('worker:2', 1, 1)]
    for w in ('worker:0', 'worker:2'):   # the job ends when the survivors have finished
        ended = s.handle(message(protocol.GOODBYE, w))
    assert ended is True


def test_the_launcher_tells_of_an_ended_process_and_only_of_the_one_registered_now():
    s = elastic_scheduler()
    s.van.connect = lambda peer, address: None
    how = 'killed by SIGKILL (exit code 137)'
    s.handle(message(protocol.ENDED, 'worker:0', node='worker:1', start=1, how=how))
    assert s.round == 0                              # (a node's word on another: ignored)
    s.handle(message(protocol.ENDED, 'launcher', node='worker:1', start=1, how=how))
    assert members_sent(s)[0] == ('worker:0', 1, ['worker:0', 'worker:2'], 'worker:1')
    assert s.van.sent[0][2]['reason'] == f'its process ended, {how}'
    s.register(message(protocol.REGISTER, 'worker:1', role='worker', rank=1,
                       address='tcp://new:4000', host_id='h'))         # started again
    ready(s, 'worker:0', 'worker:2')                                   # (it joins)
    assert s.round == 2 and s.starts['worker:1'] == 2
    s.handle(message(protocol.ENDED, 'launcher', node='worker:1', start=1, how=how))
    assert s.round == 2                              # the first process's end, told late
    s.handle(message(protocol.ENDED, 'launcher', node='worker:1', start=2, how=how))
    assert s.round == 3 and s.members('worker') == ['worker:0', 'worker:2']


# -- a node takes the new membership --------------------------------------------------------
def bare_node(rank=2, workers=3):
    node = Node.__new__(Node)
    node.van = SimpleNamespace(node_id=f'worker:{rank}', given_up=[])
    node.van.give_up_on = node.van.given_up.append
    node.num_workers, node.members, node.round = workers, None, 0
    node.joins_heard = node.joins_taken = 0
    node._barriers = {'worker': 3, 'all': 1, 'server': 2}
    return node


def test_a_node_takes_a_new_membership_and_fails_what_waits():
    node = bare_node()
    assert node.workers() == ['worker:0', 'worker:1', 'worker:2']
    with pytest.raises(WorkersChanged) as e:
        node._new_members(message(protocol.MEMBERS, 'scheduler', round=1, lost='worker:1',
                                  workers=['worker:0', 'worker:2'], reason='no heartbeat'))
    assert (e.value.lost, e.value.round) == ('worker:1', 1)
    assert node.workers() == ['worker:0', 'worker:2']
    assert node._barriers == {'server': 2}      # the new round's barriers count from 1
    assert str(e.value) == 'worker 1 was lost (no heartbeat); 2 workers go on (round 1)'
    assert node.van.given_up == ['worker:1']    # what is queued for it is not waited for
    node._new_members(message(protocol.MEMBERS, 'scheduler', round=1, workers=['worker:2']))
    assert (node.round, node.workers()) == (1, ['worker:0', 'worker:2'])   # (an old one)
    with pytest.raises(PeerFailed, match=r'^worker 2 was left out of the workers \(no hb\)$'):
        node._new_members(message(protocol.MEMBERS, 'scheduler', round=2, reason='no hb',
                                  lost='worker:2', workers=['worker:0']))


def sent(s, kind):
    return [(peer, h) for peer, k, h in s.van.sent if k == kind]


def test_one_survivor_is_counted_in_the_singular():
    node = bare_node(rank=0, workers=2)
    with pytest.raises(WorkersChanged) as e:
        node._new_members(message(protocol.MEMBERS, 'scheduler', round=1, lost='worker:1',
                                  workers=['worker:0'], reason='no heartbeat'))
    assert str(e.value) == 'worker 1 was lost (no heartbeat); 1 worker goes on (round 1)'


def test_a_restarted_worker_waits_for_the_others_commit_then_joins_with_the_book():
    s = elastic_scheduler()
    s.van.connect = lambda peer, address: None
    assert s.reform('worker:1', 'gone')
    s.register(message(protocol.REGISTER, 'worker:1', role='worker', rank=1,
                       address='tcp://new:4000', host_id='h'))
    # the others go on with their step; they hear that it waits, it hears so too
    assert sent(s, protocol.JOINING) == [(w, {'joins': 1}) for w in
                                         ('worker:1', 'worker:0', 'worker:2')]
    assert not sent(s, protocol.ADDRESS_BOOK) and s.round == 1
    ready(s, 'worker:0')
    s.handle(message(protocol.READY, 'worker:2', round=0))       # (an older round's)
    assert not sent(s, protocol.ADDRESS_BOOK)
    ready(s, 'worker:2')                  # all at the commit: it joins, they re-form
    book = [h for _, h in sent(s, protocol.ADDRESS_BOOK)]
    assert [(b['you'], b['members'], b['round'], b['joins']) for b in book] == [
        ('worker:1', ['worker:0', 'worker:1', 'worker:2'], 2, 1)]
    joined = [(peer, h['joined'], h['reason'], h['joins']) for peer, h in
              sent(s, protocol.MEMBERS) if h['round'] == 2]
    assert joined == [(w, [['worker:1', 'tcp://new:4000', 'h']], 'worker 1 joins', 1)
                      for w in ('worker:0', 'worker:2')]
    node, connected = bare_node(0), []
    node.book, node.van.address = {}, 'tcp://w0'
    node.van.connect = lambda peer, address, same_host: connected.append((peer, address))
    news = next(h for peer, h in sent(s, protocol.MEMBERS)
                if peer == 'worker:0' and h['round'] == 2)
    with pytest.raises(WorkersChanged, match=r'^worker 1 joins; 3 workers go on \(round 2\)$'):
        node._new_members(message(protocol.MEMBERS, 'scheduler', **news))
    assert connected == [('worker:1', 'tcp://new:4000')] and node.book['worker:1'] == 'tcp://new:4000'
    assert node.joins_taken == node.joins_heard == 1


def test_a_worker_joins_only_a_job_with_max_workers_and_room_left():
    s = elastic_scheduler(max_workers=None)
    s.van.connect = lambda peer, address: None
    s.register(message(protocol.REGISTER, 'worker:3', role='worker', rank=3,
                       address='tcp://new:4000', host_id='h'))
    assert sent(s, protocol.ERROR) == [('worker:3', {
        'error': 'cannot join: the job takes no new workers (d2l-launch --max-workers B)'})]
    s.max_workers = 4
    for rank in (3, 4):
        s.register(message(protocol.REGISTER, f'worker:{rank}', role='worker', rank=rank,
                           address=f'tcp://new:400{rank}', host_id='h'))
    assert list(s.newcomers) == ['worker:3'] and sent(s, protocol.ERROR)[-1] == (
        'worker:4', {'error': 'cannot join: the job has its 4 workers (--max-workers)'})


def test_a_worker_started_again_before_its_loss_was_seen_joins_at_once():
    s = elastic_scheduler()
    s.van.connect = lambda peer, address: None
    s.register(message(protocol.REGISTER, 'worker:1', role='worker', rank=1,
                       address='tcp://new:4000', host_id='h'))   # (the others' collective
    assert s.round == 1 and not sent(s, protocol.JOINING)         # fails anyway)
    assert [(p, h['lost'], h['joined']) for p, h in sent(s, protocol.MEMBERS)] == [
        (w, 'worker:1', [['worker:1', 'tcp://new:4000', 'h']]) for w in ('worker:0', 'worker:2')]


def test_a_loss_takes_in_who_waits_and_one_that_ends_waiting_is_forgotten():
    s = elastic_scheduler(workers=4)
    s.van.connect = lambda peer, address: None
    assert s.reform('worker:3', 'gone')
    s.register(message(protocol.REGISTER, 'worker:3', role='worker', rank=3,
                       address='tcp://new:4000', host_id='h'))
    ready(s, 'worker:0')
    assert s.reform('worker:2', 'no heartbeat')   # everybody resets: it joins now
    assert s.live_workers() == ['worker:0', 'worker:1', 'worker:3'] and s.round == 2
    news = dict(sent(s, protocol.MEMBERS))['worker:1']
    assert news['lost'] == 'worker:2' and news['joined'][0][0] == 'worker:3'
    node = bare_node(1, workers=4)
    node.book, node.van.address = {}, 'tcp://w1'
    node.van.connect = lambda peer, address, same_host: None
    with pytest.raises(WorkersChanged, match=r'^worker 2 was lost \(no heartbeat\), worker 3 '
                                             r'joins; 3 workers go on \(round 2\)$'):
        node._new_members(message(protocol.MEMBERS, 'scheduler', **news))
    assert node.van.given_up == ['worker:2']
    # one that ends while it waits: nobody waits for it, the others still re-form at
    # their commit (they had heard of it)
    s.register(message(protocol.REGISTER, 'worker:2', role='worker', rank=2,
                       address='tcp://new:4001', host_id='h'))
    s.handle(message(protocol.ENDED, 'launcher', node='worker:2', start=2, how='exit code 1'))
    assert s.newcomers == {} and s.round == 2
    ready(s, 'worker:0', 'worker:1', 'worker:3')
    assert s.round == 3 and s.live_workers() == ['worker:0', 'worker:1', 'worker:3']
    assert sent(s, protocol.MEMBERS)[-1][1]['reason'] == 'nobody joins after all'


def test_with_servers_a_worker_joins_at_once_and_a_goodbye_refuses_who_waits():
    s = elastic_scheduler()
    s.num_servers, s.nodes['server:0'] = 1, 'tcp://s0'
    s.van.connect = lambda peer, address: None
    assert s.reform('worker:1', 'gone')
    s.register(message(protocol.REGISTER, 'worker:1', role='worker', rank=1,
                       address='tcp://new:4000', host_id='h'))
    assert s.round == 2 and sent(s, protocol.ADDRESS_BOOK)[0][0] == 'worker:1'
    ring = elastic_scheduler()
    ring.van.connect = lambda peer, address: None
    assert ring.reform('worker:1', 'gone')
    ring.register(message(protocol.REGISTER, 'worker:1', role='worker', rank=1,
                          address='tcp://new:4000', host_id='h'))
    ring.handle(message(protocol.GOODBYE, 'worker:0'))
    assert ('worker:1', {'error': 'cannot join: the job is ending (worker 0 has finished)'}) \
        in sent(ring, protocol.ERROR) and ring.newcomers == {}


def test_a_worker_cannot_join_once_another_has_finished():
    s = elastic_scheduler()
    s.van.connect = lambda peer, address: None
    assert s.reform('worker:1', 'gone')
    s.handle(message(protocol.GOODBYE, 'worker:0'))
    s.register(message(protocol.REGISTER, 'worker:1', role='worker', rank=1,
                       address='tcp://new:4000', host_id='h'))
    assert s.van.sent[-1] == ('worker:1', protocol.ERROR, {
        'error': 'cannot join: the job is ending (worker 0 has finished)'})
    assert s.round == 1


# -- the ring keeps to its membership ----------------------------------------------------------
class QueueNode(SimpleNamespace):
    """A node whose recv() hands out the given messages (or raises them), in order."""

    def recv(self, kinds, wait=None):
        item = self.queue.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    def put_back(self, msg):
        self.back.insert(0, msg)


def test_the_ring_drops_an_older_rounds_chunks_and_keeps_a_newer_ones_for_the_next_ring():
    workers = ['worker:0', 'worker:2']
    old = message('ring', 'worker:2', membership=0, n=7)
    ours = message('ring', 'worker:2', membership=1, n=1)
    newer = message('ring', 'worker:2', membership=2, n=1)
    node = QueueNode(id='worker:0', workers=lambda: workers, round=1, counters={}, back=[],
                     queue=[old, newer, ours, WorkersChanged('round 2', round=2)])
    link = Link(node)
    assert (link.rank, link.size, link.left, link.right) == (0, 2, 'worker:2', 'worker:2')
    assert link._next(['ring'], None) is ours
    with pytest.raises(WorkersChanged):
        link._next(['ring'], None)
    assert node.back == [newer]
    node.round, node.back = 2, []                # a collective on the old ring fails at once
    link._newer = [newer]                        # (the news came by another path)
    with pytest.raises(WorkersChanged, match='called a collective on the old ring'):
        Ring(link).allreduce_(torch.ones(2), None)
    assert link.calls == 0 and node.back == [newer]


# -- TorchState and run() ---------------------------------------------------------------------
def net_and_optimizer():
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    return net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)


def take_a_step(net, optimizer):
    optimizer.zero_grad()
    net(torch.ones(2, 3)).sum().backward()
    optimizer.step()


def test_restore_goes_back_to_the_last_commit():
    net, optimizer = net_and_optimizer()
    state = elastic.TorchState(model=net, optimizer=optimizer, epoch=0, batch=0)
    take_a_step(net, optimizer)
    state.batch = 1
    state.commit()
    weights = [p.detach().clone() for p in net.parameters()]
    momentum = [optimizer.state[p]['momentum_buffer'].clone() for p in net.parameters()]
    take_a_step(net, optimizer)
    state.batch, state.epoch = 2, 1
    state.restore()
    assert (state.epoch, state.batch) == (0, 1)
    assert all(torch.equal(p, w) for p, w in zip(net.parameters(), weights))
    assert all(torch.equal(optimizer.state[p]['momentum_buffer'], m)
               for p, m in zip(net.parameters(), momentum))
    take_a_step(net, optimizer)                  # the copy is not changed by later steps
    state.restore()
    assert all(torch.equal(p, w) for p, w in zip(net.parameters(), weights))


def test_only_numbers_are_kept_as_attributes():
    with pytest.raises(TypeError, match=r'TorchState\(names=...\): only numbers and Elastic'):
        elastic.TorchState(names=['a'])


def test_a_commit_after_the_workers_changed_interrupts(monkeypatch):
    state = elastic.TorchState(batch=0)
    monkeypatch.setattr(world, 'membership', lambda: 1)
    with pytest.raises(elastic.HostsUpdatedInterrupt):
        state.commit()


def test_a_commit_takes_in_the_workers_waiting_to_join_when_any_worker_heard_of_one(
        monkeypatch):
    """A worker that has not heard of the newcomer yet takes it in at the same commit as
    the others (the most any worker heard decides), then the reset goes on from it."""
    me = SimpleNamespace(joins_heard=0, joins_taken=0, round=1, taken=[])

    def take_newcomers():
        me.taken.append(me.round)
        me.round, me.joins_taken = 2, 1
    me.take_newcomers = take_newcomers
    monkeypatch.setattr(elastic.node, 'current', lambda: me)
    monkeypatch.setattr(world, 'membership', lambda: me.round)
    monkeypatch.setattr(world, 'size', lambda: 3)
    agreed = iter([0, 1])                       # another worker heard of one before commit 2
    monkeypatch.setattr(elastic, '_agreed_joins', lambda heard: max(heard, next(agreed)))
    state = elastic.TorchState(batch=0)
    monkeypatch.setattr(config, '_current', config.Config(min_workers=2))
    state.commit()                    # nobody may join (no --max-workers): nothing asked
    monkeypatch.setattr(config, '_current', config.Config(min_workers=2, max_workers=3))
    state.commit()                              # nobody heard: nothing happens
    state.batch = 1
    with pytest.raises(elastic.HostsUpdatedInterrupt) as e:
        state.commit()
    assert me.taken == [1] and not e.value.skip_sync and state._saved == {'batch': 1}


def test_run_restores_the_commit_resets_and_calls_again(monkeypatch):
    reforms, resets, entered = [], [], []
    monkeypatch.setattr(world, 'reform', lambda: reforms.append(1))
    state = elastic.TorchState(batch=0)
    state.register_reset_callbacks([lambda: resets.append(state.batch)])

    @elastic.run
    def train(state):
        entered.append(state.batch)
        while state.batch < 5:
            state.batch += 1
            if state.batch == 3 and len(entered) == 1:   # a collective fails, once
                raise WorkersChanged('worker 1 was lost', 'worker:1', 1)
            state.commit()
        return 'done'

    assert train(state) == 'done'
    assert entered == [0, 2] and resets == [2] and len(reforms) == 1
    assert state.batch == 5


def test_part_cuts_a_global_batch_by_the_current_rank_and_size():
    assert [elastic.part(10, r, 3) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
    assert [elastic.part(10, r, 2) for r in range(2)] == [(0, 5), (5, 10)]


def sampler_parts(sampler, size, monkeypatch):
    """Every rank's part of what is left, as the sampler cuts it for ``size`` workers."""
    parts = []
    for rank in range(size):
        monkeypatch.setattr(world, 'rank', lambda: rank)
        monkeypatch.setattr(world, 'size', lambda: size)
        sampler.reset()
        parts.append(list(sampler))
    return parts


def test_the_elastic_sampler_cuts_what_is_left_for_the_workers_left(monkeypatch):
    sampler = elastic.ElasticSampler(range(10), shuffle=False)
    assert sampler_parts(sampler, 3, monkeypatch) == [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]]
    sampler.record_batch(0, 2)                   # each of the 3 read 2: 0..5 are read
    assert sampler.state_dict() == {'epoch': 0, 'processed': 6}
    assert sampler_parts(sampler, 2, monkeypatch) == [[6, 8], [7, 9]]
    sampler.set_epoch(1)
    assert sampler_parts(sampler, 2, monkeypatch) == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]
    shuffled = elastic.ElasticSampler(range(10), seed=3)
    assert sorted(sum(sampler_parts(shuffled, 2, monkeypatch), [])) == list(range(10))


def test_a_sampler_in_the_state_goes_back_to_the_commit():
    sampler = elastic.ElasticSampler(range(8), shuffle=False)
    state = elastic.TorchState(sampler=sampler, batch=0)
    sampler.record_batch(0, 3)
    state.commit()
    sampler.record_batch(1, 3)
    state.restore()
    assert state.sampler is sampler and sampler.processed == 3 and list(sampler) == [3, 4, 5, 6, 7]
    state.sync()                                 # alone: its own position, cut for 1
    assert list(sampler) == [3, 4, 5, 6, 7]


def test_a_broken_stream_to_the_right_waits_for_the_schedulers_word(monkeypatch):
    """Elastic: the right neighbour may be lost; the scheduler says so (or fails the job)."""
    from d2ldist import config
    from d2ldist.runtime.stream import StreamBroken

    def broken():
        raise StreamBroken('the stream to worker 1 broke: [Errno 32] Broken pipe')
    news = WorkersChanged('worker 1 was lost', 'worker:1', 1)
    workers = ['worker:0', 'worker:1']
    node = QueueNode(id='worker:0', workers=lambda: workers, round=0, counters={}, back=[],
                     queue=[news])
    link = Link(node)
    link.out = SimpleNamespace(flush=broken)
    with pytest.raises(StreamBroken):             # not elastic: as before
        link.end()
    monkeypatch.setattr(config, 'get', lambda: config.Config.from_env({'D2L_MIN_WORKERS': '1'}))
    with pytest.raises(WorkersChanged) as e:
        link.end()
    assert e.value is news
    waited = []                                   # with no stream, the end waits for
    link.out, link._sent = None, [SimpleNamespace(wait=lambda: waited.append(1))]   # ZeroMQ
    link.end()
    assert waited == [1] and link._sent == []


# -- the parameter server counts the workers left (dist_sync) ---------------------------------
class ServerNode(SimpleNamespace):
    """A server's node: recv() hands out the given messages, then the end of the job."""

    def peers(self, role):
        return [f'{role}:{r}' for r in range(3)]

    def recv(self, kinds=None):
        return self.queue.pop(0) if self.queue else message(protocol.SHUTDOWN, 'scheduler')

    def send(self, peer, kind, header=None, frames=(), track=False):
        self.sent.append((peer, kind, header, [bytes(f) for f in frames]))
        return []

    def meet(self, joined):
        self.met.append(joined)


def push(worker, n, membership=0):
    """Worker r pushes 1000**r to 'x' and asks for the round's value: a value's digits
    in base 1000 say whose pushes the round counted (a 2 would be one counted twice).
    ``membership``: the scheduler's membership the worker knew as it pushed."""
    from d2ldist.runtime.van import Message
    r = int(worker.split(':')[1])
    value = torch.tensor([1000.0 ** r], dtype=torch.float64)
    return Message('kv_push', worker, {'id': n, 'n': n, 'sync': True, 'pull': True,
                                       'membership': membership,
                                       'parts': [['x', 'float64', [1], 0, 1]]},
                   [bytearray(value.numpy().tobytes())])


def left(*ranks, membership):
    """The scheduler tells a server the workers left, and the membership's number."""
    return message(protocol.WORKERS, 'scheduler', workers=[f'worker:{r}' for r in ranks],
                   round=membership)


def served(queue):
    """A server of the key 'x' that handles ``queue``: the values each worker was sent."""
    from d2ldist.kv import messages as M
    from d2ldist.kv.server import Slot
    from d2ldist.kv.serving import ServerLoop
    node = ServerNode(id='server:0', sent=[], met=[], queue=list(queue))
    loop = ServerLoop(node)
    server = loop.shards[0]
    server.store['x'] = Slot('float64', [1], 0, 1, torch.zeros(1, dtype=torch.float64))
    loop.serve()
    values = {}
    for peer, kind, header, frames in node.sent:
        if kind == M.VALUES:
            values.setdefault(peer, []).append(int(torch.frombuffer(
                bytearray(frames[0]), dtype=torch.float64).item()))
    return node, loop, values


def test_a_sync_round_counts_every_push_that_arrived_once_and_waits_for_the_workers_left():
    from d2ldist.kv import messages as M
    node, loop, values = served([
        push('worker:0', 1), push('worker:1', 1), push('worker:2', 1),     # round 1: all
        push('worker:0', 2), push('worker:1', 2),
        left(0, 2, membership=1),                  # worker 1 lost after its push 2 came
        push('worker:2', 2),                       # round 2 closes: its push counts
        push('worker:0', 3, 1), push('worker:2', 3, 1),   # round 3: the two left
        message(M.HELLO, 'worker:1', id=9, address='tcp://new:4000', host_id='h'),
        left(0, 1, 2, membership=2),               # started again, it joins ...
        push('worker:1', 1, 2),                    # ... numbering its pushes from 1
        push('worker:0', 4, 2), push('worker:2', 4, 2),   # round 4: the three
        push('worker:0', 5, 2), left(0, 2, membership=2),  # worker 1 done: round 5 closes
        push('worker:2', 5, 2)])                   # ... when worker 2 pushes
    assert [kind for _, kind, _, _ in node.sent if kind not in (M.VALUES,)] == [M.ACK]
    assert node.met == [['worker:1', 'tcp://new:4000', 'h']]
    assert values == {'worker:0': [1001001, 1001001, 1000001, 1001001, 1000001],
                      'worker:1': [1001001, 1001001],        # (its 2nd answer: round 4)
                      'worker:2': [1001001, 1001001, 1000001, 1001001, 1000001]}
    server = loop.shards[0]
    assert server.rounds == {} and server.waiting == [] and server.members.nth == {}


def test_every_server_counts_a_joiners_first_push_in_the_same_round_whatever_the_order():
    """Worker 1 was lost (membership 1) and joins (membership 2). Each server hears the
    scheduler and the three workers in its own order; every order gives the same values:
    round 1's pushes knew only membership 1, so it counts worker 0 and 2; worker 2's push
    of round 2 knew of the joiner, so from round 2 on the rounds wait for worker 1 too."""
    import random
    from d2ldist.kv import messages as M
    def streams():                   # (new messages: a round adds into the first push's)
        return [[left(0, 1, 2, membership=2)],
                [push('worker:0', n, m) for n, m in [(1, 1), (2, 1), (3, 2), (4, 2)]],
                [push('worker:2', n, m) for n, m in [(1, 1), (2, 2), (3, 2), (4, 2)]],
                [message(M.HELLO, 'worker:1', id=9, address='tcp://new:4000', host_id='h')]
                + [push('worker:1', n, 2) for n in (1, 2, 3)]]
    two, three = 1_000_001, 1_001_001         # (no optimizer: a round's sum is the value)
    want = {'worker:0': [two, three, three, three], 'worker:1': [three, three, three],
            'worker:2': [two, three, three, three]}
    orders = random.Random(0)
    for _ in range(200):             # each sender's messages in order, interleaved at random
        queue, rest = [left(0, 2, membership=1)], streams()
        while any(rest):
            queue.append(orders.choice([s for s in rest if s]).pop(0))
        node, loop, values = served(queue)
        assert values == want, [(m.sender, m.kind, m.get('membership')) for m in queue]
        server = loop.shards[0]
        assert server.rounds == {} and server.waiting == [] and not any(loop.deferred[0].values())


def test_the_servers_hear_of_every_worker_lost_or_done_and_barriers_stop_waiting_for_them():
    s = elastic_scheduler()
    s.num_servers, s.nodes['server:0'] = 1, 'tcp://s0'
    assert s.reform('worker:1', 'gone')
    s.handle(message(protocol.BARRIER, 'worker:0', group='worker', n=1, what='b()', round=1))
    s.handle(message(protocol.GOODBYE, 'worker:2'))      # done: the barrier waits no more
    told = [(peer, h['workers']) for peer, kind, h in s.van.sent if kind == protocol.WORKERS]
    assert told == [('server:0', ['worker:0', 'worker:2']), ('server:0', ['worker:0'])]
    done = [(peer, h['n']) for peer, kind, h in s.van.sent if kind == protocol.BARRIER_DONE]
    assert done == [('worker:0', 1)]
    plain = elastic_scheduler(min_workers=None)          # not elastic: the servers count N
    plain.num_servers, plain.nodes['server:0'] = 1, 'tcp://s0'
    plain.handle(message(protocol.GOODBYE, 'worker:0'))
    assert [kind for _, kind, _ in plain.van.sent] == [protocol.FAREWELL]


def test_a_worker_left_out_that_fails_as_it_ends_fails_nobody():
    """Cut off, then back: a worker left out learns so and ends with an error (FAILED);
    the others, already gone on without it, are not told to give up."""
    s = elastic_scheduler()
    assert s.reform('worker:2', 'no heartbeat for 5 s')
    s.handle(message(protocol.FAILED, 'worker:2', reason='PeerFailed: worker 2 was left out'))
    assert not [peer for peer, kind, _ in s.van.sent if kind == protocol.FAILED]
    assert s.round == 1 and s.members('worker') == ['worker:0', 'worker:1']


# -- hosts from a discovery script (horovodrun's --host-discovery-script) ----------------------
def discovery_script(tmp_path, text, code=0):
    script = tmp_path / 'discover.sh'
    script.write_text(f"#!/bin/sh\nprintf '{text}'\nexit {code}\n")
    script.chmod(0o755)
    return str(script)


def test_a_discovery_script_lists_hosts_with_slots_as_horovodrun_reads_them(tmp_path):
    from d2ldist.launch import ssh
    hosts = ssh.discover(discovery_script(tmp_path, 'hostA:2\\n# a comment\\nroot@hostB\\n'))
    assert [(h.name, h.user, h.slots) for h in hosts] == [('hostA', None, 2), ('hostB', 'root', None)]
    for text, error in [('hostA:x\\n', "line 1: expected host or host:slots, got 'hostA:x'"),
                        ('hostA:0\\n', 'line 1: slots must be at least 1'),
                        ('hostA\\nhostA:2\\n', 'line 2: hostA is listed twice (use host:slots)'),
                        ('', 'printed no hosts')]:
        with pytest.raises(ssh.HostError, match=re.escape(error)):
            ssh.discover(discovery_script(tmp_path, text))
    with pytest.raises(ssh.HostError, match=r'exited with 3$'):
        ssh.discover(discovery_script(tmp_path, 'hostA\\n', code=3))


def test_discovery_options_are_checked_in_one_line(tmp_path):
    script = discovery_script(tmp_path, 'hostA\\n')
    args = cli.parse(['--launcher', 'ssh', '--host-discovery-script', script, '--min-workers',
                      '1', '-n', '2', '-s', '0', 'python', '-c', 'pass'])
    assert args.host_discovery_script == script and args.hostfile is None
    assert args.env['D2L_MAX_WORKERS'] == '4096'     # (the hosts it lists decide)
    for options in (['--launcher', 'ssh', '--host-discovery-script', script],
                    ['--launcher', 'ssh', '--host-discovery-script', script, '-H', 'hostA',
                     '--min-workers', '1'],
                    ['--host-discovery-script', script, '--min-workers', '1']):
        with pytest.raises(cli.UsageError, match=r'^--host-discovery-script needs --launcher '
                                                  r'ssh and --min-workers A, and takes the '
                                                  r'place of -H$'):
            cli.parse([*options, '-n', '2', '-s', '0', 'python', '-c', 'pass'])
    with pytest.raises(cli.UsageError, match='not an executable file'):
        cli.parse(['--launcher', 'ssh', '--host-discovery-script', str(tmp_path / 'nope'),
                   '--min-workers', '1', '-n', '2', '-s', '0', 'python', '-c', 'pass'])


def test_a_worker_on_a_new_host_has_its_own_rank_and_host_and_no_fault():
    from d2ldist.launch.processes import ProcSpec
    from d2ldist.launch.ssh import joining_worker
    template = ProcSpec('worker', 0, 'hostA', ['python', 'train.py'], {
        'D2L_RANK': '0', 'RANK': '0', 'LOCAL_RANK': '0', 'D2L_FAIL': 'step=40',
        'D2L_SLOW': '3x', 'D2L_SCHEDULER_PORT': '5555', 'D2L_NODE_HOST': '198.18.9.2'}, True)
    spec = joining_worker(template, 2, 'hostB', 0, 1, {'D2L_NODE_HOST': '198.18.9.3'})
    assert (spec.rank, spec.host, spec.label, spec.argv) == (2, 'hostB', 'worker 2@hostB',
                                                             ['python', 'train.py'])
    assert spec.env == {'D2L_RANK': '2', 'RANK': '2', 'LOCAL_RANK': '0', 'LOCAL_WORLD_SIZE': '1',
                        'D2L_SCHEDULER_PORT': '5555', 'D2L_NODE_HOST': '198.18.9.3'}
    assert template.rank == 0 and template.env['D2L_FAIL'] == 'step=40'   # (untouched)


def test_the_scheduler_admits_a_worker_above_the_first_ranks_when_elastic():
    s = elastic_scheduler(workers=2, min_workers=1)
    s.van.connect = lambda peer, address: None
    s.register(message(protocol.REGISTER, 'worker:2', role='worker', rank=2,
                       address='tcp://hostB', host_id='b'))
    ready(s, 'worker:0', 'worker:1')
    assert s.members('worker') == ['worker:0', 'worker:1', 'worker:2'] and s.round == 1
    plain = elastic_scheduler(workers=2, min_workers=None)
    plain.van.connect = lambda peer, address: None
    plain.register(message(protocol.REGISTER, 'worker:2', role='worker', rank=2,
                           address='tcp://hostB', host_id='b'))
    assert plain.van.sent[-1][1] == protocol.ERROR and plain.members('worker') == [
        'worker:0', 'worker:1']


def test_the_ssh_launcher_follows_the_discovery_script(tmp_path):
    """A host added: a worker per slot, ranks after the last, up to --max-workers; a host
    refused by its check is said once and checked again only once listed anew; a host
    dropped: its workers stopped; a failing script: said once, the hosts stay."""
    import io
    from d2ldist.launch.processes import ProcSpec
    from d2ldist.launch.ssh import Host, HostError, SshJob
    listed = tmp_path / 'listed'
    script = tmp_path / 'discover.sh'
    script.write_text(f'#!/bin/sh\ncat {listed}\n')
    script.chmod(0o755)
    specs = [ProcSpec('scheduler', 0, 'hostA', remote=True)] + [
        ProcSpec('worker', r, 'hostA', ['python', 'train.py'], {'D2L_RANK': str(r)}, True)
        for r in (0, 1)]
    checked = []

    def check(hosts):
        checked.append(hosts[0].label)
        if hosts[0].name == 'hostC' and checked.count('hostC') == 1:
            raise HostError('preflight failed on hostC: no route')
        return SimpleNamespace(host_env={hosts[0].label: {'D2L_NODE_HOST': hosts[0].name}})
    out = io.StringIO()
    job = SshJob(specs, [Host('hostA', slots=2)], None, 'python', '.', '', 'id',
                 discovery=(str(script), check), out=out, min_workers=1, max_workers=4)
    started, stopped = [], []
    job._start = lambda p: (started.append(p.label), setattr(p, 'popen', object()))
    job.terminate = lambda p: stopped.append(p.label)
    for p in job.procs:
        p.popen = object()                          # (they run)

    def look(text):
        listed.write_text(text)
        job.next_look = 0
        job.tick()
    look('hostA:2\nhostB:3\nhostC\n')
    assert started == ['worker 2@hostB', 'worker 3@hostB']          # up to --max-workers 4
    look('hostA:2\nhostB:3\nhostC\n')                                # hostC: not again
    look('hostA:2\nhostB:3\n')
    look('hostA:2\nhostC\n')             # hostB goes; hostC, listed anew, checked again
    assert stopped == ['worker 2@hostB', 'worker 3@hostB'] and checked == ['hostB', 'hostC',
                                                                           'hostC']
    script.write_text('#!/bin/sh\nexit 3\n')
    look('')
    look('')
    said = out.getvalue().splitlines()
    assert said == [
        'd2l-launch: hostB joins (host discovery): starting worker 2@hostB',
        'd2l-launch: hostB joins (host discovery): starting worker 3@hostB',
        'd2l-launch: cannot use hostC from the host discovery script: preflight failed on '
        'hostC: no route',
        'd2l-launch: hostB left the host discovery script: stopping worker 2@hostB',
        'd2l-launch: hostB left the host discovery script: stopping worker 3@hostB',
        f'd2l-launch: --host-discovery-script {script} exited with 3; the hosts stay as they '
        'were']
    assert job.listed == {'hostA', 'hostC'}


def test_a_hello_with_a_bad_address_is_refused_and_the_server_goes_on():
    from d2ldist.kv import messages as M
    from d2ldist.kv.serving import ServerLoop
    from d2ldist.runtime.node import Node
    node = ServerNode(id='server:0', sent=[], met=[], queue=[
        message(M.HELLO, 'worker:1', id=1, address='tcp://;rm -rf:1', host_id='h'),
        message(M.HELLO, 'worker:1', id=2, address='tcp://198.18.9.3:4000', host_id='h')])
    node.meet = lambda joined: (Node.meet(SimpleNamespace(book={}, van=SimpleNamespace(
        connect=lambda *a, **k: None, address='tcp://198.18.9.2:1')), joined),
        node.met.append(joined))
    ServerLoop(node).serve()
    assert [(kind, h.get('id'), h.get('error')) for _, kind, h, _ in node.sent] == [
        (M.ERROR, 1, "worker:1 gave a bad address 'tcp://;rm -rf:1'"), (M.ACK, 2, None)]
    assert node.met == [['worker:1', 'tcp://198.18.9.3:4000', 'h']]


# -- d2ldist.train's collaborator (training/elastic.py) -----------------------------------
class OneWorkerRing:
    """A store of one worker with AllreduceStore's interface (the ring's sums of one)."""
    type, rank, num_workers = 'ring', 0, 1

    def __init__(self):
        self.values, self.reforms = {}, 0

    def init(self, keys, values, optimizer=True):
        self.values.update((k, v.clone()) for k, v in zip(keys, values))

    def pull(self, keys, out):
        for k, o in zip(keys, out):
            o.copy_(self.values[k])

    def pushpull(self, keys, values, out):
        for v, o in zip(values, out):
            o.copy_(v)

    def reform(self):
        self.reforms += 1


def local_trainer():
    """A Trainer of two CPU replicas on a ring of one worker, with momentum and weight
    decay."""
    import d2ldist
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                              torch.nn.Linear(8, 3))
    devices = [torch.device('cpu')] * 2
    trainer = d2ldist.Trainer(net, 'sgd', {'lr': 0.1, 'momentum': 0.9, 'weight_decay': 0.01},
                              kvstore=OneWorkerRing(), devices=devices)
    loss = torch.nn.CrossEntropyLoss(reduction='none')
    g = torch.Generator().manual_seed(1)

    def step():
        d2ldist.train_batch(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g),
                            net, loss, trainer, devices)
    return trainer, step


def held(trainer):
    """The first replica's weights and statistics, and the optimizer's momenta (copies)."""
    return ([t.clone() for t in trainer.replicas[0].state_dict().values()],
            [s['momentum_buffer'].clone() for s in trainer.optimizer.state.values()])


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a[0] + a[1], b[0] + b[1]))


def test_a_trainer_state_goes_back_to_its_commit_on_every_replica():
    from d2ldist.training.elastic import TrainerState
    trainer, step = local_trainer()
    step()
    state = TrainerState(trainer, {'step': 1, 'epoch': 0, 'batch': 1, 'loop': {}})
    state.place(1, 0, 1, {'loss': 3, 'acc': 2, 'n': 8, 'samples': 8})
    state.commit()
    committed = held(trainer)
    trainer.set_learning_rate(0.05)
    step()
    step()
    assert not same(held(trainer), committed)
    state.restore()
    state.sync()
    assert same(held(trainer), committed) and trainer.learning_rate == 0.1
    for replica in trainer.replicas[1:]:          # every device: the first one's
        assert all(torch.equal(a, b) for a, b in zip(replica.state_dict().values(),
                                                     trainer.replicas[0].state_dict().values()))
    at = state.at()
    assert at == {'step': 1, 'epoch': 0, 'batch': 1,
                  'loop': {'loss': 3.0, 'acc': 2, 'n': 8, 'samples': 8}}
    assert isinstance(at['loop']['loss'], float)   # (one type on every worker: a broadcast)


def test_at_the_start_a_fresh_optimizer_keeps_no_state_from_the_sync():
    """broadcast_optimizer_state makes a state by a step of zero gradients (Horovod's), in
    which weight decay leaves a trace; rank 0 had none at the start: it is dropped."""
    from d2ldist.training.elastic import TrainerState
    trainer, step = local_trainer()
    trainer.init()
    state = TrainerState(trainer, {'step': 0, 'epoch': 0, 'batch': 0, 'loop': {}})
    trainer.optimizer.state[trainer.flat_weights]['momentum_buffer'] = torch.ones(1)  # (made)
    state.sync()
    assert not trainer.optimizer.state


def test_elastic_training_comes_under_min_workers_on_the_ring_and_torch_is_refused(
        monkeypatch, capsys):
    from d2ldist.training.elastic import Elastic
    trainer = lambda kind: SimpleNamespace(store=SimpleNamespace(type=kind))  # noqa: E731
    monkeypatch.setattr(config, '_current', config.Config())
    assert Elastic.from_config(trainer('ring')) is None
    monkeypatch.setattr(config, '_current', config.Config(min_workers=2))
    assert isinstance(Elastic.from_config(trainer('ring')), Elastic)
    for kind in ('dist_sync', 'local'):     # the servers' rounds count the workers left
        assert Elastic.from_config(trainer(kind)) is None
    with pytest.raises(SystemExit) as e:
        Elastic.from_config(trainer('torch'))
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        "d2ldist: --min-workers: kvstore 'torch' cannot go on without a lost worker "
        "(torch.distributed cannot change its workers): use kvstore 'ring' or servers (-s)\n")


def test_the_loop_is_taken_up_again_from_the_last_commit(monkeypatch, capsys):
    from d2ldist.training.elastic import Elastic
    trainer, step = local_trainer()
    reforms, entered = [], []
    monkeypatch.setattr(world, 'reform', lambda: reforms.append(1))
    elastic_training = Elastic(trainer)

    def train_from(at):
        entered.append(at)
        if len(entered) == 1:
            step()
            elastic_training.step_done(1, 0, 1, {'loss': 2.5, 'acc': 3, 'n': 8, 'samples': 8})
            held_at_commit.extend(held(trainer))
            step()                                   # the next step's collective fails
            raise WorkersChanged('worker 1 was lost', 'worker:1', 1)
        assert same(held(trainer), held_at_commit)
        return 'done'

    held_at_commit = []
    start = {'step': 0, 'epoch': 0, 'batch': 0, 'loop': {}}
    assert elastic_training.run(train_from, start) == 'done'
    assert entered[1] == {'step': 1, 'epoch': 0, 'batch': 1,
                          'loop': {'loss': 2.5, 'acc': 3, 'n': 8, 'samples': 8}}
    assert entered[0]['step'] == 0 and reforms == [1] and trainer.store.reforms == 1
    assert capsys.readouterr().out.splitlines()[-2:] == [
        'd2ldist: worker: worker 1 was lost; back to the last commit',
        'd2ldist: worker: goes on from step 1 (epoch 1, batch 1) as rank 0 of 1']


def test_a_worker_that_joins_makes_its_optimizers_state_before_the_sync():
    """Its momenta must exist to be sent rank 0's (the Trainer's flat weights need no
    gradient, which broadcast_optimizer_state looks for); its weights stay."""
    from d2ldist.training.elastic import TrainerState
    trainer, step = local_trainer()
    trainer.init()
    before = trainer.flat_weights.clone()
    TrainerState(trainer, {'step': 5, 'epoch': 0, 'batch': 5, 'loop': {}}).sync()
    assert not trainer.optimizer.state     # alone, rank 0 had none at its start: dropped
    state = TrainerState(trainer, {'step': 5, 'epoch': 0, 'batch': 5, 'loop': {}})
    state.fresh = False                    # (rank 0 had one: kept, as sent)
    state.sync()
    momenta = [s['momentum_buffer'] for s in trainer.optimizer.state.values()]
    assert len(momenta) == 1 and torch.equal(momenta[0], 0.01 * before)   # (weight decay)
    assert torch.equal(trainer.flat_weights, before)


def test_zero_under_min_workers_is_refused_in_one_line_at_the_start(monkeypatch, capsys):
    """ZeRO's shards have one copy each: a TorchState of a ShardedOptimizer, or of a net
    that shard_module cut, cannot go on without a lost worker's; without --min-workers
    it is made as any other."""
    from d2ldist.collectives.sharded import ShardedOptimizer
    net = torch.nn.Linear(4, 2)
    sharded = ShardedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
    monkeypatch.setattr(config, '_current', config.Config())
    assert elastic.TorchState(model=net, optimizer=sharded).optimizer is sharded
    monkeypatch.setattr(config, '_current', config.Config(min_workers=2))
    elastic.TorchState(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    from d2ldist.collectives.sharded_module import shard_module
    stage_3 = shard_module(torch.nn.Sequential(torch.nn.Linear(4, 2)))
    for model, optimizer in ((net, sharded), (stage_3, None)):
        with pytest.raises(SystemExit) as e:
            elastic.TorchState(model=model, optimizer=optimizer)
        assert e.value.code == 2
    assert capsys.readouterr().err == 2 * (
        "d2ldist: --min-workers: ZeRO's shards (ShardedOptimizer, shard_module) have one copy "
        "each: a lost worker's is gone, and the others cannot go on without it; run without "
        "--min-workers, or with --shard-replicas 1\n")


def test_an_uncaught_workers_changed_says_why_this_worker_does_not_go_on(monkeypatch, capsys):
    """A script without hvd.elastic.run or d2ldist.train cannot go on: its one line says
    so after the scheduler's news, instead of leaving '2 workers go on' as its last word."""
    from d2ldist.runtime import node as nodes
    monkeypatch.setattr(nodes, '_one_line', False)
    monkeypatch.setattr(nodes, '_crashed', None)
    monkeypatch.setattr(sys, 'excepthook', lambda *a: pytest.fail('not one line'))
    nodes.report_in_one_line()
    news = 'worker 1 was lost (no heartbeat); 2 workers go on (round 1)'
    sys.excepthook(WorkersChanged, WorkersChanged(news, 'worker:1', 1), None)
    line = capsys.readouterr().err
    assert line.startswith(f'd2ldist: {news}; not here: ') and line.count('\n') == 1
    assert 'hvd.elastic.run' in line and 'd2ldist.train' in line
