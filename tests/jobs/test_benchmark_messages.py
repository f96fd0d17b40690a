"""benchmarks/messages.py runs and prints what it says it measures (no time is checked here:
the figures are the benchmark's to print, not a test's to bound)."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROWS = ['floor', 'floor + poll', 'ring, here', 'ring, allreduce_', 'gloo']

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize('path', ['van', 'stream'])
def test_the_table_has_every_row_and_the_floor_is_the_unit(path):
    out = subprocess.run([sys.executable, 'benchmarks/messages.py', '--path', path,
                          '--seconds', '0.05'], cwd=ROOT, capture_output=True, text=True,
                         timeout=110)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    lines = out.stdout.splitlines()
    title = [line for line in lines if line.startswith('# 4096 B all-reduced by 2 workers')]
    assert len(title) == 1 and ('TCP streams' in title[0]) == (path == 'stream')
    rows = {}
    for line in lines:
        for name in ROWS:
            if line.startswith(name) and line[len(name):][:1] == ' ' \
                    and line[len(name):].split()[0].replace('.', '').isdigit():
                rows[name] = line[len(name):].split()
    assert sorted(rows) == sorted(ROWS)
    assert rows['floor'][-1] == '1.0'                       # the unit of the last column
    assert all(float(cells[0]) > 0 and float(cells[1]) > 0 for cells in rows.values())
    # Python functions per message: a plain socket needs a few, the ring's message many more
    assert int(rows['floor'][2]) < 20 < int(rows['ring, here'][2])
    assert rows['ring, allreduce_'][2] == '-'               # (its work is on another thread)
