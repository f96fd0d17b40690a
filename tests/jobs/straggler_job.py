"""A few batches of a small CNN with the Trainer; prints each worker's step-1 time.

Used by test_faults.py (d2l-launch --slow and --fail) and test_watch.py (--timeline):
``python straggler_job.py [kvstore] [batches]``, the kvstore 'ring' by default."""
import json
import sys

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
for i in range(batches):
    if i == 2:
        trainer.reset_step_times()             # the first batches warm up
    d2ldist.train_batch(X, y, net, loss, trainer, trainer.devices)
print('STEP1 ' + json.dumps({'rank': trainer.store.rank, 'step1': trainer.step_times[1],
                             'params': sum(p.numel() for p in net.parameters())}), flush=True)
