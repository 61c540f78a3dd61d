"""Selection rules of the block-sparse tile kernel (the ``gemm_cuda`` table, ``templates/registry.py``) and the
tilings they read: dense and block-sparse W4A16 / W8A8 tiles, the streaming grid, the fp16/bf16 block tile with its
few-row GEMV and smaller-M buckets. ``bsr_tile`` is the table's last rule: it always answers."""

from __future__ import annotations

from dataclasses import replace

import torch

from ...codegen.select_cuda import GemmSite, choice
from ...passes.transform.plan import KernelChoice
from ...target import Target
from ..registry import rule
from ..w4a16_gemv.select import w4a16_few_rows
from ..w8a8_gemv.select import w8a8_few_rows
from .gemv_spec import BsrGemvSpec


@rule("gemm_cuda", 25)
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
                  "w4a16", tiles, dense_grid=True)


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
    return choice("bsr_linear", "w4a16_dense_tile", why, "w4a16", tiles, note=note, few_rows=few, dense_grid=True)


@rule("gemm_cuda", 35)
def w8a8_dense_tile(site: GemmSite, target: Target):
    if site.bits == "W8A8" and site.k % 16 == 0 and site.dense:
        tiles, hopper = int8_dense_tiles(site.m, site.n, target, site.requantized)
        few = w8a8_few_rows(site, target)
        return choice("bsr_linear", "w8a8_dense_tile", "dense W8A8: int8 tensor cores (wgmma on sm_90)" +
                      (f"; the W8A8 GEMV up to {few[-1][0]} rows" if few else ""), "int8", tiles, hopper,
                      few_rows=few, dense_grid=True)
    return None


@rule("gemm_cuda", 36)
def w8a8_sparse_tile(site: GemmSite, target: Target):
    if site.bits == "W8A8" and site.k % 16 == 0:
        few = w8a8_few_rows(site, target)
        return choice("bsr_linear", "w8a8_sparse_tile", f"block-sparse W8A8 in {site.side}x{site.side} blocks" +
                      (f"; its kept 16x32 chunks on the W8A8 GEMV up to {few[-1][0]} rows" if few else ""),
                      "int8", target.tiles("int8_sparse_tiles", site.side), note=_cover_note(site), few_rows=few)
    return None


@rule("gemm_cuda", 50)
def fp16_stream(site: GemmSite, target: Target):
    if site.side == 64 and not _runs_w4(site) and (tiles := stream_tiles(site.m, site.block_mask(64, 64),
                                                                         target)) is not None:
        return choice("bsr_linear", "fp16_stream", "few kept 64-blocks per block row: the streaming grid", site.act16,
                      tiles, note=_unhonoured(site), gemv=fp16_gemv_tiling(replace(site, gate=False), tiles, target))
    return None


@rule("gemm_cuda", 90)
def bsr_tile(site: GemmSite, target: Target):
    dtype = "w4a16" if _runs_w4(site) else site.act16
    if dtype == "w4a16":
        return choice("bsr_linear", "bsr_tile", f"block-sparse in {site.side}x{site.side} blocks", dtype,
                      target.tiles("fp16_tiles", site.side), note=_unhonoured(site))
    tiles, buckets = tile_buckets(site, target)
    return choice("bsr_linear", "bsr_tile", f"block-sparse in {site.side}x{site.side} blocks", dtype, tiles,
                  note=_unhonoured(site), gemv=fp16_gemv_tiling(site, tiles, target), buckets=buckets)


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
    CTAs than the GPU SMs (measured: benchmarks/RESULTS.md, "CUDA block-sparse fp16 GEMV"). ``one_row``: the tiling
    of a second GEMV built for one row (fewer registers, more CTAs), which one-row calls run."""
    g = target.tiles("bsr_gemv")
    if not site.any_rows and site.m > g["max_rows"]:
        return None
    n = site.n // 2 if site.gate else site.n
    mask = site.block_mask(tiles["bn"], tiles["bk"], n if site.gate else 0)
    counts = mask.sum(dim=1)
    if site.gate:                      # a slot runs the gate's block row and the up's
        counts = counts[: counts.numel() // 2] + counts[counts.numel() // 2:]
    pairs = max(1, -(-int(counts.max()) // 2) if counts.numel() else 1)
    top = 16 if BsrGemvSpec(n, site.k, tiles["bn"], tiles["bk"]).ctas <= target.sms else 8
    warps = min(top, max(2, 1 << (pairs - 1).bit_length()))
    out = dict(rows=g["max_rows"], warps=warps, pdl=g["pdl"])
    if g["max_rows"] > 1 and g.get("one_row_ctas_per_sm"):
        out["one_row"] = dict(warps=warps, loads=one_row_loads(n, site.k, tiles, g["one_row_ctas_per_sm"] * target.sms))
    return out


def one_row_loads(n: int, k: int, tiles: dict, enough_ctas: int) -> int:
    """16-byte loads a lane makes per block in the one-row GEMV: two where that still gives ``enough_ctas`` CTAs,
    else one (more CTAs, each owning fewer rows of a block row; measured: benchmarks/RESULTS.md, "Block-sparse GEMV
    at the 7B decode shapes")."""
    try:
        two = BsrGemvSpec(n, k, tiles["bn"], tiles["bk"], rows=1, loads=2)
    except ValueError:                  # a block row too narrow for two loads a lane
        return 1
    return 2 if two.ctas >= enough_ctas else 1


def pingpong_pays(m: int, n: int, target: Target) -> bool:
    """Whether a dense W8A8 GEMM of ``m`` rows writing int8 codes runs fastest on the ping-pong kernel (a 128x192
    tile per consumer warpgroup): from ``tiles_per_sm`` such tiles per SM (measured: docs/notes/w8a8-tuning.md). A
    graph of any rows asks at its example's rows, as a static compile of them would."""
    return n % 192 == 0 and -(-m // 128) * (n // 192) >= target.tiles("pingpong", "tiles_per_sm") * target.sms


def codes_tiles(picked: KernelChoice, gemm: tuple, target: Target) -> dict:
    """The tiling of the int8-code-writing twin of ``picked``'s wgmma kernel, where it differs: for a dense W8A8
    128x192 wgmma tile where it pays at the example's rows (``gemm``: M, N, K), the ping-pong schedule (a producer and
    two consumer warpgroups on alternate tiles, persistent over the SMs, 4 stages: its two output tiles fit beside
    them only as int8)."""
    h = picked.hopper or {}
    if picked.dtype == "int8" and h.get("mma") == "wgmma" and (h.get("bn"), h.get("tm"), h.get("warps_n")) == \
            (192, 128, 1) and pingpong_pays(gemm[0], gemm[1], target):
        return dict(stages=target.tiles("pingpong", "stages"), producer=True, ctas=target.sms, pingpong=True)
    return {}


def int8_dense_tiles(m: int, n: int, target: Target, requantized: bool = False) -> tuple[dict, dict]:
    """(mma.sync tiles, wgmma tiles) of a dense W8A8 GEMM, over the same blocks: 128x192 where one wave of them
    covers the output, else 128x256 — but 128x192 for an output written as int8 codes where the ping-pong
    kernel pays."""
    one_wave = n % 192 == 0 and -(-m // 128) * (n // 192) <= target.sms
    bn = 192 if one_wave or (requantized and pingpong_pays(m, n, target)) else 256
    dense = target.tiles("int8_dense")
    return dict(dense["mma"], bn=bn, warps_n=bn // 64), dict(dense["wgmma"][str(bn)], bn=bn, mma="wgmma")


def gates(picked: KernelChoice) -> bool:
    """Whether a chosen kernel computes a gated unit in its epilogue: the 16-bit block tile kernel of one tile per CTA
    (and its GEMV)."""
    return picked.kernel == "bsr_linear" and picked.dtype in ("float16", "bfloat16") and not picked.tiles.get("groups")

