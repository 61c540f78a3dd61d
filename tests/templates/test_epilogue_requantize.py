"""The requantising epilogue's arithmetic (``epilogue.unit_value`` + ``requantize_bits``), emulated in fp32
torch ops, against the reference ``epilogue_ref.requantize``: z = sat(y·r/span + offset/span), the code the low byte
of fp32 fma(z, span, M − offset). Equal to round(y·r) clamped to ±127 except next to a rounding tie, by one."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparta.templates.epilogue import ROUND_MAGIC, code_span
from sparta.templates.epilogue_ref import out_scale_arg, requantize


def fma32(a, b, c) -> torch.Tensor:
    """fp32 fma: a·b exact in fp64 (two 24-bit mantissas), plus c, rounded to fp32."""
    return (torch.as_tensor(a).double() * torch.as_tensor(b).double() + torch.as_tensor(c).double()).float()


def kernel_codes(y: torch.Tensor, scale: float, act: str = "none", folded: bool = False) -> torch.Tensor:
    """What the kernel computes for the fp32 epilogue value ``y`` (after bias and activation)."""
    span, offset = code_span(act, folded)
    r = out_scale_arg(scale)[1]
    q = r * torch.tensor(1.0 / span, dtype=torch.float32)               # fp32 multiply, as OS[1] · (1/span)
    z = fma32(y.float(), q, torch.tensor(offset / span, dtype=torch.float32)).clamp(0, 1)     # __saturatef
    t = fma32(z, torch.tensor(span), torch.tensor(ROUND_MAGIC - offset, dtype=torch.float32))
    return (t.view(torch.int32) & 0xFF).to(torch.uint8).view(torch.int8)


def near_tie(y: torch.Tensor, scale: float, eps: float = 2.0 ** -13) -> torch.Tensor:
    """|y·r| within ``eps`` of a half-integer (z's rounding moves y·r by at most ≈ 2.3e-5 at |y·r| = 127)."""
    v = y.double() * out_scale_arg(scale)[1].double()
    return ((v - v.floor() - 0.5).abs() < eps) & (v.abs() < 128)


fp32 = st.floats(width=32, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(st.lists(fp32, min_size=1, max_size=64), st.floats(2.0 ** -20, 2.0 ** 20, width=32),
       st.sampled_from([("none", False), ("relu", True), ("gelu", False)]))
def test_saturating_codes_match_the_reference_but_next_to_ties(values, scale, form):
    y = torch.tensor(values, dtype=torch.float32)
    act, folded = form
    ref = requantize(y.clamp_min(0) if act == "relu" else y, scale)
    got = kernel_codes(y, scale, act, folded)
    diff = (got.int() - ref.int()).abs()
    assert diff.max() <= 1
    assert not diff[~near_tie(y, scale)].any()


def test_extremes_clamp_and_random_values_agree():
    y = torch.tensor([126.4, -126.4, 127.49, 127.5, -127.5, 128.0, 3e38, -3e38, float("inf"), float("-inf"),
                      2.0 ** 22 + 0.5, -(2.0 ** 22) - 0.5, 0.0, -0.0, 1e-40, 0.49, -0.49, 0.51, -0.51])
    assert kernel_codes(y, 1.0).tolist() == [126, -126, 127, 127, -127, 127, 127, -127, 127, -127, 127, -127,
                                             0, 0, 0, 0, 0, 1, -1]
    assert kernel_codes(y, 1.0, "relu", True).tolist() == [126, 0, 127, 127, 0, 127, 127, 0, 127, 0, 127, 0,
                                                           0, 0, 0, 0, 0, 1, 0]
    g = torch.Generator().manual_seed(0)
    y = torch.randn(200_000, generator=g) * 300
    for scale in (0.01, 1.0, 3.7):
        for act, folded in (("none", False), ("relu", True)):
            ref = requantize(y.clamp_min(0) if act == "relu" else y, scale)
            diff = (kernel_codes(y, scale, act, folded).int() - ref.int()).abs()
            assert diff.max() <= 1 and not diff[~near_tie(y, scale)].any()
            assert diff.sum() <= 5           # ties within 2⁻¹³ are rare in random data
