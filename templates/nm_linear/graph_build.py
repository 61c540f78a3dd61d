"""Codegen of a planned 2:4 linear (a ``nm_sparse`` sub-operator, ``passes/transform/nm.py``): the kernel for the
calls of up to ``NM_MAX_ROWS`` rows with selection's tilings (and the kernel for fewer rows, ``few_rows``), the packed
weight, and the dense GEMM above them
(``KernelChoice.dense_from``)."""

from __future__ import annotations


from ...codegen.cuda_bind import bind, gemm_parts, report_row
from ...codegen.cuda_build import build_cuda
from ...graph import Graph, Op
from ...meta_model import meta_weight
from ...passes.transform.nm import NM_MAX_ROWS
from ...passes.transform.plan import OpPlan
from .kernel import nm_linear
from .runtime import NmLinearCUDA
from .spec import DTYPES, NmLinearSpec, pack_nm


def nm_spec(n: int, k: int, act16: str, bias: bool, act: str, tiles: dict) -> NmLinearSpec:
    """The 2:4 kernel of a planned linear, named for what it is."""
    t = {"rows": NM_MAX_ROWS, **tiles}
    return NmLinearSpec(n, k, dtype=act16, bias=bias, act=act, **t,
                        name=f"nm_Mr{t['rows']}x{n}x{k}_{act}{'_bias' if bias else ''}_w{t.get('warps', 4)}"
                             f"i{t.get('inflight', 8)}k{t.get('ksplit', 1)}"
                             f"{'t%d' % t['tiles'] if t.get('tiles', 1) > 1 else ''}{'p' if t.get('prefetch') else ''}"
                             f"{'_bf16' if act16 == 'bfloat16' else ''}")


def build(graph: Graph, op: Op, op_plan: OpPlan):
    """(module, report rows, the fused activation op or None) of a 2:4 linear."""
    choice = op_plan.kernel
    parts = gemm_parts(graph, op, op_plan)
    site, bias, n, k, act = parts.site, parts.bias, parts.n, parts.k, parts.act
    spec = nm_spec(n, k, site.act16, bias is not None, act, choice.tiles)
    art = build_cuda(nm_linear, spec)
    few = [(nm_spec(n, k, site.act16, bias is not None, act, t), top) for top, _, t in choice.few_rows or ()]
    few_arts = [build_cuda(nm_linear, f) for f, _ in few]
    keep = op_plan.kept(n, k)
    meta = meta_weight(graph, op) is not None    # a meta-device model: ones where kept (repacked at load)
    weight = (keep if meta else site.weight).to(DTYPES[spec.dtype])
    out = parts.output(op)
    module = NmLinearCUDA(art.path, spec, pack_nm(weight, spec, keep), bias, op.name, x_name=parts.x_name,
                          out_shape=graph.tensor(out).shape, dense_from=choice.dense_from,
                          few=(few_arts[0].path, few[0][0]) if few else None)
    bind(module, graph, op, parts.view, reference=False)
    row = report_row(op, "nm_linear", "2:4", "W16A16 (bf16)" if spec.dtype == "bfloat16" else "W16A16", "-",
                     [art, *few_arts])
    row["note"] = "".join(f"up to {top} rows on {f.name}; " for f, top in few) + f"up to {spec.rows} rows on mma.sp" \
        + (f"; from {choice.dense_from} rows cuBLAS over a dense copy" if choice.dense_from else "")
    return module, [row], parts.fused if act != "none" else None


__all__ = ["build", "nm_spec"]
