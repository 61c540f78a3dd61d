"""The CUDA kernels' epilogue value as TIR: bias, activation (GELUs from one ``ex2`` and one ``rcp``) and the
int8 requantisation of ``out="int8"`` kernels (codes of one static scale, no float→int conversion, no clamp).

Shared by the block kernels (``bsr_linear/fragment_epilogue.py``) and the W8A8 GEMVs; the torch twins are in
``epilogue_ref.py``. Nothing here imports TVM until it is called.
"""

from __future__ import annotations

from .epilogue_ref import GELU_ERF_EX2, GELU_ERF_POLY, GELU_ERF_T, GELU_TANH_K
from .ptx import from_f32, mufu


def tir_activate(v, bias, act: str):
    """fp32 ``v`` (+ fp16 ``bias`` if given), activation — the fp32 value of the epilogue, as TIR."""
    from tvm.script import tirx as T
    if bias is not None:
        v = v + T.Cast("float32", bias)
    if act == "relu":
        v = T.max(v, T.float32(0))
    elif act == "gelu_tanh":
        v = gelu_tanh(v)
    elif act == "gelu":
        v = gelu_erf(v)
    elif act == "silu":
        v = silu(v)
    return v


def silu(v):
    """TIR: x·σ(x) = x / (1 + 2^(-x·log2(e))): one ``ex2.approx``, one ``rcp.approx``."""
    from tvm import tirx
    from tvm.script import tirx as T
    x = tirx.Var("sx", "float32")
    return tirx.Let(x, v, x * mufu("rcp", T.float32(1) + mufu("ex2", x * T.float32(-1.4426950408889634))))


def gelu_tanh(v):
    """TIR: the tanh-form GELU ½x(1 + tanh(u)), u = √(2/π)(x + 0.044715x³), as x·σ(2u) = x / (1 + 2^w) with w =
    -2·log2(e)·u: one ``ex2.approx``, one ``rcp.approx``, 5 multiply-adds (``tanhf``: about 20), no cancellation
    for x < 0; within 5.2e-7 absolute and 9e-7 relative of the exact value (torch's fp32 GELU: 1.5e-4 relative)."""
    from tvm import tirx
    from tvm.script import tirx as T
    x = tirx.Var("gx", "float32")
    w = x * (T.float32(GELU_TANH_K[0]) + T.float32(GELU_TANH_K[1]) * (x * x))
    return tirx.Let(x, v, x * mufu("rcp", T.float32(1) + mufu("ex2", w)))


def gelu_erf(v):
    """TIR: the exact GELU of fp32 ``v``, as relu(x) - |x|·h with h = ½·erfc(|x|/√2) by A&S 7.1.26 (the ½, 1/√2
    and log2(e) folded into its constants): one ``rcp.approx``, one ``ex2.approx``, 8 multiply-adds — under half
    the instructions of ``erff`` (two polynomials and selects), within 5e-7 of the exact GELU (``erff``'s own
    fp32 GELU: 4.5e-7)."""
    from tvm import tirx
    from tvm.script import tirx as T
    x, t = tirx.Var("gx", "float32"), tirx.Var("gt", "float32")
    poly = T.float32(GELU_ERF_POLY[0])
    for c in GELU_ERF_POLY[1:]:
        poly = poly * t + T.float32(c)
    h = t * poly * mufu("ex2", x * T.float32(GELU_ERF_EX2) * x)
    return tirx.Let(x, v, tirx.Let(t, mufu("rcp", T.float32(1) + T.float32(GELU_ERF_T) * T.fabs(x)),
                                   T.max(x, T.float32(0)) - T.fabs(x) * h))


ROUND_MAGIC = 12582912.0   # 1.5·2²³: x + ROUND_MAGIC, for |x| < 2²², is RN-even(x) in the low mantissa bits


def code_span(act: str, folded: bool) -> tuple[float, float]:
    """(span, offset) of the saturating requantisation: the code is round(span · z) − offset for z in [0, 1].
    ReLU folded into the constants needs only codes 0..127 (z = 0 is ReLU's zero); otherwise −127..127."""
    return (127.0, 0.0) if folded and act == "relu" else (254.0, 127.0)


def unit_value(v, q, c):
    """TIR: sat(fma(v, q, c)) — one ``FFMA.SAT``, the clamp to [0, 1] that saturation gives for free."""
    from tvm.script import tirx as T
    return T.call_pure_extern("float32", "__saturatef", T.call_pure_extern("float32", "__fmaf_rn", v, q, c))


def requantize_bits(z, span: float = 254.0, offset: float = 127.0):
    """TIR int32 whose low byte is the int8 code round(span · z) − offset of ``z`` in [0, 1]: the bits of fp32
    ``fma(z, span, M − offset)``, ``M`` = 1.5·2²³ — the sum's ulp is 1, so the one rounding of the ``fma`` is
    the rounding to an integer (half to even); no float→int conversion (a quarter of the FP32 rate) and no clamp
    (``unit_value`` saturated z). With z = sat(y·r/254 + ½) the code is ``epilogue_ref.requantize``'s
    clamp(round(y·r), ±127) except where y·r lies within about 2⁻¹⁵ of a rounding tie (z's own rounding), by one."""
    from tvm.script import tirx as T
    t = T.call_pure_extern("float32", "__fmaf_rn", z, T.float32(span), T.float32(ROUND_MAGIC - offset))
    return T.reinterpret("int32", t)


def output_value(v, bias, act: str, out: str, OS):
    """TIR: the value written for fp32 ``v``: fp16 ``act(v + b)`` (bf16 for ``out="bfloat16"``: its bits in the
    16-bit lane), or (``out="int8"``) its int8 code at the static scale ``OS`` (the unfolded requantisation: one
    ``FFMA.SAT`` into [0, 1], one ``FFMA`` to the code). ``bias``: fp32 (or fp16)."""
    from tvm import tirx
    from tvm.script import tirx as T
    y = tir_activate(v, bias, act)
    if out == "float16":
        return T.Cast("float16", y)
    if out == "bfloat16":
        r = tirx.Var("ry", "float32")
        return tirx.Let(r, y, from_f32(r, "bfloat16"))
    span, offset = code_span(act, False)
    z = unit_value(y, OS[1] * T.float32(1.0 / span), T.float32(offset / span))
    return T.Cast("int8", requantize_bits(z, span, offset))
