"""Selection rule of the 2:4 sparse linear (the ``gemm_cuda`` table, ``templates/registry.py``): a planned ``nm_sparse``
sub-operator (``passes/transform/nm.py``) runs the 2:4 kernel for calls of up to ``NM_MAX_ROWS`` rows and the dense
GEMM over a dense copy above (``KernelChoice.dense_from``); its tiling by shape."""

from __future__ import annotations

from ...codegen.select_cuda import GemmSite, choice
from ...passes.transform.nm import NM_MAX_ROWS
from ...target import Target
from ..registry import rule


def nm_tiling(n: int, k: int, rows: int, sms: int) -> dict:
    """The 2:4 kernel's knobs for an (N, K) linear of up to ``rows`` rows: 8 warps with 8 K tiles in flight, and
    split K in two where K is longer than N (fewer row tiles than the SMs want; measured: benchmarks/RESULTS.md,
    "CUDA 2:4 sparse GEMV", the best at 4 and 8 rows)."""
    return dict(warps=8, inflight=8, ksplit=2 if k > n else 1)


@rule("gemm_cuda", 20)
def nm_sparse(site: GemmSite, target: Target):
    if not any(s.template == "nm_sparse" for s in site.plan.subops):
        return None
    if site.requantized:
        return choice("torch", "nm_sparse", "2:4 with int8 output codes: no 2:4 kernel writes them; runs as a torch op")
    many = site.any_rows or site.m > NM_MAX_ROWS
    return choice("nm_linear", "nm_sparse", f"2:4 along K: mma.sp up to {NM_MAX_ROWS} rows"
                  + (", cuBLAS over a dense copy above" if many else ""), site.act16,
                  nm_tiling(site.n, site.k, NM_MAX_ROWS, target.sms), dense_from=NM_MAX_ROWS + 1 if many else None)


__all__ = ["nm_sparse", "nm_tiling"]
