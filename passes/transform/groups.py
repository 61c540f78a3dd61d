"""Fusion as a pass over the plan: after kernel selection, which ops a kernel computes besides its own, as typed
groups on the plan (``Plan.fusions``, :class:`~sparta.passes.transform.plan.FusionGroup`) that the plan report shows
and codegen, profiling and the dense fallback read.

Three kinds of :class:`FusionGroup`:

* ``epilogue``: a GEMM's kernel computes its activation (or a gated unit ``act(gate)·up``) in its epilogue;
* ``norm``: a norm kernel (``templates/norm/``) adds the residual before normalising (the add folded in) and/or
  writes per-token int8 codes of its output for the W8A8 linears reading it (they skip their quantiser);
* ``codes``: a GEMM whose output (after its fused activation) has a static int8 scale in the plan writes int8 codes
  for the W8A8 linears reading it (a requantising epilogue, ``out="int8"``).

The norm ops' kernels are chosen here too, by the registry's ``norm_cuda`` rule table (their int8 readers are known
only once the GEMMs' kernels are).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...errors import CodegenError
from ...graph import Graph, Op
from ..fusion import fused_activation, fused_gate
from ..gemm import gemm_bias, gemm_view
from .plan import GROUP_KINDS, FusionGroup, Plan  # noqa: F401  (FusionGroup: the plan's, built here)

NORM_OPS = ("layer_norm",)


@dataclass
class NormSite:
    """What the norm rules read about one norm op."""

    op: Op
    dtype: torch.dtype             # its input's
    width: int                     # the normalised (last) dimension
    rows: int                      # the example's rows (0 in a graph of any rows)
    weight: str | None             # "const" | "other" | None
    bias: str | None
    int8_readers: list[str]        # W8A8 linears that can read its int8 codes


def reads_int8(graph: Graph, plan: Plan, op_name: str, tensor: str) -> bool:
    """Whether ``op_name`` runs a W8A8 kernel whose one activation input is ``tensor``: it can read that tensor's int8
    codes and scales instead of quantising it."""
    p = plan.ops.get(op_name)
    if p is None or p.kind != "sparse" or p.kernel is None:
        return False
    int8 = p.kernel.kernel == "w8a8_gemv" or (p.kernel.kernel == "bsr_linear" and p.kernel.dtype == "int8")
    view = gemm_view(graph, graph.op(op_name)) if int8 else None
    return view is not None and view[0] == tensor


def fuse(graph: Graph, plan: Plan, target) -> Plan:
    """Group what each chosen kernel computes of its neighbours on ``target`` (a :class:`~sparta.target.Target`), in
    place (``plan.fusions``); returns the plan."""
    plan.fusions = _epilogues(graph, plan, target.name)
    if target.name == "cuda":
        plan.fusions += _codes(graph, plan, plan.fusions, target)
        plan.fusions += _norms(graph, plan, plan.fusions)
    return plan


def _epilogues(graph: Graph, plan: Plan, target: str) -> list[FusionGroup]:
    groups = []
    for p in plan.ops.values():
        if p.kind != "sparse" or p.kernel is not None and p.kernel.kernel == "torch":
            continue
        op = graph.op(p.op)
        unit = fused_gate(graph, op, p)
        if unit is not None:
            groups.append(FusionGroup("epilogue", p.op, [o.name for o in unit.ops]))
            continue
        act = fused_activation(graph, op, p)
        if act is not None and (target != "cpu" or _cpu_fuses(graph, op, p)):
            groups.append(FusionGroup("epilogue", p.op, [act.name]))
    return groups


def _cpu_fuses(graph: Graph, op: Op, p) -> bool:
    """Whether the CPU kernels apply the activation: one sub-operator with a bias per output channel (or none) in
    its epilogue, several after their sum; none where every weight is pruned (no sub-operator)."""
    name = gemm_bias(op)
    other = name is not None and graph.tensor(name).shape != (p.gemm[1],)     # an addmm's full addend
    return len(p.subops) > 1 or (len(p.subops) == 1 and not other)


def _codes(graph: Graph, plan: Plan, groups: list[FusionGroup], target) -> list[FusionGroup]:
    from ...templates.bsr_linear.select import codes_tiles
    out = []
    for t, scale in plan.static_scales.items():
        readers = graph.consumers(t)
        if not readers or t in graph.outputs or not all(reads_int8(graph, plan, r, t) for r in readers):
            continue
        anchor = graph.producer(t)
        epi = next((g for g in groups if anchor in g.ops), None)
        if epi is not None:
            if len(epi.ops) != 1:          # a gated unit's product: the kernel writes it already
                continue
            anchor = epi.anchor
        p = plan.ops.get(anchor)
        if p is None or p.kind != "sparse" or p.kernel is None:
            continue
        if p.kernel.kernel == "w8a8_gemv" or p.kernel.kernel == "bsr_linear" and p.kernel.dtype != "w4a16":
            tiles = codes_tiles(p.kernel, p.gemm, target) if p.kernel.kernel == "bsr_linear" else {}
            out.append(FusionGroup("codes", anchor, [], t, list(readers), float(scale), tiles=tiles))
    return out


def _norms(graph: Graph, plan: Plan, groups: list[FusionGroup]) -> list[FusionGroup]:
    from ...templates.registry import rules
    table = rules("norm_cuda")
    taken = {o for g in groups for o in g.ops}
    out = []
    for op in graph.ops():
        if op.op not in NORM_OPS or op.name not in plan.ops:
            continue
        y, x = op.outputs[0], graph.tensor(op.input_of("input"))
        readers = graph.consumers(y)
        int8 = [r for r in readers if reads_int8(graph, plan, r, y)] if x.dtype != torch.bfloat16 else []
        if x.dtype not in (torch.float16, torch.bfloat16) and not int8:
            continue                       # an fp32 LayerNorm stays torch's
        site = NormSite(op, x.dtype, x.shape[-1] if x.shape else 0, 0 if graph.any_rows else math.prod(x.shape[:-1]),
                        _param(graph, op, "weight"), _param(graph, op, "bias"), int8)
        picked = next(c for rule in table if (c := rule(site)) is not None)
        plan.ops[op.name].kernel = picked
        if picked.kernel == "torch":
            continue
        fp16_too = not int8 or len(int8) < len(readers) or y in graph.outputs
        add = residual_add(graph, op, taken)
        if add is not None:
            taken.add(add.name)
            plan.ops[add.name].est_us = 0.0
            plan.ops[add.name].note = f"computed by {op.name}'s kernel (the residual add)"
        out.append(FusionGroup("norm", op.name, [add.name] if add is not None else [], y if int8 else "", int8,
                               out="int8" if not fp16_too else "both" if int8 else "fp16"))
    return out


def _param(graph: Graph, op: Op, role: str) -> str | None:
    name = op.input_of(role)
    return None if name is None else "const" if graph.tensor(name).has_data else "other"


def residual_add(graph: Graph, op: Op, taken: set) -> Op | None:
    """The ``add`` producing norm ``op``'s input, if the norm kernel can do it instead: two 16-bit (fp16 or bf16)
    activations of one dtype and the output's shape (no broadcast, no alpha), read by nothing else, not already
    computed by another kernel (``taken``)."""
    name = graph.producer(op.input_of("input"))
    if name is None or name in taken:
        return None
    add = graph.op(name)
    if add.op != "add" or add.attrs.get("alpha", 1) != 1 or len(add.inputs) != 2 or len(set(add.inputs)) != 2:
        return None
    s = add.outputs[0]
    shape, dtype = graph.tensor(s).shape, graph.tensor(s).dtype
    if dtype not in (torch.float16, torch.bfloat16) or any(
            v.dtype != dtype or v.shape != shape or v.has_data for v in map(graph.tensor, add.inputs)):
        return None
    return add if graph.consumers(s) == [op.name] and s not in graph.outputs else None


def check_epilogue(plan: Plan, op: str, built: list[str]) -> None:
    """The plan's epilogue group of ``op`` is what its kernel's build fused (``built``): the plan is the contract."""
    planned = next((g.ops for g in plan.fusions if g.kind == "epilogue" and g.anchor == op), [])
    if planned != built:
        raise CodegenError(f"op {op!r}: the plan fuses {planned or 'nothing'} into its kernel, its build fused "
                           f"{built or 'nothing'}")


def group_of(plan: Plan, op: str) -> FusionGroup | None:
    """The group whose kernel computes ``op`` besides its own (None: ``op`` runs itself)."""
    return next((g for g in plan.fusions if op in g.ops), None)


__all__ = ["FusionGroup", "GROUP_KINDS", "NormSite", "check_epilogue", "fuse", "group_of", "reads_int8",
           "residual_add"]
