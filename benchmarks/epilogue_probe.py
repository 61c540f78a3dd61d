"""Diagnostic: what a built ``bsr_linear`` kernel costs without its epilogue (here: nvcc, no GPU).

    python benchmarks/epilogue_probe.py ffn1_i8_b64_t128_q8 [NAME ...]   # -> artifacts/cuda/noepi_<NAME>/

Copies the artifact folder and cuts the generated CUDA after the main loop (the staged constants, the fragment
epilogue and the tile store go; the MMAs are ``asm volatile`` and stay), rebuilds the cubins with the build's
nvcc flags and records their digests. ``bench_cuda_w8a8.py`` times the ``noepi_`` folders beside the real kernels
(rows ``probe_noepi_<tile>``; their outputs are garbage, and no best-of or profile fit counts them): the difference
is the epilogue's share of the kernel.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

from sparta.codegen import cache
from sparta.codegen.cuda_build import _nvcc

ROOT = Path(__file__).resolve().parents[1] / "artifacts" / "cuda"
MAIN_LOOP = re.compile(r"\n  for \(int t = 0; t < count_ptr\[0\]; \+\+t\) \{")
AFTER_LOOP = "tvm_builtin_ptx_cp_async_wait_group_async_wait_group_0();\n  __syncthreads();"


def without_epilogue(name: str) -> Path:
    src, dst = ROOT / name, ROOT / f"noepi_{name}"
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    cu = (dst / "kernel.cu").read_text()
    loop = MAIN_LOOP.search(cu)
    if loop is None or AFTER_LOOP not in cu[loop.end():]:
        raise SystemExit(f"{name}: not a one-tile bsr_linear kernel (no main loop to cut after)")
    cut = cu.index(AFTER_LOOP, loop.end())
    keep = "if (acc_ptr[0] == 12345u && threadIdx.x == 9999) { Y_ptr[0] = 1; }"   # one use of the accumulators
    (dst / "kernel.cu").write_text(cu[:cut] + keep + cu[cu.rindex("\n}"):])
    launch = json.loads((dst / "launch.json").read_text())
    for arch, info in launch["cubins"].items():
        _nvcc(dst / "kernel.cu", dst / info["file"], arch)
        info["sha256"] = cache.file_digest(dst / info["file"])
    (dst / "launch.json").write_text(json.dumps(launch, indent=1))
    return dst


if __name__ == "__main__":
    for n in sys.argv[1:]:
        print(without_epilogue(n))
