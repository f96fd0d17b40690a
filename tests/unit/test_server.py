"""The parameter server's plain path, read beside d2ldist/kv/server.py: each worker
pushes, the round closes, the update applies (SGD), the pull answers with the new
weights. A stand-in node records what the server sends; the test hands it messages."""
from types import SimpleNamespace

import torch

from d2ldist.kv import messages as M
from d2ldist.kv.server import KVServer, Slot
from d2ldist.runtime.van import Message

W = ['w', 'float32', [3], 0, 3]          # the key 'w': all three elements on this server


class Node(SimpleNamespace):
    """A server's node with no network: ``sent`` keeps (peer, kind, header, frames)."""

    def __init__(self, workers=2):
        super().__init__(id='server:0', sent=[], workers=workers)

    def peers(self, role):
        return [f'{role}:{r}' for r in range(self.workers)]

    def send(self, peer, kind, header=None, frames=(), track=False):
        self.sent.append((peer, kind, header, [bytes(f) for f in frames]))
        return []


def request(kind, worker, rid, value=None, **header):
    """A request as the van delivers it: its parts (the key 'w'), a frame for a value."""
    frames = [bytearray(value.numpy().tobytes())] if value is not None else []
    return Message(kind, worker, dict(header, id=rid, parts=[W]), frames)


def values_sent(node):
    """(worker, request id, the values sent) of every VALUES answer."""
    return [(peer, header['id'], torch.frombuffer(bytearray(frames[0]), dtype=torch.float32))
            for peer, kind, header, frames in node.sent if kind == M.VALUES]


def server_with_sgd(node, weights, lr):
    server = KVServer(node)
    server.handle(request(M.INIT, 'worker:0', 1, weights))
    server.handle(Message(M.OPTIMIZER, 'worker:0', {'id': 2, 'name': 'sgd',
                                                    'hyper': {'lr': lr}}, []))
    return server


def test_a_round_closes_when_every_worker_has_pushed_and_sgd_updates_once():
    node = Node(workers=2)
    weights, lr = torch.tensor([1.0, 2.0, 3.0]), 0.5
    server = server_with_sgd(node, weights.clone(), lr)
    grads = [torch.tensor([0.5, 1.0, -1.0]), torch.tensor([0.25, 0.0, 2.0])]

    assert server.handle(request(M.PUSH, 'worker:0', 10, grads[0], sync=True, n=1))
    assert 'w' in server.rounds and server.rounds['w'].pushed == {'worker:0'}
    assert torch.equal(server.store['w'].value, weights)       # not yet: worker 1 has not pushed

    assert server.handle(request(M.PUSH, 'worker:1', 20, grads[1], sync=True, n=1))
    assert server.rounds == {}                                  # the round closed ...
    expected = weights - lr * (grads[0] + grads[1])             # ... and SGD stepped once
    assert torch.equal(server.store['w'].value, expected)
    assert [(p, kind, h['id']) for p, kind, h, _ in node.sent[-2:]] == [
        ('worker:0', M.ACK, 10), ('worker:1', M.ACK, 20)]      # a plain push: acked at once

    assert server.handle(request(M.PULL, 'worker:1', 21))
    (peer, rid, value), = values_sent(node)
    assert (peer, rid) == ('worker:1', 21) and torch.equal(value, expected)


def test_a_pushpull_is_answered_with_the_new_weights_once_its_round_closes():
    node = Node(workers=3)
    weights, lr = torch.tensor([0.0, 1.0, -2.0]), 0.1
    server = server_with_sgd(node, weights.clone(), lr)
    grads = [torch.full((3,), float(r + 1)) for r in range(3)]
    for r in (2, 0):                                             # any order of arrival
        assert server.handle(request(M.PUSH, f'worker:{r}', 30 + r, grads[r], sync=True,
                                     pull=True, n=1))
    assert values_sent(node) == []                               # worker 1 is missing
    assert server.handle(request(M.PUSH, 'worker:1', 31, grads[1], sync=True, pull=True, n=1))
    expected = weights - lr * (grads[0] + grads[1] + grads[2])   # summed in rank order
    answers = values_sent(node)
    assert sorted((p, rid) for p, rid, _ in answers) == [
        ('worker:0', 30), ('worker:1', 31), ('worker:2', 32)]
    assert all(torch.equal(v, expected) for _, _, v in answers)


def test_a_second_push_waits_for_the_next_round():
    node = Node(workers=2)
    server = server_with_sgd(node, torch.zeros(3), 1.0)
    g = torch.ones(3)
    assert server.handle(request(M.PUSH, 'worker:0', 10, g, sync=True, n=1))
    assert not server.handle(request(M.PUSH, 'worker:0', 11, g, sync=True, n=2))


def test_without_an_optimizer_the_rounds_sum_becomes_the_value():
    node = Node(workers=2)
    server = KVServer(node)
    server.store['w'] = Slot('float32', [3], 0, 3, torch.zeros(3))
    grads = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0, 20.0, 30.0])]
    for r, g in enumerate(grads):
        server.handle(request(M.PUSH, f'worker:{r}', r, g, sync=True, pull=True, n=1))
    assert all(torch.equal(v, grads[0] + grads[1]) for _, _, v in values_sent(node))


def test_an_async_push_applies_at_once():
    node = Node(workers=2)
    weights, lr = torch.tensor([1.0, 1.0, 1.0]), 0.5
    server = server_with_sgd(node, weights.clone(), lr)
    g = torch.tensor([2.0, 0.0, -2.0])
    assert server.handle(request(M.PUSH, 'worker:1', 10, g, sync=False, n=1))
    assert server.rounds == {} and torch.equal(server.store['w'].value, weights - lr * g)
