"""Run a graph on calibration batches along two paths in lock step: full precision and quantized.

Values are lists (one tensor per batch). Until the first quantized op both paths share their
values, so the quantized path costs nothing there; a value is freed once its last reader ran.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...graph import Graph, Op

Values = list[torch.Tensor]


class LockstepWalk:
    """``run(quantize_op, on_op, on_value)`` walks every op once:

    * ``on_op(op, walk)`` may decide before the op's quantized output is computed;
    * ``quantize_op(op) -> (weight override | None, activation fn | None)`` says how the quantized
      path runs it (a dequantised weight, a fake-quantisation applied to its activation input);
    * ``on_value(name, walk)`` sees each produced tensor (and each graph input) once both paths hold it.
    """

    def __init__(self, graph: Graph, batches: list[list[torch.Tensor]], weights: dict[str, torch.Tensor]):
        self.graph = graph
        self.batches = batches
        self.weights = {v.name: weights.get(v.name, v.data) for v in graph.tensors("weight") if v.data is not None}
        self.device = next((t.device for b in batches for t in b if isinstance(t, torch.Tensor)), None)
        self.fp: dict[str, Values] = {}
        self.q: dict[str, Values] = {}

    # ---- running one op -------------------------------------------------------------------------
    def call(self, op: Op, values: dict[str, Values], b: int, override: dict[str, torch.Tensor] | None = None):
        env = {t: (override[t] if override and t in override else
                   self.weights[t] if t in self.weights and t not in values else values[t][b]) for t in op.inputs}
        try:
            return op.call(env, self.device)
        except RuntimeError as exc:     # a view of a tensor another device lays out otherwise (SDPA's output on CUDA)
            if op.op != "view" or "view size is not compatible" not in str(exc):
                raise
            return op.call({t: v.contiguous() if isinstance(v, torch.Tensor) else v for t, v in env.items()},
                           self.device)

    def run_op(self, op: Op, values: dict[str, Values], override=None) -> list[Values]:
        """The op's outputs over every batch: one list per output."""
        outs = [self.call(op, values, b, override) for b in range(len(self.batches))]
        return [[o[i] for o in outs] for i in range(len(op.outputs))]

    # ---- the walk -----------------------------------------------------------------------------------
    def run(self, quantize_op: Callable, on_op: Callable | None = None, on_value: Callable | None = None,
            desc: str = "calibrate", progress: bool = True) -> tuple[list[Values], list[Values]]:
        from tqdm.auto import tqdm

        g = self.graph
        uses = {}
        for op in g.ops():
            for t in set(op.inputs):
                uses[t] = uses.get(t, 0) + 1
        for t in g.outputs:
            uses[t] = uses.get(t, 0) + 1
        self.fp = {name: [b[i] for b in self.batches] for i, name in enumerate(g.inputs)}
        self.q = dict(self.fp)
        if on_value is not None:
            for name in g.inputs:
                on_value(name, self)
        for op in tqdm(list(g.ops()), desc=desc, disable=not progress, leave=False):
            outs_fp = self.run_op(op, self.fp)
            if on_op is not None:
                on_op(op, self, outs_fp)
            w_over, act = quantize_op(op)
            acts = [t for t in op.inputs if t in self.q and t not in self.weights]
            if w_over is None and act is None and all(self.q[t] is self.fp[t] for t in acts):
                outs_q = outs_fp
            else:
                values = self.q
                if act is not None:
                    values = dict(self.q)
                    values[act[0]] = [act[1](v) for v in self.q[act[0]]]
                outs_q = self.run_op(op, values, w_over)
            for name, vf, vq in zip(op.outputs, outs_fp, outs_q):
                self.fp[name], self.q[name] = vf, vq
            for name in op.outputs:
                if on_value is not None and name in uses:
                    on_value(name, self)
            for t in set(op.inputs):
                if t in uses:
                    uses[t] -= 1
                    if uses[t] == 0:
                        self.fp.pop(t, None)
                        self.q.pop(t, None)
        return [self.fp[t] for t in g.outputs], [self.q[t] for t in g.outputs]


def relative_mse(reference: list[Values], quantized: list[Values]) -> float:
    """‖q − r‖² / ‖r‖² over every floating-point output and batch."""
    num = den = 0.0
    for rs, qs in zip(reference, quantized):
        for r, q in zip(rs, qs):
            if isinstance(r, torch.Tensor) and r.dtype.is_floating_point:
                num += float((q.detach().double() - r.detach().double()).pow(2).sum())
                den += float(r.detach().double().pow(2).sum())
    return num / den if den > 0 else 0.0
