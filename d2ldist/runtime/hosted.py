"""A ring job that srun, mpirun or torchrun started, without d2l-launch: rank 0 hosts
the scheduler.

d2l-launch starts the scheduler beside the workers (``launch/job.py``). A tool that
knows nothing of d2ldist starts only the N copies of the script, so the first of them,
rank 0, starts the scheduler itself, as its child, where the others can reach it: the
place to meet that ``started.py`` finds (MASTER_ADDR, the first host of Slurm's node
list, or 127.0.0.1 when all run on one host), at the rendezvous port + 1 (torchrun's
own store may hold the port itself). Then every copy joins as the worker of its rank.

No launcher hands out the job's secret, which every message must prove: each copy
reads the same D2L_JOB_SECRET, or fails in one line saying so.

    export D2L_JOB_SECRET=$(python -c 'import secrets; print(secrets.token_hex(16))')
    D2L_BACKEND=ring srun -N 2 -n 4 python train.py     # mpirun: -x D2L_JOB_SECRET
"""
import atexit
import ctypes
import signal
import socket
import subprocess
import sys
import threading

from .. import config
from ..lines import say
from .started import StartError, child_env



def meeting_place(start):
    """The scheduler's address and the job's secret for the copies ``start`` describes;
    rank 0 first starts the scheduler there."""
    secret = config.get().job_secret
    if not secret:
        raise StartError(f"{start.who}: backend 'ring' needs the same D2L_JOB_SECRET in "
                         'every process (export D2L_JOB_SECRET=$(python -c "import secrets; '
                         'print(secrets.token_hex(16))"); mpirun: -x D2L_JOB_SECRET)')
    host, port = start.rendezvous()
    try:
        address = socket.gethostbyname(host)
    except OSError:
        raise StartError(f"{start.who}: cannot find the address of {host!r}, where rank 0 "
                         'hosts the scheduler') from None
    uri = f'tcp://{address}:{port + 1}'
    if start.rank == 0:
        start_scheduler(start, address, port + 1, secret)
    return uri, secret


def start_scheduler(start, address, port, secret):
    """Start the job's scheduler as this process's child; return once it listens."""
    env = child_env(PYTHONUNBUFFERED='1', **config.env(
        role='scheduler', num_worker=start.size, num_server=0, job_secret=secret,
        scheduler_uri=address, scheduler_port=port))
    scheduler = subprocess.Popen([sys.executable, '-m', 'd2ldist.runtime.scheduler'],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, preexec_fn=die_with_parent)
    ready = scheduler.stdout.readline()
    if 'scheduler ready at' not in ready:
        scheduler.wait()
        said = ready.strip().removeprefix('d2ldist.scheduler: ') or 'it ended'
        raise StartError(f'{start.who}: rank 0 cannot host the scheduler at '
                         f'{address}:{port}: {said}')
    say(f'ring backend: {start.who}; rank 0 hosts the scheduler at tcp://{address}:{port}',
        err=True)
    threading.Thread(target=_copy, args=(scheduler.stdout,), daemon=True).start()
    atexit.register(_wait_for, scheduler)    # (before the node's goodbye: runs after it)


def die_with_parent(sig=signal.SIGTERM):
    """In a child, before it runs: ``sig`` when its parent dies (Linux's prctl
    PR_SET_PDEATHSIG; elsewhere nothing). Here: the scheduler ends if rank 0 dies."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, sig)      # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _copy(lines):
    """What the scheduler says later (a worker lost, say), in rank 0's output."""
    for line in lines:
        sys.stdout.write(line)
        sys.stdout.flush()


def _wait_for(scheduler, timeout=10.0):
    """At exit: let the scheduler answer the others' goodbyes and end; else end it."""
    try:
        scheduler.wait(timeout)
    except subprocess.TimeoutExpired:
        scheduler.terminate()
        scheduler.wait()
