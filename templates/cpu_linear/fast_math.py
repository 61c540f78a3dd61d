"""Activations the CPU epilogue computes in vector registers: mul/add/div and bit operations only.

LLVM turns ``erf``/``exp`` in a vectorised TIR loop into one libm call per lane, which made a fused GELU or SiLU
cost more than the block-sparse matmul it follows. Here they are polynomials the vectoriser keeps in SIMD
registers:

* ``erf``: a rational approximation x·P(x²)/Q(x²) on [-4, 4] (clamped outside; erf(4) = 1 - 1.5e-8), with the
  coefficients Eigen's ``generic_fast_erf_float`` publishes: within 5e-7 of erf in fp32;
* ``exp``: Cody–Waite reduction x = n·ln2 + r, |r| ≤ ln2/2, a degree-6 Taylor polynomial of e^r, times 2^n built
  in the exponent bits: within 3e-7 relative on [-87, 88] (clamped outside).

GELU (exact form), SiLU, sigmoid and tanh follow, within ``BOUNDS`` of float64 (relative to max(1, |f(x)|)); each has
a torch twin here that computes the same arithmetic, and ``tests/templates/test_cpu_fast_math.py`` checks both.
"""

from __future__ import annotations

import math

import torch

ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
         -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
         -1.42647390514189e-02)
EXP_TAYLOR = tuple(1 / math.factorial(i) for i in range(6, -1, -1))       # 1/6!, ..., 1/1!, 1
LOG2E, LN2_HI, LN2_LO = 1.4426950408889634, 0.693359375, -2.12194440e-4
EXP_LO, EXP_HI, ERF_CLAMP = -87.0, 88.0, 4.0
# max |error| / max(1, |f(x)|) against float64 (GELU: erf's error times |x|/2 where 1 + erf(x/√2) cancels)
BOUNDS = {"erf": 5e-7, "exp": 3e-7, "gelu": 1.5e-6, "silu": 5e-7, "sigmoid": 5e-7, "tanh": 1e-6}


# ---- TIR (float32 expressions) ---------------------------------------------------------------------------------
def _c(x):
    from tvm import tirx
    return tirx.const(x, "float32")


def _horner(x, coefficients):
    acc = _c(coefficients[0])
    for a in coefficients[1:]:
        acc = acc * x + _c(a)
    return acc


def tir_erf(v):
    from tvm import tirx
    x = tirx.max(tirx.min(v, _c(ERF_CLAMP)), _c(-ERF_CLAMP))
    x2 = x * x
    return x * _horner(x2, ERF_P) / _horner(x2, ERF_Q)


def tir_exp(v):
    from tvm import tirx
    x = tirx.max(tirx.min(v, _c(EXP_HI)), _c(EXP_LO))
    n = tirx.floor(x * _c(LOG2E) + _c(0.5))
    r = x - n * _c(LN2_HI) - n * _c(LN2_LO)
    bits = tirx.shift_left(n.astype("int32") + tirx.const(127, "int32"), tirx.const(23, "int32"))
    return _horner(r, EXP_TAYLOR) * tirx.reinterpret("float32", bits)


def tir_activation(name: str | None, v):
    """The activation ``name`` of float32 TIR expression ``v``, on vector-friendly arithmetic."""
    from tvm import tirx
    one = _c(1.0)
    if name is None:
        return v
    if name == "relu":
        return tirx.max(v, _c(0.0))
    if name == "gelu":                       # exact (erf) GELU, as torch's default
        return v * _c(0.5) * (one + tir_erf(v * _c(1 / math.sqrt(2.0))))
    if name == "silu":                       # x clamped below: -3e38 / (1 + e^88) would not underflow to 0
        return tirx.max(v, _c(EXP_LO)) / (one + tir_exp(-v))
    if name == "sigmoid":
        return one / (one + tir_exp(-v))
    if name == "tanh":
        return _c(2.0) / (one + tir_exp(_c(-2.0) * v)) - one
    raise ValueError(f"unknown activation {name!r}")


# ---- torch twins (the same arithmetic, float32) ------------------------------------------------------------------
def _horner_t(x, coefficients):
    acc = torch.full_like(x, coefficients[0])
    for a in coefficients[1:]:
        acc = acc * x + a
    return acc


def erf(x: torch.Tensor) -> torch.Tensor:
    x = x.float().clamp(-ERF_CLAMP, ERF_CLAMP)
    x2 = x * x
    return x * _horner_t(x2, ERF_P) / _horner_t(x2, ERF_Q)


def exp(x: torch.Tensor) -> torch.Tensor:
    x = x.float().clamp(EXP_LO, EXP_HI)
    n = torch.floor(x * LOG2E + 0.5)
    r = x - n * LN2_HI - n * LN2_LO
    return _horner_t(r, EXP_TAYLOR) * torch.ldexp(torch.ones_like(x), n.to(torch.int32))


def activation(name: str | None, y: torch.Tensor) -> torch.Tensor:
    """``tir_activation``'s arithmetic in torch (float32)."""
    y = y.float()
    if name is None:
        return y
    if name == "relu":
        return torch.relu(y)
    if name == "gelu":
        return y * 0.5 * (1 + erf(y * (1 / math.sqrt(2.0))))
    if name == "silu":
        return y.clamp_min(EXP_LO) / (1 + exp(-y))
    if name == "sigmoid":
        return 1 / (1 + exp(-y))
    if name == "tanh":
        return 2 / (1 + exp(-2 * y)) - 1
    raise ValueError(f"unknown activation {name!r}")


__all__ = ["tir_activation", "activation", "erf", "exp", "tir_erf", "tir_exp", "BOUNDS"]
