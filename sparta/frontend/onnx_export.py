"""Export a sparta graph to ONNX with its TeSAs attached as model metadata.

The graph is emitted as a GraphModule (weights under their ``state_dict`` names, ops
under their graph names) and exported with ``torch.onnx.export(dynamo=True)``, which
keeps those names for initializers and values. Every TeSA that says more than "dense at
the dtype's width" is stored as ``metadata_props["sparta.tesa.<tensor>"]`` (JSON,
packed payload); :func:`sparta.frontend.from_onnx` re-attaches them by name.
"""

from __future__ import annotations

import json
import warnings

import onnx
import torch

from ..errors import CaptureError
from ..graph import Graph
from ..sampling import random_inputs
from ..tesa import bits_of_dtype
from .onnx_import import TESA_PREFIX


def to_onnx(graph: Graph, path=None, *, opset: int = 18) -> onnx.ModelProto:
    """Export ``graph`` (and its TeSAs) to an ONNX model; also written to ``path`` if given."""
    from ..backend.fx import to_graph_module

    gm = to_graph_module(graph)
    args = random_inputs(graph)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prog = torch.onnx.export(gm, args, dynamo=True, opset_version=opset, verbose=False,
                                     input_names=list(graph.inputs), output_names=list(graph.outputs))
    except Exception as exc:  # noqa: BLE001 - exporter failures come in many types
        raise CaptureError(f"ONNX export of graph {graph.name!r} failed: {type(exc).__name__}: {exc}") from exc
    model = prog.model_proto
    for v in graph.tensors():
        if v.tesa.uniform == bits_of_dtype(v.dtype):
            continue
        prop = model.metadata_props.add()
        prop.key, prop.value = TESA_PREFIX + v.name, json.dumps(v.tesa.to_json())
    if path is not None:
        onnx.save(model, str(path))
    return model
