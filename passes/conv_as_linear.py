"""1×1 convolutions as linears over channels, so a CUDA plan runs them on the block-sparse linear kernels.

A 1×1 convolution with ``groups=1`` and no padding is a GEMM over channels: on a channels-last activation,
``conv(x, W, b)`` is ``linear(x.permute(0, 2, 3, 1)[:, ::sh, ::sw], W.reshape(Cout, Cin), b).permute(0, 3, 1, 2)``.
The rewrite puts exactly that in the graph before propagation: a permute (and, for a stride, one slice per spatial
dim) of the convolution's own, the linear under the convolution's name over the weight as a
``(Cout, Cin)`` matrix (``<weight>_matrix``, its TeSA the convolution weight's, reshaped), and a permute back to
the convolution's output. Where the convolution's output is read by one activation the CUDA epilogue computes
(ReLU, GELU), the activation moves before the permute back, so the kernel applies it. The permutes are views of a
channels-last tensor: Inductor fuses what is left of them. (Two convolutions reading one input keep a permute each:
sibling stacking, ``fuse_sibling_linears``, would otherwise stack their matrices, which the weights' names alias.)

Only weights that are pruned *inside* channels (or stored at fewer bits than the model's) are rewritten: a weight
pruned by whole rows and columns alone is left to channel shrinking (``passes/transform/shrink.py``), which runs it
as a narrower dense convolution, and a dense weight stays a convolution for the vendor's kernel. The matrix is a
constant computed from a weight (``ctx.folded``, then ``Plan.derived``); the convolution's weight name stays an
alias of it, so ``graph.tesa("conv.weight")`` reads the matrix's TeSA.
"""

from __future__ import annotations

import sys

import torch

from ..graph import Graph, Op, TensorRef, Value, bind_call
from ..tesa import TeSA, bits_of_dtype
from .fusion import EPILOGUE_ACTIVATIONS, activation_name

TO_NHWC, TO_NCHW = [0, 2, 3, 1], [0, 3, 1, 2]


def _ints(v, n=2) -> tuple[int, ...]:
    return tuple(int(x) for x in v) if isinstance(v, (list, tuple)) else (int(v),) * n


def pruned_inside_channels(tesa: TeSA, model_bits: int) -> bool:
    """Whether a (Cout, Cin, ...) weight TeSA prunes elements that whole rows and columns do not cover, or keeps
    some at fewer bits than ``model_bits``: what channel shrinking alone cannot run."""
    if tesa.is_dense and tesa.uniform is not None:
        return tesa.uniform < model_bits
    bits = tesa.view().reshape(tesa.shape[0], tesa.shape[1], -1)
    if bool((bits[bits != 0] < model_bits).any()):
        return True
    kept = bits.amax(-1) != 0
    rows, cols = kept.any(1), kept.any(0)
    whole = rows[:, None] & cols[None, :]
    return not bool((kept == whole).all()) or not bool((bits != 0).all(-1)[whole].all())


def one_by_one(graph: Graph, op: Op) -> bool:
    """Whether ``op`` is a 1×1, ungrouped, unpadded conv2d over a 4-D activation and a weight only it reads."""
    if op.op != "conv2d" or len(op.outputs) != 1:
        return False
    x, w = op.input_of("input"), op.input_of("weight")
    if x is None or w is None or len(graph.tensor(x).shape) != 4:
        return False
    wv = graph.tensor(w)
    a = op.attrs
    if any(isinstance(a.get(k), str) for k in ("stride", "padding", "dilation")):   # padding="same" / "valid"
        return False
    return (wv.kind == "weight" and wv.has_data and wv.dtype.is_floating_point and len(wv.shape) == 4
            and tuple(wv.shape[2:]) == (1, 1) and int(a.get("groups", 1)) == 1
            and _ints(a.get("padding", 0)) == (0, 0) and graph.consumers(w) == [op.name]
            and (op.input_of("bias") is None or graph.tensor(op.input_of("bias")).has_data))


def candidates(graph: Graph) -> list[Op]:
    """The convolutions :func:`convs_as_linears` rewrites."""
    return [op for op in graph.ops("conv2d") if one_by_one(graph, op)
            and pruned_inside_channels(graph.tensor(op.input_of("weight")).tesa,
                                       bits_of_dtype(graph.tensor(op.input_of("weight")).dtype))]


def _permuted(tesa: TeSA, perm: list[int]) -> TeSA:
    shape = tuple(tesa.shape[p] for p in perm)
    if tesa.uniform is not None:
        return TeSA.dense(shape, tesa.uniform)
    return TeSA(tesa.view().permute(perm).contiguous(), _trusted=True)


def _op(name: str, kind: str, target, args: tuple, outputs: list[str], source: str) -> Op:
    inputs, roles, attrs = bind_call(target, args, {})
    return Op(name, kind, inputs, outputs, attrs, roles, target, args, {}, source)


class _Rewrite:
    """The ops and tensors replacing the candidates, built into ``out``."""

    def __init__(self, graph: Graph, out: Graph):
        self.graph, self.out, self.taken = graph, out, set()
        self.derived: dict[str, str] = {}         # matrix -> what it was computed from
        self.matrices: dict[str, str] = {}        # convolution weight -> its matrix

    def tensor(self, base: str, shape, like: Value, tesa: TeSA) -> str:
        name = self.graph.unused_name(base, self.taken)
        self.out.add_tensor(Value(name, tuple(shape), like.dtype, "activation", tesa))
        return name

    def channels_last(self, x: str, stride: tuple[int, int], source: str) -> str:
        """``x`` permuted to (N, H, W, C), then subsampled by ``stride`` (one slice per strided dim)."""
        v = self.graph.tensor(x)
        n, c, h, w = v.shape
        t = self.tensor(f"{x}_nhwc", (n, h, w, c), v, _permuted(v.tesa, TO_NHWC))
        self.out.add_op(_op(t, "permute", torch.ops.aten.permute.default, (TensorRef(x), TO_NHWC), [t], source))
        for dim, s in zip((1, 2), stride):
            if s == 1:
                continue
            tv = self.out.tensor(t)
            shape = list(tv.shape)
            shape[dim] = -(-shape[dim] // s)
            every = tuple(slice(None, None, s) if d == dim else slice(None) for d in range(4))
            tesa = TeSA.dense(shape, tv.tesa.uniform) if tv.tesa.uniform is not None else \
                TeSA(tv.tesa.view()[every].contiguous(), _trusted=True)
            sub = self.tensor(f"{t}_{'hw'[dim - 1]}{s}", shape, tv, tesa)
            self.out.add_op(_op(sub, "slice", torch.ops.aten.slice.Tensor, (TensorRef(t), dim, 0, sys.maxsize, s),
                                [sub], source))
            t = sub
        return t

    def convolution(self, conv: Op) -> set[str]:
        """Rewrite ``conv`` (and the activation it hands its output to); returns the op names it replaced."""
        g = self.graph
        x, w, b = conv.input_of("input"), conv.input_of("weight"), conv.input_of("bias")
        wv, yv = g.tensor(w), g.tensor(conv.outputs[0])
        cout, cin = wv.shape[:2]
        matrix = g.unused_name(f"{w}_matrix", self.taken)
        self.out.add_tensor(Value(matrix, (cout, cin), wv.dtype, "weight",
                                  TeSA(wv.tesa.view().reshape(cout, cin), _trusted=True),
                                  wv.data.reshape(cout, cin).contiguous()))
        self.matrices[w] = matrix
        self.derived[matrix] = f"{w} as a ({cout}, {cin}) matrix (a 1x1 convolution run as a linear)"
        xh = self.channels_last(x, _ints(conv.attrs.get("stride", 1)), conv.source)
        n, c, h, wd = yv.shape
        y = self.tensor(f"{conv.outputs[0]}_nhwc", (n, h, wd, c), yv, _permuted(yv.tesa, TO_NHWC))
        args = (TensorRef(xh), TensorRef(matrix)) + ((TensorRef(b),) if b is not None else ())
        self.out.add_op(_op(conv.name, "linear", torch.ops.aten.linear.default, args, [y], conv.source))
        replaced, last = {conv.name}, conv.outputs[0]
        act = _moved_activation(g, conv)
        if act is not None:
            av = g.tensor(act.outputs[0])
            ya = self.tensor(f"{act.outputs[0]}_nhwc", (n, h, wd, c), av, _permuted(av.tesa, TO_NHWC))
            args = tuple(TensorRef(y) if isinstance(a, TensorRef) else a for a in act.args)
            self.out.add_op(_op(act.name, act.op, act.target, args, [ya], act.source))
            replaced.add(act.name)
            y, last = ya, act.outputs[0]
        self.out.add_op(_op(f"{conv.name}_nchw", "permute", torch.ops.aten.permute.default, (TensorRef(y), TO_NCHW),
                            [last], conv.source))
        return replaced


def _moved_activation(graph: Graph, conv: Op) -> Op | None:
    """The activation reading only ``conv``'s output that a CUDA epilogue computes (None: none)."""
    y = conv.outputs[0]
    users = graph.consumers(y)
    if len(users) != 1 or y in graph.outputs:
        return None
    act = graph.op(users[0])
    if act.inputs != [y] or activation_name(act) not in EPILOGUE_ACTIVATIONS["cuda"] or act.kwargs:
        return None
    return act


def convs_as_linears(graph: Graph) -> tuple[Graph, dict[str, str]]:
    """``graph`` with every 1×1 convolution :func:`candidates` names run as a linear over channels (or ``graph``
    itself if none), and ``{matrix: what it was computed from}``."""
    convs = candidates(graph)
    if not convs:
        return graph, {}
    out = Graph(graph.name)
    dropped = {conv.input_of("weight") for conv in convs} | \
        {conv.outputs[0] for conv in convs if _moved_activation(graph, conv) is not None}
    for v in graph.tensors():            # a moved activation's output: now the permute back's, of the same shape
        if v.name not in dropped:
            out.add_tensor(v.copy())
    rewrite, by_name = _Rewrite(graph, out), {conv.name: conv for conv in convs}
    skip: set[str] = set()
    for op in graph.ops():
        if op.name in skip:
            continue
        if op.name in by_name:
            skip |= rewrite.convolution(op)
            continue
        out.add_op(Op(op.name, op.op, list(op.inputs), list(op.outputs), dict(op.attrs), list(op.roles), op.target,
                      op.args, dict(op.kwargs), op.source, op.multi_output))
    out.inputs, out.outputs = list(graph.inputs), list(graph.outputs)
    graph.copy_facts(out)
    matrices = rewrite.matrices
    aliases = {name: {"tensor": matrices[a["tensor"]], "perm": None} if a["tensor"] in matrices else dict(a)
               for name, a in out.meta.get("aliases", {}).items()}
    out.meta["aliases"] = aliases
    for w, m in matrices.items():
        if w not in aliases:
            out.add_alias(w, m)
    return out, rewrite.derived


__all__ = ["convs_as_linears", "candidates", "one_by_one", "pruned_inside_channels"]
