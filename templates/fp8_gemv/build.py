"""Codegen of the FP8 GEMV: one kernel built (TVM + nvcc, cached) and wrapped with its packed weight.

A plan runs it through ``graph_build.py``; :func:`build_fp8_gemv` builds it for a weight (and block mask) given
directly.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...codegen.cuda_build import built_folder
from .kernel import fp8_gemv
from .runtime import Fp8LinearCUDA
from .spec import Fp8GemvSpec, suggest_ksplit


def build_kernel(spec: Fp8GemvSpec, out: str | Path | None = None) -> Path:
    """Build ``spec``'s kernel (cached); ``out``: also copy its folder to ``out/<spec.name>``. Returns the folder."""
    return built_folder(fp8_gemv, spec, out)


def build_fp8_gemv(weight: torch.Tensor, bias: torch.Tensor | None = None, rows: int = 1,
                   block_mask: torch.Tensor | None = None, out: str | Path | None = None,
                   scales: torch.Tensor | None = None, sms: int | None = None, **knobs) -> Fp8LinearCUDA:
    """The module running ``y = act(x · (s ⊙ W8)ᵀ + bias)`` for up to ``rows`` rows: ``weight`` 16/32-bit (quantised
    here) or ``float8_e4m3fn`` codes with their ``scales``; ``block_mask`` (ceil(N/32), ceil(K/32)) makes it
    block-sparse; ``knobs`` are the other :class:`Fp8GemvSpec` fields (``dtype`` defaults to the weight's if 16-bit;
    ``ksplit`` to :func:`suggest_ksplit` for ``sms`` SMs when given)."""
    n, k = weight.shape
    if "dtype" not in knobs and weight.dtype in (torch.float16, torch.bfloat16):
        knobs["dtype"] = "float16" if weight.dtype == torch.float16 else "bfloat16"
    sparse = block_mask is not None and not bool(torch.as_tensor(block_mask).all())
    if "ksplit" not in knobs and sms:
        kept = float(torch.as_tensor(block_mask).float().mean()) if sparse else 1.0
        knobs["ksplit"] = suggest_ksplit(n, k, sms, knobs.get("warps", 4), knobs.get("inflight", 4), kept)
    spec = Fp8GemvSpec(n, k, rows=rows, bias=bias is not None, sparse=sparse, **knobs)
    return Fp8LinearCUDA.from_weight(build_kernel(spec, out), weight, bias, block_mask=block_mask if sparse else None,
                                     spec=spec, scales=scales)


__all__ = ["build_fp8_gemv", "build_kernel"]
