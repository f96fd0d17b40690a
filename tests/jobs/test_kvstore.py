"""The parameter server in real jobs: d2l-launch starts scheduler, servers and workers.

Each job combines several checks (every process pays ~2 s of torch imports); the worker
scripts are in ``kv_jobs.py`` and print JSON lines that the tests read.
"""
import json
import re
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv_jobs  # noqa: E402
from support import kill_tagged, run_job, start_launch, wait_no_survivors  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def lines(stdout, tag):
    """The JSON values the workers printed after ``tag``, by rank."""
    found = {}
    for line in stdout.splitlines():
        m = re.match(r'\[worker (\d+)\] ' + tag + r' (.*)$', line)
        if m:
            found[int(m.group(1))] = json.loads(m.group(2))
    return found


# 'tcp': big frames through sockets, as between hosts; the servers' answers then come on
# the streams the workers offer them (M.LINK) and are read straight into ``out``
PATHS = pytest.mark.parametrize('path', [(), ('D2L_SHM=0',)], ids=['shm', 'tcp'])


@PATHS
def test_sync_3x2_sums_placement_errors_optimizers(write_script, tmp_path, path):
    out = run_job(3, 2, sys.executable, write_script(kv_jobs.SYNC),
                  env=(f'KV_TMP={tmp_path}', *path)).stdout
    sums = lines(out, 'SUMS')
    assert sorted(sums) == [0, 1, 2]
    for v in sums.values():   # 1 + 2 + 3 from the workers, exactly
        assert v['small'] == 6.0 and v['big'] == [6.0, 6.0] and v['copies'] == 36.0
        assert v['int_key'] == [0.0, 6.0, 12.0, 18.0, 24.0]

    held = lines(out, 'HELD')[0]
    servers = held['held']
    assert sorted(servers) == ['server:0', 'server:1']
    slices = sorted(h['big'] for h in servers.values())          # split across both servers
    assert slices == [[0, 500001], [500001, 1000001]]            # the first one longer
    on = [srv for srv, h in servers.items() if 'small' in h]       # a small key lives on one
    assert on == [f'server:{held["expected_small"]}'] and servers[on[0]]['small'] == [0, 6]

    errors = lines(out, 'ERRORS')[0]
    assert "'never'" in errors['uninitialised'] and 'never initialised' in errors['uninitialised']
    assert "key 'small'" in errors['shape'] and 'float32[3, 2]' in errors['shape'] \
        and 'float32[2, 3]' in errors['shape']
    assert 'float64[2, 3]' in errors['dtype'] and 'float32[2, 3]' in errors['dtype']
    assert 'float32[7]' in errors['pull_size'] and 'float32[2, 3]' in errors['pull_size']
    assert 'float32[5]' in errors['server_0'] and 'float32[2, 3]' in errors['server_0']
    assert "'ghost'" in errors['server_1'] and 'never initialised' in errors['server_1']
    assert 'frame' in errors['server_2']
    assert 'int64[2, 3]' in errors['server_3'] and 'float32[2, 3]' in errors['server_3']
    assert 'malformed' in errors['server_4']

    optim = lines(out, 'OPTIM')
    assert sorted(optim) == [0, 1, 2]
    for v in optim.values():
        assert v['sgd'] < 1e-6 and v['adam'] < 1e-6, v
        assert v['optimizer'] == ['adam']
    assert (tmp_path / 'adam.states').exists()


def test_sync_4x1_and_device_sums(write_script):
    out = run_job(4, 1, sys.executable, write_script(kv_jobs.SUMS),
                  env=('KV_KIND=dist_sync_device',)).stdout
    sums = lines(out, 'SUMS4')
    assert sorted(sums) == [0, 1, 2, 3]
    for v in sums.values():   # 1 + 2 + 3 + 4 + 4 * step 2
        assert v['last'] == 18.0 and v['servers'] == 1 and v['keys_held'] == 21


@PATHS
def test_async_slow_worker_does_not_slow_fast_one(write_script, path):
    out = run_job(2, 1, sys.executable, write_script(kv_jobs.ASYNC), env=path).stdout
    pushes = {r: v['pushes'] for r, v in lines(out, 'PUSHES').items()}
    assert pushes[1] <= 13 and pushes[0] > 4 * pushes[1], pushes
    total = lines(out, 'TOTAL')
    for v in total.values():   # every push of ones was added, none lost or torn
        assert v['value'] == pushes[0] + pushes[1] and v['all_equal']


@pytest.mark.parametrize('who,how', [('worker', 'kill'), ('server', 'kill'), ('worker', 'stop')])
def test_dead_node_stops_sync_job(write_script, who, how):
    script = write_script(kv_jobs.DEATH)
    p = start_launch('-n', 3, '-s', 2, '--timeout', 100, '--env', f'WHO={who}',
                     '--env', f'HOW={how}', sys.executable, script)
    try:
        out, _ = p.communicate(timeout=120)
        ended = time.time()
    finally:
        if p.poll() is None:
            p.kill()
            kill_tagged(p.tag)
    assert p.returncode not in (0, 124), out[-3000:]
    m = re.search(r'DYING (\S+) ([\d.]+)', out)
    assert m, out[-3000:]
    victim, died = m.group(1).replace(':', ' '), float(m.group(2))
    assert ended - died < 10, f'the job took {ended - died:.1f} s to stop'
    assert victim in out.split('DYING', 1)[1].replace(':', ' ').split('\n', 1)[1], out[-3000:]
    assert re.search(rf'{victim}.*failed|failed.*{victim}', out), out[-3000:]
    assert wait_no_survivors(p.tag) == []


def test_sparse_rows_through_the_servers(write_script):
    """Sparse pushes (rows only, one row straddling two servers) are summed exactly,
    updated lazily (only touched rows, weight decay included), row_sparse_pull fills
    only the rows asked for, and the bytes sent follow the rows, not the table."""
    out = run_job(2, 2, sys.executable, write_script(kv_jobs.SPARSE),
                  env=('D2L_KVSTORE_BIGARRAY_BOUND=10',)).stdout
    got = lines(out, 'SPARSE')
    assert sorted(got) == [0, 1]
    pushed = {1: 1.0, 3: 1.0 + 2.0, 5: 2.0}            # rows of worker 0 (x1) and 1 (x2)
    summed = [[pushed.get(i, 0.0)] * 3 for i in range(7)]
    for rank, v in got.items():
        assert v['summed'] == summed
        # lazy SGD from the sum (rows 1, 3, 5): w - 0.5 * (g + 0.5 * w); rows 0, 2, 4, 6
        # keep the sum they held (no decay on them); pushpull brings back the rows this
        # worker pushed (worker 0: 1 and 3, worker 1: 3 and 5), the others stay in out
        for i in range(7):
            if i in ({0: (1, 3), 1: (3, 5)}[rank]):
                expect = [s - 0.5 * (pushed[i] + 0.5 * s) for s in summed[i]]
                assert v['w'][i] == expect, (i, v['w'][i], expect)
            else:
                assert v['w'][i] == [0.0] * 3                       # out untouched
        assert v['out'][3] == v['w'][3] and v['out'][6] == [0.0] * 3   # row 6: the sum 0
        assert all(v['out'][i] == [-1.0] * 3 for i in (0, 1, 2, 4, 5))
        assert v['sent'] == 2 * 8 + 2 * 16 * 4                         # ids + values
        assert v['broadcast'] == [7.0] * 4                              # rank 0's value
        # the store runs sgd (lr 0.5, wd 0.5) for every key now: 7 - 0.5 * (3 + 3.5)
        assert v['in_place'] == [7 - 0.5 * (3 + 0.5 * 7)] * 4
        assert v['sent'] < 10000 * 16 * 4 / 1000
        # sgd (lr 0.5, wd 0.5) from 0: row 0 after step 1 (1 + 2); row 6 after steps 1 (2)
        # and 2 (1 + 2), each round closed by both workers' pushes
        assert v['one_server'] == [-1.5, 0, 0, 0, 0, 0, -1.0 - 0.5 * (3 - 0.5)]
