"""The unstructured sparse GEMV (``spec.BitmapGemvSpec``, bitmap + kept values) in TVMScript.

Grid: (row tiles, ``ksplit``). A CTA stages the X columns of its range in shared memory as fp32 (8 pad words after
each stream's columns, so the lanes of a row read different banks), then its warps take the range's column tiles
round robin. Per tile a lane loads its stream's bitmap words (16-byte loads, the warp's 512 contiguous bytes),
counts its kept values (``__popc``) and loads its value pieces ``inflight`` at a time, all in flight before the
first product: piece ``j`` of the lanes that have one lie side by side, a lane's place among them the popcount of a
ballot. Then it walks its set bits, highest first (``__clz``; the next word when one runs out), the order the values
are stored in, against its values and the staged X: one fp32 FMA per kept value and row; whole pieces unguarded,
the last one value by value. The lanes of a row add by shuffles, the warps through shared memory; bias and
activation in the epilogue. ``ksplit > 1``: each CTA leaves its fp32 partials in ``P`` and counts itself in ``Cnt``
after a fence; the last of a row tile's CTAs sums them in split order (deterministic), writes ``Y`` and resets its
counter. ``pdl``: the first tile's bitmap and value pieces (weights) load before ``griddepcontrol.wait``; X and every
write after it.
"""

from __future__ import annotations

from ..epilogue import tir_activate
from ..ptx import from_f32, grid_dependency, to_f32
from .mma import mma_parts
from .spec import BitmapGemvSpec


def _warp_call(fn: str, ret: str, body: str, *args):
    """TIR: a call of a one-line warp-wide device function ``sparta_bm_<fn>(unsigned p)``."""
    from tvm.script import tirx as T
    ctype = {"uint32": "unsigned", "int32": "int"}[ret]
    src = f"__device__ __forceinline__ {ctype} sparta_bm_{fn}(unsigned p) {{ return {body}; }}\n"
    return T.cuda.func_call(f"sparta_bm_{fn}", *args, source_code=src, return_type=ret)


def bitmap_gemv(spec: BitmapGemvSpec):
    """The kernel as an IRModule with one PrimFunc named ``spec.name``."""
    import tvm
    from tvm import tirx
    from tvm.script import tirx as T

    M = tirx.Var("M", "int32")
    N, K, MR, W, IF = spec.n, spec.k, spec.rows, spec.warps, spec.inflight
    R, S, CS, WS, C = spec.tile_rows, spec.lanes_per_row, spec.stream_cols, spec.words, spec.tile_cols
    NRT, NKT, KT, KS = spec.row_tiles, spec.col_tiles, spec.range_tiles, spec.ksplit
    XS, NT = spec.x_stride, 32 * W
    TPW = -(-KT // W)                         # tiles a warp takes (at most)
    OUTS = R * MR
    OUT_ITERS = -(-OUTS // NT)
    STEPS = S.bit_length() - 1                # butterfly steps over a row's lanes
    ACT, PDL = spec.dtype, spec.pdl
    VEC = K % 8 == 0                          # X rows in 16-byte pieces
    STAGE = KT * S * CS // (8 if VEC else 1)  # X pieces (or values) of one row to stage
    FULL = T.uint32(0xFFFFFFFF)
    # no __restrict__ under PDL: nvcc may move a restrict (ld.global.nc) load above griddepcontrol.wait
    ATTRS = {"global_symbol": spec.name} if PDL else {"global_symbol": spec.name, "tirx.noalias": True}

    def ballot(pred):
        return _warp_call("ballot", "uint32", "__ballot_sync(0xffffffffu, p)", T.Cast("uint32", pred))

    def warp_max(v):
        return _warp_call("max", "int32", "(int)__reduce_max_sync(0xffffffffu, p)", T.Cast("uint32", v))

    def popc(w):
        return T.call_pure_extern("int32", "__popc", T.Cast("uint32", w))

    def clz(w):
        return T.call_pure_extern("int32", "__clz", T.reinterpret("int32", w))

    @T.macro
    def stage_x(X, xs, xp, M, tx, ks):
        # X[m, the range's columns] -> xs[m, stream block b: b * (CS + 8) + u] in fp32, zero past K
        for m in T.serial(M):
            for it in T.serial((STAGE + NT - 1) // NT):
                i = T.meta_var(tx + it * NT)
                if i < STAGE:
                    if VEC:
                        col = T.meta_var(ks * KT * C + i * 8)
                        dst = T.meta_var(m * XS + (i // (CS // 8)) * (CS + 8) + i % (CS // 8) * 8)
                        if col < K:
                            for v in T.vectorized(8):
                                xp[v] = X[m, col + v]
                            for v in T.unroll(8):
                                xs[dst + v] = to_f32(xp[v], ACT)
                        else:
                            for v in T.unroll(8):
                                xs[dst + v] = T.float32(0)
                    else:
                        col = T.meta_var(ks * KT * C + i)
                        xs[m * XS + (i // CS) * (CS + 8) + i % CS] = T.if_then_else(
                            col < K, to_f32(X[m, T.min(col, K - 1)], ACT), T.float32(0))

    @T.macro
    def tile_head(Bits, Off, wd, st, cur, tile, lane):
        # the lane's bitmap words of ``tile`` (16-byte loads), its kept count and pieces, the tile's first piece
        for q4 in T.unroll(WS // 4):
            for v in T.vectorized(4):
                wd[q4 * 4 + v] = Bits[((tile * (WS // 4) + q4) * 32 + lane) * 4 + v]
        st[2] = Off[tile]
        st[0] = 0
        for q in T.unroll(WS):
            st[0] = st[0] + popc(wd[q])
        st[1] = (st[0] + 7) // 8
        st[3] = 0
        st[4] = 0
        st[5] = warp_max(st[1])
        cur[0] = T.Cast("uint32", wd[0])

    @T.macro
    def load_batch(Vals, wv, st, bal, t, below):
        # the lane's pieces t * IF .. + IF - 1, all in flight: piece j of the lanes having one lie side by side
        for o in T.unroll(IF):
            bal[0] = ballot(T.Cast("int32", st[1] > t * IF + o))
            if st[1] > t * IF + o:
                for v in T.vectorized(8):
                    wv[o * 8 + v] = Vals[(st[2] + st[3] + popc(bal[0] & below)) * 8 + v]
            st[3] = st[3] + popc(bal[0])

    @T.macro
    def walk_next(wd, st, cur):
        # the next set bit: the current word's highest (the next word where one runs out); its clz into st[6]
        while cur[0] == T.uint32(0):
            st[4] = st[4] + 1
            cur[0] = T.Cast("uint32", wd[st[4]])
        st[6] = clz(cur[0])

    @T.macro
    def walk_step(M, xs, wd, wv, st, cur, acc, tot, slot, x0):
        # value ``slot`` of the loaded pieces against X at its column, then its bit cleared
        walk_next(wd, st, cur)
        tot[0] = to_f32(wv[slot], ACT)
        for m in T.unroll(MR):
            if m < M:
                acc[m] = acc[m] + tot[0] * xs[m * XS + x0 + st[4] * 32 + 31 - st[6]]
        cur[0] = cur[0] ^ (T.uint32(0x80000000) >> T.Cast("uint32", st[6]))

    @T.macro
    def walk_batch(M, xs, wd, wv, st, cur, acc, tot, t, x0):
        # each loaded value against X: whole pieces unguarded, a lane's last piece value by value
        for o in T.unroll(IF):
            if (t * IF + o + 1) * 8 <= st[0]:
                for e in T.unroll(8):
                    walk_step(M, xs, wd, wv, st, cur, acc, tot, o * 8 + e, x0)
            elif t * IF + o < st[1]:
                for e in T.unroll(8):
                    if (t * IF + o) * 8 + e < st[0]:
                        walk_step(M, xs, wd, wv, st, cur, acc, tot, o * 8 + e, x0)

    MMA = spec.mma
    if MMA:
        parts = mma_parts(spec, walk_next)
        stage_x16, zero_tile, walk_batch_mma = parts["stage_x16"], parts["zero_tile"], parts["walk_batch_mma"]
        mma_tile, acc_to_red, XOFF, WT = parts["mma_tile"], parts["acc_to_red"], parts["XOFF"], parts["WT"]
    NACC = 4 * (spec.mma_rows // 8) if MMA else MR

    @T.prim_func
    def kernel(x_h: T.handle, bits_h: T.handle, off_h: T.handle, vals_h: T.handle, b_h: T.handle, y_h: T.handle,
               p_h: T.handle, c_h: T.handle):
        T.func_attr(ATTRS)
        nvals = T.int32()
        X = T.match_buffer(x_h, (M, K), "float16")
        Bits = T.match_buffer(bits_h, (NRT * NKT * WS * 32,), "int32")
        Off = T.match_buffer(off_h, (NRT * NKT + 1,), "int32")
        Vals = T.match_buffer(vals_h, (nvals,), "float16")
        B = T.match_buffer(b_h, (N,), "float16")
        Y = T.match_buffer(y_h, (M, N), "float16")
        P = T.match_buffer(p_h, (KS, MR, NRT * R), "float32")
        Cnt = T.match_buffer(c_h, (NRT,), "int32")
        rt = T.launch_thread("blockIdx.x", NRT)
        ks = T.launch_thread("blockIdx.y", KS)
        tx = T.launch_thread("threadIdx.x", NT)
        xs = T.decl_buffer((spec.shared_bytes // 4,), "float32", scope="shared.dyn")
        sm = T.decl_buffer((spec.shared_bytes // 2,), "float16", data=xs.data, scope="shared.dyn")
        red = T.alloc_buffer((W * R * MR,), "float32", scope="shared")
        arrived = T.alloc_buffer((1,), "int32", scope="shared")
        wd = T.alloc_buffer((WS,), "int32", scope="local")
        wv = T.alloc_buffer((IF * 8,), "float16", scope="local")
        xp = T.alloc_buffer((8,), "float16", scope="local")
        acc = T.alloc_buffer((NACC,), "float32", scope="local")
        af = T.alloc_buffer((4,), "uint32", scope="local")
        bf = T.alloc_buffer((2,), "uint32", scope="local")
        st = T.alloc_buffer((7,), "int32", scope="local")  # kept, pieces, value base, pieces before, word, warp's
        #                                                     pieces, the bit's clz
        cur = T.alloc_buffer((1,), "uint32", scope="local")     # the unread bits of the current word
        bal = T.alloc_buffer((1,), "uint32", scope="local")
        tot = T.alloc_buffer((2,), "float32", scope="local")
        last = T.alloc_buffer((1,), "bool", scope="local")
        lane = T.meta_var(tx % 32)
        warp = T.meta_var(tx // 32)
        s = T.meta_var(lane % S)              # the lane's stream in its row
        kl0 = T.meta_var(warp)                # the warp's first tile in the CTA's range
        below = T.meta_var(T.shift_left(T.uint32(1), T.Cast("uint32", lane)) - T.uint32(1))
        if kl0 < KT and ks * KT + kl0 < NKT:  # the first tile's bitmap and first pieces: weights, not X
            tile_head(Bits, Off, wd, st, cur, rt * NKT + ks * KT + kl0, lane)
            if st[5] > 0:
                load_batch(Vals, wv, st, bal, 0, below)
        if PDL:                               # X (the previous kernel's output) and every write after it
            T.evaluate(grid_dependency("wait"))
            T.evaluate(grid_dependency("launch_dependents"))
        if MMA:
            stage_x16(X, sm, M, tx, ks)
        else:
            stage_x(X, xs, xp, M, tx, ks)
        for a in T.unroll(NACC):
            acc[a] = T.float32(0)
        T.tvm_storage_sync("shared")
        for i in T.serial(TPW):
            kl = T.meta_var(warp + i * W)     # the tile within the CTA's range
            if kl < KT and ks * KT + kl < NKT:
                if i > 0:
                    tile_head(Bits, Off, wd, st, cur, rt * NKT + ks * KT + kl, lane)
                if MMA:
                    zero_tile(sm, warp, lane)
                for t in T.serial((st[5] + IF - 1) // IF):
                    if i > 0 or t > 0:
                        load_batch(Vals, wv, st, bal, t, below)
                    if MMA:
                        walk_batch_mma(sm, wd, wv, st, cur, t, XOFF + (warp * 16 + lane // S) * WT + s * CS)
                    else:
                        walk_batch(M, xs, wd, wv, st, cur, acc, tot, t, (kl * S + s) * (CS + 8))
                if MMA:
                    mma_tile(sm, acc, af, bf, warp, lane, kl)
        if MMA:                               # the warps' sums
            acc_to_red(red, acc, warp, lane)
        else:                                 # the lanes of a row, then the warps
            for m in T.unroll(MR):
                for b in T.unroll(STEPS):
                    T.evaluate(T.ptx["shfl_sync.bfly.b32"](tot[1], acc[m], T.uint32(1 << b), T.uint32(31), FULL))
                    acc[m] = acc[m] + tot[1]
                if s == 0:
                    red[(warp * R + lane // S) * MR + m] = acc[m]
        T.tvm_storage_sync("shared")
        if KS == 1:
            for it in T.unroll(OUT_ITERS):
                o = T.meta_var(tx + it * NT)
                if OUTS % NT == 0 or o < OUTS:
                    n = T.meta_var(rt * R + o % R)
                    if o // R < M and n < N:
                        tot[0] = red[o % R * MR + o // R]
                        for w in T.unroll(1, W):
                            tot[0] = tot[0] + red[(w * R + o % R) * MR + o // R]
                        if spec.bias:
                            tot[0] = tot[0] + to_f32(B[n], ACT)
                        tot[1] = tir_activate(tot[0], None, spec.act)
                        Y[o // R, n] = from_f32(tot[1], ACT)
        else:
            for it in T.unroll(OUT_ITERS):
                o = T.meta_var(tx + it * NT)
                if OUTS % NT == 0 or o < OUTS:
                    if o // R < M:
                        tot[0] = red[o % R * MR + o // R]
                        for w in T.unroll(1, W):
                            tot[0] = tot[0] + red[(w * R + o % R) * MR + o // R]
                        P[ks, o // R, rt * R + o % R] = tot[0]
            T.cuda.thread_fence()
            T.tvm_storage_sync("shared")
            if tx == 0:
                arrived[0] = T.cuda.atomic_add(Cnt.ptr_to([rt]), 1)
            T.tvm_storage_sync("shared")
            last[0] = arrived[0] == KS - 1
            if last[0]:
                T.cuda.thread_fence()
                for it in T.unroll(OUT_ITERS):
                    o = T.meta_var(tx + it * NT)
                    if OUTS % NT == 0 or o < OUTS:
                        n = T.meta_var(rt * R + o % R)
                        if o // R < M and n < N:
                            tot[0] = P[0, o // R, n]
                            for k2 in T.unroll(1, KS):
                                tot[0] = tot[0] + P[k2, o // R, n]
                            if spec.bias:
                                tot[0] = tot[0] + to_f32(B[n], ACT)
                            tot[1] = tir_activate(tot[0], None, spec.act)
                            Y[o // R, n] = from_f32(tot[1], ACT)
                if tx == 0:
                    Cnt[rt] = 0

    return tvm.IRModule({spec.name: _drop_unused(kernel, spec)})


def _drop_unused(func, spec: BitmapGemvSpec):
    """The PrimFunc without the buffers this spec's kernel never reads (no bias, no split-K workspace)."""
    drop = set()
    if not spec.bias:
        drop.add("B")
    if spec.ksplit == 1:
        drop.update(("P", "Cnt"))
    from tvm import tirx
    return tirx.PrimFunc([p for p in func.params if p.name not in drop], func.body, func.ret_type, func.attrs)


__all__ = ["bitmap_gemv"]
