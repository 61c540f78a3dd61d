"""Codegen of the block-sparse tile kernel: the plan's tiling over the op's packed blocks (fp16/bf16, W8A8 with the
per-token quantiser, W4A16 with the plan's 4-bit scales), with what selection put beside it: the sm_90 wgmma twin,
the few-row block GEMV, tile kernels of smaller M tiles and the low-bit GEMVs (``KernelChoice``); and its int8-code
writing twin (:func:`int8_codes_spec`) where a requantising hand-off asks for it."""

from __future__ import annotations

import dataclasses

import torch

from ...codegen.cuda_bind import bind, gemm_parts, report_row
from ...codegen.cuda_build import build_cuda
from ...codegen.kept_blocks import packed_blocks
from ...runtime.cuda import act16_dtype
from ...graph import Graph, Op
from ...meta_model import meta_weight
from ...passes.transform.plan import OpPlan
from ..quant.build import row_quantizer
from ..w4a16_gemv.build import w4_codes, w4a16_gemv_spec
from ..w4a16_gemv.dequant import W4DequantSpec, w4a16_dequant
from ..w4a16_gemv.kernel import w4a16_gemv
from ..w8a8_gemv.build import int8_weight_scale, w8a8_gemv_spec
from ..w8a8_gemv.kernel import w8a8_gemv
from .gemv import bsr_gemv
from .gemv_spec import BsrGemvSpec
from .kernel import bsr_linear
from .packing import build_table
from .runtime import SparseLinearCUDA
from .spec import BsrSpec

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def int8_codes_spec(spec: BsrSpec, tiles: dict | None = None) -> BsrSpec:
    """The int8-code-writing (``out="int8"``) twin of a kernel; a wgmma twin takes the code-writing tiling the fusion
    pass chose (``FusionGroup.tiles``: the ping-pong schedule, where it pays)."""
    q8 = dataclasses.replace(spec, out="int8", name=spec.name + "_q8")
    if tiles and spec.mma == "wgmma":
        q8 = dataclasses.replace(q8, **tiles, name=spec.name + "_pp_q8")
    return q8


def _gemv_spec(spec: BsrSpec, tiling: dict | None) -> BsrGemvSpec | None:
    """The few-row GEMV selection chose beside ``spec``'s 16-bit kernel (``KernelChoice.gemv``), over its packed blocks
    (``SparseLinearCUDA`` refuses one that does not fit them)."""
    if not tiling:
        return None
    tiling = {k: v for k, v in tiling.items() if k != "one_row"}
    return BsrGemvSpec(spec.n, spec.k, spec.bn, spec.bk, bias=spec.bias, act=spec.act, groups=spec.groups,
                       dtype=spec.act16, gate=spec.gate, **tiling,
                       name=spec.name.replace("bsr_", "bsr_gemv_", 1) + f"_w{tiling['warps']}"
                                                                       f"{'_pdl' if tiling.get('pdl') else ''}")


def _one_row_spec(gemv: BsrGemvSpec | None, tiling: dict | None) -> BsrGemvSpec | None:
    """The GEMV built for one row beside ``gemv`` (``KernelChoice.gemv["one_row"]``), over the same blocks."""
    one = (tiling or {}).get("one_row")
    if gemv is None or not one:
        return None
    return dataclasses.replace(gemv, rows=1, **one, name=f"{gemv.name}_r1_w{one['warps']}_l{one.get('loads', 0)}")



def _few_row_specs(choice, spec: BsrSpec, site) -> list:
    """[(max rows, family, spec), ...]: the low-bit GEMVs selection put beside ``spec``'s tile kernel (any M, up to
    their rows; ``KernelChoice.few_rows``)."""
    out = []
    for top, family, tiling in choice.few_rows or ():
        t = dict(tiling)
        rows = max(top, 8)               # a kernel for up to 4 rows holds 8 (one MMA's columns)
        if family == "w4a16_gemv":
            g = w4a16_gemv_spec(0, spec.n, spec.k, t.pop("group"), not spec.zero, spec.bias, site.act16, t, rows)
        else:    # a dense tile's GEMVs read its int8 blocks: one packed weight (a sparse op's keep their chunk pack:
            if t.get("mma") and not t.get("sparse") and not spec.groups:      # over its 32x32 blocks 1.1-2.0x slower)
                t.update(bn=spec.bn, bk=spec.bk)
            g = w8a8_gemv_spec(0, spec.n, spec.k, spec.bias, spec.act, site.act16, t, rows)
        out.append((top, family, g))
    return out



def kernel_specs(op_plan: OpPlan, parts) -> dict:
    """The specs of every kernel :func:`build` builds for ``op_plan.kernel`` (``parts``: ``gemm_parts``): ``spec``,
    ``hopper``, ``gemv`` (or None), ``few`` [(rows, family, spec)], ``buckets`` [(rows, spec)], and ``w4`` (the
    plan's 4-bit ``WeightQuant`` or None: no weight values read); ``all`` lists (template, spec) of them all (what a
    build pool builds ahead)."""
    choice = op_plan.kernel
    view, site, rows, bias, unit = parts.view, parts.site, parts.rows, parts.bias, parts.unit
    _, _, _, m, n, k = view
    act = site.act
    dtype, tiles = choice.dtype, dict(choice.tiles)
    w4 = op_plan.weight_quant[4] if dtype == "w4a16" else None
    out = "bfloat16" if dtype in ("int8", "w4a16") and site.act16 == "bfloat16" else "float16"  # low bits, bf16 model
    spec = BsrSpec(rows, n // 2 if unit else n, k, bias=bias is not None, act=act, dtype=dtype, out=out,
                   zero=w4 is not None and not w4.symmetric, gate=unit is not None, **tiles)
    tag = {"int8": "i8_", "w4a16": "w4_", "float16": "", "bfloat16": "bf16_"}[dtype]
    tag += "bf16_" if out == "bfloat16" else ""
    spec = dataclasses.replace(spec, name=f"bsr_{rows or 'M'}x{n}x{k}_{tag}b{spec.bn}x{spec.bk}"
                                          f"{f'_g{spec.groups}' if spec.groups else ''}_"
                                          f"{act}{'_gated' if spec.gate else ''}{'_bias' if spec.bias else ''}")
    hopper = dataclasses.replace(spec, **choice.hopper, name=spec.name + "_wgmma") if choice.hopper else None
    few = _few_row_specs(choice, spec, site)
    w4_gemv = next((g for _, family, g in few if family == "w4a16_gemv"), None)
    if w4_gemv is not None and spec.bk == 128:       # the tile reads the GEMVs' pack: one packed weight
        spec = dataclasses.replace(spec, gemv_group=w4_gemv.group, name=f"{spec.name}_gw{w4_gemv.group}")
    gemv = _gemv_spec(spec, choice.gemv)
    gemv1 = _one_row_spec(gemv, choice.gemv)
    buckets = [(top, dataclasses.replace(spec, **t, name=f"{spec.name}_tm{t['tm']}")) for top, t in choice.buckets or ()]
    dequant = W4DequantSpec.for_gemv(w4_gemv) if choice.dequant and w4_gemv is not None else None
    every = [(bsr_linear, spec)] + ([(bsr_linear, hopper)] if hopper else []) \
        + [(w4a16_gemv if family == "w4a16_gemv" else w8a8_gemv, g) for _, family, g in few] \
        + [(bsr_gemv, g) for g in (gemv, gemv1) if g] + [(bsr_linear, b) for _, b in buckets] \
        + ([(w4a16_dequant, dequant)] if dequant else [])
    return {"spec": spec, "hopper": hopper, "gemv": gemv, "gemv1": gemv1, "few": few, "buckets": buckets, "w4": w4,
            "dequant": dequant, "all": every}


def build(graph: Graph, op: Op, op_plan: OpPlan):
    """The tile kernel of ``op_plan.kernel`` for ``op``, with the GEMVs and smaller-M tiles it carries: (module,
    report rows, the fused activation op, gated unit or None)."""
    choice = op_plan.kernel
    parts = gemm_parts(graph, op, op_plan)
    view, site, rows, bias, fused, unit = parts.view, parts.site, parts.rows, parts.bias, parts.fused, parts.unit
    x_name, _, _, m, n, k = view
    act, dtype = site.act, choice.dtype
    specs = kernel_specs(op_plan, parts)
    spec = specs["spec"]
    weight = meta_weight(graph, op) if specs["w4"] is not None else None   # meta: placeholders of the shapes
    weight = site.weight if weight is None else weight
    w4 = specs["w4"].params(weight) if specs["w4"] is not None else None    # the scales, fitted once
    out = spec.out
    gate_n = spec.n if spec.gate else 0
    mask = site.block_mask(spec.bn, spec.bk, gate_n)
    if choice.dense_grid:
        mask = torch.ones_like(mask)   # every block computed, zeros included (a dense tile does not skip empty blocks)
    art = build_cuda(bsr_linear, spec)
    hopper = (build_cuda(bsr_linear, specs["hopper"]), specs["hopper"]) if specs["hopper"] is not None else None
    few = [(top, build_cuda(w4a16_gemv if family == "w4a16_gemv" else w8a8_gemv, g), g)
           for top, family, g in specs["few"]]
    g_spec = specs["gemv"]
    gemv = (build_cuda(bsr_gemv, g_spec), g_spec) if g_spec is not None else None
    gemv1 = (build_cuda(bsr_gemv, specs["gemv1"]), specs["gemv1"]) if specs["gemv1"] is not None else None
    buckets = [(top, build_cuda(bsr_linear, b_spec), b_spec) for top, b_spec in specs["buckets"]]
    dequant = (build_cuda(w4a16_dequant, specs["dequant"]), specs["dequant"]) if specs["dequant"] else None
    out_shape = graph.tensor((unit.mul if unit else op).outputs[0]).shape
    kernels = dict(hopper=(hopper[0].path, hopper[1]) if hopper else None, gemv=(gemv[0].path, gemv[1]) if gemv
                   else None, buckets=[(top, a.path, b) for top, a, b in buckets],
                   gemv1=(gemv1[0].path, gemv1[1]) if gemv1 else None,
                   dense_from=None if choice.dequant else choice.dense_from)
    if w4 is not None:
        scale, zero = w4.expand(k)
        codes = w4_codes(w4, weight)                        # once: the tile kernel's records and the GEMVs' words
        module = SparseLinearCUDA.from_w4_codes(op.name, x_name, art.path, spec, codes, scale, zero, mask, bias,
                                                out_shape)
    elif dtype in ("float16", "bfloat16") and act16_dtype(spec) == _DTYPES[dtype] and \
            site.fast(spec.bn, spec.bk, gate_n):          # 16-bit: the kept blocks, read in the weight's own dtype
        table, packed = build_table(mask, spec.groups, spec.gate)
        wp = packed_blocks(graph.tensor(view[1]), site.keep, spec, packed, _DTYPES[dtype])
        module = SparseLinearCUDA(op.name, x_name, art.path, spec, wp, table, bias, out_shape, **kernels)
    else:
        weight = site.weight
        int8 = dtype == "int8"
        scale = int8_weight_scale(op_plan, weight, k) if int8 else None
        quant = row_quantizer(rows, k, site.act16) if int8 else None
        module = SparseLinearCUDA.from_weight(op.name, x_name, art.path, spec, weight, mask, bias, out_shape,
                                              weight_scale=scale, quant_folder=quant, **kernels)
    if few and w4 is not None:
        group = few[0][2].group
        module.attach_w4_gemvs([(top, a.path, g) for top, a, g in few], codes, scale[:, ::group],
                               None if zero is None else zero[:, ::group].to(torch.uint8))
    elif few:
        module.attach_w8_gemvs([(top, a.path, g) for top, a, g in few], module.dense_codes())
    if dequant is not None:
        module.attach_dequant(dequant[0].path, dequant[1], choice.dense_from)
    if unit is not None:
        module.write_gated(unit.mul.outputs[0])
    # low bits: the reference applies the weights the kernel applies (int8: activations per token at run time)
    bind(module, graph, op, view, reference=dtype not in ("float16", "bfloat16"))
    row = report_row(op, "bsr_linear", f"{int(mask.sum())}x{spec.bn}x{spec.bk}",
                     {"int8": "W8A8", "w4a16": "W4A16", "float16": "W16A16", "bfloat16": "W16A16 (bf16)"}[dtype]
                     + (" (bf16)" if out == "bfloat16" else ""),
                     f"tile (table argument{f', streaming grid of {spec.groups} groups' if spec.groups else ''})",
                     [art] + ([hopper[0]] if hopper else []) + [g[0] for g in (gemv, gemv1) if g] + [a for _, a, _ in buckets]
                     + [a for _, a, _ in few] + ([dequant[0]] if dequant else []))
    notes = ([f"sm_90 runs the wgmma kernel {hopper[0].path.name} ({hopper[1].bn}x{hopper[1].bk} tiles)"]
             if hopper else []) + ([f"one row runs the GEMV {gemv1[0].path.name}"] if gemv1 else []) \
        + ([f"up to {gemv[1].rows} rows run the GEMV {gemv[0].path.name}"] if gemv else []) \
        + [f"up to {top} rows run the {'W4A16' if w4 is not None else 'W8A8'} GEMV {a.path.name}" for top, a, _ in few] \
        + [f"up to {top} rows run {a.path.name}" for top, a, _ in buckets] \
        + ([f"from {choice.dense_from} rows cuBLAS over the weight {dequant[0].path.name} dequantises per call"]
           if dequant else [f"from {choice.dense_from} rows cuBLAS over a dense copy"] if choice.dense_from else []) \
        + ([choice.note] if choice.note else []) \
        + ([f"writes {unit.activation}(gate) * up ({', '.join(o.name for o in unit.ops)} fused)"] if unit else [])
    if notes:
        row["note"] = "; ".join(notes)
    return module, [row], unit if unit is not None else fused if act != "none" else None

