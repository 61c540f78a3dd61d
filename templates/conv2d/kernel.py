"""The block-sparse implicit-GEMM convolution kernel in TVMScript (``mma.sync``, sm_80 and sm_90).

Grid: ``ceil(M / tm)`` tiles of output pixels × the weight's block rows. Each thread first decodes the output pixels
of the im2col rows it loads (image, top-left input row and column) once; per kept block of its block row (the table's
run), the tap ``(r, s)`` and channel block of the block's ``kb`` give each row's input pixel, loaded 16 bytes
(8 channels) per ``cp.async`` with zero fill where the tap falls in the padding, past ``M`` or past ``Cin``; the
packed weight block follows in the same stage. ``stages`` blocks are in flight. Warps multiply ``ldmatrix``
fragments of the XOR-swizzled tiles with ``mma.sync.m16n8k16`` into fp32 accumulators; the epilogue adds the bias
and the residual, applies the activation and stores each thread's column pairs straight to ``Y``.
"""

from __future__ import annotations

from ..epilogue import tir_activate
from ..ptx import device_call, from_f32, to_f32
from .spec import Conv2dSpec

_STORES = {"st_h2": ("void* p, float a, float b", "*(half2*)p = __floats2half2_rn(a, b);"),
           "st_b2": ("void* p, float a, float b",
                     "unsigned ua = __float_as_uint(a), ub = __float_as_uint(b); ua += 0x7FFFu + ((ua >> 16) & 1u); "
                     "ub += 0x7FFFu + ((ub >> 16) & 1u); *(unsigned*)p = (ua >> 16) | (ub & 0xFFFF0000u);")}


def conv2d_kernel(spec: Conv2dSpec):
    """The kernel as an IRModule with one PrimFunc named ``spec.name``."""
    import tvm
    from tvm import tirx
    from tvm.script import tirx as T

    CIN, COUT, H, W = spec.cin, spec.cout, spec.h, spec.w
    KW = spec.kw
    (SH, SW), (PH, PW), (DH, DW) = spec.stride, spec.padding, spec.dilation
    OW, OHW = spec.ow, spec.oh * spec.ow
    BN, BK, TM, S, NT = spec.bn, spec.bk, spec.tm, spec.stages, spec.threads
    CB, R, WN = spec.cin_blocks, spec.row_blocks, spec.warps_n
    WTM, WTN = TM // spec.warps_m, BN // WN
    MI, NI = WTM // 16, WTN // 8
    C = BK // 8                              # 16-byte chunks per shared row
    RPL = max(1, 8 // C)                     # rows per 128-byte bank line
    X_ELEMS, STAGE = TM * BK, spec.stage_lanes
    X_CHUNKS, W_CHUNKS = TM * C, BN * C
    X_ITERS, W_ITERS = -(-X_CHUNKS // NT), -(-W_CHUNKS // NT)
    HEAD = R + 1                             # where the blocks' kb start in the table
    ACT, BIAS, RES = spec.dtype, spec.bias, spec.residual
    op16 = "bf16" if ACT == "bfloat16" else "f16"
    MMA = f"mma.sync.aligned.m16n8k16.row.col.f32.{op16}.{op16}.f32"
    PAIRS = COUT % 2 == 0                    # column pairs stored as one 4-byte word
    STORE = "st_b2" if ACT == "bfloat16" else "st_h2"
    NB, M = tirx.Var("NB", "int32"), tirx.Var("M", "int32")

    def swz(row, chunk):                     # shared offset of a 16-byte chunk, XOR-swizzled
        return row * BK + T.bitwise_xor(chunk, T.truncmod(T.truncdiv(row, RPL), C)) * 8

    @T.macro
    def load_stage(smem, X, Wp, pix, kd, tx, stage, kb, blk):
        # the im2col rows of K block ``kb`` (tap r, s; channel block cb) and packed block ``blk`` into ``stage``
        kd[0] = T.truncdiv(kb, CB)
        kd[1] = T.truncdiv(kd[0], KW) * DH                  # the tap's offset in input rows, columns, channels
        kd[2] = T.truncmod(kd[0], KW) * DW
        kd[3] = T.truncmod(kb, CB) * BK
        for it in T.unroll(X_ITERS):
            c = T.meta_var(tx + it * NT)
            if X_CHUNKS % NT == 0 or c < X_CHUNKS:
                ih = T.meta_var(pix[it * 4 + 1] + kd[1])
                iw = T.meta_var(pix[it * 4 + 2] + kd[2])
                ci = T.meta_var(kd[3] + c % C * 8)
                ok = T.meta_var(T.Cast("uint32", T.if_then_else(
                    T.And(T.And(pix[it * 4 + 3] != 0, ci < CIN),
                          T.And(T.And(0 <= ih, ih < H), T.And(0 <= iw, iw < W))), 16, 0)))
                T.evaluate(T.ptx["cp.async.cg.shared.global"](
                    smem.ptr_to([stage * STAGE + swz(c // C, c % C)]),
                    X.ptr_to([pix[it * 4], T.max(T.min(ih, H - 1), 0), T.max(T.min(iw, W - 1), 0),
                              T.min(ci, CIN - 8)]), 16, ok))
        for it in T.unroll(W_ITERS):
            c = T.meta_var(tx + it * NT)
            if W_CHUNKS % NT == 0 or c < W_CHUNKS:
                T.evaluate(T.ptx["cp.async.cg.shared.global"](
                    smem.ptr_to([stage * STAGE + X_ELEMS + swz(c // C, c % C)]),
                    Wp.ptr_to([blk * (BN * BK) + c * 8]), 16))

    @T.macro
    def mma_stage(smem, acc, af, bf, lane, wr, wc, base):
        for kk in T.unroll(BK // 16):
            for mi in T.unroll(MI):
                T.evaluate(T.ptx["ldmatrix.sync.aligned.m8n8.x4.shared.b16"](
                    af[mi * 4], af[mi * 4 + 1], af[mi * 4 + 2], af[mi * 4 + 3],
                    smem.ptr_to([base + swz(wr * WTM + mi * 16 + lane % 16, kk * 2 + lane // 16)])))
            for nj in T.unroll(NI // 2):
                T.evaluate(T.ptx["ldmatrix.sync.aligned.m8n8.x4.shared.b16"](
                    bf[nj * 4], bf[nj * 4 + 1], bf[nj * 4 + 2], bf[nj * 4 + 3],
                    smem.ptr_to([base + X_ELEMS + swz(wc * WTN + nj * 16 + (lane // 16) * 8 + lane % 8,
                                                      kk * 2 + (lane // 8) % 2)])))
            for mi in T.unroll(MI):
                for ni in T.unroll(NI):
                    T.evaluate(T.ptx[MMA](
                        acc[(mi * NI + ni) * 4], acc[(mi * NI + ni) * 4 + 1],
                        acc[(mi * NI + ni) * 4 + 2], acc[(mi * NI + ni) * 4 + 3],
                        af[mi * 4], af[mi * 4 + 1], af[mi * 4 + 2], af[mi * 4 + 3],
                        bf[ni * 2], bf[ni * 2 + 1],
                        acc[(mi * NI + ni) * 4], acc[(mi * NI + ni) * 4 + 1],
                        acc[(mi * NI + ni) * 4 + 2], acc[(mi * NI + ni) * 4 + 3]))

    def value(a, B, RR, row, col):
        v = a
        if BIAS:
            v = v + to_f32(B[col], ACT)
        if RES:
            v = v + to_f32(RR[row, col], ACT)
        return tir_activate(v, None, spec.act)

    @T.prim_func
    def kernel(x_h: T.handle, wp_h: T.handle, b_h: T.handle, r_h: T.handle, tab_h: T.handle, y_h: T.handle):
        T.func_attr({"global_symbol": spec.name, "tirx.noalias": True})
        wlen = T.int32()
        ntab = T.int32()
        X = T.match_buffer(x_h, (NB, H, W, CIN), "float16")
        Wp = T.match_buffer(wp_h, (wlen,), "float16")
        B = T.match_buffer(b_h, (COUT,), "float16")
        RR = T.match_buffer(r_h, (M, COUT), "float16")
        Tab = T.match_buffer(tab_h, (ntab,), "int32")
        Y = T.match_buffer(y_h, (M, COUT), "float16")
        bx = T.launch_thread("blockIdx.x", (M + TM - 1) // TM)
        by = T.launch_thread("blockIdx.y", R)
        tx = T.launch_thread("threadIdx.x", NT)
        smem = T.decl_buffer((spec.shared_bytes // 2,), "float16", scope="shared.dyn")
        acc = T.alloc_buffer((MI * NI * 4,), "float32", scope="local")
        af = T.alloc_buffer((MI * 4,), "uint32", scope="local")
        bf = T.alloc_buffer((NI * 2,), "uint32", scope="local")
        pix = T.alloc_buffer((X_ITERS * 4,), "int32", scope="local")    # per loaded row: image, ih0, iw0, in M
        kd = T.alloc_buffer((4,), "int32", scope="local")               # the loading block's tap and channels
        yv = T.alloc_buffer((2,), "float32", scope="local")
        lane = T.meta_var(tx % 32)
        wr = T.meta_var(tx // 32 // WN)
        wc = T.meta_var(tx // 32 % WN)
        m0 = T.meta_var(bx * TM)
        first = T.meta_var(Tab[by])
        count = T.meta_var(Tab[by + 1] - Tab[by])
        for it in T.unroll(X_ITERS):
            m = T.meta_var(T.min(m0 + (tx + it * NT) // C, M - 1))
            pix[it * 4] = m // OHW
            pix[it * 4 + 1] = m % OHW // OW * SH - PH
            pix[it * 4 + 2] = m % OHW % OW * SW - PW
            pix[it * 4 + 3] = T.Cast("int32", m0 + (tx + it * NT) // C < M)
        for i in T.unroll(MI * NI * 4):
            acc[i] = T.float32(0)
        for s in T.unroll(S - 1):
            if s < count:
                load_stage(smem, X, Wp, pix, kd, tx, s, Tab[HEAD + first + s], first + s)
            T.evaluate(T.ptx["cp.async.commit_group"]())
        for t in T.serial(count):
            T.evaluate(T.ptx["cp.async.wait_group"](S - 2))
            T.tvm_storage_sync("shared")               # stage t landed; stage t-1 is free
            if t + (S - 1) < count:
                load_stage(smem, X, Wp, pix, kd, tx, (t + (S - 1)) % S, Tab[HEAD + first + t + (S - 1)],
                           first + t + (S - 1))
            T.evaluate(T.ptx["cp.async.commit_group"]())
            mma_stage(smem, acc, af, bf, lane, wr, wc, (t % S) * STAGE)
        T.evaluate(T.ptx["cp.async.wait_group"](0))
        for mi in T.unroll(MI):
            for ni in T.unroll(NI):
                for h in T.unroll(2):
                    row = T.meta_var(m0 + wr * WTM + mi * 16 + lane // 4 + h * 8)
                    col = T.meta_var(by * BN + wc * WTN + ni * 8 + (lane % 4) * 2)
                    if row < M:
                        for e in T.unroll(2):
                            yv[e] = value(acc[(mi * NI + ni) * 4 + h * 2 + e], B, RR, row, T.min(col + e, COUT - 1))
                        if PAIRS:
                            if col < COUT:
                                T.evaluate(device_call(_STORES, STORE, Y.ptr_to([row, col]), yv[0], yv[1]))
                        else:
                            for e in T.unroll(2):
                                if col + e < COUT:
                                    Y[row, col + e] = from_f32(yv[e], ACT)

    return tvm.IRModule({spec.name: kernel})


__all__ = ["conv2d_kernel"]
