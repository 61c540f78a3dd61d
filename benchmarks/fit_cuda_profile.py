"""Fit the CUDA cost profile's fp16 block costs from a ``bench_cuda_bsr.py`` result (sparta's own kernels).

    python benchmarks/fit_cuda_profile.py benchmarks/results/cuda_bsr-h100-2026-11-22.json

For each block shape, the best sparta time at each sparsity is regressed on the number of
kept blocks (least squares, both FFN shapes, time normalised per activation row); the slope
is the marginal cost of a block — what weighted block cover compares — written as ns per
block per activation row into ``passes/profiles/cuda.json`` (W16A16 entry).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PROFILE = Path(__file__).resolve().parents[1] / "passes" / "profiles" / "cuda.json"


def fit(result: dict) -> dict[str, float]:
    points: dict[int, list[tuple[float, float]]] = {}
    for row in result["sparse"]:
        times = [v["kernel_us"] for k, v in row["results"].items() if k.startswith("sparta") and "kernel_us" in v]
        n_blocks = {"ffn1": 3072 * 768, "ffn2": 768 * 3072}[row["shape"]] / row["block"] ** 2
        rows = 4096
        points.setdefault(row["block"], []).append((row["density"] * n_blocks, min(times) * 1e3 / rows))
    out = {}
    for blk, pts in points.items():
        mx = sum(x for x, _ in pts) / len(pts)
        my = sum(y for _, y in pts) / len(pts)
        slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
        out[f"{blk}x{blk}"] = slope
    return out


def main():
    src = Path(sys.argv[1])
    result = json.loads(src.read_text())
    costs = fit(result)
    prof = json.loads(PROFILE.read_text())
    entry = next(k for k in prof["kernels"] if k["weight_bits"] == 16 and k["act_bits"] == 16)
    entry["blocks"].update(costs)
    meta = result.get("meta", {})
    prof["notes"]["W16 blocks"] = (f"32x32 and 64x64 measured on sparta's bsr_linear kernels ({meta.get('device')}, "
                                   f"{meta.get('date')}, `{meta.get('command')}`, fitted by "
                                   f"`python benchmarks/fit_cuda_profile.py {src.name}`); other shapes and widths "
                                   "are still stand-ins")
    PROFILE.write_text(json.dumps(prof, indent=1) + "\n")
    print({k: round(v, 5) for k, v in costs.items()})


if __name__ == "__main__":
    main()
