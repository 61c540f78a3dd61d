"""The FP8 (E4M3) weight GEMV's spec, packed format, quantisation and torch reference (TVM-free).

``Y = act(X · (s ⊙ W8)ᵀ + b)`` for ``X`` (M, K) fp16 or bf16 with M = 1..``rows`` (a run-time size), ``W8`` (N, K)
``torch.float8_e4m3fn`` codes with fp32 scales ``s``: one per output channel (``scale="channel"``), or one per
128×128 block of W (``scale="block"``). Accumulation in fp32.

Format. W is cut into 32×32 blocks (N and K zero-padded to whole blocks). A block is 1024 bytes, its 32 rows of 32
codes one after another, so a warp reads it as two coalesced 512-byte loads (lane ``l``: row ``16i + l // 2``,
bytes ``16 (l % 2)`` .. ``+ 16``). Blocks are stored block row by block row, by column inside a row:

* dense (``sparse=False``): every block, so block ``(r, c)`` is at ``r · KB + c``; no table;
* block-sparse (``sparse=True``): only the kept blocks, with an int32 table ``[offsets (NBR + 1), columns (nnzb)]``
  (block row ``r`` holds blocks ``offsets[r] .. offsets[r + 1]``; ``columns`` gives each one's block column), as
  ``bsr_linear``'s block tables do. Pruned blocks are never stored nor read.

``codes`` is int32 (words of four codes, little-endian: the first code in the low byte), ``scales`` fp32: ``(N,)``
or ``(ceil(N / 128), ceil(K / 128))``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ...errors import SpartaError
from ..epilogue_ref import ACTIVATIONS, activate

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
SCALES = ("channel", "block")
BLOCK = 32                  # the block of the layout (rows and columns)
SCALE_BLOCK = 128           # the block of ``scale="block"``
FP8_MAX = 448.0             # the largest E4M3 magnitude
WORDS = BLOCK * BLOCK // 4  # int32 words of one block


class Fp8GemvError(SpartaError, ValueError):
    """An FP8 GEMV spec, weight or call the kernel cannot run; the message says why."""


@dataclass(frozen=True)
class Fp8GemvSpec:
    n: int                     # output features (rows of W)
    k: int                     # input features
    rows: int = 1              # the most rows (tokens) of X a call may have: 1..16
    dtype: str = "bfloat16"    # X, bias and Y: "float16" or "bfloat16"
    bias: bool = False
    act: str = "none"
    sparse: bool = False       # block-sparse (32×32 blocks and a table) or dense
    scale: str = "channel"     # "channel": fp32 per output row; "block": fp32 per 128×128 block
    warps: int = 4             # warps per CTA (they take the CTA's blocks round robin)
    inflight: int = 4          # blocks a warp loads before it multiplies (two 16-byte loads per lane each)
    ksplit: int = 1            # CTAs splitting a block row's blocks (partials summed by the last to arrive)
    pdl: bool = True           # programmatic dependent launch (sm_90)
    name: str = "fp8_gemv"
    trigger: str = "late"      # pdl: let the next kernel launch at the start ("early") or after the last weights
    mma: bool = False          # tensor cores: codes decoded by bit operations into mma.sync m16n8k16's A (see kernel)

    def __post_init__(self):
        bad = []
        if self.n <= 0 or self.k <= 0:
            bad.append(f"N={self.n} and K={self.k} must be positive")
        if not 1 <= self.rows <= 16:
            bad.append(f"rows={self.rows} must be 1..16 (a GEMV for decode)")
        if self.dtype not in DTYPES:
            bad.append(f"dtype {self.dtype!r} must be one of {tuple(DTYPES)}")
        if self.act not in ACTIVATIONS:
            bad.append(f"activation {self.act!r} not in {ACTIVATIONS}")
        if self.scale not in SCALES:
            bad.append(f"scale {self.scale!r} must be one of {SCALES}")
        if self.warps not in (1, 2, 4, 8, 16):
            bad.append(f"warps={self.warps} must be 1, 2, 4, 8 or 16")
        if self.inflight not in (1, 2, 4, 8):
            bad.append(f"inflight={self.inflight} must be 1, 2, 4 or 8")
        if self.trigger not in ("early", "late"):
            bad.append(f"trigger {self.trigger!r} must be 'early' or 'late'")
        if self.ksplit < 1 or (self.n > 0 and self.k > 0 and self.ksplit > self.col_blocks):
            bad.append(f"ksplit={self.ksplit} must be 1..{max(1, self.col_blocks)} (the block columns)")
        if bad:
            raise Fp8GemvError(f"FP8 GEMV spec {self.name}: " + "; ".join(bad))

    @property
    def archs(self) -> tuple[str, ...]:
        """``cvt.rn.f16x2.e4m3x2`` needs sm_89 or later: cubins for sm_90 (H100/H200) and sm_89 (Ada)."""
        return ("sm_90", "sm_89")

    @property
    def row_blocks(self) -> int:
        return -(-self.n // BLOCK)

    @property
    def col_blocks(self) -> int:
        return -(-self.k // BLOCK)

    @property
    def scale_shape(self) -> tuple[int, ...]:
        if self.scale == "channel":
            return (self.n,)
        return (-(-self.n // SCALE_BLOCK), -(-self.k // SCALE_BLOCK))

    def key(self) -> dict:
        return asdict(self)


@dataclass
class Fp8Packed:
    """A packed weight: ``codes`` int32 (blocks · 256,), ``scales`` fp32, ``table`` int32 or None (dense)."""

    codes: torch.Tensor
    scales: torch.Tensor
    table: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.scales, self.table) if t is not None]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def to(self, device) -> Fp8Packed:
        return Fp8Packed(self.codes.to(device), self.scales.to(device),
                         None if self.table is None else self.table.to(device))

    def clone(self) -> Fp8Packed:
        return Fp8Packed(self.codes.clone(), self.scales.clone(), None if self.table is None else self.table.clone())


def _check_block_mask(block_mask, spec: Fp8GemvSpec, device) -> torch.Tensor:
    shape = (spec.row_blocks, spec.col_blocks)
    if not spec.sparse:
        if block_mask is not None and not bool(torch.as_tensor(block_mask).all()):
            raise Fp8GemvError(f"FP8 GEMV {spec.name}: a dense spec takes no block mask with pruned blocks "
                               "(build a sparse=True spec)")
        return torch.ones(shape, dtype=torch.bool, device=device)
    if block_mask is None:
        raise Fp8GemvError(f"FP8 GEMV {spec.name}: a block-sparse spec needs a block mask of shape {shape}")
    m = torch.as_tensor(block_mask)
    if tuple(m.shape) != shape:
        raise Fp8GemvError(f"FP8 GEMV {spec.name}: the block mask must be (ceil(N/32), ceil(K/32)) = {shape}, got "
                           f"{tuple(m.shape)}")
    return m.to(device=device, dtype=torch.bool)


def element_mask(block_mask: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The (N, K) kept mask of a block mask."""
    return block_mask.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]


def expand_scales(scales: torch.Tensor, spec: Fp8GemvSpec) -> torch.Tensor:
    """The (N, K) fp32 scale of every weight."""
    s = scales.float()
    if spec.scale == "channel":
        return s[:, None].expand(spec.n, spec.k)
    return s.repeat_interleave(SCALE_BLOCK, 0).repeat_interleave(SCALE_BLOCK, 1)[:spec.n, :spec.k]


def quantize(weight: torch.Tensor, spec: Fp8GemvSpec, block_mask=None) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 codes (N, K) ``float8_e4m3fn`` and fp32 scales of a 16/32-bit ``weight``: ``scale = amax / 448`` of each
    channel (or 128×128 block) over its kept elements, codes ``weight / scale`` rounded to nearest (torch's cast);
    all-zero groups get scale 1. Runs on the weight's device."""
    _check_weight(weight, spec)
    keep = element_mask(_check_block_mask(block_mask, spec, weight.device), spec.n, spec.k)
    w = torch.where(keep, weight.float(), torch.zeros((), device=weight.device))
    if spec.scale == "channel":
        amax = w.abs().amax(1)
    else:
        nb, kb = spec.scale_shape
        padded = w.new_zeros(nb * SCALE_BLOCK, kb * SCALE_BLOCK)
        padded[:spec.n, :spec.k] = w
        amax = padded.abs().view(nb, SCALE_BLOCK, kb, SCALE_BLOCK).amax((1, 3))
    if not bool(torch.isfinite(amax).all()):
        raise Fp8GemvError(f"FP8 GEMV {spec.name}: the weight has NaN or infinite values")
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (w / expand_scales(scales, spec)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scales


def _check_weight(weight: torch.Tensor, spec: Fp8GemvSpec) -> None:
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or tuple(weight.shape) != (spec.n, spec.k):
        raise Fp8GemvError(f"FP8 GEMV {spec.name}: the weight must be (N, K) = ({spec.n}, {spec.k}), got "
                           f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    if weight.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise Fp8GemvError(f"FP8 GEMV {spec.name}: quantise a 16- or 32-bit float weight, got {weight.dtype} "
                           "(E4M3 codes go with their scales to pack_codes)")


def pack_codes(codes: torch.Tensor, scales: torch.Tensor, spec: Fp8GemvSpec, block_mask=None) -> Fp8Packed:
    """Pack E4M3 ``codes`` (N, K) (``float8_e4m3fn``, or their uint8 bits) and fp32 ``scales`` (``spec.scale_shape``)
    into the kernel's layout, keeping the blocks of ``block_mask`` (block-sparse specs); on the codes' device."""
    if codes.dtype not in (torch.float8_e4m3fn, torch.uint8) or tuple(codes.shape) != (spec.n, spec.k):
        raise Fp8GemvError(f"FP8 GEMV {spec.name}: codes must be float8_e4m3fn (or uint8) of shape ({spec.n}, "
                           f"{spec.k}), got {codes.dtype} {tuple(codes.shape)}")
    if not isinstance(scales, torch.Tensor) or tuple(scales.shape) != spec.scale_shape or not scales.is_floating_point():
        raise Fp8GemvError(f"FP8 GEMV {spec.name}: scales must be floats of shape {spec.scale_shape} "
                           f"({spec.scale} scales), got {getattr(scales, 'dtype', None)} "
                           f"{tuple(getattr(scales, 'shape', ()))}")
    if not bool(torch.isfinite(scales).all()):
        raise Fp8GemvError(f"FP8 GEMV {spec.name}: scales must be finite")
    device = codes.device
    keep = _check_block_mask(block_mask, spec, device)
    nbr, kb = spec.row_blocks, spec.col_blocks
    padded = torch.zeros(nbr * BLOCK, kb * BLOCK, dtype=torch.uint8, device=device)
    padded[:spec.n, :spec.k] = codes.view(torch.uint8)
    blocks = padded.view(nbr, BLOCK, kb, BLOCK).permute(0, 2, 1, 3)            # (row block, col block, 32, 32)
    table = None
    if spec.sparse:
        blocks = blocks[keep]                                                  # kept blocks, row by row
        counts = keep.sum(1, dtype=torch.int32)
        offsets = torch.zeros(nbr + 1, dtype=torch.int32, device=device)
        offsets[1:] = counts.cumsum(0)
        cols = keep.nonzero()[:, 1].to(torch.int32)
        table = torch.cat([offsets, cols, torch.zeros(1, dtype=torch.int32, device=device)])  # never empty
        if blocks.shape[0] == 0:                                               # no block kept: one zero block
            blocks = torch.zeros(1, BLOCK, BLOCK, dtype=torch.uint8, device=device)
    flat = blocks.reshape(-1).contiguous().view(torch.int32)
    return Fp8Packed(flat, scales.detach().float().contiguous(), table)


def pack_weight(weight: torch.Tensor, spec: Fp8GemvSpec, block_mask=None) -> Fp8Packed:
    """Quantise a 16/32-bit ``weight`` (:func:`quantize`) and pack it (:func:`pack_codes`)."""
    codes, scales = quantize(weight, spec, block_mask)
    return pack_codes(codes, scales, spec, block_mask)


def check_packed(spec: Fp8GemvSpec, packed: Fp8Packed, bias: torch.Tensor | None = None,
                 check_bias: bool = True) -> None:
    """Refuse packed tensors (or, ``check_bias``, a bias) that do not fit ``spec``."""
    where = f"FP8 GEMV {spec.name}"
    c, s, t = packed.codes, packed.scales, packed.table
    if c.dim() != 1 or c.dtype != torch.int32 or c.numel() == 0 or c.numel() % WORDS:
        raise Fp8GemvError(f"{where}: codes must be int32 words of whole 32x32 blocks (pack_codes)")
    if s.dtype != torch.float32 or tuple(s.shape) != spec.scale_shape:
        raise Fp8GemvError(f"{where}: scales must be fp32 {spec.scale_shape}, got {s.dtype} {tuple(s.shape)}")
    if spec.sparse:
        if t is None or t.dim() != 1 or t.dtype != torch.int32 or t.numel() < spec.row_blocks + 2:
            raise Fp8GemvError(f"{where}: a block-sparse weight needs its int32 block table (pack_codes)")
    elif t is not None or c.numel() != spec.row_blocks * spec.col_blocks * WORDS:
        raise Fp8GemvError(f"{where}: a dense weight is every block ({spec.row_blocks}x{spec.col_blocks}), no table "
                           "(packed for another spec?)")
    if not check_bias:
        return
    if spec.bias and (bias is None or tuple(bias.shape) != (spec.n,)):
        raise Fp8GemvError(f"{where}: the kernel adds a bias of shape ({spec.n},); pass one")
    if not spec.bias and bias is not None:
        raise Fp8GemvError(f"{where}: the kernel was built without a bias")


def unpack(packed: Fp8Packed, spec: Fp8GemvSpec, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The (N, K) ``float8_e4m3fn`` codes (zero where pruned) and the block mask, on ``device``."""
    check_packed(spec, packed, check_bias=False)
    nbr, kb = spec.row_blocks, spec.col_blocks
    blocks = packed.codes.to(device).view(torch.uint8).view(-1, BLOCK, BLOCK)
    if spec.sparse:
        t = packed.table.to(device)
        offsets = t[:nbr + 1].long()
        nnz = int(offsets[-1])
        if nnz > blocks.shape[0] or t.numel() < nbr + 1 + nnz or bool((offsets[1:] < offsets[:-1]).any()):
            raise Fp8GemvError(f"FP8 GEMV {spec.name}: the block table does not match the codes")
        rows = torch.repeat_interleave(torch.arange(nbr, device=device), offsets[1:] - offsets[:-1])
        cols = t[nbr + 1:nbr + 1 + nnz].long()
        mask = torch.zeros(nbr, kb, dtype=torch.bool, device=device)
        mask[rows, cols] = True
        full = torch.zeros(nbr, kb, BLOCK, BLOCK, dtype=torch.uint8, device=device)
        full[rows, cols] = blocks[:nnz]
    else:
        mask = torch.ones(nbr, kb, dtype=torch.bool, device=device)
        full = blocks.view(nbr, kb, BLOCK, BLOCK)
    codes = full.permute(0, 2, 1, 3).reshape(nbr * BLOCK, kb * BLOCK)[:spec.n, :spec.k].contiguous()
    return codes.view(torch.float8_e4m3fn), mask


def dequantize(packed: Fp8Packed, spec: Fp8GemvSpec, device="cpu") -> torch.Tensor:
    """The (N, K) fp32 weight the kernel applies: code × scale, zero where pruned (on ``device``)."""
    codes, mask = unpack(packed, spec, device)
    w = codes.float() * expand_scales(packed.scales.to(device), spec)
    return torch.where(element_mask(mask, spec.n, spec.k), w, torch.zeros((), device=device))


def fp8_gemv_ref(x: torch.Tensor, packed: Fp8Packed, spec: Fp8GemvSpec,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``act(x · (s ⊙ W8)ᵀ + b)`` in fp32, returned in ``x``'s dtype, for ``x`` (..., K)."""
    if spec.bias and bias is None:
        raise Fp8GemvError(f"FP8 GEMV {spec.name}: the spec adds a bias; pass one")
    y = x.float() @ dequantize(packed, spec).to(x.device).t()
    if spec.bias:
        y = y + bias.float().to(x.device)
    return activate(y, spec.act).to(x.dtype)


def split_buffers(spec: Fp8GemvSpec, device) -> dict[str, torch.Tensor]:
    """The workspace of a ``ksplit > 1`` kernel, by argument name: fp32 partials ``P`` and zeroed arrival counters
    ``Cnt`` (the kernel leaves them zero again); empty for ``ksplit == 1``."""
    if spec.ksplit == 1:
        return {}
    return {"P": torch.empty(spec.ksplit, spec.rows, spec.row_blocks * BLOCK, dtype=torch.float32, device=device),
            "Cnt": torch.zeros(spec.row_blocks, dtype=torch.int32, device=device)}


def suggest_ksplit(n: int, k: int, sms: int, warps: int = 4, inflight: int = 4, kept: float = 1.0) -> int:
    """A K split giving about two CTAs per SM (``sms``: the device's, e.g. ``Target.sms``) without leaving a CTA less
    than one round of blocks (``warps · inflight``) of a block row of ``kept`` density."""
    nbr, kb = -(-n // BLOCK), -(-k // BLOCK)
    per_row = max(1, round(kb * kept))
    want = -(-2 * sms // nbr)
    return max(1, min(want, per_row // (warps * inflight), kb))


def bytes_read(spec: Fp8GemvSpec, packed: Fp8Packed, m: int = 1) -> int:
    """The bytes one call must move at least: the stored blocks, scales and table, X and Y."""
    act = 2
    return packed.nbytes() + m * spec.k * act + m * spec.n * act + (spec.n * act if spec.bias else 0)


__all__ = ["Fp8GemvSpec", "Fp8GemvError", "Fp8Packed", "quantize", "pack_codes", "pack_weight", "check_packed",
           "unpack", "dequantize", "fp8_gemv_ref", "split_buffers", "suggest_ksplit", "bytes_read",
           "element_mask", "expand_scales", "DTYPES", "BLOCK", "FP8_MAX"]
