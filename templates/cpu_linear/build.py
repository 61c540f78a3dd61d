"""Codegen of the CPU linear family: each sub-operator of the plan becomes its kernel (the variant selection chose,
``KernelChoice.tiles["modes"]``) over its share of the weight, bound in one :class:`SparseLinearCPU`. Each
sub-operator's weight is the op's weight restricted to the elements the plan assigned to it, so overlapping covers add
every weight exactly once."""

from __future__ import annotations

import dataclasses
import math

import torch

from ...codegen.build import build_cpu
from ...graph import Graph, Op
from ...passes.fusion import fused_activation
from ...passes.transform.plan import OpPlan, SubOp
from ...passes.transform.transform_op import gemm_view, weight_matrix
from . import block_spec, fine_spec
from .block import block_linear
from .fine import fine_linear
from .packing import effective_weight, fitted_scales, op_bias, pack_sub, sub_weight
from .runtime import SparseLinearCPU, SubKernel, block_rows
from .select import variant


def _padding(subs: list[SubOp]) -> tuple[int, int]:
    bh = bw = 1
    for s in subs:
        if s.block is not None:
            bh, bw = math.lcm(bh, s.block[0]), math.lcm(bw, s.block[1])
    return bh, bw



def _dense_block(n_pad: int, k_pad: int) -> tuple[int, int]:
    for b in (32, 16, 8, 4, 2, 1):
        if n_pad % b == 0 and k_pad % b == 0:
            return b, b
    return 1, 1



def build(graph: Graph, op: Op, op_plan: OpPlan):
    """The kernel module of ``op_plan`` for ``op``: (module, report rows, the fused activation op or None)."""
    x_name, _, _, m, n, k = gemm_view(graph, op)
    any_rows = graph.any_rows
    weight = weight_matrix(graph, op)
    ph, pw = _padding(op_plan.subops)
    n_pad, k_pad = -(-n // ph) * ph, -(-k // pw) * pw
    bias, extra_bias = op_bias(graph, op, n)      # extra_bias: e.g. addmm with a full (M, N) addend
    fused = fused_activation(graph, op, op_plan) if len(op_plan.subops) == 1 and extra_bias is None else None
    act = fused.op if fused is not None else None
    modes = (op_plan.kernel.tiles.get("modes") if op_plan.kernel is not None else None) or \
        [variant(s, m, any_rows, op_plan.dismantle) for s in op_plan.subops]
    subs, rows = [], []
    for i, sub in enumerate(op_plan.subops):
        w = sub_weight(weight, sub, n, k, n_pad, k_pad)
        common = dict(bias=bias is not None and i == 0, activation=act, accumulate=i > 0,
                      name=f"{_cname(op.name)}_s{i}")
        if sub.template == "fine_sparse":
            mode = modes[i]
            mask = torch.nn.functional.pad(sub.elements.mask.reshape(n, k), (0, k_pad - k, 0, n_pad - n))
            spec = fine_spec.spec_from_weight(0 if any_rows else m, w, mask, mode, **common)
            template, blocks = fine_spec, f"{sub.nnz} nnz"
            fn_template = fine_linear
        else:
            if sub.template == "dense":
                block = _dense_block(n_pad, k_pad)
                grid = torch.ones(n_pad // block[0], k_pad // block[1], dtype=torch.bool)
            else:
                block = sub.block
                grid = sub.blocks.mask
                grid = torch.nn.functional.pad(grid, (0, k_pad // block[1] - grid.shape[1],
                                                      0, n_pad // block[0] - grid.shape[0]))
            mode = modes[i]
            group = fitted_scales(op_plan, weight, sub.weight_bits, (n_pad, k_pad), block[1])[2]
            spec = block_spec.BlockLinearSpec(0 if any_rows else m, n_pad, k_pad, tuple(block), block_rows(grid),
                                              sub.weight_bits,
                                              dismantle=mode, scale_group=group, **common,
                                              act_bits=sub.act_bits if sub.weight_bits == 8 else 0)
            if mode == "none":  # the generic kernel: one per shape, shared by every op of that shape
                spec = dataclasses.replace(spec, name=spec.generic_name())
            template, blocks = block_spec, f"{spec.n_blocks}x{block[0]}x{block[1]}"
            fn_template = block_linear
        packed = pack_sub(op_plan, weight, sub, template, spec, n, k, n_pad, k_pad)
        built = build_cpu(fn_template, spec)
        info = {"op": op.name, "template": sub.template, "blocks": blocks, "bits": f"W{sub.weight_bits}A{sub.act_bits}",
                "dismantle": mode, "build_s": round(built.build_s, 3), "cached": built.cached,
                "code_bytes": built.nbytes, "key": built.key}
        subs.append(SubKernel(built.fn, template, spec, packed, info))
        rows.append(info)
    out_shape = graph.tensor(op.outputs[0]).shape
    module = SparseLinearCPU(op.name, x_name, subs, n, k, n_pad, k_pad, out_shape, bias, act, None, extra_bias)
    module.weight_name = gemm_view(graph, op)[1]
    module.reference_weight = effective_weight(graph, op, subs, n, k)
    if fused is None and len(op_plan.subops) > 1:
        nxt = fused_activation(graph, op, op_plan)
        if nxt is not None:  # several sub-ops: apply the activation once, after the sum
            module.post_activation = nxt.op
            fused = nxt
    return module, rows, fused



def _cname(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)

