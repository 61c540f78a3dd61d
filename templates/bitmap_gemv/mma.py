"""The tensor-core walk of the bitmap GEMV (``BitmapGemvSpec.mma``): the same format and loads as the FMA walk, but
each lane stores its kept values into its warp's dense 16 × ``tile_cols`` tile in shared memory (zeroed first) and
the warp multiplies the tile by X on ``mma.sync.m16n8k16`` (fp32 accumulation; one MMA per 16 columns for up to 8
rows of X, two for up to 16). A kept value costs one shared store whatever M is, instead of one FMA and one X read
per row. X is staged unconverted (16-bit, ``x_stride`` = the range's columns + 8) so the MMA's B fragments are 32-bit
shared loads; the tile's rows are ``tile_cols + 8`` halves apart, so both fragment loads are free of bank conflicts.
The per-warp tile is reached through raw pointers (``__syncwarp`` orders it; a CTA barrier could not sit in the
warps' own tile loops).
"""

from __future__ import annotations

from .spec import BitmapGemvSpec


def _device(name: str, ret: str, params: str, body: str, *args):
    from tvm.script import tirx as T
    ctype = {"void": "void", "uint32": "unsigned"}[ret]
    src = f"__device__ __forceinline__ {ctype} sparta_bm_{name}({params}) {{ {body} }}\n"
    return T.cuda.func_call(f"sparta_bm_{name}", *args, source_code=src, return_type=ret)


def mma_parts(spec: BitmapGemvSpec, walk_next) -> dict:
    """The MMA variant's macros: ``stage_x16``, ``zero_tile``, ``walk_batch_mma``, ``mma_tile``, ``acc_to_red``.
    ``walk_next(wd, st, cur)`` is the kernel's macro advancing to the next set bit (its clz in ``st[6]``)."""
    from tvm.script import tirx as T

    K, C, KT, IF = spec.k, spec.tile_cols, spec.range_tiles, spec.inflight
    CS, MR, NT = spec.stream_cols, spec.rows, 32 * spec.warps
    XH, WT, MRP = spec.x_stride, spec.tile_cols + 8, spec.mma_rows
    XOFF = MRP * XH                           # halves: where the warps' tiles start in the dynamic buffer
    MH = MRP // 8                             # MMAs per 16 columns
    VEC = K % 8 == 0
    STAGE = KT * C // (8 if VEC else 1)
    ZERO = C // 16                            # 16-byte zero stores per lane per tile
    op16 = "bf16" if spec.dtype == "bfloat16" else "f16"
    MMA = f"mma.sync.aligned.m16n8k16.row.col.f32.{op16}.{op16}.f32"

    def sts16(ptr, v):
        return _device("sts16", "void", "void* p, unsigned short v", "*(unsigned short*)p = v;", ptr, v)

    def lds32(ptr):
        return _device("lds32", "uint32", "const void* p", "return *(const unsigned*)p;", ptr)

    def zero16(ptr):
        return _device("zero16", "void", "void* p", "*(uint4*)p = make_uint4(0u, 0u, 0u, 0u);", ptr)

    def syncwarp():
        return _device("syncwarp", "void", "", "__syncwarp();")

    @T.macro
    def stage_x16(X, sm, M, tx, ks):
        # X[m, the range's columns] -> sm[m * XH + column] as they are (16-bit), zero past K
        for m in T.serial(M):
            for it in T.serial((STAGE + NT - 1) // NT):
                i = T.meta_var(tx + it * NT)
                if i < STAGE:
                    if VEC:
                        if ks * KT * C + i * 8 < K:
                            for v in T.vectorized(8):
                                sm[m * XH + i * 8 + v] = X[m, ks * KT * C + i * 8 + v]
                        else:
                            for v in T.vectorized(8):
                                sm[m * XH + i * 8 + v] = T.float16(0)
                    else:
                        sm[m * XH + i] = T.if_then_else(ks * KT * C + i < K, X[m, T.min(ks * KT * C + i, K - 1)],
                                                        T.float16(0))

    @T.macro
    def zero_tile(sm, warp, lane):
        # the warp's tile to zeros (its previous MMAs done first), then every lane sees them before it stores
        T.evaluate(syncwarp())
        for i in T.unroll(ZERO):
            p = T.meta_var(lane + i * 32)     # 16-byte piece of the tile's C columns: row p // (C / 8)
            T.evaluate(zero16(sm.ptr_to([XOFF + warp * 16 * WT + p // (C // 8) * WT + p % (C // 8) * 8])))
        T.evaluate(syncwarp())

    @T.macro
    def walk_batch_mma(sm, wd, wv, st, cur, t, base):
        # each loaded value into the warp's tile at its column (``base``: the lane's row and stream)
        for o in T.unroll(IF):
            for e in T.unroll(8):
                if (t * IF + o) * 8 + e < st[0]:
                    walk_next(wd, st, cur)
                    T.evaluate(sts16(sm.ptr_to([base + st[4] * 32 + 31 - st[6]]),
                                     T.reinterpret("uint16", wv[o * 8 + e])))
                    cur[0] = cur[0] ^ (T.uint32(0x80000000) >> T.Cast("uint32", st[6]))

    @T.macro
    def mma_tile(sm, acc, af, bf, warp, lane, kl):
        # acc (D = W tile · X^T: rows n, columns m) += the warp's tile times X's columns kl * C .. + C
        T.evaluate(syncwarp())
        for kk in T.unroll(C // 16):
            wb = T.meta_var(XOFF + warp * 16 * WT + kk * 16 + lane % 4 * 2)
            af[0] = lds32(sm.ptr_to([wb + lane // 4 * WT]))
            af[1] = lds32(sm.ptr_to([wb + (lane // 4 + 8) * WT]))
            af[2] = lds32(sm.ptr_to([wb + lane // 4 * WT + 8]))
            af[3] = lds32(sm.ptr_to([wb + (lane // 4 + 8) * WT + 8]))
            for mh in T.unroll(MH):
                xb = T.meta_var((mh * 8 + lane // 4) * XH + kl * C + kk * 16 + lane % 4 * 2)
                bf[0] = lds32(sm.ptr_to([xb]))
                bf[1] = lds32(sm.ptr_to([xb + 8]))
                T.evaluate(T.ptx[MMA](acc[mh * 4], acc[mh * 4 + 1], acc[mh * 4 + 2], acc[mh * 4 + 3],
                                      af[0], af[1], af[2], af[3], bf[0], bf[1],
                                      acc[mh * 4], acc[mh * 4 + 1], acc[mh * 4 + 2], acc[mh * 4 + 3]))

    @T.macro
    def acc_to_red(red, acc, warp, lane):
        # D element r of MMA mh: row lane // 4 (+ 8 for r >= 2), column mh * 8 + 2 (lane % 4) + r % 2
        for mh in T.unroll(MH):
            for r in T.unroll(4):
                if mh * 8 + lane % 4 * 2 + r % 2 < MR:
                    red[(warp * 16 + lane // 4 + r // 2 * 8) * MR + mh * 8 + lane % 4 * 2 + r % 2] = acc[mh * 4 + r]

    return {"stage_x16": stage_x16, "zero_tile": zero_tile, "walk_batch_mma": walk_batch_mma, "mma_tile": mma_tile,
            "acc_to_red": acc_to_red, "XOFF": XOFF, "WT": WT, "MH": MH, "CS": CS}


__all__ = ["mma_parts"]
