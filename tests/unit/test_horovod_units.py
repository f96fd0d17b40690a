"""Horovod's semantics that one process can check (issue 33): objects without pickle,
what was built, names in flight, integer scaling."""
import math

import pytest
import torch

import d2ldist.horovod as hvd
from d2ldist.collectives import api


@pytest.mark.parametrize('obj', [
    {'hello': 123, 0: [1, 2]},                                    # test_broadcast_object
    {(1, 'a'): b'\x00\xff', 2.5: None, True: (1.0, 'x'), None: {}},
    [1, (2, [3, (4,)]), {'k': {'n': -7}}], (), b'', 'text', 0, -1.5, 10 ** 30, False,
    {1, 'a', (2, b'x')}, frozenset({1.5, None}), {frozenset({1}): set()}, set()])
def test_objects_come_back_with_their_types(obj):
    back = api.decode_object(api.encode_object(obj))
    assert back == obj and type(back) is type(obj)
    if isinstance(obj, dict):
        assert [type(k) for k in back] == [type(k) for k in obj]


def test_objects_keep_nan_and_infinity():
    back = api.decode_object(api.encode_object([math.nan, math.inf]))
    assert math.isnan(back[0]) and back[1] == math.inf


@pytest.mark.parametrize('obj', [object(), range(2), torch.ones(1), [lambda: 0]])
def test_other_objects_are_refused_in_one_line(obj):
    with pytest.raises(TypeError, match='without pickle'):
        api.encode_object(obj)


@pytest.mark.parametrize('data', [b'[1, 2]', b'{"eval": "1"}', b'{"list": 1}',
                                  b'{"dict": [[{"list": [1]}, 2]]}', b'{"bytes": "!!"}',
                                  b'{"list": [], "tuple": []}', b'not json',
                                  b'{"set": [{"list": [1]}]}', b'{"frozenset": 1}'])
def test_anything_else_on_the_wire_is_refused(data):
    with pytest.raises(ValueError):
        api.decode_object(data)


def test_nccl_version_code_as_horovod_encodes_it():
    assert hvd._nccl_code((2, 18, 3)) == 21803
    assert hvd._nccl_code((2, 8, 4)) == 2804
    assert hvd._nccl_code((2, 9, 6)) == 20906


def test_what_was_built():
    """Horovod's answers: an int for NCCL (0 without a usable GPU), False for oneCCL and
    DDL, cuda_built as torch's CUDA with a usable GPU; on both faces."""
    import d2ldist
    gpu = torch.cuda.is_available() and torch.version.cuda is not None
    for face in (hvd, d2ldist):
        assert type(face.nccl_built()) is int
        assert (face.nccl_built() > 0) == (gpu and torch.distributed.is_nccl_available())
        assert face.ccl_built() is False and face.ddl_built() is False
        assert face.cuda_built() == gpu
    if gpu and torch.distributed.is_nccl_available():
        assert hvd.nccl_built() == hvd._nccl_code(torch.cuda.nccl.version())


def test_a_name_is_taken_until_its_handle_is_waited_for():
    """test_horovod_allreduce_duplicate_name_error & co., alone (the job's in
    tests/jobs/horovod_semantics.py)."""
    t = torch.ones(3)
    first = hvd.allreduce_async(t, name='n')
    with pytest.raises(ValueError, match="'n' is still in flight"):
        hvd.allreduce_async(t, name='n')
    with pytest.raises(ValueError):
        hvd.broadcast_async(t, 0, name='n')
    with pytest.raises(ValueError):
        hvd.allgather(t, name='n')
    assert torch.equal(hvd.synchronize(first), t)
    assert torch.equal(hvd.allreduce(t, name='n'), t)        # free again, and after
    hvd.synchronize(hvd.allgather_async(t, name='n'))


@pytest.mark.parametrize('dtype', [torch.uint8, torch.int8, torch.int32, torch.int64,
                                   torch.float32])
def test_integers_are_scaled_in_float64_and_cast_back(dtype):
    """test_horovod_allreduce_prescale / _postscale's rule, alone."""
    t = torch.full((4,), 3, dtype=dtype)
    got = hvd.allreduce(t, op=hvd.Sum, prescale_factor=1.5, postscale_factor=0.5)
    assert got.dtype == dtype
    assert torch.equal(got, ((t.double() * 1.5).to(dtype).double() * 0.5).to(dtype))


def test_broadcast_of_no_tensor_says_so():
    with pytest.raises(TypeError, match='got NoneType'):
        hvd.broadcast(None, root_rank=0)


def test_reducescatter_alone_as_horovods():
    """reducescatter_async, grouped_reducescatter(_async), prescale_factor and
    postscale_factor (integers in float64, cast back), alone: this worker's rows are all."""
    t = torch.arange(6.0).reshape(3, 2)
    assert torch.equal(hvd.reducescatter(t, op=hvd.Sum, prescale_factor=2.0,
                                         postscale_factor=0.25), t * 0.5)
    handle = hvd.reducescatter_async(t, name='rs', op=hvd.Sum, postscale_factor=3.0)
    assert torch.equal(hvd.synchronize(handle), t * 3) and hvd.poll(handle)
    i = torch.full((4,), 3, dtype=torch.int32)
    got = hvd.reducescatter(i, op=hvd.Sum, prescale_factor=1.5, postscale_factor=0.5)
    assert got.dtype == torch.int32 and torch.equal(got, torch.full((4,), 2, dtype=torch.int32))
    pair = hvd.grouped_reducescatter([t, 2 * t], op=hvd.Average, prescale_factor=2.0)
    assert torch.equal(pair[0], 2 * t) and torch.equal(pair[1], 4 * t)
    pair = hvd.synchronize(hvd.grouped_reducescatter_async([t, i], name='g', op=hvd.Sum))
    assert torch.equal(pair[0], t) and torch.equal(pair[1], i)
    with pytest.raises(ValueError):
        hvd.reducescatter(torch.tensor(1.0))


def test_gradients_through_reducescatter_alone():
    """dL/dx: every worker's dL/dy gathered, times the scale factors (and the workers for
    Sum: one here); through grouped_reducescatter, each tensor's own."""
    x = torch.ones(4, 2, requires_grad=True)
    hvd.reducescatter(x, op=hvd.Sum, prescale_factor=3.0, postscale_factor=0.5).sum().backward()
    assert torch.equal(x.grad, torch.full((4, 2), 1.5))
    xs = [torch.ones(2, requires_grad=True), torch.ones(3, 1, requires_grad=True)]
    for y in hvd.grouped_reducescatter(xs, op=hvd.Average):
        (2 * y).sum().backward()
    assert all(torch.equal(x.grad, torch.full_like(x, 2.0)) for x in xs)
    with pytest.raises(RuntimeError, match='no gradient through Max'):
        hvd.reducescatter(torch.ones(2, requires_grad=True), op=hvd.Max)


def test_sparse_allreduce_async_returns_a_function_to_call():
    """As Horovod's: call it for the result; synchronize and poll take it too."""
    mine = torch.sparse_coo_tensor([[1]], [[1.0, 2.0]], (3, 2), check_invariants=True)
    result = hvd.sparse_allreduce_async(mine, name='sparse', op=hvd.Sum)
    assert callable(result) and hvd.poll(result)
    got = result()
    assert got.is_sparse and torch.equal(got.to_dense(), mine.to_dense())
    assert torch.equal(hvd.synchronize(result).to_dense(), mine.to_dense())


def test_horovod_internal_error_is_what_elastic_run_catches():
    """hvd.HorovodInternalError: a RuntimeError, on both faces, the very class that
    hvd.elastic.run catches to restore the last commit (a lost worker, WorkersChanged)."""
    import d2ldist
    from d2ldist.runtime.node import WorkersChanged
    assert hvd.HorovodInternalError is d2ldist.HorovodInternalError is \
        hvd.elastic.HorovodInternalError is WorkersChanged
    assert issubclass(hvd.HorovodInternalError, RuntimeError)


def test_a_named_operation_waits_for_the_next_collective_not_for_a_barrier():
    """Horovod negotiates by name: a barrier passes by a named operation that only this
    worker asked for; it starts with the next collective, or its own wait or poll."""
    t, u = torch.ones(3), torch.ones(3)
    first = hvd.allreduce_async_(t, name='only_here', prescale_factor=2.0)
    hvd.barrier()
    assert torch.equal(t, torch.ones(3))                     # not started yet
    assert hvd.poll(first) and torch.equal(t, torch.full((3,), 2.0))
    second = hvd.allreduce_async_(u, name='only_here_too', prescale_factor=2.0)
    hvd.allreduce(torch.ones(1))                             # the next collective
    assert torch.equal(u, torch.full((3,), 2.0))
    hvd.synchronize(second)
