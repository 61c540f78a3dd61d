"""GEMV kernels for the few-row linears of ``target="cuda"`` (decode), and what every CUDA kernel module of
``codegen.specialize_cuda`` shares: its report row, the weight it stands for, the int8 scales and the row quantiser.

A dense 4-bit linear of at most 16 rows runs the W4A16 GEMV (``templates/w4a16_gemv/``), a dense W8A8 one the W8A8
GEMV (``templates/w8a8_gemv/``): both stream the weights over the whole GPU, where the tile kernels' 128-row
tiles make a grid of a few dozen CTAs. Tilings are the fastest measured on the H100 (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import torch

from ..graph import Graph, Op
from ..runtime.w4a16_gemv import W4A16GemvCUDA
from ..runtime.w8a8_gemv import W8A8GemvCUDA
from ..templates.quant.kernel import quantize_rows_kernel
from ..templates.quant.spec import QuantRowsSpec
from ..templates.quant.spec import pick_threads as pick_quant_threads
from ..templates.w4a16_gemv.kernel import w4a16_gemv
from ..templates.w4a16_gemv.spec import W4A16Spec
from ..templates.w8a8_gemv.kernel import w8a8_gemv
from ..templates.w8a8_gemv.spec import W8A8GemvSpec
from .cuda_build import build_cuda

HOPPER_SMS = 132                                        # H100/H200 SXM multiprocessors
W8A8_GEMV_ROWS = 16          # dense W8A8 linears of at most this many rows run the W8A8 GEMV


def int8_weight_scale(graph: Graph, weight: str, k: int) -> torch.Tensor | None:
    """Calibration's per-channel int8 scales of ``weight`` (None: quantise at each channel's absolute maximum)."""
    params = graph.meta.get("quant_params", {}).get(weight, {}).get(8)
    return params.scale[:, 0] if params is not None and params.group >= k else None


def row_quantizer(m: int, k: int):
    """The folder of the per-token int8 quantiser a W8A8 kernel's fp16 input goes through."""
    return build_cuda(quantize_rows_kernel, QuantRowsSpec(m, k, threads=pick_quant_threads(k),
                                                          name=f"quantize_rows_{m}x{k}")).path


def w8a8_gemv_tiling(m: int, n: int, k: int, sparse: bool = False) -> dict:
    """The W8A8 GEMV tiling ``compile`` builds for an ``m``-row ``(n, k)`` linear, the fastest measured on the H100
    (bench_cuda_w8a8_gemv.py, RESULTS.md): tensor cores where K allows (1.0-1.3x the HBM floor from 1 to 16 rows;
    dp4a falls to 2-2.4x at 16 rows, issue-bound), 16 warps per 16-row tile where 8 would leave fewer than 32 warps
    per SM (BERT/LLaMA N = 4096: 256 tiles), else 8, 4 chunks per batch. Up to 4 rows launched as a programmatic
    dependent ("early": 4096x4096 at one row 6.9 -> 6.6 us) where two grids fit on the SMs at once; where they do
    not (11008 rows: 15.6 -> 18.3 us) or from 8 rows on (8.4 -> 12.7 us at 16), none. ``sparse`` (the kept 16x32
    chunks only; at 90% a tile keeps about 13 of 128): 16 warps taking one chunk at a time, the fastest or within 4%
    of it on the three shapes at 1 and 16 rows (bench_cuda_w8a8_gemv.py --sparsity 90)."""
    if sparse:
        return dict(warps=16, group=1, mma=True, sparse=True)
    if k % 32:
        return dict(warps=4, group=8, pdl="early" if m <= 4 else "")
    tiles = -(-n // 16)
    warps = 16 if tiles * 8 < HOPPER_SMS * 32 else 8
    return dict(warps=warps, group=4, mma=True, pdl="early" if m <= 4 and tiles * warps <= HOPPER_SMS * 32 else "")


def build_w8a8_gemv(graph: Graph, op: Op, view, weight: torch.Tensor, bias, act: str, fused, sparse: bool = False):
    """A W8A8 linear of <= ``W8A8_GEMV_ROWS`` rows on the W8A8 GEMV, which streams the weights over the whole GPU (the
    tile kernels' 128-row tiles make a grid of a few dozen CTAs at decode); bias and activation fused. ``sparse``:
    only the 16x32 chunks of ``weight`` (pruned elements zero) that keep a nonzero code, listed in a table."""
    x_name, _, _, m, n, k = view
    spec = W8A8GemvSpec(m, n, k, bias=bias is not None, act=act, **w8a8_gemv_tiling(m, n, k, sparse),
                        name=f"w8a8_gemv_{m}x{n}x{k}{'_sparse' if sparse else ''}_{act}{'_bias' if bias is not None else ''}")
    art = build_cuda(w8a8_gemv, spec)
    module = W8A8GemvCUDA.from_weight(op.name, x_name, art.path, spec, weight, int8_weight_scale(graph, view[1], k),
                                      bias, graph.tensor(op.outputs[0]).shape, row_quantizer(m, k))
    bind(module, graph, op, view, reference=True)
    blocks = f"{module.table.numel() - spec.tiles - 1}x16x32" if sparse else "dense"
    return module, report_row(op, "w8a8_gemv", blocks, "W8A8", "tile (table argument)" if sparse else "-", [art]), fused


def gemv_group(params, k: int) -> int:
    """The GEMV's scale group for calibration's scales (32, 64 or 128 dividing K), 0 if none fits."""
    group = 128 if params.group >= 128 else params.group
    return group if group in (32, 64, 128) and k % group == 0 and (params.group >= k or params.group % group == 0) \
        else 0


def gemv_tiling(m: int, n: int, k: int, group: int) -> dict:
    """The W4A16 GEMV tiling ``compile`` builds for an ``m``-row ``(n, k)`` linear: the fastest measured by
    ``benchmarks/bench_cuda_w4a16.py`` (RESULTS.md)."""
    # rows <= 8: two 8-row tiles per CTA over 16 warps; more rows: four tiles over 8 warps (X is re-read per CTA)
    tiling = dict(ntile=2, warps=16, unroll=1) if m <= 8 else dict(ntile=4, warps=8, unroll=1)
    if m <= 8 and group == 128:
        # programmatic dependent launch, the next kernel launching once this one started ("early"): the tail of the
        # previous GEMV overlaps this one's first weight loads (H100, 2026-11-23, chains of GEMVs: 4096x4096 4.8 ->
        # 4.3 us, 4096x11008 10.3 -> 9.3, 11008x4096 10.1 -> 9.3 with four tiles of 8 warps bounded to 3 CTAs per SM)
        tiling["pdl"] = "early"
        if n >= 8192:
            tiling.update(ntile=4, warps=8, min_ctas=3)
        elif k >= 2 * n:
            # long rows on a one-wave grid: 64 registers for 2 CTAs of 16 warps per SM
            tiling.update(min_ctas=2)
    if m > 8:
        # the "late" trigger (the next kernel launches once this one passed its wait; "early" lets grids of several
        # waves pile up): 16 rows on the H100, 4096x4096 7.5 -> 6.5 us, 4096x11008 14.6 -> 14.1, 11008x4096 12.6 ->
        # 11.8 with 3 CTAs per SM
        tiling["pdl"] = "late"
        if n >= 8192:
            tiling["min_ctas"] = 3
        elif k >= 2 * n:
            # few 8-row tiles, long rows: two CTAs split K (4096x11008 at 16 rows: 16.4 -> 14.6 us on the H100;
            # slower where N is large or at batch 1)
            tiling["ksplit"] = 2
    # two tiles per CTA, up to 8 rows, group 128: the scale folded into the fp32 sum per chunk (1-7% faster at batch 1
    # on the H100; slower at 16 rows, where each chunk folds twice the accumulators)
    tiling["fold"] = group == 128 and m <= 8 and tiling["ntile"] == 2
    return tiling


def build_w4a16_gemv(graph: Graph, op: Op, view, weight: torch.Tensor, bias, params, group: int):
    """A dense 4-bit linear of <= 16 rows on the W4A16 GEMV (bias fused; the activation stays a torch op)."""
    x_name, _, _, m, n, k = view
    sym = params.zero is None
    tiling = gemv_tiling(m, n, k, group)
    spec = W4A16Spec(m, n, k, group=group, sym=sym, bias=bias is not None, **tiling,
                     name=f"w4a16_gemv_{m}x{n}x{k}_g{group}{'' if sym else '_zero'}{'_bias' if bias is not None else ''}"
                          f"{'_fold' if tiling['fold'] else ''}{'_ks2' if tiling.get('ksplit') else ''}"
                          f"{'_w%db%d' % (tiling['warps'], tiling['min_ctas']) if tiling.get('min_ctas') else ''}"
                          f"{'_pdl' if tiling.get('pdl') else ''}")
    art = build_cuda(w4a16_gemv, spec)
    scale_el, zero_el = params.expand(k)
    zero = None if sym else zero_el[:, ::group].to(torch.uint8)
    module = W4A16GemvCUDA.from_codes(op.name, x_name, art.path, spec, w4_codes(params, weight),
                                      scale_el[:, ::group].half(), zero, bias, graph.tensor(op.outputs[0]).shape)
    bind(module, graph, op, view, reference=True)
    return module, report_row(op, "w4a16_gemv", "dense", "W4A16", "-", [art]), None


def w4_codes(params, weight: torch.Tensor) -> torch.Tensor:
    """Calibration's 4-bit codes of ``weight`` as the kernels store them: uint8 0..15 (symmetric: +8)."""
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
