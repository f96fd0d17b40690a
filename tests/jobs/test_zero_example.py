"""examples/zero_digits.py in real jobs (issue 52 item 7): ZeRO's stages 0 and 2 on 3
workers; stage 2's checkpoint resumed at stage 1 on 3 workers and at stage 3 on 2. One
epoch (31 steps) each run: four jobs. And the elastic command of its docstring (two epochs,
a worker lost at step 20), and at stage 3 (one epoch) against its replay. Values and
SHA-256 lines, never times."""
import os
import re
import subprocess
import sys

import pytest

from support import ROOT, run_launch, wait_no_survivors

SCRIPT = ROOT / 'examples' / 'zero_digits.py'
EVERY = 20                        # save at step 20 of the epoch's 31


def zero_job(n, *args, launch=()):
    """The example on n workers for one epoch (``launch``: d2l-launch's options besides):
    its output, and each worker's final line."""
    r = run_launch('-n', n, '-s', 0, '--timeout', 90, *launch, sys.executable, SCRIPT,
                   '--epochs', 1, *args, timeout=120)
    assert wait_no_survivors(r.tag) == []
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    final = dict(re.findall(r'\[worker (\d)\] final weights after (\d+ steps: SHA-256 \w+)',
                            out))
    assert sorted(final) == [str(k) for k in range(n)]
    return out, final


def only(final):
    """The one final line every worker printed (they hold the same weights)."""
    assert len(set(final.values())) == 1, final
    return next(iter(final.values()))


def epoch_line(out):
    loss, accuracy = re.search(r'epoch 1: loss ([\d.]+), test accuracy ([\d.]+)', out).groups()
    return float(loss), float(accuracy)


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
    """Stage 2 on 3 workers, saving at step 20: the folder, the output and final line.
    Here d2l-launch's --checkpoint-dir (d2ldist.checkpoint's defaults: into step-K, from
    the newest), the resumes below the script's own flag: both write one layout."""
    folder = tmp_path_factory.mktemp('zero')
    out, final = zero_job(3, '--stage', 2,
                          launch=('--checkpoint-dir', folder, '--checkpoint-every', EVERY))
    return folder, out, only(final)


def test_plain_data_parallelism_ends_as_zero_up_to_rounding(saved):
    """Stage 0 all-reduces the gradients that stage 2 reduce-scatters, cut otherwise, so
    added in another order: in float64 it ends equal up to the printed digits."""
    _, out, stage_2 = saved
    assert stage_2.startswith('31 steps: ')
    got, final = zero_job(3, '--stage', 0)
    assert only(final).startswith('31 steps: ')
    assert epoch_line(got) == pytest.approx(epoch_line(out), abs=1.5e-4)


def test_a_checkpoint_resumes_on_3_workers_bit_for_bit_and_on_2_with_its_sha(saved):
    """The data order is the step count, and a checkpoint names tensors as if nothing were
    sharded. So stage 1 on 3 workers, resumed at step 20 from stage 2's checkpoint, ends
    with the bits of stage 2 never stopped (both reduce-scatter the same buckets); stage 3
    on 2 workers loads the state whose SHA-256 was saved, and ends close to it."""
    folder, out, whole = saved
    sha = re.findall(rf'checkpoint saved in {folder}/step-{EVERY} by 3 workers: state '
                     r'sha256 (\w{64})', out)
    assert len(sha) == 1 and sorted(p.name for p in folder.iterdir()) == [f'step-{EVERY}']
    for n, stage in ((3, 1), (2, 3)):
        got, final = zero_job(n, '--stage', stage, '--checkpoint-dir', folder,
                              '--checkpoint-every', EVERY)
        assert re.findall(rf'checkpoint loaded from {folder}/step-{EVERY} \(saved by 3 '
                          rf'workers\) by {n} workers: state sha256 (\w{{64}})', got) == sha
        assert 'checkpoint saved' not in got              # (steps 21 to 31: none is due)
        if n == 3:
            assert only(final) == whole
        else:                  # (the loss printed is worker 0's part: 24 examples, not 16)
            assert only(final).startswith('31 steps: ')
            assert epoch_line(got)[1] == pytest.approx(epoch_line(out)[1], abs=1.5e-3)


def test_a_stage_that_is_not_one_is_refused_in_one_line():
    bad = subprocess.run([sys.executable, SCRIPT, '--stage', '5'], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and bad.stdout == ''
    assert bad.stderr.startswith('zero_digits.py: error: argument --stage: invalid choice: 5')
    assert bad.stderr.count('\n') == 1


def losing_worker_1(stage, epochs):
    """The example on 3 workers under --min-workers 2 with shard replicas, worker 1 lost at
    its step 20: the output, and the final line of each of the two left (which go on)."""
    r = run_launch('-n', 3, '-s', 0, '--min-workers', 2, '--shard-replicas', 1, '--fail',
                   'worker:1@step=20', '--timeout', 150, sys.executable, SCRIPT, '--stage',
                   stage, '--epochs', epochs, timeout=200)
    assert wait_no_survivors(r.tag) == []
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert 'worker 1 failed (killed by SIGKILL (exit code 137)); 2 workers go on' in out
    final = dict(re.findall(r'\[worker (\d)\] final weights after (\d+ steps: SHA-256 \w+)',
                            out))
    assert sorted(final) == ['0', '2']
    return out, final


def test_under_min_workers_the_two_left_go_on_and_end_alike():
    """The docstring's elastic command: worker 1 dies at its step 20; the two left go back
    to their last commit, take its shard from its replica, cut each global batch for 2,
    and end with one SHA-256 after all the steps. Nothing left running."""
    out, final = losing_worker_1(2, epochs=2)
    assert 'worker 1 fails on purpose after its compute step 20 (--fail)' in out
    assert only(final).startswith('62 steps: ')


def test_at_stage_3_the_two_left_end_as_the_replay_of_the_loss(tmp_path):
    """Stage 3 with --shard-replicas 1, worker 1 lost at its step 20: the two left go back to
    commit 19 (worker 2 never gets worker 1's gradient shards of step 20), take its unit
    shards from worker 2's replica, cut each unit for 2, and end with the weights, bit for
    bit, of a replay: 3 workers to step 19, a checkpoint, 2 workers from it."""
    _, final = losing_worker_1(3, epochs=1)
    assert only(final).startswith('31 steps: ')
    replay = ('--stage', 3, '--checkpoint-dir', tmp_path, '--checkpoint-every', 19)
    zero_job(3, *replay)
    got, replayed = zero_job(2, *replay)
    assert f'checkpoint loaded from {tmp_path}/step-19 (saved by 3 workers) by 2' in got
    assert only(replayed) == only(final)


def test_min_workers_with_a_checkpoint_folder_is_refused_in_one_line(tmp_path):
    bad = subprocess.run([sys.executable, SCRIPT, '--checkpoint-dir', tmp_path],
                         capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, D2L_MIN_WORKERS='2'))
    assert bad.returncode == 2 and bad.stdout == '' and bad.stderr.count('\n') == 1
    assert '--checkpoint-dir with --min-workers' in bad.stderr


def test_a_fail_at_a_step_fires_at_stage_3():
    """Stage 3 steps a plain torch optimizer over the shards, and d2ldist still counts its
    steps (faults.watch): --fail worker:1@step=3 kills worker 1 after its compute of step
    3, before its update; the job stops, and nothing is left running."""
    r = run_launch('-n', 2, '-s', 0, '--fail', 'worker:1@step=3', '--timeout', 90,
                   sys.executable, SCRIPT, '--stage', 3, '--epochs', 1, timeout=120)
    assert wait_no_survivors(r.tag) == []
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert 'worker 1 fails on purpose after its compute step 3 (--fail)' in out, out[-3000:]
    assert 'final weights' not in out
