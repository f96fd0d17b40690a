"""A checkpointed job restarted by the launcher (d2l-launch --max-restarts), the book's
training script restarted, and torchrun's workers stopped and started again: each ends
with the weights of the job that never stopped (training/checkpoint.py)."""
import json
import re
import sys

import pytest

from checkpoint_jobs import EPOCHS, JOB, complete_steps, finals, resumed_step, uninterrupted
from d2ldist.timeline import load
from support import ROOT, run_launch, run_torchrun, wait_no_survivors


# -- with d2l-launch --max-restarts: one command, the job stopped and started again ----------
@pytest.mark.parametrize('fail', ['worker:1@step=25', 'server:0@step=25', 'scheduler@4s'])
def test_a_restarted_job_ends_as_if_nothing_had_failed(tmp_path, fail):
    """A worker, a server (each at a chosen step) or the scheduler (at a time) killed; the
    launcher starts the job again and it resumes: the same final weights, nothing left."""
    # The scheduler's fault comes at a time, and with a thread each the job may end within
    # 4 s: a worker slower by 100 ms a step (in attempt 0 only, as --fail) outlasts it.
    slow = ['--slow', 'worker:0=+100ms'] if fail.startswith('scheduler') else []
    folder, timeline = tmp_path / 'ckpt', tmp_path / 't.json'
    r = run_launch('-n', 2, '-s', 2, '--max-restarts', 1, '--checkpoint-dir', folder,
                   '--checkpoint-every', 10, '--fail', fail, *slow, '--timeline', timeline,
                   '--timeline-steps', '16-30', '--timeout', 150,
                   sys.executable, JOB, 'dist_sync', EPOCHS, timeout=240)
    assert wait_no_survivors(r.tag) == []
    out = r.stdout + r.stderr
    assert 'fails on purpose' in out and 'restart 1 of 1' in out
    # The newest complete checkpoint: step 20's, or step 10's where the kill cut off the
    # write of step 20 (a thread writes it while steps 21 to 25 train; see stopped()).
    resumed = resumed_step(out, folder)
    if 'step' in fail:                   # (the scheduler's time may come before step 10)
        assert resumed in (10, 20), out[-3000:]
    assert {f['sha256'] for f in finals(r).values()} == {uninterrupted('dist_sync')}
    spans = load(timeline)               # the restart marked; its steps numbered on from there
    assert [s.cat for s in spans if s.lane == 'job'] == ['restart']
    if fail.startswith('worker'):        # steps 21 to 24 or 25 computed twice: worker 1
        for w in (0, 1):                 # died in step 25's compute, worker 0 was stopped
            computed = sorted(s.step for s in spans if s.lane == f'worker {w} training'
                              and s.name == '1 forward, backward')     # (spans that ended)
            again = range(max(16, resumed + 1), 31)                    # (the timeline's 16-30)
            assert computed in [sorted([*range(16, last + 1), *again])
                                for last in ((24, 25) if w == 0 else (24,))], computed


def test_the_books_training_script_resumes_bit_for_bit(tmp_path):
    """examples/multimachine_cifar10_train.py (the ResNet-18 chapter's script, on
    d2ldist.train) restarted after a kill prints the uninterrupted run's fingerprint."""
    script = [sys.executable, ROOT / 'examples' / 'multimachine_cifar10_train.py', '--kvstore',
              'dist_sync', '--data', 'digits', '--epochs', 1, '--width', 8, '--threads', 1]

    def fingerprints(r):
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert wait_no_survivors(r.tag) == []
        return re.findall(r'\[worker (\d)\] final weights and BatchNorm statistics: SHA-256 '
                          r'([0-9a-f]{16})', r.stdout)

    plain = fingerprints(run_launch('-n', 2, '-s', 2, '--timeout', 150, *script, timeout=240))
    assert len(plain) == 2 and plain[0][1] == plain[1][1]
    r = run_launch('-n', 2, '-s', 2, '--max-restarts', 1, '--checkpoint-dir', tmp_path,
                   '--checkpoint-every', 5, '--fail', 'worker:0@step=13', '--timeout', 150,
                   *script, timeout=240)
    # step 10's checkpoint, or step 5's where the kill cut off the write of step 10 (a
    # thread writes it while steps 11 to 13 train)
    assert resumed_step(r.stdout, tmp_path) in (5, 10)
    assert sorted(fingerprints(r)) == sorted(plain)


def torchrun(tmp_path, **env):
    """The job as torchrun's 2 workers on the 'torch' store; its CompletedProcess."""
    return run_torchrun(JOB, 'torch', EPOCHS, env=env, cwd=tmp_path)


def test_under_torchrun_a_stopped_job_resumes_bit_for_bit(tmp_path):
    """The production path: torchrun's workers, ranks from torch.distributed, the same
    checkpoints (D2L_CHECKPOINT_DIR), stopped at step 25 by D2L_FAIL and started again."""
    plain = re.findall(r'FINAL (.*)', torchrun(tmp_path).stdout)
    assert len(plain) == 2 and len({json.loads(f)['sha256'] for f in plain}) == 1
    folder = {'D2L_CHECKPOINT_DIR': str(tmp_path / 'ckpt'), 'D2L_CHECKPOINT_EVERY': '10'}
    assert torchrun(tmp_path, D2L_FAIL='step=25', **folder).returncode != 0
    whole = complete_steps(tmp_path / 'ckpt')
    assert whole and whole[0] == 10, whole   # (20 too, unless the kill cut off its write)
    again = torchrun(tmp_path, **folder)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    # (printed relative to the workers' folder, tmp_path: no absolute path in a notebook)
    assert f'resumed from ckpt/step-{whole[-1]:08d}' in again.stdout + again.stderr
    assert sorted(re.findall(r'FINAL (.*)', again.stdout)) == sorted(plain)
