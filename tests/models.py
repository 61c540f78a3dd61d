"""Small models shared by the tests (built in-repo; BERT from a config, no download)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d_in=24, d_hidden=48, d_out=10):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.fc3 = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.fc3(F.gelu(self.fc2(F.relu(self.fc1(x)))))


class ResidualMLP(nn.Module):
    """up → GELU → down, plus the input: a transformer's FFN block."""

    def __init__(self, d=128, h=256):
        super().__init__()
        self.up, self.down = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return self.down(F.gelu(self.up(x))) + x


class SmallCNN(nn.Module):
    """Conv-BN-ReLU, depthwise + pointwise (MobileNet style), pooling, classifier."""

    def __init__(self, c=8, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.dw = nn.Conv2d(c, c, 3, stride=2, padding=1, groups=c, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.pw = nn.Conv2d(c, 2 * c, 1)
        self.fc = nn.Linear(2 * c, classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.dw(x)))
        x = F.max_pool2d(F.relu(self.pw(x)), 2)
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)


def randomize_bn(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give BatchNorm layers non-trivial running statistics (fresh init is identity-like)."""
    gen = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
    return model


def tiny_bert(layers=2, hidden=64, heads=4, inter=128, vocab=100, seed=0):
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                                  intermediate_size=inter, vocab_size=vocab, max_position_embeddings=64)
    return transformers.BertModel(cfg).eval()


def bert_base(layers=12, seed=0):
    import transformers
    torch.manual_seed(seed)
    return transformers.BertModel(transformers.BertConfig(num_hidden_layers=layers)).eval()


class NormBlock(nn.Module):
    """LayerNorm feeding an MLP and a residual (post-LN BERT's FFN input): ``ln(x) + fc2(relu(fc1(ln(x))))``."""

    def __init__(self, d=256, hidden=512, residual=True):
        super().__init__()
        self.ln, self.fc1, self.fc2, self.residual = nn.LayerNorm(d), nn.Linear(d, hidden), nn.Linear(hidden, d), residual

    def forward(self, x):
        h = self.ln(x)
        y = self.fc2(F.relu(self.fc1(h)))
        return y + h if self.residual else y


class PostLNBlock(nn.Module):
    """BERT's post-LN sublayer: ``ln(x + fc(x))`` (the residual add read only by the LayerNorm), then a
    second LayerNorm on its own input (no add before it)."""

    def __init__(self, d=256):
        super().__init__()
        self.fc, self.ln, self.ln2 = nn.Linear(d, d), nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, x):
        return self.ln2(self.ln(self.fc(x) + x))


class QKV(nn.Module):
    """Three sibling linears reading one input, as attention's q/k/v (compiled for CUDA they run stacked):
    ``q(x) * k(x) + v(x)``."""

    def __init__(self, d=256):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(d, d) for _ in range(3))

    def forward(self, x):
        return self.q(x) * self.k(x) + self.v(x)
