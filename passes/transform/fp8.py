"""8-bit weights beside 16-bit activations on CUDA run as FP8 (E4M3) weights: the GPU has no int8 weight-only
kernel, and E4M3 with an fp32 scale per output channel holds a weight the TeSA gives 5 to 8 bits. Calls of up to
``FP8_MAX_ROWS`` rows run the FP8 GEMV (``templates/fp8_gemv``) over the kept 32×32 blocks; more rows the dense
GEMM over a dense copy. The plan prices the GEMV by the bytes it streams (a byte a weight of the kept blocks, a
scale per channel), from the profile's ``low_bit_gemv["fp8_gemv"]`` fit."""

from __future__ import annotations

import torch

from ...tesa import TeSA
from .plan import SubOp
from .profile import HardwareProfile

FP8_MAX_ROWS = 16        # calls the FP8 GEMV takes (its kernels serve 1..16 rows); more rows run the dense GEMM
FP8_BLOCK = 32           # the GEMV's block: a 32x32 block of E4M3 codes (1 KiB)
FP8_FORMAT = "fp8_e4m3"


def fp8_block_grid(tesa: TeSA) -> torch.Tensor:
    """The (ceil(N/32), ceil(K/32)) blocks of a 2-d TeSA holding a kept element."""
    return tesa.block_density(FP8_BLOCK, FP8_BLOCK) > 0


def fp8_bytes(n_blocks: int, n: int) -> int:
    """Bytes the FP8 GEMV streams: a KiB a kept 32x32 block and an fp32 scale per output channel."""
    return n_blocks * FP8_BLOCK * FP8_BLOCK + 4 * n


def fp8_option(wtesa: TeSA, profile: HardwareProfile, rows: list[int], dense_at: list[float],
               model_bits: tuple[int, int], asked: bool = False):
    """(costs at ``rows``, [the FP8 sub-operator], description) for a 16-bit weight whose kept elements the TeSA
    gives 5 to 8 bits (4 or fewer have the 4-bit kernels) on a profile that prices the FP8 GEMV, else None: the
    GEMV over the kept 32x32 blocks up to :data:`FP8_MAX_ROWS` rows where it is cheaper than the dense GEMM (selection
    switches there, ``templates/fp8_gemv/select.py``), the dense GEMM's cost elsewhere; None where that is every row
    planned for, unless FP8 was ``asked`` for."""
    histogram = wtesa.bit_histogram()
    bits = {b for b, c in histogram.items() if b and c}
    if profile.target != "cuda" or wtesa.ndim != 2 or "fp8_gemv" not in profile.low_bit_gemv \
            or model_bits != (16, 16) or not bits or not 4 < max(bits) <= 8:
        return None
    n, _ = wtesa.shape
    grid = fp8_block_grid(wtesa)
    n_blocks = int(grid.sum())
    costs = [min(profile.low_bit_gemv_us("fp8_gemv", r, fp8_bytes(n_blocks, n)), d) if r <= FP8_MAX_ROWS else d
             for r, d in zip(rows, dense_at)]
    if not asked and not any(r <= FP8_MAX_ROWS and c < d for r, c, d in zip(rows, costs, dense_at)):
        return None                 # the dense GEMM at every row planned for
    nnz = sum(c for b, c in histogram.items() if b)
    sub = SubOp("block_sparse", 8, 16, (FP8_BLOCK, FP8_BLOCK), n_blocks, nnz, costs[0],
                blocks=TeSA.from_mask(grid, 1), elements=wtesa.map_bits(lambda b: (b != 0).to(torch.uint8) * 8),
                weight_format=FP8_FORMAT)
    return costs, [sub], f"{n_blocks}x{FP8_BLOCK}x{FP8_BLOCK}@W8A16[{FP8_FORMAT}]"


__all__ = ["FP8_BLOCK", "FP8_FORMAT", "FP8_MAX_ROWS", "fp8_block_grid", "fp8_bytes", "fp8_option"]
