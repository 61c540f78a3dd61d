"""Specialisation for ``target="cuda"``: every sparse linear of the plan becomes a ``bsr_linear`` kernel
(fp16; W8A8 int8 with a per-token activation quantiser where the plan chose 8-bit weights and inputs;
W4A16, int4 weights with calibration's scales dequantised in registers, where it chose 4-bit weights;
a dense 4-bit linear of at most 16 rows runs the W4A16 GEMV instead, ``templates/cuda_w4a16.py``).
fp16 LayerNorms become sparta's LayerNorm kernel (``templates/cuda_layernorm.py``): one read by W8A8
linears hands them their per-token int8 codes, so they skip the quantiser; one fed by a residual add
that nothing else reads adds the two inputs itself. A linear whose output (after its fused activation)
calibration gave a static int8 scale and only W8A8 linears read writes int8 codes itself (``out="int8"``),
so they skip the quantiser too.

Runs on a machine with TVM and nvcc and no GPU: kernels are cross-compiled (cubins for
sm_80/sm_90), not run. Each op's kept elements (the union of its sub-operators) are
covered by the template's square blocks of the plan's largest block side (32 or 64); the
block list goes in a table argument, so ops of one shape share one kernel. A dense W8A8 op also
gets a Hopper ``wgmma`` kernel (sm_90a) over the same blocks, which the runtime runs on sm_90
GPUs (1.1-1.4x fp16 cuBLAS there, where ``mma.sync`` int8 is not faster). Ops the template
cannot take (K not a multiple of 8, conv, a full-matrix addend) stay torch ops, with the
reason in the report.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..backend.fx import Fused, Passthrough
from ..graph import Graph, Op
from ..passes.transform.plan import OpPlan, Plan
from ..passes.transform.transform_op import gemm_view
from ..runtime.bsr_linear import SparseLinearCUDA
from ..runtime.layernorm import LayerNormCUDA, quantized_names
from ..runtime.w4a16_gemv import W4A16GemvCUDA
from ..templates.cuda_bsr import TUNED_TILES, BsrSpec, bsr_linear
from ..templates.cuda_bsr_ref import block_mask_of
from ..templates.cuda_layernorm import LayerNormSpec, layer_norm_kernel, pick_threads
from ..templates.cuda_quant import QuantRowsSpec, quantize_rows_kernel
from ..templates.cuda_quant import pick_threads as pick_quant_threads
from ..templates.cuda_w4a16 import W4A16Spec, w4a16_gemv
from .cuda_build import build_cuda
from .specialize import _fusable_activation, _weight_matrix

FUSED = {"relu": "relu", "gelu": "gelu_erf"}           # only exact GELU reaches here (_fusable_activation)
# W8A8 tiles measured best on the H100 (benchmarks/RESULTS.md, bench_cuda_w8a8): per block side, and dense
INT8_TILES = {32: dict(bn=32, bk=32, tm=128, warps_m=2, warps_n=1, stages=4),
              64: dict(bn=64, bk=64, tm=128, warps_m=2, warps_n=2, stages=3)}
HOPPER_SMS = 132                                        # H100/H200 SXM multiprocessors
# W4A16 dense tiles by M, measured on the H100 (benchmarks/RESULTS.md, bench_cuda_w4_gemm): up to 16 rows
# the int4 kernel beats cuBLAS fp16 (1.0-1.9x); from 17 to 255 rows it is 2x slower (32 CTAs of 128
# columns, no split-K), so such ops stay cuBLAS on the dequantised weights
W4_DENSE_TILES = ((16, dict(tm=16, bn=32, bk=128, warps_m=1, warps_n=2, stages=4)),
                  (255, None),
                  (1024, dict(tm=64, bn=128, bk=128, warps_m=1, warps_n=4, stages=4)),
                  (None, dict(tm=128, bn=128, bk=64, warps_m=2, warps_n=2, stages=4)))


STREAM_MAX_ROW_BLOCKS = 2     # kept 64-blocks per block row at or below which the streaming grid runs the op


def stream_tiles(m: int, mask: torch.Tensor) -> dict | None:
    """The streaming grid's tile (``templates/cuda_bsr_stream.py``) for an fp16 op in 64-blocks whose block
    rows keep few blocks, else None. Measured on the H200 (benchmarks/RESULTS.md, "Streaming grid"): BERT
    FFN1 at 90% / 95% (1.2 / 0.6 kept blocks per row) runs 10% / 8% faster than one tile per CTA; FFN2
    (4.8 per row) ties. 64-row tiles, 2 stages, about five CTAs per SM: ``groups`` block rows per m tile."""
    rows = mask.shape[0]
    if mask.all() or mask.sum() > STREAM_MAX_ROW_BLOCKS * rows:
        return None
    groups = min(rows, max(1, round(5 * HOPPER_SMS / -(-m // 64))))
    return dict(bn=64, bk=64, tm=64, warps_m=2, warps_n=2, stages=2, groups=groups)


PINGPONG_TILES_PER_SM = 3     # 128x192 tiles per SM from which the ping-pong kernel writes int8 codes fastest


def _pingpong_pays(m: int, n: int) -> bool:
    """Whether a dense W8A8 GEMM writing int8 codes runs fastest on the ping-pong kernel (128x192 tile per consumer
    warpgroup, ``templates/cuda_bsr_wgmma_ws.py``). Measured on the H100 (benchmarks/RESULTS.md): BERT FFN1, 3.9
    tiles per SM, 8-15% faster than any cooperative tile; FFN2, at most one tile per SM, 9% slower."""
    return n % 192 == 0 and -(-m // 128) * (n // 192) >= PINGPONG_TILES_PER_SM * HOPPER_SMS


def int8_dense_tiles(m: int, n: int, requantized: bool = False) -> tuple[dict, dict]:
    """(mma.sync tiles, wgmma tiles) of a dense W8A8 GEMM, over the same blocks. The wgmma tile
    measured best on the H100 (bench_cuda_w8a8): 128x192 where one wave of them covers the output
    (BERT FFN2, with 5 stages: 3 K blocks in flight), else 128x256 (4 stages: shared memory) — but 128x192 for
    an output that will be ``requantized`` (int8 codes) where the ping-pong kernel pays (``int8_codes_spec``)."""
    one_wave = n % 192 == 0 and -(-m // 128) * (n // 192) <= HOPPER_SMS
    bn = 192 if one_wave or (requantized and _pingpong_pays(m, n)) else 256
    hopper = dict(bn=bn, bk=128, tm=128, warps_m=2, warps_n=1 if bn == 192 else 2, stages=5 if bn == 192 else 4,
                  mma="wgmma")
    return dict(bn=bn, bk=128, tm=128, warps_m=2, warps_n=bn // 64, stages=3), hopper


def int8_codes_spec(spec: BsrSpec) -> BsrSpec:
    """The int8-code-writing (``out="int8"``) twin of a W8A8 kernel; for a dense 128x192 wgmma tile where it pays,
    the ping-pong schedule (a producer and two consumer warpgroups on alternate tiles, persistent over the SMs, 4
    stages: its two output tiles fit beside them only as int8)."""
    q8 = dataclasses.replace(spec, out="int8", name=spec.name + "_q8")
    if spec.dtype == "int8" and spec.mma == "wgmma" and (spec.bn, spec.tm, spec.warps_n) == (192, 128, 1) \
            and _pingpong_pays(spec.m, spec.n):
        q8 = dataclasses.replace(q8, stages=4, producer=True, ctas=HOPPER_SMS, pingpong=True, name=spec.name + "_pp_q8")
    return q8


def specialize_cuda(graph: Graph, plan: Plan):
    """Build a kernel for every sparse GEMM of ``plan``; returns (replacements, kernel report rows)."""
    replacements, report = {}, []
    for op_plan in plan.ops.values():
        if op_plan.kind != "sparse":
            continue
        op = graph.op(op_plan.op)
        built = _build_op(graph, op, op_plan)
        if isinstance(built, str):
            report.append(_torch_row(op, "W16A16", built))
            continue
        module, row, fused = built
        replacements[op.name] = module
        if fused is not None:
            replacements[fused.name] = Passthrough(fused.inputs[0])
        report.append(row)
    _requantized_outputs(graph, replacements, {r["op"]: r for r in report})
    report += _cuda_norms(graph, replacements)
    return replacements, report


def _requantized_outputs(graph: Graph, replacements: dict, rows: dict) -> None:
    """Linears whose output (or fused activation's output) has a static int8 scale from calibration and is
    read only by W8A8 linears: rebuilt with the requantising epilogue (``out="int8"``), they hand their
    readers int8 codes and the scale, and the per-token quantiser pass over an fp16 tensor is gone."""
    for t, scale in graph.meta.get("act_scales", {}).items():
        readers = graph.consumers(t)
        if not readers or t in graph.outputs or not all(
                isinstance(replacements.get(r), SparseLinearCUDA) and replacements[r].spec.dtype == "int8"
                and replacements[r].input_names == [t] for r in readers):
            continue
        name = graph.producer(t)
        fused = replacements.get(name) if isinstance(replacements.get(name), Passthrough) else None
        if fused is not None:
            name = graph.producer(fused.input_names[0])
        module = replacements.get(name)
        if not isinstance(module, SparseLinearCUDA) or module.output_names is not None or module.spec.dtype == "w4a16":
            continue
        spec = int8_codes_spec(module.spec)
        kernel = build_cuda(bsr_linear, spec)
        h_spec = int8_codes_spec(module.hopper[1]) if module.hopper else None
        hopper = build_cuda(bsr_linear, h_spec) if h_spec else None
        module.requantize_output(quantized_names(t), scale, (kernel.path, spec), (hopper.path, h_spec) if hopper else None)
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


def _cuda_norms(graph: Graph, replacements: dict) -> list[dict]:
    """fp16 LayerNorms become sparta's LayerNorm kernel (OneFlow-style Welford, 1.3-2x torch's): one whose
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
        int8 = [r for r in readers if isinstance(replacements.get(r), SparseLinearCUDA)
                and replacements[r].spec.dtype == "int8" and replacements[r].input_names == [y]]
        if not int8 and x.dtype != torch.float16:
            continue
        fp16_too = not int8 or len(int8) < len(readers) or y in graph.outputs
        out = "int8" if not fp16_too else "both" if int8 else "fp16"
        add = _residual_add(graph, op, replacements)
        built = _build_norm(graph, op, out, replacements[int8[0]].spec.m if int8 else math.prod(x.shape[:-1]), add)
        if isinstance(built, str):
            rows.append(_torch_row(op, "-", built))
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
    """The ``add`` producing LayerNorm ``op``'s input, if the LayerNorm kernel can do it instead: two fp16
    activations of the output's shape (no broadcast, no alpha), read by nothing else."""
    name = graph.producer(op.input_of("input"))
    if name is None or name in replacements:
        return None
    add = graph.op(name)
    if add.op != "add" or add.attrs.get("alpha", 1) != 1 or len(add.inputs) != 2 or len(set(add.inputs)) != 2:
        return None
    s = add.outputs[0]
    shape = graph.tensor(s).shape
    if any(v.dtype != torch.float16 or v.shape != shape or v.data is not None for v in map(graph.tensor, add.inputs)):
        return None
    return add if graph.consumers(s) == [op.name] and s not in graph.outputs else None


def _build_norm(graph: Graph, op: Op, out: str, rows: int, add: Op | None = None):
    x = graph.tensor(op.input_of("input"))
    n = x.shape[-1] if x.shape else 0
    if list(op.attrs.get("normalized_shape", [])) != [n]:
        return "normalises more than the last dimension"
    if n % 8 or math.prod(x.shape[:-1]) != rows:
        return f"width {n} is not a multiple of 8 or rows differ from the linears'"
    params = {}
    for role in ("weight", "bias"):
        name = op.input_of(role)
        if name is not None and graph.tensor(name).data is None:
            return f"the {role} is not a constant"
        params[role] = None if name is None else graph.tensor(name).data.float() * graph.tesa(name).mask.float()
    if params["bias"] is not None and params["weight"] is None:
        return "a bias without a weight"
    res = "_res" if add is not None else ""
    spec = LayerNormSpec(rows, n, eps=float(op.attrs.get("eps", 1e-5)), affine=params["weight"] is not None,
                         bias=params["bias"] is not None, out=out, threads=pick_threads(n), residual=add is not None,
                         name=f"layer_norm_{rows}x{n}_{out}{res}")
    art = build_cuda(layer_norm_kernel, spec)
    y = op.outputs[0]
    outputs = ([y] if out != "int8" else []) + (quantized_names(y) if out != "fp16" else [])
    x_name, r_name = (add.inputs[0], add.inputs[1]) if add is not None else (x.name, None)
    module = LayerNormCUDA(op.name, x_name, outputs, art.path, spec, params["weight"], params["bias"],
                           graph.tensor(y).shape, r_name)
    bits = {"fp16": "A16->A16", "int8": "A16->A8", "both": "A16->A16+A8"}[out]
    return module, _row(op, "layer_norm", "-", bits, "-", [art])


def _build_op(graph: Graph, op: Op, op_plan: OpPlan):
    view = gemm_view(graph, op)
    if view is None or op.op not in ("linear", "addmm", "mm", "matmul"):
        return f"not a GEMM the CUDA template takes ({op.op})"
    x_name, _, _, m, n, k = view
    if k % 8:
        return f"K={k} is not a multiple of 8"
    bias_name = op.input_of("bias") if op.op == "linear" else op.input_of("self") if op.op == "addmm" else None
    bias = graph.tensor(bias_name).data if bias_name else None
    if bias is not None and tuple(bias.shape) != (n,):
        return "bias is not a vector"
    side = 64 if max((max(s.block) for s in op_plan.subops if s.block is not None), default=32) >= 64 else 32
    keep = torch.zeros(n, k, dtype=torch.bool)
    for s in op_plan.subops:
        keep |= s.elements.mask.reshape(n, k)
    weight = _weight_matrix(graph, op) * keep
    if bias is not None:
        bias = bias.float() * graph.tesa(bias_name).mask.float()
    fused = _fusable_activation(graph, op, op_plan, single=True)
    act = FUSED.get(fused.op) if fused is not None else None
    fused = fused if act else None
    int8 = all(s.weight_bits == 8 and s.act_bits == 8 for s in op_plan.subops) and k % 16 == 0
    w4, w4_refusal = _w4_params(graph, view[1], op_plan, k)
    mask = block_mask_of(weight, side, side)
    tiles, hopper_tiles = TUNED_TILES[side], None
    if w4 is not None and keep.all() and m <= 16 and _gemv_group(w4, k):
        return _build_gemv(graph, op, view, weight, bias, w4, _gemv_group(w4, k))
    if w4 is not None and keep.all():
        tiles = next(t for top, t in W4_DENSE_TILES if top is None or m <= top)
        if tiles is None:
            return (f"W4A16 dense GEMM at M={m} is slower than cuBLAS fp16 on the dequantised weights "
                    "(measured, bench_cuda_w4_gemm); runs as a torch op")
        mask = torch.ones_like(block_mask_of(weight, tiles["bn"], tiles["bk"]))
    if side == 64 and not int8 and w4 is None and (stream := stream_tiles(m, mask)) is not None:
        tiles = stream
    if int8:
        dense = bool(keep.all())
        out = (fused or op).outputs[0]              # its int8 codes may be written (_requantized_outputs)
        requantized = out in graph.meta.get("act_scales", {})
        tiles, hopper_tiles = int8_dense_tiles(m, n, requantized) if dense else (INT8_TILES[side], None)
        if not dense and side == 64:
            # programmatic dependent launch, the next kernel launching once every CTA finished its main loop: the
            # tail of the previous kernel in the stream overlaps this one's start (BERT FFN 90% on the H100, chains
            # of launches: FFN1 12.8 -> 11.7 us, FFN2 9.0 -> 8.4 with int8 codes out; triggering right after the wait
            # instead is faster on FFN1, 11.5, and slower on one-wave FFN2, 10.6)
            tiles = {**tiles, "pdl": "tail"}
        mask = block_mask_of(weight, tiles["bn"], tiles["bk"])
        if dense:   # every block computed, zeros included (a dense tile does not skip empty blocks)
            mask = torch.ones_like(mask)
    dtype = "int8" if int8 else "w4a16" if w4 is not None else "float16"
    spec = BsrSpec(m, n, k, bias=bias is not None, act=act or "none", dtype=dtype,
                   zero=w4 is not None and w4.zero is not None, **tiles)
    tag = {"int8": "i8_", "w4a16": "w4_", "float16": ""}[dtype]
    spec = dataclasses.replace(spec, name=f"bsr_{m}x{n}x{k}_{tag}b{spec.bn}x{spec.bk}"
                                          f"{f'_g{spec.groups}' if spec.groups else ''}_"
                                          f"{act or 'none'}{'_bias' if spec.bias else ''}")
    art = build_cuda(bsr_linear, spec)
    hopper = None
    if hopper_tiles is not None:      # Hopper's warpgroup MMA over the same packed blocks, run on sm_90
        h_spec = dataclasses.replace(spec, **hopper_tiles, name=spec.name + "_wgmma")
        hopper = (build_cuda(bsr_linear, h_spec), h_spec)
    out_shape = graph.tensor(op.outputs[0]).shape
    scale, quant = None, None
    if int8:
        params = graph.meta.get("quant_params", {}).get(view[1], {}).get(8)
        scale = params.scale[:, 0] if params is not None and params.group >= k else None   # calibrated, per channel
        quant = build_cuda(quantize_rows_kernel, QuantRowsSpec(m, k, threads=pick_quant_threads(k),
                                                               name=f"quantize_rows_{m}x{k}")).path
    if w4 is not None:                 # calibration's codes, scales and zero points
        scale, zero = w4.expand(k)
        module = SparseLinearCUDA.from_w4_codes(op.name, x_name, art.path, spec, _w4_codes(w4, weight), scale, zero,
                                                mask, bias, out_shape)
    else:
        module = SparseLinearCUDA.from_weight(op.name, x_name, art.path, spec, weight, mask, bias, out_shape,
                                              weight_scale=scale, quant_folder=quant,
                                              hopper=(hopper[0].path, hopper[1]) if hopper else None)
    # low bits: the reference applies the weights the kernel applies (int8: activations per token at run time)
    _bind(module, graph, op, view, reference=int8 or w4 is not None)
    row = _row(op, "bsr_linear", f"{int(mask.sum())}x{spec.bn}x{spec.bk}",
               {"int8": "W8A8", "w4a16": "W4A16", "float16": "W16A16"}[dtype],
               f"tile (table argument{f', streaming grid of {spec.groups} groups' if spec.groups else ''})",
               [art] + ([hopper[0]] if hopper else []))
    if hopper:
        row["note"] = f"sm_90 runs the wgmma kernel {hopper[0].path.name} ({hopper[1].bn}x{hopper[1].bk} tiles)"
    planned = sorted({f"W{s.weight_bits}A{s.act_bits}" for s in op_plan.subops} - {row["bits"], "W16A16", "W32A32"})
    if planned:  # a width without a CUDA kernel for this op: say so rather than hide it
        row["note"] = f"plan asked for {', '.join(planned)}; runs the fp16 kernel" + \
            (f" ({w4_refusal})" if w4_refusal else "")
    return module, row, fused


def _gemv_group(params, k: int) -> int:
    """The GEMV's scale group for calibration's scales (32, 64 or 128 dividing K), 0 if none fits."""
    group = 128 if params.group >= 128 else params.group
    return group if group in (32, 64, 128) and k % group == 0 and (params.group >= k or params.group % group == 0) \
        else 0


def gemv_tiling(m: int, n: int, k: int, group: int) -> dict:
    """The W4A16 GEMV tiling ``compile`` builds for an ``m``-row ``(n, k)`` linear: the fastest measured by
    ``benchmarks/bench_cuda_w4a16.py`` (RESULTS.md)."""
    # rows <= 8: two 8-row tiles per CTA over 16 warps; more rows: four tiles over 8 warps (X is re-read per CTA)
    tiling = dict(ntile=2, warps=16, unroll=1) if m <= 8 else dict(ntile=4, warps=8, unroll=1)
    if m <= 8 and group == 128:
        # programmatic dependent launch, the next kernel launching once this one started ("early"): the tail of the
        # previous GEMV overlaps this one's first weight loads (H100, 2026-11-23, chains of GEMVs: 4096x4096 4.8 ->
        # 4.3 us, 4096x11008 10.3 -> 9.3, 11008x4096 10.1 -> 9.3 with four tiles of 8 warps bounded to 3 CTAs per SM)
        tiling["pdl"] = "early"
        if n >= 8192:
            tiling.update(ntile=4, warps=8, min_ctas=3)
        elif k >= 2 * n:
            # long rows on a one-wave grid: 64 registers for 2 CTAs of 16 warps per SM
            tiling.update(min_ctas=2)
    if m > 8:
        # the "late" trigger (the next kernel launches once this one passed its wait; "early" lets grids of several
        # waves pile up): 16 rows on the H100, 4096x4096 7.5 -> 6.5 us, 4096x11008 14.6 -> 14.1, 11008x4096 12.6 ->
        # 11.8 with 3 CTAs per SM
        tiling["pdl"] = "late"
        if n >= 8192:
            tiling["min_ctas"] = 3
        elif k >= 2 * n:
            # few 8-row tiles, long rows: two CTAs split K (4096x11008 at 16 rows: 16.4 -> 14.6 us on the H100;
            # slower where N is large or at batch 1)
            tiling["ksplit"] = 2
    # two tiles per CTA, up to 8 rows, group 128: the scale folded into the fp32 sum per chunk (1-7% faster at batch 1
    # on the H100; slower at 16 rows, where each chunk folds twice the accumulators)
    tiling["fold"] = group == 128 and m <= 8 and tiling["ntile"] == 2
    return tiling


def _build_gemv(graph: Graph, op: Op, view, weight: torch.Tensor, bias, params, group: int):
    """A dense 4-bit linear of <= 16 rows on the W4A16 GEMV (bias fused; the activation stays a torch op)."""
    x_name, _, _, m, n, k = view
    sym = params.zero is None
    tiling = gemv_tiling(m, n, k, group)
    spec = W4A16Spec(m, n, k, group=group, sym=sym, bias=bias is not None, **tiling,
                     name=f"w4a16_gemv_{m}x{n}x{k}_g{group}{'' if sym else '_zero'}{'_bias' if bias is not None else ''}"
                          f"{'_fold' if tiling['fold'] else ''}{'_ks2' if tiling.get('ksplit') else ''}"
                          f"{'_w%db%d' % (tiling['warps'], tiling['min_ctas']) if tiling.get('min_ctas') else ''}"
                          f"{'_pdl' if tiling.get('pdl') else ''}")
    art = build_cuda(w4a16_gemv, spec)
    scale_el, zero_el = params.expand(k)
    zero = None if sym else zero_el[:, ::group].to(torch.uint8)
    module = W4A16GemvCUDA.from_codes(op.name, x_name, art.path, spec, _w4_codes(params, weight),
                                      scale_el[:, ::group].half(), zero, bias, graph.tensor(op.outputs[0]).shape)
    _bind(module, graph, op, view, reference=True)
    return module, _row(op, "w4a16_gemv", "dense", "W4A16", "-", [art]), None


def _w4_codes(params, weight: torch.Tensor) -> torch.Tensor:
    """Calibration's 4-bit codes of ``weight`` as the kernels store them: uint8 0..15 (symmetric: +8)."""
    codes = params.codes(weight)
    return (codes + 8 if params.zero is None else codes).to(torch.uint8)


def _bind(module, graph: Graph, op: Op, view, reference: bool) -> None:
    """Record the graph weight the module stands for (and, for quantised kernels, the weight it applies)."""
    module.weight_name, module.weight_transposed = view[1], op.op in ("addmm", "mm", "matmul")
    if reference:
        module.reference_weight = module.graph_weight().to(graph.tensor(view[1]).dtype)


def _torch_row(op: Op, bits: str, why: str) -> dict:
    """The kernel report row of an op left to torch, ``why`` in its key column."""
    return {"op": op.name, "template": "torch", "blocks": "-", "bits": bits, "dismantle": "-",
            "build_s": 0.0, "cached": False, "code_bytes": 0, "key": why}


def _row(op: Op, template: str, blocks: str, bits: str, dismantle: str, arts: list) -> dict:
    """The kernel report row of an op built from ``arts`` (the first is the kernel it runs by default)."""
    art = arts[0]
    return {"op": op.name, "template": template, "blocks": blocks, "bits": bits, "dismantle": dismantle,
            "build_s": round(art.build_s, 3), "cached": art.cached,
            "code_bytes": sum((a.path / c["file"]).stat().st_size for a in arts for c in a.launch["cubins"].values()),
            "key": art.path.name, "artifact": str(art.path)}


def _w4_params(graph: Graph, weight: str, op_plan: OpPlan, k: int):
    """(QuantParams, None) when the plan runs the op as W4A16 and calibration's scales suit the kernel
    (one scale per 32 columns at least); else (None, why not or None)."""
    if not all(s.weight_bits == 4 and s.act_bits == 16 for s in op_plan.subops):
        return None, None
    params = graph.meta.get("quant_params", {}).get(weight, {}).get(4)
    if params is None:
        return None, "no fitted 4-bit scales"
    if params.group < k and params.group % 32:
        return None, f"W4A16 kernels need scale groups of a multiple of 32 columns, not {params.group}"
    return params, None
