"""The fixed point: whole-graph soundness, the paper's effects, user rules, reports, errors."""

import pytest
import torch
from models import MLP, SmallCNN, randomize_bn, tiny_bert

import sparta
from sparta import TeSA
from sparta.errors import PropagationError
from sparta.passes import propagate, rule, unregister


def run_masked(graph, inputs):
    """Interpret the graph with every tensor (weights, inputs, activations) masked by its TeSA."""
    env = {}
    for name, x in zip(graph.inputs, inputs):
        env[name] = x * graph.tesa(name).mask.to(x.dtype)
    for v in graph.tensors("weight"):
        env[v.name] = v.data * v.tesa.mask.to(v.data.dtype) if v.data.dtype != torch.bool else v.data & v.tesa.mask
    for op in graph.ops():
        for name, y in zip(op.outputs, op.call(env)):
            m = graph.tesa(name).mask
            env[name] = y * m.to(y.dtype) if y.dtype != torch.bool else y & m
    return [env[t] for t in graph.outputs]


def check_whole_graph(model, example, initial, trials=3):
    graph = sparta.capture(model, (example,))
    sparta.attach_tesa(graph, initial)
    reference = sparta.compile(model, initial, (example,), propagate=False)
    prop = propagate(graph)
    for seed in range(trials):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(example.shape, generator=gen) if example.dtype.is_floating_point else \
            torch.randint(0, int(example.max()) + 1, example.shape, generator=gen)
        with torch.no_grad():
            want = reference.module(x)
            got = run_masked(prop, [x])
        for name, a, b in zip(prop.outputs, got, want):
            m = prop.tesa(name).mask
            torch.testing.assert_close(a[m], b[m], rtol=1e-5, atol=1e-5)
    return prop


def block_mask(shape, block, density, seed):
    gen = torch.Generator().manual_seed(seed)
    keep = torch.rand(shape[0] // block, shape[1] // block, generator=gen) < density
    return keep.repeat_interleave(block, 0).repeat_interleave(block, 1)


def test_mlp_pruned_neurons_propagate_both_ways():
    model = MLP().eval()
    rows = torch.ones(48, 24, dtype=torch.bool)
    rows[:10] = False                       # fc1: neurons 0..9 removed (weights and bias)
    cols = torch.ones(48, 48, dtype=torch.bool)
    cols[:, 40:] = False                    # fc2 ignores hidden units 40..47
    prop = check_whole_graph(model, torch.randn(4, 24), {
        "fc1.weight": TeSA.from_mask(rows), "fc1.bias": TeSA.from_mask(torch.arange(48) >= 10),
        "fc2.weight": TeSA.from_mask(cols)})
    # forward: relu(fc1) is zero for 0..9, so fc2's columns 0..9 are irrelevant (input -> input)
    assert not prop.tesa("fc2.weight").mask[:, :10].any()
    # backward: fc2 never reads units 40..47, so fc1's rows 40..47 and bias are irrelevant
    assert not prop.tesa("fc1.weight").mask[40:].any()
    assert not prop.tesa("fc1.bias").mask[40:].any()
    assert prop.tesa("fc1.weight").mask[10:40].all()
    assert prop.tesa("relu").mask[:, 10:40].all() and not prop.tesa("relu").mask[:, :10].any()


def test_cnn_channel_pruning():
    model = randomize_bn(SmallCNN()).eval()
    keep = torch.arange(8) >= 3               # channels 0..2 pruned: conv1 filters and both BNs
    initial = {"conv1.weight": TeSA.from_mask(keep.reshape(8, 1, 1, 1).expand(8, 3, 3, 3)),
               "bn1.weight": TeSA.from_mask(keep), "bn1.bias": TeSA.from_mask(keep),
               "bn2.weight": TeSA.from_mask(keep), "bn2.bias": TeSA.from_mask(keep)}
    prop = check_whole_graph(model, torch.randn(2, 3, 16, 16), initial)
    # BN with pruned weight and bias maps its channel to exactly 0; depthwise keeps it 0
    assert not prop.tesa("relu").mask[:, :3].any() and prop.tesa("relu").mask[:, 3:].all()
    assert not prop.tesa("conv2d_1").mask[:, :3].any()
    # the depthwise filters of dead channels, BN statistics and pointwise columns are irrelevant
    assert not prop.tesa("dw.weight").mask[:3].any()
    assert not prop.tesa("bn2.running_mean").mask[:3].any()
    assert not prop.tesa("pw.weight").mask[:, :3].any() and prop.tesa("pw.weight").mask[:, 3:].all()


def test_bert_ffn_block_pruning_prunes_upstream_rows():
    model = tiny_bert()
    ids = torch.randint(0, 100, (2, 16))
    initial = {f"encoder.layer.{i}.output.dense.weight": TeSA.from_mask(block_mask((64, 128), 16, 0.4, i))
               for i in range(2)}
    prop = check_whole_graph(model, ids, initial)
    for i in range(2):
        w2 = initial[f"encoder.layer.{i}.output.dense.weight"].mask
        dead = ~w2.any(0)                     # FFN2 columns pruned everywhere
        w1 = prop.tesa(f"encoder.layer.{i}.intermediate.dense.weight").mask
        assert dead.any() and not w1[dead].any() and w1[~dead].all()


def test_residual_add_keeps_what_either_branch_needs():
    class Res(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 8)
            self.b = torch.nn.Linear(8, 8)

        def forward(self, x):
            h = torch.relu(self.a(x))
            return self.b(h) + h              # h has two consumers

    cols = torch.ones(8, 8, dtype=torch.bool)
    cols[:, :4] = False                       # b ignores h[:, :4], but the residual reads it
    prop = check_whole_graph(Res().eval(), torch.randn(3, 8), {"b.weight": TeSA.from_mask(cols)})
    assert prop.tesa("a.weight").is_dense and prop.tesa("relu").is_dense


def test_scramble_always_agrees_with_rules_on_mlp():
    model = MLP().eval()
    graph = sparta.capture(model, (torch.randn(4, 24),))
    graph.set_tesa("fc2.weight", TeSA.from_mask(block_mask((48, 48), 8, 0.5, 3)))
    by_rules = propagate(graph)
    by_scrambling = propagate(graph, scramble="always", trials=12)
    for v in by_rules.tensors():
        assert by_rules.tesa(v.name) == by_scrambling.tesa(v.name), v.name


def test_user_rule_overrides_and_bad_rule_raises():
    model = MLP().eval()
    graph = sparta.capture(model, (torch.randn(4, 24),))

    @rule("relu")
    def lying_rule(op, ins, outs):
        return ins, [TeSA.dense(outs[0].shape, 32)]   # returns outputs above what it was given

    try:
        graph.set_tesa("relu", TeSA.pruned(graph.tesa("relu").shape))
        with pytest.raises(PropagationError, match="raised output"):
            propagate(graph)
    finally:
        unregister("relu")
        from sparta.passes.rules import elementwise
        rule("relu")(elementwise.unary)


def test_report_and_stats():
    model = MLP().eval()
    graph = sparta.capture(model, (torch.randn(4, 24),))
    graph.set_tesa("fc3.weight", TeSA.from_mask(torch.arange(48).expand(10, 48) < 24))
    prop = propagate(graph)
    report = prop.propagation
    assert report.evaluations >= len(prop) and report.changes > 0
    assert "gelu" in report.table() and "fc2.weight" in report.changed()
    stats = {s["name"]: s for s in prop.tesa_stats()}
    assert stats["fc2.weight"]["density"] == pytest.approx(0.5)
    assert graph.tesa("fc2.weight").is_dense, "propagate works on a copy by default"


def test_bad_scramble_mode():
    graph = sparta.capture(MLP().eval(), (torch.randn(2, 24),))
    with pytest.raises(PropagationError):
        propagate(graph, scramble="sometimes")
