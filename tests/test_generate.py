"""``compiled.generate()`` on the CPU target: Hugging Face decoders (Llama, Qwen2 with grouped-query attention, GPT-2
with its transposed ``Conv1D`` weights) compiled with their default arguments generate the masked eager model's greedy
tokens with sparta's kernels standing in for their linears; saved and reloaded they still do."""

import pytest
import torch

import sparta
from sparta.generation import GenerationError, swap_report
from sparta.runtime.decode_graphs import full_mask, max_cache_length

transformers = pytest.importorskip("transformers")


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=200, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return transformers.LlamaForCausalLM(cfg)


def _qwen2():
    cfg = transformers.Qwen2Config(vocab_size=200, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return transformers.Qwen2ForCausalLM(cfg)


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=200, n_embd=128, n_layer=2, n_head=4, n_positions=128,
                                  bos_token_id=0, eos_token_id=199)
    return transformers.GPT2LMHeadModel(cfg)


MODELS = {"llama": _llama, "qwen2": _qwen2, "gpt2": _gpt2}


def _block_masks(model, seed: int, keep: float = 0.12, block: int = 16) -> dict[str, torch.Tensor]:
    """Block masks on every decoder linear (by the parameter's own name: GPT-2's (in, out) Conv1D weights too)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.named_parameters():
        if p.dim() == 2 and ("proj" in name or ".c_" in name):
            grid = torch.rand(p.shape[0] // block, p.shape[1] // block, generator=g) < keep
            grid[0, 0] = True
            out[name] = grid.repeat_interleave(block, 0).repeat_interleave(block, 1)
    return out


def _compiled(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    model = MODELS[kind]().eval()
    masks = _block_masks(model, seed + 1)
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(seed + 2))
    compiled = sparta.compile(model, masks, (ids,), target="cpu")
    with torch.no_grad():
        for name, mask in masks.items():
            model.get_parameter(name).mul_(mask)
    return model, compiled


@pytest.fixture(scope="module", params=sorted(MODELS))
def pair(request):
    return request.param, *_compiled(request.param)


def test_generate_gives_the_masked_models_greedy_tokens_with_kernels_in_its_linears(pair):
    kind, model, compiled = pair
    prompt = torch.randint(0, 200, (2, 9), generator=torch.Generator().manual_seed(7))
    want = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,
                          pad_token_id=0)
    got = compiled.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,
                            pad_token_id=0)
    assert torch.equal(got, want), (kind, got, want)
    report = dict(swap_report(compiled.decoder()))
    # the plan is the contract: every linear the plan gave a kernel runs on it in generate() (on the CPU nothing is
    # fused across linears), every other one is the model's own linear, said so
    planned = set()
    for name in compiled.module_replacements():
        op = compiled.graph.op(name)
        weight = op.input_of("weight") or (op.inputs[-1] if op.op in ("addmm", "mm") else None)
        if weight is not None and weight.endswith(".weight"):
            planned.add(weight.removesuffix(".weight"))
    assert planned and planned == {p for p, what in report.items() if what == "SparseLinearCPU"}, report
    assert all(what.startswith("torch linear on the masked weight: the plan runs it dense")
               for p, what in report.items() if p not in planned), report
    # every step's logits, not only their argmax: the decoder's forward with a cache against the masked model's
    with torch.no_grad():
        a = compiled.decoder()(got[:, :-1]).logits
        b = model(got[:, :-1]).logits
    assert torch.allclose(a, b, rtol=1e-3, atol=1e-3 * b.abs().max().item()), (a - b).abs().max()


def test_a_saved_and_reloaded_decoder_still_generates(pair, tmp_path):
    kind, model, compiled = pair
    prompt = torch.randint(0, 200, (1, 5), generator=torch.Generator().manual_seed(3))
    want = compiled.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    compiled.save(tmp_path / kind)
    loaded = sparta.load(tmp_path / kind)
    assert loaded.graph.hf_model["class"] == type(model).__name__
    assert torch.equal(loaded.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0), want)


def test_sampling_arguments_reach_hugging_faces_loop(pair):
    kind, model, compiled = pair
    prompt = torch.randint(0, 200, (1, 4), generator=torch.Generator().manual_seed(5))
    torch.manual_seed(11)
    a = compiled.generate(prompt, max_new_tokens=5, do_sample=True, top_k=20, pad_token_id=0)
    torch.manual_seed(11)
    b = model.generate(prompt, max_new_tokens=5, do_sample=True, top_k=20, pad_token_id=0)
    assert a.shape == (1, 9) and torch.equal(a, b)


def test_a_model_without_a_language_model_head_or_not_from_hugging_face_is_refused():
    torch.manual_seed(0)
    base = _llama().model.eval()
    ids = torch.randint(0, 200, (2, 8))
    compiled = sparta.compile(base, None, (ids,), target="cpu")
    assert compiled(ids).last_hidden_state.shape == (2, 8, 128)      # captured with its defaults (no cache output)
    with pytest.raises(GenerationError, match="LlamaForCausalLM"):
        compiled.generate(ids, max_new_tokens=2)
    mlp = sparta.compile(torch.nn.Sequential(torch.nn.Linear(8, 8)).eval(), None, (torch.randn(2, 8),))
    with pytest.raises(GenerationError, match="Hugging Face"):
        mlp.generate(torch.zeros(1, 2, dtype=torch.long))


def test_a_record_naming_a_class_outside_transformers_is_refused():
    from sparta.frontend.hf import model_class
    for name in ("os", "PreTrainedModel", "LlamaConfig", "__import__", 3):
        with pytest.raises(sparta.SpartaError):
            model_class(name)


def test_the_decode_steps_four_dimensional_mask_is_the_one_the_model_builds():
    """DecodeGraphs hands a one-token step its padding mask over the whole static cache: on the CPU (no graphs) the
    step's logits equal those of the model given the 2-d mask."""
    torch.manual_seed(0)
    model = _llama().eval()
    prompt = torch.randint(0, 200, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0                                            # left padding in the second row
    cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        model(prompt, attention_mask=mask, past_key_values=cache, use_cache=True)
        assert max_cache_length(cache) == 16
        step = torch.randint(0, 200, (2, 1))
        mask2 = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
        position = (mask2.cumsum(-1) - 1).clamp_min(0)[:, -1:]
        kwargs = {"input_ids": step, "position_ids": position, "past_key_values": cache, "use_cache": True}
        if "cache_position" in transformers.LlamaForCausalLM.forward.__code__.co_varnames:
            kwargs["cache_position"] = torch.tensor([6])
        state = [t.clone() for t in _small_tensors(cache)]
        want = model(attention_mask=mask2, **kwargs).logits
        for t, s in zip(_small_tensors(cache), state):      # the same step again from the same cache state
            t.copy_(s)
        full = full_mask(model, mask2, 16)
        got = model(attention_mask=full, **kwargs).logits
    assert full.shape == (2, 1, 1, 16) and torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def _small_tensors(cache):
    from sparta.runtime.decode_graphs import _cache_state
    return _cache_state(cache)


def test_a_kernels_only_save_generates_with_the_checkpoints_weights_and_refuses_another_mask(tmp_path):
    model, compiled = _compiled("llama", seed=4)
    compiled.save(tmp_path / "plan", weights=False)
    loaded = sparta.load(tmp_path / "plan", weights=model.state_dict())
    prompt = torch.randint(0, 200, (1, 6), generator=torch.Generator().manual_seed(8))
    want = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(loaded.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0), want)
    other = {k: v.clone() for k, v in model.state_dict().items()}
    other["model.layers.1.mlp.down_proj.weight"] += 1e-2          # non-zero where the compiled mask prunes
    with pytest.raises(sparta.SpartaError, match="down_proj"):
        sparta.load(tmp_path / "plan", weights=other)


@pytest.mark.parametrize("kind, inductor, path", [("llama", False, "session"), ("gpt2", False, "session"),
                                                  ("llama", True, "session"), ("llama", False, "recorded"),
                                                  ("gpt2", False, "recorded")])
def test_the_lean_greedy_loop_gives_hugging_faces_tokens_and_stops_where_it_stops(kind, inductor, path, monkeypatch):
    """The GPU loop's steps (mask slot, positions, argmax, padding after the end of sequence, stop once every row
    ended) run here one by one, without graphs (and through torch.compile, as on a GPU): the tokens equal Hugging
    Face's greedy loop's with a static cache, for rows that end early, rows that do not, and a left-padded row — as a
    session runs them (its own prefill and cache) and as the recorded-step loop does (Hugging Face's first step)."""
    from sparta.runtime import decode_loop
    if path == "recorded":
        monkeypatch.setattr(decode_loop, "supports_session", lambda *a: False)
    torch.manual_seed(0)
    model = MODELS[kind]().eval()
    prompt = torch.randint(1, 200, (3, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(prompt)
    mask[2, :3] = 0
    with torch.no_grad():
        free = model.generate(prompt, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                              cache_implementation="static")
        eos = int(free[0, 7 + 5])                         # a token the first row emits on its 6th step
        kw = dict(attention_mask=mask, max_new_tokens=12, pad_token_id=0)
        for end in (None, eos, int(free[1, 7])):          # ... and one the second row emits first
            want = model.generate(prompt, do_sample=False, cache_implementation="static", eos_token_id=end, **kw)
            hook = object()
            model.get_compiled_call = hook                    # a hook installed before is put back after
            got = decode_loop.greedy_generate(model, prompt, graphs=False, inductor=inductor, chunk=4,
                                              eos_token_id=end, **kw)
            assert torch.equal(got, want), (end, got, want)
            assert model.__dict__.pop("get_compiled_call") is hook
    assert ("sparta_decode_sessions" in model.__dict__) == (path == "session")
    if path == "session" and inductor:         # the prefill went through torch.compile too, not its eager fallback
        prefills = [p for s in model.sparta_decode_sessions.values() for p in s.prefills.values()]
        assert prefills and all(p.inductor_error is None for p in prefills)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_a_session_keeps_its_cache_and_step_for_the_next_call_and_pads_prompts_to_a_bucket(kind):
    """A second call reuses the session's cache and step loop; prompts padded on the right to a bucket of lengths
    (what a GPU prefill graph runs) give Hugging Face's tokens, at another prompt length in the same bucket and
    with a left-padded row; a call needing a longer cache gets a new session."""
    from sparta.runtime.decode_loop import greedy_generate
    from sparta.runtime.decode_session import prompt_bucket
    torch.manual_seed(1)
    model = MODELS[kind]().eval()
    prompt = torch.randint(1, 200, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0

    def both(ids, m, new=10):
        kw = dict(attention_mask=m, max_new_tokens=new, pad_token_id=0, eos_token_id=None)
        want = model.generate(ids, do_sample=False, cache_implementation="static", **kw)
        return greedy_generate(model, ids, graphs=False, inductor=False, **kw), want

    with torch.no_grad():
        got, want = both(prompt, mask)
        assert torch.equal(got, want)
        session = model.sparta_decode_sessions[2]
        cache, (loop,) = session.cache, session.loops.values()
        session.buckets = True                            # as on a GPU
        for ids, m in ((prompt, mask), (prompt[:, 2:], mask[:, 2:]), (prompt[:, :5], None)):
            got, want = both(ids, m)
            assert torch.equal(got, want), (ids.shape, got, want)
        assert model.sparta_decode_sessions[2] is session and session.cache is cache
        assert list(session.loops.values()) == [loop] and sorted(session.prefills) == [9, 16]
        assert (prompt_bucket(5), prompt_bucket(9), prompt_bucket(512), prompt_bucket(513)) == (16, 16, 512, 1024)
        got, want = both(prompt, mask, new=70)                # 79 positions: a longer cache
        assert torch.equal(got, want) and model.sparta_decode_sessions[2] is not session
