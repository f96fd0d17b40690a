"""ZeRO's shard replicas (--shard-replicas 1, shard_replica.py) in one process: N workers
as threads over in-memory collectives. Each worker's replica of its ring predecessor's
shard equals that shard bit for bit after k steps; after a loss the survivors' shards and
replicas, cut again for their number, hold the same whole state, and training goes on as
the plain optimizer on the whole batch. tests/jobs/test_shard_replicas.py runs it in a job."""
import pytest
import torch

import d2ldist
from d2ldist import config
from d2ldist.collectives import elastic, shard_replica
from d2ldist.collectives.sharded_module import full_weights, units_of
from d2ldist.launch import cli
from test_sharded_units import CAP_MB, OPTIMIZERS, ThreadWorkers, in_threads, mlp, train


class RingThreads(ThreadWorkers):
    """ThreadWorkers with the ring's one step to the right."""

    name = 'ring'

    def pass_right(self, tensor):
        return self._exchange(tensor)[(self.rank - 1) % self.n].clone()


@pytest.fixture
def ring_threads(monkeypatch):
    """in_threads over RingThreads."""
    import test_sharded_units
    monkeypatch.setattr(test_sharded_units, 'ThreadWorkers', RingThreads)
    return lambda n, work: in_threads(n, monkeypatch, work)


def steps(net, opt, r, n, first, count):
    """Global batches ``first`` .. ``first + count - 1`` of 12, worker r's part of each."""
    g = torch.Generator().manual_seed(1)
    for step in range(first + count):
        X = torch.randn(12, 5, generator=g, dtype=torch.float64)
        if step >= first:
            opt.zero_grad()
            net(X[r * 12 // n:(r + 1) * 12 // n]).pow(2).mean().backward()
            opt.step()


def replicated(stage, name, nets):
    """work(r): worker r's net and a ShardedOptimizer with a replica."""
    def make(r):
        return d2ldist.ShardedOptimizer(OPTIMIZERS[name](list(nets[r].parameters())),
                                        stage=stage, bucket_cap_mb=CAP_MB, replicas=1)
    return make


def same_state(a, b):
    """Two optimizers' states of two lists of shards, equal bit for bit."""
    return all(a.keys() == b.keys() and all(torch.equal(torch.as_tensor(a[k]),
                                                        torch.as_tensor(b[k])) for k in a)
               for a, b in zip(a, b))


def states(optimizer, shards):
    return [optimizer.state[s] for s in shards]


def copies(holder, replica):
    """Whether ``replica`` holds ``holder``'s shards of the weights and of the optimizer's
    state, bit for bit."""
    return all(torch.equal(a, b) for a, b in zip(holder.shards, replica.shards)) and \
        same_state(states(holder.optimizer, holder.shards),
                   states(replica.optimizer, replica.shards))


@pytest.mark.parametrize('stage', [1, 2])
@pytest.mark.parametrize('n', [2, 3])
@pytest.mark.parametrize('name', OPTIMIZERS)
def test_the_replica_equals_the_predecessors_shard_bit_for_bit(name, n, stage, ring_threads):
    nets = [mlp() for _ in range(n)]
    make = replicated(stage, name, nets)

    def work(r):
        opt = make(r)
        steps(nets[r], opt, r, n, 0, 4)
        return opt
    opts = ring_threads(n, work)
    ring_threads(n, lambda r: opts[r].replica.settle())     # (the last step's, pending)
    for r, opt in enumerate(opts):
        successor = opts[(r + 1) % n].replica
        assert successor.owner == r
        assert copies(opt, successor)
        assert successor.optimizer.state        # (it stepped)


def whole(opt_of, n, name):
    """Bucket by bucket, the state ``name`` of n workers' shards back to back."""
    return [torch.cat([opt_of(r).optimizer.state[opt_of(r).shards[b]][name]
                       for r in range(n)])[:bucket.numel]
            for b, bucket in enumerate(opt_of(0).buckets)]


@pytest.mark.parametrize('stage', [1, 2])
@pytest.mark.parametrize('lost', [0, 1, 2])
def test_after_a_loss_the_survivors_cut_the_whole_state_again_and_go_on(stage, lost,
                                                                        ring_threads):
    """3 workers, 3 steps; one lost; the 2 left recover (the lost shard from its
    replica), hold the same whole state in 2 shards, with replicas, and after 3 more steps
    have the plain optimizer's weights on the whole batch."""
    nets = [mlp() for _ in range(3)]
    make = replicated(stage, 'adam, two groups', nets)
    opts = ring_threads(3, lambda r: (steps(nets[r], opt := make(r), r, 3, 0, 3), opt)[1])
    ring_threads(3, lambda r: opts[r].replica.settle())     # (as a commit does)
    before = {k: whole(lambda r: opts[r], 3, k) for k in ('exp_avg', 'exp_avg_sq')}
    left = [r for r in range(3) if r != lost]

    def go_on(r):
        old = left[r]
        shard_replica.recover(opts[old])
        assert (opts[old].rank, opts[old].size) == (r, 2)
        return opts[old]
    after = ring_threads(2, go_on)
    for k, buckets in before.items():
        assert all(torch.equal(a, b) for a, b in zip(buckets, whole(lambda r: after[r], 2, k)))
    for r, opt in enumerate(after):
        successor = after[(r + 1) % 2].replica
        assert successor.owner == r and same_state(
            states(opt.optimizer, opt.shards), states(successor.optimizer, successor.shards))
    ring_threads(2, lambda r: steps(nets[left[r]], after[r], r, 2, 3, 3))
    plain = mlp()
    expected = train(plain, OPTIMIZERS['adam, two groups'](list(plain.parameters())),
                     steps=6, batch=12)
    for r in left:
        assert all(torch.allclose(p, e, rtol=1e-10, atol=1e-13)
                   for p, e in zip(nets[r].parameters(), expected))


def test_two_neighbours_lost_at_once_is_one_line():
    assert shard_replica.providers([[0, 2], [2, 1]], 3) == {0: (0, 0), 2: (1, 0), 1: (1, 1)}
    with pytest.raises(RuntimeError) as e:
        shard_replica.providers([[0, 3]], 4)                # 1 and 2 lost together
    assert '\n' not in str(e.value) and '[1, 2]' in str(e.value)


def test_replicas_is_0_or_1_and_alone_there_is_none():
    net = mlp()
    with pytest.raises(ValueError) as e:
        d2ldist.ShardedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), replicas=2)
    assert '\n' not in str(e.value)
    assert d2ldist.ShardedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                    replicas=1).replica is None


@pytest.mark.parametrize('options', [
    ['--shard-replicas', '2'], ['--shard-replicas', '-1'],
    ['--shard-replicas', '1', '--env', 'D2L_BACKEND=torch'],
    ['--shard-replicas', '1', '--min-workers', '1', '--restart-lost']])
def test_the_launcher_checks_the_option_in_one_line(options):
    with pytest.raises(cli.UsageError) as e:
        cli.parse(['-n', '2', *options, 'python', '-c', 'pass'])
    assert '--shard-replicas' in str(e.value) and '\n' not in str(e.value)
    args = cli.parse(['-n', '2', '--shard-replicas', '1', 'python', '-c', 'pass'])
    assert config.Config.from_env(args.env).shard_replicas == 1


def test_under_min_workers_a_replicated_sharded_optimizer_is_taken(monkeypatch, capsys):
    net = mlp()
    monkeypatch.setattr(config, '_current', config.Config(min_workers=2, shard_replicas=1))
    sharded = d2ldist.ShardedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
    state = elastic.TorchState(model=net, optimizer=sharded)
    assert state.replicated
    stage_3 = d2ldist.shard_module(mlp())
    with pytest.raises(SystemExit):
        elastic.TorchState(model=stage_3, optimizer=None)
    assert '--shard-replicas 1' in capsys.readouterr().err
    adam = torch.optim.Adam(stage_3.parameters(), lr=0.01)
    assert elastic.TorchState(model=stage_3, optimizer=adam).replicated
    monkeypatch.setattr(config, '_current', config.Config(min_workers=2))
    with pytest.raises(SystemExit):
        elastic.TorchState(model=stage_3, optimizer=adam)


# -- stage 3: shard_module's units, stepped by a plain torch optimizer ----------------------

def two_groups(ps):
    """Adam, the first Linear's parameters (or its unit's shard) in a group of their own."""
    half = len(ps) // 2
    return torch.optim.Adam([{'params': ps[:half], 'lr': 0.05}, {'params': ps[half:]}],
                            lr=0.01, weight_decay=1e-2)


UNIT_OPTIMIZERS = {**OPTIMIZERS, 'adam, two groups': two_groups}


def net_replicated(name, net):
    """A worker's net sharded, the user's optimizer over its shards, and their holder."""
    net = d2ldist.shard_module(net)
    opt = UNIT_OPTIMIZERS[name](list(net.parameters()))
    return net, opt, shard_replica.NetShards(units_of(net), opt)


def whole_units(holders, n, key=None):
    """Unit by unit, n workers' shards (``key``: of that optimizer state) back to back."""
    return [torch.cat([(h.optimizer.state[h.shards[u]][key] if key else h.shards[u].detach())
                       for h in holders[:n]])[:sum(unit.numels)]
            for u, unit in enumerate(holders[0].buckets)]


@pytest.mark.parametrize('n', [2, 3])
@pytest.mark.parametrize('name', UNIT_OPTIMIZERS)
def test_stage_3_the_replica_equals_the_predecessors_shard_bit_for_bit(name, n, ring_threads):
    nets = [mlp() for _ in range(n)]          # (out of the threads: torch's seed is global)

    def work(r):
        net, opt, holder = net_replicated(name, nets[r])
        steps(net, opt, r, n, 0, 4)
        holder.replica.settle()
        return holder
    holders = ring_threads(n, work)
    for r, holder in enumerate(holders):
        successor = holders[(r + 1) % n].replica
        assert successor.owner == r and successor.optimizer.state
        assert copies(holder, successor)


@pytest.mark.parametrize('lost', [0, 1, 2])
def test_stage_3_after_a_loss_the_survivors_cut_each_unit_again_and_go_on(lost, ring_threads):
    """3 workers, 3 steps; one lost; the 2 left take its unit shards from its successor's
    replica, hold the same whole weights and state in 2 shards (the same Parameters), and
    after 3 more steps have the plain optimizer's weights on the whole batch."""
    nets = [mlp() for _ in range(3)]

    def start(r):
        net, opt, holder = made = net_replicated('adam, two groups', nets[r])
        steps(net, opt, r, 3, 0, 3)
        holder.replica.settle()                  # (as a commit does)
        return made
    made = ring_threads(3, start)
    holders = [h for _, _, h in made]
    before = [whole_units(holders, 3)] + [whole_units(holders, 3, k)
                                          for k in ('exp_avg', 'exp_avg_sq')]
    params = [list(net.parameters()) for net, _, _ in made]
    left = [r for r in range(3) if r != lost]

    def go_on(r):
        shard_replica.recover(holders[left[r]])
        return holders[left[r]]
    after = ring_threads(2, go_on)
    assert [(h.rank, h.size) for h in after] == [(0, 2), (1, 2)]
    assert all(list(made[old][0].parameters())[i] is p          # the user's optimizer's
               for old in left for i, p in enumerate(params[old]))
    got = [whole_units(after, 2)] + [whole_units(after, 2, k) for k in ('exp_avg', 'exp_avg_sq')]
    assert all(torch.equal(a, b) for x, y in zip(before, got) for a, b in zip(x, y))
    for r, holder in enumerate(after):
        successor = after[(r + 1) % 2].replica
        assert successor.owner == r
        assert all(torch.equal(a, b) for a, b in zip(holder.shards, successor.shards))
    ring_threads(2, lambda r: steps(made[left[r]][0], made[left[r]][1], r, 2, 3, 3))
    finals = ring_threads(2, lambda r: full_weights(made[left[r]][0]))
    plain = mlp()
    expected = train(plain, two_groups(list(plain.parameters())), steps=6, batch=12)
    names = [name for name, _ in mlp().named_parameters()]
    for weights in finals:
        assert all(torch.allclose(weights[k], e, rtol=1e-10, atol=1e-13)
                   for k, e in zip(names, expected))


def test_stage_3_a_unit_without_gradient_is_one_line(ring_threads):
    """The user's optimizer skips a shard that got no gradient; its replica could not."""
    nets = [mlp() for _ in range(2)]

    def work(r):
        net, opt, holder = net_replicated('adam', nets[r])
        net[0](torch.ones(1, 5, dtype=torch.float64)).sum().backward()   # (net[2] unused)
        with pytest.raises(RuntimeError) as e:
            opt.step()
        return str(e.value)
    for message in ring_threads(2, work):
        assert '\n' not in message and 'got no gradient' in message


def test_fetch_copies_the_predecessors_state_anew(ring_threads):
    """After a checkpoint's load (which loads the owners' shards only) every replica
    fetches its owner's state, one step right."""
    nets = [mlp() for _ in range(3)]
    make = replicated(2, 'adam', nets)
    opts = ring_threads(3, lambda r: (steps(nets[r], opt := make(r), r, 3, 0, 2), opt)[1])
    for opt in opts:
        opt.replica.refresh()                       # (drops the step pending)
        opt.replica.optimizer.state.clear()
    ring_threads(3, lambda r: opts[r].replica.fetch())
    for r, opt in enumerate(opts):
        successor = opts[(r + 1) % 3].replica
        assert same_state(states(opt.optimizer, opt.shards),
                          states(successor.optimizer, successor.shards))


def test_stage_3_a_replica_made_after_steps_fetches_its_owners_shard_and_keeps_up(ring_threads):
    """A TorchState made after the user's optimizer stepped (NetShards then): each replica
    fetches its predecessor's weights and state, and equals them after more steps too."""
    nets = [mlp() for _ in range(3)]

    def work(r):
        net = d2ldist.shard_module(nets[r])
        opt = OPTIMIZERS['adam'](list(net.parameters()))
        steps(net, opt, r, 3, 0, 2)
        holder = shard_replica.NetShards(units_of(net), opt)
        fetched = [s.clone() for s in holder.replica.shards], \
            states(holder.replica.optimizer, holder.replica.shards)
        mine = [s.detach().clone() for s in holder.shards], states(opt, holder.shards)
        steps(net, opt, r, 3, 2, 2)
        holder.replica.settle()
        return holder, fetched, mine
    made = ring_threads(3, work)
    for r, (holder, _, mine) in enumerate(made):
        successor, fetched = made[(r + 1) % 3][0].replica, made[(r + 1) % 3][1]
        assert all(torch.equal(a, b) for a, b in zip(mine[0], fetched[0]))
        assert same_state(mine[1], fetched[1])
        assert copies(holder, successor)


def test_stage_3_a_second_torch_state_of_one_optimizer_shares_its_holder(ring_threads,
                                                                         monkeypatch):
    """Two TorchStates over one optimizer share its NetShards (NetShards.of), so a step
    passes each unit's gradient shard right once."""
    nets, calls = [mlp() for _ in range(2)], []
    passed = RingThreads.pass_right
    monkeypatch.setattr(RingThreads, 'pass_right',
                        lambda self, t: (calls.append(self.rank), passed(self, t))[1])

    def work(r):
        net = d2ldist.shard_module(nets[r])
        opt = OPTIMIZERS['adam'](list(net.parameters()))
        first = shard_replica.NetShards.of(units_of(net), opt)
        second = shard_replica.NetShards.of(units_of(net), opt)
        before = len(calls)
        steps(net, opt, r, 2, 0, 2)
        second.replica.settle()
        return first, second, before
    made = ring_threads(2, work)
    units = len(made[0][1].buckets)
    assert all(first is second for first, second, _ in made)
    stepped = calls[max(before for _, _, before in made):]
    assert sorted(stepped) == [0] * 2 * units + [1] * 2 * units
