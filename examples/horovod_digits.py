"""A Horovod training script, as Horovod's own pytorch_mnist.py is written, on d2ldist.

Only the import differs from a Horovod script (``import horovod.torch as hvd``); the
data are scikit-learn's bundled digits (8x8 images) instead of MNIST, so nothing is
downloaded. The same file runs

    python examples/horovod_digits.py                                   # alone
    d2l-launch -n 2 -s 0 python examples/horovod_digits.py              # d2ldist's ring
    d2l-launch -n 2 -s 0 --env D2L_BACKEND=torch python examples/horovod_digits.py
    torchrun --nproc_per_node=2 examples/horovod_digits.py              # torch.distributed

and prints the same numbers each way (worker 0 prints them).
"""
import argparse

import torch
import torch.nn.functional as F
import torch.utils.data.distributed
from sklearn.datasets import load_digits
from torch import nn

import d2ldist as hvd

parser = argparse.ArgumentParser(description='Horovod-style training on the digits')
parser.add_argument('--batch-size', type=int, default=32, help='per worker')
parser.add_argument('--epochs', type=int, default=3)
parser.add_argument('--lr', type=float, default=0.1, help='for one worker')
parser.add_argument('--momentum', type=float, default=0.9)
parser.add_argument('--seed', type=int, default=42)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(16 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv(x), 2))
        x = F.relu(self.fc1(x.flatten(1)))
        return F.log_softmax(self.fc2(x), dim=1)


def datasets():
    digits = load_digits()
    X = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16
    y = torch.tensor(digits.target)
    train = torch.utils.data.TensorDataset(X[:1500], y[:1500])
    test = torch.utils.data.TensorDataset(X[1500:], y[1500:])
    return train, test


def metric_average(val, name):
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


def train(epoch):
    model.train()
    # Horovod: set epoch to sampler for shuffling.
    train_sampler.set_epoch(epoch)
    for data, target in train_loader:
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
    return loss.item()


def test():
    model.eval()
    test_loss, test_accuracy = 0., 0.
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction='sum').item()
            pred = output.argmax(dim=1)
            test_accuracy += pred.eq(target).float().sum().item()
    # Horovod: use test_sampler to determine the number of examples in this worker's partition.
    test_loss /= len(test_sampler)
    test_accuracy /= len(test_sampler)
    # Horovod: average metric values across workers.
    return metric_average(test_loss, 'avg_loss'), metric_average(test_accuracy, 'avg_accuracy')


if __name__ == '__main__':
    args = parser.parse_args()
    # Horovod: initialize library.
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    train_dataset, test_dataset = datasets()
    # Horovod: use DistributedSampler to partition the data among workers.
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank(), seed=args.seed)
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size,
                                               sampler=train_sampler)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.batch_size,
                                              sampler=test_sampler)
    model = Net()
    # Horovod: scale learning rate by the number of workers.
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(),
                                momentum=args.momentum)
    # Horovod: broadcast parameters & optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    # Horovod: wrap optimizer with DistributedOptimizer.
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=hvd.Compression.none, op=hvd.Average)
    for epoch in range(1, args.epochs + 1):
        last = train(epoch)
        test_loss, test_accuracy = test()
        # Horovod: print output only on first rank.
        if hvd.rank() == 0:
            print(f'{hvd.size()} workers, epoch {epoch}: last batch loss {last:.6f}, '
                  f'test loss {test_loss:.6f}, test accuracy {test_accuracy:.4f}', flush=True)
