"""Every collective of d2ldist's ring against torch.distributed's gloo, same inputs.

Run under d2l-launch -n N -s 0: the launcher's environment lets both d2ldist and
gloo (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE) join the same job. Each worker
prints one 'ok' line with its case counts and the bytes it sent for a reduce-scatter,
an all-reduce and an all-to-all, or exits at the first mismatch.
"""
import sys

import torch
import torch.distributed as dist

import d2ldist
from d2ldist.collectives import world
from d2ldist.collectives.torch_backend import wire_bytes_sent
from d2ldist.runtime import node
from d2ldist.runtime.split import even_slices

d2ldist.init()
r, N = d2ldist.rank(), d2ldist.size()
if not dist.is_initialized():   # (backend torch has done it)
    dist.init_process_group('gloo', init_method='env://')
assert (dist.get_rank(), dist.get_world_size()) == (r, N)
TOL = {torch.float16: 1e-2, torch.bfloat16: 5e-2, torch.float32: 1e-5, torch.float64: 1e-12}
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool,
          torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
LENGTHS = [0, 1, 2, N - 1, N + 1, 7, 13, 1009, 65537, 131101]
counts = {'allreduce': 0, 'broadcast': 0, 'allgather': 0, 'reducescatter': 0, 'alltoall': 0,
          'gloo lacks': set()}


def rand(shape, dtype, seed):
    """The same random tensor on every worker for the same seed."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    low = 0 if dtype == torch.uint8 else -30   # sums of 4 fit in int8 and uint8
    return torch.randint(low, 60, shape, generator=g, dtype=torch.int64).to(dtype)


def same(a, b, what):
    ok = a.shape == b.shape and a.dtype == b.dtype and (
        torch.allclose(a.double(), b.double(), rtol=TOL[a.dtype], atol=TOL[a.dtype] * 4)
        if a.is_floating_point() else torch.equal(a, b))
    if not ok:
        sys.exit(f'worker {r}: MISMATCH {what}: d2ldist {a.flatten()[:6]} gloo {b.flatten()[:6]}')


def gloo_allreduce(X, op, inputs):
    """What gloo says, computed as d2ldist defines the op (Average = Sum / N).

    ``inputs(i)`` makes worker i's input: for dtypes gloo cannot reduce (int16),
    the reference is added up here from every worker's input instead."""
    Y = X.contiguous().clone()
    if X.dtype == torch.bool:
        Y = Y.to(torch.uint8)
    red = {'Min': dist.ReduceOp.MIN, 'Max': dist.ReduceOp.MAX}.get(op.name, dist.ReduceOp.SUM)
    if X.dtype == torch.bool and op.name != 'Min':
        red = dist.ReduceOp.MAX      # bool sums are "any"
    try:
        dist.all_reduce(Y, red)
    except RuntimeError:
        counts['gloo lacks'].add(str(X.dtype))
        Y = inputs(0).clone()
        for i in range(1, N):
            op.reduce_(Y, inputs(i))
    Y = Y.to(X.dtype)
    if op.name == 'Average' and X.dtype != torch.bool:
        Y = Y / N if X.is_floating_point() else torch.div(Y, N, rounding_mode='trunc')
    return Y.to(X.dtype)


# -- allreduce: every dtype, op and length; every third input strided (non-contiguous) --
case = 0
for dtype in DTYPES:
    for n in LENGTHS + ([1_000_003] if dtype in (torch.float32, torch.int64) else []):
        for op in (d2ldist.Sum, d2ldist.Average, d2ldist.Min, d2ldist.Max):
            case += 1
            strided = case % 3 == 0
            def inputs(i, n=n, dtype=dtype, strided=strided, case=case):
                base = rand((2 * n,) if strided else (n,), dtype, case * 100 + i)
                return base[::2] if strided else base
            X = inputs(r)
            expect = gloo_allreduce(X, op, inputs)
            before = X.clone()
            got = d2ldist.allreduce(X, op=op)
            same(X, before, f'allreduce changed its input {dtype} n={n}')
            same(got, expect, f'allreduce {op} {dtype} n={n} strided={strided}')
            d2ldist.allreduce_(X, op=op)
            same(X, expect, f'allreduce_ {op} {dtype} n={n} strided={strided}')
            if strided:
                same(X._base[1::2], inputs(r)._base[1::2], 'allreduce_ touched '
                     'elements outside the strided view')
            counts['allreduce'] += 1

# -- broadcast: every root ---------------------------------------------------------------
for dtype in DTYPES:
    for n in (0, 1, N + 1, 1009, 131101):
        for root in range(N):
            case += 1
            X = rand((n,), dtype, case * 100 + r)
            Y = X.clone()
            try:
                dist.broadcast(Y, root)
            except RuntimeError:     # a dtype gloo cannot send (bool, int16)
                counts['gloo lacks'].add(str(dtype))
                Y = rand((n,), dtype, case * 100 + root)
            same(d2ldist.broadcast(X, root_rank=root), Y, f'broadcast {dtype} n={n}')
            d2ldist.broadcast_(X, root_rank=root)
            same(X, Y, f'broadcast_ {dtype} n={n} root={root}')
            counts['broadcast'] += 1

# -- allgather: first dimensions differ between workers (0 rows included) --------------
for dtype in (torch.float32, torch.int64, torch.float16, torch.uint8):
    for rows_seed in range(6):
        case += 1
        g = torch.Generator().manual_seed(case)
        rows = torch.randint(0, 5, (N,), generator=g).tolist()
        if rows_seed == 5:
            rows = [1000 * (i + 1) for i in range(N)]
        X = rand((rows[r], 3, 2), dtype, case * 100 + r)
        padded = X.new_zeros((max(rows), 3, 2))
        padded[:rows[r]] = X
        parts = [torch.empty_like(padded) for _ in range(N)]
        dist.all_gather(parts, padded)
        expect = torch.cat([p[:k] for p, k in zip(parts, rows)])
        same(d2ldist.allgather(X), expect, f'allgather {dtype} rows={rows}')
        counts['allgather'] += 1

# -- reducescatter: each worker its rows of the all-reduce (uneven, 0 rows included) ----
for dtype in DTYPES:
    for rows in (0, 1, N + 1, 13, 1009):
        for op in (d2ldist.Sum, d2ldist.Average, d2ldist.Min, d2ldist.Max):
            case += 1
            def inputs(i, rows=rows, dtype=dtype, case=case):
                return rand((rows, 3), dtype, case * 100 + i)
            a, b = even_slices(rows, N)[r]
            expect = gloo_allreduce(inputs(r), op, inputs)[a:b]
            same(d2ldist.reducescatter(inputs(r), op=op), expect,
                 f'reducescatter {op} {dtype} rows={rows}')
            counts['reducescatter'] += 1

# -- alltoall: uneven splits (0 rows included), against gloo's all_to_all_single -------
for dtype in (torch.float32, torch.int64, torch.bfloat16, torch.bool):
    for seed in range(4):
        case += 1
        g = torch.Generator().manual_seed(case)
        splits = torch.randint(0, 4, (N, N), generator=g)    # splits[i, j]: i sends to j
        if seed == 3:
            splits = torch.full((N, N), 500)
        X = rand((int(splits[r].sum()), 2, 3), dtype, case * 100 + r)
        expect = X.new_empty((int(splits[:, r].sum()), 2, 3))
        dist.all_to_all_single(expect.view(torch.uint8), X.view(torch.uint8),   # (moved as
                               splits[:, r].tolist(), splits[r].tolist())       # bytes)
        got, came = d2ldist.alltoall(X, splits[r])
        same(got, expect, f'alltoall {dtype} splits={splits.tolist()}')
        if came.tolist() != splits[:, r].tolist():
            sys.exit(f'worker {r}: alltoall said {came.tolist()} rows came, not '
                     f'{splits[:, r].tolist()}')
        counts['alltoall'] += 1


# -- bytes: a reduce-scatter sends (N-1)/N of the tensor, half an all-reduce's ----------
def count():
    """Bytes this worker has sent: the van's count of data on the ring; on
    torch.distributed the kernel's count on gloo's connections (its headers too)."""
    return node.current().van.bytes_sent if world.name() == 'ring' else wire_bytes_sent()


def sent_by(call, *args):
    """Bytes this worker sent for one call of a backend's method."""
    before = count()
    world.run(call, *args).wait()
    return count() - before


M = 300_000                      # float32: 1.2 MB, a multiple of N = 2 to 6
X = rand((M,), torch.float32, 7)
ring = 4 * M * (N - 1) // N      # what a ring's reduce-scatter sends, and its all-gather
backend = world.backend()
sent = {'reducescatter': sent_by(backend.reducescatter, X, d2ldist.Sum),
        'reduce_scatter_flat': sent_by(backend.reduce_scatter_flat, X, d2ldist.Sum),
        'allreduce': sent_by(backend.allreduce_, X.clone(), d2ldist.Sum)}
headers = 0 if world.name() == 'ring' else 8 * 1024     # gloo's, and the calls' own checks
for call, times in (('reducescatter', 1), ('reduce_scatter_flat', 1), ('allreduce', 2)):
    if not times * ring <= sent[call] <= times * ring + headers:
        sys.exit(f'worker {r}: {call} sent {sent[call]:,} bytes, not {times} x {ring:,}')
# an alltoall: on torch.distributed each row crosses once ((N-1)/N of X leaves); the ring
# passes rows to neighbours only, so it goes through allgather (all of X, N-1 times over)
before = count()
d2ldist.alltoall(X)
sent['alltoall'] = count() - before
want = ring if world.name() == 'torch' else 4 * M * (N - 1)
if not want <= sent['alltoall'] <= want + headers + 64 * N * N:       # (and the counts)
    sys.exit(f'worker {r}: alltoall sent {sent["alltoall"]:,} bytes, not {want:,}')

d2ldist.barrier()
print(f'worker {r} of {N}: ok allreduce={counts["allreduce"]} broadcast={counts["broadcast"]} '
      f'allgather={counts["allgather"]} reducescatter={counts["reducescatter"]} '
      f'alltoall={counts["alltoall"]} '
      f'sent={sent} gloo lacks={sorted(counts["gloo lacks"])}', flush=True)
dist.destroy_process_group()
