"""A GEMM-like op (linear, addmm, mm, matmul, a convolution as a GEMM) seen as ``X · Wᵀ``: its activation, weight,
bias and sizes, what the planner, calibration and codegen all read."""

from __future__ import annotations

import math

import torch

from ..graph import Graph, Op
from ..tesa import TeSA


def gemm_view(graph: Graph, op: Op):
    """(activation, weight name, weight TeSA as (N, K), M, N, K) of a GEMM-like op, or None."""
    def is_weight(name):
        v = graph.tensor(name)
        return v.kind == "weight" and v.has_data and v.dtype.is_floating_point

    if op.op == "linear":
        x, w = op.input_of("input"), op.input_of("weight")
        if x is None or w is None or not is_weight(w):
            return None
        wv = graph.tensor(w)
        if len(wv.shape) != 2:
            return None
        n, k = wv.shape
        return x, w, graph.tesa(w), _rows(graph, x), n, k
    if op.op in ("addmm", "mm", "matmul"):
        a, b = (op.input_of("mat1"), op.input_of("mat2")) if op.op != "matmul" else \
            (op.input_of("self"), op.input_of("other"))
        if op.op == "mm":
            a, b = op.input_of("self"), op.input_of("mat2")
        if a is None or b is None or not is_weight(b) or len(graph.tensor(b).shape) != 2:
            return None
        k, n = graph.tensor(b).shape
        return a, b, TeSA(graph.tesa(b).view().t().contiguous(), _trusted=True), _rows(graph, a), n, k
    if op.op in ("conv1d", "conv2d", "conv3d"):
        x, w = op.input_of("input"), op.input_of("weight")
        if x is None or w is None or not is_weight(w) or int(op.attrs.get("groups", 1)) != 1:
            return None
        wv = graph.tensor(w)
        out = graph.tensor(op.outputs[0]).shape
        n = wv.shape[0]
        k = math.prod(wv.shape[1:])
        m = math.prod(out) // n
        return x, w, TeSA(graph.tesa(w).view().reshape(n, k), _trusted=True), m, n, k
    return None



def _rows(graph: Graph, x: str) -> int:
    shape = graph.tensor(x).shape
    return math.prod(shape[:-1]) if len(shape) > 1 else 1



def weight_matrix(graph: Graph, op: Op, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
    """The op's weight as (N, K) ``dtype`` (None: its own; transposed for addmm/mm/matmul, flattened for conv)."""
    w = graph.tensor(gemm_view(graph, op)[1]).data
    w = w if dtype is None else w.to(dtype)
    if op.op in ("addmm", "mm", "matmul"):
        return w.t().contiguous()
    return w.reshape(w.shape[0], -1)



def in_weight_layout(graph: Graph, op: Op, nk: torch.Tensor) -> torch.Tensor:
    """An (N, K) matrix back in the layout of the op's weight (the inverse of :func:`weight_matrix`)."""
    if op.op in ("addmm", "mm", "matmul"):
        return nk.t().contiguous()
    return nk.reshape(graph.tensor(gemm_view(graph, op)[1]).shape)



def gemm_bias(op: Op) -> str | None:
    """The tensor a GEMM-like op adds to its product: a linear's ``bias``, addmm's ``self`` (None for the others)."""
    return op.input_of("bias") if op.op == "linear" else op.input_of("self") if op.op == "addmm" else None



__all__ = ["gemm_view", "weight_matrix", "in_weight_layout", "gemm_bias"]
