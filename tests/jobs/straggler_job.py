"""A few batches of a small CNN with the Trainer; prints each worker's step-1 time
(median) and, step by step, how it compares with the same forward and backward pass
right after it, outside the Trainer (never stretched by --slow).

Used by test_faults.py (d2l-launch --slow and --fail) and test_watch.py (--timeline):
``python straggler_job.py [kvstore] [batches]``, the kvstore 'ring' by default."""
import copy
import json
import statistics
import sys
import time

import torch
from torch import nn

import d2ldist

torch.set_num_threads(1)
torch.manual_seed(0)
kvstore = sys.argv[1] if len(sys.argv) > 1 else 'ring'
batches = int(sys.argv[2]) if len(sys.argv) > 2 else 12
net = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1),
                    nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(128, 10))
trainer = d2ldist.Trainer(net, 'sgd', {'lr': 0.01}, kvstore=kvstore)
loss = nn.CrossEntropyLoss(reduction='none')
X, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
probe, stretched, plain = copy.deepcopy(net), [], []   # the probe: never stretched by --slow
for i in range(batches):
    trainer.reset_step_times()                 # (step_times: this batch's alone)
    d2ldist.train_batch(X, y, net, loss, trainer, trainer.devices)
    start = time.perf_counter()                # right after, so that both see one load
    probe.zero_grad(set_to_none=True)          # (step 1's work, as train_batch does it)
    y_hat = probe(X)
    loss(y_hat, y).sum().backward()
    (y_hat.argmax(dim=1) == y).sum()
    if i >= 2:                                 # the first batches warm up
        stretched.append(trainer.step_times[1])
        plain.append(time.perf_counter() - start)
ratios = [s / p for s, p in zip(stretched, plain)]
print('STEP1 ' + json.dumps({'rank': trainer.store.rank, 'step1': statistics.median(stretched),
                             'ratio': statistics.median(ratios),
                             'added': statistics.median(s - p for s, p in zip(stretched, plain)),
                             'params': sum(p.numel() for p in net.parameters())}), flush=True)
