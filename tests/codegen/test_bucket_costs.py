"""The estimate per bucket of rows: each bucket priced by the kernel that runs there (``KernelChoice.bucket_us``)."""

import dataclasses
import re
import shutil
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparta.codegen.bucket_costs import bucket_estimates, kept_blocks
from sparta.codegen.select_cuda import GemmSite, select_gemm
from sparta.passes.transform.plan import OpPlan, Plan
from sparta.target import load_target

CUDA = load_target("cuda")
PROFILE = CUDA.profile


def site(m=64, n=768, k=3072, bits="W16A16", density=0.1, any_rows=True):
    """A linear in 32x32 blocks, ``density`` of them kept, as selection sees it."""
    blocks = torch.rand(n // 32, k // 32, generator=torch.Generator().manual_seed(0)) < density
    keep = blocks.repeat_interleave(32, 0).repeat_interleave(32, 1)
    weight = torch.where(keep, torch.randn(n, k), 0.0)
    return GemmSite(SimpleNamespace(op="linear"), OpPlan("op", "linear", "sparse", 1.0, 2.0), m, n, k, bits,
                    bool(keep.all()), 32, "vector", "none", False, weight, 0, "", any_rows)


def test_each_kernel_costs_no_less_at_more_rows():
    """Within one kernel the estimate never falls as M grows; a tile costs the same at every M of one tile of rows."""
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        n_blocks, k = int(torch.randint(1, 5000, (), generator=g)), 32 * int(torch.randint(1, 200, (), generator=g))
        for shape in ((32, 32), (64, 64)):
            gemv = [PROFILE.gemv_us(n_blocks, shape, m, 16, 16, k) for m in range(1, 17)]
            assert all(a <= b for a, b in zip(gemv, gemv[1:])), (n_blocks, shape)
            for bits, tm in (((16, 16), 32), ((16, 16), 64), ((16, 16), 128), ((8, 8), 128), ((4, 16), 64)):
                tile = [PROFILE.tile_us(n_blocks, shape, m, tm, *bits, k) for m in range(1, 4 * tm + 2)]
                assert all(a <= b for a, b in zip(tile, tile[1:])), (n_blocks, shape, bits, tm)
                assert tile[0] == tile[tm - 1], "a tile computes all its rows"
        dense = [PROFILE.dense_tile_us(m, 128, 32 * n_blocks, k, 8, 8) for m in range(1, 600, 7)]
        assert all(a <= b for a, b in zip(dense, dense[1:]))
    big = 100_000                     # compute-bound: the next tile of rows costs more
    assert PROFILE.tile_us(big, (32, 32), 257, 32, 16, 16) > PROFILE.tile_us(big, (32, 32), 256, 32, 16, 16)
    assert PROFILE.gemv_us(10, (32, 32), 1, 8, 8) is None, "no one-row cost for W8A8 blocks: no GEMV estimate"


def test_each_bucket_is_priced_by_its_own_kernel():
    """The GEMV's bucket at its top by the GEMV's one-row costs, each M tile's at its top over whole tiles, the main
    tile at the planned range's end: a tile at few rows never borrows the GEMV's estimate."""
    s = site(m=64, any_rows=True)
    picked = select_gemm(s, CUDA)
    est = bucket_estimates(s, picked, PROFILE, 3000, (16, 16))
    blocks = kept_blocks(s, (32, 32))
    assert [(top, label) for top, label, *_ in est] == picked.by_rows()
    (one_row, gemv, *tiles, main) = est
    assert one_row[2] == 1 and one_row[3] == pytest.approx(PROFILE.gemv_us(blocks, (32, 32), 1, 16, 16, s.k), abs=1e-3)
    assert gemv[2] == 4 and gemv[3] == pytest.approx(PROFILE.gemv_us(blocks, (32, 32), 4, 16, 16, s.k), abs=1e-3)
    for (top, label, rows, us, dense), (_, t) in zip(tiles, picked.buckets):
        assert label == f"tm {t['tm']}" and rows == top
        assert us == pytest.approx(PROFILE.tile_us(blocks, (32, 32), top, t["tm"], 16, 16, s.k), abs=1e-3)
        assert dense == pytest.approx(PROFILE.dense_us(top, s.n, s.k, 16, 16), abs=1e-3)
    assert main[2] == 3000 and main[3] == pytest.approx(
        PROFILE.tile_us(blocks, (32, 32), 3000, picked.tiles["tm"], 16, 16, s.k), abs=1e-3)
    assert tiles[0][3] != gemv[3], "the tile bucket has its own estimate"
    cover = PROFILE.sub_op_us + PROFILE.block_us(blocks, (32, 32), tiles[0][0], 16, 16, s.k)
    assert tiles[0][3] != pytest.approx(cover, abs=1e-3), "not the cover model at those rows (the GEMV's one-row cost)"
    picked.bucket_us = est
    text = picked.describe()
    assert f"M<=4: bsr_gemv[{picked.gemv['warps']} warps] ~{gemv[3]:.1f} µs (dense {gemv[4]:.1f} µs); " in text
    assert f"M<=128: tm 32 ~{tiles[0][3]:.1f} µs (dense {tiles[0][4]:.1f} µs); " in text
    assert text.endswith(f" ~{main[3]:.1f} µs at M=3000 (dense {main[4]:.1f} µs)")
    assert bucket_estimates(s, select_gemm(site(m=4096, any_rows=False), CUDA), PROFILE, 4096, (16, 16)) is None, "one kernel"


def test_low_bit_gemvs_are_priced_by_the_bytes_they_stream_and_a_profile_without_them_says_so():
    import dataclasses
    s = site(m=4, bits="W8A8", any_rows=True)
    picked = select_gemm(s, CUDA)
    est = bucket_estimates(s, picked, PROFILE, 1000, (16, 16))
    gemvs = [e for e in est if e[1].startswith("w8a8_gemv")]
    assert gemvs and all(e[3] == pytest.approx(PROFILE.low_bit_gemv_us("w8a8_gemv", e[2], s.n * s.k + 4 * s.n),
                                               abs=1e-3) for e in gemvs)
    assert [e[3] for e in gemvs] == sorted(e[3] for e in gemvs), "more rows never cost less"
    picked.bucket_us = est
    assert f"M<=8: w8a8_gemv[16 warps] ~{gemvs[0][3]:.1f} µs (dense " in picked.describe()
    assert picked.estimate_note() == ""
    bare = dataclasses.replace(PROFILE, low_bit_gemv={})
    picked.bucket_us = bucket_estimates(s, picked, bare, 1000, (16, 16))
    assert [us is None for _, _, _, us, _ in picked.bucket_us] == [True] * (len(picked.bucket_us) - 1) + [False]
    assert "M<=8: w8a8_gemv[16 warps] no estimate (dense " in picked.describe()
    assert picked.estimate_note() == "no estimate for w8a8_gemv: the cost profile has no cost for it"
    plan = Plan("cuda", {"device": CUDA.device})
    plan.ops["linear"] = OpPlan("linear", "linear", "sparse", 1.0, 2.0, kernel=picked)
    assert "no estimate for w8a8_gemv: the cost profile has no cost for it" in plan.report()


@pytest.mark.parametrize("family, n, k, rows, measured", [
    ("w4a16_gemv", 11008, 4096, 1, 9.40), ("w4a16_gemv", 4096, 4096, 1, 4.39), ("w4a16_gemv", 11008, 4096, 16, 12.18),
    ("w4a16_gemv", 4096, 4096, 16, 6.78), ("w8a8_gemv", 11008, 4096, 1, 16.84), ("w8a8_gemv", 4096, 4096, 16, 8.96)])
def test_the_low_bit_gemv_costs_reproduce_the_measurements_they_were_fitted_to(family, n, k, rows, measured):
    """benchmarks/RESULTS.md, "CUDA low-bit GEMVs of a default (any rows) compile" (H100, the profile's device)."""
    nbytes = n * k // 2 + n * k // 128 * 4 if family == "w4a16_gemv" else n * k + 4 * n
    assert PROFILE.low_bit_gemv_us(family, rows, nbytes) == pytest.approx(measured, rel=0.04)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(PROFILE.low_bit_gemv)), st.integers(1, 64), st.integers(1, 2 ** 28))
def test_a_few_row_gemv_cost_follows_its_measured_points_piecewise(family, rows, nbytes):
    """At a measured row count the fit's own line; between two, never above the dearer of their lines (fixed cost and
    rate linear in the rows: convex); flat outside the measured rows; more bytes never cheaper."""
    fit = {int(r): v for r, v in PROFILE.low_bit_gemv[family].items()}
    cost = PROFILE.low_bit_gemv_us(family, rows, nbytes)
    line = {r: c + nbytes / (g * 1e3) for r, (c, g) in fit.items()}
    points = sorted(fit)
    if rows in fit:
        assert cost == pytest.approx(line[rows])
    lo = max([r for r in points if r <= rows], default=points[0])
    hi = min([r for r in points if r >= rows], default=points[-1])
    assert 0 < cost <= max(line[lo], line[hi]) + 1e-9
    assert PROFILE.low_bit_gemv_us(family, rows, nbytes + 4096) >= cost


def test_the_estimates_survive_the_plan_json_and_older_plans_load():
    s = site(m=64, any_rows=True)
    picked = select_gemm(s, CUDA)
    picked.bucket_us = bucket_estimates(s, picked, PROFILE, 2048, (16, 16))
    plan = Plan("cuda", {"device": CUDA.device})
    plan.ops["linear"] = OpPlan("linear", "linear", "sparse", 1.0, 2.0, kernel=picked)
    again = Plan.from_json(plan.to_json())
    assert again.ops["linear"].kernel.bucket_us == picked.bucket_us and again.report() == plan.report()
    old = plan.to_json()
    del old["ops"]["linear"]["kernel"]["bucket_us"]                 # a plan saved before the field
    older = Plan.from_json(old).ops["linear"].kernel
    assert older.bucket_us is None and "M<=128: tm 32; M<=1024: tm 64; else bsr_linear[" in older.describe()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_a_dynamic_cuda_compile_reports_each_buckets_kernel_estimate(tmp_path):
    """Compiled for CUDA here (no GPU): each 16-bit block-sparse linear's report line names the GEMV and every M
    tile with the estimate of that kernel, and a saved model keeps them."""
    pytest.importorskip("tvm", reason="builds CUDA kernels")
    import sparta
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512)).half().eval()
    masks = {}
    for i, (name, (n, k)) in enumerate((("0.weight", (1024, 512)), ("2.weight", (512, 1024)))):
        grid = torch.rand(n // 32, k // 32, generator=torch.Generator().manual_seed(i)) < 0.1
        grid[0, 0] = True
        masks[name] = grid.repeat_interleave(32, 0).repeat_interleave(32, 1)
    compiled = sparta.compile(model, masks, (torch.randn(2, 32, 512).half(),), target="cuda", dynamic=True,
                              tokens=(1, 2048))
    report = compiled.plan_report()
    linears = [p for p in compiled.plan.ops.values() if p.kernel is not None and p.kernel.kernel == "bsr_linear"]
    assert len(linears) == 2
    for p in linears:
        est = p.kernel.bucket_us
        (m, n, k), blocks = p.gemm, sum(s.n_blocks for s in p.subops)
        assert [s.block for s in p.subops] == [(32, 32)] and [(t, lab) for t, lab, *_ in est] == p.kernel.by_rows()
        gemv, tm32 = est[0], next(e for e in est if e[1] == "tm 32")
        assert gemv[1].startswith("bsr_gemv[") and gemv[3] == pytest.approx(
            PROFILE.gemv_us(blocks, (32, 32), gemv[0], 16, 16, k), abs=1e-3)
        assert tm32[3] == pytest.approx(PROFILE.tile_us(blocks, (32, 32), tm32[0], 32, 16, 16, k), abs=1e-3)
        assert tm32[3] != gemv[3] and est[-1][2] == max(r for r, _, _ in p.rows_us) == 2048 * m // 64
        line = next(r for r in report.splitlines() if r.startswith(p.op + " "))
        assert f"M<={gemv[0]}: {gemv[1]} ~{gemv[3]:.1f} µs (dense {gemv[4]:.1f} µs); " in line
        assert gemv[0] == 1 and est[1][0] == 4 and est[1][1].startswith("bsr_gemv[") and f"M<=4: {est[1][1]}" in line
        assert f"M<=128: tm 32 ~{tm32[3]:.1f} µs (dense {tm32[4]:.1f} µs); " in line
        assert re.search(r"else bsr_linear\[float16 128x32x32\] \+bias[+a-z]* ~[0-9.]+ µs at M=\d+ \(dense", line)
    compiled.save(tmp_path / "saved")
    loaded = sparta.load(tmp_path / "saved")
    assert [p.kernel.bucket_us for p in linears] == [loaded.plan.ops[p.op].kernel.bucket_us for p in linears]
    assert loaded.plan.report() == compiled.plan.report()


def test_a_4bit_linear_dequantises_per_call_for_cublas_only_where_that_costs_less_than_its_tile():
    """The W4A16 tile of any M with GEMVs hands its many-row calls to cuBLAS over the GEMVs' codes dequantised at
    each call from the rows where the tile costs more than the dense GEMM plus the dequantisation; the bucket of
    those rows is priced with the dequantisation in it, and the plan names it."""
    from sparta.codegen.bucket_costs import dense_switch_rows, dequant_us, kernel_us
    from sparta.codegen.select_cuda import dequantises, select_gemm
    from sparta.target import load_target
    cuda = load_target("cuda")
    s = GemmSite(SimpleNamespace(op="linear"), OpPlan("op", "linear", "sparse", 1.0, 2.0), 2, 11008, 4096, "W4A16",
                 True, 32, "none", "none", False, torch.randn(11008, 4096), 128, "", True)
    picked = select_gemm(s, cuda)
    assert dequantises(s, picked) and not dequantises(dataclasses.replace(s, any_rows=False), picked)
    assert not picked.dequant and picked.dense_from is None
    picked.dequant = True
    extra = dequant_us(s, picked, cuda.profile)
    assert extra == pytest.approx(cuda.profile.fixed_us + (11008 * 4096 * 2.5 + 11008 * 32 * 4) /
                                  (cuda.profile.bandwidth_gbs * 1e3))
    start = dense_switch_rows(s, picked, cuda.profile, 4096, (16, 16), extra)
    assert 256 < start < 1024
    tile = picked.runs_by_rows()[-1]
    for rows, dense_wins in ((256, False), (start, True), (4096, True)):
        t = kernel_us(s, picked, tile[2], tile[3], rows, cuda.profile)
        assert (t > cuda.profile.dense_us(rows, 11008, 4096, 16, 16) + extra) == dense_wins, rows
    assert dense_switch_rows(s, picked, cuda.profile, 256, (16, 16), extra) is None, "the tile wins over the range"
    picked.dense_from = start
    costs = bucket_estimates(s, picked, cuda.profile, 4096, (16, 16))
    assert costs[-1][1] == "cuBLAS[dequantised per call]" and costs[-1][3] == pytest.approx(costs[-1][4] + extra, 1e-3)
    assert picked.kernel_at(start) == "cuBLAS[dequantised per call]" and "dequantised per call" in picked.describe()
    picked.dequant = False
    assert picked.kernel_at(start) == "cuBLAS[dense copy]"
