"""The few-row block-sparse fp16 GEMV of ``bsr_linear`` (``gemv_spec.py``), in TVMScript."""

from __future__ import annotations

from ..epilogue import tir_activate
from ..ptx import from_f32, grid_dependency, to_f32
from .gemv_spec import BsrGemvSpec


def bsr_gemv(spec: BsrGemvSpec):
    """The kernel as an IRModule with one PrimFunc named ``spec.name``."""
    import tvm
    from tvm import tirx
    from tvm.script import tirx as T

    M = tirx.Var("M", "int32")
    N, K, BN, BK, MR, W = spec.n, spec.k, spec.bn, spec.bk, spec.rows, spec.warps
    LPR, J, UR = spec.lanes_per_row, spec.lane_loads, spec.unit_rows
    IF = spec.inflight                       # blocks a warp keeps in flight
    XF = IF > 2                              # the round's X pieces load before its first product too
    RPI = 32 // LPR                          # block rows one warp-wide load covers
    U = BN // UR                             # CTAs per block row
    HEAD, BLOCK = spec.table_head, BN * BK
    OUTS = -(-UR * MR // (32 * W))           # epilogue outputs per thread
    STEPS = LPR.bit_length() - 1             # butterfly steps over a row's lanes
    FULL = T.uint32(0xFFFFFFFF)
    PDL = spec.pdl
    ACT = spec.dtype                         # X, Wp, B, Y hold 16-bit lanes of this type

    @T.macro
    def load_block(Wp, Tab, wv, kb, o, j, first, r0, rr, kq, count, warp):
        # the warp's j-th block (if it has one): its J 16-byte pieces into wv[o], its K index into kb[o]
        if warp + j * W < count:
            for i in T.unroll(J):
                for v in T.vectorized(8):
                    wv[(o * J + i) * 8 + v] = Wp[(first + warp + j * W) * BLOCK + (r0 + i * RPI + rr) * BK + kq * 8 + v]
            kb[o] = Tab[HEAD + first + warp + j * W]

    GATE, SI = spec.gate, spec.slot_ints
    SUMS = J * MR                            # a thread's sums (a gated kernel keeps the up's after the gate's)

    @T.macro
    def load_x(X, M, xv, kb, o, kq, xs):
        # every row's X piece for the block in slot o of wv, into slot xs of xv
        for m in T.unroll(MR):
            if m < M:
                if K % BK == 0 or kb[o] * BK + kq * 8 < K:
                    for v in T.vectorized(8):
                        xv[(xs * MR + m) * 8 + v] = X[m, kb[o] * BK + kq * 8 + v]
                else:
                    for v in T.unroll(8):
                        xv[(xs * MR + m) * 8 + v] = T.float16(0)

    @T.macro
    def fma(M, wv, wf, xv, acc, o, xs, a0):
        # acc[i, m] += W piece i of slot o · its X piece (slot xs of xv, loaded by load_x)
        for e in T.unroll(J * 8):
            wf[e] = to_f32(wv[o * J * 8 + e], ACT)
        for m in T.unroll(MR):
            if m < M:
                for i in T.unroll(J):
                    for v in T.unroll(8):
                        acc[a0 + i * MR + m] = acc[a0 + i * MR + m] + wf[i * 8 + v] * to_f32(
                            xv[(xs * MR + m) * 8 + v], ACT)

    @T.macro
    def multiply(X, M, wv, wf, xv, acc, kb, o, kq, a0):
        # acc[i, m] += W piece i · X[m, the lane's 8 columns of the block]: every row's X piece in flight first
        load_x(X, M, xv, kb, o, kq, 0)
        fma(M, wv, wf, xv, acc, o, 0, a0)

    @T.macro
    def fma_block(M, wv, wf, xv, acc, o, j, warp, gate_count):
        # ``XF``: the warp's j-th block (slot o) into the gate's sums or the up's
        if GATE:
            if warp + j * W < gate_count:
                fma(M, wv, wf, xv, acc, o, o, 0)
            else:
                fma(M, wv, wf, xv, acc, o, o, SUMS)
        else:
            fma(M, wv, wf, xv, acc, o, o, 0)

    @T.macro
    def multiply_block(X, M, wv, wf, xv, acc, kb, o, kq, j, warp, gate_count):
        # the warp's j-th block into the gate's sums or the up's
        if GATE:
            if warp + j * W < gate_count:
                multiply(X, M, wv, wf, xv, acc, kb, o, kq, 0)
            else:
                multiply(X, M, wv, wf, xv, acc, kb, o, kq, SUMS)
        else:
            multiply(X, M, wv, wf, xv, acc, kb, o, kq, 0)

    @T.prim_func
    def kernel(x_h: T.handle, wp_h: T.handle, b_h: T.handle, tab_h: T.handle, y_h: T.handle):
        T.func_attr({"global_symbol": spec.name, "tirx.noalias": True})
        wlen = T.int32()
        ntab = T.int32()
        X = T.match_buffer(x_h, (M, K), "float16")
        Wp = T.match_buffer(wp_h, (wlen,), "float16")
        B = T.match_buffer(b_h, (2 * N if GATE else N,), "float16")
        Tab = T.match_buffer(tab_h, (ntab,), "int32")
        Y = T.match_buffer(y_h, (M, N), "float16")
        bx = T.launch_thread("blockIdx.x", spec.ctas)
        tx = T.launch_thread("threadIdx.x", 32 * W)
        red = T.alloc_buffer(((1 + GATE) * W * UR * MR,), "float32", scope="shared")
        acc = T.alloc_buffer(((1 + GATE) * SUMS,), "float32", scope="local")
        wv = T.alloc_buffer((IF * J * 8,), "float16", scope="local")    # IF blocks in flight
        wf = T.alloc_buffer((J * 8,), "float32", scope="local")
        kb = T.alloc_buffer((IF,), "int32", scope="local")
        xv = T.alloc_buffer(((IF if XF else 1) * MR * 8,), "float16", scope="local")
        tot = T.alloc_buffer((1 + GATE,), "float32", scope="local")
        lane = T.meta_var(tx % 32)
        warp = T.meta_var(tx // 32)
        slot = T.meta_var(bx // U)
        r0 = T.meta_var((bx % U) * UR)       # the CTA's first row inside the block row
        kq = T.meta_var(lane % LPR)          # the lane's 8 columns of a block
        rr = T.meta_var(lane // LPR)
        row = T.meta_var(Tab[slot * SI])
        first = T.meta_var(Tab[slot * SI + 1])
        count = T.meta_var(Tab[slot * SI + 2])
        gate_count = T.meta_var(Tab[slot * SI + SI - 1])     # gated: the gate's blocks come first
        for i in T.unroll((1 + GATE) * SUMS):
            acc[i] = T.float32(0)
        for t in T.serial((count - warp + IF * W - 1) // (IF * W)):     # the warp's blocks, IF at a time
            if XF:                           # every block, then every X piece, then the products
                for o in T.unroll(IF):
                    load_block(Wp, Tab, wv, kb, o, IF * t + o, first, r0, rr, kq, count, warp)
                if PDL:
                    if t == 0:
                        T.evaluate(grid_dependency("wait"))
                for o in T.unroll(IF):
                    if warp + (IF * t + o) * W < count:
                        load_x(X, M, xv, kb, o, kq, o)
                for o in T.unroll(IF):
                    if warp + (IF * t + o) * W < count:
                        fma_block(M, wv, wf, xv, acc, o, IF * t + o, warp, gate_count)
            elif IF == 2:
                load_block(Wp, Tab, wv, kb, 0, 2 * t, first, r0, rr, kq, count, warp)
                load_block(Wp, Tab, wv, kb, 1, 2 * t + 1, first, r0, rr, kq, count, warp)
                if PDL:
                    if t == 0:               # the weights load while the previous kernel finishes; X is its output
                        T.evaluate(grid_dependency("wait"))
                multiply_block(X, M, wv, wf, xv, acc, kb, 0, kq, 2 * t, warp, gate_count)
                if warp + (2 * t + 1) * W < count:
                    multiply_block(X, M, wv, wf, xv, acc, kb, 1, kq, 2 * t + 1, warp, gate_count)
            else:
                load_block(Wp, Tab, wv, kb, 0, t, first, r0, rr, kq, count, warp)
                if PDL:
                    if t == 0:
                        T.evaluate(grid_dependency("wait"))
                multiply_block(X, M, wv, wf, xv, acc, kb, 0, kq, t, warp, gate_count)
        if PDL:                              # every write after the previous kernel completed
            T.evaluate(grid_dependency("wait"))
            T.evaluate(grid_dependency("launch_dependents"))
        for g in T.unroll(1 + GATE):
            for m in T.unroll(MR):
                if m < M:
                    for i in T.unroll(J):
                        a = T.meta_var(g * SUMS + i * MR + m)
                        for s in T.unroll(STEPS):
                            T.evaluate(T.ptx["shfl_sync.bfly.b32"](tot[0], acc[a], T.uint32(LPR // 2 >> s),
                                                                    T.uint32(31), FULL))
                            acc[a] = acc[a] + tot[0]
                        if kq == 0:
                            red[g * W * UR * MR + (warp * UR + i * RPI + rr) * MR + m] = acc[a]
        T.tvm_storage_sync("shared")
        for it in T.unroll(OUTS):
            o = T.meta_var(tx + it * 32 * W)
            if UR * MR % (32 * W) == 0 or o < UR * MR:
                r = T.meta_var(o % UR)
                m = T.meta_var(o // UR)
                n = T.meta_var(row * BN + r0 + r)
                if m < M and n < N:
                    tot[0] = T.float32(0)
                    for w in T.unroll(W):
                        tot[0] = tot[0] + red[(w * UR + r) * MR + m]
                    if spec.bias:
                        tot[0] = tot[0] + to_f32(B[n], ACT)
                    tot[0] = tir_activate(tot[0], None, spec.act)
                    if GATE:
                        tot[1] = T.float32(0)
                        for w in T.unroll(W):
                            tot[1] = tot[1] + red[W * UR * MR + (w * UR + r) * MR + m]
                        if spec.bias:
                            tot[1] = tot[1] + to_f32(B[N + n], ACT)
                        tot[0] = tot[0] * tot[1]
                    Y[m, n] = from_f32(tot[0], ACT)

    return tvm.IRModule({spec.name: kernel})
