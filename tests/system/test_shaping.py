"""Does the simulated network predict a real shaped one? Linux tc against the van's pacing.

Three hosts (network namespaces with sshd, ``d2ldist/testing/netns_hosts.py``, on their
own subnet 198.18.9.0/24 so that they do not meet test_ssh's), a job across them with the
ssh launcher: one parameter server on hostB, workers on hostC and hostA, so that every
byte of the parameter server and of the ring crosses a host's link. The same job
runs twice in this test:

1. real: every host's outgoing link (eth0) shaped by ``tc`` (tbf), no pacing;
2. simulated: the links unshaped, ``d2l-launch --bandwidth`` pacing the van.

The time of a parameter-server step and of a ring all-reduce must agree within 25 %
(TCP/IP headers alone make the real link about 4.5 % slower: 66 bytes per 1448).
"""
import pytest

from support import ROOT, hosts_for_tests, run_job
from d2ldist import cost
from d2ldist.kv.placement import DEFAULT_BIGARRAY_BOUND
from d2ldist.testing import comm_step

pytestmark = pytest.mark.timeout(240)

RATE, SCALE, STEPS = 20e6, 16, 3  # bytes/s on every link; ResNet-18 / 16: 2.9 MB
BOUND = DEFAULT_BIGARRAY_BOUND // SCALE   # the same tensors split over servers as at full size


@pytest.fixture(scope='module')
def hosts():
    yield from hosts_for_tests(('hostA', 'hostB', 'hostC'), ('ip', 'tc', 'ssh', 'ssh-keygen'),
                               'tc and network namespaces need root',
                               prefix='d2lnet', subnet='198.18.9')


def step_times(hosts, *options):
    """The scaling study's step (comm_step) on 2 workers and 1 server across the hosts."""
    r = run_job(2, 1, *comm_step.worker_argv('both', SCALE, STEPS), timeout=180, job_timeout=120,
                options=('--launcher', 'ssh', '-H', 'hostA,hostB,hostC',
                         '--ssh-config', hosts.ssh_config, '--connect-timeout', '5', *options),
                env=(f'D2L_KVSTORE_BIGARRAY_BOUND={BOUND}',),
                where=('ip', 'netns', 'exec', hosts.launcher_ns),
                run_env={'PYTHONPATH': str(ROOT)})
    assert 'server     0     hostB' in r.stdout          # the placement we rely on
    return comm_step.summarize(r.stdout, 2, STEPS)


def test_software_pacing_predicts_a_tc_shaped_link(hosts):
    try:
        hosts.shape(RATE)
        real = step_times(hosts)
    finally:
        hosts.unshape()
    simulated = step_times(hosts, '--bandwidth', f'{RATE * 8:.0f}bit')
    shapes = comm_step.resnet18_shapes(SCALE)
    nbytes = 4 * sum(cost.numel(s) for s in shapes)
    model = {'ps': cost.ps_time_placed(shapes, 2, 1, RATE, 0, BOUND),
             'ring': cost.ring_time(nbytes, 2, RATE, 0)}
    print()
    for method in ('ps', 'ring', 'gloo'):
        print(f'{method:>5}: tc {real[method] * 1e3:6.0f} ms   pacing '
              f'{simulated[method] * 1e3:6.0f} ms   tc/pacing '
              f'{real[method] / simulated[method]:.2f}' +
              (f'   model {model[method] * 1e3:.0f} ms' if method in model else ''))
    for method in ('ps', 'ring'):
        assert 0.8 < real[method] / simulated[method] < 1.25, (method, real, simulated)
    # gloo is not paced by the van, but tc shapes its sockets too
    assert real['gloo'] > 0.5 * model['ring'] > simulated['gloo']
