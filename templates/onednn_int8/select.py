"""Selection rule of oneDNN's int8 GEMM (the ``gemm_cpu`` table, ``templates/registry.py``): a dense W8A8 op with
symmetric per-channel (or per-tensor) weight scales, where this torch has oneDNN's int8 linear."""

from __future__ import annotations

from ...codegen.select_cpu import CpuSite
from ...passes.transform.plan import KernelChoice
from ...target import Target
from ..registry import rule
from . import runtime as cpu_int8


@rule("gemm_cpu", 10)
def int8_vendor(site: CpuSite, target: Target):
    quant = site.plan.weight_quant.get(8)
    if site.bits == "W8A8" and site.dense and site.vector_bias and cpu_int8.available() and quant is not None \
            and quant.symmetric and quant.granularity in ("channel", "tensor"):
        note = "" if quant.bits == 8 else f"weights as {quant.bits}-bit codes: this CPU's int8 GEMM (no VNNI) " \
            "multiplies u8·s8 pairs into saturating int16"
        return KernelChoice("onednn_int8", "int8_vendor", "dense int8 GEMM: oneDNN u8·s8 through torch", "int8",
                            note=note)
    return None

