"""Codegen of the attention family: no kernel is built (torch's SDPA runs it); the module classifies the
sizes-only mask once per shape."""

from __future__ import annotations

from ...graph import Graph, Op
from ...passes.transform.plan import OpPlan
from .runtime import SizesOnlyMaskAttention


def build(graph: Graph, op: Op, op_plan: OpPlan):
    """(module, report rows, fused op): the op's :class:`SizesOnlyMaskAttention`."""
    names = [op.input_of(role) for role in ("query", "key", "value", "attn_mask")] + list(graph.inputs)
    return SizesOnlyMaskAttention(op.name, names, op.attrs.get("scale"), op.attrs.get("enable_gqa", False)), [], None
