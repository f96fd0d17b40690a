"""The launcher with real processes: merged output, exit codes, failures, signals, bad input."""
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from support import (ROOT, launch_argv, new_tag, run_launch, start_launch, tagged_pids,
                     wait_no_survivors)

CHATTY = r'''
import os, sys
rank = int(os.environ['D2L_RANK'])
for i in range(200):
    print(f'out {rank} {i} ' + 'x' * (i % 50))
    if i % 20 == 0:
        print(f'err {rank} {i}', file=sys.stderr)
sys.stdout.write(f'tail {rank} without newline')
'''


def test_merged_output_of_three_workers(write_script):
    r = run_launch('-n', 3, '-s', 1, 'python', write_script(CHATTY))
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    for rank in range(3):
        mine = [l for l in lines if l.startswith(f'[worker {rank}] ')]
        outs = [l for l in mine if ' out ' in l]
        assert [l.split()[4] for l in outs] == [str(i) for i in range(200)]
        for l in outs:   # never two lines run together, never a line cut
            i = int(l.split()[4])
            assert l == f'[worker {rank}] out {rank} {i} ' + 'x' * (i % 50)
        assert sum(' err ' in l for l in mine) == 10
        assert f'[worker {rank}] tail {rank} without newline' in lines
    assert any(l.startswith('[scheduler] d2ldist: scheduler ready at tcp://') for l in lines)
    assert not tagged_pids(r.tag)


def test_environment_contract(write_script, monkeypatch):
    script = write_script(r'''
import os
names = ['D2L_ROLE', 'D2L_RANK', 'D2L_NUM_WORKER', 'D2L_NUM_SERVER', 'D2L_SCHEDULER_URI',
         'D2L_SCHEDULER_PORT', 'D2L_JOB_SECRET', 'RANK', 'WORLD_SIZE', 'LOCAL_RANK',
         'LOCAL_WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT', 'PYTHONUNBUFFERED', 'GREETING',
         'GROUP_RANK', 'NODE_RANK', 'OMP_NUM_THREADS']
print(' '.join(f'{n}={os.environ.get(n, "MISSING")}' for n in names))
''')
    monkeypatch.delenv('OMP_NUM_THREADS', raising=False)   # unset: the launcher shares the
    threads = max(1, len(os.sched_getaffinity(0)) // 6)    # cores among its 6 processes
    r = run_launch('-n', 2, '-s', 3, '--env', 'GREETING=hi', 'python', script)
    assert r.returncode == 0, r.stdout
    assert r.stdout.startswith(f'd2l-launch: OMP_NUM_THREADS={threads} for each process '
                               f'({len(os.sched_getaffinity(0))} cores, 6 processes on this '
                               'host), so that they do not overload it;'), r.stdout[:300]
    sched_port = re.search(r'scheduler ready at tcp://[\d.]+:(\d+)', r.stdout).group(1)
    secrets_seen = set()
    for rank in range(2):
        line = next(l for l in r.stdout.splitlines() if l.startswith(f'[worker {rank}] D2L'))
        env = dict(kv.split('=', 1) for kv in line.split('] ', 1)[1].split())
        assert env['D2L_ROLE'] == 'worker' and env['D2L_RANK'] == env['RANK'] == str(rank)
        assert env['D2L_NUM_WORKER'] == env['WORLD_SIZE'] == '2'
        assert env['D2L_NUM_SERVER'] == '3'
        assert env['LOCAL_RANK'] == str(rank) and env['LOCAL_WORLD_SIZE'] == '2'
        assert env['D2L_SCHEDULER_PORT'] == sched_port != env['MASTER_PORT']
        assert env['MASTER_ADDR'] == '127.0.0.1' and env['PYTHONUNBUFFERED'] == '1'
        assert env['GREETING'] == 'hi' and len(env['D2L_JOB_SECRET']) >= 32
        assert env['GROUP_RANK'] == env['NODE_RANK'] == '0'
        assert env['OMP_NUM_THREADS'] == str(threads)
        secrets_seen.add(env['D2L_JOB_SECRET'])
    assert len(secrets_seen) == 1


def test_default_servers_equal_workers_and_roles_talk():
    r = run_launch('-n', 2, 'python', ROOT / 'examples' / 'hello_roles.py')
    assert r.returncode == 0, r.stdout
    assert '[worker 0] worker 0 sees 2 servers: server:0, server:1' in r.stdout
    assert '[worker 1] worker 1 got "hello from worker 0" from worker:0' in r.stdout
    assert r.stdout.count('passed the barrier') == 2


@pytest.mark.parametrize('how, code, words', [
    ('sys.exit(3)', 3, 'exit code 3'),
    ('raise ValueError("boom in the worker")', 1, 'exit code 1'),
    ('os.kill(os.getpid(), signal.SIGKILL)', 137, 'killed by SIGKILL'),
])
def test_a_failing_worker_stops_the_job(write_script, how, code, words):
    script = write_script(f'''
import os, signal, sys, time
import d2ldist
d2ldist.init()
if d2ldist.rank() == 1:
    print('worker one says goodbye')
    time.sleep(0.5)
    {how}
time.sleep(60)
''')
    # the others sleep 60 s: a launcher that waited for them would outlast run_launch's 60 s
    r = run_launch('-n', 3, '-s', 2, 'python', script, timeout=60)
    assert r.returncode == code, r.stdout
    assert f'd2l-launch: worker 1 failed ({words}' in r.stdout
    report = r.stdout.split('d2l-launch: worker 1 failed', 1)[1]
    assert 'worker one says goodbye' in report
    if 'boom' in how:
        assert 'ValueError: boom in the worker' in report
    assert wait_no_survivors(r.tag, 5) == []


SLEEPER = '''
import d2ldist, time
d2ldist.init()
print('ready', flush=True)
time.sleep(120)
'''


def _wait_for_ready(p, count, timeout=60):
    seen, deadline = 0, time.monotonic() + timeout
    while seen < count and time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        seen += line.rstrip().endswith('] ready')
    assert seen == count, 'the workers did not start'


def _exit_code_or_where(p, timeout):
    """The launcher's exit code; if it has not ended in time, fail with where it is
    (d2l-launch prints its threads' stacks on SIGUSR1) and what it printed."""
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGUSR1)
        time.sleep(1)
        p.kill()
        pytest.fail(f'd2l-launch still ran {timeout} s later:\n{p.stdout.read()[-6000:]}')


@pytest.mark.parametrize('sig, code, inherited', [
    (signal.SIGINT, 130, signal.SIG_DFL), (signal.SIGTERM, 143, signal.SIG_DFL),
    (signal.SIGINT, 130, signal.SIG_IGN)])      # as a script's background job starts it
def test_signal_to_the_launcher_stops_everything(write_script, sig, code, inherited):
    def as_started():
        signal.signal(signal.SIGINT, inherited)
    p = start_launch('-n', 2, '-s', 1, 'python', write_script(SLEEPER), preexec_fn=as_started)
    try:
        _wait_for_ready(p, 2)
        assert len(tagged_pids(p.tag)) >= 8   # 4 guards + scheduler, server, 2 workers
        t = time.monotonic()
        p.send_signal(sig)
        assert _exit_code_or_where(p, 10) == code
        assert time.monotonic() - t < 6
        assert wait_no_survivors(p.tag, 5) == []
    finally:
        p.kill()


def test_killing_the_launcher_leaves_nothing_running(write_script):
    p = start_launch('-n', 2, '-s', 1, 'python', write_script(SLEEPER))
    try:
        _wait_for_ready(p, 2)
        p.kill()                              # SIGKILL: the launcher cannot clean up
        p.wait(timeout=5)
        assert wait_no_survivors(p.tag, 8) == []   # the guards do
    finally:
        p.kill()


def test_timeout_stops_the_job(write_script):
    # the sleepers never end: only --timeout can end this run before run_launch's 60 s (no
    # wall-clock bound of our own: starting the processes alone takes 20 s on a busy machine)
    r = run_launch('--timeout', 3, '-n', 2, '-s', 0, 'python', write_script(SLEEPER),
                   timeout=60)
    assert r.returncode == 124
    assert 'd2l-launch: timeout: the job ran for more than 3 s' in r.stdout
    assert wait_no_survivors(r.tag, 5) == []


def test_a_silent_node_is_noticed(write_script):
    """A worker that hangs (SIGSTOP) is declared dead by the scheduler; nobody waits forever."""
    script = write_script('''
import os, signal, d2ldist
d2ldist.init()
if d2ldist.rank() == 1:
    os.kill(os.getpid(), signal.SIGSTOP)
d2ldist.barrier()
''')
    r = run_launch('--env', 'D2L_HEARTBEAT_TIMEOUT=2', '-n', 2, '-s', 1, 'python', script,
                   timeout=60)     # the stopped worker never ends: only the notice ends the job
    assert r.returncode != 0
    assert 'worker 1 failed: no heartbeat for 2 s' in r.stdout
    assert wait_no_survivors(r.tag, 5) == []


def _one_line_error(args, expect):
    tag = new_tag()
    r = subprocess.run(launch_argv('--env', f'D2L_TEST_TAG={tag}', *map(str, args)),
                       capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert r.returncode == 2
    assert r.stdout == ''
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith('d2l-launch: error: ') and expect in r.stderr
    assert tagged_pids(tag) == []


def test_bad_input_gets_one_line_and_exit_2(tmp_path):
    script = tmp_path / 'ok.py'
    script.write_text('print(1)\n')
    _one_line_error(['-n', '0', 'python', script], '-n must be at least 1')
    _one_line_error(['-n', '1', '--frobnicate', 'python', script], 'unrecognized arguments')
    _one_line_error(['-n', '2', 'python', tmp_path / 'missing.py'], 'no such script')
    _one_line_error(['-n', '2', 'no-such-command-d2l'], 'command not found')
    _one_line_error(['-n', '2'], 'no command given')
    _one_line_error(['-n', 'two', 'python', script], "invalid int value: 'two'")
    _one_line_error(['-n', '1', '--env', 'NOEQUALS', 'python', script], 'NAME=VALUE')
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        s.listen()
        _one_line_error(['-n', '1', '--port', s.getsockname()[1], 'python', script],
                        'is not free')


def test_strangers_are_ignored_and_the_job_goes_on(write_script, tmp_path):
    """Random bytes, a wrong secret, a forged header and an oversized message."""
    go = tmp_path / 'go'
    script = write_script(f'''
import os, time, d2ldist
d2ldist.init()
print('ready', flush=True)
while not os.path.exists({str(go)!r}):
    time.sleep(0.05)
d2ldist.barrier()
print('after the barrier', flush=True)
''')
    p = start_launch('-n', 2, '-s', 1, 'python', script)
    try:
        ready = next(line for line in p.stdout if 'scheduler ready at' in line)
        port = int(re.search(r'scheduler ready at tcp://127.0.0.1:(\d+)', ready).group(1))
        _wait_for_ready(p, 2)
        _attack('127.0.0.1', port)
        go.touch()
        out, _ = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 0, out
    assert out.count('after the barrier') == 2
    assert 'scheduler dropped a message' in out   # logged at most once a second
    dropped = int(re.search(r'the scheduler dropped (\d+) invalid messages', out).group(1))
    # the wrong secret's two and the bad JSON; the oversized one never gets through
    # ZeroMQ, and random bytes only sometimes parse as a (dropped) ZMTP 1.0 message
    assert dropped >= 3
    assert wait_no_survivors(p.tag, 5) == []


def _attack(host, port):
    import zmq
    from d2ldist.runtime import protocol
    from d2ldist.runtime.van import Van
    with socket.create_connection((host, port)) as s:   # not even ZeroMQ
        s.sendall(os.urandom(4096))
    stranger = Van('worker:0', 'not-the-secret', bind=False)
    stranger.connect('scheduler', f'tcp://{host}:{port}')
    stranger.send('scheduler', protocol.BARRIER, {'group': 'worker', 'n': 1})
    stranger.send('scheduler', protocol.FAILED, {'reason': 'forged'})
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 1000)
    raw.connect(f'tcp://{host}:{port}')
    raw.send_multipart([b'\0' * 32, b'{not json'])
    raw.send_multipart([b'\0' * 32, b'{}', os.urandom(2 << 20)])   # over the 1 MiB cap
    time.sleep(1.0)
    raw.close()
    stranger.close()


def test_guard_ends_the_process_group_when_stdin_closes(tmp_path):
    """The guard alone: closing its stdin ends its command and the command's children."""
    tag = new_tag()
    script = tmp_path / 'spawner.py'
    script.write_text('import subprocess, time\n'
                      'subprocess.Popen(["sleep", "100"])\n'
                      'print("spawned", flush=True)\ntime.sleep(100)\n')
    env = dict(os.environ, D2L_TEST_TAG=tag)
    g = subprocess.Popen([sys.executable, '-m', 'd2ldist.launch.guard', '--', sys.executable, script],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert g.stdout.readline().strip() == 'spawned'
        # the guard, the script and sleep; a process just exec'd may show its environment
        # (and so the tag) a moment late
        deadline = time.monotonic() + 10
        while len(tagged_pids(tag)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(tagged_pids(tag)) == 3
        g.stdin.close()
        assert g.wait(timeout=10) == 128 + signal.SIGTERM
        assert wait_no_survivors(tag, 5) == []
    finally:
        g.kill()


def test_a_slow_starter_is_not_declared_dead(write_script):
    """Heartbeats start with the address book: waiting for a late node is not silence."""
    script = write_script('''
import time, d2ldist
import os
if os.environ['D2L_RANK'] == '1':
    time.sleep(4)           # e.g. importing torch on a busy machine
d2ldist.init()
d2ldist.barrier()
print('together', flush=True)
''')
    r = run_launch('--env', 'D2L_HEARTBEAT_TIMEOUT=2', '-n', 2, '-s', 1, 'python', script)
    assert r.returncode == 0, r.stdout
    assert r.stdout.count('together') == 2


def test_barriers_of_different_groups_do_not_mix(write_script):
    """Workers meet among themselves, then with the servers: each group counts its own."""
    script = write_script('''
import d2ldist
node = d2ldist.init()
node.barrier('worker')
node.barrier('worker')
node.barrier('all')
print('met everyone', flush=True)
''')
    server = write_script('''
import d2ldist
from d2ldist.runtime.node import Node
node = Node.from_env(role='server').start()
node.barrier('all')
print('server met everyone', flush=True)
''', name='server.py')
    r = run_launch('--timeout', 60, '--env', f'D2L_SERVER_SCRIPT={server}', '-n', 2, '-s', 1,
                   'python', script)
    assert r.returncode == 0, r.stdout
    assert r.stdout.count('met everyone') == 3


def test_log_dir_keeps_each_processs_output_in_a_file_of_its_own(write_script, tmp_path):
    """--log-dir: a file per process, named by role and rank, with every line it printed
    (progress reports too, which the merged output hides), beside the merged output."""
    script = write_script('import d2ldist\n'
                          'd2ldist.init()\n'
                          'print("hello from", d2ldist.rank(), flush=True)\n'
                          'd2ldist.report(batch=1, num_batches=1)\n')
    r = run_launch('-n', 2, '-s', 1, '--log-dir', tmp_path / 'logs', 'python', script)
    assert r.returncode == 0, r.stdout + r.stderr
    logs = {f.name: f.read_text().splitlines() for f in (tmp_path / 'logs').iterdir()}
    assert sorted(logs) == ['scheduler.log', 'server-0.log', 'worker-0.log', 'worker-1.log']
    assert logs['scheduler.log'][0].startswith('d2ldist: scheduler ready at tcp://')
    for rank in (0, 1):
        assert logs[f'worker-{rank}.log'][0] == f'hello from {rank}'
        assert logs[f'worker-{rank}.log'][1].startswith('@d2l/1 ')       # the report line
        assert f'[worker {rank}] hello from {rank}' in r.stdout
    assert '@d2l/1' not in r.stdout
    assert wait_no_survivors(r.tag) == []
