"""Synchronized BatchNorm: normalize with the statistics of every worker's batch together.

Plain BatchNorm normalizes each worker's batch with that batch's own mean and variance:
with a few examples per worker (a large model, a small GPU) they are noisy, and training
differs from one process with the whole batch. ``SyncBatchNorm`` adds up, per channel,
the count, the sum and the sum of squares over all workers -- one all-reduce of 2C+1
numbers per layer and forward pass -- and normalizes every worker's slice with the
mean and variance of the whole batch:

    mean = sum x / n,    var = sum x^2 / n - mean^2    (n, sums: over all workers)

Backward needs no code of its own: the all-reduce is differentiable (its gradient is the
all-reduce of the gradients), so each worker gets the gradient of the whole batch's loss
with respect to its own slice. In evaluation it is plain BatchNorm with the running
statistics, which all workers update alike. (Horovod's ``hvd.SyncBatchNorm``;
``torch.nn.SyncBatchNorm`` on torch.distributed.)
"""
import torch
from torch import nn

from .api import allreduce
from .ops import Sum
from .world import size


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm over the batches of all workers (input N, C, ...), as Horovod's."""

    def _check_input_dim(self, X):
        if X.dim() < 2:
            raise ValueError(f'SyncBatchNorm expects (N, C, ...) input, got {X.dim()}-D')

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        if not self.training or size() == 1:
            return super().forward(X)
        self._check_input_dim(X)
        C, dims = X.shape[1], [0] + list(range(2, X.dim()))
        shape = [1, C] + [1] * (X.dim() - 2)
        n = torch.tensor([X.numel() / C], dtype=X.dtype, device=X.device)
        stats = allreduce(torch.cat([X.sum(dims), (X * X).sum(dims), n]), op=Sum)
        count = stats[-1]
        mean = stats[:C] / count
        var = stats[C:2 * C] / count - mean * mean
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked += 1
                m = self.momentum if self.momentum is not None \
                    else 1.0 / float(self.num_batches_tracked)
                self.running_mean.mul_(1 - m).add_(m * mean)
                self.running_var.mul_(1 - m).add_(m * var * count / (count - 1))
        Y = (X - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            Y = Y * self.weight.view(shape) + self.bias.view(shape)
        return Y
