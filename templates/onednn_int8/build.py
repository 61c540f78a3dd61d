"""Codegen of oneDNN's int8 linear: the plan's int8 weight codes and per-channel scales bound in an
:class:`Int8LinearCPU` (no kernel is built: the GEMM is torch's)."""

from __future__ import annotations

import time

import torch

from ...graph import Graph, Op
from ...passes.transform.plan import OpPlan
from ...passes.transform.transform_op import gemm_bias, gemm_view, in_weight_layout, weight_matrix
from .runtime import Int8LinearCPU


def build(graph: Graph, op: Op, op_plan: OpPlan):
    """A dense W8A8 op on oneDNN's int8 GEMM (``runtime/cpu_int8.py``); its epilogue is the bias only."""
    x_name, _, _, m, n, k = gemm_view(graph, op)
    weight = torch.where(op_plan.kept(n, k), weight_matrix(graph, op), 0.0)
    quant = op_plan.weight_quant[8]
    params = quant.params(weight)
    scale = params.expand(k)[0][:, 0].contiguous()       # symmetric per channel (or tensor): one scale a row
    codes = params.codes(weight).to(torch.int8)
    bias_name = gemm_bias(op)
    bias = graph.tesa(bias_name).apply(graph.tensor(bias_name).data.to(torch.float32)) if bias_name else None
    t0 = time.perf_counter()
    module = Int8LinearCPU(op.name, x_name, codes, scale, bias, graph.tensor(op.outputs[0]).shape, quant.bits)
    module.weight_name = gemm_view(graph, op)[1]
    module.reference_weight = in_weight_layout(graph, op, module.graph_weight_nk())
    info = {"op": op.name, "template": "onednn_int8", "blocks": "dense", "bits": "W8A8", "dismantle": "none",
            "build_s": round(time.perf_counter() - t0, 3), "cached": False, "code_bytes": 0, "key": ""}
    return module, [info], None

