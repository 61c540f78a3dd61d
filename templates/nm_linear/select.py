"""Selection rule of the 2:4 sparse linear (the ``gemm_cuda`` table, ``templates/registry.py``): a planned ``nm_sparse``
sub-operator (``passes/transform/nm.py``) runs the 2:4 kernels for calls of up to ``NM_MAX_ROWS`` rows (one built for
8 rows, ``KernelChoice.few_rows``, and one for 16 over the same packed weight) and the dense GEMM over a dense copy
above (``KernelChoice.dense_from``); its tiling by shape (:func:`nm_tiling`) and the row
buckets worth a kernel (:func:`nm_rows_buckets`).

The rules below come from the H200 runs of ``benchmarks/bench_cuda_nm_linear.py`` (raw JSON under
``benchmarks/results/nm_linear-h200-*.json``; summary in ``benchmarks/RESULTS.md``, "CUDA 2:4 sparse GEMV"): Llama-7B's
4096x4096, 11008x4096 and 4096x11008 at 1, 4, 8, 16, 32 and 64 rows.
"""

from __future__ import annotations

from ...codegen.select_cuda import GemmSite, choice
from ...passes.transform.nm import NM_FEW_ROWS, NM_MAX_ROWS
from ...target import Target
from ..registry import rule
from .spec import NmLinearError, NmLinearSpec

# The rows a kernel can be built for (one or more n8 MMAs a K tile): a call of M rows runs the smallest bucket >= M.
KERNEL_ROWS = (1, 8, 16, 32, 64)
# The buckets worth building: up to 8 rows the 2:4 kernel beats cuBLAS at every shape (1.6-2.2x at 1-8 rows, run of
# 2026-11-29); at 16 rows the tiled kernels beat it too (1.18-1.44x, w8i8k4t4p); at 32 and 64 rows it lost
# (0.1-0.46x, run of 2026-11-28), so those rows run the dense GEMM (``NM_MAX_ROWS``).
ROWS_BUCKETS = (1, 8, 16)
# The longest K range a CTA should own, by kernel rows (ksplit = the smallest power of two that cuts K under it):
# 1-8 rows: one CTA over K = 4096 (w8 i8 k1: 4096x4096 and 11008x4096 at 1, 4 and 8 rows), two over K = 11008
# (k2: 4096x11008 at 1 and 8 rows); 16 and 32 rows: ranges of ~1024-1376 (k4 at K = 4096, k8 at K = 11008); 64
# rows: 1024 or less (k4 at 4096, k16 at 11008).
MAX_RANGE = {1: 6144, 8: 6144, 16: 2816, 32: 1408, 64: 1024}


def nm_kernel_rows(rows: int) -> int:
    """The rows of the kernel that serves calls of up to ``rows`` rows (1..64)."""
    if not 1 <= rows <= KERNEL_ROWS[-1]:
        raise NmLinearError(f"2:4 sparse linear: rows={rows} must be 1..{KERNEL_ROWS[-1]}")
    return next(b for b in KERNEL_ROWS if b >= rows)


def nm_rows_buckets() -> tuple[int, ...]:
    """The row buckets the family builds a kernel for (a call runs the smallest bucket >= its rows; above the last,
    the dense GEMM)."""
    return ROWS_BUCKETS


def nm_tiling(n: int, k: int, rows: int, sms: int) -> dict:
    """The 2:4 kernel's :class:`NmLinearSpec` knobs (``rows``: the bucket, ``warps``, ``inflight``, ``ksplit``,
    ``tiles``, ``prefetch``) for an (N, K) linear called with up to ``rows`` rows on a GPU of ``sms`` SMs. Measured:
    benchmarks/RESULTS.md, "CUDA 2:4 sparse GEMV"."""
    bucket = nm_kernel_rows(rows)
    tiles, prefetch, least = 1, False, 1
    if bucket == 1:
        # 1 row: w8 i8 where N >= K (4096x4096 1.99x, 11008x4096 1.80x); w4 i16 where K > N (4096x11008: w4i16k2
        # 14.6 us against w8i8 k4 15.5)
        warps, inflight = (8, 8) if n >= k else (4, 16)
    elif bucket == 8 and k > n:
        # 4-8 rows, K longer than N: four row tiles a CTA, K split at least in four, prefetched (4096x11008: w8i8k4t4p
        # 15.0 / 16.9 us at 4 / 8 rows against w8i8k2's 20.0 / 23.2; run of 2026-11-29)
        warps, inflight, tiles, prefetch, least = 8, 8, 4, True, 4
    elif bucket == 8:
        # 4-8 rows: w8 i8 over the whole K (4096x4096 6.1 / 7.2 us; 11008x4096 14.5 / 17.7; the tiled variants
        # within 3% at the sum of 4 and 8 rows)
        warps, inflight = 8, 8
    elif bucket == 16:
        # 9-16 rows: four row tiles a CTA over a quarter of K, prefetched (w8i8k4t4p: 9.2, 22.2, 21.5 us at 4096x4096,
        # 11008x4096, 4096x11008; the best of the sum over the three shapes, run of 2026-11-29)
        warps, inflight, tiles, prefetch, least = 8, 8, 4, True, 4
    else:
        # 32, 64 rows: w4 i8 (w4i8 or w2i16, w4i8 within 5%; run of 2026-11-28)
        warps, inflight = 4, 8
    limit = MAX_RANGE[bucket]
    groups = -(-k // 128)
    ksplit = min(least, groups)
    while ksplit < groups and -(-groups // ksplit) * 128 > limit:
        ksplit *= 2
    # not measured, a guard: at least one CTA an SM (every measured shape had >= 64 CTAs along N)
    while -(-n // (16 * tiles)) * ksplit < sms and ksplit * 2 <= groups:
        ksplit *= 2
    knobs = dict(rows=bucket, warps=warps, inflight=inflight, ksplit=min(ksplit, groups), tiles=tiles,
                 prefetch=prefetch)
    # X of too many rows for shared memory: a longer split (X is staged for one CTA's K range)
    while True:
        try:
            NmLinearSpec(n, k, **knobs)
            return knobs
        except NmLinearError:
            if knobs["ksplit"] >= groups:
                raise
            knobs["ksplit"] = min(groups, knobs["ksplit"] * 2)


@rule("gemm_cuda", 20)
def nm_sparse(site: GemmSite, target: Target):
    if not any(s.template == "nm_sparse" for s in site.plan.subops):
        return None
    if site.requantized:
        return choice("torch", "nm_sparse", "2:4 with int8 output codes: no 2:4 kernel writes them; runs as a torch op")
    many = site.any_rows or site.m > NM_MAX_ROWS
    top = NM_MAX_ROWS if many else site.m
    few = [[NM_FEW_ROWS, "nm_linear", nm_tiling(site.n, site.k, NM_FEW_ROWS, target.sms)]] if top > NM_FEW_ROWS else None
    return choice("nm_linear", "nm_sparse", f"2:4 along K: mma.sp up to {NM_MAX_ROWS} rows"
                  + (", cuBLAS over a dense copy above" if many else ""), site.act16,
                  nm_tiling(site.n, site.k, max(top, NM_FEW_ROWS), target.sms), few_rows=few,
                  dense_from=NM_MAX_ROWS + 1 if many else None)


__all__ = ["nm_sparse", "nm_tiling", "nm_rows_buckets", "nm_kernel_rows"]
