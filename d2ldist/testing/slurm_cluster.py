"""A real Slurm cluster on one machine: munged, slurmctld and two slurmd "nodes".

    namespace d2lslurm-l   198.18.13.1  "d2lctl": munged, slurmctld; srun, salloc, sbatch
      |-- veth --> namespace d2lslurm-1   198.18.13.2  "node1": slurmd -N node1
      |-- veth --> namespace d2lslurm-2   198.18.13.3  "node2": slurmd -N node2

Debian's daemons run as root, in the foreground, with every file of theirs (munge key,
``slurm.conf``, state, spool, logs, pid files) in one temporary folder; no systemd. Each
node is a network namespace (``netns_hosts.py``'s, without sshd) and a UTS namespace
with its own hostname, so ``SLURM_JOB_NODELIST`` is ``node[1-2]`` and a task on node2
says ``node2``. Every process here runs with a mount namespace of its own in which the
folder's ``hosts`` file is mounted over ``/etc/hosts`` (the machine's stays as it is), so
the names resolve on every node and where srun runs. The clients (``srun``, ``salloc``,
``sbatch``, ``sinfo``, ``squeue``, ``scancel``) find the cluster through ``SLURM_CONF``: run
them with ``argv()`` (or ``run()``) and ``env()``. Jobs share the machine's filesystem
and process table, as nodes with a shared home would; the tests find a job's processes by
their tag.

``stop()`` ends the daemons, kills every process left in the namespaces, removes the
namespaces and the folder; ``start()`` first removes the namespaces a crashed earlier
run left. Everything here needs root and Debian's ``slurmctld``, ``slurmd`` and
``munge``.
"""
import os
import shutil
import subprocess
import time
from pathlib import Path

from .netns_hosts import NetnsHosts, ip, remove_stale

PREFIX = 'd2lslurm'
SUBNET = '198.18.13'
CONTROLLER = 'd2lctl'
DAEMONS = ('munged', 'slurmctld', 'slurmd')


class SlurmCluster:
    """A controller and ``names`` nodes, each with ``cpus`` CPUs; see the module docstring."""

    def __init__(self, names=('node1', 'node2'), cpus=4, prefix=PREFIX, subnet=SUBNET):
        self.net = NetnsHosts(names, prefix=prefix, subnet=subnet)
        self.names, self.cpus, self.prefix = list(names), cpus, prefix
        self.dir = self.net.dir
        self.conf, self.hosts = self.dir / 'slurm.conf', self.dir / 'hosts'
        self.launcher_ns = self.net.launcher_ns
        self.daemons = {}                            # name -> Popen

    # -- set-up -----------------------------------------------------------------
    def start(self, timeout=60):
        self.remove_stale()
        try:
            self.net.network()
            self._hosts_file()
            self._munge_key()
            self._write_conf()
            self._start_daemons()
            self.wait_idle(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _hosts_file(self):
        """The /etc/hosts of every namespace: the controller's and nodes' names."""
        lines = ['127.0.0.1 localhost', f'{self.net.subnet}.1 {CONTROLLER}']
        lines += [f'{self.net.addr[n]} {n}' for n in self.names]
        self.hosts.write_text('\n'.join(lines) + '\n')

    def _munge_key(self):
        key = self.dir / 'munge.key'
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)

    def _write_conf(self):
        d = self.dir
        for sub in ('state', 'spool'):
            (d / sub).mkdir()
        nodes = ''.join(f'NodeName={n} NodeAddr={self.net.addr[n]} NodeHostname={n} '
                        f'CPUs={self.cpus} RealMemory=1000 State=UNKNOWN\n' for n in self.names)
        self.conf.write_text(f"""ClusterName=d2ltest
SlurmctldHost={CONTROLLER}({self.net.subnet}.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d / 'munge.sock'}
StateSaveLocation={d / 'state'}
SlurmdSpoolDir={d / 'spool'}/%n
SlurmctldPidFile={d / 'slurmctld.pid'}
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d / 'slurmctld.log'}
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=2
MinJobAge=2
InactiveLimit=0
{nodes}PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
""")

    def _in(self, ns, hostname, argv, log):
        """Start ``argv`` on a host: namespace ``ns``, its own hostname; output to ``log``."""
        return subprocess.Popen(self._enter(ns, argv, hostname), stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, env=self.env())

    def _enter(self, ns, argv, hostname=None):
        """``argv`` in network namespace ``ns``, with a mount namespace of its own where
        /etc/hosts is the cluster's (and, given one, a UTS namespace with ``hostname``).

        Not ``ip netns exec``: it mounts a fresh /sys, without /sys/fs/cgroup, and
        slurmd will not start without it."""
        script = 'mount --bind "$1" /etc/hosts && shift && '
        uts = []
        if hostname:
            script += 'hostname "$1" && shift && '
            uts = ['--uts']
        return ['nsenter', f'--net=/run/netns/{ns}', 'unshare', '--mount', *uts, 'sh', '-c',
                script + 'exec "$@"', 'sh', str(self.hosts), *([hostname] if hostname else []),
                *map(str, argv)]

    def _start_daemons(self):
        d = self.dir
        with open(d / 'daemons.out', 'ab') as log:
            self.daemons['munged'] = self._in(self.launcher_ns, CONTROLLER, [
                'munged', '--foreground', '--force', f'--key-file={d / "munge.key"}',
                f'--socket={d / "munge.sock"}', f'--pid-file={d / "munged.pid"}',
                f'--log-file={d / "munged.log"}', f'--seed-file={d / "munged.seed"}'], log)
            self._wait_file(d / 'munge.sock', 'munged')
            self.daemons['slurmctld'] = self._in(self.launcher_ns, CONTROLLER, [
                'slurmctld', '-D', '-i', '-f', str(self.conf)], log)
            for n in self.names:
                (d / 'spool' / n).mkdir()
                self.daemons[f'slurmd {n}'] = self._in(self.net.ns[n], n, [
                    'slurmd', '-D', '-N', n, '-f', str(self.conf)], log)

    def _wait_file(self, path, daemon, timeout=15):
        deadline = time.monotonic() + timeout
        while not path.exists():
            if self.daemons[daemon].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f'{daemon} did not start: {self.logs()}')
            time.sleep(0.05)

    def wait_idle(self, timeout=60):
        """Wait until sinfo shows every node idle; RuntimeError (with the logs) if not."""
        deadline = time.monotonic() + timeout
        while True:
            states = self.node_states()
            if states and all(s == 'idle' for s in states.values()):
                return states
            dead = [name for name, p in self.daemons.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f'{", ".join(dead)} exited' if dead else f'nodes {states}'
                raise RuntimeError(f'Slurm did not come up ({why}): {self.logs()}')
            time.sleep(0.3)

    # -- use --------------------------------------------------------------------
    def env(self, base=None):
        """The environment for Slurm's clients: ``base`` (or ours) with SLURM_CONF."""
        return dict(os.environ if base is None else base, SLURM_CONF=str(self.conf))

    def argv(self, *argv):
        """``argv`` run in the controller's namespace (where srun and salloc run)."""
        return self._enter(self.launcher_ns, argv)

    def run(self, *argv, timeout=30):
        """Run a Slurm client command there to its end; the CompletedProcess (text)."""
        return subprocess.run(self.argv(*argv), capture_output=True, text=True,
                              timeout=timeout, env=self.env())

    def node_states(self):
        """{node: state} as sinfo shows them ({} when the controller does not answer)."""
        r = self.run('sinfo', '-h', '-N', '-o', '%N %T')
        return dict(line.split()[:2] for line in r.stdout.splitlines() if line.strip()) \
            if r.returncode == 0 else {}

    def queue(self):
        """The jobs squeue shows (id and state), one line each; [] when the queue is empty."""
        r = self.run('squeue', '-h', '-o', '%i %T')
        if r.returncode != 0:
            raise RuntimeError(f'squeue failed: {r.stderr.strip()}')
        return r.stdout.split('\n')[:-1]

    def wait_queue_empty(self, timeout=30):
        deadline = time.monotonic() + timeout
        while (jobs := self.queue()) and time.monotonic() < deadline:
            time.sleep(0.3)
        return jobs

    def task_pids(self):
        """{namespace: pids} of processes in the nodes' namespaces other than slurmd: what
        jobs left there."""
        daemons = {p.pid for p in self.daemons.values()}
        found = {}
        for n in self.names:
            pids = {pid for pid in _netns_pids(self.net.ns[n]) if not _is_daemon(pid, daemons)}
            if pids:
                found[self.net.ns[n]] = pids
        return found

    def wait_no_tasks(self, timeout=15):
        """Wait until the nodes run nothing but slurmd (a step's slurmstepd lingers a
        moment after srun); return what is left, as task_pids()."""
        deadline = time.monotonic() + timeout
        while (found := self.task_pids()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return found

    def logs(self, lines=15):
        """The last lines of every daemon's log, for an error message."""
        out = []
        for log in sorted(self.dir.glob('*.log')) + [self.dir / 'daemons.out']:
            if log.exists():
                tail = log.read_text(errors='replace').splitlines()[-lines:]
                out.append(f'--- {log.name}\n' + '\n'.join(tail))
        return '\n'.join(out)

    # -- tear-down --------------------------------------------------------------
    def remove_stale(self):
        """The namespaces of an earlier run, and their processes."""
        remove_stale(self.prefix)

    def stop(self):
        for p in self.daemons.values():
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 5
        for p in self.daemons.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        self.remove_stale()              # also every process still in the namespaces
        shutil.rmtree(self.dir, ignore_errors=True)


def _netns_pids(ns):
    return {int(p) for p in ip('netns', 'pids', ns, check=False).split()}


def _is_daemon(pid, daemons):
    """Whether ``pid`` is one of the daemons, or a process of theirs (slurmd forks)."""
    if pid in daemons:
        return True
    try:
        return Path(f'/proc/{pid}/comm').read_text().strip() in DAEMONS
    except OSError:
        return False
