"""Checkpoints of whole jobs (training/checkpoint.py): a job stopped by a failure and
started again with the same checkpoint folder goes on bit for bit, as if it never stopped.
The launcher's and torchrun's restarts: test_checkpoint_restarts.py; d2ldist.checkpoint
(ZeRO, FSDP2): test_sharded_checkpoint.py."""
import os
import re
import subprocess
import sys

import pytest

from checkpoint_jobs import EPOCHS, JOB, finals, job, stopped, uninterrupted
from support import IN_CI, need, run_launch, wait_no_survivors


@pytest.mark.parametrize('kvstore,servers,again,fail', [
    ('dist_sync', 2, 2, 'worker:1@step=25'),
    ('dist_sync', 2, 1, 'worker:0@step=25'),     # resumed with 1 server: states re-cut
    ('ring', 0, 0, 'worker:1@step=25')])
def test_a_stopped_job_resumes_bit_for_bit(tmp_path, kvstore, servers, again, fail):
    step = stopped(kvstore, servers, tmp_path, fail)
    r = job(kvstore, again, folder=tmp_path)
    assert f'resumed from {tmp_path}/step-{step:08d} (step {step}: epoch 1, batch {step})' \
        in r.stdout
    assert {f['sha256'] for f in finals(r).values()} == {uninterrupted(kvstore)}


def test_2bit_compression_resumes_bit_for_bit_with_what_it_kept_back(tmp_path):
    """Each worker's residuals (what 2-bit compression has not sent yet) are in its file."""
    step = stopped('dist_sync', 2, tmp_path, flags=('--2bit',))
    r = job('dist_sync', 2, folder=tmp_path, flags=('--2bit',))
    assert f'resumed from {tmp_path}/step-{step:08d} (step {step}' in r.stdout
    assert {f['sha256'] for f in finals(r).values()} == {uninterrupted('dist_sync', True)}


@pytest.mark.parametrize('kvstore,servers', [('ring', 0), ('dist_sync', 2)])
def test_workers_on_their_own_disks_agree_on_the_newest_step_all_hold(tmp_path, kvstore, servers):
    """No shared folder: each worker sees only its own files. Worker 1's write of step 20
    was cut off (its file is gone), so both resume from step 10, bit for bit."""
    own = ('--own-disk',)
    stopped(kvstore, servers, tmp_path, flags=own)
    for rank in (0, 1):               # (the kill may have cut worker 1's write of step 20)
        names = sorted(p.name for p in (tmp_path / f'host-{rank}').iterdir())
        assert names[0] == 'step-00000010' and names[1:] in ([], ['step-00000020']), names
        assert [p.name for p in (tmp_path / f'host-{rank}' / 'step-00000010').iterdir()] \
            == [f'worker-{rank}-of-2.ckpt']
    (tmp_path / 'host-1' / 'step-00000020' / 'worker-1-of-2.ckpt').unlink(missing_ok=True)
    r = job(kvstore, servers, folder=tmp_path, flags=own)
    assert f'resumed from {tmp_path}/host-0/step-00000010 (step 10: epoch 1, batch 10)' \
        in r.stdout
    assert {f['sha256'] for f in finals(r).values()} == {uninterrupted(kvstore)}


def test_a_damaged_newest_checkpoint_is_passed_over_in_one_line(tmp_path):
    if stopped('dist_sync', 2, tmp_path) != 20:
        pytest.skip('the kill cut off the write of step 20: nothing to damage')   # (rare)
    newest = tmp_path / 'step-00000020' / 'worker-1-of-2.ckpt'
    raw = bytearray(newest.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    newest.write_bytes(raw)
    r = job('dist_sync', 2, folder=tmp_path)
    lines = [line for line in (r.stdout + r.stderr).splitlines() if 'is damaged or cut short' in line]
    assert len(lines) == 1 and str(newest) in lines[0] and 'trying the checkpoint before' in lines[0]
    assert f'resumed from {tmp_path}/step-00000010 (step 10' in r.stdout
    assert {f['sha256'] for f in finals(r).values()} == {uninterrupted('dist_sync')}


def test_another_number_of_workers_is_refused_in_one_line(tmp_path):
    step = stopped('ring', 0, tmp_path)
    r = run_launch('-n', 3, '-s', 0, '--timeout', 60, sys.executable, JOB, 'ring', EPOCHS,
                   env={'D2L_CHECKPOINT_DIR': str(tmp_path)}, timeout=120)
    assert r.returncode != 0
    assert re.search(rf'step-{step:08d} was saved by 2 workers and this job has 3: start it '
                     r'with -n 2, or give it another checkpoint folder', r.stdout + r.stderr)
    assert 'Traceback' not in r.stdout + r.stderr
    assert wait_no_survivors(r.tag) == []


def test_dist_async_resumes_each_worker_at_its_own_step(tmp_path):
    """In dist_async a checkpoint is each worker at its step 20 and the servers' weights
    when worker 0 was there: not bit for bit, but the job finishes every step, and learns."""
    step = stopped('dist_async', 2, tmp_path)
    r = job('dist_async', 2, folder=tmp_path)
    assert f'resumed from {tmp_path}/step-{step:08d}' in r.stdout
    assert all(f['test_acc'] > 0.85 for f in finals(r).values())
    assert len(re.findall(r'\[worker [01]\] epoch 2, loss', r.stdout)) == 2


@pytest.fixture
def small_disk(tmp_path):
    """A 160 KB tmpfs: room for two or three of the job's checkpoint files, not more."""
    folder = tmp_path / 'disk'
    folder.mkdir()
    if os.geteuid() != 0 and not IN_CI:
        pytest.skip('mounting a tmpfs needs root')
    done = subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=160k', 'tmpfs', str(folder)],
                          capture_output=True, text=True)
    need(done.returncode == 0, f'a small tmpfs ({done.stderr.strip()})')
    try:
        yield folder
    finally:
        subprocess.run(['umount', '-l', str(folder)], check=False)


def test_a_full_disk_warns_once_per_write_and_training_goes_on(small_disk):
    from d2ldist.training.checkpoint import read_file
    r = job('dist_sync', 2, folder=small_disk, every=5)
    warnings = [line for line in (r.stdout + r.stderr).splitlines() if 'not written' in line]
    assert warnings and all('No space left on device' in line for line in warnings)
    assert {f['sha256'] for f in finals(r).values()} == {uninterrupted('dist_sync')}
    files = list(small_disk.rglob('*'))
    assert not [f for f in files if '.tmp' in f.name], 'a temporary file was left'
    for f in files:                   # whatever is there reads back whole
        if f.is_file():
            read_file(f)
