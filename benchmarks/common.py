"""What the benchmarks share: starting a benchmark's own file as a job, and reading its output.

What they share with the tests (ResNet-18's shapes, the scaling study's step, hosts in
network namespaces) is in d2ldist/testing/.
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def worker_command(script, worker_args=()):
    """``python script --worker worker_args``: what every worker of a benchmark's job runs."""
    return [sys.executable, str(Path(script).resolve()), '--worker', *map(str, worker_args)]


def launch(launcher_args, command, timeout=None, env=None):
    """Run command as a d2l-launch job with launcher_args ('-n', 2, '-s', 0, ...), and the
    variables ``env`` on top of this process's.

    The job imports this checkout's d2ldist (its root goes first on PYTHONPATH).
    Returns the CompletedProcess.
    """
    cmd = [sys.executable, '-m', 'd2ldist.launch', *map(str, launcher_args), *command]
    env = dict(os.environ, **(env or {}), PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]))
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


def result(proc, what):
    """The dict the job's worker printed after ``RESULT ``; exit with the job's output if
    none did (``what``: the job, for the message)."""
    for line in proc.stdout.splitlines():
        if 'RESULT ' in line:
            return json.loads(line.split('RESULT ', 1)[1])
    sys.exit(f'benchmark job {what} failed:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}')


def show(proc):
    """Print what worker 0 of a finished job printed (and, if the job failed, the end of
    its output on stderr); the job's exit code."""
    print('\n'.join(worker0_lines(proc.stdout)))
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-2000:])
    return proc.returncode


def worker0_lines(stdout):
    """What worker 0 printed, without the launcher's ``[worker 0] `` prefix."""
    return [line[len('[worker 0] '):] for line in stdout.splitlines()
            if line.startswith('[worker 0] ')]


def pushpull_and_all_reduce(kv, keys, grads, weights, flat, steps, warmup):
    """Inside a job: each step, ``kv.pushpull`` of ``grads`` and then gloo's all_reduce of
    ``flat`` (the same bytes), each started together on every worker; the seconds of
    each after ``warmup`` steps, as two lists."""
    import torch.distributed as dist
    t_kv, t_gloo = [], []
    for step in range(warmup + steps):
        kv.barrier()
        t0 = time.perf_counter()
        kv.pushpull(keys, grads, out=weights)
        t1 = time.perf_counter()
        dist.barrier()
        t2 = time.perf_counter()
        dist.all_reduce(flat)
        t3 = time.perf_counter()
        if step >= warmup:
            t_kv.append(t1 - t0)
            t_gloo.append(t3 - t2)
    return t_kv, t_gloo
