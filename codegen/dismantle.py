"""Dismantling: specialise a template against its compile-time sparsity, then let TVM's
simplifier delete the dead code.

The templates (``sparta.templates``) emit the block loops already unrolled against the
plan's block structure, each block guarded by a compile-time constant ("is this block
kept?") with constant indices into the packed weights. :func:`eliminate_dead_code` runs
TVM's own passes (``StmtSimplify`` folds the guards and index arithmetic, ``RemoveNoOp``
drops the pruned branches), so pruned blocks leave no code and no index array is read.
:func:`before_after` returns both texts for inspection (and the golden test).
"""

from __future__ import annotations

from .tvm_env import tvm


def eliminate_dead_code(func):
    """The PrimFunc after TVM's constant folding and dead-code removal."""
    t = tvm()
    from tvm import tirx
    mod = t.IRModule({"main": func})
    mod = t.transform.Sequential([tirx.transform.StmtSimplify(), tirx.transform.RemoveNoOp()])(mod)
    return mod["main"]


def before_after(template, spec) -> tuple[str, str]:
    """TVMScript of ``template(spec)`` as emitted, and after dead-code elimination."""
    func = template(spec)
    return func.script(), eliminate_dead_code(func).script()
