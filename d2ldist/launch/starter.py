"""The starter: one interpreter per host that has imported torch, and forks the job's
processes from it.

The local launcher starts one starter first; it imports torch and numpy once, then
waits. Each guard, instead of starting ``python train.py``, sends the starter its argv,
environment, cwd, stdout and stderr (``start``); the starter forks, and the child runs
the script as python would (``become``, ``run``, ``leave``). The guard gets
``{"pid": N}``, later ``{"exit": code}``. A request whose interpreter, options or
start-up variables differ from the starter's is refused (``refusal``), and its guard
starts the process the old way.

This file imports nothing of d2ldist: the children import it fresh, under their own
environment. ``D2L_PRELOAD=0`` turns the starter off. Why it exists, and what it
refuses: docs/design/launch.md, "The starter".
"""
import json
import os
import secrets
import selectors
import shutil
import signal
import socket
import subprocess
import sys

LIMIT = 1 << 20                 # bytes of a request: argv, environment, cwd
READ_AT_START = ('PYTHON', 'LD_', 'LC_', 'LANG', 'MALLOC_', 'TORCH_', 'PYTORCH_', 'ATEN_',
                 'ONEDNN_', 'DNNL_', 'MKL_', 'KMP_', 'OMP_', 'GOMP_', 'OPENBLAS_', 'NUMPY_')
LATE = ('OMP_NUM_THREADS',)     # read at start, but the child sets it again (set_num_threads)


# -- the launcher's side ---------------------------------------------------------------
class Starter:
    """The launcher's handle on its host's starter, started with ``env`` (what the
    job's processes share); ``address`` is what the guards are told (D2L_STARTER)."""

    def __init__(self, env, python=sys.executable):
        self.address = 'd2ldist-starter-' + secrets.token_hex(8)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind('\0' + self.address)   # (Linux's abstract names: no file to remove)
        listener.listen(128)              # guards wait here while torch is imported
        self.popen = subprocess.Popen(
            [python, __file__, str(listener.fileno())], pass_fds=[listener.fileno()],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
            start_new_session=True)
        listener.close()

    def stop(self):
        """Close its stdin: it ends, with whatever it forked that is still running."""
        self.popen.stdin.close()
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


# -- the guard's side ------------------------------------------------------------------
class Started:
    """A process the starter forked for this guard: its ``pid`` and, once it ends,
    ``wait()``'s exit code (as Popen's: -N for signal N)."""

    def __init__(self, sock, pid):
        self.sock, self.pid = sock, pid

    def wait(self):
        reply = _receive(self.sock)
        self.sock.close()
        if reply is None or not isinstance(reply.get('exit'), int):
            return 1                      # the starter went away: the guard stops the group
        return reply['exit']


def start(address, argv, env, cwd):
    """Ask the starter at ``address`` to run ``argv``; a Started, or None if it cannot
    (the guard then starts the process itself)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect('\0' + address)
        request = json.dumps({'argv': argv, 'env': env, 'cwd': cwd}).encode()
        socket.send_fds(sock, [request], [1, 2])
        reply = _receive(sock)
    except OSError:
        reply = None
    if reply is None or not isinstance(reply.get('pid'), int):
        sock.close()
        return None
    return Started(sock, reply['pid'])


def _receive(sock):
    try:
        data = sock.recv(LIMIT)
        return json.loads(data) if data else None
    except (OSError, ValueError):
        return None


# -- the starter's side ----------------------------------------------------------------
def refusal(request, own_env, python):
    """Why the starter cannot run ``request`` (a reason), or None if it can."""
    argv, env = request['argv'], request['env']
    if len(argv) < 2 or _found(argv[0], request['cwd'], env.get('PATH')) != python:
        return f'not run by {python}'
    if argv[1].startswith('-') and (argv[1] != '-m' or len(argv) < 3):
        return f'interpreter option {argv[1]}'
    for name in set(env) | set(own_env):
        if name.startswith(READ_AT_START) and name not in LATE \
                and env.get(name) != own_env.get(name):
            return f'{name} differs from the starter'
    return None


def _found(program, cwd, path):
    """The file a command's first word names, as the shell would find it."""
    if '/' in program:
        return os.path.normpath(os.path.join(cwd, program))
    return shutil.which(program, path=path)


def valid(request):
    """Whether a decoded request has the shape the guard sends."""
    return (isinstance(request, dict) and isinstance(request.get('cwd'), str)
            and isinstance(request.get('argv'), list) and isinstance(request.get('env'), dict)
            and all(isinstance(a, str) for a in request['argv'])
            and all(isinstance(k, str) and isinstance(v, str)
                    for k, v in request['env'].items()))


def serve(listener):
    """Answer requests until the launcher closes our stdin; in a forked child, return
    (request, fds) for it to run."""
    starter = _Serving(listener)
    while True:
        for key, _ in starter.selector.select():
            child = key.data(key.fileobj)     # each source's handler, below
            if child or starter.ended:
                return child


class _Serving:
    """The starter at work: what it waits on (the listener, the launcher's pipe, each
    guard and each child) and the children it forked, by their guard's socket."""

    def __init__(self, listener):
        self.listener, self.ended = listener, False
        self.own_env, self.python = dict(os.environ), sys.executable
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ, self.accept)
        self.selector.register(0, selectors.EVENT_READ, self.launcher_spoke)
        self.children = {}                # guard's socket -> (pid, pidfd)

    def accept(self, listener):
        conn, _ = listener.accept()
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        if int.from_bytes(creds[4:8], sys.byteorder) != os.getuid():
            conn.close()                  # another user's process: not ours to serve
        else:
            self.selector.register(conn, selectors.EVENT_READ, self.request)

    def launcher_spoke(self, stdin):
        if not os.read(stdin, 4096):      # the launcher is gone: so is the job
            for pid, _ in self.children.values():
                _kill_group(pid)
            for conn, (pid, _) in self.children.items():
                _, status = os.waitpid(pid, 0)
                _send(conn, {'exit': os.waitstatus_to_exitcode(status)})
            self.ended = True

    def request(self, conn):
        """A guard's request: refused, or forked; in the child, (request, fds)."""
        self.selector.unregister(conn)
        try:
            data, fds, _, _ = socket.recv_fds(conn, LIMIT, 2)
        except OSError:
            data, fds = b'', []
        try:
            request = json.loads(data)
        except ValueError:                # (its descriptors are closed below all the same)
            request = None
        why = 'malformed request' if not (valid(request) and len(fds) == 2) \
            else refusal(request, self.own_env, self.python)
        if why:                           # what it carried is closed before the answer
            for fd in fds:
                os.close(fd)
            _send(conn, {'refused': why})
            conn.close()
            return None
        return self.fork(conn, request, fds)

    def fork(self, conn, request, fds):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:                      # the child: leave the starter behind
            self.selector.close()
            self.listener.close()
            for other in self.children:
                other.close()
            conn.close()
            for _, pidfd in self.children.values():
                os.close(pidfd)
            return request, fds
        try:
            os.setpgid(pid, pid)          # (set on both sides: the guard may stop it at once)
        except OSError:
            pass
        for fd in fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        self.children[conn] = pid, pidfd
        self.selector.register(pidfd, selectors.EVENT_READ,
                               lambda pidfd, conn=conn: self.child_ended(conn))
        self.selector.register(conn, selectors.EVENT_READ, self.guard_spoke)
        _send(conn, {'pid': pid})
        return None

    def guard_spoke(self, conn):          # the guard hung up (or spoke out of turn)
        if not conn.recv(LIMIT):          # a guard killed: its process must not outlive it
            self.selector.unregister(conn)
            _kill_group(self.children[conn][0])

    def child_ended(self, conn):
        """Tell its guard how it ended."""
        pid, pidfd = self.children.pop(conn)
        self.selector.unregister(pidfd)
        if conn.fileno() in self.selector.get_map():
            self.selector.unregister(conn)  # (not if its guard has hung up)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        _send(conn, {'exit': os.waitstatus_to_exitcode(status)})
        conn.close()


def _send(conn, message):
    try:
        conn.send(json.dumps(message).encode())
    except OSError:
        pass


def _kill_group(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def become(request, fds):
    """In the forked child: become the process ``request`` asks for, as python would
    have started it; return the code to run (a callable)."""
    import runpy
    os.setpgid(0, 0)                      # its own process group, as before (the
                                          # starter has its own session, without a tty)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in (null, *fds):
        os.close(fd)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request['cwd'])
    os.environ.clear()
    os.environ.update(request['env'])
    if os.environ.get('OMP_NUM_THREADS', '').isdigit():
        import torch
        torch.set_num_threads(max(1, int(os.environ['OMP_NUM_THREADS'])))
    import numpy
    numpy.random.seed()                   # a fresh process's seed, not the starter's
    args = request['argv'][1:]
    if args[0] == '-m':
        sys.argv = [args[1], *args[2:]]   # (run_module puts the module's file first)
        sys.path[0] = os.getcwd()
        return lambda: runpy.run_module(args[1], run_name='__main__', alter_sys=True)
    sys.argv = list(args)
    sys.path[0] = os.path.dirname(os.path.realpath(args[0]))
    return lambda: runpy.run_path(args[0], run_name='__main__')


def run(code):
    """Run the child's code; its exit code, as python's would be. An exception is printed
    as python prints it, without the starter's frames."""
    try:
        code()
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)      # sys.exit('message'), as python says it
        return 1
    except BaseException as e:
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in (
                __file__, runpy.__file__, '<frozen runpy>'):
            tb = tb.tb_next
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        return -signal.SIGINT if isinstance(e, KeyboardInterrupt) else 1


def leave(code):
    """End the child as multiprocessing ends the processes it forks: other threads
    joined, atexit handlers run, every open file flushed, then ``os._exit``. Tearing down
    torch's modules one by one, as an interpreter does at its end, takes a second of CPU
    or more, and nothing needs it."""
    import atexit
    import gc
    import io
    import threading
    threading._shutdown()                 # wait for the threads that are not daemons
    atexit._run_exitfuncs()
    buffered = {io.BufferedWriter, io.BufferedRandom, io.BufferedRWPair, io.TextIOWrapper}
    for f in gc.get_objects():            # what an interpreter's end would have flushed
        if type(f) in buffered:
            try:
                f.flush()
            except (OSError, ValueError):   # closed, or its reader is gone
                pass
    if code == -signal.SIGINT:            # Ctrl-C: end by the signal, as python does
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


if __name__ == '__main__':
    import runpy
    listener = socket.socket(fileno=int(sys.argv[1]))
    import numpy   # noqa: F401  (what every process of a job imports: once, here)
    import torch   # noqa: F401
    try:           # and what torch loads on a first optimizer (node.load_torch_late_parts)
        import torch._dynamo  # noqa: F401
    except (ImportError, RuntimeError):
        pass
    child = serve(listener)
    leave(0 if child is None else run(become(*child)))
