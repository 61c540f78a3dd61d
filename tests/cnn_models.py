"""Small CNNs built from torch.nn (torchvision's shapes: ResNet BasicBlock / Bottleneck with downsample, MobileNetV2
inverted residuals), a two-branch concatenation and a pruned FFN, with helpers that prune their channels."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from torch import nn
import torch.nn.functional as F
from torch.nn.utils import prune


def conv_bn(cin, cout, k=3, stride=1, groups=1):
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride=1, mid=None):
        super().__init__()
        mid = mid or cout
        self.conv1, self.bn1 = nn.Conv2d(cin, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv2, self.bn2 = nn.Conv2d(mid, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.downsample = conv_bn(cin, cout, 1, stride) if stride != 1 or cin != cout else None

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.downsample is None else self.downsample(x)))


class Bottleneck(nn.Module):
    def __init__(self, cin, mid, stride=1, expansion=4):
        super().__init__()
        cout = mid * expansion
        self.conv1, self.bn1 = nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv2, self.bn2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv3, self.bn3 = nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.downsample = conv_bn(cin, cout, 1, stride) if stride != 1 or cin != cout else None

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.downsample is None else self.downsample(x)))


class TinyResNet(nn.Module):
    """stem, max pool, stages of blocks (the second strided, with a downsample), average pool, classifier."""

    def __init__(self, block="basic", width=16, classes=10):
        super().__init__()
        self.stem = conv_bn(3, width)
        if block == "basic":
            self.layer1 = nn.Sequential(BasicBlock(width, width), BasicBlock(width, width))
            self.layer2 = nn.Sequential(BasicBlock(width, 2 * width + 1, 2), BasicBlock(2 * width + 1, 2 * width + 1))
            out = 2 * width + 1
        else:
            self.layer1 = nn.Sequential(Bottleneck(width, width // 2), Bottleneck(2 * width, width // 2))
            self.layer2 = nn.Sequential(Bottleneck(2 * width, width - 3, 2))
            out = 4 * (width - 3)
        self.fc = nn.Linear(out, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.stem(x)), 3, 2, 1)
        x = self.layer2(self.layer1(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


class InvertedResidual(nn.Module):
    def __init__(self, cin, cout, stride, expand):
        super().__init__()
        mid = cin * expand
        self.expand = nn.Sequential(nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU6())
        self.dw = nn.Sequential(nn.Conv2d(mid, mid, 3, stride, 1, groups=mid, bias=False), nn.BatchNorm2d(mid),
                                nn.ReLU6())
        self.project = conv_bn(mid, cout, 1)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        y = self.project(self.dw(self.expand(x)))
        return x + y if self.residual else y


class TinyMobileNetV2(nn.Module):
    def __init__(self, width=8, classes=10):
        super().__init__()
        self.stem = nn.Sequential(conv_bn(3, width, 3, 2), nn.ReLU6())
        self.blocks = nn.Sequential(InvertedResidual(width, width, 1, 3), InvertedResidual(width, 12, 2, 5),
                                    InvertedResidual(12, 12, 1, 6))
        self.head = nn.Sequential(conv_bn(12, 40, 1), nn.ReLU6())
        self.fc = nn.Linear(40, classes)

    def forward(self, x):
        x = self.head(self.blocks(self.stem(x)))
        return self.fc(x.mean((2, 3)))


class TwoBranch(nn.Module):
    """Two convolutions concatenated, then a convolution; and a sum of two convolutions."""

    def __init__(self, c=6):
        super().__init__()
        self.a, self.b = conv_bn(3, c), conv_bn(3, c + 1, 1)
        self.c = conv_bn(2 * c + 1, c)
        self.d, self.e = conv_bn(c, c), conv_bn(c, c)
        self.out = nn.Conv2d(c, 5, 1)

    def forward(self, x):
        y = torch.cat([F.relu(self.a(x)), torch.sigmoid(self.b(x))], 1)
        y = F.relu(self.c(y))
        return self.out(F.relu(self.d(y) + self.e(y)))


class FFN(nn.Module):
    """A transformer FFN: up → activation → down, plus the input."""

    def __init__(self, d=24, h=61, act=F.gelu):
        super().__init__()
        self.up, self.down, self.act = nn.Linear(d, h), nn.Linear(h, d), act

    def forward(self, x):
        return self.down(self.act(self.up(x))) + x


def randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial BatchNorm statistics and affine parameters (pruned channels then leave nonzero constants)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                n = m.num_features
                m.running_mean.copy_(torch.randn(n, generator=g) * 0.3)
                m.running_var.copy_(torch.rand(n, generator=g) + 0.5)
                m.weight.copy_(1 + torch.randn(n, generator=g) * 0.2)
                m.bias.copy_(torch.randn(n, generator=g) * 0.3)
    return model.eval()


def inner_convs(model: nn.Module) -> list[nn.Conv2d]:
    """The convolutions channel pruning takes: each block's convolutions but its last (ResNet), each inverted
    residual's expansion (MobileNetV2)."""
    out = []
    for m in model.modules():
        if isinstance(m, BasicBlock):
            out.append(m.conv1)
        elif isinstance(m, Bottleneck):
            out += [m.conv1, m.conv2]
        elif isinstance(m, InvertedResidual):
            out.append(m.expand[0])
    return out


def prune_channels(model: nn.Module, amount: float = 0.5) -> nn.Module:
    """50% (``amount``) of the output channels of each inner convolution pruned by L2 norm."""
    for conv in inner_convs(model):
        prune.ln_structured(conv, "weight", amount=amount, n=2, dim=0)
    return model


def benchmark_module(name: str):
    """The module ``benchmarks/<name>.py``, loaded by path (the benchmarks are scripts, not a package)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
