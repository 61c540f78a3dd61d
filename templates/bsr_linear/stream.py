"""The streaming variant of ``bsr_linear`` (``BsrSpec(..., groups=G)``): fewer, longer-lived CTAs.

At high sparsity a one-tile CTA does little more than wait: its first loads, then its output
store, with one or two kept blocks in between. Here CTA ``(m tile, g)`` runs every block row of
group ``g`` in turn (``packing.build_table`` deals the rows to the groups, heaviest first, so
their kept blocks plus output tiles balance). The ``cp.async`` pipeline runs over the group's
kept blocks as one stream, across row boundaries, so the next row's blocks are loading while a
row's epilogue runs; the output tile has its own shared memory beside the stages (coalesced
16-byte stores), so it streams out behind the MMAs. The epilogue is ``FragmentEpilogue``: a
row's column constants (weight scales, bias) are read into registers a row ahead and staged in shared memory
(two buffers), the int8 row scales once per CTA. Rows with no kept block store bias + activation only.

Same packed weights, scales, arguments and epilogue as the one-tile kernel (``mma.py``, ``mma.sync``;
fp16, int8 and W4A16 operands); the table carries (first slot, first block) per group after the slots.
"""

from __future__ import annotations

from .fragment_epilogue import FragmentEpilogue
from .movement import Movement
from .spec import BsrSpec
from .warp_mma import WarpMma


def bsr_linear_stream(spec: BsrSpec):
    """The streaming kernel as an IRModule with one PrimFunc named ``spec.name``."""
    import tvm
    from tvm.script import tirx as T

    w4 = spec.dtype == "w4a16"
    M, N, K, TM, S = spec.rows(), spec.n, spec.k // spec.elems_per_half, spec.tm, spec.stages
    NT, WN, G = spec.threads, spec.warps_n, spec.groups
    mv = Movement(spec, NT, M)
    STAGE = mv.stage
    tab, store_tile = mv.tab, mv.store_tile
    OUT0 = S * STAGE                                 # the output tile follows the stages
    wmma = WarpMma(spec, mv)
    WTM, WTN, MI, NI, ACC = wmma.wtm, wmma.wtn, wmma.mi, wmma.ni, wmma.acc
    KW = spec.bk // 32
    MARKS = 3 * spec.row_blocks                     # the groups' (first slot, first block) marks
    epi = FragmentEpilogue(spec, NT, MI, NI, M)

    @T.prim_func
    def kernel(x_h: T.handle, wp_h: T.handle, xs_h: T.handle, ws_h: T.handle, b_h: T.handle, os_h: T.handle,
               tab_h: T.handle, y_h: T.handle):
        T.func_attr({"global_symbol": spec.name, "tirx.noalias": True})
        wlen = T.int32()
        ntab = T.int32()
        X = T.match_buffer(x_h, (M, K), "float16")
        Wp = T.match_buffer(wp_h, (wlen,), "float16")
        XS = T.match_buffer(xs_h, (M,), "float32")      # int8 only: per-row and per-channel scales
        WS = T.match_buffer(ws_h, (N,), "float32")
        B = T.match_buffer(b_h, (N,), "float16")
        OS = T.match_buffer(os_h, (2,), "float32")       # out="int8" only: the output scale and its reciprocal
        Tab = T.match_buffer(tab_h, (ntab,), "int32")
        Y = T.match_buffer(y_h, (M, N), spec.y_lanes)
        bx = T.launch_thread("blockIdx.x", -(-M // TM))
        g = T.launch_thread("blockIdx.y", G)
        tx = T.launch_thread("threadIdx.x", NT)
        smem = T.decl_buffer((spec.shared_bytes // 2,), "float16", scope="shared.dyn")
        smo = T.decl_buffer((spec.shared_bytes,), "int8", data=smem.data, scope="shared.dyn")   # out="int8" tile
        cst = T.decl_buffer((spec.shared_bytes // 4,), "float32", data=smem.data, scope="shared.dyn")
        acc = T.alloc_buffer((MI * NI * 4,), ACC, scope="local")
        af = T.alloc_buffer((MI * 4,), "uint32", scope="local")
        bf = T.alloc_buffer((NI * (4 if w4 else 2),), "uint32", scope="local")
        kr = T.alloc_buffer((epi.held,), "float32", scope="local")      # the next row's column constants
        kc = T.alloc_buffer((4,), "float32", scope="local")
        xsr = T.alloc_buffer((2 * MI,), "float32", scope="local")       # the tile's row scales (int8)
        yv = T.alloc_buffer((2,), "float32", scope="local")
        step = T.alloc_buffer((1,), "int32", scope="local")
        kn = T.alloc_buffer((1,), "int32", scope="local")
        rc = T.alloc_buffer((6,), "int32", scope="local")               # (row, count) of this slot and the next two
        smw = T.decl_buffer((S * STAGE // 2,), "uint32", data=smem.data, scope="shared.dyn")   # w4a16 views
        smb = T.decl_buffer((S * STAGE * 2,), "uint8", data=smem.data, scope="shared.dyn")
        wq = T.alloc_buffer((NI * KW if w4 else 1,), "uint32", scope="local")
        sz = T.alloc_buffer((4 if w4 else 1,), "uint32", scope="local")
        xr = T.alloc_buffer((1,), "uint32", scope="local")          # (the X loads of a gemv_group tile)
        lane = T.meta_var(tx % 32)
        wr = T.meta_var(tx // 32 // WN)
        wc = T.meta_var(tx // 32 % WN)
        m0 = T.meta_var(bx * TM)
        regs = T.meta_var((smw, smb, acc, af, bf, wq, sz, xr, lane, wr, wc))
        slot0 = tab(Tab, MARKS + 2 * g)
        slots = tab(Tab, MARKS + 2 * g + 2) - slot0
        b0 = tab(Tab, MARKS + 2 * g + 1)
        total = tab(Tab, MARKS + 2 * g + 3) - b0
        wmma.prologue(smem, X, Wp, Tab, kn, tx, m0, b0, total)    # the group's blocks are one run of the pipeline
        epi.load_scales(xsr, XS, m0, wr * WTM, lane)            # once: the CTA keeps its M tile
        for a in T.unroll(2):                          # the first two slots' (row, count), the first's constants
            if a < slots:
                rc[2 + 2 * a] = tab(Tab, (slot0 + a) * 3)
                rc[3 + 2 * a] = tab(Tab, (slot0 + a) * 3 + 2)
        if slots > 0:
            epi.fetch_constants(kr, WS, B, OS, tx, rc[2])
        step[0] = 0
        for j in T.serial(slots):
            rc[0] = rc[2]
            rc[1] = rc[3]
            rc[2] = rc[4]
            rc[3] = rc[5]
            epi.put_constants(cst, kr, tx, j % 2)     # this row's, fetched a row ago; read after the next barrier
            if j + 1 < slots:                          # the next row's constants (its table entry read a row ago)
                epi.fetch_constants(kr, WS, B, OS, tx, rc[2])
            if j + 2 < slots:                          # and the table entry of the row after it
                rc[4] = tab(Tab, (slot0 + j + 2) * 3)
                rc[5] = tab(Tab, (slot0 + j + 2) * 3 + 2)
            for i in T.unroll(MI * NI * 4):
                acc[i] = T.Cast(ACC, 0)
            for _b in T.serial(rc[1]):
                wmma.step(smem, X, Wp, Tab, kn, tx, m0, b0, total, step[0], regs)
                step[0] = step[0] + 1
            T.tvm_storage_sync("shared")               # the previous row's tile has been stored
            epi.stage_tile(acc, smem, smo, cst, kc, xsr, yv, OS, wr * WTM, wc * WTN, lane, OUT0, j % 2)
            T.tvm_storage_sync("shared")
            store_tile(smem, smo, Y, tx, m0, rc[0], OUT0)
        T.evaluate(T.ptx["cp.async.wait_group"](0))

    return tvm.IRModule({spec.name: kernel})
