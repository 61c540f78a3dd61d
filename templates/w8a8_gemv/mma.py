"""The W8A8 GEMV's tensor-core kernel (``W8A8GemvSpec(mma=True)``, dense or ``sparse``), in TVMScript."""

from __future__ import annotations

from ..epilogue import output_value
from ..ptx import grid_dependency, to_f32
from .spec import MMA_K, W8A8GemvSpec


def w8a8_gemv_mma(spec: W8A8GemvSpec):
    """``Yᵀ = W · Xᵀ`` on ``mma.sync.m16n8k32.s8``: a CTA owns a 16-row tile of W, its warps take the 32-K chunks
    round robin (each lane's 16-byte load is its A fragment, ``pack_mma``; B is 8 rows of X, an 8-byte load per lane,
    zero past M; a second MMA for rows 8..15), then add their int32 fragments through shared memory; thread ``i``
    writes output (row ``i // 16``, column ``16·tile + i % 16``) with the dp4a kernel's epilogue. ``sparse``: the warps
    take the tile's kept chunks only (``Tab``: CSR offsets per tile, then each kept chunk's K index, read with its
    weights), so a pruned chunk costs neither a load nor an MMA. ``blocks`` (``bn``, ``bk``): the weight is a dense
    ``bsr_linear`` int8 tile's packed ``bn × bk`` blocks, every block in row-major order (no table read): CTA ``bx``
    takes the 16-row tile ``bx % (bn / 16)`` of block row ``bx // (bn / 16)``, its warps the blocks' units of
    ``unit_k`` K round robin; a lane loads rows ``g`` and ``g + 8`` of its unit at K
    ``(unit_k / 4) · t`` (16 or 8 bytes each), so the MMA's K order is permuted per unit — X's 8-byte loads alike."""
    import tvm
    from tvm.script import tirx as T

    from tvm import tirx
    N, K, W, G = spec.n, spec.k, spec.warps, spec.group
    MR = spec.max_rows                        # rows the registers and shared memory hold
    ANY = spec.m == 0
    M = tirx.Var("M", "int32") if spec.m == 0 else spec.m     # m=0: a kernel argument
    TL, CH = spec.tiles, K // MMA_K
    J = -(-CH // W)                           # chunks per warp (at most, when sparse)
    NB = -(-J // G)                           # batches per warp
    EVEN = CH % W == 0
    H = -(-MR // 8)                            # 8-row halves of X: one MMA each
    OUT = -(-16 * MR // (32 * W))              # outputs per thread
    BF16 = spec.act16 == "bfloat16"
    PDL, EARLY, SPARSE, BLOCKS = bool(spec.pdl), spec.pdl == "early", spec.sparse, spec.blocks
    MMA = "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32"
    if BLOCKS:
        BN, BK, UK = spec.bn, spec.bk, spec.unit_k
        UPB, SUB = BK // UK, BN // 16           # units per block, 16-row tiles per block row
        CH = -(-K // BK) * UPB                  # units of a full block row
        J = -(-CH // W)
        G = max(1, G * 32 // UK)                # units per batch: as many bytes as G 32-K chunks
        NB = -(-J // G)
        WPU = UK // 8                           # int32 words a lane loads per unit (rows g and g + 8)
        XPAST = K % BK != 0                     # the last block runs past K: X past it reads as zero
        EVEN = CH % W == 0
        KB = -(-K // BK)
    else:
        WPU, XPAST, UK, UPB, SUB, BN, BK = 4, False, 32, 1, 1, 16, 32
    CT = spec.ctas

    def kept(warp, j, se):                    # whether the warp's j-th chunk (unit) exists
        return (warp + j * W < se[1]) if SPARSE else (EVEN or warp + j * W < CH)

    @T.macro
    def load_units(WQ, wv, kc, bx, warp, lane, j, o):
        # blocks: unit u of block row bx // SUB -> rows (16-row tile bx % SUB, g / g + 8), K (unit, lane's t) of its
        # block u // UPB, the blocks bx // SUB * KB + kb in K order
        u = T.meta_var(warp + j * W)
        blk = T.meta_var(bx // SUB * KB + u // UPB)
        for h in T.unroll(2):
            row = T.meta_var((bx % SUB) * 16 + h * 8 + lane // 4)
            if UK == 64:
                T.evaluate(T.ptx["ld.global.nc.L1::no_allocate.v4.b32"](
                    wv[o * 8 + h * 4], wv[o * 8 + h * 4 + 1], wv[o * 8 + h * 4 + 2], wv[o * 8 + h * 4 + 3],
                    WQ.ptr_to([blk, row, (u % UPB) * 16 + (lane % 4) * 4])))
            else:
                T.evaluate(T.ptx["ld.global.nc.L1::no_allocate.v2.b32"](
                    wv[o * 4 + h * 2], wv[o * 4 + h * 2 + 1], WQ.ptr_to([blk, row, (u % UPB) * 8 + (lane % 4) * 2])))
        kc[o] = ((u // UPB) * BK + (u % UPB) * UK) // 4      # the unit's first X word

    @T.macro
    def load_batch(WQ, Tab, wv, kc, se, tile, warp, lane, bt):
        for g in T.unroll(G):
            j = T.meta_var(bt * G + g)
            if j < J:
                if kept(warp, j, se):
                    o = T.meta_var((bt % 2) * G + g)
                    if BLOCKS:
                        load_units(WQ, wv, kc, tile, warp, lane, j, o)
                    elif SPARSE:
                        T.evaluate(T.ptx["ld.global.nc.L1::no_allocate.v4.b32"](
                            wv[o * 4], wv[o * 4 + 1], wv[o * 4 + 2], wv[o * 4 + 3],
                            WQ.ptr_to([se[0] + warp + j * W, lane, 0])))
                        kc[o] = Tab[TL + 1 + se[0] + warp + j * W]
                    else:
                        T.evaluate(T.ptx["ld.global.nc.L1::no_allocate.v4.b32"](
                            wv[o * 4], wv[o * 4 + 1], wv[o * 4 + 2], wv[o * 4 + 3], WQ.ptr_to([tile, warp + j * W, lane, 0])))

    nnz = tirx.Var("nnz", "int32")
    WQ_SHAPE = (nnz, BN, BK // 4) if BLOCKS else (nnz, 32, 4) if SPARSE else (TL, CH, 32, 4)

    @T.prim_func
    def kernel(xq_h: T.handle, xs_h: T.handle, wq_h: T.handle, ws_h: T.handle, b_h: T.handle, os_h: T.handle,
               tab_h: T.handle, y_h: T.handle):
        T.func_attr({"global_symbol": spec.name, "tirx.noalias": True})
        ntab = T.int32()
        XQ = T.match_buffer(xq_h, (M, K // 4), "int32")          # int8 codes, four per word
        XS = T.match_buffer(xs_h, (M,), "float32")
        WQ = T.match_buffer(wq_h, WQ_SHAPE, "int32")             # pack_mma's bytes, or the tile's blocks
        WS = T.match_buffer(ws_h, (N,), "float32")
        B = T.match_buffer(b_h, (N,), "float16")
        OS = T.match_buffer(os_h, (2,), "float32")
        Tab = T.match_buffer(tab_h, (ntab,), "int32")            # sparse: offsets per tile, then chunk K indices
        Y = T.match_buffer(y_h, (M, N), spec.y_lanes)
        bx = T.launch_thread("blockIdx.x", CT)
        tx = T.launch_thread("threadIdx.x", 32 * W)
        wv = T.alloc_buffer((2 * G * WPU,), "uint32", scope="local")  # two batches of A fragments
        kc = T.alloc_buffer((2 * G,), "int32", scope="local")       # their chunks' K indices
        se = T.alloc_buffer((2,), "int32", scope="local")           # sparse: first kept chunk, count
        xb = T.alloc_buffer((2,), "uint32", scope="local")          # a B fragment
        acc = T.alloc_buffer((H * 4,), "uint32", scope="local")
        red = T.alloc_buffer((W * H * 128,), "int32", scope="shared")
        cst = T.alloc_buffer((OUT * 3,), "float32", scope="local")  # ws, b, xs of the thread's outputs
        tot = T.alloc_buffer((1,), "int32", scope="local")
        lane = T.meta_var(tx % 32)
        warp = T.meta_var(tx // 32)
        col0 = T.meta_var(bx // SUB * BN + bx % SUB * 16 if BLOCKS else bx * 16)   # first column
        if PDL and EARLY:
            T.evaluate(grid_dependency("launch_dependents"))
        if SPARSE:
            se[0] = Tab[bx]
            se[1] = Tab[bx + 1] - se[0]
        load_batch(WQ, Tab, wv, kc, se, bx, warp, lane, 0)
        for it in T.unroll(OUT):
            n = T.meta_var(T.min(col0 + (tx + it * 32 * W) % 16, N - 1))
            cst[it * 3] = WS[n]
            cst[it * 3 + 1] = to_f32(B[n], spec.act16) if spec.bias else T.float32(0)
        if PDL:
            T.evaluate(grid_dependency("wait"))
            if not EARLY:
                T.evaluate(grid_dependency("launch_dependents"))
        for it in T.unroll(OUT):
            cst[it * 3 + 2] = XS[T.min((tx + it * 32 * W) // 16, M - 1)]
        for i in T.unroll(H * 4):
            acc[i] = T.uint32(0)
        for bt in T.unroll(NB):
            if bt + 1 < NB:
                load_batch(WQ, Tab, wv, kc, se, bx, warp, lane, bt + 1)   # in flight while this batch is multiplied
            for g in T.unroll(G):
                j = T.meta_var(bt * G + g)
                if j < J:
                    if kept(warp, j, se):
                        o = T.meta_var((bt % 2) * G + g)
                        for s in T.unroll(UK // 32 if BLOCKS else 1):
                            # X words of the MMA's K: chunk c's 8t .. 8t+7, or the unit's (UK/4)t + 8s .. +8
                            xw = T.meta_var(kc[o] + (lane % 4) * (UK // 16) + 2 * s if BLOCKS else
                                            (kc[o] if SPARSE else warp + j * W) * 8 + (lane % 4) * 2)
                            for h in T.unroll(H):
                                if (ANY or h * 8 + lane // 4 < M) and (not XPAST or xw * 4 < K):
                                    for v in T.unroll(2):   # any M: rows past it read row M-1 (unstored)
                                        row = T.meta_var(T.min(h * 8 + lane // 4, M - 1) if ANY else h * 8 + lane // 4)
                                        xb[v] = T.reinterpret("uint32", XQ[row, xw + v])
                                else:
                                    for v in T.unroll(2):
                                        xb[v] = T.uint32(0)
                                a = T.meta_var(o * WPU + s * 2)     # blocks: rows g then g + 8 (WPU / 2 words each)
                                T.evaluate(T.ptx[MMA](acc[h * 4], acc[h * 4 + 1], acc[h * 4 + 2], acc[h * 4 + 3],
                                                      wv[a] if BLOCKS else wv[o * 4],
                                                      wv[a + WPU // 2] if BLOCKS else wv[o * 4 + 1],
                                                      wv[a + 1] if BLOCKS else wv[o * 4 + 2],
                                                      wv[a + WPU // 2 + 1] if BLOCKS else wv[o * 4 + 3], xb[0], xb[1],
                                                      acc[h * 4], acc[h * 4 + 1], acc[h * 4 + 2], acc[h * 4 + 3]))
        for h in T.unroll(H):
            for r in T.unroll(4):
                red[((warp * H + h) * 32 + lane) * 4 + r] = T.reinterpret("int32", acc[h * 4 + r])
        T.tvm_storage_sync("shared")
        for it in T.unroll(OUT):
            i = T.meta_var(tx + it * 32 * W)
            if i < 16 * M:
                nl = T.meta_var(i % 16)
                m = T.meta_var(i // 16)
                src = T.meta_var(((m // 8) * 32 + (nl % 8) * 4 + (m % 8) // 2) * 4 + (nl // 8) * 2 + m % 2)
                tot[0] = 0
                for w in T.unroll(W):
                    tot[0] = tot[0] + red[w * H * 128 + src]
                if col0 + nl < N:
                    v = T.meta_var(T.Cast("float32", tot[0]) * cst[it * 3 + 2] * cst[it * 3])
                    Y[m, col0 + nl] = output_value(
                        v, (cst[it * 3 + 1] if BF16 else T.Cast("float16", cst[it * 3 + 1])) if spec.bias else None,
                        spec.act, spec.out, OS)

    return tvm.IRModule({spec.name: kernel})
