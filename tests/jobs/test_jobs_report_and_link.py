"""d2l-launch's options through real jobs: progress reports shown and hidden, bad link
values refused in one line, and a simulated network that paces every process."""
import pytest

from support import run_launch, wait_no_survivors
from nbtools import JOB_SCRIPT


def test_launch_shows_reports_as_progress_and_hides_the_protocol(write_script):
    script = write_script(JOB_SCRIPT)
    r = run_launch('-n', 2, '-s', 1, script, 2, 5, 0.02, -1, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert '@d2l/1' not in r.stdout
    for rank in (0, 1):
        assert f'[worker {rank}] worker {rank} done' in r.stdout
        assert f'[worker {rank}] [################] 100% epoch 2/2 batch 5/5' in r.stdout
    assert wait_no_survivors(r.tag) == []


@pytest.mark.parametrize('args,says', [
    (['--bandwidth', '1G'], "--bandwidth '1G': give a number and a unit"),
    (['--bandwidth=-5Mbit'], "--bandwidth '-5Mbit'"),
    (['--latency', '3'], "--latency '3': give a number and a unit"),
])
def test_launcher_refuses_bad_values_in_one_line(args, says):
    r = run_launch(*args, '-n', '1', '-s', '0', 'python', '-c', 'print(1)')
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f'd2l-launch: error: {says}')


LINK_JOB = '''\
import time, torch, d2ldist
d2ldist.init()
X = torch.ones(250_000)                      # 1 MB
d2ldist.allreduce_(X, op=d2ldist.Sum)        # warm up
times = []
for _ in range(3):
    d2ldist.barrier()
    t0 = time.perf_counter()
    d2ldist.allreduce_(X.fill_(1), op=d2ldist.Sum)
    times.append(time.perf_counter() - t0)
assert bool((X == 2).all())
waits = []
for _ in range(5):
    t0 = time.perf_counter()
    d2ldist.barrier()
    waits.append(time.perf_counter() - t0)
print(f"allreduce {min(times):.4f} barrier {min(waits):.4f}", flush=True)
'''


def test_a_job_on_a_simulated_network(write_script):
    """Two workers, 10 MB/s and 20 ms: a 1 MB ring all-reduce takes 2 steps of 0.5 MB
    (0.1 s) plus 2 latencies; a barrier (there and back to the scheduler) 2 latencies.

    The link sets a floor no machine can beat; above it, a busy machine adds its own
    delays (a worker that arrives late makes the other wait in the barrier), so each
    is timed several times and the fastest compared with the model."""
    r = run_launch('--bandwidth', '80Mbit', '--latency', '20ms', '-n', '2', '-s', '0',
                   'python', write_script(LINK_JOB))
    assert r.returncode == 0, r.stdout + r.stderr
    assert 'd2l-launch: simulated network: every process sends at 80 Mbit/s (10 MB/s), ' \
        '20 ms latency' in r.stdout
    for rank in (0, 1):
        (line,) = [x for x in r.stdout.splitlines() if x.startswith(f'[worker {rank}] allreduce')]
        allreduce, barrier = float(line.split()[3]), float(line.split()[5])
        assert 0.14 <= allreduce < 0.14 * 1.5, line
        assert 0.04 <= barrier < 0.04 * 1.5 + 0.02, line
