"""Frontends: torch modules (``torch.export``) and ONNX models into a sparta Graph."""

from __future__ import annotations

import os

import torch

from ..errors import CaptureError
from ..graph import Graph
from .torch_export import KEEP, from_torch


def from_onnx(model_or_path, example_inputs=None, *, parameters=None) -> Graph:
    """Import an ONNX model (see :mod:`sparta.frontend.onnx_import`; onnx imported lazily).

    ``parameters`` (a ``state_dict``) lets TeSAs be attached by those names to renamed initializers."""
    from .onnx_import import from_onnx as _from_onnx
    return _from_onnx(model_or_path, example_inputs, parameters=parameters)


def to_onnx(graph: Graph, path=None, **kwargs):
    """Export a graph with its TeSAs to ONNX (see :mod:`sparta.frontend.onnx_export`)."""
    from .onnx_export import to_onnx as _to_onnx
    return _to_onnx(graph, path, **kwargs)


def capture(model_or_onnx, example_inputs=(), example_kwargs=None, *, parameters=None, dynamic=False) -> Graph:
    """Turn a ``torch.nn.Module``, an ONNX ``ModelProto`` or an ``.onnx`` path into a Graph.

    For ONNX, ``parameters`` (the source model's ``state_dict``) names its initializers after them. ``dynamic``
    (torch modules): batch and sequence dimensions stay symbolic (:func:`from_torch`)."""
    if isinstance(model_or_onnx, torch.nn.Module):
        if parameters is not None:
            raise CaptureError("parameters= is for ONNX models; a torch module's weights keep their names")
        graph = from_torch(model_or_onnx, example_inputs, example_kwargs, dynamic=dynamic)
    elif dynamic:
        raise CaptureError("dynamic shapes are captured from torch modules (torch.export); an ONNX model is "
                           "compiled at its example shapes")
    elif isinstance(model_or_onnx, (str, os.PathLike)) or type(model_or_onnx).__name__ == "ModelProto":
        graph = from_onnx(model_or_onnx, example_inputs if example_inputs != () else None, parameters=parameters)
        example_inputs = example_inputs or None
    else:
        raise CaptureError(f"cannot capture a {type(model_or_onnx).__name__}: "
                           "pass a torch.nn.Module, an onnx.ModelProto or a path to an .onnx file")
    _record_input_ranges(graph, (example_inputs, example_kwargs or {}))
    return graph


def _record_input_ranges(graph: Graph, example_inputs) -> None:
    """Remember the value range of integer inputs (token ids) for random verification inputs."""
    from torch.utils import _pytree as pytree
    leaves = [x for x in pytree.tree_leaves(example_inputs) if isinstance(x, torch.Tensor)]
    ranges = {}
    for name, x in zip(graph.inputs, leaves):
        if not x.dtype.is_floating_point and x.dtype != torch.bool and x.numel():
            ranges[name] = (int(x.min()), int(x.max()))
    graph.meta["input_ranges"] = ranges


__all__ = ["capture", "from_torch", "from_onnx", "to_onnx", "KEEP"]
