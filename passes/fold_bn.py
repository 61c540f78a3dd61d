"""Fold inference BatchNorms into the convolution before them.

``bn(conv(x, W, b))`` with running statistics is ``conv(x, W·s, (b − mean)·s + β)`` per output channel, where
``s = γ / sqrt(var + ε)``. The folded weight and bias are new constants (``<weight>_folded``, ``<bias>_folded``)
holding the masked weight's values times the scale; the weight's TeSA carries over (rows whose γ is pruned are
pruned too), and the original name stays an alias of the folded weight (``graph.tesa("conv1.weight")``). A
BatchNorm is folded only where the convolution's output is read by it alone and the convolution's weight by that
convolution alone. Propagation and planning then see one op per conv-BN pair: a pruned output channel of the conv
is the folded bias there, a constant the channel shrinking of ``passes/transform/shrink.py`` folds onward.
"""

from __future__ import annotations

import dataclasses

import torch

from ..graph import Graph, Op, TensorRef, Value, bind_call
from ..tesa import TeSA, bits_of_dtype

CONVS = ("conv1d", "conv2d", "conv3d")
NORMS = ("batch_norm",)


def _foldable(graph: Graph, bn: Op) -> Op | None:
    """The convolution ``bn`` folds into, or None."""
    if bn.attrs.get("training", False) or "input" not in bn.roles:
        return None
    if any(graph.consumers(t) or t in graph.outputs for t in bn.outputs[1:]):
        return None
    x = bn.input_of("input")
    producer = graph.producer(x)
    if producer is None or graph.consumers(x) != [bn.name] or x in graph.outputs:
        return None
    conv = graph.op(producer)
    w = conv.input_of("weight")
    if conv.op not in CONVS or w is None or conv.input_of("input") is None or len(conv.outputs) != 1:
        return None
    names = [w, conv.input_of("bias")] + [bn.input_of(r) for r in ("weight", "bias", "running_mean", "running_var")]
    for name in names:
        if name is not None and (not graph.tensor(name).has_data or graph.tensor(name).kind != "weight"):
            return None
    if graph.consumers(w) != [conv.name] or not graph.tensor(w).dtype.is_floating_point:
        return None
    if bn.input_of("running_mean") is None or bn.input_of("running_var") is None:
        return None
    return conv


def _value(graph: Graph, name: str | None, default: float, n: int) -> torch.Tensor:
    if name is None:
        return torch.full((n,), default)
    v = graph.tensor(name)
    return v.tesa.apply(v.data).to(torch.float32).reshape(-1)


def fold_batch_norms(graph: Graph) -> tuple[Graph, dict[str, str]]:
    """``graph`` with every foldable BatchNorm folded into its convolution (or ``graph`` itself if none), and
    ``{folded tensor: what it was folded from}``."""
    pairs = {}
    for bn in graph.ops(NORMS):
        conv = _foldable(graph, bn)
        if conv is not None:
            pairs[conv.name] = bn
    if not pairs:
        return graph, {}
    taken: set[str] = set()
    dropped = {bn.name for bn in pairs.values()}
    new_ops, new_values, removed, folded = {}, [], set(), {}
    for conv_name, bn in pairs.items():
        conv = graph.op(conv_name)
        w, b = conv.input_of("weight"), conv.input_of("bias")
        wv = graph.tensor(w)
        n = wv.shape[0]
        eps = float(bn.attrs.get("eps", 1e-5))
        gamma = _value(graph, bn.input_of("weight"), 1.0, n)
        beta = _value(graph, bn.input_of("bias"), 0.0, n)
        mean = _value(graph, bn.input_of("running_mean"), 0.0, n)
        var = _value(graph, bn.input_of("running_var"), 1.0, n)
        scale = gamma / torch.sqrt(var + eps)
        weight = wv.tesa.apply(wv.data).to(torch.float32) * scale.reshape(-1, *[1] * (len(wv.shape) - 1))
        bias = (_value(graph, b, 0.0, n) - mean) * scale + beta
        gamma_kept = graph.tesa(bn.input_of("weight")).mask.reshape(-1) if bn.input_of("weight") else None
        wtesa = wv.tesa
        if gamma_kept is not None and not bool(gamma_kept.all()):
            rows = gamma_kept.reshape(-1, *[1] * (len(wv.shape) - 1)).expand(wv.shape)
            wtesa = wtesa.meet(TeSA.from_mask(rows, max(wtesa.max_bits(), 1)))
        wname = graph.unused_name(f"{w}_folded", taken)
        bname = graph.unused_name(f"{b}_folded" if b else f"{w.rsplit('.', 1)[0]}.bias_folded" if "." in w
                                  else f"{w}_bias_folded", taken)
        bias_dtype = graph.tensor(b).dtype if b else wv.dtype
        new_values += [Value(wname, wv.shape, wv.dtype, "weight", wtesa, weight.to(wv.dtype)),
                       Value(bname, (n,), bias_dtype, "weight", TeSA.dense((n,), bits_of_dtype(bias_dtype)),
                             bias.to(bias_dtype))]
        folded[wname] = f"{w} with {bn.name}"
        folded[bname] = f"{b or 'no bias'} with {bn.name}"
        removed |= {w, conv.outputs[0], *bn.outputs[1:]} | ({b} if b and graph.consumers(b) == [conv.name] else set())
        removed |= {t for t in bn.inputs[1:] if all(c == bn.name for c in graph.consumers(t))}
        args = list(conv.args) + [None] * max(0, 3 - len(conv.args))
        args[0], args[1], args[2] = TensorRef(conv.input_of("input")), TensorRef(wname), TensorRef(bname)
        kwargs = {k: v for k, v in conv.kwargs.items() if k not in ("input", "weight", "bias")}
        inputs, roles, attrs = bind_call(conv.target, tuple(args), kwargs)
        new_ops[conv_name] = Op(conv.name, conv.op, inputs, [bn.outputs[0]], attrs, roles, conv.target, tuple(args),
                                kwargs, conv.source or bn.source)
    out = Graph(graph.name)
    for v in graph.tensors():
        if v.name not in removed:
            out.add_tensor(v.copy())
    for v in new_values:
        out.add_tensor(v)
    for op in graph.ops():
        if op.name in dropped:
            continue
        op = new_ops.get(op.name, op)
        out.add_op(dataclasses.replace(op, inputs=list(op.inputs), outputs=list(op.outputs), attrs=dict(op.attrs),
                                       roles=list(op.roles), meta=dict(op.meta)))
    out.inputs, out.outputs = list(graph.inputs), list(graph.outputs)
    graph.copy_facts(out)
    renamed = {graph.op(c).input_of("weight"): new_ops[c].input_of("weight") for c in pairs}
    aliases = {name: {**a, "tensor": renamed.get(a["tensor"], a["tensor"])}       # (a copy: copy_facts shares it)
               for name, a in out.meta.get("aliases", {}).items()}
    out.meta["aliases"] = aliases
    for w, folded_w in renamed.items():       # the conv's own weight name reads the folded weight's TeSA
        if not out.has_tensor(w) and w not in aliases:
            out.add_alias(w, folded_w)
    return out, folded


__all__ = ["fold_batch_norms"]
