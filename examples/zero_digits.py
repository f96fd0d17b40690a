"""ZeRO on the digits: a small MLP trained at the stage you choose, checkpointed and resumed.

    d2l-launch -n 3 -s 0 python -m d2ldist.examples.zero_digits --stage 2
    d2l-launch -n 3 -s 0 python -m d2ldist.examples.zero_digits --checkpoint-dir ckpt --epochs 1
    d2l-launch -n 2 -s 0 python -m d2ldist.examples.zero_digits --checkpoint-dir ckpt
    d2l-launch -n 3 -s 0 --min-workers 2 --shard-replicas 1 --fail worker:1@step=20 \\
        python -m d2ldist.examples.zero_digits --stage 2 --epochs 2

Stage 0 is plain data parallelism (DistributedOptimizer), 1 and 2 ZeRO's
ShardedOptimizer, 3 shard_module. Each step trains on one global batch of --batch-size
examples, cut over the workers, in an order drawn from (seed, epoch): so the data order
is the step count, and it does not depend on the number of workers. Every worker ends
with the SHA-256 of the final weights (first 16 hex digits), the same on all of them.

With --checkpoint-dir every worker saves its shards (d2ldist.checkpoint.save) every
--checkpoint-every steps, or at each epoch's end, into DIR/step-K; started again, the job
resumes from the newest one (d2ldist.checkpoint.load), on any number of workers. Without
it, d2l-launch's --checkpoint-dir does the same, by its --checkpoint-every (default 100)
and --checkpoint-keep: d2ldist.checkpoint's defaults. On the
same workers the resumed run ends with the bits of a run never stopped. On another
number the sums are added in another order: the weights agree up to float rounding, and
the state's SHA-256 lines at save and at load are equal (docs/design/sharded_checkpoints.md).

Under --min-workers the job trains inside d2ldist.elastic.run (Horovod's hvd.elastic.run:
``train_elastic``), committing after each step: when a worker is lost, the others go back
to the last commit, take its shard from its replica (--shard-replicas 1; stage 0 needs
none; at stage 3 each unit's shard of the weights too) and go on, each global batch cut
for the workers left: the data order is still the step count. (No checkpoints there:
--checkpoint-dir is refused.)
"""
import argparse
import hashlib
import itertools
from pathlib import Path

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import d2ldist
from d2ldist import config
from d2ldist.collectives.sharded_module import full_weights


class Parser(argparse.ArgumentParser):
    def error(self, message):
        """Bad input: one line (without argparse's usage), exit status 2."""
        self.exit(2, f'{self.prog}: error: {message}\n')


parser = Parser(description='ZeRO stages 0-3 on the digits')
parser.add_argument('--stage', type=int, default=2, choices=range(4), help='0: plain DP')
parser.add_argument('--batch-size', type=int, default=48, help='global, over all workers')
parser.add_argument('--epochs', type=int, default=3)
parser.add_argument('--lr', type=float, default=0.01, help="Adam's")
parser.add_argument('--seed', type=int, default=42)
parser.add_argument('--checkpoint-dir', type=Path, help='save there; resume from there')
parser.add_argument('--checkpoint-every', type=int, default=0, help='steps (0: each epoch)')


def zero(net, stage, lr):
    """The net and its optimizer for a ZeRO stage (0: each worker holds everything)."""
    if stage == 3:
        net = d2ldist.shard_module(net)
        return net, torch.optim.Adam(net.parameters(), lr=lr)
    adam = torch.optim.Adam(net.parameters(), lr=lr)
    if stage == 0:
        return net, d2ldist.DistributedOptimizer(adam, net.named_parameters())
    return net, d2ldist.ShardedOptimizer(adam, net.named_parameters(), stage=stage)


def digits():
    """scikit-learn's 8x8 digits (bundled, nothing downloaded), in float64 so that the
    stages' sums, added in other orders, stay close: 1500 to train, 297 to test."""
    d = load_digits()
    X, y = torch.tensor(d.data, dtype=torch.float64) / 16, torch.tensor(d.target)
    return X[:1500], y[:1500], X[1500:], y[1500:]


def batches(X, y, epoch, args):
    """The global batches of one epoch, in an order drawn from (seed, epoch)."""
    g = torch.Generator().manual_seed(args.seed * 1000 + epoch)
    order = torch.randperm(len(y), generator=g)
    for i in range(len(y) // args.batch_size):
        idx = order[i * args.batch_size:(i + 1) * args.batch_size]
        yield X[idx], y[idx]


def weights_of(net, stage):
    return full_weights(net) if stage == 3 else dict(net.named_parameters())


def fingerprint(weights):
    """The first 16 hex digits of the SHA-256 of the weights, by name."""
    flat = torch.cat([weights[name].detach().reshape(-1) for name in sorted(weights)])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


def epochs_left(done, X, y, args):
    """After ``done`` steps: each epoch left, with its batches not yet trained."""
    per_epoch = len(y) // args.batch_size
    for epoch in range(done // per_epoch, args.epochs):
        skip = max(0, done - epoch * per_epoch)          # (trained before the checkpoint)
        yield epoch, itertools.islice(batches(X, y, epoch, args), skip, None)


def step(net, opt, X, y):
    """One step on a global batch, this worker's part of it cut by its rank and size now."""
    r, N = d2ldist.rank(), d2ldist.size()
    lo, hi = r * len(y) // N, (r + 1) * len(y) // N
    opt.zero_grad()
    # the global batch's mean loss: the optimizers average the workers' gradients
    loss = F.cross_entropy(net(X[lo:hi]), y[lo:hi], reduction='sum') * N / len(y)
    loss.backward()
    opt.step()
    return loss


def accuracy(net, X, y):
    with torch.no_grad():           # (every worker evaluates: stage 3 gathers the weights)
        return (net(X).argmax(dim=1) == y).float().mean().item()


def train(args):
    X_train, y_train, X_test, y_test = digits()
    torch.manual_seed(args.seed)         # the same first weights on every worker
    net, opt = zero(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).double(),
                    args.stage, args.lr)
    # the data order is (seed, batch size, step): saved with the weights, checked on load
    data = {'seed': args.seed, 'batch_size': args.batch_size}
    state = {'model': net, 'optimizer': opt, 'step': 0, 'data': dict(data)}
    own = args.checkpoint_dir                # (this script's flag wins over d2l-launch's)
    if own is None:
        d2ldist.checkpoint.load(state)       # d2l-launch --checkpoint-dir's newest, if any
    elif found := d2ldist.checkpoint.newest(own):
        d2ldist.checkpoint.load(state, found)
    if state['data'] != data:
        raise SystemExit('the checkpoint resumed from was trained with --seed {seed} '
                         '--batch-size {batch_size}: give the same'.format(**state['data']))
    if config.get().min_workers:
        return train_elastic(args, net, opt, (X_train, y_train, X_test, y_test))
    every = args.checkpoint_every or len(y_train) // args.batch_size
    for epoch, todo in epochs_left(state['step'], X_train, y_train, args):
        for X, y in todo:
            loss = step(net, opt, X, y)
            state['step'] += 1
            if own and state['step'] % every == 0:
                d2ldist.checkpoint.save(state, own / f'step-{state["step"]}')
            elif not own and d2ldist.checkpoint.due(state['step']):
                d2ldist.checkpoint.save(state)       # into --checkpoint-dir/step-K
        epoch_line(net, epoch, loss, X_test, y_test)
    final_line(net, state['step'], args.stage)


def train_elastic(args, net, opt, data):
    """Under d2l-launch --min-workers: the same steps inside hvd.elastic.run, a commit
    after each; after a loss, the survivors go on from the last commit (``state.step``)."""
    X_train, y_train, X_test, y_test = data
    state = d2ldist.elastic.TorchState(model=net, optimizer=opt, step=0)

    @d2ldist.elastic.run
    def loop(state):
        for epoch, todo in epochs_left(state.step, X_train, y_train, args):
            for X, y in todo:                        # (from the last commit)
                loss = step(net, opt, X, y)          # (cut for the workers there now)
                state.step += 1
                state.commit()
            epoch_line(net, epoch, loss, X_test, y_test)
    loop(state)
    final_line(net, state.step, args.stage)


def epoch_line(net, epoch, loss, X_test, y_test):
    test = accuracy(net, X_test, y_test)
    if d2ldist.rank() == 0:
        print(f'epoch {epoch + 1}: loss {loss.item():.4f}, test accuracy {test:.3f}',
              flush=True)


def final_line(net, steps, stage):
    print(f'final weights after {steps} steps: SHA-256 '
          f'{fingerprint(weights_of(net, stage))}', flush=True)


if __name__ == '__main__':
    args = parser.parse_args()
    if not 1 <= args.batch_size <= 1500 or args.epochs < 0 or args.checkpoint_every < 0:
        parser.error('--batch-size must be 1 to 1500, --epochs and --checkpoint-every >= 0')
    if config.get().min_workers and (args.checkpoint_dir or config.get().checkpoint_dir):
        parser.error('--checkpoint-dir with --min-workers: an elastic job here is not '
                     'checkpointed, its commits are in memory; give one or the other')
    torch.set_num_threads(1)
    d2ldist.init()
    if args.batch_size < d2ldist.size():
        parser.error(f'--batch-size {args.batch_size} gives some of the '
                     f'{d2ldist.size()} workers nothing')
    train(args)
