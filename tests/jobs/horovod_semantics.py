"""Issue 33: Horovod's semantics where its own tests found d2ldist wanting, in a real job.

    d2l-launch -n 2 -s 0 python tests/jobs/horovod_semantics.py d2ldist.horovod

The argument is the module to import as hvd (``d2ldist`` or ``d2ldist.horovod``). Each
check is one cause of the issue; it names the tests of Horovod's
``test/parallel/test_torch.py`` whose semantics it checks, and prints one line,
'worker R: CHECK ok', followed by a line 'worker R of N: ok' at the end. A failed check
exits non-zero at once (the workers may be out of step after it).
"""
import importlib
import sys
import warnings

import torch
from torch import nn

hvd = importlib.import_module(sys.argv[1] if len(sys.argv) > 1 else 'd2ldist')
hvd.init()
r, N = hvd.rank(), hvd.size()
odd = r % 2 == 1


def check(ok, what):
    if not ok:
        sys.exit(f'worker {r}: FAILED {what}')


def in_step(after, big=False):
    """The workers still run collectives together: a small all-reduce, and with ``big`` a
    many-chunk one (after a refused call: its chunks still on the way are dropped)."""
    check(torch.equal(hvd.allreduce(torch.ones(3), op=hvd.Sum), torch.full((3,), float(N))),
          f'a small all-reduce after {after}')
    if big:
        big = hvd.allreduce(torch.ones(3_000_000), op=hvd.Sum)    # 12 MB: several chunks
        check(bool((big == N).all()), f'a big all-reduce after {after}')


def raises(error, call, what):
    """call() must raise ``error`` here; the error, for more checks."""
    try:
        call()
    except error as e:
        return e
    check(False, f'{what}: no {error.__name__}')


def refused(call, what):
    """call() must raise RuntimeError on this worker (as on every other), then all go on."""
    raises(RuntimeError, call, what)
    in_step(what, big=True)


def refused_calls():
    """Every worker raises, and the next collective works (test_horovod_allreduce_error,
    _allreduce_type_error, _broadcast_error, _broadcast_type_error, _broadcast_rank_error,
    _allgather_error, _allgather_type_error, _alltoall_type_error, _alltoall_rank_error)."""
    refused(lambda: hvd.allreduce(torch.ones([17 + r] * 3)), 'allreduce of other shapes')
    refused(lambda: hvd.allreduce(torch.ones([17, 23 * 57] if r == 0 else [17, 23, 57])),
            'allreduce of as many values in another shape')
    other = torch.float32 if odd else torch.int32
    refused(lambda: hvd.allreduce(torch.ones([17] * 3, dtype=other)), 'allreduce of other dtypes')
    refused(lambda: hvd.allreduce(torch.ones(5), op=hvd.Max if odd else hvd.Sum), 'other ops')
    refused(lambda: hvd.broadcast(torch.ones([17 + r] * 3), root_rank=0),
            'broadcast of other shapes')
    refused(lambda: hvd.broadcast(torch.ones(7, dtype=other), 0),
            'broadcast of other dtypes')
    refused(lambda: hvd.broadcast(torch.ones(7), root_rank=r), 'broadcast from other roots')
    refused(lambda: hvd.allgather(torch.ones(17, 10 * (r + 1), 17)),
            'allgather of other row shapes')
    refused(lambda: hvd.allgather(torch.ones(3, 6) if r == 0 else torch.ones(3, 2, 3)),
            'allgather of rows as long in another shape')
    refused(lambda: hvd.allgather(torch.ones(3, 2, dtype=other)),
            'allgather of other dtypes')
    refused(lambda: hvd.alltoall(torch.ones(N, dtype=torch.int32 if odd else torch.float32)),
            'alltoall of other dtypes')
    refused(lambda: hvd.allreduce(torch.ones(3_000_000 + r)),
            'a many-chunk all-reduce of other sizes')
    refused(lambda: hvd.allreduce(torch.ones([9 + r])), 'a second refusal in a row')
    handle = hvd.allreduce_async(torch.ones([4 + r]))          # refused through a handle too
    refused(lambda: hvd.synchronize(handle), 'an async all-reduce of other shapes')
    # a dtype the collectives cannot send: a TypeError where it is, and the call fails on
    # the other workers too, instead of leaving them waiting; then on every worker
    for some in (True, False):
        for name, call in (('allreduce', hvd.allreduce), ('allgather', hvd.allgather),
                           ('broadcast', lambda X: hvd.broadcast(X, root_rank=0))):
            mine = odd or not some
            try:
                call(torch.ones(3, dtype=torch.complex64 if mine else torch.float32))
                check(False, f'{name} of complex64 was not refused')
            except TypeError as e:
                check(mine and 'do not support torch.complex64' in str(e), f'{name}: {e}')
            except RuntimeError as e:
                check(not mine and 'do not support' in str(e), f'{name}: {e}')
            in_step(f'{name} of complex64 on {"some" if some else "all"} workers', big=True)


def integer_scaling():
    """prescale/postscale: integers scaled in float64 and cast back, floats in their own
    dtype (test_horovod_allreduce_prescale, _postscale)."""
    for dtype in (torch.uint8, torch.int8, torch.int32, torch.int64, torch.float32,
                  torch.float64):
        t = torch.full((5,), 3, dtype=dtype)
        got = hvd.allreduce(t, op=hvd.Sum, prescale_factor=1.5)
        want = torch.full((5,), 3 * 1.5, dtype=torch.float64).to(dtype) * N
        check(got.dtype == dtype and torch.equal(got, want), f'prescale of {dtype}: {got}')
        got = hvd.allreduce(t, op=hvd.Sum, postscale_factor=0.5)
        want = (torch.full((5,), 3.0 * N, dtype=torch.float64) * 0.5).to(dtype)
        check(got.dtype == dtype and torch.equal(got, want), f'postscale of {dtype}: {got}')
    t = torch.tensor([-7, 7], dtype=torch.int32)             # float64 rounding toward zero
    got = hvd.allreduce(t, op=hvd.Sum, prescale_factor=0.5)
    check(torch.equal(got, torch.tensor([-3, 3], dtype=torch.int32) * N), f'-3.5 -> -3: {got}')


def duplicate_names():
    """A second operation with the name of one in flight: ValueError on the caller, on
    every worker, and nothing is sent (test_horovod_allreduce_duplicate_name_error,
    _allgather_..., _broadcast_...: each starts an operation it never synchronizes, and
    the next test uses the name again)."""
    t = torch.ones(17, 17)
    starts = {'allreduce': lambda: hvd.allreduce_async(t, name='duplicate_name'),
              'allgather': lambda: hvd.allgather_async(t, name='duplicate_name'),
              'broadcast': lambda: hvd.broadcast_async(t, root_rank=0, name='duplicate_name'),
              'grouped_allreduce': lambda: hvd.grouped_allreduce_async([t], name='duplicate_name'),
              'sparse_allreduce': lambda: hvd.sparse_allreduce_async(
                  t.to_sparse(), name='duplicate_name', op=hvd.Sum)}
    for kind, start in starts.items():
        first = start()                            # never waited for, as in Horovod's tests

        def ten_more():
            for _ in range(10):
                start()
        raises(ValueError, ten_more, f'a second {kind} named duplicate_name')
        in_step(f'{kind} with a duplicate name')   # waited: the first has ended, name free
        check(first.done(), f'the first {kind} has ended')
    handle = hvd.allreduce_async(t, name='held')   # waiting for its own handle frees it too
    hvd.synchronize(handle)
    check(torch.equal(hvd.synchronize(hvd.allreduce_async(t, name='held', op=hvd.Sum)), t * N),
          'the name again after synchronize')
    handle = hvd.allreduce_async(t, name='twice')
    raises(ValueError, lambda: hvd.allgather_async(t, name='twice'), 'another kind, same name')
    hvd.synchronize(handle)


def built():
    """What was built: Horovod's values (the reducescatter and alltoall tests ask)."""
    gpu = torch.cuda.is_available()
    nccl = gpu and torch.distributed.is_nccl_available()
    check(type(hvd.nccl_built()) is int and (hvd.nccl_built() > 0) == nccl and (
        not nccl or hvd.nccl_built() >= 2700), f'nccl_built {hvd.nccl_built()}')
    check(hvd.ccl_built() is False and hvd.ddl_built() is False and hvd.cuda_built() == gpu,
          'ccl_built, ddl_built, cuda_built')
    check(hvd.gloo_built() is True and hvd.mpi_built() is False, 'gloo_built, mpi_built')


def grouped():
    """grouped_allgather, and gradients through grouped collectives
    (test_horovod_grouped_allgather, _grouped_allgather_grad, _grouped_allreduce_grad,
    _grouped_allreduce_grad_average)."""
    xs = [torch.full((r + 1, 2), float(r), requires_grad=True),
          torch.full((2, 3), r + 1.0, requires_grad=True)]
    with torch.no_grad():
        plain = hvd.grouped_allgather(xs)
        pair = hvd.synchronize(hvd.grouped_allgather_async(xs, name='g'))
    rows = torch.cat([torch.full((i + 1, 2), float(i)) for i in range(N)])
    check(all(torch.equal(a, b) for a, b in zip(plain, pair)) and torch.equal(plain[0], rows)
          and torch.equal(plain[1], torch.cat([torch.full((2, 3), i + 1.0) for i in range(N)])),
          f'grouped_allgather {plain}')
    gathered = hvd.grouped_allgather(xs)
    gathered[0].backward(torch.cat([torch.full((i + 1, 2), float(i)) for i in range(N)]))
    check(torch.equal(xs[0].grad, torch.full((r + 1, 2), float(r))),   # the average's rows
          f'grouped_allgather grad {xs[0].grad}')
    summed = hvd.grouped_allreduce(xs[1:] + [xs[1] * 2], average=False)
    (summed[0].sum() + summed[1].sum()).backward()
    check(summed[0].requires_grad and torch.equal(xs[1].grad, torch.full((2, 3), 3.0 * N)),
          f'grouped_allreduce grad {xs[1].grad}')
    x = torch.ones(4, requires_grad=True)
    for s in hvd.grouped_allreduce([x, 3 * x], average=True):
        s.backward(torch.ones(4))
    check(torch.equal(x.grad, torch.full((4,), 4.0)), f'grouped Average grad {x.grad}')


def join_refuses():
    """A worker in join() makes the others' allgather and broadcast fail, and all go on
    (test_horovod_join_allgather, test_horovod_join_broadcast)."""
    for refused_call in ('allgather', 'broadcast'):
        if r == 0:
            last = hvd.join()
        else:
            if refused_call == 'allgather':
                e = raises(RuntimeError, lambda: hvd.allgather(torch.ones(17, 17, 17)),
                           'allgather while worker 0 is in join()')
            else:
                e = raises(RuntimeError, lambda: hvd.broadcast(torch.ones(17, 17, 17), 1),
                           'broadcast while worker 0 is in join()')
            check('called join()' in str(e), f'{refused_call} refused: {e}')
            last = hvd.join(hvd.local_rank())        # (a device, as Horovod's test gives)
        lasts = hvd.allgather(torch.tensor([last])).tolist()    # (arrival order decides it)
        check(len(set(lasts)) == 1 and 0 <= last < N, f'join returned {lasts}')
        in_step(f'join with {refused_call}')


def objects():
    """Objects keep their types, int keys included, and nothing is unpickled
    (test_broadcast_object, test_allgather_object)."""
    sent = {'hello': 123, 0: [1, 2], (1, 'a'): b'\x00\xff', 2.5: (None, True, float('inf')),
            None: {'nested': [(), {}]}}
    got = hvd.broadcast_object(sent if r == 0 else {}, root_rank=0)
    check(got == sent and [type(k) for k in got] == [type(k) for k in sent],
          f'broadcast_object {got}')
    mine = {'metric_val_1': r, **({'metric_val_2': 42} if r == 1 else {})}
    want = [{'metric_val_1': i, **({'metric_val_2': 42} if i == 1 else {})} for i in range(N)]
    check(hvd.allgather_object(mine) == want, 'allgather_object')
    e = raises(TypeError, lambda: hvd.broadcast_object(range(2) if r == 0 else None, 0),
               'a range from the root')                # on every worker, not only the root
    check('range' in str(e), f'the error names the type: {e}')
    raises(TypeError, lambda: hvd.allgather_object(range(2) if r == N - 1 else r), 'a range')
    sets = [{1, 'a', (2, b'x')}, frozenset({1.5, None}), {frozenset({1}): set()}]
    got = hvd.broadcast_object(sets if r == 0 else None, root_rank=0)
    check(got == sets and [type(x) for x in got] == [set, frozenset, dict], f'sets {got}')
    check(hvd.allgather_object({r}) == [{i} for i in range(N)], 'allgather_object of sets')
    in_step('objects')


class NoGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.tensor([1, 3], dtype=torch.int32), requires_grad=False)
        self.b = nn.Parameter(torch.rand(4))

    def forward(self, x):
        return self.b[self.a.long()] * x


def no_grad_broadcast():
    """broadcast after broadcast_optimizer_state, a parameter without gradient
    (test_broadcast_state_no_grad)."""
    model = NoGrad()
    opt = torch.optim.SGD(model.parameters(), lr=0.001, weight_decay=1e-6, momentum=0.9,
                          nesterov=True)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    grad = opt.param_groups[0]['params'][1].grad
    check(opt.param_groups[0]['params'][0].grad is None and grad is not None,
          'the gradients after broadcast_optimizer_state')
    check(torch.equal(hvd.broadcast(grad, root_rank=0), grad), 'broadcast of the gradient')
    raises(TypeError, lambda: hvd.broadcast(None, root_rank=0), 'broadcast(None)')
    return model


def optimizer():
    """DistributedOptimizer: _parameter_names, Horovod's warning, sparse gradients,
    sparse_allreduce_async (test_synchronize_step_warning, test_sparse_embeddings,
    test_horovod_sparse_allreduce's semantics on the CPU)."""
    model = NoGrad()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    check(opt._parameter_names == {model.a: 'a', model.b: 'b'}, 'named _parameter_names')
    plain = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    check(sorted(plain._parameter_names.values()) == ['allreduce.noname.0', 'allreduce.noname.1'],
          f'unnamed _parameter_names {plain._parameter_names}')
    lin = nn.Linear(1, 1)
    hvd.broadcast_parameters(lin.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(lin.parameters(), lr=0.1),
                                   named_parameters=lin.named_parameters())
    opt.zero_grad()
    (lin(torch.zeros(1, 1)) - 1).pow(2).mean().backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(lin.parameters(), 0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        opt.step()
    check([str(w.message) for w in caught] == [
        'optimizer.step() called without optimizer.skip_synchronize() context after '
        'optimizer.synchronize(). This can cause training slowdown. You may want to '
        'consider using optimizer.skip_synchronize() context if you use '
        'optimizer.synchronize() in your code.'], f'the warning: {caught}')
    with warnings.catch_warnings(record=True) as caught:        # the right way: silent
        warnings.simplefilter('always')
        opt.zero_grad()
        (lin(torch.zeros(1, 1)) - 1).pow(2).mean().backward()
        opt.synchronize()
        with opt.skip_synchronize():
            opt.step()
    check(caught == [], f'skip_synchronize warned: {caught}')
    for sparse_as_dense in (False, True):
        emb = nn.Embedding(6, 2, sparse=True)
        hvd.broadcast_parameters(emb.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=1.0),
                                       named_parameters=emb.named_parameters(),
                                       sparse_as_dense=sparse_as_dense)
        before = emb.weight.detach().clone()
        emb(torch.tensor([r, r + 1])).sum().backward()
        opt.step()
        uses = torch.zeros(6)
        for i in range(N):
            uses[i:i + 2] += 1
        check(emb.weight.grad.is_sparse and         # sparse either way, as Horovod's
              torch.allclose(emb.weight, before - (uses / N)[:, None]),
              f'sparse gradients averaged ({sparse_as_dense=}) {emb.weight.grad}')
    for sparse_as_dense in (False, True):          # SparseAdam takes sparse gradients only
        emb = nn.Embedding(6, 2, sparse=True)
        hvd.broadcast_parameters(emb.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters()), lr=0.1),
                                       sparse_as_dense=sparse_as_dense)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        opt.zero_grad()
        emb(torch.tensor([r, r + 1])).sum().backward()
        opt.step()
        check(emb.weight.grad.is_sparse and torch.equal(
            hvd.broadcast(emb.weight.detach(), root_rank=0), emb.weight.detach()),
            f'SparseAdam ({sparse_as_dense=})')
    mine = torch.sparse_coo_tensor([[r]], [[1.0, 2.0]], (N + 1, 2), check_invariants=True)
    for op, scale in ((hvd.Sum, 1.0), (hvd.Average, 1.0 / N)):
        got = hvd.sparse_allreduce_async(mine, name='sparse', op=op)()   # (Horovod's: call it)
        want = torch.zeros(N + 1, 2)
        want[:N] = torch.tensor([1.0, 2.0]) * scale
        check(got.is_sparse and torch.allclose(got.to_dense(), want), f'sparse_allreduce {got}')


def alltoall():
    """Horovod's alltoall: the rows alone without splits, with them also the counts; its
    ValueErrors; its gradient (test_horovod_alltoall, _equal_split, _equal_split_length_error,
    _splits_error, _splits_type_error, _grad, _equal_split_grad)."""
    sent = torch.cat([torch.full((r + 1, 2), float(i)) for i in range(N)])   # rows for i
    got, counts = hvd.alltoall(sent, torch.tensor([r + 1] * N, dtype=torch.int32))
    check(bool((got == r).all()) and got.shape == (N * (N + 1) // 2, 2) and
          counts.dtype == torch.int32 and counts.tolist() == list(range(1, N + 1)),
          f'alltoall with splits {got.tolist()} {counts}')
    even = torch.arange(2 * N, dtype=torch.float64) + 100 * r
    got = hvd.alltoall(even)
    check(torch.is_tensor(got) and got.tolist() == [100.0 * i + k for i in range(N)
                                                    for k in (2 * r, 2 * r + 1)],
          f'alltoall in equal parts {got}')
    raises(ValueError, lambda: hvd.alltoall(torch.ones(N + 1)), 'rows not a multiple of N')
    raises(ValueError, lambda: hvd.alltoall(torch.ones(N - 1), torch.ones(N, dtype=torch.int32)),
           'splits adding up to more rows')
    raises(ValueError, lambda: hvd.alltoall(torch.ones(N), torch.ones(N)), 'float splits')
    x = even.clone().requires_grad_()
    y = hvd.alltoall(x)
    y.backward(torch.arange(2 * N, dtype=torch.float64))        # what came from i: rows 2i..
    check(x.grad.tolist() == [2.0 * r + k for _ in range(N) for k in (0, 1)],
          f'alltoall grad {x.grad}')                  # each worker sent back rows 2r, 2r+1
    in_step('alltoall')


def reducescatter():
    """Horovod's newer reducescatter calls: _async, grouped (and _async), prescale_factor and
    postscale_factor, gradients (test_horovod_reducescatter, _average, _prescale,
    _postscale, _grad, _grad_average, grouped_reducescatter, _average, _grad)."""
    rows = [len(range(N * 2 + 1)[i::N]) for i in range(N)]      # 2N + 1 rows: uneven
    start = sum(rows[:r])
    x = torch.arange((2 * N + 1) * 3, dtype=torch.float64).reshape(-1, 3) + r
    mine = (x * N - r * N + sum(range(N)))[start:start + rows[r]]      # the sum's rows
    got = hvd.synchronize(hvd.reducescatter_async(x, name='rs', op=hvd.Sum))
    check(torch.equal(got, mine), f'reducescatter_async {got}')
    got = hvd.reducescatter(x, op=hvd.Average, prescale_factor=2.0, postscale_factor=0.5)
    check(torch.allclose(got, mine / N), f'reducescatter scaled {got}')
    i = torch.full((N * 2,), 3, dtype=torch.int32)
    got = hvd.reducescatter(i, op=hvd.Sum, prescale_factor=1.5)
    check(got.dtype == torch.int32 and torch.equal(got, torch.full((2,), 4 * N, dtype=torch.int32)),
          f'reducescatter of integers scaled in float64 {got}')
    pair = hvd.grouped_reducescatter([x, i], op=hvd.Sum, postscale_factor=2.0)
    check(torch.equal(pair[0], 2 * mine) and torch.equal(pair[1], torch.full((2,), 6 * N,
          dtype=torch.int32)), f'grouped_reducescatter {pair}')
    pair = hvd.synchronize(hvd.grouped_reducescatter_async([x, x], name='grs', op=hvd.Average))
    check(all(torch.allclose(p, mine / N) for p in pair), f'grouped_reducescatter_async {pair}')
    for op, workers in ((hvd.Sum, N), (hvd.Average, 1)):       # Horovod's gradients
        xs = [torch.ones(N * 4, 3, requires_grad=True) for _ in range(2)]
        hvd.reducescatter(xs[0], op=op, prescale_factor=3.0).backward(torch.ones(4, 3))
        for y in hvd.grouped_reducescatter([xs[1]], op=op):
            y.backward(torch.full((4, 3), r + 1.0))            # rank order: gathered back
        want = torch.cat([torch.full((4, 3), i + 1.0) for i in range(N)]) * workers
        check(torch.equal(xs[0].grad, torch.full((N * 4, 3), 3.0 * workers)) and
              torch.equal(xs[1].grad, want), f'reducescatter grads {op}: {xs[0].grad} {xs[1].grad}')
    in_step('reducescatter')


def negotiated():
    """A named operation that only one worker has asked for does not hold the barrier,
    as Horovod's negotiation by name (test_horovod_allreduce_duplicate_name_error: rank 0
    asks first, all meet at a barrier, the others ask); HorovodInternalError."""
    t = torch.ones(5)
    if r == 0:
        first = hvd.allreduce_async(t, name='asked_here_first', op=hvd.Sum)
    hvd.barrier()
    if r > 0:
        first = hvd.allreduce_async(t, name='asked_here_first', op=hvd.Sum)
    hvd.barrier()
    check(torch.equal(hvd.synchronize(first), t * N), 'the named all-reduce after barriers')
    check(issubclass(hvd.HorovodInternalError, RuntimeError) and
          hvd.HorovodInternalError is hvd.elastic.HorovodInternalError, 'HorovodInternalError')
    in_step('negotiated')


CHECKS = [refused_calls, integer_scaling, duplicate_names, built, grouped, join_refuses,
          objects, no_grad_broadcast, optimizer, alltoall, reducescatter, negotiated]
for run in CHECKS:
    run()
    print(f'worker {r}: {run.__name__} ok', flush=True)
in_step('everything', big=True)
hvd.barrier()
print(f'worker {r} of {N}: ok', flush=True)
