"""Which attention ops run a sparta module: the registry's ``attention`` rule table (``templates/attention/select.py``),
the same on every target, and the modules its family builds."""

from __future__ import annotations

from ..graph import Graph
from ..passes.simplify import ATTENTION as ATTENTION_OPS
from ..passes.transform.plan import Plan
from ..templates.registry import family, rules


def select_attention(graph: Graph, plan: Plan) -> Plan:
    """Set the kernel of every attention op a rule takes, in place; returns the plan."""
    table = rules("attention")
    for op in graph.ops(ATTENTION_OPS):
        picked = next((c for rule in table if (c := rule(graph, op)) is not None), None)
        if picked is not None and op.name in plan.ops:
            plan.ops[op.name].kernel = picked
    return plan


def attention_modules(graph: Graph, plan: Plan) -> dict:
    """The kernel modules of the attention ops selection gave a sparta kernel, by op name."""
    out = {}
    for op in graph.ops(ATTENTION_OPS):
        op_plan = plan.ops.get(op.name)
        if op_plan is not None and op_plan.kernel is not None and op_plan.kernel.kernel != "torch":
            out[op.name] = family(op_plan.kernel.kernel).builder()(graph, op, op_plan)[0]
    return out


__all__ = ["ATTENTION_OPS", "attention_modules", "select_attention"]
