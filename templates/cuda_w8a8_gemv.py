"""W8A8 GEMV for decode, llama.cpp's ``mul_mat_vec_q`` on sparta's W8A8 scheme, in TVMScript.

``Y = act((XQ · WQᵀ) · xs · ws + b)`` for ``M`` = 1..16 activation rows. ``XQ`` is ``(M, K)`` int8 per-token codes
with fp32 scales ``XS`` — what sparta's per-row quantiser (``templates/cuda_quant.py``) or a LayerNorm kernel
(``templates/cuda_layernorm.py``) writes for the W8A8 linears reading it — and ``WQ`` is ``(N, K)`` int8 per-channel
codes with fp32 scales ``WS``. ``Y`` is ``(M, N)`` fp16 or, ``out="int8"``, int8 codes of one static scale (the tile
kernels' requantising epilogue: what a W8A8 linear behind this one reads, with no quantiser pass between).

The tile kernels (``bsr_linear``, ``dtype="int8"``) compute 128 rows per CTA: with one row, a dense 4096-wide
linear is a grid of 16-32 CTAs streaming all the weights, a fraction of the GPU. Two kernels stream them over the
whole GPU instead. ``mma=True`` (what ``compile`` builds where K is a multiple of 32; ``_w8a8_gemv_mma``) computes
``Yᵀ = W·Xᵀ`` on ``mma.sync.m16n8k32.s8`` with the weights stored in fragment order (``pack_mma``), a CTA per 16
rows, its warps splitting K; ``sparse=True`` runs only the kept 16×32 chunks (``pack_sparse``). The dp4a kernel
(the default) gives one warp one output row ``n``: each lane streams 16-byte chunks of ``WQ[n]`` (chunks ``lane``, ``lane + 32``, …; a warp reads 512
contiguous bytes per load, ``ld.global.nc.L1::no_allocate``), ``group`` chunks per batch, the next batch's loads
issued before the current one is multiplied, so a warp keeps its weights streaming. Each chunk meets the ``M``
rows' chunks of ``XQ`` (L1 hits: every warp of a CTA reads the same X) in 4 ``dp4a.s32.s32`` per row into int32
sums — exact, the order does not matter: K·127² < 2³¹ for K up to 133,000. A butterfly reduction leaves every
lane every row's sum; lane ``m`` applies the tile kernels' epilogue to row ``m``: ``(acc · xs) · ws + b`` in fp32,
the activation, fp16 (``cuda_bsr_ref.reference_int8`` is the reference of both).

``pdl`` ("early" / "late") builds it for programmatic dependent launch (sm_90), as the W4A16 GEMV
(``templates/cuda_w4a16.py``): the first batch of weights and the column constants load before
``griddepcontrol.wait``, ``XQ``, ``XS`` and the writes after it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .cuda_bsr import ACTIVATIONS, OUTPUTS
from .cuda_bsr_ref import reference_int8

CHUNK = 16                 # bytes of a row per lane and load
MMA_K = 32                 # K of one mma.sync.m16n8k32
MAX_K = 133_000            # int32 sums of int8 products stay exact below this K


@dataclass(frozen=True)
class W8A8GemvSpec:
    """Shape, epilogue and tiling of one kernel."""
    m: int
    n: int
    k: int
    warps: int = 4             # output rows per CTA, one per warp
    group: int = 8             # 16-byte chunks per lane in one batch of loads
    bias: bool = False
    act: str = "none"
    pdl: str = ""              # programmatic dependent launch (sm_90): "", "early" or "late"
    mma: bool = False          # tensor cores (weights in fragment order, ``pack_mma``) instead of dp4a
    out: str = "float16"       # Y: fp16, or "int8" codes of one static scale (argument OS, as ``bsr_linear``'s)
    sparse: bool = False       # mma: only the kept 16x32 chunks, listed in a table (``pack_sparse``)
    name: str = "w8a8_gemv"

    def __post_init__(self):
        bad = []
        if not 1 <= self.m <= 16:
            bad.append(f"M={self.m} must be 1..16 (a GEMV for decode; more rows want the tile kernels)")
        if self.n <= 0 or self.k <= 0 or self.k % CHUNK or self.k > MAX_K:
            bad.append(f"N and K must be positive, K={self.k} a multiple of {CHUNK} and below {MAX_K}")
        if self.warps not in (1, 2, 4, 8, 16) or not 1 <= self.group <= 16:
            bad.append(f"warps {self.warps} must be 1, 2, 4, 8 or 16 and group {self.group} 1..16")
        if self.act not in ACTIVATIONS:
            bad.append(f"activation {self.act!r} not in {ACTIVATIONS}")
        if self.pdl not in ("", "early", "late"):
            bad.append(f"pdl {self.pdl!r} must be '', 'early' or 'late'")
        if self.out not in OUTPUTS:
            bad.append(f"out {self.out!r} must be one of {OUTPUTS}")
        if self.mma and self.k % MMA_K:
            bad.append(f"mma: K={self.k} must be a multiple of {MMA_K}")
        if self.sparse and not self.mma:
            bad.append("sparse: for the tensor-core kernel (mma=True)")
        if bad:
            raise ValueError(f"spec {self.name}: " + "; ".join(bad))

    @property
    def chunks(self) -> int:
        """16-byte chunks per lane (the last ones of a row may fall past K)."""
        return -(-self.k // (CHUNK * 32))

    @property
    def tiles(self) -> int:
        """mma: 16-row tiles of the weight (the last one zero-padded)."""
        return -(-self.n // 16)

    def weight_shape(self, kept: int = 0) -> tuple:
        """Shape of the int8 weight argument as the kernel takes it (``pack_mma``'s for the mma kernel; the sparse one
        holds the ``kept`` chunks, at least one)."""
        if self.sparse:
            return (max(kept, 1), 32, 16)
        return (self.tiles, self.k // MMA_K, 32, 16) if self.mma else (self.n, self.k)

    def key(self) -> dict:
        d = asdict(self)
        for f, default in (("mma", False), ("out", "float16"), ("sparse", False)):
            if d[f] == default:            # the keys of kernels built before the field existed
                del d[f]
        return d


def argument_names(spec: W8A8GemvSpec) -> list[str]:
    return ["XQ", "XS", "WQ", "WS", *(["B"] if spec.bias else []), *(["OS"] if spec.out == "int8" else []),
            *(["Tab"] if spec.sparse else []), "Y"]


def reference(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
              bias: torch.Tensor | None = None, act: str = "none", out_scale: float | None = None) -> torch.Tensor:
    """What the kernel computes: the W8A8 tile kernels' reference on every block kept (``out_scale``: int8 codes)."""
    return reference_int8(xq, xs, wq, ws, None, bias, act, 1, 1, out_scale)


def _output(spec: W8A8GemvSpec, v, bias, OS):
    """TIR: the value written for fp32 ``v`` = (acc · xs) · ws: fp16 ``act(v + b)``, or its int8 code at the static
    scale ``OS`` (``bsr_linear``'s unfolded requantisation: one ``FFMA.SAT`` into [0, 1], one ``FFMA`` to the code)."""
    from tvm.script import tirx as T

    from .cuda_bsr_parts import code_span, requantize_bits, tir_activate, unit_value
    y = tir_activate(v, bias, spec.act)
    if spec.out == "float16":
        return T.Cast("float16", y)
    span, offset = code_span(spec.act, False)
    z = unit_value(y, OS[1] * T.float32(1.0 / span), T.float32(offset / span))
    return T.Cast("int8", requantize_bits(z, span, offset))


def pack_mma(wq: torch.Tensor) -> torch.Tensor:
    """int8 ``(N, K)`` codes in the mma kernel's order, ``(tiles, K/32, 32, 16)``: per 16-row tile and 32-K chunk,
    lane ``4g + t`` holds its A fragment of ``mma.m16n8k32`` — rows ``g`` and ``g + 8``, K ``8t .. 8t+7`` of the
    chunk, as [row g, K 8t..+3], [row g+8, same], [row g, K 8t+4..+7], [row g+8, same] — so one 16-byte load per
    lane is the fragment, and a warp reads 512 contiguous bytes. (The MMA's K order is permuted alike in A and B:
    its lane ``t`` multiplies K ``8t .. 8t+7`` of the chunk, an 8-byte load of each X row.)"""
    n, k = wq.shape
    tiles = -(-n // 16)
    w = torch.zeros(tiles * 16, k, dtype=torch.int8, device=wq.device)
    w[:n] = wq
    w = w.reshape(tiles, 2, 8, k // MMA_K, 4, 2, 4)          # tile, row half, g, chunk, t, K half, 4 bytes
    return w.permute(0, 3, 2, 4, 5, 1, 6).reshape(tiles, k // MMA_K, 32, 16).contiguous()


def unpack_mma(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_mma`: the int8 ``(N, K)`` codes."""
    tiles, chunks = packed.shape[:2]
    w = packed.reshape(tiles, chunks, 8, 4, 2, 2, 4).permute(0, 5, 2, 1, 3, 4, 6)
    return w.reshape(tiles * 16, chunks * MMA_K)[:n].contiguous()


def chunk_mask(codes: torch.Tensor) -> torch.Tensor:
    """(tiles, K/32) bool: which 16-row × 32-K chunks of int8 ``(N, K)`` codes hold a nonzero."""
    n, k = codes.shape
    pad = torch.zeros(-(-n // 16) * 16, k, dtype=torch.bool, device=codes.device)
    pad[:n] = codes != 0
    return pad.reshape(-1, 16, k // MMA_K, MMA_K).any(dim=(1, 3))


def pack_sparse(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(WQ, Tab)`` of the sparse kernel: the kept chunks of ``pack_mma(codes)`` in tile order, ``(max(kept, 1), 32,
    16)``, and the int32 table — for each tile the offset of its first kept chunk (``tiles + 1`` entries, CSR), then
    each kept chunk's K index."""
    mask = chunk_mask(codes)
    tiles, chunks = torch.nonzero(mask, as_tuple=True)
    packed = pack_mma(codes)[tiles, chunks]
    if not len(tiles):
        packed = torch.zeros(1, 32, 16, dtype=torch.int8, device=codes.device)
    offsets = torch.zeros(mask.shape[0] + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(mask.sum(dim=1).cpu(), 0)
    return packed.contiguous(), torch.cat([offsets, chunks.cpu()]).to(torch.int32).to(codes.device)


def pack_weight(spec: W8A8GemvSpec, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """int8 ``(N, K)`` codes in the layout the kernel reads, and its table (None but for ``sparse``)."""
    if spec.sparse:
        return pack_sparse(codes)
    return (pack_mma(codes) if spec.mma else codes.contiguous()), None


def unpack_weight(spec: W8A8GemvSpec, packed: torch.Tensor, table: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`pack_weight`: the int8 ``(N, K)`` codes (pruned chunks zero)."""
    if not spec.sparse:
        return unpack_mma(packed, spec.n) if spec.mma else packed
    tiles, chunks = spec.tiles, spec.k // MMA_K
    full = torch.zeros(tiles, chunks, 32, 16, dtype=torch.int8, device=packed.device)
    table = table.long().cpu()
    for tile in range(tiles):
        first, last = int(table[tile]), int(table[tile + 1])
        full[tile, table[tiles + 1 + first: tiles + 1 + last]] = packed[first:last]
    return unpack_mma(full, spec.n)


def w8a8_gemv(spec: W8A8GemvSpec):
    """The kernel as an IRModule with one PrimFunc named ``spec.name`` (the tensor-core one for ``spec.mma``)."""
    if spec.mma:
        return _w8a8_gemv_mma(spec)
    import tvm
    from tvm.script import tirx as T

    from .cuda_w4a16 import grid_dependency

    M, N, K, W, G = spec.m, spec.n, spec.k, spec.warps, spec.group
    CK = K // CHUNK                           # chunks per row
    IT = spec.chunks                          # chunks per lane
    NB = -(-IT // G)                          # batches per lane
    FULL = CK % 32 == 0                       # every lane's every chunk in range: no guard
    PDL, EARLY = bool(spec.pdl), spec.pdl == "early"
    ONE = T.uint32(0xFFFFFFFF)

    @T.macro
    def load_batch(WQ, wv, n, lane, bt):
        for g in T.unroll(G):
            it = T.meta_var(bt * G + g)
            if it < IT:
                if FULL or lane + it * 32 < CK:
                    o = T.meta_var((bt % 2) * G * 4 + g * 4)
                    T.evaluate(T.ptx["ld.global.nc.L1::no_allocate.v4.b32"](
                        wv[o], wv[o + 1], wv[o + 2], wv[o + 3], WQ.ptr_to([n, (lane + it * 32) * 4])))

    @T.prim_func
    def kernel(xq_h: T.handle, xs_h: T.handle, wq_h: T.handle, ws_h: T.handle, b_h: T.handle, os_h: T.handle,
               y_h: T.handle):
        T.func_attr({"global_symbol": spec.name, "tirx.noalias": True})
        XQ = T.match_buffer(xq_h, (M, K // 4), "int32")          # int8 codes, four per word
        XS = T.match_buffer(xs_h, (M,), "float32")
        WQ = T.match_buffer(wq_h, (N, K // 4), "int32")
        WS = T.match_buffer(ws_h, (N,), "float32")
        B = T.match_buffer(b_h, (N,), "float16")
        OS = T.match_buffer(os_h, (2,), "float32")               # out="int8": the output scale and its reciprocal
        Y = T.match_buffer(y_h, (M, N), spec.out)
        bx = T.launch_thread("blockIdx.x", -(-N // W))
        tx = T.launch_thread("threadIdx.x", 32 * W)
        wv = T.alloc_buffer((2 * G * 4,), "int32", scope="local")  # two batches of weight chunks
        xw = T.alloc_buffer((4,), "int32", scope="local")
        acc = T.alloc_buffer((M,), "int32", scope="local")
        other = T.alloc_buffer((1,), "int32", scope="local")
        cst = T.alloc_buffer((2,), "float32", scope="local")       # ws of the warp's row, xs of the lane's
        bv = T.alloc_buffer((1,), "float16", scope="local")
        lane = T.meta_var(tx % 32)
        n = T.meta_var(bx * W + tx // 32)

        if n < N:
            if PDL and EARLY:
                T.evaluate(grid_dependency("launch_dependents"))
            load_batch(WQ, wv, n, lane, 0)
            cst[0] = WS[n]
            if spec.bias:
                bv[0] = B[n]
            if PDL:
                T.evaluate(grid_dependency("wait"))
                if not EARLY:
                    T.evaluate(grid_dependency("launch_dependents"))
            cst[1] = XS[T.min(lane, M - 1)]
            for m in T.unroll(M):
                acc[m] = 0
            for bt in T.unroll(NB):
                if bt + 1 < NB:
                    load_batch(WQ, wv, n, lane, bt + 1)                           # in flight while this batch is multiplied
                for g in T.unroll(G):
                    it = T.meta_var(bt * G + g)
                    if it < IT:
                        if FULL or lane + it * 32 < CK:
                            c = T.meta_var(lane + it * 32)
                            o = T.meta_var((bt % 2) * G * 4 + g * 4)
                            for m in T.unroll(M):
                                for v in T.vectorized(4):
                                    xw[v] = XQ[m, c * 4 + v]
                                for i in T.unroll(4):
                                    T.evaluate(T.ptx["dp4a.s32.s32"](acc[m], wv[o + i], xw[i], acc[m]))
            for m in T.unroll(M):
                for s in T.unroll(5):
                    T.evaluate(T.ptx["shfl_sync.bfly.b32"](other[0], acc[m], T.uint32(16 >> s), T.uint32(31), ONE))
                    acc[m] = acc[m] + other[0]
            for m in T.unroll(M):
                if lane == m:
                    v = T.meta_var(T.Cast("float32", acc[m]) * cst[1] * cst[0])
                    Y[m, n] = _output(spec, v, bv[0] if spec.bias else None, OS)

    return tvm.IRModule({spec.name: kernel})


def _w8a8_gemv_mma(spec: W8A8GemvSpec):
    """``Yᵀ = W · Xᵀ`` on ``mma.sync.m16n8k32.s8``: a CTA owns a 16-row tile of W, its warps take the 32-K chunks
    round robin (each lane's 16-byte load is its A fragment, ``pack_mma``; B is 8 rows of X, an 8-byte load per lane,
    zero past M; a second MMA for rows 8..15), then add their int32 fragments through shared memory; thread ``i``
    writes output (row ``i // 16``, column ``16·tile + i % 16``) with the dp4a kernel's epilogue. ``sparse``: the warps
    take the tile's kept chunks only (``Tab``: CSR offsets per tile, then each kept chunk's K index, read with its
    weights), so a pruned chunk costs neither a load nor an MMA."""
    import tvm
    from tvm.script import tirx as T

    from .cuda_w4a16 import grid_dependency

    M, N, K, W, G = spec.m, spec.n, spec.k, spec.warps, spec.group
    TL, CH = spec.tiles, K // MMA_K
    J = -(-CH // W)                           # chunks per warp (at most, when sparse)
    NB = -(-J // G)                           # batches per warp
    EVEN = CH % W == 0
    H = -(-M // 8)                            # 8-row halves of X: one MMA each
    OUT = -(-16 * M // (32 * W))              # outputs per thread
    PDL, EARLY, SPARSE = bool(spec.pdl), spec.pdl == "early", spec.sparse
    MMA = "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32"

    def kept(warp, j, se):                    # whether the warp's j-th chunk exists
        return (warp + j * W < se[1]) if SPARSE else (EVEN or warp + j * W < CH)

    @T.macro
    def load_batch(WQ, Tab, wv, kc, se, tile, warp, lane, bt):
        for g in T.unroll(G):
            j = T.meta_var(bt * G + g)
            if j < J:
                if kept(warp, j, se):
                    o = T.meta_var((bt % 2) * G + g)
                    if SPARSE:
                        T.evaluate(T.ptx["ld.global.nc.L1::no_allocate.v4.b32"](
                            wv[o * 4], wv[o * 4 + 1], wv[o * 4 + 2], wv[o * 4 + 3],
                            WQ.ptr_to([se[0] + warp + j * W, lane, 0])))
                        kc[o] = Tab[TL + 1 + se[0] + warp + j * W]
                    else:
                        T.evaluate(T.ptx["ld.global.nc.L1::no_allocate.v4.b32"](
                            wv[o * 4], wv[o * 4 + 1], wv[o * 4 + 2], wv[o * 4 + 3], WQ.ptr_to([tile, warp + j * W, lane, 0])))

    @T.prim_func
    def kernel(xq_h: T.handle, xs_h: T.handle, wq_h: T.handle, ws_h: T.handle, b_h: T.handle, os_h: T.handle,
               tab_h: T.handle, y_h: T.handle):
        T.func_attr({"global_symbol": spec.name, "tirx.noalias": True})
        nnz = T.int32()
        ntab = T.int32()
        XQ = T.match_buffer(xq_h, (M, K // 4), "int32")          # int8 codes, four per word
        XS = T.match_buffer(xs_h, (M,), "float32")
        WQ = T.match_buffer(wq_h, (nnz, 32, 4) if SPARSE else (TL, CH, 32, 4), "int32")   # pack_mma's bytes
        WS = T.match_buffer(ws_h, (N,), "float32")
        B = T.match_buffer(b_h, (N,), "float16")
        OS = T.match_buffer(os_h, (2,), "float32")
        Tab = T.match_buffer(tab_h, (ntab,), "int32")            # sparse: offsets per tile, then chunk K indices
        Y = T.match_buffer(y_h, (M, N), spec.out)
        bx = T.launch_thread("blockIdx.x", TL)
        tx = T.launch_thread("threadIdx.x", 32 * W)
        wv = T.alloc_buffer((2 * G * 4,), "uint32", scope="local")  # two batches of A fragments
        kc = T.alloc_buffer((2 * G,), "int32", scope="local")       # their chunks' K indices
        se = T.alloc_buffer((2,), "int32", scope="local")           # sparse: the tile's first kept chunk, count
        xb = T.alloc_buffer((2,), "uint32", scope="local")          # a B fragment
        acc = T.alloc_buffer((H * 4,), "uint32", scope="local")
        red = T.alloc_buffer((W * H * 128,), "int32", scope="shared")
        cst = T.alloc_buffer((OUT * 3,), "float32", scope="local")  # ws, b, xs of the thread's outputs
        tot = T.alloc_buffer((1,), "int32", scope="local")
        lane = T.meta_var(tx % 32)
        warp = T.meta_var(tx // 32)
        if PDL and EARLY:
            T.evaluate(grid_dependency("launch_dependents"))
        if SPARSE:
            se[0] = Tab[bx]
            se[1] = Tab[bx + 1] - se[0]
        load_batch(WQ, Tab, wv, kc, se, bx, warp, lane, 0)
        for it in T.unroll(OUT):
            n = T.meta_var(T.min(bx * 16 + (tx + it * 32 * W) % 16, N - 1))
            cst[it * 3] = WS[n]
            cst[it * 3 + 1] = T.Cast("float32", B[n]) if spec.bias else T.float32(0)
        if PDL:
            T.evaluate(grid_dependency("wait"))
            if not EARLY:
                T.evaluate(grid_dependency("launch_dependents"))
        for it in T.unroll(OUT):
            cst[it * 3 + 2] = XS[T.min((tx + it * 32 * W) // 16, M - 1)]
        for i in T.unroll(H * 4):
            acc[i] = T.uint32(0)
        for bt in T.unroll(NB):
            if bt + 1 < NB:
                load_batch(WQ, Tab, wv, kc, se, bx, warp, lane, bt + 1)   # in flight while this batch is multiplied
            for g in T.unroll(G):
                j = T.meta_var(bt * G + g)
                if j < J:
                    if kept(warp, j, se):
                        o = T.meta_var((bt % 2) * G + g)
                        c = T.meta_var(kc[o] if SPARSE else warp + j * W)      # the chunk's K index
                        for h in T.unroll(H):
                            if h * 8 + lane // 4 < M:
                                for v in T.unroll(2):
                                    xb[v] = T.reinterpret("uint32", XQ[h * 8 + lane // 4, c * 8 + (lane % 4) * 2 + v])
                            else:
                                for v in T.unroll(2):
                                    xb[v] = T.uint32(0)
                            T.evaluate(T.ptx[MMA](acc[h * 4], acc[h * 4 + 1], acc[h * 4 + 2], acc[h * 4 + 3],
                                                  wv[o * 4], wv[o * 4 + 1], wv[o * 4 + 2], wv[o * 4 + 3], xb[0], xb[1],
                                                  acc[h * 4], acc[h * 4 + 1], acc[h * 4 + 2], acc[h * 4 + 3]))
        for h in T.unroll(H):
            for r in T.unroll(4):
                red[((warp * H + h) * 32 + lane) * 4 + r] = T.reinterpret("int32", acc[h * 4 + r])
        T.tvm_storage_sync("shared")
        for it in T.unroll(OUT):
            i = T.meta_var(tx + it * 32 * W)
            if i < 16 * M:
                nl = T.meta_var(i % 16)
                m = T.meta_var(i // 16)
                src = T.meta_var(((m // 8) * 32 + (nl % 8) * 4 + (m % 8) // 2) * 4 + (nl // 8) * 2 + m % 2)
                tot[0] = 0
                for w in T.unroll(W):
                    tot[0] = tot[0] + red[w * H * 128 + src]
                if bx * 16 + nl < N:
                    v = T.meta_var(T.Cast("float32", tot[0]) * cst[it * 3 + 2] * cst[it * 3])
                    Y[m, bx * 16 + nl] = _output(spec, v, T.Cast("float16", cst[it * 3 + 1]) if spec.bias else None, OS)

    return tvm.IRModule({spec.name: kernel})
