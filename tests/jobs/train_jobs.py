"""The training job of tests/jobs/test_train_dist.py: every worker runs this file; the test
imports it too, to train the one-process reference on the same batches.

    d2l-launch -n 2 -s 2 python tests/jobs/train_jobs.py dist_sync [ring torch ...]

Each worker trains a small CNN with BatchNorm on two CPU replicas (devices
[cpu, cpu]) for a few steps, through the Trainer and the given store(s), and
prints one line per store: ``RESULT {json}`` with its losses, final weights and
buffers (BatchNorm's running statistics), step times and whether its replicas
were identical after every step.
"""
import json
import sys

import torch
from torch import nn

STEPS, BATCH, LR_STEP = 4, 8, 2      # at step LR_STEP the learning rate drops (momentum stays)
HYPER = {'lr': 0.1, 'momentum': 0.9, 'weight_decay': 5e-4}
LOSS = nn.CrossEntropyLoss(reduction='none')


def small_net(seed=0):
    """A small CNN with BatchNorm (the layers ResNet-18 is made of), seeded."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 10))


def batch(step, rank, fixed=False):
    """Worker rank's batch at this step (fixed: the same batch every step)."""
    g = torch.Generator().manual_seed(1000 * (0 if fixed else step) + rank)
    return torch.randn(BATCH, 3, 8, 8, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def replicas_identical(trainer):
    """Do all the replicas hold the same weights and BatchNorm statistics?"""
    first = trainer.replicas[0].state_dict()
    return all(torch.equal(first[k], v) for r in trainer.replicas[1:]
               for k, v in r.state_dict().items())


def train(kvstore, devices, rank, num_workers, steps=STEPS, fixed=False, seed=None):
    """Train through the Trainer; each step's loss is averaged over all workers' batches
    when the reference calls this with all workers' batches at once (num_workers)."""
    import d2ldist
    net = small_net(rank if seed is None else seed)   # rank 0's weights must win at init
    trainer = d2ldist.Trainer(net, 'sgd', HYPER, kvstore=kvstore, devices=devices)
    losses, identical = [], True
    for step in range(steps):
        if step == LR_STEP:
            trainer.set_learning_rate(HYPER['lr'] / 2)
        parts = [batch(step, r, fixed) for r in (range(num_workers) if rank is None else [rank])]
        X, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        l, _ = d2ldist.train_batch(X, y, net, LOSS, trainer, devices)
        losses.append(l / len(y))
        identical = identical and replicas_identical(trainer)
    return trainer, losses, identical


def buffers(trainer):
    """The first replica's buffers (running mean, variance, num_batches_tracked), flat."""
    return torch.cat([b.reshape(-1).double() for b in trainer.replicas[0].buffers()])


def reference(num_workers, devices_per_worker):
    """One process, one replica per (worker, device), on all workers' batches together:
    each replica's slice is what that device of that worker sees (BatchNorm included)."""
    from d2ldist.training.devices import cpu
    trainer, losses, _ = train('local', [cpu()] * (num_workers * devices_per_worker),
                               None, num_workers, seed=0)
    return losses, trainer.flat_weights, buffers(trainer)


def main(kinds):
    import d2ldist
    from d2ldist.training.devices import cpu
    torch.set_num_threads(1)
    for kind in kinds:
        fixed = kind == 'dist_async'          # async: does it learn one batch per worker?
        steps = 30 if fixed else STEPS      # async: enough steps to learn both batches
        store = d2ldist.create_store(kind)
        trainer, losses, identical = train(store, [cpu(), cpu()], store.rank,
                                           store.num_workers, steps=steps, fixed=fixed)
        print('RESULT', json.dumps({
            'kind': kind, 'rank': store.rank, 'num_workers': store.num_workers,
            'losses': losses, 'identical': identical,
            'weights': trainer.flat_weights.tolist(), 'buffers': buffers(trainer).tolist(),
            'step_times': trainer.step_times, 'counts': trainer._times.counts,
            'update_on_kvstore': trainer.update_on_kvstore}), flush=True)


if __name__ == '__main__':
    main(sys.argv[1:])
