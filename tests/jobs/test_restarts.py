"""d2l-launch --max-restarts with real processes: a failed job is stopped whole and
started again; --fail acts in the first attempt only; Ctrl-C never restarts."""
import re
import signal

from support import run_launch, start_launch, tagged_pids, wait_no_survivors
from test_launch import _exit_code_or_where, _wait_for_ready

# kv pushpulls that report their step; worker 1 exits 3 in attempt 0 if told to
# (FAIL_ONCE), and attempt 1 says it resumed from step 2, as a checkpoint would
KV_JOB = r'''
import os, sys
import torch
import d2ldist
attempt = int(os.environ['D2L_RESTART'])
kv = d2ldist.kv.create('dist_sync')
print(f'worker {kv.rank} in attempt {attempt}', flush=True)
kv.init(['a', 'b'], [torch.zeros(10), torch.zeros(3)])
first = 2 if attempt else 0
if first:
    d2ldist.report(resumed_from=first)
out = [torch.empty(10), torch.empty(3)]
for step in range(first + 1, 7):
    kv.pushpull(['a', 'b'], [torch.ones(10), torch.ones(3)], out=out)
    d2ldist.report(step=step)
    if step == 4 and attempt == 0 and kv.rank == 1 and os.environ.get('FAIL_ONCE'):
        sys.exit(3)
print(f'worker {kv.rank} done: {out[0][0].item():g}', flush=True)
'''


def restart_lines(out):
    return re.findall(r'^d2l-launch: .* failed \(.*\); restart \d+ of \d+$', out, re.M)


def test_a_worker_that_fails_once_is_restarted_and_the_job_succeeds(write_script):
    r = run_launch('-n', 2, '-s', 1, '--max-restarts', 1, '--env', 'FAIL_ONCE=1', '--timeout',
                   90, 'python', write_script(KV_JOB), timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert restart_lines(out) == ['d2l-launch: worker 1 failed (exit code 3); restart 1 of 1']
    assert out.count('scheduler ready at') == 2
    for rank in (0, 1):
        assert f'[worker {rank}] worker {rank} in attempt 0' in out
        assert f'[worker {rank}] worker {rank} in attempt 1' in out
        assert f'[worker {rank}] worker {rank} done: 2' in out      # the sum of 2 workers
    assert 'the job was stopped' not in out
    # the last lines: the attempts, with the step resumed from and the steps lost
    assert 'd2l-launch: 2 attempts:' in out
    assert re.search(r'^  attempt 0, started at [\d.]+ s: worker 1 failed \(exit code 3\)$',
                     out, re.M), out
    assert re.search(r'^  attempt 1, started at [\d.]+ s, resumed from step 2 \(2 steps lost\): '
                     r'finished$', out, re.M), out
    assert wait_no_survivors(r.tag) == []


def test_a_job_that_always_fails_stops_after_its_last_attempt(write_script):
    script = write_script('import os, sys\n'
                          'print("attempt", os.environ["D2L_RESTART"], flush=True)\n'
                          'sys.exit(3 if os.environ["D2L_RANK"] == "1" else 0)\n')
    r = run_launch('-n', 2, '-s', 0, '--max-restarts', 1, 'python', script, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 3, out                  # the failed process's, as without restarts
    assert restart_lines(out) == ['d2l-launch: worker 1 failed (exit code 3); restart 1 of 1']
    assert out.count('scheduler ready at') == 2
    assert out.count('[worker 1] attempt') == 2 and '[worker 1] attempt 1' in out
    assert out.count('d2l-launch: worker 1 failed (exit code 3); the job was stopped.') == 1
    assert 'Its last lines:\n  | attempt 1' in out
    assert wait_no_survivors(r.tag) == []


def test_a_server_killed_at_a_step_is_restarted_without_the_fault(write_script):
    r = run_launch('-n', 2, '-s', 1, '--max-restarts', 1, '--fail', 'server:0@step=3',
                   '--timeout', 90, 'python', write_script(KV_JOB), timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert out.count('server 0 fails on purpose after its sync round 3 (--fail)') == 1
    assert restart_lines(out) == [
        'd2l-launch: server 0 failed (killed by SIGKILL (exit code 137)); restart 1 of 1']
    assert '[worker 0] worker 0 done: 2' in out and '[worker 1] worker 1 done: 2' in out
    assert wait_no_survivors(r.tag) == []


def test_a_killed_scheduler_fails_the_attempt_and_the_job_restarts(write_script):
    script = write_script('import os, d2ldist\n'
                          'd2ldist.init()\n'
                          'd2ldist.barrier()\n'
                          'print("passed in attempt", os.environ["D2L_RESTART"], flush=True)\n')
    r = run_launch('-n', 2, '-s', 1, '--max-restarts', 1, '--fail', 'scheduler@0.2s',
                   '--timeout', 90, 'python', script, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert 'd2ldist: scheduler fails on purpose 0.2 s after it joined (--fail)' in out
    assert restart_lines(out) == [
        'd2l-launch: scheduler failed (killed by SIGKILL (exit code 137)); restart 1 of 1']
    assert out.count('passed in attempt 1') == 2 and 'passed in attempt 0' not in out
    assert wait_no_survivors(r.tag) == []


SLEEPER = '''
import d2ldist, time
d2ldist.init()
print('ready', flush=True)
time.sleep(120)
'''


def test_ctrl_c_stops_for_good_and_never_restarts(write_script):
    p = start_launch('-n', 2, '-s', 1, '--max-restarts', 3, 'python', write_script(SLEEPER))
    try:
        _wait_for_ready(p, 2)
        assert len(tagged_pids(p.tag)) >= 8
        p.send_signal(signal.SIGINT)
        assert _exit_code_or_where(p, 20) == 130
        out = p.stdout.read()
        assert 'interrupted: stopping the job' in out and 'restart' not in out
        assert wait_no_survivors(p.tag, 5) == []
    finally:
        p.kill()
