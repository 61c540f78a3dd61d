"""Emit a ``torch.fx.GraphModule`` that runs a sparta graph with torch ops.

Weights are registered on the root module under their ``state_dict`` names (a module
hierarchy is created for dotted names), so ``gm.state_dict()`` matches the original
model and ONNX export names initializers after them. ``replacements`` lets later passes
swap an op for a kernel module: it maps an op name to a callable module which receives
the op's input tensors (in ``op.inputs`` order, or the tensors named by the module's
``input_names``) and returns its outputs (or the tensors named by its ``output_names``, which
may include tensors the graph does not hold, such as quantised copies of an output). Weights
no remaining torch op reads are not registered (a kernel module holds its own packed copy).
"""

from __future__ import annotations

import operator
import re
from collections.abc import Mapping

import torch
from torch import fx
from torch.utils import _pytree as pytree

from ..graph import SIZE_FUNCTIONS, Graph, SymRef, TensorRef, substitute


def _ensure_parent(root: torch.nn.Module, dotted: str) -> tuple[torch.nn.Module, str]:
    *path, leaf = dotted.split(".")
    mod = root
    for p in path:
        if not hasattr(mod, p):
            mod.add_module(p, torch.nn.Module())
        mod = getattr(mod, p)
    return mod, leaf


def _fx_name(name: str) -> str:
    out = re.sub(r"\W", "_", name)
    return out if not out[:1].isdigit() else "_" + out


# A view traced on one device can meet other strides on another (SDPA's output layout differs
# between CPU and GPU backends): reshape is a view where strides allow and a copy where not.
RELAXED = {torch.ops.aten.view.default: torch.ops.aten.reshape.default}


class Passthrough(torch.nn.Module):
    """Stands in for an activation already fused into the producing kernel."""

    def __init__(self, input_name: str):
        super().__init__()
        self.input_names = [input_name]

    def forward(self, x):
        return x

    def saved_state(self):
        return {"input_name": self.input_names[0]}, {}, {}

    @classmethod
    def from_saved(cls, config: dict, tensors: dict, folders: dict) -> Passthrough:
        return cls(config["input_name"])


class Fused(torch.nn.Module):
    """Stands in for an op whose work another op's kernel does (a residual add inside the LayerNorm kernel
    that was its only reader; an activation inside a linear that writes its int8 codes): reads and
    produces no tensor."""

    def __init__(self, into: str):
        super().__init__()
        self.into, self.input_names, self.output_names = into, [], []

    def forward(self, *inputs):
        return ()

    def saved_state(self):
        return {"into": self.into}, {}, {}

    @classmethod
    def from_saved(cls, config: dict, tensors: dict, folders: dict) -> Fused:
        return cls(config["into"])

    def extra_repr(self) -> str:
        return f"done by {self.into}"


class SizeNodes:
    """fx nodes computing the graph's symbolic sizes (:class:`SymRef`) from its inputs' dynamic dimensions, each
    expression once."""

    def __init__(self, fg: fx.Graph, graph: Graph, env: dict):
        self.fg, self.dims, self.env = fg, graph.meta.get("dynamic_dims", {}), env
        self.nodes: dict[str, object] = {}

    def of(self, template):
        """``template`` with every SymRef replaced by its node."""
        return pytree.tree_map_only(SymRef, lambda r: self.node(r.expr), template)

    def node(self, expr: str):
        if expr not in self.nodes:
            import sympy
            self.nodes[expr] = self._emit(sympy.sympify(expr, locals=_sympy_names(self.dims)))
        return self.nodes[expr]

    def _emit(self, e):
        import sympy
        if e.is_Integer:
            return int(e)
        if e.is_Symbol:
            name = str(e)
            if name not in self.dims:
                raise KeyError(f"symbolic size {name} is no input dimension")
            if name not in self.nodes:
                tensor, dim = self.dims[name]
                self.nodes[name] = self.fg.call_function(torch.ops.aten.sym_size.int, (self.env[tensor], dim))
            return self.nodes[name]
        fn = _SIZE_OPS.get(type(e).__name__)
        if fn is None and isinstance(e, sympy.Pow) and e.exp.is_Integer and e.exp > 0:
            out = self._emit(e.base)
            for _ in range(int(e.exp) - 1):
                out = self.fg.call_function(operator.mul, (out, self._emit(e.base)))
            return out
        if fn is None:
            raise NotImplementedError(f"symbolic size {e} ({type(e).__name__}) has no fx form")
        args = [self._emit(a) for a in e.args]
        out = args[0]
        for a in args[1:]:
            out = self.fg.call_function(fn, (out, a))
        return out


_SIZE_OPS = {"Add": operator.add, "Mul": operator.mul, **SIZE_FUNCTIONS}


def _sympy_names(dims) -> dict:
    import sympy
    from torch.utils._sympy import functions
    names = {name: sympy.Symbol(name, integer=True, positive=True) for name in dims}
    names.update({k: getattr(functions, k) for k in SIZE_FUNCTIONS if hasattr(functions, k)})
    return names


CONV_OPS_2D = ("conv2d", "mkldnn_convolution")
POINTWISE_READERS = ("add", "sub", "mul")


def channels_last_constants(graph: Graph) -> set[str]:
    """The 4-D constants read only as a 2-D convolution's weight or by element-wise ops (a bias map): stored
    channels_last, oneDNN's layout on the CPU, where torch would otherwise reorder each weight on every call."""
    out = set()
    for v in graph.tensors("weight"):
        readers = [graph.op(c) for c in graph.consumers(v.name)]
        if len(v.shape) != 4 or not v.dtype.is_floating_point or not readers:
            continue
        if all(o.op in CONV_OPS_2D and o.inputs[1:2] == [v.name] and v.name not in o.inputs[:1] + o.inputs[2:]
               or o.op in POINTWISE_READERS for o in readers):
            out.add(v.name)
    return out


def to_graph_module(graph: Graph, weights: Mapping[str, torch.Tensor] | None = None,
                    replacements: Mapping[str, torch.nn.Module] | None = None,
                    channels_last: bool = False) -> fx.GraphModule:
    """Build a GraphModule computing ``graph.outputs`` (a flat tuple) from ``graph.inputs``.

    ``weights`` overrides the stored weight data by name (e.g. masked weights); ``channels_last``: the
    :func:`channels_last_constants` are held channels_last.
    """
    weights = weights if weights is not None else {}       # a mapping read by name (MaskedWeights: lazily)
    replacements = dict(replacements or {})
    root = torch.nn.Module()
    fg = fx.Graph()
    env: dict[str, fx.Node] = {}
    for name in graph.inputs:
        env[name] = fg.placeholder(_fx_name(name))
    read = {t for o in graph.ops() if o.name not in replacements for t in o.inputs} | set(graph.outputs)
    nhwc = channels_last_constants(graph) if channels_last else set()
    for v in graph.tensors("weight"):
        if v.name not in read:
            continue
        data = weights[v.name] if v.name in weights else v.data
        if data is None:
            continue
        if v.name in nhwc:
            data = data.contiguous(memory_format=torch.channels_last)
        parent, leaf = _ensure_parent(root, v.name)
        if v.is_parameter:
            parent.register_parameter(leaf, torch.nn.Parameter(data, requires_grad=False))
        else:
            parent.register_buffer(leaf, data)
    used = {t for o in graph.ops() for t in o.inputs} | set(graph.outputs)

    def lookup(name):
        if name not in env:
            if graph.tensor(name).kind == "weight":
                env[name] = fg.get_attr(name)
            else:
                raise KeyError(f"tensor {name!r} is used before it is computed")
        return env[name]

    probe = []

    def device_node():
        """A node reading the module's current device: constants created with ``device=cpu`` at
        capture time follow the module to the GPU (``.to('cuda')``)."""
        if not probe:
            root.register_buffer("_sparta_device", torch.empty(0), persistent=False)
            probe.append(fg.call_function(getattr, (fg.get_attr("_sparta_device"), "device")))
        return probe[0]

    def follow_device(value):
        return pytree.tree_map_only(torch.device, lambda d: device_node() if d.type == "cpu" else d, value)

    sizes = SizeNodes(fg, graph, env)
    for op in graph.ops():
        if op.name in replacements:
            mod_name = "kernel_" + _fx_name(op.name)
            root.add_module(mod_name, replacements[op.name])
            if isinstance(replacements[op.name], Fused):      # another op's kernel does its work: no call
                continue
            names = getattr(replacements[op.name], "input_names", None)
            names = op.inputs if names is None else names
            result = fg.create_node("call_module", mod_name, tuple(lookup(t) for t in names),
                                    name=_fx_name(op.name))
            produced = getattr(replacements[op.name], "output_names", None)
            if produced is not None:    # the module returns these tensors (in order), not op.outputs
                for i, t in enumerate(produced):
                    env[t] = result if len(produced) == 1 else fg.call_function(operator.getitem, (result, i))
                continue
            multi = len(op.outputs) > 1
        else:
            refs = {t: lookup(t) for t in op.inputs}
            args = follow_device(substitute(sizes.of(op.args), refs))
            kwargs = follow_device(substitute(sizes.of(op.kwargs), refs))
            target = RELAXED.get(op.target, op.target)
            result = fg.create_node("call_function", target, tuple(args), kwargs, name=_fx_name(op.name))
            multi = op.multi_output
        if multi:
            for i, t in enumerate(op.outputs):
                if t in used:
                    env[t] = fg.call_function(operator.getitem, (result, i))
        else:
            env[op.outputs[0]] = result
    fg.output(tuple(lookup(t) for t in graph.outputs))
    gm = fx.GraphModule(root, fg, class_name=_fx_name(graph.name) + "Sparta")
    if probe:  # GraphModule copies get_attr targets as persistent buffers: keep it out of state_dict
        gm.register_buffer("_sparta_device", torch.empty(0), persistent=False)
    gm.graph.lint()
    return gm


__all__ = ["to_graph_module", "Fused", "Passthrough", "TensorRef"]
