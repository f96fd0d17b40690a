"""The starter (launch/starter.py): one interpreter per host imports torch, and the
guards have it fork the job's processes; what it cannot start as python would, it refuses."""
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from support import new_tag, run_launch, tagged_pids, wait_no_survivors
from d2ldist import config
from d2ldist.launch import starter

# What a process sees of itself: enough to tell a fork of the starter from a fresh python
SELF = r'''
import json, os, sys
parent = open(f'/proc/{os.getppid()}/cmdline', 'rb').read().split(b'\0')
print(json.dumps({'argv': sys.argv, 'name': __name__, 'path0': sys.path[0],
                  'cwd': os.getcwd(), 'x': os.environ.get('X'),
                  'forked': any(w.endswith(b'starter.py') for w in parent),
                  'torch': 'torch' in sys.modules, 'd2ldist': 'd2ldist' in sys.modules,
                  'starter_var': os.environ.get('D2L_STARTER')}), flush=True)
print('to stderr', file=sys.stderr, flush=True)
sys.exit(int(os.environ.get('CODE', '0')))
'''


@pytest.fixture
def a_starter(tmp_path):
    """A starter with this process's environment (as the launcher starts one)."""
    tag = new_tag()
    s = starter.Starter(dict(os.environ, D2L_TEST_TAG=tag))
    s.tag = tag
    yield s
    s.stop()
    assert wait_no_survivors(tag) == []


def guard(s, argv, tag, cwd=None, **env):
    """Run ``argv`` under the guard, told where the starter listens (its stdin stays
    open, as the launcher's pipe does: its end would stop the process)."""
    full = dict(os.environ, D2L_TEST_TAG=tag)
    full.update(env)
    full[config.variable('starter')] = s.address
    with tempfile.TemporaryFile('w+') as err:
        p = subprocess.Popen([sys.executable, '-m', 'd2ldist.launch.guard', '--', *argv],
                             env=full, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=err, text=True)
        out = p.stdout.read()
        code = p.wait(timeout=60)
        p.stdin.close()
        err.seek(0)
        return subprocess.CompletedProcess(p.args, code, out, err.read())


def test_a_forked_process_runs_as_python_would_have_run_it(a_starter, tmp_path):
    script = tmp_path / 'me.py'
    script.write_text(SELF)
    r = guard(a_starter, [sys.executable, str(script), 'a', 'b'], a_starter.tag,
              X='1', CODE='3')
    assert r.returncode == 3, r.stderr
    seen = json.loads(r.stdout)
    assert seen == {'argv': [str(script), 'a', 'b'], 'name': '__main__',
                    'path0': str(tmp_path), 'cwd': os.getcwd(), 'x': '1', 'forked': True,
                    'torch': True, 'd2ldist': False, 'starter_var': None}
    assert r.stderr == 'to stderr\n'


def test_a_module_and_an_exception_are_as_python_prints_them(a_starter, tmp_path):
    (tmp_path / 'failing.py').write_text('def f():\n    raise ValueError("no")\nf()\n')
    fresh = subprocess.run([sys.executable, str(tmp_path / 'failing.py')],
                           capture_output=True, text=True)
    forked = guard(a_starter, [sys.executable, '-m', 'failing'], a_starter.tag, cwd=tmp_path)
    assert forked.returncode == fresh.returncode == 1
    # the same frames as a fresh python's, none of the starter's (nor runpy's)
    assert forked.stderr == fresh.stderr
    assert forked.stderr.startswith('Traceback') and 'starter' not in forked.stderr


@pytest.mark.parametrize('env, why', [
    ({'PYTHONHASHSEED': '7'}, 'PYTHONHASHSEED differs from the starter'),
    ({'ATEN_CPU_CAPABILITY': 'default'}, 'ATEN_CPU_CAPABILITY differs from the starter'),
])
def test_what_the_interpreter_reads_at_start_gets_a_fresh_python(a_starter, tmp_path, env,
                                                                 why):
    script = tmp_path / 'me.py'
    script.write_text(SELF)
    r = guard(a_starter, [sys.executable, str(script)], a_starter.tag, **env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)['forked'] is False
    assert starter.refusal({'argv': [sys.executable, str(script)], 'cwd': os.getcwd(),
                            'env': dict(os.environ, **env)}, dict(os.environ),
                           sys.executable) == why


def test_refusals(tmp_path):
    env, py = {'OMP_NUM_THREADS': '1', 'A': '1', 'PATH': '/usr/bin'}, '/usr/bin/python3'

    def why(argv, env=env, own=env, cwd='/tmp'):
        return starter.refusal({'argv': argv, 'env': env, 'cwd': cwd}, own, py)
    assert why(['/other/python', 'x.py']) == 'not run by /usr/bin/python3'
    assert why([py, '-u', 'x.py']) == 'interpreter option -u'
    assert why([py, '-m']) == 'interpreter option -m'
    late = dict(env, OMP_NUM_THREADS='2', A='2', D2L_RANK='1')   # read after the start
    assert why([py, 'x.py'], env=late) is None
    assert why([py, '-m', 'x', '--y']) is None
    assert why(['python3', 'x.py']) is None                  # found on the PATH
    assert why(['../usr/bin/python3', 'x.py'], cwd='/tmp') is None   # from the cwd
    assert why([py, 'x.py'], env={'PATH': '/usr/bin'}, own={'LANG': 'C', 'PATH': '/usr/bin'}) \
        == 'LANG differs from the starter'


def test_a_malformed_request_is_refused_and_the_starter_keeps_serving(a_starter, tmp_path):
    open_fds = lambda: len(os.listdir(f'/proc/{a_starter.popen.pid}/fd'))   # noqa: E731
    before = None
    for data, fds in [(b'[]', []), (b'not json', [1, 2]), (b'{"argv": "x"}', [1, 2]),
                      (json.dumps({'argv': [sys.executable, 'x.py'], 'env': {},
                                   'cwd': '/'}).encode(), [1])]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.connect('\0' + a_starter.address)
            socket.send_fds(sock, [data], fds)
            assert json.loads(sock.recv(4096)) == {'refused': 'malformed request'}
            assert sock.recv(4096) == b''        # the starter has closed the connection
        before = before or open_fds()            # (once it serves)
    assert open_fds() == before                  # what they carried was closed
    script = tmp_path / 'me.py'
    script.write_text(SELF)
    r = guard(a_starter, [sys.executable, str(script)], a_starter.tag)
    assert json.loads(r.stdout)['forked'] is True


def test_a_killed_guard_and_a_stopped_starter_leave_nothing(tmp_path):
    tag = new_tag()
    s = starter.Starter(dict(os.environ, D2L_TEST_TAG=tag))
    script = tmp_path / 'sleep.py'
    script.write_text('import time\nprint("up", flush=True)\ntime.sleep(600)\n')
    env = dict(os.environ, D2L_TEST_TAG=tag, **{config.variable('starter'): s.address})
    guards = [subprocess.Popen([sys.executable, '-m', 'd2ldist.launch.guard', '--',
                                sys.executable, str(script)], env=env, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        for g in guards:
            assert g.stdout.readline() == 'up\n'
        assert len(tagged_pids(tag)) == 5          # the starter, 2 guards, 2 forked
        guards[0].kill()                           # SIGKILL: the guard cannot stop its child
        guards[0].wait()
        deadline = time.monotonic() + 10
        while len(tagged_pids(tag)) > 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(tagged_pids(tag)) == 3          # its child went with it
    finally:
        s.stop()                                   # the launcher went away: so does the job
    assert guards[1].wait(timeout=10) == 128 + signal.SIGKILL
    assert wait_no_survivors(tag) == []


def test_jobs_are_forked_unless_preload_is_off(write_script):
    script = write_script(SELF)
    for preload, forked in (('1', True), ('0', False)):
        r = run_launch('-n', 2, '-s', 1, 'python', script,
                       env={config.variable('preload'): preload})
        assert r.returncode == 0, r.stdout
        seen = [json.loads(line.split('] ', 1)[1]) for line in r.stdout.splitlines()
                if line.startswith('[worker') and '{' in line]
        assert [s['forked'] for s in seen] == [forked, forked]
        assert {s['argv'][0] for s in seen} == {str(script)}


ENDING = r'''
import atexit, sys, threading, time
out = open(sys.argv[1], 'w')                  # never closed: the end must flush it
out.write('written, not closed\n')
atexit.register(lambda: print('atexit ran', flush=True))
def late():
    time.sleep(0.3)
    print('the thread ended', flush=True)
threading.Thread(target=late).start()         # not a daemon: the end waits for it
sys.exit('said on the way out')
'''


def test_a_forked_process_ends_as_python_ends_one(a_starter, tmp_path):
    """It leaves without tearing torch down (os._exit), but after what python's end does:
    threads joined, atexit run, files flushed, sys.exit's message and code."""
    script = tmp_path / 'ending.py'
    script.write_text(ENDING)
    fresh = subprocess.run([sys.executable, str(script), str(tmp_path / 'fresh.txt')],
                           capture_output=True, text=True)
    forked = guard(a_starter, [sys.executable, str(script), str(tmp_path / 'forked.txt')],
                   a_starter.tag)
    assert (forked.returncode, forked.stdout, forked.stderr) == \
        (fresh.returncode, fresh.stdout, fresh.stderr) == \
        (1, 'the thread ended\natexit ran\n', 'said on the way out\n')
    assert (tmp_path / 'forked.txt').read_text() == 'written, not closed\n'
