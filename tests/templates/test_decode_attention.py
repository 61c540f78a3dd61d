"""The decode-attention family without a GPU: its torch reference against a naive loop and SDPA, the split-KV algorithm
(each chunk's partials in log2 units, then the merge) against the reference, spec and input checks, the kernel module's
fake, saved form and op, and compile-only CUDA builds for sm_80 and sm_90."""

import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from sparta.errors import SpartaError
from sparta.runtime.cuda import CudaRuntimeError
from sparta.templates.decode_attention.spec import (DecodeAttentionError, DecodeAttentionSpec, check_inputs,
                                                    decode_attention_ref, workspace_shapes)

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


def make_inputs(b, hq, hkv, s, d, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, hq, d, generator=g) * 2).to(dtype)
    k = torch.randn(b, hkv, s, d, generator=g).to(dtype)
    v = (torch.randn(b, hkv, s, d, generator=g) + 0.5).to(dtype)
    return q, k, v


def masks(b, s, seed=0):
    """Random, left-padded (the first keys of each row dropped), a causal prefix, all kept, none kept for row 0."""
    g = torch.Generator().manual_seed(seed)
    pad = torch.randint(0, s, (b,), generator=g)
    fill = torch.randint(1, s + 1, (b,), generator=g)
    pos = torch.arange(s)
    none_row0 = torch.ones(b, s, dtype=torch.bool)
    none_row0[0] = False
    return {"random": torch.rand(b, s, generator=g) < 0.6, "left_padded": pos[None, :] >= pad[:, None],
            "prefix": pos[None, :] < fill[:, None], "all": torch.ones(b, s, dtype=torch.bool), "none_row0": none_row0}


def naive(q, k, v, keep, scale):
    """One (b, h) at a time in float64, zeros where no key is kept."""
    b, hq, d = q.shape
    g = hq // k.shape[1]
    out = torch.zeros(b, hq, d, dtype=torch.float64)
    for i in range(b):
        idx = keep[i].nonzero().flatten()
        if idx.numel() == 0:
            continue
        for h in range(hq):
            kk, vv = k[i, h // g, idx].double(), v[i, h // g, idx].double()
            p = torch.softmax(kk @ q[i, h].double() * scale, 0)
            out[i, h] = p @ vv
    return out


def split_partials(spec, q, k, v, keep, scale):
    """What the partial kernel writes (its workspace, in log2 units), computed chunk by chunk in torch."""
    b, s = k.shape[0], k.shape[2]
    shapes = workspace_shapes(spec, b, s)
    o, ml = torch.full(shapes["O"], float("nan")), torch.empty(shapes["ML"])
    kf = k.float().repeat_interleave(spec.group, 1)
    vf = v.float().repeat_interleave(spec.group, 1)
    for c in range(spec.splits(s)):
        sl = slice(c * spec.chunk, min(s, (c + 1) * spec.chunk))
        kept = keep[:, sl]
        scores = torch.einsum("bhd,bhsd->bhs", q.float(), kf[:, :, sl]) * scale * math.log2(math.e)
        scores = scores.masked_fill(~kept[:, None, :], -math.inf)
        m = scores.amax(-1)
        p = torch.exp2(scores - m[..., None])
        for i in range(b):
            if kept[i].any():           # else the kernel writes no V sums (left NaN here: the merge must skip them)
                o[i, :, c] = torch.einsum("hs,hsd->hd", p[i], vf[i, :, sl])
                ml[i, :, c, 0], ml[i, :, c, 1] = m[i], p[i].sum(-1)
            else:
                ml[i, :, c, 0], ml[i, :, c, 1] = -math.inf, 0.0
    return o, ml


def combine(o, ml, dtype):
    """What the combine kernel writes from the workspace."""
    m, l = ml[..., 0], ml[..., 1]
    big = m.amax(-1, keepdim=True)
    w = torch.where(l > 0, torch.exp2(m - torch.where(torch.isfinite(big), big, torch.zeros_like(big))),
                    torch.zeros_like(m))
    num = (torch.where((l > 0)[..., None], o, torch.zeros_like(o)) * w[..., None]).sum(2)
    den = (w * l).sum(-1, keepdim=True)
    return torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(num)).to(dtype)


@pytest.mark.parametrize("g", [1, 4, 8])
@pytest.mark.parametrize("s", [1, 37, 640])
def test_reference_matches_a_naive_loop_and_sdpa(g, s):
    hkv, d, b = 2, 64, 3
    q, k, v = make_inputs(b, g * hkv, hkv, s, d, seed=s + g)
    scale = d ** -0.5
    for name, keep in masks(b, s, seed=s).items():
        ref = decode_attention_ref(q, k, v, keep, scale)
        assert ref.dtype == q.dtype and ref.shape == q.shape
        want = naive(q, k, v, keep, scale)
        torch.testing.assert_close(ref.double(), want, atol=2e-2, rtol=2e-2, msg=name)
        rows = keep.any(-1)
        assert not ref[~rows].any(), f"{name}: a row with no kept key is zeros"
        sdpa = F.scaled_dot_product_attention(q[:, :, None].float(), k.float(), v.float(), attn_mask=keep[:, None, None],
                                              scale=scale, enable_gqa=True)[:, :, 0]
        torch.testing.assert_close(ref[rows].float(), sdpa[rows], atol=2e-2, rtol=2e-2, msg=name)


@pytest.mark.parametrize("g, s, chunk", [(1, 1, 64), (4, 37, 32), (8, 640, 128), (2, 1000, 64)])
def test_split_partials_merge_to_the_reference(g, s, chunk):
    spec = DecodeAttentionSpec(2 * g, 2, 128, chunk=chunk, threads=256)
    b = 3
    q, k, v = make_inputs(b, spec.hq, 2, s, 128, torch.float16, seed=g)
    for name, keep in masks(b, s, seed=g).items():
        o, ml = split_partials(spec, q, k, v, keep, 0.1)
        got = combine(o, ml, q.dtype)
        torch.testing.assert_close(got.float(), decode_attention_ref(q, k, v, keep, 0.1).float(), atol=4e-3,
                                   rtol=4e-3, msg=name)


@pytest.mark.parametrize("kw, words", [
    (dict(hq=6, hkv=4), "multiple of the kv heads"),
    (dict(d=96), "not supported"),
    (dict(dtype="float32"), "dtype"),
    (dict(chunk=48), "multiple of 32"),
    (dict(threads=96), "threads"),
    (dict(d=64, threads=512), "at most 32"),
    (dict(chunk=128, threads=128), "8 of K and of V"),
    (dict(hq=64, hkv=2, threads=256), "scores in registers"),
    (dict(stage="both"), "stage"),
])
def test_bad_specs_are_refused_with_the_reason(kw, words):
    with pytest.raises(DecodeAttentionError, match=words) as info:
        DecodeAttentionSpec(**{"hq": 8, "hkv": 2, "d": 128, **kw})
    assert isinstance(info.value, SpartaError)


def test_bad_inputs_are_refused_with_the_reason():
    spec = DecodeAttentionSpec(8, 2, 64, dtype="float16")
    q, k, v = make_inputs(2, 8, 2, 37, 64, torch.float16)
    keep = torch.ones(2, 37, dtype=torch.bool)
    assert check_inputs(spec, q, k, v, keep) == (2, 37)
    bad = {"q must be torch.float16": (q.bfloat16(), k, v, keep),
           "keep must be torch.bool": (q, k, v, keep.to(torch.uint8)),
           "q must be \\(B, Hq, D\\)": (q[:, :4].contiguous(), k, v, keep),
           "v must be \\(B, Hkv, S, D\\)": (q, k, v[:, :, :30].contiguous(), keep),
           "keep must be \\(B, S\\)": (q, k, v, keep[:, :5].contiguous()),
           "k must be contiguous": (q, k.transpose(1, 2).contiguous().transpose(1, 2), v, keep),
           "k must be a 4-d tensor": (q, k[0], v, keep)}
    for words, args in bad.items():
        with pytest.raises(DecodeAttentionError, match=words):
            check_inputs(spec, *args)


def test_workspace_has_a_row_per_chunk_and_a_partial_last_chunk():
    spec = DecodeAttentionSpec(32, 8, 128)
    assert workspace_shapes(spec, 3, 641) == {"O": (3, 32, 11, 128), "ML": (3, 32, 11, 2)}
    assert spec.pair()[1].stage == "combine" and spec.steps == 8 and spec.group == 4


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Two built kernel pairs (G=4 bf16 D=128 with PDL; G=1 fp16 D=64, 64 threads, chunks of 32, no PDL)."""
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    from sparta.templates.decode_attention.build import build_decode_attention
    mp = pytest.MonkeyPatch()
    mp.setenv("SPARTA_CACHE", str(tmp_path_factory.mktemp("cache")))
    out = tmp_path_factory.mktemp("kernels")
    try:
        yield {"gqa": build_decode_attention(8, 2, 128, "bfloat16", out=out, name="da_gqa", scale=0.125),
               "mha": build_decode_attention(3, 3, 64, "float16", chunk=32, threads=64, pdl=False, out=out,
                                             name="da_mha")}, out
    finally:
        mp.undo()


@needs_nvcc
def test_builds_both_stages_for_sm80_and_sm90(built):
    _, out = built
    for name, pdl in (("da_gqa", True), ("da_mha", False)):
        part = json.loads((out / f"{name}_partial" / "launch.json").read_text())
        comb = json.loads((out / f"{name}_combine" / "launch.json").read_text())
        for launch in (part, comb):
            assert sorted(launch["cubins"]) == ["sm_80", "sm_90"] and bool(launch.get("pdl")) == pdl
        hkv, chunk, threads = (2, 64, 128) if name == "da_gqa" else (3, 32, 64)
        assert part["grid"] == [["S", chunk], hkv, ["B", 1]] and part["block"] == [threads, 1, 1]
        assert comb["grid"] == [8 if name == "da_gqa" else 3, ["B", 1], 1]
        assert [a["name"] for a in part["args"] if a.get("scalar")] == ["B", "NS", "S"]
        src = (out / f"{name}_partial" / "kernel.cu").read_text()
        assert "__ballot_sync" in src and "uint4" in src and "exp2f" in src
        assert ("griddepcontrol.wait" in src) == pdl


@needs_nvcc
def test_module_reads_its_folders_fakes_its_output_and_saves(built):
    from sparta.templates.decode_attention.runtime import DecodeAttentionCUDA, DecodeAttentionOp
    modules, out = built
    gqa = modules["gqa"]
    assert gqa.spec.hq == 8 and float(gqa.scale) == 0.125 and float(modules["mha"].scale) == 64 ** -0.5
    again = DecodeAttentionCUDA.from_folder(out, "da_gqa", scale=0.125)
    assert again.spec == gqa.spec and again.partial_folder.endswith("da_gqa_partial")
    with pytest.raises(DecodeAttentionError, match="not the partial and combine"):
        DecodeAttentionCUDA(out / "da_gqa_partial", out / "da_mha_combine")
    config, tensors, folders = gqa.saved_state()
    assert sorted(folders) == ["da_gqa_combine", "da_gqa_partial"]
    loaded = DecodeAttentionCUDA.from_saved(json.loads(json.dumps(config)), tensors, folders)
    assert loaded.spec == gqa.spec and float(loaded.scale) == 0.125
    q, k, v = make_inputs(3, 8, 2, 37, 128)
    keep = torch.ones(3, 37, dtype=torch.bool)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fq, fk, fv, fkeep = (mode.from_tensor(t) for t in (q, k, v, keep))
        y, = torch.ops.sparta.decode_attention(gqa.kernel_key, [fq, fk, fv, fkeep], [mode.from_tensor(gqa.scale)])
    assert y.shape == (3, 8, 128) and y.dtype == torch.bfloat16
    with pytest.raises(CudaRuntimeError, match="CUDA"):
        gqa(q, k, v, keep)
    with pytest.raises(DecodeAttentionError, match="q must be"):
        DecodeAttentionOp(out / "da_gqa_partial", out / "da_gqa_combine")(q.half(), k, v, keep, 0.1)
