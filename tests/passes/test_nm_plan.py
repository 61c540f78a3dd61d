"""2:4 masks in the plan (``passes/transform/nm.py``): recognised in a 16-bit weight's TeSA on CUDA, priced as the
2:4 GEMV up to ``NM_MAX_ROWS`` rows and the dense GEMM above, never for another mask or target."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sparta
from sparta.passes.propagate import propagate
from sparta.passes.transform import transform
from sparta.passes.transform.nm import NM_MAX_ROWS, is_two_four, nm_bytes
from sparta.target import load_target
from sparta.tesa import TeSA


def two_four(n: int, k: int, seed: int = 0, keep: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(n, k // 4, 4, generator=g)
    mask = torch.zeros(scores.shape, dtype=torch.bool).scatter_(-1, scores.topk(keep, dim=-1).indices, True)
    return mask.reshape(n, k)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 9), st.integers(1, 40), st.integers(0, 4), st.integers(0, 2**31 - 1))
def test_a_mask_is_two_four_iff_no_aligned_group_of_four_keeps_three(n, groups, keep, seed):
    k = 4 * groups
    mask = two_four(n, k, seed, keep) if keep else torch.zeros(n, k, dtype=torch.bool)
    assert is_two_four(mask) == (keep <= 2)
    if keep <= 2 and k > 4:
        shifted = torch.roll(mask, 1, dims=1)          # a group may now hold 3: only where one does
        held = torch.nn.functional.pad(shifted, (0, 0)).reshape(n, -1, 4).sum(-1).max() <= 2
        assert is_two_four(shifted) == bool(held)
    assert is_two_four(torch.ones(n, 2, dtype=torch.bool)) and not is_two_four(torch.ones(n, 3, dtype=torch.bool))


def _plan(mask: torch.Tensor, rows: int, dtype=torch.bfloat16, target="cuda"):
    n, k = mask.shape
    graph = sparta.capture(torch.nn.Linear(k, n, bias=False).eval().to(dtype), (torch.randn(rows, k).to(dtype),))
    graph.set_tesa("weight", TeSA.from_mask(mask, 16 if dtype != torch.float32 else 32))
    return transform(propagate(graph), target)["linear"]


def test_a_two_four_weight_at_decode_rows_runs_the_two_four_gemv_and_its_estimate_is_its_bytes():
    mask = two_four(4096, 4096)
    p = _plan(mask, 4)
    prof = load_target("cuda").profile
    assert p.kind == "sparse" and [s.template for s in p.subops] == ["nm_sparse"], p.candidates
    assert p.subops[0].describe() == "2:4@W16A16[bf16]" and p.subops[0].nnz == int(mask.sum())
    assert p.est_us == pytest.approx(prof.low_bit_gemv_us("nm_linear", 4, nm_bytes(4096, 4096)), rel=1e-6)
    assert p.est_us < p.dense_us
    assert torch.equal(p.kept(4096, 4096), mask)


def test_many_rows_run_dense_and_other_masks_and_targets_never_take_it():
    mask = two_four(1024, 1024)
    assert _plan(mask, 4 * NM_MAX_ROWS).kind == "dense", "above the GEMV's rows only the dense GEMM is left"
    three = mask.clone()
    three[0, :3] = True                                                  # one group keeps 3
    assert all(s.template != "nm_sparse" for s in _plan(three, 4).subops)
    assert _plan(mask, 4, target="cpu").subops[0].template != "nm_sparse"
    assert all(s.template != "nm_sparse" for s in _plan(mask, 4, dtype=torch.float32).subops), "fp32: no kernel"
