"""The FP8 (E4M3) weight GEMV (``spec.Fp8GemvSpec``) in TVMScript.

Grid: (block rows, ``ksplit``). A CTA owns a 32-row block row and a ``ksplit``-th of its blocks (all of them, or the
kept ones of the block table); its warps take those blocks round robin, ``inflight`` at a time: a lane loads its two
16-byte pieces of each (rows ``16i + lane // 2``, 16 codes from ``16 (lane % 2)``; a warp's load is 512 contiguous
bytes), all of them in flight before the first product. Each word of four codes becomes two f16x2 by
``cvt.rn.f16x2.e4m3x2`` (exact: every E4M3 value is an fp16 normal), then fp32; X (fp16 or bf16, read through L1
where the block's columns are) widens to fp32 exactly, and one fp32 FMA per code and row accumulates, so each weight
is read once for every row. ``scale="block"``: a block's partial sums are multiplied by its 128×128 scale as they are
added; ``"channel"``: the row's scale multiplies the sum in the epilogue. The two lanes of a row add by a shuffle,
the warps through shared memory, then scale, bias and activation (``templates/epilogue.py``). ``ksplit > 1``: fp32
partials in ``P``, the last CTA of a block row to arrive (counted in ``Cnt`` after a fence) sums them in split order
and resets its counter. ``pdl``: the first round's weights load before ``griddepcontrol.wait``; X and every write
after it; ``griddepcontrol.launch_dependents`` after the last weights (``trigger="late"``) or at the start
(``"early"``: the next kernel's weight loads overlap this one).
"""

from __future__ import annotations

from ..epilogue import tir_activate
from ..ptx import from_f32, grid_dependency, to_f32
from .spec import BLOCK, SCALE_BLOCK, WORDS, Fp8GemvSpec

E4M3X2 = ("__device__ __forceinline__ unsigned sparta_e4m3x2_f16x2(unsigned w) {\n"
          "  unsigned r;\n"
          "  asm(\"{\\n .reg .b16 lo;\\n cvt.u16.u32 lo, %1;\\n cvt.rn.f16x2.e4m3x2 %0, lo;\\n}\" : \"=r\"(r) : \"r\"(w));\n"
          "  return r;\n}\n")


def e4m3x2(w):
    """TIR: the f16x2 (as uint32; low half from the low byte) of the two E4M3 codes in the low 16 bits of ``w``."""
    from tvm.script import tirx as T
    return T.cuda.func_call("sparta_e4m3x2_f16x2", T.Cast("uint32", w), source_code=E4M3X2, return_type="uint32")


def half_f32(u, high: bool):
    """TIR: fp32 of the low (or high) fp16 half of uint32 ``u``."""
    from tvm.script import tirx as T
    bits = (u >> T.uint32(16)) if high else (u & T.uint32(0xFFFF))
    return T.Cast("float32", T.reinterpret("float16", T.Cast("uint16", bits)))


def fp8_gemv(spec: Fp8GemvSpec):
    """The kernel as an IRModule with one PrimFunc named ``spec.name`` (``spec.mma``: :func:`fp8_gemv_mma`)."""
    if spec.mma:
        return fp8_gemv_mma(spec)
    import tvm
    from tvm import tirx
    from tvm.script import tirx as T

    M = tirx.Var("M", "int32")
    N, K, MR, W, IF, KS = spec.n, spec.k, spec.rows, spec.warps, spec.inflight, spec.ksplit
    NBR, KB = spec.row_blocks, spec.col_blocks
    SPARSE, BSCALE = spec.sparse, spec.scale == "block"
    SB = SCALE_BLOCK // BLOCK                 # layout blocks per scale block (each way)
    NT = 32 * W
    CHUNK = -(-KB // KS)                      # dense: blocks of one split
    OUTS = BLOCK * MR
    OUT_ITERS = -(-OUTS // NT)
    ACT, PDL, EARLY = spec.dtype, spec.pdl, spec.trigger == "early"
    VEC = K % 8 == 0                          # X rows in 16-byte pieces
    FULL = T.uint32(0xFFFFFFFF)
    SSHAPE = spec.scale_shape
    # no __restrict__ under PDL: nvcc may move a restrict (ld.global.nc) load above griddepcontrol.wait
    ATTRS = {"global_symbol": spec.name} if PDL else {"global_symbol": spec.name, "tirx.noalias": True}

    @T.macro
    def load_block(Wp, Tab, wv, kb, st, o, jj, rr, h):
        # the CTA's block jj of its range (if it has one): the lane's two 16-byte pieces into wv[o], its column into kb
        if jj < st[1]:
            for i in T.unroll(2):
                for v in T.vectorized(4):
                    wv[(o * 2 + i) * 4 + v] = Wp[(st[0] + jj) * WORDS + (i * 16 + rr) * (BLOCK // 4) + h * 4 + v]
            if SPARSE:
                kb[o] = Tab[NBR + 1 + st[0] + jj]
            else:
                kb[o] = st[2] + jj

    @T.macro
    def decode(wv, wf, hb, o):
        # the lane's 32 codes of slot o -> fp32 (row i, column e: wf[16 i + e]), one cvt per pair
        for i in T.unroll(2):
            for q in T.unroll(4):
                for p in T.unroll(2):
                    hb[0] = e4m3x2(T.shift_right(T.Cast("uint32", wv[(o * 2 + i) * 4 + q]), T.uint32(16 * p)))
                    wf[i * 16 + q * 4 + p * 2] = half_f32(hb[0], False)
                    wf[i * 16 + q * 4 + p * 2 + 1] = half_f32(hb[0], True)

    @T.macro
    def load_x(X, xv, xf, m, c0):
        # X[m, c0 .. c0 + 16] -> fp32 (zero past K)
        if VEC:
            for p in T.unroll(2):
                if K % BLOCK == 0 or c0 + p * 8 < K:
                    for v in T.vectorized(8):
                        xv[p * 8 + v] = X[m, c0 + p * 8 + v]
                else:
                    for v in T.unroll(8):
                        xv[p * 8 + v] = T.float16(0)
        else:
            for e in T.unroll(16):
                xv[e] = T.if_then_else(c0 + e < K, X[m, T.min(c0 + e, K - 1)], T.float16(0))
        for e in T.unroll(16):
            xf[e] = to_f32(xv[e], ACT)

    @T.macro
    def multiply(X, S, M, wf, xv, xf, acc, pb, kb, o, rb, h):
        for m in T.unroll(MR):
            if m < M:
                load_x(X, xv, xf, m, kb[o] * BLOCK + h * 16)
                for i in T.unroll(2):
                    if BSCALE:
                        pb[0] = T.float32(0)
                        for e in T.unroll(16):
                            pb[0] = pb[0] + wf[i * 16 + e] * xf[e]
                        acc[i * MR + m] = acc[i * MR + m] + pb[0] * S[rb // SB, kb[o] // SB]
                    else:
                        for e in T.unroll(16):
                            acc[i * MR + m] = acc[i * MR + m] + wf[i * 16 + e] * xf[e]

    @T.macro
    def epilogue(Y, S, B, tot, m, n):
        if not BSCALE:
            tot[0] = tot[0] * S[n]
        if spec.bias:
            tot[0] = tot[0] + to_f32(B[n], ACT)
        tot[1] = tir_activate(tot[0], None, spec.act)
        Y[m, n] = from_f32(tot[1], ACT)

    @T.prim_func
    def kernel(x_h: T.handle, w_h: T.handle, s_h: T.handle, tab_h: T.handle, b_h: T.handle, y_h: T.handle,
               p_h: T.handle, c_h: T.handle):
        T.func_attr(ATTRS)
        wlen = T.int32()
        ntab = T.int32()
        X = T.match_buffer(x_h, (M, K), "float16")
        Wp = T.match_buffer(w_h, (wlen,), "int32")
        S = T.match_buffer(s_h, SSHAPE, "float32")
        Tab = T.match_buffer(tab_h, (ntab,), "int32")
        B = T.match_buffer(b_h, (N,), "float16")
        Y = T.match_buffer(y_h, (M, N), "float16")
        P = T.match_buffer(p_h, (KS, MR, NBR * BLOCK), "float32")
        Cnt = T.match_buffer(c_h, (NBR,), "int32")
        rb = T.launch_thread("blockIdx.x", NBR)
        ks = T.launch_thread("blockIdx.y", KS)
        tx = T.launch_thread("threadIdx.x", NT)
        red = T.alloc_buffer((W * BLOCK * MR,), "float32", scope="shared")
        arrived = T.alloc_buffer((1,), "int32", scope="shared")
        wv = T.alloc_buffer((IF * 8,), "int32", scope="local")
        kb = T.alloc_buffer((IF,), "int32", scope="local")
        wf = T.alloc_buffer((32,), "float32", scope="local")
        xv = T.alloc_buffer((16,), "float16", scope="local")
        xf = T.alloc_buffer((16,), "float32", scope="local")
        acc = T.alloc_buffer((2 * MR,), "float32", scope="local")
        pb = T.alloc_buffer((1,), "float32", scope="local")
        hb = T.alloc_buffer((1,), "uint32", scope="local")
        st = T.alloc_buffer((3,), "int32", scope="local")      # first block of the range, blocks in it, its column
        tot = T.alloc_buffer((2,), "float32", scope="local")
        last = T.alloc_buffer((1,), "bool", scope="local")
        lane = T.meta_var(tx % 32)
        warp = T.meta_var(tx // 32)
        h = T.meta_var(lane % 2)              # the lane's 16 columns of a block
        rr = T.meta_var(lane // 2)            # its row in each half of the block
        if SPARSE:                            # the block row's kept blocks, this split's share of them
            st[1] = (Tab[rb + 1] - Tab[rb] + KS - 1) // KS
            st[0] = T.min(ks * st[1], Tab[rb + 1] - Tab[rb])
            st[1] = T.min(st[1], Tab[rb + 1] - Tab[rb] - st[0])
            st[0] = st[0] + Tab[rb]
            st[2] = 0
        else:
            st[2] = T.min(ks * CHUNK, KB)
            st[0] = rb * KB + st[2]
            st[1] = T.min(CHUNK, KB - st[2])
        if PDL and EARLY:                     # the next kernel may launch now: its weights load while this one runs
            T.evaluate(grid_dependency("launch_dependents"))
        for a in T.unroll(2 * MR):
            acc[a] = T.float32(0)
        for t in T.serial((st[1] - warp + IF * W - 1) // (IF * W)):
            for o in T.unroll(IF):
                load_block(Wp, Tab, wv, kb, st, o, warp + (t * IF + o) * W, rr, h)
            if PDL:
                if t == 0:                    # the weights load while the previous kernel finishes; X is its output
                    T.evaluate(grid_dependency("wait"))
            for o in T.unroll(IF):
                if warp + (t * IF + o) * W < st[1]:
                    decode(wv, wf, hb, o)
                    multiply(X, S, M, wf, xv, xf, acc, pb, kb, o, rb, h)
        if PDL:                               # every write after the previous kernel completed
            T.evaluate(grid_dependency("wait"))
            if not EARLY:
                T.evaluate(grid_dependency("launch_dependents"))
        for i in T.unroll(2):                 # the two lanes of a row, then the warps
            for m in T.unroll(MR):
                T.evaluate(T.ptx["shfl_sync.bfly.b32"](tot[0], acc[i * MR + m], T.uint32(1), T.uint32(31), FULL))
                acc[i * MR + m] = acc[i * MR + m] + tot[0]
                if h == 0:
                    red[(warp * BLOCK + i * 16 + rr) * MR + m] = acc[i * MR + m]
        T.tvm_storage_sync("shared")
        if KS == 1:
            for it in T.unroll(OUT_ITERS):
                o = T.meta_var(tx + it * NT)
                if OUTS % NT == 0 or o < OUTS:
                    n = T.meta_var(rb * BLOCK + o % BLOCK)
                    if o // BLOCK < M and n < N:
                        tot[0] = red[o % BLOCK * MR + o // BLOCK]
                        for w in T.unroll(1, W):
                            tot[0] = tot[0] + red[(w * BLOCK + o % BLOCK) * MR + o // BLOCK]
                        epilogue(Y, S, B, tot, o // BLOCK, n)
        else:
            for it in T.unroll(OUT_ITERS):
                o = T.meta_var(tx + it * NT)
                if OUTS % NT == 0 or o < OUTS:
                    if o // BLOCK < M:
                        tot[0] = red[o % BLOCK * MR + o // BLOCK]
                        for w in T.unroll(1, W):
                            tot[0] = tot[0] + red[(w * BLOCK + o % BLOCK) * MR + o // BLOCK]
                        P[ks, o // BLOCK, rb * BLOCK + o % BLOCK] = tot[0]
            T.cuda.thread_fence()
            T.tvm_storage_sync("shared")
            if tx == 0:
                arrived[0] = T.cuda.atomic_add(Cnt.ptr_to([rb]), 1)
            T.tvm_storage_sync("shared")
            last[0] = arrived[0] == KS - 1
            if last[0]:
                T.cuda.thread_fence()
                for it in T.unroll(OUT_ITERS):
                    o = T.meta_var(tx + it * NT)
                    if OUTS % NT == 0 or o < OUTS:
                        n = T.meta_var(rb * BLOCK + o % BLOCK)
                        if o // BLOCK < M and n < N:
                            tot[0] = P[0, o // BLOCK, n]
                            for k2 in T.unroll(1, KS):
                                tot[0] = tot[0] + P[k2, o // BLOCK, n]
                            epilogue(Y, S, B, tot, o // BLOCK, n)
                if tx == 0:
                    Cnt[rb] = 0

    return tvm.IRModule({spec.name: _drop_unused(kernel, spec)})


# E4M3 -> 16-bit by bit operations (no conversion unit): of a word's four codes c0..c3 (c0 the low byte), ``v = q << 8``
# gives (c0, c2) and ``v = q`` gives (c1, c3), each in a 16-bit half at bits 8..15; the sign stays at bit 15 and the 7
# bits of exponent and mantissa shift right into fp16's (by 1: the value times 2^-8, exact, E4M3 subnormals included,
# as fp16 subnormals) or bf16's (by 4: times 2^-120, bf16 subnormals, then one exact bf16x2 fma by 2^120 adding -0).
F8_DECODE = {
    "float16": ("__device__ __forceinline__ unsigned sparta_f8x2_f16(unsigned v) {\n"
                "  return (v & 0x80008000u) | ((v & 0x7F007F00u) >> 1);\n}\n"),
    "bfloat16": ("__device__ __forceinline__ unsigned sparta_f8x2_bf16(unsigned v) {\n"
                 "  unsigned r = (v & 0x80008000u) | ((v & 0x7F007F00u) >> 4);\n"
                 "  asm(\"fma.rn.bf16x2 %0, %0, %1, %2;\" : \"+r\"(r) : \"r\"(0x7B807B80u), \"r\"(0x80008000u));\n"
                 "  return r;\n}\n"),
}
F8_UNSCALE = {"float16": 256.0, "bfloat16": 1.0}      # the fp16 decode is the value times 2^-8: folded into the scale
PRMT = ("__device__ __forceinline__ unsigned sparta_prmt(unsigned a, unsigned b, unsigned s) {\n"
        "  return __byte_perm(a, b, s);\n}\n")


def f8x2(v, act: str):
    """TIR: the 16-bit pair (as uint32) of the E4M3 codes in bits 8..15 and 24..31 of ``v`` (see ``F8_DECODE``)."""
    from tvm.script import tirx as T
    fn = "sparta_f8x2_f16" if act == "float16" else "sparta_f8x2_bf16"
    return T.cuda.func_call(fn, v, source_code=F8_DECODE[act], return_type="uint32")


def prmt(a, b, sel: int):
    """TIR: ``prmt.b32`` (``__byte_perm``) of uint32 ``a``, ``b``."""
    from tvm.script import tirx as T
    return T.cuda.func_call("sparta_prmt", a, b, T.uint32(sel), source_code=PRMT, return_type="uint32")


def fp8_gemv_mma(spec: Fp8GemvSpec):
    """The tensor-core variant: the same grid, split, table, PDL and epilogue as :func:`fp8_gemv`; a warp computes a
    32×32 block as 2 (row halves) × 2 (k16 steps) ``mma.sync.m16n8k16`` per 8 rows of X, ``Yᵀ = W Xᵀ``.

    A lane ``4g + t`` loads 8 bytes (columns ``8t .. 8t+8``) of block rows ``g``, ``g+8``, ``16+g``, ``24+g`` (each
    load instruction of the warp: 256 contiguous bytes). A word of four codes (columns ``c .. c+3``) decodes by bit
    operations (``F8_DECODE``) into the pairs (c, c+2) and (c+1, c+3): the A fragment's k slots (2t, 2t+1) and
    (2t+8, 2t+9) of one k16 step. K is permuted the same way in B: the lane's 16-byte piece of X row ``g``
    (columns ``8t ..``) is regrouped by two ``prmt`` per step. X rows past ``M`` are zeros. fp32 accumulation in the
    MMA; fp16 weights are the codes times 2^-8, so the scale carries 2^8. ``scale="block"``: each block's MMAs into
    fresh accumulators, added times the block's scale."""
    import tvm
    from tvm import tirx
    from tvm.script import tirx as T

    M = tirx.Var("M", "int32")
    N, K, MR, W, IF, KS = spec.n, spec.k, spec.rows, spec.warps, spec.inflight, spec.ksplit
    NBR, KB = spec.row_blocks, spec.col_blocks
    SPARSE, BSCALE = spec.sparse, spec.scale == "block"
    SB = SCALE_BLOCK // BLOCK
    NT = 32 * W
    CHUNK = -(-KB // KS)
    OUTS = BLOCK * MR
    OUT_ITERS = -(-OUTS // NT)
    RH = 1 if MR <= 8 else 2                  # groups of 8 rows of X: the MMA's N
    NACC = 2 * RH * 4
    ACT, PDL, EARLY = spec.dtype, spec.pdl, spec.trigger == "early"
    UNSCALE = F8_UNSCALE[ACT]
    op16 = "bf16" if ACT == "bfloat16" else "f16"
    MMA = f"mma.sync.aligned.m16n8k16.row.col.f32.{op16}.{op16}.f32"
    VEC = K % 8 == 0
    SSHAPE = spec.scale_shape
    ATTRS = {"global_symbol": spec.name} if PDL else {"global_symbol": spec.name, "tirx.noalias": True}

    @T.macro
    def load_block(Wp, Tab, wv, kb, st, o, jj, g, t):
        # the CTA's block jj of its range (if it has one): the lane's 8 bytes of 4 rows into wv[o], its column into kb
        if jj < st[1]:
            for j in T.unroll(4):
                for v in T.vectorized(2):
                    wv[(o * 4 + j) * 2 + v] = Wp[(st[0] + jj) * WORDS + ((j // 2) * 16 + (j % 2) * 8 + g) * (BLOCK // 4)
                                                 + t * 2 + v]
            if SPARSE:
                kb[o] = Tab[NBR + 1 + st[0] + jj]
            else:
                kb[o] = st[2] + jj

    @T.macro
    def load_x(X, M, xh, xa, kb, o, g, t):
        # rows g (+ 8) of X, columns 8t .. 8t+8 of block column kb[o] (zero past M and K)
        for rh in T.unroll(RH):
            c0 = T.meta_var(kb[o] * BLOCK + t * 8)
            if VEC:
                if g + rh * 8 < M and (K % BLOCK == 0 or c0 < K):
                    for v in T.vectorized(8):
                        xh[(o * RH + rh) * 8 + v] = X[g + rh * 8, c0 + v]
                else:
                    for v in T.unroll(4):
                        xa[(o * RH + rh) * 4 + v] = T.uint32(0)
            else:
                for v in T.unroll(8):
                    xh[(o * RH + rh) * 8 + v] = T.if_then_else(
                        g + rh * 8 < M and c0 + v < K, X[T.min(g + rh * 8, M - 1), T.min(c0 + v, K - 1)],
                        T.float16(0))

    @T.macro
    def multiply(M, wv, xa, bq, a, c, o):
        for rh in T.unroll(RH):               # B: X columns (2t, 2t+2), (2t+1, 2t+3) of each step's 4
            for s in T.unroll(2):
                bq[rh * 4 + s * 2] = prmt(xa[(o * RH + rh) * 4 + 2 * s], xa[(o * RH + rh) * 4 + 2 * s + 1], 0x5410)
                bq[rh * 4 + s * 2 + 1] = prmt(xa[(o * RH + rh) * 4 + 2 * s], xa[(o * RH + rh) * 4 + 2 * s + 1],
                                              0x7632)
        for j in T.unroll(4):                 # A: row slot j, step s: (c0, c2) then (c1, c3)
            for s in T.unroll(2):
                a[(j * 2 + s) * 2] = f8x2(T.Cast("uint32", wv[(o * 4 + j) * 2 + s]) << T.uint32(8), ACT)
                a[(j * 2 + s) * 2 + 1] = f8x2(T.Cast("uint32", wv[(o * 4 + j) * 2 + s]), ACT)
        for rh in T.unroll(RH):
            if rh == 0 or M > 8:
                for mt in T.unroll(2):
                    for s in T.unroll(2):
                        i = T.meta_var((mt * RH + rh) * 4)
                        T.evaluate(T.ptx[MMA](c[i], c[i + 1], c[i + 2], c[i + 3],
                                              a[(4 * mt + s) * 2], a[(4 * mt + 2 + s) * 2],
                                              a[(4 * mt + s) * 2 + 1], a[(4 * mt + 2 + s) * 2 + 1],
                                              bq[rh * 4 + s * 2], bq[rh * 4 + s * 2 + 1],
                                              c[i], c[i + 1], c[i + 2], c[i + 3]))

    @T.macro
    def epilogue(Y, S, B, tot, m, n):
        if not BSCALE:
            tot[0] = tot[0] * (S[n] * T.float32(UNSCALE))
        if spec.bias:
            tot[0] = tot[0] + to_f32(B[n], ACT)
        tot[1] = tir_activate(tot[0], None, spec.act)
        Y[m, n] = from_f32(tot[1], ACT)

    @T.prim_func
    def kernel(x_h: T.handle, w_h: T.handle, s_h: T.handle, tab_h: T.handle, b_h: T.handle, y_h: T.handle,
               p_h: T.handle, c_h: T.handle):
        T.func_attr(ATTRS)
        wlen = T.int32()
        ntab = T.int32()
        X = T.match_buffer(x_h, (M, K), "float16")
        Wp = T.match_buffer(w_h, (wlen,), "int32")
        S = T.match_buffer(s_h, SSHAPE, "float32")
        Tab = T.match_buffer(tab_h, (ntab,), "int32")
        B = T.match_buffer(b_h, (N,), "float16")
        Y = T.match_buffer(y_h, (M, N), "float16")
        P = T.match_buffer(p_h, (KS, MR, NBR * BLOCK), "float32")
        Cnt = T.match_buffer(c_h, (NBR,), "int32")
        rb = T.launch_thread("blockIdx.x", NBR)
        ks = T.launch_thread("blockIdx.y", KS)
        tx = T.launch_thread("threadIdx.x", NT)
        red = T.alloc_buffer((W * BLOCK * MR,), "float32", scope="shared")
        arrived = T.alloc_buffer((1,), "int32", scope="shared")
        wv = T.alloc_buffer((IF * 8,), "int32", scope="local")
        kb = T.alloc_buffer((IF,), "int32", scope="local")
        xa = T.alloc_buffer((IF * RH * 4,), "uint32", scope="local")
        xh = T.decl_buffer((IF * RH * 8,), "float16", data=xa.data, scope="local")
        bq = T.alloc_buffer((RH * 4,), "uint32", scope="local")
        a = T.alloc_buffer((16,), "uint32", scope="local")
        acc = T.alloc_buffer((NACC,), "float32", scope="local")
        cacc = T.alloc_buffer((NACC if BSCALE else 1,), "float32", scope="local")
        st = T.alloc_buffer((3,), "int32", scope="local")      # first block of the range, blocks in it, its column
        tot = T.alloc_buffer((2,), "float32", scope="local")
        last = T.alloc_buffer((1,), "bool", scope="local")
        lane = T.meta_var(tx % 32)
        warp = T.meta_var(tx // 32)
        g = T.meta_var(lane // 4)             # the lane's rows (g, g + 8 of each half) and X row
        t = T.meta_var(lane % 4)              # its 8 columns of a block
        if SPARSE:                            # the block row's kept blocks, this split's share of them
            st[1] = (Tab[rb + 1] - Tab[rb] + KS - 1) // KS
            st[0] = T.min(ks * st[1], Tab[rb + 1] - Tab[rb])
            st[1] = T.min(st[1], Tab[rb + 1] - Tab[rb] - st[0])
            st[0] = st[0] + Tab[rb]
            st[2] = 0
        else:
            st[2] = T.min(ks * CHUNK, KB)
            st[0] = rb * KB + st[2]
            st[1] = T.min(CHUNK, KB - st[2])
        if PDL and EARLY:                     # the next kernel may launch now: its weights load while this one runs
            T.evaluate(grid_dependency("launch_dependents"))
        for i in T.unroll(NACC):
            acc[i] = T.float32(0)
        for it in T.serial((st[1] - warp + IF * W - 1) // (IF * W)):
            for o in T.unroll(IF):
                load_block(Wp, Tab, wv, kb, st, o, warp + (it * IF + o) * W, g, t)
            if PDL:
                if it == 0:                   # the weights load while the previous kernel finishes; X is its output
                    T.evaluate(grid_dependency("wait"))
            for o in T.unroll(IF):            # every slot's X in flight (L2 hits) while the weights arrive
                if warp + (it * IF + o) * W < st[1]:
                    load_x(X, M, xh, xa, kb, o, g, t)
            for o in T.unroll(IF):
                if warp + (it * IF + o) * W < st[1]:
                    if BSCALE:
                        for i in T.unroll(NACC):
                            cacc[i] = T.float32(0)
                        multiply(M, wv, xa, bq, a, cacc, o)
                        for i in T.unroll(NACC):
                            acc[i] = acc[i] + cacc[i] * (S[rb // SB, kb[o] // SB] * T.float32(UNSCALE))
                    else:
                        multiply(M, wv, xa, bq, a, acc, o)
        if PDL:                               # every write after the previous kernel completed
            T.evaluate(grid_dependency("wait"))
            if not EARLY:
                T.evaluate(grid_dependency("launch_dependents"))
        for mt in T.unroll(2):                # C: weight rows 16 mt + g (+8), X rows 8 rh + 2t (+1)
            for rh in T.unroll(RH):
                for r in T.unroll(4):
                    if MR % 8 == 0 or rh * 8 + t * 2 + r % 2 < MR:
                        red[(warp * BLOCK + mt * 16 + g + 8 * (r // 2)) * MR + rh * 8 + t * 2 + r % 2] = \
                            acc[(mt * RH + rh) * 4 + r]
        T.tvm_storage_sync("shared")
        if KS == 1:
            for it in T.unroll(OUT_ITERS):
                o = T.meta_var(tx + it * NT)
                if OUTS % NT == 0 or o < OUTS:
                    n = T.meta_var(rb * BLOCK + o % BLOCK)
                    if o // BLOCK < M and n < N:
                        tot[0] = red[o % BLOCK * MR + o // BLOCK]
                        for w in T.unroll(1, W):
                            tot[0] = tot[0] + red[(w * BLOCK + o % BLOCK) * MR + o // BLOCK]
                        epilogue(Y, S, B, tot, o // BLOCK, n)
        else:
            for it in T.unroll(OUT_ITERS):
                o = T.meta_var(tx + it * NT)
                if OUTS % NT == 0 or o < OUTS:
                    if o // BLOCK < M:
                        tot[0] = red[o % BLOCK * MR + o // BLOCK]
                        for w in T.unroll(1, W):
                            tot[0] = tot[0] + red[(w * BLOCK + o % BLOCK) * MR + o // BLOCK]
                        P[ks, o // BLOCK, rb * BLOCK + o % BLOCK] = tot[0]
            T.cuda.thread_fence()
            T.tvm_storage_sync("shared")
            if tx == 0:
                arrived[0] = T.cuda.atomic_add(Cnt.ptr_to([rb]), 1)
            T.tvm_storage_sync("shared")
            last[0] = arrived[0] == KS - 1
            if last[0]:
                T.cuda.thread_fence()
                for it in T.unroll(OUT_ITERS):
                    o = T.meta_var(tx + it * NT)
                    if OUTS % NT == 0 or o < OUTS:
                        n = T.meta_var(rb * BLOCK + o % BLOCK)
                        if o // BLOCK < M and n < N:
                            tot[0] = P[0, o // BLOCK, n]
                            for k2 in T.unroll(1, KS):
                                tot[0] = tot[0] + P[k2, o // BLOCK, n]
                            epilogue(Y, S, B, tot, o // BLOCK, n)
                if tx == 0:
                    Cnt[rb] = 0

    return tvm.IRModule({spec.name: _drop_unused(kernel, spec)})


def _drop_unused(func, spec: Fp8GemvSpec):
    """The PrimFunc without the buffers this spec's kernel never reads (no table, bias or split-K workspace)."""
    drop = set()
    if not spec.sparse:
        drop.add("Tab")
    if not spec.bias:
        drop.add("B")
    if spec.ksplit == 1:
        drop.update(("P", "Cnt"))
    from tvm import tirx
    return tirx.PrimFunc([p for p in func.params if p.name not in drop], func.body, func.ret_type, func.attrs)


__all__ = ["fp8_gemv", "fp8_gemv_mma", "e4m3x2", "half_f32", "f8x2", "prmt", "F8_DECODE", "F8_UNSCALE"]
