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
"""

from __future__ import annotations

import torch

from ..w4a16_gemv.spec import ORDER
from .packing import build_table, table_parts
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


def pack_w4(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, spec: BsrSpec,
            block_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Wp, table)``: the kept blocks as byte records (uint8 ``(nnz, 2 · rec_lanes)``; the kernel takes
    an fp16 view) and the table.
    ``codes``/``scale``/``zero`` are element-wise ``(N, K)`` (see :func:`expand_groups`); scales must be
    constant over each 32 K of a row."""
    n, k = spec.n, spec.k
    if tuple(codes.shape) != (n, k) or tuple(scale.shape) != (n, k) or (zero is not None) != spec.zero:
        raise ValueError(f"{spec.name}: codes/scales must be ({n}, {k}) and zero points given iff spec.zero")
    table, packed = build_table(block_mask, spec.groups)
    rb, kb, bn, bk, kw = spec.row_blocks, spec.k_blocks, spec.bn, spec.bk, spec.bk // KPACK
    dev = codes.device
    q = torch.full((rb * bn, kb * bk), 8, dtype=torch.int64, device=dev)
    q[:n, :k] = codes.to(torch.int64)
    s = torch.zeros(rb * bn, kb * bk, dtype=_act(spec), device=dev)
    s[:n, :k] = scale.to(s.dtype)
    s32 = s[:, ::KPACK]
    if not torch.equal(s32.repeat_interleave(KPACK, 1)[:n, :k], scale.to(s.dtype)):
        raise ValueError(f"{spec.name}: scales vary inside a 32-column group (group must be a multiple of 32)")
    z32 = torch.zeros(rb * bn, kb * kw, dtype=torch.uint8, device=dev)
    if zero is not None:
        z = torch.zeros(rb * bn, kb * bk, dtype=torch.uint8, device=dev)
        z[:n, :k] = zero.to(torch.uint8)
        z32 = z[:, ::KPACK]
    rows = torch.tensor([r for r, _ in packed] or [0], device=dev)
    cols = torch.tensor([c for _, c in packed] or [0], device=dev)
    # codes -> (blocks, n8, g, kw, h, hi, t, p) -> (blocks, n8, g, t, kw, e) with e = 4h + 2hi + p
    qb = q.reshape(rb, bn, kb, bk).permute(0, 2, 1, 3)[rows, cols]
    qb = qb.reshape(-1, bn // 8, 8, kw, 2, 2, 4, 2).permute(0, 1, 2, 6, 3, 4, 5, 7).reshape(-1, bn // 8, 32, kw, 8)
    words = torch.zeros(qb.shape[:-1], dtype=torch.int64, device=dev)
    for e, pos in enumerate(ORDER):
        words |= qb[..., e] << (4 * pos)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    sb = s32.reshape(rb, bn, kb, kw).permute(0, 2, 3, 1)[rows, cols]            # (blocks, kw, bn)
    parts = [words.reshape(len(rows), -1).view(torch.uint8), sb.reshape(len(rows), -1).view(torch.uint8)]
    if spec.zero:
        parts.append(z32.reshape(rb, bn, kb, kw).permute(0, 2, 3, 1)[rows, cols].reshape(len(rows), -1))
    wp = torch.cat(parts, 1)
    if not packed:
        wp = torch.zeros_like(wp)
    return wp.contiguous(), table.to(dev)


def unpack_w4(wp: torch.Tensor, table: torch.Tensor, spec: BsrSpec) -> torch.Tensor:
    """Inverse of :func:`pack_w4`: the dense ``(N, K)`` fp16 weight the kernel applies (zero where
    no block is kept)."""
    bn, bk, kw = spec.bn, spec.bk, spec.bk // KPACK
    rec = wp.reshape(wp.shape[0], -1)
    nw = bn * bk // 2
    words = rec[:, :nw].contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    q = torch.stack([(words >> (4 * pos)) & 0xF for pos in ORDER], -1)           # (blocks, n8*32*kw, 8)
    q = q.reshape(-1, bn // 8, 8, 4, kw, 2, 2, 2).permute(0, 1, 2, 4, 5, 6, 3, 7).reshape(-1, bn, bk)
    s32 = rec[:, nw:nw + 2 * kw * bn].contiguous().view(_act(spec)).reshape(-1, kw, bn)
    z32 = rec[:, nw + 2 * kw * bn:].reshape(-1, kw, bn) if spec.zero else None
    scale = s32.permute(0, 2, 1).repeat_interleave(KPACK, 2)
    zero = z32.permute(0, 2, 1).repeat_interleave(KPACK, 2) if z32 is not None else None
    blocks = dequantize_w4(q, scale, zero, _act(spec))
    head, kidx = table_parts(table, spec)
    pad = torch.zeros(spec.row_blocks * bn, spec.k_blocks * bk, dtype=_act(spec), device=wp.device)
    for row, first, count in head:
        for j in range(first, first + count):
            pad[row * bn:(row + 1) * bn, kidx[j] * bk:(kidx[j] + 1) * bk] = blocks[j]
    return pad[: spec.n, : spec.k].contiguous()
