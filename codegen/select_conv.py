"""Kernel selection for the convolutions of a CUDA plan: which run on the block-sparse implicit-GEMM kernel.

After the GEMMs' selection, every ``conv2d`` the plan left on the vendor's dense convolution (``kind="dense"``) whose
weight has pruned elements is read as a :class:`ConvSite` and put to the registry's ``conv_cuda`` rules
(``templates/conv2d/select.py``); the first answer wins. A ``conv2d`` choice makes the op ``kind="sparse"`` with
that kernel, its estimate and its epilogue (bias, and the ReLU reading its output, the kernel applies; the fusion pass
after it groups them); a ``torch`` one leaves the plan as it was, the reason in the op's candidates. Nothing here
needs TVM or a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..graph import Graph, Op
from ..passes.fusion import fusable_activation
from ..passes.transform.plan import Candidate, OpPlan, Plan, SubOp
from ..target import Target
from ..templates.registry import rules

ACTIVATIONS = ("relu",)          # what the plan's CUDA epilogue vocabulary and the kernel share


@dataclass
class ConvSite:
    """What the ``conv_cuda`` rules read about one convolution."""

    op: Op
    plan: OpPlan
    cin: int
    cout: int
    h: int
    w: int
    kh: int
    kw: int
    stride: tuple
    padding: tuple
    dilation: tuple
    groups: int
    dtype: str                     # the activations' dtype ("float16", "bfloat16", "float32", ...)
    bias: str                      # "none" | "vector" | "other"
    act: str                       # the activation the epilogue computes ("none", "relu")
    kept: torch.Tensor             # (Cout, Cin, KH, KW) bool: the weight elements the TeSA keeps
    est_us: float | None = None    # the estimate of the kernel a rule chose (set by the rule)

    @property
    def dense_us(self) -> float:
        return self.plan.dense_us

    def block_mask(self, bn: int, bk: int) -> torch.Tensor:
        """(Cout blocks, (tap, Cin block)) bool: the blocks holding a kept element."""
        from ..templates.conv2d.spec import Conv2dSpec, block_mask_of
        spec = Conv2dSpec(self.cin + -self.cin % 8, self.cout, self.h, self.w, self.kh, self.kw, self.stride,
                          self.padding, self.dilation, bn=bn, bk=bk, tm=64, warps_m=1, warps_n=1, stages=2)
        kept = torch.nn.functional.pad(self.kept, (0, 0, 0, 0, 0, spec.cin - self.cin))
        return block_mask_of(kept, spec)

    def kept_blocks(self, bn: int, bk: int) -> int:
        return int(self.block_mask(bn, bk).sum())

    def all_blocks(self, bn: int, bk: int) -> int:
        return -(-self.cout // bn) * self.kh * self.kw * -(-self.cin // bk)


def _pair(v) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


def conv_site(graph: Graph, op: Op, op_plan: OpPlan) -> ConvSite | None:
    """The facts the rules read about a planned ``conv2d`` over a 4-D activation and a constant weight (else None)."""
    if op.op != "conv2d":
        return None
    x, w, b = op.input_of("input"), op.input_of("weight"), op.input_of("bias")
    if x is None or w is None or len(graph.tensor(x).shape) != 4:
        return None
    wv = graph.tensor(w)
    if wv.kind != "weight" or not wv.has_data or len(wv.shape) != 4:
        return None
    a = op.attrs
    if any(isinstance(a.get(k), str) for k in ("stride", "padding", "dilation")):   # padding="same": not read here
        return None
    groups = int(a.get("groups", 1))
    _, cin, h, width = graph.tensor(x).shape
    bias = "none" if b is None else \
        "vector" if graph.tensor(b).has_data and graph.tensor(b).shape == (wv.shape[0],) else "other"
    act = fusable_activation(graph, op.outputs[0], "cuda")
    act_name = act.op if act is not None and act.op in ACTIVATIONS else "none"
    dtype = str(graph.tensor(x).dtype).removeprefix("torch.")
    return ConvSite(op, op_plan, int(cin), int(wv.shape[0]), int(h), int(width), int(wv.shape[2]), int(wv.shape[3]),
                    _pair(a.get("stride", 1)), _pair(a.get("padding", 0)), _pair(a.get("dilation", 1)), groups, dtype,
                    bias, act_name, graph.tesa(w).mask)


def select_conv(site: ConvSite, target: Target):
    for conv_rule in rules("conv_cuda"):
        picked = conv_rule(site, target)
        if picked is not None:
            return picked
    return None


def select_convolutions(graph: Graph, plan: Plan, target: Target) -> Plan:
    """Give the block-sparse kernel to every pruned ``conv2d`` of ``plan`` its rules take, in place; returns the
    plan."""
    for op_plan in plan.ops.values():
        if op_plan.op_type != "conv2d" or op_plan.kind != "dense":
            continue
        op = graph.op(op_plan.op)
        site = conv_site(graph, op, op_plan)
        if site is None or bool(site.kept.all()):
            continue
        picked = select_conv(site, target)
        if picked is None:
            continue
        if picked.kernel == "torch":
            op_plan.candidates.append(Candidate("conv2d", float("inf"), picked.reason))
            continue
        est, bn, bk = float(site.est_us), picked.tiles["bn"], picked.tiles["bk"]
        kept = site.kept_blocks(bn, bk)
        op_plan.kind, op_plan.kernel, op_plan.est_us = "sparse", picked, est
        op_plan.subops = [SubOp("block_sparse", 16, 16, (bn, bk), kept, int(site.kept.sum()), est)]
        op_plan.candidates.append(Candidate(f"conv2d {kept}x{bn}x{bk}", est, picked.reason))
        op_plan.epilogue = (["bias"] if site.bias == "vector" else []) + ([site.act] if site.act != "none" else [])
    return plan


__all__ = ["ConvSite", "conv_site", "select_conv", "select_convolutions"]
