"""sparta's few-row block-sparse fp16 GEMV vs the tile kernel over the same packed blocks, and fp16 cuBLAS.

    python benchmarks/bench_cuda_bsr_gemv.py --build      # TVM + nvcc: kernels into artifacts/cuda/bg_*/
    python benchmarks/bench_cuda_bsr_gemv.py              # the GPU

The linears of a LLaMA-style decoder (hidden 2048, intermediate 5632): N×K = 2048×2048, 5632×2048, 2048×5632, 90%
of the 32×32 blocks pruned (seeded), at 1 to 32 rows: the GEMV (``templates/bsr_linear/gemv.py``) with the warps
``compile`` picks and the others, each also as a programmatic dependent launch (``_pdl``: a chain of them overlaps), the one-tile kernel built for any number of rows (what a dynamic model runs above
the GEMV's rows), fp16 cuBLAS on the dense weight. At 512 rows the tile kernel for any rows against the same kernel
built for exactly 512 (what M as an argument costs). Kernel-only time: CUDA graphs of 40 calls rotating weight sets
beyond the L2 (120 MB). Floor = kept fp16 blocks / measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import bench_mask, gpu_kernel_us, save  # noqa: E402

ROOT = Path(os.environ.get("SPARTA_CUDA_ARTIFACTS", Path(__file__).resolve().parents[1] / "artifacts" / "cuda"))
SHAPES = {"qkvo": (2048, 2048), "gate_up": (5632, 2048), "down": (2048, 5632)}
ROWS = (1, 2, 4, 8, 16, 32)
GEMV_ROWS = 8                   # the GEMV variants are built for up to 8 rows
SPARSITY = 90
WARPS = (2, 4, 8, 16)
TILE = dict(bn=32, bk=32, tm=128, warps_m=2, warps_n=1, stages=4)     # cuda_kernels.json fp16_tiles["32"]
ROTATE_BYTES = 120e6
SMALL_TILES = {"t64w2": dict(TILE, tm=64), "t32w2": dict(TILE, tm=32), "t64w4": dict(TILE, tm=64, warps_m=4),
               "t128w4": dict(TILE, warps_m=4), "t64w2s3": dict(TILE, tm=64, stages=3)}   # the tile per bucket of M
TILE_ROWS = (8, 32, 128, 512, 2048)


def mask_of(shape: str) -> torch.Tensor:
    n, k = SHAPES[shape]
    return bench_mask(n // 32, k // 32, 1 - SPARSITY / 100, f"bsr-gemv-{shape}")


def kernels() -> dict:
    """Kernel name (its folder under ``artifacts/cuda/``) -> spec."""
    from sparta.templates.bsr_linear.gemv_spec import BsrGemvSpec
    from sparta.templates.bsr_linear.spec import BsrSpec
    specs = {}
    for shape, (n, k) in SHAPES.items():
        for w in WARPS:
            specs[f"bg_{shape}_gemv_w{w}"] = BsrGemvSpec(n, k, warps=w, rows=GEMV_ROWS)
            specs[f"bg_{shape}_gemv_w{w}_pdl"] = BsrGemvSpec(n, k, warps=w, pdl=True, rows=GEMV_ROWS)
        specs[f"bg_{shape}_tile_any"] = BsrSpec(0, n, k, **TILE)
        specs[f"bg_{shape}_tile_m512"] = BsrSpec(512, n, k, **TILE)
        for name, tile in SMALL_TILES.items():
            specs[f"bg_{shape}_tile_{name}"] = BsrSpec(0, n, k, **tile)
    return {name: type(s)(**{**s.__dict__, "name": name}) for name, s in specs.items()}


def picked_warps(shape: str) -> int:
    """The warps kernel selection gives this shape's GEMV (``templates/bsr_linear/select.py``)."""
    from types import SimpleNamespace
    from sparta.templates.bsr_linear.select import fp16_gemv_tiling
    from sparta.target import load_target
    n, k = SHAPES[shape]
    weight = mask_of(shape).repeat_interleave(32, 0).repeat_interleave(32, 1).float()
    site = SimpleNamespace(any_rows=True, m=1, n=n, k=k, weight=weight)
    return fp16_gemv_tiling(site, TILE, load_target("cuda"))["warps"]


def bench_shape(shape: str, bw: float, tiles_only: bool = False) -> dict:
    from sparta.templates.bsr_linear.runtime import BsrGemvOp, BsrLinearOp, load_spec
    from sparta.templates.bsr_linear.gemv_spec import BsrGemvSpec
    from sparta.templates.bsr_linear.spec import reference
    import json

    n, k = SHAPES[shape]
    mask = mask_of(shape)
    torch.manual_seed(n + k)
    w = (torch.randn(n, k, device="cuda") * 0.05).half()
    bias = torch.randn(n, device="cuda").half()
    kept = int(mask.sum()) * 32 * 32 * 2
    sets = max(2, math.ceil(ROTATE_BYTES / kept))
    tile_spec = load_spec(ROOT / f"bg_{shape}_tile_any")
    tiles = [BsrLinearOp(ROOT / f"bg_{shape}_tile_any", tile_spec, w, mask, bias) for _ in range(sets)]
    fixed = [BsrLinearOp(ROOT / f"bg_{shape}_tile_m512", load_spec(ROOT / f"bg_{shape}_tile_m512"), w, mask, bias)
             for _ in range(sets)]
    gemvs = {}
    for warps in WARPS:
        for sfx in ("", "_pdl"):
            folder = ROOT / f"bg_{shape}_gemv_w{warps}{sfx}"
            spec = BsrGemvSpec(**json.loads((folder / "spec.json").read_text()))
            gemvs[f"w{warps}{sfx}"] = [BsrGemvOp(folder, spec, t.wp, t.table, t.bias) for t in tiles]
    wf = [w.clone() for _ in range(max(2, math.ceil(ROTATE_BYTES / (2 * n * k))))]
    rows, floor_us = [], kept / bw / 1e3
    for m in () if tiles_only else ROWS:
        xs = [torch.randn(m, k, device="cuda").half() for _ in range(sets)]
        ref = reference(xs[0], w, mask, bias, "none", 32, 32)
        res = {}
        for variant, ops in gemvs.items() if m <= GEMV_ROWS else ():
            y = ops[0](xs[0])
            err = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            res[f"gemv_{variant}"] = {"kernel_us": gpu_kernel_us(lambda i: ops[i](xs[i]), sets), "max_rel_err": err}
        res["tile_any"] = {"kernel_us": gpu_kernel_us(lambda i: tiles[i](xs[i]), sets)}
        res["cublas_fp16"] = {"kernel_us": gpu_kernel_us(lambda i: F.linear(xs[i % sets], wf[i], bias), len(wf))}
        if m > GEMV_ROWS:
            print(f"{shape} m={m}: tile {res['tile_any']['kernel_us']:.2f} | cuBLAS "
                  f"{res['cublas_fp16']['kernel_us']:.2f}", flush=True)
            rows.append({"m": m, "results": res})
            continue
        pick = f"gemv_w{picked_warps(shape)}_pdl"
        best = min((v["kernel_us"], kk) for kk, v in res.items() if kk.startswith("gemv"))
        print(f"{shape} m={m}: floor {floor_us:.2f} us | picked {pick} {res[pick]['kernel_us']:.2f} us "
              f"(best {best[1]} {best[0]:.2f}) | tile {res['tile_any']['kernel_us']:.2f} | cuBLAS "
              f"{res['cublas_fp16']['kernel_us']:.2f} | err {res[pick]['max_rel_err']:.1e}", flush=True)
        rows.append({"m": m, "picked": pick, "results": res})
    xs = [torch.randn(512, k, device="cuda").half() for _ in range(sets)]
    m512 = {} if tiles_only else {"tile_any": gpu_kernel_us(lambda i: tiles[i](xs[i]), sets),
            "tile_m512": gpu_kernel_us(lambda i: fixed[i](xs[i]), sets),
            "cublas_fp16": gpu_kernel_us(lambda i: F.linear(xs[i % sets], wf[i], bias), len(wf))}
    if m512:
        print(f"{shape} m=512: tile for any M {m512['tile_any']:.2f} us, built for 512 {m512['tile_m512']:.2f} us, "
              f"cuBLAS {m512['cublas_fp16']:.2f} us", flush=True)
    tile_ops = {"t128w2": tiles[:2]}
    for name in SMALL_TILES:
        folder = ROOT / f"bg_{shape}_tile_{name}"
        tile_ops[name] = [BsrLinearOp(folder, load_spec(folder), w, mask, bias) for _ in range(2)]
    tile_rows = []
    for m in TILE_ROWS:
        xs = [torch.randn(m, k, device="cuda").half() for _ in range(2)]
        res = {name: gpu_kernel_us(lambda i: ops[i](xs[i]), 2) for name, ops in tile_ops.items()}
        res["cublas_fp16"] = gpu_kernel_us(lambda i: F.linear(xs[i % 2], wf[i], bias), len(wf))
        print(f"{shape} tiles m={m}: " + " ".join(f"{kk} {v:.2f}" for kk, v in res.items()), flush=True)
        tile_rows.append({"m": m, "us": res})
    return {"shape": shape, "n": n, "k": k, "sparsity": SPARSITY, "kept_bytes": kept, "floor_us": floor_us,
            "rows": rows, "m512_us": m512, "tiles": tile_rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", action="store_true", help="build the kernels (TVM + nvcc) and exit")
    ap.add_argument("--tiles-only", action="store_true", help="only the tile kernels per bucket of M")
    args = ap.parse_args()
    if args.build:
        from sparta.codegen.cuda_build import build_folders
        build_folders(kernels(), ROOT)
        return
    from bench_cuda_w4a16 import copy_bandwidth
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {bw:.0f} GB/s; torch {torch.__version__}", flush=True)
    shapes = [bench_shape(s, bw, args.tiles_only) for s in SHAPES]
    print(f"wrote {save('bsr_tiles' if args.tiles_only else 'bsr_gemv', {'copy_GBps': bw, 'shapes': shapes})}")


if __name__ == "__main__":
    main()
