"""Run a few bsr_linear kernels once each on one BERT FFN case (for ``ncu`` on the GPU machine).

    ncu --metrics ... python benchmarks/probes/probe_bsr.py ffn1 90 64 NAME [NAME ...]

``NAME`` is the artifact folder after ``<shape>_`` (``b64_t128``, ``i8_b64_t128_q8``, ...); block ``0`` runs
the dense kernels (every block kept). W8A8 kernels (``i8_``) get per-row int8 codes; ``_q8`` ones a static
output scale.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # benchmarks/
from bench_cuda_bsr import ROOT, SHAPES  # noqa: E402
from common import bench_mask  # noqa: E402

from sparta.templates.bsr_linear.runtime import BsrLinearOp, load_spec  # noqa: E402
from sparta.templates.quant.spec import quantize_rows  # noqa: E402


def main():
    shape, sp, blk, names = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
    m, n, k = SHAPES[shape]
    x = torch.randn(m, k, device="cuda").half()
    w = torch.randn(n, k, device="cuda").half()
    b = torch.randn(n, device="cuda").half()
    xq = quantize_rows(x)
    for name in names:
        folder = ROOT / f"{shape}_{name}"
        spec = load_spec(folder)
        mask = torch.ones(spec.row_blocks, spec.k_blocks, dtype=torch.bool) if blk == 0 else \
            bench_mask(-(-n // blk), -(-k // blk), 1 - sp / 100, f"{shape}-{blk}-{sp}-0")
        scale = float(x.float().abs().max() * w.float().abs().max()) * 0.05 if spec.out == "int8" else None
        op = BsrLinearOp(folder, spec, w, mask, b, out_scale=scale)
        for _ in range(3):
            op.int8(*xq) if spec.dtype == "int8" else op(x)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
