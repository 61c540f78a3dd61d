"""Device functions in inline PTX that several CUDA kernel families call, as TIR.

``device_call`` wraps a device function given as source; ``mufu`` is one SFU instruction (``rcp``, ``ex2``);
``grid_dependency`` the programmatic-dependent-launch controls; ``half2_splat``, ``zero_terms`` and
``dequant_word`` the lop3 / magic-number int4 → fp16 dequantisation of the W4A16 GEMV and the block kernels'
W4A16 variant. Nothing here imports TVM until it is called.
"""

from __future__ import annotations


def device_call(sources: dict, fn: str, *args):
    """TIR: a call of the void device function ``sparta_<fn>`` whose (parameters, body) are ``sources[fn]``."""
    from tvm.script import tirx as T
    params, body = sources[fn]
    src = f"__device__ __forceinline__ void sparta_{fn}({params}) {{ {body} }}\n"
    return T.cuda.func_call(f"sparta_{fn}", *args, source_code=src, return_type="void")


def mufu(fn: str, x):
    """TIR: ``fn``.approx.ftz.f32 of ``x`` (one SFU instruction: ``rcp`` or ``ex2``), an inline-asm device function."""
    from tvm.script import tirx as T
    src = (f"__device__ __forceinline__ float sparta_{fn}_approx(float x) "
           f"{{ float r; asm(\"{fn}.approx.ftz.f32 %0, %1;\" : \"=f\"(r) : \"f\"(x)); return r; }}\n")
    return T.cuda.func_call(f"sparta_{fn}_approx", x, source_code=src, return_type="float32")


def grid_dependency(op: str):
    """TIR: ``griddepcontrol.<op>`` (``wait``: until the previous kernel in the stream has completed and its writes
    are visible; ``launch_dependents``: let the next one launch), for a kernel launched with programmatic dependent
    launch (sm_90; a no-op before, and on a launch without the attribute)."""
    from tvm.script import tirx as T
    clobber = ' ::: "memory"' if op == "wait" else ""
    src = (f"__device__ __forceinline__ void sparta_grid_{op}() {{\n#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900\n"
           f'  asm volatile("griddepcontrol.{op};"{clobber});\n#endif\n}}\n')
    return T.cuda.func_call(f"sparta_grid_{op}", source_code=src, return_type="void")


def half2_splat(h):
    """TIR: a uint32 holding the bits of fp16 ``h`` in both halves (the half2 ``(h, h)``)."""
    from tvm.script import tirx as T
    u = T.Cast("uint32", T.reinterpret("uint16", h))
    return u | (u << T.uint32(16))


def zero_terms(z=None, act16: str = "float16"):
    """TIR ``(zl, zh)`` of :func:`dequant_word` for a uint32 zero point ``z`` (0..15): half2(1024 + z) and
    half2(-(64 + z)) (bf16: bf16x2(-(128 + z)) twice); ``None``: the symmetric zero point 8, as constants."""
    from tvm.script import tirx as T
    if act16 == "bfloat16":
        if z is None:
            return T.uint32(0xC308C308), T.uint32(0xC308C308)
        t = z | T.uint32(0xC300)
        return t | (t << T.uint32(16)), t | (t << T.uint32(16))
    if z is None:
        return T.uint32(0x64086408), T.uint32(0xD480D480)
    lo, hi = z | T.uint32(0x6400), (z << T.uint32(4)) | T.uint32(0xD400)
    return lo | (lo << T.uint32(16)), hi | (hi << T.uint32(16))


def dequant_word(scaled: bool = True, act16: str = "float16"):
    """TIR macro ``dequant(b, o, w, s2, zl, zh)``: the 8 nibbles of uint32 ``w`` (in ``w4a16_gemv.spec.ORDER``) to four
    half2 ``b[o .. o+3]`` = elements (0, 1), (2, 3), (4, 5), (6, 7), each ``(q - zero) · scale``: one
    ``lop3`` per pair into the mantissa of fp16 1024, one exact ``sub``/``fma`` removing 1024 + zero
    (``zl`` = half2(1024 + z), ``zh`` = half2(-(64 + z)) for the high nibbles, taken ×1/16), one ``mul``
    by ``s2`` = half2(scale) (none if not ``scaled``: ``q - zero``, ``s2`` unused). Shared by the W4A16
    GEMV and the ``bsr_linear`` W4A16 kernel. ``act16="bfloat16"``: bf16x2 pairs for bf16 activations
    (:func:`_dequant_word_bf16`)."""
    from tvm.script import tirx as T
    if act16 == "bfloat16":
        return _dequant_word_bf16(scaled)

    MAGIC, LO, HI = T.uint32(0x64006400), T.uint32(0x000F000F), T.uint32(0x00F000F0)
    SIXTEENTH = T.uint32(0x2C002C00)           # half2(1/16, 1/16)

    @T.macro
    def dequant(b, o, w, s2, zl, zh):
        T.evaluate(T.ptx["lop3.b32"](b[o], w, LO, MAGIC, 0xEA))
        T.evaluate(T.ptx["lop3.b32"](b[o + 1], w, HI, MAGIC, 0xEA))
        T.evaluate(T.ptx["lop3.b32"](b[o + 2], w >> T.uint32(8), LO, MAGIC, 0xEA))
        T.evaluate(T.ptx["lop3.b32"](b[o + 3], w >> T.uint32(8), HI, MAGIC, 0xEA))
        for h in T.unroll(2):
            T.evaluate(T.ptx["sub.f16x2"](b[o + 2 * h], b[o + 2 * h], zl))            # 1024+q - (1024+z)
            T.evaluate(T.ptx["fma.rn.f16x2"](b[o + 2 * h + 1], b[o + 2 * h + 1], SIXTEENTH, zh))  # (1024+16q)/16 - (64+z)
            if scaled:
                T.evaluate(T.ptx["mul.f16x2"](b[o + 2 * h], b[o + 2 * h], s2))
                T.evaluate(T.ptx["mul.f16x2"](b[o + 2 * h + 1], b[o + 2 * h + 1], s2))
    return dequant


def _dequant_word_bf16(scaled: bool):
    """:func:`dequant_word` for bf16: each nibble pair shifted to the low bits and ORed by one ``lop3`` into the
    mantissa of bf16 128 (0x4300: an ulp of 1 there, so only the low nibble fits, the high ones are shifted down
    first), one exact ``fma`` by 1 adding ``zl`` = bf16x2(-(128 + z)), one ``fma`` by ``s2`` (adding -0) rounding
    ``(q - z) · scale`` to bf16 once (sm_80 has bf16x2 ``fma`` but no bf16x2 ``sub``/``mul``); ``zh`` unused."""
    from tvm.script import tirx as T

    MAGIC, LO = T.uint32(0x43004300), T.uint32(0x000F000F)
    ONE, NEG_ZERO = T.uint32(0x3F803F80), T.uint32(0x80008000)

    @T.macro
    def dequant(b, o, w, s2, zl, zh):
        for p in T.unroll(4):
            T.evaluate(T.ptx["lop3.b32"](b[o + p], w >> T.uint32(4 * p), LO, MAGIC, 0xEA))
        for p in T.unroll(4):
            T.evaluate(T.ptx["fma.rn.bf16x2"](b[o + p], b[o + p], ONE, zl))               # 128+q - (128+z)
            if scaled:
                T.evaluate(T.ptx["fma.rn.bf16x2"](b[o + p], b[o + p], s2, NEG_ZERO))
    return dequant


# 16-bit activations: the kernels move fp16 and bf16 alike as 16-bit lanes (TIR buffers of "float16"); a bf16 kernel
# reads and writes bf16 bits through these conversions (exact widening, round-to-nearest-even narrowing).
def to_f32(h, act: str):
    """TIR: fp32 of the 16-bit lane ``h`` holding an ``act`` value (bf16: its bits are fp32's upper half)."""
    from tvm.script import tirx as T
    if act == "bfloat16":
        return T.reinterpret("float32", T.shift_left(T.Cast("uint32", T.reinterpret("uint16", h)), T.uint32(16)))
    return T.Cast("float32", h)


def from_f32(v, act: str):
    """TIR: the 16-bit lane (typed fp16) holding fp32 ``v`` rounded to ``act`` (bf16: to nearest even; ``v`` is read
    twice, so a plain value or a buffer load, not a ``Let``)."""
    from tvm.script import tirx as T
    if act == "bfloat16":
        u = T.reinterpret("uint32", v)
        r = T.shift_right(u + T.uint32(0x7FFF) + T.bitwise_and(T.shift_right(u, T.uint32(16)), T.uint32(1)),
                          T.uint32(16))
        return T.reinterpret("float16", T.Cast("uint16", r))
    return T.Cast("float16", v)
