"""The per-token int8 quantiser's spec and torch reference (TVM-free): ``quantize_rows`` is what the kernel
(``kernel.py``) computes bit for bit, and the per-token quantisation every W8A8 reference and module uses.

``XQ[m, :] = clamp(round(X[m, :] / s[m]), ±127)``, ``s[m] = max|X[m, :]| · (1/127)`` (fp32 division, round half to
even). ``threads=32``: a warp per row, four rows per CTA; more: a CTA per row.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class QuantRowsSpec:
    m: int                      # 0: any number of rows (M a kernel argument)
    k: int                      # a multiple of 8 (16-byte rows)
    threads: int = 32           # threads per row: 32 = a warp per row (4 rows per CTA), 64..512 = a CTA per row
    dtype: str = "float16"      # X: "float16" or "bfloat16"
    name: str = "quantize_rows"

    def __post_init__(self):
        if self.m < 0 or self.k <= 0 or self.k % 8:
            raise ValueError(f"spec {self.name}: M must be positive or 0 (any number of rows), K positive and "
                             f"K={self.k} a multiple of 8")
        if self.threads not in (32, 64, 128, 256, 512):
            raise ValueError(f"spec {self.name}: threads must be a power of two from 32 to 512")
        if self.dtype not in ("float16", "bfloat16"):
            raise ValueError(f"spec {self.name}: dtype {self.dtype!r} must be 'float16' or 'bfloat16'")
        if -(-self.k // 8 // self.threads) > 32:
            raise ValueError(f"spec {self.name}: K={self.k} needs more than 32 chunks per thread; use more threads")

    @property
    def rows_per_cta(self) -> int:
        return 4 if self.threads == 32 else 1

    def key(self) -> dict:
        d = asdict(self)
        if self.dtype == "float16":
            del d["dtype"]
        return d


def pick_threads(k: int) -> int:
    """A warp per row up to 16 chunks (4096 columns) per lane, else a CTA per row with at most 16 per thread."""
    chunks, threads = -(-k // 8), 32
    while threads < 512 and -(-chunks // threads) > 16:
        threads *= 2
    return threads


def quantize_rows(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row codes and fp32 scales over the last dimension (activations per token; weights per
    channel): scale = max|x| · (1/top) in fp32, code = round(x / scale) clamped to ±top, top = 2^(bits-1) - 1.
    The one definition of this rounding rule: the CUDA kernels, the CPU W8A8 path and calibration all use it."""
    top = 2 ** (bits - 1) - 1
    scale = x.float().abs().amax(-1).clamp_min(1e-12) * (1.0 / top)   # the reciprocal, as the kernel does
    codes = torch.round(x.float() / scale[..., None]).clamp(-top, top)
    return codes.to(torch.int8) if bits <= 8 else codes, scale