"""Kernel selection for ``target="cpu"``: which kernel runs each planned GEMM, as an ordered table of rules.

As on CUDA (``select_cuda.py``), each rule is ``(site, target) -> KernelChoice | None`` and the first that answers
wins; the choice lands in ``OpPlan.kernel`` and ``codegen/specialize.py`` builds exactly it. Nothing here needs TVM.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..graph import Graph, Op
from ..passes.transform.plan import KernelChoice, OpPlan, Plan
from ..passes.transform.transform_op import gemm_bias
from ..templates.onednn_int8 import runtime as cpu_int8
from ..target import Target
from ..templates.registry import epilogue_of
from .select_attention import select_attention



@dataclass
class CpuSite:
    """What selection reads about one planned GEMM."""

    op: Op
    plan: OpPlan
    bits: str            # "W8A8", "W32A32", "W4A32" (the plan's sub-operators), or "mixed"
    dense: bool          # one sub-operator covering every weight element
    vector_bias: bool    # no bias, or one per output channel


def _dtype(bits: str) -> str:
    return {"W32A32": "float32", "W8A8": "int8", "W8A32": "w8a32", "W4A32": "w4a32"}.get(bits, "mixed")


def int8_vendor(site: CpuSite, target: Target):
    quant = site.plan.weight_quant.get(8)
    if site.bits == "W8A8" and site.dense and site.vector_bias and cpu_int8.available() and quant is not None \
            and quant.symmetric and quant.granularity in ("channel", "tensor"):
        note = "" if quant.bits == 8 else f"weights as {quant.bits}-bit codes: this CPU's int8 GEMM (no VNNI) " \
            "multiplies u8·s8 pairs into saturating int16"
        return KernelChoice("onednn_int8", "int8_vendor", "dense int8 GEMM: oneDNN u8·s8 through torch", "int8",
                            note=note)
    return None


def cpu_linear(site: CpuSite, target: Target):
    subs = ", ".join(s.template for s in site.plan.subops)
    return KernelChoice("cpu_linear", "cpu_linear", f"sparta's TVM kernels ({subs})", _dtype(site.bits))


GEMM_RULES = (int8_vendor, cpu_linear)


def cpu_site(graph: Graph, op: Op, op_plan: OpPlan) -> CpuSite:
    widths = {(s.weight_bits, s.act_bits) for s in op_plan.subops}
    bits = f"W{next(iter(widths))[0]}A{next(iter(widths))[1]}" if len(widths) == 1 else "mixed"
    bias = gemm_bias(op)
    vector_bias = bias is None or len(graph.tensor(bias).shape) == 1
    dense = len(op_plan.subops) == 1 and op_plan.subops[0].template == "dense"
    return CpuSite(op, op_plan, bits, dense, vector_bias)


def select_kernels(graph: Graph, plan: Plan, target: Target) -> Plan:
    """Choose the kernel of every GEMM the plan runs on sparta (``kind="sparse"``) and of the attention ops
    ``select_attention`` takes, in place; returns the plan."""
    for op_plan in plan.ops.values():
        if op_plan.kind != "sparse":
            continue
        site = cpu_site(graph, graph.op(op_plan.op), op_plan)
        op_plan.kernel = next(c for rule in GEMM_RULES if (c := rule(site, target)) is not None)
        fuses = epilogue_of(op_plan.kernel.kernel)
        if fuses is not None:          # the rest of the planned epilogue runs as torch ops after the kernel
            op_plan.epilogue = [e for e in op_plan.epilogue if e in fuses]
    return select_attention(graph, plan)


__all__ = ["CpuSite", "GEMM_RULES", "select_kernels", "cpu_site"]
