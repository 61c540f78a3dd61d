"""A planned linear's kept blocks read from the plan's block covers, and its kept blocks packed straight from the
weight in its own dtype: what selection and the block-sparse build need, without an fp32 masked copy of the weight.

Both give exactly what the dense path gives (``block_mask_of`` / ``pack_weight`` of ``torch.where(kept, W, 0)``):
a block is kept where the cover keeps an element of it and one kept element is nonzero (only the covered blocks'
values are read). Where the covers are not held by blocks of one shape that the kernel's blocks nest on (or the op
is not a ``linear``), :func:`keep_grid` answers None and callers take the dense path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..graph import Op
from ..passes.transform.plan import OpPlan


@dataclass
class KeepGrid:
    """The weight elements an op's sub-operators compute: ``grid`` (bool, one per ``block``; None: every element)."""

    grid: torch.Tensor | None
    block: tuple[int, int]
    n: int
    k: int

    def all(self) -> bool:
        return self.grid is None or bool(self.grid.all())

    def rows(self, start: int, end: int) -> KeepGrid:
        """The grid of weight rows ``start:end`` (block-aligned)."""
        b0 = self.block[0]
        return KeepGrid(None if self.grid is None else self.grid[start // b0:end // b0], self.block, end - start,
                        self.k)

    def fits(self, bn: int, bk: int, gate_n: int = 0) -> bool:
        """Whether ``bn × bk`` kernel blocks (a gated kernel's halves of ``gate_n`` rows each) nest on the grid."""
        return bn % self.block[0] == 0 and bk % self.block[1] == 0 and gate_n % self.block[0] == 0

    def padded(self, bn: int, bk: int) -> torch.Tensor:
        """(R, bn/b0, C, bk/b1) bool: the grid padded to whole ``bn × bk`` blocks, by kernel block."""
        b0, b1 = self.block
        rows, cols = -(-self.n // bn), -(-self.k // bk)
        out = torch.zeros(rows * bn // b0, cols * bk // b1, dtype=torch.bool)
        out[: self.n // b0, : self.k // b1] = True if self.grid is None else self.grid
        return out.reshape(rows, bn // b0, cols, bk // b1)


def keep_grid(op: Op, op_plan: OpPlan, n: int, k: int) -> KeepGrid | None:
    """The kept elements of a ``linear``'s (N, K) weight by blocks, or None (not a linear, or covers not held by
    blocks of one shape dividing N and K)."""
    if op.op != "linear":
        return None
    grid, block = None, None
    for s in op_plan.subops:
        if s.elements is None:
            return KeepGrid(None, (1, 1), n, k)
        held = s.elements.block_grid()
        if held is None:
            if s.elements.uniform is None:
                return None
            if s.elements.uniform:
                return KeepGrid(None, (1, 1), n, k)
            continue
        bits, b = held
        if (block is not None and b != block) or n % b[0] or k % b[1] or tuple(bits.shape) != (n // b[0], k // b[1]):
            return None
        block, grid = b, (bits != 0) if grid is None else grid | (bits != 0)
    if block is None:                   # no sub-operator computes anything
        return KeepGrid(torch.zeros(1, 1, dtype=torch.bool), (n, k), n, k)
    return KeepGrid(grid, block, n, k)


def _halves(keep: KeepGrid, gate_n: int) -> list[tuple[int, KeepGrid]]:
    """(first weight row, grid) of each independently padded row range: a gated kernel's gate and up halves."""
    if not gate_n:
        return [(0, keep)]
    return [(0, keep.rows(0, gate_n)), (gate_n, keep.rows(gate_n, 2 * gate_n))]


def _gather(rows: torch.Tensor, bn: int, bk: int, ri: torch.Tensor, ci: torch.Tensor) -> torch.Tensor:
    """(len, bn, bk): blocks (ri, ci) of ``rows`` (zero-padded to whole blocks)."""
    n, k = rows.shape
    if n % bn or k % bk or not rows.is_contiguous():
        pad = rows.new_zeros(-(-n // bn) * bn, -(-k // bk) * bk)
        pad[:n, :k] = rows
        rows = pad
    return rows.view(rows.shape[0] // bn, bn, rows.shape[1] // bk, bk)[ri, :, ci, :]


def _kept(sub: torch.Tensor, ri, ci, b0: int, b1: int) -> torch.Tensor | None:
    """(len, bn, bk) bool: the kept elements of blocks (ri, ci); None where every element of them is kept."""
    s = sub[ri, :, ci, :]
    if bool(s.all()):
        return None
    return s.repeat_interleave(b0, 1).repeat_interleave(b1, 2)


def _values(value, start: int, n: int) -> torch.Tensor:
    return value.rows(start, start + n) if hasattr(value, "rows") else value.data[start:start + n]


def kept_block_mask(value, keep: KeepGrid, bn: int, bk: int, gate_n: int = 0) -> torch.Tensor:
    """``block_mask_of`` of the masked weight (a gated kernel's: of ``gate_padded``'s rows, ``gate_n`` = N):
    covered blocks with a kept nonzero, from the covered blocks' values only (``value``: the graph weight)."""
    out = []
    for start, half in _halves(keep, gate_n):
        sub = half.padded(bn, bk)
        mask = sub.any(dim=(1, 3))
        ri, ci = mask.nonzero(as_tuple=True)
        if len(ri):
            blocks = _gather(_values(value, start, half.n), bn, bk, ri, ci).ne(0)
            kept = _kept(sub, ri, ci, *half.block)
            mask[ri, ci] = (blocks if kept is None else blocks & kept).flatten(1).any(dim=1)
        out.append(mask)
    return torch.cat(out)


def packed_blocks(value, keep: KeepGrid, spec, packed: list, dtype: torch.dtype) -> torch.Tensor:
    """``pack_weight``'s ``Wp`` of the masked weight: the blocks ``packed`` lists (``build_table``'s order, in
    ``block_mask_for``'s rows), gathered from ``value`` in ``dtype``, pruned elements zero."""
    bn, bk = spec.bn, spec.bk
    if not packed:
        return torch.zeros(1, bn, bk, dtype=dtype)
    halves = _halves(keep, spec.n if spec.gate else 0)
    per = -(-halves[0][1].n // bn)            # kernel block rows of a half
    r = torch.tensor([p[0] for p in packed])
    c = torch.tensor([p[1] for p in packed])
    out = torch.empty(len(packed), bn, bk, dtype=dtype)
    for h, (start, half) in enumerate(halves):
        pick = ((r // per) == h).nonzero().flatten() if len(halves) > 1 else torch.arange(len(packed))
        if not len(pick):
            continue
        ri, ci = r[pick] - h * per, c[pick]
        blocks = _gather(_values(value, start, half.n), bn, bk, ri, ci).to(dtype)
        kept = _kept(half.padded(bn, bk), ri, ci, *half.block)
        out[pick] = blocks if kept is None else torch.where(kept, blocks, torch.zeros((), dtype=dtype))
    return out


__all__ = ["KeepGrid", "keep_grid", "kept_block_mask", "packed_blocks"]
