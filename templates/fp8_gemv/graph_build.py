"""Codegen of a planned linear of FP8 weights (``passes/transform/fp8.py``, chosen by ``select.py``): the GEMV for
calls of up to ``FP8_MAX_ROWS`` rows with selection's tiling, the weight quantised to E4M3 per output channel and
packed over the plan's 32x32 blocks, and the dense GEMM above ``KernelChoice.dense_from`` over the weight the
dequantisation kernel writes at each call."""

from __future__ import annotations

from ...codegen.cuda_bind import bind, gemm_parts, report_row
from ...codegen.cuda_build import build_cuda
from ...graph import Graph, Op
from ...passes.transform.fp8 import FP8_MAX_ROWS, fp8_block_grid
from ...passes.transform.plan import OpPlan
from .dequant import Fp8DequantSpec, fp8_dequant
from .kernel import fp8_gemv
from .runtime import Fp8LinearCUDA
from .spec import Fp8GemvSpec, pack_weight


def fp8_spec(n: int, k: int, act16: str, bias: bool, act: str, sparse: bool, tiles: dict) -> Fp8GemvSpec:
    """The FP8 GEMV of a planned linear, named for what it is."""
    t = {"rows": FP8_MAX_ROWS, **tiles}
    knobs = f"{'m' if t.get('mma') else ''}w{t.get('warps', 4)}i{t.get('inflight', 4)}k{t.get('ksplit', 1)}" \
            f"{'e' if t.get('trigger') == 'early' else ''}"
    return Fp8GemvSpec(n, k, dtype=act16, bias=bias, act=act, sparse=sparse, **t,
                       name=f"f8_Mr{t['rows']}x{n}x{k}_{'sparse' if sparse else 'dense'}_{act}"
                            f"{'_bias' if bias else ''}_{knobs}{'_bf16' if act16 == 'bfloat16' else ''}")


def build(graph: Graph, op: Op, op_plan: OpPlan):
    """(module, report rows, the fused activation op or None) of a linear of FP8 weights."""
    choice = op_plan.kernel
    parts = gemm_parts(graph, op, op_plan)
    site, bias, n, k, act = parts.site, parts.bias, parts.n, parts.k, parts.act
    sub = op_plan.subops[0]
    grid = fp8_block_grid(sub.elements) if sub.elements is not None else None
    sparse = grid is not None and not bool(grid.all())
    spec = fp8_spec(n, k, site.act16, bias is not None, act, sparse, choice.tiles)
    art = build_cuda(fp8_gemv, spec)
    packed = pack_weight(site.weight, spec, grid if sparse else None)   # a meta model: ones where kept (repacked)
    out = parts.output(op)
    dequant = Fp8DequantSpec.for_gemv(spec) if choice.dense_from and choice.dequant else None
    module = Fp8LinearCUDA(art.path, spec, packed, bias, op.name, x_name=parts.x_name,
                           out_shape=graph.tensor(out).shape, dense_from=None if dequant else choice.dense_from)
    arts = [art]
    if dequant is not None:
        arts.append(build_cuda(fp8_dequant, dequant))
        module.attach_dequant(arts[-1].path, dequant, choice.dense_from)
    bind(module, graph, op, parts.view, reference=True)
    blocks = f"{sub.n_blocks}x32x32" if sparse else "dense"
    row = report_row(op, "fp8_gemv", blocks, "W8A16 (e4m3)", "-", arts)
    row["note"] = f"up to {spec.rows} rows on the FP8 GEMV" + (
        f"; from {choice.dense_from} rows cuBLAS over the weight {arts[-1].path.name} dequantises per call"
        if dequant else f"; from {choice.dense_from} rows cuBLAS over a dense copy" if choice.dense_from else "")
    return module, [row], parts.fused if act != "none" else None


__all__ = ["build", "fp8_spec"]
