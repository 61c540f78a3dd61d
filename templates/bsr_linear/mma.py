"""The ``mma.sync`` kernel of ``bsr_linear``, one ``tm × bn`` output tile per CTA (sm_80 and sm_90), in TVMScript.

Inside: ``cp.async`` multi-stage pipeline into XOR-swizzled shared memory (no bank conflicts for ``ldmatrix``),
``ldmatrix.x4`` fragments, ``mma.sync.m16n8k16`` fp32 accumulation (``m16n8k32`` int32 for W8A8; int4 records
dequantised in registers for W4A16), fused bias + activation, the tile staged through shared memory and written in
coalesced 16-byte rows. Rows past ``M`` and K past ``K`` are zero-filled by the copy; columns past ``N`` are not
stored. ``pdl``: see ``spec.py``.
"""

from __future__ import annotations

from ..ptx import grid_dependency
from .fragment_epilogue import FragmentEpilogue
from .movement import Movement
from .spec import BsrSpec
from .warp_mma import WarpMma


def bsr_linear_mma(spec: BsrSpec):
    """The one-tile ``mma.sync`` kernel as an IRModule with one PrimFunc named ``spec.name``."""
    import tvm
    from tvm.script import tirx as T

    w4 = spec.dtype == "w4a16"
    M, N, K, TM, S = spec.rows(), spec.n, spec.k // spec.elems_per_half, spec.tm, spec.stages
    NT, WN, R = spec.threads, spec.warps_n, spec.row_blocks
    mv = Movement(spec, NT, M)
    STAGE, HEAD = mv.stage, mv.head
    tab, load_x, load_w, store_tile = mv.tab, mv.load_x, mv.load_w, mv.store_tile
    wmma = WarpMma(spec, mv)
    WTM, WTN, MI, NI, ACC = wmma.wtm, wmma.wtn, wmma.mi, wmma.ni, wmma.acc
    KW = spec.bk // 32                      # w4a16: words (32 K) per row of a block
    SZ = NI * 3 if spec.gemv_group else 4 if w4 else 1     # w4a16: scale and zero terms in registers
    WORDS = bool(spec.gemv_group)
    XR = MI * 8 if spec.gemv_group else 1                  # gemv_group: X rows of the warp, 16 bytes each

    epi = FragmentEpilogue(spec, NT, MI, NI, M)
    GATE, SI = spec.gate, spec.slot_ints
    PDL, LATE, TAIL = bool(spec.pdl), spec.pdl == "late", spec.pdl == "tail"   # bools: TVMScript ifs

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
        B = T.match_buffer(b_h, (spec.weight_rows,), "float16")
        OS = T.match_buffer(os_h, (2,), "float32")       # out="int8" only: the output scale and its reciprocal
        Tab = T.match_buffer(tab_h, (ntab,), "int32")
        Y = T.match_buffer(y_h, (M, N), spec.y_lanes)
        bx = T.launch_thread("blockIdx.x", -(-M // TM))
        by = T.launch_thread("blockIdx.y", R)
        tx = T.launch_thread("threadIdx.x", NT)
        smem = T.decl_buffer((spec.shared_bytes // 2,), "float16", scope="shared.dyn")
        smo = T.decl_buffer((spec.shared_bytes,), "int8", data=smem.data, scope="shared.dyn")   # out="int8" tile
        cst = T.decl_buffer((spec.shared_bytes // 4,), "float32", data=smem.data, scope="shared.dyn")
        acc = T.alloc_buffer((MI * NI * 4,), ACC, scope="local")
        acc_up = T.alloc_buffer((MI * NI * 4 if GATE else 1,), ACC, scope="local")     # gate: the up's sums
        kr = T.alloc_buffer((epi.held,), "float32", scope="local")      # the tile's column constants
        kc = T.alloc_buffer((4,), "float32", scope="local")
        xsr = T.alloc_buffer((2 * MI,), "float32", scope="local")
        yv = T.alloc_buffer((2,), "float32", scope="local")
        af = T.alloc_buffer((MI * 4,), "uint32", scope="local")
        bf = T.alloc_buffer((NI * (4 if w4 else 2),), "uint32", scope="local")
        kn = T.alloc_buffer((1,), "int32", scope="local")
        smw = T.decl_buffer((S * STAGE // 2,), "uint32", data=smem.data, scope="shared.dyn")   # w4a16 views
        smb = T.decl_buffer((S * STAGE * 2,), "uint8", data=smem.data, scope="shared.dyn")
        wq = T.alloc_buffer((NI * KW if w4 else 1,), "uint32", scope="local")
        sz = T.alloc_buffer((SZ,), "uint32", scope="local")
        xr = T.alloc_buffer((XR,), "uint32", scope="local")          # gemv_group: the X loads
        lane = T.meta_var(tx % 32)
        wr = T.meta_var(tx // 32 // WN)
        wc = T.meta_var(tx // 32 % WN)
        m0 = T.meta_var(bx * TM)
        row = tab(Tab, by * SI)
        first = tab(Tab, by * SI + 1)
        count = tab(Tab, by * SI + 2)
        epi.load_constants(cst, kr, WS, B, OS, tx, row, 0)
        for i in T.unroll(MI * NI * 4):
            acc[i] = T.Cast(ACC, 0)
            if GATE:
                acc_up[i] = T.Cast(ACC, 0)
        if PDL:
            # programmatic dependent launch: the prologue's weight blocks load while the previous kernel in the
            # stream finishes (the first commit group holds them); X (its output) and every write after the wait
            for s in T.unroll(S - 1):
                if s < count:
                    load_w(smem, Wp, tx, s, first + s)
            T.evaluate(grid_dependency("wait"))
            if LATE:
                T.evaluate(grid_dependency("launch_dependents"))
            for s in T.unroll(S - 1):
                if s < count:
                    load_x(smem, X, tx, m0, s, tab(Tab, HEAD + first + s))
                T.evaluate(T.ptx["cp.async.commit_group"]())
            if S - 1 < count:                          # K index of the next block, read one step early
                kn[0] = tab(Tab, HEAD + first + S - 1)
        else:
            wmma.prologue(smem, X, Wp, Tab, kn, tx, m0, first, count)
        regs = T.meta_var((smw, smb, acc, af, bf, wq, sz, xr, lane, wr, wc))
        if GATE:
            gate_count = tab(Tab, by * SI + 3)
            for t in T.serial(count):
                wmma.step_gated(smem, X, Wp, Tab, kn, tx, m0, first, count, t, regs, acc_up, gate_count)
        else:
            for t in T.serial(count):
                wmma.step(smem, X, Wp, Tab, kn, tx, m0, first, count, t, regs)
        T.evaluate(T.ptx["cp.async.wait_group"](0))
        if TAIL:                                       # the next kernel may launch once every CTA got here
            T.evaluate(grid_dependency("launch_dependents"))
        T.tvm_storage_sync("shared")                   # every warp is done with the stages
        if GATE:
            epi.stage_gated(acc, acc_up, smem, cst, kc, yv, wr * WTM, wc * WTN, lane, 0, 0)
        elif WORDS:                                    # Yᵀ = W·Xᵀ fragments (warp_mma.mma_stage_gemv_words)
            epi.stage_transposed(acc, smem, cst, kc, wr * WTM, wc * WTN, lane, 0, 0)
        else:
            epi.load_scales(xsr, XS, m0, wr * WTM, lane)
            epi.stage_tile(acc, smem, smo, cst, kc, xsr, yv, OS, wr * WTM, wc * WTN, lane, 0, 0)
        T.tvm_storage_sync("shared")
        store_tile(smem, smo, Y, tx, m0, row, 0)

    return tvm.IRModule({spec.name: kernel})
