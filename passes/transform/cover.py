"""Weighted block cover: cover every kept element of a 2-D mask with grid-aligned blocks.

Candidates are the blocks of each shape on its own aligned grid (edge blocks may stick
out of the tensor: the kernel pads them). Greedy weighted set cover: repeatedly take the
block with the lowest cost per newly covered kept element (lazy priority queue), which
is within ``H(max block size)`` of the optimum. Several shapes mix freely (32×32 blocks
where the mask is dense, 1×1 for stragglers).

Overlap is allowed but harmless: every kept element is *assigned* to exactly one block
(the first chosen that covers it), so each shape's sub-mask holds only its assigned
elements and the sub-operators' partial sums add up exactly once.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch


@dataclass
class ShapeCover:
    """The blocks of one shape in a cover, and the elements assigned to them."""

    shape: tuple[int, int]
    blocks: torch.Tensor      # bool grid (ceil(H/bh), ceil(W/bw)): chosen blocks
    assigned: torch.Tensor    # bool (H, W): kept elements this shape computes
    cost: float               # sum of block costs
    unit: tuple[int, int] = (1, 1)   # ``assigned`` (and a 1×1 shape's ``blocks``) hold one value per unit × unit

    @property
    def n_blocks(self) -> int:
        return int(torch.count_nonzero(self.blocks)) * (self.unit[0] * self.unit[1] if self.shape == (1, 1) else 1)

    @property
    def nnz(self) -> int:
        """Kept elements this shape computes."""
        return int(torch.count_nonzero(self.assigned)) * self.unit[0] * self.unit[1]

    def elements(self, bits: int):
        """The TeSA of the elements this shape computes, at ``bits`` (held by units where the cover ran on them)."""
        from ...tesa import TeSA
        if self.unit == (1, 1):
            return TeSA.from_mask(self.assigned, bits)
        return TeSA.from_blocks(self.assigned, self.unit, bits)


ROUNDS = 32  # vectorised greedy rounds before the heap takes over (each costs one pass per shape)


def _grid_counts(mask: torch.Tensor, bh: int, bw: int) -> torch.Tensor:
    """Kept elements per grid block (edge blocks sticking out count what is inside)."""
    h, w = mask.shape
    gh, gw = -(-h // bh), -(-w // bw)
    if (gh * bh, gw * bw) != (h, w):
        padded = torch.zeros(gh * bh, gw * bw, dtype=torch.bool)
        padded[:h, :w] = mask
        mask = padded
    rows = mask.contiguous().view(torch.uint8).reshape(gh * bh, gw, bw).sum(-1, dtype=torch.int32)
    return rows.reshape(gh, bh, gw).sum(1)


def block_cover(mask: torch.Tensor, costs: dict[tuple[int, int], float]) -> list[ShapeCover]:
    """Greedy min-cost cover of ``mask`` (2-D bool) by blocks priced ``costs[(bh, bw)]``."""
    if mask.dim() != 2:
        raise ValueError(f"block cover needs a 2-D mask, got shape {tuple(mask.shape)}")
    if not costs:
        raise ValueError("block cover needs at least one block shape")
    h, w = mask.shape
    shapes = sorted(costs, key=lambda s: -s[0] * s[1])
    uncovered = mask.clone()
    chosen = {s: torch.zeros(math.ceil(h / s[0]), math.ceil(w / s[1]), dtype=torch.bool) for s in shapes}
    assigned = {s: torch.zeros(h, w, dtype=torch.bool) for s in shapes}
    total = {s: 0.0 for s in shapes}
    fine = [s for s in shapes if s == (1, 1)]
    coarse = [s for s in shapes if s != (1, 1)]
    fine_ratio = costs[(1, 1)] if fine else math.inf
    if len(coarse) == 1:  # one grid: blocks never overlap, each is taken on its own merit
        s = coarse[0]
        counts = _grid_counts(mask, *s)
        take = (counts > 0) & (costs[s] / counts.clamp_min(1) < fine_ratio)
        chosen[s] = take
        inside = take.repeat_interleave(s[0], 0).repeat_interleave(s[1], 1)[:h, :w]
        assigned[s] = mask & inside
        total[s] = costs[s] * int(torch.count_nonzero(take))
        uncovered = mask & ~inside
        coarse = []
    # Greedy in rounds while the best ratio is shared by many blocks of one grid: those are
    # disjoint, so greedy would take them one after the other anyway (their counts cannot change
    # in between); the lazy heap then finishes the few remaining choices.
    for _ in range(ROUNDS if coarse else 0):
        ratios = {}
        for s in coarse:
            counts = _grid_counts(uncovered, *s)
            ratios[s] = torch.where(counts > 0, costs[s] / counts.clamp_min(1).to(torch.float64), math.inf)
        s = min(coarse, key=lambda s: float(ratios[s].min()) if ratios[s].numel() else math.inf)
        best = float(ratios[s].min()) if ratios[s].numel() else math.inf
        take = ratios[s] == best
        if best >= fine_ratio:
            break
        inside = take.repeat_interleave(s[0], 0).repeat_interleave(s[1], 1)[:h, :w]
        chosen[s] |= take
        assigned[s] |= uncovered & inside
        total[s] += costs[s] * int(torch.count_nonzero(take))
        uncovered &= ~inside
    heap = []
    for s in coarse:
        counts = _grid_counts(uncovered, *s)
        idx = torch.nonzero(counts > 0)
        for (i, j), c in zip(idx.tolist(), counts[counts > 0].tolist()):
            heapq.heappush(heap, (costs[s] / c, c, s, i, j))
    remaining = int(torch.count_nonzero(uncovered))
    while heap and remaining > 0:
        ratio, count, s, i, j = heapq.heappop(heap)
        if ratio >= fine_ratio:
            break
        bh, bw = s
        window = uncovered[i * bh:(i + 1) * bh, j * bw:(j + 1) * bw]
        now = int(window.sum())
        if now == 0:
            continue
        if now != count:  # stale: re-queue with the current count
            heapq.heappush(heap, (costs[s] / now, now, s, i, j))
            continue
        chosen[s][i, j] = True
        assigned[s][i * bh:(i + 1) * bh, j * bw:(j + 1) * bw] = window
        total[s] += costs[s]
        window.zero_()
        remaining -= now
    if remaining > 0:
        if not fine:
            raise ValueError("the candidate blocks cannot cover every kept element")
        chosen[(1, 1)] |= uncovered
        assigned[(1, 1)] |= uncovered
        total[(1, 1)] += costs[(1, 1)] * int(torch.count_nonzero(uncovered))
    return [ShapeCover(s, chosen[s], assigned[s], total[s]) for s in shapes if chosen[s].any()]


def block_cover_by_blocks(grid: torch.Tensor, block: tuple[int, int],
                          costs: dict[tuple[int, int], float]) -> list[ShapeCover]:
    """:func:`block_cover` of the mask that keeps the ``block``-shaped blocks ``grid`` (bool) keeps, run on units of
    the coarsest grid every candidate shape aligns with (each kept unit is whole, so the greedy takes the same blocks;
    1×1 elements are priced per unit). The covers hold ``assigned`` per unit (``ShapeCover.unit``)."""
    coarse = [s for s in costs if s != (1, 1)]
    gh = math.gcd(block[0], *(s[0] for s in coarse))
    gw = math.gcd(block[1], *(s[1] for s in coarse))
    if (1, 1) in costs and (gh, gw) in coarse:      # a shape of one unit would read as the 1×1 one: halve the unit
        gh, gw = (gh, gw // 2) if gw % 2 == 0 else (gh // 2, gw) if gh % 2 == 0 else (1, 1)
    if (gh, gw) == (1, 1):
        mask = grid.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
        return block_cover(mask, costs)
    mask = grid.repeat_interleave(block[0] // gh, 0).repeat_interleave(block[1] // gw, 1)
    scaled = {((s[0] // gh, s[1] // gw) if s != (1, 1) else s): c * (gh * gw if s == (1, 1) else 1)
              for s, c in costs.items()}
    back = {(s[0] // gh, s[1] // gw) if s != (1, 1) else s: s for s in costs}
    return [ShapeCover(back[c.shape], c.blocks, c.assigned, c.cost, (gh, gw)) for c in block_cover(mask, scaled)]


def cover_cost(cover: list[ShapeCover]) -> float:
    return sum(c.cost for c in cover)


def check_cover(mask: torch.Tensor, cover: list[ShapeCover]) -> None:
    """Raise AssertionError unless every kept element is assigned exactly once, inside a chosen block."""
    count = torch.zeros(mask.shape, dtype=torch.int32)
    for c in cover:
        bh, bw = c.shape
        inside = c.blocks.repeat_interleave(bh, 0).repeat_interleave(bw, 1)[: mask.shape[0], : mask.shape[1]]
        assert not (c.assigned & ~inside).any(), f"{c.shape}: element assigned outside its blocks"
        count += c.assigned.to(torch.int32)
    assert torch.equal(count > 0, mask), "cover misses kept elements or assigns pruned ones"
    assert (int(count.max()) if count.numel() else 0) <= 1, "an element is assigned twice"
