"""The channel-at-a-time fit to the weight and the grouped codes give exactly what the whole-tensor formulas give."""

import pytest
import torch

from sparta.passes.quant import fit_weight
from sparta.passes.quant.scheme import CLIPS, QuantParams, fit_to_weight, weight_params


def _codes_whole(p: QuantParams, w: torch.Tensor) -> torch.Tensor:
    """The codes as element-wise (N, K) scales and zero points give them."""
    scale, zero = p.expand(w.shape[1])
    q = torch.round(w.float() / scale)
    return (q if zero is None else q + zero).clamp(*p.code_range())


def _dequantize_whole(p: QuantParams, w: torch.Tensor) -> torch.Tensor:
    scale, zero = p.expand(w.shape[1])
    q = _codes_whole(p, w)
    return (q if zero is None else q - zero) * scale


def _weight(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * (torch.rand(n, 1, generator=g) * 3 + 0.01)
    w[:, 0] *= 8                                            # outliers: clipping pays on some channels
    return (w * (torch.rand(n, k, generator=g) < 0.9)).to(torch.bfloat16)


def _search_whole(w, symmetric, granularity, group):
    """The clip search over the whole tensor, as ``fit_weight`` runs it with the weight's own error."""
    if granularity == "tensor":
        return fit_weight(w, 4, lambda dq: (dq - w).pow(2).sum(1), symmetric=symmetric, granularity="tensor")[0]
    g = group if granularity == "group" else None
    tried = [weight_params(w, 4, symmetric=symmetric, group=g, clip=c) for c in CLIPS]
    errs = torch.stack([(_dequantize_whole(p, w) - w).pow(2).sum(1).double() for p in tried])
    rows, pick = torch.arange(w.shape[0]), errs.argmin(0)
    zero = None if symmetric else torch.stack([p.zero for p in tried])[pick, rows]
    return QuantParams(4, torch.stack([p.scale for p in tried])[pick, rows], zero, tried[0].group,
                       torch.tensor([CLIPS[i] for i in pick.tolist()], dtype=torch.float32))


@pytest.mark.parametrize("n,k,symmetric,granularity,group", [
    (130, 256, True, "group", 128), (70, 300, True, "group", 128), (65, 96, False, "group", 32),
    (129, 200, False, "channel", 128), (3, 50, True, "channel", 128), (40, 64, True, "tensor", 128)])
def test_fit_to_weight_equals_the_whole_tensor_search(n, k, symmetric, granularity, group):
    w = _weight(n, k, n + k)
    ref = _search_whole(w.float(), symmetric, granularity, group)
    got = fit_to_weight(w, 4, symmetric=symmetric, granularity=granularity, group=group)
    assert got.group == ref.group and torch.equal(got.clip, ref.clip) and torch.equal(got.scale, ref.scale)
    assert (got.zero is None) == symmetric and (symmetric or torch.equal(got.zero, ref.zero))
    if granularity != "tensor":
        assert len(set(got.clip.tolist())) > 1, "the weights should make channels pick different clips"


def test_search_errors_match_whole_tensor_formulas():
    """The per-clip errors the fit compares are the whole-tensor formulas' bit for bit."""
    w = _weight(33, 384, 5).float()
    for c in CLIPS[::4]:
        p = weight_params(w, 4, group=128, clip=c)
        assert torch.equal(p.dequantize(w), _dequantize_whole(p, w))


@pytest.mark.parametrize("k,group,symmetric", [(256, 128, True), (200, 64, False), (96, 96, True), (7, 3, False)])
def test_codes_and_dequantize_equal_element_wise_formulas(k, group, symmetric):
    w = _weight(17, k, k)
    p = weight_params(w, 4, symmetric=symmetric, group=group, clip=torch.linspace(0.6, 1.0, 17))
    assert torch.equal(p.codes(w), _codes_whole(p, w))
    assert torch.equal(p.dequantize(w), _dequantize_whole(p, w))
    t = w.float().t().contiguous().t()                       # a non-contiguous weight reads the same
    assert torch.equal(p.codes(t), _codes_whole(p, w))


@pytest.mark.parametrize("symmetric, granularity, group", [(True, "group", 128), (False, "channel", 128),
                                                            (True, "tensor", 128)])
def test_a_plan_without_clip_ratios_fits_them_when_asked_as_the_plan_would_have(symmetric, granularity, group):
    """A meta-device compile records the scheme with no clip ratios; the load fits them to the checkpoint: the params
    equal those of the plan a compile with the weight records (``WeightQuant.of`` of ``fit_to_weight``)."""
    from sparta.errors import PlanError
    from sparta.passes.quant.scheme import WeightQuant, fit_device
    w = _weight(96, 256, 3)
    meta = WeightQuant.of(fit_to_weight(w.to("meta"), 4, symmetric=symmetric, granularity=granularity, group=group),
                          granularity, "weight")
    assert meta.deferred and meta.clip == []
    real = WeightQuant.of(fit_to_weight(w, 4, symmetric=symmetric, granularity=granularity, group=group),
                          granularity, "weight")
    assert (meta.bits, meta.group, meta.symmetric) == (real.bits, real.group, real.symmetric)
    with fit_device("cpu"):
        on_cpu = meta.params(w)
    for got in (meta.params(w), on_cpu):
        want = real.params(w)
        assert torch.equal(got.scale, want.scale) and (got.zero is None) == (want.zero is None)
        assert got.zero is None or torch.equal(got.zero, want.zero)
    assert meta.params(w.to("meta")).scale.shape == want.scale.shape
    with pytest.raises(PlanError, match="no clip ratios"):
        WeightQuant(4, granularity, meta.group, symmetric, [], "calibration").params(w)
