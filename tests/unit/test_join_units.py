"""hvd.join()'s pieces in one process: what a joined worker gives, its stand-in calls,
the ring's empty chunks and the scheduler's bookkeeping (tests/jobs/test_join.py runs jobs)."""
from types import SimpleNamespace

import pytest
import torch

from d2ldist.collectives import ops
from d2ldist.collectives.ring_backend import RingBackend, _call, _describe, _stand_in
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
    method, t, args = _stand_in(_describe('allreduce_', X, op='Min'), 2)
    assert (method, args) == ('allreduce_', (ops.Min,)) and (t == float('inf')).all()
    assert _call('allreduce', t, 'Min') == _call('allreduce', X, 'Min')
    method, t, args = _stand_in(_describe('broadcast_', X.int(), root=1), 2)
    assert args == (1,) and t.dtype == torch.int32 and not t.any() and t.shape == X.shape
    method, t, args = _stand_in(_describe('allgather', X.view(2, 3, 1)), 2)
    assert t.shape == (0, 3, 1) and args == ()
    method, t, args = _stand_in(_describe('reducescatter', X, op='Average'), 2)
    assert args == (ops.Average,) and not t.any()


@pytest.mark.parametrize('bad', [
    None, [], {'method': 'barrier', 'dtype': 'float32', 'shape': []},
    {'method': 'allreduce_', 'dtype': 'complex64', 'shape': [2]},
    {'method': 'allreduce_', 'dtype': 'float32', 'shape': [-1]},
    {'method': 'allreduce_', 'dtype': 'float32', 'shape': [2]},            # no op
    {'method': 'broadcast_', 'dtype': 'float32', 'shape': [2], 'root': 2}])
def test_a_stand_in_refuses_what_describes_no_collective(bad):
    with pytest.raises(ValueError) as e:
        _stand_in(bad, 2)
    assert '\n' not in str(e.value)


def test_an_empty_segment_still_sends_one_empty_chunk():
    ring = Ring(SimpleNamespace(rank=0, num_workers=2), chunk_bytes=8)
    ring._itemsize = 4
    assert ring.chunks((3, 3)) == [(3, 3)]
    assert ring.chunks((0, 5)) == [(0, 2), (2, 4), (4, 5)]


def test_alone_join_returns_0_and_torch_says_what_to_use():
    assert RingBackend(None).join() == 0
    from d2ldist.collectives.torch_backend import TorchBackend
    with pytest.raises(NotImplementedError, match='torch.distributed.algorithms.Join'):
        TorchBackend.__new__(TorchBackend).join()


def test_the_scheduler_counts_joined_workers_at_barriers_and_names_the_last():
    s = scheduler()
    s.handle(message(protocol.BARRIER, 'worker:2', group='worker', n=4, what='barrier()'))
    s.handle(message(protocol.JOIN, 'worker:1'))
    s.handle(message(protocol.BARRIER, 'worker:0', group='worker', n=4, what='barrier()'))
    assert [p for p, kind, _ in s.van.sent if kind == protocol.BARRIER_DONE] == \
        ['worker:0', 'worker:1', 'worker:2']
    s.van.sent.clear()
    s.handle(message(protocol.JOIN, 'worker:0'))
    s.handle(message(protocol.BARRIER, 'worker:2', group='worker', n=5, what='barrier()'))
    assert [h['n'] for _, kind, h in s.van.sent if kind == protocol.BARRIER_DONE] == [5] * 3
    s.handle(message(protocol.JOIN, 'worker:2'))
    done = [(p, h) for p, kind, h in s.van.sent if kind == protocol.JOIN_DONE]
    assert done == [(f'worker:{r}', {'last': 2}) for r in range(3)] and s.joined == []


def test_the_scheduler_tells_joined_workers_when_one_ends_without_join():
    s = scheduler(2)
    s.handle(message(protocol.GOODBYE, 'worker:1'))
    s.handle(message(protocol.JOIN, 'worker:0'))
    (peer, kind, header), = [m for m in s.van.sent if m[1] == protocol.JOIN_DONE]
    assert peer == 'worker:0' and 'worker 1 ended without calling join()' in header['error']
