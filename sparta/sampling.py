"""Random data that respects TeSAs (fresh inputs for verification and scrambling)."""

from __future__ import annotations

import math

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


def input_kind(graph: Graph, name: str) -> str:
    """How fresh values of input ``name`` are drawn: ``"mask"`` (a bool input, or one named like ``attention_mask``,
    ``padding_mask``), ``"lengths"`` (an integer input named like ``lengths``, ``seq_lens``), ``"ids"`` (other
    integer inputs: token ids, token type and position ids, within the range seen at capture) or ``"values"``."""
    v, lower = graph.tensor(name), name.lower()
    if v.dtype == torch.bool or "mask" in lower:
        return "mask"
    if not v.dtype.is_floating_point and "len" in lower:
        return "lengths"
    return "values" if v.dtype.is_floating_point else "ids"


def padding_mask(shape, dtype, generator=None, pads_marked: bool = False) -> torch.Tensor:
    """A right-padded mask of ``shape``: along the last dimension each row keeps a random number of leading positions,
    at least one (the first row keeps all); kept positions 1 (True), padded 0 (False), or the opposite where
    ``pads_marked`` (a ``key_padding_mask``: True where padded)."""
    if len(shape) == 0:
        keep = torch.tensor(True)
    else:
        rows, length = math.prod(shape[:-1]), shape[-1]
        kept = torch.randint(1, max(length, 1) + 1, (rows,), generator=generator)
        if rows:
            kept[0] = length
        keep = (torch.arange(length)[None, :] < kept[:, None]).reshape(shape)
    return (~keep if pads_marked else keep).to(dtype)


def random_inputs(graph: Graph, seed: int = 0, sizes: dict[str, int] | None = None) -> tuple[torch.Tensor, ...]:
    """Random user inputs for ``graph`` by :func:`input_kind`: masks padded at random (:func:`padding_mask`), lengths
    from 1 to the sequence of the input they describe, ids within the range seen at capture, values never zero.
    ``sizes`` sets the graph's dynamic dimensions by symbol (default: the example's); inputs that share a symbol
    get one size."""
    gen = torch.Generator().manual_seed(seed)
    ranges = graph.meta.get("input_ranges", {})
    shapes = {}
    for v in map(graph.tensor, graph.inputs):
        shape = list(v.shape)
        for d, sym in graph.dynamic_dims_of(v.name).items():
            shape[d] = (sizes or {}).get(sym, shape[d])
        shapes[v.name] = tuple(shape)
    out = []
    for v in map(graph.tensor, graph.inputs):
        shape, kind = shapes[v.name], input_kind(graph, v.name)
        if kind == "mask":
            out.append(padding_mask(shape, v.dtype, gen, pads_marked="pad" in v.name.lower()))
        elif kind == "lengths":
            out.append(random_lengths(shape, v.dtype, sequence_of(shapes, v.name, ranges), gen))
        else:
            tesa = v.tesa if shape == v.shape else None
            out.append(random_like(shape, v.dtype, tesa, gen, ranges.get(v.name, (0, 2))))
    return tuple(out)


def sequence_of(shapes: dict[str, tuple], name: str, ranges: dict) -> int:
    """The sequence length a lengths input ``name`` of shape (batch,) describes: the second dimension of another input
    of that batch, else the largest length seen at capture."""
    batch = shapes[name][0] if shapes[name] else 1
    for other, shape in shapes.items():
        if other != name and len(shape) >= 2 and shape[0] == batch:
            return shape[1]
    return max(1, int(ranges.get(name, (1, 1))[1]))


def random_lengths(shape, dtype, length: int, generator=None) -> torch.Tensor:
    """Lengths from 1 to ``length``, the first ``length`` (one sequence unpadded)."""
    x = torch.randint(1, max(length, 1) + 1, shape, generator=generator)
    if x.numel():
        x.view(-1)[0] = length
    return x.to(dtype)


def verification_sizes(graph: Graph, trials: int) -> list[dict[str, int] | None]:
    """The dynamic dimensions' sizes of each verification trial: the example's, then one row or token, then odd
    sizes past the example within the captured range; ``[None] * trials`` for a static graph. Dimensions of one
    size in the example (a mask's batch and the ids', which export may leave apart) get one size in every trial."""
    dims = graph.meta.get("dynamic_dims", {})
    if not dims:
        return [None] * trials
    ranges = graph.meta.get("dim_ranges", {})
    hint = {sym: graph.tensor(t).shape[d] for sym, (t, d) in dims.items()}

    def within(sym, size):
        hi = ranges.get(sym, [None, None])[1]
        return max(1, min(size, hi) if hi is not None else size)

    def tied(size_of):          # the smallest size any symbol of the same example size may take
        drawn = {sym: within(sym, size_of(hint[sym])) for sym in dims}
        least = {}
        for sym, size in drawn.items():
            least[hint[sym]] = min(least.get(hint[sym], size), size)
        return {sym: least[hint[sym]] for sym in dims}
    plans = [None, {sym: 1 for sym in dims}, tied(lambda n: n + 3), tied(lambda n: 2 * n + 1)]
    return [plans[i % len(plans)] for i in range(max(trials, 3))]
