"""W4A16 small-batch linear ``Y = X · dequant(W)ᵀ (+ b)`` for CUDA (Hopper), in TVMScript.

``X`` is ``(M, K)`` fp16 with ``M`` = 1..16 (decode / small batch), ``W`` is ``(N, K)`` int4 with one
fp16 scale per ``group`` (32/64/128) consecutive K of a row, symmetric (zero point 8) or asymmetric
(a zero point per group). ``Y`` is ``(M, N)`` fp16. Memory-bound: the kernel streams the weights once.

Layout (``pack_weight``): N in tiles of 8 rows, K in chunks of 128. ``Wq[tile, chunk, lane, 4]`` int32:
lane ``l = 4g + t`` holds row ``8·tile + g``, K ``128·chunk + 32t .. +32`` as four 32-bit words of 8
nibbles, interleaved (element ``e`` of a word at nibble ``[0, 4, 1, 5, 2, 6, 3, 7][e]``) so one
``lop3.b32`` ORs two nibbles into the mantissas of fp16 1024 (0x64006400): a half2 ``1024 + q``
(or ``1024 + 16q`` for the high nibbles). One ``sub.f16x2`` (``fma.rn.f16x2`` with 1/16 for the high
nibbles) subtracts ``1024 + zero`` exactly and one ``mul.f16x2`` applies the scale. A warp reads
512 contiguous bytes per tile and chunk (16-byte ``ld.global.nc.L1::no_allocate``). Scales
``S[tile, group, 8]`` fp16, zero points ``Z[tile, group, 8]`` uint8.

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
resets its counter, so ``C`` (zeroed once, :func:`split_buffers`) is zero again after every call and CUDA-graph
replays need nothing else. ``pdl`` ("early" / "late") builds the kernel for programmatic dependent launch (sm_90;
the runtime launches it with the attribute): its first weights load before ``griddepcontrol.wait``, X and every
write after it, so the tail of the previous kernel in the stream overlaps this one's start. "early" lets the next
kernel launch as soon as every CTA of this one has started (fastest in a chain of one-wave grids, but grids pile up
waiting where a grid spans several waves); "late" only once this one has passed its wait. The overlap needs a
previous kernel that triggers (these do); after one that does not, the launch is an ordinary one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

ORDER = (0, 4, 1, 5, 2, 6, 3, 7)   # nibble position of element e of a word (AWQ's interleave)
KCHUNK = 128                        # K per chunk: 4 lanes x 32 K of one row


@dataclass(frozen=True)
class W4A16Spec:
    """Shape, quantisation and tiling of one kernel."""
    m: int
    n: int
    k: int
    group: int = 128
    sym: bool = True                 # zero point 8; else a uint8 zero point per group
    bias: bool = False
    acc: str = "float32"             # mma accumulator: "float32" or "float16"
    ntile: int = 2                   # 8-row tiles of W per CTA (each warp does all of them)
    warps: int = 4                   # warps per CTA, splitting K
    unroll: int = 2                  # K chunks in flight per warp
    fold: bool = False               # scale folded into the fp32 sum per chunk (group 128 only)
    ksplit: int = 1                  # CTAs splitting K per row block (the last to finish sums their partials)
    min_ctas: int = 0                # > 0: __launch_bounds__(threads, min_ctas), registers capped to fit them per SM
    pdl: str = ""                    # programmatic dependent launch (sm_90), "early" or "late": see the module doc
    name: str = "w4a16_gemv"

    def __post_init__(self):
        bad = []
        if not 1 <= self.m <= 16:
            bad.append(f"M={self.m} must be 1..16 (small batch)")
        if self.n <= 0 or self.k <= 0:
            bad.append("N and K must be positive")
        if self.group not in (32, 64, 128):
            bad.append(f"group {self.group} must be 32, 64 or 128")
        elif self.k % self.group:
            bad.append(f"K={self.k} must be a multiple of the group {self.group}")
        if self.acc not in ("float32", "float16"):
            bad.append(f"acc {self.acc!r} must be 'float32' or 'float16'")
        if self.fold and (self.group != 128 or self.acc != "float32"):
            bad.append("fold needs group 128 (one scale per lane and chunk) and fp32 accumulation")
        if self.ntile < 1 or self.warps not in (1, 2, 4, 8, 16) or self.unroll < 1:
            bad.append("ntile >= 1, warps in 1..16 (power of two), unroll >= 1")
        if self.warps * self.m * self.ntile * 8 * 4 > 48 * 1024:
            bad.append(f"the reduction across warps needs warps*M*ntile*32 = {self.warps * self.m * self.ntile * 32} "
                       "bytes of shared memory (48 KiB at most): fewer warps or tiles")
        if self.min_ctas < 0 or self.min_ctas * self.warps > 64:
            bad.append(f"min_ctas={self.min_ctas}: 0 (no bound) or CTAs of {self.warps} warps that fit 64 per SM")
        if self.pdl not in ("", "early", "late"):
            bad.append(f"pdl {self.pdl!r} must be '' (off), 'early' or 'late'")
        if not 1 <= self.ksplit <= -(-self.k // KCHUNK):
            bad.append(f"ksplit {self.ksplit} must be 1..{-(-self.k // KCHUNK)} (the K chunks of 128)")
        if bad:
            raise ValueError(f"spec {self.name}: " + "; ".join(bad))

    @property
    def tiles(self) -> int:
        return -(-self.n // 8)

    @property
    def chunks(self) -> int:
        return -(-self.k // KCHUNK)

    @property
    def grid(self) -> int:
        """CTAs along N (each owns ``ntile`` 8-row tiles); ``ksplit`` of them along K."""
        return -(-self.tiles // self.ntile)

    @property
    def groups(self) -> int:
        """Scale groups per row, K padded to whole chunks."""
        return self.chunks * KCHUNK // self.group

    def key(self) -> dict:
        d = asdict(self)
        if not self.min_ctas:                        # the key of the kernels built before the bound existed
            del d["min_ctas"]
        if not self.pdl:
            del d["pdl"]
        return d


def argument_names(spec: W4A16Spec) -> list[str]:
    return ["X", "Wq", "S", *([] if spec.sym else ["Z"]), *(["B"] if spec.bias else []),
            *(["P", "C"] if spec.ksplit > 1 else []), "Y"]


def split_buffers(spec: W4A16Spec, device) -> dict[str, torch.Tensor]:
    """The workspace of a ``ksplit > 1`` kernel: fp32 partials ``P`` and the zeroed arrival counters ``C``
    (the kernel leaves them zero again); empty for ``ksplit == 1``."""
    if spec.ksplit == 1:
        return {}
    return {"P": torch.empty(spec.ksplit, spec.m, spec.grid * spec.ntile * 8, dtype=torch.float32, device=device),
            "C": torch.zeros(spec.grid, dtype=torch.int32, device=device)}


def quantize(w: torch.Tensor, group: int, sym: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest per-group scales (fp16, ``(N, K/group)``) and zero points (uint8, or None if sym)."""
    g = w.float().reshape(w.shape[0], -1, group)
    if sym:
        scale = (g.abs().amax(-1) / 7.5).clamp_min(1e-6)          # codes 0..15 around 8
        return scale.half(), None
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-6).half()
    zero = torch.round(-lo / scale.float()).clamp(0, 15).to(torch.uint8)
    return scale, zero


def codes_of(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int) -> torch.Tensor:
    """int4 codes (uint8 0..15, ``(N, K)``) of ``w`` for the given scales and zero points."""
    z = 8.0 if zero is None else zero.float().repeat_interleave(group, 1)
    q = torch.round(w.float() / scale.float().repeat_interleave(group, 1)) + z
    return q.clamp(0, 15).to(torch.uint8)


def pack_codes(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, spec: W4A16Spec):
    """``(Wq, S, Z)`` in the kernel's layout from codes ``q`` (N, K) uint8; ``Z`` is None if sym."""
    n, k, g = spec.n, spec.k, spec.group
    if tuple(q.shape) != (n, k) or tuple(scale.shape) != (n, k // g):
        raise ValueError(f"codes {tuple(q.shape)} / scales {tuple(scale.shape)} do not match {n}x{k}, group {g}")
    np_, kp = spec.tiles * 8, spec.chunks * KCHUNK
    qp = torch.zeros(np_, kp, dtype=torch.int64, device=q.device)
    qp[:n, :k] = q.to(torch.int64)
    qp = qp.reshape(spec.tiles, 8, spec.chunks, 4, 4, 8).permute(0, 2, 1, 3, 4, 5)   # tile, chunk, g, t, word, e
    words = torch.zeros(qp.shape[:-1], dtype=torch.int64, device=q.device)
    for e, pos in enumerate(ORDER):
        words |= qp[..., e] << (4 * pos)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    wq = words.reshape(spec.tiles, spec.chunks, 32, 4).contiguous()

    def per_group(t, dtype):
        out = torch.zeros(np_, spec.groups, dtype=dtype, device=q.device)
        out[:n, : k // g] = t.to(dtype)
        return out.reshape(spec.tiles, 8, spec.groups).permute(0, 2, 1).contiguous()

    return wq, per_group(scale, torch.float16), None if zero is None else per_group(zero, torch.uint8)


def pack_weight(w_fp: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, spec: W4A16Spec):
    """Quantise ``w_fp`` (N, K) with ``scale``/``zero`` (None: symmetric) and pack: ``(Wq, S, Z)``."""
    return pack_codes(codes_of(w_fp, scale, zero, spec.group), scale, zero, spec)


def unpack(wq: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None, spec: W4A16Spec):
    """Inverse of :func:`pack_codes`: codes (N, K) uint8, scales (N, K/group) fp16, zeros (uint8 or None)."""
    words = wq.to(torch.int64) & 0xFFFFFFFF
    q = torch.stack([(words >> (4 * pos)) & 0xF for pos in ORDER], -1)         # tile, chunk, lane, word, e
    q = q.reshape(spec.tiles, spec.chunks, 8, 4, 4, 8).permute(0, 2, 1, 3, 4, 5)
    q = q.reshape(spec.tiles * 8, spec.chunks * KCHUNK)[: spec.n, : spec.k].to(torch.uint8)

    def per_group(t):
        return t.permute(0, 2, 1).reshape(spec.tiles * 8, spec.groups)[: spec.n, : spec.k // spec.group]

    return q, per_group(s), None if z is None else per_group(z)


def dequantize(wq, s, z, spec: W4A16Spec) -> torch.Tensor:
    """The (N, K) fp32 weight the kernel multiplies by: ``(q - zero) · scale``."""
    q, scale, zero = unpack(wq, s, z, spec)
    zf = 8.0 if zero is None else zero.float().repeat_interleave(spec.group, 1)
    return (q.float() - zf) * scale.float().repeat_interleave(spec.group, 1)


def reference(x: torch.Tensor, wq, s, z, bias, spec: W4A16Spec) -> torch.Tensor:
    """What the kernel computes, dequantised and multiplied in fp32 (fp32 result)."""
    y = x.float() @ dequantize(wq, s, z, spec).t()
    return y if bias is None else y + bias.float()


def half2_splat(h):
    """TIR: a uint32 holding the bits of fp16 ``h`` in both halves (the half2 ``(h, h)``)."""
    from tvm.script import tirx as T
    u = T.Cast("uint32", T.reinterpret("uint16", h))
    return u | (u << T.uint32(16))


def zero_terms(z=None):
    """TIR ``(zl, zh)`` of :func:`dequant_word` for a uint32 zero point ``z`` (0..15): half2(1024 + z) and
    half2(-(64 + z)); ``None``: the symmetric zero point 8, as constants."""
    from tvm.script import tirx as T
    if z is None:
        return T.uint32(0x64086408), T.uint32(0xD480D480)
    lo, hi = z | T.uint32(0x6400), (z << T.uint32(4)) | T.uint32(0xD400)
    return lo | (lo << T.uint32(16)), hi | (hi << T.uint32(16))


def dequant_word(scaled: bool = True):
    """TIR macro ``dequant(b, o, w, s2, zl, zh)``: the 8 nibbles of uint32 ``w`` (in ``ORDER``) to four
    half2 ``b[o .. o+3]`` = elements (0, 1), (2, 3), (4, 5), (6, 7), each ``(q - zero) · scale``: one
    ``lop3`` per pair into the mantissa of fp16 1024, one exact ``sub``/``fma`` removing 1024 + zero
    (``zl`` = half2(1024 + z), ``zh`` = half2(-(64 + z)) for the high nibbles, taken ×1/16), one ``mul``
    by ``s2`` = half2(scale) (none if not ``scaled``: ``q - zero``, ``s2`` unused). Shared by the W4A16
    GEMV and the ``bsr_linear`` W4A16 kernel."""
    from tvm.script import tirx as T

    MAGIC, LO, HI = T.uint32(0x64006400), T.uint32(0x000F000F), T.uint32(0x00F000F0)
    SIXTEENTH = T.uint32(0x2C002C00)           # half2(1/16, 1/16)

    @T.macro
    def dequant(b, o, w, s2, zl, zh):
        T.evaluate(T.ptx["lop3.b32"](b[o], w, LO, MAGIC, 0xEA))
        T.evaluate(T.ptx["lop3.b32"](b[o + 1], w, HI, MAGIC, 0xEA))
        T.evaluate(T.ptx["lop3.b32"](b[o + 2], w >> T.uint32(8), LO, MAGIC, 0xEA))
        T.evaluate(T.ptx["lop3.b32"](b[o + 3], w >> T.uint32(8), HI, MAGIC, 0xEA))
        for h in T.unroll(2):
            T.evaluate(T.ptx["sub.f16x2"](b[o + 2 * h], b[o + 2 * h], zl))            # 1024+q - (1024+z)
            T.evaluate(T.ptx["fma.rn.f16x2"](b[o + 2 * h + 1], b[o + 2 * h + 1], SIXTEENTH, zh))  # (1024+16q)/16 - (64+z)
            if scaled:
                T.evaluate(T.ptx["mul.f16x2"](b[o + 2 * h], b[o + 2 * h], s2))
                T.evaluate(T.ptx["mul.f16x2"](b[o + 2 * h + 1], b[o + 2 * h + 1], s2))
    return dequant


def grid_dependency(op: str):
    """TIR: ``griddepcontrol.<op>`` (``wait``: until the previous kernel in the stream has completed and its writes
    are visible; ``launch_dependents``: let the next one launch), for a kernel launched with programmatic dependent
    launch (sm_90; a no-op before, and on a launch without the attribute)."""
    from tvm.script import tirx as T
    clobber = ' ::: "memory"' if op == "wait" else ""
    src = (f"__device__ __forceinline__ void sparta_grid_{op}() {{\n#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900\n"
           f'  asm volatile("griddepcontrol.{op};"{clobber});\n#endif\n}}\n')
    return T.cuda.func_call(f"sparta_grid_{op}", source_code=src, return_type="void")


def w4a16_gemv(spec: W4A16Spec):
    """The kernel as an IRModule with one PrimFunc named ``spec.name``."""
    import tvm
    from tvm.script import tirx as T

    M, N, K, G = spec.m, spec.n, spec.k, spec.group
    TILES, KC, NG = spec.tiles, spec.chunks, spec.groups
    NT, W, U = spec.ntile, spec.warps, spec.unroll
    NP = -(-NT // 2)                          # pairs of 8-row tiles: the 16 rows of one MMA's A
    RH = 1 if M <= 8 else 2                   # 8-column halves of X rows (the MMA's B, N = 8)
    KS = spec.ksplit
    CPS = -(-KC // KS)                        # K chunks per split
    ITERS = -(-CPS // (W * U))
    EVEN = CPS % (W * U) == 0                 # every (iteration, chunk) in range: no guard
    GRID = spec.grid
    f16acc = spec.acc == "float16"
    NACC = RH * NP * (2 if f16acc else 4)
    MMA = ("mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16" if f16acc
           else "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32")
    ACC = "uint32" if f16acc else "float32"
    OUTS = M * NT * 8
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
        return zero_terms()[0] if sym else zl[i]

    def zero_hi(zh, i):                        # half2(-(64 + zero))
        return zero_terms()[1] if sym else zh[i]

    dequant = dequant_word(scaled=not fold)

    @T.macro
    def sum_warps(tot, red, o):                # output o's partial sums of the CTA's W warps, in warp order
        tot[0] = red[o]
        for w in T.unroll(1, W):
            tot[0] = tot[0] + red[w * OUTS + o]

    @T.macro
    def store(Y, B, m, n, v):
        if use_bias:
            Y[m, n] = T.Cast("float16", v + T.Cast("float32", B[n]))
        else:
            Y[m, n] = T.Cast("float16", v)

    @T.macro
    def store_outputs(Y, B, P, red, tot, tx, bx):
        # each of the CTA's outputs: the sum of its warps' partials (KS == 1) or of the KS splits' partials in P
        for it in T.unroll(OUT_ITERS):
            o = T.meta_var(tx + it * W * 32)
            if OUTS % (W * 32) == 0 or o < OUTS:
                m = T.meta_var(o // (NT * 8))
                n = T.meta_var(bx * NT * 8 + o % (NT * 8))
                if N % (NT * 8) == 0 or n < N:
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
                                sf[u * NT + tile] = T.Cast("float32", S[tl, kb // G, g])
                            else:
                                sc[u * NT + tile] = half2_splat(S[tl, kb // G, g])
                            if not sym:
                                zt = T.meta_var(zero_terms(T.Cast("uint32", Z[tl, kb // G, g])))
                                zl[u * NT + tile] = zt[0]
                                zh[u * NT + tile] = zt[1]
                if part != "w":
                    for rh in T.unroll(RH):
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
        P = T.match_buffer(p_h, (KS, M, GRID * NT * 8), "float32")
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
                    if (M % 8 == 0 or m < M) and (NT % 2 == 0 or 2 * p + r // 2 < NT):
                        red[(warp * M + m) * NT * 8 + nl] = acc_value(acc, rh * NP + p, r)
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
