"""Checkpoint files (whole or refused), the random generators, the data position, and
which checkpoints stay, in one process (training/checkpoint.py)."""
import random

import numpy as np
import pytest
import torch
from torch import nn

import d2ldist
from d2ldist.training import checkpoint
from d2ldist.training.checkpoint import Checkpoint, CheckpointError, read_file, write_file
from d2ldist.training.data import SplitSampler


def test_a_file_reads_back_as_written(tmp_path):
    state = {'w': torch.arange(6.).view(2, 3), 'lr': 0.1, 'pos': (3, [1, 2]), 'name': 'sgd'}
    write_file(tmp_path / 'a.ckpt', state)
    back = read_file(tmp_path / 'a.ckpt')
    assert torch.equal(back['w'], state['w']) and back['lr'] == 0.1
    assert back['pos'] == (3, [1, 2]) and back['name'] == 'sgd'
    assert [p.name for p in tmp_path.iterdir()] == ['a.ckpt']       # no temporary file left


@pytest.mark.parametrize('damage', ['cut', 'flip', 'header', 'empty'])
def test_a_damaged_file_is_refused_in_one_line(tmp_path, damage):
    path = tmp_path / 'a.ckpt'
    write_file(path, {'w': torch.randn(1000)})
    raw = bytearray(path.read_bytes())
    if damage == 'cut':
        raw = raw[:len(raw) // 2]
    elif damage == 'flip':
        raw[-100] ^= 1
    elif damage == 'header':
        raw[:10] = b'not-a-ckpt'
    else:
        raw = bytearray()
    path.write_bytes(raw)
    with pytest.raises(CheckpointError) as e:
        read_file(path)
    assert str(path) in str(e.value) and '\n' not in str(e.value)


def test_nothing_is_unpickled(tmp_path):
    """A file whose hash is right but holds an object: torch.load(weights_only) refuses it."""
    import hashlib
    import io

    class Evil:
        def __reduce__(self):
            return (print, ('unpickled!',))
    buffer = io.BytesIO()
    torch.save({'x': Evil()}, buffer)
    data = buffer.getvalue()
    (tmp_path / 'e.ckpt').write_bytes(
        b'd2ldist-checkpoint %d sha256=%s\n' % (checkpoint.FORMAT, hashlib.sha256(data)
                                               .hexdigest().encode()) + data)
    with pytest.raises(CheckpointError, match='cannot be read'):
        read_file(tmp_path / 'e.ckpt')


def test_a_file_of_another_format_is_refused_in_one_line(tmp_path):
    path = tmp_path / 'old.ckpt'
    write_file(path, {'w': torch.ones(2)})
    path.write_bytes(path.read_bytes().replace(b'checkpoint %d ' % checkpoint.FORMAT,
                                               b'checkpoint 1 ', 1))
    with pytest.raises(CheckpointError, match=f'format 1, and this d2ldist reads format '
                                              f'{checkpoint.FORMAT}'):
        read_file(path)


def test_random_generators_come_back(tmp_path):
    states = checkpoint.rng_states()
    write_file(tmp_path / 'r.ckpt', states)
    first = (torch.rand(3), np.random.rand(3), random.random())
    checkpoint.set_rng_states(read_file(tmp_path / 'r.ckpt'))
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(first[0], again[0]) and (first[1] == again[1]).all()
    assert first[2] == again[2]


def test_the_sampler_skips_the_done_part_of_an_epoch():
    s = SplitSampler(100, num_parts=2, part_index=1, seed=3)
    s.set_epoch(4)
    whole = list(s)
    s.set_epoch(4, skip=20)
    assert list(s) == whole[20:] and len(s) == 30
    with pytest.raises(ValueError, match='skip'):
        s.set_epoch(4, skip=51)


def small_job(tmp_path, every=5, keep=2, compression=None):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    trainer = d2ldist.Trainer(net, 'sgd', {'lr': 0.1, 'momentum': 0.9},
                              compression_params=compression)
    return net, trainer, Checkpoint(tmp_path, trainer, every=every, keep=keep)


def train_steps(net, trainer, ckpt, steps, after=lambda step: None, first=1):
    """Steps ``first`` to ``steps`` on one fixed batch, each offered to the checkpoint;
    then its writes end."""
    X, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    loss = nn.CrossEntropyLoss(reduction='none')
    for step in range(first, steps + 1):
        d2ldist.train_batch(X, y, net, loss, trainer, trainer.devices)
        ckpt.step_done(step, 0, step, {'n': step})
        after(step)
    ckpt.wait()


def test_every_few_steps_and_the_newest_kept(tmp_path):
    net, trainer, ckpt = small_job(tmp_path, every=5, keep=2)
    train_steps(net, trainer, ckpt, 22)
    assert [s for s, _ in ckpt.steps()] == [20, 15] and ckpt.writes == 4
    assert sorted(p.name for p in (tmp_path / 'step-00000020').iterdir()) == ['worker-0-of-1.ckpt']


def test_pruning_keeps_the_newest_complete_and_any_newer_unfinished(tmp_path):
    """The one rule of both kinds of checkpoint folder (the Trainer's and
    d2ldist.checkpoint's): step-K with or without zeros, newest first; what goes."""
    for name in ('step-00000005', 'step-10', 'step-12', 'step-15', 'step-20', 'other'):
        (tmp_path / name).mkdir()
    (tmp_path / 'step-30').write_text('a file, not a folder')
    steps = checkpoint.step_folders(tmp_path)
    assert [(s, f.name) for s, f in steps] == [
        (20, 'step-20'), (15, 'step-15'), (12, 'step-12'), (10, 'step-10'),
        (5, 'step-00000005')]
    complete = {10, 15, 5}                                   # 20 and 12: unfinished
    gone = checkpoint.beyond_kept(steps, lambda f: int(f.name[5:]) in complete, 2)
    assert [s for s, _ in gone] == [5]
    assert checkpoint.beyond_kept(steps, lambda f: int(f.name[5:]) in complete, 1) == \
        [(s, f) for s, f in steps if s < 15]
    assert checkpoint.beyond_kept(steps, lambda f: False, 1) == []
    assert checkpoint.step_folders(tmp_path / 'none yet') == []


def test_resume_restores_weights_and_momenta_and_falls_back_past_a_damaged_file(tmp_path, capsys):
    net, trainer, ckpt = small_job(tmp_path, every=5, keep=3)
    at_5 = {}

    def keep_step_5(step):
        if step == 5:
            at_5['weights'] = {k: v.clone() for k, v in net.state_dict().items()}
            at_5['momenta'] = checkpoint._copy(trainer.optimizer_states())
    train_steps(net, trainer, ckpt, 10, keep_step_5)
    newest = tmp_path / 'step-00000010' / 'worker-0-of-1.ckpt'
    newest.write_bytes(newest.read_bytes()[:-10])              # cut short
    net2, trainer2, ckpt2 = small_job(tmp_path, every=5, keep=3)
    at = ckpt2.resume()
    assert at == {'step': 5, 'epoch': 0, 'batch': 5, 'loop': {'n': 5}}
    assert all(torch.equal(v, at_5['weights'][k]) for k, v in net2.state_dict().items())
    momenta = trainer2.optimizer_states()
    assert momenta['on'] == 'store' and sorted(momenta['states']) == [0, 1, 2, 3, 4, 5]
    assert all(torch.equal(momenta['states'][i]['momentum_buffer'],
                           at_5['momenta']['states'][i]['momentum_buffer'])
               for i in range(6))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and 'step-00000010' in err[0] and 'cut short' in err[0], err


def test_what_2bit_compression_kept_back_comes_back(tmp_path):
    """Without its residuals a resumed job would send other codes: it must go on bit for bit."""
    two_bit = {'type': '2bit', 'threshold': 0.05}
    net, trainer, ckpt = small_job(tmp_path, every=5, keep=3, compression=two_bit)
    train_steps(net, trainer, ckpt, 10)
    assert any(r.abs().sum() > 0 for r in trainer.compression_residuals().values())
    at_10 = {k: v.clone() for k, v in net.state_dict().items()}
    for f in (tmp_path / 'step-00000010').iterdir():
        f.unlink()
    net2, trainer2, ckpt2 = small_job(tmp_path, every=5, keep=3, compression=two_bit)
    assert ckpt2.resume()['step'] == 5
    train_steps(net2, trainer2, ckpt2, 10, first=6)
    assert all(torch.equal(v, at_10[k]) for k, v in net2.state_dict().items())
