"""Diagnostic: what a built ``bsr_linear`` kernel costs without its epilogue (here: nvcc, no GPU).

    python benchmarks/probes/epilogue_probe.py ffn1_i8_b64_t128_q8 [NAME ...]   # -> artifacts/cuda/noepi_<NAME>/
    python benchmarks/probes/epilogue_probe.py --math ffn1_i8_b64_t128_q8 ...   # -> artifacts/cuda/nomath_<NAME>/

Copies the artifact folder and cuts the generated CUDA after the main loop (the staged constants, the fragment
epilogue and the tile store go; the MMAs are ``asm volatile`` and stay), rebuilds the cubins with the build's
nvcc flags and records their digests. ``bench_cuda_w8a8.py`` times the ``noepi_`` folders beside the real kernels
(rows ``probe_noepi_<tile>``; their outputs are garbage, and no best-of or profile fit counts them): the difference
is the epilogue's share of the kernel. ``--math`` cuts only the fragment stores into the staged tile (their
arithmetic goes with them as dead code; the constants are staged and the tile still leaves): the store path alone.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

from sparta.codegen.cuda_build import compile_cubins

ROOT = Path(__file__).resolve().parents[2] / "artifacts" / "cuda"
MAIN_LOOP = re.compile(r"\n  for \(int t = 0; t < count_ptr\[0\]; \+\+t\) \{")
AFTER_LOOP = "tvm_builtin_ptx_cp_async_wait_group_async_wait_group_0();\n  __syncthreads();"


def without_epilogue(name: str, math_only: bool = False) -> Path:
    src, dst = ROOT / name, ROOT / f"{'nomath' if math_only else 'noepi'}_{name}"
    cu = (src / "kernel.cu").read_text()
    loop = MAIN_LOOP.search(cu)
    cut = cu.find(AFTER_LOOP, loop.end()) if loop else -1
    if cut < 0:       # checked before copying: an uncut copy would be timed as a probe
        raise SystemExit(f"{name}: not a one-tile bsr_linear kernel (no main loop to cut after)")
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    keep = "if (acc_ptr[0] == 12345u && threadIdx.x == 9999) { Y_ptr[0] = 1; }"   # one use of the accumulators
    if math_only:
        body = re.sub(r"\n\s*sparta_st_(s8x2|h2)\(\(?&\(\(\([\w ]+\*\)smem_ptr\)[^\n]*;", "", cu[cut:])
        (dst / "kernel.cu").write_text(cu[:cut] + keep + body)
    else:
        (dst / "kernel.cu").write_text(cu[:cut] + keep + cu[cu.rindex("\n}"):])
    launch = json.loads((dst / "launch.json").read_text())
    launch["cubins"] = compile_cubins(dst, list(launch["cubins"]))
    (dst / "launch.json").write_text(json.dumps(launch, indent=1))
    return dst


if __name__ == "__main__":
    math_only = "--math" in sys.argv[1:]
    for n in (a for a in sys.argv[1:] if a != "--math"):
        print(without_epilogue(n, math_only))
