"""The Horovod-style API in real jobs, and one script on every backend."""
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, need, run_launch, wait_no_survivors

EXAMPLE = ROOT / 'examples' / 'horovod_mlp.py'


@pytest.mark.parametrize('workers,backend', [(2, 'ring'), (3, 'ring'), (2, 'torch')])
def test_distributed_optimizer_and_broadcasts(workers, backend):
    """Buckets start during backward; gradients averaged; broadcasts; unused parameters;
    and Horovod's semantics as its own tests check them (gradients through collectives,
    keywords, async handles, grouped all-reduce, JSON objects, optimizer settings)."""
    r = run_launch('-n', workers, '-s', 0, '--timeout', 120, '--env', f'D2L_BACKEND={backend}',
                   sys.executable, ROOT / 'tests' / 'jobs' / 'horovod_checks.py', timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert len(re.findall(rf'worker \d of {workers}: ok', r.stdout)) == workers, r.stdout[-3000:]
    assert wait_no_survivors(r.tag) == []


def results(text):
    """The epoch losses and the final checksum an example run printed."""
    losses = [float(x) for x in re.findall(r'epoch \d+, loss ([\d.]+)', text)]
    checksum = re.search(r'weights checksum (-?[\d.]+), spread between workers (\S+)', text)
    assert len(losses) == 3 and checksum, text[-3000:]
    assert float(checksum.group(2)) == 0.0, 'workers ended with different weights'
    return losses + [float(checksum.group(1))]


def close(a, b):
    return all(abs(x - y) <= 1e-9 * max(1.0, abs(x)) for x, y in zip(a, b))


def test_one_script_on_ring_torch_and_torchrun():
    """examples/horovod_mlp.py: d2ldist's ring, backend torch, torchrun: same results."""
    ring = run_launch('-n', 2, '-s', 0, '--timeout', 120, sys.executable, EXAMPLE, timeout=180)
    assert ring.returncode == 0, ring.stdout[-3000:] + ring.stderr[-3000:]
    torch_ = run_launch('-n', 2, '-s', 0, '--timeout', 120, '--env', 'D2L_BACKEND=torch',
                        sys.executable, EXAMPLE, timeout=180)
    assert torch_.returncode == 0, torch_.stdout[-3000:] + torch_.stderr[-3000:]
    assert close(results(ring.stdout), results(torch_.stdout))
    torchrun = str(Path(sys.executable).with_name('torchrun'))
    need(os.path.exists(torchrun), 'torchrun (installed with torch)')
    env = {k: v for k, v in os.environ.items() if not k.startswith('D2L_')}
    env['PYTHONPATH'] = str(ROOT)
    p = subprocess.Popen([torchrun, '--standalone', '--nproc_per_node=2', str(EXAMPLE)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         cwd=ROOT, start_new_session=True)
    try:
        out, err = p.communicate(timeout=180)
    finally:   # torchrun's workers go with it, even when the test fails
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert p.returncode == 0, out[-3000:] + err[-3000:]
    assert '2 workers' in out
    assert close(results(ring.stdout), results(out))
