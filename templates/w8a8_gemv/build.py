"""Codegen of the W8A8 GEMV: a W8A8 linear of few rows (its tiling selection's; dense, or the kept 16x32 chunks),
and the spec of the GEMVs a tile kernel carries for calls of few rows (``templates/bsr_linear/build.py``)."""

from __future__ import annotations

import torch

from ...codegen.cuda_bind import bind, gemm_parts, report_row
from ...codegen.cuda_build import build_cuda
from ...graph import Graph, Op
from ...passes.transform.plan import OpPlan
from ..quant.build import row_quantizer
from .kernel import w8a8_gemv
from .runtime import W8A8GemvCUDA
from .spec import W8A8GemvSpec, int8_weight_scale  # noqa: F401  (bsr_linear's build reads it here)


def w8a8_gemv_spec(m: int, n: int, k: int, bias: bool, act: str, act16: str, tiling: dict,
                   rows: int = 0) -> W8A8GemvSpec:
    """The W8A8 GEMV of ``m`` rows (0: any M up to ``rows``) with selection's ``tiling``, named for what it is."""
    rows_name = m or f"Mr{rows}"
    blocks = f"_blk{tiling['bn']}x{tiling['bk']}" if tiling.get("bn") else ""
    return W8A8GemvSpec(m, n, k, bias=bias, act=act, out=act16, rows=rows, **tiling,
                        name=f"w8a8_gemv_{rows_name}x{n}x{k}{'_sparse' if tiling.get('sparse') else ''}{blocks}_{act}"
                             f"{'_bias' if bias else ''}{'_bf16' if act16 == 'bfloat16' else ''}")



def build(graph: Graph, op: Op, op_plan: OpPlan):
    """A few-row W8A8 linear on the W8A8 GEMV, which streams the weights over the whole GPU (the tile kernels'
    128-row tiles make a grid of a few dozen CTAs at decode); bias and activation fused. A sparse tiling
    (``op_plan.kernel.tiles["sparse"]``) holds only the 16x32 chunks of ``weight`` (pruned elements zero) that keep
    a nonzero code, listed in a table."""
    parts = gemm_parts(graph, op, op_plan)
    view, weight, bias, act = parts.view, parts.site.weight, parts.bias, parts.site.act
    fused = parts.fused
    x_name, _, _, m, n, k = view
    tiles = op_plan.kernel.tiles
    sparse = bool(tiles.get("sparse"))
    act16 = "bfloat16" if graph.tensor(x_name).dtype == torch.bfloat16 else "float16"
    spec = w8a8_gemv_spec(m, n, k, bias is not None, act, act16, tiles)
    art = build_cuda(w8a8_gemv, spec)
    module = W8A8GemvCUDA.from_weight(op.name, x_name, art.path, spec, weight, int8_weight_scale(op_plan, weight, k),
                                      bias, graph.tensor(op.outputs[0]).shape, row_quantizer(m, k, act16))
    bind(module, graph, op, view, reference=True)
    blocks = f"{module.table.numel() - spec.tiles - 1}x16x32" if sparse else "dense"
    bits = "W8A8 (bf16)" if act16 == "bfloat16" else "W8A8"
    return module, [report_row(op, "w8a8_gemv", blocks, bits, "tile (table argument)" if sparse else "-", [art])], fused

