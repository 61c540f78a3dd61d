"""Execution-plan transformation: bit rounding, weighted block cover, sub-operator plans."""

from __future__ import annotations

import math

from ...graph import Graph
from ...target import TARGETS, Target, load_target
from .bitround import BitGroup, asked_fp8, choose_formats, groupings, round_bits
from .cover import ShapeCover, block_cover, check_cover, cover_cost
from .plan import Candidate, OpPlan, Plan, SubOp
from .profile import HardwareProfile, KernelCosts, load_profile
from .shrink import plan_shrink
from .transform_op import (gemm_bias, gemm_view, in_weight_layout, row_points, transform_gemm, weight_matrix,
                           weight_quantisation)


def transform(graph: Graph, target="cpu", *, profile=None, sparse_ops=None, quantization=None, formats=None) -> Plan:
    """Plan every op of ``graph`` for ``target`` (``"cpu"``/``"cuda"`` or a :class:`~sparta.target.Target`, whose
    cost model it reads): GEMM-like ops get the cheapest sub-operator plan by the hardware profile's cost model;
    the others stay torch ops. Then channel shrinking (``shrink.py``): GEMMs whose dropped channels are constant or
    unused run dense on their kept channels where the cost model says it pays.

    Every sub-operator that runs an integer weight width gets its scales in the plan
    (``OpPlan.weight_quant``): calibration's where ``quantization`` (a :class:`QuantReport`, by
    default the graph's last one) fitted that width, else fitted to the weight alone. Calibration's
    static activation scales become ``Plan.static_scales``. ``formats`` (``compile``'s): a weight asked to be FP8
    runs FP8 where it can (its TeSA gives it 5 to 8 bits: ``fp8.py``), whatever the costs."""
    if isinstance(target, Target) or target in TARGETS:
        chosen = load_target(target, profile)
        prof, target = chosen.profile, chosen.name
    else:
        prof = load_profile(profile or target)
        chosen = Target(target, prof)
    plan = Plan(target, {"device": prof.device, "date": prof.date, "source": prof.source})
    fp8_asked = asked_fp8(graph, chosen, formats)
    quantization = quantization if quantization is not None else graph.quantization
    fitted = dict(getattr(quantization, "weights", {}) or {})
    plan.static_scales = dict(getattr(quantization, "static_scales", {}) or {})
    ops_with_templates = sparse_ops if sparse_ops is not None else prof.sparse_ops
    from ...progress import bar
    with bar("transform", len(graph)) as progress:
        for op in graph.ops():
            _plan_op(graph, op, plan, prof, ops_with_templates, fitted, fp8_asked)
            progress.update(1)
    plan_shrink(graph, plan, prof)                                    # channels no output depends on: dropped
    return choose_formats(graph, plan, Target(plan.target, prof))     # each width's default number format


def _plan_op(graph: Graph, op, plan: Plan, prof, ops_with_templates, fitted: dict, fp8_asked=frozenset()) -> None:
    """One op's plan into ``plan.ops``."""
    p = transform_gemm(graph, op, prof, ops_with_templates, fp8_asked)
    if p is None:
        nbytes = sum(_nbytes(graph, t) for t in [*op.inputs, *op.outputs])
        us = prof.memory_us(nbytes)
        p = OpPlan(op.name, op.op, "torch", us, us)
    else:
        p.weight_quant = weight_quantisation(graph, op, p, fitted, prof)
        if stacked := graph.simplified.stacked_linears.get(op.name):
            why = f"runs {', '.join(stacked)} stacked as one linear ({p.weight})"
            p.note = f"{p.note}; {why}" if p.note else why
    plan.ops[op.name] = p


def _nbytes(graph: Graph, name: str) -> int:
    v = graph.tensor(name)
    return math.prod(v.shape) * v.dtype.itemsize


__all__ = ["transform", "Plan", "OpPlan", "SubOp", "Candidate", "HardwareProfile", "KernelCosts", "load_profile",
           "block_cover", "check_cover", "cover_cost", "ShapeCover", "round_bits", "groupings", "BitGroup",
           "gemm_view", "gemm_bias", "transform_gemm", "row_points", "weight_matrix", "in_weight_layout",
           "weight_quantisation"]
