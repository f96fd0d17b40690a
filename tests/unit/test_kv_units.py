"""The parameter server's pieces in one process: placement, optimizers, the 'local' store."""
import os
import subprocess
import sys
from unittest.mock import patch

import pytest
import torch
from support import ROOT

from d2ldist import kv
from d2ldist.runtime.started import StartError
from d2ldist.kv.optimizers import Updater


def test_placement_small_whole_big_split_evenly():
    assert kv.place('w', 999_999, 4) == [(kv.place('w', 10, 4)[0][0], 0, 999_999)]
    assert kv.place('w', 1_000_003, 4) == [(0, 0, 250001), (1, 250001, 500002),
                                           (2, 500002, 750003), (3, 750003, 1_000_003)]
    assert kv.place(7, 5, 3, bound=2) == [(0, 0, 2), (1, 2, 4), (2, 4, 5)]   # first ones longer
    assert kv.place(7, 10**7, 1) == [(0, 0, 10**7)]
    servers = {kv.place(k, 10, 4)[0][0] for k in range(40)}   # small keys spread out
    assert servers == {0, 1, 2, 3}


def test_the_one_even_split():
    from d2ldist.runtime.split import even_sizes, even_slices
    assert even_sizes(10, 3) == [4, 3, 3] and even_sizes(2, 3) == [1, 1, 0]
    assert even_slices(10, 3) == [(0, 4), (4, 7), (7, 10)]


def test_placement_is_stable_across_processes():
    code = 'from d2ldist.kv import placement as p; print([p.place(k, 10, 7) for k in ("a", 1, "fc")])'
    runs = {subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                           cwd=ROOT, env=dict(os.environ, PYTHONHASHSEED=str(seed))).stdout
            for seed in (1, 2)}
    assert len(runs) == 1 and runs.pop().startswith('[[(')


def test_bound_from_environment(use_config):
    use_config({'D2L_KVSTORE_BIGARRAY_BOUND': '10'})
    assert len(kv.place('w', 10, 2)) == 2 and len(kv.place('w', 9, 2)) == 1


@pytest.mark.parametrize('name,hyper,make', [
    ('sgd', dict(lr=0.1, momentum=0.9, weight_decay=0.01, dampening=0.1),
     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, dampening=0.1)),
    ('sgd', dict(lr=0.1, momentum=0.9, nesterov=True),
     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True)),
    ('adam', dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.001),
     lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.001)),
])
def test_optimizers_match_torch_optim(name, hyper, make):
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(50, generator=g)
    grads = [torch.randn(3, 50, generator=g) for _ in range(10)]   # 3 workers, 10 steps
    w, up = w0.clone(), Updater(name, rescale_grad=1 / 3, **hyper)   # the average of 3
    ref = w0.clone().requires_grad_()
    opt = make([ref])
    for G in grads:
        up('w', w, G.sum(0))
        ref.grad = G.mean(0)
        opt.step()
    assert (w - ref.detach()).abs().max().item() < 1e-6


def test_optimizer_registry_rejects_bad_names_and_values():
    with pytest.raises(ValueError, match="unknown optimizer 'rmsprop'"):
        Updater('rmsprop')
    with pytest.raises(ValueError, match='no hyperparameter momentum'):
        Updater('adam', momentum=0.9)
    with pytest.raises(ValueError, match='must be a number'):
        Updater('sgd', lr='0.1')
    with pytest.raises(ValueError, match="unknown optimizer 'adamw'; the servers run sgd, adam"):
        Updater('adamw')


def test_set_optimizer_takes_gluon_names_as_torch_names():
    """learning_rate, wd, beta1, beta2 (MXNet's) and lr, weight_decay, betas: one update."""
    outs = []
    for hyper in (dict(learning_rate=0.1, wd=0.01, beta1=0.8, beta2=0.99),
                  dict(lr=0.1, weight_decay=0.01, betas=(0.8, 0.99))):
        store = kv.create('local')
        store.init('w', torch.ones(4))
        store.set_optimizer('adam', **hyper)
        outs.append(torch.empty(4))
        store.pushpull('w', torch.arange(4.), out=outs[-1])
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], torch.ones(4))


def test_local_store_sums_devices_and_updates(tmp_path):
    store = kv.create('local')
    assert (store.type, store.rank, store.num_workers) == ('local', 0, 1)
    store.init(['a', 1], [torch.zeros(3), torch.zeros(2, 2)])
    store.push('a', [torch.ones(3), torch.full((3,), 2.0)])        # two device copies
    outs = [torch.empty(3), torch.empty(3)]
    store.pull('a', out=outs)
    assert outs[0].tolist() == [3.0] * 3 and outs[1].tolist() == [3.0] * 3
    store.set_optimizer('sgd', lr=0.5, momentum=0.9)
    out = torch.empty(2, 2)
    store.pushpull(1, torch.ones(2, 2), out=out)
    assert (out == -0.5).all()
    store.save_optimizer_states(tmp_path / 's.pt')
    store.set_optimizer('sgd', lr=0.5, momentum=0.9)
    store.load_optimizer_states(tmp_path / 's.pt')
    store.pushpull(1, torch.ones(2, 2), out=out)                   # momentum survived
    assert torch.allclose(out, torch.full((2, 2), -0.5 - 0.5 * 1.9))
    with pytest.raises(kv.KVError, match=r"key 'a': pull into float32\[4\] but the key holds float32\[3\]"):
        store.pull('a', out=torch.empty(4))
    with pytest.raises(kv.KVError, match="key 'b' was never initialised"):
        store.push('b', torch.ones(1))
    with pytest.raises(ValueError, match='unknown kvstore kind'):
        kv.create('dist')


def test_keys_without_optimizer_are_summed_not_updated():
    """init(..., optimizer=False): the optimizer leaves the key alone (the Trainer's
    BatchNorm statistics): a push replaces its value by the sum of the pushes."""
    store = kv.create('local')
    store.init('w', torch.zeros(2))
    store.init('stats', torch.zeros(2), optimizer=False)
    store.set_optimizer('sgd', lr=0.5, weight_decay=0.1)
    out = torch.empty(2)
    store.pushpull('w', torch.ones(2), out=out)
    assert (out == -0.5).all()
    store.pushpull('stats', [torch.ones(2), torch.full((2,), 2.0)], out=out)
    assert (out == 3.0).all()


def test_dist_store_outside_a_job_says_how_to_start_one(use_config):
    use_config({})
    with pytest.raises(RuntimeError, match='d2l-launch'):
        kv.create('dist_sync')


def test_import_d2ldist_does_not_import_torch():
    code = 'import sys, d2ldist; assert "torch" not in sys.modules; d2ldist.kv.KVStore; assert "torch" in sys.modules'
    path = os.pathsep.join([str(ROOT)] + [p for p in os.environ.get('PYTHONPATH', '').split(
        os.pathsep) if p])                 # (keep where the packages are, if set)
    subprocess.run([sys.executable, '-c', code], check=True,
                   env=dict(os.environ, PYTHONPATH=path))


def test_loading_a_state_of_another_optimizer_is_refused():
    with pytest.raises(ValueError, match=r"key 'w': state \['momentum_buffer'\] is not a state of adam"):
        Updater('adam').load_state('w', {'momentum_buffer': torch.zeros(3)}, 3)
    with pytest.raises(ValueError, match='has 4 elements, the key 3'):
        Updater('sgd').load_state('w', {'momentum_buffer': torch.zeros(4)}, 3)


def test_servers_follow_mxnet_rescale_grad_and_multi_precision():
    """rescale_grad is 1 unless given (MXNet's default: the servers apply the sum), and
    multi_precision keeps a float32 master of a float16 weight, so small steps add up."""
    w = torch.zeros(3)
    Updater('sgd', lr=1.0)('w', w, torch.full((3,), 6.0))
    assert w.tolist() == [-6.0] * 3                             # the sum, not an average
    w16, plain, up = torch.ones(4, dtype=torch.float16), torch.ones(4, dtype=torch.float16), \
        Updater('sgd', lr=1e-4, multi_precision=True)
    for _ in range(10):                      # 1 - 1e-4 rounds back to 1 in float16
        up('w', w16, torch.ones(4, dtype=torch.float16))
        Updater('sgd', lr=1e-4)('w', plain, torch.ones(4, dtype=torch.float16))
    assert plain.tolist() == [1.0] * 4 and up.masters['w'].dtype == torch.float32
    assert abs(up.masters['w'][0].item() - (1 - 1e-3)) < 1e-6
    assert torch.equal(w16, up.masters['w'].half())
    Updater('sgd', lr=0.1, multi_precision=False)              # MXNet scripts pass either


def test_mxnet_names_for_kinds_and_pushpull_in_place():
    """MXNet's type names, broadcast, and pushpull without out (in place)."""
    for name in ('device', 'local_update_cpu', 'local_allreduce_cpu', 'local_allreduce_device'):
        store = kv.create(name)
        assert store.type == name and isinstance(store, kv.LocalKVStore)
    with pytest.raises(ValueError, match="kvstore 'nccl' is not a parameter server"):
        kv.create('nccl')
    with pytest.raises(StartError, match="^kvstore 'dist_device_sync' runs in a job"):
        kv.create('dist_device_sync')                         # known: dist_sync_device
    with pytest.raises(StartError, match="^2 workers started by mpirun, but kvstore"):
        with patch.dict(os.environ, OMPI_COMM_WORLD_RANK='0', OMPI_COMM_WORLD_SIZE='2'):
            kv.create('dist_sync')
    store = kv.create('local')
    out = torch.empty(2)
    store.broadcast('w', torch.tensor([1.0, 2.0]), out=out)
    assert out.tolist() == [1.0, 2.0]
    grad = torch.tensor([3.0, 4.0])
    store.pushpull('w', grad)                                 # no optimizer: the sum, in place
    assert grad.tolist() == [3.0, 4.0]
    store.set_optimizer('sgd', learning_rate=0.5)
    assert store.optimizer == ('sgd', {'lr': 0.5})
    w = torch.tensor([3.0, 4.0])
    store.pushpull('w', w)                                    # weights updated into w
    assert w.tolist() == [1.5, 2.0]


def test_sparse_rows_lazy_update_and_row_sparse_pull():
    """A sparse push updates only its rows (MXNet's lazy update: momentum and weight decay
    leave the other rows alone), equal to torch.optim on those rows; row_sparse_pull fills
    only the rows asked for."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    store = kv.create('local')
    store.init('emb', emb.weight.detach())
    store.set_optimizer('sgd', lr=0.1, momentum=0.9, weight_decay=0.01)
    touched = torch.tensor([2, 5, 7])
    ref = emb.weight.detach()[touched].clone().requires_grad_()
    opt = torch.optim.SGD([ref], lr=0.1, momentum=0.9, weight_decay=0.01)
    before = emb.weight.detach().clone()
    for step in range(3):
        emb.zero_grad()
        emb(torch.tensor([[2, 5], [7, 5]])).pow(2).sum().backward()
        assert emb.weight.grad.is_sparse
        dense = emb.weight.grad.to_dense()
        store.push('emb', emb.weight.grad)
        ref.grad = dense[touched]
        opt.step()
        out = torch.full((10, 4), -1.0)
        store.row_sparse_pull('emb', out=out, row_ids=touched)
        assert torch.allclose(out[touched], ref.detach(), atol=1e-6)
        assert (out[[0, 1, 3, 4, 6, 8, 9]] == -1).all()        # only the rows asked for
        with torch.no_grad():
            emb.weight[touched] = out[touched]
    whole = torch.empty(10, 4)
    store.pull('emb', out=whole)
    untouched = [0, 1, 3, 4, 6, 8, 9]
    assert torch.equal(whole[untouched], before[untouched])   # weight decay did not touch them
    with pytest.raises(kv.KVError, match='row ids outside'):
        store.row_sparse_pull('emb', out=whole, row_ids=[10])


class _Msg(dict):
    """A received message as read_row_parts sees it: header fields and frames."""

    def __init__(self, parts, frames):
        super().__init__(parts=parts)
        self.frames = frames


def test_malformed_row_parts_are_refused():
    """Row ids out of range, not increasing, counts that do not match, wrong frames:
    each is a KVError (the server answers it and goes on), never a crash."""
    from d2ldist.kv.messages import read_row_parts
    ids = lambda *r: bytearray(torch.tensor(r, dtype=torch.int64).numpy().tobytes())
    vals = lambda n: bytearray(torch.ones(n).numpy().tobytes())
    good = _Msg([['e', 'float32', [7, 3], 0, 21, 6]], [ids(1, 3), vals(6)])
    (key, *_, positions, values), = read_row_parts(good, with_values=True)
    assert key == 'e' and positions.tolist() == [3, 4, 5, 9, 10, 11] and values.numel() == 6
    for parts, frames in [
            ([['e', 'float32', [7, 3], 0, 21, 6]], [ids(3, 1), vals(6)]),      # not increasing
            ([['e', 'float32', [7, 3], 0, 21, 3]], [ids(7), vals(3)]),         # row 7 of 7
            ([['e', 'float32', [7, 3], 0, 21, 5]], [ids(1, 3), vals(5)]),      # count wrong
            ([['e', 'float32', [7, 3], 0, 21, 6]], [ids(1, 3), vals(5)]),      # frame short
            ([['e', 'float32', [7, 3], 0, 21, 6]], [bytearray(7), vals(6)]),    # half an id
            ([['e', 'float32', [7, 3], 0, 21]], [ids(1), vals(3)]),            # no count
            ([['e', 'float32', [], 0, 1, 0]], [ids(), vals(0)]),               # no rows
            ([['e', 'complex', [7, 3], 0, 21, 3]], [ids(1), vals(3)]),         # dtype
            ('parts', [])]:
        with pytest.raises(kv.KVError):
            read_row_parts(_Msg(parts, frames), with_values=True)


def test_a_server_copies_a_value_before_an_update_only_while_it_is_being_sent():
    """Values go out from the server's own memory (no copy); an update copies the value
    first only if a send of it has not finished (it would change bytes on their way)."""
    from types import SimpleNamespace
    from d2ldist.kv.server import KVServer, Slot
    server = KVServer(SimpleNamespace(num_workers=1, id='server:0', peers=lambda role: [role + ':0']))
    server.store['w'] = Slot('float32', [2], 0, 2, torch.zeros(2))
    on_the_way = [True]
    server.lend(['w'], lambda: not on_the_way[0])
    server.lend(['w'], lambda: True)                 # (another worker's: sent)
    value = server.store['w'].value
    assert server.writable('w') is not value            # a copy: the first is still going
    on_the_way[0] = False
    value = server.store['w'].value
    server.lend(['w'], lambda: not on_the_way[0])
    assert server.writable('w') is value                # all sent: updated in place
    assert server.writable('w') is value and server.lent == {}


# -- MXNet's arguments that gluon's Trainer passes (issue 30) --------------------------------
def test_priority_is_taken_everywhere_and_calls_run_in_the_order_made():
    """MXNet's ``priority=``: push, pull, pushpull, broadcast, row_sparse_pull take it;
    a call is done when it returns, so a later call of higher priority sees an earlier
    one of lower priority, and the values are those of the same calls without it."""
    def run(p):
        store = kv.create('local')
        store.set_optimizer('sgd', learning_rate=0.5)
        out, w = torch.empty(2, 3), torch.zeros(2, 3)
        store.broadcast('w', torch.ones(2, 3), out=out, **p(0))
        store.push('w', torch.arange(6.).view(2, 3), **p(-5))
        store.pull('w', out=out, **p(10))                  # sees the push before it
        store.pushpull('w', torch.ones(2, 3), out=w, **p(-1))
        rows = torch.full((2, 3), -1.0)
        store.row_sparse_pull('w', out=rows, row_ids=[1], **p(3))
        return out, w, rows
    plain, prioritised = run(lambda i: {}), run(lambda i: {'priority': i})
    assert all(torch.equal(a, b) for a, b in zip(plain, prioritised))
    out, w, rows = prioritised
    assert out.tolist() == [[1.0, 0.5, 0.0], [-0.5, -1.0, -1.5]]     # 1 - 0.5 * arange
    assert torch.equal(w, out - 0.5) and torch.equal(rows[1], w[1]) and (rows[0] == -1).all()


@pytest.mark.parametrize('bad', [1.0, '1', True, None, torch.tensor(1), [0]])
def test_a_priority_that_is_not_an_int_is_one_line_error(bad):
    store = kv.create('local')
    store.init('w', torch.zeros(2))
    for call in (lambda: store.push('w', torch.ones(2), priority=bad),
                 lambda: store.pull('w', out=torch.empty(2), priority=bad),
                 lambda: store.pushpull('w', torch.ones(2), priority=bad),
                 lambda: store.row_sparse_pull('w', torch.empty(2), bad, [0])):
        with pytest.raises(TypeError, match='priority must be an int') as e:
            call()
        assert '\n' not in str(e.value)
    import numpy as np
    store.push('w', torch.ones(2), priority=np.int64(-3))     # numpy's ints are ints


def test_row_sparse_pull_takes_mxnets_order_and_says_so_to_the_old_one():
    """row_sparse_pull(key, out=None, priority=0, row_ids=None), as MXNet's."""
    store = kv.create('local')
    store.init('e', torch.arange(12.).view(4, 3))
    out = torch.zeros(4, 3)
    store.row_sparse_pull('e', out, -2, torch.tensor([3, 1]))        # all positional
    assert out.sum(1).tolist() == [0.0, 12.0, 0.0, 30.0]
    with pytest.raises(TypeError, match=r'pass the rows by name, row_ids=\.\.\.'):
        store.row_sparse_pull('e', out, [3, 1])                     # rows where priority goes
    with pytest.raises(ValueError, match='needs out= and row_ids='):
        store.row_sparse_pull('e', out)


def test_pull_leaves_a_sparse_out_alone_unless_told_not_to_ignore_it():
    """MXNet's ignore_sparse (default True): a row_sparse out -- here a sparse tensor,
    such as an embedding's gradient -- is skipped by pull, with a warning; dense copies
    of the same key are pulled. ignore_sparse=False: it gets every row."""
    store = kv.create('local')
    store.init('e', torch.arange(12.).view(4, 3))
    sparse = torch.sparse_coo_tensor([[2]], torch.full((1, 3), 7.0), (4, 3), check_invariants=True)
    dense = torch.zeros(4, 3)
    with pytest.warns(UserWarning, match="key 'e': a sparse out is left as it is"):
        store.pull('e', out=[dense, sparse])
    assert torch.equal(dense, torch.arange(12.).view(4, 3))
    assert sparse._indices().tolist() == [[2]] and (sparse._values() == 7).all()
    with pytest.warns(UserWarning):
        store.pull('e', out=sparse)                             # only sparse: nothing pulled
    store.pull('e', out=sparse, ignore_sparse=False)
    assert sparse.is_sparse and torch.equal(sparse.to_dense(), dense)
    assert sparse.sparse_dim() == 1 and sparse._nnz() == 4        # row-sparse: every row
    with pytest.raises(ValueError, match='pull needs out='):
        store.pull('e')


def test_barrier_by_mxnets_name_is_the_same_call():
    """gluon's Trainer calls kv._barrier(): it is barrier(), named the same to the
    scheduler (which fails workers whose n-th barriers differ), so the two mix."""
    from types import SimpleNamespace
    from d2ldist.kv.worker import DistKVStore
    calls = []
    store = DistKVStore.__new__(DistKVStore)
    store._node = SimpleNamespace(barrier=lambda group, what: calls.append((group, what)))
    store._barrier()
    store.barrier()
    assert calls == [('worker', 'barrier()')] * 2
    assert kv.create('local')._barrier() is None                 # one process: nothing to wait for


def test_a_sync_round_adds_the_pushes_in_rank_order_whatever_order_they_come_in():
    """(1e8 + -1e8) + 1 is 1 in float32, (1e8 + 1) + -1e8 is 0: the sum is the rank
    order's, for every order of arrival, and a rank that never pushed (lost) is skipped."""
    import itertools
    from d2ldist.kv.messages import Part, RowPart
    from d2ldist.kv.server import Round
    like = torch.zeros(2)

    def part(x):
        return Part(0, 'float32', [2], 0, 2, torch.tensor([x, 2 * x], dtype=torch.float32))

    pushes = {'worker:0': 1e8, 'worker:1': -1e8, 'worker:2': 1.0}
    for order in itertools.permutations(pushes):
        r = Round()
        for worker in order:
            r.add(worker, part(pushes[worker]), like)
        assert r.total(like).tolist() == [1.0, 2.0], order
    for order in itertools.permutations(['worker:0', 'worker:2', 'worker:3']):   # 1 lost
        r = Round()
        for worker in order:
            r.add(worker, part({'worker:0': 1e8, 'worker:2': 1.0, 'worker:3': -1e8}[worker]),
                  like)
        assert r.total(like).tolist() == [0.0, 0.0], order      # ((1e8 + 1) + -1e8)
    rows = Round()                        # a sparse key's rows: the same order, the rows seen
    rows.add('worker:1', RowPart(0, 'float32', [2], 0, 2, torch.tensor([1]),
                                 torch.tensor([-1e8])), like)
    rows.add('worker:0', RowPart(0, 'float32', [2], 0, 2, torch.tensor([1]),
                                 torch.tensor([1e8])), like)
    rows.add('worker:2', RowPart(0, 'float32', [2], 0, 2, torch.tensor([1]),
                                 torch.tensor([1.0])), like)
    assert rows.total(like).tolist() == [0.0, 1.0] and rows.touched.tolist() == [False, True]


def test_between_hosts_a_worker_pushes_to_the_servers_in_turn():
    """The cost model's order (d2ldist/cost.py): to another host, a push's big frames have
    left before the next server's push starts (its trackers waited for); the last is not
    waited for, and on one host (no link to share) nothing is."""
    import itertools
    from types import SimpleNamespace
    from d2ldist.kv import messages as M
    from d2ldist.kv.worker import DistKVStore

    def ask(leaves_host):
        events, answers = [], []

        def send(server, kind, header, frames, track):
            events.append(('send', server))
            answers.append(SimpleNamespace(kind=M.ACK, get=dict(id=header['id']).get,
                                           frames=[], sender=server))
            return [f'frames to {server}'] if track else []

        def wait_sent(trackers, timeout):
            if trackers:
                events.append(('wait', trackers))

        store = DistKVStore.__new__(DistKVStore)
        store._ids = itertools.count()
        store._node = SimpleNamespace(
            head=lambda shard: f'server:{shard}', send=send,
            van=SimpleNamespace(leaves_host=lambda peer: leaves_host, wait_sent=wait_sent),
            recv=lambda kinds, wait: answers.pop(0))
        store._ask([(s, M.PUSH, {}, [b'x' * 100_000]) for s in range(3)])
        return events

    assert ask(leaves_host=True) == [
        ('send', 'server:0'), ('wait', ['frames to server:0']),
        ('send', 'server:1'), ('wait', ['frames to server:1']), ('send', 'server:2')]
    assert ask(leaves_host=False) == [('send', 'server:0'), ('send', 'server:1'),
                                      ('send', 'server:2')]
