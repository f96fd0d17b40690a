"""What the tests share, apart from fixtures (those are in conftest.py): where the
repository is, skipping on a missing component, and running real jobs.

Every job a test starts carries a unique tag in its environment (``D2L_TEST_TAG``),
so that a test can look for survivors in the process table afterwards: "no process
of the job is left" is checked, not assumed. ``run_job`` runs a whole job through
d2l-launch and checks just that, with its exit status.

Tests import from here (``from support import ROOT, run_job``): pytest puts tests/ on
sys.path when it loads tests/conftest.py (rootdir-based ``prepend`` import mode).
"""
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from d2ldist.testing.netns_hosts import NetnsHosts

ROOT = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get('CI', '').lower() in ('1', 'true', 'yes')


def need(ok, what):
    """Skip (with the reason) when a system component is missing; fail in CI."""
    if not ok:
        if IN_CI:
            pytest.fail(f'{what} is missing, and CI=true requires it')
        pytest.skip(f'{what} is missing')


def need_command(name):
    need(shutil.which(name) is not None, f'the command {name!r}')


def hosts_for_tests(names, commands, why, **options):
    """Namespace hosts with sshd for a test module (a generator for a pytest fixture):
    skip without root (saying ``why``), fail under CI=true if a command is missing,
    and always stop the hosts afterwards."""
    if os.geteuid() != 0:
        pytest.skip(why)
    for command in commands:
        need_command(command)
    need(os.access('/usr/sbin/sshd', os.X_OK), "Debian's sshd (/usr/sbin/sshd)")
    hosts = NetnsHosts(names, **options)
    try:
        hosts.start()
    except (subprocess.CalledProcessError, RuntimeError) as e:   # e.g. no CAP_SYS_ADMIN
        need(False, f'network namespaces with sshd ({getattr(e, "stderr", None) or e})')
    try:
        yield hosts
    finally:
        hosts.stop()


def launch_argv(*args):
    """The launcher's command line with this Python."""
    return [sys.executable, '-m', 'd2ldist.launch', *map(str, args)]


def new_tag():
    return f'd2ltest-{uuid.uuid4().hex[:12]}'


def run_launch(*args, tag=None, timeout=120, env=None, cwd=ROOT, where=()):
    """Run d2l-launch to the end, inside ``where`` if given (e.g. ``ip netns exec NS``);
    the result has .stdout, .stderr, .returncode, .tag."""
    tag = tag or new_tag()
    full_env = dict(os.environ, **(env or {}))
    argv = [*where, *launch_argv('--env', f'D2L_TEST_TAG={tag}', *args)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                       env=full_env, cwd=cwd)
    r.tag = tag
    return r


def start_launch(*args, tag=None, env=None, cwd=ROOT, preexec_fn=None):
    """Start d2l-launch in the background (its own session); returns the Popen."""
    tag = tag or new_tag()
    full_env = dict(os.environ, **(env or {}))
    p = subprocess.Popen(launch_argv('--env', f'D2L_TEST_TAG={tag}', *args),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=full_env, cwd=cwd, start_new_session=True, preexec_fn=preexec_fn)
    p.tag = tag
    return p


def run_group(argv, env, cwd, timeout):
    """Run argv in a process group of its own to the end; the CompletedProcess (text).
    Whatever happens, the whole group is killed at the end."""
    p = subprocess.Popen([str(a) for a in argv], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def kill_pids(by_host):
    """SIGKILL every pid of ``by_host`` ({host: [pid, ...]}); those already gone are skipped."""
    for pids in by_host.values():
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def kill_leftovers(hosts):
    """After a test on namespace hosts: kill what is left on them, then fail naming it
    (killed first, so that one failure does not fail the next test)."""
    left = hosts.wait_no_leftovers(15)
    kill_pids(left)
    assert not left, f'processes left on the hosts: {left}'


def read_until_ready(proc, workers):
    """Read ``proc``'s output on a thread: (its lines so far, an Event set once ``workers``
    workers have printed 'worker N ready')."""
    lines, ready = [], threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if sum(bool(re.search(r'\] worker \d ready$', x)) for x in lines) == workers:
                ready.set()
    threading.Thread(target=read, daemon=True).start()
    return lines, ready


def run_torchrun(script, *args, workers=2, env=None, cwd=ROOT, timeout=180):
    """torchrun --standalone script args, without the launcher's D2L_* variables (but
    ``env``'s); the CompletedProcess. Its workers go with it, even on failure."""
    torchrun = Path(sys.executable).with_name('torchrun')
    need(torchrun.exists(), 'torchrun (installed with torch)')
    full_env = dict({k: v for k, v in os.environ.items() if not k.startswith('D2L_')},
                    PYTHONPATH=str(ROOT), **(env or {}))
    return run_group([torchrun, '--standalone', f'--nproc_per_node={workers}', script, *args],
                     env=full_env, cwd=cwd, timeout=timeout)


def run_mpirun(*argv, workers=2, options=(), netns=None, env=None, cwd=ROOT, timeout=180):
    """Open MPI's plain ``mpirun -np workers [options] argv`` (no d2l-launch, none of the
    launcher's D2L_* variables but ``env``'s), tagged, run in network namespace ``netns``
    if given; the CompletedProcess, with .tag. Every process gets the tag and PYTHONPATH
    (-x: also those mpirun starts over ssh). Whatever happens, its process group is
    killed at the end (mpirun's children here are in it; over ssh, their orted ends
    when its ssh connection does)."""
    need_command('mpirun')
    tag = new_tag()
    full_env = dict({k: v for k, v in os.environ.items() if not k.startswith('D2L_')},
                    PYTHONPATH=str(ROOT), D2L_TEST_TAG=tag, **(env or {}))
    root = ['--allow-run-as-root'] if os.geteuid() == 0 else []
    where = ['ip', 'netns', 'exec', netns] if netns else []
    r = run_group([*where, 'mpirun', '-np', workers, *root, '--oversubscribe', '-x',
                   'D2L_TEST_TAG', '-x', 'PYTHONPATH', *options, *argv],
                  env=full_env, cwd=cwd, timeout=timeout)
    r.tag = tag
    return r


def tagged_pids(tag):
    """Pids of live processes whose environment holds D2L_TEST_TAG=tag."""
    needle = f'D2L_TEST_TAG={tag}'.encode()
    pids = []
    for entry in Path('/proc').iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / 'environ').read_bytes().split(b'\0'):
                state = (entry / 'stat').read_text().rsplit(')', 1)[1].split()[0]
                if state != 'Z':
                    pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def wait_no_survivors(tag, timeout=10.0):
    """Wait until no process of the tagged job is left; return the survivors (if any)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = tagged_pids(tag)
        if not pids:
            return []
        time.sleep(0.1)
    return tagged_pids(tag)


def kill_tagged(tag):
    for pid in tagged_pids(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_job(workers, servers, *command, options=(), env=(), timeout=120, job_timeout=None,
            where=(), run_env=None):
    """Run ``command`` as every worker of a job with ``servers`` servers, through d2l-launch
    to the end, and check that it ended well: exit status 0, no process of it left.
    ``options``: more of the launcher's; ``env``: NAME=value for every process;
    ``job_timeout``: the launcher's own (``timeout`` - 10 unless given); ``where`` and
    ``run_env`` as run_launch's. The CompletedProcess, with .tag."""
    job_timeout = timeout - 10 if job_timeout is None else job_timeout
    r = run_launch('-n', workers, '-s', servers, '--timeout', job_timeout, *options,
                   *[a for e in env for a in ('--env', e)], *command,
                   timeout=timeout, env=run_env, where=where)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert wait_no_survivors(r.tag) == []
    return r


def load_script(path, name):
    """A script of the repository (book/build.py, say) as a module named ``name``: the
    scripts are no part of the package, and the tests read their functions."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
