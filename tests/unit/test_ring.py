"""The ring's algorithm as small specifications, to read beside d2ldist/collectives/ring.py.

Three members run in one process, one thread each. Each ``Ring`` gets a ``QueueLink``:
the narrow interface a Ring uses of its link (begin, send, recv, end), with a queue
for a wire. The link checks that each chunk is the one its receiver expects, and keeps
what it sent, so that a test can read the order and the contents of the chunks.
"""
import queue
import threading

import pytest
import torch

from d2ldist.collectives import ops
from d2ldist.collectives.ring import Ring
from d2ldist.runtime.split import even_slices

N = 3


class QueueLink:
    """A stand-in for link.py's Link: chunks go on a queue to the right neighbour."""

    def __init__(self, rank, wires):
        self.rank, self.size, self.wires = rank, len(wires), wires
        self.sent = []           # (phase, segment, chunk, values) in the order sent

    def begin(self, call, numel, replay=None, root=None):
        pass

    def send(self, x, phase, j, k):
        self.sent.append((phase, j, k, x.clone()))
        self.wires[(self.rank + 1) % self.size].put((phase, j, k, x.clone()))

    def recv(self, y, phase, j, k, reduce_=None):
        got = self.wires[self.rank].get(timeout=10)
        assert got[:3] == (phase, j, k), f'worker {self.rank} expected {(phase, j, k)}'
        (reduce_ or torch.Tensor.copy_)(y, got[3])

    def end(self):
        pass


def run(call, inputs, chunk_bytes=8):
    """``call(ring, flat, rank)`` on N rings at once; (results, their links)."""
    wires = [queue.Queue() for _ in range(N)]
    links = [QueueLink(r, wires) for r in range(N)]
    flats, errors = [x.clone() for x in inputs], []

    def member(r):
        try:
            call(Ring(links[r], chunk_bytes=chunk_bytes), flats[r], r)
        except Exception as e:          # (reported below, not lost in the thread)
            errors.append(e)
    threads = [threading.Thread(target=member, args=(r,)) for r in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    return flats, links


def inputs(numel):
    return [torch.randn(numel) for _ in range(N)]


# 10: not divisible by 3; 2: one segment empty; chunks of 2 values: smaller than a segment
@pytest.mark.parametrize('numel', [10, 2, 1, 1000])
def test_allreduce_sums_on_every_worker(numel):
    xs = inputs(numel)
    out, _ = run(lambda ring, flat, r: ring.allreduce_(flat, ops.Sum), xs)
    for flat in out:
        torch.testing.assert_close(flat, sum(xs))


def test_allreduce_with_another_op_and_one_chunk_per_segment():
    xs = inputs(10)
    out, _ = run(lambda ring, flat, r: ring.allreduce_(flat, ops.Max), xs, chunk_bytes=1 << 20)
    for flat in out:
        assert torch.equal(flat, torch.stack(xs).max(0).values)


def test_allreduce_sends_its_segment_then_relays_reduce_scatter_then_all_gather():
    """Worker r sends segment r; passes on, added to, what comes from the left (segments
    r-1, r-2, ...); its last one, r+1, is then whole and goes round again (all-gather),
    copied on by each worker but the one before its owner. Chunk by chunk, in order."""
    xs = inputs(10)
    _, links = run(lambda ring, flat, r: ring.allreduce_(flat, ops.Sum), xs)
    segs, step = even_slices(10, N), 2                 # 8-byte chunks: 2 floats
    for r, link in enumerate(links):
        order = [('rs', r)] + [('rs', (r - s - 1) % N) for s in range(N - 2)] \
            + [('ag', (r + 1) % N)] + [('ag', (r - s) % N) for s in range(N - 2)]
        want = [(phase, j, k) for phase, j in order
                for k in range(len(range(*segs[j], step)))]
        assert [sent[:3] for sent in link.sent] == want
        for phase, j, k, values in link.sent:
            a = segs[j][0] + k * step
            # a reduce-scatter chunk of segment j holds the sum of workers j, j+1, ..., r;
            # an all-gather chunk the sum of all
            owners = range(N) if phase == 'ag' else [(j + i) % N for i in range((r - j) % N + 1)]
            torch.testing.assert_close(values, sum(xs[i] for i in owners)[a:a + len(values)])


def test_reducescatter_leaves_each_worker_its_segment_reduced():
    xs, seg = inputs(10), [(0, 2), (2, 9), (9, 10)]
    out, _ = run(lambda ring, flat, r: ring.reducescatter_(flat, seg, ops.Sum), xs)
    for r, flat in enumerate(out):
        a, b = seg[r]
        torch.testing.assert_close(flat[a:b], sum(xs)[a:b])


def test_allgather_gives_every_worker_every_segment():
    seg = [(0, 3), (3, 3), (3, 10)]                    # worker 1 has nothing to give
    whole = torch.randn(10)
    xs = [torch.zeros(10) for _ in range(N)]
    for r, (a, b) in enumerate(seg):
        xs[r][a:b] = whole[a:b]
    out, _ = run(lambda ring, flat, r: ring.allgather_(flat, seg), xs)
    for flat in out:
        assert torch.equal(flat, whole)


@pytest.mark.parametrize('root', range(N))
def test_broadcast_copies_the_roots_tensor_down_the_chain(root):
    xs = inputs(10)
    out, links = run(lambda ring, flat, r: ring.broadcast_(flat, root), xs)
    for flat in out:
        assert torch.equal(flat, xs[root])
    last = (root - 1) % N                              # the end of the chain keeps it
    assert [s[0] for s in links[last].sent] == ['end']
    assert all(s[0] == 'bc' for s in links[root].sent[:-1])
