"""Codegen of the conv2d family: one spec built (TVM + nvcc, cached) and wrapped with its packed weight."""

from __future__ import annotations

from pathlib import Path

import torch

from ...codegen.cuda_build import build_cuda, save_dir
from .kernel import conv2d_kernel
from .runtime import Conv2dCUDA
from .spec import Conv2dSpec


def build_conv2d(spec: Conv2dSpec, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 blocks: torch.Tensor | None = None, op_name: str | None = None,
                 out: str | Path | None = None) -> Conv2dCUDA:
    """The kernel of ``spec`` over ``weight`` (Cout, Cin, KH, KW), its ``blocks`` (default: those holding a nonzero)
    packed; ``out``: also copy the kernel folder to ``out/<spec.name>``."""
    art = build_cuda(conv2d_kernel, spec)
    folder = save_dir(art, Path(out) / spec.name) if out is not None else art.path
    return Conv2dCUDA.from_weight(op_name or spec.name, folder, spec, weight, bias, blocks)


__all__ = ["build_conv2d"]
