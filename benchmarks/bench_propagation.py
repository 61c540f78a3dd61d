"""Time TeSA propagation on BERT-base (12 layers, batch 1 × seq 128) at several sparsities.

    python benchmarks/bench_propagation.py
"""

from __future__ import annotations

import statistics
import time

import torch
import transformers
from common import save

import sparta
from sparta.passes import propagate


def main(repeats: int = 3):
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig()).eval()
    graph = sparta.capture(model, (torch.randint(0, 30522, (1, 128)),))
    rows = []
    for sparsity in (0.0, 0.5, 0.9):
        g = graph.copy()
        gen = torch.Generator().manual_seed(1)
        if sparsity:
            for name in [v.name for v in g.tensors("weight") if v.name.endswith("dense.weight") and "encoder" in v.name]:
                h, w = g.tensor(name).shape
                keep = torch.rand(h // 32, w // 32, generator=gen) >= sparsity
                g.set_tesa(name, sparta.TeSA.from_mask(keep.repeat_interleave(32, 0).repeat_interleave(32, 1)))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = propagate(g)
            times.append(time.perf_counter() - t0)
        rep = out.propagation
        rows.append({"sparsity": sparsity, "median_s": statistics.median(times), "times_s": times,
                     "evaluations": rep.evaluations, "changes": rep.changes, "ops": len(g)})
        print(f"sparsity {sparsity:.0%}: {statistics.median(times):.2f} s (median of {repeats}), "
              f"{rep.evaluations} rule evaluations over {len(g)} ops; goal <= 5 s")
    path = save("propagation", {"model": "bert-base-uncased config, 12 layers, input 1x128", "goal_s": 5.0,
                                "rows": rows})
    print("wrote", path)


if __name__ == "__main__":
    main()
