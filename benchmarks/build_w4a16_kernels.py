"""Build sparta's W4A16 CUDA kernels here (TVM + nvcc, no GPU needed) for the GPU machine, which has no TVM.

    python benchmarks/build_w4a16_kernels.py [--only NAME ...]    # writes artifacts/cuda/w4a16/<name>/

``t_*`` kernels are for ``tests/runtime/test_cuda_w4a16.py`` (odd N, a partial last K chunk, every
group size, symmetric and asymmetric, bias, fp32 and fp16 accumulation, ragged tilings); the
others are the shapes and tilings ``benchmarks/bench_cuda_w4a16.py`` times, and ``read_*`` plain reads
of the same bytes (``read_probe.py``).
"""

from __future__ import annotations

import re
from dataclasses import asdict
from pathlib import Path

from build_cuda_kernels import arguments, build_all  # noqa: E402  (benchmarks/ is the script's folder)
from read_probe import ReadProbeSpec, read_probe
from sparta.templates.cuda_w4a16 import W4A16Spec, w4a16_gemv

BENCH_SHAPES = {"4096x4096": (4096, 4096), "11008x4096": (11008, 4096), "4096x11008": (4096, 11008)}   # N x K
# tilings by name: nt<tiles per CTA>w<warps>u<chunks in flight>[_ks<K splits>][f: fold][_b<min CTAs per SM>]; the
# fastest of earlier runs
# (RESULTS.md, incl. register prefetch and more split-K shapes, which lost everywhere), with zero points and without
TILING = re.compile(r"nt(\d+)w(\d+)u(\d+)(?:_ks(\d+))?(f?)(?:_b(\d+))?(?:_pdl(e?))?")
BENCH_TILINGS = ["nt2w8u1", "nt4w8u1", "nt2w16u1", "nt4w8u1_ks2", "nt2w16u1f", "nt4w8u1f", "nt4w8u1_ks4f",
                 "nt2w8u1f", "nt2w8u1f_b6", "nt2w16u1f_b3", "nt2w16u1f_b2", "nt4w8u1_b3", "nt4w8u1_b4",
                 "nt2w8u1_b4", "nt4w8u1_ks2_b3"]
# with programmatic dependent launch (_pdl: the next kernel launches once this one passed its wait; _pdle: once it
# started), the fastest of the above per shape and batch
BENCH_TILINGS += [t + sfx for t in ("nt2w16u1f", "nt2w8u1f_b6", "nt2w16u1f_b2", "nt2w16u1f_b3", "nt2w8u1", "nt4w8u1",
                                    "nt4w8u1_ks2", "nt4w8u1_b3") for sfx in ("_pdl", "_pdle")]


def tiling(name: str) -> dict:
    nt, w, u, ks, fold, ctas, pdl = TILING.fullmatch(name).groups()
    return dict(ntile=int(nt), warps=int(w), unroll=int(u), ksplit=int(ks or 1), fold=bool(fold),
                min_ctas=int(ctas or 0), pdl="" if pdl is None else "early" if pdl else "late")


PROBE_CONFIGS = [(528, 512, 2), (1056, 256, 2), (264, 1024, 2), (264, 512, 4), (528, 256, 4)]


def kernels() -> dict:
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
        "t_m1_sym_g128_fold": W4A16Spec(1, 333, 1024, group=128, fold=True),
        "t_m16_asym_g128_bias_fold": W4A16Spec(16, 517, 2048, group=128, sym=False, bias=True, fold=True),
        "t_m9_asym_g128_nt3w2u2_fold": W4A16Spec(9, 61, 640, group=128, sym=False, ntile=3, warps=2, unroll=2,
                                                  fold=True),
        # K split over CTAs: 13 chunks in 3 uneven splits (5, 5, 3); 16 chunks in 4; folded; an unpaired tile
        "t_m5_asym_g32_bias_ks3": W4A16Spec(5, 203, 1632, group=32, sym=False, bias=True, warps=2, ksplit=3),
        "t_m16_sym_g128_nt8w4_ks4": W4A16Spec(16, 517, 2048, group=128, ntile=8, warps=4, unroll=1, ksplit=4),
        "t_m1_asym_g128_fold_nt3_ks5": W4A16Spec(1, 333, 2560, group=128, sym=False, ntile=3, warps=2, fold=True,
                                                  ksplit=5, bias=True),
        # registers bounded for 3 CTAs per SM (__launch_bounds__), folded, zero points, bias
        "t_m1_asym_g128_bias_fold_b3": W4A16Spec(1, 333, 1152, group=128, sym=False, bias=True, fold=True,
                                                  min_ctas=3),
        "t_m9_sym_g32_nt3w2u2_b8": W4A16Spec(9, 61, 640, group=32, ntile=3, warps=2, unroll=2, min_ctas=8),
        # programmatic dependent launch, square (a launch's output is the next one's input): plain; split K with
        # zero points, bias and the fold
        "t_m4_sym_g128_sq_pdle": W4A16Spec(4, 1024, 1024, group=128, pdl="early"),
        "t_m3_asym_g128_sq_ks2f_pdl": W4A16Spec(3, 1024, 1024, group=128, sym=False, bias=True, ntile=4, warps=4,
                                                unroll=1, fold=True, ksplit=2, pdl="late"),
    }
    for shape, (n, k) in BENCH_SHAPES.items():
        for m in (1, 16):
            for name in BENCH_TILINGS:
                if m > 8 and tiling(name)["fold"]:        # folding is slower at 16 rows (RESULTS.md)
                    continue
                for sym in (False, True):
                    specs[f"b_{shape}_m{m}_{name}{'_sym' if sym else ''}"] = W4A16Spec(m, n, k, group=128, sym=sym,
                                                                                      **tiling(name))
    for shape, (n, k) in BENCH_SHAPES.items():       # plain reads of the same bytes (weights, scales, zeros)
        words = -(-(n * k // 2 + 3 * n * (k // 128)) // 16)
        for ctas, threads, unroll in PROBE_CONFIGS:
            specs[f"read_{shape}_c{ctas}t{threads}u{unroll}"] = ReadProbeSpec(words, ctas, threads, unroll)
    return {name: type(s)(**{**asdict(s), "name": name}) for name, s in specs.items()}


def main():
    args = arguments(Path(__file__).resolve().parents[1] / "artifacts" / "cuda" / "w4a16")
    build_all({n: s for n, s in kernels().items() if not args.only or n in args.only}, Path(args.out), args.jobs,
              {W4A16Spec: w4a16_gemv, ReadProbeSpec: read_probe})


if __name__ == "__main__":
    main()
