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
    [1, (2, [3, (4,)]), {'k': {'n': -7}}], (), b'', 'text', 0, -1.5, 10 ** 30, False])
def test_objects_come_back_with_their_types(obj):
    back = api.decode_object(api.encode_object(obj))
    assert back == obj and type(back) is type(obj)
    if isinstance(obj, dict):
        assert [type(k) for k in back] == [type(k) for k in obj]


def test_objects_keep_nan_and_infinity():
    back = api.decode_object(api.encode_object([math.nan, math.inf]))
    assert math.isnan(back[0]) and back[1] == math.inf


@pytest.mark.parametrize('obj', [object(), {1, 2}, torch.ones(1), [lambda: 0]])
def test_other_objects_are_refused_in_one_line(obj):
    with pytest.raises(TypeError, match='without pickle'):
        api.encode_object(obj)


@pytest.mark.parametrize('data', [b'[1, 2]', b'{"eval": "1"}', b'{"list": 1}',
                                  b'{"dict": [[{"list": [1]}, 2]]}', b'{"bytes": "!!"}',
                                  b'{"list": [], "tuple": []}', b'not json'])
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
