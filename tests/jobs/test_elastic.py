"""Elastic workers (d2l-launch --min-workers) in real jobs. On the ring (hvd.elastic): a
worker killed at step 40 of 100, the survivors re-form the ring and finish with the
weights a replay of the same membership change in one process gives (elastic_job.py).
On the parameter server: the servers' rounds count the workers left, each push once,
and a worker started again trains from the current values (kv_elastic_job.py)."""
import itertools
import json
import re
import sys

import pytest
import torch

from support import ROOT, run_launch, wait_no_survivors
from d2ldist.timeline import load
from elastic_job import BATCH, LOCAL, STEPS, replay, replay_sampler
from elastic_train_job import replay as replay_train

JOB = ROOT / 'tests' / 'jobs' / 'elastic_job.py'
KV_JOB = ROOT / 'tests' / 'jobs' / 'kv_elastic_job.py'
KILL = ['--fail', 'worker:1@step=40']
# Where the survivors go back to after a kill at the end of step 40's compute (batch 39):
# the killed worker had ended batch 38's all-reduce, so each survivor had at least entered
# it (commit 38: one still in it when the news came, on a busy machine, drops it), had
# ended it (39), or had even ended batch 39's, sent from the backward pass before the kill
# (40). Rank 0's commit is the one all take (State.sync).
AFTER_KILL = (38, 39, 40)


def entries(out, at='batch'):
    """{worker: [(batch, rank, size)]}: where each worker entered train()."""
    found = {}
    for w, batch, rank, size in re.findall(
            rf'^\[worker \d\] worker (\d): enters at {at} (\d+) as rank (\d) of (\d)$', out, re.M):
        found.setdefault(int(w), []).append((int(batch), int(rank), int(size)))
    return found


def finals(out, what):
    """{worker: the JSON after 'worker W <what>'}: its final weights, the samples it read."""
    return {int(w): json.loads(v) for w, v in
            re.findall(rf'^\[worker \d\] worker (\d) {what} (\[.*\])$', out, re.M)}


KILLED = 'killed by SIGKILL (exit code 137)'


@pytest.mark.parametrize('lost,fault,how,commits', [
    (1, KILL, KILLED, AFTER_KILL),
    (1, KILL + ['--env', 'D2L_SHM=0'], KILLED, AFTER_KILL),  # (the ring's own TCP streams)
    (0, ['--fail', 'worker:0@step=40'], KILLED, AFTER_KILL),  # rank 0: worker 1 takes its place
    # an error before batch 20: worker 1 ended step 19's all-reduce, the others may still
    # have been in it when the news came (so back to 19, the commit before it), as a kill
    (1, ['--env', 'RAISE_ON=1'], 'exit code 1', (19, 20))],
    ids=['killed', 'killed-tcp', 'killed-rank-0', 'error'])
def test_a_lost_worker_is_left_out_and_the_survivors_finish_as_the_replay(lost, fault, how,
                                                                          commits, tmp_path):
    timeline = ['--timeline', tmp_path / 't.json', '--timeline-steps', '36-44'] \
        if fault is KILL else []
    r = run_launch('-n', 3, '-s', 0, '--min-workers', 2, *fault, *timeline, '--timeout', 150,
                   sys.executable, JOB, timeout=200)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert f'd2l-launch: worker {lost} failed ({how}); 2 workers go on (--min-workers 2)' in out
    assert re.search(rf'^\[scheduler\] d2ldist: worker {lost} failed: .*; the ring re-forms '
                     r'with 2 workers \(round 1\)$', out, re.M), out[-4000:]
    a, b = survivors = [w for w in (0, 1, 2) if w != lost]
    for w in survivors:
        assert re.search(rf'^\[worker {w}\] d2ldist: worker {w}: worker {lost} was lost '
                         r'\(.*\); 2 workers go on \(round 1\); back to the last commit$',
                         out, re.M)
    # the survivors went back to the same commit, as ranks 0 and 1 of 2 (in their old order)
    seen = entries(out)
    k = seen[a][1][0]
    assert seen == {lost: [(0, lost, 3)], a: [(0, a, 3), (k, 0, 2)], b: [(0, b, 3), (k, 1, 2)]}
    assert k in commits
    # equal weights, those of the same membership change replayed in one process
    weights = finals(out, 'done:')
    assert sorted(weights) == survivors and weights[a] == weights[b]
    expected = replay([3] * k + [2] * (STEPS - k))
    assert torch.allclose(torch.tensor(weights[a]), torch.tensor(expected), rtol=1e-12,
                          atol=1e-12), (weights[a], expected)
    assert not torch.allclose(torch.tensor(expected), torch.tensor(replay([3] * STEPS)))
    # from the commit on, every sample of the epoch was read once, by one of the two
    read = finals(out, 'read')
    assert sorted(read[a] + read[b]) == list(range(k * BATCH, STEPS * BATCH))
    assert wait_no_survivors(r.tag) == []
    if timeline:          # the loss marked, the lost worker's steps up to its last compute
        spans = load(tmp_path / 't.json')
        assert [(s.name, s.cat) for s in spans if s.lane == 'job'] == [('worker 1 lost', 'change')]
        steps = {w: {s.step for s in spans if s.lane == f'worker {w} training' and s.cat == 'step'}
                 for w in (0, 1, 2)}
        assert max(steps[1]) == 40 and steps[0] == steps[2] == set(range(36, 45))


@pytest.mark.parametrize('elastic', [[], ['--min-workers', 3]], ids=['not-elastic', 'min-3'])
def test_without_enough_workers_left_the_kill_stops_the_job(elastic):
    r = run_launch('-n', 3, '-s', 0, *elastic, *KILL, '--timeout', 120, sys.executable, JOB,
                   timeout=180)
    out = r.stdout + r.stderr
    assert r.returncode == 137, out[-4000:]
    assert out.count('d2l-launch: worker 1 failed (killed by SIGKILL (exit code 137)); '
                     'the job was stopped.') == 1, out[-4000:]
    assert 'go on' not in out and 're-forms' not in out and ' done: ' not in out
    assert wait_no_survivors(r.tag) == []


def test_with_the_elastic_sampler_the_survivors_read_what_is_left_of_the_epoch_once():
    """A DataLoader on an ElasticSampler: after the reset the samples not yet read are
    cut in two, and the weights are those of the replay (global batches of 12, then 8)."""
    r = run_launch('-n', 3, '-s', 0, '--min-workers', 2, *KILL, '--timeout', 150,
                   sys.executable, JOB, 'sampler', timeout=200)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    seen = entries(out, at='sample')
    done = seen[0][1][0]
    assert seen == {0: [(0, 0, 3), (done, 0, 2)], 1: [(0, 1, 3)], 2: [(0, 2, 3), (done, 1, 2)]}
    assert done in [k * 3 * LOCAL for k in AFTER_KILL]
    read = finals(out, 'read')
    assert sorted(read[0] + read[2]) == list(range(done, STEPS * BATCH))
    weights = finals(out, 'done:')
    assert weights[0] == weights[2]
    expected = replay_sampler(done // (3 * LOCAL))
    assert torch.allclose(torch.tensor(weights[0]), torch.tensor(expected), rtol=1e-12,
                          atol=1e-12), (weights[0], expected)
    assert wait_no_survivors(r.tag) == []


def test_a_lost_worker_started_again_joins_and_trains_from_the_current_weights(tmp_path):
    """--restart-lost (--max-workers 3): the launcher starts worker 1 again; it joins (at
    once in its own place, if it registers before its loss is noticed; else at the two survivors' next
    commit, where they go on from without going back), takes rank 0's state by
    broadcast, and all three end with the weights of the replay of those memberships.
    (Worker 0 is a little slow, so that the job does not end before it has joined.)"""
    r = run_launch('-n', 3, '-s', 0, '--min-workers', 2, '--max-workers', 3, '--restart-lost',
                   *KILL,
                   '--slow', 'worker:0=+30ms', '--log-dir', tmp_path, '--timeout', 150,
                   sys.executable, JOB, timeout=200)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert ('d2l-launch: starting worker 1 again, to join the job (--restart-lost, at most 3 '
            'workers)') in out
    how = re.search(r'^\[scheduler\] d2ldist: worker 1 (was started again|joins); the ring '
                    r're-forms with 3 workers \(round \d\)$', out, re.M)
    assert how, out[-4000:]
    if how[1] == 'joins':          # the survivors took it in at a commit: only the loss
        assert ('[scheduler] d2ldist: worker 1 waits to join; the workers take it in at '
                'their next commit') in out          # sent them back to an earlier one
        for w in (0, 2):
            assert len(re.findall(rf'^\[worker {w}\] .*; back to the last commit$', out,
                                  re.M)) == 1, out[-4000:]
    seen = entries(out)
    last = seen[0][-1][0]
    assert seen[0][-1] == (last, 0, 3) and seen[2][-1] == (last, 2, 3)
    assert seen[1] == [(0, 1, 3), (last, 1, 3)]          # the first worker 1, the new one
    sizes = []
    for (batch, _, size), (until, _, _) in zip(seen[0], seen[0][1:] + [(STEPS, 0, 0)]):
        sizes += [size] * (until - batch)
    weights = finals(out, 'done:')
    assert sorted(weights) == [0, 1, 2] and weights[0] == weights[1] == weights[2]
    assert torch.allclose(torch.tensor(weights[0]), torch.tensor(replay(sizes)), rtol=1e-12,
                          atol=1e-12), (sizes, weights[0])
    read = finals(out, 'read')
    assert sorted(read[0] + read[1] + read[2]) == list(range(last * BATCH, STEPS * BATCH))
    first, again = (tmp_path / 'worker-1.log').read_text(), (tmp_path / 'worker-1.again.log')
    assert 'fails on purpose' in first and f'enters at batch {last} as rank 1' in again.read_text()
    assert wait_no_survivors(r.tag) == []


HOROVOD_EXAMPLE = ROOT / 'examples' / 'horovod_elastic_digits.py'


def test_a_script_written_as_horovods_elastic_example_survives_a_loss_and_takes_it_back():
    """examples/horovod_elastic_digits.py makes Horovod's pytorch_mnist_elastic.py's calls
    (TorchState(model, optimizer, epoch=1, batch=0), ``for state.epoch``/``state.batch``
    loops, a commit per batch, the learning rate reset for hvd.size()): worker 1 killed
    after step 20, the two others go on as ranks 0 and 1 of 2, worker 1 started again
    joins at their next commit as rank 1 of 3, and the model learns."""
    r = run_launch('-n', 3, '-s', 0, '--min-workers', 2, '--max-workers', 3, '--restart-lost',
                   *KILL[:1],
                   'worker:1@step=20', '--slow', 'worker:0=+30ms', '--timeout', 150,
                   sys.executable, HOROVOD_EXAMPLE, '--epochs', 8, '--log-interval', 1,
                   timeout=200)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    for line in ('d2l-launch: worker 1 failed (killed by SIGKILL (exit code 137)); 2 workers '
                 'go on (--min-workers 2)',
                 '[scheduler] d2ldist: worker 1 waits to join; the workers take it in at '
                 'their next commit'):
        assert line in out, out[-4000:]
    assert re.search(r'^\[scheduler\] d2ldist: worker 1 joins; the ring re-forms with 3 '
                     r'workers \(round 2\)$', out, re.M), out[-4000:]
    ranks = re.findall(r'^\[worker (\d)\] epoch (\d) batch \d+ as rank (\d) of (\d): loss',
                       out, re.M)
    for w in ('0', '2'):          # of 3, of 2 after the loss, of 3 again after the join
        sizes = [size for who, _, _, size in ranks if who == w]
        assert [size for size, _ in itertools.groupby(sizes)] == ['3', '2', '3'], sizes
    accuracy = re.search(r'^\[worker 0\] test loss [\d.]+, test accuracy ([\d.]+) \(3 '
                         r'workers at the end\)$', out, re.M)
    assert accuracy and float(accuracy[1]) > 0.9, out[-4000:]
    assert wait_no_survivors(r.tag) == []


# -- the parameter server ---------------------------------------------------------------------
def kv_job(*options, env=()):
    """kv_elastic_job.py on 3 workers and 2 servers, worker 1 killed after step 40."""
    r = run_launch('-n', 3, '-s', 2, '--min-workers', 2, *options, *KILL,
                   '--env', 'D2L_KVSTORE_BIGARRAY_BOUND=1000', *env, '--timeout', 150,
                   sys.executable, KV_JOB, timeout=200)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert ('d2l-launch: worker 1 failed (killed by SIGKILL (exit code 137)); 2 workers go '
            'on (--min-workers 2)') in out
    values = finals(out, 'values')
    final = {int(w): int(v) for w, v in re.findall(r'^\[worker \d\] worker (\d) final (\d+)$',
                                                   out, re.M)}
    assert sorted(values) == sorted(final) == [0, 2], out[-4000:]
    assert wait_no_survivors(r.tag) == []
    return out, values, final


def counted(value):
    """The pushes a value counts, per rank: 39039039 -> [39, 39, 39] (kv_elastic_job.py)."""
    return [value // 1000 ** r % 1000 for r in range(3)]


def rounds(values):
    """What each sync round added: the pushes it counted, per rank."""
    return [counted(b - a) for a, b in zip([0] + values, values)]


def test_a_lost_worker_leaves_the_sync_rounds_to_the_workers_left_each_push_counted_once():
    out, values, final = kv_job()
    # the launcher saw the process end, and told the scheduler (no wait for heartbeats)
    assert re.search(r"^\[scheduler\] d2ldist: worker 1 failed: its process ended, killed by "
                     r"SIGKILL \(exit code 137\); the servers' rounds count 2 workers "
                     r"\(round 1\)$", out, re.M), out[-4000:]
    assert values[0] == values[2] and len(values[0]) == 100
    # rounds 1-39 counted all three, the round open at the kill and the later ones two
    assert rounds(values[0]) == [[1, 1, 1]] * 39 + [[1, 0, 1]] * 61
    assert final == {0: 100_039_100, 2: 100_039_100}


def test_a_lost_worker_never_stops_dist_async_and_each_push_is_added_once():
    out, values, final = kv_job(env=['--env', 'KV=dist_async'])
    assert final == {0: 100_039_100, 2: 100_039_100}    # 100, 39 and 100 pushes
    for w in (0, 2):                   # each value came after the worker's own push
        assert [counted(v)[w] for v in values[w]] == list(range(1, 101))
        assert max(counted(v)[1] for v in values[w]) == 39


def test_a_lost_worker_started_again_pulls_the_current_values_and_joins_the_rounds():
    """--restart-lost (--max-workers 3): worker 1 starts again and joins, in its own place
    (before its loss was noticed) or after the two went on for a while: either way it pulls the
    values of the last round that closed, its 20 pushes each count once, in 20 rounds."""
    out, values, final = kv_job('--max-workers', 3, '--restart-lost', env=['--env', 'JOIN=1'])
    assert ('d2l-launch: starting worker 1 again, to join the job (--restart-lost, at most 3 '
            'workers)') in out
    assert re.search(r"^\[scheduler\] d2ldist: worker 1 (was started again|joins); the "
                     r"servers' rounds count 3 workers \(round \d\)$", out, re.M), out[-4000:]
    assert values[0] == values[2]
    added = rounds(values[0])
    assert added[:39] == [[1, 1, 1]] * 39
    assert all(a in ([1, 0, 1], [1, 1, 1]) for a in added[39:])
    assert sum(a[1] for a in added[39:]) == 20
    joined_at = int(re.search(r'^\[worker 1\] worker 1 joins at (\d+)$', out, re.M)[1])
    assert joined_at in values[0][38:] and counted(joined_at)[1] == 39
    n = len(values[0])
    assert final == {0: n * 1_000_001 + 59_000, 2: n * 1_000_001 + 59_000}


# -- d2ldist.train on the ring ----------------------------------------------------------------
TRAIN_JOB = ROOT / 'tests' / 'jobs' / 'elastic_train_job.py'


def test_d2ldist_train_on_the_ring_goes_on_from_the_last_commit_as_the_replay():
    """d2ldist.train under --min-workers (elastic_train_job.py, 2 epochs of 15 steps):
    worker 2 killed after its compute of step 20; the two others go back to rank 0's last
    commit (step 18, 19 or 20, as AFTER_KILL), re-form the ring, and end with equal
    weights, those of the replay of all three workers' batches up to that step and the
    two survivors' after it (each keeps its part of the data); the loss falls."""
    r = run_launch('-n', 3, '-s', 0, '--min-workers', 2, '--fail', 'worker:2@step=20',
                   '--timeout', 150, sys.executable, TRAIN_JOB, timeout=200)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert ('d2l-launch: worker 2 failed (killed by SIGKILL (exit code 137)); 2 workers go '
            'on (--min-workers 2)') in out
    went_on = re.findall(r'^\[worker (\d)\] d2ldist: worker \1: goes on from step (\d+) '
                         r'\(epoch (\d), batch (\d+)\) as rank (\d) of 2$', out, re.M)
    assert sorted((w, rank) for w, *_, rank in went_on) == [('0', '0'), ('1', '1')], out[-4000:]
    assert len({tuple(place) for _, *place, _ in went_on}) == 1   # rank 0's, on both
    k, epoch, batch = map(int, went_on[0][1:4])
    assert k in (18, 19, 20) and (epoch, batch) == (2, k - 15)
    weights = {int(w): json.loads(v)['weights'] for w, v in
               re.findall(r'^\[worker (\d)\] FINAL (.*)$', out, re.M)}
    assert sorted(weights) == [0, 1] and weights[0] == weights[1]
    expected = torch.tensor(replay_train([[0, 1, 2]] * k + [[0, 1]] * (30 - k)))
    assert torch.allclose(torch.tensor(weights[0]), expected, rtol=1e-9, atol=1e-12)
    calm = torch.tensor(replay_train([[0, 1, 2]] * 30))
    assert not torch.allclose(expected, calm, rtol=1e-6)
    for w in (0, 1):
        losses = [float(x) for x in re.findall(rf'^\[worker {w}\] epoch \d, loss ([\d.]+),',
                                               out, re.M)]
        assert len(losses) == 2 and losses[1] < losses[0]
    assert wait_no_survivors(r.tag) == []
