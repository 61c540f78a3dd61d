"""Rules for matrix products: linear, mm, bmm, matmul (batched, broadcast), addmm, baddbmm.

A product's output element is pruned iff every term of its sum has a pruned factor
(boolean matrix product); added terms (bias, ``addmm``'s ``self``) keep an element when
they are kept. Backward, an element of ``A`` is needed iff it meets a kept element of
``B`` on the way to a needed output (so a pruned column of ``A`` prunes the matching row
of ``B``: input → input). Computed exactly by :func:`common.multilinear`. Bits are not
changed here (the bit width of a product is chosen by calibration).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...graph import Op
from ...tesa import TeSA
from .common import any_to_shape, kept, multilinear, refine, result
from .registry import rule


def affine_rule(op: Op, ins: list[TeSA], outs: list[TeSA], fn, factors: list[int], addends: list[int],
                channel_dim: int | None = None, alpha=1, beta=1):
    """out = alpha · fn(factors) + beta · Σ addends; exact boolean rule.

    Addends broadcast like torch (trailing dims), or, with ``channel_dim``, a 1-D addend
    runs along that output dim (a convolution's bias).
    """
    nd = len(outs[0].shape)

    def addend_view(a):
        return a if channel_dim is None else a.reshape([-1 if d == channel_dim else 1 for d in range(nd)])

    y = outs[0]
    addends = [i for i in addends if i is not None] if beta != 0 else []
    add_keep = torch.zeros((), dtype=torch.bool)
    for i in addends:
        a = kept(ins[i])
        add_keep = add_keep | addend_view(a)

    def need_of(fwd):
        return kept(refine(y, (fwd if alpha != 0 else torch.zeros((), dtype=torch.bool)) | add_keep))

    fwd, needs = multilinear(fn, [ins[i] for i in factors], need_of)
    if alpha == 0:
        fwd = torch.zeros_like(fwd)
        needs = [torch.zeros_like(n) for n in needs]
    new_y = refine(y, fwd | add_keep)
    new_ins = list(ins)
    for i, n in zip(factors, needs):
        new_ins[i] = refine(ins[i], n)
    need = kept(new_y)
    for i in addends:
        if channel_dim is not None:
            n = need.any(dim=[d for d in range(nd) if d != channel_dim]) if nd > 1 else need
        else:
            n = any_to_shape(need, ins[i].shape)
        new_ins[i] = refine(ins[i], n)
    if beta == 0:
        for i in [j for j in range(len(ins)) if j not in factors]:
            new_ins[i] = refine(ins[i], torch.zeros((), dtype=torch.bool))
    return result(ins, outs, new_ins, [new_y, *outs[1:]])


def _role(op: Op, role: str) -> int | None:
    return op.roles.index(role) if role in op.roles else None


@rule("linear")
def linear(op: Op, ins, outs):
    x, w, b = _role(op, "input"), _role(op, "weight"), _role(op, "bias")
    if x is None or w is None:
        return None
    if _blocks_of(ins[w]) is not None and ins[w].ndim == 2 and ins[x].ndim >= 2:
        return block_linear(ins, outs, x, w, b)
    compact = _distinct_rows(ins[x], outs[0]) if ins[x].ndim >= 2 and ins[w].ndim == 2 else None
    if compact is None:
        return affine_rule(op, ins, outs, lambda a, m: F.linear(a, m), [x, w], [b])
    # rows of (x, y) with one pattern behave alike: run the rule once per distinct pattern
    xs, ys, inverse = compact
    small_ins = list(ins)
    small_ins[x] = TeSA.from_mask(xs)
    new_ins, new_outs = affine_rule(op, small_ins, [TeSA.from_mask(ys), *outs[1:]], lambda a, m: F.linear(a, m),
                                    [x, w], [b])
    new_ins[x] = refine(ins[x], kept(new_ins[x])[inverse].reshape(ins[x].shape))
    new_y = refine(outs[0], kept(new_outs[0])[inverse].reshape(outs[0].shape))
    return result(ins, outs, new_ins, [new_y, *new_outs[1:]])


def _blocks_of(wt: TeSA):
    """``wt.block_grid()``, or a kept uniform 2-D TeSA as one block; None otherwise."""
    if wt.uniform and wt.ndim == 2:
        return torch.full((1, 1), wt.uniform, dtype=torch.uint8), wt.shape
    return wt.block_grid()


def block_linear(ins, outs, x: int, w: int, b: int | None):
    """The exact linear rule for a weight held by blocks (``TeSA.from_blocks``; a kept uniform weight is one block),
    on its blocks: the forward and the input's need reduce the activations over a block's columns or rows; the
    weight keeps its block form unless some kept block is needed only in part (then it is refined by elements)."""
    wt, (grid, (bh, bw)) = ins[w], _blocks_of(ins[w])
    n, k = wt.shape
    g = (grid != 0).to(torch.float32)                                   # (N/bh, K/bw)
    xs = kept(ins[x]).reshape(-1, k)
    add = kept(ins[b]) if b is not None else torch.zeros((), dtype=torch.bool)
    fwd = (xs.reshape(-1, k // bw, bw).any(-1).to(torch.float32) @ g.T > 0).repeat_interleave(bh, -1)
    y = outs[0]
    new_y = refine(y, (fwd | add).reshape(y.shape))
    need = kept(new_y).reshape(-1, n)
    need_x = (need.reshape(-1, n // bh, bh).any(-1).to(torch.float32) @ g > 0).repeat_interleave(bw, -1)
    new_ins = list(ins)
    new_ins[x] = refine(ins[x], need_x.reshape(ins[x].shape))
    new_ins[w] = _refine_blocks(wt, need, xs)
    if b is not None:
        new_ins[b] = refine(ins[b], any_to_shape(need, ins[b].shape))
    return result(ins, outs, new_ins, [new_y, *outs[1:]])


def _refine_blocks(wt: TeSA, need: torch.Tensor, xs: torch.Tensor) -> TeSA:
    """``wt`` refined by ``W[n, k]`` needed iff some row needs output ``n`` and keeps input ``k``, over the distinct
    column patterns of ``need`` and ``xs`` (few: a dense activation has one)."""
    grid, (bh, bw) = _blocks_of(wt)
    cn, inv_n = torch.unique(need.T, dim=0, return_inverse=True)        # output columns' patterns over rows
    ck, inv_k = torch.unique(xs.T, dim=0, return_inverse=True)
    ok = (cn.to(torch.float32) @ ck.T.to(torch.float32)) > 0           # pattern pairs meeting on some row
    pn = torch.zeros(len(inv_n), len(cn)).index_put_((torch.arange(len(inv_n)), inv_n), torch.tensor(1.0))
    pk = torch.zeros(len(inv_k), len(ck)).index_put_((torch.arange(len(inv_k)), inv_k), torch.tensor(1.0))
    pn = pn.reshape(-1, bh, len(cn)).amax(1)                            # the patterns in each block row / column
    pk = pk.reshape(-1, bw, len(ck)).amax(1)
    some_unneeded = (pn @ (~ok).to(torch.float32) @ pk.T) > 0
    if not bool((some_unneeded & (grid != 0)).any()):
        return wt
    some_needed = (pn @ ok.to(torch.float32) @ pk.T) > 0
    if not bool((some_unneeded & some_needed & (grid != 0)).any()):     # whole blocks unneeded: still by blocks
        return wt.map_bits(lambda bits: torch.where(some_needed, bits, 0))
    return refine(wt, ok[inv_n][:, inv_k])


def _distinct_rows(x: TeSA, y: TeSA):
    """(distinct x rows, matching y rows, row → pattern index) when that shrinks the work by ≥ 2×.

    Activations usually repeat few row patterns (all kept, or whole tokens pruned), so
    the boolean product over distinct patterns is exact and far smaller than over rows.
    """
    k, n = x.shape[-1], y.shape[-1]
    rows = x.numel() // max(k, 1)
    if rows < 4 or y.numel() // max(n, 1) != rows:
        return None
    key = torch.cat([kept(x).reshape(rows, k), kept(y).reshape(rows, n)], 1)
    if bool((key == key[0]).all()):
        uniq, inverse = key[:1], torch.zeros(rows, dtype=torch.long)
    else:
        _, inverse = torch.unique(_pack_bits(key), dim=0, return_inverse=True)
        uniq = torch.zeros(int(inverse.max()) + 1, key.shape[1], dtype=torch.bool)
        uniq[inverse] = key
    if uniq.shape[0] * 2 > rows:
        return None
    return uniq[:, :k], uniq[:, k:], inverse


def _pack_bits(key: torch.Tensor) -> torch.Tensor:
    """Bool rows packed 62 bits per int64 (exact), so sorting rows is cheap."""
    rows, cols = key.shape
    pad = -cols % 62
    chunks = torch.nn.functional.pad(key.to(torch.int64), (0, pad)).reshape(rows, -1, 62)
    return (chunks << torch.arange(62, dtype=torch.int64)).sum(-1)


@rule("mm", "bmm", "matmul", "mv", "dot", "vdot")
def matmul(op: Op, ins, outs):
    if len(ins) != 2:
        return None
    return affine_rule(op, ins, outs, torch.matmul, [0, 1], [])


@rule("addmm", "baddbmm", "addmv", "addbmm")
def addmm(op: Op, ins, outs):
    if len(ins) != 3 or op.op == "addbmm":
        return None
    a, b = (1, 2)
    return affine_rule(op, ins, outs, torch.matmul, [a, b], [0], alpha=op.attrs.get("alpha", 1),
                       beta=op.attrs.get("beta", 1))
