"""8-bit weights beside 16-bit activations on CUDA (``passes/transform/fp8.py``): planned as FP8 (E4M3) weights over
their kept 32x32 blocks, priced as the FP8 GEMV where it beats the dense GEMM up to ``FP8_MAX_ROWS`` rows; never for
other widths, targets or model dtypes; ``formats`` meets them."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sparta
from sparta.errors import PlanError
from sparta.passes.propagate import propagate
from sparta.passes.transform import transform
from sparta.passes.transform.bitround import choose_formats
from sparta.passes.transform.fp8 import FP8_MAX_ROWS, fp8_block_grid, fp8_bytes
from sparta.target import load_target
from sparta.tesa import TeSA


def _graph(tesa: TeSA, rows: int, dtype=torch.bfloat16):
    n, k = tesa.shape
    graph = sparta.capture(torch.nn.Linear(k, n, bias=False).eval().to(dtype), (torch.randn(rows, k).to(dtype),))
    graph.set_tesa("weight", tesa)
    return propagate(graph)


def _plan(tesa: TeSA, rows: int, dtype=torch.bfloat16, target="cuda"):
    return transform(_graph(tesa, rows, dtype), target)["linear"]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 100), st.integers(1, 100), st.floats(0.0, 1.0), st.sampled_from([1, 2, 3]),
       st.integers(0, 2**31 - 1))
def test_the_block_grid_holds_exactly_the_blocks_with_a_kept_element(n, k, density, scale, seed):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(n, k, generator=g) < density
    grid = fp8_block_grid(TeSA.from_mask(mask, 8))
    want = torch.zeros(-(-n // 32), -(-k // 32), dtype=torch.bool)
    for i, j in mask.nonzero().tolist():
        want[i // 32, j // 32] = True
    assert torch.equal(grid, want)
    blocks = torch.rand(-(-n // (32 * scale)), -(-k // (32 * scale)), generator=g) < density
    held = TeSA.from_blocks(blocks, (32 * scale, 32 * scale), 8)
    if tuple(held.shape) == (blocks.shape[0] * 32 * scale, blocks.shape[1] * 32 * scale):   # from blocks: same grid
        assert torch.equal(fp8_block_grid(held), fp8_block_grid(TeSA.from_mask(held.mask, 8)))


def test_an_eight_bit_weight_at_decode_rows_runs_fp8_over_its_kept_blocks_priced_by_its_bytes():
    grid = torch.rand(128, 128, generator=torch.Generator().manual_seed(0)) < 0.5
    tesa = TeSA.from_blocks(grid, (32, 32), 8)
    p = _plan(tesa, 1)
    prof = load_target("cuda").profile
    assert p.kind == "sparse" and len(p.subops) == 1, p.candidates
    sub = p.subops[0]
    assert sub.describe() == f"{int(grid.sum())}x32x32@W8A16[fp8_e4m3×bf16]" and sub.nnz == int(tesa.mask.sum())
    assert p.est_us == pytest.approx(prof.low_bit_gemv_us("fp8_gemv", 1, fp8_bytes(int(grid.sum()), 4096)), rel=1e-6)
    assert p.est_us < p.dense_us and not p.note
    assert torch.equal(p.kept(4096, 4096), tesa.mask)
    fp16 = _plan(tesa, 1, torch.float16).subops[0]
    assert fp16.describe().endswith("@W8A16[fp8_e4m3×fp16]")


def test_many_rows_other_widths_targets_and_dtypes_never_take_it():
    dense8 = TeSA.dense((4096, 4096), 8)
    assert _plan(dense8, 4 * FP8_MAX_ROWS).kind == "dense", "above the GEMV's rows only the dense GEMM is left"
    for bits in (4, 16):
        assert all(s.weight_format != "fp8_e4m3" for s in _plan(TeSA.dense((4096, 4096), bits), 1).subops)
    assert all(s.weight_format != "fp8_e4m3" for s in _plan(dense8, 1, target="cpu").subops)
    assert all(s.weight_format != "fp8_e4m3" for s in _plan(dense8, 1, torch.float32).subops), "fp32: no kernel"
    six = _plan(TeSA.dense((4096, 4096), 6), 1)            # 5-8 bits: E4M3 holds them
    assert [s.describe() for s in six.subops] == ["16384x32x32@W8A16[fp8_e4m3×bf16]"]


def test_formats_ask_fp8_for_a_weight_the_costs_would_run_at_16_bits_or_another_format_for_it():
    graph = _graph(TeSA.dense((1024, 1024), 8), 1)
    target = load_target("cuda")
    cheapest = transform(graph, target)["linear"]
    assert [s.weight_bits for s in cheapest.subops] == [16], "at this size the 16-bit GEMV is priced below FP8"
    for formats in ({"weight": "fp8_e4m3"}, "fp8_e4m3"):
        plan = transform(graph, target, formats=formats)
        asked = choose_formats(graph, plan, target, formats)["linear"]
        assert [s.describe() for s in asked.subops] == ["1024x32x32@W8A16[fp8_e4m3×bf16]"], formats
    with pytest.raises(PlanError, match="no int8 kernel beside A16 activations; ask for fp8_e4m3"):
        choose_formats(graph, transform(graph, target), target, {"weight": "int8"})
    with pytest.raises(PlanError, match="4-bit"):
        choose_formats(graph, transform(graph, target), target, {"weight": "int4"})


def test_a_tie_keeps_the_fewer_bits():
    """A dense 8-bit weight whose FP8 GEMV and 16-bit block GEMV cost nearly the same runs FP8: the TeSA's bits."""
    p = _plan(TeSA.dense((2816, 1024), 8), 2)
    assert [s.weight_bits for s in p.subops] == [8], p.candidates
