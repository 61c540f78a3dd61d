"""Kernel selection for ``target="cuda"``: which kernel runs each planned GEMM, as an ordered table of rules.

Each rule is a small function ``(site, target) -> KernelChoice | None`` (TVM dlight's schedule rules, torchao's
``(condition, impl)`` table); the first that answers wins, and the last always does. A site is what the plan and
the graph say about one GEMM (:class:`GemmSite`); the measured tile tables come from the :class:`~sparta.target.Target`
(``passes/profiles/cuda_kernels.json``). The choice lands in the plan (``OpPlan.kernel``), which the plan report
shows and codegen builds exactly; where no kernel honours the plan (a width it cannot run, an op it cannot take)
the choice says so in ``note``. Nothing here needs TVM or a GPU.

Adding a kernel variant: its family folder under ``templates/``, one rule here, its tests (``docs/architecture.md``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..graph import Graph, Op
from ..passes.transform.fusion import fused_activation, fused_gate, is_gated
from ..passes.transform.plan import KernelChoice, OpPlan, Plan
from ..passes.transform.transform_op import gemm_bias, gemm_view, weight_matrix
from ..target import Target
from ..templates.registry import epilogue_of
from ..templates.bsr_linear.gemv_spec import BsrGemvSpec
from ..templates.bsr_linear.packing import block_mask_of
from ..templates.bsr_linear.spec import gate_padded
from .select_attention import select_attention

GEMM_OPS = ("linear", "addmm", "mm", "matmul")
ROW_BUCKETS = (8, 12, 16)         # the low-bit few-row GEMVs' buckets of rows in a graph of any rows


@dataclass
class GemmSite:
    """What selection reads about one planned GEMM."""

    op: Op
    plan: OpPlan
    m: int
    n: int
    k: int
    bits: str                      # "W8A8", "W4A16", "W16A16" (the plan's sub-operators), or "mixed"
    dense: bool                    # every weight element kept
    side: int                      # block side of the plan's cover (32 or 64)
    bias: str                      # "none" | "vector" | "other"
    act: str                       # the fused epilogue activation ("none", "relu", "gelu": exact)
    requantized: bool              # its (activated) output is written as int8 codes at a static scale
    weight: torch.Tensor           # (N, K) fp32, pruned elements zero
    w4_group: int                  # the W4A16 GEMV's scale group for the plan's 4-bit scales, 0 if none fits
    w4_refusal: str                # why the 4-bit scales do not suit the kernels ("" where they do)
    any_rows: bool = False         # the graph was captured dynamic: kernels take any number of rows (m: the hint)
    act16: str = "float16"         # the 16-bit activations' type: "float16", or "bfloat16" for a bf16 model
    gate: bool = False             # the epilogue computes a gated unit act(gate)·up of the output's halves


def choice(kernel: str, rule: str, reason: str, dtype: str = "float16", tiles: dict | None = None,
           hopper: dict | None = None, note: str = "", gemv: dict | None = None,
           buckets: list | None = None, few_rows: list | None = None) -> KernelChoice:
    return KernelChoice(kernel, rule, reason, dtype, dict(tiles or {}), hopper, note, gemv, buckets, few_rows)


# ---- the rules, in order ---------------------------------------------------------------------------------------
def not_a_gemm(site: GemmSite, target: Target):
    if site.op.op not in GEMM_OPS:
        return choice("torch", "not_a_gemm", f"not a GEMM the CUDA template takes ({site.op.op})")
    return None


def k_alignment(site: GemmSite, target: Target):
    if site.k % 8:
        return choice("torch", "k_alignment", f"K={site.k} is not a multiple of 8")
    return None


def bias_shape(site: GemmSite, target: Target):
    if site.bias == "other":
        return choice("torch", "bias_shape", "bias is not a constant vector")
    return None


def w4a16_gemv(site: GemmSite, target: Target):
    if site.bits == "W4A16" and not site.w4_refusal and site.dense and site.w4_group and not site.any_rows \
            and site.m <= target.tiles("gemv_max_rows", "w4a16"):
        return choice("w4a16_gemv", "w4a16_gemv", f"dense 4-bit weights, {site.m} rows: the GEMV streams them over "
                      "the whole GPU", "w4a16", dict(gemv_tiling(site.m, site.n, site.k, site.w4_group),
                                                     group=site.w4_group))
    return None


def w4a16_dense_tile(site: GemmSite, target: Target):
    if site.bits != "W4A16" or site.w4_refusal or not site.dense:
        return None
    if site.any_rows:
        return w4a16_any_rows(site, target)
    tiles = next(t for top, t in target.tiles("w4a16_dense_tiles") if top is None or site.m <= top)
    if tiles is None:
        return choice("torch", "w4a16_dense_tile", f"W4A16 dense GEMM at M={site.m} is slower than cuBLAS fp16 "
                      "(measured, bench_cuda_w4_gemm); runs as a torch op")
    return choice("bsr_linear", "w4a16_dense_tile", "dense 4-bit weights: the tile kernel dequantises in registers",
                  "w4a16", tiles)


def w4a16_any_rows(site: GemmSite, target: Target) -> KernelChoice:
    """Dense 4-bit weights in a graph of any rows: the W4A16 GEMVs up to ``gemv_max_rows`` rows (where the scale
    groups suit them), above them one tile kernel of ``w4a16_dense_tiles`` (its packed records fix the block shape,
    so one tile for every M): the example's, or the first above the GEMVs, over 4-bit weights at every M (where
    cuBLAS fp16 measured faster too: the 4-bit weight is kept)."""
    table = target.tiles("w4a16_dense_tiles")
    few = w4a16_few_rows(site, target)
    low = few[-1][0] if few else 0
    at = max(site.m, low + 1)
    tiles = next((t for top, t in table if t is not None and (top is None or top >= at)))
    slower = [top for top, t in table if t is None and top is not None and top >= at]
    note = (f"calls of {at}-{slower[0]} rows run it too, slower than cuBLAS fp16 there (measured, bench_cuda_w4_gemm):"
            " the 4-bit weight is kept" if slower else "")
    why = "dense 4-bit weights, any rows: " + (f"the W4A16 GEMV up to {low} rows, " if few else "") + \
        "the tile kernel dequantising in registers above"
    return choice("bsr_linear", "w4a16_dense_tile", why, "w4a16", tiles, note=note, few_rows=few)


def w4a16_few_rows(site: GemmSite, target: Target) -> list | None:
    """[[max rows, "w4a16_gemv", tiling], ...] of a graph of any rows: GEMVs up to 8, 12 and 16 rows (the tilings of a
    static compile at those rows; each kernel holds its rows' partial sums), or None where the scale groups do not
    suit the GEMV (benchmarks/RESULTS.md, "CUDA low-bit GEMVs of a default compile")."""
    if not site.w4_group:
        return None
    top = target.tiles("gemv_max_rows", "w4a16")
    return [[rows, "w4a16_gemv", dict(gemv_tiling(rows, site.n, site.k, site.w4_group), group=site.w4_group)]
            for rows in ROW_BUCKETS if rows <= top] or None


def w8a8_few_rows(site: GemmSite, target: Target) -> list | None:
    """[[max rows, "w8a8_gemv", tiling], ...] of a W8A8 op in a graph of any rows: the tensor-core GEMV (K a
    multiple of 32) up to 8, 12 and 16 rows, with a static compile's tilings at those rows — and up to 4 rows its
    own where a static compile's differs there (launched as a programmatic dependent)."""
    top = target.tiles("gemv_max_rows", "w8a8")
    if not site.any_rows or site.k % 32:
        return None
    tilings = {rows: w8a8_gemv_tiling(rows, site.n, site.k, target, not site.dense) for rows in (4, *ROW_BUCKETS)}
    return [[rows, "w8a8_gemv", t] for rows, t in tilings.items()
            if rows <= top and (rows != 4 or t != tilings[8])] or None


def w8a8_gemv(site: GemmSite, target: Target):
    if site.bits == "W8A8" and site.k % 16 == 0 and site.m <= target.tiles("gemv_max_rows", "w8a8") \
            and not site.any_rows and (site.k % 32 == 0 or site.dense):
        sparse = not site.dense
        return choice("w8a8_gemv", "w8a8_gemv", f"{'block-sparse' if sparse else 'dense'} W8A8, {site.m} rows: the "
                      "GEMV streams the weights over the whole GPU", "int8",
                      w8a8_gemv_tiling(site.m, site.n, site.k, target, sparse))
    return None


def w8a8_dense_tile(site: GemmSite, target: Target):
    if site.bits == "W8A8" and site.k % 16 == 0 and site.dense:
        tiles, hopper = int8_dense_tiles(site.m, site.n, target, site.requantized)
        few = w8a8_few_rows(site, target)
        return choice("bsr_linear", "w8a8_dense_tile", "dense W8A8: int8 tensor cores (wgmma on sm_90)" +
                      (f"; the W8A8 GEMV up to {few[-1][0]} rows" if few else ""), "int8", tiles, hopper,
                      few_rows=few)
    return None


def w8a8_sparse_tile(site: GemmSite, target: Target):
    if site.bits == "W8A8" and site.k % 16 == 0:
        few = w8a8_few_rows(site, target)
        return choice("bsr_linear", "w8a8_sparse_tile", f"block-sparse W8A8 in {site.side}x{site.side} blocks" +
                      (f"; its kept 16x32 chunks on the W8A8 GEMV up to {few[-1][0]} rows" if few else ""),
                      "int8", target.tiles("int8_sparse_tiles", site.side), note=_cover_note(site), few_rows=few)
    return None


def fp16_stream(site: GemmSite, target: Target):
    if site.side == 64 and not _runs_w4(site) and (tiles := stream_tiles(site.m, block_mask_of(
            site.weight, 64, 64), target)) is not None:
        return choice("bsr_linear", "fp16_stream", "few kept 64-blocks per block row: the streaming grid", site.act16,
                      tiles, note=_unhonoured(site), gemv=fp16_gemv_tiling(replace(site, gate=False), tiles, target))
    return None


def bsr_tile(site: GemmSite, target: Target):
    dtype = "w4a16" if _runs_w4(site) else site.act16
    if dtype == "w4a16":
        return choice("bsr_linear", "bsr_tile", f"block-sparse in {site.side}x{site.side} blocks", dtype,
                      target.tiles("fp16_tiles", site.side), note=_unhonoured(site))
    tiles, buckets = tile_buckets(site, target)
    return choice("bsr_linear", "bsr_tile", f"block-sparse in {site.side}x{site.side} blocks", dtype, tiles,
                  note=_unhonoured(site), gemv=fp16_gemv_tiling(site, tiles, target), buckets=buckets)


GEMM_RULES = (not_a_gemm, k_alignment, bias_shape, w4a16_gemv, w4a16_dense_tile, w8a8_gemv, w8a8_dense_tile,
              w8a8_sparse_tile, fp16_stream, bsr_tile)


def _runs_w4(site: GemmSite) -> bool:
    return site.bits == "W4A16" and not site.w4_refusal


def _cover_note(site: GemmSite) -> str:
    """How the block kernel's one square cover differs from the plan's sub-operators, if it does."""
    shapes = {("fine" if s.template == "fine_sparse" else "dense" if s.block is None else "%dx%d" % s.block)
              for s in site.plan.subops}
    if not shapes or shapes == {f"{site.side}x{site.side}"}:
        return ""
    return (f"the plan's {' + '.join(sorted(shapes))} cover runs as one {site.side}x{site.side} block cover of its "
            "kept elements (one block shape per kernel)")


def _unhonoured(site: GemmSite) -> str:
    """What the plan asked for that the kernel does not run as planned, and why."""
    cover = _cover_note(site)
    if site.bits in ("W16A16", "W32A32", "W32A16", "W16A32") or _runs_w4(site):
        return cover
    why = site.w4_refusal or (f"K={site.k} is not a multiple of 16" if site.bits == "W8A8" else
                              "no kernel runs this mix of widths")
    return "; ".join(x for x in (f"plan asked for {site.bits}; runs the fp16 kernel ({why})", cover) if x)


# ---- tilings the rules read ------------------------------------------------------------------------------------
def stream_tiles(m: int, mask: torch.Tensor, target: Target) -> dict | None:
    """The streaming grid's tile for an fp16 op in 64-blocks whose block rows keep few blocks, else None:
    about ``ctas_per_sm`` CTAs per SM, ``groups`` block rows per m tile (measured: benchmarks/RESULTS.md)."""
    stream = target.tiles("stream")
    rows = mask.shape[0]
    if mask.all() or mask.sum() > stream["max_row_blocks"] * rows:
        return None
    groups = min(rows, max(1, round(stream["ctas_per_sm"] * target.sms / -(-m // stream["tile"]["tm"]))))
    return dict(stream["tile"], groups=groups)


def tile_buckets(site: GemmSite, target: Target) -> tuple[dict, list | None]:
    """(tiles, buckets) of a 16-bit block tile kernel (``fp16_tile_buckets``: smaller M tiles where few rows leave the
    SMs waiting on a long K loop, measured: benchmarks/RESULTS.md, "CUDA block-sparse fp16 GEMV"). A graph of one M
    takes the tile of the smallest bucket that holds M, the ``fp16_tiles`` one above them (buckets None); a graph of
    any rows takes the ``fp16_tiles`` one and every bucket's, picked per call by its rows."""
    tiles = target.tiles("fp16_tiles", site.side)
    buckets = [[top, dict(t)] for top, t in target.tiles("fp16_tile_buckets").get(str(site.side), [])]
    if site.any_rows:
        return tiles, buckets or None
    return next((t for top, t in buckets if site.m <= top), tiles), None


def fp16_gemv_tiling(site: GemmSite, tiles: dict, target: Target) -> dict | None:
    """The block-sparse GEMV beside a 16-bit tile kernel, over its packed blocks, for calls of up to
    ``bsr_gemv.max_rows`` rows (a graph of any rows, or one compiled for that few), else None: warps enough to take
    the fullest block row's kept blocks in one round (two blocks a warp), up to 16, or up to 8 where the grid has more
    CTAs than the GPU SMs (measured: benchmarks/RESULTS.md, "CUDA block-sparse fp16 GEMV")."""
    g = target.tiles("bsr_gemv")
    if not site.any_rows and site.m > g["max_rows"]:
        return None
    n = site.n // 2 if site.gate else site.n
    weight = gate_padded(site.weight, n, tiles["bn"]) if site.gate else site.weight
    mask = block_mask_of(weight, tiles["bn"], tiles["bk"])
    counts = mask.sum(dim=1)
    if site.gate:                      # a slot runs the gate's block row and the up's
        counts = counts[: counts.numel() // 2] + counts[counts.numel() // 2:]
    pairs = max(1, -(-int(counts.max()) // 2) if counts.numel() else 1)
    top = 16 if BsrGemvSpec(n, site.k, tiles["bn"], tiles["bk"]).ctas <= target.sms else 8
    return dict(rows=g["max_rows"], warps=min(top, max(2, 1 << (pairs - 1).bit_length())), pdl=g["pdl"])


def pingpong_pays(m: int, n: int, target: Target) -> bool:
    """Whether a dense W8A8 GEMM of ``m`` rows writing int8 codes runs fastest on the ping-pong kernel (a 128x192
    tile per consumer warpgroup): from ``tiles_per_sm`` such tiles per SM (measured: docs/notes/w8a8-tuning.md). A
    graph of any rows asks at its example's rows, as a static compile of them would."""
    return n % 192 == 0 and -(-m // 128) * (n // 192) >= target.tiles("pingpong", "tiles_per_sm") * target.sms


def int8_dense_tiles(m: int, n: int, target: Target, requantized: bool = False) -> tuple[dict, dict]:
    """(mma.sync tiles, wgmma tiles) of a dense W8A8 GEMM, over the same blocks: 128x192 where one wave of them
    covers the output, else 128x256 — but 128x192 for an output written as int8 codes where the ping-pong
    kernel pays."""
    one_wave = n % 192 == 0 and -(-m // 128) * (n // 192) <= target.sms
    bn = 192 if one_wave or (requantized and pingpong_pays(m, n, target)) else 256
    dense = target.tiles("int8_dense")
    return dict(dense["mma"], bn=bn, warps_n=bn // 64), dict(dense["wgmma"][str(bn)], bn=bn, mma="wgmma")


def w8a8_gemv_tiling(m: int, n: int, k: int, target: Target, sparse: bool = False) -> dict:
    """The W8A8 GEMV tiling: tensor cores where K allows, dp4a else; 16 warps per 16-row tile where 8 would leave
    fewer than 32 warps per SM, else 8; up to 4 rows launched as a programmatic dependent where two grids fit on
    the SMs at once. ``sparse`` (the kept 16x32 chunks only): 16 warps, one chunk at a time (measured:
    benchmarks/RESULTS.md, "CUDA W8A8 GEMV for decode")."""
    if sparse:
        return dict(warps=16, group=1, mma=True, sparse=True)
    if k % 32:
        return dict(warps=4, group=8, pdl="early" if m <= 4 else "")
    tiles = -(-n // 16)
    warps = 16 if tiles * 8 < target.sms * 32 else 8
    return dict(warps=warps, group=4, mma=True, pdl="early" if m <= 4 and tiles * warps <= target.sms * 32 else "")


def gemv_tiling(m: int, n: int, k: int, group: int) -> dict:
    """The W4A16 GEMV tiling (measured: docs/notes/w4a16-gemv-tuning.md): up to 8 rows two 8-row tiles per CTA
    over 16 warps, launched as a programmatic dependent ("early"), four tiles of 8 warps bounded to 3 CTAs per SM
    where N >= 8192, 2 CTAs per SM for long rows; more rows four tiles over 8 warps, the "late" trigger, 3 CTAs per
    SM where N >= 8192, K split over two CTAs for long rows; the group-128 scale folded into the fp32 sum per chunk
    for two tiles per CTA."""
    tiling = dict(ntile=2, warps=16, unroll=1) if m <= 8 else dict(ntile=4, warps=8, unroll=1)
    if m <= 8 and group == 128:
        tiling["pdl"] = "early"
        if n >= 8192:
            tiling.update(ntile=4, warps=8, min_ctas=3)
        elif k >= 2 * n:
            tiling.update(min_ctas=2)
    if m > 8:
        tiling["pdl"] = "late"
        if n >= 8192:
            tiling["min_ctas"] = 3
        elif k >= 2 * n:
            tiling["ksplit"] = 2
    tiling["fold"] = group == 128 and m <= 8 and tiling["ntile"] == 2
    return tiling


# ---- sites and the pass ----------------------------------------------------------------------------------------
def gemm_site(graph: Graph, op: Op, op_plan: OpPlan, plan: Plan | None = None) -> GemmSite | None:
    """The facts selection reads about a planned GEMM (None: not a GEMM sparta can see as one)."""
    view = gemm_view(graph, op)
    if view is None:
        return None
    _, weight_name, _, m, n, k = view
    widths = {(s.weight_bits, s.act_bits) for s in op_plan.subops}
    bits = f"W{next(iter(widths))[0]}A{next(iter(widths))[1]}" if len(widths) == 1 else "mixed"
    keep = op_plan.kept(n, k)
    side = 64 if max((max(s.block) for s in op_plan.subops if s.block is not None), default=32) >= 64 else 32
    bias_name = gemm_bias(op)
    bias = "none" if bias_name is None else \
        "vector" if graph.tensor(bias_name).shape == (n,) and graph.tensor(bias_name).data is not None else "other"
    fused, unit = fused_activation(graph, op, op_plan), fused_gate(graph, op, op_plan)
    act = unit.activation if unit is not None else op_plan.epilogue[-1] if fused is not None else "none"
    out = unit.mul.outputs[0] if unit is not None else (fused or op).outputs[0]
    group, refusal = 0, ""
    if bits == "W4A16":
        quant = op_plan.weight_quant.get(4)
        if quant is None:
            refusal = "no fitted 4-bit scales"
        elif quant.group < k and quant.group % 32:
            refusal = f"W4A16 kernels need scale groups of a multiple of 32 columns, not {quant.group}"
        else:
            group = gemv_group(quant.group, k)
    weight = torch.where(keep, weight_matrix(graph, op), 0.0) if op.op in GEMM_OPS else torch.zeros(0, 0)
    requantized = plan is not None and out in plan.static_scales
    act16 = "bfloat16" if graph.tensor(view[0]).dtype == torch.bfloat16 else "float16"
    return GemmSite(op, op_plan, m, n, k, bits, bool(keep.all()), side, bias, act, requantized,
                    weight, group, refusal, graph.any_rows, act16, unit is not None)


def gemv_group(group: int, k: int) -> int:
    """The W4A16 GEMV's scale group for scales of ``group`` columns (32, 64 or 128 dividing K), 0 if none fits."""
    g = 128 if group >= 128 else group
    return g if g in (32, 64, 128) and k % g == 0 and (group >= k or group % g == 0) else 0


def select_gemm(site: GemmSite, target: Target) -> KernelChoice:
    for rule in GEMM_RULES:
        picked = rule(site, target)
        if picked is not None:
            return picked
    raise AssertionError("the last rule always answers")


def select_kernels(graph: Graph, plan: Plan, target: Target) -> Plan:
    """Choose the kernel of every GEMM the plan runs on sparta (``kind="sparse"``) and of the attention ops
    ``select_attention`` takes, in place; returns the plan."""
    for op_plan in plan.ops.values():
        if op_plan.kind != "sparse":
            continue
        op = graph.op(op_plan.op)
        site = gemm_site(graph, op, op_plan, plan)
        op_plan.kernel = choice("torch", "not_a_gemm", f"not a GEMM the CUDA template takes ({op.op})") \
            if site is None else select_gemm(site, target)
        fuses = epilogue_of(op_plan.kernel.kernel)
        for _, family, _ in op_plan.kernel.few_rows or ():    # every kernel of the op computes the fused epilogue
            less = epilogue_of(family)
            if less is not None:
                fuses = less if fuses is None else tuple(e for e in fuses if e in less)
        if fuses is not None:          # the rest of the planned epilogue runs as torch ops after the kernel
            op_plan.epilogue = [e for e in op_plan.epilogue if e in fuses]
        if not gates(op_plan.kernel):  # the gated unit runs as torch ops (slices, activation, product)
            op_plan.epilogue = [e for e in op_plan.epilogue if not is_gated(e)]
        elif (unit := fused_gate(graph, op, op_plan)) is not None:
            for o in unit.ops:
                plan.ops[o.name].est_us = 0.0
                plan.ops[o.name].note = f"computed by {op.name}'s epilogue ({op_plan.epilogue[-1]})"
    return select_attention(graph, plan)


def gates(picked: KernelChoice) -> bool:
    """Whether a chosen kernel computes a gated unit in its epilogue: the 16-bit block tile kernel of one tile per CTA
    (and its GEMV)."""
    return picked.kernel == "bsr_linear" and picked.dtype in ("float16", "bfloat16") and not picked.tiles.get("groups")


__all__ = ["GemmSite", "GEMM_RULES", "select_gemm", "select_kernels", "gates", "gemm_site", "stream_tiles",
           "fp16_gemv_tiling",
           "tile_buckets",
           "int8_dense_tiles", "pingpong_pays", "w8a8_gemv_tiling", "gemv_tiling", "gemv_group"]
