"""The codecs of runtime/compression.py, and where the stores and Horovod's names use them."""
import inspect

import pytest
import torch

from d2ldist import kv
from d2ldist.collectives.api import Compression, allreduce
from d2ldist.kv import messages as M
from d2ldist.runtime import compression
from d2ldist.runtime.van import Message


def test_two_bit_sends_plus_minus_threshold_or_zero_in_a_sixteenth_of_the_bytes():
    codec = compression.create({'type': '2bit', 'threshold': 0.5})
    g = torch.tensor([0.75, -0.25, 0.5, -1.0, 0.125])
    data = codec.encode('w', g)
    assert data.dtype == torch.uint8 and data.numel() == 2 == codec.nbytes(5)
    assert codec.decode(bytes(data.numpy()), 5).tolist() == [0.5, 0, 0.5, -0.5, 0]
    assert codec.residuals['w'].tolist() == [0.25, -0.25, 0, -0.5, 0.125]
    assert codec.nbytes(1_000_000) * 16 == 4 * 1_000_000


def test_error_feedback_delays_what_it_does_not_send_and_loses_nothing():
    """Sent so far + the residual = the gradients so far (exact in binary fractions)."""
    codec = compression.create({'type': '2bit', 'threshold': 0.5})
    torch.manual_seed(0)
    grads = [torch.randint(-8, 9, (100,)) / 16 for _ in range(20)]
    sent = sum(codec.decode(codec.encode('w', g), 100) for g in grads)
    assert torch.equal(sent + codec.residuals['w'], sum(grads))
    assert codec.residuals['w'].abs().max() < 0.5 + 0.5      # what is left stays bounded
    lossy = compression.create({'type': '2bit', 'threshold': 0.5, 'error_feedback': False})
    assert lossy.decode(lossy.encode('w', torch.full((4,), 0.25)), 4).tolist() == [0] * 4
    assert lossy.residuals == {}


@pytest.mark.parametrize('name,bound', [('fp16', 2 ** -11), ('bf16', 2 ** -8)])
def test_sixteen_bits_round_within_the_documented_bound(name, bound):
    codec = compression.create({'type': name})
    torch.manual_seed(0)
    x = torch.exp(torch.empty(10_000).uniform_(-9, 11)) * torch.randn(10_000).sign()
    back = codec.decode(bytes(codec.encode(0, x).numpy()), x.numel())
    assert back.dtype == torch.float32 and codec.nbytes(x.numel()) == 2 * x.numel()
    assert ((back - x).abs() <= bound * x.abs()).all()


@pytest.mark.parametrize('params,says', [
    ({'type': '3bit'}, 'unknown gradient compression'),
    ({'type': '2bit', 'threshold': 0}, 'needs a threshold > 0'),
    ({'type': '2bit', 'threshold': 'big'}, 'needs a threshold > 0'),
    ({'type': 'fp16', 'threshold': 0.5}, 'unknown gradient compression'),
    ([1, 2], 'takes a dict')])
def test_bad_compression_params_are_one_line_errors(params, says):
    with pytest.raises(ValueError, match=says) as e:
        compression.create(params)
    assert '\n' not in str(e.value)


def test_nothing_or_none_means_no_codec():
    assert all(compression.create(p) is None for p in (None, 'none', {'type': 'none'}))


@pytest.mark.parametrize('data,numel', [(b'\x00', 5), (b'\xff', 4), (b'\x00' * 3, 2)])
def test_received_bytes_that_no_encoder_makes_are_refused(data, numel):
    codec = compression.create({'type': '2bit', 'threshold': 0.5})
    with pytest.raises(ValueError):
        codec.decode(data, numel)


def test_a_server_decodes_coded_parts_and_refuses_garbage():
    codec = compression.create({'type': '2bit', 'threshold': 0.5})
    part = ['w', 'float32', [4], 0, 4]
    good = Message('kv_push', 'worker:0', {'parts': [part], 'codec': codec.params,
                                           'coded': [0]},
                   [bytes(codec.encode('w', torch.tensor([1.0, 0, -1, 0])).numpy())])
    (_, _, _, _, _, t), = M.read_parts(good, with_frames=True)
    assert t.tolist() == [0.5, 0, -0.5, 0]
    for header in ({'codec': {'type': 'zip'}, 'coded': [0]}, {'coded': [0]},
                   {'codec': codec.params, 'coded': [0], 'parts': [['w', 'float32', [9], 0, 9]]}):
        bad = Message('kv_push', 'worker:0', dict({'parts': [part]}, **header), good.frames)
        with pytest.raises(M.KVError):
            M.read_parts(bad, with_frames=True)


def test_the_local_store_applies_what_the_servers_would_get():
    store = kv.create('local')
    store.set_gradient_compression({'type': '2bit', 'threshold': 0.5})
    store.init('w', torch.zeros(3))
    store.init('stats', torch.zeros(3), optimizer=False)     # not a gradient: whole
    store.push(['w', 'stats'], [torch.tensor([0.75, 0.25, -0.6])] * 2)
    out = torch.empty(3)
    store.pull('w', out=out)
    assert out.tolist() == [0.5, 0, -0.5]
    store.pull('stats', out=out)
    assert out.tolist() == [0.75, 0.25, -0.6000000238418579]
    assert store.gradient_compression == {'type': '2bit', 'threshold': 0.5,
                                          'error_feedback': True}


def test_the_ring_refuses_two_bit_in_one_line():
    import d2ldist
    with pytest.raises(ValueError, match="2-bit compression needs a parameter server"):
        d2ldist.Trainer(torch.nn.Linear(2, 2), kvstore='ring',
                        compression_params={'type': '2bit', 'threshold': 0.5})


def test_horovod_compression_has_horovods_signatures():
    for c in (Compression.none, Compression.fp16):
        assert list(inspect.signature(c.compress).parameters) == ['tensor']
        assert list(inspect.signature(c.decompress).parameters) == ['tensor', 'ctx']
    x = torch.tensor([1 / 3, 2.0])
    half, ctx = Compression.fp16.compress(x)
    assert half.dtype == torch.float16 and ctx == torch.float32
    assert Compression.fp16.compress(torch.tensor([3]))[1] is None   # integers as they are
    y = allreduce(x, compression=Compression.fp16)                   # alone: rounded once
    assert y.dtype == torch.float32 and y.tolist() == [0.333251953125, 2.0]
