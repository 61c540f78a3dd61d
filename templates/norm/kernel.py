"""LayerNorm over the last dimension in fp16, optionally emitting per-token int8 codes for W8A8 consumers.

``Y[m, :] = (X[m, :] - mean) · rsqrt(var + eps) · G + B`` with the statistics in fp32 by Welford's
algorithm, as OneFlow's LayerNorm kernels compute them: each thread folds its values into
(count, mean, M2) — the count of every value is known at compile time, so each update multiplies by a
constant reciprocal instead of dividing — then threads merge pairwise (butterfly shuffles within a warp, shared memory
across warps). The row stays in registers between the statistics and the normalisation, so ``X``
is read once (OneFlow's "warp" kernel for ``threads=32``: one warp per row, four rows per CTA; its
"block, cached" kernel for more threads: one CTA per row).

``out="int8"`` or ``"both"`` fuses the per-token quantisation the W8A8 kernels read: the row's
``|y|`` maximum is reduced the same way and ``XQ = round(y / s)``, ``XS = s = max|y| · (1/127)`` —
bit for bit ``quant.spec.quantize_rows`` applied to the fp16 ``Y``, so a LayerNorm that feeds
int8 linears spares them the separate quantisation pass (2 bytes read + 1 written per element).

``residual=True`` normalises ``X + R`` (summed in fp16, as torch's ``add`` rounds it): a transformer's
residual add fused into the LayerNorm that reads it, sparing the add's pass (two reads and a write);
``residual_out=True`` also writes the sum ``H``, the residual stream a pre-norm decoder reads on.

``kind="rms"`` is RMSNorm: the row's sum of squares in fp32 (one butterfly sum, no mean), ``X · rsqrt(mean(X²) +
eps)`` rounded to 16 bits, then times ``G`` in 16 bits, as Hugging Face's LlamaRMSNorm rounds it.
"""

from __future__ import annotations

from ..ptx import from_f32, to_f32
from ..quant.int8_codes import row_max, store_codes
from .spec import LayerNormSpec


def layer_norm_kernel(spec: LayerNormSpec):
    """The kernel as an IRModule with one PrimFunc named ``spec.name``."""
    import tvm
    from tvm import tirx
    from tvm.script import tirx as T

    M, N, NT, ROWS = spec.m or tirx.Var("M", "int32"), spec.n, spec.threads, spec.rows_per_cta
    CH, IT = N // 8, spec.per_thread
    WARPS = NT // 32
    full = CH % NT == 0                       # every thread's chunks all inside the row
    emit_y, emit_q = spec.out != "int8", spec.out != "fp16"
    ACT, BF16 = spec.dtype, spec.dtype == "bfloat16"      # 16-bit lanes of fp16 or bf16 values
    affine, use_bias, residual = spec.affine, spec.bias, spec.residual
    RMS, keep_sum = spec.kind == "rms", spec.residual_out
    FULL = T.uint32(0xFFFFFFFF)
    reduce_max = row_max(WARPS)
    emit_codes = store_codes(CH, NT)          # from the fp32 values of the rounded output

    def normalised(v, mean, rstd, gw, bw, i):
        if RMS:                               # HF: (x · rstd) rounded to 16 bits, then times the 16-bit weight
            y = v * rstd
            if affine:
                y = to_f32(from_f32(y, ACT), ACT) * to_f32(gw[i], ACT)
            return y
        y = (v - mean) * rstd
        if affine:
            y = y * to_f32(gw[i], ACT)
        if use_bias:
            y = y + to_f32(bw[i], ACT)
        return y

    @T.macro
    def combine(st, n_b, mean_b, m2_b):
        # (count, mean, M2) of the union of st's values and another set's (Chan et al.)
        frac = T.meta_var(n_b / T.max(st[0] + n_b, T.float32(1)))
        st[2] = st[2] + m2_b + (mean_b - st[1]) * (mean_b - st[1]) * st[0] * frac
        st[1] = st[1] + (mean_b - st[1]) * frac
        st[0] = st[0] + n_b

    @T.macro
    def merge(st, ot, red, lane, t):
        # every thread of the row ends with the row's (count, mean, M2)
        for s in T.unroll(5):
            for i in T.unroll(3):
                T.evaluate(T.ptx["shfl_sync.bfly.b32"](ot[i], st[i], T.uint32(16 >> s), T.uint32(31), FULL))
            combine(st, ot[0], ot[1], ot[2])
        if WARPS > 1:
            if lane == 0:
                for i in T.unroll(3):
                    red[(t // 32) * 3 + i] = st[i]
            T.tvm_storage_sync("shared")
            for i in T.unroll(3):
                st[i] = red[i]
            for w in T.unroll(WARPS - 1):
                combine(st, red[(w + 1) * 3], red[(w + 1) * 3 + 1], red[(w + 1) * 3 + 2])
            T.tvm_storage_sync("shared")      # red is reused by the |y| maximum

    @T.macro
    def sum_merge(st, ot, red, lane, t):
        # every thread of the row ends with the row's sum of squares (st[0]): a butterfly sum, then across warps
        for s in T.unroll(5):
            T.evaluate(T.ptx["shfl_sync.bfly.b32"](ot[0], st[0], T.uint32(16 >> s), T.uint32(31), FULL))
            st[0] = st[0] + ot[0]
        if WARPS > 1:
            if lane == 0:
                red[t // 32] = st[0]
            T.tvm_storage_sync("shared")
            st[0] = red[0]
            for w in T.unroll(WARPS - 1):
                st[0] = st[0] + red[w + 1]
            T.tvm_storage_sync("shared")      # red is reused by the |y| maximum

    EVEN = spec.m > 0 and spec.m % ROWS == 0            # every CTA's rows inside M

    @T.prim_func
    def kernel(x_h: T.handle, r_h: T.handle, g_h: T.handle, b_h: T.handle, y_h: T.handle, h_h: T.handle,
               xq_h: T.handle, xs_h: T.handle):
        T.func_attr({"global_symbol": spec.name, "tirx.noalias": True})
        X = T.match_buffer(x_h, (M, N), "float16")
        R = T.match_buffer(r_h, (M, N), "float16")
        G = T.match_buffer(g_h, (N,), "float16")
        B = T.match_buffer(b_h, (N,), "float16")
        Y = T.match_buffer(y_h, (M, N), "float16")
        H = T.match_buffer(h_h, (M, N), "float16")
        XQ = T.match_buffer(xq_h, (M, N), "int8")
        XS = T.match_buffer(xs_h, (M,), "float32")
        bx = T.launch_thread("blockIdx.x", -(-M // ROWS))
        tx = T.launch_thread("threadIdx.x", NT * ROWS)
        red = T.alloc_buffer((3 * WARPS,), "float32", scope="shared")
        vals = T.alloc_buffer((IT * 8,), "float32", scope="local")
        raw = T.alloc_buffer((IT * 8,), "float16", scope="local")
        rraw = T.alloc_buffer((IT * 8 if residual else 1,), "float16", scope="local")
        codes = T.alloc_buffer((8,), "int8", scope="local")
        gw = T.alloc_buffer((8,), "float16", scope="local")
        bw = T.alloc_buffer((8,), "float16", scope="local")
        st = T.alloc_buffer((3,), "float32", scope="local")        # count, mean, M2 of this thread
        ot = T.alloc_buffer((3,), "float32", scope="local")        # a partner's, during the merge
        mx = T.alloc_buffer((2,), "float32", scope="local")        # |y| max, a partner's
        row = T.meta_var(bx * ROWS + tx // NT)
        t = T.meta_var(tx % NT)
        lane = T.meta_var(tx % 32)
        if ROWS == 1 or EVEN or row < M:     # a warp per row: the guard is warp-uniform
            st[0] = T.float32(0)
            st[1] = T.float32(0)
            st[2] = T.float32(0)
            for it in T.unroll(IT):            # every load in flight before the first use
                if full or t + it * NT < CH:
                    for v in T.vectorized(8):
                        raw[it * 8 + v] = X[row, (t + it * NT) * 8 + v]
                    if residual:
                        for v in T.vectorized(8):
                            rraw[it * 8 + v] = R[row, (t + it * NT) * 8 + v]
            for it in T.unroll(IT):
                if full or t + it * NT < CH:
                    if residual:               # torch's fp16 add: the correctly rounded sum
                        for v in T.unroll(8):
                            if BF16:           # torch's bf16 add: the fp32 sum rounded to bf16
                                raw[it * 8 + v] = from_f32(to_f32(raw[it * 8 + v], ACT) + to_f32(rraw[it * 8 + v], ACT),
                                                           ACT)
                            else:
                                raw[it * 8 + v] = raw[it * 8 + v] + rraw[it * 8 + v]
                    if RMS:
                        if keep_sum:
                            for v in T.vectorized(8):
                                H[row, (t + it * NT) * 8 + v] = raw[it * 8 + v]
                        for v in T.unroll(8):
                            vals[it * 8 + v] = to_f32(raw[it * 8 + v], ACT)
                            st[0] = st[0] + vals[it * 8 + v] * vals[it * 8 + v]
                    else:
                        for v in T.unroll(8):      # Welford: the count of value (it, v) is 8·it + v + 1
                            vals[it * 8 + v] = to_f32(raw[it * 8 + v], ACT)
                            ot[0] = vals[it * 8 + v] - st[1]
                            st[1] = st[1] + ot[0] * (T.float32(1) / T.Cast("float32", it * 8 + v + 1))
                            st[2] = st[2] + ot[0] * (vals[it * 8 + v] - st[1])
                        st[0] = T.Cast("float32", it * 8 + 8)
            if RMS:
                sum_merge(st, ot, red, lane, t)
                st[2] = T.rsqrt(st[0] * T.float32(1.0 / N) + T.float32(spec.eps))
            else:
                merge(st, ot, red, lane, t)
                st[2] = T.rsqrt(st[2] * T.float32(1.0 / N) + T.float32(spec.eps))     # biased variance, as torch
            mx[0] = T.float32(0)
            for it in T.unroll(IT):
                if full or t + it * NT < CH:
                    if affine:
                        for v in T.vectorized(8):
                            gw[v] = G[(t + it * NT) * 8 + v]
                    if use_bias:
                        for v in T.vectorized(8):
                            bw[v] = B[(t + it * NT) * 8 + v]
                    for v in T.unroll(8):
                        raw[v] = from_f32(normalised(vals[it * 8 + v], st[1], st[2], gw, bw, v), ACT)
                        mx[0] = T.max(mx[0], T.fabs(to_f32(raw[v], ACT)))
                        vals[it * 8 + v] = to_f32(raw[v], ACT)
                    if emit_y:
                        for v in T.vectorized(8):
                            Y[row, (t + it * NT) * 8 + v] = raw[v]
            if emit_q:
                reduce_max(mx, red, lane, t)
                emit_codes(st, mx[0], vals, codes, XS, XQ, row, t)

    return tvm.IRModule({spec.name: kernel})     # unused buffers drop out of the device signature
