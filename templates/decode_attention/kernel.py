"""Split-KV decode attention (flash-decoding) in TVMScript: a partial kernel per chunk of keys, a combine kernel.

``partial`` (grid: chunks × kv heads × batch): each CTA takes one chunk of ``chunk`` keys of one kv head for its ``G``
query heads, so K and V are read once for the group. Its warps first read the chunk's ``keep`` bytes and ballot them
into a bit mask every thread holds; a chunk with no kept key loads nothing and writes ``max = -inf, sum = 0`` (a
static cache costs only its filled part), otherwise each thread loads only its kept keys. ``D / 8`` lanes hold one key
(16 bytes each); a thread keeps all its K and V loads in flight (``spec.steps`` of each) before the first product. Dot
products are reduced by butterfly shuffles over a key's lanes; the chunk's max per head across warps through shared
memory; then ``p = 2 ** (s - max)`` (scores in log2 units: ``q · k · scale · log2 e``), the sum of ``p`` and the
``p``-weighted V summed over the warp's keys by shuffles and over warps in shared memory, into the fp32 workspace.

``combine`` (grid: query heads × batch): ``D / 4`` (``D / 8`` for 256) lanes hold one chunk's row; the CTA walks the
chunks ``threads / lanes`` rows at a time, four such steps loaded before they are merged (online rescaling, the V sums
loaded only for chunks with a kept key), merges its rows by shuffles and shared memory and writes
``out = Σ 2 ** (m_i - M) · O_i / Σ 2 ** (m_i - M) · l_i``, or zeros where no key was kept.

``pdl``: both are built for programmatic dependent launch (sm_90): each waits (``griddepcontrol.wait``) before its
first read and lets the next kernel launch at once, so the combine's launch overlaps the partial kernel's tail.

``rope`` (the decode step's rotary embedding and cache write in the same two launches; ``Q`` is then the stacked
projections (B, Hq + 2 Hkv, D), the new key at head ``Hq + h``, the new value at ``Hq + Hkv + h``): every partial CTA
rotates its ``G`` query heads as it loads them (a thread's 8 dimensions, their ``rotate_half`` partners ``D / 2`` away, ``cos`` and
``sin``, in fp32, rounded once to the 16-bit type); the CTA whose chunk holds the write position first has ``D / 8``
threads rotate the new key and store it and the new value into the cache there, then a barrier, so its loads see them.
The combine kernel, past its wait (every partial CTA has read the position), adds one to the position counter.
"""

from __future__ import annotations

from ..ptx import from_f32, grid_dependency, to_f32
from .spec import DecodeAttentionSpec

LOG2E = 1.4426950408889634
UNROLL = 4                         # combine: steps of rows loaded before they are merged


def ballot(pred):
    """TIR: ``__ballot_sync`` of the int32 ``pred`` over the full warp (a uint32 mask)."""
    from tvm.script import tirx as T
    src = "__device__ __forceinline__ unsigned sparta_ballot(int p) { return __ballot_sync(0xffffffffu, p); }\n"
    return T.cuda.func_call("sparta_ballot", pred, source_code=src, return_type="uint32")


def decode_attention_kernel(spec: DecodeAttentionSpec):
    """The kernel of ``spec.stage`` as an IRModule with one PrimFunc named ``spec.name``."""
    return partial_kernel(spec) if spec.stage == "partial" else combine_kernel(spec)


def partial_kernel(spec: DecodeAttentionSpec):
    import tvm
    from tvm import tirx
    from tvm.script import tirx as T

    B, S, NS = tirx.Var("B", "int32"), tirx.Var("S", "int32"), tirx.Var("NS", "int32")
    HQ, HKV, D, G, C, NT = spec.hq, spec.hkv, spec.d, spec.group, spec.chunk, spec.threads
    QH = spec.q_heads
    LK, KPS, ST, W = spec.lanes_per_key, spec.keys_per_step, spec.steps, spec.threads // 32
    WORDS = C // 32
    KEY_STEPS = LK.bit_length() - 1            # butterfly steps over a key's lanes
    ROW_STEPS = (32 // LK).bit_length() - 1    # ... over the warp's keys
    OUT4 = -(-(G * D // 4) // NT)              # float4 outputs per thread
    ACT, PDL, ROPE = spec.dtype, spec.pdl, spec.rope
    FULL = T.uint32(0xFFFFFFFF)
    NEG_INF = tirx.const(float("-inf"), "float32")

    def any_kept(kw):
        e = kw[0]
        for w in range(1, WORDS):
            e = e | kw[w]
        return e != T.uint32(0)

    def kept(kw, i, kr):
        # key i * KPS + kr of the chunk (KPS divides 32: the step's keys share one word)
        return (kw[i * KPS // 32] >> T.Cast("uint32", i * KPS % 32 + kr)) & T.uint32(1) != T.uint32(0)

    @T.macro
    def rotated(X, row, head, dim, COS, SIN, out, o, rb, rf):
        # 8 dims of X[row, head] from ``dim``, rotated: x · cos + rotate_half(x) · sin (the partner D/2 away, negated
        # in the first half), in fp32, into out[o:o+8] in the 16-bit type; rb: 16-bit scratch (4 x 8), rf: fp32 (8)
        for v in T.vectorized(8):
            rb[v] = X[row, head, dim + v]
        for v in T.vectorized(8):
            rb[8 + v] = X[row, head, (dim + D // 2) % D + v]
        for v in T.vectorized(8):
            rb[16 + v] = COS[row, dim + v]
        for v in T.vectorized(8):
            rb[24 + v] = SIN[row, dim + v]
        for v in T.unroll(8):
            rf[v] = to_f32(rb[v], ACT) * to_f32(rb[16 + v], ACT) + T.if_then_else(
                dim < D // 2, T.float32(-1), T.float32(1)) * to_f32(rb[8 + v], ACT) * to_f32(rb[24 + v], ACT)
            out[o + v] = from_f32(rf[v], ACT)

    @T.prim_func
    def kernel(q_h: T.handle, k_h: T.handle, v_h: T.handle, keep_h: T.handle, scale_h: T.handle, cos_h: T.handle,
               sin_h: T.handle, pos_h: T.handle, o_h: T.handle, ml_h: T.handle):
        T.func_attr({"global_symbol": spec.name, "tirx.noalias": True})
        Q = T.match_buffer(q_h, (B, QH, D), "float16")        # rope: the query heads, the new key's, the value's
        K = T.match_buffer(k_h, (B, HKV, S, D), "float16")
        V = T.match_buffer(v_h, (B, HKV, S, D), "float16")
        KEEP = T.match_buffer(keep_h, (B, S), "uint8")
        SCALE = T.match_buffer(scale_h, (1,), "float32")
        COS = T.match_buffer(cos_h, (B, D), "float16")         # rope: the rotary tables, the cache's write counter
        SIN = T.match_buffer(sin_h, (B, D), "float16")         # (unused otherwise: not among the kernel's parameters)
        POS = T.match_buffer(pos_h, (1,), "int64")
        O = T.match_buffer(o_h, (B, HQ, NS, D), "float32")
        ML = T.match_buffer(ml_h, (B, HQ, NS, 2), "float32")
        bx = T.launch_thread("blockIdx.x", (S + C - 1) // C)
        hk = T.launch_thread("blockIdx.y", HKV)
        bz = T.launch_thread("blockIdx.z", B)
        tx = T.launch_thread("threadIdx.x", NT)
        red = T.alloc_buffer((W * G * (D + 1),), "float32", scope="shared")   # per warp: V sums (G, D), then G sums
        wmax = T.alloc_buffer((W * G,), "float32", scope="shared")
        qv = T.alloc_buffer((G * 8,), "float16", scope="local")
        kv = T.alloc_buffer((ST * 8,), "float16", scope="local")
        vv = T.alloc_buffer((ST * 8,), "float16", scope="local")
        kw = T.alloc_buffer((WORDS,), "uint32", scope="local")
        sc = T.alloc_buffer((ST * G,), "float32", scope="local")       # scores, then their exponentials
        mx = T.alloc_buffer((G,), "float32", scope="local")
        ls = T.alloc_buffer((G,), "float32", scope="local")
        acc = T.alloc_buffer((G * 8,), "float32", scope="local")
        tmp = T.alloc_buffer((5,), "float32", scope="local")
        sl = T.alloc_buffer((1,), "float32", scope="local")
        rb = T.alloc_buffer((32,), "float16", scope="local")          # rope: x, its partners, cos, sin
        rf = T.alloc_buffer((8,), "float32", scope="local")           # rope: the rotated values in fp32
        kr8 = T.alloc_buffer((8,), "float16", scope="local")          # rope: the rotated new key
        wp = T.alloc_buffer((1,), "int32", scope="local")             # rope: the write position
        lane = T.meta_var(tx % 32)
        warp = T.meta_var(tx // 32)
        dq = T.meta_var(tx % LK)                # the thread's 8 dimensions of a key
        kr = T.meta_var(tx // LK)               # its key within each step
        c0 = T.meta_var(bx * C)
        if PDL:
            T.evaluate(grid_dependency("wait"))
            T.evaluate(grid_dependency("launch_dependents"))
        if ROPE:
            wp[0] = T.Cast("int32", POS[0])
            if bx == wp[0] // C:                # this CTA's chunk holds the new key: store it (and the value) first
                if tx < LK and wp[0] < S:
                    rotated(Q, bz, HQ + hk, tx * 8, COS, SIN, kr8, 0, rb, rf)
                    for v in T.vectorized(8):
                        K[bz, hk, wp[0], tx * 8 + v] = kr8[v]
                    for v in T.vectorized(8):
                        V[bz, hk, wp[0], tx * 8 + v] = Q[bz, HQ + HKV + hk, tx * 8 + v]
                T.tvm_storage_sync("shared")
            for g in T.unroll(G):
                rotated(Q, bz, hk * G + g, dq * 8, COS, SIN, qv, g * 8, rb, rf)
        else:
            for g in T.unroll(G):
                for v in T.vectorized(8):
                    qv[g * 8 + v] = Q[bz, hk * G + g, dq * 8 + v]
        sl[0] = SCALE[0] * T.float32(LOG2E)
        for w in T.unroll(WORDS):
            kw[w] = ballot(T.Cast("int32", T.if_then_else(c0 + w * 32 + lane < S, KEEP[bz, c0 + w * 32 + lane],
                                                          T.uint8(0)) != T.uint8(0)))
        if any_kept(kw):
            for i in T.unroll(ST):              # every kept key's K and V in flight before the first product
                if kept(kw, i, kr):
                    for v in T.vectorized(8):
                        kv[i * 8 + v] = K[bz, hk, c0 + i * KPS + kr, dq * 8 + v]
            for i in T.unroll(ST):
                if kept(kw, i, kr):
                    for v in T.vectorized(8):
                        vv[i * 8 + v] = V[bz, hk, c0 + i * KPS + kr, dq * 8 + v]
                else:                           # p = 0 must not meet a NaN
                    for v in T.unroll(8):
                        vv[i * 8 + v] = T.float16(0)
            for g in T.unroll(G):
                mx[g] = NEG_INF
            for i in T.unroll(ST):
                for g in T.unroll(G):
                    tmp[0] = T.float32(0)
                    for v in T.unroll(8):
                        tmp[0] = tmp[0] + to_f32(qv[g * 8 + v], ACT) * to_f32(kv[i * 8 + v], ACT)
                    for s in T.unroll(KEY_STEPS):
                        T.evaluate(T.ptx["shfl_sync.bfly.b32"](tmp[1], tmp[0], T.uint32(LK // 2 >> s), T.uint32(31),
                                                               FULL))
                        tmp[0] = tmp[0] + tmp[1]
                    sc[i * G + g] = T.if_then_else(kept(kw, i, kr), tmp[0] * sl[0], NEG_INF)
                    mx[g] = T.max(mx[g], sc[i * G + g])
            for g in T.unroll(G):
                for s in T.unroll(ROW_STEPS):
                    T.evaluate(T.ptx["shfl_sync.bfly.b32"](tmp[1], mx[g], T.uint32(LK << s), T.uint32(31), FULL))
                    mx[g] = T.max(mx[g], tmp[1])
                if lane == 0:
                    wmax[warp * G + g] = mx[g]
            T.tvm_storage_sync("shared")
            for g in T.unroll(G):               # the chunk has a kept key: its max is finite
                mx[g] = wmax[g]
                for w in T.unroll(W - 1):
                    mx[g] = T.max(mx[g], wmax[(w + 1) * G + g])
                ls[g] = T.float32(0)
                for v in T.unroll(8):
                    acc[g * 8 + v] = T.float32(0)
            for i in T.unroll(ST):
                for g in T.unroll(G):
                    sc[i * G + g] = T.exp2(sc[i * G + g] - mx[g])
                    ls[g] = ls[g] + sc[i * G + g]
                    for v in T.unroll(8):
                        acc[g * 8 + v] = acc[g * 8 + v] + sc[i * G + g] * to_f32(vv[i * 8 + v], ACT)
            for g in T.unroll(G):               # sum over the warp's keys: lanes dq of every key row
                for s in T.unroll(ROW_STEPS):
                    T.evaluate(T.ptx["shfl_sync.bfly.b32"](tmp[1], ls[g], T.uint32(LK << s), T.uint32(31), FULL))
                    ls[g] = ls[g] + tmp[1]
                    for v in T.unroll(8):
                        T.evaluate(T.ptx["shfl_sync.bfly.b32"](tmp[1], acc[g * 8 + v], T.uint32(LK << s),
                                                               T.uint32(31), FULL))
                        acc[g * 8 + v] = acc[g * 8 + v] + tmp[1]
                if lane < LK:
                    for v in T.unroll(8):
                        red[(warp * G + g) * D + dq * 8 + v] = acc[g * 8 + v]
                    if lane == 0:
                        red[W * G * D + warp * G + g] = ls[g]
            T.tvm_storage_sync("shared")
            for it in T.unroll(OUT4):           # the CTA's (G, D) sums, float4 stores
                if G * D // 4 % NT == 0 or tx + it * NT < G * D // 4:
                    for v in T.unroll(4):
                        tmp[v] = red[(tx + it * NT) * 4 + v]
                        for w in T.unroll(W - 1):
                            tmp[v] = tmp[v] + red[(w + 1) * G * D + (tx + it * NT) * 4 + v]
                    for v in T.vectorized(4):
                        O[bz, hk * G + (tx + it * NT) * 4 // D, bx, (tx + it * NT) * 4 % D + v] = tmp[v]
            if tx < G:
                tmp[0] = wmax[tx]
                tmp[1] = red[W * G * D + tx]
                for w in T.unroll(W - 1):
                    tmp[0] = T.max(tmp[0], wmax[(w + 1) * G + tx])
                    tmp[1] = tmp[1] + red[W * G * D + (w + 1) * G + tx]
                for v in T.vectorized(2):
                    ML[bz, hk * G + tx, bx, v] = tmp[v]
        else:                                   # no kept key: nothing loaded, the chunk weighs nothing
            if tx < G:
                ML[bz, hk * G + tx, bx, 0] = NEG_INF
                ML[bz, hk * G + tx, bx, 1] = T.float32(0)

    return tvm.IRModule({spec.name: kernel})


def combine_kernel(spec: DecodeAttentionSpec):
    import tvm
    from tvm import tirx
    from tvm.script import tirx as T

    B, NS = tirx.Var("B", "int32"), tirx.Var("NS", "int32")
    HQ, D, NT, W = spec.hq, spec.d, spec.threads, spec.threads // 32
    VEC = 4 if D <= 128 else 8                 # floats of a chunk's row per lane
    LR = D // VEC                              # lanes per row
    RPS = NT // LR                             # rows the CTA loads per step
    PASS = RPS * UNROLL
    ROW_STEPS = (32 // LR).bit_length() - 1
    ACT, PDL, ROPE = spec.dtype, spec.pdl, spec.rope
    FULL = T.uint32(0xFFFFFFFF)
    NEG_INF = tirx.const(float("-inf"), "float32")

    @T.macro
    def merge(st, acc, m2, l2, a2, o2, f):
        # (max, sum, V sums) of st/acc and of another set (m2, l2, a2[o2:]), both in log2 units; nothing if both empty
        f[0] = T.max(st[0], m2)
        if f[0] > NEG_INF:
            f[1] = T.exp2(st[0] - f[0])
            f[2] = T.exp2(m2 - f[0])
            st[1] = st[1] * f[1] + l2 * f[2]
            for v in T.unroll(VEC):
                acc[v] = acc[v] * f[1] + a2[o2 + v] * f[2]
            st[0] = f[0]

    @T.prim_func
    def kernel(o_h: T.handle, ml_h: T.handle, pos_h: T.handle, y_h: T.handle):
        T.func_attr({"global_symbol": spec.name, "tirx.noalias": True})
        O = T.match_buffer(o_h, (B, HQ, NS, D), "float32")
        ML = T.match_buffer(ml_h, (B, HQ, NS, 2), "float32")
        POS = T.match_buffer(pos_h, (1,), "int64")            # rope: the cache's write counter, one added
        Y = T.match_buffer(y_h, (B, HQ, D), "float16")
        h = T.launch_thread("blockIdx.x", HQ)
        b = T.launch_thread("blockIdx.y", B)
        tx = T.launch_thread("threadIdx.x", NT)
        part = T.alloc_buffer((W * LR * (2 + VEC),), "float32", scope="shared")
        ml = T.alloc_buffer((UNROLL * 2,), "float32", scope="local")
        ov = T.alloc_buffer((UNROLL * VEC,), "float32", scope="local")
        st = T.alloc_buffer((2,), "float32", scope="local")               # max, sum
        acc = T.alloc_buffer((VEC,), "float32", scope="local")
        oth = T.alloc_buffer((2 + VEC,), "float32", scope="local")        # another row's state
        f = T.alloc_buffer((3,), "float32", scope="local")
        yv = T.alloc_buffer((VEC,), "float16", scope="local")
        lane = T.meta_var(tx % 32)
        warp = T.meta_var(tx // 32)
        r = T.meta_var(tx // LR)
        dl = T.meta_var(tx % LR)
        if PDL:
            T.evaluate(grid_dependency("wait"))
            T.evaluate(grid_dependency("launch_dependents"))
        if ROPE:                                # every partial CTA has read the position (the wait, or stream order)
            if h == 0 and b == 0 and tx == 0:
                POS[0] = POS[0] + T.int64(1)
        st[0] = NEG_INF
        st[1] = T.float32(0)
        for v in T.unroll(VEC):
            acc[v] = T.float32(0)
        for p in T.serial((NS + PASS - 1) // PASS):
            for u in T.unroll(UNROLL):
                if p * PASS + u * RPS + r < NS:
                    for v in T.vectorized(2):
                        ml[u * 2 + v] = ML[b, h, p * PASS + u * RPS + r, v]
                else:
                    ml[u * 2] = NEG_INF
                    ml[u * 2 + 1] = T.float32(0)
            for u in T.unroll(UNROLL):          # a chunk's V sums only where it kept a key (else never written)
                if ml[u * 2 + 1] > T.float32(0):
                    for v in T.vectorized(VEC):
                        ov[u * VEC + v] = O[b, h, p * PASS + u * RPS + r, dl * VEC + v]
            for u in T.unroll(UNROLL):
                if ml[u * 2 + 1] > T.float32(0):
                    merge(st, acc, ml[u * 2], ml[u * 2 + 1], ov, u * VEC, f)
        for s in T.unroll(ROW_STEPS):           # the warp's rows
            T.evaluate(T.ptx["shfl_sync.bfly.b32"](oth[0], st[0], T.uint32(LR << s), T.uint32(31), FULL))
            T.evaluate(T.ptx["shfl_sync.bfly.b32"](oth[1], st[1], T.uint32(LR << s), T.uint32(31), FULL))
            for v in T.unroll(VEC):
                T.evaluate(T.ptx["shfl_sync.bfly.b32"](oth[2 + v], acc[v], T.uint32(LR << s), T.uint32(31), FULL))
            merge(st, acc, oth[0], oth[1], oth, 2, f)
        if W > 1:                               # the warps' rows, merged by warp 0
            if lane < LR:
                part[(warp * LR + dl) * (2 + VEC)] = st[0]
                part[(warp * LR + dl) * (2 + VEC) + 1] = st[1]
                for v in T.unroll(VEC):
                    part[(warp * LR + dl) * (2 + VEC) + 2 + v] = acc[v]
            T.tvm_storage_sync("shared")
            if warp == 0 and lane < LR:
                for w in T.unroll(W - 1):
                    for v in T.unroll(2 + VEC):
                        oth[v] = part[((w + 1) * LR + dl) * (2 + VEC) + v]
                    merge(st, acc, oth[0], oth[1], oth, 2, f)
        if warp == 0 and lane < LR:
            for v in T.unroll(VEC):
                f[0] = T.if_then_else(st[1] > T.float32(0), acc[v] / st[1], T.float32(0))
                yv[v] = from_f32(f[0], ACT)
            for v in T.vectorized(VEC):
                Y[b, h, dl * VEC + v] = yv[v]

    return tvm.IRModule({spec.name: kernel})
