"""Kernel-only time of tile-kernel variants over a saved model's packed weights, by rows (probe, not a benchmark).

    python benchmarks/probes/tile_probe.py artifacts/llama_dynamic_bf16 [VARIANTS_DIR]

For each distinct 16-bit linear of the saved model (N, K, gated): its bucket kernels and, from ``VARIANTS_DIR``,
folders named ``<N>x<K>[g]_<label>`` holding other tilings built over the same blocks; each timed at 256, 512 and 1024
rows as the median of 5 replays of a CUDA graph of 20 calls.
"""
import sys
from pathlib import Path

import torch

import sparta
from sparta.templates.bsr_linear.runtime import BsrLinearOp, load_spec


def time_us(op, x, y) -> float:
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20):
            op(x, out=y)
    g.replay()
    torch.cuda.synchronize()
    s, e, ts = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True), []
    for _ in range(5):
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) * 1000 / 20)
    return sorted(ts)[2]


def main():
    model = sparta.load(sys.argv[1], inductor=False).to("cuda")
    variants = Path(sys.argv[2]) if len(sys.argv) > 2 else None
    seen = set()
    for mod in model.module_replacements().values():
        if not getattr(mod, "buckets", None) or (mod.spec.n, mod.spec.k, mod.spec.gate) in seen:
            continue
        seen.add((mod.spec.n, mod.spec.k, mod.spec.gate))
        tag = f"{mod.spec.n}x{mod.spec.k}{'g' if mod.spec.gate else ''}"
        kernels = [(f"tm{b.tm} (bucket)", f, b) for _, f, b in mod.buckets]
        if variants is not None:
            kernels += [(p.name.split("_", 1)[1], p, load_spec(p)) for p in sorted(variants.glob(f"{tag}_*"))]
        for rows in (256, 512, 1024):
            x = torch.randn(rows, mod.spec.k, device="cuda").to(mod.wp.dtype)
            times = []
            for label, folder, spec in kernels:
                op = BsrLinearOp.packed(folder, spec, mod.wp, mod.table, mod.bias)
                times.append((time_us(op, x, op(x)), label))
            print(f"{tag} @ {rows}: " + ", ".join(f"{label} {t:.2f}" for t, label in sorted(times)), flush=True)


if __name__ == "__main__":
    main()
