"""Rules for normalisations and softmax: softmax/log_softmax, layer_norm, rms_norm,
batch_norm (eval), group_norm.

None of these maps a row of zeros to zeros in general, so the forward rules are exact
about where a zero survives:

* softmax never produces a zero (exp(0) = 1): no forward pruning. Backward, a row of the
  input is needed iff any output of that row is.
* layer_norm: ``x̂ · w + b``. A column is zero iff ``w`` and ``b`` are pruned there; a row
  whose input is entirely pruned normalises to 0, leaving ``b``. Backward, a row of
  ``x`` is needed iff it reaches a needed output through a kept ``w``.
* rms_norm: ``x / rms(x) · w`` keeps zeros of ``x`` and ``w`` (forward = x ∧ w).
* batch_norm (eval): per channel ``x · s + t`` with ``s = w / sqrt(var + eps)`` and
  ``t = b − mean · s``: zero where ``(x or w pruned) and b pruned and (mean or w pruned)``.
* group_norm: layer_norm over (n, group) with per-channel affine.

Bits are not changed.
"""

from __future__ import annotations

import torch

from ...graph import Op
from ...tesa import TeSA
from .common import kept, normalize_dims, refine, result
from .registry import rule

FALSE = torch.zeros((), dtype=torch.bool)
TRUE = torch.ones((), dtype=torch.bool)


def _opt(op: Op, ins, role, default):
    i = op.roles.index(role) if role in op.roles else None
    return (i, kept(ins[i])) if i is not None else (None, default)


@rule("softmax", "log_softmax")
def softmax(op: Op, ins: list[TeSA], outs: list[TeSA]):
    if len(ins) != 1:
        return None
    x, y = ins[0], outs[0]
    if x.ndim == 0:
        return result(ins, outs, ins, outs)
    dim = op.attrs.get("dim", -1) % x.ndim
    if x.shape[dim] == 1:  # softmax of one element is 1 (log_softmax 0), whatever x is
        y = refine(y, FALSE) if op.op == "log_softmax" else y
        return result(ins, outs, [refine(x, FALSE)], [y])
    need = kept(y).any(dim=dim, keepdim=True).expand(x.shape)
    return result(ins, outs, [refine(x, need)], outs)


def _rows(x: TeSA, nshape) -> int:
    return x.ndim - len(nshape)


@rule("layer_norm")
def layer_norm(op: Op, ins: list[TeSA], outs: list[TeSA]):
    xi = op.roles.index("input") if "input" in op.roles else None
    if xi is None:
        return None
    x, y = ins[xi], outs[0]
    nshape = list(op.attrs.get("normalized_shape", x.shape[-1:]))
    lead = _rows(x, nshape)
    dims = list(range(lead, x.ndim))
    wi, w = _opt(op, ins, "weight", TRUE)
    bi, b = _opt(op, ins, "bias", FALSE)
    row = kept(x).any(dim=dims, keepdim=True)
    if all(s == 1 for s in nshape):  # one element per row normalises to exactly 0
        row = torch.zeros_like(row)
    new_y = refine(y, (row & w) | b)
    need = kept(new_y)
    new_ins = list(ins)
    new_ins[xi] = refine(x, (need & w).any(dim=dims, keepdim=True).expand(x.shape))
    lead_dims = list(range(lead))
    if wi is not None:
        new_ins[wi] = refine(ins[wi], (need & row).any(dim=lead_dims) if lead_dims else need & row)
    if bi is not None:
        new_ins[bi] = refine(ins[bi], need.any(dim=lead_dims) if lead_dims else need)
    return result(ins, outs, new_ins, [new_y, *outs[1:]])


@rule("rms_norm")
def rms_norm(op: Op, ins: list[TeSA], outs: list[TeSA]):
    xi = op.roles.index("input") if "input" in op.roles else None
    if xi is None:
        return None
    x, y = ins[xi], outs[0]
    nshape = list(op.attrs.get("normalized_shape", x.shape[-1:]))
    lead = _rows(x, nshape)
    dims = list(range(lead, x.ndim))
    wi, w = _opt(op, ins, "weight", TRUE)
    xk = kept(x)
    new_y = refine(y, xk & w)
    need = kept(new_y)
    new_ins = list(ins)
    new_ins[xi] = refine(x, (need & w & xk).any(dim=dims, keepdim=True).expand(x.shape))
    if wi is not None:
        new_ins[wi] = refine(ins[wi], (need & xk).any(dim=list(range(lead))) if lead else need & xk)
    return result(ins, outs, new_ins, [new_y, *outs[1:]])


@rule("batch_norm")
def batch_norm(op: Op, ins: list[TeSA], outs: list[TeSA]):
    if op.attrs.get("training", False) or "input" not in op.roles:
        return None
    xi = op.roles.index("input")
    x, y = ins[xi], outs[0]
    if x.ndim < 2:
        return None
    shape = [1, -1] + [1] * (x.ndim - 2)
    wi, w = _opt(op, ins, "weight", TRUE.reshape(1))
    bi, b = _opt(op, ins, "bias", FALSE.reshape(1))
    mi, mean = _opt(op, ins, "running_mean", FALSE.reshape(1))
    vi, _ = _opt(op, ins, "running_var", TRUE.reshape(1))
    s, t = w, b | (mean & w)
    xk = kept(x)
    new_y = refine(y, (xk & s.reshape(shape)) | t.reshape(shape))
    need = kept(new_y)
    red = [d for d in range(x.ndim) if d != 1]
    ch_need = need.any(dim=red)
    new_ins = list(ins)
    new_ins[xi] = refine(x, need & s.reshape(shape))
    if wi is not None:
        new_ins[wi] = refine(ins[wi], (need & xk).any(dim=red) | (ch_need & mean))
    if bi is not None:
        new_ins[bi] = refine(ins[bi], ch_need)
    if mi is not None:
        new_ins[mi] = refine(ins[mi], ch_need & w)
    if vi is not None:
        new_ins[vi] = refine(ins[vi], ch_need & w)
    return result(ins, outs, new_ins, [new_y, *outs[1:]])


@rule("group_norm")
def group_norm(op: Op, ins: list[TeSA], outs: list[TeSA]):
    if "input" not in op.roles:
        return None
    xi = op.roles.index("input")
    x, y = ins[xi], outs[0]
    groups = int(op.attrs.get("num_groups", 1))
    if x.ndim < 2 or x.shape[1] % groups:
        return None
    n, c = x.shape[:2]
    shape = [1, -1] + [1] * (x.ndim - 2)
    wi, w = _opt(op, ins, "weight", TRUE.reshape(1))
    bi, b = _opt(op, ins, "bias", FALSE.reshape(1))
    grouped = kept(x).reshape(n, groups, -1).any(-1)  # (N, G)
    row = grouped.repeat_interleave(c // groups, dim=1).reshape([n, c] + [1] * (x.ndim - 2))
    new_y = refine(y, (row & w.reshape(shape)) | b.reshape(shape))
    need = kept(new_y)
    red = [d for d in range(x.ndim) if d != 1]
    gneed = (need & w.reshape(shape)).reshape(n, groups, -1).any(-1)
    new_ins = list(ins)
    new_ins[xi] = refine(x, gneed.repeat_interleave(c // groups, dim=1).reshape([n, c] + [1] * (x.ndim - 2))
                         .expand(x.shape))
    if wi is not None:
        new_ins[wi] = refine(ins[wi], (need & row).any(dim=red))
    if bi is not None:
        new_ins[bi] = refine(ins[bi], need.any(dim=red))
    return result(ins, outs, new_ins, [new_y, *outs[1:]])


__all__ = ["softmax", "layer_norm", "rms_norm", "batch_norm", "group_norm", "normalize_dims"]
