"""The 2:4 sparse linear (``spec.NmLinearSpec``) in TVMScript, on ``mma.sp`` m16n8k32.

Grid: (row tiles / ``tiles``, ``ksplit``). A CTA owns ``16 · tiles`` output channels and a K range; warp ``w``
multiplies row tile ``w % tiles`` and takes its batches of ``inflight`` K tiles round robin with the tile's other warps
(``prefetch``: the next batch's fragments load into a second register buffer before this one's MMAs). Per batch a lane loads its A fragments (one 16-byte load a K tile: the warp's
512 contiguous bytes) and the metadata words of the batch's groups of 4 K tiles (one 16-byte load a group), all in
flight before the first MMA; then per K tile one ``mma.sp::ordered_metadata`` (selector 0) per 8 rows of X, the B
fragment one 16-byte shared load: X is staged in shared memory with each 32-column block permuted so lane ``t``'s
eight values (columns ``8j + 2t``, ``8j + 2t + 1``, j = 0..3) lie together. fp32 accumulation; the warps' partial
tiles are summed through shared memory (reusing X's), then bias and activation (``templates/epilogue.py``).
``ksplit > 1``: each CTA leaves fp32 partials in ``P`` and counts itself in ``Cnt`` after a fence; the last of a row
tile's CTAs sums them in split order, writes ``Y`` and resets its counter. ``pdl``: the first batch's weights load
before ``griddepcontrol.wait``; X and every write after it.
"""

from __future__ import annotations

from ..epilogue import tir_activate
from ..ptx import from_f32, grid_dependency, to_f32
from .spec import NmLinearSpec


def nm_linear(spec: NmLinearSpec):
    """The kernel as an IRModule with one PrimFunc named ``spec.name``."""
    import tvm
    from tvm import tirx
    from tvm.script import tirx as T

    M = tirx.Var("M", "int32")
    N, K, MR, W, IF = spec.n, spec.k, spec.rows, spec.warps, spec.inflight
    RT, G, KTP, RG, KS = spec.row_tiles, spec.groups, spec.k_tiles, spec.range_groups, spec.ksplit
    RK, XS, NB, NT = spec.range_k, spec.x_stride, spec.mmas, 32 * W
    TL, WT, RTG, PF = spec.tiles, spec.tile_warps, spec.cta_rows, spec.prefetch
    GB = IF // 4                              # groups of 4 K tiles a batch
    NBT = spec.batches
    ITER = -(-NBT // WT)                      # batches a warp takes (at most)
    NBUF = 2 if PF else 1                     # register buffers of weight fragments
    CH = 16 * TL                              # output channels of a CTA
    OUTS = CH * MR
    OUT_ITERS = -(-OUTS // NT)
    ACT, PDL = spec.dtype, spec.pdl
    VEC = K % 8 == 0                          # X rows in 16-byte pieces
    STAGE = RK // 8 if VEC else RK            # X pieces (or values) of one row to stage
    SU = max(1, min(8, -(-MR * STAGE // NT)))  # pieces a thread loads before it stores them
    RED = 8 * NB                              # columns of a warp's partial tile in ``red``
    op16 = "bf16" if ACT == "bfloat16" else "f16"
    MMA = f"mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32.{op16}.{op16}.f32"
    # no __restrict__ under PDL: nvcc may move a restrict (ld.global.nc) load above griddepcontrol.wait
    ATTRS = {"global_symbol": spec.name} if PDL else {"global_symbol": spec.name, "tirx.noalias": True}

    @T.macro
    def load_batch(Vw, Mw, af, mf, rt, ks, b, lane, ml, buf):
        # the batch's A fragments (16 bytes a K tile) and metadata (16 bytes a group): all in flight
        for gi in T.unroll(GB):
            if b * GB + gi < RG and ks * RG + b * GB + gi < G:
                for v in T.vectorized(4):
                    mf[(buf * GB + gi) * 4 + v] = Mw[((rt * G + ks * RG + b * GB + gi) * 16 + ml) * 4 + v]
                for q in T.unroll(4):
                    for v in T.vectorized(4):
                        af[((buf * GB + gi) * 4 + q) * 4 + v] = Vw[((rt * KTP + (ks * RG + b * GB + gi) * 4 + q) * 32
                                                         + lane) * 4 + v]

    @T.macro
    def mma_batch(smw, af, mf, bq, acc, M, ks, b, g, t, buf):
        # per K tile: the B fragment of each 8 rows of X (one 16-byte shared load), one mma.sp each
        for gi in T.unroll(GB):
            if b * GB + gi < RG and ks * RG + b * GB + gi < G:
                for q in T.unroll(4):
                    for nb in T.unroll(NB):
                        if nb * 8 < M:
                            for v in T.vectorized(4):
                                bq[v] = smw[(T.min(nb * 8 + g, MR - 1) * XS + ((b * GB + gi) * 4 + q) * 32 + t * 8) // 2
                                             + v]
                            T.evaluate(T.ptx[MMA](
                                acc[nb * 4], acc[nb * 4 + 1], acc[nb * 4 + 2], acc[nb * 4 + 3],
                                af[((buf * GB + gi) * 4 + q) * 4], af[((buf * GB + gi) * 4 + q) * 4 + 1],
                                af[((buf * GB + gi) * 4 + q) * 4 + 2], af[((buf * GB + gi) * 4 + q) * 4 + 3],
                                bq[0], bq[1], bq[2], bq[3],
                                acc[nb * 4], acc[nb * 4 + 1], acc[nb * 4 + 2], acc[nb * 4 + 3],
                                mf[(buf * GB + gi) * 4 + q], 0))

    @T.macro
    def stage_pieces(Xh, Xw, sm, smw, xw, xh, lim, tx, ks, it):
        # round ``it`` of the staging: SU pieces a thread, all loaded before any is stored
        for u in T.unroll(SU):
            p = T.meta_var((it * SU + u) * NT + tx)
            if p < lim[0]:
                if VEC:
                    if ks * RK + p % STAGE * 8 < K:
                        for v in T.vectorized(4):
                            xw[u * 4 + v] = Xw[(p // STAGE * K + ks * RK + p % STAGE * 8) // 2 + v]
                    else:
                        for v in T.unroll(4):
                            xw[u * 4 + v] = T.uint32(0)
                else:
                    xh[u] = T.if_then_else(ks * RK + p % STAGE < K,
                                           Xh[p // STAGE * K + T.min(ks * RK + p % STAGE, K - 1)], T.float16(0))
        for u in T.unroll(SU):
            p = T.meta_var((it * SU + u) * NT + tx)
            if p < lim[0]:
                if VEC:   # word w of piece i holds columns 8 (i % 4) + 2w, + 1 of block i // 4: lane t = w
                    for w in T.unroll(4):
                        smw[(p // STAGE * XS + p % STAGE // 4 * 32 + w * 8 + p % 4 * 2) // 2] = xw[u * 4 + w]
                else:
                    sm[p // STAGE * XS + p % STAGE // 32 * 32 + p % 8 // 2 * 8 + p % 32 // 8 * 2 + p % 2] = xh[u]

    @T.macro
    def stage_x(Xh, Xw, sm, smw, xw, xh, lim, tx, ks):
        # X[m, the range's columns] -> shared row m, each 32-column block permuted: column 8j + 2t + e at 8t + 2j + e;
        # the (row, piece) pairs (``lim[0]`` = M · STAGE of them, kept in a register: TVM would compute it on the
        # host) spread over the CTA
        for it in T.serial((MR * STAGE + NT * SU - 1) // (NT * SU)):
            if it * NT * SU < lim[0]:
                stage_pieces(Xh, Xw, sm, smw, xw, xh, lim, tx, ks, it)

    @T.macro
    def epilogue_value(B, Y, tot, row, n):
        if spec.bias:
            tot[0] = tot[0] + to_f32(B[n], ACT)
        tot[1] = tir_activate(tot[0], None, spec.act)
        Y[row, n] = from_f32(tot[1], ACT)

    @T.prim_func
    def kernel(x_h: T.handle, vals_h: T.handle, meta_h: T.handle, b_h: T.handle, y_h: T.handle, p_h: T.handle,
               c_h: T.handle):
        T.func_attr(ATTRS)
        X = T.match_buffer(x_h, (M, K), "float16")
        Vals = T.match_buffer(vals_h, (RT * KTP * 32 * 4,), "int32")
        Meta = T.match_buffer(meta_h, (RT * G * 16 * 4,), "int32")
        B = T.match_buffer(b_h, (N,), "float16")
        Y = T.match_buffer(y_h, (M, N), "float16")
        P = T.match_buffer(p_h, (KS, MR, RT * 16), "float32")
        Cnt = T.match_buffer(c_h, (RT,), "int32")
        rtg = T.launch_thread("blockIdx.x", RTG)
        ks = T.launch_thread("blockIdx.y", KS)
        tx = T.launch_thread("threadIdx.x", NT)
        Xw = T.decl_buffer(((MR * K + 1) // 2,), "uint32", data=X.data)   # extents: the most rows
        Xh = T.decl_buffer((MR * K,), "float16", data=X.data)
        Vw = T.decl_buffer((RT * KTP * 32 * 4,), "uint32", data=Vals.data)
        Mw = T.decl_buffer((RT * G * 16 * 4,), "uint32", data=Meta.data)
        smw = T.decl_buffer((spec.shared_bytes // 4,), "uint32", scope="shared.dyn")
        sm = T.decl_buffer((spec.shared_bytes // 2,), "float16", data=smw.data, scope="shared.dyn")
        red = T.decl_buffer((spec.shared_bytes // 4,), "float32", data=smw.data, scope="shared.dyn")
        arrived = T.alloc_buffer((1,), "int32", scope="shared")
        af = T.alloc_buffer((NBUF * IF * 4,), "uint32", scope="local")
        mf = T.alloc_buffer((NBUF * GB * 4,), "uint32", scope="local")
        bq = T.alloc_buffer((4,), "uint32", scope="local")
        xw = T.alloc_buffer((SU * 4,), "uint32", scope="local")
        xh = T.alloc_buffer((SU,), "float16", scope="local")
        lim = T.alloc_buffer((1,), "int32", scope="local")
        acc = T.alloc_buffer((NB * 4,), "float32", scope="local")
        tot = T.alloc_buffer((2,), "float32", scope="local")
        last = T.alloc_buffer((1,), "bool", scope="local")
        lane = T.meta_var(tx % 32)
        warp = T.meta_var(tx // 32)
        g = T.meta_var(lane // 4)
        t = T.meta_var(lane % 4)
        ml = T.meta_var(lane // 4 * 2 + lane % 2)   # the metadata lane: lanes t and t + 2 read the same word
        wi = T.meta_var(warp // TL)                 # the warp's place among its row tile's warps
        rt = T.meta_var(rtg * TL + warp % TL)       # the warp's row tile
        if wi < NBT and (RT % TL == 0 or rt < RT):  # the first batch: weights, not X
            load_batch(Vw, Mw, af, mf, rt, ks, wi, lane, ml, 0)
        if PDL:                                     # X (the previous kernel's output) and every write after it
            T.evaluate(grid_dependency("wait"))
            T.evaluate(grid_dependency("launch_dependents"))
        lim[0] = M
        lim[0] = lim[0] * STAGE                     # not M * STAGE: TVM may share that with the host's checks
        stage_x(Xh, Xw, sm, smw, xw, xh, lim, tx, ks)
        for a in T.unroll(NB * 4):
            acc[a] = T.float32(0)
        T.tvm_storage_sync("shared")
        if PF:      # batch i + 1's loads are issued before batch i's MMAs (buffers alternate; pairs unrolled)
            for i2 in T.serial((ITER + 1) // 2):
                for p in T.unroll(2):
                    if RT % TL == 0 or rt < RT:
                        if wi + (i2 * 2 + p + 1) * WT < NBT:
                            load_batch(Vw, Mw, af, mf, rt, ks, wi + (i2 * 2 + p + 1) * WT, lane, ml, 1 - p)
                        if wi + (i2 * 2 + p) * WT < NBT:
                            mma_batch(smw, af, mf, bq, acc, M, ks, wi + (i2 * 2 + p) * WT, g, t, p)
        else:
            for i in T.serial(ITER):
                if wi + i * WT < NBT and (RT % TL == 0 or rt < RT):
                    if i > 0:
                        load_batch(Vw, Mw, af, mf, rt, ks, wi + i * WT, lane, ml, 0)
                    mma_batch(smw, af, mf, bq, acc, M, ks, wi + i * WT, g, t, 0)
        T.tvm_storage_sync("shared")                # X is read; its memory holds the warps' partial tiles
        for nb in T.unroll(NB):                     # D element r: channel g (+ 8 for r >= 2), row 2t + r % 2
            if nb * 8 < M:
                for r in T.unroll(4):
                    red[(warp * 16 + g + r // 2 * 8) * RED + nb * 8 + t * 2 + r % 2] = acc[nb * 4 + r]
        T.tvm_storage_sync("shared")
        # output o: row o // CH, the CTA's channel o % CH (row tile o % CH // 16); warp wi * TL + that tile holds
        # channel o % 16 at red row (wi * TL + o % CH // 16) * 16 + o % 16 = wi * CH + o % CH
        if KS == 1:
            for it in T.unroll(OUT_ITERS):
                o = T.meta_var(tx + it * NT)
                if OUTS % NT == 0 or o < OUTS:
                    if o // CH < M and rtg * CH + o % CH < N:
                        tot[0] = red[o % CH * RED + o // CH]
                        for w in T.unroll(1, WT):
                            tot[0] = tot[0] + red[(w * CH + o % CH) * RED + o // CH]
                        epilogue_value(B, Y, tot, o // CH, rtg * CH + o % CH)
        else:
            for it in T.unroll(OUT_ITERS):
                o = T.meta_var(tx + it * NT)
                if OUTS % NT == 0 or o < OUTS:
                    if o // CH < M and (RT % TL == 0 or rtg * CH + o % CH < RT * 16):
                        tot[0] = red[o % CH * RED + o // CH]
                        for w in T.unroll(1, WT):
                            tot[0] = tot[0] + red[(w * CH + o % CH) * RED + o // CH]
                        P[ks, o // CH, rtg * CH + o % CH] = tot[0]
            T.cuda.thread_fence()
            T.tvm_storage_sync("shared")
            if tx == 0:
                arrived[0] = T.cuda.atomic_add(Cnt.ptr_to([rtg]), 1)
            T.tvm_storage_sync("shared")
            last[0] = arrived[0] == KS - 1
            if last[0]:
                T.cuda.thread_fence()
                for it in T.unroll(OUT_ITERS):
                    o = T.meta_var(tx + it * NT)
                    if OUTS % NT == 0 or o < OUTS:
                        if o // CH < M and rtg * CH + o % CH < N:
                            tot[0] = P[0, o // CH, rtg * CH + o % CH]
                            for k2 in T.unroll(1, KS):
                                tot[0] = tot[0] + P[k2, o // CH, rtg * CH + o % CH]
                            epilogue_value(B, Y, tot, o // CH, rtg * CH + o % CH)
                if tx == 0:
                    Cnt[rtg] = 0

    return tvm.IRModule({spec.name: _drop_unused(kernel, spec)})


def _drop_unused(func, spec: NmLinearSpec):
    """The PrimFunc without the buffers this spec's kernel never reads (no bias, no split-K workspace)."""
    drop = set()
    if not spec.bias:
        drop.add("B")
    if spec.ksplit == 1:
        drop.update(("P", "Cnt"))
    from tvm import tirx
    return tirx.PrimFunc([p for p in func.params if p.name not in drop], func.body, func.ret_type, func.attrs)


__all__ = ["nm_linear"]
