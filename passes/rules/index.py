"""Rules for ops whose data movement depends on values: lookups, gathers, selections, scatters.

Indices (and the order of values) are data, unknown at compile time, so each rule assumes
the worst: an output element may read *any* element its index or selection can reach.

* lookups (``embedding``, ``index``, ``gather``, ``index_select``): an output element is
  pruned iff every element it may read is; computed by running the op itself on the kept
  mask reduced (OR) over the indexed dims, with all indices 0. Backward, an element is
  needed iff a needed output may read it (autograd through the same call); index tensors
  are left as they are.
* selections (``sort``, ``topk``, ``kthvalue``, ``median``, ``mode``, ``cummax``, ``argmax`` …):
  a value output along the dim is pruned iff the whole dim is; the dim is needed whole as
  soon as any output along it (values or indices) is needed. Index outputs are unchanged.
* scatters (``scatter``, ``scatter_add``, ``scatter_reduce``, ``index_put``): an output keeps
  what ``self`` keeps, and everything if any source element is kept; ``self`` is needed
  where the output is, the source whole if any output is needed.
* other data-dependent ops (``searchsorted``, ``bucketize``, embedding bags …): no zeros are
  derived; every input is needed as soon as any output is.
"""

from __future__ import annotations

import torch

from ...graph import Op, substitute
from ...tesa import TeSA
from .common import kept, normalize_dims, refine, result
from .registry import rule

SELECTIONS = ("sort", "topk", "kthvalue", "median", "nanmedian", "mode", "cummax", "cummin", "argmax", "argmin",
              "msort", "argsort")
SCATTERS = ("scatter", "scatter_add", "scatter_reduce", "index_put", "index_add", "index_copy", "index_fill",
            "masked_scatter")
DATA_DEPENDENT = ("searchsorted", "bucketize", "_embedding_bag", "_embedding_bag_forward_only", "take", "histc")


@rule("embedding")
def embedding(op: Op, ins: list[TeSA], outs: list[TeSA]):
    """``embedding(weight, indices)``: any row may be read, so a feature is pruned iff its column is."""
    if "weight" not in op.roles or "indices" not in op.roles:
        return None
    wi, ii = op.roles.index("weight"), op.roles.index("indices")
    w, idx, y = ins[wi], ins[ii], outs[0]
    if w.ndim != 2:
        return None
    cols = kept(w).any(0)  # (D,)
    new_y = refine(y, cols)
    need = kept(new_y)
    lead = list(range(need.dim() - 1))
    new_ins = list(ins)
    new_ins[wi] = refine(w, (need.any(dim=lead) if lead else need).unsqueeze(0).expand(w.shape))
    new_ins[ii] = refine(idx, need.any(-1))
    return result(ins, outs, new_ins, [new_y, *outs[1:]])


def _lookup_dims(op: Op, x: TeSA) -> list[int] | None:
    """The dims of the data input that indices route along (None: not a lookup we model)."""
    if op.op in ("gather", "index_select"):
        return [op.attrs["dim"] % max(x.ndim, 1)]
    if op.op == "index":
        dims = [int(r.split(".")[1]) for r in op.roles if r.startswith("indices.")]
        dtypes = op.meta.get("in_dtypes") or []
        if any(dt == torch.bool for dt, r in zip(dtypes, op.roles) if r.startswith("indices.")):
            return None   # a boolean mask selects a data-dependent number of elements
        return dims
    return None


@rule("index", "gather", "index_select")
def lookup(op: Op, ins: list[TeSA], outs: list[TeSA]):
    data = op.roles.index("self") if "self" in op.roles else None
    if data is None or len(outs) != 1:
        return None
    x, y = ins[data], outs[0]
    dims = _lookup_dims(op, x)
    if dims is None or x.ndim == 0:
        return None
    reduced = kept(x).any(dim=dims, keepdim=True).float().requires_grad_(True)
    bits = x.view().amax(dim=dims, keepdim=True) if x.numel() else x.view()
    env = {}
    for name, t, role in zip(op.inputs, ins, op.roles):
        env[name] = torch.zeros(t.shape, dtype=torch.int64) if role != "self" else None
    name = op.inputs[data]
    try:
        with torch.enable_grad():
            reach = op.target(*substitute(op.args, {**env, name: reduced}),
                              **substitute(op.kwargs, {**env, name: reduced}))
        reach_bits = op.target(*substitute(op.args, {**env, name: bits}), **substitute(op.kwargs, {**env, name: bits}))
    except Exception:  # noqa: BLE001 - an argument layout we do not model: no rule
        return None
    if tuple(reach.shape) != y.shape:
        return None
    new_y = refine(y, reach.detach() > 0, bits=reach_bits)
    (grad,) = torch.autograd.grad(reach, reduced, kept(new_y).float())
    new_ins = list(ins)
    new_ins[data] = refine(x, (grad > 0).expand(x.shape))
    return result(ins, outs, new_ins, [new_y])


def _selection_dims(op: Op, x: TeSA) -> list[int]:
    dim = op.attrs.get("dim", -1 if op.op in ("sort", "topk", "msort", "argsort", "cummax", "cummin") else None)
    if op.op == "msort":
        dim = 0
    return normalize_dims(dim, x.ndim)


@rule(*SELECTIONS)
def selection(op: Op, ins: list[TeSA], outs: list[TeSA]):
    if len(ins) != 1 or ins[0].ndim == 0:
        return None
    x = ins[0]
    dims = _selection_dims(op, x)
    m = kept(x).any(dim=dims, keepdim=True)
    bits = x.view().amax(dim=dims, keepdim=True) if x.numel() else x.view()
    out_dtypes = op.meta.get("out_dtypes") or [None] * len(outs)
    new_outs, need = [], torch.zeros(m.shape, dtype=torch.bool)
    for y, dt in zip(outs, out_dtypes):
        fits = _fit(m, y.shape, dims)
        if dt is not None and dt.is_floating_point and fits is not None:   # values; indices stay as they are
            y = refine(y, fits, bits=_fit(bits, y.shape, dims))
        new_outs.append(y)
        if y.numel() and kept(y).any():
            need = torch.ones_like(need) if fits is None else need | _unfit(kept(y), m.shape, dims)
    return result(ins, outs, [refine(x, need.expand(x.shape))], new_outs)


def _fit(reduced: torch.Tensor, shape: tuple, dims: list[int]) -> torch.Tensor | None:
    """``reduced`` (size 1 along ``dims``) broadcast to an output of ``shape`` (keepdim or not)."""
    if len(shape) == reduced.dim():
        try:
            return reduced.expand(shape)
        except RuntimeError:
            return None
    squeezed = reduced.squeeze(dims) if dims else reduced
    return squeezed if tuple(squeezed.shape) == tuple(shape) else None


def _unfit(need: torch.Tensor, reduced_shape, dims: list[int]) -> torch.Tensor:
    """An output's need mask OR-reduced back to the size-1-along-``dims`` shape."""
    if need.dim() == len(reduced_shape):
        return need.any(dim=dims, keepdim=True) if dims else need
    for d in sorted(dims):
        need = need.unsqueeze(d)
    return need


@rule(*SCATTERS)
def scatter(op: Op, ins: list[TeSA], outs: list[TeSA]):
    if "self" not in op.roles or len(outs) != 1 or ins[op.roles.index("self")].shape != outs[0].shape:
        return None
    data = op.roles.index("self")
    x, y = ins[data], outs[0]
    sources = [i for i, r in enumerate(op.roles) if i != data and r not in ("index", "mask")
               and not r.startswith("indices")]
    value = op.attrs.get("value", 0)
    scattered = any(kept(ins[i]).any() for i in sources) or (isinstance(value, (int, float)) and value != 0)
    new_y = y if scattered else refine(y, kept(x))
    any_needed = bool(kept(new_y).any())
    new_ins = list(ins)
    new_ins[data] = refine(x, kept(new_y))
    for i in sources:
        new_ins[i] = ins[i] if any_needed else refine(ins[i], torch.zeros((), dtype=torch.bool))
    return result(ins, outs, new_ins, [new_y])


@rule(*DATA_DEPENDENT)
def data_dependent(op: Op, ins: list[TeSA], outs: list[TeSA]):
    if any(kept(y).any() for y in outs):
        return result(ins, outs, ins, outs)
    return result(ins, outs, [refine(t, torch.zeros((), dtype=torch.bool)) for t in ins], outs)


__all__ = ["embedding", "lookup", "selection", "scatter", "data_dependent"]
