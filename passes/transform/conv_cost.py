"""The cost of a convolution on the block-sparse implicit-GEMM kernel (``templates/conv2d``), against the vendor's.

The kernel visits only the kept (output-channel block × (tap, input-channel block)) blocks, so its work is the dense
convolution's times the kept blocks' share; ``efficiency`` is its throughput per kept block against the vendor's
dense convolution (the target's measured ``conv2d`` table where it has one). A launch is paid either way.
"""

from __future__ import annotations

from .profile import HardwareProfile


def block_sparse_conv_us(dense_us: float, kept_blocks: int, all_blocks: int, efficiency: float,
                         profile: HardwareProfile) -> float:
    """µs of the convolution run over ``kept_blocks`` of ``all_blocks`` by a kernel of ``efficiency``, given the
    vendor's dense estimate ``dense_us``."""
    fixed = min(profile.fixed_us, dense_us)
    share = kept_blocks / max(all_blocks, 1)
    return fixed + (dense_us - fixed) * share / efficiency


__all__ = ["block_sparse_conv_us"]
