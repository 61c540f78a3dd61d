"""The sparta graph IR: tensors and ops in one networkx multigraph.

Tensor values and op nodes live in separate namespaces (node keys ``("t", name)`` and
``("o", name)``); an edge tensor→op is an input (its ``index`` is the position in
``op.inputs``), an edge op→tensor an output. Weights are named by their ``state_dict``
name, so ``graph.tesa("fc1.weight")`` works directly. Op types are normalised ATen
names (``"linear"``, ``"conv2d"``, ``"add"``; see ``docs/ops.md``).
"""

from __future__ import annotations

import copy
import difflib
import math
import operator
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import networkx as nx
import torch

from .errors import GraphError
from .tesa import TeSA

KINDS = ("input", "weight", "activation", "output")


@dataclass(frozen=True)
class TensorRef:
    """A placeholder for a graph tensor inside an op's argument template."""

    name: str


# the functions a symbolic size may call (torch.utils._sympy's names) and their Python forms
SIZE_FUNCTIONS = {"FloorDiv": operator.floordiv, "PythonMod": operator.mod, "Mod": operator.mod, "Max": torch.sym_max,
                  "Min": torch.sym_min}


@dataclass(frozen=True)
class SymRef:
    """A size that follows the inputs' dynamic dimensions inside an op's argument template: ``expr`` over the symbols
    of ``graph.meta["dynamic_dims"]`` (sympy syntax, e.g. ``"s0*s1"``), ``hint`` its value at the example inputs
    (what the passes see: they run at the example shapes)."""

    expr: str
    hint: int


@dataclass
class Value:
    """A tensor of the graph: shape, dtype, role and its TeSA."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str
    tesa: TeSA
    data: torch.Tensor | None = None  # weights and constants only
    is_parameter: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise GraphError(f"tensor {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")
        self.shape = tuple(int(s) for s in self.shape)
        self.tesa.check_shape(self.shape, self.name)

    @property
    def has_data(self) -> bool:
        """Whether the tensor holds a value (without computing a stacked one)."""
        return self.data is not None

    def copy(self) -> Value:
        """A fresh record of the same tensor (value and TeSA shared)."""
        return replace(self)


@dataclass
class Op:
    """An operator node: normalised type, ordered tensor inputs/outputs, attributes.

    ``roles[i]`` names the schema argument ``inputs[i]`` fills (``"input"``,
    ``"weight"``, ``"tensors.1"``); ``attrs`` holds the non-tensor arguments by name
    (defaults filled in). ``target`` with ``args``/``kwargs`` (tensors as
    :class:`TensorRef`) re-creates the call.
    """

    name: str
    op: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    roles: list[str] = field(default_factory=list)
    target: Any = None
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    source: str = ""
    multi_output: bool = False  # the target returns a tuple/list even for one output
    meta: dict[str, Any] = field(default_factory=dict)  # in_dtypes/out_dtypes, filled by Graph.add_op

    def input_of(self, role: str) -> str | None:
        """The tensor filling schema argument ``role`` (None if absent)."""
        for r, name in zip(self.roles, self.inputs):
            if r == role:
                return name
        return None

    def call(self, env: dict[str, torch.Tensor], device=None) -> list[torch.Tensor]:
        """Run the op on tensors looked up by name in ``env``; returns its outputs. ``device``: where an op that
        creates a tensor (its ``device`` argument, e.g. ``arange``) creates it instead of where it was captured."""
        if self.target is None:
            raise GraphError(f"op {self.name!r} ({self.op}) has no executable target")
        args = substitute(self.args, env)
        kwargs = substitute(self.kwargs, env)
        if device is not None and isinstance(kwargs, dict) and "device" in kwargs:
            kwargs = {**kwargs, "device": device}
        out = self.target(*args, **kwargs)
        if self.multi_output:
            return list(out)
        return [out]


def bind_call(target, args, kwargs) -> tuple[list[str], list[str], dict[str, Any]]:
    """Split a call template (tensors as TensorRef) into (inputs, roles, attrs) by the op's schema.

    Tensor arguments become inputs named by their schema argument (``"weight"``; list
    elements as ``"tensors.1"``); everything else becomes an attribute, defaults filled.
    """
    inputs, roles, attrs = [], [], {}
    schema = getattr(target, "_schema", None)
    if schema is None:
        named = [(f"arg{i}", a) for i, a in enumerate(args)] + list(kwargs.items())
    else:
        named = []
        for i, arg in enumerate(schema.arguments):
            if i < len(args) and not arg.kwarg_only:
                named.append((arg.name, args[i]))
            elif arg.name in kwargs:
                named.append((arg.name, kwargs[arg.name]))
            elif arg.has_default_value():
                named.append((arg.name, arg.default_value))
    for name, val in named:
        val = hints(val)
        if isinstance(val, TensorRef):
            inputs.append(val.name)
            roles.append(name)
        elif isinstance(val, (list, tuple)) and any(isinstance(v, TensorRef) for v in val):
            for j, v in enumerate(val):
                if isinstance(v, TensorRef):
                    inputs.append(v.name)
                    roles.append(f"{name}.{j}")
        else:
            attrs[name] = val
    return inputs, roles, attrs


def substitute(template, env):
    """Replace every TensorRef in a nested args template by ``env[name]`` (and every SymRef by its hint)."""
    if isinstance(template, TensorRef):
        return env[template.name]
    if isinstance(template, SymRef):
        return template.hint
    if isinstance(template, (list, tuple)):
        return type(template)(substitute(t, env) for t in template)
    if isinstance(template, dict):
        return {k: substitute(v, env) for k, v in template.items()}
    return template


def hints(template):
    """``template`` with every SymRef replaced by its hint (the op's attributes at the example shapes)."""
    if isinstance(template, SymRef):
        return template.hint
    if isinstance(template, (list, tuple)):
        return type(template)(hints(t) for t in template)
    if isinstance(template, dict):
        return {k: hints(v) for k, v in template.items()}
    return template


def _t(name):
    return ("t", name)


def _o(name):
    return ("o", name)


@dataclass
class TokenRange:
    """The tokens (batch x sequence) a dynamic graph's plan is costed over, and the example's."""

    lo: int
    hi: int
    example: int


@dataclass
class Simplified:
    """What ``passes.simplify`` changed: masks and copies dropped, linears stacked (stacked op → its parts)."""

    dropped_masks: list[str] = field(default_factory=list)
    dropped_copies: list[str] = field(default_factory=list)
    stacked_linears: dict[str, list[str]] = field(default_factory=dict)


FACTS = ("token_range", "propagation", "quantization", "simplified", "stacked_weights", "hf_model")


class Graph:
    """A dataflow graph whose every tensor carries a TeSA."""

    def __init__(self, name: str = "graph"):
        self.name = name
        self._g = nx.MultiDiGraph()
        self._order: list[str] = []  # ops in a topological order
        self.inputs: list[str] = []
        self.outputs: list[str] = []
        self.in_spec: str | None = None  # pytree spec (treespec_dumps) of the user inputs
        self.out_spec: str | None = None
        self.meta: dict[str, Any] = {}    # what capture found (dynamic dimensions, aliases, input leaves)
        # facts passes hand on about the graph (typed; graph_json serialises them)
        self.token_range: TokenRange | None = None      # shapes.plan_tokens
        self.propagation = None                         # passes.propagate: PropagationReport
        self.quantization = None                        # passes.quant.calibrate: QuantReport
        self.simplified = Simplified()                  # passes.simplify
        self.stacked_weights: dict[str, list] = {}      # simplify.fuse_sibling_linears: [[part, first, end], ...]
        self.hf_model: dict | None = None               # frontend.hf.model_record: class and config (generate())

    def copy_facts(self, other: Graph) -> None:
        """Give ``other`` (a rewrite of this graph) this graph's capture metadata and pass facts."""
        other.in_spec, other.out_spec, other.meta = self.in_spec, self.out_spec, dict(self.meta)
        for name in FACTS:
            value = getattr(self, name)
            setattr(other, name, copy.deepcopy(value) if isinstance(value, (Simplified, dict)) else value)

    # ---- building ---------------------------------------------------------------------
    def add_tensor(self, value: Value) -> Value:
        if self._g.has_node(_t(value.name)):
            raise GraphError(f"tensor {value.name!r} already exists")
        self._g.add_node(_t(value.name), value=value)
        return value

    def add_op(self, op: Op) -> Op:
        if self._g.has_node(_o(op.name)):
            raise GraphError(f"op {op.name!r} already exists")
        for name in op.inputs:
            self.tensor(name)
        for name in op.outputs:
            if self.producer(name) is not None:
                raise GraphError(f"tensor {name!r} is produced twice ({self.producer(name)} and {op.name})")
        if len(op.roles) != len(op.inputs):
            op.roles = op.roles + [f"arg{i}" for i in range(len(op.roles), len(op.inputs))]
        op.meta["in_dtypes"] = [self.tensor(t).dtype for t in op.inputs]
        op.meta["out_dtypes"] = [self.tensor(t).dtype for t in op.outputs]
        self._g.add_node(_o(op.name), op=op)
        for i, name in enumerate(op.inputs):
            self._g.add_edge(_t(name), _o(op.name), index=i)
        for i, name in enumerate(op.outputs):
            self._g.add_edge(_o(op.name), _t(name), index=i)
        self._order.append(op.name)
        return op

    # ---- reading -----------------------------------------------------------------------
    def tensor(self, name: str) -> Value:
        node = self._g.nodes.get(_t(name))
        if node is None:
            raise GraphError(self._unknown("tensor", name, self.tensor_names()))
        return node["value"]

    def op(self, name: str) -> Op:
        node = self._g.nodes.get(_o(name))
        if node is None:
            raise GraphError(self._unknown("op", name, [o.name for o in self.ops()]))
        return node["op"]

    def has_tensor(self, name: str) -> bool:
        return self._g.has_node(_t(name))

    def unused_name(self, name: str, taken: set) -> str:
        """``name``, or ``name1``, ``name2``, ...: the first no tensor of the graph and nothing in ``taken`` holds
        (added to ``taken``)."""
        out, i = name, 1
        while self.has_tensor(out) or out in taken:
            out, i = f"{name}{i}", i + 1
        taken.add(out)
        return out

    def tensor_names(self) -> list[str]:
        return [k[1] for k in self._g.nodes if k[0] == "t"]

    def tensors(self, kind: str | None = None) -> Iterator[Value]:
        for key, data in self._g.nodes(data=True):
            if key[0] == "t" and (kind is None or data["value"].kind == kind):
                yield data["value"]

    def ops(self, op_type: str | Iterable[str] | None = None) -> Iterator[Op]:
        """Ops in topological order, optionally only of the given type(s)."""
        types = {op_type} if isinstance(op_type, str) else set(op_type) if op_type else None
        for name in self._order:
            node = self._g.nodes.get(_o(name))
            if node is not None and (types is None or node["op"].op in types):
                yield node["op"]

    def producer(self, tensor: str) -> str | None:
        preds = list(self._g.predecessors(_t(tensor))) if self._g.has_node(_t(tensor)) else []
        return preds[0][1] if preds else None

    def consumers(self, tensor: str) -> list[str]:
        """Names of the ops reading ``tensor`` (each once, in topological order)."""
        succ = {k[1] for k in self._g.successors(_t(tensor))} if self._g.has_node(_t(tensor)) else set()
        return [n for n in self._order if n in succ]

    def upstream(self, tensor: str) -> tuple[list[Op], list[str]]:
        """What ``tensor`` is computed from: the ops (transitively, in topological order) and the tensors no op
        produces (inputs, weights) that start it."""
        nodes = nx.ancestors(self._g, _t(tensor)) | {_t(tensor)}
        ops = [self.op(n) for n in self._order if _o(n) in nodes]
        return ops, sorted(k[1] for k in nodes if k[0] == "t" and self.producer(k[1]) is None)

    def neighbors(self, op: str) -> list[str]:
        """Ops sharing a tensor with ``op``: producers of its inputs, consumers of its outputs."""
        o = self.op(op)
        out = {self.producer(t) for t in o.inputs} | {c for t in o.outputs for c in self.consumers(t)}
        out |= {c for t in o.inputs for c in self.consumers(t)}  # siblings: input→input rules
        out.discard(None)
        out.discard(op)
        return [n for n in self._order if n in out]

    def weights(self) -> dict[str, torch.Tensor]:
        return {v.name: v.data for v in self.tensors("weight") if v.has_data}

    @property
    def any_rows(self) -> bool:
        """Whether the graph was captured with dynamic dimensions: its kernels take the number of rows at run time."""
        return bool(self.meta.get("dynamic_dims"))

    @property
    def example_tokens(self) -> int:
        """The product of the dynamic dimensions' sizes at the example inputs (batch x sequence: the tokens a linear
        over every position sees); 0 for a graph without dynamic dimensions."""
        dims = self.meta.get("dynamic_dims", {})
        return math.prod(self.tensor(t).shape[d] for t, d in dims.values()) if dims else 0

    def dynamic_dims_of(self, name: str) -> dict[int, str]:
        """The dynamic dimensions of input ``name``: dim -> symbol (a dimension that shares its symbol with an earlier
        input's, an attention mask's sequence with the ids', is one of them too)."""
        out = {d: sym for sym, (t, d) in self.meta.get("dynamic_dims", {}).items() if t == name}
        for sym, uses in self.meta.get("dim_uses", {}).items():
            out.update({d: sym for t, d in uses if t == name})
        return dict(sorted(out.items()))

    def input_shape(self, name: str) -> tuple:
        """Input ``name``'s shape with its dynamic dimensions named (``("s0", 128)``)."""
        dyn = self.dynamic_dims_of(name)
        return tuple(dyn.get(d, size) for d, size in enumerate(self.tensor(name).shape))

    def fits(self, name: str, shape: tuple[int, ...]) -> bool:
        """Whether an input of ``shape`` fits input ``name``: its static sizes, its dynamic ones within range
        (from 1: a size-1 batch runs the same ops)."""
        want = self.tensor(name).shape
        if len(shape) != len(want):
            return False
        dyn, ranges = self.dynamic_dims_of(name), self.meta.get("dim_ranges", {})
        for d, (got, size) in enumerate(zip(shape, want)):
            if d in dyn:
                hi = ranges.get(dyn[d], [None, None])[1]
                if got < 1 or (hi is not None and got > hi):
                    return False
            elif got != size:
                return False
        return True

    def flat_inputs(self, args=(), kwargs=None, check: bool = True) -> list[torch.Tensor]:
        """The graph's input tensors from a call's ``(args, kwargs)``, checked against the captured shapes and dtypes
        (``check=False``: only their count, e.g. under Dynamo, which guards the shapes itself)."""
        from torch.utils import _pytree as pytree

        from .errors import SpartaError
        leaves, _ = pytree.tree_flatten((tuple(args), dict(kwargs or {})))
        spec = self.meta.get("input_leaves")
        if spec is not None and len(leaves) == len(spec):
            flat = [x for x, name in zip(leaves, spec) if name is not None]
        else:
            flat = [x for x in leaves if isinstance(x, torch.Tensor)]
        if len(flat) != len(self.inputs):
            raise SpartaError(f"the model takes {len(self.inputs)} tensor inputs ({', '.join(self.inputs)}), "
                              f"got {len(flat)}")
        for x, name in zip(flat, self.inputs if check else ()):
            if not isinstance(x, torch.Tensor) or not self.fits(name, tuple(x.shape)):
                got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                ranges = self.meta.get("dim_ranges", {})
                bounds = [f"{sym} <= {ranges[sym][1]}" for sym in self.dynamic_dims_of(name).values()
                          if ranges.get(sym, [None, None])[1] is not None]
                raise SpartaError(f"input {name!r}: shape {got} does not fit the compiled {self.input_shape(name)} "
                                  f"({', '.join(bounds) + '; ' if bounds else ''}named dimensions take any size from "
                                  "1, numbers only theirs: the model, a size-1 example or dynamic=False fixed those, "
                                  "and compile(..., dynamic=True) says why; recompile with an example of this shape)")
            if x.dtype != self.tensor(name).dtype:
                raise SpartaError(f"input {name!r}: dtype {x.dtype} differs from the compiled {self.tensor(name).dtype}; "
                                  f"convert it (x.to({self.tensor(name).dtype})) or recompile")
        if check:
            shapes = dict(zip(self.inputs, (tuple(x.shape) for x in flat)))
            for sym, uses in self.meta.get("dim_uses", {}).items():
                sizes = {f"{t}[{d}]": shapes[t][d] for t, d in uses}
                if len(set(sizes.values())) > 1:
                    raise SpartaError(f"inputs {', '.join(sizes)} share one dynamic dimension ({sym}) of their shapes "
                                      f"but got sizes {', '.join(map(str, sizes.values()))}")
        return flat

    # ---- TeSAs ---------------------------------------------------------------------------
    def add_alias(self, name: str, tensor: str, perm: Iterable[int] | None = None) -> None:
        """Let ``name`` stand for ``tensor`` (permuted by ``perm``: ``name``'s view is ``tensor.permute(perm)``).

        Tied parameters (one tensor, several ``state_dict`` names) and ONNX initializers stored transposed
        under another name are reached this way by ``tesa`` / ``set_tesa``."""
        self.tensor(tensor)
        if self._g.has_node(_t(name)):
            raise GraphError(f"cannot alias {name!r}: a tensor of that name exists")
        perm = None if perm is None else [int(p) for p in perm]
        if perm is not None and sorted(perm) != list(range(len(self.tensor(tensor).shape))):
            raise GraphError(f"alias {name!r}: {perm} is not a permutation of {tensor!r}'s dims")
        self.meta.setdefault("aliases", {})[name] = {"tensor": tensor, "perm": perm}

    def resolve(self, name: str) -> tuple[str, list[int] | None]:
        """``(tensor name, permutation or None)`` of a tensor name or an alias."""
        if self._g.has_node(_t(name)):
            return name, None
        alias = self.meta.get("aliases", {}).get(name)
        if alias is None:
            raise GraphError(self._unknown("tensor", name, self.tensor_names() + list(self.meta.get("aliases", {}))))
        return alias["tensor"], alias["perm"]

    def tesa(self, name: str) -> TeSA:
        """The TeSA of a tensor, by tensor name, parameter (``state_dict``) name or alias."""
        target, perm = self.resolve(name)
        tesa = self.tensor(target).tesa
        return tesa if perm is None else TeSA(tesa.view().permute(perm).contiguous(), _trusted=True)

    def set_tesa(self, name: str, tesa: TeSA) -> None:
        """Attach ``tesa`` to a tensor (or the tensor an alias names); its shape must match."""
        target, perm = self.resolve(name)
        value = self.tensor(target)
        if not isinstance(tesa, TeSA):
            from .errors import TeSAError
            raise TeSAError(f"TeSA for {name!r}: expected a sparta.TeSA, got {type(tesa).__name__}")
        if perm is not None:
            shape = tuple(value.shape[p] for p in perm)
            inverse = sorted(range(len(perm)), key=perm.__getitem__)
            tesa = TeSA(tesa.check_shape(shape, name).view().permute(inverse).contiguous(), _trusted=True)
        value.tesa = tesa.check_shape(value.shape, name)

    def tesa_stats(self) -> list[dict]:
        """Per tensor: name, kind, shape, density and bit histogram."""
        return [{"name": v.name, "kind": v.kind, "shape": v.shape, "density": v.tesa.density,
                 "bits": v.tesa.bit_histogram()} for v in self.tensors()]

    # ---- views and copies --------------------------------------------------------------
    def subgraph(self, op_names: Iterable[str]) -> Graph:
        """A view holding the given ops and the tensors they touch (shares the values)."""
        names = set(op_names)
        for n in names:
            self.op(n)
        nodes = {_o(n) for n in names}
        for n in names:
            nodes |= set(self._g.predecessors(_o(n))) | set(self._g.successors(_o(n)))
        sub = Graph(f"{self.name}[sub]")
        sub._g = self._g.subgraph(nodes)
        sub._order = [n for n in self._order if n in names]
        sub.inputs = [t for t in self.inputs if _t(t) in nodes]
        sub.outputs = [t for t in self.outputs if _t(t) in nodes]
        return sub

    def copy(self) -> Graph:
        """A structural copy with fresh Value/Op records (weights and TeSAs shared: immutable)."""
        g = Graph(self.name)
        for v in self.tensors():
            g.add_tensor(v.copy())
        for o in self.ops():
            g.add_op(replace(o, inputs=list(o.inputs), outputs=list(o.outputs), attrs=dict(o.attrs),
                             roles=list(o.roles), meta=dict(o.meta)))
        g.inputs, g.outputs = list(self.inputs), list(self.outputs)
        self.copy_facts(g)
        return g

    def validate(self) -> None:
        """Check structure: acyclic, every op's tensors exist, outputs produced once."""
        if not nx.is_directed_acyclic_graph(self._g):
            raise GraphError(f"graph {self.name!r} has a cycle")
        for t in self.inputs + self.outputs:
            self.tensor(t)
        for o in self.ops():
            for t in o.outputs:
                if self.producer(t) != o.name:
                    raise GraphError(f"tensor {t!r} is not produced by {o.name!r}")

    def to_dot(self) -> str:
        """Graphviz DOT text: tensors as ellipses labelled with density, ops as boxes."""
        def q(s):
            return '"' + str(s).replace('"', r'\"') + '"'
        lines = [f"digraph {q(self.name)} {{", "  rankdir=TB;"]
        for v in self.tensors():
            style = ', style=filled, fillcolor="#eeeeee"' if v.kind == "weight" else ""
            label = q(f"{v.name}|{list(v.shape)} d={v.tesa.density:.2f}").replace("|", "\\n", 1)
            lines.append(f"  {q('t:' + v.name)} [label={label}{style}];")
        for o in self.ops():
            lines.append(f"  {q('o:' + o.name)} [shape=box, label={q(o.name + ' : ' + o.op)}];")
            lines += [f"  {q('t:' + t)} -> {q('o:' + o.name)};" for t in o.inputs]
            lines += [f"  {q('o:' + o.name)} -> {q('t:' + t)};" for t in o.outputs]
        lines.append("}")
        return "\n".join(lines)

    def __len__(self) -> int:
        return len(self._order)

    def __repr__(self) -> str:
        return (f"Graph({self.name!r}, {len(self._order)} ops, {sum(1 for _ in self.tensors())} tensors, "
                f"inputs={self.inputs}, outputs={self.outputs})")

    @staticmethod
    def _unknown(what, name, known):
        close = difflib.get_close_matches(str(name), known, n=3)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        return f"unknown {what} {name!r}{hint}"
