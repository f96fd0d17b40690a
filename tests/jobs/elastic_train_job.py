"""d2ldist.train elastic on the ring, for test_elastic.py: a small MLP in float64 on the
digits (3 workers: 15 steps of 32 examples each per epoch, 2 epochs, the learning rate
halved at epoch 2, momentum and weight decay). Each worker prints d2ldist.train's epoch
lines and ``FINAL {json}``: its test accuracy and final weights. ``replay(k, survivors)`` computes
the same in one process, for any sequence of memberships.

    d2l-launch -n 3 -s 0 --min-workers 2 --fail worker:2@step=20 \\
        python tests/jobs/elastic_train_job.py
"""
import functools
import json
import sys

import torch
from torch import nn

EPOCHS, BATCH, WORKERS = 2, 32, 3
HYPER = {'lr': 0.1, 'momentum': 0.9, 'weight_decay': 5e-4}


class Double(nn.Module):
    """The digits' float32 images as float64, so that sums in another order agree closely."""

    def forward(self, x):
        return x.double()


def model():
    torch.manual_seed(0)
    return nn.Sequential(Double(), nn.AvgPool2d(8), nn.Flatten(), nn.Linear(48, 16),
                         nn.ReLU(), nn.Linear(16, 10)).double()


def flat(net):
    return [float(v) for v in torch.cat([p.detach().reshape(-1) for p in net.parameters()])]


@functools.cache
def digits():
    """The digits load_data_digits splits (loaded once for several replays)."""
    from d2ldist.training.data import digits_tensors
    return digits_tensors()


def replay(ranks):
    """The final weights in one process, with the Trainer's update: ``ranks[s]``, the
    workers whose batches step s + 1 sums (each keeps its part of the data)."""
    from d2ldist.training.data import SplitSampler
    net, loss = model(), nn.CrossEntropyLoss(reduction='none')
    optimizer = torch.optim.SGD(net.parameters(), **HYPER)
    data = torch.utils.data.TensorDataset(*digits()[:2])
    loaders = [torch.utils.data.DataLoader(data, BATCH, drop_last=True, sampler=SplitSampler(
        len(data), WORKERS, r, seed=0)) for r in range(WORKERS)]
    step = 0
    for epoch in range(EPOCHS):
        for group in optimizer.param_groups:
            group['lr'] = HYPER['lr'] * 0.5 ** epoch
        for loader in loaders:
            loader.sampler.set_epoch(epoch)
        for batches in zip(*loaders):
            net.zero_grad()
            for r in ranks[step]:
                X, y = batches[r]
                loss(net(X), y).sum().backward()
            for p in net.parameters():
                p.grad /= BATCH * len(ranks[step])
            optimizer.step()
            step += 1
    return flat(net)


def main():
    import d2ldist
    torch.set_num_threads(1)
    store = d2ldist.create_store(sys.argv[1] if sys.argv[1:] else 'ring')
    train_iter, test_iter = d2ldist.load_data_digits(BATCH, store.num_workers, store.rank)
    net = model()
    trainer = d2ldist.Trainer(net, 'sgd', HYPER, kvstore=store)
    result = d2ldist.train(net, train_iter, test_iter, EPOCHS, trainer, [torch.device('cpu')],
                           lr_period=1, lr_decay=0.5)
    final = json.dumps({'test_acc': result['test_acc'], 'weights': flat(net)})
    sys.stdout.write(f'FINAL {final}\n')
    sys.stdout.flush()


if __name__ == '__main__':
    main()
