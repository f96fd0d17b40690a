"""A few batches of a small CNN with the Trainer; prints each worker's step-1 time
(median) and, step by step, how it compares with the compute the Trainer measured in
that same step (what d2l-launch --slow stretches: ``faults.computed``).

Used by test_faults.py (d2l-launch --slow and --fail) and test_watch.py (--timeline):
``python straggler_job.py [kvstore] [batches]``, the kvstore 'ring' by default.
(Against a probe pass run right after each step instead, a busy machine slowed the probe,
not the step, and the ratio strayed: 2.24 for 3x once in CI.)"""
import json
import statistics
import sys

import torch
from torch import nn

import d2ldist
from d2ldist.runtime import faults

torch.set_num_threads(1)
torch.manual_seed(0)
kvstore = sys.argv[1] if len(sys.argv) > 1 else 'ring'
batches = int(sys.argv[2]) if len(sys.argv) > 2 else 12
net = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1),
                    nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(128, 10))
trainer = d2ldist.Trainer(net, 'sgd', {'lr': 0.01}, kvstore=kvstore)
loss = nn.CrossEntropyLoss(reduction='none')
X, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
computed, stretched, plain = faults.computed, [], []


def measured(seconds):
    """The Trainer's own measure of this step's compute, kept; then --slow and --fail."""
    plain.append(seconds)
    computed(seconds)


faults.computed = measured
for i in range(batches):
    trainer.reset_step_times()                 # (step_times: this batch's alone)
    d2ldist.train_batch(X, y, net, loss, trainer, trainer.devices)
    if i >= 2:                                 # the first batches warm up
        stretched.append(trainer.step_times[1])
plain = plain[2:]
ratios = [s / p for s, p in zip(stretched, plain)]
print('STEP1 ' + json.dumps({'rank': trainer.store.rank, 'step1': statistics.median(stretched),
                             'ratio': statistics.median(ratios),
                             'added': statistics.median(s - p for s, p in zip(stretched, plain)),
                             'params': sum(p.numel() for p in net.parameters())}), flush=True)
