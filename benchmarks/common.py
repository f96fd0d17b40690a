"""What the benchmarks share: starting a benchmark's own file as a job, and ResNet-18's shapes."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def worker_command(script, worker_args=()):
    """``python script --worker worker_args``: what every worker of a benchmark's job runs."""
    return [sys.executable, str(Path(script).resolve()), '--worker', *map(str, worker_args)]


def launch(launcher_args, command, timeout=None):
    """Run command as a d2l-launch job with launcher_args ('-n', 2, '-s', 0, ...).

    The job imports this checkout's d2ldist (its root goes first on PYTHONPATH).
    Returns the CompletedProcess.
    """
    cmd = [sys.executable, '-m', 'd2ldist.launch', *map(str, launcher_args), *command]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]))
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


def worker0_lines(stdout):
    """What worker 0 printed, without the launcher's ``[worker 0] `` prefix."""
    return [line[len('[worker 0] '):] for line in stdout.splitlines()
            if line.startswith('[worker 0] ')]



def resnet18_shapes(scale=1):
    """The 62 parameter shapes of ResNet-18 (11.7 M values); output channels / scale."""
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    c_in = 64
    for c, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        for block in range(2):
            shapes += [(c, c_in if block == 0 else c, 3, 3), (c,), (c,), (c, c, 3, 3), (c,), (c,)]
            if block == 0 and (stride != 1 or c_in != c):
                shapes += [(c, c_in, 1, 1), (c,), (c,)]
        c_in = c
    shapes += [(1000, 512), (1000,)]
    return [(max(1, s[0] // scale),) + tuple(s[1:]) for s in shapes]
