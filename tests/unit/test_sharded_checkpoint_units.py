"""d2ldist.checkpoint (training/sharded_checkpoint.py) without processes: the pieces of a
flat vector cut for N workers, written, and cut again for M; every way of training
(Horovod's DistributedOptimizer too) writing the same state; and N workers as threads
(ZeRO's stages 1-3) saving, M loading, the same SHA-256,
and training on to the weights of one process on the whole batch.
tests/jobs/test_sharded_checkpoint.py does it among real workers on the ring."""
import json
import math
import re

import pytest
import torch

import d2ldist
from d2ldist import config
from d2ldist.collectives.distributed_optimizer import DistributedOptimizer
from d2ldist.collectives.sharded_module import full_weights
from d2ldist.training.checkpoint import CheckpointError, read_file, write_file
from d2ldist.training.sharded_checkpoint import Flat, fill, manifest, read_manifest

from test_sharded_units import OPTIMIZERS, in_threads, mlp, zero

SHAPES = {'a': (7, 5), 'b': (7,), 'c': (3, 7), 'd': (3,)}      # 35 + 7 + 21 + 3 = 66


def cut(flat, n, r):
    """Worker r's Flat of the tensors of SHAPES back to back, among n workers."""
    k = -(-flat.numel() // n)
    return Flat(SHAPES, SHAPES.values(), r * k, k, whole=False), \
        torch.cat([flat, flat.new_zeros(n * k - flat.numel())])[r * k:(r + 1) * k]


@pytest.mark.parametrize('n, m', [(3, 2), (2, 3), (4, 1), (1, 5), (3, 3)])
def test_pieces_written_by_n_workers_are_cut_again_for_m(tmp_path, n, m):
    flat = torch.arange(66, dtype=torch.float64)
    table = []
    for r in range(n):
        layout, held = cut(flat, n, r)
        slots = layout.slots(held, r)
        table.append([s.row() for s in slots])
        write_file(tmp_path / f'shard-{r}-of-{n}.ckpt', {s.key: s.view.clone() for s in slots})
    written = manifest(table, {'step': 7}, 'sha')
    (tmp_path / 'manifest.json').write_text(json.dumps(written))
    layout = read_manifest(tmp_path)
    for key, shape in SHAPES.items():     # the pieces tile each tensor, in order
        pieces = layout['tensors'][key]['pieces']
        assert pieces[0][1] == 0 and pieces[-1][2] == math.prod(shape)
        assert all(a[2] == b[1] for a, b in zip(pieces, pieces[1:]))
    again = []
    for r in range(m):
        layout_m, held = cut(torch.full((66,), -1.0, dtype=torch.float64), m, r)
        fill(layout_m.slots(held, r), layout, tmp_path)
        again.append(held)
    assert torch.equal(torch.cat(again)[:66], flat)      # (the padding stays -1: not read)


def test_a_missing_tensor_or_another_shape_is_one_line(tmp_path):
    layout, held = cut(torch.zeros(66), 1, 0)
    write_file(tmp_path / 'shard-0-of-1.ckpt', {s.key: s.view for s in layout.slots(held, 0)})
    (tmp_path / 'manifest.json').write_text(json.dumps(
        manifest([[s.row() for s in layout.slots(held, 0)]], {}, 'sha')))
    other = Flat(['a', 'e'], [(5, 7), (1,)], 0, 36, whole=True)
    with pytest.raises(CheckpointError,
                       match=r'^a is of shape \(7, 5\) in .*, and \(5, 7\) here$'):
        fill(other.slots(torch.zeros(36), 0), read_manifest(tmp_path), tmp_path)
    with pytest.raises(CheckpointError, match=r'holds no e$'):
        fill(Flat.alone('e', torch.zeros(1), 1).slots(torch.zeros(1), 0),
             read_manifest(tmp_path), tmp_path)
    with pytest.raises(CheckpointError, match=r'holds no whole checkpoint \(manifest.json: '):
        read_manifest(tmp_path / 'nothing')


def make(kind, net):
    """(net, optimizer) of a way of training: ZeRO's stages 1-3, or Horovod's."""
    if kind == 'horovod':
        return net, DistributedOptimizer(OPTIMIZERS['adam'](list(net.parameters())))
    return zero(kind, net, OPTIMIZERS['adam'])


def weights(kind, net):
    return full_weights(net) if kind == 3 else dict(net.named_parameters())


def steps(net, opt, r, n, first, last):
    """Global batches first..last-1 of 12 (each from its own seed), worker r's part."""
    for step in range(first, last):
        X = torch.randn(12, 5, generator=torch.Generator().manual_seed(step),
                        dtype=torch.float64)
        opt.zero_grad()
        net(X[r * 12 // n:(r + 1) * 12 // n]).pow(2).mean().backward()
        opt.step()


@pytest.mark.parametrize('kind, n, m', [(1, 3, 2), (2, 3, 2), (2, 2, 3), (3, 3, 2)])
def test_saved_by_n_threads_loaded_by_m_the_same_state_and_training_goes_on(
        tmp_path, monkeypatch, kind, n, m, capsys):
    nets = [mlp() for _ in range(n)]            # (torch's seed is global: not in threads)

    def first(r):
        net, opt = make(kind, nets[r])
        steps(net, opt, r, n, 0, 3)
        return d2ldist.checkpoint.save({'model': net, 'optimizer': opt, 'step': 3}, tmp_path)

    def then(r):
        net, opt = make(kind, mlp(seed=1))          # other weights, no state: all loaded
        state = {'model': net, 'optimizer': opt, 'step': 0}
        sha = d2ldist.checkpoint.load(state, tmp_path)
        steps(net, opt, r, m, state['step'], 5)
        return sha, weights(kind, net)

    saved = in_threads(n, monkeypatch, first)
    loaded = in_threads(m, monkeypatch, then)
    assert len(set(saved)) == 1 and {sha for sha, _ in loaded} == set(saved)
    assert sorted(p.name for p in tmp_path.iterdir()) == \
        ['manifest.json'] + [f'shard-{r}-of-{n}.ckpt' for r in range(n)]
    lines = capsys.readouterr().out.splitlines()
    assert [line.rsplit(' ', 1)[1] for line in lines if 'state sha256' in line] == saved[:1] * 2
    plain = mlp()
    expected = train_steps(plain)
    for _, got in loaded:
        assert all(torch.allclose(got[name], p, rtol=1e-10, atol=1e-13)
                   for (name, _), p in zip(plain.named_parameters(), expected))


def train_steps(net):
    """Adam on the whole global batches 0..4, in one process."""
    opt = OPTIMIZERS['adam'](list(net.parameters()))
    steps(net, opt, 0, 1, 0, 5)
    return [p.detach() for p in net.parameters()]


@pytest.mark.parametrize('kind', ['plain', 2])
@pytest.mark.parametrize('n', [2, 3])
def test_a_tensor_every_worker_holds_whole_is_written_once_in_near_equal_ranges(
        tmp_path, monkeypatch, kind, n):
    """The weights (and under plain Adam, its moments): each worker writes a range of
    each, worker r the r-th, near-equal, every element once; Adam's 0-dim steps worker
    0 alone; the plain values are in the manifest, in no worker's file."""
    nets = [mlp() for _ in range(n)]

    def save(r):
        net, opt = (nets[r], OPTIMIZERS['adam'](list(nets[r].parameters()))) \
            if kind == 'plain' else make(kind, nets[r])
        steps(net, opt, *((0, 1) if kind == 'plain' else (r, n)), 0, 2)   # (the same state)
        d2ldist.checkpoint.save({'model': net, 'optimizer': opt, 'step': 2}, tmp_path)
        return {k: t.detach().clone() for k, t in net.state_dict().items()}

    weights = in_threads(n, monkeypatch, save)[0]
    layout = read_manifest(tmp_path)
    files = [read_file(tmp_path / name) for name in layout['files']]
    whole = [k for k in layout['tensors'] if k.startswith('model.') or
             kind == 'plain' and not k.endswith('.step')]
    assert len(whole) == (12 if kind == 'plain' else 4)
    for key in whole:
        pieces = layout['tensors'][key]['pieces']
        sizes = [end - start for _, start, end in pieces]
        assert [owner for owner, _, _ in pieces] == list(range(n))
        assert all(a[2] == b[1] for a, b in zip(pieces, pieces[1:]))
        assert sum(sizes) == math.prod(layout['tensors'][key]['shape'])
        assert max(sizes) - min(sizes) <= 1
        if key.startswith('model.'):
            assert torch.equal(torch.cat([files[r][key] for r in range(n)]),
                               weights[key.removeprefix('model.')].view(-1))
    steps_ = [k for k in layout['tensors'] if k.endswith('.step')]
    assert len(steps_) == 4 and all(layout['tensors'][k]['pieces'] == [[0, 0, 1]]
                                    for k in steps_)
    assert layout['values']['step'] == 2 and not any('step' in f for f in files)


def test_a_checkpoint_of_the_old_layout_whole_tensors_by_worker_0_still_loads(
        tmp_path, monkeypatch):
    """Before, worker 0 alone wrote a tensor all hold whole (one piece, one owner): the
    manifest says who holds what, so 3 workers load such a checkpoint of 2, as they load
    today's; the SHA-256 is the same for both layouts."""
    nets = [mlp() for _ in range(2)]

    def train(r):
        net, opt = make(2, nets[r])
        steps(net, opt, r, 2, 0, 3)
        return {'model': net, 'optimizer': opt, 'step': 3}

    states = in_threads(2, monkeypatch, train)
    shas = {}
    with monkeypatch.context() as old:           # the old rule: worker 0 writes it all
        old.setattr(Flat, 'ranges', lambda self, n, rank: [(0, n, rank == 0 or not self.whole)])
        shas['old'] = in_threads(2, monkeypatch, lambda r: d2ldist.checkpoint.save(
            states[r], tmp_path / 'old'))
    shas['new'] = in_threads(2, monkeypatch, lambda r: d2ldist.checkpoint.save(
        states[r], tmp_path / 'new'))
    assert shas['old'] == shas['new'] and len(set(shas['old'])) == 1
    pieces = {k: read_manifest(tmp_path / k)['tensors']['model.0.weight']['pieces']
              for k in shas}
    assert pieces == {'old': [[0, 0, 35]], 'new': [[0, 0, 18], [1, 18, 35]]}

    def load(r):
        net, opt = make(1, mlp(seed=1))
        state = {'model': net, 'optimizer': opt, 'step': 0}
        return d2ldist.checkpoint.load(state, tmp_path / 'old'), state['step'], \
            dict(net.named_parameters())

    saved = dict(states[0]['model'].named_parameters())
    for sha, step, got in in_threads(3, monkeypatch, load):
        assert (sha, step) == (shas['old'][0], 3)
        assert all(torch.equal(p, saved[k]) for k, p in got.items())


def test_every_way_of_training_saves_the_same_state(tmp_path):
    """Alone, the same steps: ZeRO's stages, Horovod's and the plain optimizer write the
    same tensors under the same names (their SHA-256 equal): one checkpoint for all; and
    stage 3's loads into stage 2."""
    shas = []
    for i, kind in enumerate(['plain', 1, 2, 3, 'horovod']):
        net = mlp()
        net, opt = (net, OPTIMIZERS['adam'](list(net.parameters()))) if kind == 'plain' \
            else make(kind, net)
        steps(net, opt, 0, 1, 0, 3)
        shas.append(d2ldist.checkpoint.save({'model': net, 'optimizer': opt}, tmp_path / str(i)))
    assert len(set(shas)) == 1
    net, opt = make(2, mlp(seed=1))
    assert d2ldist.checkpoint.load({'model': net, 'optimizer': opt}, tmp_path / '3') == shas[0]


def test_what_cannot_be_saved_or_loaded_is_one_line(tmp_path):
    """An optimizer without its module, a value JSON cannot hold; a load into another
    kind of optimizer; and a parameter without state (unused) stays without."""
    net = torch.nn.ModuleDict({'used': torch.nn.Linear(3, 2), 'unused': torch.nn.Linear(2, 2)})
    adam = torch.optim.Adam(net.parameters(), lr=0.1)
    net['used'](torch.ones(4, 3)).sum().backward()
    adam.step()
    with pytest.raises(TypeError, match='^the parameters of o are in no module of the state'):
        d2ldist.checkpoint.save({'o': adam}, tmp_path)
    with pytest.raises(TypeError, match='^a checkpoint holds modules, .*not JSON serializable$'):
        d2ldist.checkpoint.save({'m': net, 'x': object()}, tmp_path)
    sha = d2ldist.checkpoint.save({'m': net, 'o': adam}, tmp_path)
    again = torch.optim.Adam(net.parameters(), lr=0.5)
    assert d2ldist.checkpoint.load({'m': net, 'o': again}, tmp_path) == sha
    assert len(again.state) == 2 and again.param_groups[0]['lr'] == 0.1
    sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(CheckpointError,
                       match=r'holds no o\.state\.m\.used\.weight\.momentum_buffer$'):
        d2ldist.checkpoint.load({'m': net, 'o': sgd}, tmp_path)


def test_a_folder_worker_0_cannot_make_fails_every_worker_in_one_line(tmp_path, monkeypatch):
    """Worker 0 alone makes the folder: its failure reaches every worker at the same
    agreement, so none waits for a collective the others never call."""
    (tmp_path / 'file').write_text('not a folder')
    nets = [mlp() for _ in range(3)]

    def save(r):
        net, opt = make(2, nets[r])
        try:
            d2ldist.checkpoint.save({'model': net, 'optimizer': opt}, tmp_path / 'file' / 'ckpt')
        except CheckpointError as e:
            return str(e)

    errors = in_threads(3, monkeypatch, save)
    assert errors[0].startswith(f'checkpoint not saved in {tmp_path}/file/ckpt: ')
    assert errors[1:] == [f'worker 0: {errors[0]}'] * 2


# -- with no folder: d2l-launch's --checkpoint-dir, --checkpoint-every, --checkpoint-keep --
def launched(monkeypatch, folder=None, every=100, keep=3):
    """This process as d2l-launch --checkpoint-dir folder starts it (None: without)."""
    monkeypatch.setattr(config, '_current', config.Config(
        checkpoint_dir=None if folder is None else str(folder), checkpoint_every=every,
        checkpoint_keep=keep))


def test_due_every_k_steps_and_only_with_a_checkpoint_dir(monkeypatch):
    launched(monkeypatch, 'ckpt', every=5)
    assert [k for k in range(16) if d2ldist.checkpoint.due(k)] == [5, 10, 15]
    launched(monkeypatch)
    assert not any(d2ldist.checkpoint.due(k) for k in range(16))


def test_saved_into_step_k_the_newest_finished_kept_and_loaded(tmp_path, monkeypatch):
    """Steps 5, 10, 15 saved with --checkpoint-keep 2: 5 goes, and 7 (half written, older
    than the kept) with it; 20, half written and newer, stays, and a load passes it over."""
    launched(monkeypatch, tmp_path, keep=2)
    net, opt = make(2, mlp())
    state, shas = {'model': net, 'optimizer': opt, 'step': 0}, {}
    for step in (5, 10, 15):
        if step == 15:
            for half in ('step-7', 'step-20'):          # a shard file, no manifest
                (tmp_path / half).mkdir()
                write_file(tmp_path / half / 'shard-0-of-1.ckpt', {})
        steps(net, opt, 0, 1, step - 5, step)
        state['step'] = step
        shas[step] = d2ldist.checkpoint.save(state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ['step-10', 'step-15', 'step-20']
    assert d2ldist.checkpoint.newest() == tmp_path / 'step-15'
    again, opt_again = make(2, mlp(seed=1))
    resumed = {'model': again, 'optimizer': opt_again, 'step': 0}
    assert d2ldist.checkpoint.load(resumed) == shas[15] and resumed['step'] == 15


def test_with_nothing_to_resume_from_a_load_is_none_and_the_state_untouched(
        tmp_path, monkeypatch):
    net, opt = make(2, mlp())
    state = {'model': net, 'optimizer': opt, 'step': 0}
    before = {k: p.clone() for k, p in net.named_parameters()}
    for folder in (None, tmp_path / 'none yet', tmp_path):   # (tmp_path: one half written)
        (tmp_path / 'step-3').mkdir(exist_ok=True)
        launched(monkeypatch, folder)
        assert d2ldist.checkpoint.load(state) is None and state['step'] == 0
    assert all(torch.equal(p, before[k]) for k, p in net.named_parameters())


@pytest.mark.parametrize('folder, step, error', [
    (None, 3, r'd2l-launch --checkpoint-dir DIR, and none was given$'),
    ('ckpt', None, r"step-K, K = state\['step'\], a whole number >= 0; got None$"),
    ('ckpt', '3', r"step-K, .* got '3'$"),
    ('ckpt', True, r'step-K, .* got True$'),
    ('ckpt', -1, r'step-K, .* got -1$')])
def test_a_save_with_no_folder_needs_the_dir_and_an_int_step(tmp_path, monkeypatch, folder,
                                                             step, error):
    launched(monkeypatch, folder and tmp_path / folder)
    net = mlp()
    state = {'model': net} if step is None else {'model': net, 'step': step}
    with pytest.raises(ValueError, match=r'^d2ldist\.checkpoint\.save\(state\) with no '
                                         r'folder saves into ' + error):
        d2ldist.checkpoint.save(state)
    assert list(tmp_path.iterdir()) == []


def test_saved_by_2_threads_loaded_by_3_from_the_newest(tmp_path, monkeypatch):
    """Worker 0 names the newest checkpoint; every worker loads that one."""
    launched(monkeypatch, tmp_path)
    nets = [mlp() for _ in range(2)]

    def first(r):
        net, opt = make(2, nets[r])
        steps(net, opt, r, 2, 0, 3)
        return d2ldist.checkpoint.save({'model': net, 'optimizer': opt, 'step': 3})

    def then(r):
        net, opt = make(1, mlp(seed=1))
        state = {'model': net, 'optimizer': opt, 'step': 0}
        return d2ldist.checkpoint.load(state), state['step']

    saved = in_threads(2, monkeypatch, first)
    assert in_threads(3, monkeypatch, then) == [(saved[0], 3)] * 3


# -- a damaged newest checkpoint: passed over, as the Trainer's are ----------------------------
def damage(folder, how):
    """Damage a finished checkpoint: worker 1's file's bytes flipped, or cut short, or the
    manifest no longer JSON."""
    if how == 'manifest':
        (folder / 'manifest.json').write_text('{"format": 1, "work')
        return
    file = folder / 'shard-1-of-2.ckpt'
    raw = bytearray(file.read_bytes())
    if how == 'flip':
        raw[len(raw) // 2] ^= 0xFF
    file.write_bytes(raw if how == 'flip' else raw[:len(raw) // 2])


def saved_twice(tmp_path, monkeypatch):
    """2 workers (ZeRO stage 2) save step-3 and step-6 into --checkpoint-dir; their SHA-256."""
    launched(monkeypatch, tmp_path)
    nets = [mlp() for _ in range(2)]

    def save(r):
        net, opt = make(2, nets[r])
        state, shas = {'model': net, 'optimizer': opt, 'step': 0}, {}
        for step in (3, 6):
            steps(net, opt, r, 2, step - 3, step)
            state['step'] = step
            shas[step] = d2ldist.checkpoint.save(state)
        return shas
    return in_threads(2, monkeypatch, save)[0]


def loading(tmp_path, monkeypatch, trained=False, folder=None):
    """2 workers load (from ``folder``, or the newest) into a state of their own: fresh
    (no optimizer state), or ``trained`` (6 steps of other weights: Adam's state for every
    parameter, another step). Each worker's (result or error line, state, whether its
    tensors are the same objects after as before)."""
    nets = [mlp(seed=1) for _ in range(2)]       # (torch's seed is global: not in threads)

    def load(r):
        net, opt = make(2, nets[r])
        if trained:
            steps(net, opt, r, 2, 10, 16)
        state = {'model': net, 'optimizer': opt, 'step': 16 if trained else 0}
        tensors = [*net.parameters(), *opt.shards]
        try:
            got = d2ldist.checkpoint.load(state, folder)
        except CheckpointError as e:
            got = str(e)
        return got, state, all(a is b for a, b in zip(tensors, [*net.parameters(),
                                                                *opt.shards]))
    return in_threads(2, monkeypatch, load)


@pytest.mark.parametrize('how, why', [
    ('flip', r'worker 1: .*/step-6/shard-1-of-2\.ckpt is damaged or cut short \(its SHA-256 '
             r'does not match\)'),
    ('cut', r'worker 1: .*/step-6/shard-1-of-2\.ckpt is damaged or cut short .*'),
    ('manifest', r'.*/step-6/manifest\.json is damaged \(not JSON\)')])
@pytest.mark.parametrize('trained', [False, True])
def test_a_damaged_newest_is_passed_over_in_one_line_and_the_one_before_loaded(
        tmp_path, monkeypatch, capsys, how, why, trained):
    """Every worker passes over step-6 together (worker 0 says why, once) and loads step-3:
    its SHA-256, whatever the state held before (a trained one: every tensor overwritten
    in place, the step replaced)."""
    shas = saved_twice(tmp_path, monkeypatch)
    damage(tmp_path / 'step-6', how)
    capsys.readouterr()
    got = loading(tmp_path, monkeypatch, trained)
    assert [(sha, state['step'], same) for sha, state, same in got] == [(shas[3], 3, True)] * 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and re.fullmatch(
        rf'd2ldist: checkpoint {tmp_path}/step-6 passed over: {why}; loading the one '
        r'before it', err[0]), err


def test_with_every_checkpoint_damaged_nothing_to_resume_from_the_state_untouched(
        tmp_path, monkeypatch, capsys):
    """As the Trainer's resume(): None, the state as it was (no optimizer state made)."""
    saved_twice(tmp_path, monkeypatch)
    damage(tmp_path / 'step-6', 'flip')
    damage(tmp_path / 'step-3', 'cut')
    capsys.readouterr()
    got = loading(tmp_path, monkeypatch)
    fresh = [dict(mlp(seed=1).named_parameters()) for _ in range(2)]
    for (sha, state, _), weights in zip(got, fresh):
        assert sha is None and state['step'] == 0 and not state['optimizer'].optimizer.state
        assert all(torch.equal(p, weights[k]) for k, p in state['model'].named_parameters())
    err = capsys.readouterr().err.splitlines()
    assert [line.split(' passed over: ')[0] for line in err] == \
        [f'd2ldist: checkpoint {tmp_path}/step-{k}' for k in (6, 3)]
    assert err[1].endswith('; none before it: nothing to resume from')


def test_a_damaged_folder_named_fails_on_every_worker_in_one_line_the_state_untouched(
        tmp_path, monkeypatch):
    """The user named it: no other is tried."""
    saved_twice(tmp_path, monkeypatch)
    damage(tmp_path / 'step-6', 'flip')
    got = loading(tmp_path, monkeypatch, folder=tmp_path / 'step-6')
    line = f'{tmp_path}/step-6/shard-1-of-2.ckpt is damaged or cut short (its SHA-256 ' \
           'does not match)'
    assert [error for error, _, _ in got] == [f'worker 1: {line}', line]
    assert [(s['step'], len(s['optimizer'].optimizer.state)) for _, s, _ in got] == \
        [(0, 0)] * 2
