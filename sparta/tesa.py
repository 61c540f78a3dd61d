"""TeSA: a tensor with sparsity attribute.

A TeSA has the shape of the data tensor it describes. Each element is ``0`` when the
data element is pruned (it is, and stays, zero or irrelevant) and otherwise the number
of bits the element needs (4, 8, 16, 32; other values up to 32 are allowed and rounded
later by bit rounding). TeSAs form a lattice under the element-wise minimum
(:meth:`TeSA.meet`): pruned wins, fewer bits win.

TeSAs are immutable values. ``tesa.bits`` hands out a copy; passes that need the raw
tensor without copying use :meth:`TeSA.view`, which must never be written to.

A TeSA constant over aligned ``bh × bw`` blocks of its last two dims can be held as one value per block
(:meth:`TeSA.from_blocks`; :meth:`TeSA.block_grid` reads it): ``view()`` then materialises the elements, and the
lattice, statistics and passes that know the form work on the blocks (a 7B model's masks fit in memory).
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import struct
import zlib
from collections.abc import Sequence

import numpy as np
import torch

from .errors import TeSAError

MAX_BITS = 32
_HEADER = struct.Struct("<I")


def _label(name):
    return f"TeSA for {name!r}" if name else "TeSA"


def _as_tensor(x, name, what):
    if isinstance(x, TeSA):
        return x.view()
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(np.ascontiguousarray(x))
    if not isinstance(x, torch.Tensor):
        try:
            x = torch.as_tensor(x)
        except Exception as exc:  # noqa: BLE001 - anything unconvertible is a user error
            raise TeSAError(f"{_label(name)}: {what} must be a tensor or array, got {type(x).__name__}") from exc
    return x.detach().cpu()


def _check_integral(x, name, what):
    if x.dtype.is_floating_point or x.dtype.is_complex:
        if x.dtype.is_floating_point and torch.isnan(x).any():
            raise TeSAError(f"{_label(name)}: {what} contains NaN; expected integers 0..{MAX_BITS}")
        raise TeSAError(f"{_label(name)}: {what} has non-integer dtype {x.dtype}; "
                        f"expected an integer tensor (uint8) with values 0..{MAX_BITS}")


class TeSA:
    """Tensor with sparsity attribute: per element, 0 (pruned) or its bit width."""

    __slots__ = ("_bits", "_uniform", "_block", "_shape")

    def __init__(self, bits: torch.Tensor, *, _trusted: bool = False, name: str | None = None, _block=None):
        if not _trusted:
            bits = _as_tensor(bits, name, "bits")
            _check_integral(bits, name, "bits")
            if bits.dtype == torch.bool:
                raise TeSAError(f"{_label(name)}: got a bool tensor as bits; use TeSA.from_mask(mask, bits=...)")
            if bits.numel() and (int(bits.min()) < 0 or int(bits.max()) > MAX_BITS):
                raise TeSAError(f"{_label(name)}: bit values must lie in 0..{MAX_BITS}, "
                                f"got range [{int(bits.min())}, {int(bits.max())}]")
            bits = bits.to(torch.uint8).contiguous().clone()
        uniform = None
        if bits.numel() == 0:
            uniform = 0
        elif bits.stride() == (0,) * bits.dim() or bits.numel() == 1:
            uniform = int(bits.reshape(-1)[0])
        self._bits = bits
        self._uniform = uniform
        self._block = None
        self._shape = tuple(bits.shape)
        if _block is not None:            # ``bits`` is one value per block: the elements' shape is the grid's × block
            if uniform is not None:
                bits = torch.tensor(uniform, dtype=torch.uint8)
            shape = (*self._shape[:-2], self._shape[-2] * _block[0], self._shape[-1] * _block[1])
            self._bits = bits if uniform is None else bits.expand(shape)
            self._block = None if uniform is not None else (int(_block[0]), int(_block[1]))
            self._shape = shape

    # ---- constructors -------------------------------------------------------------
    @classmethod
    def from_mask(cls, mask, bits: int = 32, *, name: str | None = None) -> TeSA:
        """Kept elements (``mask`` true / 1) get ``bits``; the others are pruned."""
        m = _as_tensor(mask, name, "mask")
        if m.dtype != torch.bool:
            _check_integral(m, name, "mask")
            if m.numel() and not bool(((m == 0) | (m == 1)).all()):
                raise TeSAError(f"{_label(name)}: a mask must hold only 0/1 or booleans")
            m = m != 0
        if not isinstance(bits, (int, np.integer)) or not 1 <= int(bits) <= MAX_BITS:
            raise TeSAError(f"{_label(name)}: bits must be an integer in 1..{MAX_BITS}, got {bits!r}")
        return cls(m.to(torch.uint8) * int(bits), _trusted=True)

    @classmethod
    def from_blocks(cls, blocks, block: Sequence[int] = (32, 32), bits: int = 32, *, name: str | None = None) -> TeSA:
        """Kept ``block``-shaped blocks (``blocks`` true / 1: a grid over the last two dims) get ``bits``, the others
        are pruned; held as one value per block (the elements of a 4096×11008 mask cost 45 MB, its blocks 44 kB)."""
        grid = cls.from_mask(blocks, bits, name=name).view()
        if grid.dim() < 2:
            raise TeSAError(f"{_label(name)}: a block grid needs 2 or more dims, got shape {tuple(grid.shape)}")
        if len(block) != 2 or not all(isinstance(b, (int, np.integer)) and b >= 1 for b in block):
            raise TeSAError(f"{_label(name)}: block must be two positive ints, got {block!r}")
        return cls(grid.contiguous(), _trusted=True, _block=tuple(block))

    @classmethod
    def from_bits(cls, bits, *, name: str | None = None) -> TeSA:
        """From a tensor of per-element bit widths (0 = pruned)."""
        return cls(bits, name=name)

    @classmethod
    def dense(cls, shape: Sequence[int], bits: int = 32) -> TeSA:
        """Every element kept at ``bits`` (no memory is spent on the elements)."""
        if not isinstance(bits, (int, np.integer)) or not 0 <= int(bits) <= MAX_BITS:
            raise TeSAError(f"TeSA.dense: bits must be an integer in 0..{MAX_BITS}, got {bits!r}")
        shape = tuple(int(s) for s in shape)
        return cls(torch.tensor(int(bits), dtype=torch.uint8).expand(shape), _trusted=True)

    @classmethod
    def pruned(cls, shape: Sequence[int]) -> TeSA:
        """Every element pruned."""
        return cls.dense(shape, 0)

    # ---- reading --------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def ndim(self) -> int:
        return len(self._shape)

    def numel(self) -> int:
        return math.prod(self._shape)

    def view(self) -> torch.Tensor:
        """The stored uint8 tensor itself (may be an expanded view; a block TeSA's elements, materialised); never
        write to it."""
        if self._block is None:
            return self._bits
        bh, bw = self._block
        return self._bits.repeat_interleave(bh, -2).repeat_interleave(bw, -1)

    def block_grid(self) -> tuple[torch.Tensor, tuple[int, int]] | None:
        """``(one uint8 value per block, (bh, bw))`` of a TeSA held by blocks (:meth:`from_blocks`), else None."""
        return None if self._block is None else (self._bits, self._block)

    def map_bits(self, fn) -> TeSA:
        """The TeSA of ``fn(bits)`` for an element-wise ``fn`` of uint8 tensors (on the blocks where held so; on one
        element where all are alike)."""
        if self._uniform is not None and self.numel():
            return TeSA.dense(self.shape, int(fn(self._bits.reshape(-1)[:1]).to(torch.uint8)))
        return TeSA(fn(self._bits).to(torch.uint8), _trusted=True, _block=self._block)

    def _area(self) -> int:
        return 1 if self._block is None else self._block[0] * self._block[1]

    @property
    def bits(self) -> torch.Tensor:
        """A copy of the per-element bit widths (uint8; 0 = pruned)."""
        return self.view().clone()

    @property
    def mask(self) -> torch.Tensor:
        """Bool tensor: True where the element is kept."""
        return self.view() != 0

    @property
    def uniform(self) -> int | None:
        """The single value every element holds, or None when they differ (cheap test)."""
        return self._uniform

    @property
    def is_dense(self) -> bool:
        """No element pruned."""
        return self.numel() == 0 or (self._uniform != 0 if self._uniform is not None else bool(self._bits.all()))

    @property
    def density(self) -> float:
        """Fraction of kept elements."""
        if self.numel() == 0:
            return 1.0
        if self._uniform is not None:
            return 1.0 if self._uniform else 0.0
        return float(torch.count_nonzero(self._bits)) / self._bits.numel()

    def bit_histogram(self) -> dict[int, int]:
        """Element count per bit value (0 = pruned), only values that occur."""
        if self._uniform is not None:
            return {self._uniform: self.numel()} if self.numel() else {}
        counts = torch.bincount(self._bits.reshape(-1).to(torch.int64), minlength=MAX_BITS + 1)
        return {int(v): int(c) * self._area() for v, c in enumerate(counts.tolist()) if c}

    def max_bits(self) -> int:
        return int(self._bits.max()) if self.numel() else 0

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` with its pruned elements zero (``False`` for bools); NaN or inf stored there is dropped too."""
        keep = self.mask.to(x.device)
        if x.dtype == torch.bool:
            return x & keep
        return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))

    def block_density(self, bh: int, bw: int) -> torch.Tensor:
        """Kept fraction per grid-aligned ``bh × bw`` block over the last two dims.

        A 1-D TeSA is treated as one row. Edge blocks count only the elements inside
        the tensor. Returns float32 of shape ``(..., ceil(H/bh), ceil(W/bw))``.
        """
        if bh < 1 or bw < 1:
            raise TeSAError(f"block shape must be positive, got {bh}x{bw}")
        if self._block is not None and bh % self._block[0] == 0 and bw % self._block[1] == 0:
            return TeSA(self._bits != 0, _trusted=True).block_density(bh // self._block[0], bw // self._block[1])
        if self._block is not None and self._block[0] % bh == 0 and self._block[1] % bw == 0:   # finer: whole blocks
            kept = (self._bits != 0).to(torch.float32)
            return kept.repeat_interleave(self._block[0] // bh, -2).repeat_interleave(self._block[1] // bw, -1)
        if self._uniform is not None and self.ndim >= 2 and self.numel():      # every element alike
            h, w = self._shape[-2:]
            return torch.full((*self._shape[:-2], -(-h // bh), -(-w // bw)), float(self._uniform != 0))
        m = self.mask.to(torch.float32)
        if m.dim() == 0:
            m = m.reshape(1, 1)
        elif m.dim() == 1:
            m = m.unsqueeze(0)
        lead, (h, w) = m.shape[:-2], m.shape[-2:]
        m = m.reshape(-1, 1, h, w)
        kept = torch.nn.functional.avg_pool2d(m, (bh, bw), ceil_mode=True, divisor_override=1)
        ones = torch.nn.functional.avg_pool2d(torch.ones(1, 1, h, w), (bh, bw), ceil_mode=True, divisor_override=1)
        return (kept / ones).reshape(*lead, kept.shape[-2], kept.shape[-1])

    # ---- lattice ---------------------------------------------------------------------
    def meet(self, other: TeSA) -> TeSA:
        """Element-wise minimum: pruned wins, fewer bits win."""
        if not isinstance(other, TeSA):
            raise TeSAError(f"meet needs a TeSA, got {type(other).__name__}")
        if other.shape != self.shape:
            raise TeSAError(f"meet of TeSAs with different shapes {self.shape} and {other.shape}")
        if self._uniform is not None and other._uniform is not None:
            return TeSA.dense(self.shape, min(self._uniform, other._uniform))
        if other._uniform is not None and other._uniform >= self.max_bits():
            return self
        if self._uniform is not None and self._uniform >= other.max_bits():
            return other
        if self._block is not None and self._block == other._block:
            return TeSA(torch.minimum(self._bits, other._bits), _trusted=True, _block=self._block)
        return TeSA(torch.minimum(self.view(), other.view()), _trusted=True)

    def join(self, other: TeSA) -> TeSA:
        """Element-wise maximum (least upper bound): kept wins, more bits win."""
        if not isinstance(other, TeSA):
            raise TeSAError(f"join needs a TeSA, got {type(other).__name__}")
        if other.shape != self.shape:
            raise TeSAError(f"join of TeSAs with different shapes {self.shape} and {other.shape}")
        if self._uniform is not None and other._uniform is not None:
            return TeSA.dense(self.shape, max(self._uniform, other._uniform))
        if other._uniform == 0:
            return self
        if self._uniform == 0:
            return other
        if self._block is not None and self._block == other._block:
            return TeSA(torch.maximum(self._bits, other._bits), _trusted=True, _block=self._block)
        return TeSA(torch.maximum(self.view(), other.view()), _trusted=True)

    def __le__(self, other: TeSA) -> bool:
        """Lattice order: every element of self is at most other's."""
        if self.shape != other.shape:
            return False
        if self._block is not None and self._block == other._block:
            return bool((self._bits <= other._bits).all())
        return bool((self.view() <= other.view()).all())

    def __eq__(self, other) -> bool:
        if not isinstance(other, TeSA):
            return NotImplemented
        if self.shape != other.shape:
            return False
        if self._uniform is not None and other._uniform is not None:
            return self._uniform == other._uniform or self.numel() == 0
        if self._block is not None and self._block == other._block:
            return bool(torch.equal(self._bits, other._bits))
        return bool(torch.equal(self.view().contiguous(), other.view().contiguous()))

    def __hash__(self) -> int:
        return hash(self.shape)         # equal TeSAs held differently (by blocks, by elements) hash alike

    def digest(self) -> str:
        """A content hash (shape and values, and the block form where held by blocks), stable across processes."""
        h = hashlib.sha256(repr(self.shape).encode())
        if self._uniform is not None:
            h.update(b"u%d" % self._uniform)
        else:
            h.update(b"b%r" % (self._block,) if self._block else b"")
            h.update(self._bits.contiguous().numpy().tobytes())
        return h.hexdigest()[:16]

    def check_shape(self, shape: Sequence[int], name: str | None = None) -> TeSA:
        """Raise TeSAError unless this TeSA fits a tensor of ``shape``; return self."""
        if tuple(shape) != self.shape:
            raise TeSAError(f"{_label(name)}: shape {self.shape} does not match the tensor's shape {tuple(shape)}")
        return self

    # ---- (de)serialisation -----------------------------------------------------------
    def serialize(self) -> tuple[dict, bytes]:
        """A JSON-able header and a compact payload (never pickle).

        Encodings: ``uniform`` (one value, empty payload), ``mask`` (one bit width,
        packed kept-bits, zlib), ``raw`` (uint8 values, zlib).
        """
        header = {"shape": list(self.shape)}
        if self._uniform is not None:
            return {**header, "encoding": "uniform", "value": self._uniform}, b""
        if self._block is not None:     # the grid's own encoding, and the block
            inner, payload = TeSA(self._bits, _trusted=True).serialize()
            return {**header, "encoding": "blocks", "block": list(self._block), "grid": inner}, payload
        flat = self._bits.reshape(-1).numpy()
        kept = flat != 0
        top = int(flat.max())
        if top and int(np.where(kept, flat, np.uint8(MAX_BITS)).min()) == top:     # one bit width kept
            return {**header, "encoding": "mask", "value": top}, _compress(np.packbits(kept).tobytes())
        return {**header, "encoding": "raw"}, _compress(flat.tobytes())

    @classmethod
    def deserialize(cls, header: dict, payload: bytes) -> TeSA:
        try:
            shape = tuple(int(s) for s in header["shape"])
            n = int(np.prod(shape, dtype=np.int64))
            enc = header["encoding"]
            if enc == "blocks":
                block, grid = tuple(int(b) for b in header["block"]), cls.deserialize(header["grid"], payload)
                out = cls(grid.view(), _trusted=True, _block=block) if len(block) == 2 else None
                if out is None or out.shape != shape:
                    raise TeSAError(f"corrupt serialised TeSA: blocks of {block} over {grid.shape} are not {shape}")
                return out
            if enc == "uniform":
                return cls.dense(shape, int(header["value"]))
            raw = zlib.decompress(payload)
            if enc == "mask":
                kept = np.unpackbits(np.frombuffer(raw, np.uint8), count=n).astype(np.uint8)
                return cls(torch.from_numpy(kept * np.uint8(header["value"])).reshape(shape), name=None)
            if enc == "raw":
                return cls(torch.from_numpy(np.frombuffer(raw, np.uint8).copy()).reshape(shape))
        except TeSAError:
            raise
        except Exception as exc:  # noqa: BLE001 - any decoding failure is a corrupt TeSA
            raise TeSAError(f"corrupt serialised TeSA: {exc}") from exc
        raise TeSAError(f"unknown TeSA encoding {enc!r}")

    def to_bytes(self) -> bytes:
        header, payload = self.serialize()
        h = json.dumps(header).encode()
        return _HEADER.pack(len(h)) + h + payload

    @classmethod
    def from_bytes(cls, blob: bytes) -> TeSA:
        if len(blob) < _HEADER.size:
            raise TeSAError("corrupt serialised TeSA: too short")
        (n,) = _HEADER.unpack_from(blob)
        try:
            header = json.loads(blob[_HEADER.size:_HEADER.size + n])
        except ValueError as exc:
            raise TeSAError(f"corrupt serialised TeSA header: {exc}") from exc
        return cls.deserialize(header, blob[_HEADER.size + n:])

    def to_json(self) -> dict:
        """A JSON-able dict (payload base64-encoded)."""
        header, payload = self.serialize()
        return {**header, "payload": base64.b64encode(payload).decode("ascii")}

    @classmethod
    def from_json(cls, data: dict) -> TeSA:
        try:
            payload = base64.b64decode(data.get("payload", ""))
        except (ValueError, TypeError) as exc:
            raise TeSAError(f"corrupt TeSA payload: {exc}") from exc
        return cls.deserialize(data, payload)

    def __repr__(self) -> str:
        hist = self.bit_histogram()
        n = max(self.numel(), 1)
        parts = ", ".join(f"{'pruned' if b == 0 else f'{b}b'}: {c / n:.1%}" for b, c in sorted(hist.items()))
        return f"TeSA(shape={self.shape}, density={self.density:.3f}, {{{parts}}})"

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):  # deliberately unpicklable: serialise with to_bytes / to_json
        raise TypeError("TeSA is not picklable; use tesa.to_bytes() / TeSA.from_bytes()")


def _compress(data: bytes) -> bytes:
    """zlib of ``data``: the fast level, and the thorough one only where the data compresses well (a random element
    mask of a 7B model's linear is 4 MB of near-incompressible bits: the thorough level there costs 3× for 3%)."""
    fast = zlib.compress(data, 1)
    return zlib.compress(data, 6) if len(fast) < len(data) // 4 else fast


def bits_of_dtype(dtype: torch.dtype) -> int:
    """Natural bit width of a dtype, capped at 32 (the widest TeSA value)."""
    if dtype == torch.bool:
        return 1
    return min(torch.iinfo(dtype).bits if not dtype.is_floating_point else torch.finfo(dtype).bits, MAX_BITS)
