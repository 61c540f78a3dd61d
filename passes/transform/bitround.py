"""Bit rounding: round every kept element's bits up to a width the hardware runs, and
enumerate how to group the widths into sub-TeSAs.

With supported widths present in a tensor ``w1 < w2 < … < wk``, a grouping is a split of
that sorted list into consecutive runs; each run becomes one sub-TeSA at its widest width
(the run ``{4, 8}`` stores 4-bit elements at 8 bits). ``k`` widths give ``2^(k-1)``
options, among them "one sub-TeSA per width" and "everything at the widest width".
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ...tesa import TeSA


@dataclass(frozen=True)
class BitGroup:
    bits: int              # the width this group runs at
    tesa: TeSA             # kept elements of the group, at ``bits``


def round_bits(tesa: TeSA, widths: list[int]) -> TeSA:
    """Each kept element's bits rounded up to the smallest width in ``widths`` holding it."""
    widths = sorted(widths)
    bits = tesa.view().to(torch.int16)
    out = torch.zeros_like(bits)
    lower = 0
    for w in widths:
        out = torch.where((bits > lower) & (bits <= w), torch.full_like(bits, w), out)
        lower = w
    out = torch.where(bits > widths[-1], torch.full_like(bits, widths[-1]), out)
    return TeSA(out.to(torch.uint8), _trusted=True)


def groupings(tesa: TeSA, widths: list[int]) -> list[list[BitGroup]]:
    """Every way to group the rounded widths into sub-TeSAs (finest first, widest last)."""
    rounded = round_bits(tesa, widths)
    present = sorted(b for b in rounded.bit_histogram() if b)
    if not present:
        return [[]]
    options = []
    for cuts in itertools.product([False, True], repeat=len(present) - 1):
        runs, run = [], [present[0]]
        for w, cut in zip(present[1:], cuts):
            if cut:
                runs.append(run)
                run = [w]
            else:
                run.append(w)
        runs.append(run)
        bits = rounded.view()
        groups = []
        for r in runs:
            sel = (bits >= r[0]) & (bits <= r[-1])
            groups.append(BitGroup(r[-1], TeSA.from_mask(sel, r[-1])))
        options.append(groups)
    options.sort(key=len, reverse=True)
    return options
