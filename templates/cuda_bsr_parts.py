"""What the three ``bsr_linear`` kernels share (``templates/cuda_bsr.py``: ``mma.sync``; ``cuda_bsr_wgmma.py``;
``cuda_bsr_stream.py``): the epilogue's value (scales, bias, activation) and its requantisation, the data
movement (table lookup, ``cp.async`` stage loads into swizzled shared memory, the staged output tile and its
coalesced store) and the warp-level ``mma.sync`` inner loop (fp16, int8, int4 dequantised in registers).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from .cuda_bsr_ref import GELU_ERF_EX2, GELU_ERF_POLY, GELU_ERF_T, GELU_TANH_K, build_table
from .cuda_w4a16 import dequant_word, half2_splat, zero_terms

if TYPE_CHECKING:
    from .cuda_bsr import BsrSpec


def tir_activate(v, bias, act: str):
    """fp32 ``v`` (+ fp16 ``bias`` if given), activation — the fp32 value of the epilogue, as TIR."""
    from tvm.script import tirx as T
    if bias is not None:
        v = v + T.Cast("float32", bias)
    if act == "relu":
        v = T.max(v, T.float32(0))
    elif act == "gelu":
        v = gelu_tanh(v)
    elif act == "gelu_erf":
        v = gelu_erf(v)
    return v


def _mufu(fn: str, x):
    """TIR: ``fn``.approx.ftz.f32 of ``x`` (one SFU instruction: ``rcp`` or ``ex2``), an inline-asm device function."""
    from tvm.script import tirx as T
    src = (f"__device__ __forceinline__ float sparta_{fn}_approx(float x) "
           f"{{ float r; asm(\"{fn}.approx.ftz.f32 %0, %1;\" : \"=f\"(r) : \"f\"(x)); return r; }}\n")
    return T.cuda.func_call(f"sparta_{fn}_approx", x, source_code=src, return_type="float32")


def gelu_tanh(v):
    """TIR: the tanh-form GELU ½x(1 + tanh(u)), u = √(2/π)(x + 0.044715x³), as x·σ(2u) = x / (1 + 2^w) with w =
    -2·log2(e)·u: one ``ex2.approx``, one ``rcp.approx``, 5 multiply-adds (``tanhf``: about 20), no cancellation
    for x < 0; within 5.2e-7 absolute and 9e-7 relative of the exact value (torch's fp32 GELU: 1.5e-4 relative)."""
    from tvm import tirx
    from tvm.script import tirx as T
    x = tirx.Var("gx", "float32")
    w = x * (T.float32(GELU_TANH_K[0]) + T.float32(GELU_TANH_K[1]) * (x * x))
    return tirx.Let(x, v, x * _mufu("rcp", T.float32(1) + _mufu("ex2", w)))


def gelu_erf(v):
    """TIR: the exact GELU of fp32 ``v``, as relu(x) - |x|·h with h = ½·erfc(|x|/√2) by A&S 7.1.26 (the ½, 1/√2
    and log2(e) folded into its constants): one ``rcp.approx``, one ``ex2.approx``, 8 multiply-adds — under half
    the instructions of ``erff`` (two polynomials and selects), within 5e-7 of the exact GELU (``erff``'s own
    fp32 GELU: 4.5e-7)."""
    from tvm import tirx
    from tvm.script import tirx as T
    x, t = tirx.Var("gx", "float32"), tirx.Var("gt", "float32")
    poly = T.float32(GELU_ERF_POLY[0])
    for c in GELU_ERF_POLY[1:]:
        poly = poly * t + T.float32(c)
    h = t * poly * _mufu("ex2", x * T.float32(GELU_ERF_EX2) * x)
    return tirx.Let(x, v, tirx.Let(t, _mufu("rcp", T.float32(1) + T.float32(GELU_ERF_T) * T.fabs(x)),
                                   T.max(x, T.float32(0)) - T.fabs(x) * h))


def _const_table_source(spec: BsrSpec) -> tuple[str, str]:
    values = build_table(spec.pattern_mask(), spec.groups)[0].tolist()
    digest = hashlib.sha256(repr(values).encode()).hexdigest()[:12]
    fn = f"sparta_tab_{digest}"
    src = (f"__constant__ int {fn}_data[{len(values)}] = {{{', '.join(map(str, values))}}};\n"
           f"__device__ __forceinline__ int {fn}(int i) {{ return {fn}_data[i]; }}\n")
    return fn, src


ROUND_MAGIC = 12582912.0   # 1.5·2²³: x + ROUND_MAGIC, for |x| < 2²², is RN-even(x) in the low mantissa bits


def code_span(act: str, folded: bool) -> tuple[float, float]:
    """(span, offset) of the saturating requantisation: the code is round(span · z) − offset for z in [0, 1].
    ReLU folded into the constants needs only codes 0..127 (z = 0 is ReLU's zero); otherwise −127..127."""
    return (127.0, 0.0) if folded and act == "relu" else (254.0, 127.0)


def unit_value(v, q, c):
    """TIR: sat(fma(v, q, c)) — one ``FFMA.SAT``, the clamp to [0, 1] that saturation gives for free."""
    from tvm.script import tirx as T
    return T.call_pure_extern("float32", "__saturatef", T.call_pure_extern("float32", "__fmaf_rn", v, q, c))


def requantize_bits(z, span: float = 254.0, offset: float = 127.0):
    """TIR int32 whose low byte is the int8 code round(span · z) − offset of ``z`` in [0, 1]: the bits of fp32
    ``fma(z, span, M − offset)``, ``M`` = 1.5·2²³ — the sum's ulp is 1, so the one rounding of the ``fma`` is
    the rounding to an integer (half to even); no float→int conversion (a quarter of the FP32 rate) and no clamp
    (``unit_value`` saturated z). With z = sat(y·r/254 + ½) the code is ``cuda_bsr_ref.requantize``'s
    clamp(round(y·r), ±127) except where y·r lies within about 2⁻¹⁵ of a rounding tie (z's own rounding), by one."""
    from tvm.script import tirx as T
    t = T.call_pure_extern("float32", "__fmaf_rn", z, T.float32(span), T.float32(ROUND_MAGIC - offset))
    return T.reinterpret("int32", t)


_SHARED_IO = {             # one source per device function: TVM keeps one source per called name
    "ld_f32x4": ("const void* p, float* out", "*(float4*)out = *(const float4*)p;"),
    "st_f32x4": ("void* p, float a, float b, float c, float d", "*(float4*)p = make_float4(a, b, c, d);"),
    "st_h2": ("void* p, float a, float b", "*(half2*)p = __floats2half2_rn(a, b);"),   # one cvt for two
    "st_s8x2": ("void* p, int a, int b", "*(char2*)p = make_char2((signed char)a, (signed char)b);"),
}


def device_call(sources: dict, fn: str, *args):
    """TIR: a call of the void device function ``sparta_<fn>`` whose (parameters, body) are ``sources[fn]``."""
    from tvm.script import tirx as T
    params, body = sources[fn]
    src = f"__device__ __forceinline__ void sparta_{fn}({params}) {{ {body} }}\n"
    return T.cuda.func_call(f"sparta_{fn}", *args, source_code=src, return_type="void")


def shared_io(fn: str, *args):
    """TIR: a plain shared-memory access through a device function (invisible to TVM's barrier insertion)."""
    return device_call(_SHARED_IO, fn, *args)


class Movement:
    """What the ``mma.sync`` and ``wgmma`` kernels share: the table lookup, the ``cp.async`` stage
    loader into XOR-swizzled shared memory (for ``bk`` of 16/32/64 lanes this is exactly the
    32/64/128-byte swizzle that wgmma's shared-memory descriptors read) and the coalesced store of the output
    tile staged in shared memory (fp16, or int8 codes)."""

    def __init__(self, spec: BsrSpec, threads: int):
        from tvm.script import tirx as T

        EL = spec.elems_per_half             # the data movement counts 16-bit lanes: K and BK in lanes
        M, N, K, BN, BK, TM = spec.m, spec.n, spec.k // EL, spec.bn, spec.bk // EL, spec.tm
        NT = threads
        C = BK // 8                          # 16-byte chunks per shared row
        RPL = max(1, 8 // C)                 # rows per 128-byte bank line
        self.x_elems, self.stage = TM * BK, TM * BK + spec.w_lanes
        X_ELEMS, STAGE, W_LANES = self.x_elems, self.stage, spec.w_lanes
        W4 = spec.dtype == "w4a16"           # a W4A16 block is a record copied as is, not a swizzled tile
        X_CHUNKS, W_CHUNKS = TM * C, W_LANES // 8
        X_ITERS, W_ITERS = -(-X_CHUNKS // NT), -(-W_CHUNKS // NT)
        self.head = spec.table_head          # where the K indices start
        OUT8 = spec.out == "int8"
        self.out_ld = OUT_LD = spec.out_ld   # padded row of the output tile (fp16 lanes or int8 bytes)
        EPC = 16 if OUT8 else 8              # output elements per 16-byte chunk
        OUT_CHUNKS = TM * (BN // EPC)
        OUT_ITERS = -(-OUT_CHUNKS // NT)
        self.const_tab = spec.table == "const"
        if self.const_tab:
            self.tab_fn, self.tab_src = _const_table_source(spec)

        def swz(row, chunk):                 # shared offset of a 16-byte chunk, XOR-swizzled
            return row * BK + T.bitwise_xor(chunk, T.truncmod(T.truncdiv(row, RPL), C)) * 8
        self.swz = swz

        @T.macro
        def load_x(smem, X, tx, m0, stage, kb):
            # X[m0 : m0+TM, kb*BK : +BK] into ``stage``, 16 bytes per cp.async
            for it in T.unroll(X_ITERS):
                c = T.meta_var(tx + it * NT)
                if X_CHUNKS % NT == 0 or c < X_CHUNKS:
                    r = T.meta_var(c // C)
                    kc = T.meta_var(kb * BK + (c % C) * 8)
                    ok = T.meta_var(T.Cast("uint32", T.if_then_else(T.And(m0 + r < M, kc < K), 16, 0)))
                    T.evaluate(T.ptx["cp.async.cg.shared.global"](
                        smem.ptr_to([stage * STAGE + swz(r, c % C)]),
                        X.ptr_to([T.min(m0 + r, M - 1), T.min(kc, K - 8)]), 16, ok))

        @T.macro
        def load_w(smem, Wp, tx, stage, blk):
            # packed block ``blk`` into ``stage``
            for it in T.unroll(W_ITERS):
                c = T.meta_var(tx + it * NT)
                if W_CHUNKS % NT == 0 or c < W_CHUNKS:
                    T.evaluate(T.ptx["cp.async.cg.shared.global"](
                        smem.ptr_to([stage * STAGE + X_ELEMS + (c * 8 if W4 else swz(c // C, c % C))]),
                        Wp.ptr_to([blk * W_LANES + c * 8]), 16))

        @T.macro
        def load_stage(smem, X, Wp, tx, m0, stage, kb, blk):
            load_x(smem, X, tx, m0, stage, kb)
            load_w(smem, Wp, tx, stage, blk)
        self.load_stage, self.load_x, self.load_w = load_stage, load_x, load_w

        @T.macro
        def store_tile(smem, smo, Y, tx, m0, row, out0):
            # the tile (TM x BN at out0 fp16 lanes, rows OUT_LD elements apart) -> coalesced 16-byte rows of Y
            for it in T.unroll(OUT_ITERS):
                c = T.meta_var(tx + it * NT)
                if OUT_CHUNKS % NT == 0 or c < OUT_CHUNKS:
                    yr = T.meta_var(m0 + c // (BN // EPC))
                    yc = T.meta_var(row * BN + (c % (BN // EPC)) * EPC)
                    src = T.meta_var((c // (BN // EPC)) * OUT_LD + (c % (BN // EPC)) * EPC)
                    if N % EPC == 0:
                        if yr < M and yc < N:
                            for v in T.vectorized(EPC):
                                if OUT8:
                                    Y[yr, yc + v] = smo[out0 * 2 + src + v]
                                else:
                                    Y[yr, yc + v] = smem[out0 + src + v]
                    else:
                        for v in T.unroll(EPC):
                            if yr < M and yc + v < N:
                                if OUT8:
                                    Y[yr, yc + v] = smo[out0 * 2 + src + v]
                                else:
                                    Y[yr, yc + v] = smem[out0 + src + v]
        self.store_tile = store_tile

    def tab(self, tab_buf, i):
        """Entry ``i`` of the block table: the baked constant array, or the ``Tab`` argument."""
        from tvm.script import tirx as T
        if self.const_tab:
            return T.cuda.func_call(self.tab_fn, i, source_code=self.tab_src, return_type="int32")
        return tab_buf[i]


class FragmentEpilogue:
    """The epilogue of the ``bsr_linear`` kernels, over a thread's accumulator fragments:
    ``mi`` × ``nj`` tiles of m16n8 (accumulator ``(i·nj + j)·4 + 2h + e`` at row ``r0 + 16i + lane/4 + 8h``,
    column ``c0 + 8j + 2·(lane%4) + e``). Per column pair, (ws, ws', b, b') as fp32 are staged in shared memory
    once per tile (``load_constants``, or ``fetch_constants`` a row ahead + ``put_constants``, into buffer ``buf``
    of those at ``spec.const_offset``); the int8 row scales by ``load_scales`` (once per M tile); then per pair of
    accumulators one float4 read, ``(acc · xs) · ws + b`` (the reference's order; int8 codes out: times RN(1/s),
    folded into ws and b where the activation allows), the activation, and one half2 (or two int8 codes) store
    into the output tile staged at ``out0``. Shared accesses go through device
    functions: TVM's barrier insertion would otherwise fence each constant read against the tile's writes."""

    def __init__(self, spec: BsrSpec, threads: int, mi: int, nj: int):
        from tvm.script import tirx as T

        int8, BN, N, M, OUT_LD, PAIRS = spec.dtype == "int8", spec.bn, spec.n, spec.m, spec.out_ld, spec.bn // 2
        one, zero = T.float32(1), T.float32(0)
        const0 = spec.const_offset // 4          # float index
        ITERS = -(-PAIRS // threads)
        # int8 codes out: z = sat(y · r/span + offset/span) in [0, 1], code = round(span · z) − offset
        # (``requantize_bits``). No activation, or ReLU (which commutes with a positive scale, and which the
        # saturation at z = 0 then is): r/span and offset/span folded into the staged constants, so an output is one
        # FFMA.SAT of (acc · xs) by (ws · r/span) plus (b · r/span + offset/span); codes differ from the
        # reference's round(y · r) only next to a rounding tie, by one
        q8 = spec.out == "int8"
        fold = q8 and spec.act in ("none", "relu")
        span, offset = code_span(spec.act, fold)
        inv_span = T.float32(1.0 / span)

        def value(a, xs, kc, e, OS):
            # fp32 y (fp16 out) or z in [0, 1] (int8 out) of accumulator a
            v = T.Cast("float32", T.reinterpret("int32", a)) * xs if int8 else a
            if fold:
                return unit_value(v, kc[e], kc[2 + e])
            if int8:
                v = v * kc[e]
            y = tir_activate(v, kc[2 + e] if spec.bias else None, spec.act)
            return unit_value(y, OS[1] * inv_span, T.float32(offset / span)) if q8 else y

        def column_constants(WS, B, OS, c):      # fp32 (ws, b) of column c; folded: (ws · r/span, b · r/span + ½)
            ws = WS[c] if int8 else one
            b = T.Cast("float32", B[c]) if spec.bias else zero
            if not fold:
                return ws, b
            q = OS[1] * inv_span
            return ws * q, b * q + T.float32(offset / span)

        self.held = 4 * ITERS                    # registers kr of fetch_constants / put_constants

        @T.macro
        def fetch_constants(kr, WS, B, OS, t, row):
            # the column constants of block row ``row``: global loads into registers kr (a streaming kernel: a row
            # ahead) ...
            for it in T.unroll(ITERS):
                p = T.meta_var(t + it * threads)
                if PAIRS % threads == 0 or p < PAIRS:
                    for e in T.unroll(2):
                        k = T.meta_var(column_constants(WS, B, OS, T.min(row * BN + p * 2 + e, N - 1)))
                        kr[it * 4 + e] = k[0]
                        kr[it * 4 + 2 + e] = k[1]
        self.fetch_constants = fetch_constants

        @T.macro
        def put_constants(cst, kr, t, buf):
            # ... and their shared stores into buffer ``buf``
            for it in T.unroll(ITERS):
                p = T.meta_var(t + it * threads)
                if PAIRS % threads == 0 or p < PAIRS:
                    T.evaluate(shared_io("st_f32x4", cst.ptr_to([const0 + buf * BN * 2 + p * 4]),
                                         kr[it * 4], kr[it * 4 + 1], kr[it * 4 + 2], kr[it * 4 + 3]))
        self.put_constants = put_constants

        @T.macro
        def load_constants(cst, kr, WS, B, OS, t, row, buf):
            fetch_constants(kr, WS, B, OS, t, row)
            put_constants(cst, kr, t, buf)
        self.load_constants = load_constants

        @T.macro
        def load_scales(xsr, XS, m0, r0, lane):
            # int8: the per-token scales of the thread's 2·mi rows (nothing for other operands)
            if int8:
                for r in T.unroll(2 * mi):
                    xsr[r] = XS[T.min(m0 + r0 + r // 2 * 16 + lane // 4 + r % 2 * 8, M - 1)]
        self.load_scales = load_scales

        @T.macro
        def stage_tile(acc, smem, smo, cst, kc, xsr, yv, OS, r0, c0, lane, out0, buf):
            for j in T.unroll(nj):
                T.evaluate(shared_io("ld_f32x4", cst.ptr_to([const0 + buf * BN * 2 + (c0 + j * 8) * 2 +
                                                             (lane % 4) * 4]), kc.ptr_to([0])))
                for i in T.unroll(mi):
                    for h in T.unroll(2):
                        lr = T.meta_var(r0 + i * 16 + lane // 4 + h * 8)
                        lc = T.meta_var(c0 + j * 8 + (lane % 4) * 2)
                        for e in T.unroll(2):
                            yv[e] = value(acc[(i * nj + j) * 4 + h * 2 + e], xsr[i * 2 + h], kc, e, OS)
                        if q8:
                            T.evaluate(shared_io("st_s8x2", smo.ptr_to([out0 * 2 + lr * OUT_LD + lc]),
                                                 requantize_bits(yv[0], span, offset),
                                                 requantize_bits(yv[1], span, offset)))
                        else:
                            T.evaluate(shared_io("st_h2", smem.ptr_to([out0 + lr * OUT_LD + lc]), yv[0], yv[1]))
        self.stage_tile = stage_tile


class WarpMma:
    """The ``mma.sync`` inner loop shared by the one-tile-per-CTA and the streaming kernels: per stage
    in shared memory, ``ldmatrix`` fragments (or int4 words dequantised in registers) and the warp's
    ``m16n8`` MMAs into its accumulators."""

    def __init__(self, spec: BsrSpec, mv: Movement):
        from tvm.script import tirx as T

        int8 = spec.dtype == "int8"
        EL = spec.elems_per_half
        TM, BN, BK = spec.tm, spec.bn, spec.bk // EL
        self.wtm, self.wtn = WTM, WTN = TM // spec.warps_m, BN // spec.warps_n       # warp tile
        self.mi, self.ni = MI, NI = WTM // 16, WTN // 8        # mma tiles per warp: 16 rows x 8 cols each
        X_ELEMS, swz = mv.x_elems, mv.swz
        MMA = "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32" if int8 else \
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
        self.acc = "uint32" if int8 else "float32"          # PTX's int mma takes .u32 registers (int32 bits)

        @T.macro
        def load_a(smem, af, lane, wr, base, kk):
            for mi in T.unroll(MI):
                T.evaluate(T.ptx["ldmatrix.sync.aligned.m8n8.x4.shared.b16"](
                    af[mi * 4], af[mi * 4 + 1], af[mi * 4 + 2], af[mi * 4 + 3],
                    smem.ptr_to([base + swz(wr * WTM + mi * 16 + lane % 16, kk * 2 + lane // 16)])))

        @T.macro
        def mma_tiles(acc, af, bf, bs, bo):
            # every m16 x n8 tile of the warp: A fragments af, B fragment of column tile ni at bf[ni * bs + bo]
            for mi in T.unroll(MI):
                for ni in T.unroll(NI):
                    T.evaluate(T.ptx[MMA](
                        acc[(mi * NI + ni) * 4], acc[(mi * NI + ni) * 4 + 1],
                        acc[(mi * NI + ni) * 4 + 2], acc[(mi * NI + ni) * 4 + 3],
                        af[mi * 4], af[mi * 4 + 1], af[mi * 4 + 2], af[mi * 4 + 3],
                        bf[ni * bs + bo], bf[ni * bs + bo + 1],
                        acc[(mi * NI + ni) * 4], acc[(mi * NI + ni) * 4 + 1],
                        acc[(mi * NI + ni) * 4 + 2], acc[(mi * NI + ni) * 4 + 3]))

        @T.macro
        def mma_stage(smem, acc, af, bf, lane, wr, wc, base):
            for kk in T.unroll(BK // 16):
                load_a(smem, af, lane, wr, base, kk)
                for nj in T.unroll(NI // 2):
                    T.evaluate(T.ptx["ldmatrix.sync.aligned.m8n8.x4.shared.b16"](
                        bf[nj * 4], bf[nj * 4 + 1], bf[nj * 4 + 2], bf[nj * 4 + 3],
                        smem.ptr_to([base + X_ELEMS + swz(wc * WTN + nj * 16 + (lane // 16) * 8 + lane % 8,
                                                          kk * 2 + (lane // 8) % 2)])))
                mma_tiles(acc, af, bf, 2, 0)

        KW = spec.bk // 32                      # w4a16: words (32 K) per row of a block
        NW = BN * spec.bk // 8                   # w4a16: words per block; scales follow, then zero points
        dequant = dequant_word()

        @T.macro
        def mma_stage_w4(smem, smw, smb, acc, af, bf, wq, sz, lane, wr, wc, base):
            # B fragments from the int4 record: KW words per 8 columns, dequantised in registers
            for ni in T.unroll(NI):
                for v in T.vectorized(KW):
                    wq[ni * KW + v] = smw[(base + X_ELEMS) // 2 + ((wc * (WTN // 8) + ni) * 32 + lane) * KW + v]
            for kw in T.unroll(KW):
                for ni in T.unroll(NI):
                    n = T.meta_var(wc * WTN + ni * 8 + lane // 4)
                    sz[0] = half2_splat(smem[base + X_ELEMS + NW * 2 + kw * BN + n])
                    if spec.zero:
                        sz[3] = T.Cast("uint32", smb[(base + X_ELEMS + NW * 2 + KW * BN) * 2 + kw * BN + n])
                        zt = T.meta_var(zero_terms(sz[3]))
                        sz[1] = zt[0]                                              # half2(1024 + z)
                        sz[2] = zt[1]                                              # half2(-(64 + z))
                        dequant(bf, ni * 4, wq[ni * KW + kw], sz[0], sz[1], sz[2])
                    else:
                        dequant(bf, ni * 4, wq[ni * KW + kw], sz[0], zero_terms()[0], zero_terms()[1])
                for h in T.unroll(2):
                    load_a(smem, af, lane, wr, base, kw * 2 + h)
                    mma_tiles(acc, af, bf, 4, 2 * h)

        self.mma_stage, self.mma_stage_w4 = mma_stage, mma_stage_w4
