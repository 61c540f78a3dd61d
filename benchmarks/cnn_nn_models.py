"""torchvision's ResNet-18, ResNet-50 and MobileNetV2 topologies built from ``torch.nn`` alone, for machines where
torchvision does not import. The class names (``BasicBlock``, ``Bottleneck``, ``InvertedResidual``) are torchvision's,
which the CNN shrink benchmark's pruning recipe goes by."""

from __future__ import annotations

import torch
from torch import nn


def _downsample(cin: int, cout: int, stride: int) -> nn.Module | None:
    if stride == 1 and cin == cout:
        return None
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


class BasicBlock(nn.Module):
    """torchvision's ResNet-18/34 block: two 3×3 convolutions (stride on the first) and the residual."""

    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.downsample = _downsample(cin, cout, stride)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + (x if self.downsample is None else self.downsample(x)))


class Bottleneck(nn.Module):
    """torchvision's ResNet-50 bottleneck (stride on the 3×3)."""

    def __init__(self, cin, mid, stride=1):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv2, self.bn2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv3, self.bn3 = nn.Conv2d(mid, 4 * mid, 1, bias=False), nn.BatchNorm2d(4 * mid)
        self.downsample = _downsample(cin, 4 * mid, stride)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return torch.relu(y + (x if self.downsample is None else self.downsample(x)))


def _stem() -> list[nn.Module]:
    return [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]


def resnet18_nn() -> nn.Module:
    """ResNet-18: stages of 2, 2, 2, 2 basic blocks of 64, 128, 256, 512 channels."""
    layers, cin = _stem(), 64
    for i, cout in enumerate((64, 128, 256, 512)):
        for j in range(2):
            layers.append(BasicBlock(cin, cout, 2 if i and not j else 1))
            cin = cout
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 1000))


def resnet50_nn() -> nn.Module:
    """ResNet-50: stages of 3, 4, 6, 3 bottlenecks."""
    layers, cin = _stem(), 64
    for i, (mid, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3))):
        for j in range(blocks):
            layers.append(Bottleneck(cin, mid, 2 if i and not j else 1))
            cin = 4 * mid
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, 1000))


def _conv_bn_relu6(cin, cout, k=1, stride=1, groups=1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout), nn.ReLU6()]


class InvertedResidual(nn.Module):
    """torchvision's MobileNetV2 block: 1×1 expansion (none at ratio 1), 3×3 depthwise, 1×1 projection, the residual
    where shapes allow."""

    def __init__(self, cin, cout, stride, expand):
        super().__init__()
        mid = cin * expand
        layers = _conv_bn_relu6(cin, mid) if expand != 1 else []
        layers += _conv_bn_relu6(mid, mid, 3, stride, mid)
        layers += [nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.conv = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        return x + self.conv(x) if self.residual else self.conv(x)


def mobilenet_v2_nn() -> nn.Module:
    """MobileNetV2 (width 1.0): torchvision's inverted residual settings, 1280-channel head, 1000 classes."""
    layers, cin = _conv_bn_relu6(3, 32, 3, 2), 32
    for t, c, n, s in ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
                       (6, 320, 1, 1)):
        for j in range(n):
            layers.append(InvertedResidual(cin, c, s if j == 0 else 1, t))
            cin = c
    layers += _conv_bn_relu6(cin, 1280)
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(1280, 1000))


NN_MODELS = {"resnet18": resnet18_nn, "resnet50": resnet50_nn, "mobilenet_v2": mobilenet_v2_nn}

__all__ = ["NN_MODELS", "BasicBlock", "Bottleneck", "InvertedResidual", "mobilenet_v2_nn", "resnet18_nn",
           "resnet50_nn"]
