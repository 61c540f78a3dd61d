"""Which attention ops run :class:`~sparta.templates.attention.runtime.SizesOnlyMaskAttention`: an ordered table of rules, as
for the GEMMs (``select_cpu.py``, ``select_cuda.py``), the same on every target.

An attention op qualifies when its mask is a function of sizes alone: every op the mask is computed from reads only
other such tensors and constants (``arange``, ``full``, the model's weights and buffers), nothing random, and no
graph input reaches it. Such a mask is the same on every call of one shape, so the runtime classifies it once per
shape.
"""

from __future__ import annotations

from ..graph import Graph, Op
from ..passes.simplify import ATTENTION as ATTENTION_OPS
from ..passes.transform.plan import KernelChoice, Plan

RANDOM_OPS = ("rand", "randn", "randint", "randperm", "bernoulli", "multinomial", "normal", "uniform", "dropout",
              "native_dropout", "poisson", "exponential", "geometric", "cauchy", "log_normal", "empty",
              "empty_like", "empty_strided", "new_empty")


def input_reaching(graph: Graph, tensor: str) -> str | None:
    """The first graph input, random or uninitialised op the computation of ``tensor`` reads, or None if it is a
    function of sizes and constants alone."""
    ops, sources = graph.upstream(tensor)
    for name in sources:
        if graph.tensor(name).kind != "weight":
            return f"input {name!r}"
    for op in ops:
        if op.op in RANDOM_OPS or op.op.rstrip("_") in RANDOM_OPS:
            return f"{op.op} ({op.name})"
    return None


def sizes_only_mask(graph: Graph, op: Op) -> KernelChoice | None:
    mask = op.input_of("attn_mask")
    if mask is None or op.attrs.get("dropout_p", 0.0) != 0.0 or op.attrs.get("is_causal"):
        return None
    if input_reaching(graph, mask) is not None:
        return None
    dtype = str(graph.tensor(op.outputs[0]).dtype).removeprefix("torch.")
    return KernelChoice("attention", "sizes_only_mask",
                        "its mask is computed from sizes alone: per shape, dropped where all true, is_causal where "
                        "causal", dtype=dtype)


ATTENTION_RULES = (sizes_only_mask,)


def select_attention(graph: Graph, plan: Plan) -> Plan:
    """Set the kernel of every attention op a rule takes, in place; returns the plan."""
    for op in graph.ops(ATTENTION_OPS):
        picked = next((c for rule in ATTENTION_RULES if (c := rule(graph, op)) is not None), None)
        if picked is not None and op.name in plan.ops:
            plan.ops[op.name].kernel = picked
    return plan


def attention_modules(graph: Graph, plan: Plan) -> dict:
    """The kernel modules of the attention ops selection gave a sparta kernel, by op name."""
    from ..templates.attention.runtime import SizesOnlyMaskAttention
    out = {}
    for op in graph.ops(ATTENTION_OPS):
        choice = plan.ops[op.name].kernel if op.name in plan.ops else None
        if choice is not None and choice.kernel == "attention":
            names = [op.input_of(role) for role in ("query", "key", "value", "attn_mask")] + list(graph.inputs)
            out[op.name] = SizesOnlyMaskAttention(op.name, names, op.attrs.get("scale"),
                                                  op.attrs.get("enable_gqa", False))
    return out


__all__ = ["ATTENTION_OPS", "ATTENTION_RULES", "attention_modules", "input_reaching", "select_attention",
           "sizes_only_mask"]
