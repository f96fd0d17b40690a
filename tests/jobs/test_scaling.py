"""The chapter's law, checked on a simulated network (real jobs through d2l-launch).

With every process's outgoing link paced to 20 MB/s -- slow enough that the pacing,
not the 2 shared cores, sets the time -- and ResNet-18's 62 gradient tensors at 1/16
of their size (2.9 MB), one synchronous step of communication (measured as
benchmarks/scaling.py does: d2ldist/testing/comm_step.py) must follow the book's cost
model (d2ldist/cost.py):

* one parameter server: the time grows with m (the model: (1 + m) S/B);
* as many servers as workers: flat within 25 % (the model: about 2 S/B);
* the ring: from 4 to 8 workers it grows as its model does (2(N-1)/N S/B), within
  25 % (from 2 to 4 the model itself grows by 50 %);
* every measured time within 1.5x of the model's.

The parameter server runs with m = 2 and 4 only (8 workers + 8 servers on 2 cores
start too slowly for a test); benchmarks/scaling.py runs m = 8 as well.
"""
import time

import pytest

from support import run_job
from d2ldist import cost
from d2ldist.kv.placement import DEFAULT_BIGARRAY_BOUND
from d2ldist import config
from d2ldist.testing import comm_step

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]   # the fixture runs all five jobs

BANDWIDTH, SCALE, STEPS = '160Mbit', 16, 3
BOUND = DEFAULT_BIGARRAY_BOUND // SCALE   # the same tensors split over servers as at full size
# (workers, servers, what runs): the ring runs in the jobs that have servers too
JOBS = [(2, 1, 'ps'), (4, 1, 'ps'), (2, 2, 'both'), (4, 4, 'both'), (8, 0, 'ring')]


def step_times(m, n, mode):
    """One job on the simulated network: {method: the slowest worker's median step}."""
    r = run_job(m, n, *comm_step.worker_argv(mode, SCALE, STEPS), job_timeout=90,
                options=('--bandwidth', BANDWIDTH), env=(f'D2L_KVSTORE_BIGARRAY_BOUND={BOUND}',))
    return comm_step.summarize(r.stdout, m, STEPS)


@pytest.fixture(scope='module')
def times():
    """{('ps', m, n) or ('ring', m) or ('gloo', m): (measured seconds, model seconds)}."""
    rate = config.parse_bandwidth(BANDWIDTH)
    shapes = comm_step.resnet18_shapes(SCALE)
    nbytes = 4 * sum(cost.numel(s) for s in shapes)
    out = {}
    for m, n, mode in JOBS:
        t0 = time.time()
        got = step_times(m, n, mode)
        print(f'job {m} workers x {n} servers ({mode}): {time.time() - t0:.1f} s')
        if 'ps' in got:
            out['ps', m, n] = got['ps'], cost.ps_time_placed(shapes, m, n, rate, 0.0, BOUND)
        if 'ring' in got:
            out['ring', m] = got['ring'], cost.ring_time(nbytes, m, rate, 0.0)
            out['gloo', m] = got['gloo'], None
    print('\n'.join(f'{k}: {t * 1e3:.0f} ms' + (f' (model {model * 1e3:.0f} ms)' if model else '')
                    for k, (t, model) in out.items()))
    return out


def test_one_server_grows_with_the_workers(times):
    t2, t4 = times['ps', 2, 1][0], times['ps', 4, 1][0]
    assert 1.35 < t4 / t2 < 2.1, (t2, t4)        # the model: 5/3


def test_as_many_servers_as_workers_stays_flat(times):
    t2, t4 = times['ps', 2, 2][0], times['ps', 4, 4][0]
    assert 0.8 < t4 / t2 < 1.25, (t2, t4)


def test_the_ring_stays_flat(times):
    """From 4 to 8 workers the ring's time grows as its model does (1.75/1.5 = 1.17), not as
    one server's would (9/5): measured over modelled, the two runs agree within 25 %. (The
    bound was t8/t4 < 1.25 until a CI run beside other jobs measured 1.28 -- 1.10 times the
    model's growth: 8 processes on 2 cores pay more CPU per step than 4.)"""
    (t4, model4), (t8, model8) = times['ring', 4], times['ring', 8]
    assert 0.8 < (t8 / model8) / (t4 / model4) < 1.25, (t4, t8)
    assert t8 / t4 < 9 / 5, (t4, t8)


def test_each_time_follows_the_model(times):
    for key, (t, model) in times.items():
        if model is not None:
            assert model / 1.5 < t < 1.5 * model, (key, t, model)


def test_gloo_is_not_shaped(times):
    """gloo has its own sockets: the simulated network does not slow it down."""
    for m in (2, 4, 8):
        assert times['gloo', m][0] < times['ring', m][0] / 2
