"""Selection rule of sparta's CPU linears (the ``gemm_cpu`` table, ``templates/registry.py``; its last rule: it always
answers): each sub-operator's kernel variant — block kernel dismantled as the plan says, the generic (row-parallel,
shared per shape) block kernel, or the fine-grained kernel with its weights baked in ("full") or tiled."""

from __future__ import annotations

from ...codegen.select_cpu import CpuSite
from ...passes.transform.plan import KernelChoice
from ...target import Target
from ..registry import rule
from . import block_spec

FULL_FINE_MAX_NNZ = 256  # baked FMAs: LLVM time grows fast with the non-zeros baked in, so bake only small weights


def _dtype(bits: str) -> str:
    return {"W32A32": "float32", "W8A8": "int8", "W8A32": "w8a32", "W4A32": "w4a32"}.get(bits, "mixed")



def variant(sub, m: int, any_rows: bool, dismantle: str) -> str:
    """The dismantle mode of one sub-operator's kernel: ``full`` / ``tile`` / ``none`` (the generic kernel)."""
    if sub.template == "fine_sparse":
        return "full" if sub.nnz <= FULL_FINE_MAX_NNZ else "tile"
    if sub.template == "dense":   # few rows: the row-parallel generic kernel (any rows: it picks that or panels)
        return "none" if any_rows or m < 2 * block_spec.PANEL else "tile"
    return dismantle


@rule("gemm_cpu", 90)
def cpu_linear(site: CpuSite, target: Target):
    subs = ", ".join(s.template for s in site.plan.subops)
    modes = [variant(s, site.m, site.any_rows, site.plan.dismantle) for s in site.plan.subops]
    return KernelChoice("cpu_linear", "cpu_linear", f"sparta's TVM kernels ({subs})", _dtype(site.bits),
                        dict(modes=modes))
