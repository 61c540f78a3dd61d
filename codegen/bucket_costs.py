"""The estimate per bucket of rows of a chosen CUDA kernel (``KernelChoice.bucket_us``): each bucket priced by the cost
of the kernel that runs there, never by the plan's cover model at those rows.

The cost profile (``passes/profiles/cuda.json``) prices the block-sparse GEMV by its one-row block costs
(``HardwareProfile.gemv_us``), the tile kernels by their block costs per row over whole M tiles
(``tile_us``; a dense grid by the kernel's dense rate, ``dense_tile_us``), the low-bit GEMVs by the bytes they stream
(``low_bit_gemv_us``); a kernel it has no cost for gets no estimate (None), which the plan report says. Each bucket is priced at its top rows, the last at the
planned range's end (at least one row above the bucket before it). Nothing here needs TVM or a GPU.
"""

from __future__ import annotations

from ..errors import PlanError
from ..passes.transform.plan import KernelChoice
from ..passes.transform.profile import HardwareProfile

BITS = {"float16": (16, 16), "bfloat16": (16, 16), "int8": (8, 8), "w4a16": (4, 16)}   # kernel dtype -> (W, A) bits


def bucket_estimates(site, picked: KernelChoice, profile: HardwareProfile, last_rows: int,
                     dense_bits: tuple[int, int]) -> list | None:
    """``[[max rows, kernel, rows, est µs, dense µs], ...]`` per entry of ``picked.by_rows()`` (``site``: the
    ``GemmSite``; ``last_rows``: the rows the last bucket is priced at, the planned range's end; ``dense_bits``: the
    dense GEMM's widths), or None for a choice of one kernel or not the block-sparse family."""
    runs = picked.runs_by_rows()
    if picked.kernel not in ("bsr_linear", "nm_linear", "fp8_gemv") or len(runs) < 2:
        return None
    out, low, blocks = [], 0, {}
    for top, label, what, tiles in runs:
        rows = top if top is not None else max(last_rows, low + 1)
        dense = profile.dense_us(rows, site.n, site.k, *dense_bits)
        est = dense + (dequant_us(site, picked, profile) if picked.dequant else 0.0) if what == "dense" \
            else kernel_us(site, picked, what, tiles, rows, profile, blocks)
        out.append([top, label, rows, None if est is None else round(est, 3), round(dense, 3)])
        low = rows
    return out


def dequant_us(site, picked: KernelChoice, profile: HardwareProfile) -> float:
    """The per-call dequantisation ``picked`` pays before its dense GEMM where it runs one (``KernelChoice.dequant``):
    the packed codes and scales read (the FP8 GEMV's, or the W4A16 GEMVs'), the 16-bit weight written."""
    if picked.kernel == "fp8_gemv":
        from ..passes.transform.fp8 import fp8_bytes
        return profile.dequant_us(site.n, site.k, fp8_bytes(sum(s.n_blocks for s in site.plan.subops), site.n))
    group = next((t.get("group") for _, f, t in picked.few_rows or () if f == "w4a16_gemv"), None) or 128
    return profile.dequant_us(site.n, site.k, w4_bytes(site.n, site.k, group))


def w4_bytes(n: int, k: int, group: int) -> int:
    """Bytes of a W4A16 GEMV's packed weight: int4 codes and a 16-bit scale and zero point a group."""
    return n * k // 2 + n * k // max(group, 1) * 4


def kernel_us(site, picked: KernelChoice, what: str, tiles: dict, rows: int, profile: HardwareProfile,
              blocks: dict | None = None) -> float | None:
    """The cost of one kernel of ``picked`` (``what``/``tiles``: an entry of ``runs_by_rows``) at ``rows`` rows, or
    None where the profile has no cost for it. ``blocks``: a cache of kept-block counts by block shape."""
    if what in ("w4a16_gemv", "w8a8_gemv"):               # dense codes and their scales, streamed once
        n, k = site.n, site.k
        nbytes = w4_bytes(n, k, tiles.get("group") or 128) if what == "w4a16_gemv" else n * k + 4 * n
        return profile.low_bit_gemv_us(what, rows, nbytes)
    if what == "nm_linear":                               # 2:4: half the values and their 2-bit indices
        from ..passes.transform.nm import nm_bytes
        return profile.low_bit_gemv_us("nm_linear", rows, nm_bytes(site.n, site.k))
    if what == "fp8_gemv":                                # E4M3 codes of the kept 32x32 blocks, a scale a channel
        from ..passes.transform.fp8 import fp8_bytes
        n_blocks = sum(s.n_blocks for s in site.plan.subops)
        return profile.low_bit_gemv_us("fp8_gemv", rows, fp8_bytes(n_blocks, site.n))
    if what not in ("bsr_gemv", "tile", "bsr_linear"):
        return None
    wb, ab = BITS.get(picked.dtype, (16, 16))
    try:
        profile.kernel(wb, ab)
    except PlanError:
        return None
    main = picked.tiles
    if what == "bsr_linear" and picked.dense_grid:
        return profile.dense_tile_us(rows, main.get("tm", 128), site.n, site.k, wb, ab)
    shape = (main["bn"], main["bk"])
    n_blocks = kept_blocks(site, shape, blocks)
    if what == "bsr_gemv":
        return profile.gemv_us(n_blocks, shape, rows, wb, ab, site.k)
    return profile.tile_us(n_blocks, shape, rows, tiles.get("tm", main.get("tm", 128)), wb, ab, site.k)


def dense_switch_rows(site, picked: KernelChoice, profile: HardwareProfile, end: int,
                      dense_bits: tuple[int, int], extra_us: float = 0.0) -> int | None:
    """From how many rows calls run the dense GEMM (``KernelChoice.dense_from``) where the plan switches to it: the
    fewest rows from which, up to the planned range's ``end``, the kernel that would run costs more than dense at
    every row tried (every row to 256, then steps of 1/64 of the rows), by the costs :func:`bucket_estimates`
    reports (``extra_us``: what the dense GEMM pays beside, a per-call dequantisation); None where the kernels win
    at ``end`` or have no cost."""
    runs, blocks = picked.runs_by_rows(), {}

    def loses(rows: int) -> bool:
        _, _, what, tiles = next(r for r in runs if r[0] is None or rows <= r[0])
        est = kernel_us(site, picked, what, tiles, rows, profile, blocks)
        return est is not None and est > profile.dense_us(rows, site.n, site.k, *dense_bits) + extra_us

    if not loses(end):
        return None
    rows = end
    while rows > 1:
        step = 1 if rows <= 256 else rows // 64
        if not loses(rows - step):
            break
        rows -= step
    return rows


def dense_widths(graph, op, profile: HardwareProfile) -> tuple[int, int]:
    """The (weight, activation) widths of the op's dense GEMM: the model's, rounded up as the plan's dense path."""
    from ..passes.gemm import gemm_view
    from ..tesa import bits_of_dtype
    x, w = gemm_view(graph, op)[:2]
    widths = profile.act_widths()
    return tuple(profile.round_up(bits_of_dtype(graph.tensor(t).dtype), widths) for t in (w, x))


def kept_blocks(site, shape: tuple[int, int], cache: dict | None = None) -> int:
    """The blocks of ``shape`` the kernels over the site's packed weight compute (a gated kernel: both halves')."""
    if cache is not None and shape in cache:
        return cache[shape]
    n = site.n // 2 if site.gate else site.n
    count = int(site.block_mask(shape[0], shape[1], n if site.gate else 0).sum())
    if cache is not None:
        cache[shape] = count
    return count


__all__ = ["bucket_estimates", "dense_widths", "kernel_us", "kept_blocks"]
