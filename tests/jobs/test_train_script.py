"""The chapter's training script, run as a real process (tiny ResNet, one epoch)."""
import re
import subprocess
import sys

from support import ROOT

SCRIPT = str(ROOT / 'examples' / 'multimachine_cifar10_train.py')
EPOCH_LINE = re.compile(r'^epoch 1, loss \d+\.\d{3}, train acc \d\.\d{3}, test acc \d\.\d{3}, '
                        r'time \d+\.\d sec, lr 0\.1$', re.M)


def run(*args, timeout=120):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_script_trains_on_the_digits_with_two_cpu_replicas(tmp_path):
    r = run('--kvstore', 'local', '--epochs', '1', '--width', '4', '--batch-size', '100',
            '--lr', '0.1', '--devices', 'cpu:2', '--threads', '1', '--root', str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "data: scikit-learn's digits" in r.stdout
    assert 'worker 0 of 1, kvstore local, devices cpu,cpu' in r.stdout
    assert EPOCH_LINE.search(r.stdout), r.stdout
    times = re.search(r'steps 1-7 \(ms\): (.*)$', r.stdout, re.M).group(1)
    assert [int(s.split()[0]) for s in times.split(', ')] == list(range(1, 8))


def test_script_bad_input_is_one_line_and_exit_2(tmp_path):
    cases = [(('--kvstore', 'nosuch'), 'unknown kvstore'),
             (('--data', 'cifar10', '--root', str(tmp_path)), 'CIFAR-10 is not in'),
             (('--devices', 'cuda:7'), 'does not exist')]
    procs = [subprocess.Popen([sys.executable, SCRIPT, *args, '--epochs', '1'], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for args, _ in cases]                       # at once: each mostly imports torch
    try:
        for p, (args, message) in zip(procs, cases):
            _, err = p.communicate(timeout=120)
            assert p.returncode == 2 and message in err, (args, err)
            assert len(err.strip().splitlines()) == 1
    finally:
        for p in procs:
            p.kill()
            p.wait()
