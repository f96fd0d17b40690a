"""ZeRO that loses a worker without a disk (issue 52 item 4): stage 2 on 3 workers with
--shard-replicas 1 under --min-workers 2 (shard_replicas_job.py); a worker killed
mid-step; the two left take its shard from its successor's replica, cut the state again
and finish with the weights, bit for bit, of a replay of the same membership change: 3
workers to the commit they went back to, a checkpoint, then 2 workers from it. SHA-256
lines computed in the runs, never literals; nothing left running."""
import re
import sys

import pytest

from support import ROOT, run_launch, wait_no_survivors

JOB = ROOT / 'tests' / 'jobs' / 'shard_replicas_job.py'


def job(n, *args, launch=()):
    """The job on n workers: its output (it ended well, nothing left running)."""
    r = run_launch('-n', n, '-s', 0, '--timeout', 150, *launch, sys.executable, JOB, *args,
                   timeout=200)
    assert wait_no_survivors(r.tag) == []
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    return out


def finals(out):
    """{worker: the SHA-256 of its final weights}."""
    return dict(re.findall(r'^\[worker (\d)\] worker \1 final weights: SHA-256 (\w+)$',
                           out, re.M))


@pytest.mark.parametrize('lost', [1, 0])
def test_a_lost_workers_shard_comes_from_its_replica_and_the_end_is_the_replays(lost,
                                                                             tmp_path):
    out = job(3, launch=('--min-workers', 2, '--shard-replicas', 1,
                         '--fail', f'worker:{lost}@step=13'))   # batch 12's step()
    assert f'worker {lost} fails on purpose after its compute step 13 (--fail)' in out
    assert (f'd2l-launch: worker {lost} failed (killed by SIGKILL (exit code 137)); 2 workers '
            'go on (--min-workers 2)') in out
    left = [w for w in '012' if w != str(lost)]
    entered = re.findall(r'^\[worker (\d)\] worker \1: enters at batch (\d+) as rank (\d) of '
                         r'2$', out, re.M)
    assert sorted((w, rank) for w, _, rank in entered) == [(left[0], '0'), (left[1], '1')]
    batches = {int(b) for _, b, _ in entered}
    assert len(batches) == 1                       # the same commit on both
    k = batches.pop()
    assert k in (11, 12), out[-3000:]       # (batch 12's step was cut short)
    got = finals(out)
    assert sorted(got) == left and len(set(got.values())) == 1

    saved = tmp_path / 'commit'
    job(3, '--stop-at', k, '--save', saved)
    replayed = finals(job(2, '--resume', saved))
    assert sorted(replayed) == ['0', '1'] and set(replayed.values()) == set(got.values())
    if lost == 1:
        calm = finals(job(3))                      # (no loss: other weights)
        assert set(calm.values()) != set(got.values())


def test_without_replicas_zero_under_min_workers_is_refused_in_one_line():
    r = run_launch('-n', 2, '-s', 0, '--min-workers', 1, '--timeout', 60, sys.executable, JOB,
                   timeout=100)
    assert wait_no_survivors(r.tag) == []
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert "have one copy each" in out and '--shard-replicas 1' in out


def test_fail_at_a_step_fires_in_a_sharded_optimizer_job():
    """--fail worker:1@step=3 counts ShardedOptimizer's steps (faults.StepClock)."""
    r = run_launch('-n', 2, '-s', 0, '--fail', 'worker:1@step=3', '--timeout', 60,
                   sys.executable, JOB, timeout=100)
    assert wait_no_survivors(r.tag) == []
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert 'worker 1 fails on purpose after its compute step 3 (--fail)' in out, out[-3000:]
