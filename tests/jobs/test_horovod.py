"""The Horovod-style API in real jobs, and one script on every backend."""
import re
import sys

import pytest

from support import ROOT, run_launch, run_torchrun, wait_no_survivors

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
    out = torchrun_output(EXAMPLE)
    assert '2 workers' in out
    assert close(results(ring.stdout), results(out))


def torchrun_output(script, timeout=180):
    """torchrun's 2 workers running script, which must succeed; their stdout."""
    r = run_torchrun(script, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


DIGITS = ROOT / 'examples' / 'horovod_digits.py'


@pytest.mark.slow
def test_a_horovod_script_runs_unchanged_on_every_backend():
    """examples/horovod_digits.py, written as Horovod's pytorch_mnist.py (DistributedSampler,
    set_epoch, lr * size, broadcasts, Compression.none, allreduce(name=...)): the same
    numbers on d2ldist's ring, on backend torch and under torchrun, and it learns."""
    outputs = []
    for env in ([], ['--env', 'D2L_BACKEND=torch']):
        r = run_launch('-n', 2, '-s', 0, '--timeout', 150, *env, sys.executable, DIGITS,
                       timeout=200)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        outputs.append(re.findall(r'2 workers, epoch \d: .*', r.stdout))
    outputs.append(re.findall(r'2 workers, epoch \d: .*', torchrun_output(DIGITS, timeout=200)))
    assert len(outputs[0]) == 3 and outputs[0] == outputs[1] == outputs[2], outputs
    accuracy = float(outputs[0][-1].rsplit(' ', 1)[1])
    assert accuracy > 0.8, outputs[0]


SEMANTICS = ROOT / 'tests' / 'jobs' / 'horovod_semantics.py'
CHECKS = ('refused_calls', 'integer_scaling', 'duplicate_names', 'built', 'grouped',
          'join_refuses', 'objects', 'no_grad_broadcast', 'optimizer', 'alltoall',
          'reducescatter', 'negotiated')


@pytest.mark.parametrize('workers,backend,module,env', [
    (2, 'ring', 'd2ldist', ()), (2, 'ring', 'd2ldist.horovod', ()),
    (3, 'ring', 'd2ldist', ()), (3, 'ring', 'd2ldist.horovod', ('D2L_SHM=0',)),
    (2, 'torch', 'd2ldist.horovod', ())])
def test_horovod_semantics_of_issue_33(workers, backend, module, env):
    """One check per cause of issue 33, each printing a line on every worker: refused
    calls leave the workers in step; integer scaling; duplicate names; what was built;
    grouped collectives and their gradients; join's refusals; objects with their types;
    broadcasts without gradients; DistributedOptimizer's names, warning and sparse
    gradients; alltoall (tests/jobs/horovod_semantics.py: which of Horovod's tests each
    covers). D2L_SHM=0: the ring's chunks on its TCP streams."""
    extra = [a for e in env for a in ('--env', e)]
    r = run_launch('-n', workers, '-s', 0, '--timeout', 150, '--env', f'D2L_BACKEND={backend}',
                   *extra, sys.executable, SEMANTICS, module, timeout=200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for check in CHECKS:
        passed = re.findall(rf'worker \d: {check} ok', r.stdout)
        assert len(passed) == workers, f'{check}: {r.stdout[-3000:]}'
    assert len(re.findall(rf'worker \d of {workers}: ok', r.stdout)) == workers, r.stdout[-3000:]
    assert wait_no_survivors(r.tag) == []
