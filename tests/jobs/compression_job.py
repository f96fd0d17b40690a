"""A small network on the digits with the Trainer, its gradients compressed or not.

    d2l-launch -n 2 -s 2 python compression_job.py KVSTORE COMPRESSION_JSON EPOCHS [LR MOMENTUM]

Prints worker-by-worker: the test accuracy and the bytes this worker sent (its van's
count of data frames: the pushes of gradients, and nothing else this network needs).
Used by tests/jobs/test_compression.py and benchmarks/compression.py."""
import json
import os
import sys

import torch
from torch import nn

import d2ldist
from d2ldist.runtime import node

torch.set_num_threads(1)
kvstore, params, num_epochs = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
lr, momentum = (float(a) for a in (sys.argv[4:6] or (0.5, 0.0)))
batch_size = 32
train_iter, test_iter = d2ldist.load_data_digits(batch_size, num_parts=2,
                                                 part_index=int(os.environ.get('D2L_RANK', 0)))
torch.manual_seed(0)
net = nn.Sequential(nn.AvgPool2d(4), nn.Flatten(), nn.Linear(192, 128), nn.ReLU(),
                    nn.Linear(128, 10))
trainer = d2ldist.Trainer(net, 'sgd', {'lr': lr, 'momentum': momentum}, kvstore=kvstore,
                          compression_params=params)
loss = nn.CrossEntropyLoss(reduction='none')
for epoch in range(num_epochs):
    train_iter.sampler.set_epoch(epoch)
    for X, y in train_iter:
        d2ldist.train_batch(X, y, net, loss, trainer, trainer.devices)
acc = d2ldist.evaluate_accuracy(net, test_iter)
print('RESULT ' + json.dumps({'rank': trainer.store.rank, 'acc': acc,
                              'sent': node.current().van.bytes_sent,
                              'params': sum(p.numel() for p in net.parameters()),
                              'steps': num_epochs * len(train_iter)}), flush=True)
