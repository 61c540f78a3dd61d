"""A graph as JSON plus a dict of tensors: what ``compiled.save`` writes, never pickle.

Op targets are written by name (``"aten::linear.default"``) and resolved on load only from an
allowlist of pure tensor ops (:func:`refusal`) and a few Python operators, so a saved graph can
compute on tensors and nothing else: no files, storage, uninitialised memory, in-place writes or
process state. Argument templates use tagged JSON for what JSON lacks: tensor references, tuples,
dtypes, devices, layouts, memory formats and non-finite floats. Output and input structures
(pytree specs) come back from plain containers and Hugging Face output classes only (:func:`load_treespec`);
no module named in the file is imported. Weight data goes in the tensor dict (``safetensors`` in a saved model).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib
import importlib.util
import json
import math
import operator
import re
import sys
import warnings

import torch
from torch.utils import _pytree as pytree

from .errors import SpartaError
from .graph import SIZE_FUNCTIONS, Graph, Op, SymRef, TensorRef, TokenRange, Value, bind_call
from .saved_checks import SavedModelError, is_row_range
from .tesa import TeSA

FORMAT = 1
OP_NAMESPACES = ("aten", "prims")
PY_TARGETS = {f"operator.{f.__name__}": f for f in (operator.getitem, operator.add, operator.sub, operator.mul,
                                                      operator.truediv, operator.floordiv, operator.neg)}
# functional ops that still reach outside their tensor arguments: files, raw storage and strides,
# uninitialised memory, unchecked index structures
DENIED_OPS = frozenset({
    "from_file", "as_strided", "as_strided_copy", "as_strided_scatter", "set", "lift_fresh",
    "empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided",
    "segment_reduce", "sparse_coo_tensor", "sparse_compressed_tensor", "sparse_csr_tensor", "sparse_csc_tensor",
    "sparse_bsr_tensor", "sparse_bsc_tensor", "view_of_dtype", "device_put"})
# ops that return memory they did not compute (uninitialised, resized or another tensor's storage), by name prefix
UNINITIALISED_PREFIXES = ("empty", "new_empty", "resize", "set")
# private ATen ops that torch.export's decompositions emit for the graphs sparta captures
PRIVATE_OPS = frozenset({
    "_to_copy", "_softmax", "_log_softmax", "_safe_softmax", "_unsafe_view", "_native_batch_norm_legit_no_training",
    "_native_batch_norm_legit_functional", "_adaptive_avg_pool2d", "_adaptive_avg_pool3d", "_addmm_activation",
    "_prelu_kernel", "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_attention_math", "_upsample_bilinear2d_aa",
    "_upsample_nearest_exact1d", "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "_cdist_forward",
    "_pdist_forward", "_embedding_bag", "_weight_norm", "_weight_norm_interface"})
_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
_LAYOUTS = {"strided": torch.strided}
_FORMATS = {str(x).removeprefix("torch."): x for x in vars(torch).values() if isinstance(x, torch.memory_format)}
_DEVICE_TYPES = ("cpu", "cuda", "meta")


class GraphFormatError(SavedModelError):
    """A saved graph that cannot be read (corrupt, newer format, or an op outside the allowlist)."""


def refusal(op: torch._ops.OpOverload) -> str | None:
    """Why a saved graph may not call ``op`` (None: it may).

    Allowed: ATen/prims overloads whose schema writes no argument, that return only tensors
    and take no storage, public ones but :data:`DENIED_OPS` and those named like
    :data:`UNINITIALISED_PREFIXES` (``empty*``, ``resize*``, ``set*``: memory an output could hold
    without the op computing it), and the private ones in :data:`PRIVATE_OPS`.
    """
    schema, name = op._schema, op._schema.name.split("::", 1)[-1]
    if op.namespace not in OP_NAMESPACES:
        return f"it is outside the namespaces {OP_NAMESPACES}"
    if name.startswith(UNINITIALISED_PREFIXES):
        return "it returns memory it did not compute (uninitialised, resized or another tensor's storage)"
    if schema.is_mutable:
        return "it writes to its arguments"
    if not schema.returns or not all(_is_tensor_type(r.type) for r in schema.returns):
        return "it returns something other than tensors"
    if any("Storage" in str(a.type) for a in schema.arguments):
        return "it reads raw storage"
    if torch.Tag.inplace_view in op.tags or torch.Tag.data_dependent_output in op.tags:
        return "it is not a pure tensor op"
    if name in DENIED_OPS:
        return "it reaches outside its tensor arguments (files, storage or uninitialised memory)"
    if name.startswith("_") and not name.startswith("__") and name not in PRIVATE_OPS:
        return "it is a private ATen op outside sparta's graphs"
    return None


def _is_tensor_type(t) -> bool:
    return str(t) in ("Tensor", "Optional[Tensor]", "List[Tensor]", "List[Optional[Tensor]]")


@functools.lru_cache(maxsize=None)
def _allowed(op: torch._ops.OpOverload) -> str | None:
    return refusal(op)


def target_name(target) -> str:
    """The name a target is saved under; raises for targets ``load`` would refuse."""
    if isinstance(target, torch._ops.OpOverload):
        why = _allowed(target)
        if why is not None:
            raise GraphFormatError(f"cannot save op {target}: {why}")
        return f"{target.namespace}::{target._schema.name.split('::', 1)[1]}.{target._overloadname}"
    for name, fn in PY_TARGETS.items():
        if target is fn:
            return name
    raise GraphFormatError(f"cannot save op target {target!r}: only ATen/prims overloads and "
                           f"{sorted(PY_TARGETS)} can be saved")


def resolve_target(name: str):
    """The callable saved as ``name``, from the allowlist only."""
    if not isinstance(name, str):
        raise GraphFormatError(f"op target {name!r} is not one a saved model may call")
    if name in PY_TARGETS:
        return PY_TARGETS[name]
    ns, _, rest = name.partition("::")
    packet_name, _, overload = rest.rpartition(".")
    if ns not in OP_NAMESPACES or not packet_name.isidentifier() or not overload.isidentifier():
        raise GraphFormatError(f"op target {name!r} is not one a saved model may call")
    try:
        op = getattr(getattr(getattr(torch.ops, ns), packet_name), overload)
    except (AttributeError, RuntimeError) as exc:
        raise GraphFormatError(f"op target {name!r} does not exist in torch {torch.__version__}") from exc
    why = _allowed(op) if isinstance(op, torch._ops.OpOverload) else "it is not an operator overload"
    if why is not None:
        raise GraphFormatError(f"op target {name!r} is not one a saved model may call: {why}")
    return op


def encode(value):
    """Argument template → JSON-able value (tagged dicts for non-JSON types)."""
    if isinstance(value, TensorRef):
        return {"$ref": value.name}
    if isinstance(value, SymRef):
        return {"$sym": [value.expr, value.hint]}
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
                "$dict": lambda v: {k: decode(i) for k, i in v.items()}, "$device": _device, "$sym": _symref}
    if tag not in decoders:
        raise GraphFormatError(f"unknown argument tag {tag!r}")
    return decoders[tag](x)


# a dimension symbol; a saved size expression (which sympy parses) holds only these, integers and SIZE_FUNCTIONS
_SYMBOL = r"s\d+"


def _symref(value) -> SymRef:
    if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and type(value[1]) is int):
        raise GraphFormatError(f"malformed symbolic size {value!r}")
    expr = value[0]
    names = re.findall(r"[A-Za-z_][A-Za-z0-9_]*", expr)
    if not re.fullmatch(r"[A-Za-z0-9_+\-*(), ]{1,200}", expr) or any(
            n not in SIZE_FUNCTIONS and not re.fullmatch(_SYMBOL, n) for n in names):
        raise GraphFormatError(f"symbolic size {expr!r} is not an expression of dimension symbols")
    return SymRef(expr, value[1])


def _device(text) -> torch.device:
    if not isinstance(text, str) or text.split(":")[0] not in _DEVICE_TYPES:
        raise GraphFormatError(f"unknown device {text!r}")
    return torch.device(text)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise GraphFormatError(f"unknown dtype {name!r}")
    return _DTYPES[name]


def load_treespec(text: str):
    """A pytree spec from ``treespec_dumps`` text, built from plain containers (tuples, lists, dicts and
    ordered dicts) and Hugging Face output classes: a node saved under the qualified name of a class of
    ``transformers.modeling_outputs`` comes back as that class (the one module imported, only when
    transformers is installed), as does an already registered ``ModelOutput`` subclass of another
    transformers module. A node of any other type comes back as a dict where its context is a key
    list, else as a tuple; nothing it names is imported."""
    try:
        protocol, schema = json.loads(text)
        if protocol != 1:
            raise ValueError(f"unknown pytree protocol {protocol!r}")
        return _treespec(schema)
    except (ValueError, TypeError, KeyError, RecursionError) as exc:
        raise GraphFormatError(f"malformed pytree spec: {exc}") from exc


_CONTAINERS = {"builtins.tuple": tuple, "builtins.list": list, "builtins.dict": dict,
               "collections.OrderedDict": collections.OrderedDict}
MODEL_OUTPUTS = "transformers.modeling_outputs"     # the one module a saved output structure may import


def output_class(kind: str, keys: list):
    """The Hugging Face output class saved as ``kind`` with fields ``keys`` (None: not one): a ``ModelOutput``
    subclass of :data:`MODEL_OUTPUTS`, looked up there by name, or one registered with pytree by transformers
    already; its fields must include ``keys``."""
    registered = pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE.get(kind)
    if registered is None:
        module, _, name = kind.rpartition(".")
        if module != MODEL_OUTPUTS or not name.isidentifier() or importlib.util.find_spec("transformers") is None:
            return None
        try:
            outputs = importlib.import_module(MODEL_OUTPUTS)
        except Exception:  # noqa: BLE001 - a broken transformers install: the output comes back as a dict
            return None
        registered = vars(outputs).get(name)
        if getattr(registered, "__module__", None) != MODEL_OUTPUTS:
            return None
    generic = sys.modules.get("transformers.utils.generic")
    base = getattr(generic, "ModelOutput", None)
    if not (isinstance(registered, type) and base is not None and issubclass(registered, base)
            and dataclasses.is_dataclass(registered)):
        return None
    node = pytree.SUPPORTED_SERIALIZED_TYPES.get(registered)
    ok = node is not None and node.serialized_type_name == kind and node.from_dumpable_context is None and \
        set(keys) <= {f.name for f in dataclasses.fields(registered)}
    return registered if ok else None


def _treespec(node: dict):
    kind, context, children = node["type"], node["context"], [_treespec(c) for c in node["children_spec"]]
    if kind is None:
        if children or context is not None:
            raise ValueError("a leaf with children")
        return pytree.treespec_leaf()
    if not isinstance(kind, str) or (context is not None and not isinstance(context, str)):
        raise ValueError(f"malformed node of type {kind!r}")
    if kind in ("builtins.tuple", "builtins.list"):
        return pytree.TreeSpec(_CONTAINERS[kind], None, children)
    keys = _keys(context, len(children))
    if keys is None:
        return pytree.TreeSpec(tuple, None, children)
    if kind in _CONTAINERS:
        return pytree.TreeSpec(_CONTAINERS[kind], keys, children)
    return pytree.TreeSpec(output_class(kind, keys) or dict, keys, children)


def _keys(context: str | None, n: int) -> list | None:
    """The key list a dict-like node's context holds (None if it holds something else)."""
    try:
        keys = json.loads(context) if context is not None else None
    except ValueError:
        return None
    plain = isinstance(keys, list) and len(keys) == n and all(isinstance(k, (str, int)) and not isinstance(k, bool)
                                                              for k in keys)
    return keys if plain else None


def graph_to_json(graph: Graph, prefix: str = "graph/", stacked: bool = True) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(json, tensors)``: the graph's structure and TeSAs as JSON, weight data keyed ``prefix + name``
    (``stacked=False``: not the stacked weights', which would be concatenated from their parts to be read)."""
    tensors, values = {}, []
    for v in graph.tensors():
        values.append({"name": v.name, "shape": list(v.shape), "dtype": dtype_name(v.dtype), "kind": v.kind,
                       "is_parameter": v.is_parameter, "tesa": v.tesa.to_json(), "data": v.has_data})
        if v.has_data and (stacked or v.name not in graph.stacked_weights):
            tensors[prefix + v.name] = v.data
    ops = [{"name": o.name, "op": o.op, "inputs": o.inputs, "outputs": o.outputs, "target": target_name(o.target),
            "args": encode(tuple(o.args)), "kwargs": encode(dict(o.kwargs)), "source": o.source,
            "multi_output": o.multi_output} for o in graph.ops()]
    meta = {"input_leaves": graph.meta.get("input_leaves"),
            "input_ranges": {k: list(v) for k, v in graph.meta.get("input_ranges", {}).items()},
            "aliases": graph.meta.get("aliases", {})}
    if graph.meta.get("dynamic_dims"):
        meta["dynamic_dims"] = {k: list(v) for k, v in graph.meta["dynamic_dims"].items()}
        meta["dim_ranges"] = {k: list(v) for k, v in graph.meta.get("dim_ranges", {}).items()}
        meta["dim_uses"] = {k: [list(u) for u in v] for k, v in graph.meta.get("dim_uses", {}).items()}
    for key in ("one_shape", "size_one"):
        if graph.meta.get(key) is not None:
            meta[key] = graph.meta[key]
    if graph.token_range is not None:
        meta["token_range"] = dataclasses.asdict(graph.token_range)
    if graph.stacked_weights:
        meta["stacked_weights"] = graph.stacked_weights
    if graph.hf_model is not None:
        meta["hf_model"] = graph.hf_model
    for key in ("in_spec", "out_spec"):
        if graph.meta.get(key) is not None:
            with warnings.catch_warnings():  # torch's own dumps trips its LeafSpec deprecation
                warnings.simplefilter("ignore", FutureWarning)
                meta[key] = pytree.treespec_dumps(graph.meta[key])
    if graph.propagation is not None:
        meta["propagation"] = graph.propagation.to_json()
    if graph.meta.get("mask_sources") is not None:        # where the TeSAs came from (the plan report's last line)
        meta["mask_sources"] = {k: sorted(v) for k, v in graph.meta["mask_sources"].items()}
    return {"format": FORMAT, "name": graph.name, "inputs": graph.inputs, "outputs": graph.outputs,
            "tensors": values, "ops": ops, "meta": meta}, tensors


def _read_dynamic_dims(g: Graph, meta: dict) -> None:
    """The dynamic dimensions a graph's symbolic sizes name (none: the graph has no symbolic size)."""
    dims, ranges = meta.get("dynamic_dims", {}), meta.get("dim_ranges", {})
    ok = isinstance(dims, dict) and all(
        re.fullmatch(_SYMBOL, k) and isinstance(v, list) and len(v) == 2 and v[0] in g.inputs and type(v[1]) is int
        and 0 <= v[1] < len(g.tensor(v[0]).shape) for k, v in dims.items())
    ok = ok and isinstance(ranges, dict) and all(
        k in dims and isinstance(v, list) and len(v) == 2 and all(x is None or type(x) is int for x in v)
        for k, v in ranges.items())
    if not ok:
        raise GraphFormatError("malformed dynamic dimensions")
    uses = meta.get("dim_uses", {})
    ok = isinstance(uses, dict) and all(k in dims and isinstance(v, list) and all(
        isinstance(u, list) and len(u) == 2 and u[0] in g.inputs and type(u[1]) is int
        and 0 <= u[1] < len(g.tensor(u[0]).shape) for u in v) for k, v in uses.items())
    span = meta.get("token_range")
    ok = ok and (span is None or isinstance(span, dict) and set(span) == {"lo", "hi", "example"}
                 and all(type(x) is int for x in span.values()))
    if not ok or not all(isinstance(meta.get(k, ""), str) for k in ("one_shape", "size_one")):
        raise GraphFormatError("malformed dynamic dimensions")
    if dims:
        g.meta["dynamic_dims"] = {k: list(v) for k, v in dims.items()}
        g.meta["dim_ranges"] = {k: list(v) for k, v in ranges.items()}
        g.meta["dim_uses"] = {k: [list(u) for u in v] for k, v in uses.items()}
    if span is not None:
        g.token_range = TokenRange(**span)
    for key in ("one_shape", "size_one"):
        if meta.get(key):
            g.meta[key] = meta[key]
    stacked = meta.get("stacked_weights", {})
    if not isinstance(stacked, dict) or not all(
            isinstance(rows, list) and all(is_row_range(r) for r in rows) for rows in stacked.values()):
        raise GraphFormatError("malformed stacked weights")
    if stacked:
        g.stacked_weights = {k: [list(r) for r in v] for k, v in stacked.items()}
    unknown = {n for o in g.ops() for n in _symbols(o.args) | _symbols(o.kwargs)} - set(dims)
    if unknown:
        raise GraphFormatError(f"symbolic sizes name unknown dimensions {sorted(unknown)}")


def _symbols(template) -> set[str]:
    if isinstance(template, SymRef):
        return set(re.findall(_SYMBOL, template.expr))
    if isinstance(template, (list, tuple)):
        return set().union(*map(_symbols, template)) if template else set()
    if isinstance(template, dict):
        return _symbols(list(template.values()))
    return set()


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
            if not isinstance(args, tuple) or not isinstance(kwargs, dict):
                raise GraphFormatError(f"op {o['name']!r}: malformed arguments")
            inputs, roles, attrs = bind_call(target, args, kwargs)
            if inputs != o["inputs"]:
                raise GraphFormatError(f"op {o['name']!r}: arguments name inputs {inputs}, the graph says {o['inputs']}")
            g.add_op(Op(o["name"], o["op"], inputs, list(o["outputs"]), attrs, roles, target, args, kwargs,
                        o["source"], o["multi_output"]))
        g.inputs, g.outputs = list(data["inputs"]), list(data["outputs"])
        meta = data["meta"]
        leaves, ranges = meta["input_leaves"], meta["input_ranges"]
        if leaves is not None and not (isinstance(leaves, list)
                                       and all(x is None or isinstance(x, str) for x in leaves)):
            raise GraphFormatError(f"malformed input_leaves {leaves!r}")
        if not all(isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r) for r in ranges.values()):
            raise GraphFormatError(f"malformed input_ranges {ranges!r}")
        g.meta["input_leaves"] = leaves
        g.meta["input_ranges"] = {k: tuple(v) for k, v in ranges.items()}
        _read_dynamic_dims(g, meta)
        for name, alias in meta.get("aliases", {}).items():
            g.add_alias(name, alias["tensor"], alias["perm"])
        for key in ("in_spec", "out_spec"):
            if key in meta:
                g.meta[key] = load_treespec(meta[key])
        sources = meta.get("mask_sources")
        if sources is not None:
            if not (isinstance(sources, dict) and all(isinstance(v, list) and all(isinstance(x, str) for x in v)
                                                       for v in sources.values())):
                raise GraphFormatError(f"malformed mask_sources {sources!r}")
            g.meta["mask_sources"] = {str(k): list(v) for k, v in sources.items()}
        if meta.get("hf_model") is not None:
            g.hf_model = _hf_record(meta["hf_model"])
        if "propagation" in meta:
            from .passes.propagate import PropagationReport
            g.propagation = PropagationReport.from_json(meta["propagation"])
        g.validate()
    except GraphFormatError:
        raise
    except (SpartaError, KeyError, TypeError, ValueError, AttributeError, IndexError, RuntimeError) as exc:
        raise GraphFormatError(f"malformed saved graph: {type(exc).__name__}: {exc}") from exc
    return g


def _hf_record(record) -> dict:
    """A saved Hugging Face model record (``frontend.hf.model_record``), checked for shape: data, never code."""
    if not (isinstance(record, dict) and isinstance(record.get("class"), str) and record["class"].isidentifier()
            and isinstance(record.get("config"), dict) and isinstance(record.get("generative", False), bool)):
        raise GraphFormatError(f"malformed hf_model record {str(record)[:200]!r}")
    return record


__all__ = ["graph_to_json", "graph_from_json", "encode", "decode", "target_name", "resolve_target", "refusal",
           "load_treespec", "GraphFormatError"]
