"""The fixtures the tests ask for by name, and pytest's hooks; the helpers the tests
share are in support.py (``from support import ...``)."""
import os
import shutil
import subprocess

import pytest

from d2ldist import config
from d2ldist.testing.slurm_cluster import SlurmCluster
from support import need, need_command


@pytest.fixture(scope='session')
def slurm_cluster():
    """A real Slurm of two nodes (d2ldist/testing/slurm_cluster.py): munged, slurmctld
    and two slurmd, started once for the session and stopped at its end, whatever
    happened; skipped without root or Debian's daemons, failed under CI=true."""
    if os.geteuid() != 0:
        pytest.skip('a Slurm cluster needs root (namespaces, daemons as root)')
    for daemon in ('munged', 'slurmctld', 'slurmd'):
        need(shutil.which(daemon) is not None or os.access(f'/usr/sbin/{daemon}', os.X_OK),
             f"Debian's {daemon}")
    for command in ('srun', 'salloc', 'sinfo', 'squeue', 'scancel', 'nsenter', 'unshare'):
        need_command(command)
    cluster = SlurmCluster()
    try:
        cluster.start()
    except (subprocess.CalledProcessError, RuntimeError) as e:
        need(False, f'a Slurm cluster ({getattr(e, "stderr", None) or e})')
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def write_script(tmp_path):
    """Write a worker script into tmp_path; returns its path."""
    def write(text, name='job.py'):
        path = tmp_path / name
        path.write_text(text)
        return path
    return write


@pytest.fixture
def use_config(monkeypatch):
    """This process's settings, for one test, as some D2L_* variables give them:
    ``use_config({'D2L_ROLE': 'worker'})``; config.get() returns that Config until the end."""
    def use(variables):
        monkeypatch.setattr(config, '_current', config.Config.from_env(variables))
    return use


def pytest_addoption(parser):
    parser.addoption('--docs-screenshot', action='store_true',
                     help="the browser test also saves its picture of the live dashboard "
                          "as docs/dashboard.png, the README's screenshot")
