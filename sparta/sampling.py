"""Random data that respects TeSAs (fresh inputs for verification and scrambling)."""

from __future__ import annotations

import torch

from .graph import Graph
from .tesa import TeSA


def random_like(shape, dtype, tesa: TeSA | None = None, generator=None, int_range=(0, 2)) -> torch.Tensor:
    """Random values of ``shape``/``dtype``, never zero at kept positions, zero at pruned ones."""
    if dtype.is_floating_point:
        x = torch.randn(shape, generator=generator)
        x = torch.where(x == 0, torch.ones_like(x), x).to(dtype)
    elif dtype == torch.bool:
        x = torch.rand(shape, generator=generator) < 0.5
    else:
        lo, hi = int(int_range[0]), int(int_range[1])
        x = torch.randint(lo, hi + 1, shape, generator=generator).to(dtype)
    if tesa is not None and not tesa.is_dense:
        x = tesa.apply(x)
    return x


def random_inputs(graph: Graph, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random user inputs for ``graph`` (integer inputs within the range seen at capture)."""
    gen = torch.Generator().manual_seed(seed)
    ranges = graph.meta.get("input_ranges", {})
    return tuple(random_like(v.shape, v.dtype, v.tesa, gen, ranges.get(v.name, (0, 2)))
                 for v in map(graph.tensor, graph.inputs))
