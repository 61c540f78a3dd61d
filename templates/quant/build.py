"""Codegen of the per-token quantiser the W8A8 families' modules run before their kernels."""

from __future__ import annotations

from ...codegen.cuda_build import build_cuda
from .kernel import quantize_rows_kernel
from .spec import QuantRowsSpec
from .spec import pick_threads as pick_quant_threads


def row_quantizer(m: int, k: int, act16: str = "float16"):
    """The folder of the per-token int8 quantiser a W8A8 kernel's 16-bit (``act16``) input goes through."""
    bf16 = act16 == "bfloat16"
    return build_cuda(quantize_rows_kernel, QuantRowsSpec(m, k, threads=pick_quant_threads(k), dtype=act16,
                                                          name=f"quantize_rows_{m or 'M'}x{k}{'_bf16' if bf16 else ''}")
                      ).path

