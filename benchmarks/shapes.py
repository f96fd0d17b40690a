"""The parameter shapes the benchmarks move: torchvision's ResNet-18 layout."""


def resnet18_shapes(scale=1):
    """The 62 parameter shapes of ResNet-18 (11.7 M values); output channels / scale."""
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    c_in = 64
    for c, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        for block in range(2):
            shapes += [(c, c_in if block == 0 else c, 3, 3), (c,), (c,), (c, c, 3, 3), (c,), (c,)]
            if block == 0 and (stride != 1 or c_in != c):
                shapes += [(c, c_in, 1, 1), (c,), (c,)]
        c_in = c
    shapes += [(1000, 512), (1000,)]
    return [(max(1, s[0] // scale),) + tuple(s[1:]) for s in shapes]
