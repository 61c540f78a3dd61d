"""Padded batches under one compile: attention masks (int, bool, float), token type ids, padding masks and lengths
are captured with free batch and sequence dimensions, tied to the ids'; ``verify()`` draws one size per shared
dimension and padded masks; ``dynamic=True`` and ``dynamic={...}`` refuse what cannot hold."""

import copy

import pytest
import torch
import torch.nn.functional as F
import transformers

import sparta
from sparta.errors import CaptureError
from sparta.frontend.torch_export import FixedDimensionError
from sparta.sampling import input_kind, padding_mask, random_inputs, verification_sizes

pytest.importorskip("tvm", reason="compiles CPU kernels")

VOCAB = 100
SHAPES = [(batch, seq) for batch in (1, 3, 8) for seq in (1, 17, 40)]


def block_mask(n, k, density, seed, block=32):
    g = torch.Generator().manual_seed(seed)
    grid = torch.rand(n // block, k // block, generator=g) < density
    grid[0, 0] = True
    return grid.repeat_interleave(block, 0).repeat_interleave(block, 1)


def sparse_tesa(model, names, density=0.1):
    """90% block-sparse (32x32 blocks) TeSAs for these weights (one block kept at least)."""
    params = dict(model.named_parameters())
    return {name: sparta.TeSA.from_mask(block_mask(*params[name].shape, density, seed))
            for seed, name in enumerate(names)}


def masked_copy(model, tesa):
    """The eager model with the TeSAs' pruned weights zeroed: what the compiled model must equal."""
    out = copy.deepcopy(model)
    params = dict(out.named_parameters())
    with torch.no_grad():
        for name, t in tesa.items():
            params[name].copy_(t.apply(params[name]))
    return out


def right_padded(batch, seq, gen, dtype=torch.long):
    """A mask keeping a random prefix of each row (at least one token), and the kept lengths."""
    lengths = torch.randint(1, seq + 1, (batch,), generator=gen)
    return (torch.arange(seq)[None, :] < lengths[:, None]).to(dtype), lengths


def tiny_bert():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                                  vocab_size=VOCAB, max_position_embeddings=64, attn_implementation="sdpa")
    model = transformers.BertModel(cfg).eval()
    linears = [f"encoder.layer.{i}.{part}.weight" for i in range(2) for part in (
        "attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
        "intermediate.dense", "output.dense")]
    return model, sparse_tesa(model, linears)


def assert_equal_where_kept(got, want, keep, rtol=1e-4, atol=1e-4):
    kept = keep.bool()
    torch.testing.assert_close(got[kept], want[kept], rtol=rtol, atol=atol)


@pytest.fixture(scope="module")
def bert():
    model, tesa = tiny_bert()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 16), generator=gen)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 11:] = 0
    compiled = sparta.compile(model, tesa, (ids, mask), target="cpu")
    return model, tesa, compiled


def test_one_bert_compile_answers_every_padded_batch(bert):
    """(batch, seq) in {1, 3, 8} x {1, 17, 40}, each row right-padded at random: the outputs equal the masked eager
    model at the kept positions (the pooler reads the first token, always kept)."""
    model, tesa, compiled = bert
    graph = compiled.graph
    assert all(isinstance(size, str) for size in graph.input_shape("attention_mask")), "batch and sequence free"
    assert graph.input_shape("attention_mask") == graph.input_shape("input_ids"), "one batch, one sequence"
    assert "attention_mask[1]" in compiled.shapes_line() and "planned over 1-32 tokens" in compiled.shapes_line()
    assert sum(p.kind == "sparse" for p in compiled.plan.ops.values()) >= 6
    eager = masked_copy(model, tesa)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for batch, seq in SHAPES:
            ids = torch.randint(0, VOCAB, (batch, seq), generator=gen)
            mask, _ = right_padded(batch, seq, gen)
            got, want = compiled(ids, mask), eager(ids, attention_mask=mask)
            assert got.last_hidden_state.shape == (batch, seq, 64)
            assert_equal_where_kept(got.last_hidden_state, want.last_hidden_state, mask)
            torch.testing.assert_close(got.pooler_output, want.pooler_output, rtol=1e-4, atol=1e-4)


def test_the_padded_bert_verifies_reloads_and_refuses_what_it_cannot_take(bert, tmp_path):
    model, tesa, compiled = bert
    worst = compiled.verify(trials=4)
    assert worst and all(err < 1e-3 for err in worst.values())
    loaded = sparta.load(compiled.save(tmp_path / "padded"))
    assert loaded.graph.input_shape("attention_mask") == compiled.graph.input_shape("input_ids")
    ids, mask = torch.randint(0, VOCAB, (5, 23)), right_padded(5, 23, torch.Generator().manual_seed(7))[0]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, mask).last_hidden_state, compiled(ids, mask).last_hidden_state)
    with pytest.raises(sparta.SpartaError, match=r"s\d+ <= 64"):        # past max_position_embeddings
        compiled(torch.randint(0, VOCAB, (2, 65)), torch.ones(2, 65, dtype=torch.long))
    for mask_shape in ((2, 8), (3, 9)):         # another sequence, another batch
        with pytest.raises(sparta.SpartaError, match="share one dynamic dimension"):
            compiled(torch.randint(0, VOCAB, (2, 9)), torch.ones(mask_shape, dtype=torch.long))


def test_a_bool_mask_and_token_type_ids_take_any_padded_batch():
    model, tesa = tiny_bert()
    ids = torch.randint(0, VOCAB, (2, 16))
    kwargs = {"input_ids": ids, "attention_mask": torch.ones(2, 16, dtype=torch.bool),
              "token_type_ids": torch.zeros(2, 16, dtype=torch.long)}
    compiled = sparta.compile(model, tesa, (), example_kwargs=kwargs, target="cpu", verify=True)
    ids_dims = compiled.graph.dynamic_dims_of("input_ids")
    assert all(compiled.graph.dynamic_dims_of(name) == ids_dims for name in ("attention_mask", "token_type_ids"))
    eager = masked_copy(model, tesa)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for batch, seq in SHAPES:
            ids = torch.randint(0, VOCAB, (batch, seq), generator=gen)
            mask, lengths = right_padded(batch, seq, gen, torch.bool)
            types = (torch.arange(seq)[None, :] >= (lengths[:, None] + 1) // 2).long()   # a second segment
            got = compiled(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
            want = eager(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
            assert_equal_where_kept(got, want, mask)


def test_a_float_mask_keeps_the_sequence_free():
    """A float attention mask's last dimension is freed with the ids' (a float input of 2 dimensions used to keep
    it, and with it the ids' sequence)."""
    torch.manual_seed(0)
    model = transformers.DistilBertModel(transformers.DistilBertConfig(
        vocab_size=VOCAB, dim=64, n_layers=1, n_heads=2, hidden_dim=128, max_position_embeddings=64)).eval()
    ids = torch.randint(0, VOCAB, (2, 16))
    compiled = sparta.compile(model, {}, (ids, torch.ones(2, 16)), target="cpu")
    assert len(compiled.graph.dynamic_dims_of("attention_mask")) == 2
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        ids = torch.randint(0, VOCAB, (3, 21), generator=gen)
        mask, _ = right_padded(3, 21, gen, torch.float32)
        assert_equal_where_kept(compiled(ids, mask).last_hidden_state, model(ids, mask).last_hidden_state, mask)


class PaddedEncoder(torch.nn.Module):
    """Embedding, one attention over the kept keys, an FFN; padded positions zeroed."""

    def __init__(self, d=64, heads=2, hidden=128):
        super().__init__()
        self.heads = heads
        self.emb = torch.nn.Embedding(VOCAB, d)
        self.qkv, self.out = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.up, self.down = torch.nn.Linear(d, hidden), torch.nn.Linear(hidden, d)

    def encode(self, ids, keep):
        x = self.emb(ids)
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
        x = x + self.out(a.transpose(1, 2).reshape(b, s, d))
        x = x + self.down(F.gelu(self.up(x)))
        return x * keep[..., None]


class PaddingMaskEncoder(PaddedEncoder):
    def forward(self, input_ids, padding_mask):                 # True where padded (a key_padding_mask)
        return self.encode(input_ids, ~padding_mask)


class LengthsEncoder(PaddedEncoder):
    def forward(self, input_ids, lengths):
        return self.encode(input_ids, torch.arange(input_ids.shape[1])[None, :] < lengths[:, None])


@pytest.mark.parametrize("kind", ["padding_mask", "lengths"])
def test_a_padding_mask_or_lengths_input_takes_any_padded_batch(kind):
    torch.manual_seed(0)
    model = (PaddingMaskEncoder if kind == "padding_mask" else LengthsEncoder)().eval()
    tesa = sparse_tesa(model, ["up.weight", "down.weight"])
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (2, 16), generator=gen)
    mask, lengths = right_padded(2, 16, gen, torch.bool)
    example = ~mask if kind == "padding_mask" else lengths
    compiled = sparta.compile(model, tesa, (ids, example), target="cpu", verify=True)
    graph = compiled.graph
    assert graph.dynamic_dims_of(graph.inputs[1])[0] == graph.dynamic_dims_of("input_ids")[0], "one batch"
    assert input_kind(graph, graph.inputs[1]) == ("mask" if kind == "padding_mask" else "lengths")
    eager = masked_copy(model, tesa)
    with torch.no_grad():
        for batch, seq in SHAPES:
            ids = torch.randint(0, VOCAB, (batch, seq), generator=gen)
            mask, lengths = right_padded(batch, seq, gen, torch.bool)
            arg = ~mask if kind == "padding_mask" else lengths
            torch.testing.assert_close(compiled(ids, arg), eager(ids, arg), rtol=1e-4, atol=1e-4)


def tiny_gpt2():
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=2, n_positions=64, use_cache=False,
                                  bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    return transformers.GPT2Model(cfg).eval(), ["h.0.mlp.c_fc.weight", "h.1.mlp.c_proj.weight"]


def tiny_distilbert():
    cfg = transformers.DistilBertConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=2, hidden_dim=128,
                                        max_position_embeddings=64)
    return transformers.DistilBertModel(cfg).eval(), ["transformer.layer.0.ffn.lin1.weight",
                                                      "transformer.layer.1.ffn.lin2.weight"]


def tiny_bert_two_linears():
    model, _ = tiny_bert()
    return model, ["encoder.layer.0.intermediate.dense.weight", "encoder.layer.1.output.dense.weight"]


@pytest.mark.parametrize("make", [tiny_gpt2, tiny_distilbert, tiny_bert_two_linears],
                         ids=["gpt2", "distilbert", "bert"])
def test_verify_passes_for_padded_transformers(make):
    """``compile(..., verify=True)`` with an attention mask input: every trial draws the mask's sizes with the ids'
    and pads its rows at random."""
    torch.manual_seed(0)
    model, names = make()
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, VOCAB, (2, 16), generator=gen)
    mask, _ = right_padded(2, 16, gen)
    compiled = sparta.compile(model, sparse_tesa(model, names), (), example_kwargs={
        "input_ids": ids, "attention_mask": mask}, target="cpu", verify=True)
    assert any(p.kind == "sparse" for p in compiled.plan.ops.values())
    graph, padded = compiled.graph, False
    for sizes in verification_sizes(graph, 4)[1:]:
        ids, mask = random_inputs(graph, 1, sizes)
        assert ids.shape == mask.shape and mask[0].all() and set(mask.unique().tolist()) <= {0, 1}
        padded |= bool((mask == 0).any())
    assert padded, "some trial pads its rows"


def test_masks_and_lengths_are_drawn_padded_with_a_token_kept():
    gen = torch.Generator().manual_seed(0)
    mask = padding_mask((50, 7), torch.long, gen)
    assert mask[0].all() and (mask.sum(1) >= 1).all() and (mask.sum(1) < 7).any()
    assert ((mask[:, 1:] <= mask[:, :-1]).all()), "right padding: no kept token after a padded one"
    pads = padding_mask((50, 7), torch.bool, gen, pads_marked=True)
    assert pads.dtype == torch.bool and not pads[:, 0].any() and pads.any()
    assert padding_mask((3, 1), torch.float32, gen).eq(1).all()


class FixedBatch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)

    def forward(self, x):
        return self.lin(x).reshape(4, -1)


def test_dynamic_true_refuses_a_dimension_the_model_fixes():
    x = torch.randn(4, 8, 64)
    with pytest.raises(FixedDimensionError, match=r"x\[0\] stayed at 4: the traced code requires x\[0\] == 4"):
        sparta.compile(FixedBatch().eval(), {}, (x,), dynamic=True)
    assert issubclass(FixedDimensionError, CaptureError) and issubclass(FixedDimensionError, sparta.SpartaError)
    default = sparta.compile(FixedBatch().eval(), {}, (x,))              # the default frees what it can: the sequence
    assert list(default.graph.dynamic_dims_of("x")) == [1]
    assert default(torch.randn(4, 11, 64)).shape == (4, 11 * 64)
    with pytest.raises(FixedDimensionError, match=r"input\[0\] stayed at 1: torch.export keeps sizes 0 and 1.*trace with 2"):
        sparta.compile(torch.nn.Linear(64, 64).eval(), {}, (torch.randn(1, 8, 64),), dynamic=True)


def test_a_dynamic_dict_is_checked_against_forward_and_the_inputs():
    auto = torch.export.Dim.AUTO
    model, x = torch.nn.Linear(64, 64).eval(), torch.randn(4, 8, 64)
    with pytest.raises(CaptureError, match=r"names dimension 5, but 'input' has 3"):
        sparta.compile(model, {}, (x,), dynamic={"input": {5: auto}})
    with pytest.raises(CaptureError, match=r"names dimension -1"):
        sparta.compile(model, {}, (x,), dynamic={"input": {-1: auto}})
    with pytest.raises(CaptureError, match=r"'x', which is no parameter of Linear.forward \(input\)"):
        sparta.compile(model, {}, (x,), dynamic={"x": {0: auto}})
    with pytest.raises(CaptureError, match=r"lists 2 dimensions, but 'input' has 3"):
        sparta.compile(model, {}, (x,), dynamic={"input": [auto, None]})
    ok = sparta.compile(model, {}, (x,), dynamic={"input": {1: auto}})
    assert list(ok.graph.dynamic_dims_of("input")) == [1]
