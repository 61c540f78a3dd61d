"""Models pruned with torch.nn.utils.prune (masks attached or made permanent) compile with their masks as TeSAs."""

import warnings

import pytest
import torch
from torch.nn.utils import prune

import sparta
from sparta import TeSA
from sparta.frontend.prune_masks import FROM_PRUNE, FROM_USER, FROM_ZEROS, MIN_ZERO_FRACTION, mask_sources_line


def _mlp(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64)).eval()


def _compile(model, tesa=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sparta.compile(model, tesa, (torch.randn(4, 64),), target="cpu")


def _gemm(compiled, weight: str):
    (plan,) = [p for p in compiled.plan.ops.values() if p.weight == weight]
    return plan


def _check_outputs(compiled, model):
    for rows in (3, 7, 1):
        x = torch.randn(rows, 64)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)


def _l1(m):
    prune.l1_unstructured(m[0], "weight", amount=0.9)


def _random(m):
    prune.random_unstructured(m[0], "weight", amount=0.9)


def _ln_rows(m):
    prune.ln_structured(m[0], "weight", amount=0.9, n=2, dim=0)


def _random_columns(m):
    prune.random_structured(m[0], "weight", amount=0.9, dim=1)


def _global(m):
    with torch.no_grad():   # both weights drawn alike, so both keep about 15% and every hidden unit stays in use
        m[2].weight.mul_(128 ** 0.5 / 64 ** 0.5)
    prune.global_unstructured([(m[0], "weight"), (m[2], "weight")], pruning_method=prune.L1Unstructured, amount=0.85)
    assert m[2].weight_mask.any(0).all() and 0.1 < m[2].weight_mask.mean() < 0.2


def _custom(m):
    prune.custom_from_mask(m[0], "weight", torch.rand(128, 64, generator=torch.Generator().manual_seed(1)) < 0.1)


def _stacked(m):
    prune.l1_unstructured(m[0], "weight", amount=0.7)
    prune.random_unstructured(m[0], "weight", amount=0.7)


@pytest.mark.parametrize("method", [_l1, _random, _ln_rows, _random_columns, _global, _custom, _stacked])
def test_pruned_linear_runs_sparse_at_its_mask(method):
    model = _mlp()
    method(model)
    mask = model[0].weight_mask.bool().clone()
    compiled = _compile(model)
    if method is _ln_rows:          # whole rows pruned: the linear runs dense on its kept rows (channel shrinking)
        gemm = _gemm(compiled, "0.weight_shrunk")
        assert gemm.kind == "shrink" and gemm.shrink["out"] == [128, int(mask.any(1).sum())]
    else:
        gemm = _gemm(compiled, "0.weight")
        assert gemm.kind == "sparse" and gemm.density == pytest.approx(mask.float().mean().item())
    assert torch.equal(compiled.tesa("0.weight").mask, mask) and compiled.tesa("0.weight_orig") == compiled.tesa(
        "0.weight")
    assert FROM_PRUNE in mask_sources_line(compiled.graph)
    _check_outputs(compiled, model)
    assert hasattr(model[0], "weight_orig") and hasattr(model[0], "weight_mask"), "the user's model keeps its pruning"
    assert any(isinstance(h, prune.BasePruningMethod) for h in model[0]._forward_pre_hooks.values())
    assert torch.equal(model[0].weight_mask.bool(), mask) and not isinstance(model[0].weight, torch.nn.Parameter)


def test_user_tesa_meets_the_mask():
    model = _mlp()
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    mask = model[0].weight_mask.bool()
    user = torch.rand(128, 64, generator=torch.Generator().manual_seed(2)) < 0.2
    compiled = _compile(model, {"0.weight": TeSA.from_mask(user)})
    assert torch.equal(compiled.tesa("0.weight").mask, mask & user)
    assert _gemm(compiled, "0.weight").density == pytest.approx((mask & user).float().mean().item())
    assert mask_sources_line(compiled.graph) == f"masks: 1 from {FROM_PRUNE}, 1 from {FROM_USER}"
    assert compiled.plan_report().splitlines()[-1] == f"masks: 1 from {FROM_PRUNE}, 1 from {FROM_USER}"
    reference = _mlp()
    with torch.no_grad():
        reference[0].weight.copy_(model[0].weight * user)
        reference[0].bias.copy_(model[0].bias)
    _check_outputs(compiled, reference)
    by_orig = _compile(model, {"0.weight_orig": user})      # the name the pruned model's state_dict uses
    assert torch.equal(by_orig.tesa("0.weight").mask, mask & user)


def test_permanent_zeros_are_picked_up():
    model = _mlp()
    prune.l1_unstructured(model[0], "weight", amount=0.8)
    prune.remove(model[0], "weight")
    compiled = _compile(model)
    kept = model[0].weight != 0
    assert torch.equal(compiled.tesa("0.weight").mask, kept) and _gemm(compiled, "0.weight").kind == "sparse"
    assert mask_sources_line(compiled.graph) == f"masks: 1 from {FROM_ZEROS}"
    _check_outputs(compiled, model)


def test_dense_model_gets_no_tesa_from_zeros():
    model = _mlp()
    with torch.no_grad():           # a few exact zeros, under the threshold, and a zero bias
        model[0].weight.view(-1)[: int(MIN_ZERO_FRACTION * 128 * 64) - 1] = 0
        model[2].bias.zero_()
    compiled = _compile(model)
    assert all(compiled.tesa(name).is_dense for name, _ in model.named_parameters())
    assert mask_sources_line(compiled.graph) == "masks: none"
    assert all(p.kind != "sparse" for p in compiled.plan.ops.values())
    _check_outputs(compiled, model)


def test_nothing_pruned_runs_dense():
    model = _mlp()
    prune.l1_unstructured(model[0], "weight", amount=0.0)
    compiled = _compile(model)
    assert compiled.tesa("0.weight").is_dense and _gemm(compiled, "0.weight").kind != "sparse"
    _check_outputs(compiled, model)


def test_everything_pruned_gives_the_bias():
    model = _mlp()
    prune.l1_unstructured(model[0], "weight", amount=1.0)
    compiled = _compile(model)
    assert compiled.tesa("0.weight").density == 0.0
    _check_outputs(compiled, model)
    x = torch.randn(5, 64)
    with torch.no_grad():
        hidden = torch.relu(model[0].bias).expand(5, 128)
        torch.testing.assert_close(compiled(x), model[2](hidden), rtol=1e-5, atol=1e-5)
