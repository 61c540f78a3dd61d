"""The ``mma.sync`` inner loop of the one-tile and the streaming ``bsr_linear`` kernels: per stage in shared memory,
``ldmatrix`` fragments (or int4 words dequantised in registers) and the warp's ``m16n8`` MMAs into its accumulators.
"""

from __future__ import annotations

from ..ptx import dequant_word, half2_splat, zero_terms
from .movement import Movement
from .spec import BsrSpec


class WarpMma:
    """The ``mma.sync`` pipeline shared by the one-tile-per-CTA and the streaming kernels: per stage
    in shared memory, ``ldmatrix`` fragments (or int4 words dequantised in registers) and the warp's
    ``m16n8`` MMAs into its accumulators (``mma_stage``, ``mma_stage_w4``); the ``cp.async`` prologue and
    one step of the main loop over a run of kept blocks (``prologue``, ``step``)."""

    def __init__(self, spec: BsrSpec, mv: Movement):
        from tvm.script import tirx as T

        int8 = spec.dtype == "int8"
        EL = spec.elems_per_half
        TM, BN, BK = spec.tm, spec.bn, spec.bk // EL
        self.wtm, self.wtn = WTM, WTN = TM // spec.warps_m, BN // spec.warps_n       # warp tile
        self.mi, self.ni = MI, NI = WTM // 16, WTN // 8        # mma tiles per warp: 16 rows x 8 cols each
        X_ELEMS, swz = mv.x_elems, mv.swz
        op16 = "bf16" if spec.act16 == "bfloat16" else "f16"
        MMA = "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32" if int8 else \
            f"mma.sync.aligned.m16n8k16.row.col.f32.{op16}.{op16}.f32"
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
        dequant = dequant_word(act16=spec.act16)
        ACT = spec.act16

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
                        zt = T.meta_var(zero_terms(sz[3], ACT))
                        sz[1] = zt[0]                                              # half2(1024 + z)
                        sz[2] = zt[1]                                              # half2(-(64 + z))
                        dequant(bf, ni * 4, wq[ni * KW + kw], sz[0], sz[1], sz[2])
                    else:
                        dequant(bf, ni * 4, wq[ni * KW + kw], sz[0], zero_terms(None, ACT)[0],
                                zero_terms(None, ACT)[1])
                for h in T.unroll(2):
                    load_a(smem, af, lane, wr, base, kw * 2 + h)
                    mma_tiles(acc, af, bf, 4, 2 * h)

        GG, WORDS = spec.gemv_group, bool(spec.gemv_group)
        QPC = 128 // GG if GG else 1                   # gemv_group: scale groups per 128-K chunk

        NX, NP = WTM // 8, NI // 2

        @T.macro
        def mma_stage_gemv_words(smem, smw, smb, acc, af, bf, wq, sz, xr, lane, wr, wc, base):
            # Yᵀ = W·Xᵀ as the GEMV computes it: the W4A16 GEMVs' words (lane t: K 32t .. 32t+31 of the chunk, word
            # j = K 8j .. 8j+7 of those) with one scale (and zero point) per 8-row tile, dequantised, are the A
            # fragments of two 8-row tiles (the register allocator places the pairs, no moves); X in the same K
            # order, a 16-byte load of row g of each 8 rows per word, is the B fragments of k16 steps 2j and 2j+1
            g = T.meta_var(lane // 4)
            t = T.meta_var(lane % 4)
            for ni in T.unroll(NI):
                tile = T.meta_var(wc * (WTN // 8) + ni)
                for v in T.vectorized(4):
                    wq[ni * 4 + v] = smw[(base + X_ELEMS) // 2 + (tile * 32 + lane) * 4 + v]
                slot = T.meta_var((tile * QPC + t * 32 // GG) * 8 + g)
                sz[ni * 3] = half2_splat(smem[base + X_ELEMS + NW * 2 + slot])
                if spec.zero:
                    zt = T.meta_var(zero_terms(T.Cast("uint32", smb[(base + X_ELEMS + NW * 2 + KW * BN) * 2 + slot]),
                                               ACT))
                    sz[ni * 3 + 1] = zt[0]
                    sz[ni * 3 + 2] = zt[1]
                else:
                    sz[ni * 3 + 1] = zero_terms(None, ACT)[0]
                    sz[ni * 3 + 2] = zero_terms(None, ACT)[1]
            for j in T.unroll(4):
                for ni in T.unroll(NI):
                    dequant(bf, ni * 4, wq[ni * 4 + j], sz[ni * 3], sz[ni * 3 + 1], sz[ni * 3 + 2])
                for x in T.unroll(NX):
                    for v in T.vectorized(4):
                        xr[x * 4 + v] = smw[(base + swz(wr * WTM + x * 8 + g, t * 4 + j)) // 2 + v]
                    for h in T.unroll(2):
                        for p in T.unroll(NP):
                            a = T.meta_var((x * NP + p) * 4)
                            T.evaluate(T.ptx[MMA](acc[a], acc[a + 1], acc[a + 2], acc[a + 3],
                                                  bf[8 * p + 2 * h], bf[8 * p + 4 + 2 * h], bf[8 * p + 2 * h + 1],
                                                  bf[8 * p + 4 + 2 * h + 1], xr[x * 4 + 2 * h], xr[x * 4 + 2 * h + 1],
                                                  acc[a], acc[a + 1], acc[a + 2], acc[a + 3]))

        self.mma_stage, self.mma_stage_w4, self.mma_stage_gemv_words = mma_stage, mma_stage_w4, mma_stage_gemv_words
        S, STAGE, HEAD, tab, load_stage = spec.stages, mv.stage, mv.head, mv.tab, mv.load_stage
        w4 = spec.dtype == "w4a16"

        @T.macro
        def prologue(smem, X, Wp, Tab, kn, tx, m0, first, count):
            # the run's blocks first .. first+S-2 in flight (stages 0 .. S-2), the K index of the next read early
            for s in T.unroll(S - 1):
                if s < count:
                    load_stage(smem, X, Wp, tx, m0, s, tab(Tab, HEAD + first + s), first + s)
                T.evaluate(T.ptx["cp.async.commit_group"]())
            if S - 1 < count:
                kn[0] = tab(Tab, HEAD + first + S - 1)

        @T.macro
        def step(smem, X, Wp, Tab, kn, tx, m0, first, count, t, regs):
            # block t of the run: wait for its stage, load block t+S-1 into the stage freed, multiply block t
            smw, smb, acc, af, bf, wq, sz, xr, lane, wr, wc = T.meta_var(regs)
            T.evaluate(T.ptx["cp.async.wait_group"](S - 2))
            T.tvm_storage_sync("shared")               # stage t landed; stage t-1 is free
            if t + (S - 1) < count:
                load_stage(smem, X, Wp, tx, m0, (t + (S - 1)) % S, kn[0], first + t + (S - 1))
                if t + S < count:
                    kn[0] = tab(Tab, HEAD + first + t + S)
            T.evaluate(T.ptx["cp.async.commit_group"]())
            if WORDS:
                mma_stage_gemv_words(smem, smw, smb, acc, af, bf, wq, sz, xr, lane, wr, wc, (t % S) * STAGE)
            elif w4:
                mma_stage_w4(smem, smw, smb, acc, af, bf, wq, sz, lane, wr, wc, (t % S) * STAGE)
            else:
                mma_stage(smem, acc, af, bf, lane, wr, wc, (t % S) * STAGE)

        @T.macro
        def step_gated(smem, X, Wp, Tab, kn, tx, m0, first, count, t, regs, acc_up, gate_count):
            # a gated kernel's block t: the gate's blocks (t < gate_count) into acc, the up's into acc_up
            smw, smb, acc, af, bf, wq, sz, xr, lane, wr, wc = T.meta_var(regs)
            T.evaluate(T.ptx["cp.async.wait_group"](S - 2))
            T.tvm_storage_sync("shared")
            if t + (S - 1) < count:
                load_stage(smem, X, Wp, tx, m0, (t + (S - 1)) % S, kn[0], first + t + (S - 1))
                if t + S < count:
                    kn[0] = tab(Tab, HEAD + first + t + S)
            T.evaluate(T.ptx["cp.async.commit_group"]())
            if t < gate_count:
                mma_stage(smem, acc, af, bf, lane, wr, wc, (t % S) * STAGE)
            else:
                mma_stage(smem, acc_up, af, bf, lane, wr, wc, (t % S) * STAGE)

        self.prologue, self.step, self.step_gated = prologue, step, step_gated
