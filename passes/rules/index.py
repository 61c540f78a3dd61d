"""Rules for lookups: ``embedding(weight, indices)``.

The indices are data, unknown at compile time, so any row may be read: an output
feature ``j`` is pruned iff column ``j`` of the table is pruned everywhere. Backward, a
column of the table is needed iff that feature is needed at any position, and an index
iff any feature at its position is needed. ``gather``/``index_select`` with data-dependent
indices fall back to scrambling.
"""

from __future__ import annotations

from ...graph import Op
from ...tesa import TeSA
from .common import kept, refine, result
from .registry import rule


@rule("embedding")
def embedding(op: Op, ins: list[TeSA], outs: list[TeSA]):
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
