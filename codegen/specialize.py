"""Specialisation for ``target="cpu"``: each sparse op plan becomes the kernel module its family builds.

``specialize(graph, plan, target)`` returns the fx replacements (op name → module) and a per-kernel report (template,
blocks, dismantle level, build seconds, cache hit, code bytes). The family is the one selection chose
(``OpPlan.kernel``); its ``build`` (``templates/<family>/build.py``, found through ``templates/registry.py``) makes
the module.
"""

from __future__ import annotations


from ..backend.fx import Passthrough
from ..errors import CodegenError
from ..graph import Graph
from ..passes.transform.groups import check_epilogue
from ..passes.transform.plan import Plan
from ..target import load_target
from ..templates.registry import family
from .cuda_bind import torch_row
from .select_cpu import select_kernels


def specialize(graph: Graph, plan: Plan, target="cpu"):
    """Build every sparse op of ``plan`` for ``target`` (a name or a Target); returns (replacements, kernel report
    rows)."""
    target = getattr(target, "name", target)
    if target == "cpu" and any(p.kind == "sparse" and p.kernel is None for p in plan.ops.values()):
        select_kernels(graph, plan, load_target("cpu"))
    replacements, report = {}, []
    for op_plan in plan.ops.values():
        if op_plan.kind != "sparse":
            continue
        if target != "cpu":
            raise CodegenError(f"no kernels for target {target!r} yet (op {op_plan.op!r})")
        op = graph.op(op_plan.op)
        if op_plan.kernel is not None and op_plan.kernel.kernel == "torch":     # e.g. a format no CPU kernel runs
            report.append(torch_row(op, "-", op_plan.kernel.reason))
            continue
        name = op_plan.kernel.kernel if op_plan.kernel is not None else "cpu_linear"
        module, rows, fused = family(name).builder()(graph, op, op_plan)
        replacements[op.name] = module
        check_epilogue(plan, op.name, [fused.name] if fused is not None else [])
        if fused is not None:
            replacements[fused.name] = Passthrough(fused.inputs[0])
        report += rows
    return replacements, report
