"""Per-row (per-token) symmetric int8 quantisation of fp16 activations for the W8A8 kernels, in TVMScript.

Bit for bit ``spec.quantize_rows`` (of fp16 or, ``dtype="bfloat16"``, bf16 rows). Every 16-byte load of a thread is in flight before the first use, the row maximum
is a butterfly of warp shuffles (plus one shared-memory step across warps), each quotient is x times the row's
reciprocal corrected by one ``fma`` (correctly rounded like torch's division, 3 instructions), 8-byte int8 stores.
Memory-bound: it reads 2 and writes 1 byte per element (measured: benchmarks/RESULTS.md, "CUDA per-token int8
quantiser").
"""

from __future__ import annotations

from ..ptx import to_f32
from .int8_codes import row_max, store_codes
from .spec import QuantRowsSpec


def quantize_rows_kernel(spec: QuantRowsSpec):
    """The kernel as an IRModule with one PrimFunc named ``spec.name``."""
    import tvm
    from tvm import tirx
    from tvm.script import tirx as T

    M, K, NT = spec.m or tirx.Var("M", "int32"), spec.k, spec.threads
    R = spec.rows_per_cta
    CH = K // 8                                   # 16-byte chunks per row
    IT = -(-CH // NT)
    WARPS = NT // 32
    full = CH % NT == 0
    reduce_max = row_max(WARPS)
    emit_codes = store_codes(CH, NT, spec.dtype)

    EVEN = spec.m > 0 and spec.m % R == 0            # every CTA's rows inside M

    @T.prim_func
    def kernel(x_h: T.handle, xq_h: T.handle, xs_h: T.handle):
        T.func_attr({"global_symbol": spec.name, "tirx.noalias": True})
        X = T.match_buffer(x_h, (M, K), "float16")
        XQ = T.match_buffer(xq_h, (M, K), "int8")
        XS = T.match_buffer(xs_h, (M,), "float32")
        bx = T.launch_thread("blockIdx.x", -(-M // R))
        tx = T.launch_thread("threadIdx.x", NT * R)
        red = T.alloc_buffer((WARPS,), "float32", scope="shared")
        raw = T.alloc_buffer((IT * 8,), "float16", scope="local")
        mx = T.alloc_buffer((2,), "float32", scope="local")        # |x| max, a partner's; then scale, 1 / scale
        codes = T.alloc_buffer((8,), "int8", scope="local")
        row = T.meta_var(bx * R + tx // NT)
        t = T.meta_var(tx % NT)
        lane = T.meta_var(tx % 32)
        if R == 1 or EVEN or row < M:     # a warp per row: the guard is warp-uniform
            for it in T.unroll(IT):            # every load in flight before the first use
                if full or t + it * NT < CH:
                    for v in T.vectorized(8):
                        raw[it * 8 + v] = X[row, (t + it * NT) * 8 + v]
            mx[0] = T.float32(0)
            for it in T.unroll(IT):
                if full or t + it * NT < CH:
                    for v in T.unroll(8):
                        mx[0] = T.max(mx[0], T.fabs(to_f32(raw[it * 8 + v], spec.dtype)))
            reduce_max(mx, red, lane, t)
            emit_codes(mx, mx[0], raw, codes, XS, XQ, row, t)

    return tvm.IRModule({spec.name: kernel})
