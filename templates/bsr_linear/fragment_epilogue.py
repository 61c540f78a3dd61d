"""The epilogue of the ``bsr_linear`` kernels over a thread's accumulator fragments (every variant runs it): column
constants staged in shared memory, the epilogue value of ``templates/epilogue.py``, the output tile staged for the
coalesced store.
"""

from __future__ import annotations

from ..epilogue import code_span, requantize_bits, tir_activate, unit_value
from ..ptx import device_call, to_f32
from .spec import BsrSpec

_SHARED_IO = {             # one source per device function: TVM keeps one source per called name
    "ld_f32x4": ("const void* p, float* out", "*(float4*)out = *(const float4*)p;"),
    "st_f32x4": ("void* p, float a, float b, float c, float d", "*(float4*)p = make_float4(a, b, c, d);"),
    "st_h2": ("void* p, float a, float b", "*(half2*)p = __floats2half2_rn(a, b);"),   # one cvt for two
    "st_b2": ("void* p, float a, float b",                                             # bf16, to nearest even
              "unsigned ua = __float_as_uint(a), ub = __float_as_uint(b); ua += 0x7FFFu + ((ua >> 16) & 1u); "
              "ub += 0x7FFFu + ((ub >> 16) & 1u); *(unsigned*)p = (ua >> 16) | (ub & 0xFFFF0000u);"),
    "st_s8x2": ("void* p, int a, int b", "*(char2*)p = make_char2((signed char)a, (signed char)b);"),
    "st_h1": ("void* p, float a", "*(half*)p = __float2half_rn(a);"),
    "st_b1": ("void* p, float a",                                                      # bf16, to nearest even
              "unsigned ua = __float_as_uint(a); ua += 0x7FFFu + ((ua >> 16) & 1u); *(unsigned short*)p = ua >> 16;"),
}


def shared_io(fn: str, *args):
    """TIR: a plain shared-memory access through a device function (invisible to TVM's barrier insertion)."""
    return device_call(_SHARED_IO, fn, *args)


class FragmentEpilogue:
    """The epilogue of the ``bsr_linear`` kernels, over a thread's accumulator fragments:
    ``mi`` × ``nj`` tiles of m16n8 (accumulator ``(i·nj + j)·4 + 2h + e`` at row ``r0 + 16i + lane/4 + 8h``,
    column ``c0 + 8j + 2·(lane%4) + e``). Per column pair, (ws, ws', b, b') as fp32 are staged in shared memory
    once per tile (``load_constants``, or ``fetch_constants`` a row ahead + ``put_constants``, into buffer ``buf``
    of those at ``spec.const_offset``); the int8 row scales by ``load_scales`` (once per M tile); then per pair of
    accumulators one float4 read, ``(acc · xs) · ws + b`` (the reference's order; int8 codes out: times RN(1/s),
    folded into ws and b where the activation allows), the activation, and one half2 (or two int8 codes) store
    into the output tile staged at ``out0``. Shared accesses go through device
    functions: TVM's barrier insertion would otherwise fence each constant read against the tile's writes."""

    def __init__(self, spec: BsrSpec, threads: int, mi: int, nj: int, M):
        from tvm.script import tirx as T

        int8, BN, N, OUT_LD, PAIRS = spec.dtype == "int8", spec.bn, spec.n, spec.out_ld, spec.bn // 2
        one, zero = T.float32(1), T.float32(0)
        const0 = spec.const_offset // 4          # float index
        ITERS = -(-PAIRS // threads)
        STORE16 = "st_b2" if spec.act16 == "bfloat16" else "st_h2"
        # int8 codes out: z = sat(y · r/span + offset/span) in [0, 1], code = round(span · z) − offset
        # (``requantize_bits``). No activation, or ReLU (which commutes with a positive scale, and which the
        # saturation at z = 0 then is): r/span and offset/span folded into the staged constants, so an output is one
        # FFMA.SAT of (acc · xs) by (ws · r/span) plus (b · r/span + offset/span); codes differ from the
        # reference's round(y · r) only next to a rounding tie, by one
        q8 = spec.out == "int8"
        fold = q8 and spec.act in ("none", "relu")
        span, offset = code_span(spec.act, fold)
        inv_span = T.float32(1.0 / span)

        GATE = spec.gate

        def value(a, xs, kc, e, OS, up=None):
            # fp32 y (fp16 out) or z in [0, 1] (int8 out) of accumulator a (gated: of the pair a, up)
            if GATE:          # the up's bias sits in the constants' ws slots
                g = tir_activate(a, kc[2 + e] if spec.bias else None, spec.act)
                return g * (up + kc[e] if spec.bias else up)
            v = T.Cast("float32", T.reinterpret("int32", a)) * xs if int8 else a
            if fold:
                return unit_value(v, kc[e], kc[2 + e])
            if int8:
                v = v * kc[e]
            y = tir_activate(v, kc[2 + e] if spec.bias else None, spec.act)
            return unit_value(y, OS[1] * inv_span, T.float32(offset / span)) if q8 else y

        def column_constants(WS, B, OS, c):      # fp32 (ws, b) of column c; folded: (ws · r/span, b · r/span + ½)
            if GATE:                             # (up's bias, gate's bias)
                return (to_f32(B[N + c], spec.act16), to_f32(B[c], spec.act16)) if spec.bias else (zero, zero)
            ws = WS[c] if int8 else one
            b = to_f32(B[c], spec.act16) if spec.bias else zero
            if not fold:
                return ws, b
            q = OS[1] * inv_span
            return ws * q, b * q + T.float32(offset / span)

        self.held = 4 * ITERS                    # registers kr of fetch_constants / put_constants

        @T.macro
        def fetch_constants(kr, WS, B, OS, t, row):
            # the column constants of block row ``row``: global loads into registers kr (a streaming kernel: a row
            # ahead) ...
            for it in T.unroll(ITERS):
                p = T.meta_var(t + it * threads)
                if PAIRS % threads == 0 or p < PAIRS:
                    for e in T.unroll(2):
                        k = T.meta_var(column_constants(WS, B, OS, T.min(row * BN + p * 2 + e, N - 1)))
                        kr[it * 4 + e] = k[0]
                        kr[it * 4 + 2 + e] = k[1]
        self.fetch_constants = fetch_constants

        @T.macro
        def put_constants(cst, kr, t, buf):
            # ... and their shared stores into buffer ``buf``
            for it in T.unroll(ITERS):
                p = T.meta_var(t + it * threads)
                if PAIRS % threads == 0 or p < PAIRS:
                    T.evaluate(shared_io("st_f32x4", cst.ptr_to([const0 + buf * BN * 2 + p * 4]),
                                         kr[it * 4], kr[it * 4 + 1], kr[it * 4 + 2], kr[it * 4 + 3]))
        self.put_constants = put_constants

        @T.macro
        def load_constants(cst, kr, WS, B, OS, t, row, buf):
            fetch_constants(kr, WS, B, OS, t, row)
            put_constants(cst, kr, t, buf)
        self.load_constants = load_constants

        @T.macro
        def load_scales(xsr, XS, m0, r0, lane):
            # int8: the per-token scales of the thread's 2·mi rows (nothing for other operands)
            if int8:
                for r in T.unroll(2 * mi):
                    xsr[r] = XS[T.min(m0 + r0 + r // 2 * 16 + lane // 4 + r % 2 * 8, M - 1)]
        self.load_scales = load_scales

        @T.macro
        def stage_gated(acc, acc_up, smem, cst, kc, yv, r0, c0, lane, out0, buf):
            # a gated kernel's tile: act(gate + bg) · (up + bu) per pair of accumulators
            for j in T.unroll(nj):
                T.evaluate(shared_io("ld_f32x4", cst.ptr_to([const0 + buf * BN * 2 + (c0 + j * 8) * 2 +
                                                             (lane % 4) * 4]), kc.ptr_to([0])))
                for i in T.unroll(mi):
                    for h in T.unroll(2):
                        lr = T.meta_var(r0 + i * 16 + lane // 4 + h * 8)
                        lc = T.meta_var(c0 + j * 8 + (lane % 4) * 2)
                        for e in T.unroll(2):
                            a = T.meta_var((i * nj + j) * 4 + h * 2 + e)
                            yv[e] = value(acc[a], None, kc, e, None, acc_up[a])
                        T.evaluate(shared_io(STORE16, smem.ptr_to([out0 + lr * OUT_LD + lc]), yv[0], yv[1]))
        self.stage_gated = stage_gated

        @T.macro
        def stage_tile(acc, smem, smo, cst, kc, xsr, yv, OS, r0, c0, lane, out0, buf):
            for j in T.unroll(nj):
                T.evaluate(shared_io("ld_f32x4", cst.ptr_to([const0 + buf * BN * 2 + (c0 + j * 8) * 2 +
                                                             (lane % 4) * 4]), kc.ptr_to([0])))
                for i in T.unroll(mi):
                    for h in T.unroll(2):
                        lr = T.meta_var(r0 + i * 16 + lane // 4 + h * 8)
                        lc = T.meta_var(c0 + j * 8 + (lane % 4) * 2)
                        for e in T.unroll(2):
                            yv[e] = value(acc[(i * nj + j) * 4 + h * 2 + e], xsr[i * 2 + h], kc, e, OS)
                        if q8:
                            T.evaluate(shared_io("st_s8x2", smo.ptr_to([out0 * 2 + lr * OUT_LD + lc]),
                                                 requantize_bits(yv[0], span, offset),
                                                 requantize_bits(yv[1], span, offset)))
                        else:
                            T.evaluate(shared_io(STORE16, smem.ptr_to([out0 + lr * OUT_LD + lc]), yv[0], yv[1]))
        self.stage_tile = stage_tile
        NX, NP = 2 * mi, nj // 2
        STORE1 = "st_b1" if spec.act16 == "bfloat16" else "st_h1"

        @T.macro
        def stage_transposed(acc, smem, cst, kc, r0, c0, lane, out0, buf):
            # the fragments of Yᵀ = W·Xᵀ (a W4A16 tile over the GEMVs' pack): accumulator (x·NP + p)·4 + 2q + e at
            # column c0 + 8(2p + q) + lane/4 and row r0 + 8x + 2(lane%4) + e; 16-bit (bias, activation) out only
            for p in T.unroll(NP):
                for q in T.unroll(2):
                    col = T.meta_var(c0 + (2 * p + q) * 8 + lane // 4)
                    T.evaluate(shared_io("ld_f32x4", cst.ptr_to([const0 + buf * BN * 2 + col // 2 * 4]), kc.ptr_to([0])))
                    bias = T.meta_var(T.if_then_else(lane // 4 % 2 == 0, kc[2], kc[3]))
                    for x in T.unroll(NX):
                        for e in T.unroll(2):
                            y = T.meta_var(tir_activate(acc[(x * NP + p) * 4 + 2 * q + e], bias if spec.bias else None,
                                                        spec.act))
                            T.evaluate(shared_io(STORE1, smem.ptr_to([out0 + (r0 + x * 8 + (lane % 4) * 2 + e) * OUT_LD
                                                                      + col]), y))
        self.stage_transposed = stage_transposed
