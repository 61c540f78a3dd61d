"""TransformOp: turn one GEMM-like op into the cheapest plan of sub-operators.

For ``Y = X·Wᵀ`` (linear; ``addmm``/``mm``/``matmul`` with a constant weight; convolutions
seen as im2col GEMMs) the candidates are the Cartesian product of

* the activation's decomposition: its width rounded to a supported activation width,
  and its rows (tokens) that are entirely pruned dropped;
* the weight's decompositions: every bit-rounding grouping, and for each group every
  block-shape menu covered by weighted block cover (or the group run dense at its width);

and the dense vendor GEMM at the model's own precision. Each candidate's cost comes from
the hardware profile (per block per row, plus a fixed cost per kernel); the cheapest
wins, and all candidates stay in the plan.
"""

from __future__ import annotations

import itertools
import math

import torch

from ...graph import Graph, Op
from ...tesa import TeSA, bits_of_dtype
from .bitround import groupings
from .cover import block_cover, block_cover_by_blocks
from ..fusion import epilogue
from ..gemm import gemm_bias, gemm_view, in_weight_layout, weight_matrix
from .plan import Candidate, OpPlan, SubOp, WeightQuant
from .fp8 import fp8_option
from .nm import nm_option
from .profile import HardwareProfile

GEMM_OPS = ("linear", "addmm", "mm", "matmul", "conv1d", "conv2d", "conv3d")
FULL_DISMANTLE_MAX_NNZ = 4096
TIE_MARGIN = 0.05  # how closely re-measured profiles agree: within it, the simpler plan wins


def _kept_rows(graph: Graph, x: str, m: int) -> int:
    t = graph.tesa(x)
    if t.is_dense or t.ndim < 2:
        return m
    return int(t.mask.reshape(-1, t.shape[-1]).any(-1).sum())


def _menus(shapes):
    """Block-shape menus to try: each shape alone, each coarse shape with 1×1, all together."""
    fine = [s for s in shapes if s == (1, 1)]
    coarse = [s for s in shapes if s != (1, 1)]
    menus = [[s] for s in shapes] + [[s, (1, 1)] for s in coarse if fine]
    if len(shapes) > 2:
        menus.append(list(shapes))
    return menus


def row_points(graph: Graph, m: int) -> list[int]:
    """The rows an op of ``m`` rows at the example is costed at: ``[m]``, or for a graph planned over a token range
    (``graph.token_range``: ``lo``, ``hi``, the example's tokens) ``m`` first, then ``m`` scaled to ``lo``,
    each power of 4 between, and ``hi`` tokens."""
    span = graph.token_range
    if not span:
        return [m]
    lo, hi, example = span.lo, span.hi, max(span.example, 1)
    tokens = [lo] + [4 ** i for i in range(1, 32) if lo < 4 ** i < hi] + ([hi] if hi > lo else [])
    return [m] + sorted({max(1, round(m * t / example)) for t in tokens})


def transform_gemm(graph: Graph, op: Op, profile: HardwareProfile, sparse_ops=None,
                   fp8_weights=frozenset()) -> OpPlan | None:
    """The op's plan (None: not a GEMM); ``fp8_weights``: weights asked to be FP8, which run so where they can."""
    view = gemm_view(graph, op)
    if view is None:
        return None
    x, w, wtesa, m, n, k = view
    fp8 = w in fp8_weights
    wv = graph.tensor(w)
    model_bits = bits_of_dtype(wv.dtype)
    act_model_bits = bits_of_dtype(graph.tensor(x).dtype)
    rows = row_points(graph, m)
    dense_at = [profile.dense_us(r, n, k, profile.round_up(model_bits, profile.act_widths()),
                                 profile.round_up(act_model_bits, profile.act_widths())) for r in rows]
    dense_us = dense_at[0]
    base = dict(op=op.name, op_type=op.op, weight=w, gemm=(m, n, k), density=wtesa.density,
                bits=wtesa.bit_histogram(), epilogue=epilogue(graph, op, profile.target), dense_us=dense_us)
    dense_candidate = Candidate("dense", dense_us, f"vendor dense GEMM at W{model_bits}A{act_model_bits}")
    sparse_ok = sparse_ops is None or op.op in sparse_ops
    if wtesa.is_dense and set(wtesa.bit_histogram()) == {model_bits} or not sparse_ok:
        note = [] if sparse_ok else [Candidate("sparse", math.inf, f"no sparse template for {op.op} on "
                                                                    f"{profile.target}")]
        sub = SubOp("dense", model_bits, act_model_bits, None, 0, wtesa.numel(), dense_us)
        return OpPlan(kind="dense", est_us=dense_us, subops=[sub], candidates=[dense_candidate, *note], **base)

    act_bits = profile.round_up(int(graph.tesa(x).max_bits()) or act_model_bits, profile.act_widths())
    kept_rows = [max(1, round(r * _kept_rows(graph, x, m) / max(m, 1))) for r in rows]

    def score(costs):       # over a token range: the mean of cost / dense at each row count, in the example's µs
        if len(costs) == 1:
            return costs[0]
        return dense_us * sum(c / d for c, d in zip(costs[1:], dense_at[1:])) / (len(costs) - 1)

    widths = profile.weight_widths(act_bits)
    candidates = [dense_candidate]
    seen = set()
    options = [(score(dense_at), None, dense_at, None)]
    for grouping in groupings(wtesa, widths):
        per_group = []
        for group in grouping:
            per_group.append(_group_options(group, profile, act_bits, kept_rows, (model_bits, act_model_bits)))
        for combo in itertools.product(*per_group):
            costs = [sum(c[i] for c, _, _ in combo) for i in range(len(rows))]
            name = " + ".join(d for _, _, d in combo) or "all pruned (output is the bias)"
            if name in seen:
                continue
            seen.add(name)
            candidates.append(Candidate(name, costs[0]))
            subs = [s for _, subs, _ in combo for s in subs]
            switch = None
            if profile.target == "cuda" and all((s.template, s.weight_bits, s.act_bits) == (
                    "block_sparse", model_bits, act_model_bits) for s in subs):
                costs, switch = dense_switch(rows, costs, dense_at)
            options.append((score(costs), subs, costs, switch))
    if act_bits == act_model_bits and (nm := nm_option(wtesa, profile, kept_rows, dense_at,
                                                       (model_bits, act_model_bits))) is not None:
        candidates.append(Candidate(nm[2], nm[0][0]))
        options.append((score(nm[0]), nm[1], nm[0], None))
    f8 = None
    if act_bits == act_model_bits and (f8 := fp8_option(wtesa, profile, kept_rows, dense_at,
                                                        (model_bits, act_model_bits), fp8)) is not None:
        candidates.append(Candidate(f8[2], f8[0][0]))
        options.append((score(f8[0]), f8[1], f8[0], None))
        if fp8:                                 # asked for: the only plan, whatever the others cost
            options = options[-1:]
    base["note"] = _rounding_note(wtesa, widths, act_bits, profile.target)
    _, subops, costs, base["dense_from"] = choose(options, model_bits)
    if f8 is not None and base["note"]:         # 8 bits have a kernel here: FP8, chosen or priced above another
        base["note"] = "" if subops is f8[1] or subops is None else \
            f"FP8 (E4M3) weights on the FP8 GEMV estimated {f8[0][0]:.1f} µs: another plan is cheaper"
    if len(rows) > 1:
        base["rows_us"] = [[r, round(c, 3), round(d, 3)] for r, c, d in zip(rows[1:], costs[1:], dense_at[1:])]
    if subops is None:
        if lower := sorted(b for b in wtesa.bit_histogram() if 0 < b < model_bits):
            best = min(candidates[1:], key=lambda c: c.est_us, default=None)
            base["note"] = "; ".join(x for x in (base["note"], (
                f"{'/'.join(map(str, lower))}-bit weights run at W{model_bits}A{act_model_bits} on the vendor GEMM: "
                f"estimated {dense_us:.1f} µs, faster than the cheapest plan that keeps the bits"
                + (f" ({best.name}, {best.est_us:.1f} µs)" if best is not None else ""))) if x)
        sub = SubOp("dense", model_bits, act_model_bits, None, 0, wtesa.numel(), dense_us)
        return OpPlan(kind="dense", est_us=dense_us, subops=[sub], candidates=candidates, **base)
    blocks = sum(s.n_blocks for s in subops if s.template == "block_sparse")
    nnz = sum(s.nnz for s in subops if s.template == "fine_sparse")
    small = blocks <= profile.full_max_blocks and nnz <= FULL_DISMANTLE_MAX_NNZ
    dismantle = "full" if small else profile.large_dismantle
    return OpPlan(kind="sparse", est_us=costs[0], subops=subops, candidates=candidates, dismantle=dismantle, **base)


def dense_switch(rows: list[int], costs: list[float], dense_at: list[float]) -> tuple[list[float], tuple | None]:
    """(costs, (below, from)): a 16-bit block-sparse plan over a token range (CUDA) runs the vendor dense GEMM where
    that is cheaper at every row point from some point on (a 50% mask: the GEMV wins at decode, cuBLAS at prefill),
    switching between the last point it wins (``below``) and the first dense wins for good (``from``; selection
    places the switch between them by its kernels' costs); those points cost dense's. (costs, None) where it
    wins at the last point or at none."""
    points = list(zip(rows[1:], costs[1:], dense_at[1:]))
    i = len(points)
    while i and points[i - 1][1] > points[i - 1][2]:
        i -= 1
    if i in (0, len(points)):
        return costs, None
    start = points[i][0]
    return [d if r >= start else c for r, c, d in zip(rows, costs, dense_at)], (points[i - 1][0], start)


def _rounding_note(wtesa: TeSA, widths: list[int], act_bits: int, target: str) -> str:
    """Why a weight width the TeSA asks for does not run as such (rounded up to one the target runs)."""
    asked = sorted(b for b in wtesa.bit_histogram() if b and b not in widths)
    if not asked:
        return ""
    return (f"{'/'.join(map(str, asked))}-bit weights run at the next width {target} has for A{act_bits} "
            f"activations (W{', W'.join(map(str, widths))}): no W{asked[0]}A{act_bits} kernel")


def choose(options, dense_bits: int = 16):
    """The cheapest (cost, sub-ops, ...); within TIE_MARGIN of it, those of the fewest weight bits (the dense path:
    ``dense_bits``), of them the simplest: fewest kernels, then fewest blocks (the dense path counts as one kernel
    of one block).

    Costs closer than the profile's run-to-run spread are not a real difference; fewer bits keep what the TeSA
    asks (and the memory it saves); fewer, larger blocks mean fewer passes over the activation and shorter code.
    """
    best = min(o[0] for o in options)
    near = [o for o in options if o[0] <= best * (1 + TIE_MARGIN)]

    def bits(o):
        return dense_bits if o[1] is None else max((s.weight_bits for s in o[1]), default=0)
    fewest = min(bits(o) for o in near)
    return min((o for o in near if bits(o) == fewest), key=lambda o: (1, 1, o[0]) if o[1] is None else
               (len(o[1]), sum(max(s.n_blocks, 1) for s in o[1]), o[0]))


def _group_options(group, profile: HardwareProfile, act_bits: int, rows: list[int], model_bits: tuple[int, int]):
    """(cost at each of ``rows``, sub-ops costed at the first, description) for each way to run one bit group."""
    by_blocks = group.tesa.block_grid()
    alike = group.tesa.uniform is not None and group.tesa.ndim == 2     # every element alike: one block
    if alike:
        by_blocks = (torch.full((1, 1), group.tesa.uniform, dtype=torch.uint8), group.tesa.shape)
    mask = group.tesa.mask if by_blocks is None else None
    kern = profile.kernel(group.bits, act_bits)
    n, k = group.tesa.shape
    options = []
    if (group.bits, act_bits) != model_bits:  # at the model's own widths this is the dense candidate
        us = [profile.dense_us(m, n, k, group.bits, act_bits) for m in rows]
        nnz = sum(c for b, c in group.tesa.bit_histogram().items() if b)
        options.append((us, [SubOp("dense", group.bits, act_bits, None, 0, nnz, us[0],
                                   elements=group.tesa)], f"dense@W{group.bits}A{act_bits}"))
    seen = set()
    for menu in _menus(kern.block_shapes()):
        menu_costs = {s: kern.blocks[s] for s in menu}
        cover = block_cover(mask, menu_costs) if by_blocks is None else \
            block_cover_by_blocks(by_blocks[0] != 0, by_blocks[1], menu_costs)
        key = tuple((c.shape, c.n_blocks) for c in cover)
        if key in seen:
            continue
        seen.add(key)
        subs, costs = [], [0.0] * len(rows)
        for c in cover:
            us = [profile.cover_us(c.n_blocks, c.shape, m, group.bits, act_bits, k) for m in rows]
            fine = c.shape == (1, 1)
            subs.append(SubOp("fine_sparse" if fine else "block_sparse", group.bits, act_bits, c.shape,
                              c.n_blocks, c.nnz, us[0],
                              blocks=TeSA.from_mask(c.blocks, 1) if not fine else None,
                              elements=group.tesa if alike and len(cover) == 1 else c.elements(group.bits)))
            costs = [a + b for a, b in zip(costs, us)]
        desc = " + ".join(f"{c.n_blocks}x{c.shape[0]}x{c.shape[1]}@W{group.bits}A{act_bits}" for c in cover)
        options.append((costs, subs, desc or "empty"))
    return options


def weight_quantisation(graph: Graph, op: Op, plan: OpPlan, fitted: dict,
                        profile: HardwareProfile | None = None) -> dict:
    """Per integer width the op's sub-operators run: calibration's scales where it fitted that width
    (``fitted``: weight -> WeightQuant), else scales fitted to the (masked) weight alone, in the scheme
    calibration uses by default (8 bits: symmetric per channel; 4: symmetric per 128 columns). The codes
    keep ``profile.code_bits(width)`` bits (7 for int8 on x86 without VNNI)."""
    from ..quant.calibrate import QuantConfig
    from ..quant.scheme import fit_to_weight

    widths = sorted({s.weight_bits for s in plan.subops if s.weight_bits < 16})
    if not widths:
        return {}
    out, w = {}, None
    for bits in widths:
        code = profile.code_bits(bits) if profile is not None else bits
        given = fitted.get(plan.weight)
        if given is not None and given.bits == code:
            out[bits] = given
            continue
        if w is None:
            w = masked_weight(graph, op, plan, None)
        scheme = QuantConfig(0.0).scheme(bits)
        params = fit_to_weight(w, code, **scheme)
        out[bits] = WeightQuant.of(params, scheme["granularity"], "weight")
    return out


def computes_every_element(plan: OpPlan) -> bool:
    """Whether the op's sub-operators compute every weight element (``plan.kept`` all true, without building it)."""
    return any(s.elements is None or s.elements.uniform for s in plan.subops)


def masked_weight(graph: Graph, op: Op, plan: OpPlan, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
    """The op's (N, K) weight with the elements no sub-operator computes zero; ``dtype`` None: the weight's own
    where every element is computed (fp32 otherwise)."""
    if computes_every_element(plan):
        return weight_matrix(graph, op, dtype)
    _, _, _, _, n, k = gemm_view(graph, op)
    w = weight_matrix(graph, op)
    return w if w.is_meta else torch.where(plan.kept(n, k), w, 0.0)      # meta: no values (fitted at load)


__all__ = ["transform_gemm", "row_points", "gemm_view", "GEMM_OPS", "weight_matrix", "in_weight_layout", "gemm_bias",
           "weight_quantisation", "masked_weight", "computes_every_element"]
