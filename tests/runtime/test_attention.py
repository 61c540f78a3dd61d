"""Attention whose mask is computed from sizes alone (``templates/attention/runtime.py``, ``codegen/select_attention.py``):
the class of a mask is sound (the specialised call equals the masked one), decided per shape, selected only where no
input's values reach the mask, and kept through torch.compile, export, save and load."""

import pytest
import torch
import torch.nn.functional as F
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

import sparta
from sparta.templates.attention.select import input_reaching
from sparta.templates.attention.runtime import SizesOnlyMaskAttention, classify_mask, in_layout, output_strides

MASKS = ("ones", "causal", "band", "causal_one_flip", "random", "float_zero", "float_causal", "float_bias", "keys_ones",
         "keys_padded")


def make_mask(kind: str, q_len: int, kv_len: int, gen: torch.Generator) -> torch.Tensor:
    causal = torch.ones(q_len, kv_len, dtype=torch.bool).tril()
    if kind == "ones":
        return torch.ones(q_len, kv_len, dtype=torch.bool)
    if kind == "keys_ones":                             # one row, broadcast over the queries
        return torch.ones(1, kv_len, dtype=torch.bool)
    if kind == "keys_padded":
        mask = torch.ones(1, kv_len, dtype=torch.bool)
        mask[0, kv_len - 1] = kv_len == 1               # the last key padded (unless it is the only one)
        return mask
    if kind == "causal":
        return causal
    if kind == "band":                                  # sliding window of 3: causal only while q_len <= 3
        return causal & ~torch.ones(q_len, kv_len, dtype=torch.bool).tril(-3)
    if kind == "causal_one_flip":
        mask = causal.clone()
        i = int(torch.randint(q_len, (1,), generator=gen))
        mask[i, min(i + 1, kv_len - 1)] = True          # one future key (or, at the edge, nothing) kept
        mask[i, 0] = True
        return mask
    if kind == "random":
        mask = torch.rand(q_len, kv_len, generator=gen) < 0.7
        mask[:, 0] = True                               # no row masked whole (sdpa would return NaN there)
        return mask
    zero = torch.zeros(q_len, kv_len)
    if kind == "float_zero":
        return zero
    if kind == "float_causal":
        return zero.masked_fill(~causal, float("-inf"))
    return torch.randn(q_len, kv_len, generator=gen)    # float_bias


def expected_class(kind: str, q_len: int, kv_len: int) -> str | None:
    causal = torch.ones(q_len, kv_len, dtype=torch.bool).tril()
    if kind in ("ones", "float_zero", "keys_ones") or kind == "keys_padded" and kv_len == 1 or \
            (kind in ("causal", "float_causal", "band") and bool(causal.all())):
        return "none"
    if kind in ("causal", "float_causal") or (kind == "band" and q_len <= 3):
        return "causal"
    return None if kind in ("causal_one_flip", "random", "keys_padded") else "mask"


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(MASKS), q_len=st.integers(1, 19), extra=st.integers(0, 5), batch=st.integers(1, 3),
       heads=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_a_mask_class_runs_the_same_attention_as_the_mask(kind, q_len, extra, batch, heads, seed):
    """Soundness: whatever class a mask gets, the call it allows equals sdpa with the mask (fresh random q, k, v)."""
    gen = torch.Generator().manual_seed(seed)
    kv_len = q_len + extra
    full = make_mask(kind, q_len, kv_len, gen)[None, None]         # broadcast over batch and heads, as graphs pass it
    q = torch.randn(batch, heads, q_len, 16, generator=gen)
    k, v = torch.randn(2, batch, heads, kv_len, 16, generator=gen)
    kind_of = classify_mask(full, q_len, kv_len)
    want = expected_class(kind, q_len, kv_len)
    assert kind_of == want or want is None and kind_of in ("none", "causal", "mask")
    module = SizesOnlyMaskAttention("attn", ["q", "k", "v", "mask"], scale=0.3)
    got = module(q, k, v, full)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, attn_mask=full, scale=0.3),
                               rtol=1e-5, atol=1e-5)
    assert got.stride() == output_strides(got.shape)


def test_each_shape_is_decided_once_and_on_its_own():
    """A sliding-window mask is causal at 3 tokens and not at 8: each shape gets its own class, reused after."""
    module = SizesOnlyMaskAttention("attn", ["q", "k", "v", "mask"])
    gen = torch.Generator().manual_seed(0)
    classes = {}
    for n in (3, 8, 3):
        mask = make_mask("band", n, n, gen)[None, None]
        q, k, v = torch.randn(3, 1, 2, n, 8, generator=gen)
        torch.testing.assert_close(module(q, k, v, mask), F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
        classes = {key[0][2]: c for key, c in module.classes.items()}
    assert classes == {3: "causal", 8: "mask"} and len(module.classes) == 2


def test_a_shape_first_met_in_a_capture_runs_masked_and_stays_undecided(monkeypatch):
    from sparta.templates.attention import runtime as attention
    module = SizesOnlyMaskAttention("attn", ["q", "k", "v", "mask"])
    q, k, v = torch.randn(3, 1, 2, 6, 8)
    mask = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    seen = []
    real_sdpa = F.scaled_dot_product_attention

    def sdpa(*args, **kwargs):
        seen.append("mask" if kwargs.get("attn_mask") is not None else "causal" if kwargs.get("is_causal") else "none")
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", sdpa)
    monkeypatch.setattr(attention, "capturing", lambda t: True)
    torch.testing.assert_close(module(q, k, v, mask), real_sdpa(q, k, v, attn_mask=mask))
    assert seen == ["mask"] and module.classes == {}, "no host read while capturing"
    monkeypatch.setattr(attention, "capturing", lambda t: False)
    module(q, k, v, mask)
    monkeypatch.setattr(attention, "capturing", lambda t: True)
    module(q, k, v, mask)
    assert seen == ["mask", "causal", "causal"], "a shape decided before the capture keeps its class in it"


def test_outputs_take_the_layout_the_fake_promises():
    q = torch.randn(2, 3, 5, 4)
    same = torch.randn(2, 5, 3, 4).transpose(1, 2)           # (B, L, H, E) in memory already
    assert in_layout(same).data_ptr() == same.data_ptr() and in_layout(same).stride() == output_strides(same.shape)
    moved = in_layout(q)                                      # contiguous (B, H, L, E): copied
    assert moved.stride() == output_strides(q.shape) and torch.equal(moved, q)
    one = torch.randn(2, 3, 1, 4)                             # one query: strides differ only where the size is 1
    assert in_layout(one).data_ptr() == one.data_ptr() and in_layout(one).stride() == output_strides(one.shape)
    with FakeTensorMode():
        fq = torch.empty(2, 3, 5, 4, device="cuda", dtype=torch.bfloat16)
        fv = torch.empty(2, 3, 7, 6, device="cuda", dtype=torch.bfloat16)
        module = SizesOnlyMaskAttention("attn", ["q", "k", "v", "mask"])
        (out,) = module.fake([fq, fv, fv, torch.empty(2, 1, 5, 7, dtype=torch.bool, device="cuda")])
        assert out.shape == (2, 3, 5, 6) and out.stride() == output_strides((2, 3, 5, 6)) and out.device.type == "cuda"


def test_the_attention_op_passes_opcheck():
    module = SizesOnlyMaskAttention("attn", ["q", "k", "v", "mask"], scale=0.25)
    q, k, v = torch.randn(3, 2, 4, 9, 16)
    mask = torch.ones(9, 9, dtype=torch.bool).tril()[None, None].expand(2, 1, 9, 9)
    torch.library.opcheck(torch.ops.sparta.attention.default, (module.kernel_key, [q, k, v, mask], []))


def tiny_llama(layers=2):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=2, num_key_value_heads=2, vocab_size=64, use_cache=False)
    return transformers.LlamaModel(cfg).eval()


@pytest.fixture(scope="module")
def llama():
    model = tiny_llama()
    return model, sparta.compile(model, {}, (torch.randint(0, 64, (2, 16)),))


def test_a_decoder_runs_causal_and_one_token_without_its_mask(llama, tmp_path):
    model, compiled = llama
    attn = [m for m in compiled.module_replacements().values() if isinstance(m, SizesOnlyMaskAttention)]
    assert len(attn) == 2 and all(m.input_names[4:] == compiled.graph.inputs for m in attn), "keyed on every size"
    report = compiled.plan_report()
    assert report.count("attention[float32]") == 2 and "its mask is computed from sizes alone" in report
    reference = compiled.reference()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for batch, seq in ((1, 1), (1, 7), (3, 16), (2, 33)):
            ids = torch.randint(0, 64, (batch, seq), generator=g)
            torch.testing.assert_close(compiled(ids).last_hidden_state, reference(ids)[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(compiled(ids).last_hidden_state, model(ids).last_hidden_state,
                                       rtol=1e-4, atol=1e-4)
    decided = {(key[0][0], key[0][2]): c for key, c in attn[0].classes.items()}
    assert decided == {(1, 1): "none", (1, 7): "causal", (3, 16): "causal", (2, 33): "causal"}
    ids = torch.randint(0, 64, (2, 9), generator=g)
    with torch.no_grad():
        want = compiled(ids).last_hidden_state
        torch.testing.assert_close(torch.compile(compiled, fullgraph=True)(ids).last_hidden_state, want)
        ep = torch.export.export(compiled, (ids,))
        assert sum("sparta.attention" in str(n.target) for n in ep.graph.nodes) == 2
    compiled.save(tmp_path / "saved")
    loaded = sparta.load(tmp_path / "saved")
    assert sum(isinstance(m, SizesOnlyMaskAttention) for m in loaded.module_replacements().values()) == 2
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).last_hidden_state, want)


def test_a_mask_from_an_input_or_from_random_numbers_is_not_taken():
    """BERT's all-true mask from sizes is taken; given the attention mask as an input, it is not."""
    model = transformers.BertModel(transformers.BertConfig(
        num_hidden_layers=1, hidden_size=64, num_attention_heads=2, intermediate_size=128, vocab_size=64,
        max_position_embeddings=64, attn_implementation="sdpa")).eval()
    ids = torch.randint(0, 64, (2, 12))
    alone = sparta.compile(model, {}, (ids,))
    assert "attention[float32]" in alone.plan_report()
    given_mask = sparta.compile(model, {}, (), example_kwargs={"input_ids": ids,
                                                                "attention_mask": torch.ones(2, 12, dtype=torch.long)})
    sdpa = next(given_mask.graph.ops("scaled_dot_product_attention"))
    assert "input" in input_reaching(given_mask.graph, sdpa.input_of("attn_mask"))
    assert "attention[" not in given_mask.plan_report()
    assert not any(isinstance(m, SizesOnlyMaskAttention) for m in given_mask.module_replacements().values())

    class NoisyMask(torch.nn.Module):
        def forward(self, q):
            mask = torch.rand(q.shape[-2], q.shape[-2]) < 2.0          # all true, but random numbers made it
            return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)

    noisy = sparta.compile(NoisyMask(), {}, (torch.randn(2, 2, 6, 8),), dynamic=False)
    assert "attention[" not in noisy.plan_report()


class MaskInput(torch.nn.Module):
    """Attention over a mask that is a graph input: as given, or joined to a built one through a list argument."""

    def __init__(self, joined: bool):
        super().__init__()
        self.joined = joined

    def forward(self, x, keep):
        q = x.view(x.shape[0], x.shape[1], 2, -1).transpose(1, 2)
        mask = keep[:, None, None, :]
        if self.joined:                                   # cat reads the input inside a list of tensors
            built = torch.ones(q.shape[0], 1, 1, 1, dtype=torch.bool)
            mask = torch.cat([built, mask[..., 1:]], dim=-1)
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)


@pytest.mark.parametrize("joined", [False, True], ids=["as_given", "through_cat"])
def test_a_mask_input_is_never_classified(joined):
    """A mask that is an input differs between calls of one shape: its attention op is not selected, and calls of one
    shape with all-true and padded masks each get their own answer."""
    model = MaskInput(joined).eval()
    x = torch.randn(2, 12, 16)
    compiled = sparta.compile(model, {}, (x, torch.ones(2, 12, dtype=torch.bool)))
    assert len(compiled.graph.dynamic_dims_of("keep")) == 2
    sdpa = next(compiled.graph.ops("scaled_dot_product_attention"))
    assert input_reaching(compiled.graph, sdpa.input_of("attn_mask")) == "input 'keep'"
    assert "keep" in compiled.graph.upstream(sdpa.input_of("attn_mask"))[1]
    assert "attention[" not in compiled.plan_report()
    assert not any(isinstance(m, SizesOnlyMaskAttention) for m in compiled.module_replacements().values())
    x = torch.randn(3, 9, 16)
    padded = torch.arange(9)[None, :] < torch.tensor([9, 4, 1])[:, None]
    with torch.no_grad():
        for keep in (torch.ones(3, 9, dtype=torch.bool), padded, torch.ones(3, 9, dtype=torch.bool)):
            torch.testing.assert_close(compiled(x, keep), model(x, keep))


def test_a_cuda_model_propagates_fake_tensors_through_its_attention():
    """Compiled for CUDA here (no GPU): the attention op's fake output follows the call's shapes."""
    model = tiny_llama(layers=1).to(torch.bfloat16)
    compiled = sparta.compile(model, {}, (torch.randint(0, 64, (2, 16)),), target="cuda")
    assert "attention[bfloat16]" in compiled.plan_report()
    for shape in ((1, 1), (3, 40)):
        with FakeTensorMode(allow_non_fake_inputs=True):
            state = {k: torch.empty(v.shape, dtype=v.dtype, device="cuda")
                     for k, v in [*compiled.module.named_parameters(), *compiled.module.named_buffers()]}
            ids = torch.empty(shape, dtype=torch.long, device="cuda")
            out = torch.func.functional_call(compiled.module, state, (ids,))[0]
            assert out.shape == (*shape, 64) and out.dtype == torch.bfloat16 and out.device.type == "cuda"
