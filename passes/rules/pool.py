"""Rules for pooling: max/avg pools (1d, 2d), adaptive avg/max pools.

Forward, a window whose inputs are all pruned yields zero (max of zeros, mean of zeros),
so an output is pruned iff its whole window is: computed by running the pool on the kept
mask. Backward, an input is needed iff a window holding it has a needed output: computed
through autograd of the matching *average* pool (its coefficients are positive on exactly
the window), with the same kernel, stride, padding and ceil mode. A dilated max pool
falls back to "needed if any output of its channel is needed". ``max_pool2d`` also
returns indices (core ATen): those are left as they are. Bits are not changed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...graph import Op
from ...tesa import TeSA
from .common import fkept, kept, refine, result
from .registry import rule


def _pair(v, n):
    v = list(v) if isinstance(v, (list, tuple)) else [v]
    return v * n if len(v) == 1 else v


def _window_fn(op: Op, nd: int):
    """A positive-coefficient function with the pool's windows, or None."""
    a = op.attrs
    if op.op.startswith("adaptive"):
        size = a.get("output_size")
        return lambda m: (F.adaptive_avg_pool1d if nd == 1 else F.adaptive_avg_pool2d)(m, size)
    k = _pair(a.get("kernel_size"), nd)
    stride = _pair(a.get("stride") or k, nd)
    pad = _pair(a.get("padding", 0), nd)
    if any(d != 1 for d in _pair(a.get("dilation", 1), nd)):
        return None
    ceil = bool(a.get("ceil_mode", False))
    pool = F.avg_pool1d if nd == 1 else F.avg_pool2d
    return lambda m: pool(m, k, stride, pad, ceil, True)


@rule("max_pool1d", "max_pool2d", "avg_pool1d", "avg_pool2d", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
      "adaptive_max_pool1d", "adaptive_max_pool2d")
def pool(op: Op, ins: list[TeSA], outs: list[TeSA]):
    if len(ins) != 1 or not outs:
        return None
    x, y = ins[0], outs[0]
    nd = 1 if op.op.endswith("1d") else 2
    fn = _window_fn(op, nd)
    if fn is None:  # dilated max pool: forward by the op itself, backward per channel
        fwd = op.call({op.inputs[0]: fkept(x)})[0] > 0
        new_y = refine(y, fwd)
        spatial = list(range(x.ndim - nd, x.ndim))
        need = kept(new_y) | (kept(outs[1]) if len(outs) > 1 and outs[1].shape == y.shape else False)
        need = need.any(dim=spatial, keepdim=True).expand(x.shape)
        return result(ins, outs, [refine(x, need)], [new_y, *outs[1:]])
    m = fkept(x).requires_grad_(True)
    with torch.enable_grad():
        w = fn(m)
        if tuple(w.shape) != y.shape:
            return None
        new_y = refine(y, w.detach() > 0)
        need = kept(new_y)
        if len(outs) > 1 and outs[1].shape == y.shape:  # max pools' indices read the whole window
            need = need | kept(outs[1])
        (g,) = torch.autograd.grad(w, m, need.to(w.dtype))
    return result(ins, outs, [refine(x, g > 0)], [new_y, *outs[1:]])
