"""Shared memory between processes on one host: same results, blocks reused, forgeries
dropped, nothing left behind; and not used under a simulated network or D2L_SHM=0."""
import hashlib
import hmac
import json
import os

import pytest
import torch
import zmq

from support import run_launch, wait_no_survivors
from d2ldist.config import Config
from d2ldist.runtime import shm
from d2ldist.runtime.van import Van
from d2ldist.runtime.wire import pack, unpack

SECRET = 's' * 64
pytestmark = pytest.mark.skipif(not shm.enabled(Config()),
                                reason='shared memory needs x86-64 Linux')


@pytest.fixture
def pair():
    a, b = Van('worker:0', SECRET), Van('worker:1', SECRET)
    a.connect('worker:1', b.address, same_host=True)
    b.connect('worker:0', a.address, same_host=True)
    yield a, b
    a.close()
    b.close()


def test_frames_from_the_threshold_up_go_through_shared_memory(pair):
    a, b = pair
    n = shm.SHM_MIN_BYTES // 4
    below, at, big = torch.arange(n - 1.), torch.arange(float(n)), torch.randn(3_000_000)
    metas, frames = zip(*(pack(t) for t in (below, at, big)))
    a.send('worker:1', 'x', {'metas': metas}, frames)
    msg = b.recv(timeout=5)
    assert [e[0] for e in msg['shm']] == [1, 2]          # the small one went by socket
    got = [unpack(m, f) for m, f in zip(msg['metas'], msg.frames)]
    assert all(torch.equal(g, t) for g, t in zip(got, (below, at, big)))
    assert a.shm_stats()['sent'] == 2 and b.shm_stats()['received'] == 2
    got[2].add_(1)                                       # writable, and shared (no copy)
    assert torch.equal(unpack(msg['metas'][2], msg.frames[2]), big + 1)


def test_a_block_is_reused_once_its_last_user_is_gone(pair):
    a, b = pair
    x = torch.ones(1 << 20)
    for i in range(20):
        a.send('worker:1', 'x', {}, [pack(x * i)[1]])
        t = unpack({'dtype': 'float32', 'shape': [1 << 20]}, b.recv(timeout=5).frames[0])
        assert float(t[0]) == i
        del t                                             # the last user: the block is FREE
    assert a.shm_stats()['blocks'] == 1
    kept = [b'', b'']
    for i in range(2):                                   # views kept alive: blocks stay busy
        a.send('worker:1', 'x', {}, [pack(x * i)[1]])
        kept[i] = b.recv(timeout=5).frames[0]
    assert a.shm_stats()['blocks'] == 2
    assert unpack({'dtype': 'float32', 'shape': [1 << 20]}, kept[0])[0] == 0


def test_peers_on_other_hosts_and_paced_links_use_the_socket():
    assert shm.same_host('tcp://127.0.0.1:5', 'tcp://127.0.0.2:6')
    assert shm.same_host('tcp://198.18.0.1:5', 'tcp://198.18.0.1:6')
    assert not shm.same_host('tcp://198.18.0.1:5', 'tcp://198.18.0.2:5')   # netns "hosts"
    paced = Config.from_env({'D2L_LATENCY': '0.001'})
    assert Van('w', SECRET, bind=False, cfg=paced).shm is None
    off = Config.from_env({'D2L_SHM': '0'})
    assert Van('w', SECRET, bind=False, cfg=off).shm is None
    a, b = Van('worker:0', SECRET, cfg=off), Van('worker:1', SECRET, cfg=off)
    try:
        a.connect('worker:1', b.address, same_host=True)
        a.send('worker:1', 'x', {}, [bytes(1 << 20)])
        msg = b.recv(timeout=5)
        assert 'shm' not in msg.header and msg.frames[0].nbytes == 1 << 20
    finally:
        a.close()
        b.close()


def test_forged_descriptors_are_dropped_and_the_receiver_keeps_serving(pair, tmp_path):
    a, b = pair
    a.send('worker:1', 'x', {}, [bytes(1 << 20)])       # a real block, then free again
    assert b.recv(timeout=5) is not None
    (block,) = a.shm.blocks[1 << 20]
    pid, fd = os.getpid(), block.fd
    other = os.open(tmp_path / 'file', os.O_RDWR | os.O_CREAT)
    os.write(other, bytes(1 << 21))
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 1000)
    raw.connect(b.address)
    forgeries = [
        [[0, pid, fd, 64, (1 << 20) + 1]],               # past the end of the block
        [[0, pid, fd, 8, 100]],                          # over its header
        [[0, pid, fd, 64, 0]],
        [[0, pid, other, 64, 100]],                      # a file that is not a block
        [[0, 2**22 + 1, 3, 64, 100]],                    # no such process
        [[0, pid, fd, 64, 100]],                         # a FREE block (not sent)
        [[0, pid, fd, '64', 100]], [[0, pid, fd, 64, True]], [[0, pid, fd, 64]],
        [[0, [pid], fd, 64, 100]], [[0, pid, fd, 64, 100.0]], [[0, pid, fd, -64, 100]],
        [[1, pid, fd, 64, 100]], [[0, pid, fd, 64, 100], [0, pid, fd, 64, 100]], 'x',
    ]
    for seq, where in enumerate(forgeries, 1):
        head = json.dumps({'kind': 'x', 'from': 'forger', 'seq': seq, 'session': 's',
                           'sizes': [100], 'shm': where}).encode()
        raw.send_multipart([hmac.new(SECRET.encode(), head, hashlib.sha256).digest(), head, b''])
    head = json.dumps({'kind': 'x', 'from': 'forger', 'seq': 99, 'session': 's',
                       'sizes': [4], 'shm': [[0, pid, fd, 64, 4]]}).encode()
    raw.send_multipart([hmac.new(SECRET.encode(), head, hashlib.sha256).digest(), head, b'abcd'])
    assert b.recv(timeout=1) is None                      # the frame was not empty
    assert b.dropped == len(forgeries) + 1
    assert block.state.value == shm.FREE
    assert os.pread(other, 8, 0) == bytes(8)             # nothing written into the file
    a.send('worker:1', 'still', {}, [bytes(1 << 20)])
    assert b.recv(timeout=5).frames[0].nbytes == 1 << 20
    raw.close()
    os.close(other)


def test_payload_mac_mode_with_shared_memory():
    a = Van('worker:0', SECRET, mac_payload=True)
    b = Van('worker:1', SECRET, mac_payload=True)
    try:
        a.connect('worker:1', b.address, same_host=True)
        a.send('worker:1', 'x', {}, [pack(torch.arange(100_000.))[1], b'abc'])
        msg = b.recv(timeout=5)
        assert 'shm' in msg.header and bytes(msg.frames[1]) == b'abc'
    finally:
        a.close()
        b.close()


# -- real jobs through the launcher --------------------------------------------------------
JOB = '''
import json, torch, d2ldist
kv = d2ldist.kv.create('dist_sync')
shapes = [(300, 1000), (70_000,), (65_535,), (65_536,), (1_100_000,), (10,)]
keys = list(range(len(shapes)))
kv.init(keys, [torch.zeros(s) for s in shapes])
outs = [torch.zeros(s) for s in shapes]
van, sent = d2ldist.runtime.node.current().van, d2ldist.runtime.node.current().van.shm_stats()['sent']
for step in range(STEPS):
    kv.pushpull(keys, [torch.full(s, float(kv.rank + 1 + step)) for s in shapes], out=outs)
    want = sum(r + 1 + step for r in range(kv.num_workers))
    assert all(bool((o == want).all()) for o in outs), f'wrong sums at step {step}'
    if step == 0:
        per_step = van.shm_stats()['sent'] - sent     # big frames a step pushes
kv_blocks = van.shm_stats()['blocks']
for n in (0, 1, 65_537, 1_000_003):
    x = torch.arange(n, dtype=torch.float32) + kv.rank
    d2ldist.allreduce_(x, op=d2ldist.Sum)
    want = torch.arange(n, dtype=torch.float32) * kv.num_workers + sum(range(kv.num_workers))
    assert torch.equal(x, want), f'wrong all-reduce of {n}'
stream = d2ldist.collectives.world.backend().ring.link.out is not None   # its stream
answers = sum(s.received for s in van.streams           # kv's VALUES on streams
              if isinstance(s, d2ldist.runtime.stream.Receiver) and s.peer.startswith('server'))
print('STATS', json.dumps(dict(van.shm_stats(), kv_blocks=kv_blocks, per_step=per_step,
                               stream=stream, answers=answers)), flush=True)
'''


def _stats(r):
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    return [json.loads(line.split('STATS ', 1)[1]) for line in r.stdout.splitlines()
            if 'STATS ' in line]


@pytest.mark.timeout(120)
@pytest.mark.parametrize('env', [{}, {'D2L_SHM': '0'}, {'D2L_LATENCY': '0.0001'}],
                         ids=['shm', 'D2L_SHM=0', 'paced'])
def test_kv_sums_and_ring_results_are_exact_with_and_without_shared_memory(write_script, env):
    before = set(os.listdir('/dev/shm'))
    steps = 30 if not env else 3
    r = run_launch('-n', '3', '-s', '2', '--timeout', '100', 'python',
                   write_script(JOB.replace('STEPS', str(steps))), env=env, timeout=110)
    stats = _stats(r)
    assert len(stats) == 3
    for s in stats:
        if env:                                          # everything through the socket
            assert s['sent'] == s['received'] == s['blocks'] == 0
            # the ring's chunks on its own TCP link where they cross a socket anyway
            # (not under a simulated link: the van paces what it sends)
            assert s['stream'] == ('D2L_SHM' in env)
            # and the servers' answers on the streams the workers offer (a pull each
            # step from each of 2 servers)
            assert s['answers'] == (2 * steps if 'D2L_SHM' in env else 0)
        else:                # big frames shared; blocks reused: a step's pushes, those the
            assert not s['stream'] and s['answers'] == 0
            # servers still hold as values, and a few in flight -- not one set per step
            assert s['per_step'] >= 2 and s['received'] >= steps * 2
            assert s['kv_blocks'] <= 3 * s['per_step'] and s['fallbacks'] == 0
    assert wait_no_survivors(r.tag) == []
    assert set(os.listdir('/dev/shm')) <= before


KILLED = '''
import os, signal, torch, d2ldist
kv = d2ldist.kv.create('dist_sync')
kv.init(0, torch.zeros(1_000_000))
out = torch.zeros(1_000_000)
for step in range(1000):
    kv.pushpull(0, torch.ones(1_000_000), out=out)
    assert d2ldist.runtime.node.current().van.shm_stats()['sent'] > 0
    if step == 3 and kv.rank == 1:                  # its blocks are held by the server
        os.kill(os.getpid(), signal.SIGKILL)
'''


@pytest.mark.timeout(60)
def test_a_killed_worker_leaves_no_process_and_no_file(write_script):
    before = set(os.listdir('/dev/shm'))
    r = run_launch('-n', '2', '-s', '1', '--timeout', '50', 'python', write_script(KILLED),
                   timeout=55)
    assert r.returncode not in (0, 124), r.stdout[-3000:] + r.stderr[-2000:]
    assert 'worker 1' in r.stdout + r.stderr
    assert wait_no_survivors(r.tag) == []
    assert set(os.listdir('/dev/shm')) <= before


OTHER_CONTAINER = '''
import json, os, torch, d2ldist
from d2ldist.runtime import shm
from d2ldist.collectives import world
if os.environ['D2L_RANK'] == '1':      # same address, but another pid namespace
    shm.identity = lambda: 'a container that shares only the network'
d2ldist.init()
x = torch.ones(1_000_000)
d2ldist.allreduce_(x, op=d2ldist.Sum)
assert bool((x == 2).all())
ring = world.backend().ring
print('STATS', json.dumps(dict(ring.link.node.van.shm_stats(), stream=ring.link.out is not None)),
      flush=True)
'''


@pytest.mark.timeout(60)
def test_nodes_that_cannot_see_each_others_processes_use_the_socket(write_script):
    """Same host address, different identity (boot, pid namespace, user): no shared memory."""
    r = run_launch('-n', '2', '-s', '0', '--timeout', '50', 'python',
                   write_script(OTHER_CONTAINER), timeout=55)
    stats = _stats(r)
    assert len(stats) == 2 and all(s['sent'] == s['received'] == 0 for s in stats)
    assert all(s['stream'] for s in stats)      # the ring's chunks on its own TCP link
    assert wait_no_survivors(r.tag) == []
