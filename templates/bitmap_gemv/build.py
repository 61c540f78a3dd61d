"""Codegen of the bitmap GEMV: one kernel built (TVM + nvcc, cached) and wrapped with its packed weight.

No plan rule selects it yet: :func:`build_bitmap_gemv` builds it for a weight and mask given directly.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...codegen.cuda_build import built_folder
from .kernel import bitmap_gemv
from .runtime import BitmapLinearCUDA
from .spec import BitmapGemvSpec


def build_kernel(spec: BitmapGemvSpec, out: str | Path | None = None) -> Path:
    """Build ``spec``'s kernel (cached); ``out``: also copy its folder to ``out/<spec.name>``. Returns the folder."""
    return built_folder(bitmap_gemv, spec, out)


def build_bitmap_gemv(weight: torch.Tensor, mask: torch.Tensor, bias: torch.Tensor | None = None,
                      rows: int = 1, out: str | Path | None = None, **knobs) -> BitmapLinearCUDA:
    """The module running ``y = act(x · (weight ⊙ mask)ᵀ + bias)`` for up to ``rows`` rows: ``knobs`` are the
    other :class:`BitmapGemvSpec` fields (``dtype`` defaults to the weight's if it is fp16 or bf16)."""
    n, k = weight.shape
    if "dtype" not in knobs and weight.dtype in (torch.float16, torch.bfloat16):
        knobs["dtype"] = "float16" if weight.dtype == torch.float16 else "bfloat16"
    spec = BitmapGemvSpec(n, k, rows=rows, bias=bias is not None, **knobs)
    return BitmapLinearCUDA.from_weight(build_kernel(spec, out), weight, mask, bias, spec)


__all__ = ["build_bitmap_gemv", "build_kernel"]
