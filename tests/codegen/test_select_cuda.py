"""Kernel selection for the CUDA target: the ordered rule table, read against the measured tile tables."""

from types import SimpleNamespace

import pytest
import torch

from sparta.codegen.select_cuda import GemmSite, select_gemm
from sparta.templates.registry import rules
from sparta.passes.transform.plan import KernelChoice, OpPlan, Plan
from sparta.target import load_target

CUDA = load_target("cuda")


def site(m=4096, n=768, k=3072, bits="W16A16", density=0.1, side=32, bias="vector", act="none", op="linear",
         requantized=False, w4_group=0, w4_refusal="", seed=0, any_rows=False):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.rand(-(-n // side), -(-k // side), generator=g) < density
    if density >= 1:
        blocks[:] = True
    keep = blocks.repeat_interleave(side, 0).repeat_interleave(side, 1)[:n, :k]
    weight = torch.where(keep, torch.randn(n, k, generator=g), 0.0)
    plan = OpPlan("op", op, "sparse", 1.0, 2.0)
    return GemmSite(SimpleNamespace(op=op), plan, m, n, k, bits, bool(keep.all()), side, bias, act, requantized,
                    weight, w4_group, w4_refusal, any_rows)


def test_the_last_rule_always_answers_and_every_rule_answers_a_choice_or_none():
    cases = [site(), site(bits="W8A8"), site(bits="W4A16", density=1, w4_group=128), site(op="conv2d"),
             site(k=3070), site(bias="other"), site(bits="mixed"), site(side=64, density=0.02)]
    for s in cases:
        for rule in rules("gemm_cuda"):
            picked = rule(s, CUDA)
            assert picked is None or isinstance(picked, KernelChoice)
        assert rules("gemm_cuda")[-1](s, CUDA) is not None
        assert select_gemm(s, CUDA).reason


@pytest.mark.parametrize("kw, kernel, rule", [
    (dict(op="conv2d"), "torch", "not_a_gemm"),
    (dict(k=3068), "torch", "k_alignment"),
    (dict(bias="other"), "torch", "bias_shape"),
    (dict(m=1, bits="W4A16", density=1, w4_group=128), "w4a16_gemv", "w4a16_gemv"),
    (dict(m=16, bits="W4A16", density=1, w4_group=128), "w4a16_gemv", "w4a16_gemv"),
    (dict(m=64, bits="W4A16", density=1, w4_group=128), "torch", "w4a16_dense_tile"),
    (dict(m=512, bits="W4A16", density=1, w4_group=128), "bsr_linear", "w4a16_dense_tile"),
    (dict(m=512, bits="W4A16", w4_group=128), "bsr_linear", "bsr_tile"),
    (dict(m=4, bits="W8A8", density=1), "w8a8_gemv", "w8a8_gemv"),
    (dict(m=4, bits="W8A8"), "w8a8_gemv", "w8a8_gemv"),
    (dict(m=4096, bits="W8A8", density=1), "bsr_linear", "w8a8_dense_tile"),
    (dict(m=4096, bits="W8A8"), "bsr_linear", "w8a8_sparse_tile"),
    (dict(m=4096, side=64, density=0.02), "bsr_linear", "fp16_stream"),
    (dict(m=4096, side=64, density=0.5), "bsr_linear", "bsr_tile"),
    (dict(m=4096), "bsr_linear", "bsr_tile"),
])
def test_each_gemm_goes_to_the_rule_that_takes_it(kw, kernel, rule):
    picked = select_gemm(site(**kw), CUDA)
    assert (picked.kernel, picked.rule) == (kernel, rule), picked


def test_fp16_tiles_carry_the_few_row_gemv_where_calls_can_be_that_small():
    """fp16 block-sparse linears called with up to ``bsr_gemv.max_rows`` rows, or with any rows (a dynamic graph),
    also get the GEMV over the same blocks (the report names the kernel per bucket of rows); larger calls, W8A8 and
    W4A16 do not; the GEMVs of fixed M (W8A8, W4A16) are not chosen for any rows."""
    top = CUDA.tiles("bsr_gemv", "max_rows")
    for kw in (dict(m=1), dict(m=top), dict(m=4096, any_rows=True), dict(m=4096, side=64, density=0.02, any_rows=True)):
        picked = select_gemm(site(**kw), CUDA)
        assert picked.gemv is not None and picked.gemv["rows"] == top and 2 <= picked.gemv["warps"] <= 16, kw
        one = picked.gemv["one_row"]
        assert picked.describe().startswith(f"M<=1: bsr_gemv[1 row, {one['warps']} warps]; M<={top}: bsr_gemv[")
        assert picked.kernel_at(1).startswith("bsr_gemv[1 row") and picked.kernel_at(2).startswith("bsr_gemv[")
    for kw in (dict(m=top + 1), dict(m=4096), dict(m=1, bits="W8A8"), dict(m=512, bits="W4A16", w4_group=128)):
        assert select_gemm(site(**kw), CUDA).gemv is None, kw
    assert select_gemm(site(m=4, bits="W8A8", any_rows=True), CUDA).rule == "w8a8_sparse_tile"
    assert select_gemm(site(m=1, bits="W4A16", density=1, w4_group=128, any_rows=True), CUDA).rule != "w4a16_gemv"
    full = select_gemm(site(m=1, density=1.0), CUDA)       # every block of a row kept: as many warps as allowed
    assert full.gemv["warps"] == 16


@pytest.mark.parametrize("n,k,gate,loads", [(4096, 4096, False, 1), (12288, 4096, False, 2),
                                             (4096, 11008, False, 1), (22016, 4096, True, 2)])
def test_one_row_gemv_takes_two_loads_a_lane_only_where_its_grid_stays_wide(n, k, gate, loads):
    """The one-row GEMV at the 7B decode shapes (o, qkv, down, gated): two 16-byte loads a lane where that still gives
    4 CTAs an SM, else one (the sweep's winners, RESULTS "Block-sparse GEMV at the 7B decode shapes")."""
    picked = select_gemm(site(m=1, n=n, k=k, bias="none", any_rows=True, density=0.1), CUDA) if not gate else None
    if gate:
        from sparta.templates.bsr_linear.select import one_row_loads
        tiles = {"bn": 32, "bk": 32}
        assert one_row_loads(n // 2, k, tiles, 4 * CUDA.sms) == loads
        return
    assert picked.gemv["one_row"]["loads"] == loads
    assert picked.gemv["one_row"]["warps"] == picked.gemv["warps"]


def test_choices_carry_the_measured_tiles_of_the_target():
    tile = select_gemm(site(side=64, density=0.5), CUDA)
    assert tile.tiles == CUDA.tiles("fp16_tiles", 64) and tile.dtype == "float16" and tile.hopper is None
    dense8 = select_gemm(site(bits="W8A8", density=1), CUDA)
    assert dense8.dtype == "int8" and dense8.hopper["mma"] == "wgmma" and dense8.hopper["bn"] == dense8.tiles["bn"]
    sparse8 = select_gemm(site(bits="W8A8", side=64, density=0.5), CUDA)
    assert sparse8.tiles == CUDA.tiles("int8_sparse_tiles", 64) and sparse8.tiles["pdl"] == "tail"
    stream = select_gemm(site(side=64, density=0.02), CUDA)
    assert stream.tiles["groups"] >= 1 and stream.tiles["tm"] == CUDA.tiles("stream")["tile"]["tm"]


def test_a_width_no_kernel_runs_is_reported_not_hidden():
    mixed = select_gemm(site(bits="mixed"), CUDA)
    assert mixed.kernel == "bsr_linear" and mixed.dtype == "float16" and "plan asked for mixed" in mixed.note
    refused = select_gemm(site(bits="W4A16", w4_refusal="scale groups of 48 columns"), CUDA)
    assert refused.dtype == "float16" and "scale groups of 48 columns" in refused.note
    odd8 = select_gemm(site(bits="W8A8", k=3080), CUDA)
    assert odd8.dtype == "float16" and "K=3080 is not a multiple of 16" in odd8.note


def test_a_kernel_choice_survives_the_plan_json():
    plan = Plan("cuda", {"device": CUDA.device})
    op_plan = OpPlan("linear", "linear", "sparse", 1.0, 2.0)
    op_plan.kernel = select_gemm(site(bits="W8A8", density=1), CUDA)
    plan.ops["linear"] = op_plan
    again = Plan.from_json(plan.to_json())
    assert again.ops["linear"].kernel == op_plan.kernel
    assert "bsr_linear[int8 128x" in again.report() and "+wgmma" in again.report()


def test_the_target_reads_its_measured_tables_and_refuses_unknown_ones():
    assert CUDA.sms == 132 and CUDA.tiles("gemv_max_rows", "w4a16") == 16
    assert "device" in CUDA.kernels and "command" in CUDA.kernels and "date" in CUDA.kernels
    with pytest.raises(Exception, match="no measured 'nope' tiles"):
        CUDA.tiles("nope")
    with pytest.raises(Exception, match="unknown target"):
        load_target("tpu")


def test_a_cover_the_kernel_runs_otherwise_is_noted():
    from sparta.passes.transform.plan import SubOp
    s = site(side=64, density=0.5)
    s.plan.subops = [SubOp("block_sparse", 16, 16, (32, 32), 10, 0, 1.0), SubOp("block_sparse", 16, 16, (64, 64), 3, 0, 1.0)]
    assert "32x32 + 64x64 cover runs as one 64x64 block cover" in select_gemm(s, CUDA).note
    s.plan.subops = [SubOp("block_sparse", 16, 16, (64, 64), 3, 0, 1.0)]
    assert select_gemm(s, CUDA).note == ""


def test_a_16_bit_tile_kernel_takes_the_tile_of_its_bucket_of_rows():
    """Few rows take the smaller M tiles of ``fp16_tile_buckets`` (measured faster there), many the large tile; a
    graph of any rows keeps the large tile and carries every bucket's, picked per call (the report names each)."""
    buckets = CUDA.tiles("fp16_tile_buckets")["32"]
    assert select_gemm(site(m=64), CUDA).tiles == buckets[0][1]
    assert select_gemm(site(m=512), CUDA).tiles == buckets[1][1]
    assert select_gemm(site(m=4096), CUDA).tiles == CUDA.tiles("fp16_tiles", 32)
    assert select_gemm(site(m=64, any_rows=True), CUDA).tiles == CUDA.tiles("fp16_tiles", 32)
    assert all(select_gemm(site(m=m), CUDA).buckets is None for m in (64, 512, 4096))
    picked = select_gemm(site(m=64, any_rows=True), CUDA)
    assert picked.buckets == [list(b) for b in buckets] and len(buckets) >= 2
    assert all(t["bn"] == picked.tiles["bn"] and t["bk"] == picked.tiles["bk"] for _, t in picked.buckets)
    text = picked.describe()
    assert text.index("bsr_gemv") < text.index(f"M<={buckets[0][0]}: ") < text.index(f"M<={buckets[1][0]}: ") \
        < text.index("else bsr_linear"), text
    assert select_gemm(site(m=64, any_rows=True, bits="W8A8"), CUDA).buckets is None


@pytest.mark.parametrize("kw, gates", [(dict(m=512), True), (dict(m=512, any_rows=True), True),
                                       (dict(m=4096, side=64, density=0.02), False),   # the streaming grid
                                       (dict(m=4096, bits="W8A8"), False), (dict(m=512, bits="W4A16", w4_group=128),
                                                                             False)])
def test_only_the_16_bit_one_tile_kernel_computes_a_gated_unit(kw, gates):
    """The gated epilogue (act(gate)·up) is the 16-bit one-tile kernel's and its GEMV's; any other pick leaves the
    gated unit to torch ops. A gated site's GEMV takes warps for a slot's gate and up blocks together."""
    from dataclasses import replace
    from sparta.templates.bsr_linear.select import fp16_gemv_tiling, gates as computes_gate
    s = site(n=2 * 1408, k=1024, **kw)
    picked = select_gemm(replace(s, gate=True), CUDA)
    assert computes_gate(picked) == gates, picked
    if gates and picked.gemv:
        one = fp16_gemv_tiling(replace(s, any_rows=True), picked.tiles, CUDA)
        both = fp16_gemv_tiling(replace(s, gate=True, any_rows=True), picked.tiles, CUDA)
        assert both["warps"] >= one["warps"]
