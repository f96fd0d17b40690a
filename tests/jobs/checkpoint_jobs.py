"""The checkpointed job of the checkpoint tests (checkpoint_job.py, 2 workers on the
digits), run stopped, started again or never stopped; helpers of test_checkpoint.py and
test_checkpoint_restarts.py."""
import json
import re
import sys

from support import ROOT, run_launch, wait_no_survivors


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


