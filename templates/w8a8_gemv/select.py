"""Selection rules of the W8A8 GEMV (the ``gemm_cuda`` table, ``templates/registry.py``): W8A8 weights at few rows,
and the GEMVs beside a tile kernel in a graph of any rows (``KernelChoice.few_rows``)."""

from __future__ import annotations

from ...codegen.select_cuda import ROW_BUCKETS, GemmSite, choice
from ...target import Target
from ..registry import rule


@rule("gemm_cuda", 30)
def w8a8_gemv(site: GemmSite, target: Target):
    if site.bits == "W8A8" and site.k % 16 == 0 and site.m <= target.tiles("gemv_max_rows", "w8a8") \
            and not site.any_rows and (site.k % 32 == 0 or site.dense):
        sparse = not site.dense
        return choice("w8a8_gemv", "w8a8_gemv", f"{'block-sparse' if sparse else 'dense'} W8A8, {site.m} rows: the "
                      "GEMV streams the weights over the whole GPU", "int8",
                      w8a8_gemv_tiling(site.m, site.n, site.k, target, sparse))
    return None


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

