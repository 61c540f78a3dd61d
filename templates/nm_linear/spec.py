"""The 2:4 sparse linear's spec, packed format, packing and torch reference (TVM-free).

``Y = act(X · (W ⊙ mask)ᵀ + b)`` for ``X`` of 1 to ``rows`` rows (decode, small batches) and ``W`` (N, K) fp16 or
bf16 whose mask keeps at most 2 of every 4 consecutive elements along K (1:4 and 0:4 groups are 2:4 groups holding
zeros). The kernel runs ``mma.sp`` m16n8k32: W is the sparse A operand (16 output channels × 32 K, compressed to
16 values a row and 2-bit indices), Xᵀ the dense B operand (32 K × 8 rows of X).

Format. N is cut into row tiles of 16, K into K tiles of 32, padded with zeros to whole groups of 4 K tiles
(``k_pad`` = a multiple of 128; any K is accepted, X's columns past K read as zeros). Per row tile:

* ``values`` (``(row_tiles, k_tiles, 32, 8)`` of the dtype): per K tile, lane ``l``'s A fragment as it sits in its
  four registers (16 bytes; the warp's 512 bytes contiguous): with ``g = l // 4``, ``t = l % 4`` and the compressed
  16 × 16 tile ``C`` (row ``r``: the two kept values of each group of 4, lower column first), registers 0..3 hold
  ``C[g, 2t:2t+2]``, ``C[g+8, 2t:2t+2]``, ``C[g, 2t+8:2t+10]``, ``C[g+8, 2t+8:2t+10]`` (PTX's m16n8k16 A layout over
  ``C``);
* ``meta`` (int32, ``(row_tiles, groups, 16, 4)``): per group of 4 K tiles, metadata lane ``2g + h`` holds the
  sparse MMA's metadata word of lanes ``(g, t)`` with ``t % 2 == h`` for each of the 4 K tiles (selector 0: the
  lanes ``t = 0, 1`` of each quad supply it): bits 0..15 are row ``g``'s groups ``4h .. 4h + 3`` of the K tile, bits
  16..31 row ``g + 8``'s, a nibble a group (the first kept index in its low 2 bits, the second above, increasing:
  valid for ``mma.sp::ordered_metadata``). A warp loads its 4 tiles' words with one 16-byte load a lane.

Bytes: ``N · K · 9 / 8`` (padded to whole tiles): half the values plus 4 bits a group of 4.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ...errors import SpartaError
from ..epilogue_ref import ACTIVATIONS, activate

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
SHARED_LIMIT = 160 * 1024        # dynamic shared memory of one CTA (sm_80 allows 163 KB, sm_90 227 KB)
ZERO_NIBBLE = 0b0100             # a group with nothing kept: indices 0 and 1, both values zero


class NmLinearError(SpartaError, ValueError):
    """A 2:4 sparse linear spec, weight or call the kernel cannot run; the message says why."""


@dataclass(frozen=True)
class NmLinearSpec:
    n: int                     # output features (rows of W)
    k: int                     # input features (any; padded to a multiple of 128 with zeros)
    rows: int = 1              # the most rows (tokens) of X a call may have: 1..64 (8 per n8 MMA)
    dtype: str = "bfloat16"    # X, W, bias and Y: "float16" or "bfloat16"
    bias: bool = False
    act: str = "none"
    warps: int = 4             # warps per CTA (they split the CTA's K range)
    inflight: int = 8          # K tiles a warp loads before it multiplies: 4, 8 or 16
    ksplit: int = 1            # CTAs splitting K per row tile (partials summed by the last to arrive)
    pdl: bool = True           # programmatic dependent launch (sm_90)
    tiles: int = 1             # row tiles (16 channels each) a CTA owns: X staged once serves them all
    prefetch: bool = False     # double-buffer the weight fragments: the next batch loads while this one multiplies
    name: str = "nm_linear"

    def __post_init__(self):
        bad = []
        if self.n <= 0 or self.k <= 0:
            bad.append(f"N={self.n} and K={self.k} must be positive")
        if not 1 <= self.rows <= 64:
            bad.append(f"rows={self.rows} must be 1..64")
        if self.dtype not in DTYPES:
            bad.append(f"dtype {self.dtype!r} must be one of {tuple(DTYPES)}")
        if self.act not in ACTIVATIONS:
            bad.append(f"activation {self.act!r} not in {ACTIVATIONS}")
        if self.warps not in (1, 2, 4, 8, 16):
            bad.append(f"warps={self.warps} must be 1, 2, 4, 8 or 16")
        if self.inflight not in (4, 8, 16):
            bad.append(f"inflight={self.inflight} must be 4, 8 or 16")
        if self.ksplit < 1:
            bad.append(f"ksplit={self.ksplit} must be >= 1")
        if self.tiles not in (1, 2, 4, 8):
            bad.append(f"tiles={self.tiles} must be 1, 2, 4 or 8")
        elif self.warps % self.tiles:
            bad.append(f"warps={self.warps} must be a multiple of tiles={self.tiles} (each row tile has its warps)")
        if not isinstance(self.prefetch, bool):
            bad.append(f"prefetch={self.prefetch!r} must be a bool")
        if not bad and self.ksplit > self.groups:
            bad.append(f"ksplit={self.ksplit} is over the {self.groups} groups of 128 columns of K={self.k}")
        if not bad and self.shared_bytes > SHARED_LIMIT:
            bad.append(f"{self.shared_bytes} bytes of shared memory (X of {self.x_rows} rows x {self.range_k} "
                       f"columns) are over {SHARED_LIMIT}: fewer rows, or a larger ksplit")
        if bad:
            raise NmLinearError(f"2:4 sparse linear spec {self.name}: " + "; ".join(bad))

    # ---- geometry -------------------------------------------------------------------
    @property
    def row_tiles(self) -> int:
        return -(-self.n // 16)

    @property
    def cta_rows(self) -> int:
        """CTAs along N (``tiles`` row tiles each; the last may own fewer)."""
        return -(-self.row_tiles // self.tiles)

    @property
    def tile_warps(self) -> int:
        """Warps sharing one row tile (they take its batches round robin)."""
        return self.warps // self.tiles

    @property
    def groups(self) -> int:
        """Groups of 4 K tiles (128 columns) of the padded K."""
        return -(-self.k // 128)

    @property
    def k_tiles(self) -> int:
        return 4 * self.groups

    @property
    def k_pad(self) -> int:
        return 128 * self.groups

    @property
    def range_groups(self) -> int:
        """Groups of one CTA's K range (the last range may be shorter)."""
        return -(-self.groups // self.ksplit)

    @property
    def range_k(self) -> int:
        return 128 * self.range_groups

    @property
    def mmas(self) -> int:
        """n8 MMAs per K tile (each covers 8 rows of X)."""
        return -(-self.rows // 8)

    @property
    def x_rows(self) -> int:
        """Rows of X staged in shared memory (a lane of an MMA past them reads the last: its D column is unused)."""
        return self.rows

    @property
    def x_stride(self) -> int:
        """Halves of one X row in shared memory: the range's columns and 32 pad (rows 64 bytes apart modulo 128, so
        a quarter warp's 16-byte B-fragment loads touch every bank once)."""
        return self.range_k + 32

    @property
    def batches(self) -> int:
        """Batches of ``inflight`` K tiles in one CTA's range."""
        return -(-4 * self.range_groups // self.inflight)

    @property
    def red_floats(self) -> int:
        """The warps' partial sums (fp32), in the shared memory X used."""
        return self.warps * 16 * 8 * self.mmas

    @property
    def shared_bytes(self) -> int:
        return max(2 * self.x_rows * self.x_stride, 4 * self.red_floats)

    def key(self) -> dict:
        return asdict(self)


@dataclass
class NmPacked:
    """A packed weight: ``values`` (row_tiles, k_tiles, 32, 8) of the spec's dtype, ``meta`` int32 (row_tiles,
    groups, 16, 4) (see the module docstring)."""

    values: torch.Tensor
    meta: torch.Tensor

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.values, self.meta))

    def to(self, device) -> NmPacked:
        return NmPacked(self.values.to(device), self.meta.to(device))


def check_two_four(mask: torch.Tensor, where: str = "2:4 sparse linear") -> None:
    """Refuse a mask (N, K) with more than 2 kept elements in a group of 4 consecutive columns (K padded with
    pruned columns to a multiple of 4)."""
    n, k = mask.shape
    m = torch.zeros(n, -(-k // 4) * 4, dtype=torch.bool, device=mask.device)
    m[:, :k] = mask
    counts = m.view(n, -1, 4).sum(-1)
    bad = (counts > 2).nonzero()
    if bad.numel():
        r, c = (int(v) for v in bad[0])
        raise NmLinearError(f"{where}: the mask is not 2:4 — {int((counts > 2).sum())} groups of 4 keep more than 2 "
                            f"(the first: row {r}, columns {4 * c}..{4 * c + 3} keep {int(counts[r, c])})")


def pack_nm(weight: torch.Tensor, spec: NmLinearSpec, mask: torch.Tensor | None = None) -> NmPacked:
    """Pack ``weight`` (N, K) where ``mask`` (True = kept; default: the weight's nonzeros) into the kernel's format,
    vectorised on the weight's device."""
    where = f"2:4 sparse linear {spec.name}"
    if weight.dim() != 2 or tuple(weight.shape) != (spec.n, spec.k):
        raise NmLinearError(f"{where}: the weight must be (N, K) = ({spec.n}, {spec.k}), got {tuple(weight.shape)}")
    if not (weight.is_floating_point() and weight.dtype.itemsize <= 4):
        raise NmLinearError(f"{where}: the weight must be fp16, bf16 or fp32, got {weight.dtype}")
    if mask is None:
        mask = weight != 0
    if tuple(mask.shape) != (spec.n, spec.k) or mask.dtype != torch.bool:
        raise NmLinearError(f"{where}: the mask must be a bool (N, K) = ({spec.n}, {spec.k}) tensor, got "
                            f"{mask.dtype} {tuple(mask.shape)}")
    mask = mask.to(weight.device)
    check_two_four(mask, where)
    dtype, dev, RT, G = DTYPES[spec.dtype], weight.device, spec.row_tiles, spec.groups
    NP, KP = 16 * RT, spec.k_pad
    w = torch.zeros(NP, KP, dtype=dtype, device=dev)
    w[:spec.n, :spec.k] = torch.where(mask, weight.detach(), torch.zeros((), dtype=weight.dtype, device=dev))
    m = torch.zeros(NP, KP, dtype=torch.bool, device=dev)
    m[:spec.n, :spec.k] = mask
    # the two indices of each group: the kept ones, then the lowest pruned ones, in increasing order
    key = m.view(NP, KP // 4, 4).to(torch.int8) * 4 + torch.arange(3, -1, -1, dtype=torch.int8, device=dev)
    idx = key.topk(2, dim=-1).indices.sort(-1).values                       # (NP, KP/4, 2), idx0 < idx1
    comp = w.view(NP, KP // 4, 4).gather(-1, idx).reshape(NP, KP // 2)     # compressed rows: 2 values a group
    nib = (idx[..., 0] | (idx[..., 1] << 2)).to(torch.int64)                # (NP, KP/4)
    # values: C (RT, h, g, KT, j, t, e) -> (RT, KT, g, t, j, h, e)
    vals = comp.view(RT, 2, 8, 4 * G, 2, 4, 2).permute(0, 3, 2, 5, 4, 1, 6).reshape(RT, 4 * G, 32, 8)
    # metadata: a 16-bit half per (row, K tile, t): 4 nibbles; word = row g's half | row g+8's half << 16
    half = (nib.view(NP, 4 * G, 2, 4) << (4 * torch.arange(4, device=dev))).sum(-1)     # (NP, KT, 2)
    half = half.view(RT, 2, 8, G, 4, 2)
    word = half[:, 0] | (half[:, 1] << 16)                                  # (RT, g, G, q, t)
    word = torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)
    meta = word.permute(0, 2, 1, 4, 3).reshape(RT, G, 16, 4)                # (RT, G, g * 2 + t, q)
    return NmPacked(vals.contiguous(), meta.contiguous())


def unpack(packed: NmPacked, spec: NmLinearSpec, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The dense (N, K) weight (zeros where pruned) and the kept mask (nonzero stored values), on ``device``."""
    RT, G = spec.row_tiles, spec.groups
    NP, KP = 16 * RT, spec.k_pad
    vals, meta = packed.values.to(device), packed.meta.to(device)
    if tuple(vals.shape) != (RT, 4 * G, 32, 8) or tuple(meta.shape) != (RT, G, 16, 4):
        raise NmLinearError(f"2:4 sparse linear {spec.name}: packed tensors of shapes {tuple(vals.shape)} and "
                            f"{tuple(meta.shape)} are not the spec's {(RT, 4 * G, 32, 8)} and {(RT, G, 16, 4)}")
    comp = vals.view(RT, 4 * G, 8, 4, 2, 2, 2).permute(0, 5, 2, 1, 4, 3, 6).reshape(NP, KP // 2)
    word = meta.to(torch.int64) & 0xFFFFFFFF                                # (RT, G, g * 2 + t, q)
    word = word.view(RT, G, 8, 2, 4).permute(0, 2, 1, 4, 3)                 # (RT, g, G, q, t)
    half = torch.stack([word & 0xFFFF, word >> 16], 1).reshape(NP, 4 * G, 2, 1)
    nib = ((half >> (4 * torch.arange(4, device=vals.device))) & 0xF).reshape(NP, KP // 4)
    idx = torch.stack([nib & 3, nib >> 2], -1)                             # (NP, KP/4, 2)
    if (idx[..., 0] >= idx[..., 1]).any():
        raise NmLinearError(f"2:4 sparse linear {spec.name}: metadata with indices not increasing in a group")
    dense = torch.zeros(NP, KP // 4, 4, dtype=vals.dtype, device=vals.device)
    dense.scatter_(-1, idx, comp.view(NP, KP // 4, 2))
    dense = dense.view(NP, KP)
    if dense[spec.n:].any() or dense[:, spec.k:].any():
        raise NmLinearError(f"2:4 sparse linear {spec.name}: values in the padding past N or K")
    dense = dense[:spec.n, :spec.k].contiguous()
    return dense, dense != 0


def nm_linear_ref(x: torch.Tensor, packed: NmPacked, spec: NmLinearSpec,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``act(x · Wᵀ + b)`` of the packed weight in fp32, in ``x``'s dtype, for ``x`` (..., K)."""
    w = unpack(packed, spec)[0].float()
    y = x.float().cpu() @ w.t()
    if bias is not None:
        y = y + bias.float().cpu()
    return activate(y, spec.act).to(x.dtype)


def split_buffers(spec: NmLinearSpec, device) -> dict[str, torch.Tensor]:
    """The workspace of a ``ksplit > 1`` kernel, by its argument names: fp32 partials ``P`` and the zeroed arrival
    counters ``Cnt`` (the kernel leaves them zero again); empty for ``ksplit == 1``."""
    if spec.ksplit == 1:
        return {}
    return {"P": torch.empty(spec.ksplit, spec.rows, spec.row_tiles * 16, dtype=torch.float32, device=device),
            "Cnt": torch.zeros(spec.row_tiles, dtype=torch.int32, device=device)}


def bytes_floor(n: int, k: int, dtype_bytes: int = 2) -> float:
    """Bytes a 2:4 format must read at least: half the values and 2 bits for each of them."""
    return n * k * (dtype_bytes / 2 + 1 / 8)


__all__ = ["NmLinearSpec", "NmLinearError", "NmPacked", "pack_nm", "unpack", "check_two_four", "nm_linear_ref",
           "split_buffers", "bytes_floor", "DTYPES", "ZERO_NIBBLE"]
