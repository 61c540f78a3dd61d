"""The requantising epilogue's arithmetic (``cuda_bsr_parts.requantize_bits``), emulated in fp32 torch ops, against
the reference ``cuda_bsr_ref.requantize``: round half to even and the ±127 clamp without a float→int conversion."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparta.templates.cuda_bsr_parts import ROUND_MAGIC
from sparta.templates.cuda_bsr_ref import out_scale_arg, requantize


def magic_codes(y: torch.Tensor, scale: float) -> torch.Tensor:
    """What the kernel computes: t = RN(RN(y·r) + M), clamped to [M − 127, M + 127]; the code is t's low byte."""
    r = out_scale_arg(scale)[1]
    m = torch.tensor(ROUND_MAGIC, dtype=torch.float32)
    t = (y.float() * r) + m                       # two fp32 roundings, as __fmul_rn / __fadd_rn
    t = torch.minimum(torch.maximum(t, m - 127), m + 127)
    return (t.view(torch.int32) & 0xFF).to(torch.uint8).view(torch.int8)


fp32 = st.floats(width=32, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(st.lists(fp32, min_size=1, max_size=64), st.floats(2.0 ** -20, 2.0 ** 20, width=32))
def test_magic_rounding_equals_the_reference(values, scale):
    y = torch.tensor(values, dtype=torch.float32)
    assert torch.equal(magic_codes(y, scale), requantize(y, scale))


def test_ties_round_to_even_and_extremes_clamp():
    y = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 127.49, 127.5, -127.5, 3e38, -3e38,
                      float("inf"), float("-inf"), 2.0 ** 22 + 0.5, -(2.0 ** 22) - 0.5, 0.0, -0.0, 1e-40])
    codes = magic_codes(y, 1.0)
    assert codes.tolist() == [0, 2, 2, 0, -2, -2, 126, -126, 127, 127, -127, 127, -127, 127, -127, 127, -127,
                              0, 0, 0]
    assert torch.equal(codes, requantize(y, 1.0))
    g = torch.Generator().manual_seed(0)
    y = torch.randn(100_000, generator=g) * 300
    for scale in (0.01, 1.0, 3.7):
        assert torch.equal(magic_codes(y, scale), requantize(y, scale))
