"""The joint plan: calibration that may also prune a GEMM weight's blocks by magnitude (``QuantConfig.densities``),
keeping, within the tolerance, the (density, width) the target's profile estimates cheapest."""

import pytest
import torch
import torch.nn as nn

import sparta
from sparta.passes import calibrate
from sparta.passes.quant import QuantizationError, fake_quantized_weights
from sparta.passes.quant.prune import block_magnitude_mask


def _batches(k, n=2, rows=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, k, generator=g),) for _ in range(n)]


def _linear_with_small_blocks(n=256, k=512, big=0.25, seed=0):
    """A linear whose weight has ``big`` of its 32×32 blocks (exactly) at full scale and the rest 1e-4 of it."""
    g = torch.Generator().manual_seed(seed)
    blocks = (n // 32) * (k // 32)
    grid = torch.zeros(blocks, dtype=torch.bool)
    grid[torch.randperm(blocks, generator=g)[:round(big * blocks)]] = True
    grid = grid.reshape(n // 32, k // 32)
    scale = torch.where(grid, 1.0, 1e-4).repeat_interleave(32, 0).repeat_interleave(32, 1)
    lin = nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * scale)
    return lin.eval(), grid


def test_the_largest_blocks_are_kept():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(70, 45, generator=g)                      # edge blocks: 70 = 2·32 + 6, 45 = 32 + 13
    keep = block_magnitude_mask(w, 0.5, (32, 32))
    norms = torch.zeros(3, 2)
    for i in range(3):
        for j in range(2):
            norms[i, j] = w[32 * i:32 * i + 32, 32 * j:32 * j + 32].pow(2).sum()
    grid = torch.zeros(96, 64, dtype=torch.bool)
    grid[:70, :45] = keep
    grid = grid.reshape(3, 32, 2, 32).any(3).any(1)
    assert int(grid.sum()) == 3 and set(norms[grid].tolist()) == set(norms.flatten().topk(3).values.tolist())
    assert torch.equal(keep, grid.repeat_interleave(32, 0).repeat_interleave(32, 1)[:70, :45])
    assert block_magnitude_mask(torch.zeros(64, 64), 0.5, (32, 32)).sum() == 2 * 32 * 32   # ties: the earlier


def test_small_blocks_are_pruned_where_that_is_cheapest_within_the_tolerance():
    model, grid = _linear_with_small_blocks()
    batches = _batches(512)
    graph = sparta.capture(model, batches[0])
    report = calibrate(graph, batches, 1e-4, densities=(0.5, 0.25), widths=(32,), progress=False)
    (d,) = report.decisions
    assert d.density == 0.25 and d.error <= 1e-4 and d in report.lowered()
    assert set(d.prune_trials) == {"0.5@32", "0.25@32"}
    kept = graph.tesa("weight").mask
    assert torch.equal(kept, grid.repeat_interleave(32, 0).repeat_interleave(32, 1))        # the large blocks
    assert "25% of blocks kept" in report.table()


def test_no_tolerance_prunes_nothing_and_the_model_tolerance_undoes_pruning():
    model, _ = _linear_with_small_blocks(seed=2)
    batches = _batches(512, seed=2)
    graph = sparta.capture(model, batches[0])
    (d,) = calibrate(graph, batches, 0.0, densities=(0.25,), widths=(32,), progress=False).decisions
    assert d.density == 1.0 and graph.tesa("weight").is_dense and d.prune_trials["0.25@32"] > 0
    graph = sparta.capture(model, batches[0])
    report = calibrate(graph, batches, 1e-4, densities=(0.25,), widths=(32,), model_tolerance=1e-12, progress=False)
    (d,) = report.decisions
    assert d.density == 0.25 and d.reverted and graph.tesa("weight").is_dense and report.model_error <= 1e-12


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_choice_adds_at_most_the_tolerance_and_the_model_runs_as_calibrated(seed):
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512)).eval()
    with torch.no_grad():           # a quarter of each weight's blocks large (large enough for sparse kernels to pay)
        for i, lin in ((0, model[0]), (2, model[2])):
            lin.weight.copy_(_linear_with_small_blocks(*lin.weight.shape, seed=seed * 3 + i)[0].weight)
    batches = _batches(512, seed=seed)
    tol = 1e-3
    compiled = sparta.compile(model, {}, batches[0], calibration=batches, target="cpu",
                              quant_tolerance={"tolerance": tol, "densities": (0.5, 0.25), "progress": False})
    report = compiled.quantization
    assert all(d.error <= tol for d in report.decisions)
    assert any(d.density < 1 for d in report.decisions)
    # the compiled model computes the model with each weight as calibration left it: pruned blocks, fitted widths
    fq = fake_quantized_weights(compiled.graph)
    state = {k: fq.get(k, compiled.graph.tesa(k).apply(v)) for k, v in model.state_dict().items() if "weight" in k}
    with torch.no_grad():
        want = torch.func.functional_call(model, state, batches[0], strict=False)
        got = compiled(*batches[0])
    assert float((got - want).pow(2).sum() / want.pow(2).sum()) < 1e-4      # the int8 kernels' rounding
    assert float((want - model(*batches[0])).pow(2).sum() / want.pow(2).sum()) < 4 * tol
    pruned = [d.tensor for d in report.decisions if d.density < 1]
    assert all(not compiled.graph.tesa(w).is_dense for w in pruned)
    assert "sparse" in {op["kind"] for op in compiled.plan.to_json()["ops"].values()}


@pytest.mark.parametrize("bad,match", [({"densities": (1.5,)}, "strictly between 0 and 1"),
                                       ({"densities": ("half",)}, "fractions of blocks"),
                                       ({"densities": (0.5,), "prune_block": (0, 32)}, "two positive ints")])
def test_bad_joint_options_are_explained(bad, match):
    model, _ = _linear_with_small_blocks()
    batches = _batches(512)
    graph = sparta.capture(model, batches[0])
    with pytest.raises(QuantizationError, match=match):
        calibrate(graph, batches, 1e-3, progress=False, **bad)


def test_the_joint_plan_needs_the_planners_prices():
    """``passes.quant`` imports nothing of the planner: its own ``calibrate`` refuses densities without a price."""
    from sparta.passes.quant import calibrate as quant_calibrate
    model, _ = _linear_with_small_blocks()
    batches = _batches(512)
    with pytest.raises(QuantizationError, match="planner's prices"):
        quant_calibrate(sparta.capture(model, batches[0]), batches, 1e-3, densities=(0.5,), progress=False)
