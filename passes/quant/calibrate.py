"""Quantization by calibration: the fewest bits each weight (and, optionally, each GEMM input)
can keep while the op's output survives.

The graph is run on the calibration batches twice in lock step, op by op in topological order:
the full-precision path (the targets) and the quantized path (every decision so far applied).
An op's calibration inputs are the quantized path's values, computed once from the nearest
cached activations; nothing re-runs the whole model per op. For each weight, the next lower
width the target runs is tried: its scales are fitted (clip-ratio search) to minimise the op's
output error against the full-precision output, and the width is kept if the relative output
MSE it *adds* stays within ``tolerance``. Activations (``activations=True``) are tried in a
second walk the same way, jointly for every GEMM reading the tensor, at the kernel the lower
activation width selects (e.g. W8A8). An 8-bit activation that only GEMMs read and a GEMM produces
(directly or through a ReLU/GELU its epilogue applies) is then tried at one static scale (clip ratio
searched on the calibration data), kept if it too adds at most ``tolerance``: the producing kernel
then writes int8 codes itself instead of an fp16 tensor quantised per token by another pass
(``static_activations``; default on for the CUDA target). With ``model_tolerance`` (or a ``metric``) the final
model outputs are checked and the costliest decisions are undone until they pass.

``densities`` makes it a joint plan: each GEMM weight may also keep only its largest blocks (``prune.py``), and of
the (density, width) choices within the tolerance the one the caller's ``price`` (the plan's estimate) finds cheapest is
kept.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

from ...errors import QuantizationError
from ...graph import Graph, Op
from ...tesa import TeSA, bits_of_dtype
from ..fusion import epilogue_producer
from .scheme import WeightQuant
from .report import Decision, QuantReport
from .scheme import (CLIPS, FLOAT_WIDTHS, GRANULARITIES, QuantParams, fake_quant_float, fake_quant_rows,
                     fake_quant_static, fit_weight)
from .prune import check_densities, joint_choice
from .sites import WeightSite, parse_batches, weight_sites
from .walk import LockstepWalk, relative_mse


@dataclass(frozen=True)
class QuantConfig:
    """How calibration searches. ``tolerance``: relative output MSE (‖Δy‖²/‖y‖²) one op may add.

    4-bit (and narrower) weights use ``granularity`` (``"group"`` of ``group_size`` columns,
    ``"channel"`` or ``"tensor"``) and ``symmetric``; 8-bit weights are symmetric per channel
    (per tensor if asked), the scheme of the int8 tensor-core and CPU kernels.
    """

    tolerance: float
    model_tolerance: float | None = None
    metric: Callable | None = None        # metric(reference_outputs, quantized_outputs) -> float
    widths: tuple[int, ...] | None = None  # weight widths to try; default: what the target runs
    activations: bool = False
    static_activations: bool | None = None   # None: where the target's kernels requantise (CUDA)
    symmetric: bool = True
    granularity: str = "group"
    group_size: int = 128
    progress: bool = True
    device: str | None = None       # where the batches run: "cpu" or a GPU ("cuda"; what fails there reruns on the
#                                     CPU with a warning); None: the calibration batches' own device
    densities: tuple[float, ...] = ()   # joint plan: fractions of a GEMM weight's blocks it may keep (prune.py)
    prune_block: tuple[int, int] = (32, 32)   # the blocks pruned by magnitude

    def __post_init__(self):
        if not (isinstance(self.tolerance, (int, float)) and self.tolerance >= 0 and math.isfinite(self.tolerance)):
            raise QuantizationError(f"quant_tolerance must be a finite number >= 0, got {self.tolerance!r}")
        if self.model_tolerance is not None and not self.model_tolerance >= 0:
            raise QuantizationError(f"model_tolerance must be >= 0, got {self.model_tolerance!r}")
        if self.granularity not in GRANULARITIES:
            raise QuantizationError(f"granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if self.group_size < 1 or self.group_size & (self.group_size - 1):
            raise QuantizationError(f"group_size must be a power of two, got {self.group_size}")
        densities, block = check_densities(self.densities, self.prune_block)
        object.__setattr__(self, "densities", densities)
        object.__setattr__(self, "prune_block", block)

    def scheme(self, bits: int) -> dict:
        if bits >= 8:
            return {"symmetric": True, "granularity": "tensor" if self.granularity == "tensor" else "channel"}
        return {"symmetric": self.symmetric, "granularity": self.granularity, "group": self.group_size}


# ---- the search ------------------------------------------------------------------------------------

class _Calibration:
    def __init__(self, graph: Graph, batches, config: QuantConfig, profile, weights, static: bool = False,
                 device: str = "cpu", price: Callable | None = None):
        self.g, self.cfg, self.profile, self.static_on = graph, config, profile, static
        self.price = price                  # joint plan: price(graph, op, weight, tesa, profile) -> µs
        self.static: dict[str, float] = {}        # 8-bit activations at one static scale
        self.batches = [[t.detach().to(device) if isinstance(t, torch.Tensor) else t for t in b] for b in batches]
        self.weights = {v.name: weights.get(v.name, v.data).to(device) for v in graph.tensors("weight")
                        if v.data is not None}
        sites = weight_sites(graph)
        count = {}
        for s in sites.values():
            count[s.weight] = count.get(s.weight, 0) + 1
        self.sites = {k: s for k, s in sites.items() if count[s.weight] == 1}    # tied weights stay as they are
        self.model_bits = {s.weight: bits_of_dtype(graph.tensor(s.weight).dtype) for s in self.sites.values()}
        self.wbits = {w: self._kept_bits(w) for w in self.model_bits}
        self.fixed = {w for w, b in self.wbits.items() if b < self.model_bits[w]}   # the user chose these bits
        self.abits: dict[str, int] = {}
        self.params: dict[str, dict[int, QuantParams | None]] = {w: {} for w in self.model_bits}
        self.decisions: list[Decision] = []
        self._undo: dict[int, Callable] = {}
        self._dequantized: dict[tuple[str, int], torch.Tensor] = {}
        self.lowered_by: dict[str, str] = {}     # weight -> the activation whose decision lowered it
        self.prune: dict[str, torch.Tensor] = {}       # joint plan: weight -> kept (N, K) of its pruned blocks

    def _kept_bits(self, name: str) -> int:
        return self.g.tesa(name).max_bits() or bits_of_dtype(self.g.tensor(name).dtype)

    # ---- what runs ------------------------------------------------------------------------------------
    def act_bits(self, x: str) -> int:
        return self.abits.get(x, bits_of_dtype(self.g.tensor(x).dtype))

    def run_act_bits(self, x: str) -> int:
        bits = self.act_bits(x)
        return self.profile.round_up(bits, self.profile.act_widths()) if self.profile else bits

    def run_weight_bits(self, site: WeightSite, act_bits: int | None = None) -> int | None:
        bits = self.wbits[site.weight]
        if self.profile is None:
            return bits
        if act_bits is None:   # activations are lowered only for GEMMs (see on_value)
            act_bits = self.run_act_bits(site.x) if site.gemm else \
                self.profile.round_up(bits_of_dtype(self.g.tensor(site.x).dtype), self.profile.act_widths())
        widths = self.profile.weight_widths(act_bits)
        return self.profile.round_up(bits, widths) if widths else None

    def fit(self, site: WeightSite, bits: int, objective=None) -> tuple[QuantParams | None, torch.Tensor]:
        w = site.to_nk(self.weights[site.weight]).float()
        if bits in FLOAT_WIDTHS:
            q = fake_quant_float(w, bits)
            return None, objective(q) if objective else None
        scheme = self.cfg.scheme(bits)
        code = self.profile.code_bits(bits) if self.profile is not None else bits   # the codes the kernel holds
        if objective is None:   # weights whose bits the user fixed: plain range, no search
            zero = (lambda q: torch.zeros(w.shape[0], device=w.device))
            return fit_weight(w, code, zero, clips=(1.0,), **scheme)[0], None
        return fit_weight(w, code, objective, **scheme)

    def dequantized(self, site: WeightSite, bits: int) -> torch.Tensor:
        """The weight as the kernel at ``bits`` applies it, in the graph's layout (cached)."""
        key = (site.weight, bits)
        if key not in self._dequantized:
            w = self.weights[site.weight]
            if bits >= self.model_bits[site.weight]:
                return w
            if bits not in FLOAT_WIDTHS and bits not in self.params[site.weight]:
                self.params[site.weight][bits] = self.fit(site, bits)[0]
            p = self.params[site.weight].get(bits)
            nk = site.to_nk(w).float()
            q = fake_quant_float(nk, bits) if p is None else p.dequantize(nk)
            mask = site.to_nk(self.g.tesa(site.weight).mask).to(q.device)
            if site.weight in self.prune:
                mask = mask & self.prune[site.weight]
            self._dequantized[key] = site.from_nk(q * mask, w.shape).to(w.dtype)
        return self._dequantized[key]

    def quantize_op(self, op: Op):
        site = self.sites.get(op.name)
        if site is None:
            return None, None
        rb = self.run_weight_bits(site)
        override = None
        if rb is not None and rb < self.model_bits[site.weight]:
            override = {site.weight: self.dequantized(site, rb)}
        elif site.weight in self.prune:                   # pruned at its own width
            override = {site.weight: self.weights[site.weight]}
        ab = self.run_act_bits(site.x)
        lowered = site.gemm and ab < bits_of_dtype(self.g.tensor(site.x).dtype)
        act = (site.x, self.act_fn(site.x, ab)) if lowered else None
        return override, act

    def act_fn(self, x: str, bits: int):
        """How the kernels quantise activation ``x`` at ``bits``: one static scale, or per token."""
        if x in self.static:
            return lambda v, b=bits, s=self.static[x]: fake_quant_static(v, b, s)
        return lambda v, b=bits: fake_quant_rows(v, b)

    # ---- the op's output error as a function of its weight ---------------------------------------------
    def objective(self, site: WeightSite, walk, xs, ys, act_fn=None):
        """``channel_sse(dequantised (N, K) weight)`` of ``site``'s op on inputs ``xs`` against ``ys``."""
        op = self.g.op(site.op)
        w = walk.weights.get(site.weight, self.weights[site.weight])    # what the op ran with (before any pruning)
        if act_fn is not None:
            xs = [act_fn(x) for x in xs]
        values = {site.x: xs}
        if site.gemm:
            w_nk = site.to_nk(w).float()
            n, k = w_nk.shape
            x2d = torch.cat([x.reshape(-1, k).float() for x in xs])
            res = torch.cat([(f - y).reshape(-1, n).float() for f, y in zip(walk.run_op(op, values)[0], ys)])
            return lambda q: torch.addmm(res, x2d, (q - w_nk).t()).pow(2).sum(0)

        def channel_sse(q):
            override = {site.weight: site.from_nk(q, w.shape).to(w.dtype)}
            total = 0
            for f, y in zip(walk.run_op(op, values, override)[0], ys):
                d = (f.float() - y.float()).pow(2)
                total = total + d.transpose(0, 1).reshape(d.shape[1], -1).sum(1)
            return total
        return channel_sse

    def current_nk(self, site: WeightSite) -> torch.Tensor:
        rb = self.run_weight_bits(site)
        return site.to_nk(self.dequantized(site, rb) if rb is not None else self.weights[site.weight]).float()

    # ---- phase A: weights -------------------------------------------------------------------------------
    def weight_candidates(self, site: WeightSite) -> list[int]:
        if self.cfg.widths is not None:
            widths = self.cfg.widths
        elif self.profile is not None:
            widths = self.profile.weight_widths(self.run_act_bits(site.x))
        else:
            widths = (16, 8, 4)
        return sorted((b for b in set(widths) if 0 < b < self.wbits[site.weight]), reverse=True)

    def on_op(self, op: Op, walk, outs_fp):
        site = self.sites.get(op.name)
        if site is None or site.weight in self.fixed:
            return
        cands = self.weight_candidates(site)
        joint = bool(self.cfg.densities) and site.gemm      # calibrate() saw to a profile and a price
        if not cands and not joint:
            return
        ys = outs_fp[0]
        ref = sum(float(y.double().pow(2).sum()) for y in ys) or 1.0
        objective = self.objective(site, walk, walk.q[site.x], ys)
        base = float(objective(self.current_nk(site)).sum())
        before = self.wbits[site.weight]
        d = Decision(site.weight, "weight", [op.name], before, before)
        if joint:
            self._joint(site, d, objective, base, ref, walk.q[site.x], cands)
            self.decisions.append(d)
            return
        for bits in cands:
            params, sse = self.fit(site, bits, objective)
            added = (float(sse.sum()) - base) / ref
            d.trials[bits] = added
            if added > self.cfg.tolerance:
                break
            d.bits, d.error = bits, added
            self.params[site.weight][bits] = params
        self.decisions.append(d)
        if d.bits < before:
            self.wbits[site.weight] = d.bits
            self._undo[id(d)] = lambda w=site.weight, b=before: self.wbits.__setitem__(w, b)

    def _joint(self, site: WeightSite, d: Decision, objective, base: float, ref: float, xs, cands: list[int]) -> None:
        """The joint plan's choice for one GEMM weight (``prune.joint_choice``), applied: its width, and its blocks
        pruned where that was cheapest."""
        w = site.weight
        params, keep = joint_choice(self, site, d, objective, base, ref, xs, cands)
        bits, before = d.bits, (self.wbits[w], self.weights[w])
        if bits < self.wbits[w]:
            self.wbits[w] = bits
            self.params[w][bits] = params
        if keep is not None:
            self.prune[w] = keep
            w_nk = site.to_nk(self.weights[w]).float()
            self.weights[w] = site.from_nk(w_nk * keep, self.weights[w].shape).to(self.weights[w].dtype)
            self._dequantized = {key: v for key, v in self._dequantized.items() if key[0] != w}
        if bits < before[0] or keep is not None:
            self._undo[id(d)] = lambda s=site, b=before: self._restore_weight(s, *b)

    def _restore_weight(self, site: WeightSite, bits: int, weight: torch.Tensor) -> None:
        """Undo a joint-plan decision: the weight's width and, if it pruned, its blocks."""
        self.wbits[site.weight], self.weights[site.weight] = bits, weight
        self.prune.pop(site.weight, None)
        self._dequantized = {key: v for key, v in self._dequantized.items() if key[0] != site.weight}

    # ---- phase B: activations -----------------------------------------------------------------------------
    def on_value(self, name: str, walk):
        value = self.g.tensor(name)
        if not value.dtype.is_floating_point:
            return
        readers = [self.sites[c] for c in self.g.consumers(name) if c in self.sites and self.sites[c].gemm]
        if not readers or any(s.x != name or any(t != name and t not in walk.weights
                                                  for t in self.g.op(s.op).inputs) for s in readers):
            return
        widths = self.profile.act_widths() if self.profile else (16, 8)
        before = self.act_bits(name)
        cands = sorted((a for a in widths if a < before), reverse=True)
        if not cands:
            return
        d = Decision(name, "activation", [s.op for s in readers], before, before)
        targets = {}
        old = (self.abits.get(name), {s.weight: self.wbits[s.weight] for s in readers})
        for s in readers:
            ys = walk.run_op(self.g.op(s.op), walk.fp)[0]
            ref = sum(float(y.double().pow(2).sum()) for y in ys) or 1.0
            base = float(self.objective(s, walk, walk.q[name], ys)(self.current_nk(s)).sum())
            targets[s.op] = (ys, ref, base)
        for a in cands:
            act_fn = (lambda v, b=a: fake_quant_rows(v, b))
            worst, chosen = -math.inf, {}
            for s in readers:
                rb = self.run_weight_bits(s, act_bits=a)
                if rb is None or (s.weight in self.fixed and rb < self.wbits[s.weight]):
                    worst = math.inf
                    break
                ys, ref, base = targets[s.op]
                objective = self.objective(s, walk, walk.q[name], ys, act_fn)
                if rb >= self.model_bits[s.weight]:
                    params, sse = None, objective(s.to_nk(self.weights[s.weight]).float())
                elif rb in self.params[s.weight] or s.weight in self.fixed:
                    params, sse = self.params[s.weight].get(rb), objective(self.dequantized_nk(s, rb))
                else:
                    params, sse = self.fit(s, rb, objective)
                chosen[s.weight] = (rb, params)
                worst = max(worst, (float(sse.sum()) - base) / ref)
            d.trials[a] = worst
            if worst > self.cfg.tolerance:
                break
            d.bits, d.error = a, worst
            self.abits[name] = a
            for w, (rb, params) in chosen.items():
                if params is not None:
                    self.params[w][rb] = params
                    self._dequantized.pop((w, rb), None)
                if rb < self.wbits[w]:
                    self.wbits[w] = rb
                    self.lowered_by[w] = name
            self._undo[id(d)] = lambda n=name, o=old: self._restore_act(n, *o)
        if d.bits == 8 and self.static_on and self._requantizable(name, readers):
            self._try_static(name, d, readers, targets, walk)
        self.decisions.append(d)

    def _requantizable(self, name: str, readers: list[WeightSite]) -> bool:
        """Whether a kernel could write ``name`` as int8 codes: GEMMs read nothing but it, and a GEMM's
        epilogue makes it (the GEMM itself, or the activation it fuses: ``passes/fusion.py``)."""
        if len(readers) != len(self.g.consumers(name)) or name in self.g.outputs:
            return False
        p = epilogue_producer(self.g, name, self.profile.target if self.profile is not None else "cuda")
        return p is not None and p in self.sites and self.sites[p].gemm

    def _try_static(self, name: str, d: Decision, readers: list[WeightSite], targets: dict, walk) -> None:
        """One static scale for 8-bit activation ``name``: the clip of its calibration range that adds the least
        output error at its readers (weights as decided); kept if that is within the tolerance."""
        amax = max(float(v.detach().float().abs().max()) for v in walk.q[name])
        if not amax > 0 or not math.isfinite(amax):
            return
        weights = {s.op: self.current_nk(s) for s in readers}
        best = (math.inf, None)
        for c in CLIPS:
            scale = c * amax / 127
            fn = (lambda v, sc=scale: fake_quant_static(v, 8, sc))
            worst = -math.inf
            for s in readers:
                ys, ref, base = targets[s.op]
                sse = self.objective(s, walk, walk.q[name], ys, fn)(weights[s.op])
                worst = max(worst, (float(sse.sum()) - base) / ref)
            best = min(best, (worst, scale), key=lambda t: t[0])
        d.static_error = best[0]
        if best[0] <= self.cfg.tolerance:              # what runs: its error is the decision's (trials: per token)
            self.static[name] = d.scale = best[1]
            d.error = best[0]

    def dequantized_nk(self, site: WeightSite, bits: int) -> torch.Tensor:
        return site.to_nk(self.dequantized(site, bits)).float()

    def _restore_act(self, name: str, act_bits: int | None, wbits: dict[str, int]):
        self.static.pop(name, None)
        if act_bits is None:
            self.abits.pop(name, None)
        else:
            self.abits[name] = act_bits
        self.wbits.update(wbits)
        self.lowered_by = {w: a for w, a in self.lowered_by.items() if a != name}

    # ---- the whole pass ---------------------------------------------------------------------------------
    def model_error(self, ref_outs, q_outs) -> float:
        if self.cfg.metric is None:
            return relative_mse(ref_outs, q_outs)
        spec = self.g.meta.get("out_spec")

        def per_batch(outs):
            batches = [list(t) for t in zip(*outs)]
            return [pytree.tree_unflatten(b, spec) if spec is not None else tuple(b) for b in batches]
        return float(self.cfg.metric(per_batch(ref_outs), per_batch(q_outs)))

    def run(self) -> QuantReport:
        t0 = time.perf_counter()
        walk = LockstepWalk(self.g, self.batches, self.weights)
        progress = self.cfg.progress
        ref, q = walk.run(self.quantize_op, on_op=self.on_op, desc="calibrate weights", progress=progress)
        if self.cfg.activations:
            ref, q = walk.run(self.quantize_op, on_value=self.on_value, desc="calibrate activations",
                              progress=progress)
        err = self.model_error(ref, q)
        limit = self.cfg.model_tolerance
        while limit is not None and err > limit:
            live = [d for d in self.decisions if (d.bits < d.bits_before or d.density < 1) and not d.reverted]
            if not live:
                break
            worst = max(live, key=lambda d: d.error)
            self._undo[id(worst)]()
            worst.reverted = True
            _, q = walk.run(self.quantize_op, desc="check model", progress=progress)
            err = self.model_error(ref, q)
        return QuantReport(self.decisions, err, self.cfg.tolerance, limit, time.perf_counter() - t0)

    def commit(self, report: QuantReport) -> None:
        """Lower the graph's TeSAs (lattice meet) and store the fitted parameters for codegen."""
        sites = {s.weight: s for s in self.sites.values()}
        for w, keep in self.prune.items():                # joint plan: the pruned blocks
            v = self.g.tensor(w)
            mask = sites[w].from_nk(keep.float(), v.shape) != 0
            self.g.set_tesa(w, v.tesa.meet(TeSA.from_mask(mask.cpu(), bits=32)))
        for w, bits in self.wbits.items():
            if bits < self.model_bits[w] and w not in self.fixed:
                v = self.g.tensor(w)
                self.g.set_tesa(w, v.tesa.meet(TeSA.dense(v.shape, bits)))
        report.static_scales = dict(self.static)           # kernels that write these as int8 codes
        for x, bits in self.abits.items():
            v = self.g.tensor(x)
            self.g.set_tesa(x, v.tesa.meet(TeSA.dense(v.shape, bits)))
        for site in self.sites.values():
            rb = self.run_weight_bits(site)
            if rb is not None and rb < self.model_bits[site.weight] and site.weight not in self.fixed:
                self.dequantized(site, rb)          # fits the width if only rounding reached it
                p = self.params[site.weight].get(rb)
                if p is not None:
                    report.weights[site.weight] = WeightQuant.of(p, self.cfg.scheme(rb)["granularity"],
                                                                 "calibration")
        runs = {}
        for site in self.sites.values():
            rb = self.run_weight_bits(site)
            act = self.run_act_bits(site.x) if site.gemm else bits_of_dtype(self.g.tensor(site.x).dtype)
            runs[site.op] = f"W{rb if rb is not None else self.wbits[site.weight]}A{act}"
        for d in report.decisions:
            d.runs = ", ".join(dict.fromkeys(runs[o] for o in d.ops))
            if d.kind == "weight" and not d.reverted and self.wbits[d.tensor] < d.bits:
                d.bits, d.by = self.wbits[d.tensor], self.lowered_by.get(d.tensor, "")
        self.g.quantization = report


def calibrate(graph: Graph, calibration, tolerance: float | QuantConfig, *, target: str | None = "cpu",
              weights: dict[str, torch.Tensor] | None = None, price: Callable | None = None, **options) -> QuantReport:
    """Find the fewest bits each weight (and GEMM input, with ``activations=True``) can keep.

    ``calibration``: batches of example inputs (see :func:`parse_batches`); ``tolerance``: the
    relative output MSE one op may add (or a full :class:`QuantConfig`; ``options`` fill one).
    ``target`` picks the widths tried from its hardware profile (None: 16, 8, 4).
    ``weights`` overrides weight values (default: the graph's, with pruned elements zeroed).
    ``price(graph, op, weight, tesa, profile) -> µs``: how the joint plan (``densities``) compares its choices
    (``sparta.passes.calibrate`` and ``compile`` pass the planner's, ``passes/transform/price.py``).
    Lowers the graph's TeSAs in place and returns the report (also in ``graph.quantization``), whose
    fitted weight scales and static activation scales the planner copies into the plan.
    """
    from ...target import load_target

    config = tolerance if isinstance(tolerance, QuantConfig) else QuantConfig(tolerance, **options)
    batches = parse_batches(graph, calibration)
    profile = load_target(target).profile if target is not None else None
    if config.densities and (price is None or profile is None):
        raise QuantizationError("densities (pruning beside the bits) need a target and the planner's prices: call "
                                "sparta.passes.calibrate or sparta.compile")
    if weights is None:
        weights = {v.name: v.tesa.apply(v.data) for v in graph.tensors("weight")
                   if v.data is not None and v.data.dtype.is_floating_point and not v.tesa.is_dense}
    static = config.static_activations if config.static_activations is not None else target == "cuda"
    device = calibration_device(config.device, batches)
    with torch.no_grad():
        for device in dict.fromkeys((device, "cpu")):        # the device asked, then the CPU where it fails
            try:
                cal = _Calibration(graph, batches, config, profile, weights, static and config.activations, device,
                                   price)
                report = cal.run()
                break
            except (RuntimeError, NotImplementedError) as exc:
                if device == "cpu":
                    raise
                warnings.warn(f"calibration on {device} failed ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:160]}); calibrating on the CPU", stacklevel=2)
        report.device = device
        cal.commit(report)
    return report


def calibration_device(asked: str | None, batches=()) -> str:
    """Where calibration runs: ``asked``, else the device the calibration batches are on (a GPU where the user's
    data is: the model's device), else the CPU."""
    if asked is not None:
        try:
            torch.device(asked)
        except (RuntimeError, TypeError) as exc:
            raise QuantizationError(f"quant_tolerance device {asked!r} is not a torch device: {exc}") from None
        if torch.device(asked).type == "cuda" and not torch.cuda.is_available():
            raise QuantizationError(f"quant_tolerance device {asked!r}: torch sees no CUDA GPU here")
        return str(asked)
    found = next((t.device for b in batches for t in b if isinstance(t, torch.Tensor)), None)
    return str(found) if found is not None and (found.type != "cuda" or torch.cuda.is_available()) else "cpu"
