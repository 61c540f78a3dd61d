"""The CPU int8 linear (oneDNN u8·s8, ``templates/onednn_int8/runtime.py``) against its torch reference, and its choice by
``compile`` for dense W8A8 plans."""

from __future__ import annotations

import pytest
import torch

import sparta
from sparta.errors import CodegenError
from sparta.templates.onednn_int8 import runtime as cpu_int8
from sparta.templates.onednn_int8.runtime import Int8LinearCPU, host_code_bits, int8_reference

pytestmark = pytest.mark.skipif(not cpu_int8.available(), reason="torch here has no oneDNN int8 linear")


def _codes(n, k, bits, gen):
    top = 2 ** (bits - 1) - 1
    return torch.randint(-top, top + 1, (n, k), dtype=torch.int8, generator=gen)


@pytest.mark.parametrize("m,n,k", [(1, 37, 53), (3, 64, 96), (130, 96, 200), (64, 3072, 768)])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_its_reference_on_odd_shapes(m, n, k, bias):
    gen = torch.Generator().manual_seed(m * 7 + n)
    codes = _codes(n, k, host_code_bits(), gen)
    scale = torch.rand(n, generator=gen) * 0.01 + 1e-3
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(m, k, generator=gen) * 3
    lin = Int8LinearCPU("op", "x", codes, scale, b, (m, n), host_code_bits())
    ref = int8_reference(x, codes, scale, b)
    torch.testing.assert_close(lin(x), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_extreme_codes_sum_exactly():
    """Every weight and activation code at its extreme: the int16 pair sums of a VNNI-less CPU saturate unless
    the weight codes keep the host's width, which the module enforces."""
    bits = host_code_bits()
    top = 2 ** (bits - 1) - 1
    n, k = 48, 256
    codes = torch.full((n, k), top, dtype=torch.int8)
    codes[::2] = -top
    x = torch.ones(5, k)
    x[1] = -1.0
    lin = Int8LinearCPU("op", "x", codes, torch.ones(n), None, (5, n), bits)
    torch.testing.assert_close(lin(x), int8_reference(x, codes, torch.ones(n), None), rtol=0, atol=1e-3)


def test_codes_wider_than_the_host_sums_are_refused():
    gen = torch.Generator().manual_seed(0)
    if host_code_bits() == 8:
        pytest.skip("this CPU has VNNI: 8-bit codes sum exactly")
    with pytest.raises(CodegenError, match="overflow"):
        Int8LinearCPU("op", "x", _codes(8, 8, 8, gen), torch.ones(8), None, (1, 8), 8)
    with pytest.raises(CodegenError, match="within"):
        Int8LinearCPU("op", "x", _codes(8, 8, 8, gen), torch.ones(8), None, (1, 8), host_code_bits())


def test_all_zero_weight_gives_the_bias():
    b = torch.randn(16)
    lin = Int8LinearCPU("op", "x", torch.zeros(16, 32, dtype=torch.int8), torch.ones(16), b, (4, 16), 7)
    torch.testing.assert_close(lin(torch.randn(4, 32)), b.expand(4, 16))


class FFN(torch.nn.Module):
    def __init__(self, d=96, h=256):
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, h), torch.nn.Linear(h, d)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def test_compile_runs_dense_w8a8_on_onednn_and_saves_it(tmp_path):
    """Calibrated to W8A8, every dense linear runs on the int8 kernel: the plan says so (and that the weights are
    7-bit codes where the CPU lacks VNNI), the GELU runs after it as a torch op, and the model verifies, saves and
    loads."""
    torch.manual_seed(0)
    model = FFN().eval()
    batches = [(torch.randn(64, 96),) for _ in range(2)]
    compiled = sparta.compile(model, {}, batches[0], calibration=batches,
                              quant_tolerance={"tolerance": 1e-2, "activations": True, "progress": False})
    kernels = {p.op: p.kernel for p in compiled.plan.ops.values() if p.kind == "sparse"}
    assert kernels and {k.kernel for k in kernels.values()} == {"onednn_int8"}
    report = compiled.plan_report()
    assert "onednn_int8[int8]" in report
    if host_code_bits() == 7:
        assert "7-bit codes" in report
        assert {p.weight_quant[8].bits for p in compiled.plan.ops.values() if p.kind == "sparse"} == {7}
    assert all(p.epilogue == ["bias"] for p in compiled.plan.ops.values() if p.kind == "sparse")
    compiled.verify()
    x = torch.randn(64, 96)
    with torch.no_grad():
        y, ref = compiled(x), model(x)
    assert float((y - ref).pow(2).mean() / ref.pow(2).mean()) < 1e-2
    compiled.save(tmp_path / "m")
    loaded = sparta.load(tmp_path / "m")
    torch.testing.assert_close(loaded(x), y)
