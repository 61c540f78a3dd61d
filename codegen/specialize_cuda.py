"""Specialisation for ``target="cuda"``: the kernel module of each GEMM of the plan is built by the family selection
chose (``OpPlan.kernel``; its ``build`` in ``templates/<family>/build.py``, found through ``templates/registry.py``).

Then the hand-offs between ops: fp16/bf16 LayerNorms become sparta's norm kernel (``templates/norm/``): one read by
W8A8 linears hands them their per-token int8 codes, so they skip the quantiser; one fed by a residual add that
nothing else reads adds the two inputs itself. A linear whose output (after its fused activation) has a static int8
scale in the plan and that only W8A8 linears read writes int8 codes itself (``out="int8"``), so they skip the
quantiser too.

Runs on a machine with TVM and nvcc and no GPU: kernels are cross-compiled (cubins for sm_80/sm_90), not run.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..backend.fx import Fused, Passthrough
from ..graph import Graph, Op
from ..passes.transform.fusion import GatedUnit
from ..passes.transform.plan import Plan
from ..target import Target, load_target
from ..templates.bsr_linear.build import int8_codes_spec
from ..templates.bsr_linear.kernel import bsr_linear
from ..templates.bsr_linear.runtime import SparseLinearCUDA
from ..templates.norm.build import build as build_norm
from ..templates.norm.runtime import quantized_names
from ..templates.registry import family
from ..templates.w8a8_gemv.kernel import w8a8_gemv
from ..templates.w8a8_gemv.runtime import W8A8GemvCUDA
from .cuda_bind import torch_row
from .cuda_build import build_cuda
from .select_cuda import select_kernels


def specialize_cuda(graph: Graph, plan: Plan, target: Target | None = None):
    """Build the kernel selection chose for every sparse GEMM of ``plan`` (choosing first where the plan has no
    choice yet); returns (replacements, kernel report rows)."""
    target = target if target is not None else load_target("cuda")
    if any(p.kind == "sparse" and p.kernel is None for p in plan.ops.values()):
        select_kernels(graph, plan, target)
    replacements, report = {}, []
    for op_plan in plan.ops.values():
        if op_plan.kind != "sparse":
            continue
        op = graph.op(op_plan.op)
        if op_plan.kernel.kernel == "torch":
            report.append(torch_row(op, "W16A16", op_plan.kernel.reason))
            continue
        module, rows, fused = family(op_plan.kernel.kernel).builder()(graph, op, op_plan)
        replacements[op.name] = module
        if isinstance(fused, GatedUnit):       # the kernel writes act(gate)·up itself
            replacements.update({o.name: Fused(op.name) for o in fused.ops})
        elif fused is not None:
            replacements[fused.name] = Passthrough(fused.inputs[0])
        report += rows
    _requantized_outputs(graph, plan, target, replacements, {r["op"]: r for r in report})
    report += _cuda_norms(graph, replacements)
    return replacements, report


def _requantized_outputs(graph: Graph, plan: Plan, target: Target, replacements: dict, rows: dict) -> None:
    """Linears whose output (or fused activation's output) has a static int8 scale in the plan (calibration's) and
    is read only by W8A8 linears: rebuilt with the requantising epilogue (``out="int8"``), they hand their
    readers int8 codes and the scale, and the per-token quantiser pass over an fp16 tensor is gone."""
    for t, scale in plan.static_scales.items():
        readers = graph.consumers(t)
        if not readers or t in graph.outputs or not all(_reads_int8(replacements.get(r), t) for r in readers):
            continue
        name = graph.producer(t)
        fused = replacements.get(name) if isinstance(replacements.get(name), Passthrough) else None
        if fused is not None:
            name = graph.producer(fused.input_names[0])
        module = replacements.get(name)
        if isinstance(module, W8A8GemvCUDA) and module.output_names is None:
            spec = dataclasses.replace(module.spec, out="int8", name=module.spec.name + "_q8")
            kernel, hopper = build_cuda(w8a8_gemv, spec), None
            module.requantize_output(quantized_names(t), scale, (kernel.path, spec))
        elif isinstance(module, SparseLinearCUDA) and module.output_names is None and module.spec.dtype != "w4a16":
            example_rows = plan.ops[name].gemm[0] if plan.ops[name].gemm else 0
            spec = int8_codes_spec(module.spec, target, example_rows)
            kernel = build_cuda(bsr_linear, spec)
            h_spec = int8_codes_spec(module.hopper[1], target, example_rows) if module.hopper else None
            hopper = build_cuda(bsr_linear, h_spec) if h_spec else None
            few = []                    # the few-row GEMVs writing codes too
            for top, _, g in module.few_rows:
                q8 = dataclasses.replace(g, out="int8", name=g.name + "_q8")
                few.append((top, build_cuda(w8a8_gemv, q8).path, q8))
            module.requantize_output(quantized_names(t), scale, (kernel.path, spec),
                                     (hopper.path, h_spec) if hopper else None, few or None)
        else:
            continue
        if fused is not None:
            replacements[graph.producer(t)] = Fused(name)
        for r in readers:
            replacements[r].use_quantized_input(quantized_names(t), graph.tensor(graph.op(r).outputs[0]).dtype)
        row = rows[name]
        arts = [kernel] + ([hopper] if hopper else [])
        row.update(key=kernel.path.name, artifact=str(kernel.path), cached=kernel.cached,
                   build_s=round(row["build_s"] + sum(a.build_s for a in arts), 3),
                   code_bytes=sum((a.path / c["file"]).stat().st_size for a in arts
                                  for c in a.launch["cubins"].values()))
        note = f"writes int8 codes of {t} (static scale {scale:.3g}) for {', '.join(readers)}"
        row["note"] = f"{row['note']}; {note}" if row.get("note") else note


def _reads_int8(module, t: str) -> bool:
    """Whether ``module`` (a replacement) is a W8A8 kernel module whose one input is the graph tensor ``t``: it can
    take that tensor's per-token int8 codes and scales instead (``QuantizedInput``)."""
    return getattr(module, "reads_int8", False) and module.input_names == [t]


def _cuda_norms(graph: Graph, replacements: dict) -> list[dict]:
    """fp16 LayerNorms become sparta's LayerNorm kernel (OneFlow-style Welford): one whose
    output W8A8 linears read hands them per-token int8 codes and scales (bit for bit their own quantiser's
    on its fp16 output), so they skip a pass over the activations; one fed by a residual add that nothing
    else reads normalises the add's two inputs itself (the add becomes :class:`Fused`). fp32 LayerNorms
    stay torch's. Returns the kernel report rows."""
    rows = []
    for op in list(graph.ops("layer_norm")):
        if op.name in replacements:
            continue
        y, x = op.outputs[0], graph.tensor(op.input_of("input"))
        readers = graph.consumers(y)
        int8 = [r for r in readers if _reads_int8(replacements.get(r), y)] if x.dtype != torch.bfloat16 else []
        if not int8 and x.dtype not in (torch.float16, torch.bfloat16):
            continue
        fp16_too = not int8 or len(int8) < len(readers) or y in graph.outputs
        out = "int8" if not fp16_too else "both" if int8 else "fp16"
        add = _residual_add(graph, op, replacements)
        m = 0 if graph.any_rows else replacements[int8[0]].spec.m if int8 else math.prod(x.shape[:-1])
        built = build_norm(graph, op, out, m, add)
        if isinstance(built, str):
            rows.append(torch_row(op, "-", built))
            continue
        module, row = built
        for r in int8:
            replacements[r].use_quantized_input(quantized_names(y), graph.tensor(graph.op(r).outputs[0]).dtype)
        replacements[op.name] = module
        notes = ([f"emits per-token int8 codes for {', '.join(int8)}"] if int8 else []) + \
            ([f"adds the residual ({add.name} fused)"] if add is not None else [])
        if notes:
            row["note"] = "; ".join(notes)
        if add is not None:
            replacements[add.name] = Fused(op.name)
        rows.append(row)
    return rows


def _residual_add(graph: Graph, op: Op, replacements: dict) -> Op | None:
    """The ``add`` producing LayerNorm ``op``'s input, if the LayerNorm kernel can do it instead: two 16-bit (fp16 or
    bf16) activations of one dtype and the output's shape (no broadcast, no alpha), read by nothing else."""
    name = graph.producer(op.input_of("input"))
    if name is None or name in replacements:
        return None
    add = graph.op(name)
    if add.op != "add" or add.attrs.get("alpha", 1) != 1 or len(add.inputs) != 2 or len(set(add.inputs)) != 2:
        return None
    s = add.outputs[0]
    shape = graph.tensor(s).shape
    dtype = graph.tensor(s).dtype
    if dtype not in (torch.float16, torch.bfloat16) or any(
            v.dtype != dtype or v.shape != shape or v.data is not None for v in map(graph.tensor, add.inputs)):
        return None
    return add if graph.consumers(s) == [op.name] and s not in graph.outputs else None


