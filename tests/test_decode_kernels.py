"""Kernels only ``generate()``'s decode steps run (``codegen/decode_kernels.py``, ``sparta/hf_attention.py``): a
Hugging Face decoder compiled for CUDA gets its decode-step attention on the ``decode_attention`` family, in the plan
and report, saved and loaded with the folder, attached to the rebuilt decoder's attention modules; everything else
runs Hugging Face's SDPA attention unchanged (checked here on the CPU, where no kernel runs)."""

import json
from pathlib import Path

import pytest
import torch

from sparta.templates.decode_attention.spec import DecodeAttentionSpec

pytest.importorskip("transformers")


def _llama(dtype=torch.bfloat16, heads=4, kv=2, hidden=256):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=512, num_hidden_layers=1,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=128)
    return LlamaForCausalLM(config).eval().to(dtype)


@pytest.fixture(scope="module")
def compiled():
    pytest.importorskip("tvm", reason="builds CUDA kernels")
    import sparta
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("SPARTA_DECODE_ATTENTION", raising=False)       # on by default
        return _compile(sparta)


def test_turned_off_no_decode_kernel_is_planned(monkeypatch):
    pytest.importorskip("tvm", reason="builds CUDA kernels")
    import sparta
    monkeypatch.setenv("SPARTA_DECODE_ATTENTION", "0")
    plain = _compile(sparta)
    assert plain.plan.decode == {} and plain.decode_modules == {}
    assert "generate() decode steps" not in plain.plan_report()
    assert plain.decoder().config._attn_implementation == "sdpa"


def _compile(sparta):
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    return sparta.compile(_llama(), None, (ids,), target="cuda")


def test_a_cuda_decoder_plans_and_builds_its_decode_attention(compiled):
    choice = compiled.plan.decode["attention"]
    assert (choice.kernel, choice.dtype) == ("decode_attention", "bfloat16")
    assert {k: choice.tiles[k] for k in ("hq", "hkv", "d")} == {"hq": 4, "hkv": 2, "d": 64}
    module = compiled.decode_modules["attention"]
    assert (module.spec.hq, module.spec.hkv, module.spec.d, module.spec.dtype) == (4, 2, 64, "bfloat16")
    assert module.scale_value == pytest.approx(64 ** -0.5)
    assert "generate() decode steps: attention on decode_attention[bfloat16 4x2x64]" in compiled.plan_report()
    # a Llama: its decode steps' rotary embedding and cache write run in the same kernels (the rope pair)
    assert choice.tiles["rope"] is True and module.has_rope and "rotary embedding and cache write" in choice.reason
    rope = [DecodeAttentionSpec(**json.loads((Path(f) / "spec.json").read_text())) for f in module.rope_folders]
    assert [(s.stage, s.rope) for s in rope] == [("partial", True), ("combine", True)]
    # the partial kernel reads the stacked projections (4 query heads, the key's 2, the value's 2): no input of their own
    args = {a["name"]: a for a in json.loads((Path(module.rope_folders[0]) / "launch.json").read_text())["args"]}
    assert args["Q"]["shape"][1:] == [8, 64] and not {"KN", "VN"} & set(args), args


@pytest.mark.parametrize("weights", [True, False])
def test_the_decode_attention_is_saved_and_loaded_with_the_folder(compiled, tmp_path, weights):
    import sparta
    compiled.save(tmp_path / "m", weights=weights)
    kw = {} if weights else {"weights": compiled.source_reference().state_dict()}
    loaded = sparta.load(tmp_path / "m", **kw)
    assert loaded.decode_modules["attention"].spec == compiled.decode_modules["attention"].spec
    assert loaded.decode_modules["attention"].has_rope
    assert loaded.plan.decode == compiled.plan.decode
    assert "generate() decode steps" in loaded.plan_report()


def test_the_rebuilt_decoder_runs_sparta_attention_and_cpu_calls_stay_hugging_faces(compiled):
    from sparta.generation import swap_report
    decoder = compiled.decoder()
    assert decoder.config._attn_implementation == "sparta"
    report = dict(swap_report(decoder))
    assert report["model.layers.0.self_attn"].startswith("DecodeAttentionCUDA at one-token steps")
    assert "with the rotary embedding and cache write" in report["model.layers.0.self_attn"], report
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    reference = _llama()
    reference.load_state_dict(decoder.state_dict())
    with torch.no_grad():            # on the CPU every call is SDPA's: the same logits as the model's own attention
        assert torch.equal(decoder(ids).logits, reference(ids).logits)
    got = compiled.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    want = reference.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)


@pytest.mark.parametrize("kw, why", [(dict(dtype=torch.float32), "not fp16 or bf16"),
                                     (dict(heads=8, kv=8, hidden=256), "head size 32")])
def test_decoders_no_kernel_fits_get_none_and_say_why(kw, why):
    from sparta.codegen.decode_kernels import attention_shape
    from sparta.frontend import capture
    model = _llama(**kw)
    graph = capture(model, (torch.randint(0, 128, (1, 8)),))
    shape, reason = attention_shape(graph)
    assert shape is None and why in reason


def test_only_one_token_steps_with_a_boolean_cache_mask_take_the_kernel():
    from types import SimpleNamespace

    from sparta.hf_attention import _decode_step
    spec = SimpleNamespace(hq=4, hkv=2, d=64)
    kernel = SimpleNamespace(spec=spec, dtype=torch.bfloat16, scale_value=0.125)
    q, k = torch.empty(2, 4, 1, 64, dtype=torch.bfloat16), torch.empty(2, 2, 40, 64, dtype=torch.bfloat16)
    mask = torch.ones(2, 1, 1, 40, dtype=torch.bool)
    q = SimpleNamespace(**{a: getattr(q, a) for a in ("shape", "dtype", "dim")}, is_cuda=True)
    assert _decode_step(kernel, q, k, mask, 0.0, 0.125, {})
    assert not _decode_step(kernel, q, k, mask.float(), 0.0, 0.125, {}), "an additive mask"
    assert not _decode_step(kernel, q, k, mask, 0.1, 0.125, {}), "dropout"
    assert not _decode_step(kernel, q, k, mask, 0.0, 0.1, {}), "another softmax scale"
    assert not _decode_step(kernel, q, k, mask, 0.0, 0.125, {"sliding_window": 16}), "a sliding window"
    assert not _decode_step(kernel, q, k[:, :, :20], mask, 0.0, 0.125, {}), "a mask over other keys"
    two = SimpleNamespace(shape=(2, 4, 2, 64), dtype=torch.bfloat16, dim=lambda: 4, is_cuda=True)
    assert not _decode_step(kernel, two, k, mask, 0.0, 0.125, {}), "two queries a row (prefill)"
