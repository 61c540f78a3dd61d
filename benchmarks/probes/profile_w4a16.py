"""Launch W4A16 kernels a few times each on fresh operands, for Nsight Compute (no timing of its own):

    ncu --section SpeedOfLight --section WarpStateStats \
        python benchmarks/probes/profile_w4a16.py b_11008x4096_m16_nt4w8u1_b3_pdl ...

Kernel folders are looked up in ``$SPARTA_CUDA_ARTIFACTS/w4a16`` (default ``artifacts/cuda/w4a16``).
"""

import json
import os
import sys
from pathlib import Path

import torch

from sparta.runtime.cuda import CudaKernel
from sparta.templates.w4a16_gemv.spec import W4A16Spec, pack_weight, quantize, split_buffers

ROOT = Path(os.environ.get("SPARTA_CUDA_ARTIFACTS", Path(__file__).resolve().parents[2] / "artifacts" / "cuda"))


def main(names):
    for name in names:
        folder = ROOT / "w4a16" / name
        spec = W4A16Spec(**json.loads((folder / "spec.json").read_text()))
        w = torch.randn(spec.n, spec.k, device="cuda") * 0.05
        scale, zero = quantize(w, spec.group, spec.sym)
        wq, s, z = pack_weight(w, scale, zero, spec)
        ops = {"X": torch.randn(spec.m, spec.k, device="cuda").half(), "Wq": wq, "S": s, "Z": z,
               "B": torch.randn(spec.n, device="cuda").half() if spec.bias else None,
               "Y": torch.empty(spec.m, spec.n, device="cuda", dtype=torch.float16), **split_buffers(spec, "cuda")}
        kernel = CudaKernel(folder)
        for _ in range(3):
            kernel.call(**{k: v for k, v in ops.items() if v is not None})
        torch.cuda.synchronize()
        print(name, "launched", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
