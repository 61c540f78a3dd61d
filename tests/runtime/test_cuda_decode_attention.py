"""The decode-attention kernels on the GPU against their torch reference: fp16 and bf16, G of 1, 4 and 8, D of 64, 128
and 256, caches of 1 to 1000 keys (partial last chunks), batches of 1 to 16, random, left-padded, causal-prefix, empty
and full masks; masked keys never read; inside ``torch.compile`` and a CUDA graph replayed on new inputs. Kernels are
built beforehand where TVM is (``tests/fixtures/build_cuda.py``: the ``da_*`` fixtures)."""

import pytest
import torch

from sparta.templates.decode_attention.runtime import DecodeAttentionCUDA, DecodeAttentionOp
from sparta.templates.decode_attention.spec import DecodeAttentionError, decode_attention_ref

from fixtures.artifacts import MISSING, ROOT

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CASES = ["da_g1_d128_bf16", "da_g1_d128_fp16", "da_g1_d64_bf16", "da_g1_d64_fp16", "da_g4_d128_bf16",
         "da_g4_d128_fp16", "da_g4_d64_bf16", "da_g4_d64_fp16", "da_g8_d128_bf16", "da_g1_d256_bf16"]
TOL = {torch.float16: dict(rtol=4e-3, atol=4e-3), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _module(name, scale=None) -> DecodeAttentionCUDA:
    for stage in ("partial", "combine"):
        if not (ROOT / f"{name}_{stage}" / "launch.json").is_file():
            pytest.skip(MISSING + f"kernel {name}_{stage} not built in {ROOT}")
    return DecodeAttentionCUDA.from_folder(ROOT, name, scale).cuda()


def _inputs(module, b, s, seed):
    spec = module.spec
    dtype = torch.bfloat16 if spec.dtype == "bfloat16" else torch.float16
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = (torch.randn(b, spec.hq, spec.d, device="cuda", generator=g) * 2).to(dtype)
    k = torch.randn(b, spec.hkv, s, spec.d, device="cuda", generator=g).to(dtype)
    v = (torch.randn(b, spec.hkv, s, spec.d, device="cuda", generator=g) + 0.5).to(dtype)
    return q, k, v, g


def _masks(b, s, g):
    pos = torch.arange(s, device="cuda")
    pad = torch.randint(0, s, (b,), device="cuda", generator=g)
    fill = torch.randint(1, s + 1, (b,), device="cuda", generator=g)
    one_empty = torch.rand(b, s, device="cuda", generator=g) < 0.5
    one_empty[b // 2] = False
    return {"random": torch.rand(b, s, device="cuda", generator=g) < 0.5,
            "sparse": torch.rand(b, s, device="cuda", generator=g) < 0.03,
            "left_padded": pos[None, :] >= pad[:, None],
            "causal_prefix": pos[None, :] < fill[:, None],
            "none": torch.zeros(b, s, dtype=torch.bool, device="cuda"),
            "all": torch.ones(b, s, dtype=torch.bool, device="cuda"),
            "one_row_empty": one_empty}


def _check(out, q, k, v, keep, scale, what):
    want = decode_attention_ref(q, k, v, keep, scale)
    assert out.shape == want.shape and out.dtype == want.dtype, what
    torch.testing.assert_close(out.float(), want.float(), **TOL[q.dtype], msg=what)
    empty = ~keep.any(-1)
    assert not out[empty].any(), f"{what}: a row with no kept key is zeros"


@pytest.mark.parametrize("b", [1, 3, 16])
@pytest.mark.parametrize("s", [1, 37, 640, 1000])
@pytest.mark.parametrize("name", CASES)
def test_matches_the_reference(name, s, b):
    module = _module(name)
    q, k, v, g = _inputs(module, b, s, seed=s * 31 + b)
    scale = float(module.scale)
    for kind, keep in _masks(b, s, g).items():
        _check(module(q, k, v, keep), q, k, v, keep, scale, f"{name} S={s} B={b} {kind}")


@pytest.mark.parametrize("name", ["da_g4_d128_bf16", "da_g1_d64_fp16"])
def test_masked_keys_are_never_read(name):
    module = _module(name, scale=0.07)
    b, s = 3, 1000
    q, k, v, g = _inputs(module, b, s, seed=5)
    keep = _masks(b, s, g)["random"]
    keep[:, 64:300] = False                               # whole chunks masked, and masked keys inside kept chunks
    nan_k, nan_v = k.clone(), v.clone()
    nan_k[~keep[:, None, :].expand(-1, k.shape[1], -1)] = float("nan")
    nan_v[~keep[:, None, :].expand(-1, v.shape[1], -1)] = float("nan")
    out = module(q, nan_k, nan_v, keep)
    assert torch.isfinite(out.float()).all()
    _check(out, q, k, v, keep, 0.07, name)


def test_op_takes_a_float_scale_and_refuses_bad_inputs():
    module = _module("da_g4_d64_bf16")
    op = DecodeAttentionOp(module.partial_folder, module.combine_folder)
    q, k, v, g = _inputs(module, 2, 100, seed=3)
    keep = _masks(2, 100, g)["random"]
    for scale in (0.3, 0.05):
        _check(op(q, k, v, keep, scale), q, k, v, keep, scale, f"scale {scale}")
    with pytest.raises(DecodeAttentionError, match="keep must be torch.bool"):
        op(q, k, v, keep.to(torch.uint8), 0.3)
    with pytest.raises(DecodeAttentionError, match="q must be"):
        op(q.half(), k, v, keep, 0.3)
    with pytest.raises(DecodeAttentionError, match="contiguous"):
        op(q, k.transpose(2, 3), v, keep, 0.3)


def test_runs_inside_torch_compile():
    module = _module("da_g4_d128_bf16")

    def step(q, k, v, keep):                              # torch ops around the sparta op, fused by Inductor
        return module(q * 1.5, k, v, keep).float().relu()

    compiled = torch.compile(step, fullgraph=True)
    for b, s in ((2, 640), (3, 1000), (2, 640)):
        q, k, v, g = _inputs(module, b, s, seed=b + s)
        keep = _masks(b, s, g)["left_padded"]
        want = decode_attention_ref(q * 1.5, k, v, keep, float(module.scale)).float().relu()
        torch.testing.assert_close(compiled(q, k, v, keep), want, **TOL[q.dtype])


@pytest.mark.parametrize("name", ["da_g1_d128_bf16", "da_g4_d64_fp16"])
def test_a_cuda_graph_replays_on_new_inputs(name):
    module = _module(name)
    b, s = 3, 640
    q, k, v, g = _inputs(module, b, s, seed=11)
    keep = _masks(b, s, g)["causal_prefix"]
    module(q, k, v, keep)                                 # loads the kernels before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = module(q, k, v, keep)
    scale = float(module.scale)
    for seed, kind in ((12, "random"), (13, "left_padded"), (14, "none"), (15, "all"), (16, "sparse")):
        q2, k2, v2, g2 = _inputs(module, b, s, seed=seed)
        q.copy_(q2), k.copy_(k2), v.copy_(v2), keep.copy_(_masks(b, s, g2)[kind])
        graph.replay()
        torch.cuda.synchronize()
        _check(out, q, k, v, keep, scale, f"{name} replay {kind}")


ROPE_CASES = ["da_g4_d128_bf16", "da_g1_d64_fp16", "da_g8_d128_bf16"]


def _rope_module(name) -> DecodeAttentionCUDA:
    module = _module(name)
    if not module.has_rope:
        pytest.skip(MISSING + f"kernels {name}_rope_partial / _rope_combine not built in {ROOT}")
    return module


def _rope_inputs(module, b, s, p, seed):
    """(qkv, k, v, cos, sin, keep): the stacked projections (query heads, the new key, the new value) of a step at
    position ``p`` over a cache of ``s`` slots."""
    q, k, v, g = _inputs(module, b, s, seed)
    spec, dtype = module.spec, q.dtype
    k_new, v_new = (torch.randn(b, spec.hkv, spec.d, device="cuda", generator=g).to(dtype) for _ in range(2))
    inv = 1.0 / (10000 ** (torch.arange(0, spec.d, 2, device="cuda").float() / spec.d))
    ang = torch.full((b, 1), float(p), device="cuda") * inv[None]
    emb = torch.cat([ang, ang], -1)
    keep = _masks(b, s, g)["random"]
    keep[:, p] = True
    return torch.cat([q, k_new, v_new], 1), k, v, emb.cos().to(dtype), emb.sin().to(dtype), keep


@pytest.mark.parametrize("b,s", [(1, 640), (3, 37), (2, 1000)])
@pytest.mark.parametrize("name", ROPE_CASES)
def test_rope_kernels_rotate_write_the_cache_and_attend_as_the_reference(name, b, s):
    """``rope_forward``: the rotated key and the value land in slot ``p`` of the cache (nothing else changes), the
    counter gains one, and the output is the reference's, with ``p`` at the start, middle and end of the cache."""
    from sparta.templates.decode_attention.spec import decode_attention_rope_ref
    module = _rope_module(name)
    for p in (0, s // 2, s - 1):
        qkv, k, v, cos, sin, keep = _rope_inputs(module, b, s, p, seed=p + s)
        kr, vr, position, pr = k.clone(), v.clone(), torch.tensor(p, device="cuda"), torch.tensor(p, device="cuda")
        out = module.rope_forward(qkv, cos, sin, keep, k, v, position)
        want = decode_attention_rope_ref(qkv, cos, sin, kr, vr, keep, pr, float(module.scale))
        torch.cuda.synchronize()
        assert int(position) == p + 1
        assert torch.equal(v, vr) and torch.equal(k[:, :, :p], kr[:, :, :p]) and torch.equal(k[:, :, p + 1:], kr[:, :, p + 1:])
        torch.testing.assert_close(k[:, :, p].float(), kr[:, :, p].float(), rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(out.float(), want.float(), **TOL[qkv.dtype], msg=f"{name} p={p}")


def test_rope_kernels_refuse_a_plain_call_and_bad_inputs():
    module = _rope_module("da_g4_d128_bf16")
    qkv, k, v, cos, sin, keep = _rope_inputs(module, 1, 64, 5, seed=1)
    position = torch.tensor(5, device="cuda")
    with pytest.raises(DecodeAttentionError, match="cos"):
        module.rope_forward(qkv, cos[:, :64].contiguous(), sin, keep, k, v, position)
    with pytest.raises(DecodeAttentionError, match="position"):
        module.rope_forward(qkv, cos, sin, keep, k, v, position.int())
    with pytest.raises(DecodeAttentionError, match="qkv must be"):
        module.rope_forward(qkv[:, :module.spec.hq].contiguous(), cos, sin, keep, k, v, position)
    with pytest.raises(DecodeAttentionError, match="rope kernels take"):
        module._rope_op = None
        DecodeAttentionOp(*module.rope_folders)(qkv, k, v, keep, 0.1)
    assert int(position) == 5, "a refused call writes nothing"


@pytest.mark.parametrize("name", ["da_g4_d128_bf16", "da_g1_d64_fp16"])
def test_a_cuda_graph_of_the_rope_kernels_writes_one_slot_further_each_replay(name):
    """Each replay reads the counter the last one advanced: three replays fill slots p, p+1, p+2 (as three decode
    steps would), each attending over the keys written so far."""
    from sparta.templates.decode_attention.spec import decode_attention_rope_ref
    module = _rope_module(name)
    b, s, p = 2, 640, 100
    qkv, k, v, cos, sin, keep = _rope_inputs(module, b, s, p, seed=7)
    keep[:, p:] = False
    position = torch.tensor(p, device="cuda")
    module.rope_forward(qkv, cos, sin, keep, k.clone(), v.clone(), position.clone())   # load kernels
    torch.cuda.synchronize()
    kr, vr, pr = k.clone(), v.clone(), position.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = module.rope_forward(qkv, cos, sin, keep, k, v, position)
    for step in range(3):
        qkv2, _, _, cos2, sin2, _ = _rope_inputs(module, b, s, p + step, seed=20 + step)
        qkv.copy_(qkv2), cos.copy_(cos2), sin.copy_(sin2)
        keep[:, p + step] = True
        graph.replay()
        want = decode_attention_rope_ref(qkv, cos, sin, kr, vr, keep, pr, float(module.scale))
        torch.cuda.synchronize()
        assert int(position) == int(pr) == p + step + 1
        torch.testing.assert_close(out.float(), want.float(), **TOL[qkv.dtype], msg=f"{name} replay {step}")
        torch.testing.assert_close(k.float(), kr.float(), rtol=1e-2, atol=1e-2)


def test_rope_kernels_update_the_cache_in_place_inside_torch_compile():
    from sparta.templates.decode_attention.spec import decode_attention_rope_ref
    module = _rope_module("da_g4_d128_bf16")
    b, s, p = 2, 640, 37
    qkv, k, v, cos, sin, keep = _rope_inputs(module, b, s, p, seed=3)
    position = torch.tensor(p, device="cuda")
    kr, vr, pr = k.clone(), v.clone(), position.clone()

    def step(qkv, cos, sin, keep):
        return module.rope_forward(qkv * 1.5, cos, sin, keep, k, v, position).float().relu()

    out = torch.compile(step, fullgraph=True)(qkv, cos, sin, keep)
    want = decode_attention_rope_ref(qkv * 1.5, cos, sin, kr, vr, keep, pr, float(module.scale))
    torch.cuda.synchronize()
    assert int(position) == p + 1 and torch.equal(v, vr)
    torch.testing.assert_close(k.float(), kr.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out, want.float().relu(), **TOL[qkv.dtype])
