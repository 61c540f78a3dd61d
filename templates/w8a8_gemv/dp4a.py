"""The W8A8 GEMV's dp4a kernel (``W8A8GemvSpec(mma=False)``; K a multiple of 16), in TVMScript.

One warp per output row ``n``: each lane streams 16-byte chunks of ``WQ[n]`` (chunks ``lane``, ``lane + 32``, …; a
warp reads 512 contiguous bytes per load, ``ld.global.nc.L1::no_allocate``), ``group`` chunks per batch, the next
batch's loads issued before the current one is multiplied, so a warp keeps its weights streaming. Each chunk meets
the ``M`` rows' chunks of ``XQ`` (L1 hits: every warp of a CTA reads the same X) in 4 ``dp4a.s32.s32`` per row into
int32 sums — exact, the order does not matter: K·127² < 2³¹ for K up to 133,000. A butterfly reduction leaves every
lane every row's sum; lane ``m`` applies the epilogue to row ``m`` and writes it.
"""

from __future__ import annotations

from ..epilogue import output_value
from ..ptx import grid_dependency, to_f32
from .spec import CHUNK, W8A8GemvSpec


def w8a8_gemv_dp4a(spec: W8A8GemvSpec):
    """The dp4a kernel as an IRModule with one PrimFunc named ``spec.name``."""
    import tvm
    from tvm.script import tirx as T

    M, N, K, W, G = spec.m, spec.n, spec.k, spec.warps, spec.group
    CK = K // CHUNK                           # chunks per row
    IT = spec.chunks                          # chunks per lane
    NB = -(-IT // G)                          # batches per lane
    FULL = CK % 32 == 0                       # every lane's every chunk in range: no guard
    PDL, EARLY = bool(spec.pdl), spec.pdl == "early"
    ONE = T.uint32(0xFFFFFFFF)

    @T.macro
    def load_batch(WQ, wv, n, lane, bt):
        for g in T.unroll(G):
            it = T.meta_var(bt * G + g)
            if it < IT:
                if FULL or lane + it * 32 < CK:
                    o = T.meta_var((bt % 2) * G * 4 + g * 4)
                    T.evaluate(T.ptx["ld.global.nc.L1::no_allocate.v4.b32"](
                        wv[o], wv[o + 1], wv[o + 2], wv[o + 3], WQ.ptr_to([n, (lane + it * 32) * 4])))

    def bias_value(bv):                       # the bias as the epilogue adds it: fp16 as is, bf16 widened to fp32
        return to_f32(bv[0], "bfloat16") if spec.act16 == "bfloat16" else bv[0]

    @T.prim_func
    def kernel(xq_h: T.handle, xs_h: T.handle, wq_h: T.handle, ws_h: T.handle, b_h: T.handle, os_h: T.handle,
               y_h: T.handle):
        T.func_attr({"global_symbol": spec.name, "tirx.noalias": True})
        XQ = T.match_buffer(xq_h, (M, K // 4), "int32")          # int8 codes, four per word
        XS = T.match_buffer(xs_h, (M,), "float32")
        WQ = T.match_buffer(wq_h, (N, K // 4), "int32")
        WS = T.match_buffer(ws_h, (N,), "float32")
        B = T.match_buffer(b_h, (N,), "float16")
        OS = T.match_buffer(os_h, (2,), "float32")               # out="int8": the output scale and its reciprocal
        Y = T.match_buffer(y_h, (M, N), spec.y_lanes)
        bx = T.launch_thread("blockIdx.x", -(-N // W))
        tx = T.launch_thread("threadIdx.x", 32 * W)
        wv = T.alloc_buffer((2 * G * 4,), "int32", scope="local")  # two batches of weight chunks
        xw = T.alloc_buffer((4,), "int32", scope="local")
        acc = T.alloc_buffer((M,), "int32", scope="local")
        other = T.alloc_buffer((1,), "int32", scope="local")
        cst = T.alloc_buffer((2,), "float32", scope="local")       # ws of the warp's row, xs of the lane's
        bv = T.alloc_buffer((1,), "float16", scope="local")
        lane = T.meta_var(tx % 32)
        n = T.meta_var(bx * W + tx // 32)

        if n < N:
            if PDL and EARLY:
                T.evaluate(grid_dependency("launch_dependents"))
            load_batch(WQ, wv, n, lane, 0)
            cst[0] = WS[n]
            if spec.bias:
                bv[0] = B[n]
            if PDL:
                T.evaluate(grid_dependency("wait"))
                if not EARLY:
                    T.evaluate(grid_dependency("launch_dependents"))
            cst[1] = XS[T.min(lane, M - 1)]
            for m in T.unroll(M):
                acc[m] = 0
            for bt in T.unroll(NB):
                if bt + 1 < NB:
                    load_batch(WQ, wv, n, lane, bt + 1)                           # in flight while this batch is multiplied
                for g in T.unroll(G):
                    it = T.meta_var(bt * G + g)
                    if it < IT:
                        if FULL or lane + it * 32 < CK:
                            c = T.meta_var(lane + it * 32)
                            o = T.meta_var((bt % 2) * G * 4 + g * 4)
                            for m in T.unroll(M):
                                for v in T.vectorized(4):
                                    xw[v] = XQ[m, c * 4 + v]
                                for i in T.unroll(4):
                                    T.evaluate(T.ptx["dp4a.s32.s32"](acc[m], wv[o + i], xw[i], acc[m]))
            for m in T.unroll(M):
                for s in T.unroll(5):
                    T.evaluate(T.ptx["shfl_sync.bfly.b32"](other[0], acc[m], T.uint32(16 >> s), T.uint32(31), ONE))
                    acc[m] = acc[m] + other[0]
            for m in T.unroll(M):
                if lane == m:
                    v = T.meta_var(T.Cast("float32", acc[m]) * cst[1] * cst[0])
                    Y[m, n] = output_value(v, bias_value(bv) if spec.bias else None, spec.act, spec.out, OS)

    return tvm.IRModule({spec.name: kernel})
