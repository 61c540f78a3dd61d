"""The W4A16 dequantisation kernel (``templates/w4a16_gemv/dequant.py``) on the CPU: its spec and checks, the torch
reference (the GEMV's ``(q - zero) · scale`` rounded once; a hypothesis property over shapes, groups and zero
points), and the kernel built through TVM + nvcc (16-byte loads and stores, the arguments the launcher passes)."""

import json
import shutil

import pytest
import torch
from hypothesis import given, settings, strategies as st

from sparta.templates.w4a16_gemv.dequant import W4DequantSpec, dequant_ref
from sparta.templates.w4a16_gemv.spec import W4A16Spec, codes_of, pack_codes, quantize, unpack


def _packed(n, k, group, sym, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    scale, zero = quantize(w, group, sym)
    spec = W4DequantSpec(n, k, group, sym, dtype)
    return spec, pack_codes(codes_of(w, scale, zero, group), scale, zero, spec.gemv)


@pytest.mark.parametrize("kw, words", [(dict(n=8, k=100, group=32), "multiple of the group"),
                                       (dict(n=8, k=96, group=48), "group 48"),
                                       (dict(n=0, k=128), "positive"),
                                       (dict(n=8, k=128, dtype="float32"), "dtype")])
def test_bad_specs_are_refused_with_the_reason(kw, words):
    with pytest.raises(ValueError, match=words):
        W4DequantSpec(**kw)


def test_the_spec_for_a_gemv_reads_its_packed_layout():
    gemv = W4A16Spec(0, 333, 1024, group=64, sym=False, dtype="bfloat16", rows=16, ntile=4, warps=8)
    spec = W4DequantSpec.for_gemv(gemv)
    assert (spec.n, spec.k, spec.group, spec.sym, spec.dtype) == (333, 1024, 64, False, "bfloat16")
    assert (spec.gemv.tiles, spec.gemv.chunks, spec.gemv.groups) == (gemv.tiles, gemv.chunks, gemv.groups)
    assert spec.name == "w4a16_dequant_333x1024_g64_zero_bf16"


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 70), chunks=st.integers(1, 5), group=st.sampled_from([32, 64, 128]), sym=st.booleans(),
       bf16=st.booleans(), seed=st.integers(0, 10_000))
def test_reference_is_the_codes_minus_zero_times_scale_rounded_once(n, chunks, group, sym, bf16, seed):
    k = max(group, 32 * chunks) // group * group
    spec, (wq, s, z) = _packed(n, k, group, sym, "bfloat16" if bf16 else "float16", seed)
    q, scale, zero = unpack(wq, s, z, spec.gemv)
    zf = 8.0 if zero is None else zero.double().repeat_interleave(group, 1)
    exact = (q.double() - zf) * scale.double().repeat_interleave(group, 1)
    want = exact.to(torch.bfloat16 if bf16 else torch.float16)
    got = dequant_ref(wq, s, z, spec)
    assert got.shape == (n, k) and torch.equal(got, want)
    assert (q.float() - zf).abs().max() > 0, "random codes, not all at the zero point"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    pytest.importorskip("tvm")
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    from sparta.templates.w4a16_gemv.dequant import build_dequant
    mp = pytest.MonkeyPatch()
    mp.setenv("SPARTA_CACHE", str(tmp_path_factory.mktemp("cache")))
    specs = [W4DequantSpec(333, 1024, 128, name="dq_sym"),
             W4DequantSpec(203, 544, 32, sym=False, dtype="bfloat16", name="dq_zero_bf16")]
    try:
        yield [(spec, build_dequant(spec)) for spec in specs]
    finally:
        mp.undo()


def test_builds_with_16_byte_loads_and_stores_and_the_launchers_arguments(built):
    for spec, folder in built:
        launch = json.loads((folder / "launch.json").read_text())
        assert {a["name"] for a in launch["args"]} == {"Wq", "S", "W"} | (set() if spec.sym else {"Z"})
        records = spec.gemv.tiles * spec.gemv.chunks * 32
        assert launch["grid"][0] * launch["block"][0] >= records > (launch["grid"][0] - 1) * launch["block"][0]
        src = (folder / "kernel.cu").read_text()
        assert src.count("*(uint4*)(W_ptr") == 4 and "ld_vec_global_nc" in src
        assert ("fma_half_rn_bf16x2" in src) == (spec.dtype == "bfloat16")
