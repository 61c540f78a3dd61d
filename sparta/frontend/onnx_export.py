"""Export a sparta graph to ONNX with its TeSAs attached as model metadata.

The graph is emitted as a GraphModule (weights under their ``state_dict`` names) and exported with
``torch.onnx.export(dynamo=True, optimize=False)``: the optimizer would fold transposes into renamed
initializers and merge equal ones (all LayerNorm weights of a freshly initialised model become one
tensor), so it stays off and every weight keeps its own initializer under its own name. Each TeSA is
stored with the identity of the tensor it belongs to (:mod:`sparta.frontend.onnx_tesa`), which
:func:`sparta.frontend.from_onnx` checks before attaching it.
"""

from __future__ import annotations

import warnings

import onnx
import torch

from ..errors import CaptureError
from ..graph import Graph
from ..sampling import random_inputs
from .onnx_tesa import TESA_PREFIX, write_records


def to_onnx(graph: Graph, path=None, *, opset: int = 18) -> onnx.ModelProto:
    """Export ``graph`` (and its TeSAs) to an ONNX model; also written to ``path`` if given."""
    from ..backend.fx import to_graph_module

    gm = to_graph_module(graph)
    args = random_inputs(graph)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prog = torch.onnx.export(gm, args, dynamo=True, optimize=False, opset_version=opset, verbose=False,
                                     input_names=list(graph.inputs), output_names=list(graph.outputs))
    except Exception as exc:  # noqa: BLE001 - exporter failures come in many types
        raise CaptureError(f"ONNX export of graph {graph.name!r} failed: {type(exc).__name__}: {exc}") from exc
    model = prog.model_proto
    skipped = write_records(graph, model)
    if skipped:
        warnings.warn(f"ONNX export of {graph.name!r}: the TeSAs of {len(skipped)} intermediate activations "
                      f"({', '.join(skipped[:3])}…) are not stored (an ONNX value cannot be tied to them); "
                      "propagation re-derives them from the weights after import", stacklevel=3)
    if path is not None:
        onnx.save(model, str(path))
    return model


__all__ = ["to_onnx", "TESA_PREFIX"]
