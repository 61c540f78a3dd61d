"""The W4A16 GEMV kernel (``spec.W4A16Spec``) in TVMScript.

Compute: ``Yᵀ = W Xᵀ`` on ``mma.sync.m16n8k16``: the dequantised half2 pairs of two 8-row tiles are
exactly an A fragment (tile ``2p`` rows 0..7, tile ``2p+1`` rows 8..15; K permuted consistently in A and
B: lane ``t`` takes K ``32t + 4s .. +4`` of k16-step ``s``) and B is 8 rows of X (zero past ``M``, a second
MMA for rows 8..15) from four 16-byte loads per row and chunk, in registers — the operands sit where the
MMA wants them, with no register moves, and one MMA covers 16 weight rows. Accumulation in fp32
(``acc="float32"``) or fp16 (``acc="float16"``). ``fold=True`` (groups of 128, fp32 accumulation) leaves the
scale out of the dequantisation: each chunk's MMAs run on the integer codes minus the zero point (exact in
fp16) into fresh accumulators, folded into the sum with one fp32 ``fma`` by the row's scale — 4 fewer
``mul.f16x2`` per word of 8 weights. A CTA owns ``ntile`` 8-row tiles; its ``warps`` split K (chunks
round-robin) and reduce through shared memory; bias is fused into the fp16 store. ``min_ctas`` bounds the
registers (``__launch_bounds__(threads, min_ctas)``) so that many CTAs fit on an SM: each warp has one chunk of
weights in flight at a time, so the bytes in flight grow with the warps an SM holds. ``ksplit > 1`` also splits K
across CTAs: each leaves its fp32 partials in the workspace ``P`` and counts itself in ``C`` (after a fence);
the last of a row block's CTAs to arrive sums the partials in split order (deterministic), writes ``Y`` and
resets its counter, so ``C`` (zeroed once, ``spec.split_buffers``) is zero again after every call and CUDA-graph
replays need nothing else. ``pdl`` ("early" / "late") builds the kernel for programmatic dependent launch (sm_90;
the runtime launches it with the attribute): its first weights load before ``griddepcontrol.wait``, X and every
write after it, so the tail of the previous kernel in the stream overlaps this one's start. "early" lets the next
kernel launch as soon as every CTA of this one has started (fastest in a chain of one-wave grids, but grids pile up
waiting where a grid spans several waves); "late" only once this one has passed its wait. The overlap needs a
previous kernel that triggers (these do); after one that does not, the launch is an ordinary one.
"""

from __future__ import annotations

from ..ptx import dequant_word, from_f32, grid_dependency, half2_splat, to_f32, zero_terms
from .spec import W4A16Spec


def w4a16_gemv(spec: W4A16Spec):
    """The kernel as an IRModule with one PrimFunc named ``spec.name``."""
    import tvm
    from tvm.script import tirx as T

    from tvm import tirx
    N, K, G = spec.n, spec.k, spec.group
    ANY = spec.m == 0                         # M a kernel argument (up to MR rows), else the spec's
    MR = spec.max_rows
    M = tirx.Var("M", "int32") if ANY else spec.m
    TILES, KC, NG = spec.tiles, spec.chunks, spec.groups
    NT, W, U = spec.ntile, spec.warps, spec.unroll
    NP = -(-NT // 2)                          # pairs of 8-row tiles: the 16 rows of one MMA's A
    RH = 1 if MR <= 8 else 2                   # 8-column halves of X rows (the MMA's B, N = 8)
    KS = spec.ksplit
    CPS = -(-KC // KS)                        # K chunks per split
    ITERS = -(-CPS // (W * U))
    EVEN = CPS % (W * U) == 0                 # every (iteration, chunk) in range: no guard
    GRID = spec.grid
    f16acc = spec.acc == "float16"
    NACC = RH * NP * (2 if f16acc else 4)
    ACT = spec.dtype                          # X, S, B, Y: 16-bit lanes of this type
    op16 = "bf16" if ACT == "bfloat16" else "f16"
    MMA = ("mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16" if f16acc
           else f"mma.sync.aligned.m16n8k16.row.col.f32.{op16}.{op16}.f32")
    ACC = "uint32" if f16acc else "float32"
    OUTS = MR * NT * 8
    OUT_ITERS = -(-OUTS // (W * 32))
    sym, use_bias, fold = spec.sym, spec.bias, spec.fold
    # WAITS: PDL as a bool (a TVMScript ``if`` on a str does not parse)
    MIN_CTAS, BOUNDED, PDL, WAITS = spec.min_ctas, spec.min_ctas > 0, spec.pdl, bool(spec.pdl)

    def acc_value(acc, i, r):                  # the fp32 value of C element r (0..3) of accumulator set i
        if f16acc:
            bits = T.Cast("uint16", (acc[i * 2 + r // 2] >> T.Cast("uint32", 16 * (r % 2))) & T.uint32(0xFFFF))
            return T.Cast("float32", T.reinterpret("float16", bits))
        return acc[i * 4 + r]

    def zero_lo(zl, i):                        # half2(1024 + zero)
        return zero_terms(None, ACT)[0] if sym else zl[i]

    def zero_hi(zh, i):                        # half2(-(64 + zero))
        return zero_terms(None, ACT)[1] if sym else zh[i]

    dequant = dequant_word(scaled=not fold, act16=ACT)

    @T.macro
    def sum_warps(tot, red, o):                # output o's partial sums of the CTA's W warps, in warp order
        tot[0] = red[o]
        for w in T.unroll(1, W):
            tot[0] = tot[0] + red[w * OUTS + o]

    @T.macro
    def store(Y, B, m, n, v):
        if use_bias:
            Y[m, n] = from_f32(v + to_f32(B[n], ACT), ACT)
        else:
            Y[m, n] = from_f32(v, ACT)

    @T.macro
    def store_outputs(Y, B, P, red, tot, tx, bx):
        # each of the CTA's outputs: the sum of its warps' partials (KS == 1) or of the KS splits' partials in P
        for it in T.unroll(OUT_ITERS):
            o = T.meta_var(tx + it * W * 32)
            if OUTS % (W * 32) == 0 or o < OUTS:
                m = T.meta_var(o // (NT * 8))
                n = T.meta_var(bx * NT * 8 + o % (NT * 8))
                if (N % (NT * 8) == 0 or n < N) and (not ANY or m < M):
                    if KS == 1:
                        sum_warps(tot, red, o)
                    else:
                        tot[0] = P[0, m, n]
                        for ks in T.unroll(1, KS):
                            tot[0] = tot[0] + P[ks, m, n]
                    store(Y, B, m, n, tot[0])

    @T.macro
    def mma_pair(acc, b, xa, xo, p, j, paired):
        # Y^T = W X^T: A = 16 weight rows (tile 2p: b[0..3], tile 2p+1: b[4..7]) in registers straight from
        # the dequantisation, B = 8 rows of X (two of the lane's xa words): no register shuffling per MMA.
        # Word j: 8 nibbles = k 8j..8j+7 of the lane's 32 -> k16 steps 2j (pairs 0, 1) and 2j+1 (pairs 2, 3).
        for h in T.unroll(2):
            s = T.meta_var(2 * j + h)
            a1 = T.meta_var(b[4 + 2 * h] if paired else T.uint32(0))
            a3 = T.meta_var(b[5 + 2 * h] if paired else T.uint32(0))
            for rh in T.unroll(RH):
                i = T.meta_var(rh * NP + p)
                x0 = T.meta_var(xa[xo + rh * 16 + 2 * s])
                x1 = T.meta_var(xa[xo + rh * 16 + 2 * s + 1])
                if f16acc:
                    T.evaluate(T.ptx[MMA](acc[i * 2], acc[i * 2 + 1], b[2 * h], a1, b[2 * h + 1], a3, x0, x1,
                                          acc[i * 2], acc[i * 2 + 1]))
                else:
                    T.evaluate(T.ptx[MMA](acc[i * 4], acc[i * 4 + 1], acc[i * 4 + 2], acc[i * 4 + 3],
                                          b[2 * h], a1, b[2 * h + 1], a3, x0, x1,
                                          acc[i * 4], acc[i * 4 + 1], acc[i * 4 + 2], acc[i * 4 + 3]))

    @T.macro
    def load_stage(it, ctx, X, Wq, S, Z, wq, sc, sf, zl, zh, xh, xa, part):   # issue every load of U chunks first
        # part: "w" the weights (scales, zero points), "x" the rows of X, "wx" both
        bx, by, warp, lane, g, t = T.meta_var(ctx)       # CTA along N and K, warp, lane, its row and K quarter
        for u in T.unroll(U):
            cl = T.meta_var((it * U + u) * W + warp)
            c = T.meta_var(by * CPS + cl)
            kb = T.meta_var(c * 128 + t * 32)
            if (EVEN or cl < CPS) and (KC % CPS == 0 or c < KC):
                if part != "x":
                    for tile in T.unroll(NT):
                        tl = T.meta_var(bx * NT + tile)
                        if TILES % NT == 0 or tl < TILES:
                            o = T.meta_var((u * NT + tile) * 4)
                            T.evaluate(T.ptx["ld.global.nc.L1::no_allocate.v4.b32"](
                                wq[o], wq[o + 1], wq[o + 2], wq[o + 3], Wq.ptr_to([tl, c, lane, 0])))
                            if fold:
                                sf[u * NT + tile] = to_f32(S[tl, kb // G, g], ACT)
                            else:
                                sc[u * NT + tile] = half2_splat(S[tl, kb // G, g])
                            if not sym:
                                zt = T.meta_var(zero_terms(T.Cast("uint32", Z[tl, kb // G, g]), ACT))
                                zl[u * NT + tile] = zt[0]
                                zh[u * NT + tile] = zt[1]
                if part != "w":
                    for rh in T.unroll(RH):
                        # rows past M are zeros (reading row M-1 for them instead measured up to 1.45x slower)
                        if g + rh * 8 < M and kb < K:
                            for q in T.unroll(4):
                                for v in T.vectorized(8):
                                    xh[(u * RH + rh) * 32 + q * 8 + v] = X[g + rh * 8, kb + q * 8 + v]
                        else:
                            for q in T.unroll(4):
                                for v in T.vectorized(4):
                                    xa[(u * RH + rh) * 16 + q * 4 + v] = T.uint32(0)

    @T.macro
    def compute_stage(it, ctx, wq, sc, sf, zl, zh, xa, b, acc, cacc):    # dequantise and multiply them
        bx, by, warp, lane, g, t = T.meta_var(ctx)       # CTA along N and K, warp, lane, its row and K quarter
        for u in T.unroll(U):
            cl = T.meta_var((it * U + u) * W + warp)
            c = T.meta_var(by * CPS + cl)
            if (EVEN or cl < CPS) and (KC % CPS == 0 or c < KC):
                for p in T.unroll(NP):
                    t0 = T.meta_var(u * NT + 2 * p)
                    if TILES % NT == 0 or bx * NT + 2 * p < TILES:
                        if fold:
                            for rh in T.unroll(RH):
                                for r in T.unroll(4):
                                    cacc[(rh * NP + p) * 4 + r] = T.float32(0)
                        for j in T.unroll(4):
                            dequant(b, 0, wq[t0 * 4 + j], sc[t0], zero_lo(zl, t0), zero_hi(zh, t0))
                            if 2 * p + 1 < NT:
                                if TILES % NT == 0 or bx * NT + 2 * p + 1 < TILES:
                                    dequant(b, 4, wq[(t0 + 1) * 4 + j], sc[t0 + 1], zero_lo(zl, t0 + 1),
                                            zero_hi(zh, t0 + 1))
                                else:
                                    for e in T.unroll(4):
                                        b[4 + e] = T.uint32(0)
                            mma_pair(cacc if fold else acc, b, xa, u * RH * 16, p, j, 2 * p + 1 < NT)
                        if fold:                       # C rows 0..7 are tile 2p's row g, rows 8..15 tile 2p+1's
                            for rh in T.unroll(RH):
                                for r in T.unroll(4):
                                    i = T.meta_var((rh * NP + p) * 4 + r)
                                    acc[i] = acc[i] + cacc[i] * sf[t0 + (r // 2 if 2 * p + 1 < NT else 0)]

    @T.prim_func
    def kernel(x_h: T.handle, wq_h: T.handle, s_h: T.handle, z_h: T.handle, b_h: T.handle, p_h: T.handle,
               c_h: T.handle, y_h: T.handle):
        T.func_attr({"global_symbol": spec.name, "tirx.noalias": True})
        X = T.match_buffer(x_h, (M, K), "float16")
        Wq = T.match_buffer(wq_h, (TILES, KC, 32, 4), "int32")
        S = T.match_buffer(s_h, (TILES, NG, 8), "float16")
        Z = T.match_buffer(z_h, (TILES, NG, 8), "uint8")
        B = T.match_buffer(b_h, (N,), "float16")
        P = T.match_buffer(p_h, (KS, MR, GRID * NT * 8), "float32")
        C = T.match_buffer(c_h, (GRID,), "int32")
        Y = T.match_buffer(y_h, (M, N), "float16")
        bx = T.launch_thread("blockIdx.x", GRID)
        by = T.launch_thread("blockIdx.y", KS)
        tx = T.launch_thread("threadIdx.x", W * 32)
        red = T.alloc_buffer((W * OUTS,), "float32", scope="shared")     # [warp][row of X][column of the CTA]
        acc = T.alloc_buffer((NACC,), ACC, scope="local")
        wq = T.alloc_buffer((U * NT * 4,), "uint32", scope="local")
        xa = T.alloc_buffer((U * RH * 16,), "uint32", scope="local")
        xh = T.decl_buffer((U * RH * 32,), "float16", data=xa.data, scope="local")
        sc = T.alloc_buffer((U * NT,), "uint32", scope="local")
        sf = T.alloc_buffer((U * NT if fold else 1,), "float32", scope="local")      # fold: fp32 scales
        cacc = T.alloc_buffer((NACC if fold else 1,), "float32", scope="local")       # fold: a chunk's sums
        zl = T.alloc_buffer((U * NT,), "uint32", scope="local")
        zh = T.alloc_buffer((U * NT,), "uint32", scope="local")
        b = T.alloc_buffer((8,), "uint32", scope="local")
        tot = T.alloc_buffer((1,), "float32", scope="local")
        arrived = T.alloc_buffer((1,), "int32", scope="shared")
        last = T.alloc_buffer((1,), "bool", scope="local")
        warp = T.meta_var(tx // 32)
        lane = T.meta_var(tx % 32)
        g = T.meta_var(tx % 32 // 4)
        t = T.meta_var(tx % 4)
        if BOUNDED:       # __launch_bounds__(threads, MIN_CTAS): TVM takes it from an attribute on a statement
            with T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", MIN_CTAS):
                for i in T.unroll(NACC):
                    acc[i] = T.Cast(ACC, 0)
        else:
            for i in T.unroll(NACC):
                acc[i] = T.Cast(ACC, 0)
        ctx = T.meta_var((bx, by, warp, lane, g, t))
        ld = T.meta_var((X, Wq, S, Z, wq, sc, sf, zl, zh, xh, xa))
        mm = T.meta_var((wq, sc, sf, zl, zh, xa, b, acc, cacc))
        if PDL == "early":  # the next kernel may launch as soon as every CTA of this one has started
            T.evaluate(grid_dependency("launch_dependents"))
        for it in T.serial(ITERS):
            if WAITS:       # the first weights load while the previous kernel finishes; X only after it has
                load_stage(it, ctx, *ld, "w")
                if it == 0:
                    T.evaluate(grid_dependency("wait"))
                    if PDL == "late":   # only now (one grid waits at a time)
                        T.evaluate(grid_dependency("launch_dependents"))
                load_stage(it, ctx, *ld, "x")
            else:
                load_stage(it, ctx, *ld, "wx")
            compute_stage(it, ctx, *mm)
        for rh in T.unroll(RH):                        # every warp's partial sums into shared memory
            for p in T.unroll(NP):
                for r in T.unroll(4):
                    m = T.meta_var(rh * 8 + t * 2 + r % 2)
                    nl = T.meta_var((2 * p + r // 2) * 8 + g)
                    if (MR % 8 == 0 or m < MR) and (NT % 2 == 0 or 2 * p + r // 2 < NT):
                        red[(warp * MR + m) * NT * 8 + nl] = acc_value(acc, rh * NP + p, r)
        T.tvm_storage_sync("shared")
        if KS == 1:
            store_outputs(Y, B, P, red, tot, tx, bx)
        else:
            # split K: every CTA leaves its partials in P; the last of the row block's KS CTAs to arrive
            # (counted in C after a fence) sums them in split order -- deterministic -- and resets C
            for it in T.unroll(OUT_ITERS):
                o = T.meta_var(tx + it * W * 32)
                if OUTS % (W * 32) == 0 or o < OUTS:
                    sum_warps(tot, red, o)
                    P[by, o // (NT * 8), bx * NT * 8 + o % (NT * 8)] = tot[0]
            T.cuda.thread_fence()
            T.tvm_storage_sync("shared")
            if tx == 0:
                arrived[0] = T.cuda.atomic_add(C.ptr_to([bx]), 1)
            T.tvm_storage_sync("shared")
            last[0] = arrived[0] == KS - 1
            if last[0]:
                store_outputs(Y, B, P, red, tot, tx, bx)
                if tx == 0:
                    C[bx] = 0

    return tvm.IRModule({spec.name: kernel})
