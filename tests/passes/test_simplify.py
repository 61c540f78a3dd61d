"""Simplification: attention masks that mask nothing are dropped, any other mask stays."""

import pytest
import torch
import torch.nn.functional as F
from models import tiny_bert

import sparta
from sparta.passes.simplify import drop_copies, drop_trivial_masks


class Attention(torch.nn.Module):
    def __init__(self, mask_kind):
        super().__init__()
        self.mask_kind = mask_kind

    def forward(self, q):
        n = q.shape[-2]
        if self.mask_kind == "all_true":
            mask = (torch.arange(n) >= 0)[None, None, :, None].expand(q.shape[0], 1, n, n)
        elif self.mask_kind == "zeros":
            mask = torch.zeros(n, n, dtype=q.dtype)
        else:                                       # causal: masks half the scores
            mask = torch.ones(n, n, dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(q, q * 2, q + 1, attn_mask=mask)


@pytest.mark.parametrize("kind,dropped", [("all_true", True), ("zeros", True), ("causal", False)])
def test_only_masks_that_keep_everything_are_dropped(kind, dropped):
    model, q = Attention(kind), torch.randn(2, 3, 7, 8)
    graph = sparta.capture(model, (q,))
    simple = drop_trivial_masks(graph)
    sdpa = next(simple.ops("scaled_dot_product_attention"))
    assert (sdpa.input_of("attn_mask") is None) == dropped
    if dropped:
        assert len(simple) < len(graph), "the ops that only built the mask are gone"
    else:
        assert simple is graph
    compiled = sparta.compile(model, {}, (q,))
    torch.testing.assert_close(compiled(x := torch.randn(2, 3, 7, 8)), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("padding", [False, True])
def test_bert_mask_from_constants_is_dropped_a_real_padding_mask_is_not(padding):
    """Compiled for its example's shapes, BERT's all-true mask goes; compiled for any shape it stays in the graph and
    the runtime drops it per shape (its sizes change it); a padding mask is an input and stays."""
    from sparta.templates.attention.runtime import SizesOnlyMaskAttention
    model = tiny_bert()
    ids = torch.randint(0, 100, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0
    inputs, kwargs = (ids,), ({"attention_mask": mask} if padding else {})
    for dynamic in (False, None):
        compiled = sparta.compile(model, {}, inputs, example_kwargs=kwargs, dynamic=dynamic)
        masks = [op.input_of("attn_mask") for op in compiled.graph.ops("scaled_dot_product_attention")]
        assert all(m is not None for m in masks) if padding or dynamic is None else all(m is None for m in masks)
        per_shape = [m for m in compiled.module_replacements().values() if isinstance(m, SizesOnlyMaskAttention)]
        assert len(per_shape) == (len(masks) if dynamic is None and not padding else 0)
        with torch.no_grad():
            want = model(ids, **kwargs).last_hidden_state
            got = compiled(ids, **kwargs)[0]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert all(c == "none" for m in per_shape for c in m.classes.values())


class SlidingWindow(torch.nn.Module):
    def forward(self, q):
        i = torch.arange(q.shape[-2])
        keep = i[:, None] - i[None, :] < 6            # a window of 6 past keys (and every future one): all true below 7
        return F.scaled_dot_product_attention(q, q * 2, q + 1, attn_mask=keep)


def test_a_mask_of_a_dynamic_size_is_not_judged_at_the_example_alone():
    """All true at the example's length, a window further on: dropping it at compile time would be wrong at 20."""
    model = SlidingWindow()
    compiled = sparta.compile(model, {}, (torch.randn(2, 3, 5, 8),), dynamic={"q": {2: torch.export.Dim("n")}})
    assert next(compiled.graph.ops("scaled_dot_product_attention")).input_of("attn_mask") is not None
    for n in (5, 20):
        x = torch.randn(2, 3, n, 8)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)


class CopyChain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(12, 6)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        h = self.drop(torch.relu(x)).clone()
        return self.fc(h), h.detach() * 2


def test_copies_are_dropped_their_readers_read_the_source():
    model, x = CopyChain().eval(), torch.randn(3, 12)
    graph = sparta.capture(model, (x,))
    assert any(op.op in ("clone", "detach", "alias") for op in graph.ops()), "the capture keeps the copies"
    simple = drop_copies(graph)
    assert not any(op.op in ("clone", "detach", "alias") for op in simple.ops())
    relu = next(simple.ops("relu")).outputs[0]
    assert next(simple.ops("linear")).input_of("input") == relu
    assert simple.simplified.dropped_copies
    compiled = sparta.compile(model, {}, (x,))
    y = torch.randn(3, 12)
    for got, want in zip(compiled(y), model(y)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_a_copy_with_its_own_tesa_stays():
    model, x = CopyChain().eval(), torch.randn(3, 12)
    graph = sparta.capture(model, (x,))
    clone = next(op for op in graph.ops() if op.op in ("clone", "alias", "detach"))
    mask = torch.rand(graph.tensor(clone.outputs[0]).shape) < 0.5
    graph.set_tesa(clone.outputs[0], sparta.TeSA.from_mask(mask))
    assert clone.name in {op.name for op in drop_copies(graph).ops()}


class Siblings(torch.nn.Module):
    """q/k/v-like linears on one input (biased), a gate/up-like pair (no bias), one linear of its own, and a linear on
    the same input whose output is a model output (kept alone)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(64, 64) for _ in range(3))
        self.gate, self.up = torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(64, 96, bias=False)
        self.down = torch.nn.Linear(96, 64)

    def forward(self, x):
        a = self.q(x) * self.k(x) + self.v(x)
        return self.down(torch.relu(self.gate(a)) * self.up(a))


def test_sibling_linears_run_as_one_linear_over_stacked_weights():
    """Linears reading one input become one linear over their weights (and biases, and TeSAs) stacked along N, each
    former output a slice of its output: the same outputs, fewer linears."""
    from sparta.backend.fx import to_graph_module
    from sparta.passes.simplify import fuse_sibling_linears
    torch.manual_seed(0)
    model, x = Siblings().eval(), torch.randn(2, 5, 64)
    graph = sparta.capture(model, (x,), dynamic=True)
    keep = torch.rand(96, 64) < 0.5
    graph.set_tesa("up.weight", sparta.TeSA.from_mask(keep))
    fused = fuse_sibling_linears(graph)
    assert sorted(fused.simplified.stacked_linears.values()) == [["linear", "linear_1", "linear_2"],
                                                                            ["linear_3", "linear_4"]]
    assert len(list(fused.ops("linear"))) == 3 and len(list(fused.ops("slice"))) == 5
    qkv, gate_up = fused.tensor("q+k+v.weight"), fused.tensor("gate+up.weight")
    assert qkv.shape == (192, 64) and fused.tensor("q+k+v.bias").shape == (192,) and gate_up.shape == (192, 64)
    assert torch.equal(gate_up.data, torch.cat([model.gate.weight, model.up.weight]).detach())
    assert torch.equal(fused.tesa(gate_up.name).mask, torch.cat([torch.ones(96, 64, dtype=torch.bool), keep]))
    assert "q.weight" not in {v.name for v in fused.tensors("weight")}
    masked = dict(up=model.up.weight * keep)
    with torch.no_grad():
        model.up.weight.copy_(masked["up"])
        for shape in ((2, 5, 64), (1, 1, 64), (3, 7, 64)):
            y = torch.randn(shape)
            got = to_graph_module(fused, {n: fused.tesa(n).apply(v.data) for n, v in
                                          ((v.name, v) for v in fused.tensors("weight"))})(y)
            torch.testing.assert_close(got[0], model(y), rtol=1e-5, atol=1e-5)
    lone = sparta.capture(torch.nn.Linear(8, 8), (torch.randn(2, 8),))
    assert fuse_sibling_linears(lone) is lone, "nothing to stack: the graph itself"
