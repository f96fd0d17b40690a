"""The seven steps with two CPU replicas, against plain one-replica PyTorch training."""
import copy

import pytest
import torch
from torch import nn

from d2ldist.training.devices import cpu
from d2ldist.training.models import resnet18
from d2ldist.kv import LocalKVStore
from d2ldist.training.stores import create_store
from d2ldist.training.trainer import Trainer, train_batch

LOSS = nn.CrossEntropyLoss(reduction='none')
HYPER = {'lr': 0.1, 'momentum': 0.9, 'weight_decay': 5e-4}


def small_cnn(batch_norm=False):
    """A small CNN (with BatchNorm, the same kind of layers as ResNet-18)."""
    torch.manual_seed(0)
    norm = [nn.BatchNorm2d(8)] if batch_norm else []
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), *norm, nn.ReLU(),
                         nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 10))


def batches(n, batch_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch_size, 3, 8, 8, generator=g),
             torch.randint(0, 10, (batch_size,), generator=g)) for _ in range(n)]


def assert_replicas_identical(trainer):
    for r in trainer.replicas[1:]:
        for a, b in zip(trainer.replicas[0].state_dict().values(), r.state_dict().values()):
            assert torch.equal(a, b)


def train_beside_torch(reference, optimizer, net, trainer, data, lr_at=None):
    """Train reference with torch.optim and net with the Trainer on the same batches
    (changing the lr to lr_at[1] before batch lr_at[0]); the weights must agree."""
    for i, (X, y) in enumerate(data):
        if lr_at is not None and i == lr_at[0]:
            trainer.set_learning_rate(lr_at[1])
            optimizer.param_groups[0]['lr'] = lr_at[1]
        optimizer.zero_grad()
        LOSS(reference(X), y).mean().backward()
        optimizer.step()
        train_batch(X, y, net, LOSS, trainer, [cpu()])
    for p, q in zip(reference.parameters(), net.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), (p - q).abs().max()


def test_seven_steps_timed_and_replicas_identical_after_every_step():
    torch.manual_seed(0)
    net = resnet18(10, width=4)
    devices = [cpu(), cpu()]
    trainer = Trainer(net, 'sgd', HYPER, kvstore='local', devices=devices)
    assert trainer.step_times == dict.fromkeys(range(1, 8))            # nothing run yet
    before = copy.deepcopy(net.state_dict())
    for X, y in batches(3, 6):
        X = X.repeat(1, 1, 4, 4)                                        # 32x32
        l, correct = train_batch(X, y, net, LOSS, trainer, devices)
        assert l > 0 and 0 <= correct <= 6
        assert_replicas_identical(trainer)
    times = trainer.step_times
    assert sorted(times) == list(range(1, 8)) and all(t > 0 for t in times.values())
    assert trainer._times.counts == dict.fromkeys(range(1, 8), 3)        # once per batch
    assert not torch.equal(before['0.weight'], net.state_dict()['0.weight'])   # it trained


@pytest.mark.parametrize('update_on_kvstore', [True, False])
@pytest.mark.parametrize('batch_size', [8, 7])
def test_two_replicas_equal_one_replica_on_the_whole_batch(update_on_kvstore, batch_size):
    """Three steps with SGD + momentum + weight decay, against plain PyTorch.

    Tolerance: the replicas each sum the gradient of half the batch and step 2
    adds the two sums, where PyTorch sums the whole batch at once. Float32
    addition is not associative, so results differ by rounding, a few ulps of
    values of order 0.1 (seen: at most 3e-8 after three steps of momentum SGD);
    we allow 1e-6 + 1e-5 * |value|. A real mistake (a wrong scale, a missed replica, stale weights)
    shows up at the order of lr * gradient, 1e-3 and more.
    """
    reference = small_cnn()
    net = small_cnn()
    optimizer = torch.optim.SGD(reference.parameters(), **HYPER)
    devices = [cpu(), cpu()]
    trainer = Trainer(net, 'sgd', HYPER, kvstore=LocalKVStore(), devices=devices,
                      update_on_kvstore=update_on_kvstore)
    assert trainer.update_on_kvstore == update_on_kvstore
    for X, y in batches(3, batch_size):
        optimizer.zero_grad()
        LOSS(reference(X), y).mean().backward()
        optimizer.step()
        train_batch(X, y, net, LOSS, trainer, devices)
        for p, q in zip(reference.parameters(), net.parameters()):
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), (p - q).abs().max()
    assert_replicas_identical(trainer)
    # The host copies are views of one flat buffer, holding the latest weights.
    assert torch.equal(trainer.flat_weights, torch.cat([p.detach().flatten()
                                                        for p in net.parameters()]))


class TwinStore(LocalKVStore):
    """A store of two workers where the other worker pushes the same gradients as we do."""
    num_workers = 2

    def _push(self, keys, values):
        super()._push(keys, [2 * v for v in values])


@pytest.mark.parametrize('update_on_kvstore', [True, False])
def test_gradients_are_averaged_over_all_workers(update_on_kvstore):
    """Two workers with the same batch take the same step as one worker with it."""
    reference, net = small_cnn(), small_cnn()
    optimizer = torch.optim.SGD(reference.parameters(), **HYPER)
    trainer = Trainer(net, 'sgd', HYPER, kvstore=TwinStore(), devices=[cpu()],
                      update_on_kvstore=update_on_kvstore)
    train_beside_torch(reference, optimizer, net, trainer, batches(2, 6))


def test_batchnorm_running_statistics_are_averaged_over_replicas():
    """Policy: each replica normalizes its slice; step 7 averages the running stats."""
    net = small_cnn(batch_norm=True)
    initial = copy.deepcopy(net)
    devices = [cpu(), cpu()]
    trainer = Trainer(net, 'sgd', HYPER, kvstore='local', devices=devices)
    (X, y), = batches(1, 8)
    train_batch(X, y, net, LOSS, trainer, devices)
    # What each replica's BatchNorm saw: its own half of the batch.
    halves = []
    for X_half in X.split(4):
        bn = copy.deepcopy(initial)
        bn.train()
        bn(X_half)
        halves.append(bn[1])
    for r in trainer.replicas:
        bn = r[1]
        assert torch.allclose(bn.running_mean, (halves[0].running_mean + halves[1].running_mean) / 2)
        assert torch.allclose(bn.running_var, (halves[0].running_var + halves[1].running_var) / 2)
        assert int(bn.num_batches_tracked) == 1
    assert not torch.allclose(halves[0].running_mean, halves[1].running_mean)   # it matters
    assert_replicas_identical(trainer)


@pytest.mark.parametrize('update_on_kvstore', [True, False])
def test_set_learning_rate(update_on_kvstore):
    net = small_cnn()
    trainer = Trainer(net, 'sgd', {'lr': 0.1}, devices=[cpu()],
                      update_on_kvstore=update_on_kvstore)
    before = [p.detach().clone() for p in net.parameters()]
    trainer.set_learning_rate(0.0)
    (X, y), = batches(1, 4)
    train_batch(X, y, net, LOSS, trainer, [cpu()])
    assert trainer.learning_rate == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))


def test_bad_use_gives_clear_errors():
    net = small_cnn()
    trainer = Trainer(net, devices=[cpu()], optimizer_params={'lr': 0.1})
    (X, y), = batches(1, 4)
    with pytest.raises(ValueError, match='one value per example'):
        train_batch(X, y, net, nn.CrossEntropyLoss(), trainer, [cpu()])
    with pytest.raises(ValueError, match="trainer's net and devices"):
        train_batch(X, y, small_cnn(), LOSS, trainer, [cpu()])
    with pytest.raises(ValueError, match='unknown kvstore'):
        create_store('nosuch')
    with pytest.raises(ValueError, match='unknown optimizer'):
        Trainer(small_cnn(), 'rmsprop', {'lr': 0.1}, devices=[cpu()])


@pytest.mark.parametrize('update_on_kvstore', [True, False])
def test_learning_rate_change_keeps_momentum(update_on_kvstore):
    """set_learning_rate between steps: the same weights as torch.optim with the same change."""
    reference, net = small_cnn(), small_cnn()
    optimizer = torch.optim.SGD(reference.parameters(), **HYPER)
    trainer = Trainer(net, 'sgd', HYPER, devices=[cpu()], update_on_kvstore=update_on_kvstore)
    train_beside_torch(reference, optimizer, net, trainer, batches(3, 6), lr_at=(2, 0.01))


def test_adam_on_the_store_with_torch_names():
    """torch's betas reach the store's Adam as they are: the steps of torch's Adam."""
    hyper = {'lr': 0.01, 'betas': (0.8, 0.99), 'weight_decay': 1e-3}
    reference, net = small_cnn(), small_cnn()
    optimizer = torch.optim.Adam(reference.parameters(), **hyper)
    trainer = Trainer(net, 'adam', hyper, devices=[cpu()])
    assert trainer.update_on_kvstore
    train_beside_torch(reference, optimizer, net, trainer, batches(2, 6))


def test_step_times_reach_the_dashboard_by_name(capsys, use_config):
    """trainer.step_times_report() goes through d2ldist.report to the dashboard's bars."""
    from d2ldist.launch.progress import JobModel
    from d2ldist.notebook.final import figure, steps_table
    from d2ldist.launch.processes import local_specs
    from d2ldist.report import parse_report, report
    from d2ldist.training.trainer import STEPS
    net = small_cnn()
    trainer = Trainer(net, 'sgd', HYPER, devices=[cpu(), cpu()])
    (X, y), = batches(1, 4)
    train_batch(X, y, net, LOSS, trainer, [cpu(), cpu()])
    use_config({'D2L_ROLE': 'worker'})
    report(step_times=trainer.step_times_report())
    r = parse_report(capsys.readouterr().out.strip())
    assert list(r['step_times']) == [step.label for step in STEPS.values()]     # all seven, in order
    assert all(t > 0 for t in r['step_times'].values())
    model = JobModel(local_specs(1, 0, ['true'], 'secret'))
    model.add_report(model.workers[0].label, r)
    assert figure(model).startswith(b'\x89PNG')
    assert steps_table(model).splitlines()[1].startswith('  1 forward, backward')


class RecordingAllreduceStore:
    """One worker's all-reduce store that records the size of each bucket it is given."""
    type, rank, num_workers = 'ring', 0, 1

    def __init__(self):
        self.started = []

    def init(self, keys, values):
        pass

    def pull(self, keys, out):
        pass

    def pushpull(self, keys, values, out):
        raise AssertionError('with overlap the Trainer all-reduces buckets, not pushpull')

    def allreduce_async_(self, tensor, after=None):
        assert after is None        # (a CUDA event: only behind copies from a GPU)
        self.started.append(tensor.numel())
        done = torch.futures.Future()   # the sum over one worker: the tensor as it is
        done.set_result(tensor)
        return done


def test_buckets_start_during_backward_last_layers_first():
    """Every bucket's all-reduce has started when backward returns, before step()."""
    store, net, devices = RecordingAllreduceStore(), small_cnn(), [cpu(), cpu()]
    trainer = Trainer(net, 'sgd', HYPER, kvstore=store, devices=devices, bucket_cap_mb=1e-6)
    X, y = batches(1, 6)[0]
    for replica, X_shard, y_shard in zip(trainer.replicas, X.chunk(2), y.chunk(2)):
        LOSS(replica(X_shard), y_shard).sum().backward()
    sizes = [p.numel() for p in net.parameters()]
    assert store.started == sizes[::-1]              # one bucket each, last layer first
    trainer.step(6)
    assert [trainer._times.counts[s] for s in range(2, 8)] == [1] * 6
    assert store.started == sizes[::-1]              # step() started nothing more


def test_each_bucket_finishes_as_soon_as_its_sum_is_in_while_later_ones_run():
    """Buckets.wait(): finish(b) after bucket b's handle, before waiting for b + 1's."""
    from d2ldist.collectives.buckets import Buckets
    events = []

    class Handle:
        def __init__(self, b):
            self.b = b

        def wait(self):
            events.append(('wait', self.b))

    buckets = Buckets([4, 4, 4], [4] * 3, [None] * 3, lambda b, group: Handle(b),
                      cap_mb=4e-6, finish=lambda b, group: events.append(('finish', b, group)))
    for i in (2, 1, 0):
        buckets.ready(i)
    buckets.wait()
    assert events == [('wait', 0), ('finish', 0, [2]), ('wait', 1), ('finish', 1, [1]),
                      ('wait', 2), ('finish', 2, [0])]


def test_a_ring_of_one_worker_sums_nothing_so_the_gradients_stay_on_the_device():
    """Alone, the ring store has no device of its own: the Trainer keeps flat_grads on
    devices[0] (on a GPU: no copy down to the host and up again, tests/unit/test_cuda.py)."""
    from d2ldist.training.stores import AllreduceStore
    store = AllreduceStore('ring')
    assert store.num_workers == 1 and store.device is None
    trainer = Trainer(small_cnn(), 'sgd', HYPER, kvstore=store, devices=[cpu()])
    assert trainer.flat_grads.device == cpu() and trainer._grads_up is None


def test_overlap_takes_the_same_steps_as_one_step_after_the_other():
    """A ring of one worker, with and without overlap: the same weights, to float rounding."""
    from d2ldist.training.stores import AllreduceStore
    nets = [small_cnn(batch_norm=True), small_cnn(batch_norm=True)]
    devices = [cpu(), cpu()]
    trainers = [Trainer(net, 'sgd', HYPER, kvstore=AllreduceStore('ring'), devices=devices,
                        overlap=overlap, bucket_cap_mb=0.001)
                for net, overlap in zip(nets, (True, False))]
    assert trainers[0]._buckets is not None and len(trainers[0]._buckets) > 1
    assert trainers[1]._buckets is None
    for X, y in batches(3, 8):
        for net, trainer in zip(nets, trainers):
            train_batch(X, y, net, LOSS, trainer, devices)
    for p, q in zip(nets[0].parameters(), nets[1].parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-7), (p - q).abs().max()
    assert_replicas_identical(trainers[0])


def test_a_refused_trainer_leaves_nothing_in_the_store():
    """Arguments are checked before the store is touched, and it is filled at the first step."""
    store = LocalKVStore()
    store.is_async = True             # a store that must update on the servers
    with pytest.raises(ValueError, match='update_on_kvstore=True'):
        Trainer(small_cnn(), 'sgd', HYPER, kvstore=store, update_on_kvstore=False)
    assert store._store == {} and store._meta == {}
    store = LocalKVStore()
    trainer = Trainer(small_cnn(), 'sgd', HYPER, kvstore=store)
    assert store._store == {}                          # nothing until the first step
    X, y = batches(1, 8)[0]
    train_batch(X, y, trainer.replicas[0], LOSS, trainer, trainer.devices)
    assert set(store._store) == set(trainer.keys) and trainer.keys[0].endswith('.0')


def test_two_trainers_share_a_store():
    """Each Trainer has its own keys: two nets trained through one store, each as if alone."""
    store = LocalKVStore()
    nets = [small_cnn(), small_cnn()]
    alone = [copy.deepcopy(n) for n in nets]
    shared = [Trainer(n, 'sgd', HYPER, kvstore=store) for n in nets]
    own = [Trainer(n, 'sgd', HYPER, kvstore=LocalKVStore()) for n in alone]
    assert not set(shared[0].keys) & set(shared[1].keys)
    for X, y in batches(3, 8):
        for net, trainer in list(zip(nets, shared)) + list(zip(alone, own)):
            train_batch(X, y, net, LOSS, trainer, trainer.devices)
    for a, b in zip(nets, alone):
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p, q)
    # a Trainer that updates the weights itself (the store only sums) shares it too, made
    # before or after one that sets the store's optimizer: its sums are never updated
    for first_sums in (True, False):
        store, nets = LocalKVStore(), [small_cnn(), small_cnn()]
        twin = copy.deepcopy(nets[0])
        on_own = [True, False] if first_sums else [False, True]
        trainers = [Trainer(n, 'sgd', HYPER, kvstore=store, update_on_kvstore=not own)
                    for n, own in zip(nets if first_sums else nets[::-1], on_own)]
        alone = Trainer(twin, 'sgd', HYPER, kvstore=LocalKVStore(), update_on_kvstore=False)
        for X, y in batches(3, 8):
            for t in trainers + [alone]:
                train_batch(X, y, t.replicas[0], LOSS, t, t.devices)
        for p, q in zip(nets[0].parameters(), twin.parameters()):
            assert torch.equal(p, q)
    # updating in the store, another optimizer on the same store is refused in one line
    other = Trainer(small_cnn(), 'sgd', dict(HYPER, lr=0.5), kvstore=store)
    with pytest.raises(ValueError, match='already runs sgd'):
        other.init()
