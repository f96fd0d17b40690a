"""Checkpoints of sharded training, written by N workers and read back by any number.

``save(state, folder)`` and ``load(state, folder)``, as ``torch.distributed.checkpoint``'s:
``state`` is a dict of modules, optimizers (a torch optimizer, Horovod's
``DistributedOptimizer``, ZeRO's ``ShardedOptimizer``, or a torch optimizer over
``shard_module``'s shards), tensors and plain values (numbers, strings, lists, dicts).
Every worker calls both.

Each tensor is named as if nothing were sharded (``model.0.weight``,
``optimizer.state.model.0.weight.exp_avg``). A worker writes the pieces it holds into its
own file: its shard; of a parameter all workers hold whole, and of its optimizer state, an
even N-th of the elements, the r-th; of a buffer, another tensor or a 0-dim one (Adam's
step), worker 0 all. Worker 0 writes ``manifest.json``: the number of workers, each
piece's owner and range, the plain values. A load cuts the pieces again for its own
layout: any number of workers, any stage. At both, worker 0 prints the SHA-256 of the
whole state in a canonical order (``state_hash.py``). A state with FSDP2's modules is
written in PyTorch's own format instead (``dcp_checkpoint.py``). With no folder, both use
``d2l-launch --checkpoint-dir``: ``save`` into ``step-K``, ``load`` from the newest
finished one (one whose files do not read back whole is passed over, in one line, for the
one before); ``due(step)`` says when.

The layout, and why: docs/design/sharded_checkpoints.md.
"""
import json
import math
import os
import shutil
from pathlib import Path

import torch
from torch import nn

from .. import config
from ..collectives import world
from ..collectives.distributed_optimizer import DistributedOptimizer, initialize_state
from ..collectives.sharded import ShardedOptimizer
from ..collectives.sharded_module import units_of
from ..lines import say
from ..runtime.split import even_slices
from . import dcp_checkpoint
from .checkpoint import (CheckpointError, beyond_kept, read_file, replace_file, step_folders,
                         write_file)
from .state_hash import state_sha256

FORMAT = 1
MANIFEST = 'manifest.json'


class Damaged(CheckpointError):
    """A checkpoint whose manifest or files do not read back whole, found before a load
    touches the state: a load from the newest passes it over."""


class Slot:
    """Elements ``start``..``end`` of the tensor ``key`` (of ``shape``, flattened), held
    here in ``view``; ``written``: by this worker (``Flat.ranges``: who writes what)."""

    def __init__(self, key, shape, start, end, view, written):
        self.key, self.shape, self.start, self.end = key, tuple(shape), start, end
        self.view, self.written = view, written

    def row(self):
        """What the manifest records of it: key, dtype, shape, start, end."""
        return [self.key, dtype_name(self.view.dtype), list(self.shape), self.start, self.end]

    def data(self):
        """Its elements' bytes."""
        return self.view.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


class Flat:
    """Tensors back to back in one flat vector (a ZeRO bucket or unit; or one tensor
    alone, ``whole``: held by each of the ``workers``), of which this worker holds
    elements [start, start + length)."""

    def __init__(self, keys, shapes, start, length, whole, workers=1):
        self.keys, self.shapes = list(keys), [tuple(s) for s in shapes]
        self.start, self.length, self.whole, self.workers = start, length, whole, workers

    @classmethod
    def alone(cls, key, tensor, workers):
        return cls([key], [tensor.shape], 0, tensor.numel(), True, workers)

    def pieces(self):
        """(key, shape, start, end, offset in the part held) of each tensor held here."""
        found, offset = [], 0
        for key, shape in zip(self.keys, self.shapes):
            numel = math.prod(shape)
            lo, hi = max(self.start, offset), min(self.start + self.length, offset + numel)
            if lo < hi:
                found.append((key, shape, lo - offset, hi - offset, lo - self.start))
            offset += numel
        return found

    def ranges(self, n, rank):
        """(start, end, whether this worker writes it) of n elements held here: a shard's,
        one range, this worker's; a tensor all hold whole, n cut evenly, range r worker r's
        (as DCP's dedup spreads replicated items over the ranks), so no one writes it all."""
        if not self.whole:
            return [(0, n, True)]
        return [(a, b, r == rank) for r, (a, b) in enumerate(even_slices(n, self.workers))
                if a < b]

    def slots(self, held, rank, prefix='', suffix=''):
        """The Slots of ``held``: this worker's part of the flat vector, or a state tensor
        shaped like it; anything else (Adam's step) belongs whole to each of its tensors,
        written by worker 0."""
        if held.dim() > 0 and held.numel() == self.length:
            flat = held.view(-1)
            return [Slot(prefix + key + suffix, shape, a + lo, a + hi,
                         flat[at + lo:at + hi], written)
                    for key, shape, a, b, at in self.pieces()
                    for lo, hi, written in self.ranges(b - a, rank)]
        return [Slot(prefix + key + suffix, held.shape, 0, held.numel(), held.view(-1),
                     rank == 0) for key in self.keys]


def dtype_name(dtype):
    return str(dtype).removeprefix('torch.')


def itemsize(name):
    """The bytes of an element of the dtype called ``name`` (a manifest's: checked)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f'unknown dtype {name!r} in a checkpoint')
    return torch.empty(0, dtype=dtype).element_size()


# -- what each kind of entry of the state holds ------------------------------------------
class Part:
    """An entry of the state: the Slots it holds here, its plain values; before a load
    fills its slots, ``prepare``; after, ``restore`` what is not in them."""

    def slots(self):
        return []

    def values(self):
        return {}

    def prepare(self, manifest):
        """(Nothing to make before the slots are filled.)"""

    def restore(self, values):
        """(Nothing but the slots to load.)"""


class ModulePart(Part):
    """A module: each unit of shard_module one Flat (its shard held), every other tensor
    of its state_dict alone (held whole): a parameter, the same on every worker, written
    by all in even parts; a buffer (BatchNorm's statistics: a worker's own, unless
    synchronized), worker 0's. ``flats``: by each parameter, its Flat."""

    def __init__(self, key, module, rank, size):
        self.rank, self.held, self.flats = rank, [], {}
        params = {id(p) for p in module.parameters()}
        for unit in units_of(module):
            k = unit.shard.numel()
            flat = Flat([f'{key}.{n}' for n in unit.names], unit.shapes, rank * k, k, False)
            self.held.append((flat, unit.shard.detach()))
            self.flats[id(unit.shard)] = flat
        for name, t in module.state_dict(keep_vars=True).items():
            if id(t) not in self.flats:
                flat = Flat.alone(f'{key}.{name}', t, size if id(t) in params else 1)
                self.held.append((flat, t.detach()))
                self.flats[id(t)] = flat

    def slots(self):
        return [s for flat, t in self.held for s in flat.slots(t, self.rank)]



class OptimizerPart(Part):
    """An optimizer: each parameter's state tensors cut as the parameter's Flat is (a
    ZeRO bucket's, a unit's, or the parameter alone); its groups' settings as values."""

    def __init__(self, key, optimizer, flats, rank):
        self.key, self.optimizer, self.rank = key, optimizer, rank
        wrapped = isinstance(optimizer, (DistributedOptimizer, ShardedOptimizer))
        self.inner = optimizer.optimizer if wrapped else optimizer
        if isinstance(optimizer, ShardedOptimizer):     # its buckets' shards
            flats = {id(shard): Flat([flat_of(flats, p, key).keys[0] for p in bucket.params],
                                     [p.shape for p in bucket.params],
                                     bucket.shard(optimizer.rank)[0], bucket.shard_numel, False)
                     for bucket, shard in zip(optimizer.buckets, optimizer.shards)}
        self.flats = {id(p): flat_of(flats, p, key) for p in self.params()}

    def params(self):
        return [p for g in self.inner.param_groups for p in g['params']]

    def entries(self):
        """(parameter, its Flat, name, value) of each entry of each parameter's state."""
        return [(p, self.flats[id(p)], name, value) for p in self.params()
                for name, value in self.inner.state.get(p, {}).items()]

    def slots(self):
        return [s for _, flat, name, value in self.entries() if torch.is_tensor(value)
                for s in flat.slots(value.detach(), self.rank, f'{self.key}.state.', f'.{name}')]

    def values(self):
        found = {f'{self.key}.state.{k}.{name}': value
                 for _, flat, name, value in self.entries() if not torch.is_tensor(value)
                 for k in flat.keys}
        found[f'{self.key}.param_groups'] = [
            {**{k: v for k, v in g.items() if k != 'params'},
             'params': sorted(k for p in g['params'] for k in self.flats[id(p)].keys)}
            for g in self.inner.param_groups]
        return found

    def prepare(self, manifest):
        """Before its slots are filled: a state for each parameter the checkpoint holds
        one for (made by a step on zero gradients, then overwritten), none for the others."""
        prefix = f'{self.key}.state.'
        saved = {k[len(prefix):] for k in [*manifest['tensors'], *manifest['values']]
                 if k.startswith(prefix)}
        held = [p for p in self.params() if any(
            s.startswith(f'{k}.') for k in self.flats[id(p)].keys for s in saved)]
        if any(p not in self.inner.state for p in held):
            initialize_state(self.inner, [p for p in self.params() if p.is_floating_point()])
        for p in set(self.params()) - set(held):
            self.inner.state.pop(p, None)

    def restore(self, values):
        """The groups' settings and the state's other values; ZeRO's shards of the weights
        cut again from the weights loaded."""
        key = f'{self.key}.param_groups'
        groups, mine = values.get(key), self.values()[key]
        if groups is None or [g['params'] for g in groups] != [g['params'] for g in mine]:
            raise CheckpointError(f'the checkpoint\'s {self.key} has other parameter groups '
                                  'than this optimizer')
        for group, theirs in zip(self.inner.param_groups, groups):
            for k, v in theirs.items():
                if k != 'params':
                    group[k] = tuple(v) if isinstance(group.get(k), tuple) else v
        for p, flat, name, value in self.entries():
            if not torch.is_tensor(value):
                key = f'{self.key}.state.{flat.keys[0]}.{name}'
                self.inner.state[p][name] = saved(values, key)
        if isinstance(self.optimizer, ShardedOptimizer):
            self.optimizer.refresh_shards()


def flat_of(flats, param, key):
    """A parameter's Flat, from the modules of the state (one line if none holds it)."""
    if id(param) not in flats:
        raise TypeError(f'the parameters of {key} are in no module of the state: save the '
                        'module beside its optimizer')
    return flats[id(param)]


class TensorPart(Part):
    """A tensor of the state: held whole, loaded in place; worker 0's (each worker's may
    differ: a random generator's state, say)."""

    def __init__(self, key, tensor, rank):
        self.flat, self.tensor, self.rank = Flat.alone(key, tensor, 1), tensor, rank

    def slots(self):
        return self.flat.slots(self.tensor.detach(), self.rank)



class ValuePart(Part):
    """A plain value of the state (a number, a string, lists and dicts of them): in the
    manifest; a load puts the saved one in its place in the state."""

    def __init__(self, key, state):
        self.key, self.state = key, state

    def values(self):
        return {self.key: self.state[self.key]}

    def restore(self, values):
        self.state[self.key] = saved(values, self.key)


def saved(values, key):
    """The manifest's value of ``key`` (one line if it has none)."""
    if key not in values:
        raise CheckpointError(f'the checkpoint holds no {key}')
    return values[key]


def parts_of(state, rank, size):
    """A part for each entry of ``state``: the modules first (the optimizers find their
    parameters' names in them), then optimizers, tensors and plain values."""
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise TypeError('a checkpoint\'s state is a dict by names (str): of modules, '
                        'optimizers, tensors and plain values')
    modules = [ModulePart(k, v, rank, size) for k, v in state.items()
               if isinstance(v, nn.Module)]
    flats = {i: flat for m in modules for i, flat in m.flats.items()}
    others = [OptimizerPart(k, v, flats, rank) if isinstance(v, torch.optim.Optimizer)
              else TensorPart(k, v, rank) if torch.is_tensor(v) else ValuePart(k, state)
              for k, v in state.items() if not isinstance(v, nn.Module)]
    return modules + others


def contents(parts):
    """Every Slot the parts hold here, and their values as plain JSON (tuples as lists)."""
    values = {k: v for part in parts for k, v in part.values().items()}
    try:
        values = json.loads(json.dumps(values))
    except (TypeError, ValueError) as e:
        raise TypeError(f'a checkpoint holds modules, optimizers, tensors and plain values '
                        f'(numbers, strings, lists, dicts): {e}') from None
    return [s for part in parts for s in part.slots()], values


# -- among the workers ----------------------------------------------------------------------
def allgather_bytes(data):
    """Every worker's bytes, by rank: the lengths, then the bytes, gathered."""
    backend = world.backend()
    lengths = world.run(backend.allgather, torch.tensor([len(data)])).wait().tolist()
    mine = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data \
        else torch.zeros(0, dtype=torch.uint8)
    everything = world.run(backend.allgather, mine).wait().numpy().tobytes()
    ends = [sum(lengths[:r + 1]) for r in range(len(lengths))]
    return [everything[end - n:end] for n, end in zip(lengths, ends)]


def agree(error, rows=(), kind=CheckpointError):
    """Every worker's rows of the manifest, by rank, once every one has got this far; if
    one failed (``error``: what went wrong there), a ``kind`` of CheckpointError on all."""
    told = [json.loads(b) for b in allgather_bytes(json.dumps([error, list(rows)]).encode())]
    for r, (why, _) in enumerate(told):
        if why is not None:
            raise kind(why if r == world.backend().rank else f'worker {r}: {why}')
    return [rows for _, rows in told]


def digest(mine, values, table):
    """The SHA-256 of the whole state: every worker's pieces gathered (``table``: their
    rows), each tensor whole, by key in sorted order (key, dtype, shape, then its
    bytes), then the values as JSON with sorted keys."""
    whole = {}
    for rows, data in zip(table, allgather_bytes(b''.join(s.data() for s in mine))):
        at = 0
        for key, dtype, shape, start, end in rows:
            size = itemsize(dtype)
            _, _, buffer = whole.setdefault(key, (dtype, shape,
                                                  bytearray(math.prod(shape) * size)))
            buffer[start * size:end * size] = data[at:at + (end - start) * size]
            at += (end - start) * size
    return state_sha256(whole, values)


# -- save and load ---------------------------------------------------------------------------
def save(state: dict, directory: str | os.PathLike | None = None) -> str:
    """Save ``state`` into the folder ``directory``: each worker its own pieces, worker 0
    the manifest, last (FSDP2's modules: in DCP's format). Every worker calls it; each
    gets the SHA-256 of the whole state.

    No ``directory``: into ``step-K`` of ``d2l-launch --checkpoint-dir``, K being
    ``state['step']`` (ValueError if it is not a whole number, or without the option);
    then worker 0 removes the checkpoints older than the newest ``--checkpoint-keep``
    finished ones."""
    if directory is None:
        return save_step(state)
    backend, folder = world.backend(), Path(directory)
    rank, size = backend.rank, backend.size
    if dcp_checkpoint.holds_fsdp2(state):
        return save_dcp(state, folder, rank, size)
    slots, values = contents(parts_of(state, rank, size))
    mine = [s for s in slots if s.written]
    agree(cleared(folder, rank))      # (until its new manifest is written: no checkpoint)
    error = None
    try:
        write_file(folder / shard_file(rank, size),
                   {s.key: s.view.detach().to('cpu', copy=True) for s in mine})
    except OSError as e:
        error = f'checkpoint not saved in {folder}: {e.strerror or e}'
    table = agree(error, [s.row() for s in mine])
    sha = digest(mine, values, table)
    return finished(folder, rank, size, sha,
                    lambda: write_manifest(folder, manifest(table, values, sha)))


def cleared(folder, rank):
    """Worker 0 makes the folder and removes its old manifest; what went wrong, or None."""
    try:
        if rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / MANIFEST).unlink(missing_ok=True)
    except OSError as e:
        return f'checkpoint not saved in {folder}: {e.strerror or e}'
    return None


def save_dcp(state, folder, rank, size):
    """FSDP2's state in DCP's format (``dcp_checkpoint.py``), in save's steps: the old
    manifest gone, every worker's shards (DCP's save), the new manifest, last."""
    agree(cleared(folder, rank))
    dcp_checkpoint.save(state, folder)
    sha = dcp_checkpoint.whole_sha256(state)
    return finished(folder, rank, size, sha,
                    lambda: replace_file(folder / MANIFEST, dcp_checkpoint.manifest(size, sha)))


def finished(folder, rank, size, sha, write):
    """Worker 0 writes the manifest, last, and says so; a failure reaches every worker."""
    error = None
    if rank == 0:
        try:
            write()
        except OSError as e:
            error = f'checkpoint not saved in {folder}: {e.strerror or e}'
        else:
            say(f'checkpoint saved in {folder} by {workers(size)}: state sha256 {sha}')
    agree(error)
    return sha


def workers(n):
    return f'{n} worker' + ('s' if n != 1 else '')


def shard_file(rank, size):
    return f'shard-{rank}-of-{size}.ckpt'


def manifest(table, values, sha):
    """The checkpoint's layout: by each tensor, its dtype, shape and pieces (owner, start,
    end); the files; the values; the SHA-256 of the whole state."""
    tensors = {}
    for owner, rows in enumerate(table):
        for key, dtype, shape, start, end in rows:
            entry = tensors.setdefault(key, {'dtype': dtype, 'shape': shape, 'pieces': []})
            entry['pieces'].append([owner, start, end])
    for entry in tensors.values():
        entry['pieces'].sort(key=lambda piece: piece[1])
    return {'format': FORMAT, 'workers': len(table),
            'files': [shard_file(r, len(table)) for r in range(len(table))],
            'tensors': dict(sorted(tensors.items())), 'values': values, 'sha256': sha}


def write_manifest(folder, layout):
    replace_file(folder / MANIFEST, json.dumps(layout, indent=1).encode())


def read_manifest(folder):
    """The manifest of the checkpoint in ``folder`` (one line if there is none, or another)."""
    try:
        layout = json.loads((folder / MANIFEST).read_text())
    except OSError as e:
        raise CheckpointError(f'{folder} holds no whole checkpoint ({MANIFEST}: '
                              f'{e.strerror})') from None
    except ValueError:
        raise CheckpointError(f'{folder / MANIFEST} is damaged (not JSON)') from None
    if not isinstance(layout, dict) or layout.get('format') != FORMAT:
        raise CheckpointError(f'{folder / MANIFEST} is not a checkpoint of format {FORMAT}')
    if any(Path(name).name != name for name in layout['files']):
        raise CheckpointError(f'{folder / MANIFEST} names files outside its folder')
    return layout


def load(state: dict, directory: str | os.PathLike | None = None) -> str | None:
    """Load the checkpoint in ``directory`` into ``state``: modules, optimizers and
    tensors in place, plain values replaced; cut for this job's workers, however many
    saved it. Every worker calls it; each gets the SHA-256 of the whole state loaded.

    Its files are checked before the state is touched: one damaged (cut short, its
    SHA-256 not matching, a manifest not JSON) is a ``Damaged`` error, the state as it was
    (DCP's files, FSDP2's, are not checked: their damage fails the load in one line).

    No ``directory``: the newest finished checkpoint in ``d2l-launch --checkpoint-dir``
    (``load_newest``; one half written or damaged is passed over); None, with ``state``
    untouched, when there is none, or no ``--checkpoint-dir``: nothing to resume from."""
    if directory is None:
        return load_newest(state)
    backend, folder = world.backend(), Path(directory)
    if dcp_checkpoint.holds_fsdp2(state):
        saved_by, sha = dcp_checkpoint.load(state, folder)
        loaded(folder, saved_by, backend, sha)
        return sha
    layout = checked(folder)
    parts, error = parts_of(state, backend.rank, backend.size), None
    try:
        for part in parts:
            part.prepare(layout)
        slots, _ = contents(parts)
        fill(slots, layout, folder)
        for part in parts:
            part.restore(layout['values'])
    except CheckpointError as e:
        error = str(e)
    slots, values = contents(parts)
    mine = [s for s in slots if s.written]
    sha = digest(mine, values, agree(error, [s.row() for s in mine]))
    for part in parts:              # ZeRO's replicas (--shard-replicas): from their owners
        replica = getattr(getattr(part, 'optimizer', None), 'replica', None)
        if replica is not None:
            replica.fetch()
    loaded(folder, layout['workers'], backend, sha)
    return sha


def load_newest(state):
    """load() from the newest finished checkpoint of --checkpoint-dir; one damaged is
    passed over (worker 0 says which, and why) for the one before it. None when none is
    left: nothing to resume from, as the Trainer's resume() (the state untouched)."""
    folders = finished_folders()
    for i, folder in enumerate(folders):
        try:
            return load(state, folder)
        except Damaged as e:
            if world.backend().rank == 0:
                then = 'loading the one before it' if i + 1 < len(folders) else \
                    'none before it: nothing to resume from'
                say(f'checkpoint {folder} passed over: {e}; {then}', err=True)
    return None


def checked(folder):
    """The manifest in ``folder``, once the workers have read every file back whole
    (worker r of M: files r, r + M, ...); if one did not, Damaged on every worker."""
    backend, layout, error = world.backend(), None, None
    try:
        layout = read_manifest(folder)
        for name in layout['files'][backend.rank::backend.size]:
            read_file(folder / name)
    except CheckpointError as e:
        error = str(e)
    agree(error, kind=Damaged)
    return layout


def loaded(folder, saved_by, backend, sha):
    """Worker 0's line after a load."""
    if backend.rank == 0:
        say(f'checkpoint loaded from {folder} (saved by {workers(saved_by)}) by '
            f'{workers(backend.size)}: state sha256 {sha}')


def fill(slots, layout, folder):
    """Each Slot's elements, copied from the pieces that hold them, file by file (one in
    memory at a time: a tensor all hold whole is in every file, a piece in each)."""
    copies = {}                 # by owner: (slot, lo, hi, the piece's start) to copy
    for slot in slots:
        entry = layout['tensors'].get(slot.key)
        if entry is None:
            raise CheckpointError(f'the checkpoint in {folder} holds no {slot.key}')
        if tuple(entry['shape']) != slot.shape:
            raise CheckpointError(f'{slot.key} is of shape {tuple(entry["shape"])} in '
                                  f'{folder}, and {slot.shape} here')
        found = 0
        for owner, start, end in entry['pieces']:
            lo, hi = max(start, slot.start), min(end, slot.end)
            if lo < hi:
                copies.setdefault(owner, []).append((slot, lo, hi, start))
                found += hi - lo
        if found != slot.end - slot.start:
            raise CheckpointError(f'{folder / MANIFEST}: pieces of {slot.key} are missing')
    for owner, wanted in sorted(copies.items()):
        pieces = read_file(folder / layout['files'][owner])
        for slot, lo, hi, start in wanted:
            piece = pieces.get(slot.key)
            if piece is None:
                raise CheckpointError(f'{layout["files"][owner]} holds no {slot.key}')
            slot.view[lo - slot.start:hi - slot.start].copy_(piece[lo - start:hi - start])


# -- in d2l-launch's folder: --checkpoint-dir, --checkpoint-every, --checkpoint-keep -------
def due(step: int) -> bool:
    """Whether a checkpoint is due after step ``step``: d2l-launch was given
    ``--checkpoint-dir`` and ``step`` is a multiple of ``--checkpoint-every`` (not 0)."""
    cfg = config.get()
    return cfg.checkpoint_dir is not None and step > 0 and step % cfg.checkpoint_every == 0


def save_step(state: dict) -> str:
    """save() into --checkpoint-dir/step-K (K: state['step']); worker 0 then prunes."""
    cfg, step = config.get(), state.get('step') if isinstance(state, dict) else None
    if cfg.checkpoint_dir is None:
        raise ValueError('d2ldist.checkpoint.save(state) with no folder saves into '
                         'd2l-launch --checkpoint-dir DIR, and none was given')
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError("d2ldist.checkpoint.save(state) with no folder saves into step-K, "
                         f"K = state['step'], a whole number >= 0; got {step!r}")
    sha = save(state, Path(cfg.checkpoint_dir) / f'step-{step}')
    if world.backend().rank == 0:
        for _, folder in beyond_kept(step_folders(cfg.checkpoint_dir), finished_in,
                                     cfg.checkpoint_keep):
            try:
                (folder / MANIFEST).unlink(missing_ok=True)    # (no longer whole, then gone)
                shutil.rmtree(folder)
            except OSError as e:
                say(f'old checkpoint {folder} not removed: {e.strerror or e}', err=True)
    return sha


def finished_in(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds a finished checkpoint: its manifest, written last."""
    return (Path(folder) / MANIFEST).is_file()


def newest(directory: str | os.PathLike | None = None) -> Path | None:
    """The newest folder ``step-K`` in ``directory`` (no ``directory``: d2l-launch's
    ``--checkpoint-dir``) that holds a finished checkpoint, as worker 0 sees it, or None.
    Every worker calls it (worker 0 tells the others), so all load the same one."""
    return next(iter(finished_folders(directory)), None)


def finished_folders(directory: str | os.PathLike | None = None) -> list[Path]:
    """The folders ``step-K`` in ``directory`` (none: ``--checkpoint-dir``) that hold a
    finished checkpoint, newest first, as worker 0 sees them (it tells the others)."""
    root = directory if directory is not None else config.get().checkpoint_dir
    if root is None:
        return []
    found = []
    if world.backend().rank == 0:
        found = [str(f) for _, f in step_folders(root) if finished_in(f)]
    return [Path(f) for f in json.loads(allgather_bytes(json.dumps(found).encode())[0])]
