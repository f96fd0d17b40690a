"""The ssh launcher with real OpenSSH, across hosts that are network namespaces.

The hosts (``d2ldist/testing/netns_hosts.py``): hostA and hostB, each a namespace
running Debian's sshd; the launcher runs in a third namespace. "No process of the job
is left" is checked on every host's process table (the processes in its network
namespace, other than sshd itself) and by the job's tag.
"""
import json
import os
import signal
import subprocess
import time

import pytest

from support import ROOT, hosts_for_tests, kill_leftovers, launch_argv, new_tag, read_until_ready, \
    tagged_pids, wait_no_survivors
from d2ldist.testing.netns_hosts import LAUNCHER_NS, UNREACHABLE, netns_pids

pytestmark = pytest.mark.timeout(120)

# The jobs that must run across hosts: (name, d2l-launch arguments, a line every
# worker prints). Adding a job is one line.
JOBS = [
    ('hello_roles', ['-n', '3', '-s', '2', 'python', 'examples/hello_roles.py'],
     'worker {rank} passed the barrier'),
    ('parameter_server', ['-n', '2', '-s', '2', 'python', 'tests/jobs/exact_sums.py', 'kv'],
     'worker {rank} of 2: kv sum on cpu exact'),
    ('ring', ['-n', '3', '-s', '0', 'python', 'tests/jobs/exact_sums.py', 'ring'],
     'worker {rank} of 3: ring sum on cpu exact'),
]


@pytest.fixture(scope='module')
def hosts():
    yield from hosts_for_tests(('hostA', 'hostB'), ('ip', 'ssh', 'ssh-keygen', 'rsync'),
                               'the ssh tests need root to make network namespaces')


@pytest.fixture
def clean(hosts):
    """Every test must leave no process on any host, whatever happened."""
    yield hosts
    kill_leftovers(hosts)


def ssh_argv(hosts, *args, tag, config=None):
    """d2l-launch --launcher ssh, run in the launcher's namespace."""
    return ['ip', 'netns', 'exec', LAUNCHER_NS, *launch_argv(
        '--env', f'D2L_TEST_TAG={tag}', '--launcher', 'ssh', '--connect-timeout', '5',
        '--ssh-config', config or hosts.ssh_config, *args)]


def run_ssh(hosts, *args, cwd=ROOT, config=None, env=None, timeout=90):
    tag = new_tag()
    r = subprocess.run(ssh_argv(hosts, *args, tag=tag, config=config), capture_output=True,
                       text=True, timeout=timeout, cwd=cwd,
                       env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})))
    r.tag = tag
    return r


def prefixed(stdout, label):
    """The lines of the process ``label`` (e.g. 'worker 1@hostB'), prefix removed."""
    head = f'[{label}] '
    return [line[len(head):] for line in stdout.splitlines() if line.startswith(head)]


def expected_host(names, num_servers, rank):
    """The documented placement: scheduler, servers, workers dealt round-robin."""
    return names[(1 + num_servers + rank) % len(names)]


# -- jobs across hosts --------------------------------------------------------------
@pytest.mark.parametrize('name,args,done', JOBS, ids=[j[0] for j in JOBS])
def test_job_across_hosts(clean, tmp_path, name, args, done):
    hosts = clean
    r = run_ssh(hosts, '--hostfile', hosts.hostfile(tmp_path / 'hosts'), *args)
    assert r.returncode == 0, r.stdout + r.stderr
    n, s = int(args[args.index('-n') + 1]), int(args[args.index('-s') + 1])
    for rank in range(n):
        host = expected_host(hosts.names, s, rank)
        assert done.format(rank=rank) in prefixed(r.stdout, f'worker {rank}@{host}'), r.stdout
        assert f'  worker     {rank}     {host}' in r.stdout       # the placement table
    # the scheduler listens on hostA's network address, not on 127.0.0.1
    assert f'd2ldist: scheduler ready at tcp://{hosts.addr["hostA"]}:' in r.stdout
    assert {line.split('@')[1].split(']')[0] for line in r.stdout.splitlines()
            if line.startswith('[')} == set(hosts.names)
    assert wait_no_survivors(r.tag) == []


def test_sync_dst_dir_copies_the_directory(clean, tmp_path):
    hosts = clean
    src = tmp_path / 'project'
    (src / 'sub').mkdir(parents=True)
    (src / 'data.txt').write_text('42 apples\n')
    (src / 'sub' / 'deep.txt').write_text('deep file')
    (src / '.git').mkdir()
    (src / '.git' / 'HEAD').write_text('ref: refs/heads/main\n')
    (src / 'job.py').write_text(
        'import os, d2ldist\n'
        'd2ldist.init()\n'
        'print("cwd", os.getcwd())\n'
        'print("data", open("data.txt").read().strip(), "|", open("sub/deep.txt").read())\n'
        'print(".git copied:", os.path.exists(".git"))\n'
        'd2ldist.barrier()\n')
    dst = hosts.remote_dir / 'job dir'    # a private tmpfs on each host; a space in the path
    r = run_ssh(hosts, '-H', 'hostA,hostB', '-n', '2', '-s', '0', '--sync-dst-dir', dst,
                'python', 'job.py', cwd=src)
    assert r.returncode == 0, r.stdout + r.stderr
    for rank, host in ((0, 'hostB'), (1, 'hostA')):
        lines = prefixed(r.stdout, f'worker {rank}@{host}')
        assert f'cwd {dst}' in lines, r.stdout
        assert 'data 42 apples | deep file' in lines
        assert '.git copied: False' in lines
    # the copies exist only on the hosts: they came by rsync, not the shared filesystem
    assert not dst.exists()


def test_hostfile_with_user_port_and_slots(clean, tmp_path):
    hosts = clean
    script = tmp_path / 'local.py'
    script.write_text('import os\nprint("local", os.environ["RANK"], os.environ["LOCAL_RANK"], '
                      'os.environ["LOCAL_WORLD_SIZE"])\n')
    hostfile = hosts.hostfile(tmp_path / 'hosts', ['root@hostA:22 slots=2', 'hostB  # one slot'])
    r = run_ssh(hosts, '--hostfile', hostfile, '-n', '3', '-s', '0', 'python', script)
    assert r.returncode == 0, r.stdout + r.stderr
    # workers fill hostA's two slots first, then hostB's one
    assert 'local 0 0 2' in prefixed(r.stdout, 'worker 0@hostA:22')
    assert 'local 1 1 2' in prefixed(r.stdout, 'worker 1@hostA:22')
    assert 'local 2 0 1' in prefixed(r.stdout, 'worker 2@hostB')
    assert 'workers by slots' in r.stdout


WEIRD_ARGS = ['two words', "it's", '"double"', '$HOME', '${PATH}', '$(id -u)', '`id`',
              'back\\slash', '', ';exit 3', '*', 'tab\there', 'new\nline', 'ünïcode €']
WEIRD_VALUE = 'a b "c" \'d\' $HOME $(id) `id` \\ ;&|'


def test_arguments_and_env_arrive_unchanged(clean, tmp_path):
    hosts = clean
    script = tmp_path / 'show.py'
    script.write_text(
        'import json, os, sys, torch, torch.distributed as dist\n'
        'dist.init_process_group("gloo")   # MASTER_ADDR must be worker 0\'s host\n'
        'x = torch.tensor([dist.get_rank() + 1.0]); dist.all_reduce(x)\n'
        'print(json.dumps({"argv": sys.argv[1:], "weird": os.environ.get("D2L_TEST_WEIRD"),'
        ' "omp": os.environ.get("OMP_NUM_THREADS"), "node": os.environ.get("D2L_NODE_HOST"),'
        ' "master": os.environ.get("MASTER_ADDR"), "sum": x.item()}))\n'
        'dist.destroy_process_group()\n')
    r = run_ssh(hosts, '-H', 'hostA,hostB', '-n', '2', '-s', '0', '--interface', 'eth0',
                '--env', f'D2L_TEST_WEIRD={WEIRD_VALUE}', 'python', script, *WEIRD_ARGS,
                env={'OMP_NUM_THREADS': '3'})
    assert r.returncode == 0, r.stdout + r.stderr
    for rank, host in ((0, 'hostB'), (1, 'hostA')):
        (line,) = [x for x in prefixed(r.stdout, f'worker {rank}@{host}') if x.startswith('{')]
        assert json.loads(line) == {'argv': WEIRD_ARGS, 'weird': WEIRD_VALUE, 'omp': '3',
                                    'node': hosts.addr[host], 'master': hosts.addr['hostB'],
                                    'sum': 3.0}


def test_a_restart_stops_every_host_and_starts_the_job_again(clean, tmp_path):
    """--max-restarts over ssh: worker 1 (hostA) fails in attempt 0 while worker 0 waits
    on hostB; the launcher ends attempt 0 on both hosts and the next attempt succeeds."""
    hosts = clean
    script = tmp_path / 'once.py'
    script.write_text(
        'import os, sys, d2ldist\n'
        'd2ldist.init()\n'
        'attempt = os.environ["D2L_RESTART"]\n'
        'print("attempt", attempt, os.environ["D2L_CHECKPOINT_DIR"], flush=True)\n'
        'if attempt == "0" and d2ldist.rank() == 1:\n'
        '    sys.exit(3)\n'
        'd2ldist.barrier()\n')
    r = run_ssh(hosts, '-H', 'hostA,hostB', '-n', '2', '-s', '0', '--max-restarts', '1',
                '--checkpoint-dir', '/shared/ck', 'python', script)
    assert r.returncode == 0, r.stdout + r.stderr
    assert 'd2l-launch: worker 1@hostA failed (exit code 3); restart 1 of 1' in r.stdout
    assert r.stdout.count('scheduler ready at') == 2
    for rank, host in ((0, 'hostB'), (1, 'hostA')):
        assert 'attempt 1 /shared/ck' in prefixed(r.stdout, f'worker {rank}@{host}'), r.stdout
    assert wait_no_survivors(r.tag) == []


def test_a_replicated_server_lost_on_one_host_is_answered_for_from_the_other(clean):
    """--server-replicas 1 over ssh: server 0 (hostB) killed after its 20th round; server
    1 (hostA) holds its shard's replica and answers for it, and the three workers end with
    the weights of the same job run on this machine without the loss, to the last bit."""
    hosts = clean
    job = ['-n', '3', '-s', '2', '--env', 'D2L_KVSTORE_BIGARRAY_BOUND=1000', 'python',
           'tests/jobs/replicas_job.py']
    r = run_ssh(hosts, '-H', 'hostA,hostB', '--server-replicas', '1', '--fail',
                'server:0@step=20', *job)
    assert r.returncode == 0, r.stdout + r.stderr
    assert ('d2l-launch: server 0@hostB failed (killed by SIGKILL (exit code 137)); its '
            'replicas take over (--server-replicas 1)') in r.stdout, r.stdout
    assert any(line.startswith('d2ldist: server 1 answers for shard 0 now: its replica has '
                               'every change up to ')
               for line in prefixed(r.stdout, 'server 1@hostA')), r.stdout
    local = subprocess.run(launch_argv(*job), capture_output=True, text=True, timeout=90,
                           cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert local.returncode == 0, local.stdout + local.stderr

    def weights(out, label):                # (the job checked each round's count)
        return [line.split()[-1] for line in prefixed(out, label) if ' weights ' in line]
    remote = [weights(r.stdout, f'worker {rank}@{expected_host(hosts.names, 2, rank)}')
              for rank in range(3)]
    here = [weights(local.stdout, f'worker {rank}') for rank in range(3)]
    assert len(remote[0]) == 1 and remote == here == [remote[0]] * 3, (remote, here)
    assert wait_no_survivors(r.tag) == []


# -- clean-up on every host -----------------------------------------------------------
SLEEPER = '''\
import time, d2ldist
d2ldist.init()
print(f"worker {d2ldist.rank()} ready", flush=True)
time.sleep(300)
'''


def environ_of(pid):
    try:
        return dict(item.split('=', 1) for item in
                    open(f'/proc/{pid}/environ', 'rb').read().decode().split('\0') if '=' in item)
    except OSError:
        return {}


def job_pids_on(hosts, host, tag, role=None):
    """The job's processes on ``host`` (optionally of one role)."""
    pids = set(tagged_pids(tag)) & netns_pids(hosts.ns[host])
    return [p for p in pids if role is None or environ_of(p).get('D2L_ROLE') == role]


def ssh_children(pid):
    """The launcher's ssh client processes."""
    found = []
    for entry in os.listdir('/proc'):
        try:
            with open(f'/proc/{entry}/stat') as f:
                fields = f.read().rsplit(')', 1)[1].split()
            if int(fields[1]) == pid and open(f'/proc/{entry}/comm').read().strip() == 'ssh':
                found.append(int(entry))
        except (OSError, ValueError):
            continue
    return found


def kill_worker_on_b(hosts, launcher, tag):
    (pid, *_) = job_pids_on(hosts, 'hostB', tag, role='worker')
    os.kill(pid, signal.SIGKILL)


def interrupt_launcher(hosts, launcher, tag):
    os.kill(launcher.pid, signal.SIGINT)


def terminate_launcher(hosts, launcher, tag):
    os.kill(launcher.pid, signal.SIGTERM)


def kill_launcher(hosts, launcher, tag):
    os.kill(launcher.pid, signal.SIGKILL)


def kill_ssh_children(hosts, launcher, tag):
    children = ssh_children(launcher.pid)
    assert len(children) == 4      # scheduler + 3 workers
    for pid in children:
        os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize('action,code,says', [
    (kill_worker_on_b, 137, '@hostB failed (killed by SIGKILL (exit code 137))'),
    (interrupt_launcher, 130, 'interrupted: stopping the job'),
    (terminate_launcher, 143, 'interrupted: stopping the job'),
    (kill_ssh_children, 137, 'failed (killed by SIGKILL (exit code 137))'),
    (kill_launcher, -signal.SIGKILL, ''),        # MXNet's launcher left everything running
])
def test_no_process_left_on_any_host(clean, tmp_path, action, code, says):
    hosts = clean
    script = tmp_path / 'sleeper.py'
    script.write_text(SLEEPER)
    tag = new_tag()
    launcher = subprocess.Popen(
        ssh_argv(hosts, '-H', 'hostA,hostB', '-n', '3', '-s', '0', 'python', script, tag=tag),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)), start_new_session=True)
    lines, ready = read_until_ready(launcher, 3)
    try:
        assert ready.wait(60), ''.join(lines)
        # the job runs on both hosts, and its secret is on no command line anywhere
        assert len(job_pids_on(hosts, 'hostA', tag, 'worker')) == 1
        assert len(job_pids_on(hosts, 'hostB', tag, 'worker')) == 2
        (worker, *_) = job_pids_on(hosts, 'hostB', tag, 'worker')
        secret = environ_of(worker)['D2L_JOB_SECRET'].encode()
        assert len(secret) == 64
        for entry in os.listdir('/proc'):
            try:
                assert secret not in open(f'/proc/{entry}/cmdline', 'rb').read()
            except OSError:
                continue
        action(hosts, launcher, tag)
        assert launcher.wait(timeout=60) == code, ''.join(lines)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    time.sleep(0.2)             # let the reader take the last lines
    assert says in ''.join(lines)
    assert wait_no_survivors(tag, timeout=15) == []
    assert hosts.wait_no_leftovers(15) == {}


# -- preflight: nothing starts when a host cannot be used -----------------------------
@pytest.mark.parametrize('hostlist,options,reason', [
    (f'hostA,{UNREACHABLE}', [], f'preflight failed on {UNREACHABLE}: ssh: connect to host '
     f'{UNREACHABLE} port 22: '),      # No route to host (or timed out, on a slow ARP)
    ('hostA,hostB', ['--wrong-key'], 'preflight failed on hostA: root@198.18.7.2: '
     'Permission denied (publickey)'),
    ('hostA,hostB', ['--python', '/nonexistent/python3'], 'preflight failed on hostA: '
     'cannot run /nonexistent/python3'),
    ('hostA,hostB', ['--interface', 'nope0'], 'preflight failed on hostA: '
     'no IPv4 address on interface nope0'),
])
def test_preflight_stops_the_launch(clean, hostlist, options, reason):
    hosts = clean
    config = hosts.bad_ssh_config if '--wrong-key' in options else None
    options = [o for o in options if o != '--wrong-key']
    start = time.monotonic()
    r = run_ssh(hosts, '-H', hostlist, *options, '-n', '2', '-s', '0', 'python',
                'examples/hello_roles.py', config=config)
    assert r.returncode == 2, r.stdout + r.stderr
    (line,) = r.stderr.splitlines()
    assert line.startswith('d2l-launch: error: ' + reason), line
    assert r.stdout == ''                      # no placement, nothing started
    assert time.monotonic() - start < 30
    assert wait_no_survivors(r.tag) == []
