"""The data movement of the ``bsr_linear`` kernels: the table lookup (argument or baked ``__constant__`` data), the
``cp.async`` stage loader into XOR-swizzled shared memory and the coalesced store of the output tile staged in shared
memory (fp16, or int8 codes).
"""

from __future__ import annotations

import hashlib

from .packing import build_table
from .spec import BsrSpec


def _const_table_source(spec: BsrSpec) -> tuple[str, str]:
    values = build_table(spec.pattern_mask(), spec.groups)[0].tolist()
    digest = hashlib.sha256(repr(values).encode()).hexdigest()[:12]
    fn = f"sparta_tab_{digest}"
    src = (f"__constant__ int {fn}_data[{len(values)}] = {{{', '.join(map(str, values))}}};\n"
           f"__device__ __forceinline__ int {fn}(int i) {{ return {fn}_data[i]; }}\n")
    return fn, src


class Movement:
    """What the ``mma.sync`` and ``wgmma`` kernels share: the table lookup, the ``cp.async`` stage
    loader into XOR-swizzled shared memory (for ``bk`` of 16/32/64 lanes this is exactly the
    32/64/128-byte swizzle that wgmma's shared-memory descriptors read) and the coalesced store of the output
    tile staged in shared memory (fp16, or int8 codes)."""

    def __init__(self, spec: BsrSpec, threads: int, M):
        from tvm.script import tirx as T

        EL = spec.elems_per_half             # the data movement counts 16-bit lanes: K and BK in lanes
        N, K, BN, BK, TM = spec.n, spec.k // EL, spec.bn, spec.bk // EL, spec.tm
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

        GG = spec.gemv_group                 # w4a16 over the GEMVs' pack: X read by 16-byte loads (warp_mma.py)

        def swz(row, chunk):                 # shared offset of a 16-byte chunk, XOR-swizzled
            if GG:   # the 16-byte X loads of lanes (g, t) = rows 2r, 2r+1 x chunks 4t + j fill all 8 bank slots
                return row * BK + T.bitwise_xor(T.bitwise_xor(chunk, T.truncmod(T.truncdiv(chunk, 8), 2) * 2),
                                                T.truncmod(row, 2)) * 8
            return row * BK + T.bitwise_xor(chunk, T.truncmod(T.truncdiv(row, RPL), C)) * 8
        self.swz = swz
        if GG:
            self.load_w = self._gemv_words_loader(spec, NT)

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

        if GG:
            load_w = self.load_w

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

    def _gemv_words_loader(self, spec: BsrSpec, threads: int):
        """``load_w`` of a ``gemv_group`` tile: block ``blk`` (dense: block row ``blk // k_blocks``, K chunk
        ``blk % k_blocks``) from the W4A16 GEMVs' pack — per 8-row tile 512 bytes of words, its scales and zero points
        of the chunk — into a stage laid out as a record (words, scales at ``bn · bk / 4`` lanes, zero points after
        ``bk / 32 · bn`` lanes of scales); tiles past N are zero-filled (codes and scales 0: weight 0)."""
        from tvm.script import tirx as T

        NT, BN, KB = threads, spec.bn, spec.k_blocks
        TILES, G8 = -(-spec.n // 8), spec.bn // 8
        QPC = 128 // spec.gemv_group                       # scale groups per 128-K chunk
        NG = KB * QPC
        S_OFF = TILES * KB * 256                           # fp16 lanes: the scales after the words
        Z_OFF = S_OFF + TILES * NG * 8                     # the zero points after the scales
        X_ELEMS, NW2, KWBN = self.x_elems, BN * 32, 4 * BN   # stage: X, words, scales, zero points
        STAGE, ZERO = self.stage, spec.zero
        W_CHUNKS, S_CHUNKS = G8 * 32, G8 * QPC
        W_ITERS, S_ITERS = -(-W_CHUNKS // NT), -(-S_CHUNKS // NT)

        @T.macro
        def load_w(smem, Wp, tx, stage, blk):
            row = T.meta_var(blk // KB)
            kb = T.meta_var(blk % KB)
            for it in T.unroll(W_ITERS):
                c = T.meta_var(tx + it * NT)
                if W_CHUNKS % NT == 0 or c < W_CHUNKS:
                    tile = T.meta_var(row * G8 + c // 32)
                    T.evaluate(T.ptx["cp.async.cg.shared.global"](
                        smem.ptr_to([stage * STAGE + X_ELEMS + c * 8]),
                        Wp.ptr_to([((T.min(tile, TILES - 1) * KB + kb) * 32 + c % 32) * 8]), 16,
                        T.Cast("uint32", T.if_then_else(tile < TILES, 16, 0))))
            for it in T.unroll(S_ITERS):
                c = T.meta_var(tx + it * NT)
                if S_CHUNKS % NT == 0 or c < S_CHUNKS:
                    tile = T.meta_var(row * G8 + c // QPC)
                    group = T.meta_var(T.min(tile, TILES - 1) * NG + kb * QPC + c % QPC)
                    live = T.meta_var(tile < TILES)
                    T.evaluate(T.ptx["cp.async.cg.shared.global"](
                        smem.ptr_to([stage * STAGE + X_ELEMS + NW2 + c * 8]), Wp.ptr_to([S_OFF + group * 8]), 16,
                        T.Cast("uint32", T.if_then_else(live, 16, 0))))
                    if ZERO:
                        T.evaluate(T.ptx["cp.async.ca.shared.global"](
                            smem.ptr_to([stage * STAGE + X_ELEMS + NW2 + KWBN + c * 4]), Wp.ptr_to([Z_OFF + group * 4]),
                            8, T.Cast("uint32", T.if_then_else(live, 8, 0))))
        return load_w

    def tab(self, tab_buf, i):
        """Entry ``i`` of the block table: the baked constant array, or the ``Tab`` argument."""
        from tvm.script import tirx as T
        if self.const_tab:
            return T.cuda.func_call(self.tab_fn, i, source_code=self.tab_src, return_type="int32")
        return tab_buf[i]
