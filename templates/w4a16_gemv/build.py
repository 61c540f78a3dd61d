"""Codegen of the W4A16 GEMV: a dense 4-bit linear of few rows (its tiling selection's), and the spec of the GEMVs
a tile kernel carries for calls of few rows (``templates/bsr_linear/build.py``)."""

from __future__ import annotations

import torch

from ...codegen.cuda_bind import bind, gemm_parts, report_row
from ...codegen.cuda_build import build_cuda
from ...graph import Graph, Op
from ...meta_model import meta_weight
from ...passes.transform.plan import OpPlan
from .kernel import w4a16_gemv
from .runtime import W4A16GemvCUDA
from .spec import W4A16Spec, w4_codes


def w4a16_gemv_spec(m: int, n: int, k: int, group: int, sym: bool, bias: bool, act16: str, tiling: dict,
                    rows: int = 0) -> W4A16Spec:
    """The W4A16 GEMV of ``m`` rows (0: any M up to ``rows``) with selection's ``tiling`` (no ``group``), named for
    what it is."""
    rows_name = m or f"Mr{rows}"
    return W4A16Spec(m, n, k, group=group, sym=sym, bias=bias, dtype=act16, rows=rows, **tiling,
                     name=f"w4a16_gemv_{rows_name}x{n}x{k}_g{group}{'' if sym else '_zero'}{'_bias' if bias else ''}"
                          f"{'_fold' if tiling.get('fold') else ''}{'_ks2' if tiling.get('ksplit') else ''}"
                          f"{'_w%db%d' % (tiling['warps'], tiling['min_ctas']) if tiling.get('min_ctas') else ''}"
                          f"{'_pdl' if tiling.get('pdl') else ''}{'_bf16' if act16 == 'bfloat16' else ''}")



def build(graph: Graph, op: Op, op_plan: OpPlan):
    """A dense few-row 4-bit linear on the W4A16 GEMV (bias fused; the activation stays a torch op): (module,
    report rows, None)."""
    parts = gemm_parts(graph, op, op_plan)
    view, bias = parts.view, parts.bias
    weight = meta_weight(graph, op)                  # meta: placeholders of the shapes (a kernels-only save)
    weight = parts.site.weight if weight is None else weight
    params = op_plan.weight_quant[4].params(weight)
    x_name, _, _, m, n, k = view
    sym = params.zero is None
    tiling = dict(op_plan.kernel.tiles)
    group = tiling.pop("group")
    act16 = "bfloat16" if graph.tensor(x_name).dtype == torch.bfloat16 else "float16"
    spec = w4a16_gemv_spec(m, n, k, group, sym, bias is not None, act16, tiling)
    art = build_cuda(w4a16_gemv, spec)
    scale_el, zero_el = params.expand(k)
    zero = None if sym else zero_el[:, ::group].to(torch.uint8)
    module = W4A16GemvCUDA.from_codes(op.name, x_name, art.path, spec, w4_codes(params, weight),
                                      scale_el[:, ::group], zero, bias, graph.tensor(op.outputs[0]).shape)
    bind(module, graph, op, view, reference=True)
    bits = "W4A16 (bf16)" if act16 == "bfloat16" else "W4A16"
    return module, [report_row(op, "w4a16_gemv", "dense", bits, "-", [art])], None

