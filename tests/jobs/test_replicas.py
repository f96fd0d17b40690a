"""Replicated servers (d2l-launch --server-replicas) in real jobs: a server killed just as
it closed a round, before its replica had the update; the replica answers for its shard,
the workers send again what was unanswered, and the job ends with exactly the weights of
a run without the loss (replicas_job.py: an MLP with momentum and weight decay on the
servers, a sparse embedding, a key cut over both servers, and a count of the pushes).
With three servers a lost server's shards get a new replica, so a second loss later
loses nothing either."""
import re
import sys

import pytest

from support import ROOT, run_launch, wait_no_survivors

JOB = ROOT / 'tests' / 'jobs' / 'replicas_job.py'
SPLIT = ['--env', 'D2L_KVSTORE_BIGARRAY_BOUND=1000']   # the first layer over both servers
KILLED = 'killed by SIGKILL (exit code 137)'


def finals(out, what):
    """{worker: what it printed after 'worker W <what>'}."""
    return {int(w): v for w, v in re.findall(rf'^\[worker \d\] worker (\d) {what} (\S+)$',
                                             out, re.M)}


@pytest.fixture(scope='module')
def without_replicas():
    """The weights of the job without replicas and without a loss."""
    r = run_launch('-n', 2, '-s', 2, *SPLIT, sys.executable, JOB)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    weights = finals(r.stdout, 'weights')
    assert sorted(weights) == [0, 1] and weights[0] == weights[1]
    return weights[0]


@pytest.mark.parametrize('lost,other,extra', [
    (0, 1, []), (1, 0, []),
    (0, 1, ['--env', 'D2L_SHM=0'])],         # (answers on the van's TCP and the streams)
    ids=['server-0', 'server-1', 'server-0-tcp'])
def test_a_lost_server_s_replica_takes_over_and_the_weights_are_those_without_the_loss(
        without_replicas, lost, other, extra):
    r = run_launch('-n', 2, '-s', 2, '--server-replicas', 1, '--fail', f'server:{lost}@step=20',
                   *SPLIT, *extra, sys.executable, JOB)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert f'[server {lost}] d2ldist: server {lost} fails on purpose after its sync round 20' in out
    assert (f'd2l-launch: server {lost} failed ({KILLED}); its replicas take over '
            '(--server-replicas 1)') in out
    assert (f'[scheduler] d2ldist: server {lost} failed: its process ended, {KILLED}; '
            f'server {other} answers for shard {lost}') in out
    took = re.search(rf'^\[server {other}\] d2ldist: server {other} answers for shard {lost} '
                     r'now: its replica has every change up to (\d+)$', out, re.M)
    assert took, out[-4000:]
    # every round counted both pushes once (the job asserts it), and the weights are
    # exactly those of the run without replicas and without the loss
    assert finals(out, 'count') == {0: '1001', 1: '1001'}
    assert finals(out, 'weights') == {0: without_replicas, 1: without_replicas}
    assert wait_no_survivors(r.tag) == []


def test_with_three_workers_too_the_weights_are_those_without_the_loss():
    """Three workers' pushes come in any order; a server adds them in rank order, so the
    replica that sums again what the workers sent again gets the bits the lost server
    would have (with two, a + b is b + a anyway)."""
    runs = [run_launch('-n', 3, '-s', 2, *options, *SPLIT, sys.executable, JOB)
            for options in ([], ['--server-replicas', 1, '--fail', 'server:1@step=20'])]
    for r in runs:
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
        assert finals(r.stdout, 'count') == {0: '1001001', 1: '1001001', 2: '1001001'}
    assert 'server 0 answers for shard 1' in runs[1].stdout
    plain, lost = (finals(r.stdout, 'weights') for r in runs)
    assert len(set(plain.values())) == 1 and lost == plain, (plain, lost)
    assert wait_no_survivors(runs[1].tag) == []


def test_replicas_without_a_loss_change_nothing(without_replicas):
    r = run_launch('-n', 2, '-s', 2, '--server-replicas', 1, *SPLIT, sys.executable, JOB)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert finals(r.stdout, 'weights') == {0: without_replicas, 1: without_replicas}


def test_in_dist_async_every_push_is_counted_once_across_the_loss():
    r = run_launch('-n', 2, '-s', 2, '--server-replicas', 1, '--fail', 'server:0@step=30',
                   '--env', 'KV=dist_async', *SPLIT, sys.executable, JOB)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert '[server 0] d2ldist: server 0 fails on purpose after its push 30 (--fail)' in out
    assert 'server 1 answers for shard 0' in out
    # 40 steps of 1 (worker 0) and of 1000 (worker 1), each added once
    assert finals(out, 'count') == {0: '40040', 1: '40040'}
    assert wait_no_survivors(r.tag) == []


def test_a_shard_with_no_holder_left_stops_the_job_in_one_line():
    r = run_launch('-n', 2, '-s', 2, '--server-replicas', 1, '--fail', 'server:0@step=10',
                   '--fail', 'server:1@step=30', *SPLIT, sys.executable, JOB)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-4000:]
    assert 'server 1 answers for shard 0' in out
    assert '[scheduler] d2ldist: server 1 held the last copy of shards 0, 1: ' in out
    assert (f'[scheduler] d2ldist: server 1 failed: its process ended, {KILLED}; telling the '
            'others') in out
    assert re.search(rf'^\[worker \d\] d2ldist: server 1 failed \(its process ended, '
                     rf'{re.escape(KILLED)}\); worker \d gives up$', out, re.M), out[-4000:]
    assert 'Traceback' not in out
    assert wait_no_survivors(r.tag) == []


def test_a_new_replica_after_a_loss_makes_a_second_loss_lose_nothing(without_replicas):
    """Three servers, each shard on two: server 0 lost at its round 10, server 2 gets a
    copy of shard 0 and server 1 one of shard 2; server 1 lost at its round 30, after
    both came: server 2 answers for every shard, with the weights of the calm run. (Those
    are the same bits on 2 servers as on 3: every update is elementwise.)"""
    r = run_launch('-n', 2, '-s', 3, '--server-replicas', 1, '--fail', 'server:0@step=10',
                   '--fail', 'server:1@step=30', *SPLIT, sys.executable, JOB)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert ('server 1 answers for shard 0, server 2 gets a copy of shard 0, server 1 gets a '
            'copy of shard 2') in out
    copies = [out.index(f'[scheduler] d2ldist: {s} holds shard {n} now: its copy has come')
              for s, n in (('server 2', 0), ('server 1', 2))]
    second = out.index(f'[scheduler] d2ldist: server 1 failed: its process ended, {KILLED}; '
                       'server 2 answers for shard 0, server 2 answers for shard 1')
    assert max(copies) < second, out[-4000:]
    assert finals(out, 'count') == {0: '1001', 1: '1001'}
    assert finals(out, 'weights') == {0: without_replicas, 1: without_replicas}
    assert wait_no_survivors(r.tag) == []
