"""Quantisers and the clip-ratio fit: codes in range, bounded error, zeros kept, fit beats absmax."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparta.passes.quant import fake_quant_rows, fit_weight, weight_params
from sparta.passes.quant.scheme import CLIPS, per_tensor


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 9), k=st.integers(1, 70), bits=st.sampled_from([2, 3, 4, 8]), symmetric=st.booleans(),
       group=st.sampled_from([None, 1, 8, 32]), seed=st.integers(0, 2**16), scale=st.floats(1e-3, 1e3))
def test_codes_in_range_error_bounded_zeros_exact(n, k, bits, symmetric, group, seed, scale):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * scale * (torch.rand(n, k, generator=g) < 0.8)   # some exact zeros
    p = weight_params(w, bits, symmetric=symmetric, group=group)
    lo, hi = p.code_range()
    q = p.codes(w)
    assert q.min() >= lo and q.max() <= hi and torch.equal(q, q.round())
    step, _ = p.expand(k)
    dq = p.dequantize(w)
    assert ((dq - w).abs() <= step / 2 * (1 + 1e-5) + 1e-30).all(), "clip 1: every value within half a step"
    assert (dq[w == 0] == 0).all(), "zeros (pruned elements) stay exactly zero"


def test_per_tensor_has_one_scale():
    w = torch.randn(6, 10)
    p = per_tensor(w, 4)
    assert torch.unique(p.scale).numel() == 1 and p.group == 10


def test_fit_picks_the_clip_minimising_each_channels_error():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 64, generator=g)
    w[:, 0] *= 12                                   # one outlier per row: clipping it pays
    x = torch.randn(256, 64, generator=g)
    y = x @ w.t()

    def channel_sse(q):
        return (x @ q.t() - y).pow(2).sum(0)
    params, err = fit_weight(w, 4, channel_sse, granularity="channel")
    absmax = channel_sse(weight_params(w, 4).dequantize(w))
    assert (err <= absmax.double() + 1e-6).all() and err.sum() < 0.9 * absmax.sum()
    assert (params.clip < 1).any()
    torch.testing.assert_close(channel_sse(params.dequantize(w)).double(), err, rtol=1e-5, atol=1e-5)
    for c in CLIPS:                                  # no clip on the grid does better for any channel
        other = channel_sse(weight_params(w, 4, clip=c).dequantize(w)).double()
        assert (err <= other + 1e-4).all()


def test_asymmetric_beats_symmetric_on_skewed_weights():
    g = torch.Generator().manual_seed(1)
    w = torch.rand(8, 32, generator=g) + 0.5       # all positive: symmetric wastes half its codes
    sse = lambda q: (q - w).pow(2).sum(1)           # noqa: E731
    _, sym = fit_weight(w, 4, sse, symmetric=True, granularity="channel")
    _, asym = fit_weight(w, 4, sse, symmetric=False, granularity="channel")
    assert asym.sum() < 0.5 * sym.sum()


def test_activation_rows_match_the_int8_kernel_quantiser():
    from sparta.templates.cpu_linear.block_spec import quantize_rows
    x = torch.randn(5, 33) * torch.logspace(-2, 2, 5)[:, None]
    q, s = quantize_rows(x)
    torch.testing.assert_close(fake_quant_rows(x, 8), q.float() * s[:, None])
    torch.testing.assert_close(fake_quant_rows(x, 16), x.half().float())


def test_bad_granularity():
    with pytest.raises(ValueError, match="granularity"):
        fit_weight(torch.randn(2, 2), 4, lambda q: q.sum(1), granularity="row")
