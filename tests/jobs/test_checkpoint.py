"""Checkpoints of whole jobs (training/checkpoint.py): a job stopped by a failure and
started again with the same checkpoint folder goes on bit for bit, as if it never stopped.
At the end, d2ldist.checkpoint (training/sharded_checkpoint.py): ZeRO saved by 3 workers
and resumed by 2; FSDP2 saved in DCP's format and loaded by plain PyTorch."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from support import IN_CI, ROOT, need, run_launch, run_torchrun, wait_no_survivors
from d2ldist.timeline import load

JOB = ROOT / 'tests' / 'jobs' / 'checkpoint_job.py'
EPOCHS = 2                       # 2 x 23 steps of 2 workers on the digits
_uninterrupted = {}


def finals(r):
    """Each worker's FINAL record, by rank (the job must have ended well)."""
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    found = {f['rank']: f for f in map(json.loads, re.findall(r'FINAL (.*)', r.stdout))}
    assert sorted(found) == [0, 1], r.stdout[-3000:]
    return found


def job(kvstore, servers, *options, folder=None, every=10, flags=()):
    """Run the job; with ``folder``, saving checkpoints there every ``every`` steps.
    ``flags``: the job's own (--2bit, --own-disk)."""
    env = {'D2L_CHECKPOINT_DIR': str(folder), 'D2L_CHECKPOINT_EVERY': str(every)} \
        if folder else {}
    r = run_launch('-n', 2, '-s', servers, *options, '--timeout', 120, sys.executable, JOB,
                   kvstore, EPOCHS, *flags, env=env, timeout=180)
    assert wait_no_survivors(r.tag) == []
    return r


def uninterrupted(kvstore, compression=False):
    """The SHA-256 of the final weights of the job that never stopped (once per store)."""
    flags = ('--2bit',) if compression else ()
    if (kvstore, flags) not in _uninterrupted:
        found = finals(job(kvstore, 2 if kvstore.startswith('dist') else 0, flags=flags))
        assert found[0]['sha256'] == found[1]['sha256']
        _uninterrupted[kvstore, flags] = found[0]['sha256']
    return _uninterrupted[kvstore, flags]


def complete_steps(folder, steps=(10, 20)):
    """The steps among ``steps`` whose checkpoint in ``folder`` has both workers' files."""
    return [step for step in steps if all(
        (folder / f'step-{step:08d}' / f'worker-{w}-of-2.ckpt').exists() for w in (0, 1))]


def resumed_step(out, folder):
    """The step of the checkpoint in ``folder`` that the job says it resumed from, or None."""
    found = re.search(rf'resumed from {re.escape(str(folder))}/step-(\d+) ', out)
    return int(found.group(1)) if found else None


def stopped(kvstore, servers, folder, fail='worker:1@step=25', flags=()):
    """The job, killed by --fail after its checkpoints of steps 10 and 20; the step of the
    newest checkpoint whose files are all whole, which a job started again must resume
    from. (A checkpoint is written on a thread while training goes on, so the kill may
    cut off the write of step 20 on a slow disk: then step 10 is the newest.)"""
    r = job(kvstore, servers, '--fail', fail, folder=folder, flags=flags)
    assert r.returncode != 0 and 'fails on purpose' in r.stdout + r.stderr
    if '--own-disk' in flags:
        return None
    names = sorted(p.name for p in folder.iterdir())
    if kvstore == 'dist_async':         # worker 0 went on alone until the job was stopped
        assert names[:2] == ['step-00000010', 'step-00000020'], names
        assert not list(folder.glob('step-0000003*/worker-1-*')), 'worker 1 died at step 25'
    else:
        assert names in (['step-00000010'], ['step-00000010', 'step-00000020']), names
    whole = complete_steps(folder)
    assert whole and whole[0] == 10, names
    return whole[-1]


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


# -- d2ldist.checkpoint: sharded training saved by N workers, resumed by M -------------------
SHARDED_JOB = ROOT / 'tests' / 'jobs' / 'sharded_checkpoint_job.py'


def sharded_job(n, stage, folder, *save_at):
    """The ZeRO job on the ring with n workers, to step 8; its output and RESULT records."""
    r = run_launch('-n', n, '-s', 0, '--timeout', 90, sys.executable, SHARDED_JOB, stage,
                   folder, 8, *save_at, timeout=120)
    assert wait_no_survivors(r.tag) == []
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    found = [json.loads(line) for line in re.findall(r'RESULT (.*)', r.stdout)]
    assert sorted(f['rank'] for f in found) == list(range(n))
    return r.stdout + r.stderr, found


def test_zero_stage_2_saved_by_3_workers_resumes_on_2(tmp_path):
    """3 workers save at step 4 and go on to step 8; 2 workers load it and go on to step
    8 from there: the whole state's SHA-256 at the load is the save's, and both end with
    the same weights (up to float64's rounding: 2 workers sum in another order)."""
    out, three = sharded_job(3, 2, tmp_path, '--save-at', 4)
    saved = re.findall(rf'checkpoint saved in {tmp_path} by 3 workers: state sha256 '
                       r'([0-9a-f]{64})', out)
    assert len(saved) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == \
        ['manifest.json', 'shard-0-of-3.ckpt', 'shard-1-of-3.ckpt', 'shard-2-of-3.ckpt']
    out, two = sharded_job(2, 2, tmp_path)
    assert re.findall(rf'checkpoint loaded from {tmp_path} \(saved by 3 workers\) by 2 '
                      r'workers: state sha256 ([0-9a-f]{64})', out) == saved
    assert {f['began'] for f in two} == {4} and {f['began'] for f in three} == {0}
    for f in two:
        for name, w in f['weights'].items():
            assert torch.allclose(torch.tensor(w), torch.tensor(three[0]['weights'][name]),
                                  rtol=1e-10, atol=1e-13)


# -- FSDP2 on the torch backend: DCP's format, loaded by plain PyTorch ------------------------
FSDP2_JOB = ROOT / 'tests' / 'jobs' / 'fsdp2_checkpoint_job.py'
PLAIN_LOAD = ROOT / 'tests' / 'jobs' / 'fsdp2_plain_load.py'


def fsdp2_job(n, folder, *flags):
    """The FSDP2 job on the torch backend with n workers; its output."""
    r = run_launch('-n', n, '-s', 0, '--timeout', 60, '--env', 'D2L_BACKEND=torch',
                   sys.executable, FSDP2_JOB, folder, 4, *flags, timeout=90)
    assert wait_no_survivors(r.tag) == []
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout + r.stderr


def test_fsdp2_saved_by_2_workers_loads_in_plain_torch_and_in_d2ldist_on_3(tmp_path):
    """2 workers train an FSDP2 MLP 4 steps and save: DCP's files. A plain PyTorch
    script (torchrun, 3 workers, no d2ldist) loads them with dcp.load into its own FSDP2
    model: its whole state's SHA-256 is the one d2ldist printed at save; d2ldist on 3
    workers loads them too, to the same line."""
    folder = tmp_path / 'ckpt'
    saved = re.findall(rf'checkpoint saved in {folder} by 2 workers: state sha256 '
                       r'([0-9a-f]{64})', fsdp2_job(2, folder))
    assert len(saved) == 1
    assert sorted(p.name for p in folder.iterdir()) == \
        ['.metadata', '__0_0.distcp', '__1_0.distcp', 'manifest.json']
    plain = run_torchrun(PLAIN_LOAD, folder, workers=3, timeout=90)
    assert plain.returncode == 0, plain.stdout[-3000:] + plain.stderr[-3000:]
    assert [json.loads(x) for x in re.findall(r'LOADED (.*)', plain.stdout)] == \
        [{'step': 4, 'workers': 3, 'sha256': saved[0]}]
    assert re.findall(rf'checkpoint loaded from {folder} \(saved by 2 workers\) by 3 '
                      r'workers: state sha256 ([0-9a-f]{64})',
                      fsdp2_job(3, folder, '--load')) == saved
