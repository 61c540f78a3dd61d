"""What a GEMM's epilogue computes: decided here, once, for the planner, calibration and codegen.

A GEMM's epilogue adds its bias and applies the activation that reads its output, where that activation is the
output's only reader (the output is not a graph output) and the target's kernels compute it. ``gelu`` is the exact
(erf) GELU everywhere; ``gelu_tanh`` names the tanh form, which no epilogue computes. The plan records the choice
(``OpPlan.epilogue``, shown by the plan report); codegen fuses exactly what it names.

A gated linear unit is an epilogue too, on CUDA: a GEMM over a gate's and an up projection's weights stacked (the
simplifier's sibling stacking) whose output's two halves are read only as ``act(gate) · up`` writes that product
itself (epilogue entry ``swiglu``, ``geglu``, ...); the ``(M, 2N)`` product is never stored.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..graph import Graph, Op

EPILOGUE_ACTIVATIONS = {"cpu": ("relu", "gelu", "silu", "tanh", "sigmoid"), "cuda": ("relu", "gelu")}
GATED_UNITS = {"cuda": {"silu": "swiglu", "gelu": "geglu", "gelu_tanh": "geglu_tanh", "relu": "reglu"}}


@dataclass(frozen=True)
class GatedUnit:
    """The ops of ``act(gate) · up`` over a GEMM's output halves: two slices, the activation, the product."""
    gate: Op
    up: Op
    act: Op
    mul: Op

    @property
    def ops(self) -> tuple[Op, ...]:
        return self.gate, self.up, self.act, self.mul

    @property
    def activation(self) -> str:
        return activation_name(self.act)


def activation_name(op: Op) -> str:
    """An activation op's name in the epilogue vocabulary (``gelu`` exact, ``gelu_tanh`` the tanh form)."""
    if op.op == "gelu" and op.attrs.get("approximate", "none") != "none":
        return "gelu_tanh"
    return op.op


def fusable_activation(graph: Graph, tensor: str, target: str) -> Op | None:
    """The activation op a GEMM producing ``tensor`` can apply in its epilogue on ``target``, or None."""
    users = graph.consumers(tensor)
    if len(users) != 1 or tensor in graph.outputs:
        return None
    nxt = graph.op(users[0])
    if len(nxt.inputs) != 1 or activation_name(nxt) not in EPILOGUE_ACTIVATIONS.get(target, ()):
        return None
    return nxt


def gated_unit(graph: Graph, tensor: str, target: str) -> GatedUnit | None:
    """The gated linear unit a GEMM producing ``tensor`` can compute in its epilogue on ``target``, or None: its only
    readers slice its last dimension into halves, the first half's only reader an activation, whose and the second
    half's only reader is one product of the two (no broadcast); none of them a graph output."""
    units = GATED_UNITS.get(target)
    users = graph.consumers(tensor)
    if not units or len(users) != 2 or tensor in graph.outputs:
        return None
    width, rank = graph.tensor(tensor).shape[-1], len(graph.tensor(tensor).shape)
    halves = {}
    for name in users:
        o = graph.op(name)
        a = o.attrs
        if o.op != "slice" or o.inputs != [tensor] or a.get("dim") not in (rank - 1, -1) or a.get("step", 1) != 1:
            return None
        halves[(a.get("start") or 0, a.get("end"))] = o
    if not isinstance(width, int) or width % 2 or set(halves) != {(0, width // 2), (width // 2, width)}:
        return None
    gate, up = halves[(0, width // 2)], halves[(width // 2, width)]

    def only_reader(t):
        readers = graph.consumers(t)
        return None if len(readers) != 1 or t in graph.outputs else graph.op(readers[0])
    act = only_reader(gate.outputs[0])
    if act is None or len(act.inputs) != 1 or activation_name(act) not in units:
        return None
    mul = only_reader(act.outputs[0])
    if mul is None or mul.op != "mul" or only_reader(up.outputs[0]) is not mul \
            or sorted(mul.inputs) != sorted([act.outputs[0], up.outputs[0]]) \
            or graph.tensor(mul.outputs[0]).shape != graph.tensor(up.outputs[0]).shape:
        return None
    return GatedUnit(gate, up, act, mul)


def epilogue(graph: Graph, op: Op, target: str) -> list[str]:
    """The GEMM ``op``'s epilogue on ``target``: ``bias`` where it has one, then the fused activation's name (or the
    gated unit's: ``swiglu``, ...)."""
    epi = ["bias"] if (op.input_of("bias") or op.op == "addmm") else []
    unit = gated_unit(graph, op.outputs[0], target)
    if unit is not None:
        return epi + [GATED_UNITS[target][unit.activation]]
    act = fusable_activation(graph, op.outputs[0], target)
    return epi + ([activation_name(act)] if act is not None else [])


def is_gated(entry: str) -> bool:
    """Whether an epilogue entry names a gated linear unit."""
    return any(entry in units.values() for units in GATED_UNITS.values())


def fused_activation(graph: Graph, op: Op, op_plan) -> Op | None:
    """The activation op the plan's epilogue for ``op`` fuses (None: the epilogue has no activation, or computes a
    gated unit: :func:`fused_gate`)."""
    if not op_plan.epilogue or op_plan.epilogue[-1] == "bias" or is_gated(op_plan.epilogue[-1]):
        return None
    return graph.op(graph.consumers(op.outputs[0])[0])


def fused_gate(graph: Graph, op: Op, op_plan) -> GatedUnit | None:
    """The gated unit the plan's epilogue for ``op`` computes (None: it computes none)."""
    if not op_plan.epilogue or not is_gated(op_plan.epilogue[-1]):
        return None
    return gated_unit(graph, op.outputs[0], "cuda")


def epilogue_producer(graph: Graph, tensor: str, target: str) -> str | None:
    """The op whose epilogue writes ``tensor``: its producer, or the GEMM under the activation producing it
    (None: no op's epilogue could write it, e.g. a graph input)."""
    name = graph.producer(tensor)
    if name is None:
        return None
    op = graph.op(name)
    if len(op.inputs) == 1 and (gemm := graph.producer(op.inputs[0])) is not None \
            and getattr(fusable_activation(graph, op.inputs[0], target), "name", None) == op.name:
        return gemm
    return name


__all__ = ["EPILOGUE_ACTIVATIONS", "GATED_UNITS", "GatedUnit", "activation_name", "fusable_activation", "gated_unit",
           "epilogue", "is_gated", "fused_activation", "fused_gate", "epilogue_producer"]
