"""The guard: runs one process of a job and makes sure it cannot outlive the job.

``python -m d2ldist.launch.guard -- command ...`` starts the command in its own
process group and waits for it. The guard's stdin is a pipe from the launcher (or,
on a remote host, the ssh connection): when it closes - the launcher exited, was
killed, or the ssh link dropped - the guard ends the command's whole process group.
SIGTERM, SIGINT and SIGHUP to the guard do the same. The guard exits with the
command's exit code (128 + signal number if a signal ended it). The one line the
launcher may write there, ``FAIL``, SIGKILLs the command's group at once: ``--fail`` on a
worker that never joined through d2ldist (``failwatch.py``).

On a remote host the ssh launcher runs ``python -m d2ldist.launch.guard --remote -- command``:
the guard then reads the job's environment as one JSON line from stdin (so that the
job secret never appears on a command line, where ``ps`` would show it) and prints
``d2ldist.guard: pgid N`` so that the launcher can also end the group by its number.

In a local job the guard asks the host's starter (``starter.py``) to fork the command
from an interpreter that has imported torch already (``D2L_STARTER``: where it listens);
where the starter cannot, the guard starts the command itself.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time

from .. import config
from . import starter

FAIL = b'd2ldist.guard: fail\n'       # from the launcher: kill the command now, as a crash

def stop_group(pgid, grace=None):
    """SIGTERM a process group, then SIGKILL whatever is left after ``grace`` seconds
    (default: D2L_KILL_GRACE)."""
    grace = config.get().kill_grace if grace is None else grace
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)          # anyone left in the group?
        except ProcessLookupError:
            return
        time.sleep(0.05)
    kill_group(pgid)


def kill_group(pgid):
    """SIGKILL a process group, as a crash would end it."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def read_env_line():
    """The job's environment, sent by the ssh launcher as the first line of stdin."""
    line = b''
    while not line.endswith(b'\n'):
        byte = os.read(0, 1)              # one byte at a time: leave the rest unread
        if not byte:
            sys.exit('d2ldist.guard: the launcher went away before sending the environment')
        line += byte
    env = json.loads(line)
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        sys.exit('d2ldist.guard: the environment line is not a JSON object of strings')
    return env


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    remote = argv[:1] == ['--remote']
    if remote:
        argv = argv[1:]
    if argv[:1] == ['--']:
        argv = argv[1:]
    if not argv:
        sys.exit('d2ldist.guard: no command given')
    env = dict(os.environ, **read_env_line()) if remote else dict(os.environ)
    starter_address = env.pop(config.variable('starter'), None)
    child = starter_address and starter.start(starter_address, argv, env, os.getcwd())
    try:
        child = child or subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                          start_new_session=True, env=env)
    except OSError as e:
        print(f'd2l-launch: cannot start {argv[0]!r}: {e.strerror}', file=sys.stderr, flush=True)
        sys.exit(127)
    if remote:
        print(f'd2ldist.guard: pgid {child.pid}', flush=True)
    stopping, stoppers = threading.Event(), []

    def stop(*_):
        # On a thread of its own: this one must go back to child.wait(), or the child,
        # once ended, stays a zombie that stop_group counts as alive for the whole grace.
        if not stopping.is_set():
            stopping.set()
            stoppers.append(threading.Thread(target=stop_group, args=(child.pid,),
                                             daemon=True))
            stoppers[-1].start()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)

    def watch_stdin():
        while data := os.read(0, 4096):     # EOF means "go"; FAIL, "die now"
            if FAIL in data:
                kill_group(child.pid)
        stop()

    threading.Thread(target=watch_stdin, daemon=True).start()
    code = child.wait()
    for stopper in stoppers:            # what the command started in its group gets the
        stopper.join()                  # whole grace too
    stop_group(child.pid, grace=0.5)    # leftovers the command started in its group
    sys.exit(128 - code if code < 0 else code)


if __name__ == '__main__':
    main()
