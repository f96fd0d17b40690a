"""Elastic workers for d2ldist.train: a commit at each step's end, and the loop taken up
again from it when a worker is lost, as ``hvd.elastic.run`` does.

Under ``d2l-launch --min-workers A`` with kvstore 'ring', the loop hands each step's end
to ``Elastic.step_done``: the weights, BatchNorm's statistics, the optimizer's state and
the loop's place are copied in memory (``TrainerState``, a ``TorchState``). When a worker
is lost, the collective in flight fails on every survivor (``WorkersChanged``);
``d2ldist.collectives.elastic.run`` takes each back to its last commit, re-forms the
ring, gives every survivor rank 0's state, and the loop goes on from there (a worker
that joins is taken in at a commit). Each worker keeps its part of the data: a lost
worker's part is not read again, one that joins reads that of the rank it joins as. With
servers the servers' rounds count the workers left (nothing to do here); kvstore 'torch'
cannot change its workers: one line at the start. docs/design/training.md#elastic-workers.
"""
import torch

from .. import config
from ..collectives import elastic, world
from ..lines import say, shown
from ..runtime import node

SUMS = {'loss': float, 'acc': int, 'n': int, 'samples': int}   # the loop's, with its place


class TrainerState(elastic.TorchState):
    """What a reset goes back to: the Trainer's first replica and optimizer (TorchState's
    copies) and the loop's place (``step``, ``epoch``, ``batch``) and sums (numbers)."""

    def __init__(self, trainer, at):
        self.trainer = trainer
        self.first, self.fresh = at['step'], not trainer.optimizer.state
        super().__init__(trainer.replicas[0], trainer.optimizer, **_numbers(at))

    def sync(self):
        """Rank 0's state on every worker (TorchState's), then on all its devices. Where
        rank 0's optimizer had no state yet, the state broadcast_optimizer_state made (a
        step of zero gradients, as Horovod's: weight decay's trace in it) is dropped."""
        optimizer = self.trainer.optimizer
        if not optimizer.state:       # (a worker that joined: the momenta it is sent)
            _made_state(optimizer, self.trainer.flat_weights)
        super().sync()
        if self.step == self.first and self.fresh:
            optimizer.state.clear()
        self.trainer.set_learning_rate(optimizer.param_groups[0]['lr'])
        self.trainer.forget_step()

    def at(self):
        """The loop's place, as ``train`` takes it (a checkpoint's too)."""
        return {'step': self.step, 'epoch': self.epoch, 'batch': self.batch,
                'loop': {k: getattr(self, k) for k in SUMS}}

    def place(self, step, epoch, batch, sums):
        """Take the loop's place and sums (numbers of one type on every worker: they go
        by broadcast, whole numbers and the others apart)."""
        self.step, self.epoch, self.batch = int(step), int(epoch), int(batch)
        for k, kind in SUMS.items():
            setattr(self, k, kind(sums.get(k, 0)))


@torch.no_grad()
def _made_state(optimizer, weights):
    """The Trainer's optimizer with a state (momenta, ...), as broadcast_optimizer_state
    makes one (its weights do not need a gradient): a step of zero gradients, the
    weights kept."""
    kept = weights.clone()
    weights.grad = torch.zeros_like(weights)
    optimizer.step()
    weights.copy_(kept)


def _numbers(at):
    """The numbers a TrainerState keeps, from the loop's place ``at``."""
    return dict({k: kind(at['loop'].get(k, 0)) for k, kind in SUMS.items()},
                step=at['step'], epoch=at['epoch'], batch=at['batch'])


class Elastic:
    """The loop's collaborator under --min-workers on the ring: ``run`` the epochs from a
    place, again from the last commit after a change of the workers; ``step_done``
    commits."""

    def __init__(self, trainer):
        self.trainer, self.state, self.entries = trainer, None, 0

    @classmethod
    def from_config(cls, trainer):
        """One under ``--min-workers`` with kvstore 'ring', else None; with kvstore 'torch',
        which cannot go on without a worker, one line and exit status 2."""
        kind = getattr(trainer.store, 'type', None)
        if not config.get().min_workers or kind not in ('ring', 'torch'):
            return None
        if kind == 'torch':
            say("--min-workers: kvstore 'torch' cannot go on without a lost worker "
                "(torch.distributed cannot change its workers): use kvstore 'ring' or servers "
                '(-s)', err=True)
            raise SystemExit(2)
        return cls(trainer)

    def run(self, train_from, at):
        """``train_from(at)``; when the workers change, ``train_from`` again from the last
        commit's place, on the re-formed ring."""
        self.state = TrainerState(self.trainer, at)
        self.state.register_reset_callbacks([self.trainer.store.reform])   # (the new ring)
        return elastic.run(self._enter)(self.state, train_from)

    def _enter(self, state, train_from):
        """``train_from`` the state's place, the Trainer's store filled again on this ring
        (every worker at once, a worker that joined too); after a reset, or joined, say
        where from."""
        if self.entries or state.step != state.first:
            me = node.current()
            say(f'{shown(me.id) if me else "worker"}: goes on from step {state.step} '
                f'(epoch {state.epoch + 1}, batch {state.batch}) as rank {world.rank()} of '
                f'{world.size()}')
        self.entries += 1
        self.trainer.init()
        return train_from(state.at())

    def step_done(self, step, epoch, batch, sums):
        """The end of a step: commit the state, at this place (``sums``: the loop's)."""
        self.state.place(step, epoch, batch, sums)
        self.state.commit()
