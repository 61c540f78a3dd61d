"""Selection rule of the FP8 GEMV (the ``gemm_cuda`` table, ``templates/registry.py``): a planned linear of FP8 (E4M3)
weights beside 16-bit activations (``passes/transform/fp8.py``) runs the FP8 GEMV for calls of few rows and the dense
GEMM over the weight dequantised at each call from the rows where that is cheaper (``KernelChoice.dense_from``,
``dequant``: no dense copy is kept, the model holds its FP8 codes only); its tiling by density."""

from __future__ import annotations

from ...codegen.select_cuda import GemmSite, choice
from ...passes.transform.fp8 import FP8_BLOCK, FP8_FORMAT, FP8_MAX_ROWS, fp8_bytes
from ...passes.transform.profile import HardwareProfile
from ...target import Target
from ..registry import rule
from .spec import suggest_ksplit


def fp8_tiling(n: int, k: int, dense: bool, sms: int) -> dict:
    """The GEMV's knobs (measured: benchmarks/RESULTS.md, "CUDA FP8 weight GEMV", the best at 1-4 rows): tensor-core
    decode; every block kept: 8 warps, 4 blocks in flight, K split for about two CTAs per SM; block-sparse: 16 warps
    a block each, no split. The next kernel launches at the start (PDL "early")."""
    if dense:
        return dict(mma=True, warps=8, inflight=4, ksplit=suggest_ksplit(n, k, sms, 8, 4), trigger="early")
    return dict(mma=True, warps=16, inflight=1, ksplit=1, trigger="early")


def fp8_dense_from(n: int, k: int, n_blocks: int, profile: HardwareProfile) -> int:
    """From how many rows the dense GEMM over the weight dequantised per call is cheaper than the FP8 GEMV at every
    row up to ``FP8_MAX_ROWS`` (by the profile: the GEMV's bytes fit against the dense GEMM and the dequantisation),
    at most ``FP8_MAX_ROWS + 1``."""
    start, nbytes = FP8_MAX_ROWS + 1, fp8_bytes(n_blocks, n)
    dequant = profile.dequant_us(n, k, nbytes)
    for rows in range(FP8_MAX_ROWS, 1, -1):
        if profile.low_bit_gemv_us("fp8_gemv", rows, nbytes) <= profile.dense_us(rows, n, k, 16, 16) + dequant:
            break
        start = rows
    return start


@rule("gemm_cuda", 4)
def fp8_weights(site: GemmSite, target: Target):
    subs = site.plan.subops
    if len(subs) != 1 or subs[0].weight_format != FP8_FORMAT or subs[0].act_format not in ("fp16", "bf16"):
        return None                  # not one E4M3 weight beside 16-bit activations: the format guard says why
    s = subs[0]
    if site.requantized:
        return choice("torch", "fp8_weights", "FP8 weights with int8 output codes: no FP8 kernel writes them; runs as "
                      "a torch op")
    dense = s.block is None or s.n_blocks >= -(-site.n // FP8_BLOCK) * -(-site.k // FP8_BLOCK)
    start = fp8_dense_from(site.n, site.k, s.n_blocks, target.profile)
    many = site.any_rows or site.m > FP8_MAX_ROWS
    picked = choice("fp8_gemv", "fp8_weights", f"{FP8_FORMAT} weights beside {site.act16}: the FP8 GEMV up to "
                    f"{start - 1} rows" + (", cuBLAS over the weight dequantised per call above" if many else ""),
                    "e4m3", fp8_tiling(site.n, site.k, dense, target.sms), dense_from=start if many else None)
    picked.dequant = many
    return picked


__all__ = ["fp8_dense_from", "fp8_tiling", "fp8_weights"]
