"""The warp-specialised Hopper variant of ``bsr_linear`` (``BsrSpec(mma="wgmma", producer=True)``).

The plain wgmma kernel (``wgmma.py``) has every thread load and multiply, with a CTA
barrier per kept block; Nsight Compute finds it latency-bound (tensor pipe about half busy at one CTA per SM).
Here warpgroup 0 is a *producer*: its 128 threads only issue the ``cp.async`` stage loads; the other
warpgroups only wait for stages and issue wgmmas. Two ``mbarrier`` rings replace the barrier: ``full[s]`` (128
producer arrivals, each made by ``cp.async.mbarrier.arrive.noinc`` once that thread's copies of stage ``s``
have landed, so the producer never waits for its own loads) and ``empty[s]`` (one arrival per consumer thread:
the wgmmas reading ``s`` are complete). A consumer runs ``fence.proxy.async`` after its wait: ``cp.async``
writes through the generic proxy, wgmma reads through the async proxy.

With ``ctas > 0`` the grid is persistent: CTA ``c`` runs tiles ``c, c + ctas, …`` (M tile fastest), the
pipeline streams across tile boundaries, and the output tile has its own shared memory beside the stages, so
the next tile's loads proceed while the consumers run the epilogue and store the tile. The consumer threads
alone run the epilogue, between two named barriers (``bar.sync 1``).

``pingpong=True`` (CUTLASS's ping-pong schedule): two consumer warpgroups, *roles*, take alternate tiles, each
a whole tile (``warps_m`` = 2: both 64-row halves, two accumulators), with its own output tile, constant
buffers and named barrier, so one role's epilogue runs while the other's wgmmas use the tensor cores. They
share the one ring; a role skips the other's stages by count. Two ``turn`` mbarriers order the roles: role r
starts tile i only after the other role has passed the full barriers of tile i - 1 — the mainloops alternate,
and no role waits on a full barrier whose previous phase is still pending (an mbarrier parity names a phase
only modulo two). A role with more than 96 accumulator registers per thread (128×128 and 128×192 tiles: 128, 192)
takes registers from the producer: ``setmaxnreg`` 40 for the producer, 232 for the consumers. Same spec, table, packed
weights, arguments, epilogue and output staging as the other kernels.
"""

from __future__ import annotations

from ..ptx import device_call
from .fragment_epilogue import FragmentEpilogue
from .movement import Movement
from .spec import SETMAXNREG, BsrSpec
from .wgmma import WgmmaIssue

_SMEM = "(unsigned)__cvta_generic_to_shared(bar)"
_SYNC_SOURCES = {          # one source per device function: TVM keeps one source per called name
    "mbar_init": ("void* bar, int count",
                  f'asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"({_SMEM}), "r"(count) : "memory");'),
    "mbar_arrive": ("void* bar", f'asm volatile("{{\\n .reg .b64 st;\\n mbarrier.arrive.shared::cta.b64 st, [%0];'
                                 f'\\n}}" :: "r"({_SMEM}) : "memory");'),
    "mbar_wait": ("void* bar, int parity",
                  'asm volatile("{\\n .reg .pred done;\\n WAIT_%=:\\n mbarrier.try_wait.parity.shared::cta.b64 '
                  f'done, [%0], %1;\\n @!done bra WAIT_%=;\\n}}" :: "r"({_SMEM}), "r"(parity) : "memory");'),
    "cp_async_arrive": ("void* bar", 'asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: '
                                     f'"r"({_SMEM}) : "memory");'),
    "setmaxnreg_dec": ("", f'asm volatile("setmaxnreg.dec.sync.aligned.u32 {SETMAXNREG[0]};" ::: "memory");'),
    "setmaxnreg_inc": ("", f'asm volatile("setmaxnreg.inc.sync.aligned.u32 {SETMAXNREG[1]};" ::: "memory");'),
    "named_sync": ("int id, int threads", 'asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(threads) : "memory");'),
    "fence_mbar_init": ("", 'asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");'),
}


def _sync(fn: str, *args):
    """TIR: a call of one of the mbarrier / named-barrier device functions (inline PTX)."""
    from tvm.script import tirx as T
    return T.evaluate(device_call(_SYNC_SOURCES, fn, *args))


def bsr_linear_warp_specialized(spec: BsrSpec):
    """The warp-specialised wgmma kernel as an IRModule with one PrimFunc named ``spec.name``."""
    import tvm
    from tvm.script import tirx as T

    EL = spec.elems_per_half
    M, N, K, TM, BN, S = spec.rows(), spec.n, spec.k // EL, spec.tm, spec.bn, spec.stages
    NT, GN = spec.threads, spec.warps_n
    RO = spec.roles                          # consumer roles, each with its own tiles (alternate tiles in ping-pong)
    RT = (NT - 128) // RO                    # consumer threads per role
    ROWS2 = spec.pingpong and spec.warps_m == 2      # a ping-pong warpgroup issues both 64-row halves
    WTN = BN // GN
    R, MT = spec.row_blocks, -(-M // TM)
    TILES = MT * R
    P = (spec.ctas if spec.m == 0 else min(spec.ctas, TILES)) if spec.ctas else TILES   # any M: CTAs past it idle
    prod, cons = Movement(spec, 128, M), Movement(spec, RT, M)
    STAGE, HEAD = prod.stage, prod.head
    tab = prod.tab
    OUT0 = S * STAGE if spec.ctas else 0     # persistent: the output tiles beside the stages
    OUTL = spec.out_lanes
    BAR0 = spec.barrier_offset               # byte offset of full[S], then empty[S] (8 bytes each)
    epi = FragmentEpilogue(spec, RT, 1, WTN // 8, M)
    issue = WgmmaIssue(spec, prod)
    NACC, ACC, acc_fence = issue.nacc, issue.acc, issue.fence
    mma_stage, mma_stage_rows2 = issue.mma_stage, issue.mma_stage_rows2

    def bar(smb, i):                         # the i-th mbarrier (full: 0 .. S-1, empty: S .. 2S-1, turn: 2S, 2S+1)
        return smb.ptr_to([BAR0 + 8 * i])

    def mine(i, ro):                         # does consumer role ``ro`` run the CTA's i-th tile
        return True if RO == 1 else i % RO == ro

    @T.prim_func
    def kernel(x_h: T.handle, wp_h: T.handle, xs_h: T.handle, ws_h: T.handle, b_h: T.handle, os_h: T.handle,
               tab_h: T.handle, y_h: T.handle):
        T.func_attr({"global_symbol": spec.name, "tirx.noalias": True})
        wlen = T.int32()
        ntab = T.int32()
        X = T.match_buffer(x_h, (M, K), "float16")
        Wp = T.match_buffer(wp_h, (wlen,), "float16")
        XS = T.match_buffer(xs_h, (M,), "float32")
        WS = T.match_buffer(ws_h, (N,), "float32")
        B = T.match_buffer(b_h, (N,), "float16")
        OS = T.match_buffer(os_h, (2,), "float32")
        Tab = T.match_buffer(tab_h, (ntab,), "int32")
        Y = T.match_buffer(y_h, (M, N), spec.y_lanes)
        bx = T.launch_thread("blockIdx.x", P)
        tx = T.launch_thread("threadIdx.x", NT)
        smem = T.decl_buffer((spec.shared_bytes // 2,), "float16", scope="shared.dyn")
        smo = T.decl_buffer((spec.shared_bytes,), "int8", data=smem.data, scope="shared.dyn")
        cst = T.decl_buffer((spec.shared_bytes // 4,), "float32", data=smem.data, scope="shared.dyn")
        acc = T.alloc_buffer((NACC,), ACC, scope="local")
        acc2 = T.alloc_buffer((NACC if ROWS2 else 1,), ACC, scope="local")   # rows 64-127 (ping-pong, tm=128)
        kr = T.alloc_buffer((epi.held,), "float32", scope="local")      # the tile's column constants
        kc = T.alloc_buffer((4,), "float32", scope="local")
        xsr = T.alloc_buffer((2,), "float32", scope="local")
        yv = T.alloc_buffer((2,), "float32", scope="local")
        desc = T.alloc_buffer((1,), "uint64", scope="local")
        cnt = T.alloc_buffer((1,), "int32", scope="local")   # stages issued (producer) / passed (consumer)
        lane = T.meta_var(tx % 32)
        ct = T.meta_var(tx - 128)                       # consumer thread
        ro = T.meta_var(ct // RT)                       # its role
        rt = T.meta_var(ct % RT)                        # thread within the role
        gm = T.meta_var(rt // 128 // GN)                # warpgroup within the role: rows, columns
        gn = T.meta_var(rt // 128 % GN)
        wq = T.meta_var(tx % 128 // 32)
        ntiles = T.meta_var((TILES - bx + P - 1) // P)
        if tx == 0:
            for s in T.serial(S):
                _sync("mbar_init", bar(smo, s), 128)
                _sync("mbar_init", bar(smo, S + s), RT)
            if RO > 1:                                  # ping-pong: one turn barrier per role
                _sync("mbar_init", bar(smo, 2 * S), 1)
                _sync("mbar_init", bar(smo, 2 * S + 1), 1)
            _sync("fence_mbar_init")
        T.tvm_storage_sync("shared")
        cnt[0] = 0
        if tx < 128:                                    # the producer warpgroup
            if spec.moves_registers:                   # registers from the producer to the consumers
                _sync("setmaxnreg_dec")
            for i in T.serial(ntiles):
                tile = T.meta_var(bx + i * P)
                slot = T.meta_var(tile // MT)
                first = T.meta_var(tab(Tab, slot * 3 + 1))
                for t in T.serial(tab(Tab, slot * 3 + 2)):
                    _sync("mbar_wait", bar(smo, S + cnt[0] % S), (cnt[0] // S) % 2 ^ 1)
                    prod.load_stage(smem, X, Wp, tx, (tile % MT) * TM, cnt[0] % S, tab(Tab, HEAD + first + t),
                                    first + t)
                    _sync("cp_async_arrive", bar(smo, cnt[0] % S))  # full[s] once this thread's copies have landed
                    cnt[0] = cnt[0] + 1
            T.evaluate(T.ptx["cp.async.commit_group"]())       # (wait_group counts committed groups only)
            T.evaluate(T.ptx["cp.async.wait_group"](0))
        else:                                           # the consumer warpgroups
            if spec.moves_registers:
                _sync("setmaxnreg_inc")
            T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc[0]), smem.ptr_to([0]), 1, issue.sbo,
                                                  issue.swizzle)
            for i in T.serial(ntiles):
                tile = T.meta_var(bx + i * P)
                slot = T.meta_var(tile // MT)
                count = T.meta_var(tab(Tab, slot * 3 + 2))
                if mine(i, ro):
                    m0 = T.meta_var((tile % MT) * TM)
                    row = T.meta_var(tab(Tab, slot * 3))
                    out0 = T.meta_var(OUT0 + ro * OUTL)
                    buf = T.meta_var(ro * 2 + i // RO % 2)
                    # this tile's column constants (the other buffer may still be read by the previous epilogue)
                    epi.load_constants(cst, kr, WS, B, OS, rt, row, buf)
                    for a in T.unroll(NACC):
                        acc[a] = T.Cast(ACC, 0)
                    acc_fence(acc)
                    if ROWS2:
                        for a in T.unroll(NACC):
                            acc2[a] = T.Cast(ACC, 0)
                        acc_fence(acc2)
                    if RO > 1 and i > 0:                # ping-pong: the other role has passed tile i-1's stages
                        _sync("mbar_wait", bar(smo, 2 * S + ro), (i - 1) // 2 % 2)
                    for t in T.serial(count):
                        _sync("mbar_wait", bar(smo, cnt[0] % S), (cnt[0] // S) % 2)
                        T.evaluate(T.ptx["fence.proxy.async.shared::cta"]())   # cp.async wrote it: generic proxy
                        if ROWS2:
                            mma_stage_rows2(acc, acc2, desc, gn, cnt[0] % S)
                        else:
                            mma_stage(acc, desc, gm, gn, cnt[0] % S)
                        if t > 0:                       # the previous stage's wgmmas are complete
                            _sync("mbar_arrive", bar(smo, S + (cnt[0] - 1) % S))
                        cnt[0] = cnt[0] + 1
                    if RO > 1 and rt == 0:              # this role's turn at the ring is over: the other's begins
                        _sync("mbar_arrive", bar(smo, 2 * S + 1 - ro))
                    T.evaluate(T.ptx["wgmma.wait_group.sync.aligned"](0))
                    acc_fence(acc)
                    if ROWS2:
                        acc_fence(acc2)
                    if count > 0:
                        _sync("mbar_arrive", bar(smo, S + (cnt[0] - 1) % S))
                    _sync("named_sync", 1 + ro, RT)     # the previous tile's store has read the staged tile
                    epi.load_scales(xsr, XS, m0, gm * 64 + wq * 16, lane)
                    epi.stage_tile(acc, smem, smo, cst, kc, xsr, yv, OS, gm * 64 + wq * 16, gn * WTN, lane, out0,
                                   buf)
                    if ROWS2:
                        epi.load_scales(xsr, XS, m0, 64 + wq * 16, lane)
                        epi.stage_tile(acc2, smem, smo, cst, kc, xsr, yv, OS, 64 + wq * 16, 0, lane, out0, buf)
                    _sync("named_sync", 1 + ro, RT)
                    cons.store_tile(smem, smo, Y, rt, m0, row, out0)
                else:                                   # the other role's tile: its stages pass by in the ring
                    cnt[0] = cnt[0] + count

    return tvm.IRModule({spec.name: kernel})
