"""Specialisation for ``target="cuda"``: build the kernel selection chose for each GEMM of the plan
(``OpPlan.kernel``, ``codegen/select_cuda.py``) and bind it to the packed weights: the block-sparse kernel
(``templates/bsr_linear/``: fp16, W8A8 with a per-token activation quantiser, W4A16 with the plan's 4-bit scales
dequantised in registers; a dense W8A8 op also its Hopper ``wgmma`` twin over the same blocks), the W4A16 GEMV
or the W8A8 GEMV (``codegen/specialize_gemv.py``).

fp16 LayerNorms become sparta's LayerNorm kernel (``templates/norm/``): one read by W8A8 linears hands them
their per-token int8 codes, so they skip the quantiser; one fed by a residual add that nothing else reads adds the
two inputs itself. A linear whose output (after its fused activation) has a static int8 scale in the plan and that
only W8A8 linears read writes int8 codes itself (``out="int8"``), so they skip the quantiser too.

Runs on a machine with TVM and nvcc and no GPU: kernels are cross-compiled (cubins for sm_80/sm_90), not run.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..backend.fx import Fused, Passthrough
from ..graph import Graph, Op
from ..passes.transform.fusion import GatedUnit, fused_gate
from ..passes.transform.plan import OpPlan, Plan
from ..passes.transform.transform_op import gemm_bias, gemm_view
from ..target import Target, load_target
from ..templates.bsr_linear.runtime import SparseLinearCUDA
from ..templates.norm.runtime import LayerNormCUDA, quantized_names
from ..templates.w8a8_gemv.runtime import W8A8GemvCUDA
from ..templates.bsr_linear.gemv import bsr_gemv
from ..templates.bsr_linear.gemv_spec import BsrGemvSpec
from ..templates.bsr_linear.kernel import bsr_linear
from ..templates.bsr_linear.packing import block_mask_for
from ..templates.bsr_linear.spec import BsrSpec
from ..templates.norm.kernel import layer_norm_kernel
from ..templates.norm.spec import LayerNormSpec, pick_threads
from ..templates.w4a16_gemv.kernel import w4a16_gemv
from ..templates.w8a8_gemv.kernel import w8a8_gemv
from .cuda_build import build_cuda
from .select_cuda import fused_activation, gemm_site, pingpong_pays, select_kernels
from .specialize_gemv import (bind, build_w4a16_gemv, build_w8a8_gemv, int8_weight_scale, report_row, row_quantizer,
                              torch_row, w4_codes, w4a16_gemv_spec, w8a8_gemv_spec)

def int8_codes_spec(spec: BsrSpec, target: Target, rows: int = 0) -> BsrSpec:
    """The int8-code-writing (``out="int8"``) twin of a W8A8 kernel; for a dense 128x192 wgmma tile where it pays at
    ``rows`` (default: the spec's M; a kernel of any M: the example's rows), the ping-pong schedule (a producer and
    two consumer warpgroups on alternate tiles, persistent over the SMs, 4 stages: its two output tiles fit beside
    them only as int8)."""
    q8 = dataclasses.replace(spec, out="int8", name=spec.name + "_q8")
    if spec.dtype == "int8" and spec.mma == "wgmma" and (spec.bn, spec.tm, spec.warps_n) == (192, 128, 1) \
            and pingpong_pays(spec.m or rows, spec.n, target):
        q8 = dataclasses.replace(q8, stages=target.tiles("pingpong", "stages"), producer=True, ctas=target.sms,
                                 pingpong=True, name=spec.name + "_pp_q8")
    return q8


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
        module, row, fused = _build_op(graph, op, op_plan)
        replacements[op.name] = module
        if isinstance(fused, GatedUnit):       # the kernel writes act(gate)·up itself
            replacements.update({o.name: Fused(op.name) for o in fused.ops})
        elif fused is not None:
            replacements[fused.name] = Passthrough(fused.inputs[0])
        report.append(row)
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
        built = _build_norm(graph, op, out, m, add)
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


def _build_norm(graph: Graph, op: Op, out: str, rows: int, add: Op | None = None):
    x = graph.tensor(op.input_of("input"))
    n = x.shape[-1] if x.shape else 0
    if list(op.attrs.get("normalized_shape", [])) != [n]:
        return "normalises more than the last dimension"
    if n % 8 or (rows and math.prod(x.shape[:-1]) != rows):
        return f"width {n} is not a multiple of 8 or rows differ from the linears'"
    params = {}
    for role in ("weight", "bias"):
        name = op.input_of(role)
        if name is not None and graph.tensor(name).data is None:
            return f"the {role} is not a constant"
        params[role] = None if name is None else graph.tesa(name).apply(graph.tensor(name).data.float())
    if params["bias"] is not None and params["weight"] is None:
        return "a bias without a weight"
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
    return module, report_row(op, "layer_norm", "-", bits, "-", [art])


def _gemv_spec(spec: BsrSpec, tiling: dict | None) -> BsrGemvSpec | None:
    """The few-row GEMV selection chose beside ``spec``'s 16-bit kernel (``KernelChoice.gemv``), over its packed blocks
    (``SparseLinearCUDA`` refuses one that does not fit them)."""
    if not tiling:
        return None
    return BsrGemvSpec(spec.n, spec.k, spec.bn, spec.bk, bias=spec.bias, act=spec.act, groups=spec.groups,
                       dtype=spec.act16, gate=spec.gate, **tiling,
                       name=spec.name.replace("bsr_", "bsr_gemv_", 1) + f"_w{tiling['warps']}"
                                                                       f"{'_pdl' if tiling.get('pdl') else ''}")


def _few_row_specs(choice, spec: BsrSpec, site) -> list:
    """[(max rows, family, spec), ...]: the low-bit GEMVs selection put beside ``spec``'s tile kernel (any M, up to
    their rows; ``KernelChoice.few_rows``)."""
    out = []
    for top, family, tiling in choice.few_rows or ():
        t = dict(tiling)
        rows = max(top, 8)               # a kernel for up to 4 rows holds 8 (one MMA's columns)
        if family == "w4a16_gemv":
            g = w4a16_gemv_spec(0, spec.n, spec.k, t.pop("group"), not spec.zero, spec.bias, site.act16, t, rows)
        else:
            g = w8a8_gemv_spec(0, spec.n, spec.k, spec.bias, spec.act, site.act16, t, rows)
        out.append((top, family, g))
    return out


def _build_op(graph: Graph, op: Op, op_plan: OpPlan):
    """The kernel module of ``op_plan.kernel`` for ``op``: (module, report row, the fused activation op, gated unit
    or None)."""
    choice = op_plan.kernel
    view = gemm_view(graph, op)
    x_name, _, _, m, n, k = view
    site = gemm_site(graph, op, op_plan)
    rows = 0 if site.any_rows else m
    weight = site.weight
    bias_name = gemm_bias(op)
    bias = graph.tesa(bias_name).apply(graph.tensor(bias_name).data.float()) if bias_name else None
    fused, unit = fused_activation(graph, op, op_plan), fused_gate(graph, op, op_plan)
    act = site.act
    if choice.kernel == "w4a16_gemv":
        return build_w4a16_gemv(graph, op, op_plan, view, weight, bias, op_plan.weight_quant[4].params(weight))
    if choice.kernel == "w8a8_gemv":
        return build_w8a8_gemv(graph, op, op_plan, view, weight, bias, act, fused)
    dtype, tiles = choice.dtype, dict(choice.tiles)
    w4 = op_plan.weight_quant[4].params(weight) if dtype == "w4a16" else None
    out = "bfloat16" if dtype in ("int8", "w4a16") and site.act16 == "bfloat16" else "float16"  # low bits, bf16 model
    spec = BsrSpec(rows, n // 2 if unit else n, k, bias=bias is not None, act=act, dtype=dtype, out=out,
                   zero=w4 is not None and w4.zero is not None, gate=unit is not None, **tiles)
    mask = block_mask_for(weight, spec)
    if choice.rule in ("w4a16_dense_tile", "w8a8_dense_tile"):
        mask = torch.ones_like(mask)   # every block computed, zeros included (a dense tile does not skip empty blocks)
    tag = {"int8": "i8_", "w4a16": "w4_", "float16": "", "bfloat16": "bf16_"}[dtype]
    tag += "bf16_" if out == "bfloat16" else ""
    spec = dataclasses.replace(spec, name=f"bsr_{rows or 'M'}x{n}x{k}_{tag}b{spec.bn}x{spec.bk}"
                                          f"{f'_g{spec.groups}' if spec.groups else ''}_"
                                          f"{act}{'_gated' if spec.gate else ''}{'_bias' if spec.bias else ''}")
    art = build_cuda(bsr_linear, spec)
    hopper = None
    if choice.hopper is not None:      # Hopper's warpgroup MMA over the same packed blocks, run on sm_90
        h_spec = dataclasses.replace(spec, **choice.hopper, name=spec.name + "_wgmma")
        hopper = (build_cuda(bsr_linear, h_spec), h_spec)
    few = [(top, build_cuda(w4a16_gemv if family == "w4a16_gemv" else w8a8_gemv, g), g)
           for top, family, g in _few_row_specs(choice, spec, site)]
    g_spec = _gemv_spec(spec, choice.gemv)
    gemv = (build_cuda(bsr_gemv, g_spec), g_spec) if g_spec is not None else None
    buckets = []                        # tile kernels over the same packed blocks for calls of few rows
    for top, t in choice.buckets or ():
        b_spec = dataclasses.replace(spec, **t, name=f"{spec.name}_tm{t['tm']}")
        buckets.append((top, build_cuda(bsr_linear, b_spec), b_spec))
    out_shape = graph.tensor((unit.mul if unit else op).outputs[0]).shape
    if w4 is not None:
        scale, zero = w4.expand(k)
        module = SparseLinearCUDA.from_w4_codes(op.name, x_name, art.path, spec, w4_codes(w4, weight), scale, zero,
                                                mask, bias, out_shape)
    else:
        int8 = dtype == "int8"
        scale = int8_weight_scale(op_plan, weight, k) if int8 else None
        quant = row_quantizer(rows, k, site.act16) if int8 else None
        module = SparseLinearCUDA.from_weight(op.name, x_name, art.path, spec, weight, mask, bias, out_shape,
                                              weight_scale=scale, quant_folder=quant,
                                              hopper=(hopper[0].path, hopper[1]) if hopper else None,
                                              gemv=(gemv[0].path, gemv[1]) if gemv else None,
                                              buckets=[(top, a.path, b) for top, a, b in buckets])
    if few and w4 is not None:
        group = few[0][2].group
        module.attach_w4_gemvs([(top, a.path, g) for top, a, g in few], w4_codes(w4, weight),
                               scale[:, ::group], None if zero is None else zero[:, ::group].to(torch.uint8))
    elif few:
        module.attach_w8_gemvs([(top, a.path, g) for top, a, g in few], module.dense_codes())
    if unit is not None:
        module.write_gated(unit.mul.outputs[0])
    # low bits: the reference applies the weights the kernel applies (int8: activations per token at run time)
    bind(module, graph, op, view, reference=dtype not in ("float16", "bfloat16"))
    row = report_row(op, "bsr_linear", f"{int(mask.sum())}x{spec.bn}x{spec.bk}",
                     {"int8": "W8A8", "w4a16": "W4A16", "float16": "W16A16", "bfloat16": "W16A16 (bf16)"}[dtype]
                     + (" (bf16)" if out == "bfloat16" else ""),
                     f"tile (table argument{f', streaming grid of {spec.groups} groups' if spec.groups else ''})",
                     [art] + ([hopper[0]] if hopper else []) + ([gemv[0]] if gemv else []) + [a for _, a, _ in buckets]
                     + [a for _, a, _ in few])
    notes = ([f"sm_90 runs the wgmma kernel {hopper[0].path.name} ({hopper[1].bn}x{hopper[1].bk} tiles)"]
             if hopper else []) + ([f"up to {gemv[1].rows} rows run the GEMV {gemv[0].path.name}"] if gemv else []) \
        + [f"up to {top} rows run the {'W4A16' if w4 is not None else 'W8A8'} GEMV {a.path.name}" for top, a, _ in few] \
        + [f"up to {top} rows run {a.path.name}" for top, a, _ in buckets] + ([choice.note] if choice.note else []) \
        + ([f"writes {unit.activation}(gate) * up ({', '.join(o.name for o in unit.ops)} fused)"] if unit else [])
    if notes:
        row["note"] = "; ".join(notes)
    return module, row, unit if unit is not None else fused if act != "none" else None
