"""Worker scripts for tests/jobs/test_kvstore.py (each runs as every worker of a real job)."""

COMMON = r'''
import json, os, signal, sys, time
import torch
import d2ldist
from d2ldist.kv import KVError, place
torch.set_num_threads(1)

def say(tag, value):
    print(tag, json.dumps(value), flush=True)

def error_of(call):
    try:
        call()
    except KVError as e:
        return str(e)
    return None
'''

# 3 workers x 2 servers (and 4 x 1): exact sums, placement, bad input, optimizers, checkpoint
SYNC = COMMON + r'''
kv = d2ldist.kv.create(os.environ.get('KV_KIND', 'dist_sync'))
r, n = kv.rank, kv.num_workers
tri = n * (n + 1) / 2                       # 1 + 2 + ... + n: what the sums must be

# 1. exact sums: int and str keys, several dtypes, a big key, device copies
BIG = 1_000_001
keys = ['small', 3, 'big']
kv.init(keys, [torch.zeros(2, 3), torch.zeros(5, dtype=torch.float64), torch.zeros(BIG)])
outs = [torch.empty(2, 3), torch.empty(5, dtype=torch.float64), torch.empty(BIG)]
kv.pushpull(keys, [torch.full((2, 3), r + 1.0), torch.arange(5.0, dtype=torch.float64) * (r + 1),
                   torch.full((BIG,), r + 1.0)], out=outs)
assert (outs[0] == tri).all() and (outs[2] == tri).all(), (outs[0], outs[2][:3])
assert outs[1].tolist() == [i * tri for i in range(5)], outs[1]
kv.push('small', [torch.full((2, 3), r + 1.0), torch.full((2, 3), 10.0)])   # two device copies
copies = [torch.empty(2, 3), torch.empty(2, 3)]
kv.pull('small', out=copies)
assert (copies[0] == tri + 10 * n).all() and (copies[1] == copies[0]).all(), copies
say('SUMS', {'rank': r, 'small': outs[0][0, 0].item(), 'big': [outs[2][0].item(), outs[2][-1].item()],
             'int_key': outs[1].tolist(), 'copies': copies[1][0, 0].item()})

# 2. placement: ask the servers what they hold
info = kv.server_info()
held = {s: {k[0]: [k[3], k[4]] for k in v['keys']} for s, v in info.items()}
say('HELD', {'rank': r, 'held': {s: {str(k): v for k, v in h.items()} for s, h in held.items()},
             'expected_small': place('small', 6, len(info))[0][0]})

# 3. bad input: clear errors on the worker, naming key and both shapes
errors = {
    'uninitialised': error_of(lambda: kv.push('never', torch.zeros(2))),
    'shape': error_of(lambda: kv.push('small', torch.zeros(3, 2))),
    'dtype': error_of(lambda: kv.pushpull('small', torch.zeros(2, 3, dtype=torch.float64),
                                          out=torch.zeros(2, 3))),
    'pull_size': error_of(lambda: kv.pull('small', out=torch.zeros(7))),
}
# ... and the servers check for themselves: hand-made requests that skip the worker's checks
node = d2ldist.runtime.node.current()
server = f"server:{place('small', 6, node.num_servers)[0][0]}"
bad = [('kv_push', [['small', 'float32', [5], 0, 5]], [bytes(20)]),          # wrong shape
       ('kv_push', [['ghost', 'float32', [2], 0, 2]], [bytes(8)]),           # never initialised
       ('kv_push', [['small', 'float32', [2, 3], 0, 6]], [bytes(12)]),       # frame too short
       ('kv_pull', [['small', 'int64', [2, 3], 0, 6]], []),                  # wrong dtype
       ('kv_push', 'not a list', [])]
for i, (kind, parts, frames) in enumerate(bad):
    node.send(server, kind, {'id': -1 - i, 'parts': parts, 'sync': True, 'pull': False}, frames)
    answer = node.recv(['kv_error'], timeout=20)
    errors[f'server_{i}'] = answer and answer['error']
say('ERRORS', {'rank': r, **errors})
out = torch.empty(2, 3)                         # the server still serves, sums still exact
kv.pushpull('small', torch.full((2, 3), r + 1.0), out=out)
assert (out == tri).all(), out

# 4. optimizers on the servers == one process running torch.optim on the averaged gradient
def grad(rank, step, i, shape):   # multiples of 1/1024: sums are exact in any order
    g = torch.randn(shape, generator=torch.Generator().manual_seed(10007 * step + 101 * i + rank))
    return torch.round(g * 1024) / 1024

def compare(name, hyper, torch_opt, steps=10, reload=False):
    shapes = [(1000, 1001), (7,)]             # one split across servers, one whole
    w0 = [torch.randn(s, generator=torch.Generator().manual_seed(5 + i)) for i, s in enumerate(shapes)]
    keys = [f'{name}.w', f'{name}.b']
    kv.init(keys, w0)
    hyper = dict(hyper, rescale_grad=1 / n)  # MXNet's default is 1: average explicitly
    kv.set_optimizer(name, **hyper)
    w = [t.clone() for t in w0]
    for t in range(steps):
        if reload and t == steps - 1:       # checkpoint, forget, restore, go on
            path = f"{os.environ['KV_TMP']}/{name}.states"
            if r == 0:
                kv.save_optimizer_states(path)
            kv.barrier()
            kv.set_optimizer(name, **hyper)     # fresh states ...
            kv.load_optimizer_states(path)      # ... replaced by the saved ones
        kv.pushpull(keys, [grad(r, t, i, s) for i, s in enumerate(shapes)], out=w)
    ref = [t.clone().requires_grad_() for t in w0]
    opt = torch_opt(ref)
    for t in range(steps):
        for i, p in enumerate(ref):
            p.grad = torch.stack([grad(q, t, i, p.shape) for q in range(n)]).sum(0) * (1 / n)
        opt.step()
    return max((a - b.detach()).abs().max().item() for a, b in zip(w, ref))

diff_sgd = compare('sgd', dict(lr=0.1, momentum=0.9, weight_decay=0.01),
                   lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01))
diff_adam = compare('adam', dict(lr=0.01, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.001),
                    lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.8, 0.99), eps=1e-6,
                                                weight_decay=0.001), reload=True)
say('OPTIM', {'rank': r, 'sgd': diff_sgd, 'adam': diff_adam,
              'optimizer': sorted({v['optimizer'] for v in kv.server_info().values()})})
kv.barrier()
'''

SUMS = COMMON + r'''
kv = d2ldist.kv.create(os.environ.get('KV_KIND', 'dist_sync'))
r, n = kv.rank, kv.num_workers
tri = n * (n + 1) / 2
keys = list(range(20)) + ['big']
kv.init(keys, [torch.zeros(i + 1) for i in range(20)] + [torch.zeros(1_500_000)])
for step in range(3):                            # device copies: two CPU replicas per worker
    values = [[torch.full((k + 1,), r + 1.0), torch.full((k + 1,), float(step))] for k in range(20)]
    values.append([torch.full((1_500_000,), r + 1.0), torch.full((1_500_000,), float(step))])
    outs = [[torch.empty(k + 1), torch.empty(k + 1)] for k in range(20)] + [[torch.empty(1_500_000)]]
    kv.pushpull(keys, values, out=outs)
    for o in outs:
        for t in o:
            assert (t == tri + n * step).all(), (step, t[:3])
info = kv.server_info()
say('SUMS4', {'rank': r, 'last': outs[-1][0][0].item(), 'servers': len(info),
              'keys_held': sum(len(v['keys']) for v in info.values())})
kv.barrier()
'''

ASYNC = COMMON + r'''
kv = d2ldist.kv.create('dist_async')
r = kv.rank
kv.init('w', torch.zeros(1000))
kv.barrier()
pushes, end = 0, time.monotonic() + 3.0
while time.monotonic() < end:
    kv.push('w', torch.ones(1000))
    pushes += 1
    if r == 1:
        time.sleep(0.25)                        # the slow worker
say('PUSHES', {'rank': r, 'pushes': pushes})
kv.barrier()
out = torch.empty(1000)
kv.pull('w', out=out)                           # every push was applied, atomically
say('TOTAL', {'rank': r, 'value': out[0].item(), 'all_equal': bool((out == out[0]).all())})
kv.barrier()
'''

# dead nodes: WHO=worker|server, HOW=kill|stop
DEATH = COMMON + r'''
kv = d2ldist.kv.create('dist_sync')
r = kv.rank
kv.init('w', torch.zeros(10))
out = torch.empty(10)
kv.pushpull('w', torch.ones(10), out=out)
who, how = os.environ['WHO'], os.environ['HOW']
victim = f"server:{place('w', 10, d2ldist.runtime.node.current().num_servers)[0][0]}"   # the server holding 'w'
pid = kv.server_info()[victim]['pid'] if who == 'server' else os.getpid()
kv.barrier()
if r == 1:
    print('DYING', victim if who == 'server' else 'worker:1', time.time(), flush=True)
    os.kill(pid, signal.SIGKILL if how == 'kill' else signal.SIGSTOP)
for step in range(1000):                         # the others wait for the dead node
    kv.pushpull('w', torch.ones(10), out=out)
'''


# Sparse keys: a 7 x 3 table cut over 2 servers (bound 10): elements 0..10 and 11..20,
# so row 3 (elements 9..11) straddles the two. Values are multiples of 1/4: exact sums.
SPARSE = r'''
import json
import torch
import d2ldist
from d2ldist.kv import messages as M

kv = d2ldist.kv.create('dist_sync')
r, n = kv.rank, kv.num_workers
w0 = torch.arange(21, dtype=torch.float32).view(7, 3) / 4
kv.init('emb', w0)
rows = {0: [1, 3], 1: [3, 5]}[r]
grad = torch.sparse_coo_tensor(torch.tensor([rows]), torch.ones(2, 3) * (r + 1), (7, 3),
                               check_invariants=True)
kv.push('emb', grad)                           # no optimizer: the value becomes the sum
summed = torch.empty(7, 3)
kv.pull('emb', out=summed)
kv.barrier()
kv.set_optimizer('sgd', lr=0.5, weight_decay=0.5)
w = torch.zeros(7, 3)
kv.pushpull('emb', grad, out=w)                # rows only, and only those rows come back
out = torch.full((7, 3), -1.0)
kv.row_sparse_pull('emb', out=out, row_ids=[6, 3])
# MXNet's broadcast (rank 0's value to every worker) and pushpull in place (no out)
got = torch.zeros(4)
kv.broadcast('b', torch.full((4,), float(r + 7)), out=got)
g = torch.full((4,), float(r + 1))
kv.pushpull('b', g)                            # updated by the servers' sgd, back into g
mx = {'broadcast': got.tolist(), 'in_place': g.tolist()}
# bytes on the wire for 2 of 10,000 rows of 16 values, against the whole table
kv.init('big', torch.zeros(10000, 16))
ids, vals = torch.tensor([17, 9000]), torch.ones(2, 16)
sent = sum(len(f) for m in kv._row_messages(M.PUSH_ROWS, 'big', ids, vals) for f in m[3])
# a sync round where one worker's rows all lie on server 0 (rows 0..2: elements 0..8):
# it still pushes (no rows) to server 1, so both rounds close with both workers' pushes
kv.init('emb2', torch.zeros(7, 3))
first = {0: [0], 1: [0, 6]}[r]
for ids in (first, [6]):
    g2 = torch.sparse_coo_tensor(torch.tensor([ids]), torch.ones(len(ids), 3) * (r + 1),
                                 (7, 3))
    kv.pushpull('emb2', g2, out=torch.zeros(7, 3))
w2 = torch.empty(7, 3)
kv.pull('emb2', out=w2)
print('SPARSE ' + json.dumps({'summed': summed.tolist(), 'w': w.tolist(), 'out': out.tolist(),
                              'sent': sent, 'one_server': w2[:, 0].tolist(), **mx}),
      flush=True)
'''
