"""The plan's price of one GEMM op were its weight's TeSA another: what calibration's joint plan compares choices by
(``passes/quant/prune.py`` takes it as an argument, so quantization imports nothing of the planner)."""

from __future__ import annotations

import math

from ...errors import PlanError
from .transform_op import transform_gemm


def plan_price(graph, op: str, weight: str, tesa, profile) -> float:
    """The plan's estimate for ``op`` with ``weight``'s TeSA set to ``tesa`` (restored after): its cost over the token
    range the compile plans for (the dense cost times the mean ratio to dense there, as the plan chooses), or at the
    example's rows; inf where it cannot plan it."""
    value = graph.tensor(weight)
    before = value.tesa
    value.tesa = tesa
    try:
        plan = transform_gemm(graph, graph.op(op), profile)
    except PlanError:
        return math.inf
    finally:
        value.tesa = before
    if plan is None:
        return math.inf
    rows = getattr(plan, "rows_us", None)
    if rows:
        return plan.dense_us * sum(c / d for _, c, d in rows) / len(rows)
    return plan.est_us


__all__ = ["plan_price"]
