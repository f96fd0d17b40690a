"""A small training job through d2ldist.train, for the checkpoint tests.

    d2l-launch -n 2 -s 2 python tests/jobs/checkpoint_job.py dist_sync 2 [--2bit] [--own-disk]

``--2bit``: the gradients through 2-bit compression. ``--own-disk``: each worker keeps its
checkpoints in its own subfolder of D2L_CHECKPOINT_DIR (``host-RANK``), as workers on
hosts that share no file system do.

Prints ``FINAL {json}``: the worker's rank, steps, test accuracy and the SHA-256 of its
final weights and buffers (equal hashes: equal to the last bit).
"""
import hashlib
import json
import os
import sys

import sklearn.datasets  # noqa: F401  (the digits' loader's, loaded before the job is
import torch             # joined: see docs/design/runtime.md, Heartbeats)
from torch import nn

import d2ldist

kvstore, num_epochs, flags = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
if '--own-disk' in flags:
    os.environ['D2L_CHECKPOINT_DIR'] += f"/host-{os.environ['D2L_RANK']}"
compression = {'type': '2bit', 'threshold': 0.01} if '--2bit' in flags else None
torch.set_num_threads(1)
node = d2ldist.init()
store = d2ldist.create_store(kvstore)
train_iter, test_iter = d2ldist.load_data_digits(32, num_parts=store.num_workers,
                                                 part_index=store.rank)
torch.manual_seed(0)
net = nn.Sequential(nn.AvgPool2d(4), nn.Flatten(), nn.Linear(192, 64), nn.BatchNorm1d(64),
                    nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 10))
trainer = d2ldist.Trainer(net, 'sgd', {'lr': 0.1, 'momentum': 0.9}, kvstore=store,
                          compression_params=compression)
result = d2ldist.train(net, train_iter, test_iter, num_epochs, trainer, [torch.device('cpu')],
                       lr_period=1, lr_decay=0.5)
weights = b''.join(v.numpy().tobytes() for v in net.state_dict().values())
final = json.dumps({'rank': store.rank, 'test_acc': result['test_acc'],
                    'sha256': hashlib.sha256(weights).hexdigest()})
sys.stdout.write(f'FINAL {final}\n')     # one write: under torchrun the workers share a pipe,
sys.stdout.flush()                        # and print's text and newline would be two
