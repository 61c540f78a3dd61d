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


def random_inputs(graph: Graph, seed: int = 0, sizes: dict[str, int] | None = None) -> tuple[torch.Tensor, ...]:
    """Random user inputs for ``graph`` (integer inputs within the range seen at capture); ``sizes`` sets the
    graph's dynamic dimensions by symbol (default: the example's)."""
    gen = torch.Generator().manual_seed(seed)
    ranges = graph.meta.get("input_ranges", {})
    out = []
    for v in map(graph.tensor, graph.inputs):
        shape = list(v.shape)
        for d, sym in graph.dynamic_dims_of(v.name).items():
            shape[d] = (sizes or {}).get(sym, shape[d])
        tesa = v.tesa if tuple(shape) == v.shape else None
        out.append(random_like(tuple(shape), v.dtype, tesa, gen, ranges.get(v.name, (0, 2))))
    return tuple(out)


def verification_sizes(graph: Graph, trials: int) -> list[dict[str, int] | None]:
    """The dynamic dimensions' sizes of each verification trial: the example's, then one row or token, then odd
    sizes past the example within the captured range; ``[None] * trials`` for a static graph."""
    dims = graph.meta.get("dynamic_dims", {})
    if not dims:
        return [None] * trials
    ranges = graph.meta.get("dim_ranges", {})
    hint = {sym: graph.tensor(t).shape[d] for sym, (t, d) in dims.items()}

    def within(sym, size):
        hi = ranges.get(sym, [None, None])[1]
        return max(1, min(size, hi) if hi is not None else size)
    plans = [None, {sym: 1 for sym in dims}, {sym: within(sym, hint[sym] + 3) for sym in dims},
             {sym: within(sym, 2 * hint[sym] + 1) for sym in dims}]
    return [plans[i % len(plans)] for i in range(max(trials, 3))]
