"""W8A8 GEMV for decode, llama.cpp's ``mul_mat_vec_q`` on sparta's W8A8 scheme: spec, weight layouts, reference.

``Y = act((XQ · WQᵀ) · xs · ws + b)`` for ``M`` = 1..16 activation rows. ``XQ`` is ``(M, K)`` int8 per-token codes
with fp32 scales ``XS`` — what sparta's per-row quantiser (``templates/quant/``) or a LayerNorm kernel
(``templates/norm/``) writes for the W8A8 linears reading it — and ``WQ`` is ``(N, K)`` int8 per-channel
codes with fp32 scales ``WS``. ``Y`` is ``(M, N)`` fp16 or, ``out="int8"``, int8 codes of one static scale (the tile
kernels' requantising epilogue: what a W8A8 linear behind this one reads, with no quantiser pass between).

The tile kernels (``bsr_linear``, ``dtype="int8"``) compute 128 rows per CTA: with one row, a dense 4096-wide
linear is a grid of 16-32 CTAs streaming all the weights, a fraction of the GPU. Two kernels stream them over the
whole GPU instead: ``mma=True`` (``mma.py``; what ``compile`` builds where K is a multiple of 32) on
``mma.sync.m16n8k32.s8`` with the weights stored in fragment order (``pack_mma``), ``sparse=True`` only over the
kept 16×32 chunks (``pack_sparse``); the default, ``dp4a.py``, one warp per output row with ``dp4a`` on the
codes as they are. Both apply the tile kernels' epilogue, ``(acc · xs) · ws + b`` in fp32 and the activation
(``bsr_linear.spec.reference_int8`` is the reference of both). ``pdl`` ("early" / "late") builds them for
programmatic dependent launch (sm_90), as the W4A16 GEMV: the first batch of weights and the column constants
load before ``griddepcontrol.wait``, ``XQ``, ``XS`` and the writes after it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..bsr_linear.spec import reference_int8
from ..epilogue_ref import ACTIVATIONS, OUTPUTS

CHUNK = 16                 # bytes of a row per lane and load
MMA_K = 32                 # K of one mma.sync.m16n8k32
MAX_K = 133_000            # int32 sums of int8 products stay exact below this K


@dataclass(frozen=True)
class W8A8GemvSpec:
    """Shape, epilogue and tiling of one kernel."""
    m: int                     # 0: any number of rows up to ``rows`` (M a kernel argument; the mma kernel)
    n: int
    k: int
    warps: int = 4             # output rows per CTA, one per warp
    group: int = 8             # 16-byte chunks per lane in one batch of loads (blocks: of 32 K, units of 64 K count 2)
    bias: bool = False
    act: str = "none"
    pdl: str = ""              # programmatic dependent launch (sm_90): "", "early" or "late"
    mma: bool = False          # tensor cores (weights in fragment order, ``pack_mma``) instead of dp4a
    out: str = "float16"       # Y: fp16, "bfloat16" (and bias; a bf16 model), or "int8" codes of one static scale
                               # (argument OS, as ``bsr_linear``'s)
    sparse: bool = False       # mma: only the kept 16x32 chunks, listed in a table (``pack_sparse``)
    rows: int = 0              # m=0: the most rows a call may have (1..16)
    bn: int = 0                # > 0 (with bk): mma over a dense bsr_linear int8 tile's packed bn x bk blocks, every
    bk: int = 0                # block in K order (one packed weight; its table is passed, not read)
    name: str = "w8a8_gemv"

    def __post_init__(self):
        bad = []
        if self.m == 0 and (not 1 <= self.rows <= 16 or not self.mma):
            bad.append(f"rows={self.rows}: a kernel for any M (m=0) is the mma kernel, for up to 1..16 rows")
        elif self.m and (not 1 <= self.m <= 16 or self.rows not in (0, self.m)):
            bad.append(f"M={self.m} must be 1..16 (a GEMV for decode; more rows want the tile kernels), rows 0 or M")
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
        if (self.bn or self.bk) and (not self.mma or self.bn % 16 or self.bn <= 0 or self.bk % 32 or self.bk <= 0):
            bad.append(f"blocks {self.bn}x{self.bk}: the tensor-core kernel (mma) over a tile's blocks of a multiple of "
                       "16 rows and 32 K")
        if self.bn and self.sparse:
            bad.append("blocks: over a dense tile's blocks only (a block-sparse tile's GEMVs keep their chunk pack, "
                       "pack_sparse: over the tile's kept blocks they measured 1.1-2.0x slower)")
        if bad:
            raise ValueError(f"spec {self.name}: " + "; ".join(bad))

    @property
    def act16(self) -> str:
        """The 16-bit type of the bias and a 16-bit ``Y``."""
        return "bfloat16" if self.out == "bfloat16" else "float16"

    @property
    def y_lanes(self) -> str:
        return "int8" if self.out == "int8" else "float16"

    @property
    def max_rows(self) -> int:
        """The most rows a call may have: M, or ``rows`` for a kernel of any M."""
        return self.m or self.rows

    @property
    def chunks(self) -> int:
        """16-byte chunks per lane (the last ones of a row may fall past K)."""
        return -(-self.k // (CHUNK * 32))

    @property
    def tiles(self) -> int:
        """mma: 16-row tiles of the weight (the last one zero-padded)."""
        return -(-self.n // 16)

    @property
    def blocks(self) -> bool:
        """Whether the kernel reads a dense ``bsr_linear`` int8 tile's packed blocks (``bn``, ``bk``)."""
        return self.bn > 0

    @property
    def row_blocks(self) -> int:
        return -(-self.n // self.bn) if self.bn else 0

    @property
    def unit_k(self) -> int:
        """blocks: K of one lane's work unit: 64 (two 16-byte loads, rows g and g + 8, two MMAs) where the block
        holds whole 64s, else 32 (two 8-byte loads, one MMA)."""
        return 64 if self.bk % 64 == 0 else 32

    @property
    def ctas(self) -> int:
        """CTAs of the grid: a 16-row tile each (blocks: ``bn / 16`` per block row)."""
        return self.row_blocks * (self.bn // 16) if self.bn else self.tiles

    def weight_shape(self, kept: int = 0) -> tuple:
        """Shape of the int8 weight argument as the kernel takes it (``pack_mma``'s for the mma kernel; the sparse one
        holds the ``kept`` chunks, at least one; blocks: the tile's blocks, ``kept`` of them)."""
        if self.bn:
            return (max(kept, 1), self.bn, self.bk)
        if self.sparse:
            return (max(kept, 1), 32, 16)
        return (self.tiles, self.k // MMA_K, 32, 16) if self.mma else (self.n, self.k)

    def key(self) -> dict:
        d = asdict(self)
        for f, default in (("mma", False), ("out", "float16"), ("sparse", False), ("rows", 0), ("bn", 0), ("bk", 0)):
            if d[f] == default:            # the keys of kernels built before the field existed
                del d[f]
        return d


def argument_names(spec: W8A8GemvSpec) -> list[str]:
    return ["XQ", "XS", "WQ", "WS", *(["B"] if spec.bias else []), *(["OS"] if spec.out == "int8" else []),
            *(["Tab"] if spec.sparse else []), "Y"]


def reference(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
              bias: torch.Tensor | None = None, act: str = "none", out_scale: float | None = None,
              dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """What the kernel computes: the W8A8 tile kernels' reference on every block kept (``out_scale``: int8 codes;
    ``dtype``: bf16 for ``out="bfloat16"``)."""
    return reference_int8(xq, xs, wq, ws, None, bias, act, 1, 1, out_scale, dtype)


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


def int8_weight_scale(op_plan, weight: torch.Tensor, k: int) -> torch.Tensor | None:
    """The plan's per-channel int8 scales of ``weight`` (N, K) (None: the int8 kernels quantise each channel
    at its absolute maximum, for scales fitted per group, which they do not take)."""
    quant = op_plan.weight_quant.get(8)
    params = quant.params(weight) if quant is not None else None
    return params.scale[:, 0] if params is not None and params.group >= k else None
