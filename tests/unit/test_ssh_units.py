"""The ssh launcher's parts that need no sshd, no network namespace and no root.

Hostfiles, where each process goes, the options that need ``--launcher ssh``, the
command line a remote host runs, and the last-resort sweep of a job's process groups.
The same launcher across real hosts (namespaces with sshd) is tests/system/test_ssh.py.
"""
import os
import signal
import subprocess

import pytest

from support import launch_argv
from d2ldist.launch.processes import ProcSpec, assign_hosts
from d2ldist.launch.ssh import (SWEEP, HostError, Host, Ssh, placement_table, read_hostfile,
                                read_hosts, remote_command)


def test_hostfile_formats(tmp_path):
    f = tmp_path / 'hosts'
    f.write_text('# my cluster\n\nhostA\nhostB:2222   # a comment\nalice@hostC\n'
                 'bob@hostD:2200 slots=4\n')
    hosts = read_hostfile(str(f))
    assert [(h.user, h.name, h.port, h.slots) for h in hosts] == [
        (None, 'hostA', None, None), (None, 'hostB', 2222, None),
        ('alice', 'hostC', None, None), ('bob', 'hostD', 2200, 4)]
    f.write_text('hostA\nhostB\nhost C\n')
    with pytest.raises(HostError, match=f'{f} line 3: expected host.*got \'host C\''):
        read_hostfile(str(f))
    f.write_text('# nothing\n')
    with pytest.raises(HostError, match='no hosts'):
        read_hostfile(str(f))
    with pytest.raises(HostError, match='cannot read hostfile'):
        read_hostfile(str(tmp_path / 'missing'))


def test_inline_hosts_have_slots_as_in_horovodrun():
    """-H h1:2,h2: host:slots (horovodrun's, mpirun's), not host:port."""
    hosts = read_hosts('host1:2,bob@host2')
    assert [(h.user, h.name, h.port, h.slots) for h in hosts] == [
        (None, 'host1', None, 2), ('bob', 'host2', None, None)]
    with pytest.raises(HostError, match='listed twice'):
        read_hosts('a,b,a')
    with pytest.raises(HostError, match=r"item 2: expected host or host:slots, got 'b:x'"):
        read_hosts('a,b:x')


def test_ssh_port_is_every_hosts_unless_its_own():
    ssh = Ssh(port=2222)
    assert ssh.options(Host('a'))[-2:] == ['-p', '2222']
    assert ssh.options(Host('b', port=22))[-2:] == ['-p', '22']
    assert '-p' not in Ssh().options(Host('a'))


def test_placement_is_deterministic_and_uses_slots():
    assert assign_hosts(3, 1, ['A', 'B']) == [('scheduler', 0, 'A'), ('server', 0, 'B'),
                                       ('worker', 0, 'A'), ('worker', 1, 'B'),
                                       ('worker', 2, 'A')]
    # slots: workers fill host A's two slots, then B's one, then start again at A
    workers = [h for role, _, h in assign_hosts(4, 1, ['A', 'B'], slots=[2, 1]) if role == 'worker']
    assert workers == ['A', 'A', 'B', 'A']
    table = placement_table([ProcSpec('scheduler', 0, 'A'), ProcSpec('worker', 0, 'B')])
    assert table.splitlines() == ['  role       rank  host', '  scheduler  -     A',
                                  '  worker     0     B']


def test_cli_rejects_ssh_options_without_ssh():
    r = subprocess.run(launch_argv('-n', '1', '--sync-dst-dir', '/tmp/x', 'python', '-c', '1'),
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and r.stderr.strip() == \
        'd2l-launch: error: --sync-dst-dir needs --launcher ssh (or mpi)'
    r = subprocess.run(launch_argv('-n', '1', '--launcher', 'ssh', 'python', '-c', '1'),
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and 'needs -H' in r.stderr


def test_remote_command_quotes_everything():
    spec = ProcSpec('worker', 0, 'hostA', ['/usr/bin/python3', 'a b', "it's", '$X'])
    command = remote_command(spec, '/opt/py thon', '/work dir', '/src/d2l')
    assert command.startswith("cd '/work dir' && exec env PYTHONPATH=/src/d2l '/opt/py thon' "
                              '-m d2ldist.launch.guard --remote -- ')
    # the shell splits the command line back into exactly the original words
    printf = command.replace("cd '/work dir' && exec ", 'printf "%s\\0" ')
    echo = subprocess.run(['sh', '-c', printf], capture_output=True,
                          timeout=10).stdout.split(b'\0')[:-1]
    assert [w.decode() for w in echo] == ['env', 'PYTHONPATH=/src/d2l', '/opt/py thon', '-m',
                                          'd2ldist.launch.guard', '--remote', '--', *spec.argv]


def test_sweep_ends_only_this_jobs_groups():
    """The launcher's last resort, run here: it ends groups of this job, not others."""
    def group(job_id):
        return subprocess.Popen(['sleep', '60'], start_new_session=True,
                                env=dict(os.environ, D2L_JOB_ID=job_id))
    ours, theirs = group('job1'), group('job2')
    try:
        r = subprocess.run(['sh', '-c', SWEEP, 'sweep', 'job1', '0.2', str(ours.pid),
                            str(theirs.pid), '999999999'], timeout=10)
        assert r.returncode == 0
        assert ours.wait(timeout=5) == -signal.SIGTERM
        assert theirs.poll() is None
    finally:
        for p in (ours, theirs):
            p.kill()
            p.wait()
