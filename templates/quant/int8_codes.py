"""TIR building blocks of per-token int8 quantisation, shared by the quantiser and the LayerNorm kernel: the
row maximum (warp shuffles, one shared-memory step across warps) and the codes of a row (``quotient``: x / s
correctly rounded from RN(1/s) and one ``fma``, without IEEE division). Nothing here imports TVM until it is called.
"""

from __future__ import annotations

from ..ptx import to_f32


def quotient(x, d, r):
    """TIR: ``x / d`` correctly rounded, from ``r`` = RN(1/d) (Markstein: q = RN(x·r) is within an ulp; one
    ``fma`` with the exact remainder x - q·d corrects it) — 3 instructions instead of IEEE division's
    subroutine, bit for bit torch's fp32 division where the quotient neither overflows nor underflows."""
    from tvm.script import tirx as T
    q = T.call_pure_extern("float32", "__fmul_rn", x, r)
    rem = T.call_pure_extern("float32", "__fmaf_rn", q, T.float32(0) - d, x)
    return T.call_pure_extern("float32", "__fmaf_rn", rem, r, q)


def int8_scale(absmax):
    """TIR: the per-token scale of a row whose ``max |x|`` is ``absmax`` (``quantize_rows``: max·(1/127))."""
    from tvm.script import tirx as T
    return T.max(absmax, T.float32(1e-12)) * T.float32(1.0 / 127.0)


def int8_code(q):
    """TIR: the int8 code of the fp32 quotient ``q`` = x / scale: rounded half to even, clamped to ±127."""
    from tvm.script import tirx as T
    return T.Cast("int8", T.max(T.min(T.nearbyint(q), T.float32(127)), T.float32(-127)))


def store_codes(chunks: int, threads: int, act: str = "float16"):
    """TIR macro ``store_codes(sc, absmax, src, codes, XS, XQ, row, t)`` for a row of ``chunks`` 16-byte chunks over
    ``threads`` threads: the per-token scale of the row's ``absmax`` into ``sc[0]`` (its reciprocal into ``sc[1]``),
    written to ``XS[row]`` by thread 0, and the int8 codes of thread ``t``'s chunks of values (chunk ``it`` at
    ``src[it * 8]``: fp32, or 16-bit lanes of ``act``) into ``XQ[row]``, 8 bytes per store. Shared by the quantiser
    and the LayerNorm kernel."""
    from tvm.script import tirx as T
    IT, full = -(-chunks // threads), chunks % threads == 0

    @T.macro
    def store(sc, absmax, src, codes, XS, XQ, row, t):
        sc[0] = int8_scale(absmax)
        sc[1] = T.float32(1) / sc[0]
        if t == 0:
            XS[row] = sc[0]
        for it in T.unroll(IT):
            if full or t + it * threads < chunks:
                for v in T.unroll(8):
                    codes[v] = int8_code(quotient(to_f32(src[it * 8 + v], act), sc[0], sc[1]))
                for v in T.vectorized(8):
                    XQ[row, (t + it * threads) * 8 + v] = codes[v]
    return store


def row_max(warps: int):
    """TIR macro ``row_max(mx, red, lane, t)``: every thread of a row of ``warps`` warps ends with the row's
    maximum of ``mx[0]`` (``mx[1]`` is scratch): a butterfly of warp shuffles, then, across warps, one step
    through the shared ``red[warps]``. Shared by the quantiser and the LayerNorm kernel's |y| maximum."""
    from tvm.script import tirx as T
    FULL = T.uint32(0xFFFFFFFF)

    @T.macro
    def reduce(mx, red, lane, t):
        for s in T.unroll(5):
            T.evaluate(T.ptx["shfl_sync.bfly.b32"](mx[1], mx[0], T.uint32(16 >> s), T.uint32(31), FULL))
            mx[0] = T.max(mx[0], mx[1])
        if warps > 1:
            if lane == 0:
                red[t // 32] = mx[0]
            T.tvm_storage_sync("shared")
            for w in T.unroll(warps):
                mx[0] = T.max(mx[0], red[w])
    return reduce
