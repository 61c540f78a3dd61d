"""Codegen of the norm family: a LayerNorm op on sparta's kernel, optionally adding the residual (the add fused) and
writing per-token int8 codes for the W8A8 linears reading it."""

from __future__ import annotations

import math

import torch

from ...codegen.cuda_bind import report_row
from ...codegen.cuda_build import build_cuda
from ...graph import Graph, Op
from .kernel import layer_norm_kernel
from .runtime import LayerNormCUDA, norm_params, quantized_names
from .spec import LayerNormSpec, pick_threads


def build(graph: Graph, op: Op, out: str, add: Op | None = None):
    """The kernel module of the norm ``op`` the plan runs on sparta's kernel (its ``norm_cuda`` rules checked the
    op), writing ``out`` and adding the residual ``add``'s inputs where given: (module, report row)."""
    x = graph.tensor(op.input_of("input"))
    n = x.shape[-1]
    rows = 0 if graph.any_rows else math.prod(x.shape[:-1])
    params = norm_params(graph, op)
    res = "_res" if add is not None else ""
    bf16 = x.dtype == torch.bfloat16
    spec = LayerNormSpec(rows, n, eps=float(op.attrs.get("eps", 1e-5)), affine=params["weight"] is not None,
                         bias=params["bias"] is not None, out=out, threads=pick_threads(n), residual=add is not None,
                         dtype="bfloat16" if bf16 else "float16",
                         name=f"layer_norm_{rows or 'M'}x{n}_{out}{res}{'_bf16' if bf16 else ''}")
    art = build_cuda(layer_norm_kernel, spec)
    y = op.outputs[0]
    outputs = ([y] if out != "int8" else []) + (quantized_names(y) if out != "fp16" else [])
    x_name, r_name = (add.inputs[0], add.inputs[1]) if add is not None else (x.name, None)
    module = LayerNormCUDA(op.name, x_name, outputs, art.path, spec, params["weight"], params["bias"],
                           graph.tensor(y).shape, r_name)
    bits = {"fp16": "A16->A16", "int8": "A16->A8", "both": "A16->A16+A8"}[out]
    return module, report_row(op, "norm", "-", bits, "-", [art])

