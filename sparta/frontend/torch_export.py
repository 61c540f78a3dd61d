"""Capture a ``torch.nn.Module`` into a sparta :class:`Graph` through ``torch.export``.

The exported program is decomposed to core ATen, except the ops in :data:`KEEP`: those
are the high-level ops sparta has rules and kernels for (a ``linear`` stays a
``linear``, not ``permute`` + ``addmm``). Weights, buffers and lifted constants become
``weight`` tensors named by their ``state_dict`` name. ``operator.getitem`` on a
multi-output op is not an op: it names one of that op's outputs.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
import re
import warnings

import numpy as np
import torch
from torch.utils import _pytree as pytree

from ..errors import CaptureError
from ..graph import Graph, Op, SymRef, TensorRef, Value, bind_call
from ..tesa import TeSA, bits_of_dtype
from .hf import cache_free, model_record

A = torch.ops.aten

#: High-level ATen ops kept as they are (not decomposed); see docs/ops.md.
KEEP = (
    A.linear.default, A.matmul.default, A.conv1d.default, A.conv2d.default, A.conv3d.default,
    A.batch_norm.default, A.layer_norm.default, A.group_norm.default, A.rms_norm.default,
    A.scaled_dot_product_attention.default, A.softmax.int, A.log_softmax.int,
    A.gelu.default, A.silu.default, A.hardswish.default, A.mish.default, A.embedding.default,
    A.flatten.using_ints, A.dropout.default, A.t.default, A.chunk.default, A.hardtanh.default,
    A.max_pool2d.default, A.avg_pool2d.default, A.adaptive_avg_pool2d.default,
    A.adaptive_max_pool2d.default, A.unflatten.int, A.reshape.default,
)

_ALIASES = {"_softmax": "softmax", "_log_softmax": "log_softmax",
            "_native_batch_norm_legit_no_training": "batch_norm", "convolution": "conv",
            "max_pool2d_with_indices": "max_pool2d", "_adaptive_avg_pool2d": "adaptive_avg_pool2d"}


def normalise_op_name(target) -> str:
    """``aten.linear.default`` → ``"linear"``; non-ATen callables keep a readable name."""
    if isinstance(target, torch._ops.OpOverload):
        base = target.overloadpacket.__name__
        return _ALIASES.get(base, base)
    return getattr(target, "__name__", str(target))


def from_torch(module: torch.nn.Module, example_inputs=(), example_kwargs=None, *, name=None,
               dynamic=False) -> Graph:
    """Export ``module`` on ``example_inputs`` and build a graph with dense TeSAs.

    A module in ``train()`` mode is captured in eval mode (with a warning) and left as it was;
    a module that writes into its buffers or inputs is refused (sparta compiles inference graphs).
    ``dynamic``: the inputs' batch and sequence dimensions (every dimension of an integer input, all but the last of
    a float one of up to 3 dimensions, the first of a larger one: an image's batch; a float mask's sequence too) stay
    symbolic where the model allows (``torch.export.Dim.AUTO``; those it fixes are ``graph.meta["fixed_dims"]``, with
    why), or a dict of ``torch.export``'s ``dynamic_shapes`` says which; the graph's shapes are the example's, and the
    sizes its ops compute from those dimensions are :class:`SymRef` expressions."""
    if isinstance(module, type):
        raise CaptureError(f"got the class {module.__name__}, not a model: pass an instance ({module.__name__}(...))")
    if not isinstance(module, torch.nn.Module):
        raise CaptureError(f"from_torch needs a torch.nn.Module, got {type(module).__name__}")
    example_inputs, example_kwargs = _check_examples(module, example_inputs, example_kwargs)
    name = name or type(module).__name__
    if isinstance(dynamic, dict):
        _check_dynamic_shapes(module, example_inputs, example_kwargs, dynamic)
    fixed = {}
    with _eval_mode(module), cache_free(module, example_kwargs):
        try:
            shapes = dynamic if isinstance(dynamic, dict) else \
                _dynamic_shapes(module, example_inputs, example_kwargs) if dynamic else None
            ep = torch.export.export(module, example_inputs, example_kwargs, strict=False, dynamic_shapes=shapes)
            if dynamic is True:
                fixed = fixed_dims(ep, module, example_inputs, example_kwargs)
            table = torch.export.default_decompositions()
            for op in KEEP:
                table.pop(op, None)
            ep = ep.run_decompositions(table)
        except Exception as exc:  # noqa: BLE001 - export errors come in many types; all mean "cannot capture"
            hint = ("; the model returns an object sparta cannot take apart (a cache?): have forward return tensors "
                    "or a ModelOutput (a Hugging Face model: use_cache=False in example_kwargs)"
                    if "in output, which is not a known type" in str(exc) else "")
            raise CaptureError(f"torch.export could not capture {name}: {type(exc).__name__}: {exc}{hint}") from exc
        _refuse_mutation(ep, name)      # known only once decomposition has functionalised the graph
        _check_runs(module, example_inputs, example_kwargs, name)
    graph = _build(ep, name)
    graph.hf_model = model_record(module)
    if fixed:
        graph.meta["fixed_dims"] = fixed      # what dynamic=True refuses (sparta/shapes.py)
    return graph


def demanded_dims(x) -> list[int]:
    """The dimensions of input ``x`` that ``dynamic=True`` frees and demands: every dimension of an integer or bool
    input (ids, masks, lengths), all but the last of a float one of up to 3 dimensions (features), the first of a
    larger one (an image's batch)."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return []
    return list(range(x.dim() if not x.is_floating_point() else x.dim() - 1 if x.dim() <= 3 else 1))


def _dynamic_shapes(module, example_inputs, example_kwargs) -> dict:
    """``torch.export``'s ``dynamic_shapes`` for :func:`from_torch`'s ``dynamic``, by forward's parameter names: the
    :func:`demanded_dims`, and the last dimension of a float input of up to 3 dimensions whose size is that of a
    demanded dimension of an integer or bool input (a float attention mask's sequence: export keeps it free where
    the model allows, tied to the ids'; a feature size that only matches stays fixed)."""
    auto = torch.export.Dim.AUTO
    bound = inspect.signature(module.forward).bind(*example_inputs, **example_kwargs).arguments
    tensors = [x for x in pytree.tree_leaves(list(bound.values())) if isinstance(x, torch.Tensor)]
    id_sizes = {x.shape[d] for x in tensors if not x.is_floating_point() for d in demanded_dims(x)} - {0, 1}

    def dims(x):
        free = demanded_dims(x)
        if isinstance(x, torch.Tensor) and x.is_floating_point() and 1 <= x.dim() <= 3 and x.shape[-1] in id_sizes:
            free.append(x.dim() - 1)
        return {d: auto for d in free} or None
    return {k: pytree.tree_map(dims, v) for k, v in bound.items()}


def size_one_dims(module, example_inputs, example_kwargs) -> list[str]:
    """The dimensions the default ``dynamic`` would free that have size 1 in the example (``"input_ids[0]"``):
    torch.export keeps those at 1 (its 0/1 rule; lifting it, ``backed_size_oblivious``, captures graphs that index
    as if the batch were 1)."""
    example_inputs, example_kwargs = _check_examples(module, example_inputs, example_kwargs)
    shapes = _dynamic_shapes(module, example_inputs, example_kwargs)
    bound = inspect.signature(module.forward).bind(*example_inputs, **example_kwargs).arguments
    out = []
    for name, spec in shapes.items():
        leaves = pytree.tree_leaves(bound.get(name))
        specs = pytree.tree_leaves(spec, is_leaf=lambda d: d is None or isinstance(d, dict))
        for i, (x, free) in enumerate(zip(leaves, specs)):
            if isinstance(x, torch.Tensor) and isinstance(free, dict):
                out += [f"{name}{f'.{i}' if len(leaves) > 1 else ''}[{d}]" for d in free if x.shape[d] == 1]
    return out


class FixedDimensionError(CaptureError):
    """``dynamic=True``: a batch or sequence dimension the model does not let stay free."""


def _labelled_inputs(module, example_inputs, example_kwargs) -> list[tuple[str, str, torch.Tensor]]:
    """Every tensor input in forward's order: (label as the reports write it, export's source name, tensor)."""
    bound = inspect.signature(module.forward).bind(*example_inputs, **example_kwargs).arguments
    out = []
    for name, value in bound.items():
        leaves = pytree.tree_flatten_with_path(value)[0]
        for i, (path, x) in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                out.append((f"{name}{f'.{i}' if len(leaves) > 1 else ''}", f"L['{name}']{pytree.keystr(path)}", x))
    return out


def fixed_dims(ep, module, example_inputs, example_kwargs) -> dict[str, str]:
    """The :func:`demanded_dims` that ``ep`` (exported with them ``Dim.AUTO``) kept at the example's size, or left
    symbolic but tied to a constant (``x[0]*x[1] == 32``: export drops that guard), each with why
    (``{"x[0]": "stayed at 4: the traced code requires x[0] == 4 (in ...)"}``)."""
    labelled = _labelled_inputs(module, example_inputs, example_kwargs)
    kinds = torch.export.graph_signature.InputKind
    nodes = {n.name: n for n in ep.graph.nodes}
    vals = [nodes[s.arg.name].meta.get("val") for s in ep.graph_signature.input_specs
            if s.kind == kinds.USER_INPUT and isinstance(s.arg, torch.export.graph_signature.TensorArgument)]
    if len(vals) != len(labelled) or any(not isinstance(v, torch.Tensor) or v.dim() != x.dim()
                                         for v, (_, _, x) in zip(vals, labelled)):
        return {}                           # an input layout this reading does not know: nothing to say
    env = next((v.fake_mode.shape_env for v in vals if getattr(v, "fake_mode", None) is not None), None)
    labels = _symbol_labels(env, labelled)
    out = {}
    for val, (label, source, x) in zip(vals, labelled):
        for d in demanded_dims(x):
            size = val.shape[d]
            if not (isinstance(size, torch.SymInt) and size.node.expr.is_Symbol):
                out[f"{label}[{d}]"] = _why_fixed(env, labels, f"{source}.size()[{d}]", int(x.shape[d]))
            elif (guard := _pinning_guard(env, size.node.expr)) is not None:
                out[f"{label}[{d}]"] = f"cannot take any size: the traced code requires {_render(guard, labels)}"
    return out


def _symbol_labels(env, labelled) -> dict[str, str]:
    """Export's size symbols by the input dimension they stand for (``{"s77": "x[0]"}``), as far as they can be read."""
    def label_of(src: str) -> str | None:                # "L['x'].size()[0]" -> "x[0]"
        for label, base, _ in labelled:
            if src.startswith(base + ".size()["):
                return f"{label}[{src[len(base) + len('.size()['):-1]}]"
        return None
    try:
        return {str(sym): lab for sym, sources in env.var_to_sources.items()
                if (lab := next((lab for s in sources if (lab := label_of(s.name))), None))}
    except Exception:  # noqa: BLE001 - torch's shape environment is internal: its reading is best effort
        return {}


def _render(guard, labels: dict[str, str]) -> str:
    """A guard as the caller's dimensions: ``x[0] == 4``, with the torch function that asked for it."""
    expr = guard.expr
    text = f"{expr.lhs} == {expr.rhs}" if type(expr).__name__ == "Equality" else str(expr)
    for sym in sorted(labels, key=len, reverse=True):
        text = text.replace(sym, labels[sym])
    where = getattr(getattr(guard.sloc, "framework_loc", None), "name", None)
    return f"{text}{f' (in torch {where})' if where else ''}"


def _pinning_guard(env, symbol):
    """A guard tying ``symbol`` with other input sizes to a constant (``Eq(64*s0*s1, 2048)``), or None."""
    try:
        for guard in env.guards:
            expr = guard.expr.xreplace(env.replacements)
            if symbol in expr.free_symbols and type(expr).__name__ == "Equality" and not expr.has(sympy_mod()) \
                    and any(side.is_Number for side in (expr.lhs, expr.rhs)) and len(expr.free_symbols) >= 2:
                return guard
    except Exception:  # noqa: BLE001 - best effort, as above
        return None
    return None


def sympy_mod():
    from torch.utils._sympy.functions import Mod
    return Mod


def _why_fixed(env, labels: dict[str, str], source: str, size: int) -> str:
    """Why export fixed the dimension ``source`` names: the 0/1 rule, or the first guard the model's code put on it."""
    if size <= 1:
        return f"stayed at {size}: torch.export keeps sizes 0 and 1 of the example static (trace with 2 or more)"
    try:
        mine = next(sym for sym, sources in env.var_to_sources.items() if any(s.name == source for s in sources))
        guard = next(g for g in env.guards if mine in g.expr.free_symbols)
    except Exception:  # noqa: BLE001 - torch's shape environment is internal: its reading is best effort
        return (f"stayed at {size}: the model's code fixes it (a reshape or view to a constant size, a fixed-size "
                "buffer, or a dimension of another input that is fixed)")
    return f"stayed at {size}: the traced code requires {_render(guard, labels)}"


def _check_dynamic_shapes(module, example_inputs, example_kwargs, shapes: dict) -> None:
    """Refuse a ``dynamic`` dict that names a parameter forward does not have, or a dimension its input lacks (export
    would ignore it, and the model would take one shape where the caller asked for more)."""
    params = inspect.signature(module.forward).parameters
    bound = inspect.signature(module.forward).bind(*example_inputs, **example_kwargs).arguments
    for name, spec in shapes.items():
        if name not in params and name not in example_kwargs:
            raise CaptureError(f"dynamic names {name!r}, which is no parameter of {type(module).__name__}.forward "
                               f"({', '.join(params)})")
        if name not in bound and name not in example_kwargs:
            raise CaptureError(f"dynamic names {name!r}, but the example inputs give no {name!r}")
        x = bound.get(name, example_kwargs.get(name))
        if not isinstance(x, torch.Tensor) or spec is None:
            continue
        if isinstance(spec, dict):
            bad = [d for d in spec if not isinstance(d, int) or isinstance(d, bool) or not 0 <= d < x.dim()]
            if bad:
                raise CaptureError(f"dynamic[{name!r}] names dimension {bad[0]!r}, but {name!r} has {x.dim()} "
                                   f"(shape {tuple(x.shape)}): name dimensions 0 to {x.dim() - 1}")
        elif isinstance(spec, (list, tuple)) and len(spec) != x.dim():
            raise CaptureError(f"dynamic[{name!r}] lists {len(spec)} dimensions, but {name!r} has {x.dim()} "
                               f"(shape {tuple(x.shape)})")


def _hint(size) -> int:
    """A dimension's size at the example inputs (symbolic ones by their hint)."""
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        if hint is None:
            raise CaptureError(f"size {size} has no value at the example inputs (data-dependent shapes are not "
                               "supported)")
        return int(hint)
    return int(size)


def _bound(value) -> int | None:
    """A range bound of a dynamic dimension as an int (None: unbounded)."""
    try:
        return int(value)
    except (TypeError, ValueError, AttributeError, OverflowError):
        return None


def _check_examples(module, example_inputs, example_kwargs) -> tuple[tuple, dict]:
    """Example inputs as export takes them, or a CaptureError that says what is wrong."""
    if isinstance(example_inputs, dict):
        raise CaptureError("example_inputs must be a tuple of positional inputs; pass keyword inputs as "
                           "example_kwargs={...}")
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise CaptureError(f"example_kwargs must be a dict of keyword inputs, got {type(example_kwargs).__name__}")
    example_inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    example_kwargs = dict(example_kwargs or {})
    try:
        inspect.signature(module.forward).bind(*example_inputs, **example_kwargs)
    except TypeError as exc:
        raise CaptureError(f"the example inputs do not fit {type(module).__name__}.forward"
                           f"{inspect.signature(module.forward)}: {exc}; sparta needs example_inputs "
                           "(and example_kwargs) it can call the model with") from None
    leaves, _ = pytree.tree_flatten((example_inputs, example_kwargs))
    for i, x in enumerate(leaves):
        if isinstance(x, np.ndarray):
            raise CaptureError(f"example input {i} is a numpy ndarray; convert it with torch.from_numpy")
        if isinstance(x, torch.Tensor):
            if x.device.type == "meta":
                raise CaptureError(f"example input {i} is on the meta device; sparta needs real example data")
            if x.numel() == 0:
                raise CaptureError(f"example input {i} is empty {tuple(x.shape)}; sparta specialises to the example "
                                   "shapes, so give a non-empty example of the shape you will run")
    return example_inputs, example_kwargs


@contextlib.contextmanager
def _eval_mode(module: torch.nn.Module):
    training = {m: m.training for m in module.modules()}
    if any(training.values()):
        warnings.warn(f"{type(module).__name__} is in train() mode; sparta compiles it in eval mode (dropout off, "
                      "batch-norm statistics fixed). Call model.eval() first to silence this.", UserWarning,
                      stacklevel=4)
        module.eval()
    try:
        yield
    finally:
        for m, mode in training.items():
            m.training = mode


def _refuse_mutation(ep, name: str) -> None:
    sig = ep.graph_signature
    for buffer in sig.buffers_to_mutate.values():
        raise CaptureError(f"{name} updates its buffer {buffer!r} in forward; sparta compiles inference graphs "
                           "whose state does not change: remove the update (or do it outside the model)")
    for user_input in sig.user_inputs_to_mutate.values():
        raise CaptureError(f"{name} writes into its input {user_input!r} in forward (an in-place op); sparta "
                           "compiles pure inference graphs: use an out-of-place op")


def _check_runs(module, example_inputs, example_kwargs, name: str) -> None:
    """Run the model once eagerly: export accepts inputs (int64 ids for a float layer) the model cannot run (a model
    on the meta device cannot run: its export's own checks stand)."""
    if any(p.is_meta for p in module.parameters()):
        return
    try:
        with torch.no_grad():
            module(*example_inputs, **example_kwargs)
    except Exception as exc:  # noqa: BLE001 - any failure means the examples do not fit the model
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in module.parameters() if p.is_floating_point()})
        given = sorted({str(x.dtype).removeprefix("torch.") for x in pytree.tree_leaves((example_inputs, example_kwargs))
                        if isinstance(x, torch.Tensor)})
        raise CaptureError(f"{name} fails on the example inputs ({type(exc).__name__}: {exc}); the inputs are "
                           f"{', '.join(given) or 'no tensors'}, the model's parameters {', '.join(dtypes) or 'none'}: "
                           "pass example inputs of the dtypes and shapes the model runs on") from exc


def _value_of(meta_val, name, kind, data=None, is_parameter=False):
    if not isinstance(meta_val, torch.Tensor):
        raise CaptureError(f"tensor {name!r}: expected a tensor, got {type(meta_val).__name__}")
    shape = tuple(_hint(s) for s in meta_val.shape)
    tesa = TeSA.dense(shape, bits_of_dtype(meta_val.dtype))
    return Value(name, shape, meta_val.dtype, kind, tesa, data=data, is_parameter=is_parameter)


def _source(node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    path = list(stack.values())[-1][0] if stack else ""
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    line = trace[-2].strip() if len(trace) >= 2 else ""
    return f"{path} {line}".strip()


def _build(ep, name: str) -> Graph:
    g = Graph(name)
    sig = ep.graph_signature
    kinds = torch.export.graph_signature.InputKind
    names: dict[str, str | list[str]] = {}  # fx node name -> tensor name (list for multi-output)
    leaves: list[str | None] = []
    state = {**ep.state_dict, **ep.constants}
    for spec in sig.input_specs:
        node_name = spec.arg.name
        if spec.kind == kinds.USER_INPUT:
            if isinstance(spec.arg, torch.export.graph_signature.TensorArgument):
                leaves.append(node_name)
            else:
                leaves.append(None)
            continue
        if spec.kind in (kinds.PARAMETER, kinds.BUFFER, kinds.CONSTANT_TENSOR):
            names[node_name] = spec.target
        else:
            raise CaptureError(f"unsupported exported input {node_name!r} of kind {spec.kind.name}")
    nodes = {n.name: n for n in ep.graph.nodes}
    dynamic: dict[str, list] = {}    # symbol -> [input, dim]
    uses: dict[str, list] = {}       # symbol -> every [input, dim] of that size
    tied = _tie(names, state, nodes)
    params = dict(ep.named_parameters())
    share = _shares_storage(state, names.values())
    for n in ep.graph.nodes:
        if n.op == "placeholder":
            if n.name in names:  # weight / buffer / constant
                target = names[n.name]
                if target in tied:
                    names[n.name] = tied[target]
                    continue
                # an own copy (later in-place updates of the source model do not reach the compiled one), except
                # for a model too large to hold twice: then the module's storage is shared (_shares_storage)
                data = state[target].detach() if share else state[target].detach().clone()
                g.add_tensor(_value_of(data, target, "weight", data=data, is_parameter=target in params))
            elif isinstance(n.meta.get("val"), torch.Tensor):
                names[n.name] = n.name
                g.add_tensor(_value_of(n.meta["val"], n.name, "input"))
                for d, size in enumerate(n.meta["val"].shape):
                    if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                        dynamic.setdefault(str(size.node.expr), [n.name, d])
                        uses.setdefault(str(size.node.expr), []).append([n.name, d])
        elif n.op == "call_function":
            val = n.meta.get("val")
            if isinstance(val, torch.SymInt):       # a size computed from the inputs' dynamic dimensions
                names[n.name] = SymRef(str(val.node.expr), _hint(val))
                continue
            if isinstance(val, (torch.SymBool, torch.SymFloat)) or n.target in TRACE_CHECKS and not n.users:
                continue                            # export's own checks on the dynamic dimensions
            if n.target is operator.getitem and isinstance(names.get(n.args[0].name), list):
                names[n.name] = names[n.args[0].name][n.args[1]]
                continue
            _add_call(g, n, names, nodes)
        elif n.op == "output":
            outs = []
            for a in pytree.tree_leaves(n.args[0]):
                if isinstance(a, torch.fx.Node):
                    outs.append(names[a.name])
                else:
                    raise CaptureError(f"model output {a!r} is not a tensor; sparta needs tensor outputs")
            g.outputs = outs
        elif n.op == "get_attr":
            raise CaptureError(f"unsupported get_attr node {n.target!r} (higher-order ops are not supported)")
    g.inputs = [leaf for leaf in leaves if leaf is not None]
    for alias, target in tied.items():
        g.add_alias(alias, target)
    g.meta["input_leaves"] = leaves
    if dynamic:
        ranges = {str(sym): [_bound(r.lower), _bound(r.upper)] for sym, r in ep.range_constraints.items()}
        _tie_batches(g, dynamic, uses, ranges)
        g.meta["dynamic_dims"] = dynamic
        g.meta["dim_uses"] = {sym: u for sym, u in uses.items() if len(u) > 1}
        g.meta["dim_ranges"] = {sym: r for sym, r in ranges.items() if sym in dynamic}
    g.meta["in_spec"], g.meta["out_spec"] = ep.call_spec.in_spec, ep.call_spec.out_spec
    for key, spec in (("in_spec", ep.call_spec.in_spec), ("out_spec", ep.call_spec.out_spec)):
        try:
            setattr(g, key, pytree.treespec_dumps(spec))
        except Exception:  # noqa: BLE001 - unserialisable custom containers: flat outputs on reload
            setattr(g, key, None)
    for t in g.outputs:
        v = g.tensor(t)
        if v.kind == "activation":
            v.kind = "output"
    g.validate()
    return g


def _tie_batches(g: Graph, dynamic: dict, uses: dict, ranges: dict) -> None:
    """Give two inputs that share a dynamic dimension besides the first (a mask's sequence and the ids') one batch
    symbol where export left their first dimensions apart at one size (BERT indexes its mask by the ids' batch, which
    bounds the mask's batch from below only): the compiled model then takes masks of the ids' batch, refuses others
    with a clear error, and counts each token once. In place: ``dynamic``, ``uses``, ``ranges`` and the ops' sizes."""
    dims = {name: {d: sym for sym, u in uses.items() for t, d in u if t == name} for name in g.inputs}
    rename: dict[str, str] = {}
    for i, first in enumerate(g.inputs):
        for other in g.inputs[i + 1:]:
            a, b = dims[first].get(0), dims[other].get(0)
            a = rename.get(a, a)
            shared = (set(dims[first].values()) - {a}) & (set(dims[other].values()) - {b})
            if a is None or b is None or a == b or b in rename or not shared \
                    or g.tensor(first).shape[0] != g.tensor(other).shape[0]:
                continue
            rename[b] = a
            uses[a] += uses.pop(b)
            dynamic.pop(b, None)
            kept, dropped = ranges.get(a, [None, None]), ranges.pop(b, [None, None])     # the tighter of both
            ranges[a] = [max((x for x in (kept[0], dropped[0]) if x is not None), default=None),
                         min((x for x in (kept[1], dropped[1]) if x is not None), default=None)]
    if not rename:
        return
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, rename)) + r")\b")

    def renamed(ref: SymRef) -> SymRef:
        return SymRef(pattern.sub(lambda m: rename[m.group(1)], ref.expr), ref.hint)
    for op in g.ops():
        op.args = pytree.tree_map_only(SymRef, renamed, op.args)
        op.kwargs = pytree.tree_map_only(SymRef, renamed, op.kwargs)


SHARE_BYTES = 1 << 30
"""A model whose weights, buffers and constants take more bytes than this is captured sharing their storage with the
module (no copy: a 7B model is 13.5 GB in bf16); the graph then reads what the module holds, and an in-place update of
the module after the compile reaches the dense ops of the compiled model (packed sparse weights are copies)."""


def _shares_storage(state: dict, targets) -> bool:
    """Whether :func:`_build` shares the module's tensors instead of copying them (:data:`SHARE_BYTES`)."""
    return sum(state[t].numel() * state[t].element_size() for t in set(targets)) > SHARE_BYTES


def _tie(names: dict, state: dict, nodes: dict) -> dict[str, str]:
    """Tied weights (one tensor under several names): alias → the one name the graph keeps,
    the first name the exported graph reads (so a TeSA on any owner's name reaches the shared tensor)."""
    groups: dict[tuple, list[str]] = {}
    for node_name, target in names.items():
        t = state[target]
        # meta tensors have no storage (every address is 0): one only ties to itself
        where = ("meta", id(t)) if t.is_meta else t.untyped_storage().data_ptr()
        key = (where, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        groups.setdefault(key, []).append(node_name)
    tied = {}
    for members in groups.values():
        if len(members) < 2:
            continue
        keep = next((m for m in members if nodes[m].users), members[0])
        tied.update({names[m]: names[keep] for m in members if m != keep})
    return tied


TRACE_CHECKS = tuple(getattr(torch.ops.aten, name).default for name in ("_assert_tensor_metadata", "_assert_async",
                                                                      "sym_constrain_range_for_size", "_assert_scalar")
                     if hasattr(torch.ops.aten, name))


def _add_call(g: Graph, n, names, nodes):
    def ref(node):
        t = names.get(node.name)
        if isinstance(t, SymRef):
            return t
        if not isinstance(t, str):
            raise CaptureError(f"op {n.name!r} reads {node.name!r}, which is not a tensor")
        return TensorRef(t)

    args = pytree.tree_map_only(torch.fx.Node, ref, n.args)
    kwargs = pytree.tree_map_only(torch.fx.Node, ref, n.kwargs)
    inputs, roles, attrs = bind_call(n.target, args, kwargs)
    val = n.meta.get("val")
    multi = isinstance(val, (list, tuple))
    if multi:
        users = {u.args[1]: u.name for u in n.users if u.target is operator.getitem}
        outs = [users.get(i, f"{n.name}.{i}") for i in range(len(val))]
        vals = list(val)
    else:
        outs, vals = [n.name], [val]
    for out, v in zip(outs, vals):
        if v is None:
            raise CaptureError(f"op {n.name!r} ({n.target}) has a non-tensor output; at {_source(n)}")
        g.add_tensor(_value_of(v, out, "activation"))
    g.add_op(Op(n.name, normalise_op_name(n.target), inputs, outs, attrs, roles, n.target, tuple(args),
                dict(kwargs), _source(n), multi_output=multi))
    names[n.name] = outs if multi else outs[0]
