"""What a GEMM's epilogue computes: decided here, once, for the planner, calibration and codegen.

A GEMM's epilogue adds its bias and applies the activation that reads its output, where that activation is the
output's only reader (the output is not a graph output) and the target's kernels compute it. ``gelu`` is the exact
(erf) GELU everywhere; ``gelu_tanh`` names the tanh form, which no epilogue computes. The plan records the choice
(``OpPlan.epilogue``, shown by the plan report); codegen fuses exactly what it names.
"""

from __future__ import annotations

from ...graph import Graph, Op

EPILOGUE_ACTIVATIONS = {"cpu": ("relu", "gelu", "silu", "tanh", "sigmoid"), "cuda": ("relu", "gelu")}


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


def epilogue(graph: Graph, op: Op, target: str) -> list[str]:
    """The GEMM ``op``'s epilogue on ``target``: ``bias`` where it has one, then the fused activation's name."""
    epi = ["bias"] if (op.input_of("bias") or op.op == "addmm") else []
    act = fusable_activation(graph, op.outputs[0], target)
    return epi + ([activation_name(act)] if act is not None else [])


def fused_activation(graph: Graph, op: Op, op_plan) -> Op | None:
    """The activation op the plan's epilogue for ``op`` fuses (None: the epilogue has no activation)."""
    if not op_plan.epilogue or op_plan.epilogue[-1] == "bias":
        return None
    return graph.op(graph.consumers(op.outputs[0])[0])


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


__all__ = ["EPILOGUE_ACTIVATIONS", "activation_name", "fusable_activation", "epilogue", "fused_activation",
           "epilogue_producer"]
