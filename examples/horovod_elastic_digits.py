"""Elastic training written as Horovod's examples/elastic/pytorch/pytorch_mnist_elastic.py.

The calls are Horovod's, in the same places: ``hvd.elastic.TorchState(model, optimizer,
epoch=1, batch=0)``, a training function under ``@hvd.elastic.run`` that loops with
``for state.epoch in ...`` and ``for state.batch, ... in enumerate(...)`` and commits
after every batch, a reset callback that sets the learning rate for ``hvd.size()``
workers, and a DistributedOptimizer with Horovod's ``compression`` and ``op``. Only the
import and the data differ (scikit-learn's digits, so nothing is downloaded). As in
Horovod's example, the DistributedSampler is cut once, for the first workers: after a
loss the survivors go on with their own parts (``hvd.elastic.ElasticSampler`` re-cuts
what is left: ``tests/jobs/elastic_job.py``).

    python examples/horovod_elastic_digits.py                           # alone
    d2l-launch -n 3 -s 0 --min-workers 2 --max-workers 3 --restart-lost \\
        --fail worker:1@step=20 python examples/horovod_elastic_digits.py

Worker 1 dies after its 20th step; the two others go back to their last commit and go on
as ranks 0 and 1 of 2; the launcher starts worker 1 again, and it joins at their next
commit with rank 0's state. Worker 0 prints the test accuracy at the end.
"""
import argparse

import torch
import torch.nn.functional as F
import torch.utils.data.distributed
from torch import nn

import d2ldist.horovod as hvd
from d2ldist.training.data import digits_tensors

parser = argparse.ArgumentParser(description='Horovod elastic training on the digits')
parser.add_argument('--batch-size', type=int, default=32, help='per worker')
parser.add_argument('--epochs', type=int, default=5)
parser.add_argument('--lr', type=float, default=0.05, help='for one worker')
parser.add_argument('--momentum', type=float, default=0.5)
parser.add_argument('--seed', type=int, default=42)
parser.add_argument('--log-interval', type=int, default=10, help='batches between lines')
parser.add_argument('--fp16-allreduce', action='store_true', help="Horovod's compression")
parser.add_argument('--use-adasum', action='store_true', help='not in d2ldist: refused')
args = parser.parse_args()

hvd.init()
torch.manual_seed(args.seed)
torch.set_num_threads(1)
X_train, y_train, X_test, y_test = digits_tensors()
train_dataset = torch.utils.data.TensorDataset(X_train, y_train)
test_dataset = torch.utils.data.TensorDataset(X_test, y_test)
# Cut once, for the workers there at the start (as Horovod's example does).
train_sampler = torch.utils.data.distributed.DistributedSampler(
    train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
train_iter = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size,
                                         sampler=train_sampler)
test_sampler = torch.utils.data.distributed.DistributedSampler(
    test_dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
test_iter = torch.utils.data.DataLoader(test_dataset, batch_size=100, sampler=test_sampler)

net = nn.Sequential(nn.AvgPool2d(4), nn.Flatten(), nn.Linear(192, 64), nn.ReLU(),
                    nn.Linear(64, 10), nn.LogSoftmax(dim=1))
lr_scaler = 1 if args.use_adasum else hvd.size()     # Adasum needs no larger rate
optimizer = torch.optim.SGD(net.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=net.named_parameters(),
                                     compression=compression,
                                     op=hvd.Adasum if args.use_adasum else hvd.Average)


def metric_average(val, name):
    """The mean of ``val`` over the workers."""
    return hvd.allreduce(torch.tensor(val), name=name).item()


@hvd.elastic.run
def train(state):
    """Train from the state's epoch and batch on; commit after every batch."""
    for state.epoch in range(state.epoch, args.epochs + 1):
        state.model.train()
        train_sampler.set_epoch(state.epoch)
        steps_remaining = len(train_iter) - state.batch
        for state.batch, (X, y) in enumerate(train_iter):
            if state.batch >= steps_remaining:
                break
            state.optimizer.zero_grad()
            loss = F.nll_loss(state.model(X), y)
            loss.backward()
            state.optimizer.step()
            if state.batch % args.log_interval == 0:
                print(f'epoch {state.epoch} batch {state.batch} as rank {hvd.rank()} of '
                      f'{hvd.size()}: loss {loss.item():.4f}', flush=True)
            state.commit()
        state.batch = 0


def test():
    """The test loss and accuracy, averaged over the workers' parts."""
    net.eval()
    test_loss, test_accuracy = 0., 0.
    with torch.no_grad():
        for X, y in test_iter:
            y_hat = net(X)
            test_loss += F.nll_loss(y_hat, y, reduction='sum').item()
            test_accuracy += (y_hat.argmax(dim=1) == y).float().sum().item()
    test_loss = metric_average(test_loss / len(test_sampler), 'avg_loss')
    test_accuracy = metric_average(test_accuracy / len(test_sampler), 'avg_accuracy')
    if hvd.rank() == 0:
        print(f'test loss {test_loss:.4f}, test accuracy {test_accuracy:.4f} '
              f'({hvd.size()} workers at the end)', flush=True)


def on_state_reset():
    """After a reset: the learning rate for the workers there now."""
    for param_group in optimizer.param_groups:
        param_group['lr'] = args.lr * hvd.size()


state = hvd.elastic.TorchState(net, optimizer, epoch=1, batch=0)
state.register_reset_callbacks([on_state_reset])
train(state)
test()
