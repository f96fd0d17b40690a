"""What d2l-launch sets for the processes besides the D2L_* contract: torchrun's
conventions (OMP_NUM_THREADS shared out by host, GROUP_RANK and NODE_RANK)."""
from d2ldist.launch.processes import job_specs, local_specs, share_cores


def threads(specs):
    return {s.label: s.env.get('OMP_NUM_THREADS') for s in specs}


def test_each_host_shares_its_cores_among_its_processes():
    """5 processes on 2 cores: 1 thread each (never 0), with one line saying so."""
    specs = local_specs(2, 2, ['true'], 'secret')
    notice = share_cores(specs, {'localhost': 2}, environ={})
    assert set(threads(specs).values()) == {'1'}
    assert notice == ('d2l-launch: OMP_NUM_THREADS=1 for each process (2 cores, 5 processes '
                      'on this host), so that they do not overload it; set it '
                      '(--env OMP_NUM_THREADS=N) to tune')
    specs = local_specs(2, 0, ['true'], 'secret')     # the scheduler and 2 workers on 16
    share_cores(specs, {'localhost': 16}, environ={})
    assert set(threads(specs).values()) == {'5'}


def test_hosts_of_different_sizes_over_ssh():
    specs = job_specs(3, 1, ['true'], 'secret', hosts=['hostA', 'hostB'], slots=[1, 2])
    notice = share_cores(specs, {'hostA': 8, 'hostB': 4}, environ={})
    # workers by slots: worker 0 on hostA, 1 and 2 on hostB; the scheduler on the first
    # host, server 0 on the second: 8 cores over 2 processes, 4 over 3
    assert threads(specs) == {'scheduler': '4', 'worker 0': '4', 'server 0': '1',
                              'worker 1': '1', 'worker 2': '1'}
    assert notice == ("d2l-launch: OMP_NUM_THREADS for each process, its host's cores over "
                      'its processes: hostA 4, hostB 1; set it (--env OMP_NUM_THREADS=N) '
                      'to tune')


def test_the_users_own_setting_wins_and_nothing_is_said():
    specs = local_specs(2, 0, ['true'], 'secret')
    assert share_cores(specs, {'localhost': 2}, environ={'OMP_NUM_THREADS': '4'}) is None
    assert set(threads(specs).values()) == {None}      # the children inherit the 4
    specs = local_specs(2, 0, ['true'], 'secret', extra_env={'OMP_NUM_THREADS': '3'})
    assert share_cores(specs, {'localhost': 2}, environ={}) is None
    assert set(threads(specs).values()) == {'3'}


def test_workers_get_their_hosts_index_as_torchrun_and_lightning_name_it():
    specs = job_specs(3, 0, ['true'], 'secret', hosts=['hostA', 'hostB'])
    ranks = {s.label: (s.env['GROUP_RANK'], s.env['NODE_RANK'], s.env['D2L_CROSS_RANK'])
             for s in specs if s.role == 'worker'}
    # round-robin after the scheduler: worker 0 on hostB, 1 on hostA, 2 on hostB
    assert ranks == {'worker 0': ('0', '0', '0'), 'worker 1': ('1', '1', '1'),
                     'worker 2': ('0', '0', '0')}


def test_preflight_reports_each_hosts_cores(tmp_path, monkeypatch):
    """The ssh launcher's probe, run here by a stand-in for ssh: address, a free port,
    the interface, and the cores the host lets a process use (for OMP_NUM_THREADS)."""
    import os
    import sys

    from support import ROOT
    from d2ldist.launch import ssh

    class Here(ssh.Ssh):
        def argv(self, host, command):
            return ['sh', '-c', command]

    monkeypatch.delenv('SSH_CONNECTION', raising=False)   # (reached at 127.0.0.1, on lo)
    hosts = ssh.read_hosts('hostA,hostB')
    answers = ssh.preflight(hosts, Here(), sys.executable, str(tmp_path), str(ROOT))
    cores = len(os.sched_getaffinity(0))
    assert answers == {'hostA': ('127.0.0.1', answers['hostA'][1], 'lo', cores),
                       'hostB': ('127.0.0.1', answers['hostB'][1], 'lo', cores)}
    # the port as started.free_port chooses one: below the kernel's range for outgoing
    # connections, which any program's next connection may take from
    from d2ldist.runtime.started import ephemeral_ports
    assert all(int(a[1]) < ephemeral_ports()[0] for a in answers.values())


def test_env_server_and_env_worker_reach_only_their_role():
    """MXNet's --env-server and --env-worker (NAME=VALUE, or MXNet's NAME:VALUE); the
    more particular wins over --env, and OMP_NUM_THREADS given so is left alone."""
    import pytest

    from d2ldist.launch import cli
    args = cli.parse(['-n', '2', '-s', '1', '--env', 'A=all', '--env-server', 'A=server',
                      '--env-server', 'OMP_NUM_THREADS:4', '--env-worker', 'B=w',
                      'python', '-c', 'pass'])
    specs = [p.spec for p in cli.make_job(args, notices=False).procs]
    seen = {s.label: (s.env.get('A'), s.env.get('B'), s.env.get('OMP_NUM_THREADS'))
            for s in specs}
    shared = seen['scheduler'][2]
    assert seen == {'scheduler': ('all', None, shared), 'server 0': ('server', None, '4'),
                    'worker 0': ('all', 'w', shared), 'worker 1': ('all', 'w', shared)}
    for bad, message in ((['--env-worker', 'novalue'], '--env-worker takes NAME=VALUE'),
                         (['--env-server', 'D2L_SHM=2'], '--env-server D2L_SHM:')):
        with pytest.raises(cli.UsageError, match=message):
            cli.parse(['-n', '1', *bad, 'python', '-c', 'pass'])


def test_log_dir_names_a_file_per_process_and_attempt(tmp_path):
    import pytest

    from d2ldist.launch import cli
    from d2ldist.launch.job import Job, Proc
    job = Job(local_specs(1, 1, ['true'], 'secret'), log_dir=str(tmp_path / 'logs'))
    names = []
    for attempt in (0, 2):
        job.attempt = attempt
        for p in map(Proc, [s.spec for s in job.procs]):
            f = job._log_file(p)
            names.append(f.name.rsplit('/', 1)[1])
            f.close()
    assert names == ['scheduler.log', 'server-0.log', 'worker-0.log', 'scheduler.restart-2.log',
                     'server-0.restart-2.log', 'worker-0.restart-2.log']
    (tmp_path / 'afile').write_text('')
    with pytest.raises(cli.UsageError, match='--log-dir .*afile: not a folder'):
        cli.parse(['-n', '1', '--log-dir', str(tmp_path / 'afile'), 'python', '-c', 'pass'])
