"""The block table and the packing of kept fp16 / int8 blocks of ``bsr_linear`` kernels (TVM-free)."""

from __future__ import annotations

import torch

from .spec import BsrSpec, gate_padded, gate_unpadded


def block_mask_of(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """(row_blocks, k_blocks) bool: which ``bn × bk`` blocks of ``w`` hold a nonzero."""
    n, k = w.shape
    pad = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk, dtype=w.dtype, device=w.device)
    pad[:n, :k] = w
    return pad.reshape(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk).ne(0).any(dim=(1, 3))


def block_mask_for(w: torch.Tensor, spec: BsrSpec) -> torch.Tensor:
    """The block mask of ``w`` in ``spec``'s packed layout (a gated kernel's: :func:`spec.gate_padded`'s rows)."""
    return block_mask_of(gate_padded(w, spec.n, spec.bn) if spec.gate else w, spec.bn, spec.bk)


def build_table(block_mask: torch.Tensor, groups: int = 0, gate: bool = False
                ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Table (int32: per slot row, first packed block, count; then the packed blocks' K
    indices) and the packed order of kept blocks. Slots are sorted by decreasing count.

    ``gate``: ``block_mask`` has the gate's block rows then the up's; slot ``r`` holds gate row ``r``'s blocks, then
    up row ``r``'s, and a fourth entry, the gate's count.

    ``groups > 0`` (the streaming grid): slots are dealt to ``groups`` groups, heaviest first to the
    lightest group (a row costs its blocks plus one for its output tile), each group's slots
    contiguous; (first slot, first packed block) per group and an end mark follow the slots."""
    mask = block_mask.cpu().bool()
    if gate:
        return _gated_table(mask)
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


def _gated_table(mask: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    rows = mask.shape[0] // 2
    counts = mask.sum(dim=1).tolist()
    order = sorted(range(rows), key=lambda r: (-(counts[r] + counts[rows + r]), r))
    head, kidx, packed = [], [], []
    for r in order:
        gate, up = (torch.nonzero(mask[i]).flatten().tolist() for i in (r, rows + r))
        head += [r, len(packed), len(gate) + len(up), len(gate)]
        packed += [(r, kb) for kb in gate] + [(rows + r, kb) for kb in up]
        kidx += gate + up
    return torch.tensor(head + kidx, dtype=torch.int32), packed


def table_parts(table: torch.Tensor, spec: BsrSpec) -> tuple[list[list[int]], list[int]]:
    """``(slots, kidx)`` of a table: (row, first packed block, count[, gate's count]) per slot, the K index per
    packed block."""
    head = table[: spec.slot_ints * spec.row_blocks].reshape(-1, spec.slot_ints).tolist()
    return head, table[spec.table_head:].tolist()


def table_block_mask(table: torch.Tensor, spec: BsrSpec) -> torch.Tensor:
    """The block mask a table lists (the inverse of :func:`build_table`), in :func:`block_mask_for`'s rows."""
    head, kidx = table_parts(table.cpu(), spec)
    mask = torch.zeros(spec.weight_row_blocks, spec.k_blocks, dtype=torch.bool)
    for row, first, count, *gate in head:
        for j in range(first, first + count):
            mask[row + (spec.row_blocks if gate and j - first >= gate[0] else 0), kidx[j]] = True
    return mask


def pack_weight(w: torch.Tensor, spec: BsrSpec, block_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Wp, table)``: the kept ``bn × bk`` blocks of ``w`` (zero-padded at the edges), fp16
    (int8 codes for ``dtype="int8"``), contiguous in table order, and the int32 table. ``Wp`` has
    at least one block. A gated kernel's ``w`` is ``(2n, K)``, its mask over :func:`block_mask_for`'s rows."""
    table, packed = build_table(block_mask, spec.groups, spec.gate)
    if spec.gate:
        w = gate_padded(w, spec.n, spec.bn)
    n, k = w.shape
    dtype = {"int8": torch.int8, "bfloat16": torch.bfloat16}.get(spec.dtype, torch.float16)
    rb = spec.weight_row_blocks
    pad = torch.zeros(rb * spec.bn, spec.k_blocks * spec.bk, dtype=dtype, device=w.device)
    pad[:n, :k] = w
    blocks = pad.reshape(rb, spec.bn, spec.k_blocks, spec.bk).permute(0, 2, 1, 3)
    if packed:
        rows = torch.tensor([r for r, _ in packed], device=w.device)
        cols = torch.tensor([c for _, c in packed], device=w.device)
        wp = blocks[rows, cols].contiguous()
    else:
        wp = torch.zeros(1, spec.bn, spec.bk, dtype=dtype, device=w.device)
    return wp, table.to(w.device)


def unpack_weight(wp: torch.Tensor, table: torch.Tensor, spec: BsrSpec) -> torch.Tensor:
    """Inverse of :func:`pack_weight`: the dense ``(N, K)`` (gated: ``(2N, K)``) weight, zero where no block is
    kept, on ``wp``'s device (one scatter of every block: a 7B model's ops unpack in milliseconds)."""
    rows, cols = packed_positions(table, spec)
    pad = torch.zeros(spec.weight_row_blocks, spec.k_blocks, spec.bn, spec.bk, dtype=wp.dtype, device=wp.device)
    if rows.numel():
        pad[rows.to(wp.device), cols.to(wp.device)] = wp[: rows.numel()]
    pad = pad.permute(0, 2, 1, 3).reshape(spec.weight_row_blocks * spec.bn, spec.k_blocks * spec.bk)
    if spec.gate:
        return gate_unpadded(pad, spec.n, spec.bn)[:, : spec.k].contiguous()
    return pad[: spec.n, : spec.k].contiguous()


def packed_positions(table: torch.Tensor, spec: BsrSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(block row, K block) of each packed block a table lists, in packed order (gated: the up's rows after the
    gate's, as :func:`block_mask_for`), as int64 tensors on the CPU."""
    table = table.cpu().long()
    head = table[: spec.slot_ints * spec.row_blocks].reshape(-1, spec.slot_ints)
    kidx = table[spec.table_head:]
    row, first, count = head[:, 0], head[:, 1], head[:, 2]
    total = int(count.sum())
    rows = torch.zeros(kidx.numel(), dtype=torch.long)
    if total:
        slot = torch.repeat_interleave(torch.arange(head.shape[0]), count)
        at = torch.repeat_interleave(first, count) + torch.arange(total) - torch.repeat_interleave(
            torch.cumsum(count, 0) - count, count)
        r = row[slot]
        if spec.gate:               # a slot's blocks past the gate's count are the up's rows
            r = r + spec.row_blocks * ((at - first[slot]) >= head[slot, 3]).long()
        rows[at] = r
    return rows, kidx
