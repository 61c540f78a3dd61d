"""The unstructured sparse GEMV's spec, packed format, packing and torch reference (TVM-free).

``Y = act(X · (W ⊙ mask)ᵀ + b)`` for ``X`` of 1 to ``rows`` rows (decode), ``W`` (N, K) fp16 or bf16 with an
unstructured mask. Only the kept values (2 bytes each) and a 1-bit bitmap are stored.

Format. Rows are cut into row tiles of ``tile_rows`` rows, columns into column tiles of ``S · stream_cols`` columns
(``S = 32 / tile_rows``): a tile (row tile ``rt``, column tile ``kt``) is the work of one warp step, lane ``l`` owning
the stream of row ``rt · tile_rows + l // S``, columns ``kt · C + (l % S) · stream_cols`` onward (``stream_cols``
of them). Per tile:

* ``bits`` (int32, ``(tiles, stream_cols / 128, 32, 4)``): lane ``l``'s bitmap words, four per 16-byte piece, so a
  warp's bitmap load is 512 contiguous bytes; bit ``b`` of word ``q`` is column ``32q + b`` of the stream;
* ``values`` (16-bit, pieces of 8): each stream's kept values in the kernel's walk order (word by word, within a
  word from its highest column down: one ``clz`` finds the next), cut into pieces of 8 (the last one zero-padded). A tile stores piece 0 of every lane that has one (lanes in order), then piece 1 of every lane that
  has one, ...: the lanes loading their ``j``-th piece read consecutive 16-byte pieces (a lane's place among them is
  the popcount of a ballot), and nothing but a stream's last piece is padded;
* ``offsets`` (int32, ``tiles + 1``): the first piece of each tile (the last entry: all pieces).

Tiles are numbered ``rt · col_tiles + kt``. Rows past N and columns past K are pruned (no bits).

The kernel (``kernel.py``): a CTA owns a row tile and a range of column tiles (all of them, or a ``ksplit``-th),
stages its X columns in shared memory, and its warps take the range's tiles round robin; each lane walks its set bits
(``__clz``, highest first) against its values: an FMA per kept value and row of X, or (``mma``) a store into the
warp's dense 16-row tile, multiplied by X on ``mma.sync`` (``mma.py``). ``M`` is a kernel argument: one build serves
every row count up to ``rows``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from ...errors import SpartaError
from ..epilogue_ref import ACTIVATIONS, activate

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
SHARED_LIMIT = 160 * 1024        # dynamic + static shared memory of one CTA (sm_80 allows 163 KB, sm_90 227 KB)
MAX_PIECES = 1 << 27             # int32 value indices (8 values a piece)


class BitmapGemvError(SpartaError, ValueError):
    """A bitmap-GEMV spec, weight or call the kernel cannot run; the message says why."""


@dataclass(frozen=True)
class BitmapGemvSpec:
    n: int                     # output features (rows of W)
    k: int                     # input features
    rows: int = 1              # the most rows (tokens) of X a call may have: 1..16
    dtype: str = "bfloat16"    # X, W, bias and Y: "float16" or "bfloat16"
    bias: bool = False
    act: str = "none"
    tile_rows: int = 8         # rows a warp's tile covers: 8, 16 or 32 (32 / tile_rows lanes per row)
    stream_cols: int = 128     # columns of one lane's stream: 128, 256 or 512
    warps: int = 8             # warps per CTA (they split the CTA's column tiles)
    inflight: int = 8          # 16-byte value pieces a lane loads before it multiplies: 2, 4, 8 or 16
    ksplit: int = 1            # CTAs splitting K per row tile (partials summed by the last to arrive)
    pdl: bool = True           # programmatic dependent launch (sm_90)
    name: str = "bitmap_gemv"
    mma: bool = False          # tensor cores: values stored into a dense tile per warp, then mma.sync (tile_rows 16)

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
        if self.tile_rows not in (8, 16, 32):
            bad.append(f"tile_rows={self.tile_rows} must be 8, 16 or 32")
        if self.stream_cols not in (128, 256, 512):
            bad.append(f"stream_cols={self.stream_cols} must be 128, 256 or 512")
        if self.warps not in (1, 2, 4, 8, 16):
            bad.append(f"warps={self.warps} must be 1, 2, 4, 8 or 16")
        if self.inflight not in (2, 4, 8, 16):
            bad.append(f"inflight={self.inflight} must be 2, 4, 8 or 16")
        if self.mma and self.tile_rows != 16:
            bad.append(f"mma: a warp's tile is the MMA's 16 rows (tile_rows=16, got {self.tile_rows})")
        if self.ksplit < 1:
            bad.append(f"ksplit={self.ksplit} must be >= 1")
        if not bad and self.ksplit > self.col_tiles:
            bad.append(f"ksplit={self.ksplit} is over the {self.col_tiles} column tiles of K={self.k}")
        if not bad and self.shared_total > SHARED_LIMIT:
            bad.append(f"{self.shared_total} bytes of shared memory (X of {self.rows} rows x {self.range_cols} "
                       f"columns in fp32) are over {SHARED_LIMIT}: fewer rows, or a larger ksplit")
        if bad:
            raise BitmapGemvError(f"bitmap GEMV spec {self.name}: " + "; ".join(bad))

    # ---- geometry -------------------------------------------------------------------
    @property
    def lanes_per_row(self) -> int:
        return 32 // self.tile_rows

    @property
    def tile_cols(self) -> int:
        return self.lanes_per_row * self.stream_cols

    @property
    def words(self) -> int:
        """Bitmap words of one stream."""
        return self.stream_cols // 32

    @property
    def row_tiles(self) -> int:
        return -(-self.n // self.tile_rows)

    @property
    def col_tiles(self) -> int:
        return -(-self.k // self.tile_cols)

    @property
    def tiles(self) -> int:
        return self.row_tiles * self.col_tiles

    @property
    def range_tiles(self) -> int:
        """Column tiles of one CTA's range (the last range may be shorter)."""
        return -(-self.col_tiles // self.ksplit)

    @property
    def range_cols(self) -> int:
        return self.range_tiles * self.tile_cols

    @property
    def x_stride(self) -> int:
        """Elements of one X row in shared memory: fp32 with 8 pad words after each stream's columns (so the lanes of
        one row, ``stream_cols`` apart, read different banks); ``mma``: 16-bit, the range's columns and 8 pad."""
        if self.mma:
            return self.range_cols + 8
        return self.range_tiles * self.lanes_per_row * (self.stream_cols + 8)

    @property
    def mma_rows(self) -> int:
        """``mma``: the rows of X the MMAs cover (8 or 16: the B operand's N)."""
        return 8 if self.rows <= 8 else 16

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory: the CTA's X columns (``mma``: then each warp's 16-bit dense tile)."""
        if self.mma:
            return 2 * (self.mma_rows * self.x_stride + self.warps * 16 * (self.tile_cols + 8))
        return self.rows * self.x_stride * 4

    @property
    def shared_total(self) -> int:
        """Dynamic plus static shared memory (the warps' partial sums, the split-K arrival flag)."""
        return self.shared_bytes + self.warps * self.tile_rows * self.rows * 4 + 16

    def key(self) -> dict:
        return asdict(self)


@dataclass
class BitmapPacked:
    """A packed weight (see the module docstring): ``bits`` int32 (tiles, words / 4, 32, 4), ``offsets`` int32
    (tiles + 1,), ``values`` of the spec's dtype (pieces · 8,)."""

    bits: torch.Tensor
    offsets: torch.Tensor
    values: torch.Tensor

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.bits, self.offsets, self.values))

    def to(self, device) -> BitmapPacked:
        return BitmapPacked(self.bits.to(device), self.offsets.to(device), self.values.to(device))


def _streams(t: torch.Tensor, spec: BitmapGemvSpec) -> torch.Tensor:
    """(N, K) → (tiles · 32, stream_cols): each lane's stream, tiles in order, lanes in order (zero-padded)."""
    R, S, CS = spec.tile_rows, spec.lanes_per_row, spec.stream_cols
    padded = t.new_zeros(spec.row_tiles * R, spec.col_tiles * spec.tile_cols)
    padded[:spec.n, :spec.k] = t
    return padded.view(spec.row_tiles, R, spec.col_tiles, S, CS).permute(0, 2, 1, 3, 4).reshape(-1, CS)


def _unstreams(s: torch.Tensor, spec: BitmapGemvSpec) -> torch.Tensor:
    R, S, CS = spec.tile_rows, spec.lanes_per_row, spec.stream_cols
    full = s.view(spec.row_tiles, spec.col_tiles, R, S, CS).permute(0, 2, 1, 3, 4)
    return full.reshape(spec.row_tiles * R, spec.col_tiles * spec.tile_cols)[:spec.n, :spec.k]


def _walk_order(a: np.ndarray, spec: BitmapGemvSpec) -> np.ndarray:
    """Streams (rows of ``a``) in the kernel's walk order: word by word, within a word from its highest column down
    (a copy)."""
    return np.ascontiguousarray(a.reshape(-1, spec.words, 32)[:, :, ::-1]).reshape(a.shape)


def _piece_slots(counts: torch.Tensor, spec: BitmapGemvSpec) -> tuple[torch.Tensor, torch.Tensor, int]:
    """For stream counts (tiles, 32): the (tiles, pmax, 32) bool of the pieces stored (lane has a j-th piece), in
    storage order, the offsets (tiles + 1,) and pmax."""
    pieces = (counts + 7) // 8
    pmax = int(pieces.max()) if pieces.numel() else 0
    stored = pieces[:, None, :] > torch.arange(pmax, device=counts.device)[None, :, None]
    per_tile = stored.flatten(1).sum(1)
    offsets = torch.zeros(spec.tiles + 1, dtype=torch.int64, device=counts.device)
    offsets[1:] = per_tile.cumsum(0)
    if int(offsets[-1]) > MAX_PIECES:
        raise BitmapGemvError(f"bitmap GEMV {spec.name}: {int(offsets[-1])} pieces are over the kernel's 32-bit "
                              "value indices")
    return stored, offsets.to(torch.int32), pmax


def pack_bitmap(weight: torch.Tensor, mask: torch.Tensor, spec: BitmapGemvSpec) -> BitmapPacked:
    """Pack ``weight`` (N, K) where ``mask`` (N, K, True = kept) into the kernel's format, vectorised, on the weight's
    device (numpy's boolean indexing on the CPU, torch's on a GPU)."""
    if tuple(weight.shape) != (spec.n, spec.k) or tuple(mask.shape) != (spec.n, spec.k):
        raise BitmapGemvError(f"bitmap GEMV {spec.name}: weight and mask must be (N, K) = ({spec.n}, {spec.k}), got "
                              f"{tuple(weight.shape)} and {tuple(mask.shape)}")
    return _pack(weight, mask, spec, on_cpu=weight.device.type == "cpu")


def _pack(weight: torch.Tensor, mask: torch.Tensor, spec: BitmapGemvSpec, on_cpu: bool) -> BitmapPacked:
    dtype, device, T = DTYPES[spec.dtype], weight.device, spec.tiles
    w = _streams(weight.detach().to(dtype), spec)
    m = _streams(mask.detach().to(device, torch.bool), spec)
    counts = m.sum(1, dtype=torch.int32)                                   # kept values per stream
    stored, offsets, pmax = _piece_slots(counts.view(T, 32), spec)
    first_of = (torch.arange(pmax * 8, device=device)[None, :] < counts[:, None])
    if on_cpu:      # numpy: packbits, and boolean indexing of 16-bit words (row-major), several times torch's speed
        mn = m.numpy()
        words = np.packbits(mn.reshape(T * 32, spec.words, 32), axis=-1, bitorder="little")
        bits = torch.from_numpy(words.reshape(T, 32, spec.words // 4, 16).view(np.int32).copy())
        kept = _walk_order(w.view(torch.int16).numpy(), spec)[_walk_order(mn, spec)]
        compact = np.zeros((T * 32, pmax * 8), dtype=np.int16)
        compact[first_of.numpy()] = kept
        compact = torch.from_numpy(compact).view(dtype)
    else:
        shifts = torch.arange(32, device=device, dtype=torch.int64)
        words = (m.view(T * 32, spec.words, 32).to(torch.int64) << shifts).sum(-1)
        bits = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
        walk = m.view(-1, spec.words, 32).flip(-1).reshape(m.shape)
        compact = torch.zeros(T * 32, pmax * 8, dtype=dtype, device=device)
        compact[first_of] = w.view(-1, spec.words, 32).flip(-1).reshape(w.shape)[walk]
    bits = bits.view(T, 32, spec.words // 4, 4).permute(0, 2, 1, 3).contiguous()
    pieces = compact.view(T, 32, pmax, 8).permute(0, 2, 1, 3)[stored]     # (tiles, piece, lane) storage order
    return BitmapPacked(bits, offsets, pieces.reshape(-1).contiguous())


def unpack_mask(bits: torch.Tensor, spec: BitmapGemvSpec) -> torch.Tensor:
    """The (N, K) kept mask of ``bits``."""
    raw = bits.cpu().permute(0, 2, 1, 3).contiguous().numpy().view(np.uint8)
    m = np.unpackbits(raw.reshape(spec.tiles * 32, spec.words, 4), axis=-1, bitorder="little")
    return _unstreams(torch.from_numpy(m.reshape(-1, spec.stream_cols).astype(bool)), spec)


def unpack(packed: BitmapPacked, spec: BitmapGemvSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense (N, K) weight (zeros where pruned) and its mask, on the CPU."""
    mask = unpack_mask(packed.bits, spec)
    m = _streams(mask, spec)
    counts = m.sum(1, dtype=torch.int32)
    stored, offsets, pmax = _piece_slots(counts.view(spec.tiles, 32), spec)
    values = packed.values.cpu()
    if values.numel() != int(offsets[-1]) * 8 or not torch.equal(offsets, packed.offsets.cpu()):
        raise BitmapGemvError(f"bitmap GEMV {spec.name}: values and offsets do not match the bitmap")
    compact = torch.zeros(spec.tiles, pmax, 32, 8, dtype=values.dtype)
    compact[stored] = values.view(-1, 8)
    compact = compact.permute(0, 2, 1, 3).reshape(spec.tiles * 32, pmax * 8)
    first = np.arange(pmax * 8)[None, :] < counts.numpy()[:, None]
    dense = np.zeros(tuple(m.shape), dtype=np.int16)
    dense[_walk_order(m.numpy(), spec)] = compact.view(torch.int16).numpy()[first]
    dense = _walk_order(dense, spec)                                       # the order is its own inverse
    return _unstreams(torch.from_numpy(dense).view(values.dtype), spec), mask


def bitmap_gemv_ref(x: torch.Tensor, packed: BitmapPacked, spec: BitmapGemvSpec,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """``act(x · Wᵀ + b)`` of the packed weight in fp32, in ``x``'s dtype, for ``x`` (..., K)."""
    w, _ = unpack(packed, spec)
    y = x.float() @ w.to(x.device).float().t()
    if spec.bias:
        if bias is None:
            raise BitmapGemvError(f"bitmap GEMV {spec.name}: the spec adds a bias; pass one")
        y = y + bias.float()
    return activate(y, spec.act).to(x.dtype)


def split_buffers(spec: BitmapGemvSpec, device) -> dict[str, torch.Tensor]:
    """The workspace of a ``ksplit > 1`` kernel, by its argument names: fp32 partials ``P`` and the zeroed arrival
    counters ``Cnt`` (the kernel leaves them zero again); empty for ``ksplit == 1``."""
    if spec.ksplit == 1:
        return {}
    return {"P": torch.empty(spec.ksplit, spec.rows, spec.row_tiles * spec.tile_rows, dtype=torch.float32,
                             device=device),
            "Cnt": torch.zeros(spec.row_tiles, dtype=torch.int32, device=device)}


def bytes_floor(n: int, k: int, density: float, dtype_bytes: int = 2) -> float:
    """Bytes a bitmap format must read at least: the kept values and one bit per element."""
    return n * k * (density * dtype_bytes + 1 / 8)


__all__ = ["BitmapGemvSpec", "BitmapGemvError", "BitmapPacked", "pack_bitmap", "unpack", "unpack_mask",
           "bitmap_gemv_ref", "split_buffers", "bytes_floor", "DTYPES"]
