"""Data-parallel training of ResNet-18 on CIFAR-10 (or the digits) on several machines.

The chapter's multimachine_cifar10_train.py, in PyTorch with d2ldist. The same
file runs alone or as every worker of a job (each worker prints its own lines):

    python examples/multimachine_cifar10_train.py --kvstore local
    python examples/multimachine_cifar10_train.py --kvstore local --devices cpu:2
    d2l-launch -n 2 -s 2 python examples/multimachine_cifar10_train.py --kvstore dist_sync
    d2l-launch -n 2 -s 2 --hostfile hosts --launcher ssh python examples/multimachine_cifar10_train.py --kvstore dist_sync
    d2l-launch -n 2 python examples/multimachine_cifar10_train.py --kvstore ring
    d2l-launch -n 2 -s 2 --checkpoint-dir ckpt --checkpoint-every 20 --max-restarts 3 \
        python examples/multimachine_cifar10_train.py --kvstore dist_sync

The data set is CIFAR-10 when it is in --root (cifar-10-batches-py), else
scikit-learn's digits; the script says which one it uses. ``make demo`` runs

    d2l-launch -n 2 -s 2 python examples/multimachine_cifar10_train.py \
        --kvstore dist_sync --data digits

With the defaults (3 epochs, 32 examples per worker per batch, lr 0.05) that
job reached test accuracy 0.825, 0.953 and 0.963 after epochs 1, 2 and 3, the
same on both workers (they share weights and BatchNorm statistics), in 62 s of
wall time on 2 shared cores without a GPU (load average 1 to 2); with torch's
portable kernels (ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41: other
roundings, much slower) 0.832, 0.939 and 0.983. Each worker uses cores /
workers threads, which matters when all processes share a few cores.

BatchNorm momentum 0.5, not PyTorch's 0.1: an epoch is only 23 steps here and
the weights change fast (lr 0.05, momentum 0.9), so running statistics that
average the last ~10 steps describe weights that are gone (running variances
at 0.7 of the true ones after epoch 1). Measured in one process that trains as
this job does, on the same weights (momentum does not change training), test
accuracy after epochs 1, 2 and 3: 0.38, 0.63, 0.92 with 0.1; 0.86, 0.93, 0.97
with 0.5; 0.91, 0.98, 0.98 with statistics recomputed for the final weights.

With ``--checkpoint-dir`` d2ldist.train saves the whole job every
``--checkpoint-every`` steps and, started again (by hand, or by ``--max-restarts``
after a failure), resumes from the newest checkpoint: the last line, the SHA-256 of
the final weights, is then the same as in a run that never stopped.

Besides its lines, every worker calls ``d2ldist.report`` every few batches, so
that d2l-launch shows a progress bar and ``%launch`` its dashboard: loss,
accuracy, samples per second and the time of each of the seven steps.
"""
import argparse
import hashlib
import os
import sys

import torch
from torch import nn

import d2ldist
from d2ldist.training.stores import create_store

parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
parser.add_argument('--kvstore', default='local',
                    help="local, dist_sync, dist_async, dist_sync_device, ring or torch")
parser.add_argument('--epochs', type=int, default=3, help='number of epochs')
parser.add_argument('--lr', type=float, default=0.05, help='learning rate')
parser.add_argument('--wd', type=float, default=5e-4, help='weight decay')
parser.add_argument('--momentum', type=float, default=0.9)
parser.add_argument('--lr-period', type=int, default=80, help='epochs between lr decays')
parser.add_argument('--lr-decay', type=float, default=0.1, help='lr factor at each decay')
parser.add_argument('--batch-size', type=int, default=32, help='examples per worker per batch')
parser.add_argument('--data', choices=['auto', 'digits', 'cifar10'], default='auto',
                    help='auto: CIFAR-10 if it is in --root, else the digits')
parser.add_argument('--root', default='../data', help='folder holding cifar-10-batches-py')
parser.add_argument('--devices', default='cpu',
                    help="this worker's devices: cpu, cpu:2 (two CPU replicas), gpu, cuda:0,cuda:1")
parser.add_argument('--width', type=int, default=64, help='channels of the first stage')
parser.add_argument('--bn-momentum', type=float, default=0.5,
                    help="BatchNorm's running statistics: weight of each new batch "
                         "(PyTorch's default 0.1 lags behind weights that move fast)")
parser.add_argument('--threads', type=int, default=0,
                    help='torch threads per worker (0: cores / workers on this machine)')
parser.add_argument('--seed', type=int, default=0)


def setup(args):
    """The store, this worker's devices, its part of the data, and ResNet-18."""
    devices = d2ldist.parse_devices(args.devices)
    store = create_store(args.kvstore, devices[0])   # 'torch' on NCCL sums on this GPU
    d2ldist.init()                               # (joins the job also with kvstore local)
    train_iter, test_iter = d2ldist.load_data(
        args.data, args.batch_size, root=args.root, num_parts=store.num_workers,
        part_index=store.rank, seed=args.seed,
        pin_memory=any(d.type == 'cuda' for d in devices))
    torch.manual_seed(args.seed)
    in_channels = next(iter(test_iter))[0].shape[1]
    net = d2ldist.resnet18(10, in_channels=in_channels, width=args.width)
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.momentum = args.bn_momentum
    return store, devices, train_iter, test_iter, net


def main():
    args = parser.parse_args()
    local_workers = int(os.environ.get('LOCAL_WORLD_SIZE', '1'))
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_workers))
    try:
        store, devices, train_iter, test_iter, net = setup(args)
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        print(f'error: {e}', file=sys.stderr)
        sys.exit(2)
    print(f'worker {store.rank} of {store.num_workers}, kvstore {args.kvstore}, devices '
          f'{",".join(map(str, devices))}, {torch.get_num_threads()} threads', flush=True)
    if store.num_workers < d2ldist.size():
        print(f'note: with kvstore {args.kvstore}, each of the {d2ldist.size()} workers of '
              'this job trains alone on all the data', flush=True)
    trainer = d2ldist.Trainer(net, 'sgd', {'lr': args.lr, 'momentum': args.momentum,
                                           'weight_decay': args.wd},
                              kvstore=store, devices=devices)
    d2ldist.train(net, train_iter, test_iter, args.epochs, trainer, devices,
                  args.lr_period, args.lr_decay)
    times = ', '.join(f'{s} {t * 1000:.1f}' for s, t in trainer.step_times.items()
                      if t is not None)
    print(f'mean time per batch of steps 1-7 (ms): {times}', flush=True)
    print(f'final weights and BatchNorm statistics: SHA-256 {fingerprint(net)}', flush=True)


def fingerprint(net):
    """The first 16 hex digits of the SHA-256 of the model's floats: equal on every worker
    of a synchronous job, and equal again after a restart from a checkpoint."""
    flat = torch.cat([t.detach().reshape(-1).float().cpu()
                      for t in net.state_dict().values() if t.is_floating_point()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


if __name__ == '__main__':
    main()
