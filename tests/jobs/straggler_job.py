"""A few batches of a small CNN with the Trainer (ring); prints each worker's step-1 time.

Used by test_faults.py with d2l-launch --slow and --fail."""
import json

import torch
from torch import nn

import d2ldist

torch.set_num_threads(1)
torch.manual_seed(0)
net = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1),
                    nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(128, 10))
trainer = d2ldist.Trainer(net, 'sgd', {'lr': 0.01}, kvstore='ring')
loss = nn.CrossEntropyLoss(reduction='none')
X, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
for i in range(12):
    if i == 2:
        trainer.reset_step_times()             # the first batches warm up
    d2ldist.train_batch(X, y, net, loss, trainer, trainer.devices)
print('STEP1 ' + json.dumps({'rank': trainer.store.rank, 'step1': trainer.step_times[1]}),
      flush=True)
