"""The torch side of ``templates/cuda_bsr.py``: block masks, the block table, packing of the kept
blocks (fp16 or int8 codes) and the references the kernels are tested against.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .cuda_bsr import BsrSpec


def block_mask_of(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """(row_blocks, k_blocks) bool: which ``bn × bk`` blocks of ``w`` hold a nonzero."""
    n, k = w.shape
    pad = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk, dtype=w.dtype, device=w.device)
    pad[:n, :k] = w
    return pad.reshape(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk).ne(0).any(dim=(1, 3))


def build_table(block_mask: torch.Tensor, groups: int = 0) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Table (int32: per slot row, first packed block, count; then the packed blocks' K
    indices) and the packed order of kept blocks. Slots are sorted by decreasing count.

    ``groups > 0`` (the streaming grid): slots are dealt to ``groups`` groups, heaviest first to the
    lightest group (a row costs its blocks plus one for its output tile), each group's slots
    contiguous; (first slot, first packed block) per group and an end mark follow the slots."""
    mask = block_mask.cpu().bool()
    counts = mask.sum(dim=1).tolist()
    order = sorted(range(len(counts)), key=lambda r: (-counts[r], r))
    if groups:
        bins: list[list[int]] = [[] for _ in range(groups)]
        load = [0] * groups
        for r in order:
            g = min(range(groups), key=lambda i: (load[i], i))
            bins[g].append(r)
            load[g] += counts[r] + 1
        order = [r for b in bins for r in b]
    head, kidx, packed = [], [], []
    for r in order:
        ks = torch.nonzero(mask[r]).flatten().tolist()
        head += [r, len(packed), len(ks)]
        packed += [(r, kb) for kb in ks]
        kidx += ks
    tail = []
    if groups:
        slot, first = 0, 0
        for b in bins:
            tail += [slot, first]
            slot, first = slot + len(b), first + sum(counts[r] for r in b)
        tail += [slot, first]
    return torch.tensor(head + tail + kidx, dtype=torch.int32), packed


def table_parts(table: torch.Tensor, spec: BsrSpec) -> tuple[list[list[int]], list[int]]:
    """``(slots, kidx)`` of a table: (row, first packed block, count) per slot, the K index per packed block."""
    head = table[: 3 * spec.row_blocks].reshape(-1, 3).tolist()
    return head, table[spec.table_head:].tolist()


def pack_weight(w: torch.Tensor, spec: BsrSpec, block_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Wp, table)``: the kept ``bn × bk`` blocks of ``w`` (zero-padded at the edges), fp16
    (int8 codes for ``dtype="int8"``), contiguous in table order, and the int32 table. ``Wp`` has
    at least one block."""
    table, packed = build_table(block_mask, spec.groups)
    n, k = w.shape
    dtype = torch.int8 if spec.dtype == "int8" else torch.float16
    pad = torch.zeros(spec.row_blocks * spec.bn, spec.k_blocks * spec.bk, dtype=dtype, device=w.device)
    pad[:n, :k] = w
    blocks = pad.reshape(spec.row_blocks, spec.bn, spec.k_blocks, spec.bk).permute(0, 2, 1, 3)
    if packed:
        rows = torch.tensor([r for r, _ in packed], device=w.device)
        cols = torch.tensor([c for _, c in packed], device=w.device)
        wp = blocks[rows, cols].contiguous()
    else:
        wp = torch.zeros(1, spec.bn, spec.bk, dtype=dtype, device=w.device)
    return wp, table.to(w.device)


def unpack_weight(wp: torch.Tensor, table: torch.Tensor, spec: BsrSpec) -> torch.Tensor:
    """Inverse of :func:`pack_weight`: the dense ``(N, K)`` fp16 weight, zero where no block is kept."""
    head, kidx = table_parts(table, spec)
    pad = torch.zeros(spec.row_blocks * spec.bn, spec.k_blocks * spec.bk, dtype=wp.dtype, device=wp.device)
    for row, first, count in head:
        for j in range(first, first + count):
            kb = kidx[j]
            pad[row * spec.bn:(row + 1) * spec.bn, kb * spec.bk:(kb + 1) * spec.bk] = wp[j]
    return pad[: spec.n, : spec.k].contiguous()


def reference(x: torch.Tensor, w: torch.Tensor, block_mask: torch.Tensor | None, bias: torch.Tensor | None,
              act: str, bn: int, bk: int, out_scale: float | None = None) -> torch.Tensor:
    """What the kernel computes, in fp32 from the fp16 operands, rounded to fp16 at the end (or, with
    ``out_scale``, requantised to int8 codes: ``out="int8"``)."""
    w = w.float()
    if block_mask is not None:
        keep = block_mask.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[: w.shape[0], : w.shape[1]]
        w = w * keep.to(w.device)
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return _output(_activate(y, act), out_scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 codes and fp32 scales (activations per token; weights per channel)."""
    scale = x.float().abs().amax(-1).clamp_min(1e-12) * (1.0 / 127.0)   # the reciprocal, as the kernel does
    return torch.round(x.float() / scale[..., None]).clamp(-127, 127).to(torch.int8), scale


def requantize(y: torch.Tensor, scale: float) -> torch.Tensor:
    """int8 codes of ``y`` at one static scale, as the ``out="int8"`` epilogue computes them: round(y · RN(1/scale))
    in fp32 (half to even), clamped to ±127."""
    r = out_scale_arg(scale)[1].to(y.device)
    return torch.round(y.float() * r).clamp(-127, 127).to(torch.int8)


def out_scale_arg(scale: float) -> torch.Tensor:
    """The ``OS`` argument of an ``out="int8"`` kernel: fp32 [scale, RN(1 / scale)]."""
    s = torch.tensor([scale], dtype=torch.float32)
    if not (torch.isfinite(s).all() and s.item() > 0):
        raise ValueError(f"an output scale must be a positive finite number, got {scale!r}")
    return torch.cat([s, 1.0 / s])


def reference_int8(xq, xs, wq, ws, block_mask, bias, act: str, bn: int, bk: int,
                   out_scale: float | None = None) -> torch.Tensor:
    """What the W8A8 kernel computes: exact int32 dot products, scaled in fp32, fp16 out (or, with
    ``out_scale``, int8 codes)."""
    w = wq.double()
    if block_mask is not None:
        keep = block_mask.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[: w.shape[0], : w.shape[1]]
        w = w * keep.to(w.device)
    y = (xq.double() @ w.t()).float() * xs.float()[:, None] * ws.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return _output(_activate(y, act), out_scale)


def _output(y: torch.Tensor, out_scale: float | None) -> torch.Tensor:
    return y.half() if out_scale is None else requantize(y, out_scale)


# The epilogue's GELUs (``cuda_bsr_parts.gelu_erf`` / ``gelu_tanh``) and their fp32 twins here. Exact GELU:
# h = ½·erfc(|x|/√2) by Abramowitz & Stegun 7.1.26 (erf(a) = 1 - t·P(t)·exp(-a²), t = 1/(1 + p·a), |error| <= 1.5e-7).
AS_P = 0.3275911
AS_COEFFS = (1.061405429, -1.453152027, 1.421413741, -0.284496736, 0.254829592)
# folded for GELU: t = 1/(1 + GELU_ERF_T·|x|), h = t·P(t)·2^(GELU_ERF_EX2·x²) with P's coefficients halved (the ½)
GELU_ERF_T, GELU_ERF_EX2 = AS_P / math.sqrt(2), -0.5 / math.log(2)
GELU_ERF_POLY = tuple(c / 2 for c in AS_COEFFS)
GELU_TANH_K = (-2 / math.log(2) * math.sqrt(2 / math.pi), -2 / math.log(2) * math.sqrt(2 / math.pi) * 0.044715)


def gelu_erf_fast(x: torch.Tensor) -> torch.Tensor:
    """The kernels' exact GELU in fp32 (torch's exp2 and division for the SFU's ``ex2`` / ``rcp``): relu(x) - |x|·h."""
    x = x.float()
    t = 1 / (1 + torch.tensor(GELU_ERF_T) * x.abs())
    poly = torch.full_like(x, GELU_ERF_POLY[0])
    for c in GELU_ERF_POLY[1:]:
        poly = poly * t + c
    h = t * poly * torch.exp2(x * torch.tensor(GELU_ERF_EX2) * x)
    return x.clamp_min(0) - x.abs() * h


def gelu_tanh_fast(x: torch.Tensor) -> torch.Tensor:
    """The kernels' tanh-form GELU in fp32: x·σ(2u) = x / (1 + 2^w), w = -2·log2(e)·√(2/π)(x + 0.044715x³)."""
    x = x.float()
    return x / (1 + torch.exp2(x * (GELU_TANH_K[0] + GELU_TANH_K[1] * (x * x))))


def _activate(y: torch.Tensor, act: str) -> torch.Tensor:
    if act == "relu":
        return torch.relu(y)
    if act == "gelu":
        return torch.nn.functional.gelu(y, approximate="tanh")
    if act == "gelu_erf":
        return torch.nn.functional.gelu(y)
    return y
