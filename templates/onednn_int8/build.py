"""Codegen of oneDNN's int8 linear: the plan's int8 weight codes and per-channel scales bound in an
:class:`Int8LinearCPU` (no kernel is built: the GEMM is torch's)."""

from __future__ import annotations

import time


from ...graph import Graph, Op
from ...passes.transform.plan import OpPlan
from ...passes.transform.transform_op import gemm_view, in_weight_layout
from .runtime import Int8LinearCPU, int8_operands


def build(graph: Graph, op: Op, op_plan: OpPlan):
    """A dense W8A8 op on oneDNN's int8 GEMM (``runtime/cpu_int8.py``); its epilogue is the bias only."""
    x_name = gemm_view(graph, op)[0]
    quant = op_plan.weight_quant[8]
    codes, scale, bias = int8_operands(graph, op, op_plan)
    t0 = time.perf_counter()
    module = Int8LinearCPU(op.name, x_name, codes, scale, bias, graph.tensor(op.outputs[0]).shape, quant.bits)
    module.weight_name = gemm_view(graph, op)[1]
    module.reference_weight = in_weight_layout(graph, op, module.graph_weight_nk())
    info = {"op": op.name, "template": "onednn_int8", "blocks": "dense", "bits": "W8A8", "dismantle": "none",
            "build_s": round(time.perf_counter() - t0, 3), "cached": False, "code_bytes": 0, "key": ""}
    return module, [info], None

