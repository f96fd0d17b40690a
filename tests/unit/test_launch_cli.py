"""d2l-launch's options as horovodrun, mpirun and torchrun users type them (-np, -H
host:slots, --hostfile, --max-np, --local-ranks-filter, --config-file, --version), the
old spellings refused in one line, and --dry-run's plan: all without starting a job."""
import io
import subprocess

import pytest

from support import launch_argv
from d2ldist.launch import cli
from d2ldist.launch.job import Job, Proc
from d2ldist.launch.processes import ProcSpec

COMMAND = ['python', '-c', 'pass']


def parse(*options):
    return cli.parse([*map(str, options), *COMMAND])


def refused(*options):
    with pytest.raises(cli.UsageError) as e:
        parse(*options)
    return str(e.value), e.value.hint


def plan(*options):
    return cli.dry_run(parse('--dry-run', *options)).splitlines()


# -- the names of horovodrun and mpirun ---------------------------------------------------
def test_np_is_n():
    assert parse('-np', 3).num_workers == parse('-n', 3).num_workers == 3


def test_h_lists_hosts_with_slots_and_hostfile_is_its_own_option(tmp_path):
    assert [row.split()[:3] for row in plan('-np', 3, '-s', 0, '--launcher', 'ssh',
                                            '-H', 'hostA:2,hostB')[2:]] == [
        ['scheduler', '-', 'hostA'], ['worker', '0', 'hostA'], ['worker', '1', 'hostA'],
        ['worker', '2', 'hostB']]
    hostfile = tmp_path / 'hosts'
    hostfile.write_text('# the cluster\nhostA slots=1\n\nhostB slots=2  # big\n')
    assert [row.split()[2] for row in plan('-n', 3, '-s', 0, '--launcher', 'mpi',
                                           '--hostfile', hostfile)[3:6]] == [
        'hostA', 'hostB', 'hostB']


@pytest.mark.parametrize('options,says', [
    (['-H', 'hostA:2222'], "-H hostA:2222: 2222 slots? -H takes host:slots (horovodrun's, "
     "mpirun's); an ssh port is --ssh-port 2222 or an ssh config (--ssh-config FILE)"),
    (['-H', '/etc/hosts'], '-H /etc/hosts: a file of hosts is --hostfile /etc/hosts (-H '
     'lists host:slots,...)'),
    (['-H', 'a', '--hostfile', '/etc/hosts'], '-H and --hostfile both list hosts: give one'),
    (['--ssh-port', 2222, '--launcher', 'mpi'], '--ssh-port needs --launcher ssh (mpi: put '
     'the port in an ssh config, --ssh-config FILE)'),
    (['--min-np', 1, '--max-np', 2], "--max-workers 2 bounds the workers that join, as "
     "horovodrun's --max-np: to start a lost worker again, once, add --restart-lost"),
    (['--restart-lost'], '--restart-lost needs --min-workers A'),
])
def test_old_spellings_are_refused_with_the_new_one(options, says):
    assert refused('-n', 2, *options) == (says, True)


def test_max_np_is_the_bound_and_restart_lost_the_one_restart():
    args = parse('-n', 2, '-s', 0, '--min-np', 1, '--restart-lost')
    assert (args.max_workers, args.restart_lost, args.env['D2L_MAX_WORKERS']) == (2, True, '2')
    args = parse('-n', 2, '-s', 0, '--min-np', 1, '--max-np', 4, '--restart-lost')
    assert (args.max_workers, args.env['D2L_MAX_WORKERS']) == (4, '4')


def test_option_errors_end_by_pointing_to_help():
    r = subprocess.run(launch_argv('-np', 2, '--bogus', *COMMAND), capture_output=True,
                       text=True, timeout=30)
    assert (r.returncode, r.stderr) == (2, 'd2l-launch: error: unrecognized arguments: '
                                           '--bogus; see d2l-launch --help\n')


# -- console, version, config file ---------------------------------------------------------
def test_version_and_the_servers_default_are_said():
    r = subprocess.run(launch_argv('--version'), capture_output=True, text=True, timeout=30)
    assert (r.returncode, r.stdout) == (0, f'd2l-launch {cli.version()}\n')
    r = subprocess.run(launch_argv('--help'), capture_output=True, text=True, timeout=30)
    assert 'default: as many as workers, so -n 4 starts 4 workers, 4 servers' in ' '.join(
        r.stdout.split())


def test_local_ranks_filter_keeps_the_console_to_some_workers(tmp_path):
    assert parse('-n', 4, '--local-ranks-filter', '0,2-3').console_ranks == {0, 2, 3}
    assert parse('-n', 4).console_ranks is None
    assert refused('-n', 2, '--local-ranks-filter', '2')[0] == (
        '--local-ranks-filter 2: the workers are 0 to 1')
    out = io.StringIO()
    job = Job([ProcSpec('server', 0), ProcSpec('worker', 0), ProcSpec('worker', 1)], out=out,
              console_ranks={1})
    job.procs[1].file = (tmp_path / 'worker-0.log').open('w')
    for p in job.procs:
        job._emit(p, f'hello from {p.label}')
    job.procs[1].file.close()
    assert out.getvalue() == '[server 0] hello from server 0\n[worker 1] hello from worker 1\n'
    assert (tmp_path / 'worker-0.log').read_text() == 'hello from worker 0\n'   # --log-dir
    assert list(job.procs[1].tail) == ['hello from worker 0']      # (the failure report)


def test_config_file_gives_long_options_and_the_command_line_wins(tmp_path):
    f = tmp_path / 'job.toml'
    f.write_text('num-workers = 4\nnum_servers = 1\nenv = ["A=1"]\ndry-run = true\n')
    args = parse('--config-file', f, '-n', 2, '--env', 'B=2')
    assert (args.num_workers, args.num_servers, args.dry_run) == (2, 1, True)
    assert (args.env['A'], args.env['B']) == ('1', '2')
    f.write_text('workers = 4\n')
    assert refused('--config-file', f) == (
        f"--config-file {f}: 'workers' is not an option of d2l-launch", True)
    yaml = tmp_path / 'job.yaml'
    assert refused('-n', 1, '--config-file', yaml)[0] == (
        f'--config-file {yaml}: YAML needs PyYAML, which d2ldist does not install; write '
        'the same keys as TOML (FILE.toml)')


# -- --dry-run -----------------------------------------------------------------------------
def test_dry_run_shows_every_process_and_starts_nothing():
    r = subprocess.run(launch_argv('--dry-run', '-n', 2, '-s', 1, *COMMAND),
                       capture_output=True, text=True, timeout=30)
    assert (r.returncode, r.stderr) == (0, '')
    lines = r.stdout.splitlines()
    assert lines[0] == ('d2l-launch: dry run, nothing started: 1 scheduler, 1 server, '
                        '2 workers; each a process on this machine')
    assert [line.split()[:3] for line in lines[1:]] == [
        ['role', 'rank', 'host'], ['scheduler', '-', 'localhost'],
        ['server', '0', 'localhost'], ['worker', '0', 'localhost'],
        ['worker', '1', 'localhost']]
    assert lines[2].endswith('-m d2ldist.runtime.scheduler') and lines[4].endswith('-c pass')


def test_dry_run_over_ssh_shows_each_ssh_command_with_user_and_port():
    lines = plan('-n', 1, '-s', 0, '--launcher', 'ssh', '-H', 'bob@hostA',
                 '--ssh-port', 2222, '--sync-dst-dir', '/tmp/job')
    assert lines[0].endswith('each over ssh (the job runs in /tmp/job)')
    worker = lines[3]
    assert worker.split()[:3] == ['worker', '0', 'hostA']
    assert ' -p 2222 -l bob hostA ' in worker and "'cd /tmp/job && exec " in worker
    assert lines[-1] == '  first: rsync the current directory to /tmp/job on every host'


def test_dry_run_inside_slurm_shows_the_srun_step(monkeypatch):
    monkeypatch.setattr('shutil.which', lambda name: f'/usr/bin/{name}')   # (srun)
    env = {'SLURM_JOB_ID': '7', 'SLURM_JOB_NODELIST': 'n[1-2]', 'SLURM_TASKS_PER_NODE': '1(x2)',
           'PATH': '/usr/bin'}
    args = cli.parse(['-n', '2', '-s', '0', '--launcher', 'slurm', '--dry-run', *COMMAND],
                     environ=env)
    lines = cli.dry_run(args, env).splitlines()
    assert lines[0].endswith('each a task of one srun step in allocation 7')
    assert [line.split()[2] for line in lines[2:5]] == ['n1', 'n1', 'n2']
    assert lines[-1].startswith('  started by: srun --ntasks=3 --nodes=2 ')


# -- --fail on a worker that never joins through d2ldist ------------------------------------
def test_the_launcher_fires_a_timed_fail_only_on_a_worker_that_never_joined():
    """failwatch.FailWatch: a timed --fail on a worker that has not said it joined is due
    its time after the start (once); one that joined counts its own; a step never fired
    on a worker that never joined is said so; the word of joining is taken, not shown."""
    import time
    from d2ldist import config
    from d2ldist.launch.failwatch import FailWatch
    from d2ldist.runtime.faults import JOINED
    args = parse('-n', 3, '-s', 0, '--fail', 'worker:0@2s', '--fail', 'worker:1@2s',
                 '--fail', 'worker:2@step=5')
    procs = [Proc(ProcSpec('worker', r, env=args.process_env[('worker', r)]
                           | config.env(restart=0))) for r in range(3)]
    watch = FailWatch([p.spec for p in procs])
    for p in procs:
        p.popen = object()                        # running (no process needed here)
        watch.start(p)
    assert watch.said(procs[1], JOINED) and not watch.said(procs[0], 'hello')
    assert list(watch.due(procs)) == []           # not yet 2 s
    for key in watch.started:
        watch.started[key] = time.monotonic() - 2
    assert [(p.spec.rank, line) for p, line in watch.due(procs)] == [
        (0, 'worker 0 fails on purpose 2 s after it started (--fail; it never joined '
            'through d2ldist, so the launcher kills it)')]
    assert list(watch.due(procs)) == []           # once
    assert list(watch.never_fired()) == [
        '--fail worker:2@step=5 never fired: worker 2 never joined through d2ldist (a step '
        'is a d2ldist training step)']
    tasks = FailWatch([p.spec for p in procs], kills=False)    # srun's, mpirun's tasks
    assert list(tasks.never_fired())[0] == (
        '--fail worker:0@2s never fired: worker 0 never joined through d2ldist, and the '
        'launcher cannot kill one task of srun or mpirun alone')


def test_a_fail_that_a_joined_worker_never_reached_is_named_at_the_end():
    """failwatch.FailWatch on workers that joined: one that exited 0 by itself (the Job's
    'finished' with code 0) before its step or its time gets the line, under every
    launcher; one that said it fails on purpose, one stopped by the launcher (no code
    yet) or one that failed gets none, nor does a worker of a later attempt."""
    from d2ldist import config
    from d2ldist.runtime.faults import JOINED
    args = parse('-n', 4, '-s', 0, '--fail', 'worker:0@step=5', '--fail', 'worker:1@30s',
                 '--fail', 'worker:2@step=5', '--fail', 'worker:3@step=5')
    for kills_one in (True, False):                 # local and ssh; srun's, mpirun's tasks
        job = Job([ProcSpec('scheduler', 0, argv=COMMAND)] + [
            ProcSpec('worker', r, argv=COMMAND, env=args.process_env[('worker', r)]
                     | config.env(restart=0)) for r in range(4)])
        job.fails.kills = kills_one
        workers = job.procs[1:]
        for p in workers:
            p.popen = object()
            job.fails.start(p)
            assert job.fails.said(p, JOINED)
        assert not job.fails.said(workers[2], 'd2ldist: worker 2 fails on purpose after '
                                              'its compute step 5 (--fail)')   # (shown)
        for p in workers[:3]:                       # ... and its wrapper exited 0
            p.code = 0
            job._set_state(p, 'finished')
        job._set_state(workers[3], 'finished')      # stopped by the launcher: no code yet
        workers[3].code = 0
        assert list(job.fails.never_fired()) == [
            '--fail worker:0@step=5 never fired: worker 0 ended before its step 5 (d2ldist '
            "counts only its Trainer's and optimizers' steps)",
            '--fail worker:1@30s never fired: worker 1 ended less than 30 s after it joined']
    later = Proc(ProcSpec('worker', 3, env=args.process_env[('worker', 3)]
                          | config.env(restart=1)))
    later.code = 0
    job._set_state(later, 'finished')               # a restart runs without its fault
    assert len(list(job.fails.never_fired())) == 2


def test_percent_launch_dry_run_prints_the_plan_and_starts_nothing(monkeypatch, capsys):
    """%launch --dry-run (d2ldist/notebook/magic.py): d2l-launch's plan in the cell, no
    job made, no process started."""
    pytest.importorskip('IPython')
    from d2ldist.notebook.magic import LaunchMagics

    def refuse(*args, **kwargs):
        raise AssertionError('a dry run started something')
    monkeypatch.setattr(cli, 'make_job', refuse)
    monkeypatch.setattr(subprocess, 'Popen', refuse)
    assert LaunchMagics(shell=None).launch('--dry-run -n 2 -s 1 python -c pass') is None
    out = capsys.readouterr().out
    assert out == cli.dry_run(parse('--dry-run', '-n', 2, '-s', 1))
    assert out.startswith('d2l-launch: dry run, nothing started: 1 scheduler, 1 server, 2 '
                          'workers; each a process on this machine\n')
