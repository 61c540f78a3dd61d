"""The dp4a W4A8 GEMV template's torch side (packing, q8 quantisation, reference) and its compile-only build."""

import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparta.templates.cuda_q4_gemv import (Q4GemvSpec, Q8QuantSpec, argument_names, dequantize_weight, q4_gemv,
                                           quantize_q8, quantize_q8_kernel, quantize_weight, reference)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 9), blocks=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_q4_packing_round_trips_and_errs_at_most_half_a_step(n, blocks, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, 32 * blocks, generator=g) * torch.rand(n, 1, generator=g) * 5
    w[0, :32] = 0                                                     # a pruned block stays exactly zero
    wq, dw = quantize_weight(w)
    assert wq.dtype == torch.int32 and wq.shape == (n, 4 * blocks) and dw.shape == (n, blocks)
    deq = dequantize_weight(wq, dw)
    step = dw.float().repeat_interleave(32, 1)
    assert torch.all((deq - w).abs() <= step / 2 + 1e-6 + 1e-3 * step)  # fp16 scale rounding: slightly over
    assert torch.all(deq[0, :32] == 0)
    again, _ = quantize_weight(deq)                                   # representable weights are kept exactly
    assert torch.equal(dequantize_weight(again, dw), deq)


def test_nibble_layout_is_the_one_dp4a_reads():
    """Word i of a block: low nibbles are elements 4i..4i+3, high nibbles 16+4i..16+4i+3."""
    w = torch.arange(32, dtype=torch.float32).sub(16).clamp(-8, 7)[None] * 1.0
    w[0, 0] = -8                                                      # scale exactly 8/7 → codes = w + 8 after rounding
    wq, dw = quantize_weight(w)
    words = wq[0].tolist()
    codes = torch.round(w / dw.float()).clamp(-8, 7).add(8).int()[0].tolist()
    for i, word in enumerate(words):
        word &= 0xFFFFFFFF
        for j in range(4):
            byte = (word >> (8 * j)) & 0xFF
            assert byte & 0xF == codes[4 * i + j] and byte >> 4 == codes[16 + 4 * i + j]


def test_q8_quantisation_and_reference():
    torch.manual_seed(0)
    x = torch.randn(3, 96).half()
    x[1, 32:64] = 0
    xq, xd = quantize_q8(x)
    assert xq.dtype == torch.int8 and xd.shape == (3, 3, 2)
    assert torch.all(xq[1, 32:64] == 0) and xq.abs().max() == 127
    torch.testing.assert_close(xd[..., 1], xd[..., 0] * xq.float().reshape(3, 3, 32).sum(-1))
    w = torch.randn(10, 96)
    wq, dw = quantize_weight(w)
    b = torch.randn(10).half()
    xh = (xq.float().reshape(3, 3, 32) * xd[..., :1]).reshape(3, 96)
    torch.testing.assert_close(reference(x, wq, dw, b).float(), (xh @ dequantize_weight(wq, dw).t() + b.float()),
                               rtol=1e-3, atol=1e-3)


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="1..8"):
        Q4GemvSpec(16, 64, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        Q4GemvSpec(1, 64, 48)
    with pytest.raises(ValueError, match="multiple of 32"):
        Q8QuantSpec(1, 40)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_weight(torch.randn(4, 40))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_kernels_build_with_dp4a_shuffles_and_vector_loads(tmp_path, monkeypatch):
    from sparta.codegen.cuda_build import build_cuda
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    spec = Q4GemvSpec(3, 100, 1056, warps=2, bias=True, name="probe_q4")
    art = build_cuda(q4_gemv, spec)
    src = (art.path / "kernel.cu").read_text()
    assert src.count("dp4a.u32.s32") >= 1 and "shfl.sync.bfly.b32" in src and "*(int4*)(wv_ptr" in src
    args = {a["name"]: a for a in art.launch["args"]}
    assert set(args) == set(argument_names(spec))
    assert args["Wq"]["shape"] == [100, 132] and args["XQ"]["shape"] == [3, 264] and args["Dw"]["dtype"] == "float16"
    assert art.launch["grid"][0] == 50 and art.launch["block"][0] == 64
    q = build_cuda(quantize_q8_kernel, Q8QuantSpec(3, 1056, name="probe_q8"))
    assert "nearbyint" in (q.path / "kernel.cu").read_text() and q.launch["grid"][:2] == [3, 1]
    assert sorted(art.launch["cubins"]) == ["sm_80", "sm_90"]
