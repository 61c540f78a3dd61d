"""Run chosen sparse ops dense again: ``compiled.run_dense(ops, why)``, and ``compile(..., measure=True)``.

The plan is the contract and a plan is never measured slower than dense: where a sparta kernel measures slower than
the dense op it replaces (``compiled.profile()`` names them), the op runs the torch op on its masked weight instead,
and the plan says so (kind ``dense``, the measurement in its note). Ops fused into the kernel (its activation, a gated
unit's slices and product) run as torch ops again. A kernel that hands its readers int8 codes, or reads a LayerNorm's,
is part of a chain the dense op cannot join; it is refused with the reason.
"""

from __future__ import annotations

from .backend.fx import Fused, Passthrough
from .errors import SpartaError
from .passes.transform.groups import group_of


def dense_fallback_blocker(compiled, op: str) -> str | None:
    """Why the sparse op ``op`` cannot run dense alone, or None (read from the plan's fusion groups)."""
    module = compiled.module_replacements().get(op)
    plan = compiled.plan
    p = plan.ops.get(op) if plan is not None else None
    if module is None or p is None or p.kind != "sparse" or group_of(plan, op) is not None:
        return "it runs no sparta GEMM kernel"
    if not plan.fusions and any(isinstance(m, (Fused, Passthrough)) for m in compiled.module_replacements().values()):
        return "its plan (saved by an older sparta) does not say which ops its kernels fuse: compile it again"
    if any(g.anchor == op and g.readers for g in plan.fusions):
        return "its readers take the int8 codes its kernel writes"
    if any(op in g.readers for g in plan.fusions):
        return "it reads the int8 codes another kernel writes"
    return None


def run_dense(compiled, reasons: dict[str, str]) -> list[str]:
    """Make each op of ``reasons`` (op → why) run its dense torch op (in place); returns the ops changed. Raises,
    changing nothing, if one of them runs no sparta GEMM kernel or cannot leave its int8 chain."""
    for op in reasons:
        blocker = dense_fallback_blocker(compiled, op)
        if blocker is not None:
            raise SpartaError(f"op {op!r} cannot run dense: {blocker}")
    replacements = compiled.module_replacements()
    for op, why in reasons.items():
        del replacements[op]
        for group in [g for g in compiled.plan.fusions if g.anchor == op]:    # its epilogue: torch ops again
            compiled.plan.fusions.remove(group)
            for name in group.ops:
                del replacements[name]
                p = compiled.plan.ops[name]
                compiled.plan.pin(name, est_us=p.dense_us, note="")
        p = compiled.plan.ops[op]
        compiled.plan.pin(op, kind="dense", est_us=p.dense_us, subops=[], epilogue=[], kernel=None,
                          note=f"runs dense: {why}")
    if reasons:
        compiled.kernels = [row for row in compiled.kernels if row.get("op") not in reasons]
        compiled.rebuild(replacements)
    return list(reasons)


def measured_slower(compiled, margin: float = 1.1, reps: int = 5) -> dict[str, str]:
    """The sparse ops that measure more than ``margin`` × their dense op on random inputs of the example's shapes
    (on the model's device), with the measurement in words."""
    prof = compiled.profile(reps=reps)
    return {name: f"measured {prof.op(name).measured_us:.1f} µs against dense {prof.op(name).dense_us:.1f} µs at "
                  f"{prof.inputs}" for name in prof.slower_than_dense(margin)
            if dense_fallback_blocker(compiled, name) is None}


def measure_and_fall_back(compiled, margin: float = 1.1) -> dict[str, str]:
    """``compile(..., measure=True)``: run dense the sparse ops measured slower than ``margin`` × their dense op on
    the target's device; returns them with the measurement."""
    import torch
    if compiled.target == "cuda" and not torch.cuda.is_available():
        raise SpartaError("measure=True times the kernels on the target's device and this machine has no GPU: load "
                          "the saved model on one and call compiled.run_dense(compiled.profile().slower_than_dense())")
    home = compiled.device
    compiled.to(compiled.target)
    try:
        slow = measured_slower(compiled, margin)
        run_dense(compiled, slow)
    finally:
        compiled.to(home)
    return slow


__all__ = ["dense_fallback_blocker", "measure_and_fall_back", "measured_slower", "run_dense"]
