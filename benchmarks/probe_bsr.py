"""Run a few bsr_linear kernels once each on one BERT FFN case (for ``ncu`` on the GPU machine).

    ncu --metrics ... python benchmarks/probe_bsr.py ffn1 90 64 NAME [NAME ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_cuda_bsr import ROOT, SHAPES  # noqa: E402
from common import bench_mask  # noqa: E402

from sparta.runtime.bsr_linear import BsrLinearOp, load_spec  # noqa: E402


def main():
    shape, sp, blk, names = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
    m, n, k = SHAPES[shape]
    x = torch.randn(m, k, device="cuda").half()
    w = torch.randn(n, k, device="cuda").half()
    b = torch.randn(n, device="cuda").half()
    mask = bench_mask(-(-n // blk), -(-k // blk), 1 - sp / 100, f"{shape}-{blk}-{sp}-0")
    for name in names:
        folder = ROOT / f"{shape}_{name}"
        op = BsrLinearOp(folder, load_spec(folder), w, mask, b)
        for _ in range(3):
            op(x)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
