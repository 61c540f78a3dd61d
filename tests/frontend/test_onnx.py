import onnx
import pytest
import torch
from models import MLP, SmallCNN, randomize_bn
from onnx import TensorProto, helper, numpy_helper

import sparta
from sparta import CaptureError, TeSA


def _init(name, array):
    return numpy_helper.from_array(array.numpy(), name)


def handmade_model():
    """MatMul, Gemm, Add, Mul, Relu, Gelu, Erf, Softmax, LayerNormalization, Transpose, Reshape, Conv + CumSum."""
    g = torch.Generator().manual_seed(0)
    W = torch.randn(8, 6, generator=g)
    G = torch.randn(5, 6, generator=g)
    Gb = torch.randn(5, generator=g)
    ln_w, ln_b = torch.randn(5, generator=g), torch.randn(5, generator=g)
    K = torch.randn(2, 1, 3, 3, generator=g)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["mm"]),
        helper.make_node("Gemm", ["mm", "G", "Gb"], ["gemm"], transB=1),
        helper.make_node("Relu", ["gemm"], ["r"]),
        helper.make_node("Gelu", ["r"], ["ge"]),
        helper.make_node("Erf", ["ge"], ["erf"]),
        helper.make_node("Mul", ["erf", "ge"], ["mul"]),
        helper.make_node("Add", ["mul", "r"], ["add"]),
        helper.make_node("LayerNormalization", ["add", "ln_w", "ln_b"], ["ln"], axis=-1, epsilon=1e-5),
        helper.make_node("Softmax", ["ln"], ["sm"], axis=-1),
        helper.make_node("Transpose", ["sm"], ["tr"], perm=[1, 0]),
        helper.make_node("Reshape", ["tr", "shape"], ["rs"]),
        helper.make_node("Conv", ["rs", "K"], ["conv"], pads=[1, 1, 1, 1]),
        helper.make_node("CumSum", ["conv", "axis"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes, "handmade", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 1, 5, 4])],
        [_init("W", W), _init("G", G), _init("Gb", Gb), _init("ln_w", ln_w), _init("ln_b", ln_b), _init("K", K),
         _init("shape", torch.tensor([1, 1, 5, 4])), _init("axis", torch.tensor(3))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    onnx.checker.check_model(model)

    def reference(x):
        h = torch.relu((x @ W) @ G.T + Gb)
        ge = torch.nn.functional.gelu(h)
        a = torch.erf(ge) * ge + h
        s = torch.softmax(torch.nn.functional.layer_norm(a, (5,), ln_w, ln_b, 1e-5), -1)
        c = torch.nn.functional.conv2d(s.T.reshape(1, 1, 5, 4), K, padding=1)
        return torch.cumsum(c, 3)
    return model, reference


def test_onnx_import_maps_ops_and_keeps_unknown_as_opaque(tmp_path):
    model, reference = handmade_model()
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    graph = sparta.from_onnx(path)
    ops = [o.op for o in graph.ops()]
    assert ops[:4] == ["matmul", "linear", "relu", "gelu"]
    assert {"erf", "mul", "add", "layer_norm", "softmax", "permute", "reshape", "conv2d"} <= set(ops)
    assert ops[-1] == "onnx_CumSum", "unsupported ops are kept as opaque nodes"
    assert graph.tensor("W").kind == "weight" and graph.tensor("x").kind == "input"
    x = torch.randn(4, 8)
    compiled = sparta.compile(path, {"W": TeSA.dense((8, 6))}, (x,))
    torch.testing.assert_close(compiled(x), reference(x), rtol=1e-5, atol=1e-5)


def test_onnx_masks_apply_by_initializer_name():
    model, reference = handmade_model()
    x = torch.randn(4, 8)
    mask = torch.rand(8, 6) < 0.5
    compiled = sparta.compile(model, {"W": TeSA.from_mask(mask)}, (x,), propagate=False)
    W = torch.from_numpy(numpy_helper.to_array(model.graph.initializer[0]).copy())
    assert not torch.equal(compiled(x), reference(x))
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array((W * mask).numpy(), "W"))
    masked_by_hand = sparta.compile(model, {}, (x,))
    torch.testing.assert_close(compiled(x), masked_by_hand(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("factory, shape", [(MLP, (3, 24)), (lambda: randomize_bn(SmallCNN()), (1, 3, 8, 8))])
def test_onnx_export_roundtrip_keeps_tesas(tmp_path, factory, shape):
    model = factory().eval()
    x = torch.randn(shape)
    name = "fc2.weight" if factory is MLP else "pw.weight"
    graph = sparta.capture(model, (x,))
    w = graph.tensor(name)
    mask = torch.rand(w.shape, generator=torch.Generator().manual_seed(1)) < 0.3
    graph.set_tesa(name, TeSA.from_mask(mask, bits=8))
    path = tmp_path / "out.onnx"
    sparta.to_onnx(graph, path)
    back = sparta.from_onnx(path, (x,))
    assert back.tesa(name) == graph.tesa(name)
    assert back.tensor(name).kind == "weight"
    want = sparta.compile(model, {name: graph.tesa(name)}, (x,))(x)   # the re-imported TeSA masks too
    torch.testing.assert_close(sparta.compile(str(path), {}, (x,))(x), want, rtol=1e-5, atol=1e-5)


def test_onnx_errors(tmp_path):
    with pytest.raises(CaptureError, match="cannot read"):
        sparta.from_onnx(tmp_path / "missing.onnx")
    model, _ = handmade_model()
    with pytest.raises(CaptureError, match="1 inputs, got 2"):
        sparta.from_onnx(model, (torch.randn(4, 8), torch.randn(1)))


def test_onnx_gather_elements_runs_as_torch_gather():
    """onnx.reference's GatherElements fails beyond 32 choices (BERT's token-type ids); negative indices wrap."""
    const = numpy_helper.from_array(torch.arange(64).reshape(1, 64).numpy(), "table")
    index = numpy_helper.from_array(torch.arange(40).reshape(1, 40).numpy(), "positions")
    nodes = [helper.make_node("GatherElements", ["table", "positions"], ["ids"], axis=1),
             helper.make_node("GatherElements", ["x", "idx"], ["y"], axis=1)]
    graph = helper.make_graph(
        nodes, "gather", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 50]),
                          helper.make_tensor_value_info("idx", TensorProto.INT64, [2, 3])],
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 40]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], [const, index])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    x, idx = torch.randn(2, 50), torch.tensor([[0, 45, -1], [-50, 3, 49]])
    back = sparta.from_onnx(model, (x, idx))
    ids, y = sparta.compile(model, {}, (x, idx))(x, idx)
    assert torch.equal(ids, torch.arange(40).reshape(1, 40))
    assert torch.equal(y, torch.gather(x, 1, idx % 50))
    assert "gather" in {o.op for o in back.ops()}
