"""Reproduce the SparTA paper's propagation effect: prune a few weights, see how far it reaches.

BERT-base (from its config, random init, no download) with coarse 32×32-block pruning of
both FFN weights at 50/70/90%, and a MobileNet-style CNN with channel pruning. For each,
the table shows the density of the tensors propagation changed (upstream weights,
biases, activations) before and after. Run:

    python examples/propagation_effect.py            # writes examples/results/propagation.md
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import transformers

import sparta
from sparta.passes import propagate


def block_mask(shape, block, density, gen):
    keep = torch.rand(shape[0] // block, shape[1] // block, generator=gen) < density
    return keep.repeat_interleave(block, 0).repeat_interleave(block, 1)


def bert_rows(sparsity: float, layers: int, seq: int):
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(num_hidden_layers=layers)).eval()
    graph = sparta.capture(model, (torch.randint(0, 30522, (1, seq)),))
    gen = torch.Generator().manual_seed(1)
    for i in range(layers):
        for part in ("intermediate", "output"):
            name = f"encoder.layer.{i}.{part}.dense.weight"
            graph.set_tesa(name, sparta.TeSA.from_mask(block_mask(graph.tensor(name).shape, 32, 1 - sparsity, gen)))
    t0 = time.perf_counter()
    prop = propagate(graph)
    seconds = time.perf_counter() - t0
    rows = []
    for name in [f"encoder.layer.0.{p}" for p in ("intermediate.dense.weight", "intermediate.dense.bias",
                                                  "output.dense.weight")] + ["gelu"]:
        rows.append((f"BERT {sparsity:.0%}", name, graph.tesa(name).density, prop.tesa(name).density))
    changed = prop.propagation.changed()
    return rows, seconds, len(changed)


def cnn_rows():
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from models import SmallCNN, randomize_bn
    model = randomize_bn(SmallCNN(c=16)).eval()
    graph = sparta.capture(model, (torch.randn(1, 3, 32, 32),))
    keep = torch.arange(16) % 4 != 0        # prune every fourth channel of the first block
    graph.set_tesa("conv1.weight", sparta.TeSA.from_mask(keep.reshape(16, 1, 1, 1).expand(16, 3, 3, 3)))
    for p in ("bn1.weight", "bn1.bias", "bn2.weight", "bn2.bias"):
        graph.set_tesa(p, sparta.TeSA.from_mask(keep))
    prop = propagate(graph)
    names = ["conv1.weight", "relu", "dw.weight", "conv2d_1", "bn2.running_mean", "pw.weight"]
    return [("CNN 25% channels", n, graph.tesa(n).density, prop.tesa(n).density) for n in names]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "propagation.md"))
    args = ap.parse_args()
    lines = ["| model | tensor | density before | density after |", "| --- | --- | --- | --- |"]
    notes = []
    for s in (0.5, 0.7, 0.9):
        rows, secs, changed = bert_rows(s, args.layers, args.seq)
        lines += [f"| {m} | `{n}` | {a:.3f} | {b:.3f} |" for m, n, a, b in rows]
        notes.append(f"BERT-base {args.layers} layers, {s:.0%} block sparsity: {changed} tensors changed, "
                     f"propagation {secs:.2f} s")
    lines += [f"| {m} | `{n}` | {a:.3f} | {b:.3f} |" for m, n, a, b in cnn_rows()]
    text = "\n".join(["# Propagation effect", "", *lines, "", *[f"- {n}" for n in notes], ""])
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
