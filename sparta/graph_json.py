"""A graph as JSON plus a dict of tensors: what ``compiled.save`` writes, never pickle.

Op targets are written by name (``"aten::linear.default"``) and resolved on load only
from an allowlist (ATen/prims operator overloads and a few Python operators), so loading
a saved model cannot call arbitrary code. Argument templates use tagged JSON for what
JSON lacks: tensor references, tuples, dtypes, devices, layouts, memory formats and
non-finite floats. Weight data goes in the tensor dict (``safetensors`` in a saved model).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import operator
import warnings

import torch
from torch.utils import _pytree as pytree

from .errors import SpartaError
from .graph import Graph, Op, TensorRef, Value, bind_call
from .tesa import TeSA

FORMAT = 1
MODEL_PACKAGES = ("transformers", "diffusers", "timm")    # whose output classes a load may import
OP_NAMESPACES = ("aten", "prims")
PY_TARGETS = {f"operator.{f.__name__}": f for f in (operator.getitem, operator.add, operator.sub, operator.mul,
                                                      operator.truediv, operator.floordiv, operator.neg)}
_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
_LAYOUTS = {str(x).removeprefix("torch."): x for x in vars(torch).values() if isinstance(x, torch.layout)}
_FORMATS = {str(x).removeprefix("torch."): x for x in vars(torch).values() if isinstance(x, torch.memory_format)}


class GraphFormatError(SpartaError):
    """A saved graph that cannot be read (corrupt, newer format, or an op outside the allowlist)."""


def target_name(target) -> str:
    """The name a target is saved under; raises for targets ``load`` would refuse."""
    if isinstance(target, torch._ops.OpOverload):
        ns = target.namespace
        if ns not in OP_NAMESPACES:
            raise GraphFormatError(f"op {target} is outside the namespaces a saved model may call ({OP_NAMESPACES})")
        return f"{ns}::{target._schema.name.split('::', 1)[1]}.{target._overloadname}"
    for name, fn in PY_TARGETS.items():
        if target is fn:
            return name
    raise GraphFormatError(f"cannot save op target {target!r}: only ATen/prims overloads and "
                           f"{sorted(PY_TARGETS)} can be saved")


def resolve_target(name: str):
    """The callable saved as ``name``, from the allowlist only."""
    if name in PY_TARGETS:
        return PY_TARGETS[name]
    ns, _, rest = name.partition("::")
    packet_name, _, overload = rest.rpartition(".")
    if ns not in OP_NAMESPACES or not packet_name or not overload:
        raise GraphFormatError(f"op target {name!r} is not one a saved model may call")
    try:
        return getattr(getattr(getattr(torch.ops, ns), packet_name), overload)
    except (AttributeError, RuntimeError) as exc:
        raise GraphFormatError(f"op target {name!r} does not exist in torch {torch.__version__}") from exc


def encode(value):
    """Argument template → JSON-able value (tagged dicts for non-JSON types)."""
    if isinstance(value, TensorRef):
        return {"$ref": value.name}
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"$float": repr(value)}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, tuple):
        return {"$tuple": [encode(v) for v in value]}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"$dict": {k: encode(v) for k, v in value.items()}}
    for tag, table in (("$dtype", _DTYPES), ("$layout", _LAYOUTS), ("$memory_format", _FORMATS)):
        if any(value is v for v in table.values()):
            return {tag: str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"$device": str(value)}
    raise GraphFormatError(f"cannot save an op argument of type {type(value).__name__}: {value!r}")


def decode(value):
    """Inverse of :func:`encode`."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) != 1:
        raise GraphFormatError(f"malformed argument {value!r}")
    (tag, x), = value.items()
    tables = {"$dtype": _DTYPES, "$layout": _LAYOUTS, "$memory_format": _FORMATS}
    if tag in tables:
        if x not in tables[tag]:
            raise GraphFormatError(f"unknown {tag[1:]} {x!r}")
        return tables[tag][x]
    decoders = {"$ref": TensorRef, "$tuple": lambda v: tuple(decode(i) for i in v), "$float": float,
                "$dict": lambda v: {k: decode(i) for k, i in v.items()}, "$device": torch.device}
    if tag not in decoders:
        raise GraphFormatError(f"unknown argument tag {tag!r}")
    return decoders[tag](x)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise GraphFormatError(f"unknown dtype {name!r}")
    return _DTYPES[name]


def load_treespec(text: str):
    """A pytree spec from ``treespec_dumps`` text. Output classes of known model libraries
    (``MODEL_PACKAGES``) are imported so their pytree registration exists; any other
    unregistered node whose context is a key list comes back as a plain dict."""
    try:
        return pytree.treespec_loads(text)
    except NotImplementedError:
        pass
    protocol, schema = json.loads(text)

    def fix(node):
        kind = node.get("type")
        if _foreign(kind):
            module = kind.rsplit(".", 1)[0]
            if module.split(".")[0] in MODEL_PACKAGES and importlib.util.find_spec(module.split(".")[0]):
                importlib.import_module(module)
            elif isinstance(json.loads(node["context"] or "null"), list):
                node = {**node, "type": "builtins.dict"}
        return {**node, "children_spec": [fix(c) for c in node.get("children_spec", [])]}

    try:
        return pytree.treespec_loads(json.dumps([protocol, fix(schema)]))
    except NotImplementedError:
        return pytree.treespec_loads(json.dumps([protocol, _as_dicts(schema)]))


def _foreign(kind) -> bool:
    """A pytree node type from outside Python's and torch's own containers."""
    return bool(kind) and not kind.startswith(("builtins.", "collections.", "torch."))


def _as_dicts(node):
    if _foreign(node.get("type")):
        node = {**node, "type": "builtins.dict"}
    return {**node, "children_spec": [_as_dicts(c) for c in node.get("children_spec", [])]}


def graph_to_json(graph: Graph, prefix: str = "graph/") -> tuple[dict, dict[str, torch.Tensor]]:
    """``(json, tensors)``: the graph's structure and TeSAs as JSON, weight data keyed ``prefix + name``."""
    tensors, values = {}, []
    for v in graph.tensors():
        values.append({"name": v.name, "shape": list(v.shape), "dtype": dtype_name(v.dtype), "kind": v.kind,
                       "is_parameter": v.is_parameter, "tesa": v.tesa.to_json(), "data": v.data is not None})
        if v.data is not None:
            tensors[prefix + v.name] = v.data
    ops = [{"name": o.name, "op": o.op, "inputs": o.inputs, "outputs": o.outputs, "target": target_name(o.target),
            "args": encode(tuple(o.args)), "kwargs": encode(dict(o.kwargs)), "source": o.source,
            "multi_output": o.multi_output} for o in graph.ops()]
    meta = {"input_leaves": graph.meta.get("input_leaves"),
            "input_ranges": {k: list(v) for k, v in graph.meta.get("input_ranges", {}).items()},
            "aliases": graph.meta.get("aliases", {})}
    for key in ("in_spec", "out_spec"):
        if graph.meta.get(key) is not None:
            with warnings.catch_warnings():  # torch's own dumps trips its LeafSpec deprecation
                warnings.simplefilter("ignore", FutureWarning)
                meta[key] = pytree.treespec_dumps(graph.meta[key])
    if graph.meta.get("propagation") is not None:
        meta["propagation"] = graph.meta["propagation"].to_json()
    return {"format": FORMAT, "name": graph.name, "inputs": graph.inputs, "outputs": graph.outputs,
            "tensors": values, "ops": ops, "meta": meta}, tensors


def graph_from_json(data: dict, tensors: dict[str, torch.Tensor], prefix: str = "graph/") -> Graph:
    """Rebuild a graph written by :func:`graph_to_json`."""
    if data.get("format") != FORMAT:
        raise GraphFormatError(f"saved graph format {data.get('format')!r}; this sparta reads format {FORMAT}")
    try:
        g = Graph(data["name"])
        for v in data["tensors"]:
            tensor = tensors.get(prefix + v["name"]) if v["data"] else None
            if v["data"] and tensor is None:
                raise GraphFormatError(f"weight {v['name']!r} is missing from the saved tensors")
            g.add_tensor(Value(v["name"], tuple(v["shape"]), dtype_of(v["dtype"]), v["kind"],
                               TeSA.from_json(v["tesa"]), tensor, v["is_parameter"]))
        for o in data["ops"]:
            target = resolve_target(o["target"])
            args, kwargs = decode(o["args"]), decode(o["kwargs"])
            inputs, roles, attrs = bind_call(target, args, kwargs)
            if inputs != o["inputs"]:
                raise GraphFormatError(f"op {o['name']!r}: arguments name inputs {inputs}, the graph says {o['inputs']}")
            g.add_op(Op(o["name"], o["op"], inputs, list(o["outputs"]), attrs, roles, target, args, kwargs,
                        o["source"], o["multi_output"]))
        g.inputs, g.outputs = list(data["inputs"]), list(data["outputs"])
        meta = data["meta"]
        g.meta["input_leaves"] = meta["input_leaves"]
        g.meta["input_ranges"] = {k: tuple(v) for k, v in meta["input_ranges"].items()}
        for name, alias in meta.get("aliases", {}).items():
            g.add_alias(name, alias["tensor"], alias["perm"])
        for key in ("in_spec", "out_spec"):
            if key in meta:
                g.meta[key] = load_treespec(meta[key])
        if "propagation" in meta:
            from .passes.propagate import PropagationReport
            g.meta["propagation"] = PropagationReport.from_json(meta["propagation"])
    except (KeyError, TypeError, ValueError) as exc:
        raise GraphFormatError(f"malformed saved graph: {type(exc).__name__}: {exc}") from exc
    g.validate()
    return g


__all__ = ["graph_to_json", "graph_from_json", "encode", "decode", "target_name", "resolve_target",
           "GraphFormatError"]
