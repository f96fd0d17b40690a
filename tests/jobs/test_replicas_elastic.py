"""Elastic workers (d2l-launch --min-workers) and replicated servers (--server-replicas)
in one job, kv_elastic_job.py on 3 workers and 2 servers, each shard also held by the
other server: a worker killed after step 40 leaves the rounds to the two left, on the
heads and on their replicas; a server killed after its round 40 is answered for by its
replica while all three workers go on; and a worker lost first, then a server, shows
that the replica followed the rounds of the workers left; in dist_async, a worker and
then a server lost. Each time the values count every push exactly once (in base 1000,
per rank), and no process of the job is left."""
import re
import sys

from support import ROOT, run_launch, wait_no_survivors
from test_elastic import KILL, KILLED, counted, finals, rounds

KV_JOB = ROOT / 'tests' / 'jobs' / 'kv_elastic_job.py'
WORKER_LOST = f'd2l-launch: worker 1 failed ({KILLED}); 2 workers go on (--min-workers 2)'
ROUNDS_OF_2 = (f"[scheduler] d2ldist: worker 1 failed: its process ended, {KILLED}; the "
               "servers' rounds count 2 workers (round 1)")
SERVER_LOST = (f'd2l-launch: server 0 failed ({KILLED}); its replicas take over '
               '(--server-replicas 1)')
TAKES_OVER = (f'[scheduler] d2ldist: server 0 failed: its process ended, {KILLED}; '
              'server 1 answers for shard 0')
ANSWERS = r'^\[server 1\] d2ldist: server 1 answers for shard 0 now: its replica has every ' \
          r'change up to \d+$'


def kv_job(*faults):
    """kv_elastic_job.py, elastic and replicated, with ``faults``; (output, values, final)."""
    r = run_launch('-n', 3, '-s', 2, '--min-workers', 2, '--server-replicas', 1, *faults,
                   '--env', 'D2L_KVSTORE_BIGARRAY_BOUND=1000', '--timeout', 150,
                   sys.executable, KV_JOB, timeout=200)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert 'Traceback' not in out and 'no longer follows its head' not in out, out[-4000:]
    final = {int(w): int(v) for w, v in re.findall(r'^\[worker \d\] worker (\d) final (\d+)$',
                                                   out, re.M)}
    assert wait_no_survivors(r.tag) == []
    return out, finals(out, 'values'), final


def test_a_lost_worker_leaves_the_rounds_to_the_two_left_with_replicas_on():
    """Worker 1 killed after step 40: no server is lost, the rounds count 2 from round 40."""
    out, values, final = kv_job(*KILL)
    assert WORKER_LOST in out and ROUNDS_OF_2 in out
    assert 'replicas take over' not in out and 'answers for shard' not in out
    assert sorted(values) == [0, 2] and values[0] == values[2] and len(values[0]) == 100
    assert rounds(values[0]) == [[1, 1, 1]] * 39 + [[1, 0, 1]] * 61
    assert final == {0: 100_039_100, 2: 100_039_100}


def test_a_lost_server_s_replica_answers_and_every_worker_s_push_counts_once():
    """Server 0 killed after its round 40: server 1 answers for shard 0, no worker lost."""
    out, values, final = kv_job('--fail', 'server:0@step=40')
    assert '[server 0] d2ldist: server 0 fails on purpose after its sync round 40' in out
    assert SERVER_LOST in out and TAKES_OVER in out
    assert re.search(ANSWERS, out, re.M), out[-4000:]
    assert 'workers go on' not in out and 'rounds count' not in out
    assert sorted(values) == [0, 1, 2] and values[0] == values[1] == values[2]
    assert rounds(values[0]) == [[1, 1, 1]] * 100
    assert final == {0: 100_100_100, 1: 100_100_100, 2: 100_100_100}


def test_a_worker_lost_then_a_server_the_replica_had_the_rounds_of_the_workers_left():
    """Worker 1 killed after step 40, then server 0 after its round 60: server 1, the
    new head of shard 0, counts the two workers left, and the values are those without
    the server's loss."""
    out, values, final = kv_job(*KILL, '--fail', 'server:0@step=60')
    assert WORKER_LOST in out and ROUNDS_OF_2 in out
    assert SERVER_LOST in out and TAKES_OVER in out and re.search(ANSWERS, out, re.M)
    assert out.index(ROUNDS_OF_2) < out.index(SERVER_LOST)
    assert sorted(values) == [0, 2] and values[0] == values[2]
    assert rounds(values[0]) == [[1, 1, 1]] * 39 + [[1, 0, 1]] * 61
    assert final == {0: 100_039_100, 2: 100_039_100}


def test_in_dist_async_a_worker_then_a_server_lost_each_push_is_added_once():
    """dist_async, worker 1 killed after step 40, then server 0 after its 150th push
    applied (about step 55): nobody waits, the pushes that server 0 left unanswered go
    again to its replica, which counts a push it already has only once."""
    out, values, final = kv_job(*KILL, '--fail', 'server:0@step=150', '--env', 'KV=dist_async')
    assert WORKER_LOST in out and SERVER_LOST in out and TAKES_OVER in out
    assert re.search(ANSWERS, out, re.M), out[-4000:]
    assert final == {0: 100_039_100, 2: 100_039_100}     # 100, 39 and 100 pushes
    for w in (0, 2):                   # each value came after the worker's own push
        assert [counted(v)[w] for v in values[w]] == list(range(1, 101))
