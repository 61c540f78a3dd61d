"""Graph simplification before propagation: drop attention masks that mask nothing, and copies.

Exported transformers often build their attention mask from constants only (``arange >= 0``
expanded to ``(B, 1, L, L)``) when no padding mask is given. A mask is an input of
``scaled_dot_product_attention`` that keeps the GPU from its fused (flash / memory-
efficient) kernels — with a stride-0 boolean mask torch falls back to the fp32 math path,
which measured 2.7 ms of a 5.4 ms BERT-base forward on an H100. ``drop_trivial_masks``
evaluates every mask that depends on no graph input, and where it keeps everything (bool
all True, or a float mask of zeros) rewrites the attention op without it; the ops that
only fed the mask are removed. A mask computed from a dynamic size is a different mask at every
length (a sliding window keeps everything below its width): one evaluation proves nothing, so it
stays, and the runtime decides it per shape (``templates/attention/runtime.py``).

``drop_copies`` removes value-preserving copies (``clone`` — what an exported eval-mode dropout
becomes —, ``alias``, ``detach``) whose input and output carry the same TeSA: their readers read the
input instead. On the GPU each was a pass over its tensor, and a
copy between a LayerNorm and the W8A8 linears it feeds hid the linears from the LayerNorm kernel
that hands them their int8 codes.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
from torch.utils import _pytree as pytree


from ..graph import Graph, Op, SymRef, TensorRef, bind_call
from ..tesa import TeSA

ATTENTION = ("scaled_dot_product_attention",)
COPIES = ("clone", "alias", "detach")


def _constant_value(graph: Graph, name: str, cache: dict):
    """The value of tensor ``name`` if it depends on weights/constants only, else None."""
    if name in cache:
        return cache[name]
    v = graph.tensor(name)
    value = None
    if v.kind == "weight":
        value = v.data
    elif v.kind == "activation" and (producer := graph.producer(name)) is not None:
        op = graph.op(producer)
        env = {t: _constant_value(graph, t, cache) for t in op.inputs}
        if all(x is not None for x in env.values()) and op.target is not None:
            with torch.no_grad():
                outs = op.call(env)
            value = outs[op.outputs.index(name)]
    cache[name] = value
    return value


def _masks_nothing(mask: torch.Tensor) -> bool:
    if mask.dtype == torch.bool:
        return bool(mask.all())
    return mask.is_floating_point() and not bool(mask.any())


def _follows_sizes(graph: Graph, name: str) -> bool:
    """Whether the computation of tensor ``name`` reads a symbolic size (an op argument following a dynamic
    dimension)."""
    ops, _ = graph.upstream(name)
    return any(isinstance(leaf, SymRef) for op in ops for leaf in pytree.tree_leaves((op.args, op.kwargs)))


def drop_trivial_masks(graph: Graph) -> Graph:
    """A copy of ``graph`` with all-keeping attention masks removed (or ``graph`` itself if none)."""
    cache, rewrites = {}, {}
    for op in graph.ops(ATTENTION):
        mask_name = op.input_of("attn_mask")
        if mask_name is None:
            continue
        if _follows_sizes(graph, mask_name):
            continue
        mask = _constant_value(graph, mask_name, cache)
        if mask is not None and _masks_nothing(mask):
            rewrites[op.name] = mask_name
    if not rewrites:
        return graph
    return _rebuild(graph, rewrites)


def drop_copies(graph: Graph) -> Graph:
    """A copy of ``graph`` whose readers of a plain copy read its input (or ``graph`` itself if none)."""
    renames = {}
    for op in graph.ops(COPIES):
        if len(op.inputs) != 1 or op.attrs.get("memory_format") not in (None, torch.preserve_format):
            continue
        src, out = op.inputs[0], op.outputs[0]
        a, b = graph.tensor(src), graph.tensor(out)
        if out in graph.outputs or (a.shape, a.dtype) != (b.shape, b.dtype) or not a.tesa == b.tesa:
            continue
        renames[out] = renames.get(src, src)
    if not renames:
        return graph
    return _rebuild(graph, {}, renames, {"dropped_copies": sorted(renames)})


def _rebuild(graph: Graph, rewrites: dict[str, str], renames: dict[str, str] | None = None,
             note: dict | None = None) -> Graph:
    """``graph`` with the masks ``rewrites`` names dropped from their ops, tensors read under ``renames``
    (copy output -> its source), and every op nothing reads removed."""
    renames = renames or {}

    def drop(template, mask):
        return pytree.tree_map_only(TensorRef, lambda r: None if r.name == mask else r, template)

    def rename(template):
        return pytree.tree_map_only(TensorRef, lambda r: TensorRef(renames[r.name]) if r.name in renames else r,
                                    template)

    ops = []
    for op in graph.ops():
        if op.name in rewrites or (renames and any(t in renames for t in op.inputs)):
            args, kwargs = rename(op.args), rename(op.kwargs)
            if op.name in rewrites:
                args, kwargs = drop(args, rewrites[op.name]), drop(kwargs, rewrites[op.name])
            inputs, roles, attrs = bind_call(op.target, args, kwargs)
            op = Op(op.name, op.op, inputs, list(op.outputs), attrs, roles, op.target, args, kwargs, op.source,
                    op.multi_output)
        ops.append(op)
    live = set(graph.outputs)                          # dead-code elimination, last op first
    kept = []
    for op in reversed(ops):
        if any(t in live for t in op.outputs):
            kept.append(op)
            live |= set(op.inputs)
    live |= {t for op in kept for t in op.outputs} | set(graph.inputs)
    out = Graph(graph.name)
    for v in graph.tensors():
        if v.name in live:
            out.add_tensor(v.copy())
    for op in reversed(kept):
        out.add_op(Op(op.name, op.op, list(op.inputs), list(op.outputs), dict(op.attrs), list(op.roles), op.target,
                      op.args, dict(op.kwargs), op.source, op.multi_output))
    out.inputs, out.outputs = list(graph.inputs), list(graph.outputs)
    graph.copy_facts(out)
    out.simplified = dataclasses.replace(graph.simplified, **(note or {"dropped_masks": sorted(rewrites)}))
    return out


def fuse_sibling_linears(graph: Graph) -> Graph:
    """A copy of ``graph`` where linears reading one input (attention's q/k/v, a gated MLP's gate/up) run as one linear
    over their weights stacked along N, each former output a slice of its output (or ``graph`` itself if none).

    Each linear's weight (and bias, if all have one) must be a constant only it reads, of one dtype and K; the stacked
    weight's TeSA stacks theirs and its value is theirs, concatenated only when read (``graph.StackedValue``). One kernel launch instead of several: on a GPU each costs a few µs of latency at
    decode and prefill sizes, and a wider N fills the SMs better."""
    groups: dict[str, list[Op]] = {}
    for op in graph.ops("linear"):
        x, w, b = op.input_of("input"), op.input_of("weight"), op.input_of("bias")
        wv = graph.tensor(w) if w is not None else None
        if x is None or wv is None or not wv.has_data or len(wv.shape) != 2 or graph.consumers(w) != [op.name] \
                or (b is not None and (not graph.tensor(b).has_data or graph.consumers(b) != [op.name])) \
                or op.outputs[0] in graph.outputs:
            continue
        groups.setdefault(x, []).append(op)
    fused = {}
    for x, ops in groups.items():
        ws = [graph.tensor(o.input_of("weight")) for o in ops]
        same = {(w.dtype, w.shape[1], o.input_of("bias") is None) for w, o in zip(ws, ops)}
        if len(ops) > 1 and len(same) == 1:
            fused[ops[0].name] = ops
    if not fused:
        return graph
    members = {o.name for ops in fused.values() for o in ops}
    stacked = {t for ops in fused.values() for o in ops for t in (o.input_of("weight"), o.input_of("bias")) if t}
    out = Graph(graph.name)
    for v in graph.tensors():
        if v.name not in stacked:
            out.add_tensor(v.copy())
    ranges = {}                 # each stacked weight or bias: [[its part, first row, end row], ...]
    for op in graph.ops():
        if op.name in fused:
            for new in _stacked_linear(graph, out, fused[op.name], ranges):
                out.add_op(new)
        elif op.name not in members:
            out.add_op(Op(op.name, op.op, list(op.inputs), list(op.outputs), dict(op.attrs), list(op.roles),
                          op.target, op.args, dict(op.kwargs), op.source, op.multi_output))
    out.inputs, out.outputs = list(graph.inputs), list(graph.outputs)
    graph.copy_facts(out)
    out.simplified = dataclasses.replace(graph.simplified, stacked_linears={
        **graph.simplified.stacked_linears, **{ops[0].name: [o.name for o in ops] for ops in fused.values()}})
    out.stacked_weights = {**graph.stacked_weights, **ranges}
    return out


def _stacked_tesa(tesas: list) -> TeSA:
    """The TeSAs of weights (or biases) stacked along their first dim: by blocks where every part is held by blocks
    of one shape (or is uniform and a whole number of them), else by elements; uniform where all parts are alike."""
    if len({t.uniform for t in tesas}) == 1 and tesas[0].uniform is not None:
        return TeSA.dense((sum(t.shape[0] for t in tesas), *tesas[0].shape[1:]), tesas[0].uniform)
    grids = [t.block_grid() for t in tesas]
    block = next((g[1] for g in grids if g is not None), None)
    if block is not None and all(t.ndim == 2 and t.shape[0] % block[0] == 0 and t.shape[1] % block[1] == 0
                                 and (g is None and t.uniform is not None or g is not None and g[1] == block)
                                 for t, g in zip(tesas, grids)):
        parts = [g[0] if g is not None else torch.full((t.shape[0] // block[0], t.shape[1] // block[1]), t.uniform,
                                                         dtype=torch.uint8) for t, g in zip(tesas, grids)]
        return TeSA(torch.cat(parts), _trusted=True, _block=block)
    return TeSA(torch.cat([t.view() for t in tesas]), _trusted=True)


def _stacked_name(names: list[str]) -> str:
    """``a.q_proj.weight`` + ``a.k_proj.weight`` -> ``a.q_proj+k_proj.weight``."""
    parts = [n.split(".") for n in names]
    head = 0
    while all(len(p) > head + 1 and p[head] == parts[0][head] for p in parts):
        head += 1
    tail = 0
    while all(len(p) > head + tail + 1 and p[-1 - tail] == parts[0][-1 - tail] for p in parts):
        tail += 1
    mids = ["_".join(p[head:len(p) - tail]) for p in parts]
    return ".".join(parts[0][:head] + ["+".join(mids)] + (parts[0][len(parts[0]) - tail:] if tail else []))


def _stacked_linear(graph: Graph, out: Graph, ops: list[Op], ranges: dict) -> list[Op]:
    """The stacked linear of ``ops`` (its weight, bias and output added to ``out``, the parts' rows of each to
    ``ranges``) and one slice per former output."""
    from ..graph import Value
    from ..stacked_value import StackedValue
    from ..tesa import TeSA, bits_of_dtype
    first = ops[0]
    x = first.input_of("input")
    values = {}
    for role in ("weight", "bias"):
        names = [o.input_of(role) for o in ops]
        if names[0] is None:
            continue
        vs = [graph.tensor(n) for n in names]
        tesa = _stacked_tesa([v.tesa for v in vs])      # the value: the parts', concatenated when read
        values[role] = out.add_tensor(StackedValue(_stacked_name(names), tesa, [v.data for v in vs])).name
        ends = itertools.accumulate(v.shape[0] for v in vs)
        ranges[values[role]] = [[n, end - v.shape[0], end] for n, v, end in zip(names, vs, ends)]
    y0 = graph.tensor(first.outputs[0])
    n = sum(graph.tensor(o.outputs[0]).shape[-1] for o in ops)
    y = out.add_tensor(Value(f"{first.outputs[0]}_stacked", (*y0.shape[:-1], n), y0.dtype, "activation",
                             TeSA.dense((*y0.shape[:-1], n), bits_of_dtype(y0.dtype)))).name
    args = (TensorRef(x), TensorRef(values["weight"])) + ((TensorRef(values["bias"]),) if "bias" in values else ())
    target = torch.ops.aten.linear.default
    inputs, roles, attrs = bind_call(target, args, {})
    new = [Op(first.name, "linear", inputs, [y], attrs, roles, target, args, {}, first.source)]
    start, dim = 0, len(y0.shape) - 1
    for o in ops:
        width = graph.tensor(o.outputs[0]).shape[-1]
        args = (TensorRef(y), dim, start, start + width)
        inputs, roles, attrs = bind_call(torch.ops.aten.slice.Tensor, args, {})
        new.append(Op(f"{o.name}_part", "slice", inputs, list(o.outputs), attrs, roles, torch.ops.aten.slice.Tensor,
                      args, {}, o.source))
        start += width
    return new


SIMPLIFICATIONS = (drop_trivial_masks, drop_copies)


def simplify(graph: Graph) -> Graph:
    """Run every simplification in order."""
    for fn in SIMPLIFICATIONS:
        graph = fn(graph)
    return graph


__all__ = ["simplify", "drop_trivial_masks", "drop_copies", "fuse_sibling_linears", "SIMPLIFICATIONS"]
