"""Which channels of each activation depend on the model's inputs: the analysis channel shrinking plans from.

A channel is *live* if its values depend on the inputs; the others are *dead*: zero (the TeSA prunes the whole
channel) or a constant map the weights alone give (a conv whose filter rows are pruned outputs its bias there, then
a ReLU of it, a BatchNorm's shift...). Dead channels need not be computed: a consumer GEMM adds what they contribute
as a bias (or a bias map where padding makes it vary over positions), and a narrow tensor holds only its *kept*
channels (the live ones; the first channel where none is live, so no tensor is empty).

Channel rules are registered per op type (``@channel_rule("relu", ...)``), each a function of the op and the states
of its inputs returning the state of its output (or None: the op's output is not analysed). GEMMs (linear, conv of
any groups) have their own rule. Ops whose output channels follow their input channels one to one (unary element-
wise ops, binary ones over two tensors of one layout, pooling, a mean over other dims, concatenation along the
channel dim) *link* tensors into regions that planning makes narrow or keeps full as one.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass, field

import torch

from ...graph import Graph, Op

GEMMS = ("linear", "conv1d", "conv2d", "conv3d")
UNARY = ("relu", "gelu", "silu", "tanh", "sigmoid", "hardtanh", "hardswish", "hardsigmoid", "mish", "leaky_relu",
         "elu", "softplus", "relu6", "celu", "selu", "clamp", "clamp_min", "clamp_max", "clone", "dropout", "alias",
         "detach", "_to_copy", "contiguous", "neg", "abs", "square", "exp", "erf")
BINARY = ("add", "sub", "mul", "div", "maximum", "minimum")
POOLS = ("max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d",
         "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool2d")
CHANNEL_RULES: dict = {}


def channel_rule(*op_types: str):
    """Register ``fn(analysis, op, x_state) -> Channels | None`` for ``op_types``."""
    def register(fn):
        for t in op_types:
            CHANNEL_RULES[t] = fn
        return fn
    return register


@dataclass
class Channels:
    """The channels of one tensor along ``axis``: live, zero, kept by a narrow layout, and the dead ones whose values
    may vary over the other dims (``vary``: a padded conv of a nonzero constant)."""

    axis: int
    live: torch.Tensor
    zero: torch.Tensor
    keep: torch.Tensor
    vary: torch.Tensor | None = None

    def __post_init__(self):
        if self.vary is None:
            self.vary = torch.zeros_like(self.live)

    @property
    def constant(self) -> torch.Tensor:
        """Dead channels that are not zero."""
        return ~self.live & ~self.zero

    @property
    def size(self) -> int:
        return int(self.live.numel())


@dataclass
class GemmSite:
    """A linear or convolution whose weight is a constant: what shrinking it needs."""

    op: str
    x: str
    w: str
    b: str | None
    y: str
    groups: int
    kk: int                           # weight elements per (output, input) channel pair
    padded: bool
    dense: bool                       # no weight element pruned
    _used: torch.Tensor | None = None

    def _pairs(self, graph: Graph) -> torch.Tensor:
        """(Cout, Cin / groups): which input channel of its group each output channel reads (kept weights)."""
        v = graph.tesa(self.w).view()
        return v.reshape(v.shape[0], v.shape[1], -1).any(-1)

    def reach(self, graph: Graph, cols: torch.Tensor) -> torch.Tensor:
        """Bool (Cout,): the output channels that read any input channel of ``cols`` (bool (Cin,))."""
        tesa, g = graph.tesa(self.w), self.groups
        if self.dense:
            return cols.reshape(g, -1).any(1).repeat_interleave(tesa.shape[0] // g)
        grid = tesa.block_grid()
        if grid is not None and g == 1 and tesa.ndim == 2:       # held by blocks: reach them by blocks
            blocks, (bh, bw) = grid
            return ((blocks != 0) & cols.reshape(-1, bw).any(1)).any(1).repeat_interleave(bh)
        m = self._pairs(graph)
        if g == 1:
            return m.any(1) if bool(cols.all()) else m[:, cols.bool()].any(1)
        return (m.reshape(g, -1, m.shape[1]) & cols.reshape(g, 1, -1)).any(-1).reshape(-1)

    def used(self, graph: Graph) -> torch.Tensor:
        """Bool (Cin,): the input channels some output channel reads."""
        if self._used is None:
            tesa, g = graph.tesa(self.w), self.groups
            cin = tesa.shape[1] * g
            grid = tesa.block_grid()
            if self.dense:
                self._used = torch.ones(cin, dtype=torch.bool)
            elif grid is not None and g == 1 and tesa.ndim == 2:
                self._used = (grid[0] != 0).any(0).repeat_interleave(grid[1][1])
            else:
                m = self._pairs(graph)
                self._used = m.any(0) if g == 1 else m.reshape(g, -1, m.shape[1]).any(1).reshape(-1)
        return self._used


@dataclass
class Analysis:
    graph: Graph
    spatial_static: bool              # only batch dims are dynamic: dead maps may vary over positions
    states: dict[str, Channels] = field(default_factory=dict)
    gemms: dict[str, GemmSite] = field(default_factory=dict)
    links: dict[str, list[str]] = field(default_factory=dict)   # link op -> its analysed inputs (output: op.outputs[0])
    parent: dict[str, str] = field(default_factory=dict)

    def state(self, name: str, axis: int) -> Channels:
        """The analysed state of ``name`` along ``axis``, else its TeSA's (no dead channel but zero ones)."""
        s = self.states.get(name)
        if s is not None and s.axis == axis:
            return s
        return from_tesa(self.graph, name, axis)

    def region(self, name: str) -> str:
        while self.parent.get(name, name) != name:
            name = self.parent[name]
        return name

    def link(self, a: str, b: str) -> None:
        ra, rb = self.region(a), self.region(b)
        if ra != rb:
            self.parent[rb] = ra


def from_tesa(graph: Graph, name: str, axis: int) -> Channels:
    t = graph.tesa(name)
    c = t.shape[axis]
    if t.is_dense:
        live = torch.ones(c, dtype=torch.bool)
    else:
        live = t.mask.movedim(axis, 0).reshape(c, -1).any(1)
    return Channels(axis, live, ~live, _keep(live))


def _keep(live: torch.Tensor) -> torch.Tensor:
    keep = live.clone()
    if live.numel() and not bool(live.any()):
        keep[0] = True
    return keep


def _channel_zero(graph: Graph, name: str, axis: int) -> torch.Tensor:
    return ~from_tesa(graph, name, axis).live


def gemm_site(graph: Graph, op: Op) -> GemmSite | None:
    """The op as a :class:`GemmSite`, or None (not a linear/conv over a constant weight of that form)."""
    if op.op not in GEMMS or len(op.outputs) != 1:
        return None
    x, w, b = op.input_of("input"), op.input_of("weight"), op.input_of("bias")
    if x is None or w is None:
        return None
    wv = graph.tensor(w)
    if wv.kind != "weight" or not wv.has_data or not wv.dtype.is_floating_point:
        return None
    if b is not None and (graph.tensor(b).kind != "weight" or not graph.tensor(b).has_data):
        return None
    if w in graph.stacked_weights:
        return None                                   # sibling linears stacked into one: left as they are
    if op.op == "linear":
        if len(wv.shape) != 2:
            return None
        return GemmSite(op.name, x, w, b, op.outputs[0], 1, 1, False, graph.tesa(w).is_dense)
    if op.attrs.get("transposed") or len(graph.tensor(x).shape) != len(wv.shape):
        return None                                   # unbatched convolutions stay as they are
    padding = op.attrs.get("padding", 0)
    padded = isinstance(padding, str) and padding != "valid" or any(int(p) for p in
                                                                        (padding if isinstance(padding, (list, tuple))
                                                                         else [padding]))
    return GemmSite(op.name, x, w, b, op.outputs[0], int(op.attrs.get("groups", 1)), math.prod(wv.shape[2:]), padded,
                    graph.tesa(w).is_dense)


def axis_of(graph: Graph, op: Op) -> int:
    """The channel dim a GEMM reads and writes: a linear's last, a convolution's second."""
    return len(graph.tensor(op.outputs[0]).shape) - 1 if op.op == "linear" else 1


def _settle(an: Analysis, y: str, s: Channels) -> Channels:
    """``s`` for tensor ``y``: TeSA-zero channels dead; dead maps that vary over a dynamic dim computed (live)."""
    zero = _channel_zero(an.graph, y, s.axis)
    live = s.live & ~zero
    if not an.spatial_static:
        live = live | (s.vary & ~zero)
    return Channels(s.axis, live, zero, _keep(live), s.vary & ~live & ~zero)


def _gemm(an: Analysis, site: GemmSite, op: Op) -> Channels:
    graph = an.graph
    axis = axis_of(graph, op)
    xs = an.state(site.x, axis)
    cout = graph.tensor(site.y).shape[axis]
    live = site.reach(graph, xs.live)
    src = xs.constant & (xs.vary | site.padded)          # inputs whose contribution varies over positions
    vary = site.reach(graph, src) if bool(src.any()) else torch.zeros(cout, dtype=torch.bool)
    return _settle(an, site.y, Channels(axis, live, live, live, vary))


@channel_rule(*UNARY, *POOLS, *BINARY)      # binary ops: with a number as the other operand
def _unary(an: Analysis, op: Op, xs: Channels) -> Channels | None:
    y = an.graph.tensor(op.outputs[0])
    if len(y.shape) <= xs.axis or y.shape[xs.axis] != xs.size:
        return None
    padding = op.attrs.get("padding", 0)
    padded = op.op in POOLS and any(int(p) for p in (padding if isinstance(padding, (list, tuple)) else [padding]))
    return Channels(xs.axis, xs.live, xs.zero, xs.keep, xs.vary | (xs.constant if padded else xs.vary))


@channel_rule("mean")
def _mean(an: Analysis, op: Op, xs: Channels) -> Channels | None:
    dims = op.attrs.get("dim")
    n = len(an.graph.tensor(op.inputs[0]).shape)
    if not dims:
        return None
    dims = sorted(d % n for d in dims)
    if xs.axis in dims or not (op.attrs.get("keepdim") or dims[0] > xs.axis):
        return None
    return Channels(xs.axis, xs.live, xs.zero, xs.keep, xs.vary & (len(dims) < n - 2))


def _binary(an: Analysis, op: Op) -> tuple[Channels, list[str]] | None:
    acts = [t for t in op.inputs if an.graph.tensor(t).kind != "weight"]
    if len(acts) != len(op.inputs) or not acts or len(acts) > 2:
        return None
    shapes = {an.graph.tensor(t).shape for t in acts} | {an.graph.tensor(op.outputs[0]).shape}
    known = [t for t in acts if t in an.states]
    if len(shapes) != 1 or not known:
        return None
    axis = an.states[known[0]].axis
    ss = [an.state(t, axis) for t in acts]
    live = ss[0].live.clone()
    for s in ss[1:]:
        live = (live | s.live) & ~(ss[0].zero | s.zero) if op.op == "mul" else live | s.live
    vary = ss[0].vary.clone()
    for s in ss[1:]:
        vary = vary | s.vary
    out = Channels(axis, live, live, live, vary)
    linked = [t for t, s in zip(acts, ss) if t in an.states and an.states[t].axis == axis and torch.equal(s.live, live)]
    return out, linked if len(linked) == len(acts) else []


def _cat(an: Analysis, op: Op) -> tuple[Channels, list[str]] | None:
    tensors = [t for r, t in zip(op.roles, op.inputs) if r.startswith("tensors")]
    y = an.graph.tensor(op.outputs[0])
    axis = int(op.attrs.get("dim", 0)) % len(y.shape)
    if len(tensors) != len(op.inputs) or not any(t in an.states and an.states[t].axis == axis for t in tensors):
        return None
    ss = [an.state(t, axis) for t in tensors]
    out = Channels(axis, torch.cat([s.live for s in ss]), torch.cat([s.zero for s in ss]),
                   torch.cat([s.keep for s in ss]), torch.cat([s.vary for s in ss]))
    return out, [t for t in tensors if t in an.states and an.states[t].axis == axis]


def needs_analysis(graph: Graph) -> bool:
    """Whether any GEMM's weight or any input prunes something (else every channel is live)."""
    for op in graph.ops(GEMMS):
        site = gemm_site(graph, op)
        if site is not None and not site.dense:
            return True
    return any(not graph.tesa(t).is_dense for t in graph.inputs)


def analyse(graph: Graph) -> Analysis:
    """The channel states of every tensor downstream of a GEMM, in one pass in topological order."""
    dims = graph.meta.get("dynamic_dims", {})
    an = Analysis(graph, all(int(d) == 0 for _, d in dims.values()))
    for op in graph.ops():
        site = gemm_site(graph, op)
        if site is not None:
            an.gemms[op.name] = site
            an.states[site.y] = _gemm(an, site, op)
            continue
        result = None
        if op.op in ("cat", "concat"):
            result = _cat(an, op)
        elif op.op in BINARY and len([t for t in op.inputs if graph.tensor(t).kind != "weight"]) == 2:
            result = _binary(an, op)
        elif op.op in CHANNEL_RULES and len(op.outputs) >= 1 and op.inputs and op.inputs[0] in an.states \
                and all(graph.tensor(t).kind == "weight" for t in op.inputs[1:]) and len(op.inputs) == 1:
            xs = an.states[op.inputs[0]]
            s = CHANNEL_RULES[op.op](an, op, xs)
            result = (s, [op.inputs[0]]) if s is not None else None
        if result is None or any(t in graph.outputs for t in op.outputs[1:]) or \
                any(graph.consumers(t) for t in op.outputs[1:]):
            continue
        s, linked = result
        y = op.outputs[0]
        settled = _settle(an, y, s)
        if linked and torch.equal(settled.live, s.live):
            settled.keep = s.keep if op.op in ("cat", "concat") else an.states[linked[0]].keep
            an.links[op.name] = linked
            for t in linked:
                an.link(t, y)
        an.states[y] = settled
    return an


def pack(mask: torch.Tensor) -> str:
    """A bool vector as base64 of its packed bits."""
    import numpy as np
    return base64.b64encode(np.packbits(mask.numpy().astype(bool)).tobytes()).decode()


def unpack(text: str, n: int) -> torch.Tensor:
    import numpy as np
    bits = np.unpackbits(np.frombuffer(base64.b64decode(text), dtype=np.uint8))[:n]
    return torch.from_numpy(bits.astype(bool))


__all__ = [
    "CHANNEL_RULES",
    "Analysis",
    "Channels",
    "GemmSite",
    "analyse",
    "axis_of",
    "channel_rule",
    "from_tesa",
    "gemm_site",
    "needs_analysis",
    "pack",
    "unpack",
]
