"""Selection rules of the W4A16 GEMV (the ``gemm_cuda`` table, ``templates/registry.py``): dense 4-bit weights at
few rows, and the GEMVs beside a tile kernel in a graph of any rows (``KernelChoice.few_rows``)."""

from __future__ import annotations

from ...codegen.select_cuda import ROW_BUCKETS, GemmSite, choice
from ...target import Target
from ..registry import rule


@rule("gemm_cuda", 20)
def w4a16_gemv(site: GemmSite, target: Target):
    if site.bits == "W4A16" and not site.w4_refusal and site.dense and site.w4_group and not site.any_rows \
            and site.m <= target.tiles("gemv_max_rows", "w4a16"):
        return choice("w4a16_gemv", "w4a16_gemv", f"dense 4-bit weights, {site.m} rows: the GEMV streams them over "
                      "the whole GPU", "w4a16", dict(gemv_tiling(site.m, site.n, site.k, site.w4_group),
                                                     group=site.w4_group))
    return None


def w4a16_few_rows(site: GemmSite, target: Target) -> list | None:
    """[[max rows, "w4a16_gemv", tiling], ...] of a graph of any rows: GEMVs up to 8, 12 and 16 rows (the tilings of a
    static compile at those rows; each kernel holds its rows' partial sums), or None where the scale groups do not
    suit the GEMV (benchmarks/RESULTS.md, "CUDA low-bit GEMVs of a default compile")."""
    if not site.w4_group:
        return None
    top = target.tiles("gemv_max_rows", "w4a16")
    return [[rows, "w4a16_gemv", dict(gemv_tiling(rows, site.n, site.k, site.w4_group), group=site.w4_group)]
            for rows in ROW_BUCKETS if rows <= top] or None


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

