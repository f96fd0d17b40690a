"""d2l's ResNet-18 for 32x32 images, in PyTorch.

The network of the reference chapter (and of d2l's CIFAR-10 sections): a 3x3
stem without max-pooling (a 32x32 image is already small), then four stages of
two residual blocks with 64, 128, 256 and 512 channels, the last three halving
the height and width, then global average pooling and one dense layer.
"""
from torch import nn
from torch.nn import functional as F


class Residual(nn.Module):
    """d2l's residual block: two 3x3 convolutions; a 1x1 convolution fits the shortcut."""

    def __init__(self, input_channels, num_channels, use_1x1conv=False, strides=1):
        super().__init__()
        self.conv1 = nn.Conv2d(input_channels, num_channels, kernel_size=3,
                               padding=1, stride=strides)
        self.conv2 = nn.Conv2d(num_channels, num_channels, kernel_size=3, padding=1)
        if use_1x1conv:
            self.conv3 = nn.Conv2d(input_channels, num_channels, kernel_size=1,
                                   stride=strides)
        else:
            self.conv3 = None
        self.bn1 = nn.BatchNorm2d(num_channels)
        self.bn2 = nn.BatchNorm2d(num_channels)

    def forward(self, X):
        Y = F.relu(self.bn1(self.conv1(X)))
        Y = self.bn2(self.conv2(Y))
        if self.conv3:
            X = self.conv3(X)
        return F.relu(Y + X)


def resnet_block(input_channels, num_channels, num_residuals, first_block=False):
    """A stage of residual blocks; all but the first stage start by halving the size."""
    blk = []
    for i in range(num_residuals):
        if i == 0 and not first_block:
            blk.append(Residual(input_channels, num_channels,
                                use_1x1conv=True, strides=2))
        else:
            blk.append(Residual(num_channels, num_channels))
    return nn.Sequential(*blk)


def resnet18(num_classes: int, in_channels: int = 3, width: int = 64) -> nn.Sequential:
    """ResNet-18 for 32x32 inputs (width: channels of the first stage, 64 in d2l)."""
    w = width
    return nn.Sequential(
        nn.Conv2d(in_channels, w, kernel_size=3, stride=1, padding=1),
        nn.BatchNorm2d(w), nn.ReLU(),
        resnet_block(w, w, 2, first_block=True),
        resnet_block(w, 2 * w, 2),
        resnet_block(2 * w, 4 * w, 2),
        resnet_block(4 * w, 8 * w, 2),
        nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(),
        nn.Linear(8 * w, num_classes))
