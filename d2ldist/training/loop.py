"""The training loop every chapter and example uses: d2l's ``train_ch13``, on several machines.

Each worker runs the same loop on its own part of the data (``SplitSampler``): a new
permutation every epoch, the seven steps for every batch (``train_batch``), a progress
report every few batches (for ``d2l-launch``'s bars and ``%launch``'s dashboard) and
one line per epoch. Saved from the chapter that introduces it
(``notebooks/multimachine_resnet18.ipynb``, its ``#@save`` cell).
"""
import functools
import sys
import time
from collections.abc import Iterable

import torch
from torch import nn

from ..report import report
from .checkpoint import Checkpoint, CheckpointError
from .elastic import Elastic
from .trainer import train_batch


def evaluate_accuracy(net: nn.Module, data_iter: Iterable,
                      device: torch.device | None = None) -> float:
    """The accuracy of net on a data set, in evaluation mode."""
    device = device or next(net.parameters()).device
    net.eval()
    correct, total = 0, 0
    with torch.no_grad():
        for X, y in data_iter:
            X, y = X.to(device), y.to(device)
            correct += int((net(X).argmax(dim=1) == y).sum())
            total += y.numel()
    return correct / total


def train(net, train_iter, test_iter, num_epochs, trainer, devices, lr_period=None,
          lr_decay=0.1, report_every=5):
    """Train for num_epochs; report progress every few batches; return the final metrics.

    With D2L_CHECKPOINT_DIR set (``d2l-launch --checkpoint-dir``), save a checkpoint
    every D2L_CHECKPOINT_EVERY steps and first resume from the newest one, if any. Under
    ``d2l-launch --min-workers`` on the ring, commit every step and go on from the last
    commit without a lost worker (``training/elastic.py``)."""
    ckpt = Checkpoint.from_config(trainer)
    at = (ckpt and _resume(ckpt)) or {'step': 0, 'epoch': 0, 'batch': 0, 'loop': {}}
    elastic = Elastic.from_config(trainer)
    epochs = functools.partial(_train_from, net, train_iter, test_iter, num_epochs, trainer,
                               devices, lr_period, lr_decay, report_every, ckpt, elastic)
    return elastic.run(epochs, at) if elastic else epochs(at)


def _train_from(net, train_iter, test_iter, num_epochs, trainer, devices, lr_period,
                lr_decay, report_every, ckpt, elastic, at):
    """train()'s epochs from the place ``at`` (step, epoch, batch done, the loop's sums)."""
    loss = nn.CrossEntropyLoss(reduction='none')
    num_batches = len(train_iter)
    step, samples = at['step'], at['loop'].get('samples', 0)
    for epoch in range(at['epoch'], num_epochs):
        skip = at['batch'] if epoch == at['epoch'] else 0   # a resumed epoch's done batches
        if lr_period and epoch > 0 and epoch % lr_period == 0 and skip == 0:
            trainer.set_learning_rate(trainer.learning_rate * lr_decay)
        train_iter.sampler.set_epoch(epoch, skip * train_iter.batch_size)   # a new permutation,
        batches = iter(train_iter)                                          # the same on all workers
        sums = at['loop'] if skip else {}
        train_l_sum, train_acc_sum, n = (sums.get(k, 0) for k in ('loss', 'acc', 'n'))
        if ckpt:
            ckpt.restore_rng()        # (after iter(), which draws from torch's generator)
        start = time.time()
        for i, (X, y) in enumerate(batches, start=skip):
            l, acc = train_batch(X, y, net, loss, trainer, devices)
            train_l_sum, train_acc_sum, n = train_l_sum + l, train_acc_sum + acc, n + len(y)
            samples, step = samples + len(y), step + 1
            sums = {'loss': train_l_sum, 'acc': train_acc_sum, 'n': n, 'samples': samples}
            if ckpt:                  # a checkpoint every few steps
                ckpt.step_done(step, epoch, i + 1, sums)
            if elastic:               # a commit in memory, every step
                elastic.step_done(step, epoch, i + 1, sums)
            if (i + 1) % report_every == 0 or i + 1 == num_batches:
                report(epoch=epoch + 1, num_epochs=num_epochs, batch=i + 1,
                       num_batches=num_batches, loss=l / len(y), acc=acc / len(y),
                       samples=samples, step=step, step_times=trainer.step_times_report())
            else:
                report(step=step)     # (the launcher counts the steps a failure loses)
        test_acc = evaluate_accuracy(net, test_iter, devices[0])
        print(f'epoch {epoch + 1}, loss {train_l_sum / n:.3f}, train acc '
              f'{train_acc_sum / n:.3f}, test acc {test_acc:.3f}, '
              f'time {time.time() - start:.1f} sec, lr {trainer.learning_rate:g}', flush=True)
        report(epoch=epoch + 1, num_epochs=num_epochs, batch=num_batches,
               num_batches=num_batches, test_acc=test_acc)
    if ckpt:
        ckpt.wait()
    return {'loss': train_l_sum / n, 'train_acc': train_acc_sum / n, 'test_acc': test_acc}


def _resume(ckpt):
    """The newest checkpoint restored, or None; a checkpoint that cannot be used: one line."""
    try:
        return ckpt.resume()
    except CheckpointError as e:
        print(f'd2ldist: {e}', file=sys.stderr, flush=True)
        raise SystemExit(2) from None
