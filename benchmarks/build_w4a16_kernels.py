"""Build sparta's W4A16 CUDA kernels here (TVM + nvcc, no GPU needed) for the GPU machine, which has no TVM.

    python benchmarks/build_w4a16_kernels.py [--only NAME ...]    # writes artifacts/cuda/w4a16/<name>/

``t_*`` kernels are for ``tests/runtime/test_cuda_w4a16.py`` (odd N, a partial last K chunk, every
group size, symmetric and asymmetric, bias, fp32 and fp16 accumulation, ragged tilings); the
others are the shapes and tilings ``benchmarks/bench_cuda_w4a16.py`` times.
"""

from __future__ import annotations

import argparse
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

from sparta.codegen.cuda_build import build_cuda, save_dir
from sparta.templates.cuda_w4a16 import W4A16Spec, w4a16_gemv

BENCH_SHAPES = {"4096x4096": (4096, 4096), "11008x4096": (11008, 4096), "4096x11008": (4096, 11008)}   # N x K
BENCH_TILINGS = {"nt1w4u2": dict(ntile=1, warps=4, unroll=2), "nt2w4u2": dict(ntile=2, warps=4, unroll=2),
                 "nt2w8u1": dict(ntile=2, warps=8, unroll=1), "nt4w4u1": dict(ntile=4, warps=4, unroll=1),
                 "nt1w8u2": dict(ntile=1, warps=8, unroll=2), "nt1w8u1": dict(ntile=1, warps=8, unroll=1),
                 "nt1w4u4": dict(ntile=1, warps=4, unroll=4), "nt1w16u2": dict(ntile=1, warps=16, unroll=2),
                 "nt1w8u4": dict(ntile=1, warps=8, unroll=4), "nt2w8u2": dict(ntile=2, warps=8, unroll=2),
                 "nt4w8u1": dict(ntile=4, warps=8, unroll=1), "nt2w16u1": dict(ntile=2, warps=16, unroll=1)}


def kernels() -> dict[str, W4A16Spec]:
    specs = {
        "t_m1_sym_g128": W4A16Spec(1, 333, 1024, group=128),
        "t_m1_sym_g128_f16acc": W4A16Spec(1, 333, 4096, group=128, acc="float16"),
        "t_m5_asym_g32_bias": W4A16Spec(5, 203, 544, group=32, sym=False, bias=True),
        "t_m5_asym_g64_nt4w8u1": W4A16Spec(5, 203, 1152, group=64, sym=False, ntile=4, warps=8, unroll=1),
        "t_m5_sym_g32_nt1w2u3": W4A16Spec(5, 77, 800, group=32, ntile=1, warps=2, unroll=3, bias=True),
        "t_m16_asym_g128_bias": W4A16Spec(16, 517, 2048, group=128, sym=False, bias=True),
        "t_m16_asym_g128_f16acc": W4A16Spec(16, 517, 2048, group=128, sym=False, acc="float16"),
        "t_m16_sym_g32": W4A16Spec(16, 100, 800, group=32),
        "t_m9_asym_g32_nt3w1u1": W4A16Spec(9, 61, 416, group=32, sym=False, ntile=3, warps=1, unroll=1),
    }
    for shape, (n, k) in BENCH_SHAPES.items():
        for m in (1, 16):
            for tiling, kw in BENCH_TILINGS.items():
                specs[f"b_{shape}_m{m}_{tiling}"] = W4A16Spec(m, n, k, group=128, sym=False, **kw)
    return {name: W4A16Spec(**{**asdict(s), "name": name}) for name, s in specs.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "artifacts" / "cuda" / "w4a16"))
    ap.add_argument("--only", nargs="*", help="names to build (default: all)")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    todo = {n: s for n, s in kernels().items() if not args.only or n in args.only}

    def one(item):
        name, spec = item
        t0 = time.perf_counter()
        art = build_cuda(w4a16_gemv, spec)
        dest = out / name
        shutil.rmtree(dest, ignore_errors=True)
        save_dir(art, dest)
        return name, art, time.perf_counter() - t0

    with ThreadPoolExecutor(args.jobs) as pool:
        for name, art, dt in pool.map(one, todo.items()):
            print(f"{name}: grid {art.launch['grid']} block {art.launch['block']} "
                  f"({'cached' if art.cached else f'built in {dt:.1f} s'})", flush=True)


if __name__ == "__main__":
    main()
