"""Rules for reductions (sum, mean, amax/amin, max/min over a dim, var/std, norms, prod).

For a reduction that maps an all-zero group to zero (checked by evaluating the op on
zeros), an output element is pruned iff its whole group is pruned (``prod``/``all``:
iff any element of the group is pruned). Backward, an input element is needed iff its
group's output is needed. ``max``/``min`` over a dim also return indices: those are
left as they are. Bits are not changed.
"""

from __future__ import annotations

import math

import torch

from ...graph import Op
from ...tesa import TeSA
from .common import kept, normalize_dims, refine, result
from .elementwise import value_at_zero
from .registry import rule

ANY_GROUP = ("sum", "mean", "amax", "amin", "max", "min", "var", "std", "norm", "linalg_vector_norm", "any",
             "nansum", "nanmean", "var_mean", "std_mean")
ALL_GROUP = ("prod", "all")


def _dims(op: Op, ndim: int):
    dim = op.attrs.get("dim", None)
    return normalize_dims(dim, ndim), bool(op.attrs.get("keepdim", False))


@rule(*ANY_GROUP, *ALL_GROUP)
def reduction(op: Op, ins: list[TeSA], outs: list[TeSA]):
    if len(ins) != 1 or not outs:
        return None
    x, y = ins[0], outs[0]
    if x.ndim == 0:
        return None
    dims, keepdim = _dims(op, x.ndim)
    group_all = op.op in ALL_GROUP
    m = kept(x)
    red = m.all(dim=dims, keepdim=True) if group_all else m.any(dim=dims, keepdim=True)
    shaped = red if keepdim else red.reshape(y.shape) if red.numel() == y.numel() else None
    if shaped is None or tuple(shaped.shape) != y.shape:
        return None
    z = value_at_zero(op, [x.ndim])
    group = 1
    for d in dims:
        group *= x.shape[d]
    any_kept = shaped
    if op.op in ("var", "std", "var_mean", "std_mean") and group == 1 and op.attrs.get("correction", 1) == 0:
        shaped = torch.zeros((), dtype=torch.bool)  # variance of a single element is exactly 0
    new_y = refine(y, shaped) if z == 0.0 else y
    new_outs = [new_y, *outs[1:]]
    if op.op in ("var_mean", "std_mean") and len(outs) == 2 and z == 0.0:  # second output: the mean
        new_outs[1] = refine(outs[1], any_kept)
    if z is not None and not math.isfinite(z):
        return result(ins, outs, ins, new_outs)
    need = kept(new_y)
    if len(outs) > 1 and outs[1].shape == y.shape:  # max/min indices, var_mean's mean
        need = need | kept(new_outs[1])
    need = need.reshape(red.shape).expand(x.shape)
    return result(ins, outs, [refine(x, need)], new_outs)


__all__ = ["reduction", "torch"]
