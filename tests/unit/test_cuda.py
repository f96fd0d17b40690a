"""The CUDA paths: the seven steps, staging and the store's copies on a GPU, against the CPU.

They run only where CUDA is (a user's GPU, or a GPU machine lent to a developer); on
a machine without one they are skipped, also in CI, whose machines have no GPU. On one
GPU, 'several devices' are two replicas on the same GPU (``cuda:0,cuda:0``): every
copy, pinned buffer and synchronization of several GPUs runs, only not in parallel.

Tolerance against the CPU: the GPU's kernels add in other orders, and cuDNN's
convolutions would use TF32 (10-bit mantissas) unless told not to; with TF32 off the
weights after three steps agree to about 1e-6. A real mistake (a stale weight, a copy
that had not landed, a missed replica) shows at the order of lr * gradient, 1e-3.
"""
import pytest
import torch

from d2ldist.runtime.staging import staged
from d2ldist.kv import LocalKVStore
from d2ldist.training.devices import cpu, parse_devices, split_and_load
from d2ldist.training.stores import AllreduceStore
from d2ldist.training.trainer import Trainer, train_batch
from test_trainer import HYPER, LOSS, assert_replicas_identical, batches, small_cnn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason='no GPU here')


@pytest.fixture(autouse=True)
def no_tf32():
    """Full float32 in cuDNN's convolutions while a test runs (TF32 is its default)."""
    if not torch.cuda.is_available():
        yield
        return
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


def train(devices, kvstore, steps=3, **kwargs):
    """A small CNN with BatchNorm trained on `devices`; returns the trainer."""
    net = small_cnn(batch_norm=True)
    trainer = Trainer(net, 'sgd', HYPER, kvstore=kvstore, devices=devices, **kwargs)
    for X, y in batches(steps, 8):
        l, correct = train_batch(X, y, net, LOSS, trainer, devices)
        assert l > 0 and 0 <= correct <= 8
    return trainer


def assert_same_weights(gpu_trainer, cpu_trainer):
    for a, b in zip(gpu_trainer.replicas[0].state_dict().values(),
                    cpu_trainer.replicas[0].state_dict().values()):
        assert a.device.type == 'cuda'
        assert torch.allclose(a.cpu().float(), b.float(), rtol=1e-4, atol=1e-5), \
            (a.cpu().float() - b.float()).abs().max()


@pytest.mark.parametrize('replicas', [1, 2])
@pytest.mark.parametrize('update_on_kvstore', [True, False])
def test_seven_steps_on_cuda_equal_the_cpu(replicas, update_on_kvstore):
    """Steps 1 to 7 on one or two replicas of one GPU take the CPU's steps."""
    gpus = parse_devices(','.join(['cuda:0'] * replicas))
    on_gpu = train(gpus, LocalKVStore(), update_on_kvstore=update_on_kvstore)
    on_cpu = train([cpu()] * replicas, LocalKVStore(), update_on_kvstore=update_on_kvstore)
    assert on_gpu.flat_grads.is_pinned()                      # step 3 lands on the host
    if update_on_kvstore:                                     # step 5 pulls to the host
        assert on_gpu.flat_weights.is_pinned()
    else:          # the Trainer updates on the GPU, in the network's own weights
        assert on_gpu.flat_weights.device.type == 'cuda'
        assert all(p.data_ptr() == w.data_ptr()
                   for p, w in zip(on_gpu.params[0], on_gpu._weights))
    assert all(t > 0 for t in on_gpu.step_times.values())
    assert_same_weights(on_gpu, on_cpu)
    assert_replicas_identical(on_gpu)


def test_buckets_overlapping_backward_on_cuda_equal_the_cpu():
    """The ring's path with two workers or more (a ring of one worker told to sum on the
    host): buckets start in backward's hooks, summed once their non-blocking copies to
    pinned memory have landed (a CUDA event the summing thread waits for), and each sum
    goes back up to the GPU as soon as it is in."""
    gpus = parse_devices('cuda:0,cuda:0')
    on_host = AllreduceStore('ring')
    on_host.device = cpu()                  # as with two workers: the ring sums on the host
    on_gpu = train(gpus, on_host, bucket_cap_mb=0.001)
    on_cpu = train([cpu(), cpu()], AllreduceStore('ring'), bucket_cap_mb=0.001)
    assert len(on_gpu._buckets) > 1
    assert on_gpu.flat_grads.is_pinned() and on_gpu._grads_up.device.type == 'cuda'
    assert_same_weights(on_gpu, on_cpu)
    assert_replicas_identical(on_gpu)


def test_a_ring_of_one_worker_keeps_the_gradients_on_the_gpu():
    """Alone the ring sums nothing: no staging, flat_grads on the GPU, the same steps."""
    gpus = parse_devices('cuda:0,cuda:0')
    on_gpu = train(gpus, AllreduceStore('ring'), bucket_cap_mb=0.001)
    on_cpu = train([cpu(), cpu()], AllreduceStore('ring'), bucket_cap_mb=0.001)
    assert on_gpu.flat_grads.device.type == 'cuda' and on_gpu._grads_up is None
    assert_same_weights(on_gpu, on_cpu)
    assert_replicas_identical(on_gpu)


def test_torch_store_on_nccl_keeps_the_gradients_on_the_gpu(monkeypatch):
    """kvstore 'torch' on NCCL (a job of one worker): flat_grads on the GPU, summed there."""
    import socket
    import torch.distributed as dist
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    for name, value in dict(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), RANK='0',
                            WORLD_SIZE='1', LOCAL_RANK='0', LOCAL_WORLD_SIZE='1').items():
        monkeypatch.setenv(name, value)
    try:
        store = AllreduceStore('torch')
        assert dist.get_backend() == 'nccl' and store.device.type == 'cuda'
        on_gpu = train(parse_devices('cuda:0,cuda:0'), store, bucket_cap_mb=0.001)
        assert on_gpu.flat_grads.device.type == 'cuda'
        on_cpu = train([cpu(), cpu()], AllreduceStore('ring'), bucket_cap_mb=0.001)
        assert_same_weights(on_gpu, on_cpu)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_staged_takes_gpu_tensors_through_pinned_memory_and_back():
    """A collective's flat CPU buffer made of GPU tensors, one of them not contiguous."""
    a = torch.arange(6., device='cuda').view(2, 3).t()          # not contiguous
    b = torch.arange(4., device='cuda')
    with staged([a, b], 'cpu') as flat:
        assert flat.device.type == 'cpu' and flat.is_pinned()
        assert flat.tolist() == a.cpu().flatten().tolist() + [0., 1., 2., 3.]
        flat.mul_(2)
    assert torch.equal(a.cpu(), 2 * torch.arange(6.).view(2, 3).t())
    assert torch.equal(b.cpu(), 2 * torch.arange(4.))


def test_store_pushes_and_pulls_gpu_tensors():
    """The kvstore's worker side: GPU values go out and come back through pinned buffers."""
    store = LocalKVStore()
    store.init(['w'], [torch.zeros(5)])
    store.push('w', [torch.ones(5, device='cuda'), torch.ones(5, device='cuda')])  # 2 copies
    out = torch.empty(5, device='cuda')
    store.pull('w', out=out)
    assert out.device.type == 'cuda' and torch.equal(out.cpu(), torch.full((5,), 2.))


def test_split_and_load_pins_and_copies_in_order():
    X = torch.arange(14.).view(7, 2)
    parts = split_and_load(X, parse_devices('cuda:0,cuda:0'))
    assert [p.device.type for p in parts] == ['cuda', 'cuda']
    assert [len(p) for p in parts] == [4, 3]
    assert torch.equal(torch.cat(parts).cpu(), X)
