"""Several "machines" on one: network namespaces on a bridge, each running Debian's sshd.

    launcher namespace (d2lssh-l)           198.18.7.1  on bridge br0
      |-- veth --> namespace d2lssh-a       198.18.7.2  "hostA", sshd
      |-- veth --> namespace d2lssh-b       198.18.7.3  "hostB", sshd

The launcher runs inside its own namespace too (``ip netns exec d2lssh-l d2l-launch``),
so the tests add nothing to the machine's own network (which other jobs share), and
no process of a test can reach anything outside 198.18.7.0/24.

Each sshd has generated host keys, its own config (no PAM, root by key only, its own
pid file) and a private tmpfs at ``remote_dir``: files there exist on that host only,
so a test can tell a file that rsync really copied from one that the shared
filesystem shows everywhere. The client side is an ssh config file (``ssh -F``) with
a throw-away key and the hosts' keys in its own known_hosts.

``shape(rate, latency)`` shapes every host's outgoing link with Linux ``tc``, the real
counterpart of d2l-launch's simulated network; ``unshape()`` removes it. ``cut(name)``
and ``mend(name)`` take a host off the network and put it back (a partition).

The ssh tests (tests/system, through ``hosts_for_tests`` in tests/support.py) and
benchmarks/between_hosts.py use these hosts; everything here needs root.
"""
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

PREFIX = 'd2lssh'
SUBNET = '198.18.7'
LAUNCHER_NS = f'{PREFIX}-l'
UNREACHABLE = f'{SUBNET}.250'     # on the bridge's subnet, but nobody has it


def ip(*args, check=True):
    return subprocess.run(['ip', *args], capture_output=True, text=True, check=check,
                          timeout=30).stdout


def netns_pids(ns):
    """Pids of the processes in network namespace ``ns`` (its 'process table')."""
    return {int(p) for p in ip('netns', 'pids', ns, check=False).split()}


def remove_stale(prefix=PREFIX):
    """Remove namespaces (and their processes) left by an earlier run."""
    for line in ip('netns', 'list').splitlines():
        ns = line.split()[0] if line.split() else ''
        if ns.startswith(prefix + '-'):
            for pid in netns_pids(ns):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            ip('netns', 'del', ns, check=False)


class NetnsHosts:
    """Hosts ``hostA``, ``hostB``, ... as namespaces with sshd; see the module docstring.

    Everything is removed in ``stop()``; ``start()`` first removes what a crashed earlier
    run may have left (anything named with the ``d2lssh`` prefix). Another ``prefix`` and
    ``subnet`` give a second, independent set of hosts (tests that may run concurrently)."""

    def __init__(self, names=('hostA', 'hostB'), prefix=PREFIX, subnet=SUBNET):
        self.names, self.prefix, self.subnet = list(names), prefix, subnet
        self.launcher_ns = f'{prefix}-l'
        self.ns = {n: f'{prefix}-{n[-1].lower()}' for n in self.names}
        self.addr = {n: f'{subnet}.{i}' for i, n in enumerate(self.names, 2)}
        self.dir = Path(tempfile.mkdtemp(prefix=f'{prefix}-'))
        self.remote_dir = self.dir / 'remote'     # a private tmpfs on every host
        self.ssh_config = self.dir / 'ssh_config'
        self.bad_ssh_config = self.dir / 'ssh_config_wrong_key'
        self.sshd = {}                            # name -> Popen

    # -- set-up -----------------------------------------------------------------
    def start(self):
        remove_stale(self.prefix)
        try:
            self.network()
            self._keys()
            for name in self.names:
                self._start_sshd(name)
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def network(self):
        """The namespaces and the bridge, without sshd (slurm_cluster.py uses this alone)."""
        lns = self.launcher_ns
        ip('netns', 'add', lns)
        ip('-n', lns, 'link', 'set', 'lo', 'up')
        ip('-n', lns, 'link', 'add', 'br0', 'type', 'bridge')
        ip('-n', lns, 'addr', 'add', f'{self.subnet}.1/24', 'dev', 'br0')
        ip('-n', lns, 'link', 'set', 'br0', 'up')
        for name in self.names:
            ns, veth = self.ns[name], f'v-{name}'
            ip('netns', 'add', ns)
            ip('-n', lns, 'link', 'add', veth, 'type', 'veth',
               'peer', 'name', 'eth0', 'netns', ns)
            ip('-n', lns, 'link', 'set', veth, 'master', 'br0', 'up')
            ip('-n', ns, 'addr', 'add', f'{self.addr[name]}/24', 'dev', 'eth0')
            ip('-n', ns, 'link', 'set', 'eth0', 'up')
            ip('-n', ns, 'link', 'set', 'lo', 'up')

    def _keys(self):
        def keygen(path):
            subprocess.run(['ssh-keygen', '-q', '-t', 'ed25519', '-N', '', '-C', self.prefix,
                            '-f', str(path)], check=True, timeout=30)
            return path.with_suffix('.pub').read_text().strip()
        client = keygen(self.dir / 'id_client')
        keygen(self.dir / 'id_wrong')             # a key no host accepts
        (self.dir / 'authorized_keys').write_text(client + '\n')
        known = []
        for name in self.names:
            host_key = keygen(self.dir / f'host_{name}')
            known.append(f'{self.addr[name]} {" ".join(host_key.split()[:2])}')
        (self.dir / 'known_hosts').write_text('\n'.join(known) + '\n')
        for config, key in ((self.ssh_config, 'id_client'), (self.bad_ssh_config, 'id_wrong')):
            config.write_text(''.join(f'Host {n}\n  HostName {self.addr[n]}\n'
                                      for n in self.names) + f"""Host *
  User root
  IdentityFile {self.dir / key}
  IdentitiesOnly yes
  IdentityAgent none
  UserKnownHostsFile {self.dir / 'known_hosts'}
  GlobalKnownHostsFile /dev/null
  StrictHostKeyChecking yes
""")

    def _start_sshd(self, name):
        Path('/run/sshd').mkdir(exist_ok=True)    # Debian's privilege separation dir
        self.remote_dir.mkdir(exist_ok=True)
        config = self.dir / f'sshd_config_{name}'
        config.write_text(f"""ListenAddress {self.addr[name]}
Port 22
HostKey {self.dir / f'host_{name}'}
PidFile {self.dir / f'sshd_{name}.pid'}
UsePAM no
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
AuthorizedKeysFile {self.dir / 'authorized_keys'}
StrictModes no
PrintMotd no
MaxStartups 100
MaxSessions 100
LogLevel ERROR
""")
        # ip netns exec gives sshd its own mount namespace; a tmpfs there is this host's
        self.sshd[name] = subprocess.Popen(
            ['ip', 'netns', 'exec', self.ns[name], 'sh', '-c',
             f'mount -t tmpfs -o size=64m {self.prefix} "$1" && exec /usr/sbin/sshd -D -e -f "$2"',
             'sh', str(self.remote_dir), str(config)],
            stdin=subprocess.DEVNULL)

    def _wait_ready(self, timeout=15):
        deadline = time.monotonic() + timeout
        for name in self.names:
            pidfile = self.dir / f'sshd_{name}.pid'
            while not pidfile.exists():
                if self.sshd[name].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f'sshd for {name} did not start')
                time.sleep(0.05)

    # -- use --------------------------------------------------------------------
    def hostfile(self, path, lines=None):
        """Write a hostfile (by default: every host, one per line); return its path."""
        path = Path(path)
        path.write_text('# test hosts\n' + '\n'.join(lines or self.names) + '\n')
        return path

    def leftovers(self):
        """{namespace: pids} of processes other than sshd itself, on every host and
        in the launcher's namespace."""
        found = {}
        for name in self.names:
            pids = netns_pids(self.ns[name]) - {self.sshd[name].pid}
            if pids:
                found[self.ns[name]] = pids
        pids = netns_pids(self.launcher_ns)
        if pids:
            found[self.launcher_ns] = pids
        return found

    def wait_no_leftovers(self, timeout=10):
        deadline = time.monotonic() + timeout
        while (found := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return found

    # -- a real shaped network -------------------------------------------------
    def shape(self, rate, latency=0.0):
        """Limit every host's outgoing link (its eth0) to ``rate`` bytes/s, with tc.

        A token bucket filter (tbf) with a 64 KB bucket (one GSO packet of a veth)
        and a queue deep enough that TCP is paced rather than dropped; with a
        ``latency`` (seconds), netem does both the delay and the rate instead."""
        for name in self.names:
            if latency:
                qdisc = ['netem', 'delay', f'{latency * 1e6:.0f}us',
                         'rate', f'{rate * 8:.0f}bit', 'limit', '100000']
            else:
                qdisc = ['tbf', 'rate', f'{rate * 8:.0f}bit', 'burst', '64kb',
                         'limit', f'{max(4 << 20, int(rate)):d}']
            subprocess.run(['ip', 'netns', 'exec', self.ns[name], 'tc', 'qdisc', 'replace',
                            'dev', 'eth0', 'root', *qdisc],
                           check=True, capture_output=True, text=True, timeout=30)

    def unshape(self):
        """Remove the shaping: the links are as fast as the machine again."""
        for name in self.names:
            subprocess.run(['ip', 'netns', 'exec', self.ns[name], 'tc', 'qdisc', 'del',
                            'dev', 'eth0', 'root'], capture_output=True, timeout=30)

    # -- a partition ------------------------------------------------------------
    def cut(self, name):
        """Cut a host off the network, as if its cable were pulled: the bridge's end of
        its link goes down (the host keeps its address and routes)."""
        ip('-n', self.launcher_ns, 'link', 'set', f'v-{name}', 'down')

    def mend(self, name):
        """Plug the host back in."""
        ip('-n', self.launcher_ns, 'link', 'set', f'v-{name}', 'up')

    # -- tear-down --------------------------------------------------------------
    def stop(self):
        for p in self.sshd.values():
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
        remove_stale(self.prefix)
        subprocess.run(['rm', '-rf', str(self.dir)], timeout=30)

