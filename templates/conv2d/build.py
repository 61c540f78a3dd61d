"""Codegen of the conv2d family: a planned convolution's kernel (``build``, the registry's per-op build) or one spec's
(``conv2d_module``), built through TVM + nvcc (cached) and wrapped with its packed weight."""

from __future__ import annotations

from pathlib import Path

import torch

from ...codegen.cuda_bind import report_row
from ...codegen.cuda_build import build_cuda, save_dir
from ...graph import Graph, Op
from ...passes.fusion import fused_activation
from ...passes.transform.plan import OpPlan
from .kernel import conv2d_kernel
from .runtime import Conv2dCUDA
from .spec import Conv2dSpec, block_mask_of


def conv2d_module(spec: Conv2dSpec, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  blocks: torch.Tensor | None = None, op_name: str | None = None,
                  out: str | Path | None = None) -> Conv2dCUDA:
    """The kernel of ``spec`` over ``weight`` (Cout, Cin, KH, KW), its ``blocks`` (default: those holding a nonzero)
    packed; ``out``: also copy the kernel folder to ``out/<spec.name>``."""
    art = build_cuda(conv2d_kernel, spec)
    folder = save_dir(art, Path(out) / spec.name) if out is not None else art.path
    return Conv2dCUDA.from_weight(op_name or spec.name, folder, spec, weight, bias, blocks)


def build(graph: Graph, op: Op, op_plan: OpPlan):
    """The kernel selection chose for the planned ``conv2d`` ``op``: (module, kernel report rows, the fused
    activation op or None)."""
    from ...codegen.select_conv import conv_site
    site = conv_site(graph, op, op_plan)
    choice = op_plan.kernel
    x, w, b = op.input_of("input"), op.input_of("weight"), op.input_of("bias")
    act = op_plan.epilogue[-1] if op_plan.epilogue and op_plan.epilogue[-1] != "bias" else "none"
    spec = Conv2dSpec(site.cin, site.cout, site.h, site.w, site.kh, site.kw, site.stride, site.padding,
                      site.dilation, bias=b is not None, act=act, dtype=choice.dtype, **choice.tiles)
    spec = Conv2dSpec(**{**spec.key(), "name": f"conv2d_{spec.cin}x{spec.cout}x{spec.h}x{spec.w}_k{spec.kh}x{spec.kw}"
                                                f"_s{spec.stride[0]}x{spec.stride[1]}_{act}{'_bias' if b else ''}"
                                                f"_b{spec.bn}x{spec.bk}_tm{spec.tm}{'_bf16' if spec.dtype == 'bfloat16' else ''}"})
    wv = graph.tensor(w)
    weight = graph.tesa(w).apply(wv.data.float())
    bias = graph.tesa(b).apply(graph.tensor(b).data.float()) if b is not None else None
    blocks = block_mask_of(site.kept, spec)
    art = build_cuda(conv2d_kernel, spec)
    module = Conv2dCUDA.from_weight(op.name, art.path, spec, weight, bias, blocks)
    module.input_names, module.weight_name, module.weight_transposed = [x], w, False
    row = report_row(op, "conv2d", f"{int(blocks.sum())}x{spec.bn}x{spec.bk}",
                     "W16A16" + (" (bf16)" if spec.dtype == "bfloat16" else ""), "tile (table argument)", [art])
    if choice.note:
        row["note"] = choice.note
    return module, [row], fused_activation(graph, op, op_plan)


__all__ = ["build", "conv2d_module"]
