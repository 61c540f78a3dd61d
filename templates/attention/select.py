"""Selection rule of the attention family (the ``attention`` table, ``templates/registry.py``), the same on every
target: an attention op qualifies when its mask is a function of sizes alone: every op the mask is computed from
reads only other such tensors and constants (``arange``, ``full``, the model's weights and buffers), nothing random,
and no graph input reaches it. Such a mask is the same on every call of one shape, so the runtime classifies it once
per shape."""

from __future__ import annotations

from ...graph import Graph, Op
from ...passes.transform.plan import KernelChoice
from ..registry import rule

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


@rule("attention", 90)
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
