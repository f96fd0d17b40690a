"""What the benchmarks share: starting a benchmark's own file as a job, and reading its output.

What they share with the tests (ResNet-18's shapes, the scaling study's step, hosts in
network namespaces) is in d2ldist/testing/.
"""
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
