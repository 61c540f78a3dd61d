"""Codegen of the 2:4 sparse linear: one kernel built (TVM + nvcc, cached) and wrapped with its packed weight.

:func:`build_nm_linear` builds it for a weight given directly; a planned op's build is ``graph_build.py``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...codegen.cuda_build import built_folder
from .kernel import nm_linear
from .runtime import NmLinearCUDA
from .spec import NmLinearSpec


def build_kernel(spec: NmLinearSpec, out: str | Path | None = None) -> Path:
    """Build ``spec``'s kernel (cached); ``out``: also copy its folder to ``out/<spec.name>``. Returns the folder."""
    return built_folder(nm_linear, spec, out)


def build_nm_linear(weight: torch.Tensor, bias: torch.Tensor | None = None, rows: int = 1,
                    mask: torch.Tensor | None = None, out: str | Path | None = None, **knobs) -> NmLinearCUDA:
    """The module running ``y = act(x · (weight ⊙ mask)ᵀ + bias)`` for up to ``rows`` rows (``mask``: default the
    weight's nonzeros; it must be 2:4): ``knobs`` are the other :class:`NmLinearSpec` fields (``dtype`` defaults to
    the weight's if it is fp16 or bf16)."""
    n, k = weight.shape
    if "dtype" not in knobs and weight.dtype in (torch.float16, torch.bfloat16):
        knobs["dtype"] = "float16" if weight.dtype == torch.float16 else "bfloat16"
    spec = NmLinearSpec(n, k, rows=rows, bias=bias is not None, **knobs)
    return NmLinearCUDA.from_weight(build_kernel(spec, out), weight, bias, mask=mask, spec=spec)


__all__ = ["build_nm_linear", "build_kernel"]
