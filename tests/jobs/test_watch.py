"""Seeing inside a running job: the timeline, the hang detector, calls that disagree.

Real jobs of d2l-launch: --timeline writes a Chrome trace with the spans asked for;
a worker that never comes is named within --hang-warn, and the job fails at
--hang-fail; calls that disagree (keys pushed in another order, barriers from other
calls) stop every worker at once with one line naming both sides.
"""
import json
import sys
import time

import pytest

from support import ROOT, run_launch, start_launch, wait_no_survivors

JOB = ROOT / 'tests' / 'jobs' / 'straggler_job.py'
STEPS = ['1 forward, backward', '2 sum on device', '3 copy to CPU', '4 push',
         '5 update, pull', '6 copy to device', '7 to all devices']


def check_trace_format(data):
    """The trace-event format (JSON object form) as Perfetto and chrome://tracing read it."""
    assert set(data) >= {'traceEvents'} and isinstance(data['traceEvents'], list)
    for e in data['traceEvents']:
        assert e['ph'] in ('X', 'M') and isinstance(e['pid'], int) and isinstance(e['tid'], int)
        if e['ph'] == 'M':
            assert e['name'] in ('process_name', 'process_sort_index', 'thread_name')
            assert isinstance(e['args'], dict)
        else:
            assert isinstance(e['name'], str) and isinstance(e['cat'], str)
            assert isinstance(e['ts'], (int, float)) and e['ts'] >= 0
            assert isinstance(e['dur'], (int, float)) and e['dur'] >= 0
            assert isinstance(e['args'], dict)


def lanes(data):
    """{'worker 0': {thread name: [span events]}}."""
    names = {e['pid']: e['args']['name'] for e in data['traceEvents']
             if e['ph'] == 'M' and e['name'] == 'process_name'}
    threads = {(e['pid'], e['tid']): e['args']['name'] for e in data['traceEvents']
               if e['ph'] == 'M' and e['name'] == 'thread_name'}
    out = {}
    for e in data['traceEvents']:
        if e['ph'] == 'X':
            out.setdefault(names[e['pid']], {}).setdefault(threads[e['pid'], e['tid']],
                                                           []).append(e)
    return out


@pytest.mark.parametrize('workers,servers,kvstore', [(2, 2, 'dist_sync'), (3, 0, 'ring')])
def test_timeline_has_the_spans_of_every_worker_and_server(tmp_path, workers, servers, kvstore):
    path = tmp_path / 'timeline.json'
    r = run_launch('-n', workers, '-s', servers, '--timeline', path, '--timeline-steps', '3-6',
                   '--timeout', 90, sys.executable, JOB, kvstore, 8, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f'timeline of' in r.stdout and str(path) in r.stdout
    assert '@d2l/timeline' not in r.stdout             # the spans go to the file only
    data = json.loads(path.read_text())
    check_trace_format(data)
    params = json.loads(r.stdout.split('STEP1 ')[1].splitlines()[0])['params']
    found = lanes(data)
    assert sorted(found) == [f'server {s}' for s in range(servers)] + \
        [f'worker {w}' for w in range(workers)]
    for w in range(workers):
        training = found[f'worker {w}']['training']
        assert {e['args']['step'] for e in training} == {3, 4, 5, 6}   # the window only
        steps = [e['name'] for e in training if e['cat'] == 'step']
        if kvstore == 'ring':   # steps 2 and 3 run in backward's hooks, inside step 1
            assert all(steps.count(name) == 4 for name in STEPS if name[0] not in '23')
            comm = found[f'worker {w}']['communication']
            sums = [e for e in comm if e['name'] == 'allreduce']
            assert [e['args']['bytes'] for e in sums] == [4 * params] * 4
            left = f'wait for worker {(w - 1) % workers}'
            assert {e['name'] for e in comm} <= {'allreduce', left} and all(
                e['cat'] == 'wait' for e in comm if e['name'] == left)
        else:
            assert all(steps.count(name) == 4 for name in STEPS)
            comm = [e for e in training if e['cat'] == 'comm']
            assert sum(e['args']['sent'] for e in comm if e['name'] == 'push') == 16 * params
            assert sum(e['args']['received'] for e in comm if e['name'] == 'pull') \
                == 16 * params                          # 4 steps of the float32 weights
            assert any(e['name'] == 'wait for servers' for e in training)
        assert abs(data['otherData']['clock_error_us'][f'worker {w}']) < 50_000
    for s in range(servers):
        served = {e['name'] for e in found[f'server {s}']['serving']}
        assert {'push', 'pull'} <= served
    assert wait_no_survivors(r.tag) == []


HANGS = '''
import sys, time, torch, d2ldist
torch.set_num_threads(1)
d2ldist.init()
x = torch.ones(1000)
for i in range(3):
    d2ldist.allreduce_(x)
print('ENTER', flush=True)
if d2ldist.rank() == 2:
    time.sleep(60)                # never calls the fourth all-reduce
d2ldist.allreduce_(x)
'''


def test_a_worker_that_never_comes_is_named_within_the_threshold(write_script):
    """--hang-warn 2: both others name worker 2 about 2 s after they began waiting
    (measured from the line each printed before it); --hang-fail 5 ends the job."""
    script = write_script(HANGS)
    proc = start_launch('-n', 3, '-s', 0, '--hang-warn', 2, '--hang-fail', 5,
                        sys.executable, script)
    arrived = []
    for line in proc.stdout:
        arrived.append((time.monotonic(), line.rstrip('\n')))
    proc.wait(timeout=60)
    entered = {l.split(']')[0]: t for t, l in arrived if l.endswith('] ENTER')}
    warned = {l.split(']')[0]: (t, l) for t, l in arrived
              if l.startswith('[worker') and 'has waited 2 s' in l}
    assert sorted(warned) == ['[worker 0', '[worker 1'], arrived
    for who, (t, line) in warned.items():
        assert 'worker 2 has not arrived (it has started 3 collectives; it is computing' \
            in line, line
        assert 1.9 < t - entered[who] < 4.0, (who, t - entered[who])
    assert proc.returncode != 0
    assert any('has waited 5 s' in l for _, l in arrived)
    assert wait_no_survivors(proc.tag) == []


KV = '''
import sys, time, torch, d2ldist
torch.set_num_threads(1)
kv = d2ldist.kv.create('dist_sync')
kv.init('w', torch.zeros(10)); kv.init('b', torch.zeros(3))
mode = sys.argv[1]
if mode == 'skip':                # worker 1 never pushes
    if kv.rank == 0:
        kv.pushpull('w', torch.ones(10), out=torch.empty(10))
    else:
        time.sleep(60)
elif mode == 'order':             # the keys in another order
    for k in (['w', 'b'] if kv.rank == 0 else ['b', 'w']):
        kv.pushpull(k, torch.ones(10 if k == 'w' else 3), out=torch.empty(10 if k == 'w' else 3))
elif mode == 'barrier':           # a barrier against kv.init's
    if kv.rank == 0:
        kv.barrier()
    else:
        kv.init('c', torch.zeros(2))
print('not reached', flush=True)
'''


@pytest.mark.parametrize('mode,says', [
    ('skip', "worker 0 has waited 2 s for the answer to pushpull of 'w' from server 0: "
             "worker 1 has not arrived (has not pushed 'w' to server 0; it is computing"),
    ('order', "d2ldist: server 0: push 1 of worker 0 carried keys ['w'], push 1 of worker "
              "1 keys ['b']; in dist_sync every worker must push the same keys in the same "
              "order"),
    ('barrier', "d2ldist: worker barrier 3: worker 0 entered it from barrier(), worker 1 "
                "from kv.init('c')")])
def test_parameter_server_and_barriers_name_who_is_missing_or_disagrees(write_script, mode,
                                                                         says):
    started = time.monotonic()
    r = run_launch('-n', 2, '-s', 1, '--hang-warn', 2, '--hang-fail', 4, sys.executable,
                   write_script(KV), mode, timeout=60)
    took = time.monotonic() - started
    out = r.stdout + r.stderr
    assert r.returncode != 0 and 'not reached' not in out
    assert says in out, out[-3000:]
    if mode != 'skip':            # at once: no waiting for the thresholds
        assert 'Traceback' not in out and 'has waited' not in out
        assert out.count(says) >= 2, out[-3000:]      # every worker says it
    assert took < 30
    assert wait_no_survivors(r.tag) == []


ENDS = '''
import sys, torch, d2ldist
torch.set_num_threads(1)
mode = sys.argv[1]
if mode == 'ring':                # worker 1 makes three all-reduces, worker 0 four
    d2ldist.init()
    x = torch.ones(4)
    for _ in range(3 if d2ldist.rank() == 1 else 4):
        d2ldist.allreduce_(x)
else:
    kv = d2ldist.kv.create('dist_sync')
    kv.init('w', torch.zeros(10))
    if mode == 'push' and kv.rank == 0:       # worker 1 never pushes
        kv.pushpull('w', torch.ones(10), out=torch.empty(10))
    elif mode == 'barrier' and kv.rank == 0:  # worker 1 never comes to the barrier
        kv.barrier()
print('worker', d2ldist.rank() if mode == 'ring' else kv.rank, 'returns', flush=True)
'''


@pytest.mark.parametrize('mode,servers,waits', [
    ('ring', 0, 'in allreduce(Average, float32, [4]) (collective 4) for worker 1'),
    ('push', 1, "for the answer to pushpull of 'w' from server 0"),
    ('barrier', 1, 'in worker barrier 2 (barrier())')])
def test_a_worker_that_waits_for_one_that_has_ended_fails_at_once(write_script, mode,
                                                                   servers, waits):
    """Worker 1's script returns, one call short: worker 0 asks after a second, hears
    it has ended, and fails in one line (no --hang-fail: it would have waited forever)."""
    r = run_launch('-n', 2, '-s', servers, '--timeout', 60, sys.executable,
                   write_script(ENDS), mode, timeout=90)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-3000:]
    assert '[worker 1] worker 1 returns' in out and 'worker 0 returns' not in out
    assert (f'[worker 0] d2ldist: worker 0 waits {waits}, but worker 1 ended without coming: '
            'every worker must issue the same calls, as many times') in out, out[-3000:]
    assert 'Traceback' not in out and 'has waited' not in out
    assert wait_no_survivors(r.tag) == []


TORCH = '''
import sys, time, torch, d2ldist
torch.set_num_threads(1)
d2ldist.init(backend='torch')
if sys.argv[1] == 'barrier':
    if d2ldist.rank() == 1:
        time.sleep(30)
    d2ldist.barrier()
else:
    d2ldist.allreduce_(torch.ones(4 if d2ldist.rank() == 0 else 2))
print('not reached', flush=True)
'''


@pytest.mark.parametrize('mode,options,says', [
    ('barrier', ['--hang-fail', 2], 'Ranks 1 failed to pass monitoredBarrier'),
    # the Horovod API's calls compare themselves before torch's TORCH_DISTRIBUTED_DEBUG
    ('shapes', ['--env', 'TORCH_DISTRIBUTED_DEBUG=DETAIL'],
     'they must call the same collectives in the same order on tensors of the same shape')])
def test_torch_backend_names_what_torch_distributed_can(write_script, mode, options, says):
    """What the torch backend's docstring promises of torch.distributed's own checks."""
    r = run_launch('-n', 2, '-s', 0, *options, '--timeout', 40, sys.executable,
                   write_script(TORCH), mode, timeout=60)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and says in out and 'not reached' not in out, out[-3000:]
    assert wait_no_survivors(r.tag) == []
