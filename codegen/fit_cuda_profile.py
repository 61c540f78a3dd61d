"""Fit the CUDA cost profile's block costs from sparta's own kernels' benchmark results.

    python -m sparta.codegen.fit_cuda_profile benchmarks/results/cuda_bsr-h100-2026-11-22.json \
                                              benchmarks/results/cuda_w8a8-h100-2026-11-22.json

For each block shape, the best sparta time at each sparsity is regressed on the number of
kept blocks (least squares, both FFN shapes, time normalised per activation row); the slope
is the marginal cost of a block — what weighted block cover compares — written as ns per
block per activation row into ``passes/profiles/cuda.json``: ``benchmarks/bench_cuda_bsr.py`` results
fill the W16A16 entry, ``bench_cuda_w8a8.py`` results the W8A8 entry (its dense rate too:
sparta's dense int8 tile is what a dense W8A8 sub-operator runs), ``bench_cuda_w4_gemm.py``
results the W4A16 entry (dense rate: the best tile at M = 4096; blocks: the W4A16 kernel's
times on the BERT FFN masks). The profile streams weights (``stream_weights``): small-M GEMMs
cost at least their weight bytes over the copy bandwidth.

``bench_cuda_bsr_gemv.py`` results fit what one row costs, kernel-only (the default CUDA model replays CUDA graphs,
so a kernel's fixed cost is its GPU latency, not an eager launch's host time): ``fixed_us``, cuBLAS at one row less
its weight bytes over the profile's bandwidth (median over the shapes); the W16A16 ``blocks_one_row`` of 32x32
blocks, the GEMV's time at one row regressed on its kept blocks; 64x64 blocks four times that (a row's cost there is
the blocks' bytes and latency: no one-row kernel runs 64x64 blocks yet).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PROFILE = Path(__file__).resolve().parents[1] / "passes" / "profiles" / "cuda.json"   # passes/ beside codegen/


def _best(row: dict) -> float:
    """The fastest sparta kernel of the row with fp16 output (``*_q8`` tiles write int8 codes: another op's cost)."""
    return min(v["kernel_us"] for k, v in row["results"].items()
               if k.startswith("sparta") and not k.endswith("_q8") and "kernel_us" in v)


def fit(rows: list[dict]) -> dict[str, float]:
    points: dict[int, list[tuple[float, float]]] = {}
    for row in rows:
        n_blocks = row["n"] * row["k"] / row["block"] ** 2 if "n" in row else \
            {"ffn1": 3072 * 768, "ffn2": 768 * 3072}[row["shape"]] / row["block"] ** 2
        density = row.get("density", 1 - row.get("sparsity", 0) / 100)   # W8A8 rows: the masks' expected density
        points.setdefault(row["block"], []).append((density * n_blocks, _best(row) * 1e3 / row.get("m", 4096)))
    out = {}
    for blk, pts in points.items():
        mx = sum(x for x, _ in pts) / len(pts)
        my = sum(y for _, y in pts) / len(pts)
        slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
        out[f"{blk}x{blk}"] = slope
    return out


def fit_one_row(result: dict, prof: dict, where: str) -> None:
    """``fixed_us`` and the W16A16 ``blocks_one_row`` from ``bench_cuda_bsr_gemv.py`` results (module docstring)."""
    ones = [(s, next(r for r in s["rows"] if r["m"] == 1)) for s in result["shapes"]]
    residual = sorted(r["results"]["cublas_fp16"]["kernel_us"] - 2 * s["n"] * s["k"] / (prof["bandwidth_gbs"] * 1e3)
                      for s, r in ones)
    prof["fixed_us"] = residual[len(residual) // 2]
    pts = [(s["kept_bytes"] / 2048, r["results"][r["picked"]]["kernel_us"] * 1e3) for s, r in ones]
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    entry = next(k for k in prof["kernels"] if (k["weight_bits"], k["act_bits"]) == (16, 16))
    entry["blocks_one_row"] = {"32x32": slope, "64x64": 4 * slope}
    prof["rows"] = prof["notes"]["rows"]
    prof["notes"]["fixed_us"] = ("one kernel's GPU latency in a CUDA graph: cuBLAS fp16 at one row less its weight "
                                 f"bytes over the bandwidth, median of the LLaMA decoder's shapes ({where})")
    prof["notes"]["one row"] = (f"W16A16 32x32: the block-sparse GEMV at one row regressed on its kept blocks; "
                                f"64x64: four times that, an estimate ({where})")
    print("fixed_us", round(prof["fixed_us"], 3), "W16A16 blocks_one_row 32x32", round(slope, 4))


def main():
    prof = json.loads(PROFILE.read_text())
    for arg in sys.argv[1:]:
        src = Path(arg)
        result = json.loads(src.read_text())
        meta = result.get("meta", {})
        where = (f"{meta.get('device')}, {meta.get('date')}, fitted by "
                 f"`python -m sparta.codegen.fit_cuda_profile {src.name}`")
        if "shapes" in result:                                   # bench_cuda_bsr_gemv.py: one row
            fit_one_row(result, prof, where)
            continue
        w4 = bool(result.get("dense")) and "group" in result["dense"][0]
        if w4:                                                   # bench_cuda_w4_gemm.py
            bits = (4, 16)
            rows = [{**r, "results": {"sparta": r["results"]["sparta_w4a16"]}} for r in result["sparse"]
                    if "kernel_us" in r["results"].get("sparta_w4a16", {})]
        elif "sparse" in result:                                 # bench_cuda_bsr.py: fp16
            bits, rows = (16, 16), result["sparse"]
        else:                                                    # bench_cuda_w8a8.py
            bits, rows = (8, 8), [r for r in result["rows"] if r["block"] is not None]
        entry = next(k for k in prof["kernels"] if (k["weight_bits"], k["act_bits"]) == bits)
        costs = fit(rows)
        entry["blocks"].update(costs)
        label = f"W{bits[0]}A{bits[1]}"
        if bits == (8, 8):
            dense = [r for r in result["rows"] if r["block"] is None]
            entry["dense_gflops"] = sum(2 * r["m"] * r["n"] * r["k"] / _best(r) / 1e3 for r in dense) / len(dense)
            prof["notes"]["W8A8"] = (f"dense rate and 32x32/64x64 block costs measured on sparta's int8 bsr_linear "
                                     f"kernels, the best tile of each case (dense: the Hopper wgmma tiles "
                                     f"compile() builds for sm_90) ({where}); other block shapes are stand-ins")
        elif w4:
            dense = [r for r in result["dense"] if r["m"] == 4096]
            entry["dense_gflops"] = sum(2 * r["m"] * r["n"] * r["k"] / _best(r) / 1e3 for r in dense) / len(dense)
            prof["notes"]["W4A16"] = (f"dense rate (best tile at M=4096) and 32x32/64x64 block costs measured on "
                                      f"sparta's W4A16 bsr_linear kernels ({where}); other block shapes are stand-ins")
        else:
            prof["notes"]["W16 blocks"] = (f"32x32 and 64x64 measured on sparta's bsr_linear kernels ({where}); other "
                                           "shapes and widths are still stand-ins")
        print(label, {k: round(v, 5) for k, v in costs.items()}, round(entry["dense_gflops"]))
    prof["stream_weights"] = True
    PROFILE.write_text(json.dumps(prof, indent=1) + "\n")


if __name__ == "__main__":
    main()
