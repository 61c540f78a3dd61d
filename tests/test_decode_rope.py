"""The decode step's rotary embedding and cache write fused into the decode-attention kernels (``rope``), checked on
the CPU where no kernel runs: the kernels' torch reference against Hugging Face's own rotary embedding, static cache
update and attention; a Llama decoder whose attention modules take the fused path (a reference-backed stand-in for
the kernel module) against the same decoder on Hugging Face's path, eagerly and under ``torch.compile``, where the
cache and its counter must be updated in place (no copy of the cache)."""

import pytest
import torch

from sparta.runtime.ops import KernelModule
from sparta.templates.decode_attention.runtime import DecodeAttentionCUDA
from sparta.templates.decode_attention.spec import (DecodeAttentionError, DecodeAttentionSpec, check_inputs,
                                                    check_rope_inputs, decode_attention_ref, decode_attention_rope_ref,
                                                    rotate)

transformers = pytest.importorskip("transformers")


class ReferenceRope(KernelModule):
    """The rope kernels' torch reference behind the module interface ``sparta/hf_attention.py`` drives (CPU)."""

    kernel_family = "decode_attention"
    weight_names = ("scale",)
    has_rope = True
    device_type = "cpu"
    rope_forward = DecodeAttentionCUDA.rope_forward
    fake = DecodeAttentionCUDA.fake
    fake_rope = DecodeAttentionCUDA.fake_rope

    def __init__(self, spec: DecodeAttentionSpec):
        super().__init__()
        self.spec, self.op_name, self.calls = spec, "reference_rope", 0
        self.register_buffer("scale", torch.tensor([spec.d ** -0.5]))
        self.register_kernel("reference_rope")

    @property
    def dtype(self):
        return torch.bfloat16 if self.spec.dtype == "bfloat16" else torch.float16

    @property
    def scale_value(self) -> float:
        return self.spec.d ** -0.5

    def launch_rope(self, inputs, k, v, position):
        self.calls += 1
        qkv, cos, sin, keep = inputs
        return decode_attention_rope_ref(qkv, cos, sin, k, v, keep, position, float(self.scale))


def _tables(b, d, positions, dtype):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = positions.float()[:, None] * inv[None]
    emb = torch.cat([ang, ang], -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("hq,hkv,d,b,s", [(4, 4, 64, 1, 37), (8, 2, 128, 3, 100), (6, 1, 64, 2, 64)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_reference_is_hugging_faces_rotary_cache_update_and_attention(hq, hkv, d, b, s, dtype):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    g = torch.Generator().manual_seed(hq * d + s)
    q, k_new, v_new = (torch.randn(b, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
    k, v = (torch.randn(b, hkv, s, d, generator=g).to(dtype) for _ in range(2))
    p = int(torch.randint(0, s, (1,), generator=g))
    keep = torch.rand(b, s, generator=g) < 0.7
    keep[:, p] = True
    cos, sin = _tables(b, d, torch.full((b,), p), dtype)
    # Hugging Face: rotary on (B, H, 1, D), StaticLayer.update's index_copy_, then attention over the cache
    hq_rot, hk_rot = apply_rotary_pos_emb(q[:, :, None], k_new[:, :, None], cos[:, None], sin[:, None])
    hk, hv = k.clone(), v.clone()
    hk.index_copy_(2, torch.tensor([p]), hk_rot)
    hv.index_copy_(2, torch.tensor([p]), v_new[:, :, None])
    want = decode_attention_ref(hq_rot[:, :, 0], hk, hv, keep, d ** -0.5)
    position = torch.tensor(p)
    got = decode_attention_rope_ref(torch.cat([q, k_new, v_new], 1), cos, sin, k, v, keep, position, d ** -0.5)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=2e-3, atol=2e-3)
    assert int(position) == p + 1
    torch.testing.assert_close(k, hk, **tol)                 # one rounding here, two in Hugging Face's
    assert torch.equal(v, hv) and torch.equal(k[:, :, :p], hk[:, :, :p]) and torch.equal(k[:, :, p + 1:], hk[:, :, p + 1:])
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(rotate(q, cos, sin), hq_rot[:, :, 0], **tol)


def test_the_rope_inputs_are_checked():
    spec = DecodeAttentionSpec(4, 2, 64, "float16", rope=True)
    qkv, cos = torch.randn(1, 8, 64).half(), torch.randn(1, 64).half()
    k, v, keep = torch.randn(1, 2, 10, 64).half(), torch.randn(1, 2, 10, 64).half(), torch.ones(1, 10, dtype=torch.bool)
    check_rope_inputs(spec, qkv, cos, cos, k, torch.tensor(3))
    check_inputs(spec, qkv, k, v, keep)
    for bad, why in (((qkv, cos[:, :32], cos, k, torch.tensor(3)), "cos"),
                     ((qkv, cos, cos.float(), k, torch.tensor(3)), "sin"),
                     ((qkv, cos, cos, k, torch.tensor(3, dtype=torch.int32)), "position")):
        with pytest.raises(DecodeAttentionError, match=why):
            check_rope_inputs(spec, *bad)
    with pytest.raises(DecodeAttentionError, match=r"qkv must be \(B, Hq \+ 2 Hkv, D\) = \(1, 8, 64\)"):
        check_inputs(spec, qkv[:, :4].contiguous(), k, v, keep)          # the query heads alone


def _llama(heads=4, kv=2, layers=2):
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=256, intermediate_size=384, num_hidden_layers=layers,
                                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval().to(torch.bfloat16)


def _decode_steps(model, ids, steps, capacity=32, compile_step=False):
    """Prefill ``ids`` into a static cache, then ``steps`` greedy one-token forwards with a boolean 4-d mask over the
    cache (what sparta's loop passes); the logits of each step and the cache's layers."""
    from transformers import StaticCache
    from sparta.runtime.decode_graphs import full_mask
    b, n = ids.shape
    cache = StaticCache(config=model.config, max_cache_len=capacity)
    keep = torch.zeros(b, capacity, dtype=torch.bool)
    keep[:, :n] = True
    with torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True, position_ids=torch.arange(n)[None].expand(b, n))
        step = torch.compile(model, dynamic=False) if compile_step else model
        nxt, logits = out.logits[:, -1].argmax(-1), []
        for i in range(steps):
            keep[:, n + i] = True
            out = step(nxt[:, None], past_key_values=cache, use_cache=True, attention_mask=full_mask(model, keep, capacity),
                       position_ids=torch.full((b, 1), n + i))
            logits.append(out.logits[:, -1].float())
            nxt = out.logits[:, -1].argmax(-1)
    return torch.stack(logits), cache


@pytest.mark.parametrize("compile_step", [False, True])
def test_a_llama_decode_step_on_the_fused_path_equals_hugging_faces(compile_step):
    from sparta.hf_attention import attach
    plain, fused = _llama(), _llama()
    kernel = ReferenceRope(DecodeAttentionSpec(4, 2, 64, "bfloat16", rope=True))
    assert [rope for _, rope in attach(fused, kernel)] == [True, True]
    attach(plain, type("Plain", (), {"spec": kernel.spec, "has_rope": False})())   # "sparta" attention, no kernel calls
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(3))
    want, cache_want = _decode_steps(plain, ids, 4, compile_step=compile_step)
    got, cache_got = _decode_steps(fused, ids, 4, compile_step=compile_step)
    assert kernel.calls == 2 * 4, "every layer of every decode step takes the fused path"
    for a, b in zip(cache_got.layers, cache_want.layers):
        assert int(a.cumulative_length) == int(b.cumulative_length) == 7 + 4
        torch.testing.assert_close(a.keys.float(), b.keys.float(), rtol=2e-2, atol=2e-2)
        assert torch.equal(a.values[:, :, :7], b.values[:, :, :7])
    torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_under_torch_compile_the_cache_is_written_in_place():
    """Inductor runs the mutating op on the cache's own tensors: no copy of a cache layer in the step's code."""
    from torch._inductor.utils import run_and_get_code
    spec = DecodeAttentionSpec(8, 2, 64, "float16", rope=True)
    module = ReferenceRope(spec)
    k, v = torch.randn(2, 2, 40, 64).half(), torch.randn(2, 2, 40, 64).half()
    position = torch.tensor(5)

    def step(x, cos, sin, keep):
        return module.rope_forward((x * 2).reshape(2, 12, 64), cos, sin, keep, k, v, position).reshape(2, -1) + 1

    x = torch.randn(2, 768).half()
    cos, sin = _tables(2, 64, torch.full((2,), 5), torch.float16)
    keep = torch.ones(2, 40, dtype=torch.bool)
    k0, v0 = k.clone(), v.clone()
    out, (code, *_) = run_and_get_code(torch.compile(step, fullgraph=True), x, cos, sin, keep)
    want = decode_attention_rope_ref((x * 2).reshape(2, 12, 64), cos, sin, k0, v0, keep, torch.tensor(5), 0.125)
    assert int(position) == 6 and torch.equal(k, k0) and torch.equal(v, v0)
    torch.testing.assert_close(out, want.reshape(2, -1) + 1)
    import re
    calls = re.findall(r"decode_attention_rope\.default\('[^']+', \[[^\]]*\], (\w+), (\w+), (\w+),", code)
    assert len(calls) == 1 and all(re.fullmatch(r"arg\d+_1", a) for a in calls[0]), code   # the inputs themselves
    assert ".copy_(" not in code and "aten.copy" not in code, code


@pytest.mark.parametrize("batch", [1, 2])
def test_stacked_projections_reach_the_kernels_as_one_tensor(batch):
    """q/k/v as slices of one stacked kernel's output (``KernelSlice``): the kernels read that output itself, at one row
    and at a batch (whose slices are strided), and run once a layer per step; Hugging Face's logits."""
    from sparta.generation import KernelSlice, SharedKernel
    from sparta.hf_attention import attach
    plain, fused = _llama(layers=1), _llama(layers=1)
    attn = fused.model.layers[0].self_attn
    stacked = torch.nn.Linear(256, 512, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        stacked.weight.copy_(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    shared = SharedKernel(stacked, 3)
    attn.q_proj, attn.k_proj, attn.v_proj = (KernelSlice(shared, a, b, b - a) for a, b in ((0, 256), (256, 384),
                                                                                           (384, 512)))
    kernel = ReferenceRope(DecodeAttentionSpec(4, 2, 64, "bfloat16", rope=True))
    attach(fused, kernel)
    attach(plain, type("Plain", (), {"spec": kernel.spec, "has_rope": False})())
    ids = torch.randint(0, 96, (batch, 5), generator=torch.Generator().manual_seed(5))
    seen = []
    stacked.register_forward_hook(lambda m, args, out: seen.append(out))
    launch = kernel.launch_rope
    kernel.launch_rope = lambda inputs, *rest: (seen.append(inputs[0]), launch(inputs, *rest))[1]
    want, _ = _decode_steps(plain, ids, 3)
    got, _ = _decode_steps(fused, ids, 3)
    assert kernel.calls == 3
    steps = [(a, b) for a, b in zip(seen[1::2], seen[2::2])] if len(seen) == 7 else []
    assert len(steps) == 3 and all(q.data_ptr() == out.data_ptr() for out, q in steps), "the stacked output, no copy"
    torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2)


def test_separate_projections_reach_the_kernels_concatenated():
    """q/k/v_proj of their own (not one stacked kernel): their outputs concatenated into the stacked layout."""
    from sparta.hf_attention import _stacked_projections
    model = _llama(layers=1)
    attn = model.model.layers[0].self_attn
    x = torch.randn(3, 1, 256).to(torch.bfloat16)
    qkv = _stacked_projections(attn, x, DecodeAttentionSpec(4, 2, 64, "bfloat16", rope=True))
    assert qkv.shape == (3, 8, 64) and qkv.is_contiguous()
    want = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], -1).reshape(3, 8, 64)
    assert torch.equal(qkv, want)


def test_an_expanded_mask_reaches_the_kernels_contiguous():
    """Hugging Face may build a step's mask expanded over the batch (stride 0): the kernels get its rows contiguous."""
    from sparta.hf_attention import attach
    plain, fused = _llama(layers=1), _llama(layers=1)
    kernel = ReferenceRope(DecodeAttentionSpec(4, 2, 64, "bfloat16", rope=True))
    attach(fused, kernel)
    attach(plain, type("Plain", (), {"spec": kernel.spec, "has_rope": False})())
    launch, keeps = kernel.launch_rope, []
    kernel.launch_rope = lambda inputs, *rest: (keeps.append(inputs[3]), launch(inputs, *rest))[1]
    from transformers import StaticCache
    from sparta.runtime.decode_graphs import full_mask
    ids = torch.randint(0, 96, (3, 5), generator=torch.Generator().manual_seed(2))
    outs = []
    for model in (plain, fused):
        cache = StaticCache(config=model.config, max_cache_len=16)
        keep = torch.zeros(1, 16, dtype=torch.bool)
        keep[:, :6] = True
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
            mask = full_mask(model, keep, 16).expand(3, -1, -1, -1)       # one row's mask for every row
            assert mask.stride(0) == 0
            outs.append(model(ids[:, -1:], past_key_values=cache, use_cache=True, attention_mask=mask,
                              position_ids=torch.full((3, 1), 5)).logits.float())
    assert len(keeps) == 1 and keeps[0].is_contiguous() and keeps[0].shape == (3, 16)
    torch.testing.assert_close(outs[1], outs[0], rtol=5e-2, atol=5e-2)


def test_rope_kernels_built_for_separate_key_and_value_inputs_are_not_used(tmp_path):
    """A folder saved before the rope kernels read the stacked projections (their partial kernel takes ``KN``, ``VN``)
    loads with the plain pair only, and says so: the decode steps keep Hugging Face's rotary embedding."""
    import dataclasses
    import json
    base = DecodeAttentionSpec(4, 2, 64, "float16", name="da")
    folders = {}
    for rope in (False, True):
        for spec in dataclasses.replace(base, rope=rope, name="da_rope" if rope else "da").pair():
            spec = dataclasses.replace(spec, name=f"{spec.name}_{spec.stage}")
            folder = folders[(rope, spec.stage)] = tmp_path / spec.name
            folder.mkdir()
            (folder / "spec.json").write_text(json.dumps(spec.key()))
            args = [{"name": n} for n in ("Q", "K", "V", "KEEP", "SCALE", "KN", "VN", "COS", "SIN", "POS", "O", "ML")]
            (folder / "launch.json").write_text(json.dumps({"args": args}))
    with pytest.warns(UserWarning, match="built before they read the stacked projections"):
        module = DecodeAttentionCUDA(folders[(False, "partial")], folders[(False, "combine")],
                                     rope_folders=(folders[(True, "partial")], folders[(True, "combine")]))
    assert not module.has_rope
