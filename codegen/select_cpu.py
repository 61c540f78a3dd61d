"""Kernel selection for ``target="cpu"``: which kernel runs each planned GEMM, as an ordered table of rules.

As on CUDA (``select_cuda.py``), each rule is ``(site, target) -> KernelChoice | None`` and the first that answers
wins: the registry's ``gemm_cpu`` table (``templates/<family>/select.py``). The choice lands in ``OpPlan.kernel``
(with each sub-operator's kernel variant) and the family's ``build`` builds exactly it. Nothing here needs TVM.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..graph import Graph, Op
from ..passes.transform.groups import fuse
from ..passes.transform.plan import KernelChoice, OpPlan, Plan
from ..passes.transform.transform_op import gemm_bias, gemm_view
from ..target import Target
from ..templates.registry import epilogue_of, rules
from .select_attention import select_attention


@dataclass
class CpuSite:
    """What selection reads about one planned GEMM."""

    op: Op
    plan: OpPlan
    bits: str            # "W8A8", "W32A32", "W4A32" (the plan's sub-operators), or "mixed"
    dense: bool          # one sub-operator covering every weight element
    vector_bias: bool    # no bias, or one per output channel
    m: int = 0           # rows of the example
    any_rows: bool = False  # the graph was captured dynamic: kernels take any number of rows


def cpu_site(graph: Graph, op: Op, op_plan: OpPlan) -> CpuSite:
    widths = {(s.weight_bits, s.act_bits) for s in op_plan.subops}
    bits = f"W{next(iter(widths))[0]}A{next(iter(widths))[1]}" if len(widths) == 1 else "mixed"
    bias = gemm_bias(op)
    vector_bias = bias is None or len(graph.tensor(bias).shape) == 1
    dense = len(op_plan.subops) == 1 and op_plan.subops[0].template == "dense"
    view = gemm_view(graph, op)
    return CpuSite(op, op_plan, bits, dense, vector_bias, view[3] if view else 0, graph.any_rows)


CPU_FORMATS = ("int4", "int8", "fp32")     # the number formats (sparta.formats) some CPU kernel family runs


def not_a_format_we_run(op_plan: OpPlan) -> KernelChoice | None:
    """A format no CPU kernel runs (fp8 or nf4 from a profile listing them, ...): torch, saying why; never another
    format instead."""
    for role, fmt in ((r, f) for s in op_plan.subops for r, f in (("weights", s.weight_format),
                                                                   ("activations", s.act_format))):
        if fmt not in CPU_FORMATS:
            return KernelChoice("torch", "not_a_format_we_run", f"{fmt} {role}: no sparta CPU kernel for {fmt} yet; "
                                "runs as a torch op at the model's dtype", "float32")
    return None


def select_kernels(graph: Graph, plan: Plan, target: Target) -> Plan:
    """Choose the kernel of every GEMM the plan runs on sparta (``kind="sparse"``) and of the attention ops
    ``select_attention`` takes, in place; returns the plan."""
    for op_plan in plan.ops.values():
        if op_plan.kind != "sparse":
            continue
        site = cpu_site(graph, graph.op(op_plan.op), op_plan)
        op_plan.kernel = not_a_format_we_run(op_plan) or \
            next(c for rule in rules("gemm_cpu") if (c := rule(site, target)) is not None)
        fuses = epilogue_of(op_plan.kernel.kernel)
        if fuses is not None:          # the rest of the planned epilogue runs as torch ops after the kernel
            op_plan.epilogue = [e for e in op_plan.epilogue if e in fuses]
    fuse(graph, plan, target)
    return select_attention(graph, plan)


__all__ = ["CPU_FORMATS", "CpuSite", "cpu_site", "not_a_format_we_run", "select_kernels"]
