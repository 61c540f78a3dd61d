"""Import an ONNX model into a sparta :class:`Graph`.

Each supported ONNX node becomes the ATen op with the same meaning (``MatMul`` →
``matmul``, ``Gemm`` with ``transB=1`` → ``linear``, ``Conv`` → ``conv2d`` …), so the
rest of sparta sees one vocabulary. Initializers (and ``Constant`` nodes) become weight
tensors named as in the ONNX file. Any other node is kept as an opaque op executed by
ONNX's reference evaluator, never dropped. Shapes come from running the graph once on
the example inputs (random data when none are given and the inputs are static).
TeSAs stored by :func:`sparta.frontend.onnx_export.to_onnx` are re-attached to the initializers holding
the weights they were computed for, and a user's parameter names are mapped onto renamed initializers
(:mod:`sparta.frontend.onnx_tesa`, :mod:`sparta.frontend.onnx_identity`).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from torch.utils import _pytree as pytree

from ..errors import CaptureError
from ..graph import Graph, Op, TensorRef, Value, bind_call, substitute
from ..tesa import TeSA, bits_of_dtype
from .onnx_tesa import TESA_PREFIX, attach, prepare

A = torch.ops.aten
_DTYPES = {onnx.TensorProto.FLOAT: torch.float32, onnx.TensorProto.FLOAT16: torch.float16,
           onnx.TensorProto.BFLOAT16: torch.bfloat16, onnx.TensorProto.DOUBLE: torch.float64,
           onnx.TensorProto.INT64: torch.int64, onnx.TensorProto.INT32: torch.int32,
           onnx.TensorProto.INT8: torch.int8, onnx.TensorProto.UINT8: torch.uint8,
           onnx.TensorProto.BOOL: torch.bool}


class OnnxNodeFunction:
    """Runs one ONNX node with ``onnx.reference`` (the fallback for unmapped ops)."""

    def __init__(self, node: onnx.NodeProto, opset: int):
        self.node_bytes = node.SerializeToString()
        self.opset = opset
        self.__name__ = f"onnx_{node.op_type}"
        self._evaluator = None

    def __call__(self, *inputs):
        if self._evaluator is None:
            from onnx.reference import ReferenceEvaluator
            node = onnx.NodeProto.FromString(self.node_bytes)
            self._evaluator = (ReferenceEvaluator(node, opsets={"": self.opset}), list(node.input))
        ev, names = self._evaluator
        feeds = {n: x.detach().cpu().numpy() for n, x in zip(names, inputs) if n}
        outs = ev.run(None, feeds)
        dev = inputs[0].device if inputs else "cpu"
        return tuple(torch.from_numpy(np.ascontiguousarray(o)).to(dev) for o in outs)


def _attrs(node) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _decode(v):
    return v.decode() if isinstance(v, bytes) else v


class _Importer:
    def __init__(self, model: onnx.ModelProto, example_inputs):
        self.model = model
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
        self.g = Graph(model.graph.name or "onnx")
        self.env: dict[str, torch.Tensor] = {}
        self.consts: dict[str, torch.Tensor] = {}
        self.example_inputs = example_inputs
        self.counter = 0
        self.op_names: set[str] = set()
        self.weights: set[str] = set()        # floating-point initializers: never folded away
        self.linears: dict[int, tuple] = {}   # MatMul node index -> (weight, bias, output, name)
        self.skip: set[int] = set()           # nodes another node's op covers

    # -- tensors ---------------------------------------------------------------------------
    def add_value(self, name, tensor, kind, data=None):
        self.env[name] = tensor
        tesa = TeSA.dense(tuple(tensor.shape), bits_of_dtype(tensor.dtype))
        self.g.add_tensor(Value(name, tuple(tensor.shape), tensor.dtype, kind, tesa, data=data,
                                is_parameter=kind == "weight" and tensor.dtype.is_floating_point))

    def weight(self, name, array):
        t = array if isinstance(array, torch.Tensor) else torch.from_numpy(np.array(array, copy=True))
        t = t.clone(memory_format=torch.contiguous_format) if t.numel() else torch.empty(t.shape, dtype=t.dtype)
        self.consts[name] = t
        self.add_value(name, t, "weight", data=t)

    def const(self, name):
        if name not in self.consts:
            raise CaptureError(f"ONNX input {name!r} must be a constant (initializer) here")
        return self.consts[name]

    # -- ops -------------------------------------------------------------------------------
    def emit(self, node, target, args, kwargs=None, op_name=None, outputs=None, multi=False):
        """Add one ATen-backed op; TensorRef leaves in args are its inputs."""
        kwargs = kwargs or {}
        outputs = outputs or list(node.output)
        inputs, roles, attrs = bind_call(target, args, kwargs)
        env = {name: self.env[name] for name in inputs}
        try:
            out = target(*substitute(args, env), **substitute(kwargs, env))
        except Exception as exc:  # noqa: BLE001 - report which node failed
            raise CaptureError(f"ONNX node {node.name or node.op_type!r} ({node.op_type}) failed: {exc}") from exc
        outs = list(out) if multi else [out]
        if inputs and node.op_type not in RANDOM and all(i in self.consts and i not in self.weights for i in inputs):
            for name, t in zip(outputs, outs):   # computed from constants alone (shapes, masks): a constant
                self.weight(name, t)
            return
        for name, t in zip(outputs, outs):
            self.add_value(name, t, "activation")
        name = op_name or node.name or f"{node.op_type.lower()}_{self.counter}"
        self.counter += 1
        while name in self.op_names:
            name = f"{name}_{self.counter}"
        self.op_names.add(name)
        self.g.add_op(Op(name, _op_name(target), inputs, outputs[:len(outs)], attrs, roles, target, tuple(args),
                         kwargs, f"onnx:{node.op_type}", multi_output=multi))

    def run(self):
        graph = self.model.graph
        for init in graph.initializer:
            self.weight(init.name, numpy_helper.to_array(init))
            if self.consts[init.name].dtype.is_floating_point:
                self.weights.add(init.name)
        self.find_linears()
        init_names = {i.name for i in graph.initializer}
        real_inputs = [i for i in graph.input if i.name not in init_names]
        examples = self.example_inputs
        if examples is None:
            examples = [_random_input(i) for i in real_inputs]
        if len(examples) != len(real_inputs):
            raise CaptureError(f"the ONNX model has {len(real_inputs)} inputs, got {len(examples)} example inputs")
        for info, x in zip(real_inputs, examples):
            self.add_value(info.name, torch.as_tensor(x), "input")
            self.g.inputs.append(info.name)
        for index, node in enumerate(graph.node):
            if index in self.skip:
                continue
            if index in self.linears:
                weight, bias, output, name = self.linears[index]
                self.emit(node, A.linear.default, (TensorRef(node.input[0]), TensorRef(weight),
                                                   TensorRef(bias) if bias else None), outputs=[output], op_name=name)
                continue
            handler = getattr(self, "op_" + node.op_type, None) if node.domain in ("", "ai.onnx") else None
            if handler is None or handler(node, _attrs(node)) is False:
                self.opaque(node)
        self.g.outputs = [o.name for o in graph.output]
        for t in self.g.outputs:
            if self.g.tensor(t).kind == "activation":
                self.g.tensor(t).kind = "output"
        self.g.meta["input_leaves"] = list(self.g.inputs)
        outs = self.g.outputs
        self.g.meta["out_spec"] = pytree.tree_structure(0 if len(outs) == 1 else tuple(range(len(outs))))
        self.g.out_spec = pytree.treespec_dumps(self.g.meta["out_spec"])
        self.g.validate()
        return self.g

    def find_linears(self):
        """``MatMul(x, Transpose(W))`` [+ ``Add(·, b)``] with W a 2-D initializer — how the exporter writes
        ``linear`` when it does not fold the transpose — becomes one ``linear`` op on W."""
        nodes = self.model.graph.node
        graph_outputs = {o.name for o in self.model.graph.output}
        readers: dict[str, list[int]] = {}
        for i, node in enumerate(nodes):
            for name in set(node.input):
                readers.setdefault(name, []).append(i)
        for t, node in enumerate(nodes):
            w = node.input[0] if node.op_type == "Transpose" and node.input else None
            if w not in self.weights or self.consts[w].dim() != 2 or list(_attrs(node).get("perm", [1, 0])) != [1, 0]:
                continue
            uses = readers.get(node.output[0], [])
            if node.output[0] in graph_outputs or not uses or any(
                    nodes[m].op_type != "MatMul" or list(nodes[m].input)[1:] != [node.output[0]] or
                    nodes[m].input[0] == node.output[0] for m in uses):
                continue
            self.skip.add(t)
            for m in uses:
                mm = nodes[m]
                bias, output, name = None, mm.output[0], mm.name or None
                after = readers.get(mm.output[0], [])
                if len(after) == 1 and mm.output[0] not in graph_outputs and nodes[after[0]].op_type == "Add":
                    add = nodes[after[0]]
                    other = [i for i in add.input if i != mm.output[0]]
                    if len(other) == 1 and other[0] in self.consts and tuple(self.consts[other[0]].shape) == (
                            self.consts[w].shape[0],):
                        bias, output, name = other[0], add.output[0], add.name or name
                        self.skip.add(after[0])
                self.linears[m] = (w, bias, output, name)

    def opaque(self, node):
        fn = OnnxNodeFunction(node, self.opset)
        args = tuple(TensorRef(i) for i in node.input if i)
        outputs = [o or f"{node.name or node.op_type}.unused{i}" for i, o in enumerate(node.output)]
        self.emit(node, fn, args, multi=True, outputs=outputs)

    # one handler per supported ONNX op; returning False falls back to an opaque node
    def op_MatMul(self, n, a):
        self.emit(n, A.matmul.default, (TensorRef(n.input[0]), TensorRef(n.input[1])))

    def op_Gemm(self, n, a):
        alpha, beta = a.get("alpha", 1.0), a.get("beta", 1.0)
        x, w = TensorRef(n.input[0]), TensorRef(n.input[1])
        bias = TensorRef(n.input[2]) if len(n.input) > 2 and n.input[2] else None
        if a.get("transA", 0) or alpha != 1.0 or (bias is not None and beta != 1.0):
            return False
        if a.get("transB", 0):
            self.emit(n, A.linear.default, (x, w, bias))
        elif bias is not None:
            self.emit(n, A.addmm.default, (bias, x, w))
        else:
            self.emit(n, A.mm.default, (x, w))

    def op_Conv(self, n, a):
        rank = len(self.env[n.input[1]].shape) - 2
        pads = list(a.get("pads", [0] * 2 * rank))
        if _decode(a.get("auto_pad", "NOTSET")) not in ("NOTSET", "VALID") or pads[:rank] != pads[rank:] \
                or rank not in (1, 2, 3):
            return False
        bias = TensorRef(n.input[2]) if len(n.input) > 2 and n.input[2] else None
        target = {1: A.conv1d.default, 2: A.conv2d.default, 3: A.conv3d.default}[rank]
        self.emit(n, target, (TensorRef(n.input[0]), TensorRef(n.input[1]), bias, list(a.get("strides", [1] * rank)),
                              pads[:rank], list(a.get("dilations", [1] * rank)), a.get("group", 1)))

    def _binary(self, n, target):
        self.emit(n, target, (TensorRef(n.input[0]), TensorRef(n.input[1])))

    def op_Add(self, n, a): self._binary(n, A.add.Tensor)
    def op_Sub(self, n, a): self._binary(n, A.sub.Tensor)
    def op_Mul(self, n, a): self._binary(n, A.mul.Tensor)
    def op_Div(self, n, a): self._binary(n, A.div.Tensor)
    def op_Pow(self, n, a): self._binary(n, A.pow.Tensor_Tensor)

    def _unary(self, n, target, *extra):
        self.emit(n, target, (TensorRef(n.input[0]), *extra))

    def op_Relu(self, n, a): self._unary(n, A.relu.default)
    def op_Erf(self, n, a): self._unary(n, A.erf.default)
    def op_Tanh(self, n, a): self._unary(n, A.tanh.default)
    def op_Sigmoid(self, n, a): self._unary(n, A.sigmoid.default)
    def op_Sqrt(self, n, a): self._unary(n, A.sqrt.default)
    def op_Identity(self, n, a): self._unary(n, A.clone.default)
    def op_Dropout(self, n, a):
        if len(n.output) > 1 and n.output[1]:
            return False
        self._unary(n, A.clone.default)

    def op_Gelu(self, n, a):
        self.emit(n, A.gelu.default, (TensorRef(n.input[0]),), {"approximate": _decode(a.get("approximate", "none"))})

    def op_Softmax(self, n, a):
        axis = a.get("axis", -1 if self.opset >= 13 else 1)
        if self.opset < 13 and axis != len(self.env[n.input[0]].shape) - 1:
            return False
        self._unary(n, A.softmax.int, axis)

    def op_LayerNormalization(self, n, a):
        x = self.env[n.input[0]]
        axis = a.get("axis", -1) % x.dim()
        if len(n.output) > 1 and any(n.output[1:]):
            return False
        w = TensorRef(n.input[1]) if len(n.input) > 1 and n.input[1] else None
        b = TensorRef(n.input[2]) if len(n.input) > 2 and n.input[2] else None
        self.emit(n, A.layer_norm.default, (TensorRef(n.input[0]), list(x.shape[axis:]), w, b,
                                             a.get("epsilon", 1e-5)), outputs=[n.output[0]])

    def op_Transpose(self, n, a):
        perm = a.get("perm", list(reversed(range(self.env[n.input[0]].dim()))))
        self._unary(n, A.permute.default, list(perm))

    def op_Reshape(self, n, a):
        x = self.env[n.input[0]]
        shape = [int(s) for s in self.const(n.input[1]).tolist()]
        if not a.get("allowzero", 0):
            shape = [x.shape[i] if s == 0 else s for i, s in enumerate(shape)]
        self._unary(n, A.reshape.default, shape)

    def op_Flatten(self, n, a):
        x = self.env[n.input[0]]
        axis = a.get("axis", 1) % max(x.dim(), 1)
        self._unary(n, A.reshape.default, [math.prod(x.shape[:axis]), math.prod(x.shape[axis:])])

    def op_Constant(self, n, a):
        value = a.get("value")
        if value is None:   # value_float(s) / value_int(s) / sparse_value: onnx evaluates them
            self.weight(n.output[0], OnnxNodeFunction(n, self.opset)()[0])
        else:
            self.weight(n.output[0], numpy_helper.to_array(value))

    def op_Shape(self, n, a):   # sparta specialises to the example shapes: a shape is a constant
        shape = list(self.env[n.input[0]].shape)
        self.weight(n.output[0], torch.tensor(shape[a.get("start", 0):a.get("end", len(shape))], dtype=torch.int64))

    def op_Size(self, n, a):
        self.weight(n.output[0], torch.tensor(self.env[n.input[0]].numel(), dtype=torch.int64))

    def op_Concat(self, n, a):
        self.emit(n, A.cat.default, ([TensorRef(i) for i in n.input], a.get("axis", 0)))

    def op_Gather(self, n, a):
        if a.get("axis", 0) != 0 or n.input[0] not in self.consts:
            return False
        self.emit(n, A.embedding.default, (TensorRef(n.input[0]), TensorRef(n.input[1])))

    def op_GatherElements(self, n, a):
        # torch.gather, not onnx.reference (whose GatherElements mis-handles more than 32 choices)
        data, index = n.input[0], n.input[1]
        axis = a.get("axis", 0) % max(self.env[data].dim(), 1)
        if index in self.consts and bool((self.consts[index] >= 0).all()):
            self.emit(n, A.gather.default, (TensorRef(data), axis, TensorRef(index)))
            return
        wrapped = f"{n.output[0]}.index"   # ONNX allows negative indices; torch.gather does not
        self.emit(n, A.remainder.Scalar, (TensorRef(index), self.env[data].shape[axis]), outputs=[wrapped],
                  op_name=f"{n.name or 'gather_elements'}.wrap")
        self.emit(n, A.gather.default, (TensorRef(data), axis, TensorRef(wrapped)))

    def op_MaxPool(self, n, a):
        k = list(a["kernel_shape"])
        pads = list(a.get("pads", [0] * 2 * len(k)))
        if len(k) != 2 or pads[:2] != pads[2:] or a.get("ceil_mode", 0) or len(n.output) > 1:
            return False
        self._unary(n, A.max_pool2d.default, k, list(a.get("strides", [1, 1])), pads[:2],
                    list(a.get("dilations", [1, 1])))

    def op_AveragePool(self, n, a):
        k = list(a["kernel_shape"])
        pads = list(a.get("pads", [0] * 2 * len(k)))
        if len(k) != 2 or pads[:2] != pads[2:] or a.get("ceil_mode", 0):
            return False
        self._unary(n, A.avg_pool2d.default, k, list(a.get("strides", [1, 1])), pads[:2], False,
                    bool(a.get("count_include_pad", 0)))

    def op_GlobalAveragePool(self, n, a):
        if self.env[n.input[0]].dim() != 4:
            return False
        self._unary(n, A.adaptive_avg_pool2d.default, [1, 1])

    def op_BatchNormalization(self, n, a):
        if a.get("training_mode", 0) or len(n.output) > 1:
            return False
        x, s, b, m, v = (TensorRef(i) for i in n.input[:5])
        self.emit(n, A.batch_norm.default, (x, s, b, m, v, False, a.get("momentum", 0.9), a.get("epsilon", 1e-5),
                                             False))


RANDOM = ("RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli")


def _op_name(target):
    from .torch_export import normalise_op_name
    return normalise_op_name(target)


def _random_input(info) -> torch.Tensor:
    tt = info.type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
    if any(d is None for d in dims):
        raise CaptureError(f"ONNX input {info.name!r} has a dynamic shape; pass example_inputs")
    dtype = _DTYPES.get(tt.elem_type)
    if dtype is None:
        raise CaptureError(f"ONNX input {info.name!r}: unsupported element type {tt.elem_type}")
    if dtype.is_floating_point:
        return torch.randn(dims, generator=torch.Generator().manual_seed(0)).to(dtype)
    return torch.zeros(dims, dtype=dtype)


def from_onnx(model_or_path, example_inputs=None, *, parameters=None) -> Graph:
    """Import an ONNX ``ModelProto`` or file; ``example_inputs`` fix dynamic shapes.

    ``parameters`` (a ``state_dict``, or the module) names the file's initializers after the parameters
    whose values they hold, as they are or transposed: ``graph.tesa("fc.weight")`` then reaches an
    initializer the exporter called ``val_12``. Initializers the exporter merged because several
    parameters were equal are split by the module each reader was exported from."""
    owned = not isinstance(model_or_path, onnx.ModelProto)
    try:
        model = model_or_path if not owned else onnx.load(str(model_or_path))
    except Exception as exc:  # noqa: BLE001 - unreadable file
        raise CaptureError(f"cannot read ONNX model {model_or_path!r}: {exc}") from exc
    if example_inputs is not None and not isinstance(example_inputs, (list, tuple)):
        example_inputs = (example_inputs,)
    model, plan = prepare(model, owned, parameters)
    with torch.no_grad():
        graph = _Importer(model, example_inputs).run()
    return attach(graph, plan)


__all__ = ["from_onnx", "TESA_PREFIX", "OnnxNodeFunction"]
