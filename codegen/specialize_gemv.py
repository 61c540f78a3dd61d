"""GEMV kernels for the few-row linears of ``target="cuda"`` (decode), and what every CUDA kernel module of
``codegen.specialize_cuda`` shares: its report row, the weight it stands for, the int8 scales and the row quantiser.

A dense 4-bit linear of at most 16 rows runs the W4A16 GEMV (``templates/w4a16_gemv/``), a dense W8A8 one the W8A8
GEMV (``templates/w8a8_gemv/``): both stream the weights over the whole GPU, where the tile kernels' 128-row
tiles make a grid of a few dozen CTAs. The tilings are selection's (``codegen/select_cuda.py``), in the plan.
"""

from __future__ import annotations

import torch

from ..graph import Graph, Op
from ..passes.transform.plan import OpPlan
from ..templates.w4a16_gemv.runtime import W4A16GemvCUDA
from ..templates.w8a8_gemv.runtime import W8A8GemvCUDA
from ..templates.quant.kernel import quantize_rows_kernel
from ..templates.quant.spec import QuantRowsSpec
from ..templates.quant.spec import pick_threads as pick_quant_threads
from ..templates.w4a16_gemv.kernel import w4a16_gemv
from ..templates.w4a16_gemv.spec import W4A16Spec
from ..templates.w8a8_gemv.kernel import w8a8_gemv
from ..templates.w8a8_gemv.spec import W8A8GemvSpec
from .cuda_build import build_cuda

def int8_weight_scale(op_plan: OpPlan, weight: torch.Tensor, k: int) -> torch.Tensor | None:
    """The plan's per-channel int8 scales of ``weight`` (N, K) (None: the int8 kernels quantise each channel
    at its absolute maximum, for scales fitted per group, which they do not take)."""
    quant = op_plan.weight_quant.get(8)
    params = quant.params(weight) if quant is not None else None
    return params.scale[:, 0] if params is not None and params.group >= k else None


def row_quantizer(m: int, k: int, act16: str = "float16"):
    """The folder of the per-token int8 quantiser a W8A8 kernel's 16-bit (``act16``) input goes through."""
    bf16 = act16 == "bfloat16"
    return build_cuda(quantize_rows_kernel, QuantRowsSpec(m, k, threads=pick_quant_threads(k), dtype=act16,
                                                          name=f"quantize_rows_{m or 'M'}x{k}{'_bf16' if bf16 else ''}")
                      ).path


def w8a8_gemv_spec(m: int, n: int, k: int, bias: bool, act: str, act16: str, tiling: dict,
                   rows: int = 0) -> W8A8GemvSpec:
    """The W8A8 GEMV of ``m`` rows (0: any M up to ``rows``) with selection's ``tiling``, named for what it is."""
    rows_name = m or f"Mr{rows}"
    return W8A8GemvSpec(m, n, k, bias=bias, act=act, out=act16, rows=rows, **tiling,
                        name=f"w8a8_gemv_{rows_name}x{n}x{k}{'_sparse' if tiling.get('sparse') else ''}_{act}"
                             f"{'_bias' if bias else ''}{'_bf16' if act16 == 'bfloat16' else ''}")


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


def build_w8a8_gemv(graph: Graph, op: Op, op_plan: OpPlan, view, weight: torch.Tensor, bias, act: str, fused):
    """A few-row W8A8 linear on the W8A8 GEMV, which streams the weights over the whole GPU (the tile kernels'
    128-row tiles make a grid of a few dozen CTAs at decode); bias and activation fused. A sparse tiling
    (``op_plan.kernel.tiles["sparse"]``) holds only the 16x32 chunks of ``weight`` (pruned elements zero) that keep
    a nonzero code, listed in a table."""
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
    return module, report_row(op, "w8a8_gemv", blocks, bits, "tile (table argument)" if sparse else "-", [art]), fused


def build_w4a16_gemv(graph: Graph, op: Op, op_plan: OpPlan, view, weight: torch.Tensor, bias, params):
    """A dense few-row 4-bit linear on the W4A16 GEMV (bias fused; the activation stays a torch op)."""
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
    return module, report_row(op, "w4a16_gemv", "dense", bits, "-", [art]), None


def w4_codes(params, weight: torch.Tensor) -> torch.Tensor:
    """The 4-bit codes of ``weight`` under ``params`` as the kernels store them: uint8 0..15 (symmetric: +8)."""
    codes = params.codes(weight)
    return (codes + 8 if params.zero is None else codes).to(torch.uint8)


def bind(module, graph: Graph, op: Op, view, reference: bool) -> None:
    """Record the graph weight the module stands for (and, for quantised kernels, the weight it applies)."""
    module.weight_name, module.weight_transposed = view[1], op.op in ("addmm", "mm", "matmul")
    if reference:
        module.reference_weight = module.graph_weight().to(graph.tensor(view[1]).dtype)


def torch_row(op: Op, bits: str, why: str) -> dict:
    """The kernel report row of an op left to torch, ``why`` in its key column."""
    return {"op": op.name, "template": "torch", "blocks": "-", "bits": bits, "dismantle": "-",
            "build_s": 0.0, "cached": False, "code_bytes": 0, "key": why}


def report_row(op: Op, template: str, blocks: str, bits: str, dismantle: str, arts: list) -> dict:
    """The kernel report row of an op built from ``arts`` (the first is the kernel it runs by default)."""
    art = arts[0]
    return {"op": op.name, "template": template, "blocks": blocks, "bits": bits, "dismantle": dismantle,
            "build_s": round(art.build_s, 3), "cached": art.cached,
            "code_bytes": sum((a.path / c["file"]).stat().st_size for a in arts for c in a.launch["cubins"].values()),
            "key": art.path.name, "artifact": str(art.path)}
