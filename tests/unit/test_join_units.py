"""hvd.join()'s pieces in one process: what a joined worker gives, its stand-in calls,
the ring's empty chunks and the scheduler's bookkeeping (tests/jobs/test_join.py runs jobs)."""
from types import SimpleNamespace

import pytest
import torch

from d2ldist.collectives import ops
from d2ldist.collectives.ring_backend import RingBackend, _call, _describe, stand_in
from d2ldist.collectives.join import Join
from d2ldist.collectives.link import STALE, Link, classify
from d2ldist.collectives.ring import Ring
from d2ldist.runtime import protocol
from d2ldist.runtime.wire import DTYPES
from fakes import message, scheduler


@pytest.mark.parametrize('dtype', list(DTYPES.values()))
@pytest.mark.parametrize('op', list(ops.OPS.values()))
def test_a_joined_worker_leaves_every_reduction_as_it_is(op, dtype):
    x = torch.tensor([0, 1, 5, 100], dtype=torch.float64).to(dtype)
    neutral = torch.full_like(x, ops.identity(op, dtype))
    assert torch.equal(op.reduce_(x.clone(), neutral), x)
    if op in (ops.Sum, ops.Average):
        assert not neutral.any(), 'zeros, as Horovod'


def test_a_stand_in_makes_the_same_call_with_nothing_of_its_own():
    X = torch.arange(6.).view(2, 3)
    method, t, args = stand_in(_describe('allreduce_', X, op='Min'), 2)
    assert (method, args) == ('allreduce_', (ops.Min,)) and (t == float('inf')).all()
    assert _call('allreduce', t, 'Min') == _call('allreduce', X, 'Min')
    method, t, args = stand_in(_describe('broadcast_', X.int(), root=1), 2)
    assert args == (1,) and t.dtype == torch.int32 and not t.any() and t.shape == X.shape
    method, t, args = stand_in(_describe('allgather', X.view(2, 3, 1)), 2)
    assert t.shape == (0, 3, 1) and args == ()
    method, t, args = stand_in(_describe('reducescatter', X, op='Average'), 2)
    assert args == (ops.Average,) and not t.any()


@pytest.mark.parametrize('bad', [
    None, [], {'method': 'barrier', 'dtype': 'float32', 'shape': []},
    {'method': 'allreduce_', 'dtype': 'complex64', 'shape': [2]},
    {'method': 'allreduce_', 'dtype': 'float32', 'shape': [-1]},
    {'method': 'allreduce_', 'dtype': 'float32', 'shape': [2]},            # no op
    {'method': 'broadcast_', 'dtype': 'float32', 'shape': [2], 'root': 2}])
def test_a_stand_in_refuses_what_describes_no_collective(bad):
    with pytest.raises(ValueError) as e:
        stand_in(bad, 2)
    assert '\n' not in str(e.value)


def fake_node(rank, size):
    """What a Ring reads of its node: its id, the workers, the membership's number."""
    workers = [f'worker:{r}' for r in range(size)]
    return SimpleNamespace(id=workers[rank], workers=lambda: workers, round=0, counters={})


def test_an_empty_segment_still_sends_one_empty_chunk():
    ring = Ring(Link(fake_node(0, 2)), chunk_bytes=8)
    ring._itemsize = 4
    assert ring.chunks((3, 3)) == [(3, 3)]
    assert ring.chunks((0, 5)) == [(0, 2), (2, 4), (4, 5)]


def test_alone_join_returns_0_and_a_trainers_torch_store_has_none():
    assert RingBackend(None).join() == 0
    from d2ldist.collectives.torch_backend import TorchBackend
    alone = TorchBackend.__new__(TorchBackend)
    alone.joinable, alone.size = True, 1
    assert alone.join() == 0
    alone.joinable = False                        # (the Trainer's store makes it so)
    with pytest.raises(RuntimeError, match=r'join\(\) needs the Horovod API'):
        alone.join()


def test_on_torch_a_joined_worker_learns_each_call_from_the_max_of_what_all_say():
    """Backend torch: before each collective the workers all-reduce (max) what it is;
    a worker in join() says zeros (and that it has joined), so the max is the call of
    the workers still training, and it takes part with the ring's stand-in."""
    from d2ldist.collectives.torch_backend import ACTIVE, DTYPE, JOINED, UNSUPPORTED, _heard, _said
    X = torch.arange(24.).view(4, 3, 2)
    joined = [0] * (JOINED + 3)
    joined[JOINED + 2] = 1                                       # worker 2 is in join()
    for call, args, want in [
            ('allreduce_', dict(op=ops.Min), (X.shape, (ops.Min,))),
            ('reducescatter', dict(op=ops.Average), (X.shape, (ops.Average,))),
            ('broadcast_', dict(root=1), (X.shape, (1,))),
            ('allgather', {}, ((0, 6), ()))]:
        said = _said(call, 3, X, **args)
        heard = [max(a, b) for a, b in zip(said, joined)]
        method, (t, *rest) = _heard(heard, 3)
        assert (method, tuple(rest), t.dtype) == (call, want[1], X.dtype)
        assert t.numel() == (0 if call == 'allgather' else X.numel())   # its size: what counts
        assert heard[ACTIVE] == 1 and heard[JOINED:] == [0, 0, 1]
    assert _heard([max(a, b) for a, b in zip(_said('barrier', 3), joined)], 3) == \
        ('barrier', ())
    assert _said('allreduce_', 3, torch.tensor(5), op=ops.Sum)[5:7] == [1, 1]   # 0-d: 1 row
    # a dtype no worker can send is said too (then refused on every worker, not only here)
    assert _said('allreduce_', 2, torch.ones(2, dtype=torch.complex64), op=ops.Sum)[DTYPE] \
        == UNSUPPORTED


def test_the_scheduler_counts_joined_workers_at_barriers_and_names_the_last():
    s = scheduler()
    s.handle(message(protocol.BARRIER, 'worker:2', group='worker', n=4, what='barrier()'))
    s.handle(message(protocol.JOIN, 'worker:1', calls=3))
    s.handle(message(protocol.BARRIER, 'worker:0', group='worker', n=4, what='barrier()'))
    assert [p for p, kind, _ in s.van.sent if kind == protocol.BARRIER_DONE] == \
        ['worker:0', 'worker:1', 'worker:2']
    s.van.sent.clear()
    s.handle(message(protocol.JOIN, 'worker:0', calls='9'))        # (not a count: ignored)
    s.handle(message(protocol.BARRIER, 'worker:2', group='worker', n=5, what='barrier()'))
    assert [h['n'] for _, kind, h in s.van.sent if kind == protocol.BARRIER_DONE] == [5] * 3
    s.handle(message(protocol.JOIN, 'worker:2', calls=7))
    # each is told its join is counted (before it tells the others), before all are done
    assert [(p, kind) for p, kind, _ in s.van.sent if kind.startswith('join')][:3] == [
        ('worker:0', protocol.JOIN_NOTED), ('worker:2', protocol.JOIN_NOTED),
        ('worker:0', protocol.JOIN_DONE)]
    done = [(p, h) for p, kind, h in s.van.sent if kind == protocol.JOIN_DONE]
    assert done == [(f'worker:{r}', {'last': 2, 'calls': 7}) for r in range(3)]
    assert s.joined == []


def test_after_join_calls_a_worker_never_saw_count_as_failed():
    """Refused while it was in join(): their notices may come after the scheduler's word
    (another path); the next call has the same number everywhere, the notices are dropped."""
    link = Link(fake_node(1, 3))
    link.calls, link.failed = 5, {2}
    assert Join(link).all_joined(message(protocol.JOIN_DONE, 'scheduler', last=0, calls=8)) == 0
    assert (link.calls, link.failed, link.joins) == (8, {2, 6, 7, 8}, 1)

    def what(msg):
        return classify(msg, link.round, link.calls, link.failed, link.left)
    assert what(message('ring_disagree', 'worker:0', n=7, error='refused')) == STALE
    assert what(message('ring_disagree', 'worker:0', n=9, error='refused')) != STALE


def test_the_scheduler_tells_joined_workers_when_one_ends_without_join():
    s = scheduler(2)
    s.handle(message(protocol.GOODBYE, 'worker:1'))
    s.handle(message(protocol.JOIN, 'worker:0'))
    (peer, kind, header), = [m for m in s.van.sent if m[1] == protocol.JOIN_DONE]
    assert peer == 'worker:0' and 'worker 1 ended without calling join()' in header['error']


def test_on_torch_only_the_horovod_apis_backend_says_each_call_first(monkeypatch):
    """The price of join() on torch.distributed: one all-reduce of size + 9 integers and
    their negation (the min: calls that disagree are refused) before each collective of
    the Horovod API's backend; the Trainer's 'torch' store (not joinable) sends only its own."""
    from types import SimpleNamespace
    import torch.distributed as dist
    from d2ldist.collectives import torch_backend
    from d2ldist.collectives.torch_backend import TorchBackend
    sent = []
    monkeypatch.setattr(torch_backend, 'dist', SimpleNamespace(
        ReduceOp=dist.ReduceOp, get_backend=lambda: 'gloo',
        all_reduce=lambda X, op: sent.append((X.numel(), op))))
    for joinable in (True, False):
        b = TorchBackend.__new__(TorchBackend)
        b.joinable, b.rank, b.size, b.device = joinable, 0, 3, torch.device('cpu')
        sent.clear()
        b.allreduce_(torch.ones(5), ops.Sum)
        assert sent == [(24, dist.ReduceOp.MAX)] * joinable + [(5, dist.ReduceOp.SUM)]


def test_on_torch_the_same_number_of_values_in_another_shape_is_refused():
    """Horovod refuses an allreduce of [17, 1311] against [17, 23, 57]: same rows and
    row size, so the integers the workers say include a code of the rows' shape."""
    from d2ldist.collectives.torch_backend import _disagreement, _said
    a = _said('allreduce_', 2, torch.ones(17, 23 * 57), op=ops.Sum)
    b = _said('allreduce_', 2, torch.ones(17, 23, 57), op=ops.Sum)
    heard, low = [max(x, y) for x, y in zip(a, b)], [min(x, y) for x, y in zip(a, b)]
    assert _disagreement('allreduce_', heard, low).startswith('shape')
    assert _disagreement('allreduce_', a, a) is None
    rows = _said('allgather', 2, torch.ones(3, 2, 2)), _said('allgather', 2, torch.ones(5, 2, 2))
    assert _disagreement('allgather', *[[f(x, y) for x, y in zip(*rows)] for f in (max, min)]) \
        is None                                 # an allgather's rows may differ in number
