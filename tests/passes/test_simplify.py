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
    model = tiny_bert()
    ids = torch.randint(0, 100, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0
    inputs, kwargs = (ids,), ({"attention_mask": mask} if padding else {})
    compiled = sparta.compile(model, {}, inputs, example_kwargs=kwargs)
    masks = [op.input_of("attn_mask") for op in compiled.graph.ops("scaled_dot_product_attention")]
    assert all(m is not None for m in masks) if padding else all(m is None for m in masks)
    with torch.no_grad():
        want = model(ids, **kwargs).last_hidden_state
        got = compiled(ids, **kwargs)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


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
    assert simple.meta["simplified"]["dropped_copies"]
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
