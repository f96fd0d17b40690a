"""Checkpoints of a whole job, and resuming from the newest: what a restart needs.

Every ``every`` steps, at the step boundary, each worker saves what only it knows (its
place in the data, its random generators, its loop's sums, ...) and worker 0 also what
all workers share (the weights, the servers' optimizer states), into
``DIR/step-00000120/worker-R-of-N.ckpt``. A job resumes from the newest checkpoint that
every worker holds whole, agreed through the store; in ``dist_sync`` and on the ring it
then goes on bit for bit. A thread writes each snapshot while training goes on, each
file whole or not at all, with the SHA-256 of its bytes; a write that fails (a full
disk) is one warning line, and training goes on.

One more limit: a DataLoader with worker processes (``num_workers > 0``, d2ldist's
loaders use none by default) seeds them afresh each epoch, so random augmentation after
a resume differs from the uninterrupted run's; the weights then do too.

What each file holds, why one step, and how a file is written:
docs/design/checkpoints.md; how to use them: docs/checkpoints.md.
"""
import hashlib
import io
import os
import random
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from .. import config
from ..lines import say
from ..report import report
from ..runtime import spans
from .trainer import Trainer

FORMAT = 2        # what a file holds (1: before every worker kept its learning rate)
HEADER = re.compile(rb'd2ldist-checkpoint (\d+) sha256=([0-9a-f]{64})')


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: one line says which file, and why."""


def write_file(path, state):
    """Save ``state`` (tensors and numbers) whole or not at all: a temporary file, fsync,
    rename. Its first line is the SHA-256 of the rest."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getbuffer()
    digest = hashlib.sha256(data).hexdigest().encode()
    replace_file(path, b'd2ldist-checkpoint %d sha256=%s\n' % (FORMAT, digest), data)


def replace_file(path, *data):
    """Write the bytes ``data`` into ``path``, whole or not at all: a temporary file,
    fsync, rename, and the folder's fsync."""
    tmp = path.with_name(f'{path.name}.tmp{os.getpid()}')
    try:
        with open(tmp, 'wb') as f:
            for part in data:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    folder = os.open(path.parent, os.O_RDONLY)   # the rename itself must reach the disk
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def read_file(path):
    """The state in a file of write_file, if it reads back whole (else CheckpointError)."""
    try:
        header, _, data = path.read_bytes().partition(b'\n')
    except OSError as e:
        raise CheckpointError(f'{path}: {e.strerror}') from None
    match = HEADER.fullmatch(header)
    if match is None:
        raise CheckpointError(f'{path} is not a d2ldist checkpoint')
    if int(match.group(1)) != FORMAT:
        raise CheckpointError(f'{path} is a checkpoint of format {int(match.group(1))}, and '
                              f'this d2ldist reads format {FORMAT}')
    if hashlib.sha256(data).hexdigest().encode() != match.group(2):
        raise CheckpointError(f'{path} is damaged or cut short (its SHA-256 does not match)')
    try:
        return torch.load(io.BytesIO(data), weights_only=True)   # tensors and numbers only
    except Exception as e:                                     # (whatever torch says)
        raise CheckpointError(f'{path} cannot be read: {e}'.splitlines()[0]) from None


def rng_states():
    """This process's random generators (torch, numpy, random), as tensors and numbers."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    states = {'torch': torch.get_rng_state(), 'random': random.getstate(),
              'numpy': (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states['cuda'] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states):
    """Put the generators back where rng_states() found them."""
    torch.set_rng_state(states['torch'])
    random.setstate(states['random'])
    kind, keys, pos, has_gauss, gauss = states['numpy']
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if 'cuda' in states:
        torch.cuda.set_rng_state_all(states['cuda'])


def step_folders(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """The (step, folder) of each checkpoint folder ``step-K`` in ``directory``, newest
    first (K with or without leading zeros); none if there is no such folder."""
    try:
        found = [(int(m.group(1)), p) for p in Path(directory).iterdir()
                 if (m := re.fullmatch(r'step-(\d+)', p.name)) and p.is_dir()]
    except FileNotFoundError:
        return []
    return sorted(found, reverse=True)


def beyond_kept(steps: list[tuple[int, Path]], complete: Callable[[Path], bool],
                keep: int) -> list[tuple[int, Path]]:
    """Of ``steps`` (step, folder), newest first, those older than the newest ``keep``
    that are ``complete(folder)``: what pruning removes (nothing while fewer are)."""
    done = [step for step, folder in steps if complete(folder)]
    if len(done) < keep:
        return []
    return [(step, folder) for step, folder in steps if step < done[keep - 1]]


def _copy(state):
    """A copy on the CPU of a nest of dicts, lists and tensors (the snapshot)."""
    if isinstance(state, torch.Tensor):
        return state.detach().to('cpu', copy=True)
    if isinstance(state, dict):
        return {k: _copy(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_copy(v) for v in state)
    return state


class Checkpoint:
    """Save this worker's part of the job every ``every`` steps into ``directory``;
    resume() from the newest complete checkpoint. ``d2ldist.train`` uses one when
    D2L_CHECKPOINT_DIR is set (``d2l-launch --checkpoint-dir``)."""

    def __init__(self, directory: str | Path, trainer: Trainer, every: int = 100,
                 keep: int = 3) -> None:
        self.dir, self.trainer, self.every, self.keep = Path(directory), trainer, every, keep
        store, cfg = trainer.store, config.get()
        if store.num_workers > 1:      # the workers share a store (also under torchrun)
            self.rank, self.num_workers = store.rank, store.num_workers
        else:                          # alone, or each worker of a job on its own store
            self.rank, self.num_workers = cfg.rank or 0, cfg.num_worker or 1
        # Rank 0 saves what the workers share; a worker that trains alone (kvstore
        # 'local' in a job), saves and reads its own.
        self.source = 0 if store.num_workers > 1 else self.rank
        self.writes = 0          # files written
        # seconds: in the steps; on the thread, and its CPU time (taken from training
        # where the CPU is what limits it)
        self.seconds = {'snapshot': 0.0, 'write': 0.0, 'write cpu': 0.0}
        self._writer = None      # the thread writing the last snapshot
        self._rng = None         # a resumed worker's generators, until its epoch starts
        self._gathers = 0        # the store's keys it made to gather the workers' steps
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f'checkpoint folder {self.dir}: {e.strerror}') from None

    @classmethod
    def from_config(cls, trainer: Trainer) -> 'Checkpoint | None':
        """The Checkpoint D2L_CHECKPOINT_* ask for, or None (unset)."""
        cfg = config.get()
        if cfg.checkpoint_dir is None:
            return None
        return cls(cfg.checkpoint_dir, trainer, cfg.checkpoint_every, cfg.checkpoint_keep)

    # -- saving ------------------------------------------------------------------------
    def step_done(self, step: int, epoch: int, batch: int, loop: dict) -> None:
        """After step ``step`` (batch ``batch`` of ``epoch`` done): every ``every`` steps,
        snapshot this worker's state in memory and write it on a thread."""
        if step % self.every == 0:
            start = time.perf_counter()
            self.wait()                       # (the write before must have ended)
            state = self.snapshot(step, epoch, batch, loop)
            self.seconds['snapshot'] += time.perf_counter() - start
            self._writer = threading.Thread(target=self._write, args=(step, state),
                                            name='d2ldist-checkpoint')
            self._writer.start()

    def snapshot(self, step: int, epoch: int, batch: int, loop: dict) -> dict:
        """This worker's state at the step boundary, copied (training goes on meanwhile)."""
        t = self.trainer
        state = {'step': step, 'epoch': epoch, 'batch': batch, 'loop': dict(loop),
                 'rng': rng_states(), 'lr': t.learning_rate,
                 'residuals': t.compression_residuals()}
        if self.rank == self.source:
            state['model'] = t.replicas[0].state_dict()
        else:       # (the store shares the weights, not every buffer: BatchNorm's counts)
            state['model'] = dict(t.replicas[0].named_buffers())
        if self.rank == self.source or not t.update_on_kvstore:
            state['optimizer'] = t.optimizer_states()   # (the servers': one request)
        return _copy(state)

    def _write(self, step, state):
        folder, start, cpu = self.dir / f'step-{step:08d}', time.perf_counter(), time.thread_time()
        try:
            folder.mkdir(exist_ok=True)
            write_file(self.file(folder, self.rank), state)
        except OSError as e:
            say(f'checkpoint of step {step} not written: {e.strerror or e}', err=True)
            return
        finally:
            self.seconds['write'] += time.perf_counter() - start
            self.seconds['write cpu'] += time.thread_time() - cpu
        self.writes += 1
        self.prune()

    def wait(self) -> None:
        """Until the last snapshot is on disk (or has failed to get there)."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None

    def prune(self) -> None:
        """Keep the newest ``keep`` complete checkpoints, and any newer still being
        written: remove this worker's files of the older ones. (A worker that sees no
        other worker's file, on its own disk, counts its own files.)"""
        steps = self.steps()
        shared = any(self.file(folder, r).exists() for _, folder in steps
                     for r in range(self.num_workers) if r != self.rank)

        def complete(folder):
            return self.complete(folder) if shared else self.file(folder, self.rank).exists()
        for _, folder in beyond_kept(steps, complete, self.keep):
            self.file(folder, self.rank).unlink(missing_ok=True)
            try:
                folder.rmdir()                # (the last worker to leave removes it)
            except OSError:
                pass

    def steps(self) -> list[tuple[int, Path]]:
        """The checkpoints' (step, folder), newest first."""
        return step_folders(self.dir)

    def file(self, folder: Path, rank: int) -> Path:
        """Worker ``rank``'s file in a checkpoint's folder (its name says how many workers)."""
        return folder / f'worker-{rank}-of-{self.num_workers}.ckpt'

    def complete(self, folder: Path) -> bool:
        """Whether every worker's file of this checkpoint is there."""
        return all(self.file(folder, r).exists() for r in range(self.num_workers))

    # -- resuming ----------------------------------------------------------------------
    def resume(self) -> dict | None:
        """Before the first step: restore the newest checkpoint every worker holds whole,
        if there is one. Returns its position {'step', 'epoch', 'batch', 'loop'}, or None."""
        held = self.held()
        while (step := self.newest_common(held)) is not None:
            folder = self.dir / f'step-{step:08d}'
            try:
                mine, whole = read_file(self.file(folder, self.rank)), 1
            except CheckpointError as e:
                say(f'{e}; trying the checkpoint before it', err=True)
                mine, whole = None, 0
            if all(row == [1] for row in self.gather([whole], 1)):
                break
            held.discard(step)                # (a worker's file of it is damaged)
        else:
            return None
        self.restore(mine)
        self._rng = mine['rng']
        if self.rank == 0:
            say(f'resumed from {folder.relative_to(Path.cwd()) if folder.is_relative_to(Path.cwd()) else folder} '
                f'(step {step}: epoch {mine["epoch"] + 1}, batch {mine["batch"]})')
        report(resumed_from=step, step=step)
        spans.resume(step)                    # (the timeline counts steps on from it)
        return {k: mine[k] for k in ('step', 'epoch', 'batch', 'loop')}

    def held(self) -> list[int]:
        """The steps of this worker's files; files of another number of workers: refused."""
        held = set()
        for step, folder in self.steps():
            for p in folder.iterdir():
                m = re.fullmatch(r'worker-\d+-of-(\d+)\.ckpt', p.name)
                if m and int(m.group(1)) != self.num_workers:
                    raise CheckpointError(
                        f'{folder} was saved by {m.group(1)} workers and this job has '
                        f'{self.num_workers}: start it with -n {m.group(1)}, or give it '
                        'another checkpoint folder')
            if self.file(folder, self.rank).exists():
                held.add(step)
        return held

    def newest_common(self, held: list[int]) -> int | None:
        """The newest step that every worker holds a file of (None: there is none)."""
        width = max(n for [n] in self.gather([len(held)], 1))
        rows = self.gather(sorted(held, reverse=True), width)
        return max(set.intersection(*map(set, rows)), default=None)

    def gather(self, numbers: list[int], width: int) -> list[list[int]]:
        """Every worker's list of at most ``width`` whole numbers >= 0, by rank: one sum
        over the store of a table in which each worker fills its own row (-1: empty)."""
        if self.num_workers == 1:
            return [list(numbers)]
        store = self.trainer.store
        table = torch.zeros(self.num_workers, max(width, 1), dtype=torch.float64)
        table[self.rank] = -1
        table[self.rank, :len(numbers)] = torch.tensor(numbers, dtype=torch.float64)
        table = table.to(getattr(store, 'device', 'cpu'))
        self._gathers += 1
        key = f'd2ldist.checkpoint.{self._gathers}'
        store.init([key], [torch.zeros_like(table)], optimizer=False)
        if getattr(store, 'is_async', False):      # pushes add up: all of them, then read
            store.push([key], [table])
            store.barrier()
            store.pull([key], out=[table])
        else:
            store.pushpull([key], [table], out=[table])
        return [[int(v) for v in row if v >= 0] for row in table.cpu()]

    def restore(self, mine: dict) -> None:
        """The model, then the store (rank 0's weights for all), the optimizer's states,
        what compression kept back, the rate."""
        t = self.trainer
        if t.initialized:
            raise CheckpointError('resume() must come before the first step: the store '
                                  'already holds other weights')
        for replica in t.replicas:        # (a worker but 0 has only the buffers: init()
            replica.load_state_dict(mine['model'], strict=self.rank == self.source)
        t.init()                          # gives it 0's weights and float buffers)
        t.set_optimizer_states(mine.get('optimizer'))
        t.set_compression_residuals(mine['residuals'])
        if mine['lr'] is not None:
            t.set_learning_rate(mine['lr'])

    def restore_rng(self) -> None:
        """Once the resumed epoch's data iterator exists (making it draws a seed): this
        worker's generators as they were at the checkpoint."""
        if self._rng is not None:
            set_rng_states(self._rng)
            self._rng = None
