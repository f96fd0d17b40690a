"""Training on a worker: the seven steps of a batch and what they need (docs/design/training.md).

* ``trainer.py`` -- the seven steps of a batch, timed (``Trainer``, ``train_batch``);
* ``stores.py``  -- the stores the Trainer talks to, by name (``create_store``);
* ``statistics.py`` -- BatchNorm's running statistics, shared over the workers in step 7;
* ``timing.py``  -- each step's seconds per batch (``trainer.step_times``);
* ``loop.py``    -- the training loop (``train``) and ``evaluate_accuracy``;
* ``elastic.py`` -- the loop's commits and recovery under ``--min-workers`` on the ring;
* ``data.py``    -- each worker's part of the data (``SplitSampler``), CIFAR-10, digits;
* ``models.py``  -- ResNet-18; ``devices.py`` -- devices and splitting a batch over them.
"""
