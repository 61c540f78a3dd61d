"""Number formats: what a sub-operator's bits mean (``int8`` or ``fp8_e4m3``, ``fp16`` or ``bf16``).

A TeSA keeps bits (the user's statement); the plan picks one :class:`NumberFormat` of those bits per sub-operator
and role (weights, activations) among those the :class:`~sparta.target.Target` runs. Each format has a torch
reference: ``quantize(x, scale)`` to codes, ``dequantize(codes, scale)`` back, ``fake_quant`` both (the TeSA's
reference path). Scales are per element-broadcastable tensors (:meth:`NumberFormat.scale_of`); formats without
scales (fp16, bf16, fp32) take ``scale=None``. Quantisation saturates: values past ``max_value · scale`` clamp.
No TVM here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import PlanError

KINDS = ("int", "float", "lookup")
# scale granularities: one per tensor, per output channel (a weight's row), per token (an activation's row), per
# ``group`` consecutive columns of a row, per 1x128 / 128x128 block (DeepSeek-V3's fp8 activations / weights)
GRANULARITIES = ("tensor", "channel", "token", "group", "1x128", "128x128")
NF4_TABLE = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
             -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
             0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
             0.7229568362236023, 1.0)      # QLoRA's NormalFloat4: quantiles of N(0, 1) scaled to [-1, 1]


@dataclass(frozen=True)
class NumberFormat:
    """One number format: its width, kind, range and scales, and a torch reference of its rounding."""

    name: str
    bits: int
    kind: str                       # "int" (symmetric codes), "float" (IEEE-like), "lookup" (a table of values)
    signed: bool
    max_value: float                # the largest code magnitude (int: 2^(b-1)-1; float: finfo.max; lookup: 1)
    scales: tuple[str, ...] = ()    # the scale granularities it is used with, the usual first (): needs none
    group: int = 0                  # the usual ``group`` columns per scale (0: none)
    dtype_name: str | None = None   # torch dtype holding the codes, where torch has one
    mantissa_bits: int = 0          # float: explicit mantissa bits
    min_normal: float = 0.0         # float: the smallest normal magnitude
    table: tuple[float, ...] = ()   # lookup: the code values, ascending

    def __post_init__(self):
        if self.kind not in KINDS or any(g not in GRANULARITIES for g in self.scales):
            raise PlanError(f"format {self.name!r}: kind {self.kind!r} / scales {self.scales} not in "
                            f"{KINDS} / {GRANULARITIES}")

    @property
    def needs_scale(self) -> bool:
        return bool(self.scales)

    @property
    def dtype(self) -> torch.dtype | None:
        """The torch dtype of the codes (``torch.float8_e4m3fn``, ``torch.int8``, ...), None where torch has none."""
        return getattr(torch, self.dtype_name) if self.dtype_name else None

    # ---- reference -------------------------------------------------------------------------------------
    def scale_of(self, x: torch.Tensor, granularity: str | None = None, group: int = 0) -> torch.Tensor:
        """Absmax scales of ``x`` (2-D for all but ``"tensor"``) at ``granularity`` (default: the usual), each
        broadcastable to ``x`` (blocks and groups expanded); an all-zero part gets scale 1. No-scale formats: 1."""
        if not self.scales:
            return torch.ones((), dtype=torch.float32)
        granularity = granularity or self.scales[0]
        if granularity not in GRANULARITIES:
            raise PlanError(f"unknown scale granularity {granularity!r}; expected one of {GRANULARITIES}")
        a = x.detach().float().abs()
        if granularity == "tensor":
            amax = a.amax() if a.numel() else torch.zeros(())
        else:
            rows, cols = {"channel": (1, a.shape[1]), "token": (1, a.shape[1]), "1x128": (1, 128),
                          "128x128": (128, 128), "group": (1, group or self.group or a.shape[1])}[granularity]
            n, k = a.shape
            padded = torch.nn.functional.pad(a, (0, -k % cols, 0, -n % rows))
            amax = padded.reshape(padded.shape[0] // rows, rows, -1, cols).amax(dim=(1, 3))
            amax = amax.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[:n, :k]
        scale = amax / self.max_value
        return torch.where(scale > 0, scale, torch.ones_like(scale))

    def quantize(self, x: torch.Tensor, scale: torch.Tensor | float | None = None) -> torch.Tensor:
        """Codes of ``x / scale``: int8-held integers (int), the format's dtype (float; fp32 where torch has none),
        uint8 indices into ``table`` (lookup)."""
        y = x.float() / _scale(scale)
        y = torch.nan_to_num(y, nan=0.0).clamp(-self.max_value, self.max_value)
        if self.kind == "int":
            return torch.round(y).to(torch.int8 if self.bits <= 8 else torch.int32)
        if self.kind == "lookup":
            table = torch.tensor(self.table, dtype=torch.float32)
            return (y.unsqueeze(-1) - table).abs().argmin(dim=-1).to(torch.uint8)
        return y.to(self.dtype) if self.dtype is not None else y

    def dequantize(self, codes: torch.Tensor, scale: torch.Tensor | float | None = None) -> torch.Tensor:
        """fp32 values of ``codes`` at ``scale``."""
        if self.kind == "lookup":
            values = torch.tensor(self.table, dtype=torch.float32)[codes.long()]
        else:
            values = codes.float()
        return values * _scale(scale)

    def fake_quant(self, x: torch.Tensor, scale: torch.Tensor | float | None = None) -> torch.Tensor:
        """``x`` rounded to the format and back (fp32): the reference of what a kernel in this format computes."""
        return self.dequantize(self.quantize(x, scale), scale)

    def error_bound(self, x: torch.Tensor, scale: torch.Tensor | float | None = None) -> torch.Tensor:
        """Per element, the most ``fake_quant`` may move ``x`` where ``|x / scale| <= max_value``: half a step of
        the format's grid at ``x`` (int: 0.5; float: half an ulp, subnormals included; lookup: half the widest gap)."""
        s = _scale(scale)
        if self.kind == "int":
            return 0.5 * s * torch.ones_like(x, dtype=torch.float32)
        if self.kind == "lookup":
            gap = max(b - a for a, b in zip(self.table, self.table[1:]))
            return gap / 2 * s * torch.ones_like(x, dtype=torch.float32)
        half = 2.0 ** -(self.mantissa_bits + 1)
        return torch.maximum((x.float() / s).abs() * half, torch.tensor(self.min_normal * half)) * s


def _scale(scale) -> torch.Tensor | float:
    if scale is None:
        return 1.0
    return scale.float() if isinstance(scale, torch.Tensor) else float(scale)


FORMATS: dict[str, NumberFormat] = {}


def register(fmt: NumberFormat) -> NumberFormat:
    """Add ``fmt`` to the table by its name (a name registered twice raises)."""
    if fmt.name in FORMATS and FORMATS[fmt.name] != fmt:
        raise PlanError(f"number format {fmt.name!r} is registered already")
    FORMATS[fmt.name] = fmt
    return fmt


def get_format(name) -> NumberFormat:
    """The registered format ``name`` (a :class:`NumberFormat` is returned as is)."""
    if isinstance(name, NumberFormat):
        return name
    if not isinstance(name, str) or name not in FORMATS:
        raise PlanError(f"unknown number format {name!r}; known: {', '.join(FORMATS)}")
    return FORMATS[name]


def default_format(bits: int, dtype: torch.dtype | None = None) -> str:
    """The format ``bits`` mean where nothing else is asked: int4/int8 (sparta's integer kernels), bf16 for a
    16-bit ``dtype`` of bfloat16 else fp16, fp32 (any other width: the next of these up)."""
    if bits <= 4:
        return "int4"
    if bits <= 8:
        return "int8"
    if bits <= 16:
        return "bf16" if dtype == torch.bfloat16 else "fp16"
    return "fp32"


def _float(name: str, bits: int, dtype_name: str, scales: tuple[str, ...] = ()) -> NumberFormat:
    info = torch.finfo(getattr(torch, dtype_name))
    return NumberFormat(name, bits, "float", True, float(info.max), scales, 0, dtype_name,
                        round(-math.log2(info.eps)), float(info.smallest_normal))


FP8_SCALES = ("tensor", "channel", "token", "1x128", "128x128")
for _fmt in (NumberFormat("int4", 4, "int", True, 7.0, ("group", "channel"), 128),
             NumberFormat("nf4", 4, "lookup", True, 1.0, ("group",), 64, table=NF4_TABLE),
             NumberFormat("int8", 8, "int", True, 127.0, ("channel", "token", "tensor", "group"), 0, "int8"),
             _float("fp8_e4m3", 8, "float8_e4m3fn", FP8_SCALES),
             _float("fp8_e5m2", 8, "float8_e5m2", FP8_SCALES),
             _float("fp16", 16, "float16"),
             _float("bf16", 16, "bfloat16"),
             _float("fp32", 32, "float32")):
    register(_fmt)

__all__ = ["FORMATS", "GRANULARITIES", "NF4_TABLE", "NumberFormat", "default_format", "get_format", "register"]
