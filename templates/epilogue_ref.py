"""The CUDA kernels' epilogue in torch (TVM-free): activations, the fast GELUs' fp32 twins, int8 output codes.

The kernels' epilogue (``templates/epilogue.py``) adds the bias, applies the activation and writes fp16 or, with
``out="int8"``, int8 codes of one static scale; here are its vocabulary, the constants of its GELUs and the torch
functions the kernel families' references compute it with.
"""

from __future__ import annotations

import math

import torch

ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu")  # gelu: exact (erf), as torch's default; gelu_tanh: the
                                                              # tanh form
OUTPUTS = ("float16", "bfloat16", "int8")              # int8: codes of one static scale (requantised)

# The epilogue's GELUs (``epilogue.gelu_erf`` / ``gelu_tanh``) and their fp32 twins here. Exact GELU:
# h = ½·erfc(|x|/√2) by Abramowitz & Stegun 7.1.26 (erf(a) = 1 - t·P(t)·exp(-a²), t = 1/(1 + p·a), |error| <= 1.5e-7).
AS_P = 0.3275911
AS_COEFFS = (1.061405429, -1.453152027, 1.421413741, -0.284496736, 0.254829592)
# folded for GELU: t = 1/(1 + GELU_ERF_T·|x|), h = t·P(t)·2^(GELU_ERF_EX2·x²) with P's coefficients halved (the ½)
GELU_ERF_T, GELU_ERF_EX2 = AS_P / math.sqrt(2), -0.5 / math.log(2)
GELU_ERF_POLY = tuple(c / 2 for c in AS_COEFFS)
GELU_TANH_K = (-2 / math.log(2) * math.sqrt(2 / math.pi), -2 / math.log(2) * math.sqrt(2 / math.pi) * 0.044715)


def gelu_erf_fast(x: torch.Tensor) -> torch.Tensor:
    """The kernels' exact GELU in fp32 (torch's exp2 and division for the SFU's ``ex2`` / ``rcp``): relu(x) - |x|·h."""
    x = x.float()
    t = 1 / (1 + torch.tensor(GELU_ERF_T) * x.abs())
    poly = torch.full_like(x, GELU_ERF_POLY[0])
    for c in GELU_ERF_POLY[1:]:
        poly = poly * t + c
    h = t * poly * torch.exp2(x * torch.tensor(GELU_ERF_EX2) * x)
    return x.clamp_min(0) - x.abs() * h


def gelu_tanh_fast(x: torch.Tensor) -> torch.Tensor:
    """The kernels' tanh-form GELU in fp32: x·σ(2u) = x / (1 + 2^w), w = -2·log2(e)·√(2/π)(x + 0.044715x³)."""
    x = x.float()
    return x / (1 + torch.exp2(x * (GELU_TANH_K[0] + GELU_TANH_K[1] * (x * x))))


def activate(y: torch.Tensor, act: str) -> torch.Tensor:
    """torch's ``act`` of fp32 ``y`` (the exact functions the kernels' fast GELUs approximate)."""
    if act == "relu":
        return torch.relu(y)
    if act == "gelu_tanh":
        return torch.nn.functional.gelu(y, approximate="tanh")
    if act == "gelu":
        return torch.nn.functional.gelu(y)
    if act == "silu":
        return torch.nn.functional.silu(y)
    return y


def gated(y: torch.Tensor, act: str) -> torch.Tensor:
    """A gated linear unit of fp32 ``y`` = [gate | up] along its last dimension: ``act(gate) · up`` (SwiGLU for
    ``silu``, GeGLU for ``gelu``)."""
    gate, up = y.chunk(2, dim=-1)
    return activate(gate, act) * up


def requantize(y: torch.Tensor, scale: float) -> torch.Tensor:
    """int8 codes of ``y`` at one static scale, as the ``out="int8"`` epilogue computes them: round(y · RN(1/scale))
    in fp32 (half to even), clamped to ±127."""
    r = out_scale_arg(scale)[1].to(y.device)
    return torch.round(y.float() * r).clamp(-127, 127).to(torch.int8)


def out_scale_arg(scale: float) -> torch.Tensor:
    """The ``OS`` argument of an ``out="int8"`` kernel: fp32 [scale, RN(1 / scale)]."""
    s = torch.tensor([scale], dtype=torch.float32)
    if not (torch.isfinite(s).all() and s.item() > 0):
        raise ValueError(f"an output scale must be a positive finite number, got {scale!r}")
    return torch.cat([s, 1.0 / s])


def to_output(y: torch.Tensor, out_scale: float | None, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """What a kernel writes for the fp32 epilogue value ``y``: ``dtype`` (fp16 or bf16), or int8 codes at
    ``out_scale``."""
    return y.to(dtype) if out_scale is None else requantize(y, out_scale)
