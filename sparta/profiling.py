"""Where a compiled model's time goes, op by op: ``compiled.profile(*inputs)``.

The measurement that closes a researcher's loop (prune → compile → profile → adjust the TeSA): each graph op
timed inside the forward, on the tensors it hands it, as sparta runs it (its kernel or the torch op) and as the dense
reference runs it (the torch op on the masked weights), beside the plan's estimates; the ops sparta runs slower than
dense are named. The whole forward is timed too, as the user calls the model (through its third stage) and as the
dense reference runs eagerly.
"""

from __future__ import annotations

import bisect
import math
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
from torch import fx

from .backend.fx import Fused, Passthrough, _fx_name
from .passes.transform.groups import group_of
from .errors import SpartaError
from .text import table


@dataclass
class OpTime:
    """One graph op: what ran it, its measured µs (sparta's and the dense reference's) and the plan's estimates."""

    op: str
    op_type: str
    runs: str                       # the sparta kernel that ran it (the plan's kernel column), "fused" (another op's
    #                                 kernel did its work) or "torch"
    measured_us: float              # sparta's call of the op inside the forward (median over forwards)
    dense_us: float                 # the dense reference's op on the same tensors
    est_us: float | None = None     # the plan's estimate at this call's rows, for the ops it costs (GEMMs)
    dense_est_us: float | None = None
    note: str = ""
    rows: int | None = None         # a GEMM's rows (M) at this call

    @property
    def speedup(self) -> float:
        return self.dense_us / self.measured_us if self.measured_us > 0 else float("inf")


@dataclass
class Profile:
    """A profile of one forward (see :func:`profile`): ``report()`` prints it, ``to_json()`` keeps it."""

    device: str
    inputs: list[list[int]]
    ops: list[OpTime] = field(default_factory=list)
    forward_us: float = 0.0         # the compiled model as the user calls it (third stage included)
    dense_forward_us: float = 0.0   # the dense reference module, eager

    def op(self, name: str) -> OpTime:
        return next(o for o in self.ops if o.op == name)

    def sparta_ops(self) -> list[OpTime]:
        return [o for o in self.ops if o.runs not in ("torch", "fused")]

    def slower_than_dense(self, margin: float = 1.0) -> list[str]:
        """The GEMMs a sparta kernel runs that measured slower than ``margin`` × their dense op (what
        ``compiled.run_dense`` takes)."""
        return [o.op for o in self.sparta_ops() if o.est_us is not None and o.measured_us > margin * o.dense_us]

    def report(self, top: int | None = 20) -> str:
        """The ``top`` ops by sparta's measured time (None: all), then totals and the ops slower than dense."""
        rows = [("op", "type", "runs", "est µs", "measured µs", "dense µs", "×", "note")]
        for o in sorted(self.ops, key=lambda o: -o.measured_us)[:top]:
            rows.append((o.op, o.op_type, o.runs, "" if o.est_us is None else f"{o.est_us:.1f}",
                         f"{o.measured_us:.1f}", f"{o.dense_us:.1f}", f"{o.speedup:.2f}", o.note))
        ours, dense = sum(o.measured_us for o in self.ops), sum(o.dense_us for o in self.ops)
        lines = [table(rows),
                 f"ops: {ours:.1f} µs, dense {dense:.1f} µs ({dense / ours:.2f}x); sparta kernels "
                 f"{sum(o.measured_us for o in self.sparta_ops()):.1f} µs against their dense ops' "
                 f"{sum(o.dense_us for o in self.sparta_ops()):.1f} µs",
                 f"forward as called: {self.forward_us:.1f} µs; dense reference, eager: "
                 f"{self.dense_forward_us:.1f} µs "
                 f"({self.dense_forward_us / self.forward_us:.2f}x) on {self.device}, inputs {self.inputs}"]
        slow = self.slower_than_dense()
        if slow:
            lines.append(f"slower than dense: {', '.join(slow)} (compiled.run_dense(profile.slower_than_dense()) runs "
                         "them dense; or prune them coarser)")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return asdict(self)


class _OpTimer(fx.Interpreter):
    """Runs a GraphModule node by node, timing once each node that computes a graph op (summed per op): in the
    forward's own order, so every op meets the caches as the forward leaves them (a decode step's weights come from
    memory, not from the cache a repeated call would warm)."""

    def __init__(self, gm: fx.GraphModule, ops_by_node: dict[str, str], device: torch.device):
        super().__init__(gm)
        self.ops_by_node, self.cuda, self.times = ops_by_node, device.type == "cuda", {}

    def run_node(self, n: fx.Node):
        op = self.ops_by_node.get(n.name)
        if op is None or n.op not in ("call_module", "call_function", "call_method"):
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        call = getattr(self, n.op)
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = call(n.target, args, kwargs)
            end.record()
            end.synchronize()
            us = start.elapsed_time(end) * 1e3
        else:
            t0 = time.perf_counter()
            out = call(n.target, args, kwargs)
            us = (time.perf_counter() - t0) * 1e6
        self.times[op] = self.times.get(op, 0.0) + us
        return out


def median_us(fn, reps: int, device: torch.device) -> float:
    """Median µs of ``fn()`` over ``reps`` calls after one more, on ``device``'s clock."""
    from .codegen.profile import median_timer
    return median_timer(device.type)(fn, reps)


def op_times(gm: fx.GraphModule, graph, flat: list[torch.Tensor], reps: int) -> dict[str, float]:
    """µs of each graph op of ``graph`` as ``gm`` (an fx module built from it) runs it on ``flat``: the median over
    ``reps`` forwards (after one more) of its time inside each."""
    device = flat[0].device if flat else torch.device("cpu")
    ops_by_node = {_fx_name(op.name): op.name for op in graph.ops()}
    runs = []
    with torch.no_grad():
        for _ in range(reps + 1):
            timer = _OpTimer(gm, ops_by_node, device)
            timer.run(*flat)
            runs.append(timer.times)
    return {op: statistics.median(r[op] for r in runs[1:]) for op in runs[0]}


def call_rows(p, graph, flat: list[torch.Tensor]) -> int | None:
    """A costed GEMM's rows (M) at a call of these inputs: its rows at the example scaled by the call's tokens (the
    product of the dynamic dimensions), as the plan scales them over its token range."""
    if p is None or p.gemm is None:
        return None
    dims, m = graph.meta.get("dynamic_dims", {}), p.gemm[0]
    if not dims:
        return m
    sizes = {t: x.shape for t, x in zip(graph.inputs, flat)}
    tokens = math.prod(sizes[t][d] for t, d in dims.values())
    return max(1, round(m * tokens / max(graph.example_tokens, 1)))


def estimate_at(p, rows: int) -> tuple[float, float]:
    """The plan's (estimate, dense estimate) of a GEMM at ``rows``: linear between the rows it was costed at
    (``OpPlan.rows_us``, and the example's), continued from the nearest two beyond them."""
    points = sorted({(p.gemm[0], p.est_us, p.dense_us), *((r, e, d) for r, e, d in p.rows_us)})
    if len(points) == 1:
        return p.est_us, p.dense_us
    i = min(max(bisect.bisect_left([r for r, _, _ in points], rows), 1), len(points) - 1)
    (r0, e0, d0), (r1, e1, d1) = points[i - 1], points[i]
    t = (rows - r0) / (r1 - r0) if r1 != r0 else 0.0
    return e0 + t * (e1 - e0), d0 + t * (d1 - d0)


def profile(compiled, args=(), kwargs=None, reps: int = 10) -> Profile:
    """Profile ``compiled`` on one call's inputs (``args``/``kwargs`` as the model takes them; none: random inputs
    of the example's shapes on the model's device)."""
    from .sampling import random_inputs
    if not isinstance(reps, int) or reps < 1:
        raise SpartaError(f"profile needs reps >= 1, got {reps!r}")
    graph, device = compiled.graph, compiled.device
    if device.type != compiled.target:
        raise SpartaError(f"a model compiled for {compiled.target} is profiled there: compiled.to({compiled.target!r}) "
                          f"first (it is on {device})")
    if not args and not kwargs:
        args = tuple(x.to(device) for x in random_inputs(graph, seed=0))
    flat = graph.flat_inputs(args, kwargs)
    reference = compiled.reference().to(device)
    ours = op_times(compiled.module, graph, flat, reps)
    dense = op_times(reference, graph, flat, reps)
    replacements, plan = compiled.module_replacements(), compiled.plan
    rows = []
    for op in graph.ops():
        p = plan.ops.get(op.name) if plan is not None else None
        module = replacements.get(op.name)
        runs, note = "torch", p.note if p is not None else ""
        group = group_of(plan, op.name) if plan is not None else None
        if group is not None:
            runs, note = "fused", f"done by {group.anchor}"
        elif isinstance(module, (Fused, Passthrough)):     # a plan saved before fusion groups
            runs, note = "fused", "by another op's kernel"
        elif module is not None:
            runs = p.kernel.describe() if p is not None and p.kernel is not None else type(module).__name__
        m = call_rows(p, graph, flat)
        est, dense_est = estimate_at(p, m) if m is not None else (None, None)
        rows.append(OpTime(op.name, op.op, runs, ours.get(op.name, 0.0), dense.get(op.name, 0.0), est, dense_est,
                           note, m))
    with torch.no_grad():
        forward = median_us(lambda: compiled(*args, **(kwargs or {})), reps, device)
        dense_forward = median_us(lambda: reference(*flat), reps, device)
    return Profile(str(device), [list(x.shape) for x in flat], rows, forward, dense_forward)


__all__ = ["OpTime", "Profile", "median_us", "op_times", "profile"]
