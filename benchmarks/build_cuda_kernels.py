"""Build sparta's CUDA kernels here (TVM + nvcc, no GPU needed) for the GPU machine, which has no TVM.

    python benchmarks/build_cuda_kernels.py            # writes artifacts/cuda/<name>/

Each folder holds the CUDA source, cubins for sm_80 and sm_90 and launch.json;
``tests/runtime/test_cuda_runtime.py`` and ``benchmarks/bench_cuda_gemm.py`` load them there
through ``sparta.runtime.cuda`` (cuda-bindings).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from sparta.codegen.cuda_build import build_cuda, save_dir
from sparta.templates.cuda_gemm import GemmSpec, mma_gemm

GEMMS = {  # name: (M, N, K)
    "gemm_small": (192, 128, 96),        # odd multiples of the tile: several CTAs, several K steps
    "gemm_ffn1": (4096, 3072, 768),      # BERT-base FFN1, 4096 tokens
    "gemm_ffn2": (4096, 768, 3072),      # BERT-base FFN2
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "artifacts" / "cuda"))
    ap.add_argument("--only", nargs="*", help="names to build (default: all)")
    args = ap.parse_args()
    out = Path(args.out)
    for name, (m, n, k) in GEMMS.items():
        if args.only and name not in args.only:
            continue
        art = build_cuda(mma_gemm, GemmSpec(m, n, k, name=name))
        dest = out / name
        shutil.rmtree(dest, ignore_errors=True)
        save_dir(art, dest)
        print(f"{name}: {m}x{n}x{k} grid {art.launch['grid']} block {art.launch['block']} "
              f"({'cached' if art.cached else f'built in {art.build_s:.1f} s'}) -> {dest}")
    (out / "index.json").write_text(json.dumps({n: dict(zip("mnk", s)) for n, s in GEMMS.items()}, indent=1))


if __name__ == "__main__":
    main()
