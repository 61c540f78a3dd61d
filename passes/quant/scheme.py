"""Quantisers: integer weights (symmetric or asymmetric, per tensor / channel / group), fp16/bf16,
dynamic per-row activations, and the clip-ratio search that fits a weight's scales to an op's
output error.

Weights are handled as an ``(N, K)`` matrix: ``N`` output channels (a linear's rows, a conv's
``out_channels``), ``K`` the values each channel reads. A scale (and zero point) covers
``group`` consecutive columns of one channel; ``group == K`` is per channel.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ...errors import PlanError

CLIPS = tuple(1.0 - 0.025 * i for i in range(17))    # clip ratios searched: 1.0 down to 0.6
GRANULARITIES = ("tensor", "channel", "group")
FLOAT_WIDTHS = {16: torch.float16}


@dataclass(frozen=True)
class QuantParams:
    """Integer quantisation of an (N, K) weight: ``w ≈ (q - zero) · scale`` per group of columns.

    Symmetric (``zero is None``): ``q ∈ [-(2^(b-1)-1), 2^(b-1)-1]``. Asymmetric: ``q ∈ [0, 2^b - 1]``
    and ``zero`` holds the integer code of 0 (so pruned zeros stay exactly zero).
    """

    bits: int
    scale: torch.Tensor                 # (N, G) fp32, G = ceil(K / group)
    zero: torch.Tensor | None           # (N, G) fp32 integer-valued, or None (symmetric)
    group: int
    clip: torch.Tensor | None = None    # (N,) the fitted clip ratio of each channel

    @property
    def symmetric(self) -> bool:
        return self.zero is None

    def code_range(self) -> tuple[int, int]:
        if self.symmetric:
            top = 2 ** (self.bits - 1) - 1
            return -top, top
        return 0, 2 ** self.bits - 1

    def expand(self, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Element-wise (N, k) scale and zero point."""
        scale = self.scale.repeat_interleave(self.group, dim=1)[:, :k]
        zero = None if self.zero is None else self.zero.repeat_interleave(self.group, dim=1)[:, :k]
        return scale, zero

    def codes(self, w: torch.Tensor) -> torch.Tensor:
        """Integer codes (as fp32) of the (N, K) weight ``w``."""
        w = w.float()
        q = torch.empty(w.shape, dtype=torch.float32, device=w.device)
        _codes_into(q, w, self.scale, self.zero, self.group, self.code_range())
        return q

    def dequantize(self, w: torch.Tensor) -> torch.Tensor:
        """``w`` quantised and dequantised (fp32, same shape)."""
        q = self.codes(w)
        _dequantize_codes(q, self.scale, self.zero, self.group)
        return q


def _by_group(x: torch.Tensor, t: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (N, K) and per-group ``t`` (N, G) in shapes that broadcast element-wise: ``(N, G, group)`` (a view of a
    contiguous ``x``) where groups tile K, else ``x`` and ``t`` repeated to ``(N, K)``."""
    n, k = x.shape
    if k % group == 0:
        return x.reshape(n, k // group, group), t.unsqueeze(2)
    return x, t.repeat_interleave(group, dim=1)[:, :k]


def _codes_into(q: torch.Tensor, w: torch.Tensor, scale, zero, group: int, code_range) -> None:
    """``q`` (N, K) contiguous fp32 := the codes of ``w`` (``round(w / scale) + zero``, clamped)."""
    qg, s = _by_group(q, scale, group)
    torch.div(_by_group(w, scale, group)[0], s, out=qg)
    q.round_()
    if zero is not None:
        qg.add_(_by_group(q, zero, group)[1])
    q.clamp_(*code_range)


def _dequantize_codes(q: torch.Tensor, scale, zero, group: int) -> None:
    """``q`` (N, K) codes := ``(q - zero) · scale``, in place."""
    qg, s = _by_group(q, scale, group)
    if zero is not None:
        qg.sub_(_by_group(q, zero, group)[1])
    qg.mul_(s)


def weight_params(w: torch.Tensor, bits: int, *, symmetric: bool = True, group: int | None = None,
                  clip: torch.Tensor | float = 1.0) -> QuantParams:
    """Scales (and zero points) of ``w`` (N, K) from its clipped range: ``group`` columns per scale
    (None: per channel), ``clip`` a ratio per channel (or one) applied to the range."""
    group = w.shape[1] if group is None else min(int(group), w.shape[1])
    return _clipped(_ranges(w, group, symmetric), bits, group, clip)


def _ranges(w: torch.Tensor, group: int, symmetric: bool) -> tuple[torch.Tensor, ...]:
    """Each group's range: ``(absolute maximum,)`` (symmetric) or ``(minimum ≤ 0, maximum ≥ 0)``, (N, G) each."""
    n, k = w.shape
    g = -(-k // group)
    wf = torch.nn.functional.pad(w.detach().float(), (0, g * group - k)).reshape(n, g, group)
    if symmetric:
        return (wf.abs().amax(2),)
    return wf.amin(2).clamp(max=0), wf.amax(2).clamp(min=0)


def _clipped(ranges: tuple[torch.Tensor, ...], bits: int, group: int, clip) -> QuantParams:
    """The params of group ranges (:func:`_ranges`) clipped by ``clip`` (a ratio per channel, or one)."""
    n = ranges[0].shape[0]
    clip = torch.as_tensor(clip, dtype=torch.float32, device=ranges[0].device).reshape(-1, 1).expand(n, 1)
    if len(ranges) == 1:
        scale = (ranges[0] * clip).clamp_min(1e-12) / (2 ** (bits - 1) - 1)
        return QuantParams(bits, scale, None, group, clip[:, 0].clone())
    lo, hi = ranges[0] * clip, ranges[1] * clip
    scale = ((hi - lo) / (2 ** bits - 1)).clamp_min(1e-12)
    zero = torch.round(-lo / scale).clamp(0, 2 ** bits - 1)
    return QuantParams(bits, scale, zero, group, clip[:, 0].clone())


def per_tensor(w: torch.Tensor, bits: int, *, symmetric: bool = True, clip: float = 1.0) -> QuantParams:
    """One scale for the whole tensor (stored per channel, all equal)."""
    flat = weight_params(w.reshape(1, -1), bits, symmetric=symmetric, clip=clip)
    n, k = w.shape
    expand = (lambda t: None if t is None else t.expand(n, 1).clone())
    return QuantParams(bits, expand(flat.scale), expand(flat.zero), k, torch.full((n,), float(clip), device=w.device))


def fit_weight(w: torch.Tensor, bits: int, channel_sse: Callable[[torch.Tensor], torch.Tensor], *,
               symmetric: bool = True, granularity: str = "channel", group: int = 128,
               clips=CLIPS) -> tuple[QuantParams, torch.Tensor]:
    """The clip ratio (per channel, or one for ``granularity="tensor"``) minimising the op's output
    error, by search over ``clips``. ``channel_sse(dequantised (N, K) weight)`` returns the op's
    summed squared output error of each output channel. Returns (params, per-channel error)."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    w = w.detach().float()
    tried = []
    for c in clips:
        if granularity == "tensor":
            p = per_tensor(w, bits, symmetric=symmetric, clip=c)
        else:
            p = weight_params(w, bits, symmetric=symmetric, group=group if granularity == "group" else None, clip=c)
        tried.append((p, channel_sse(p.dequantize(w)).double()))
    errs = torch.stack([e for _, e in tried])                             # (clips, N)
    if granularity == "tensor":
        best = int(errs.sum(1).argmin())
        return tried[best][0], errs[best]
    pick = errs.argmin(0)                                                  # per channel
    rows = torch.arange(w.shape[0], device=w.device)
    scale = torch.stack([p.scale for p, _ in tried])[pick, rows]
    zero = None if symmetric else torch.stack([p.zero for p, _ in tried])[pick, rows]
    clip = torch.tensor([clips[i] for i in pick.tolist()], dtype=torch.float32, device=w.device)
    return QuantParams(bits, scale, zero, tried[0][0].group, clip), errs[pick, rows]


FIT_ROWS = 64     # channels fitted to their weight at once (their work stays in cache)


def fit_to_weight(w: torch.Tensor, bits: int, *, symmetric: bool = True, granularity: str = "channel",
                  group: int = 128) -> QuantParams:
    """Scales fitted to the weight alone (no calibration data): per channel, the clip ratio that minimises
    the weight's own squared rounding error ‖w − Q(w)‖². The search of :func:`fit_weight` with that error, run
    ``FIT_ROWS`` channels at a time (each channel's error is its own): the same ratios, on ``w``'s device. A meta
    ``w`` (a model compiled from the meta device) gives meta scales of the right shapes and no clip ratios."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if w.is_meta:
        group = {"channel": None, "tensor": w.shape[1]}.get(granularity, group)
        return replace(weight_params(w, bits, symmetric=symmetric, group=group), clip=None)
    if granularity == "tensor" or not w.shape[0]:
        w = w.detach().float()
        return fit_weight(w, bits, lambda dq: (dq - w).pow(2).sum(1), symmetric=symmetric, granularity=granularity,
                          group=group)[0]
    n, k = w.shape
    group = min(int(group), k) if granularity == "group" else k
    parts = []
    for start in range(0, n, FIT_ROWS):
        rows = w[start:start + FIT_ROWS].detach().float()
        ranges = _ranges(rows, group, symmetric)
        best = _clip_errors(rows, ranges, bits, group).argmin(0)
        parts.append(_clipped(ranges, bits, group, torch.tensor(CLIPS, dtype=torch.float32, device=w.device)[best]))
    zero = None if symmetric else torch.cat([p.zero for p in parts])
    return QuantParams(bits, torch.cat([p.scale for p in parts]), zero, group, torch.cat([p.clip for p in parts]))


def _clip_errors(w: torch.Tensor, ranges: tuple[torch.Tensor, ...], bits: int, group: int) -> torch.Tensor:
    """``(len(CLIPS), N)`` float64: each channel's ‖w − Q(w)‖² at each clip ratio (as ``dequantize`` gives Q)."""
    errs = torch.empty(len(CLIPS), w.shape[0], dtype=torch.float64, device=w.device)
    q = torch.empty(w.shape, dtype=torch.float32, device=w.device)
    for i, c in enumerate(CLIPS):
        p = _clipped(ranges, bits, group, c)
        _codes_into(q, w, p.scale, p.zero, group, p.code_range())
        _dequantize_codes(q, p.scale, p.zero, group)
        errs[i] = q.sub_(w).pow_(2).sum(1)
    return errs


def fake_quant_float(t: torch.Tensor, bits: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Round ``t`` through a 16-bit float format (fp16 unless ``dtype`` says bf16)."""
    return t.to(dtype or FLOAT_WIDTHS[bits]).to(t.dtype)


def fake_quant_static(x: torch.Tensor, bits: int, scale: float) -> torch.Tensor:
    """Symmetric quantisation at one static (calibrated) scale, as a kernel whose epilogue requantises its
    output applies it: ``round(x · RN(1/scale))`` in fp32 clamped to ±(2^(b-1) - 1), times ``scale``."""
    top = 2 ** (bits - 1) - 1
    s = torch.tensor(scale, dtype=torch.float32)
    return (torch.round(x.float() * (1 / s)).clamp(-top, top) * s).to(x.dtype)


def fake_quant_rows(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Dynamic symmetric per-row (per-token) quantisation over the last dimension, as the W8A8
    kernels apply it to their activations at run time."""
    if bits in FLOAT_WIDTHS:
        return fake_quant_float(x, bits)
    from ...templates.quant.spec import quantize_rows
    codes, scale = quantize_rows(x, bits)
    return (codes.float() * scale[..., None]).to(x.dtype)


GRANULARITIES = ("tensor", "channel", "group")
QUANT_SOURCES = ("calibration", "weight")


_FIT_DEVICE: contextvars.ContextVar = contextvars.ContextVar("sparta_fit_device", default=None)


@contextlib.contextmanager
def fit_device(device):
    """Scales :class:`WeightQuant` fits at load (no clip ratios recorded) are searched on ``device`` (None: the
    weight's own), e.g. the GPU a checkpoint is on; the params come back on the weight's device."""
    token = _FIT_DEVICE.set(None if device is None else torch.device(device))
    try:
        yield
    finally:
        _FIT_DEVICE.reset(token)


@dataclass
class WeightQuant:
    """How an op's integer weight is quantised, fitted by calibration or, without calibration data, to
    the weight alone: scales (and zero points) per ``group`` columns of the (N, K) weight, from its range
    clipped by ``clip`` (one ratio per output channel; one in all for ``granularity="tensor"``). No clip
    ratios (a plan compiled from the meta device, ``source="weight"``): the ratios are fitted to the weight when
    its params are asked for (:func:`fit_to_weight`, the rule that gave the recorded ones)."""

    bits: int
    granularity: str
    group: int
    symmetric: bool
    clip: list[float]
    source: str

    def __post_init__(self):
        if self.granularity not in GRANULARITIES or self.source not in QUANT_SOURCES:
            raise PlanError(f"weight quantisation: granularity {self.granularity!r} / source {self.source!r} "
                            f"not in {GRANULARITIES} / {QUANT_SOURCES}")
        self.clip = [float(c) for c in self.clip]

    @property
    def deferred(self) -> bool:
        """Whether the clip ratios are fitted to the weight when its params are asked for (none recorded)."""
        return not self.clip

    def params(self, w):
        """The :class:`~sparta.passes.quant.QuantParams` of the (N, K) weight ``w`` (masked as the kernel holds it)."""
        if self.deferred:
            return self._fitted(w)
        if self.granularity == "tensor":
            return per_tensor(w, self.bits, symmetric=self.symmetric, clip=self.clip[0])
        group = self.group if self.granularity == "group" else None
        return weight_params(w, self.bits, symmetric=self.symmetric, group=group,
                             clip=torch.tensor(self.clip, dtype=torch.float32))

    def _fitted(self, w):
        if self.source != "weight":
            raise PlanError(f"weight quantisation from {self.source!r} records no clip ratios")
        device = _FIT_DEVICE.get()
        src = w if device is None or w.is_meta else w.to(device)
        p = fit_to_weight(src, self.bits, symmetric=self.symmetric, granularity=self.granularity, group=self.group)
        if src is w:
            return p
        return QuantParams(p.bits, p.scale.to(w.device), None if p.zero is None else p.zero.to(w.device), p.group,
                           None if p.clip is None else p.clip.to(w.device))

    @classmethod
    def of(cls, params, granularity: str, source: str) -> WeightQuant:
        """The plan's record of fitted :class:`QuantParams` (which its clip ratios reproduce exactly); meta params
        (a model compiled from the meta device) record none: they are fitted when asked for (:meth:`params`)."""
        clip = [] if params.scale.is_meta else params.clip.tolist() if params.clip is not None else [1.0]
        return cls(params.bits, granularity, int(params.group), params.zero is None,
                   clip[:1] if granularity == "tensor" else clip, source)

