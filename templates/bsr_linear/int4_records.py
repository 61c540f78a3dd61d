"""The torch side of ``bsr_linear``'s W4A16 kernel (``BsrSpec(..., dtype="w4a16")``): int4 weight
blocks with fp16 scales, dequantised in registers into ``mma.sync`` B fragments.

A kept ``bn × bk`` block is one record of ``rec_lanes`` 16-bit lanes, copied to shared memory as is:

* words ``[bn/8][32 lanes][bk/32]`` uint32: lane ``4g + t`` of 8-row group ``n8`` holds row ``8·n8 + g``,
  K ``32·kw + (2t, 2t+1, 2t+8, 2t+9, 16+2t, 17+2t, 24+2t, 25+2t)`` — exactly its B fragments of the
  two m16n8k16 steps of that 32 — as 8 nibbles in AWQ's interleave (``w4a16_gemv.spec.ORDER``), so one
  ``lop3`` makes each half2 (``ptx.dequant_word``);
* scales ``[bk/32][bn]`` fp16: one per 32 K of a row (groups of 32, 64, 128 or per channel repeat);
* zero points ``[bk/32][bn]`` uint8 when ``spec.zero`` (else code 8 is zero: symmetric).

Codes are uint8 ``0..15``: ``w = (q - zero) · scale``.

A tile of ``spec.gemv_group > 0`` holds no records: its weight is the W4A16 GEMVs' pack (``gemv_layout``), one buffer
for the GEMVs and the tile (:func:`pack_w4` and :func:`unpack_w4` take either).
"""

from __future__ import annotations

import torch

from ..w4a16_gemv.spec import ORDER, W4A16Spec, dequantize, flat_views, pack_codes, pack_flat
from .packing import build_table
from .spec import KPACK, BsrSpec


def quantize_w4(w: torch.Tensor, group: int, zero: bool = False, dtype: torch.dtype = torch.float16):
    """Round-to-nearest codes (uint8 0..15), per-group ``dtype`` (fp16 or bf16) scales ``(N, ceil(K/group))`` and
    uint8 zero points (None when symmetric: codes -7..7 stored +8) of ``w`` ``(N, K)``."""
    n, k = w.shape
    g = -(-k // group)
    wf = torch.nn.functional.pad(w.float(), (0, g * group - k)).reshape(n, g, group)
    if not zero:
        scale = (wf.abs().amax(-1) / 7).clamp_min(1e-6).to(dtype)
        q = torch.round(wf / scale.float()[..., None]).clamp(-7, 7) + 8
        return q.reshape(n, -1)[:, :k].to(torch.uint8), scale, None
    lo, hi = wf.amin(-1).clamp(max=0), wf.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp_min(1e-6).to(dtype)
    z = torch.round(-lo / scale.float()).clamp(0, 15)
    q = (torch.round(wf / scale.float()[..., None]) + z[..., None]).clamp(0, 15)
    return q.reshape(n, -1)[:, :k].to(torch.uint8), scale, z.to(torch.uint8)


def expand_groups(t: torch.Tensor, group: int, k: int) -> torch.Tensor:
    """Per-group values ``(N, G)`` repeated to one per column ``(N, K)``."""
    return t.repeat_interleave(group, dim=1)[:, :k]


def dequantize_w4(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                  dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """The ``dtype`` (fp16 or bf16) weight the kernel multiplies by, from element-wise codes, scales and zero points
    (``(q - zero)`` exact, one rounding of the product, as ``mul.f16x2`` / bf16x2 ``fma`` does)."""
    z = 8.0 if zero is None else zero.float()
    return ((codes.float() - z) * scale.to(dtype).float()).to(dtype)


def _act(spec: BsrSpec) -> torch.dtype:
    return torch.bfloat16 if spec.act16 == "bfloat16" else torch.float16


_LOW = [ORDER.index(2 * b) for b in range(4)]        # element of each byte's low nibble (little-endian words)
_HIGH = [ORDER.index(2 * b + 1) for b in range(4)]   # and of its high nibble
_NIBBLES = list(ORDER)                               # nibble position of element e (bytes' low, high, ...)


def _per32(t: torch.Tensor, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Column ``32 j`` of the element-wise ``(N, K)`` ``t``, zero-padded to ``(rows, cols)``: one value per 32 K."""
    out = torch.zeros(rows, cols, dtype=dtype, device=t.device)
    first = t[:, ::KPACK]
    out[: first.shape[0], : first.shape[1]] = first.to(dtype)
    return out


def _constant_per32(scale: torch.Tensor) -> bool:
    """Whether each row of the element-wise ``scale`` holds one value per 32 columns."""
    n, k = scale.shape
    if scale.is_meta:
        return True
    full = k - k % KPACK
    head = scale[:, :full].reshape(n, -1, KPACK)
    ok = bool((head == head[..., :1]).all())
    return ok and bool((scale[:, full:] == scale[:, full:full + 1]).all()) if full < k else ok


def pack_w4(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, spec: BsrSpec,
            block_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Wp, table)``: the kept blocks as byte records (uint8 ``(nnz, 2 · rec_lanes)``; the kernel takes
    an fp16 view) and the table.
    ``codes``/``scale``/``zero`` are element-wise ``(N, K)`` (see :func:`expand_groups`); scales must be
    constant over each 32 K of a row. Meta tensors give a meta ``Wp`` of its shape (a model compiled from the meta
    device)."""
    n, k = spec.n, spec.k
    if tuple(codes.shape) != (n, k) or tuple(scale.shape) != (n, k) or (zero is not None) != spec.zero:
        raise ValueError(f"{spec.name}: codes/scales must be ({n}, {k}) and zero points given iff spec.zero")
    if spec.gemv_group:
        return _pack_gemv_words(codes, scale, zero, spec, block_mask)
    if not _constant_per32(scale.to(_act(spec))):
        raise ValueError(f"{spec.name}: scales vary inside a 32-column group (group must be a multiple of 32)")
    table, packed = build_table(block_mask, spec.groups)
    rb, kb, bn, bk, kw = spec.row_blocks, spec.k_blocks, spec.bn, spec.bk, spec.bk // KPACK
    dev = codes.device
    q = torch.full((rb * bn, kb * bk), 8, dtype=torch.uint8, device=dev)
    q[:n, :k] = codes.to(torch.uint8)
    rows = torch.tensor([r for r, _ in packed] or [0], device=dev)
    cols = torch.tensor([c for _, c in packed] or [0], device=dev)
    # codes -> (blocks, n8, g, kw, h, hi, t, p) -> (blocks, n8, g, t, kw, e) with e = 4h + 2hi + p; byte b of a
    # little-endian word holds nibble positions 2b (low) and 2b + 1 (high)
    qb = q.reshape(rb, bn, kb, bk).permute(0, 2, 1, 3)[rows, cols]
    del q
    qb = qb.reshape(-1, bn // 8, 8, kw, 2, 2, 4, 2).permute(0, 1, 2, 6, 3, 4, 5, 7).reshape(-1, bn // 8, 32, kw, 8)
    words = qb[..., _LOW] | (qb[..., _HIGH] << 4)                                   # (blocks, n8, 32, kw, 4 bytes)
    del qb
    s32 = _per32(scale, rb * bn, kb * kw, _act(spec))
    sb = s32.reshape(rb, bn, kb, kw).permute(0, 2, 3, 1)[rows, cols]            # (blocks, kw, bn)
    parts = [words.reshape(len(rows), -1), sb.reshape(len(rows), -1).view(torch.uint8)]
    if spec.zero:
        z32 = _per32(zero, rb * bn, kb * kw, torch.uint8)
        parts.append(z32.reshape(rb, bn, kb, kw).permute(0, 2, 3, 1)[rows, cols].reshape(len(rows), -1))
    wp = torch.cat(parts, 1)
    if not packed:
        wp = torch.zeros_like(wp)
    return wp.contiguous(), table if dev.type == "meta" else table.to(dev)


def unpack_w4(wp: torch.Tensor, table: torch.Tensor, spec: BsrSpec) -> torch.Tensor:
    """Inverse of :func:`pack_w4`: the dense ``(N, K)`` fp16 weight the kernel applies (zero where
    no block is kept)."""
    if spec.gemv_group:
        layout = gemv_layout(spec)
        return dequantize(*flat_views(wp.reshape(-1), layout), layout).to(_act(spec))
    bn, bk, kw = spec.bn, spec.bk, spec.bk // KPACK
    rec = wp.reshape(wp.shape[0], -1)
    nw = bn * bk // 2
    byte = rec[:, :nw].reshape(-1, bn // 8, 32, kw, 4)
    nib = torch.stack([byte & 0xF, byte >> 4], -1).reshape(*byte.shape[:-1], 8)    # by nibble position
    q = nib[..., _NIBBLES]                                                          # by element
    q = q.reshape(-1, bn // 8, 8, 4, kw, 2, 2, 2).permute(0, 1, 2, 4, 5, 6, 3, 7).reshape(-1, bn, bk)
    s32 = rec[:, nw:nw + 2 * kw * bn].contiguous().view(_act(spec)).reshape(-1, kw, bn)
    z32 = rec[:, nw + 2 * kw * bn:].reshape(-1, kw, bn) if spec.zero else None
    scale = s32.permute(0, 2, 1).unsqueeze(3)                                       # (blocks, bn, kw, 1)
    zero = z32.permute(0, 2, 1).unsqueeze(3) if z32 is not None else None
    blocks = dequantize_w4(q.reshape(-1, bn, kw, KPACK), scale, zero, _act(spec)).reshape(-1, bn, bk)
    row, first, count, kidx = _block_places(table, spec)
    pad = torch.zeros(spec.row_blocks, spec.k_blocks, bn, bk, dtype=_act(spec), device=wp.device)
    brow = torch.repeat_interleave(row, count)
    slot = torch.repeat_interleave(first - (torch.cumsum(count, 0) - count), count) + torch.arange(len(brow))
    pad[brow, kidx[slot]] = blocks[slot]
    return pad.permute(0, 2, 1, 3).reshape(spec.row_blocks * bn, spec.k_blocks * bk)[: spec.n, : spec.k].contiguous()


def _block_places(table: torch.Tensor, spec: BsrSpec):
    """(row, first packed block, count) per slot and the K index per packed block of a table, as int64 tensors."""
    t = table.cpu().to(torch.int64)
    head = t[: spec.slot_ints * spec.row_blocks].reshape(-1, spec.slot_ints)
    return head[:, 0], head[:, 1], head[:, 2], t[spec.table_head:]


def gemv_layout(spec: BsrSpec) -> W4A16Spec:
    """The W4A16 GEMV layout a ``gemv_group`` tile reads (what fixes the pack: shape, scale group, zero points,
    16-bit type; the GEMVs' tilings do not change it)."""
    return W4A16Spec(0, spec.n, spec.k, group=spec.gemv_group, sym=not spec.zero, dtype=spec.act16, rows=16,
                     name=spec.name)


def _pack_gemv_words(codes, scale, zero, spec: BsrSpec, block_mask: torch.Tensor):
    """``(flat, table)`` of a ``gemv_group`` tile: the GEMVs' pack of element-wise codes, scales and zero points
    (constant over each group) and the dense table."""
    g = spec.gemv_group
    if not bool(torch.as_tensor(block_mask).all()):
        raise ValueError(f"{spec.name}: the GEMVs' pack is dense; a tile reading it keeps every block")
    per_group = scale.to(_act(spec))[:, ::g]
    if not scale.is_meta and not torch.equal(expand_groups(per_group, g, spec.k), scale.to(_act(spec))):
        raise ValueError(f"{spec.name}: scales vary inside a group of {g} columns")
    wq, s, z = pack_codes(codes.to(torch.uint8), per_group, None if zero is None else zero[:, ::g].to(torch.uint8),
                          gemv_layout(spec))
    table, _ = build_table(torch.ones(spec.row_blocks, spec.k_blocks, dtype=torch.bool))
    return pack_flat(wq, s, z), table if codes.device.type == "meta" else table.to(codes.device)
