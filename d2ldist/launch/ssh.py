"""The ssh launcher: run a job's processes on other machines with OpenSSH.

``processes.py`` decides what runs where, with which command and environment; this
module adds only *which host* and *how to get there*: the hosts (``-H a:2,b:2`` with
slots, a ``--hostfile``, or ``--host-discovery-script``), a preflight of every host in parallel,
``--sync-dst-dir``, and every process as ``ssh -T host 'cd DIR && exec python -m
d2ldist.launch.guard --remote -- cmd'``, its environment and the job's secret sent as
one JSON line down ssh's stdin, never on a command line.

No process outlives the job: the guard ends its process group when its stdin, the ssh
channel, closes; and after the job the launcher logs in again to end any group
(``d2ldist.guard: pgid N``) still alive. The steps, and why no tty:
docs/design/launch.md, "Over ssh".
"""
import dataclasses
import inspect
import json
import os
import re
import shlex
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from .. import config
from ..lines import NAME, clip
from ..runtime import started
from .job import Job, Proc
from .processes import child_env, guarded, job_specs, share_cores

HOST_LINE = re.compile(r'(?:(?P<user>[A-Za-z0-9_][A-Za-z0-9_.-]*)@)?'
                       r'(?P<name>[A-Za-z0-9][A-Za-z0-9_.-]*)(?::(?P<port>\d+))?'
                       r'(?:\s+slots=(?P<slots>\d+))?')
GUARD_PGID = re.compile(r'd2ldist\.guard: pgid (\d+)')
SYNC_EXCLUDES = ('.git', '.venv')
# Variables a user expects to reach every process (as ``env`` does for local jobs).
FORWARD = ('PYTHONPATH', 'OMP_NUM_THREADS', 'MKL_NUM_THREADS', 'OPENBLAS_NUM_THREADS')
FORWARD_PREFIXES = (config.PREFIX, 'NCCL_', 'GLOO_', 'TORCH_')
# ... but not the job's own (the launcher sets them for each process) nor the launcher's
NOT_FORWARDED = (*config.JOB_VARIABLES, config.variable('interface'))
DISCOVERY_SECONDS = 1.0       # how often --host-discovery-script runs (horovodrun's)


class HostError(Exception):
    """A host cannot be used: reported in one line, exit code 2, nothing started."""


@dataclass
class Host:
    """One line of a hostfile."""
    name: str
    user: str = None
    port: int = None
    slots: int = None

    @property
    def label(self):
        """How the host appears in placement and output: 'hostB' (or 'hostB:2222')."""
        return self.name if self.port is None else f'{self.name}:{self.port}'


# -- 1. hosts ----------------------------------------------------------------------
def parse_host(text, where):
    """One ``[user@]host[:port] [slots=N]`` entry; ``where`` names it in errors."""
    m = HOST_LINE.fullmatch(text.strip())
    if m is None:
        raise HostError(f'{where}: expected host, host:port, user@host or user@host:port, '
                        f'optionally followed by slots=N; got {text.strip()!r}')
    port = None if m['port'] is None else int(m['port'])
    if port is not None and not 0 < port < 65536:
        raise HostError(f'{where}: port {port} is out of range')
    slots = None if m['slots'] is None else int(m['slots'])
    if slots == 0:
        raise HostError(f'{where}: slots must be at least 1')
    return Host(m['name'], m['user'], port, slots)


def read_hosts(value):
    """The hosts of ``-H``: ``host1:2,user@host2`` (host:slots, as horovodrun's)."""
    entries = [slot_entry(item, f'-H {value!r} item {i}')
               for i, item in enumerate(value.split(','), 1)]
    return hosts_of(entries, 'host:slots', f'no hosts in -H {value!r}')


def slot_entry(text, where):
    """``host:slots`` as a hostfile line, ``host slots=N`` (with where it was)."""
    name, colon, slots = text.strip().partition(':')
    if colon and not slots.isdigit():
        raise HostError(f'{where}: expected host or host:slots, got {text.strip()!r}')
    return name + (f' slots={slots}' if colon else ''), where


def read_hostfile(path):
    """The hosts of ``--hostfile``: ``host slots=N`` lines (``[user@]host[:port]`` too),
    with ``#`` comments and blank lines."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise HostError(f'cannot read hostfile {path}: {e.strerror}') from None
    entries = [(line.split('#', 1)[0], f'{path} line {i}') for i, line in enumerate(lines, 1)]
    return hosts_of(entries, 'slots=N', f'no hosts in {path}')


def hosts_from(args):
    """The hosts that ``-H`` or ``--hostfile`` lists (None: neither)."""
    if args.hosts is not None:
        return read_hosts(args.hosts)
    return None if args.hostfile is None else read_hostfile(args.hostfile)


def hosts_of(entries, how, none):
    """The Hosts of (hostfile text, where it was) entries, blank ones skipped; a host
    listed twice is refused (``how``: the way to give it more slots), no host (``none``)."""
    hosts = []
    for text, where in entries:
        if not text.strip():
            continue
        host = parse_host(text, where)
        if any(h.label == host.label for h in hosts):
            raise HostError(f'{where}: {host.label} is listed twice (use {how})')
        hosts.append(host)
    if not hosts:
        raise HostError(none)
    return hosts


def discover(script, timeout=10.0):
    """The hosts ``--host-discovery-script`` prints now, one per line: ``host`` or
    ``host:slots``, as horovodrun reads them (an ssh port goes in the ssh config)."""
    try:
        r = subprocess.run([script], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise HostError(f'--host-discovery-script {script}: {e}') from None
    if r.returncode != 0:
        said = clip((r.stderr.strip().splitlines() or [''])[-1], NAME)
        raise HostError(f'--host-discovery-script {script} exited with {r.returncode}'
                        + (f': {said}' if said else ''))
    entries = [slot_entry(line.split('#', 1)[0], f'--host-discovery-script line {i}')
               for i, line in enumerate(r.stdout.splitlines(), 1)]
    return hosts_of(entries, 'host:slots', f'--host-discovery-script {script} printed no hosts')


# -- how to get there --------------------------------------------------------------
class Ssh:
    """The ssh command line for each host (and for rsync's ``-e``)."""

    def __init__(self, config=None, connect_timeout=10, port=None):
        self.config, self.connect_timeout = config, connect_timeout
        self.port = port                  # --ssh-port: every host's, unless its own

    def options(self, host):
        """ssh and its options for ``host``: no tty, never a password prompt."""
        argv = ['ssh', '-T', '-o', 'BatchMode=yes',
                '-o', f'ConnectTimeout={self.connect_timeout:g}',
                '-o', 'ServerAliveInterval=5', '-o', 'ServerAliveCountMax=3',
                '-o', 'LogLevel=ERROR']
        if self.config:
            argv += ['-F', self.config]
        if (host.port or self.port) is not None:
            argv += ['-p', str(host.port or self.port)]
        if host.user:
            argv += ['-l', host.user]
        return argv

    def argv(self, host, command):
        """``ssh ... host command``: run the shell command line ``command`` on ``host``."""
        return [*self.options(host), host.name, command]


def run_parallel(argvs, timeout):
    """Run commands at once; return [(exit code, stdout, stderr)] (code None: timed out)."""
    procs = [subprocess.Popen(a, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for a in argvs]
    results = []
    try:
        for p in procs:
            try:
                out, err = p.communicate(timeout=timeout)
                results.append((p.returncode, out, err))
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
                results.append((None, out, err))
    finally:                  # interrupted: leave no ssh or rsync behind
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def reason(code, err, timeout):
    """ssh's (or the remote shell's) reason for a failure, in one line."""
    if code is None:
        return f'no answer within {timeout:g} s'
    lines = [line.strip() for line in err.splitlines() if line.strip()]
    return lines[-1] if lines else f'exit code {code}'


# -- 2. preflight ------------------------------------------------------------------
# Runs on each host with its Python: the address it was reached at (or the address of
# --interface), a free port there (chosen as ``started.free_port`` chooses, whose code it
# carries: d2ldist may not be there before the sync), and (unless the directory is still
# to be synced) that d2ldist can be imported.
PROBE = '''\
import fcntl, os, random, socket, struct, sys
''' + ''.join(inspect.getsource(f) for f in (
    started.free_port, started.port_is_free, started.ephemeral_ports)) + '''
iface, check = sys.argv[1], sys.argv[2] == "1"
if check:
    import d2ldist.launch.guard
def address_of(name):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("256s", name.encode()[:15])
        return socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24])
addr = os.environ.get("SSH_CONNECTION", "- - 127.0.0.1").split()[2]
if iface:
    try:
        addr = address_of(iface)
    except OSError as e:
        sys.exit(f"no IPv4 address on interface {iface}: {e.strerror}")
else:
    for _, name in socket.if_nameindex():
        try:
            if address_of(name) == addr:
                iface = name
        except OSError:
            pass
print("d2ldist-preflight", addr, free_port(addr), iface or "-", len(os.sched_getaffinity(0)))
'''


def preflight(hosts, ssh, python, workdir, pythonpath, interface=None, syncing=False):
    """Check every host in parallel; return {label: (address, free port, interface, cores)}.

    Raise HostError naming the first host that failed."""
    steps = [f'mkdir -p {shlex.quote(workdir)}'] if syncing else []
    steps.append(f'cd {shlex.quote(workdir)}')
    steps.append('exec ' + shlex.join([*env_words(pythonpath), python, '-c', PROBE,
                                       interface or '', '0' if syncing else '1']))
    command = ' && '.join(steps)
    timeout = ssh.connect_timeout + 20
    results = run_parallel([ssh.argv(h, command) for h in hosts], timeout)
    answers, failed = {}, []
    for host, (code, out, err) in zip(hosts, results):
        m = re.search(r'^d2ldist-preflight (\S+) (\d+) (\S+) (\d+)$', out, re.M)
        if code == 0 and m:
            answers[host.label] = (m.group(1), int(m.group(2)), m.group(3), int(m.group(4)))
        else:
            why = reason(code, err, timeout)
            if code == 127:
                why = f'cannot run {python}: {why}'
            failed.append(f'{host.label}: {why}')
    if failed:
        more = len(failed) - 1
        more = f' (and {more} more host{"s" * (more > 1)})' if more else ''
        raise HostError(f'preflight failed on {failed[0]}{more}')
    first = answers[hosts[0].label][0]
    if ':' in first:
        raise HostError(f'{hosts[0].label} is reached over IPv6 ({first}); d2ldist needs '
                        'IPv4: pick an interface with --interface')
    if first.startswith('127.') and any(not a.startswith('127.') for a, *_ in answers.values()):
        raise HostError(f'{hosts[0].label} is reached at {first}, which other hosts cannot '
                        'reach: list it by its network address or use --interface')
    return answers


def env_words(pythonpath):
    """``env PYTHONPATH=...``: what the guard itself needs to start (no secrets)."""
    return ['env', f'PYTHONPATH={pythonpath}'] if pythonpath else []


# -- 3. --sync-dst-dir -------------------------------------------------------------
def sync(hosts, ssh, dst, src='.', excludes=SYNC_EXCLUDES):
    """rsync ``src`` to ``dst`` on every host in parallel; raise HostError on failure."""
    argvs = [['rsync', '-a', *[f'--exclude={e}' for e in excludes],
              '-e', shlex.join(ssh.options(h)), f'{src.rstrip("/")}/',
              f'{h.name}:{dst.rstrip("/")}/'] for h in hosts]
    timeout = 600
    for host, (code, _, err) in zip(hosts, run_parallel(argvs, timeout)):
        if code != 0:
            raise HostError(f'rsync to {host.label}:{dst} failed: {reason(code, err, timeout)}')


# -- 4. the processes --------------------------------------------------------------
def forwarded_env(environ=os.environ):
    """The launcher's variables every remote process gets (PYTHONPATH goes separately)."""
    return {k: v for k, v in environ.items()
            if (k in FORWARD or k.startswith(FORWARD_PREFIXES))
            and k not in NOT_FORWARDED and k != 'PYTHONPATH'}


def remote_pythonpath(pythonpath, cwd, workdir):
    """PYTHONPATH for the hosts: entries inside the synced directory move with it."""
    entries = []
    for entry in filter(None, (pythonpath or '').split(os.pathsep)):
        path = Path(cwd, entry).resolve()
        try:
            entries.append(str(Path(workdir, path.relative_to(Path(cwd).resolve()))))
        except ValueError:
            entries.append(str(path))
    return os.pathsep.join(entries)


def remote_command(spec, python, workdir, pythonpath):
    """The shell command line that runs one process on its host, under the guard."""
    return f'cd {shlex.quote(workdir)} && exec ' + shlex.join(
        [*env_words(pythonpath), *guarded(spec.argv, python, remote=True)])


class SshJob(Job):
    """A Job whose processes run on other hosts, each through its own ssh connection."""

    def __init__(self, specs, hosts, ssh, python, workdir, pythonpath, job_id,
                 discovery=None, **kw):
        super().__init__(specs, **kw)
        self.hosts = {h.label: h for h in hosts}
        self.ssh, self.python, self.workdir = ssh, python, workdir
        self.pythonpath, self.job_id = pythonpath, job_id
        self.swept = set()
        self.discovery = discovery        # (script, how to check a new host), or None
        self.listed = set(self.hosts)     # the hosts the script lists now
        self.refused = {}                 # host -> why it cannot be used (said once)
        self.script_error = None          # what the script's last failure said
        self.next_look = time.monotonic() + DISCOVERY_SECONDS

    def spawn(self, spec):
        """ssh to the host, then send the environment as the first line of stdin."""
        command = remote_command(spec, self.python, self.workdir, self.pythonpath)
        secret = config.variable('job_secret')
        env = {k: v for k, v in child_env(spec).items() if k != secret}
        popen = subprocess.Popen(
            self.ssh.argv(self.hosts[spec.host], command), env=env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            popen.stdin.write(json.dumps(spec.env).encode() + b'\n')
            popen.stdin.flush()
        except BrokenPipeError:
            pass          # ssh already failed: its exit code and message tell why
        return popen

    def _emit(self, p, line):
        m = GUARD_PGID.fullmatch(line)
        if m:             # the guard's note of the remote process group: keep, don't show
            p.remote_pgid = int(m.group(1))
            return
        super()._emit(p, line)

    def terminate(self, p):
        """Close ssh's stdin: the remote guard reads EOF and stops its group (with a grace)."""
        try:
            p.popen.stdin.close()
        except OSError:
            pass

    def stop_all(self, state='stopped'):
        super().stop_all(state)
        self.sweep()

    # -- --host-discovery-script: hosts that come and go ------------------------------
    def tick(self):
        """Every DISCOVERY_SECONDS: start workers on the hosts the script added, stop
        those on the hosts it dropped (elastic: the ring re-forms each time)."""
        if self.discovery is None or time.monotonic() < self.next_look:
            return
        self.next_look = time.monotonic() + DISCOVERY_SECONDS
        script, check = self.discovery
        try:
            now = {h.label: h for h in discover(script)}
        except HostError as e:
            if self.script_error != str(e):
                self._say(f'{e}; the hosts stay as they were')
            self.script_error = str(e)
            return
        self.script_error = None
        for label in sorted(self.listed - set(now)):
            self._host_went(label)
        self.refused = {h: why for h, why in self.refused.items() if h in now}  # (listed
        for label, host in now.items():                      # again later: checked again)
            if label not in self.listed and label not in self.refused:
                self._host_came(host, check)

    def _host_went(self, label):
        """The script no longer lists ``label``: stop its workers (not left to start
        again); a scheduler or server there stays."""
        self.listed.discard(label)
        for p in self.procs:
            if p.spec.host == label and p.spec.role == 'worker' and p.alive:
                self._say(f'{label} left the host discovery script: stopping {p.label}')
                self.terminate(p)

    def _host_came(self, host, check):
        """The script lists a new host: check it, then start a worker per slot (up to
        --max-workers), each with the next rank, to join the job."""
        try:
            at = check([host])
        except HostError as e:
            self.refused[host.label] = str(e)
            self._say(f'cannot use {host.label} from the host discovery script: {e}')
            return
        self.hosts[host.label] = host
        self.listed.add(host.label)
        template = next(p.spec for p in self.procs if p.spec.role == 'worker')
        for local in range(host.slots or 1):
            running = [p for p in self.procs if p.spec.role == 'worker' and p.alive]
            if self.max_workers is not None and len(running) >= self.max_workers:
                break
            rank = 1 + max(p.spec.rank for p in self.procs if p.spec.role == 'worker')
            spec = joining_worker(template, rank, host.label, local, host.slots or 1,
                                  at.host_env[host.label])
            self.procs.append(Proc(spec))
            self._say(f'{host.label} joins (host discovery): starting {spec.label}')
            self._start(self.procs[-1])

    def _start_again(self, p):
        if p.spec.host in self.listed or self.discovery is None:   # (not a host gone)
            super()._start_again(p)


    def sweep(self):
        """End, on every host, the recorded process groups that may still be alive."""
        groups = {}
        for p in self.procs:
            pgid = getattr(p, 'remote_pgid', None)
            if pgid and p.state != 'finished' and p not in self.swept:
                groups.setdefault(p.spec.host, []).append(str(pgid))
                self.swept.add(p)
        if not groups:
            return
        grace = config.get().kill_grace
        argvs = [self.ssh.argv(self.hosts[label], shlex.join(
                 ['sh', '-c', SWEEP, 'sweep', self.job_id, f'{grace:g}', *pgids]))
                 for label, pgids in groups.items()]
        run_parallel(argvs, self.ssh.connect_timeout + grace + 5)


# $1 job id, $2 grace, then process group ids. A group is ours if its leader is gone
# (a pid is never reused while its group lives) or the leader's environment holds our
# D2L_JOB_ID; then it gets SIGTERM and, after the grace, SIGKILL.
SWEEP = f'''\
job=$1 grace=$2; shift 2; alive=
for g in "$@"; do
  kill -0 -"$g" 2>/dev/null || continue
  if [ -r /proc/"$g"/environ ]; then
    tr '\\000' '\\n' < /proc/"$g"/environ \\
      | grep -qx "{config.variable('job_id')}=$job" || continue
  fi
  alive="$alive $g"; kill -TERM -"$g" 2>/dev/null
done
[ -n "$alive" ] || exit 0
sleep "$grace"
for g in $alive; do kill -KILL -"$g" 2>/dev/null; done
exit 0
'''


def joining_worker(template, rank, host, local_rank, local_size, host_env):
    """A worker that joins a running job on ``host``: another worker's spec with its
    own rank and host (without --fail and --slow, which name the first processes)."""
    drop = {config.variable('fail'), config.variable('slow')}
    env = {k: v for k, v in template.env.items() if k not in drop}
    env.update(host_env)
    env.update(config.env(rank=rank), RANK=str(rank), LOCAL_RANK=str(local_rank),
               LOCAL_WORLD_SIZE=str(local_size))
    return dataclasses.replace(template, rank=rank, host=host, env=env)


# -- putting it together -------------------------------------------------------------
def host_variables(address, port, interface, chosen, environ=os.environ):
    """Variables for the processes of one host: which network to use.

    torch.distributed's gloo and NCCL find their own address from the host name, which
    often resolves to 127.0.0.1; naming the interface the host was reached on avoids
    that (unless the user set the variables already)."""
    env = config.env(node_host=address) if chosen else {}
    if interface != '-':
        for name in ('GLOO_SOCKET_IFNAME', 'NCCL_SOCKET_IFNAME'):
            if name not in environ:
                env[name] = interface
    return env



def placement_table(specs):
    """The placement, printed at start: role, rank and host of every process."""
    rows = [('role', 'rank', 'host')] + [
        (s.role, '-' if s.role == 'scheduler' else str(s.rank), s.host) for s in specs]
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    return '\n'.join('  ' + '  '.join(c.ljust(w) for c, w in zip(r, width)).rstrip()
                     for r in rows)


def checked_hosts(hosts, args, python):
    """Preflight every host (and sync the directory with --sync-dst-dir); what the
    launchers that reach hosts over ssh need of them (ssh, and mpi through mpirun)."""
    ssh = Ssh(args.ssh_config, args.connect_timeout, args.ssh_port)
    cwd = os.getcwd()
    workdir = args.sync_dst_dir or cwd
    pythonpath = remote_pythonpath(os.environ.get('PYTHONPATH'), cwd, workdir)
    answers = preflight(hosts, ssh, python, workdir, pythonpath, args.interface,
                        syncing=bool(args.sync_dst_dir))
    if args.sync_dst_dir:
        sync(hosts, ssh, args.sync_dst_dir, cwd, () if args.sync_all else SYNC_EXCLUDES)
    labels = [h.label for h in hosts]
    return SimpleNamespace(
        hosts=hosts, ssh=ssh, workdir=workdir, pythonpath=pythonpath, labels=labels,
        answers=answers,
        slots=[h.slots or 1 for h in hosts] if any(h.slots for h in hosts) else None,
        addresses={label: answers[label][0] for label in labels},
        ports={label: answers[label][1] for label in labels},
        host_env={label: host_variables(*answers[label][:3], args.interface)
                  for label in labels},
        cores={label: answers[label][3] for label in labels})


def prepare(args, secret, out=None, notices=True, **job_options):
    """The job of the parsed ``args`` with ``--launcher ssh``, after preflight and sync.

    ``notices``: say what was set for the user (cli.make_job); ``job_options`` go to
    the Job (``on_line``, ``on_state``: see job.py)."""
    out = out or sys.stdout
    python = args.python or sys.executable
    script = args.host_discovery_script
    at = checked_hosts(discover(script) if script else hosts_from(args), args, python)
    job_id = uuid.uuid4().hex
    specs = job_specs(args.num_workers, args.num_servers, args.command, secret,
                      hosts=at.labels, slots=at.slots, addresses=at.addresses,
                      free_ports=at.ports, host_env=at.host_env, python=python, remote=True,
                      extra_env={**forwarded_env(), **args.env, **config.env(job_id=job_id)},
                      process_env=args.process_env)
    if args.port:
        specs[0].env.update(config.env(scheduler_port=args.port))
    notice = share_cores(specs, at.cores)
    if notice and notices:
        out.write(notice + '\n')
    rule = 'workers by slots' if at.slots else 'servers and workers round-robin'
    out.write(f'd2l-launch: placement (scheduler on the first host, {rule}):\n'
              f'{placement_table(specs)}\n')
    out.flush()
    return SshJob(specs, at.hosts, at.ssh, python, at.workdir, at.pythonpath, job_id,
                  discovery=script and (script, lambda hosts: checked_hosts(hosts, args,
                                                                           python)),
                  timeout=args.timeout, max_restarts=args.max_restarts, out=out,
                  min_workers=args.min_workers, max_workers=args.max_workers,
                  restart_lost=args.restart_lost, **job_options)

