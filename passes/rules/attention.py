"""Rule for ``scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale)``.

``out[i] = Σ_j softmax_j(q[i]·k[j] + mask[i, j]) · v[j]``. Softmax weights are never
zero except where the causal pattern or a *boolean* mask forbids (a pruned boolean mask
element is False). So, with ``allowed[i, j]`` that pattern:

* forward: ``out[i, d]`` is pruned iff ``v[j, d]`` is pruned for every allowed ``j``.
* backward: ``v[j, d]`` is needed iff some allowed ``i`` needs ``out[i, d]``; ``q[i, e]`` iff
  row ``i`` has a needed output and some allowed ``k[j, e]`` is kept; ``k[j, e]`` iff some
  allowed ``i`` with a needed row has ``q[i, e]`` kept; ``mask[i, j]`` iff row ``i`` is needed.

Batch/head dims broadcast; grouped-query attention (``enable_gqa``) has no rule.
"""

from __future__ import annotations

import torch

from ...graph import Op
from ...tesa import TeSA
from .common import any_to_shape, kept, refine, result
from .registry import rule


def _bmm_any(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a.float(), b.float()) > 0


@rule("scaled_dot_product_attention")
def sdpa(op: Op, ins: list[TeSA], outs: list[TeSA]):
    roles = op.roles
    if not all(r in roles for r in ("query", "key", "value")) or op.attrs.get("enable_gqa", False):
        return None
    qi, ki, vi = roles.index("query"), roles.index("key"), roles.index("value")
    mi = roles.index("attn_mask") if "attn_mask" in roles else None
    q, k, v, y = kept(ins[qi]), kept(ins[ki]), kept(ins[vi]), outs[0]
    if q.shape[:-2] != k.shape[:-2] or k.shape[:-2] != v.shape[:-2]:
        return None
    L, S = q.shape[-2], k.shape[-2]
    allowed = torch.ones(L, S, dtype=torch.bool)
    if op.attrs.get("is_causal", False):
        allowed = torch.ones(L, S, dtype=torch.bool).tril()
    if mi is not None and op.meta.get("in_dtypes", [None] * len(ins))[mi] == torch.bool:
        allowed = allowed & kept(ins[mi])
    allowed = allowed.expand(*q.shape[:-2], L, S) if allowed.dim() == 2 else allowed.expand(*q.shape[:-2], L, S)
    new_y = refine(y, _bmm_any(allowed, v))
    need = kept(new_y)
    row = need.any(-1, keepdim=True)  # (.., L, 1)
    new_ins = list(ins)
    new_ins[vi] = refine(ins[vi], _bmm_any(allowed.transpose(-1, -2), need))
    new_ins[qi] = refine(ins[qi], row & _bmm_any(allowed, k))
    new_ins[ki] = refine(ins[ki], _bmm_any((allowed & row).transpose(-1, -2), q))
    if mi is not None:
        new_ins[mi] = refine(ins[mi], any_to_shape(row.expand(allowed.shape) & allowed, ins[mi].shape))
    return result(ins, outs, new_ins, [new_y, *outs[1:]])
