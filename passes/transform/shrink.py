"""Channel shrinking as a plan option: GEMMs that compute only the channels that depend on the inputs.

From the channel analysis (``channels.py``), each *region* of tensors linked by channel-preserving ops is either
*narrow* (holding only its kept channels) or full. A GEMM reading a narrow tensor slices its weight's input channels,
one writing a narrow tensor its output channels; a GEMM reading a full tensor with dead or unused channels may gather
the ones it needs first. What the dropped channels contribute becomes the GEMM's bias (a bias map where padding makes
it vary). Where a narrow tensor meets an op that needs it whole (or another layout), the plan converts it: a gather
(``index_select``) or a scatter (pad with a zero channel, ``index_select``, add the constants), only at the regions'
boundaries.

The choice is by the cost model: a shrunk GEMM costs the dense GEMM of its smaller sizes, a channel-preserving op its
share of the channels, a conversion a pass over its tensors; the existing plan (block-sparse kernels or dense) is the
cost of a GEMM left whole. Regions are toggled narrow/full greedily while the total estimate drops. The plan records
each narrow tensor's kept channels (``Plan.channels``) and each shrunk GEMM's (``OpPlan.shrink``, kind ``"shrink"``);
``passes/shrink_graph.py`` rewrites the graph to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...tesa import bits_of_dtype
from ..fusion import fused_activation
from .channels import Analysis, _keep, analyse, axis_of, needs_analysis, pack
from .plan import Candidate, Plan, SubOp
from .transform_op import TIE_MARGIN

MAX_ROUNDS = 4
# targets whose compiled model runs its torch ops under Inductor by default: a region's boundary ops (a gather, a
# scatter, a bias map's add) fuse into the element-wise op beside them, costing their bytes but no launch
FUSING_TARGETS = ("cuda",)


@dataclass
class Config:
    """How one GEMM runs: the input channels it reads (None: all, from the whole input; ``gather``: gathered from the
    whole input first) and the output channels it writes (None: all)."""

    in_keep: torch.Tensor | None
    out_keep: torch.Tensor | None
    gather: bool = False

    @property
    def shrunk(self) -> bool:
        return self.in_keep is not None or self.out_keep is not None


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(a, b)


def _count(keep, n: int) -> int:
    return n if keep is None else int(keep.sum())


class Costs:
    """The cost model of layouts over one analysis."""

    def __init__(self, an: Analysis, plan: Plan, prof):
        self.an, self.plan, self.prof, self.graph = an, plan, prof, an.graph
        self.boundary_fixed_us = 0.0 if prof.target in FUSING_TARGETS else prof.fixed_us
        self.regions: dict[str, list[str]] = {}
        for t in an.states:
            self.regions.setdefault(an.region(t), []).append(t)
        outputs = set(self.graph.outputs)
        self.candidates = [r for r, ts in self.regions.items()
                           if not outputs & set(ts) and any(not bool(an.states[t].keep.all()) for t in ts)]
        touched = {t for r in self.candidates for t in self.regions[r]}
        self.fused = {}               # activation op -> the sparse GEMM whose epilogue computes it (while not shrunk)
        for name in an.gemms:
            p = plan.ops.get(name)
            act = fused_activation(self.graph, self.graph.op(name), p) if p is not None and p.kind == "sparse" \
                else None
            if act is not None:
                self.fused[act.name] = name
        self.ops = [op for op in self.graph.ops()
                    if op.name in an.gemms or any(t in touched for t in [*op.inputs, *op.outputs])]
        self.local = {}               # region -> the estimates of the ops that read or write it (a narrow region's
        for r in self.candidates:     # saving must beat TIE_MARGIN of them: the estimates' spread)
            ts = set(self.regions[r])
            self.local[r] = sum(plan.ops[op.name].est_us for op in self.ops if op.name in plan.ops
                                and ts & {*op.inputs, *op.outputs})

    # ---- pieces --------------------------------------------------------------------------------------------------
    def per_channel_us(self, t: str, axis: int) -> float:
        v = self.graph.tensor(t)
        return self.prof.memory_us(math.prod(v.shape) * v.dtype.itemsize) / max(v.shape[axis], 1)

    def convert_us(self, t: str, axis: int, src, dst) -> float:
        if _same(src, dst):
            return 0.0
        n = self.graph.tensor(t).shape[axis]
        passes = _count(src, n) + _count(dst, n) * (1 if dst is not None and src is None else 2)
        return self.boundary_fixed_us + self.per_channel_us(t, axis) * passes

    def gemm_us(self, name: str, cfg: Config, score: bool = True) -> float:
        """Its estimate; ``score``: over the token range planned for, as transform scores it (dense µs times the mean
        of cost / dense at each row count)."""
        p = self.plan.ops[name]
        if not cfg.shrunk:
            return p.dense_us * sum(e / d for _, e, d in p.rows_us) / len(p.rows_us) if score and p.rows_us \
                else p.est_us
        site = self.an.gemms[name]
        op = self.graph.op(name)
        axis = axis_of(self.graph, op)
        cout = self.graph.tensor(site.y).shape[axis]
        cin = self.graph.tensor(site.x).shape[axis]
        n, c = _count(cfg.out_keep, cout), _count(cfg.in_keep, cin)
        if p.gemm is None or site.groups != 1:        # costed by its bytes: its share of the channels
            return p.est_us * n / max(cout, 1)
        bits = self.prof.round_up(bits_of_dtype(self.graph.tensor(site.w).dtype), self.prof.act_widths())
        us = self.prof.dense_us(p.gemm[0], n, c * site.kk, bits, bits)
        if score and p.rows_us:
            us = p.dense_us * sum(self.prof.dense_us(r, n, c * site.kk, bits, bits) / d for r, _, d in p.rows_us) \
                / len(p.rows_us)
        return us

    def bias_map_us(self, name: str, cfg: Config) -> float:
        """The add of a bias map: dropped input constants that vary over positions (a padded conv reads them)."""
        site = self.an.gemms[name]
        axis = axis_of(self.graph, self.graph.op(name))
        xs = self.an.state(site.x, axis)
        if cfg.in_keep is None:
            return 0.0
        src = ~cfg.in_keep & xs.constant & (xs.vary | site.padded)
        if not bool(src.any()):
            return 0.0
        reached = site.reach(self.graph, src)
        if not bool((reached if cfg.out_keep is None else reached & cfg.out_keep).any()):
            return 0.0
        n = _count(cfg.out_keep, self.graph.tensor(site.y).shape[axis])
        return self.boundary_fixed_us + 2 * n * self.per_channel_us(site.y, axis)

    def layout(self, layouts: dict, t: str, axis: int):
        s = self.an.states.get(t)
        return layouts.get(t) if s is not None and s.axis == axis else None

    def config(self, layouts: dict, name: str) -> tuple[Config, float]:
        """The cheapest configuration of GEMM ``name`` under ``layouts`` and its cost, conversions included."""
        site, graph = self.an.gemms[name], self.graph
        axis = axis_of(graph, graph.op(name))
        have_in, have_out = layouts.get(site.x), layouts.get(site.y)
        l_in, l_out = self.layout(layouts, site.x, axis), self.layout(layouts, site.y, axis)
        x_axis = self.an.states[site.x].axis if site.x in self.an.states else axis
        options = []
        if site.groups > 1:
            if l_in is not None and l_out is not None and _whole_groups(site.groups, l_in, l_out):
                options.append(Config(l_in, l_out))
            options.append(Config(None, None))
        else:
            options.append(Config(l_in, l_out))
            if have_in is None:
                xs = self.an.state(site.x, axis)
                need = _keep(xs.live & site.used(graph))
                if not bool(need.all()):
                    options.append(Config(need, l_out, gather=True))
        best = None
        for cfg in options:             # a shrunk GEMM only where it pays beyond the estimates' spread
            us = self.gemm_us(name, cfg) + self.bias_map_us(name, cfg) \
                + self.convert_us(site.x, x_axis, have_in, cfg.in_keep) + self.convert_us(site.y, axis, cfg.out_keep,
                                                                                           have_out)
            rank = us * (1 + TIE_MARGIN) if cfg.gather else us
            if best is None or rank < best[2] - 1e-9:
                best = (cfg, us, rank)
        return best[:2]

    def total(self, layouts: dict) -> float:
        an, us = self.an, 0.0
        to_full, shrunk = set(), set()
        for op in self.ops:
            if op.name in an.gemms:
                cfg, cost = self.config(layouts, op.name)
                us += cost
                if cfg.shrunk:
                    shrunk.add(op.name)
                continue
            y = op.outputs[0]
            p = self.plan.ops.get(op.name)
            own = p.est_us if p is not None else 0.0
            if op.name in self.fused and self.fused[op.name] not in shrunk:
                own = 0.0                                 # in the sparse kernel's epilogue
            if op.name in an.links and layouts.get(y) is not None:
                s = an.states[y]
                us += own * int(s.keep.sum()) / max(s.size, 1)
                if op.op in ("cat", "concat"):        # inputs outside the region: gathered
                    us += sum(self.convert_us(t, s.axis, None, k) for t, k in cat_parts(an, op, layouts[y])
                              if t not in an.links[op.name])
                continue
            us += own
            for t in op.inputs:
                if layouts.get(t) is not None and t not in to_full:
                    to_full.add(t)
                    us += self.convert_us(t, an.states[t].axis, layouts[t], None)
            if y in an.states and layouts.get(y) is not None:
                us += self.convert_us(y, an.states[y].axis, None, layouts[y])
        return us

    def layouts(self, narrow) -> dict:
        return {t: self.an.states[t].keep for r in narrow for t in self.regions[r]}


def cat_parts(an: Analysis, op, keep: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Each input of a concatenation with its slice of the output's kept channels."""
    parts, start = [], 0
    for r, t in zip(op.roles, op.inputs):
        if r.startswith("tensors"):
            n = an.graph.tensor(t).shape[an.states[op.outputs[0]].axis]
            parts.append((t, keep[start:start + n]))
            start += n
    return parts


def _whole_groups(groups: int, l_in: torch.Tensor, l_out: torch.Tensor) -> bool:
    """Whether every group of a grouped conv is kept or dropped whole, inputs and outputs alike."""
    i, o = l_in.reshape(groups, -1), l_out.reshape(groups, -1)
    kept = i.all(1) & o.all(1)
    gone = ~i.any(1) & ~o.any(1)
    return bool((kept | gone).all()) and bool(kept.any())


def choose(costs: Costs) -> set:
    """The narrow regions: greedy toggling while the total estimate drops, from all narrow and from all full (a
    GEMM between two narrow regions shrinks only if both are: one start alone can stop short), the cheaper end. Each
    narrow region pays TIE_MARGIN of its ops' estimates: a saving within the estimates' spread is no saving."""
    def score(narrow):
        return costs.total(costs.layouts(narrow)) + TIE_MARGIN * sum(costs.local[r] for r in narrow)

    ends = []
    for start in (set(), set(costs.candidates)):      # a tie keeps the graph as it is
        narrow, best = start, score(start)
        for _ in range(MAX_ROUNDS):
            changed = False
            for r in costs.candidates:
                trial = narrow ^ {r}
                us = score(trial)
                if us < best - 1e-6:
                    narrow, best, changed = trial, us, True
            if not changed:
                break
        ends.append((best, len(ends), narrow))
    return min(ends, key=lambda e: e[:2])[2]


def describe(shrink: dict) -> str:
    parts = [f"{shrink['out'][0]}→{shrink['out'][1]} out" if shrink.get("out_keep") else "",
             f"{shrink['in'][0]}→{shrink['in'][1]} in" + (" (gathered)" if shrink.get("gather") else "")
             if shrink.get("in_keep") else ""]
    return "shrink " + ", ".join(p for p in parts if p)


def plan_shrink(graph, plan: Plan, prof) -> Plan:
    """Choose channel shrinking for ``plan`` (in place): narrow regions, shrunk GEMMs; returns the plan."""
    if not needs_analysis(graph):
        return plan
    an = analyse(graph)
    costs = Costs(an, plan, prof)
    narrow = choose(costs)
    layouts = costs.layouts(narrow)
    plan.channels = {t: pack(k) for t, k in layouts.items()}
    for name in an.gemms:
        cfg, _ = costs.config(layouts, name)
        if not cfg.shrunk:
            continue
        site, p = an.gemms[name], plan.ops[name]
        axis = axis_of(graph, graph.op(name))
        cout, cin = graph.tensor(site.y).shape[axis], graph.tensor(site.x).shape[axis]
        shrink = {"out": [cout, _count(cfg.out_keep, cout)], "in": [cin, _count(cfg.in_keep, cin)],
                  "out_keep": pack(cfg.out_keep) if cfg.out_keep is not None else "",
                  "in_keep": pack(cfg.in_keep) if cfg.in_keep is not None else "", "gather": cfg.gather,
                  "groups": site.groups if site.groups == 1 else
                  int(cfg.in_keep.reshape(site.groups, -1).all(1).sum())}
        what = describe(shrink)
        est = costs.gemm_us(name, cfg, score=False)
        bits = bits_of_dtype(graph.tensor(site.w).dtype)
        why = ("dropped channels are constant or unread (their share is in the bias)"
               + (f"; cheaper than its sparse plan ({p.est_us:.1f} µs)" if p.kind == "sparse" else ""))
        plan.ops[name] = p.replace(kind="shrink", est_us=est, shrink=shrink, epilogue=[], kernel=None,
                                   weight_quant={}, dismantle="none", rows_us=[],
                                   subops=[SubOp("dense", bits, bits, None, 0, 0, est)],
                                   candidates=[*p.candidates, Candidate(what, est)],
                                   note="; ".join(x for x in (why, p.note if p.kind != "sparse" else "") if x))
    for name in an.links:
        y = graph.op(name).outputs[0]
        if y in layouts and name in plan.ops:
            s = an.states[y]
            p = plan.ops[name]
            kept = int(s.keep.sum())
            plan.ops[name] = p.replace(est_us=p.est_us * kept / max(s.size, 1),
                                       note="; ".join(x for x in (p.note, f"on {kept} of {s.size} channels") if x))
    return plan


__all__ = ["Config", "Costs", "cat_parts", "choose", "describe", "plan_shrink"]
