"""Build the W4A16 GEMV kernels the benchmarks time, here (TVM + nvcc, no GPU needed), for the GPU machine (no TVM).

    python benchmarks/build_w4a16_kernels.py [--only NAME ...]    # writes artifacts/cuda/w4a16/<name>/

The shapes and tilings ``benchmarks/bench_cuda_w4a16.py`` times, and ``read_*`` plain reads of the same bytes
(``probes/read_probe.py``). The GPU tests' W4A16 kernels (``t_*``) are built by ``tests/fixtures/build_cuda.py``.
"""

from __future__ import annotations

import re
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "probes"))
from build_cuda_kernels import arguments  # noqa: E402
from read_probe import ReadProbeSpec, read_probe  # noqa: E402

from sparta.codegen.cuda_build import build_folders  # noqa: E402
from sparta.templates.w4a16_gemv.kernel import w4a16_gemv  # noqa: E402
from sparta.templates.w4a16_gemv.spec import W4A16Spec  # noqa: E402

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
    """Kernel name (its folder under ``artifacts/cuda/w4a16/``) -> spec, for ``bench_cuda_w4a16.py``."""
    specs = {}
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
    build_folders({n: s for n, s in kernels().items() if not args.only or n in args.only}, Path(args.out), args.jobs,
                  {W4A16Spec: w4a16_gemv, ReadProbeSpec: read_probe}, log=lambda line: print(line, flush=True))


if __name__ == "__main__":
    main()
