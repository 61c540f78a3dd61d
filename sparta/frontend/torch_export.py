"""Capture a ``torch.nn.Module`` into a sparta :class:`Graph` through ``torch.export``.

The exported program is decomposed to core ATen, except the ops in :data:`KEEP`: those
are the high-level ops sparta has rules and kernels for (a ``linear`` stays a
``linear``, not ``permute`` + ``addmm``). Weights, buffers and lifted constants become
``weight`` tensors named by their ``state_dict`` name. ``operator.getitem`` on a
multi-output op is not an op: it names one of that op's outputs.
"""

from __future__ import annotations

import operator

import torch
from torch.utils import _pytree as pytree

from ..errors import CaptureError
from ..graph import Graph, Op, TensorRef, Value, bind_call
from ..tesa import TeSA, bits_of_dtype

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


def from_torch(module: torch.nn.Module, example_inputs=(), example_kwargs=None, *, name=None) -> Graph:
    """Export ``module`` on ``example_inputs`` and build a graph with dense TeSAs."""
    if not isinstance(module, torch.nn.Module):
        raise CaptureError(f"from_torch needs a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    try:
        ep = torch.export.export(module, example_inputs, example_kwargs or {}, strict=False)
        table = torch.export.default_decompositions()
        for op in KEEP:
            table.pop(op, None)
        ep = ep.run_decompositions(table)
    except Exception as exc:  # noqa: BLE001 - export errors come in many types; all mean "cannot capture"
        raise CaptureError(f"torch.export could not capture {type(module).__name__}: "
                           f"{type(exc).__name__}: {exc}") from exc
    return _build(ep, name or type(module).__name__)


def _value_of(meta_val, name, kind, data=None, is_parameter=False):
    if not isinstance(meta_val, torch.Tensor):
        raise CaptureError(f"tensor {name!r}: expected a tensor, got {type(meta_val).__name__}")
    shape = tuple(int(s) for s in meta_val.shape)
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
    tied = _tie(names, state, nodes)
    params = dict(ep.named_parameters())
    for n in ep.graph.nodes:
        if n.op == "placeholder":
            if n.name in names:  # weight / buffer / constant
                target = names[n.name]
                if target in tied:
                    names[n.name] = tied[target]
                    continue
                # an own copy: later in-place updates of the source model do not reach the compiled one
                data = state[target].detach().clone()
                g.add_tensor(_value_of(data, target, "weight", data=data, is_parameter=target in params))
            elif isinstance(n.meta.get("val"), torch.Tensor):
                names[n.name] = n.name
                g.add_tensor(_value_of(n.meta["val"], n.name, "input"))
        elif n.op == "call_function":
            if n.target is operator.getitem and isinstance(names.get(n.args[0].name), list):
                names[n.name] = names[n.args[0].name][n.args[1]]
                continue
            if n.target in TRACE_CHECKS and not n.users:   # export's own shape/dtype checks: nothing to run
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


def _tie(names: dict, state: dict, nodes: dict) -> dict[str, str]:
    """Tied weights (one tensor under several names): alias → the one name the graph keeps,
    the first name the exported graph reads (so a TeSA on any owner's name reaches the shared tensor)."""
    groups: dict[tuple, list[str]] = {}
    for node_name, target in names.items():
        t = state[target]
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        groups.setdefault(key, []).append(node_name)
    tied = {}
    for members in groups.values():
        if len(members) < 2:
            continue
        keep = next((m for m in members if nodes[m].users), members[0])
        tied.update({names[m]: names[keep] for m in members if m != keep})
    return tied


TRACE_CHECKS = tuple(getattr(torch.ops.aten, name).default for name in ("_assert_tensor_metadata", "_assert_async",
                                                                      "sym_constrain_range_for_size")
                     if hasattr(torch.ops.aten, name))


def _add_call(g: Graph, n, names, nodes):
    def ref(node):
        t = names.get(node.name)
        if not isinstance(t, str):
            raise CaptureError(f"op {n.name!r} reads {node.name!r}, which is not a tensor")
        return t

    args = pytree.tree_map_only(torch.fx.Node, lambda a: TensorRef(ref(a)), n.args)
    kwargs = pytree.tree_map_only(torch.fx.Node, lambda a: TensorRef(ref(a)), n.kwargs)
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
