"""Rules for data-movement ops: every output element is a copy of one input element (or 0).

One exact rule serves them all: the op is run on integer *element ids* in place of its
tensor inputs, which tells, for each output element, which input element it copies
(id 0: a constant zero, e.g. ``constant_pad_nd`` with value 0 or ``tril``).

* forward: an output element takes the TeSA value (pruned or bits) of its source.
* backward: an input element is needed at the most bits any copy of it is needed with;
  an element no output copies (sliced away, ``view_as``'s shape-only input) is irrelevant.

So pruning and bits are carried along both ways through view/reshape/permute/transpose/
expand/slice/select/cat/split/chunk/flatten/unflatten/squeeze/unsqueeze/repeat/flip/roll
and friends. ``getitem`` needs no rule: it names one output of a multi-output op.
"""

from __future__ import annotations

import torch

from ...graph import Op
from ...tesa import TeSA
from .common import refine, result
from .registry import rule

MOVEMENT = ("view", "_unsafe_view", "reshape", "permute", "transpose", "t", "expand", "expand_as", "view_as",
            "reshape_as", "slice", "select", "unsqueeze", "squeeze", "flatten", "unflatten", "cat", "concat",
            "stack", "split", "split_with_sizes", "chunk", "unbind", "narrow", "repeat", "flip", "roll", "movedim",
            "diagonal", "tril", "triu", "as_strided", "slice_scatter", "select_scatter", "alias_copy",
            "view_copy", "permute_copy", "transpose_copy", "expand_copy", "unsqueeze_copy", "squeeze_copy",
            "tile", "hstack", "vstack", "swapaxes", "pixel_shuffle", "pixel_unshuffle", "channel_shuffle")


def trace_sources(op: Op, shapes: list[tuple[int, ...]]) -> list[torch.Tensor] | None:
    """Per output, the flat id (1-based over all inputs; 0 = constant zero) it copies."""
    env, offset = {}, 1
    for name, shape in zip(op.inputs, shapes):
        if name in env:
            continue
        n = 1
        for s in shape:
            n *= s
        env[name] = torch.arange(offset, offset + n, dtype=torch.int64).reshape(shape)
        offset += n
    try:
        outs = op.call(env)
    except Exception:  # noqa: BLE001 - not traceable on integers: no rule
        return None
    if not all(isinstance(o, torch.Tensor) and o.dtype == torch.int64 for o in outs):
        return None
    return [o.contiguous() for o in outs]


def _flat_bits(op: Op, ins: list[TeSA]) -> torch.Tensor:
    seen, parts = set(), [torch.zeros(1, dtype=torch.uint8)]
    for name, t in zip(op.inputs, ins):
        if name not in seen:
            seen.add(name)
            parts.append(t.view().reshape(-1))
    return torch.cat(parts)


@rule(*MOVEMENT)
def movement(op: Op, ins: list[TeSA], outs: list[TeSA]):
    if not ins:
        return None
    if op.op in ("constant_pad_nd",) and op.attrs.get("value", 0) != 0:
        return None
    sources = trace_sources(op, [t.shape for t in ins])
    if sources is None or len(sources) != len(outs):
        return None
    flat = _flat_bits(op, ins)
    new_outs = [refine(y, bits=flat[src]) for y, src in zip(outs, sources)]
    need = torch.zeros_like(flat)
    for y, src in zip(new_outs, sources):
        need.scatter_reduce_(0, src.reshape(-1), y.view().reshape(-1).contiguous(), "amax")
    new_ins, offset, offsets = [], 1, {}
    for name, t in zip(op.inputs, ins):
        if name not in offsets:
            offsets[name] = offset
            offset += t.numel()
        start = offsets[name]
        new_ins.append(refine(t, bits=need[start:start + t.numel()].reshape(t.shape)))
    return result(ins, outs, new_ins, new_outs)


rule("constant_pad_nd")(movement)
