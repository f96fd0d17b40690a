"""Who started a process (runtime/started.py), and the torch backend's choice of NCCL or
gloo from the workers' GPUs (collectives/torch_backend.py), with fake environments and
fake GPUs: the CUDA paths run only where CUDA is."""
import re

import pytest
import torch

from d2ldist import config
from d2ldist.runtime.started import (DEFAULT_PORT, Start, StartError, detect,
                                     expand_nodelist, tasks_per_node)

ALONE = config.Config()                  # no D2L_* variables: not under d2l-launch


def mpirun(rank, size, local_rank, local_size, **more):
    """The variables Open MPI's mpirun gives one process."""
    return dict(OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE=str(size),
                OMPI_COMM_WORLD_LOCAL_RANK=str(local_rank),
                OMPI_COMM_WORLD_LOCAL_SIZE=str(local_size), **more)


def srun(procid, ntasks, localid, nodeid, **more):
    """The variables srun gives one task of a step (SLURM_STEP_ID: not the batch script)."""
    return dict(SLURM_STEP_ID='0', SLURM_PROCID=str(procid), SLURM_NTASKS=str(ntasks),
                SLURM_LOCALID=str(localid), SLURM_NODEID=str(nodeid), **more)


def test_mpirun_on_one_host_meets_at_localhost():
    s = detect(mpirun(1, 2, 1, 2), ALONE)
    assert (s.tool, s.rank, s.size, s.local_rank, s.local_size) == ('mpirun', 1, 2, 1, 2)
    assert s.several and s.who == '2 workers started by mpirun'
    assert s.torchrun_env() == {'RANK': '1', 'WORLD_SIZE': '2', 'LOCAL_RANK': '1',
                                'LOCAL_WORLD_SIZE': '2', 'MASTER_ADDR': '127.0.0.1',
                                'MASTER_PORT': str(DEFAULT_PORT)}


def test_mpirun_on_several_hosts_needs_master_addr():
    """Two hosts of one process each: no address to guess; MASTER_ADDR set: it is used."""
    with pytest.raises(StartError) as e:
        detect(mpirun(0, 2, 0, 1), ALONE).rendezvous()
    assert str(e.value) == ("2 workers started by mpirun, but MASTER_ADDR is not set and "
                            "they are on several hosts: set it to rank 0's host "
                            '(mpirun -x MASTER_ADDR=HOST)')
    s = detect(mpirun(0, 2, 0, 1, MASTER_ADDR='10.0.0.7', MASTER_PORT='6000'), ALONE)
    assert s.rendezvous() == ('10.0.0.7', 6000)


def test_mpich_pmi_without_local_size_needs_master_addr():
    s = detect({'PMI_RANK': '3', 'PMI_SIZE': '4'}, ALONE)
    assert (s.tool, s.rank, s.size, s.local_size) == ('mpiexec (PMI)', 3, 4, 1)
    with pytest.raises(StartError, match='MASTER_ADDR is not set and MPI_LOCALNRANKS is '
                                         'not set'):
        s.rendezvous()
    s = detect({'PMI_RANK': '1', 'PMI_SIZE': '2', 'MPI_LOCALRANKID': '1',
                'MPI_LOCALNRANKS': '2'}, ALONE)
    assert s.rendezvous() == ('127.0.0.1', DEFAULT_PORT) and s.local_rank == 1


def test_srun_meets_at_the_first_host_of_the_step():
    s = detect(srun(5, 6, 1, 2, SLURM_STEP_NODELIST='gpu[07-08],cpu[1-2]',
                    SLURM_JOB_NODELIST='gpu[01-09],cpu[1-4]',
                    SLURM_STEP_TASKS_PER_NODE='2(x3)'), ALONE)
    assert (s.tool, s.rank, s.size, s.local_rank, s.local_size, s.node) == \
        ('srun', 5, 6, 1, 2, 2)
    assert s.rendezvous() == ('gpu07', DEFAULT_PORT)
    assert s.torchrun_env()['GROUP_RANK'] == '2'
    s = detect(srun(0, 2, 0, 0, SLURM_JOB_NODELIST='node[01-04,07]', MASTER_PORT='7000'),
               ALONE)
    assert s.rendezvous() == ('node01', 7000)
    with pytest.raises(StartError, match='neither MASTER_ADDR nor SLURM_JOB_NODELIST'):
        detect(srun(0, 2, 0, 0), ALONE).rendezvous()


def test_a_batch_script_and_a_plain_process_run_alone():
    """The batch script has SLURM_PROCID and SLURM_NTASKS but is one process, not a task
    of srun; run alone, a process meets only itself, on a free port."""
    batch = {'SLURM_PROCID': '0', 'SLURM_NTASKS': '4', 'SLURM_JOB_NODELIST': 'n[1-2]'}
    for env in (batch, {}):
        s = detect(env, ALONE)
        assert s == Start(addr='127.0.0.1', port=0) and not s.several
        assert s.who == '1 worker run alone' and s.rendezvous()[1] > 0


def test_torchrun_and_d2l_launch():
    env = {'RANK': '1', 'WORLD_SIZE': '2', 'LOCAL_RANK': '1', 'LOCAL_WORLD_SIZE': '2',
           'MASTER_ADDR': 'h0', 'MASTER_PORT': '1234', 'TORCHELASTIC_RUN_ID': 'x'}
    s = detect(env, ALONE)
    assert (s.tool, s.rank, s.size, s.rendezvous()) == ('torchrun', 1, 2, ('h0', 1234))
    launched = config.Config.from_env({'D2L_SCHEDULER_URI': '127.0.0.1'})
    s = detect(env, launched)
    assert s.tool == 'd2l-launch' and not s.several   # d2l-launch's job: the ring's too
    with pytest.raises(StartError, match="RANK and WORLD_SIZE, but MASTER_ADDR is not set"):
        detect({'RANK': '0', 'WORLD_SIZE': '2'}, ALONE).rendezvous()


def test_torchrun_wins_over_the_tool_that_started_torchrun():
    """srun (or mpirun) starting torchrun: torchrun's workers carry both; RANK is theirs."""
    env = dict(srun(0, 2, 0, 0, SLURM_JOB_NODELIST='n1'), RANK='3', WORLD_SIZE='4',
               MASTER_ADDR='n1', MASTER_PORT='29400')
    assert detect(env, ALONE).rank == 3
    env = dict(mpirun(1, 2, 1, 2), SLURM_STEP_ID='0', SLURM_PROCID='0', SLURM_NTASKS='1')
    assert detect(env, ALONE).tool == 'mpirun'         # mpirun inside an allocation


@pytest.mark.parametrize('env,message', [
    (mpirun(2, 2, 0, 2), 'OMPI_COMM_WORLD_RANK=2 does not fit OMPI_COMM_WORLD_SIZE=2'),
    (mpirun(0, 2, 0, 2, MASTER_PORT='x'), "MASTER_PORT='x' is not a whole number"),
    (mpirun(0, 2, 0, 2, MASTER_PORT='70000'), 'MASTER_PORT=70000 is not a port'),
    ({'OMPI_COMM_WORLD_SIZE': 'two'}, "OMPI_COMM_WORLD_SIZE='two' is not a whole number"),
    ({'WORLD_SIZE': '2'}, 'RANK is not set'),
    (srun(0, 2, 0, 0, SLURM_JOB_NODELIST='n[1-'), "node list 'n[1-'"),
    (srun(0, 2, 0, 0, SLURM_JOB_NODELIST='n1', SLURM_TASKS_PER_NODE='2(3)'),
     "tasks per node '2(3)'"),
])
def test_bad_values_are_one_line_errors_naming_the_variable(env, message):
    with pytest.raises(StartError, match=re.escape(message)):
        detect(env, ALONE)


def test_slurm_node_lists_and_tasks_per_node():
    assert expand_nodelist('node[01-04,07]') == ['node01', 'node02', 'node03', 'node04',
                                                 'node07']
    assert expand_nodelist('a1,b[9-10],c') == ['a1', 'b9', 'b10', 'c']
    assert expand_nodelist('r[1-2]n[01-02]') == ['r1n01', 'r1n02', 'r2n01', 'r2n02']
    assert expand_nodelist('host-1.example') == ['host-1.example']
    assert tasks_per_node('2(x3),1') == [2, 2, 2, 1] and tasks_per_node('4') == [4]
    for bad in ('n[1-', 'n[a]', 'n[1-2', ''):
        with pytest.raises(ValueError):
            expand_nodelist(bad)


# -- NCCL or gloo: the workers compare their GPUs --------------------------------------
def fake_gpus(monkeypatch, uuids):
    """This process sees the GPUs of these UUIDs (none: no CUDA); returns the list of
    devices it was made to use."""
    class Properties:
        def __init__(self, i):
            self.uuid = uuids[i]
    current = []
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: bool(uuids))
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: len(uuids))
    monkeypatch.setattr(torch.cuda, 'get_device_properties', Properties)
    monkeypatch.setattr(torch.cuda, 'set_device', current.append)
    return current


def test_each_worker_takes_the_gpu_of_its_local_rank(monkeypatch):
    from d2ldist.collectives.torch_backend import my_gpu
    current = fake_gpus(monkeypatch, ['GPU-a', 'GPU-b'])   # two workers see both GPUs
    assert my_gpu(0) == (0, 'GPU-a') and my_gpu(1) == (1, 'GPU-b') and current == [0, 1]
    current = fake_gpus(monkeypatch, ['GPU-c'])            # a task that sees its own only
    assert my_gpu(3) == (0, 'GPU-c') and current == [0]
    current = fake_gpus(monkeypatch, [])
    assert my_gpu(0) == (None, '') and current == []


def test_nccl_where_every_worker_has_its_own_gpu_else_gloo_saying_why():
    from d2ldist.collectives.torch_backend import choose
    assert choose(['GPU-a', 'GPU-b']) == ('nccl', 'each with its own GPU')
    # Slurm's --gpus-per-task: every task sees one GPU, as cuda:0, each a different one
    assert choose(['GPU-a', 'GPU-b', 'GPU-c', 'GPU-d'])[0] == 'nccl'
    assert choose(['GPU-a', 'GPU-a', 'GPU-b']) == (
        'gloo', 'sharing 2 GPUs (NCCL needs one each): tensors go through the CPU')
    assert choose(['GPU-a', 'GPU-a']) == (
        'gloo', 'sharing 1 GPU (NCCL needs one each): tensors go through the CPU')
    assert choose(['', '']) == ('gloo', 'CPU')
    assert choose(['GPU-a', '']) == ('gloo', 'CPU (1 of 2 have no GPU)')


def test_the_workers_exchange_their_gpus_through_the_rendezvous_store():
    """Rank 1 of 3 in a real store, where ranks 0 and 2 have written theirs."""
    import torch.distributed as dist
    from d2ldist.collectives.torch_backend import agree_on_gpus
    store = dist.HashStore()
    store.set('d2ldist/gpu/0/0', 'GPU-a')
    store.set('d2ldist/gpu/0/2', '-')
    assert agree_on_gpus(store, 1, 3, 'GPU-b') == ['GPU-a', 'GPU-b', '']


def test_tasks_that_each_see_their_own_gpu_start_nccl(monkeypatch, use_config, capsys):
    """The whole start of the torch backend, its CUDA path with fakes: rank 0 of 2 tasks
    of srun, each seeing one GPU (a different one), meets the other through the store,
    and both choose NCCL on their cuda:0; rank 0 says so in one line."""
    import torch.distributed as dist
    from d2ldist.collectives.torch_backend import TorchBackend
    use_config({})
    for name in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'MASTER_ADDR',
                 'MASTER_PORT', 'GROUP_RANK', 'OMPI_COMM_WORLD_SIZE', 'PMI_SIZE'):
        monkeypatch.setenv(name, 'x')     # (so that the end of the test unsets them again)
        monkeypatch.delenv(name)
    for name, value in srun(0, 2, 0, 0, SLURM_JOB_NODELIST='gpu[1-2]',
                            SLURM_TASKS_PER_NODE='1(x2)').items():
        monkeypatch.setenv(name, value)
    current = fake_gpus(monkeypatch, ['GPU-a'])
    store = dist.HashStore()
    store.set('d2ldist/gpu/0/1', 'GPU-b')              # the other task's, on gpu2
    started_with = []
    monkeypatch.setattr(dist, 'rendezvous', lambda url, **kw: iter([(store, 0, 2)]))
    monkeypatch.setattr(dist, 'init_process_group',
                        lambda kind, **kw: started_with.append((kind, kw['rank'],
                                                                kw['world_size'])))
    monkeypatch.setattr('atexit.register', lambda fn: None)
    TorchBackend.__new__(TorchBackend)._start()
    assert started_with == [('nccl', 0, 2)] and current == [0]
    assert __import__('os').environ['MASTER_ADDR'] == 'gpu1'
    assert capsys.readouterr().err == ('d2ldist: torch backend (nccl): 2 workers started by '
                                       'srun, each with its own GPU\n')


def test_a_free_port_is_chosen_below_the_kernels_range_for_outgoing_connections():
    """A port from bind(0) comes from the range outgoing connections take theirs from,
    so another program's next connection could take it before the job listens there (a
    fresh-clone CI saw 'Address already in use'); free_port chooses below that range."""
    import socket

    from d2ldist.runtime.started import ephemeral_ports, free_port, port_is_free
    low, _ = ephemeral_ports()
    ports = {free_port() for _ in range(20)}
    assert all(max(1024, low - 10_000) <= p < low and port_is_free(p) for p in ports)
    assert len(ports) > 1                                   # (chosen at random)
    with socket.socket() as s:                              # one taken is not chosen
        s.bind(('127.0.0.1', 0))
        assert not port_is_free(s.getsockname()[1])
