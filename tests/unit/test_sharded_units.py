"""ZeRO's ShardedOptimizer in one process (issue 31): the layout among N workers (computed
for N = 2 and 3 without a job), the one-line errors, alone exactly the wrapped optimizer,
and N workers as threads over in-memory collectives. tests/jobs/test_sharded.py runs it
among real workers, on the ring and on torch.distributed."""
import threading

import pytest
import torch
from torch import nn

import d2ldist
from d2ldist.collectives import world
from d2ldist.collectives.distributed_optimizer import DistributedOptimizer
from d2ldist.collectives.engine import Handle
from d2ldist.collectives.join import Refused
from d2ldist.collectives.ring_backend import RingBackend, equal_shard, stand_in
from d2ldist.collectives.sharded import MemoryPeak, paper_memory, plan
from d2ldist.collectives.sharded_module import full_weights, units_of
from d2ldist.collectives.ops import Average

# 8-byte elements; a cap of 30 of them puts the last two parameters (3 + 21) together,
# and the next ones (7, then 35) each alone
CAP_MB = 30 * 8 / 2 ** 20


def mlp(seed=0, dtype=torch.float64):
    """Linear(5, 7), Tanh, Linear(7, 3): parameters of 35, 7, 21 and 3 elements."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(dtype)


@pytest.mark.parametrize('n, padded', [(1, [24, 7, 35]), (2, [24, 8, 36]),
                                       (3, [24, 9, 36])])
def test_buckets_in_backward_order_padded_to_a_multiple_of_n(n, padded):
    buckets = plan(list(mlp().parameters()), n, CAP_MB)
    assert [b.indices for b in buckets] == [[3, 2], [1], [0]]
    assert [b.numel for b in buckets] == [24, 7, 35]
    assert [b.padded for b in buckets] == padded
    assert [b.shard_numel for b in buckets] == [p // n for p in padded]


@pytest.mark.parametrize('n', [2, 3])
def test_the_shards_tile_each_bucket_and_the_places_hold_the_parameters(n):
    params = list(mlp().parameters())
    for bucket in plan(params, n, CAP_MB):
        shards = [bucket.shard(r) for r in range(n)]
        assert shards[0][0] == 0 and shards[-1][1] == bucket.padded
        assert all(a[1] == b[0] and a[1] - a[0] == bucket.shard_numel
                   for a, b in zip(shards, shards[1:]))
        flat = bucket.pack(bucket.params)
        assert flat[bucket.numel:].eq(0).all()                 # the padding: zeros
        assert all(torch.equal(place, p) for place, p in zip(bucket.places(flat),
                                                              bucket.params))
    three = plan(params, 3, CAP_MB)[2]          # 35 elements: 12 + 12 + 11 and 1 zero
    assert [three.shard(r) for r in range(3)] == [(0, 12), (12, 24), (24, 36)]


def test_one_big_bucket_by_default_and_dtypes_and_groups_apart():
    params = list(mlp().parameters())
    assert [b.indices for b in plan(params, 2)] == [[3, 2, 1, 0]]
    mixed = [params[0], params[1].float(), params[2], params[3]]
    assert [b.indices for b in plan(mixed, 2)] == [[3, 2], [1], [0]]    # float32 alone
    net = mlp()
    opt = d2ldist.ShardedOptimizer(torch.optim.SGD(
        [{'params': net[0].parameters()}, {'params': net[2].parameters(), 'lr': 0.5}],
        lr=0.1))
    assert [(b.indices, b.group) for b in opt.buckets] == [([3, 2], 1), ([1, 0], 0)]
    assert [g['lr'] for g in opt.param_groups] == [0.1, 0.5]
    assert [[s.numel() for s in g['params']] for g in opt.param_groups] == [[42], [24]]


def one_line_error(kind, match, make):
    with pytest.raises(kind, match=match) as e:
        make()
    assert '\n' not in str(e.value)


def test_what_cannot_be_sharded_is_refused_in_one_line():
    net = mlp()
    sgd = lambda ps=None: torch.optim.SGD(ps or net.parameters(), lr=0.1)  # noqa: E731
    for stage in (0, 3, '1'):
        one_line_error(ValueError, 'stage must be 1 or 2.*d2ldist.shard_module', lambda: d2ldist.ShardedOptimizer(
            sgd(), stage=stage))
    one_line_error(ValueError, r'2 parameters of the model are not in the optimizer '
                   r'\(2.weight, 2.bias\)', lambda: d2ldist.ShardedOptimizer(
                       sgd(net[0].parameters()), net.named_parameters()))
    one_line_error(TypeError, 'wraps a torch.optim optimizer, not list',
                   lambda: d2ldist.ShardedOptimizer([1]))
    one_line_error(TypeError, 'not DistributedOptimizer',
                   lambda: d2ldist.ShardedOptimizer(DistributedOptimizer(sgd())))


def test_an_optimizer_that_has_stepped_is_refused():
    net = mlp()
    adam = torch.optim.Adam(net.parameters())
    net(torch.ones(1, 5, dtype=torch.float64)).sum().backward()
    adam.step()
    one_line_error(ValueError, 'already has state .* before the first step',
                   lambda: d2ldist.ShardedOptimizer(adam))


def train(net, opt, steps=5, batch=8):
    """A few steps on fixed random batches; the loss is nothing but a function of them."""
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        X = torch.randn(batch, 5, generator=g, dtype=torch.float64)
        opt.zero_grad()
        net(X).pow(2).mean().backward()
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


OPTIMIZERS = {
    'sgd momentum': lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3),
    'adam': lambda ps: torch.optim.Adam(ps, lr=0.01),
    'adam, two groups': lambda ps: torch.optim.Adam(
        [{'params': ps[:2], 'lr': 0.05}, {'params': ps[2:]}], lr=0.01, weight_decay=1e-2)}


@pytest.mark.parametrize('stage', [1, 2])
@pytest.mark.parametrize('name', OPTIMIZERS)
def test_alone_it_is_the_wrapped_optimizer(name, stage):
    """Elementwise updates of a flat shard equal those of the separate tensors, exactly."""
    plain, sharded = mlp(), mlp()
    expected = train(plain, OPTIMIZERS[name](list(plain.parameters())))
    opt = d2ldist.ShardedOptimizer(OPTIMIZERS[name](list(sharded.parameters())),
                                   sharded.named_parameters(), stage=stage, bucket_cap_mb=CAP_MB)
    got = train(sharded, opt)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_the_state_is_the_shards_and_stage_2_keeps_no_full_gradient():
    net = mlp()
    opt = d2ldist.ShardedOptimizer(torch.optim.Adam(net.parameters()), stage=2,
                                   bucket_cap_mb=CAP_MB)
    net(torch.ones(2, 5, dtype=torch.float64)).sum().backward()
    assert all(p.grad is None for p in net.parameters())       # dropped once in the bucket
    assert [s.grad.numel() for s in opt.shards] == [24, 7, 35]  # (alone: run at once)
    opt.step()
    state = [t for s in opt.shards for k, t in opt.state[s].items() if k != 'step']
    assert sum(t.numel() for t in state) == 2 * 66          # exp_avg, exp_avg_sq: 1/N of 66
    opt.zero_grad()
    assert all(s.grad is None for s in opt.shards)


def test_stage_2_refuses_a_second_backward_before_the_step():
    """Its first backward's gradients are already gone into the buckets."""
    net = mlp()
    opt = d2ldist.ShardedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), stage=2)
    net(torch.ones(1, 5, dtype=torch.float64)).sum().backward()
    one_line_error(RuntimeError, 'computed twice before the step.*stage 1 accumulates',
                   lambda: net(torch.ones(1, 5, dtype=torch.float64)).sum().backward())
    opt.step()


def test_zero_grad_as_torchs():
    net = mlp()
    opt = d2ldist.ShardedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
    net(torch.ones(2, 5, dtype=torch.float64)).sum().backward()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in net.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in net.parameters())


def test_the_flat_collectives_alone_and_their_one_line_error():
    ring = RingBackend(None)
    flat = torch.arange(6.0)
    assert torch.equal(ring.reduce_scatter_flat(flat, Average), torch.arange(6.0))
    out = torch.zeros(6)
    assert torch.equal(ring.all_gather_flat_(out, torch.arange(6.0)), torch.arange(6.0))
    assert equal_shard(torch.zeros(12), 2, 3) == (8, 12)
    one_line_error(ValueError, 'multiple of the 5 workers', lambda: equal_shard(
        torch.zeros(12), 0, 5))


class ThreadWorkers:
    """N workers as threads: the two flat collectives and allgather over memory, each
    thread its rank."""

    def __init__(self, n):
        self.n, self.slots, self.here = n, [None] * n, threading.Barrier(n, timeout=60)
        self.local = threading.local()

    def reduce_scatter_flat(self, flat, op):
        total = sum(self._exchange(flat)) / self.n            # (Average)
        k = flat.numel() // self.n
        return total[self.rank * k:(self.rank + 1) * k]

    def all_gather_flat_(self, flat, shard):
        return flat.copy_(torch.cat(self._exchange(shard)))

    def allgather(self, tensor):
        return torch.cat(self._exchange(tensor))

    def _exchange(self, tensor):
        """Every worker's tensor, in rank order."""
        self.slots[self.rank] = tensor.clone()
        self.here.wait()
        everyone = list(self.slots)
        self.here.wait()
        return everyone

    rank = property(lambda self: self.local.rank)
    size = property(lambda self: self.n)


def zero(stage, net, make_optimizer, cap_mb=CAP_MB, **options):
    """(net, optimizer) of ZeRO's stage 1, 2 (ShardedOptimizer) or 3 (shard_module)."""
    if stage == 3:
        net = d2ldist.shard_module(net)
        return net, make_optimizer(list(net.parameters()))
    return net, d2ldist.ShardedOptimizer(make_optimizer(list(net.parameters())), stage=stage,
                                         bucket_cap_mb=cap_mb, **options)


def in_threads(n, monkeypatch, work, run=lambda fn, *args: Handle.finished(fn(*args))):
    """work(r) on N threads, each worker r over ThreadWorkers' collectives; their results
    (``run``: how world.run runs a collective; at once, unless given)."""
    workers, results = ThreadWorkers(n), [None] * n
    monkeypatch.setattr(world, 'backend', lambda: workers)
    monkeypatch.setattr(world, 'run', run)

    def run(r):
        workers.local.rank = r
        results[r] = work(r)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def zero_train(stage, n, make_optimizer, dtype=torch.float64, steps=5, **options):
    """work(r) for in_threads: worker r's part of 5 global batches of 12 (the last step's
    memory watched); it returns its full weights by name, its optimizer and that peak."""
    nets = [mlp(dtype=dtype) for _ in range(n)]       # (here: torch's seed is global)
    return lambda r: zero_train_one(stage, n, r, nets[r], make_optimizer, dtype, steps,
                                    **options)


def zero_train_one(stage, n, r, net, make_optimizer, dtype, steps, **options):
    cap = CAP_MB * torch.finfo(dtype).bits / 64           # 30 elements whatever the dtype
    net, opt = zero(stage, net, make_optimizer, cap, **options)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        X = torch.randn(12, 5, generator=g, dtype=torch.float64).to(dtype)
        with MemoryPeak(net, opt) as peak:
            opt.zero_grad()
            net(X[r * 12 // n:(r + 1) * 12 // n]).pow(2).mean().backward()
            peak.sample()
            opt.step()
    weights = full_weights(net) if stage == 3 else dict(net.named_parameters())
    return weights, opt, peak.bytes


@pytest.mark.parametrize('stage', [1, 2, 3])
@pytest.mark.parametrize('n', [2, 3])
@pytest.mark.parametrize('name', ['sgd momentum', 'adam'])
def test_n_workers_equal_one_process_on_the_whole_batch(name, n, stage, monkeypatch):
    """Each worker its part of a global batch of 12: after 5 steps every worker has the
    weights of the plain optimizer on the whole batch, and Adam's state for 1/N of them."""
    done = in_threads(n, monkeypatch, zero_train(stage, n, OPTIMIZERS[name]))
    plain = mlp()
    expected = train(plain, OPTIMIZERS[name](list(plain.parameters())), batch=12)
    numels = [24, 7, 35] if stage < 3 else [42, 24]       # the buckets, or the units
    state = sum(t.numel() for s in done[0][1].state.values() for t in s.values() if t.dim())
    assert state == (1 if name == 'sgd momentum' else 2) * sum(-(-k // n) for k in numels)
    for weights, opt, _ in done:
        assert all(torch.allclose(weights[name], p, rtol=1e-10, atol=1e-13)
                   for (name, _), p in zip(plain.named_parameters(), expected))


def test_the_papers_formulas():
    """ZeRO's Table 1 in one dtype (4 bytes): 16 Psi for data parallelism, then 4 + 4 +
    8/N, 4 + 12/N and 16/N; here Psi = 7 + 5 (padded to 8 and 6 for N = 2, 9 and 6 for 3)."""
    assert paper_memory(0, [7, 5], 2) == {'weights': 48, 'gradients': 48,
                                          'optimizer state': 96}
    assert paper_memory(1, [7, 5], 2) == {'weights': 48, 'gradients': 48,
                                          'optimizer state': 2 * 4 * 7}
    assert paper_memory(2, [7, 5], 3) == {'weights': 48, 'gradients': 4 * 5,
                                          'optimizer state': 2 * 4 * 5}
    assert paper_memory(3, [7, 5], 3, itemsize=8) == {'weights': 40, 'gradients': 40,
                                                      'optimizer state': 80}


@pytest.mark.parametrize('stage', [1, 2, 3])
@pytest.mark.parametrize('n', [2, 3])
def test_memory_at_the_peak_is_the_papers_plus_what_is_named(n, stage, monkeypatch):
    """fp32 Adam, Psi = 66 weights: each worker's live bytes by kind at the last step's
    peak are the paper's formulas exactly, plus, named:

    * stages 1-2: the optimizer steps a copy of its shard of the weights (4 Psi/N: under
      mixed precision, the fp32 master weights the paper counts in its K = 12);
    * stage 1: the averaged gradient's shard beside the full local gradients (4 Psi/N;
      DeepSpeed writes it into the gradient buffer in place);
    * stage 2: at the last bucket (35 elements) the whole bucket less its own shard;
    * stage 3: the first layer (42 elements), gathered at the end of backward: its
      weights and its full gradient."""
    done = in_threads(n, monkeypatch, zero_train(stage, n, OPTIMIZERS['adam'], torch.float32))
    numels = [24, 7, 35] if stage < 3 else [42, 24]
    padded = [-(-k // n) * n for k in numels]
    shard = 4 * sum(padded) // n
    if stage == 1:
        extra = {'weights': shard, 'gradients': shard}
    elif stage == 2:
        extra = {'weights': shard, 'gradients': 4 * padded[2] - 4 * padded[2] // n}
    else:
        extra = {'weights': 4 * 42, 'gradients': 4 * 42}
    paper = paper_memory(stage, numels, n)
    assert [peak for _, _, peak in done] == [
        {kind: paper[kind] + extra.get(kind, 0) for kind in paper}] * n
    if stage == 3:        # 16 Psi / N, plus the layer gathered
        assert sum(done[0][2].values()) == 16 * sum(padded) // n + 8 * 42


class Lazy:
    """A collective that runs only when waited for: communication that never keeps up."""

    def __init__(self, fn, *args):
        self.fn, self.args, self.ran = fn, args, False

    def wait(self):
        if not self.ran:
            self.result, self.ran = self.fn(*self.args), True
        return self.result

    def done(self):
        return self.ran


@pytest.mark.parametrize('limit', [None, 1])
def test_stage_2_holds_the_buckets_the_communication_has_not_reduced_unless_limited(
        limit, monkeypatch):
    """fp32 Adam, N = 2, buckets of 24, 8 and 36 (padded) elements, and reduce-scatters
    that run only when waited for: at the end of backward every bucket is whole; with
    max_whole_buckets=1 backward waits for each before it fills the next, and the peak is
    the last bucket whole beside the others' shards, as when communication keeps up."""
    done = in_threads(2, monkeypatch, zero_train(2, 2, OPTIMIZERS['adam'], torch.float32,
                                                 max_whole_buckets=limit), run=Lazy)
    padded = [24, 8, 36]
    whole = 4 * sum(padded) if limit is None else 4 * padded[2] + 4 * sum(padded[:2]) // 2
    assert [peak['gradients'] for _, _, peak in done] == [whole] * 2
    plain = mlp()          # and the same weights, whichever way
    expected = train(plain, OPTIMIZERS['adam'](list(plain.parameters())), batch=12)
    assert all(torch.allclose(done[0][0][name], p.float(), rtol=1e-5, atol=1e-6)
               for (name, _), p in zip(plain.named_parameters(), expected))


def test_max_whole_buckets_is_for_stage_2_in_one_line():
    net = nn.Linear(3, 2)
    for stage, limit in ((1, 1), (2, 0), (2, 1.5)):
        with pytest.raises(ValueError, match=rf'^max_whole_buckets is for stage 2, a whole '
                                             rf'number from 1, got {limit} at stage {stage}$'):
            d2ldist.ShardedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), stage=stage,
                                     max_whole_buckets=limit)


@pytest.mark.parametrize('method, args', [('reduce_scatter_flat', {'op': 'Average'}),
                                          ('all_gather_flat_', {})])
def test_a_worker_in_join_has_no_shard_and_refuses_them(method, args):
    """As Horovod's allgather: the others' call fails on every worker, naming it."""
    described = {'method': method, 'dtype': 'float64', 'shape': [6], **args}
    assert stand_in(described, 2)[0] == method
    with pytest.raises(Refused, match=f'no {method.strip("_")} while a worker is in join'):
        RingBackend(None)._take_part(described)


# -- stage 3: shard_module ------------------------------------------------------------------
def test_stage_3_each_layer_holds_one_flat_shard_and_no_weights(monkeypatch):
    """Linear(5, 7) (35 + 7 = 42 elements) and Linear(7, 3) (24): one unit each, and the
    net's parameters are the shards; between steps ``weight`` is None."""
    net = d2ldist.shard_module(mlp())
    assert [(u.names, u.padded) for u in units_of(net)] == [
        (['0.weight', '0.bias'], 42), (['2.weight', '2.bias'], 24)]
    assert [(n, p.numel()) for n, p in net.named_parameters()] == [
        ('0.flat_shard', 42), ('2.flat_shard', 24)]
    assert net[0].weight is None and net[2].bias is None
    net(torch.ones(2, 5, dtype=torch.float64)).sum().backward()
    assert net[0].weight is None and units_of(net)[0].full.untyped_storage().nbytes() == 0
    assert [p.grad.numel() for p in net.parameters()] == [42, 24]
    weights = full_weights(net)
    assert list(weights) == ['0.weight', '0.bias', '2.weight', '2.bias']
    assert all(torch.equal(weights[n], p) for n, p in mlp().named_parameters())


class Twice(nn.Module):
    """A convolution, BatchNorm and an in-place ReLU, then one Linear used twice."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU(inplace=True))
        self.fc = nn.Linear(12, 12)

    def forward(self, X):
        return self.fc(torch.tanh(self.fc(self.conv(X.view(-1, 2, 4, 4)).flatten(1))))


@pytest.mark.parametrize('name', ['sgd momentum', 'adam'])
@pytest.mark.parametrize('model, units', [(mlp, None), (Twice, None),
                                          (Twice, lambda net: [net.conv, net.fc])])
def test_stage_3_alone_is_the_plain_optimizer(model, units, name):
    """The same steps on shards (alone: one shard, the padded flat) give the same weights,
    exactly: a layer used twice in forward and an in-place op after one are fine."""
    inputs = 5 if model is mlp else 32
    plain, sharded = model().double(), model().double()
    sharded = d2ldist.shard_module(sharded, units and units(sharded))
    opt = OPTIMIZERS[name](list(sharded.parameters()))
    popt = OPTIMIZERS[name](list(plain.parameters()))
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        X = torch.randn(6, inputs, generator=g, dtype=torch.float64)
        for net, o in ((plain, popt), (sharded, opt)):
            o.zero_grad()
            net(X).pow(2).mean().backward()
            o.step()
    weights = full_weights(sharded)
    assert sorted(weights) == sorted(n for n, _ in plain.named_parameters())
    assert all(torch.equal(weights[n], p) for n, p in plain.named_parameters())
    assert all(torch.equal(a, b) for a, b in zip(plain.buffers(), sharded.buffers()))


def test_stage_3_refuses_in_one_line_what_it_cannot_shard():
    net = mlp()
    one_line_error(ValueError, r'2 parameters are in no unit \(2.weight, 2.bias\)',
                   lambda: d2ldist.shard_module(net, [net[0]]))
    one_line_error(ValueError, 'must be modules of the net, not Linear',
                   lambda: d2ldist.shard_module(net, [nn.Linear(2, 2)]))
    one_line_error(ValueError, 'a unit is named twice',
                   lambda: d2ldist.shard_module(net, [net, net]))
    tied = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    tied[1].weight = tied[0].weight
    one_line_error(ValueError, r'shared parameters \(0.weight = 1.weight\)',
                   lambda: d2ldist.shard_module(tied))
    mixed = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3).double())
    one_line_error(ValueError, 'unit net mixes dtypes',
                   lambda: d2ldist.shard_module(mixed, [mixed]))
    d2ldist.shard_module(net, [net])                    # the whole net: one unit
    assert [n for n, _ in net.named_parameters()] == ['flat_shard']
    one_line_error(ValueError, 'already sharded', lambda: d2ldist.shard_module(net))
