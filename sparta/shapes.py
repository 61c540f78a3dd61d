"""Which input shapes a compiled model takes: the capture policy of ``compile(dynamic=...)``, the token range its plan
is costed over (``compile(tokens=...)``) and the plan report's ``shapes:`` line."""

from __future__ import annotations

import warnings

import torch

from .errors import CaptureError, SpartaError
from .graph import Graph, TokenRange


def capture_shapes(model, example_inputs, example_kwargs, parameters, dynamic) -> Graph:
    """The graph of ``model``: by default (``dynamic=None``) a torch module with its batch and sequence dimensions
    free, or, where it cannot be captured so, at the example's shapes (warned, the reason in the plan report)."""
    from .frontend import capture
    if dynamic is not None or not isinstance(model, torch.nn.Module):
        graph = capture(model, example_inputs, example_kwargs, parameters=parameters, dynamic=bool(dynamic)
                        if not isinstance(dynamic, dict) else dynamic)
        if dynamic is True and graph.meta.get("fixed_dims"):
            from .frontend.torch_export import FixedDimensionError
            fixed = graph.meta["fixed_dims"].items()
            raise FixedDimensionError(
                "dynamic=True: " + "; ".join(f"{dim} {why}" for dim, why in fixed)
                + " (the default, dynamic=None, frees the dimensions the model allows; dynamic=False specialises "
                "them all)")
        return graph
    try:
        graph = capture(model, example_inputs, example_kwargs, dynamic=True)
    except CaptureError as exc:
        graph = capture(model, example_inputs, example_kwargs, dynamic=False)
        why = f"captured for the example's shapes only: with free batch and sequence dimensions, {exc}"
        warnings.warn(f"sparta.compile: {why} (dynamic=False silences this)", stacklevel=3)
        graph.meta["one_shape"] = why
        return graph
    from .frontend.torch_export import size_one_dims
    if ones := size_one_dims(model, example_inputs, example_kwargs):
        why = (f"{', '.join(ones)} fixed at the example's size 1 (torch.export keeps sizes 0 and 1 static): "
               "trace with 2 or more to free them")
        warnings.warn(f"sparta.compile: {why} (dynamic=False silences this)", stacklevel=3)
        graph.meta["size_one"] = why
    if not graph.any_rows:
        fixed = "; ".join(f"{dim} {why}" for dim, why in graph.meta.get("fixed_dims", {}).items())
        graph.meta["one_shape"] = graph.meta.pop("size_one", None) or (
            "the example's only: the model fixes its batch and sequence sizes (torch.export kept them static"
            + (f": {fixed})" if fixed else ")"))
    return graph


def plan_tokens(graph: Graph, tokens) -> None:
    """Record the token range a dynamic graph is planned over (``graph.token_range``)."""
    if tokens is None and not graph.any_rows:
        return
    if not graph.any_rows:
        raise SpartaError("tokens= plans a model captured with dynamic dimensions over a range; this one was "
                          "captured for one shape (compile with dynamic=True)")
    example = graph.example_tokens
    lo, hi = (1, example) if tokens is None else tokens if isinstance(tokens, (tuple, list)) and len(tokens) == 2 \
        else (None, None)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in (lo, hi)) or not 1 <= lo <= hi:
        raise SpartaError(f"tokens must be (lo, hi) with 1 <= lo <= hi, got {tokens!r}")
    graph.token_range = TokenRange(lo, hi, example)


def shapes_line(graph: Graph) -> str:
    """``shapes: ...``: the input dimensions free at run time and the token range, or why the model takes one shape."""
    meta = graph.meta
    if not graph.any_rows:
        return "shapes: " + meta.get("one_shape", "the example's only (compiled with dynamic=False, or from ONNX)")
    span = graph.token_range
    free = ", ".join(f"{t}[{d}]" for t in graph.inputs for d in graph.dynamic_dims_of(t))
    return (f"shapes: any size of {free}" + (f"; planned over {span.lo}-{span.hi} tokens (the example's: "
                                              f"{span.example})" if span else "")
            + (f"; {meta['size_one']}" if meta.get("size_one") else ""))


__all__ = ["capture_shapes", "plan_tokens", "shapes_line"]
