"""``propagate(graph)``: the fixed point of all propagation rules over a graph.

Each tensor's TeSA is ``fact ∧ (∨ over its consumers of what each needs)``:

* facts come from the user's initial TeSAs and from forward rules (the element is zero);
* needs come from each consumer's backward / input→input rule (the element matters to
  that consumer's kept outputs). An element is irrelevant only when *every* consumer
  agrees, so one consumer cannot prune what another reads (the residual-add conflict).
  Graph outputs are needed as they are; a tensor nobody reads is irrelevant.

A worklist visits ops; when a TeSA changes, the ops touching it are revisited, until
nothing changes. Every update is a lattice meet, and a rule returning a value above what
it was given raises :class:`PropagationError`. Ops without a rule (or all ops, with
``scramble="always"``) are scrambled.
"""

from __future__ import annotations

import dataclasses

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from ..errors import PropagationError
from ..graph import Graph, Op
from ..tesa import TeSA
from .rules import get_rule
from .scramble import scramble as run_scramble

SCRAMBLE_MODES = ("fallback", "always", "never")


@dataclass
class PropagationReport:
    """What propagation did: counts, timings, and per tensor density/bits before and after."""

    evaluations: int = 0
    changes: int = 0
    seconds: float = 0.0
    by_rule: dict[str, int] = field(default_factory=dict)
    scrambled: list[str] = field(default_factory=list)
    no_rule: list[str] = field(default_factory=list)
    before: dict[str, tuple[float, dict]] = field(default_factory=dict)
    after: dict[str, tuple[float, dict]] = field(default_factory=dict)
    # a graph with dynamic dimensions: weights whose pruning was undone (it held only at the example's sequence)
    sequence_bound: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        for side in ("before", "after"):
            d[side] = {n: [dens, {str(b): c for b, c in bits.items()}] for n, (dens, bits) in d[side].items()}
        return d

    @classmethod
    def from_json(cls, data: dict) -> PropagationReport:
        data = {"sequence_bound": [], **data}
        for side in ("before", "after"):
            data[side] = {n: (dens, {int(b): c for b, c in bits.items()}) for n, (dens, bits) in data[side].items()}
        return cls(**data)

    def changed(self) -> list[str]:
        return [n for n in self.after if self.after[n] != self.before.get(n)]

    def table(self, only_changed: bool = True) -> str:
        rows = [("tensor", "density before", "density after", "bits after")]
        for name in (self.changed() if only_changed else list(self.after)):
            (d0, _), (d1, bits) = self.before[name], self.after[name]
            rows.append((name, f"{d0:.3f}", f"{d1:.3f}", " ".join(f"{b}:{c}" for b, c in sorted(bits.items()))))
        from ..text import table
        head = (f"propagation: {self.evaluations} rule evaluations, {self.changes} TeSA changes, "
                f"{self.seconds:.2f} s; scrambled: {len(self.scrambled)} ops; no rule: {len(self.no_rule)} ops")
        return head + "\n" + table(rows)


def _stats(t: TeSA):
    return (round(t.density, 6), t.bit_histogram())


def propagate(graph: Graph, *, scramble: str = "fallback", trials: int = 16, seed: int = 0, device="cpu",
              max_evaluations: int | None = None, copy: bool = True) -> Graph:
    """Propagate TeSAs to a fixed point; returns the graph (a copy unless ``copy=False``).

    ``scramble``: ``"fallback"`` (ops without a rule), ``"always"`` (every op; to check the
    rules), ``"never"``. The report lands in ``graph.propagation``. In a graph captured with
    dynamic dimensions only the pruning of weights that GEMMs read is kept (it must hold at every shape).
    """
    if scramble not in SCRAMBLE_MODES:
        raise PropagationError(f"scramble must be one of {SCRAMBLE_MODES}, got {scramble!r}")
    g = graph.copy() if copy else graph
    report = PropagationReport()
    t0 = time.perf_counter()
    report.before = {v.name: _stats(v.tesa) for v in g.tensors()}
    before = {v.name: v.tesa for v in g.tensors("weight")}
    engine = _Engine(g, scramble, trials, seed, device, report)
    engine.run(max_evaluations or 50 * max(len(g), 1) + 100)
    if g.meta.get("dynamic_dims"):
        report.sequence_bound = _restore_sequence_bound_weights(g, before)
    report.seconds = time.perf_counter() - t0
    report.after = {v.name: _stats(v.tesa) for v in g.tensors()}
    g.propagation = report
    return g


GEMM_OPS = ("linear", "addmm", "mm", "matmul", "bmm", "conv1d", "conv2d", "conv3d")
LAYOUT_OPS = ("t", "permute", "transpose", "view", "reshape", "_unsafe_view", "expand", "contiguous", "clone")


def _restore_sequence_bound_weights(graph: Graph, before: dict) -> list[str]:
    """In a graph captured with dynamic dimensions, keep what propagation pruned only for weights that GEMMs and
    convolutions read (through layout ops): their pruning follows feature dimensions. Any other weight (a position
    embedding, a position-id buffer) may have been pruned only because the example's sequence was short; it keeps
    the TeSA it had. Returns those weights."""
    def gemm_only(name, seen=()):
        users = graph.consumers(name)
        if not users:
            return False
        for u in users:
            op = graph.op(u)
            if op.op in GEMM_OPS:
                continue
            if op.op in LAYOUT_OPS and u not in seen and all(gemm_only(t, (*seen, u)) for t in op.outputs):
                continue
            return False
        return True
    restored = []
    for name, tesa in before.items():
        if graph.tesa(name) != tesa and not gemm_only(name):
            graph.set_tesa(name, tesa)
            restored.append(name)
    return restored


def _structure(op: Op) -> str:
    """What a rule reads of ``op`` besides the TeSAs, with its tensors named by their place among its inputs (so two
    layers' ops of one structure have one key)."""
    from torch.utils import _pytree as pytree

    from ..graph import TensorRef
    slot = {t: i for i, t in reversed(list(enumerate(op.inputs)))}

    def anon(x):
        return f"@{slot.get(x.name, x.name)}"
    args = pytree.tree_map_only(TensorRef, anon, (op.args, op.kwargs))
    return repr((op.op, str(op.target), op.roles, [slot[t] for t in op.inputs], len(op.outputs), op.multi_output,
                 sorted(op.attrs.items(), key=lambda kv: kv[0]), args))


class _Engine:
    def __init__(self, g: Graph, scramble: str, trials: int, seed: int, device, report: PropagationReport):
        self.g, self.mode, self.trials, self.seed, self.device, self.report = g, scramble, trials, seed, device, report
        self.fact = {v.name: v.tesa for v in g.tensors()}
        self.needs: dict[tuple[str, int], TeSA] = {}
        self.slots = {v.name: [] for v in g.tensors()}
        for op in g.ops():
            for i, t in enumerate(op.inputs):
                self.slots[t].append((op.name, i))
        self.is_output = set(g.outputs)
        self.constants = {v.name: v.data for v in g.tensors("weight")
                          if not v.dtype.is_floating_point and v.has_data}
        self.memo: dict[tuple, tuple] = {}      # rule answers by op structure and TeSA contents (repeated layers)

    def remembered(self, op: Op, ins, outs, fn):
        """``fn(op, ins, outs)`` of a rule (a pure function of the op's structure and the TeSAs), answered from
        :attr:`memo` for an op of the same structure already seen with equal TeSAs (the next decoder layer's)."""
        key = (_structure(op), tuple(t.digest() for t in ins), tuple(t.digest() for t in outs))
        hit = self.memo.get(key)
        if hit is None:
            res = fn(op, ins, outs)
            if res is None:
                self.memo[key] = (None,)
                return None
            hit = tuple([None if new is old else new for new, old in zip(news, olds)] for news, olds in
                        zip(res, (ins, outs)))
            self.memo[key] = hit
        if hit == (None,):
            return None
        return tuple([old if new is None else new for new, old in zip(news, olds)] for news, olds in
                     zip(hit, (ins, outs)))

    def combined(self, name: str) -> TeSA:
        fact = self.fact[name]
        slots = self.slots[name]
        if name in self.is_output or any(s not in self.needs for s in slots):
            return fact
        if not slots:
            return TeSA.pruned(fact.shape) if fact.uniform != 0 else fact
        join = self.needs[slots[0]]
        for s in slots[1:]:
            join = join.join(self.needs[s])
        return fact.meet(join)

    def update(self, name: str, queue, queued) -> None:
        value = self.g.tensor(name)
        new = self.combined(name).meet(value.tesa)
        if new is value.tesa or new == value.tesa:
            return
        value.tesa = new
        self.report.changes += 1
        touching = [self.g.producer(name)] + self.g.consumers(name)
        for op_name in touching:
            if op_name is not None and op_name not in queued:
                queue.append(op_name)
                queued.add(op_name)

    def evaluate(self, op: Op, ins, outs):
        fn = None if self.mode == "always" else get_rule(op.op)
        res = self.remembered(op, ins, outs, fn) if fn is not None else None
        if res is not None:
            self.report.by_rule[fn.__name__] = self.report.by_rule.get(fn.__name__, 0) + 1
            return res, fn.__name__
        if fn is None and op.name not in self.report.no_rule:
            self.report.no_rule.append(op.name)
        if self.mode == "never":
            return None, None
        res = run_scramble(op, ins, outs, trials=self.trials, seed=self.seed, device=self.device,
                           constants={t: self.constants[t] for t in op.inputs if t in self.constants})
        if res is not None and op.name not in self.report.scrambled:
            self.report.scrambled.append(op.name)
        return res, "scramble"

    def run(self, limit: int) -> None:
        queue = deque(op.name for op in self.g.ops())
        queued = set(queue)
        # start from what the graph says: outputs are fully needed, unread tensors irrelevant
        for v in list(self.g.tensors()):
            if not self.slots[v.name] and v.name not in self.is_output:
                self.update(v.name, queue, queued)
        from ..progress import bar
        with bar("propagate", unit="rule") as progress:
            self._drain(queue, queued, limit, progress)

    def _drain(self, queue, queued, limit: int, progress) -> None:
        while queue:
            progress.update(1)
            if self.report.evaluations >= limit:
                raise PropagationError(f"propagation did not converge within {limit} rule evaluations")
            op = self.g.op(queue.popleft())
            queued.discard(op.name)
            ins = [self.g.tesa(t) for t in op.inputs]
            outs = [self.g.tesa(t) for t in op.outputs]
            self.report.evaluations += 1
            with torch.no_grad():
                res, who = self.evaluate(op, ins, outs)
            if res is None:
                continue
            new_ins, new_outs = res
            self._check(op, who, ins, new_ins, "input")
            self._check(op, who, outs, new_outs, "output")
            for t, old, new in zip(op.outputs, outs, new_outs):
                if new is not old:
                    self.fact[t] = self.fact[t].meet(new)
                    self.update(t, queue, queued)
            for i, (t, old, new) in enumerate(zip(op.inputs, ins, new_ins)):
                if new is not old:
                    self.needs[(op.name, i)] = new
                    self.update(t, queue, queued)
                elif (op.name, i) not in self.needs:
                    self.needs[(op.name, i)] = old

    @staticmethod
    def _check(op: Op, who, given, returned, what) -> None:
        if len(returned) != len(given):
            raise PropagationError(f"{who} for op {op.name!r} ({op.op}) returned {len(returned)} {what} TeSAs, "
                                   f"expected {len(given)}")
        for i, (a, b) in enumerate(zip(given, returned)):
            if b is a:
                continue
            if not isinstance(b, TeSA) or b.shape != a.shape:
                raise PropagationError(f"{who} for op {op.name!r} ({op.op}) returned a bad {what} TeSA #{i}")
            if not b <= a:
                raise PropagationError(f"{who} for op {op.name!r} ({op.op}) raised {what} #{i} above the "
                                       "lattice value it was given (rules may only lower TeSAs)")
