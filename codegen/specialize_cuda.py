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


from ..backend.fx import Fused, Passthrough
from ..graph import Graph
from ..progress import bar
from ..passes.fusion import GatedUnit
from ..passes.transform.groups import NORM_OPS, check_epilogue
from ..passes.transform.plan import Plan
from ..target import Target, load_target
from ..templates.bsr_linear.build import int8_codes_spec
from ..templates.bsr_linear.kernel import bsr_linear
from ..templates.norm.build import build as build_norm
from ..templates.norm.runtime import quantized_names
from ..templates.registry import family
from ..templates.w8a8_gemv.kernel import w8a8_gemv
from ..templates.w8a8_gemv.runtime import W8A8GemvCUDA
from .cuda_bind import torch_row
from .cuda_build import build_cuda, prebuild
from .select_cuda import select_kernels


def specialize_cuda(graph: Graph, plan: Plan, target: Target | None = None):
    """Build the kernel selection chose for every sparse GEMM and norm of ``plan`` (choosing first where the plan has
    no choice yet) and the hand-offs of its fusion groups (``Plan.fusions``); returns (replacements, kernel report
    rows)."""
    target = target if target is not None else load_target("cuda")
    if any(p.kind == "sparse" and p.kernel is None for p in plan.ops.values()):
        select_kernels(graph, plan, target)
    prebuild_tiles(graph, plan)
    replacements, report = {}, []
    sparse = [p for p in plan.ops.values() if p.kind == "sparse"]
    progress = bar("specialise", len(sparse))
    for op_plan in sparse:
        progress.update(1)
        op = graph.op(op_plan.op)
        if op_plan.kernel.kernel == "torch":
            report.append(torch_row(op, "W16A16", op_plan.kernel.reason))
            continue
        module, rows, fused = family(op_plan.kernel.kernel).builder()(graph, op, op_plan)
        replacements[op.name] = module
        check_epilogue(plan, op.name, [o.name for o in fused.ops] if isinstance(fused, GatedUnit) else
                       [fused.name] if fused is not None else [])
        if isinstance(fused, GatedUnit):       # the kernel writes act(gate)·up itself
            replacements.update({o.name: Fused(op.name) for o in fused.ops})
        elif fused is not None:
            replacements[fused.name] = Passthrough(fused.inputs[0])
        report += rows
    progress.close()
    rows = {r["op"]: r for r in report}
    for group in plan.fusions:
        if group.kind == "codes":
            _write_codes(graph, group, replacements, rows[group.anchor])
    report += _norms(graph, plan, replacements)
    return replacements, report


def prebuild_tiles(graph: Graph, plan: Plan, jobs: int | None = None) -> int:
    """Build the block-sparse family's kernels of ``plan`` that the cache lacks in a pool of processes
    (``cuda_build.prebuild``), before the ops' builds find them cached; returns how many were built."""
    from ..templates.bsr_linear.build import kernel_specs
    from .cuda_bind import gemm_parts
    items = []
    for p in plan.ops.values():
        if p.kind == "sparse" and p.kernel is not None and p.kernel.kernel == "bsr_linear":
            items += kernel_specs(p, gemm_parts(graph, graph.op(p.op), p))["all"]
    with bar("build kernels", unit="kernel") as progress:
        return prebuild(items, jobs, progress.update)


def _write_codes(graph: Graph, group, replacements: dict, row: dict) -> None:
    """A ``codes`` group: the anchor's kernels rebuilt with the requantising epilogue (``out="int8"``) hand the
    readers int8 codes of ``group.tensor`` at its static scale, and their per-token quantiser pass is gone."""
    t, scale, name = group.tensor, group.scale, group.anchor
    module = replacements[name]
    if isinstance(module, W8A8GemvCUDA):
        spec = dataclasses.replace(module.spec, out="int8", name=module.spec.name + "_q8")
        kernel, hopper = build_cuda(w8a8_gemv, spec), None
        module.requantize_output(quantized_names(t), scale, (kernel.path, spec))
    else:
        spec = int8_codes_spec(module.spec, group.tiles)
        kernel = build_cuda(bsr_linear, spec)
        h_spec = int8_codes_spec(module.hopper[1], group.tiles) if module.hopper else None
        hopper = build_cuda(bsr_linear, h_spec) if h_spec else None
        few = []                    # the few-row GEMVs writing codes too
        for top, _, g in module.few_rows:
            q8 = dataclasses.replace(g, out="int8", name=g.name + "_q8")
            few.append((top, build_cuda(w8a8_gemv, q8).path, q8))
        module.requantize_output(quantized_names(t), scale, (kernel.path, spec),
                                 (hopper.path, h_spec) if hopper else None, few or None)
    if graph.producer(t) != name:   # the fused activation's output: the kernel writes it
        replacements[graph.producer(t)] = Fused(name)
    for r in group.readers:
        replacements[r].use_quantized_input(quantized_names(t), graph.tensor(graph.op(r).outputs[0]).dtype)
    arts = [kernel] + ([hopper] if hopper else [])
    row.update(key=kernel.path.name, artifact=str(kernel.path), cached=kernel.cached,
               build_s=round(row["build_s"] + sum(a.build_s for a in arts), 3),
               code_bytes=sum((a.path / c["file"]).stat().st_size for a in arts for c in a.launch["cubins"].values()))
    note = f"writes int8 codes of {t} (static scale {scale:.3g}) for {', '.join(group.readers)}"
    row["note"] = f"{row['note']}; {note}" if row.get("note") else note


def _norms(graph: Graph, plan: Plan, replacements: dict) -> list[dict]:
    """The norm ops the plan runs on sparta's kernel (OneFlow-style Welford), with their ``norm`` groups: one whose
    output W8A8 linears read hands them per-token int8 codes and scales (bit for bit their own quantiser's on its fp16
    output), so they skip a pass over the activations; one fed by a residual add that nothing else reads normalises
    the add's two inputs itself (the add becomes :class:`Fused`). Returns the kernel report rows."""
    rows = []
    for op_plan in plan.ops.values():
        choice = op_plan.kernel
        if op_plan.op_type not in NORM_OPS or choice is None:
            continue
        op = graph.op(op_plan.op)
        if choice.kernel == "torch":
            rows.append(torch_row(op, "-", choice.reason))
            continue
        group = next(g for g in plan.fusions if g.kind == "norm" and g.anchor == op.name)
        add = graph.op(group.ops[0]) if group.ops else None
        module, row = build_norm(graph, op, group.out, add)
        y = op.outputs[0]
        for r in group.readers:
            replacements[r].use_quantized_input(quantized_names(y), graph.tensor(graph.op(r).outputs[0]).dtype)
        replacements[op.name] = module
        notes = ([f"emits per-token int8 codes for {', '.join(group.readers)}"] if group.readers else []) + \
            ([f"adds the residual ({add.name} fused)"] if add is not None else [])
        if notes:
            row["note"] = "; ".join(notes)
        if add is not None:
            replacements[add.name] = Fused(op.name)
        rows.append(row)
    return rows
