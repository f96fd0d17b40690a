"""Issue 33: Horovod's semantics where its own tests found d2ldist wanting, in a real job.

    d2l-launch -n 2 -s 0 python tests/jobs/horovod_semantics.py d2ldist.horovod

The argument is the module to import as hvd (``d2ldist`` or ``d2ldist.horovod``). Prints
one 'ok' line per worker, or exits non-zero at the first failed check.
"""
import importlib
import sys
import warnings

import torch
from torch import nn

hvd = importlib.import_module(sys.argv[1] if len(sys.argv) > 1 else 'd2ldist')
hvd.init()
r, N = hvd.rank(), hvd.size()


def check(ok, what):
    if not ok:
        sys.exit(f'worker {r}: FAILED {what}')


def in_step(after):
    """The workers still run collectives together: a small and a many-chunk all-reduce."""
    check(torch.equal(hvd.allreduce(torch.ones(3), op=hvd.Sum), torch.full((3,), float(N))),
          f'a small all-reduce after {after}')
    big = hvd.allreduce(torch.ones(3_000_000), op=hvd.Sum)    # 12 MB: several chunks
    check(bool((big == N).all()), f'a big all-reduce after {after}')


def refused(call, what):
    """call() must raise RuntimeError on this worker (as on every other), then go on."""
    try:
        call()
    except RuntimeError:
        in_step(what)
        return
    check(False, f'{what} was not refused')


# -- 1. a refused call leaves the workers in step (test_horovod_allreduce_error,
# -- _allreduce_type_error, _broadcast_error, _broadcast_type_error, _broadcast_rank_error,
# -- _allgather_error, _allgather_type_error) ----------------------------------------
odd = r % 2 == 1
refused(lambda: hvd.allreduce(torch.ones([17 + r] * 3)), 'allreduce of other shapes')
refused(lambda: hvd.allreduce(torch.ones([17] * 3, dtype=torch.float32 if odd else torch.int32)),
        'allreduce of other dtypes')
refused(lambda: hvd.allreduce(torch.ones(5), op=hvd.Max if odd else hvd.Sum), 'other ops')
refused(lambda: hvd.broadcast(torch.ones([17 + r] * 3), root_rank=0), 'broadcast of other shapes')
refused(lambda: hvd.broadcast(torch.ones(7, dtype=torch.float32 if odd else torch.int32), 0),
        'broadcast of other dtypes')
refused(lambda: hvd.broadcast(torch.ones(7), root_rank=r), 'broadcast from other roots')
refused(lambda: hvd.allgather(torch.ones(17, 10 * (r + 1), 17)), 'allgather of other row shapes')
refused(lambda: hvd.allgather(torch.ones(3, 2, dtype=torch.float32 if odd else torch.int32)),
        'allgather of other dtypes')
refused(lambda: hvd.allreduce(torch.ones(3_000_000 + r)), 'a many-chunk all-reduce of other sizes')
refused(lambda: hvd.allreduce(torch.ones([9 + r])), 'a second refusal in a row')
handle = hvd.allreduce_async(torch.ones([4 + r]))          # refused through a handle too
refused(lambda: hvd.synchronize(handle), 'an async all-reduce of other shapes')
# a dtype the collectives cannot send: a TypeError where it is, and the call fails on the
# other workers too, instead of leaving them waiting; then on every worker
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
        in_step(f'{name} of complex64 on {"some" if some else "all"} workers')

# -- 2. prescale/postscale on integers: scaled in float64, cast back
# -- (test_horovod_allreduce_prescale, _postscale) ---------------------------------
for dtype in (torch.uint8, torch.int8, torch.int32, torch.int64, torch.float32, torch.float64):
    t = torch.full((5,), 3, dtype=dtype)
    got = hvd.allreduce(t, op=hvd.Sum, prescale_factor=1.5)
    want = torch.full((5,), 3 * 1.5, dtype=torch.float64).to(dtype) * N
    check(got.dtype == dtype and torch.equal(got, want), f'prescale of {dtype}: {got}')
    got = hvd.allreduce(t, op=hvd.Sum, postscale_factor=0.5)
    want = (torch.full((5,), 3.0 * N, dtype=torch.float64) * 0.5).to(dtype)
    check(got.dtype == dtype and torch.equal(got, want), f'postscale of {dtype}: {got}')

# -- 3. two operations in flight with one name: the second raises ValueError on the
# -- caller (test_horovod_allreduce_duplicate_name_error, _allgather_..., _broadcast_...)
t = torch.ones(17, 17)
for start in (lambda: hvd.allreduce_async(t, name='twice'),
              lambda: hvd.allgather_async(t, name='twice'),
              lambda: hvd.broadcast_async(t, root_rank=0, name='twice')):
    first = start()
    try:
        start()
        check(False, 'a second operation with the same name was not refused')
    except ValueError:
        pass
    hvd.synchronize(first)            # the name is free again
    hvd.synchronize(start())
in_step('duplicate names')

# -- 4. objects keep their types, int keys included (test_broadcast_object,
# -- test_allgather_object) -----------------------------------------------------------
sent = {'hello': 123, 0: [1, 2], (1, 'a'): b'\x00\xff', 2.5: (None, True, float('inf'))}
got = hvd.broadcast_object(sent if r == 0 else {}, root_rank=0)
check(got == sent, f'broadcast_object {got}')
check(hvd.allgather_object({r: (r, str(r))}) == [{i: (i, str(i))} for i in range(N)],
      'allgather_object')


# -- 5. broadcast after broadcast_optimizer_state, a parameter without gradient
# -- (test_broadcast_state_no_grad) --------------------------------------------------
class NoGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.tensor([1, 3], dtype=torch.int32), requires_grad=False)
        self.b = nn.Parameter(torch.rand(4))

    def forward(self, x):
        return self.b[self.a.long()] * x


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
try:
    hvd.broadcast(None, root_rank=0)
    check(False, 'broadcast(None) was not refused')
except TypeError:
    pass

# -- 6. DistributedOptimizer: _parameter_names, and the warning
# -- (test_synchronize_step_warning; _parameter_names as Horovod's tests read it) ------
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
check(len(caught) == 1 and 'optimizer.step() called without optimizer.skip_synchronize()'
      in str(caught[0].message), f'the warning: {[str(w.message) for w in caught]}')

# -- 7. grouped allgather, and gradients through a grouped allreduce
# -- (test_horovod_grouped_allgather, _grouped_allgather_grad, _grouped_allreduce_grad) --
xs = [torch.full((r + 1, 2), float(r), requires_grad=True), torch.full((2, 3), r + 1.0,
                                                                        requires_grad=True)]
with torch.no_grad():
    plain = hvd.grouped_allgather(xs)
    pair = hvd.synchronize(hvd.grouped_allgather_async(xs, name='g'))
rows = torch.cat([torch.full((i + 1, 2), float(i)) for i in range(N)])
check(all(torch.equal(a, b) for a, b in zip(plain, pair)) and torch.equal(plain[0], rows)
      and torch.equal(plain[1], torch.cat([torch.full((2, 3), i + 1.0) for i in range(N)])),
      f'grouped_allgather {plain}')
gathered = hvd.grouped_allgather(xs)
gathered[0].backward(torch.ones_like(gathered[0]))
check(torch.equal(xs[0].grad, torch.ones(r + 1, 2)), f'grouped_allgather grad {xs[0].grad}')
summed = hvd.grouped_allreduce(xs[1:] + [xs[1] * 2], average=False)
(summed[0].sum() + summed[1].sum()).backward()
check(summed[0].requires_grad and torch.equal(xs[1].grad, torch.full((2, 3), 3.0 * N)),
      f'grouped_allreduce grad {xs[1].grad}')

# -- 8. sparse gradients: nn.Embedding(sparse=True) in DistributedOptimizer, and
# -- sparse_allreduce_async (test_horovod_sparse_allreduce's semantics, on the CPU) ------
emb = nn.Embedding(6, 2, sparse=True)
hvd.broadcast_parameters(emb.state_dict(), root_rank=0)
opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=1.0),
                               named_parameters=emb.named_parameters())
before = emb.weight.detach().clone()
emb(torch.tensor([r, r + 1])).sum().backward()
opt.step()
uses = torch.zeros(6)
for i in range(N):
    uses[i:i + 2] += 1
check(emb.weight.grad.is_sparse and torch.allclose(emb.weight, before - (uses / N)[:, None]),
      f'sparse gradients averaged {emb.weight.grad}')
mine = torch.sparse_coo_tensor([[r]], [[1.0, 2.0]], (6, 2), check_invariants=True)
got = hvd.synchronize(hvd.sparse_allreduce_async(mine, name='sparse', op=hvd.Sum))
want = torch.zeros(6, 2)
want[:N] = torch.tensor([1.0, 2.0])
check(got.is_sparse and torch.equal(got.to_dense(), want), f'sparse_allreduce_async {got}')

# -- 9. what was built: Horovod's values (the reducescatter and alltoall tests ask) ------
gpu = torch.cuda.is_available()
check(type(hvd.nccl_built()) is int and (hvd.nccl_built() > 0) == (
    gpu and torch.distributed.is_nccl_available()), f'nccl_built {hvd.nccl_built()}')
check(hvd.ccl_built() is False and hvd.ddl_built() is False and hvd.cuda_built() == gpu,
      'ccl_built, ddl_built, cuda_built')

# -- 10. a worker in join() makes the others' allgather and broadcast fail, and all go on
# -- (test_horovod_join_allgather, test_horovod_join_broadcast) ----------------------
for refused_call in ('allgather', 'broadcast'):
    if r == 0:
        last = hvd.join()
    else:
        try:
            if refused_call == 'allgather':
                hvd.allgather(torch.ones(17, 17, 17))
            else:
                hvd.broadcast(torch.ones(17, 17, 17), root_rank=1)
            check(False, f'{refused_call} while worker 0 is in join() was not refused')
        except RuntimeError as e:
            check('called join()' in str(e), f'{refused_call} refused: {e}')
        last = hvd.join()
    lasts = hvd.allgather(torch.tensor([last])).tolist()    # (arrival order decides it)
    check(len(set(lasts)) == 1 and 0 <= last < N, f'join returned {lasts}')
    in_step(f'join with {refused_call}')
in_step('everything')
hvd.barrier()
print(f'worker {r} of {N}: ok', flush=True)
