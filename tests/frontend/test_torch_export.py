import pytest
import torch
from models import MLP, SmallCNN, randomize_bn, tiny_bert

import sparta
from sparta import CaptureError, GraphError
from sparta.frontend.torch_export import KEEP, normalise_op_name


@pytest.fixture(scope="module")
def captured():
    torch.manual_seed(0)
    return {
        "mlp": (MLP().eval(), torch.randn(5, 24)),
        "cnn": (randomize_bn(SmallCNN()).eval(), torch.randn(2, 3, 15, 15)),
        "bert": (tiny_bert(), torch.randint(0, 100, (2, 11))),
    }


@pytest.mark.parametrize("key", ["mlp", "cnn", "bert"])
def test_compile_without_tesa_is_bitwise_identical(captured, key):
    model, x = captured[key]
    compiled = sparta.compile(model, {}, (x,))
    with torch.no_grad():
        want, got = model(x), compiled(x)
    if key == "bert":
        assert type(got) is type(want)
        assert torch.equal(got.last_hidden_state, want.last_hidden_state)
        assert torch.equal(got.pooler_output, want.pooler_output)
    elif key == "cnn":          # its BatchNorms fold into the convolutions: equal up to rounding
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(got, want)
    x2 = x.clone().random_(0, 100) if key == "bert" else torch.randn_like(x)
    with torch.no_grad():
        a, b = model(x2), compiled(x2)
    a, b = (a.last_hidden_state, b.last_hidden_state) if key == "bert" else (a, b)
    if key == "cnn":
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(a, b), "fresh inputs, same result"


def test_weights_are_named_by_state_dict(captured):
    model, x = captured["bert"]
    graph = sparta.capture(model, (x,))
    weights = {v.name for v in graph.tensors("weight")}
    assert {k for k, _ in model.named_parameters()} <= weights
    v = graph.tensor("encoder.layer.0.intermediate.dense.weight")
    assert v.kind == "weight" and v.is_parameter and v.shape == (128, 64) and v.dtype == torch.float32
    assert graph.tensor("input_ids").kind == "input" and graph.inputs == ["input_ids"]
    assert all(graph.tensor(o).kind == "output" for o in graph.outputs)
    ops = {o.op for o in graph.ops()}
    assert {"linear", "layer_norm", "scaled_dot_product_attention", "gelu", "embedding"} <= ops
    lin = next(graph.ops("linear"))
    assert lin.roles == ["input", "weight", "bias"] and "encoder.layer.0" in lin.source


def test_graph_structure(captured):
    model, x = captured["mlp"]
    g = sparta.capture(model, (x,))
    names = [o.name for o in g.ops()]
    assert names[0] == "linear" and g.producer("relu") == "relu" and g.consumers("relu") == ["linear_1"]
    assert "linear" in g.neighbors("relu") and "linear_1" in g.neighbors("relu")
    sub = g.subgraph(["relu", "linear_1"])
    assert [o.name for o in sub.ops()] == ["relu", "linear_1"] and sub.has_tensor("fc2.weight")
    assert not sub.has_tensor("fc3.weight")
    dot = g.to_dot()
    assert dot.startswith("digraph") and '"t:fc1.weight" -> "o:linear"' in dot
    g.validate()
    with pytest.raises(GraphError, match="did you mean 'fc1.weight'"):
        g.tensor("fc1.weigth")
    copy = g.copy()
    copy.set_tesa("fc1.weight", sparta.TeSA.pruned((48, 24)))
    assert g.tesa("fc1.weight").is_dense


def test_kept_ops_and_names():
    assert torch.ops.aten.linear.default in KEEP
    assert normalise_op_name(torch.ops.aten._softmax.default) == "softmax"
    assert normalise_op_name(torch.ops.aten.add.Tensor) == "add"


def test_uncapturable_model_names_the_line():
    class Bad(torch.nn.Module):
        def forward(self, x):
            if x.sum() > 0:          # data-dependent control flow
                return x * 2
            return x

    with pytest.raises(CaptureError, match="Bad") as info:
        sparta.capture(Bad(), (torch.randn(3),))
    assert "x.sum() > 0" in str(info.value) or "forward" in str(info.value)


def test_capture_rejects_non_models():
    with pytest.raises(CaptureError, match="torch.nn.Module"):
        sparta.capture(42, ())


def test_multi_output_and_kwargs():
    class M(torch.nn.Module):
        def forward(self, x, scale=1.0, *, bias=None):
            a, b = torch.split(x, 2, dim=1)
            return {"a": a * scale + bias, "b": b.relu()}

    m = M()
    x, bias = torch.randn(3, 4), torch.randn(3, 2)
    compiled = sparta.compile(m, {}, (x, 2.0), example_kwargs={"bias": bias})
    out = compiled(x, 2.0, bias=bias)
    assert set(out) == {"a", "b"} and torch.equal(out["a"], m(x, 2.0, bias=bias)["a"])
    with pytest.raises(sparta.SpartaError, match="shape"):
        compiled(torch.randn(5, 4), 2.0, bias=bias)
