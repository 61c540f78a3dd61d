"""2:4 masks on CUDA: a weight whose TeSA keeps at most 2 of every 4 consecutive elements along K runs on the 2:4
sparse tensor cores (``templates/nm_linear``) for calls of few rows and on the dense GEMM above them; the plan
prices it by the bytes the 2:4 GEMV streams (half the values and a 2-bit index each: 1.125 bytes an element of a
16-bit weight against 2), from the profile's ``low_bit_gemv["nm_linear"]`` fit."""

from __future__ import annotations

import torch

from ...tesa import TeSA
from .plan import SubOp
from .profile import HardwareProfile

NM_MAX_ROWS = 16         # calls the 2:4 kernels take (one built for 8 rows, one for 16); more rows run the dense GEMM
#                          (measured: benchmarks/RESULTS.md, "CUDA 2:4 sparse GEMV": 1.2-1.4x cuBLAS at 16 rows)
NM_FEW_ROWS = 8          # calls of up to this many rows run the 8-row kernel


def is_two_four(mask: torch.Tensor) -> bool:
    """Whether ``mask`` (N, K) keeps at most 2 of every aligned 4 elements along K (K padded with pruned ones)."""
    if mask.dim() != 2:
        return False
    n, k = mask.shape
    groups = torch.nn.functional.pad(mask.bool(), (0, (-k) % 4)).reshape(n, -1, 4)
    return bool((groups.sum(-1) <= 2).all())


def nm_bytes(n: int, k: int) -> int:
    """Bytes the 2:4 GEMV streams for a 16-bit (N, K) weight: half the values and a 2-bit index per kept slot."""
    k4 = -(-k // 4) * 4
    return n * k4 + n * k4 // 8


def nm_option(wtesa: TeSA, profile: HardwareProfile, rows: list[int], dense_at: list[float],
              model_bits: tuple[int, int]):
    """(costs at ``rows``, [the 2:4 sub-operator], description) for a 16-bit weight whose TeSA is 2:4 on a profile
    that prices the 2:4 GEMV, else None: the GEMV's cost up to :data:`NM_MAX_ROWS` rows, the dense GEMM's above."""
    bits = wtesa.bit_histogram()
    if profile.target != "cuda" or wtesa.ndim != 2 or "nm_linear" not in profile.low_bit_gemv \
            or set(bits) - {0, model_bits[0]} or model_bits[0] != 16 or wtesa.is_dense or not is_two_four(wtesa.mask):
        return None
    n, k = wtesa.shape
    costs = [profile.low_bit_gemv_us("nm_linear", r, nm_bytes(n, k)) if r <= NM_MAX_ROWS else d
             for r, d in zip(rows, dense_at)]
    nnz = int(bits.get(model_bits[0], 0))
    sub = SubOp("nm_sparse", model_bits[0], model_bits[1], None, 0, nnz, costs[0], elements=wtesa)
    return costs, [sub], f"2:4@W{model_bits[0]}A{model_bits[1]}"


__all__ = ["NM_FEW_ROWS", "NM_MAX_ROWS", "is_two_four", "nm_bytes", "nm_option"]
