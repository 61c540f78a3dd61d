"""Helpers shared by the rule tables: refining TeSAs by masks, broadcasting, boolean algebra."""

from __future__ import annotations

import torch

from ...tesa import TeSA


def kept(t: TeSA) -> torch.Tensor:
    """Bool mask of kept elements (materialised, contiguous)."""
    return t.view() != 0


def fkept(t: TeSA, dtype=torch.float32) -> torch.Tensor:
    """Kept mask as 0/1 floats (for boolean algebra through torch ops)."""
    return (t.view() != 0).to(dtype)


def refine(t: TeSA, keep: torch.Tensor | None = None, bits: torch.Tensor | None = None) -> TeSA:
    """``t`` with elements outside ``keep`` pruned and bits capped at ``bits``.

    ``keep`` (bool) and ``bits`` (integer) broadcast to ``t.shape``. Never raises a
    value; returns ``t`` itself when nothing changes, so callers can test ``is``.
    """
    cur = t.view()
    new = cur
    if keep is not None:
        if t.uniform is not None and t.uniform == 0:
            return t
        if int(torch.count_nonzero(keep)) == keep.numel():  # before expanding: cheaper, same answer
            keep = None
        else:
            keep = keep.expand(t.shape) if keep.shape != t.shape else keep
            new = torch.where(keep, new, torch.zeros((), dtype=torch.uint8))
    if bits is not None:
        bits = bits.to(torch.uint8)
        bits = bits.expand(t.shape) if bits.shape != t.shape else bits
        new = torch.minimum(new, bits)
    if new is cur or torch.equal(new, cur):
        return t
    return TeSA(new.contiguous(), _trusted=True)


def any_to_shape(mask: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Reduce a broadcast result back to an operand's ``shape`` with logical OR."""
    if tuple(mask.shape) == tuple(shape):
        return mask
    lead = mask.dim() - len(shape)
    if lead:
        mask = mask.reshape(-1, *mask.shape[lead:]).any(0) if lead else mask
    dims = tuple(i for i, s in enumerate(shape) if s == 1 and mask.shape[i] != 1)
    if dims:
        mask = mask.any(dim=dims, keepdim=True)
    return mask


def normalize_dims(dims, ndim: int) -> list[int]:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return sorted({d % max(ndim, 1) for d in dims})


def result(ins: list[TeSA], outs: list[TeSA], new_ins: list[TeSA], new_outs: list[TeSA]):
    """A rule's answer: refined inputs and outputs (unchanged ones passed through as-is).

    A rule returns None only when it does not apply (the op then falls back to
    scrambling); "nothing changed" is the given TeSAs returned.
    """
    assert len(new_ins) == len(ins) and len(new_outs) == len(outs)
    return new_ins, new_outs


def multilinear(fn, tesas: list[TeSA], need_of):
    """Boolean algebra of a multilinear op through autograd on 0/1 masks.

    ``fn(*masks)`` runs the op on the kept masks: an output is structurally non-zero iff
    its count of all-kept terms is positive (exact for 0/1 inputs). ``need_of(fwd)``
    turns that forward mask into the needed-output mask; the gradient of
    ``sum(fn(...) * need)`` with respect to each operand then counts the needed outputs
    each element reaches through kept partners, so ``grad > 0`` is the backward (and
    input → input) rule. Returns ``(forward_mask, [needed_mask per operand])``.
    """
    big = max(t.numel() for t in tesas) > (1 << 24)
    dtype = torch.float64 if big else torch.float32
    xs = [fkept(t, dtype).requires_grad_(True) for t in tesas]
    with torch.enable_grad():
        y = fn(*xs)
        fwd = y.detach() > 0
        need = need_of(fwd)
        grads = torch.autograd.grad(y, xs, need.to(dtype), allow_unused=True)
    return fwd, [torch.zeros(t.shape, dtype=torch.bool) if g is None else g > 0 for t, g in zip(tesas, grads)]
