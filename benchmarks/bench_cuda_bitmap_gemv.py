"""sparta's unstructured sparse GEMV (bitmap + kept values) at Llama-7B's decode shapes against cuBLAS, CSR and BSR.

    python benchmarks/bench_cuda_bitmap_gemv.py --build [DIR]          # TVM + nvcc: kernels + manifest.json into DIR
    python benchmarks/bench_cuda_bitmap_gemv.py [--dir DIR] [--out FILE] [--only NAME ...]   # the GPU (no TVM)

Shapes (N×K): 4096×4096, 11008×4096 and 4096×11008, bf16, no bias; 50%, 70% and 90% of the weights pruned by a
seeded uniform random mask, M = 1 and 16. The kernels depend only on the shape and their knobs (not the mask), so
each variant is built once per shape and rows: for M = 1 a small sweep of ``tile_rows`` / ``stream_cols`` / ``warps``
/ ``inflight`` (and one tensor-core build), for M = 16 of the tiles and K-split ranges (X of 16 rows must fit shared
memory), on CUDA cores and on tensor cores (``mma``). The build keeps sm_90 cubins only, no CUDA source;
``manifest.json`` lists every kernel with its spec.

On the GPU each weight is made on the GPU from a seed, packed there once per format (``pack_bitmap``), copied to
rotate past the L2 and checked against the masked dense linear before timing (a wrong one is reported, not timed);
then timed kernel-only (CUDA graphs of 40 calls, ``common.gpu_kernel_us``) beside cuBLAS (``F.linear`` on the dense
weight), torch CSR (``to_sparse_csr`` then ``torch.sparse.mm``) and, at M = 16, BSR (16×16 blocks,
``bsr_dense_mm``) where they run. ``floor`` is the packed format's least bytes (kept values and one bit an element)
at the measured copy bandwidth. Prints one table per shape, density and M, fastest first, with the ratio to cuBLAS
and the fraction of the floor reached; the JSON has every row.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import build_folders, build_or_time, copy_bandwidth, gpu_kernel_us, save  # noqa: E402

OUT = Path(os.environ.get("SPARTA_CUDA_ARTIFACTS", Path(__file__).resolve().parents[1] / "artifacts" / "cuda")
           ).parent / "cuda_bitmap_gemv"
SHAPES = {"4096x4096": (4096, 4096), "11008x4096": (11008, 4096), "4096x11008": (4096, 11008)}
DENSITIES = (0.5, 0.3, 0.1)
ARCHS = ("sm_90",)
ROTATE_BYTES = 160e6
# M = 1: (tile_rows, stream_cols, warps, inflight), one CTA per row tile over all of K
ONE_ROW = {"t8c128w8i8": (8, 128, 8, 8), "t8c256w8i8": (8, 256, 8, 8), "t8c256w8i16": (8, 256, 8, 16),
           "t16c512w4i8": (16, 512, 4, 8), "t32c512w4i16": (32, 512, 4, 16), "t8c128w4i4": (8, 128, 4, 4)}
# split K: (tile_rows, stream_cols, tiles per CTA range (= warps), inflight, tensor cores), by the rows of the build
SPLIT = {1: {"t16c128r4i8mma": (16, 128, 4, 8, True)},
         16: {"t8c128r1i8": (8, 128, 1, 8, False), "t8c128r2i4": (8, 128, 2, 4, False),
              "t32c512r1i8": (32, 512, 1, 8, False), "t16c512r1i8": (16, 512, 1, 8, False),
              "t16c128r4i8mma": (16, 128, 4, 8, True), "t16c256r2i8mma": (16, 256, 2, 8, True),
              "t16c128r2i4mma": (16, 128, 2, 4, True)}}


def kernels() -> dict:
    """Kernel name (its folder) -> spec."""
    from sparta.templates.bitmap_gemv.spec import BitmapGemvSpec
    specs = {}
    for shape, (n, k) in SHAPES.items():
        for variant, (tr, cs, w, inflight) in ONE_ROW.items():
            name = f"bm_{shape}_r1_{variant}"
            specs[name] = BitmapGemvSpec(n, k, rows=1, tile_rows=tr, stream_cols=cs, warps=w, inflight=inflight,
                                         name=name)
        for rows, variants in SPLIT.items():
            for variant, (tr, cs, per_cta, inflight, mma) in variants.items():
                col_tiles = -(-k // (32 // tr * cs))
                name = f"bm_{shape}_r{rows}_{variant}"
                specs[name] = BitmapGemvSpec(n, k, rows=rows, tile_rows=tr, stream_cols=cs, warps=per_cta,
                                             inflight=inflight, ksplit=-(-col_tiles // per_cta), mma=mma, name=name)
    return specs


def build(folder: Path, jobs: int) -> None:
    from sparta.templates.bitmap_gemv.kernel import bitmap_gemv
    build_folders(bitmap_gemv, kernels(), folder, jobs, ARCHS)



def weight_and_mask(n: int, k: int, density: float, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.05).bfloat16()
    return w, torch.rand(n, k, device="cuda", generator=g) < density


def peers(w_masked: torch.Tensor, xs: list, sets: int) -> dict:
    """µs of cuBLAS, CSR and BSR on the masked weight (None where torch cannot run one)."""
    dense = [w_masked] + [w_masked.clone() for _ in range(sets - 1)]
    out = {"cublas": gpu_kernel_us(lambda i: F.linear(xs[i], dense[i]), sets)}
    xt = [x.t().contiguous() for x in xs[:sets]]
    for name in ("csr", "bsr16") if xs[0].shape[0] > 1 else ("csr",):    # torch's BSR kernel: 16 rows
        try:
            if name == "csr":
                sp = w_masked.to_sparse_csr()
                fn = (lambda sp: lambda i: torch.sparse.mm(sp, xt[i]))(sp)
            else:
                from torch.sparse._triton_ops import bsr_dense_mm
                sp = w_masked.to_sparse_bsr((16, 16))
                fn = (lambda sp: lambda i: bsr_dense_mm(sp, xt[i]))(sp)
            fn(0)
            out[name] = gpu_kernel_us(fn, len(xt))
        except Exception as exc:  # noqa: BLE001 - a peer torch cannot run here is reported, not fatal
            out[name] = None
            print(f"  {name}: not run ({type(exc).__name__}: {str(exc).splitlines()[0][:90] if str(exc) else ''})",
                  flush=True)
    return out


def bench_case(shape: str, density: float, manifest: list, root: Path, bw: float, only, wrong: list) -> list[dict]:
    from sparta.runtime.cuda import CudaKernel
    from sparta.templates.bitmap_gemv.runtime import BitmapGemvOp
    from sparta.templates.bitmap_gemv.spec import BitmapGemvSpec, bytes_floor, pack_bitmap
    n, k = SHAPES[shape]
    w, mask = weight_and_mask(n, k, density, seed=n * 7 + k + int(density * 100))
    w_masked = torch.where(mask, w, torch.zeros_like(w))
    floor = bytes_floor(n, k, float(mask.float().mean()))
    packs, rows = {}, []
    for m in (1, 16):
        sets = max(2, math.ceil(ROTATE_BYTES / floor))
        g = torch.Generator(device="cuda").manual_seed(m)
        xs = [torch.randn(m, k, device="cuda", generator=g).bfloat16() for _ in range(sets)]
        want = (xs[0].float() @ w_masked.float().t()).bfloat16().float()
        us = {f"{key}": t for key, t in peers(w_masked, xs, min(sets, max(2, math.ceil(ROTATE_BYTES / (n * k * 2)))))
              .items()}
        for entry in manifest:
            spec = BitmapGemvSpec(**entry["spec"])
            if (spec.n, spec.k) != (n, k) or spec.rows != m or (only and entry["name"] not in only):
                continue
            fmt = (spec.tile_rows, spec.stream_cols)
            if fmt not in packs:
                t0 = time.perf_counter()
                packs[fmt] = pack_bitmap(w, mask, spec)                          # on the GPU
                print(f"  packed {shape} density {density} as {fmt} in {time.perf_counter() - t0:.2f} s "
                      f"({packs[fmt].nbytes() / floor:.3f} of the floor's bytes)", flush=True)
            packed = packs[fmt]
            copies = [packed] + [type(packed)(packed.bits.clone(), packed.offsets.clone(), packed.values.clone())
                                 for _ in range(max(2, math.ceil(ROTATE_BYTES / packed.nbytes())) - 1)]
            kernel = CudaKernel(root / entry["name"])
            ops = [BitmapGemvOp(root / entry["name"], spec, p, None, kernel=kernel) for p in copies]
            got = ops[0](xs[0]).float()
            err = float((got - want).abs().max() / want.abs().max())
            if not err < 2e-2:                  # recorded, not timed; the sweep goes on
                print(f"  WRONG: {entry['name']} at density {density}, M={m}: relative error {err:.3g}", flush=True)
                wrong.append({"shape": shape, "density": density, "m": m, "kernel": entry["name"], "rel_err": err})
                continue
            us[entry["name"]] = gpu_kernel_us(lambda i: ops[i % len(ops)](xs[i % len(xs)]), len(ops))
        floor_us = floor / bw / 1e3
        for name, t in us.items():
            rows.append({"shape": shape, "n": n, "k": k, "density": density, "m": m, "kernel": name,
                         "us": None if t is None else round(t, 3),
                         "over_cublas": None if t is None else round(us["cublas"] / t, 3),
                         "of_floor": None if t is None else round(floor_us / t, 3), "floor_us": round(floor_us, 3)})
        table = sorted((r for r in rows if r["m"] == m and r["us"] is not None), key=lambda r: r["us"])
        print(f"{shape} kept {density:.0%} M={m}: floor {floor_us:.2f} µs ({floor / 1e6:.1f} MB)", flush=True)
        for r in table:
            print(f"  {r['kernel']:<34} {r['us']:8.2f} µs  {r['over_cublas']:5.2f}x cuBLAS  {r['of_floor']:5.2f} of "
                  "floor", flush=True)
    return rows


def main():
    args = build_or_time(__doc__, OUT, build, lambda ap: ap.add_argument(
        "--only", nargs="*", help="kernel names to time (default: all in the manifest)"))
    if args is None:
        return
    root = Path(args.dir)
    manifest = json.loads((root / "manifest.json").read_text())
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {bw:.0f} GB/s; torch {torch.__version__}", flush=True)
    rows, wrong = [], []
    for shape in SHAPES:
        for density in DENSITIES:
            rows += bench_case(shape, density, manifest, root, bw, set(args.only or ()), wrong)
    best = {}
    for r in rows:
        if r["kernel"].startswith("bm_") and r["us"] is not None:
            key = f"{r['shape']} kept {r['density']:.0%} M={r['m']}"
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = {"kernel": r["kernel"], "us": r["us"], "over_cublas": r["over_cublas"],
                             "of_floor": r["of_floor"]}
    print("best sparta variant per case:")
    for key, b in best.items():
        print(f"  {key:<28} {b['kernel']:<34} {b['over_cublas']:5.2f}x cuBLAS  {b['of_floor']:5.2f} of floor")
    if wrong:
        print(f"{len(wrong)} kernel runs were WRONG (not timed): {sorted({w['kernel'] for w in wrong})}")
    payload = {"device": torch.cuda.get_device_name(), "copy_GBps": bw, "rows": rows, "best": best, "wrong": wrong}
    print(f"wrote {save('bitmap_gemv', payload)}")
    if args.out:
        Path(args.out).write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
