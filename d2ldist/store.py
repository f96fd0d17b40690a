"""The key-value store interface the Trainer talks to, and the one-process store.

A *store* holds one value per key (here: one tensor per parameter of the
network, keys 0, 1, 2, ...) and is shared by all workers. What the Trainer needs:

- ``rank``, ``num_workers``: this worker's place in the job;
- ``init(keys, values)``: start every worker from the same values: afterwards
  the store holds rank 0's values and every worker's ``values`` are overwritten
  with them, in place;
- ``pushpull(keys, values, out)``: push this worker's values and pull back the
  sum over all workers into ``out`` (an all-reduce; ``out`` may be ``values``).
  The Trainer's values are views of one flat CPU buffer, in key order
  (``trainer.flat_grads``), so a ring may all-reduce that buffer at once.

A store that can also run the optimizer itself (a parameter server does: the
servers update the weights they hold) has three more methods; the Trainer then
pushes gradients and pulls back weights:

- ``set_optimizer(name, params)``: the update rule, e.g. ``('sgd', {'lr': 0.1})``
  (a name and numbers, so it can cross the network without pickling code);
- ``push(keys, values)`` and ``pull(keys, out)``: the two halves of a round,
  so that sending the gradients and waiting for the new weights are timed
  apart; ``pull`` returns the weights after all workers' gradients are applied;
- ``set_learning_rate(lr)`` (optional), for learning-rate schedules;
- ``is_async`` (optional, default False): True if each worker's push updates
  the weights on its own (dist_async) instead of being summed with the others'.

``LocalStore`` is the store of a single process (``kvstore='local'``).
"""
import torch

OPTIMIZERS = {'sgd': 'SGD', 'adam': 'Adam', 'adamw': 'AdamW'}
# gluon's names for the same hyperparameters
GLUON_NAMES = {'learning_rate': 'lr', 'wd': 'weight_decay'}


def create_optimizer(name, params, tensors):
    """A torch.optim optimizer by name, e.g. ('sgd', {'lr': 0.1, 'momentum': 0.9}) over tensors."""
    if name.lower() not in OPTIMIZERS:
        raise ValueError(f'unknown optimizer {name!r}: use one of {sorted(OPTIMIZERS)}')
    params = {GLUON_NAMES.get(k, k): v for k, v in (params or {}).items()}
    return getattr(torch.optim, OPTIMIZERS[name.lower()])(tensors, **params)


class LocalStore:
    """kvstore='local': one worker; pushed values are summed; the optimizer runs here."""

    type = 'local'
    rank, num_workers = 0, 1

    def __init__(self):
        self._values, self._pushed, self._optimizer = {}, {}, None

    def init(self, keys, values):
        """Hold a copy of values (one worker: rank 0's values are ours already)."""
        for k, v in zip(keys, values):
            self._values[k] = v.detach().to('cpu', copy=True)

    def set_optimizer(self, name, params):
        """Update the held values with this optimizer when gradients are pushed."""
        keys = sorted(self._values)
        self._optimizer = create_optimizer(name, params, [self._values[k] for k in keys])

    def set_learning_rate(self, lr):
        for group in self._optimizer.param_groups:
            group['lr'] = lr

    def push(self, keys, values):
        """Add values to what was pushed for these keys in this round."""
        for k, v in zip(keys, values):
            if k in self._pushed:
                self._pushed[k] += v.to('cpu')
            else:
                self._pushed[k] = v.to('cpu', copy=True)

    def pull(self, keys, out):
        """Copy the values into out, after applying this round's pushes."""
        if self._pushed:
            self._apply()
        for k, o in zip(keys, out):
            o.copy_(self._values[k])

    def pushpull(self, keys, values, out):
        self.push(keys, values)
        self.pull(keys, out)

    def _apply(self):
        if self._optimizer is None:           # no optimizer: the value is the sum
            self._values.update(self._pushed)
        else:                                 # the sum is a gradient: update the value
            for k, v in self._values.items():
                v.grad = self._pushed.get(k)
            self._optimizer.step()
        self._pushed = {}
