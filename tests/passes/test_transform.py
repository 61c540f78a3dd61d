"""Execution-plan transformation: profiles, bit rounding, block cover, plans."""

import itertools
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import SmallCNN, randomize_bn, tiny_bert

import sparta
from sparta import PlanError, TeSA
from sparta.passes import propagate, transform
from sparta.passes.transform import (Plan, block_cover, check_cover, cover_cost, groupings, load_profile,
                                     round_bits)
from sparta.passes.transform.plan import OpPlan

# ---- profiles ------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_shipped_profiles_are_measured(target):
    prof = load_profile(target)
    assert prof.target == target and prof.date and prof.device and "measured" in prof.source
    assert 32 in prof.act_widths() and prof.fixed_us > 0 and prof.bandwidth_gbs > 0
    k = prof.kernel(32, 32)
    assert (32, 32) in k.blocks and (1, 1) in k.blocks and k.dense_gflops > 0
    if target == "cuda":
        assert {(16, 16), (8, 8), (4, 16)} <= {(kk.weight_bits, kk.act_bits) for kk in prof.kernels}
        assert "H100" in prof.device or "H200" in prof.device


def test_profile_errors(tmp_path):
    with pytest.raises(PlanError, match="no hardware profile"):
        load_profile("tpu")
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"target": "cpu", "kernels": []}))
    with pytest.raises(PlanError, match="invalid hardware profile"):
        load_profile(bad)
    with pytest.raises(PlanError, match="W3A3"):
        load_profile("cpu").kernel(3, 3)


def test_profiler_command_writes_a_loadable_profile(tmp_path):
    from sparta.codegen.profile import main
    out = tmp_path / "cpu.json"
    main(["--target", "cpu", "--rows", "8", "--size", "128", "--iters", "2", "-o", str(out)])
    prof = load_profile(out)
    assert prof.kernel(32, 32).blocks[(32, 32)] > 0 and prof.kernel(8, 8).dense_gflops > 0


def test_block_costs_through_two_row_counts_and_the_json_round_trip():
    """With a one-row figure, a block costs its one-row time at one row and its measured per-row time at the
    profile's rows, linear between; the dense path of a width without a vendor kernel costs its blocks."""
    from sparta.passes.transform import HardwareProfile
    data = load_profile("cpu").to_json()
    data.update(rows=256, stream_weights=False, kernel_call_us=20.0)
    w4 = next(k for k in data["kernels"] if (k["weight_bits"], k["act_bits"]) == (4, 32))
    w4.update(blocks={"32x32": 100.0}, blocks_one_row={"32x32": 2000.0}, dense_blocks="32x32")
    prof = HardwareProfile.from_json(data)
    assert HardwareProfile.from_json(prof.to_json()) == prof
    assert prof.block_us(10, (32, 32), 1, 4, 32) == pytest.approx(10 * 2000.0 / 1e3)
    assert prof.block_us(10, (32, 32), 256, 4, 32) == pytest.approx(10 * 256 * 100.0 / 1e3)
    mid = prof.block_us(10, (32, 32), 128, 4, 32)
    assert prof.block_us(10, (32, 32), 1, 4, 32) < mid < prof.block_us(10, (32, 32), 256, 4, 32)
    assert prof.dense_us(1, 64, 96, 4, 32) == pytest.approx(20.0 + 6 * 2000.0 / 1e3)


def test_block_costs_grow_with_k_between_the_two_measured_widths():
    """A block's per-row cost is the profile's at its K, the wide-K figure from ``wide_k`` on, linear between;
    a wide-K figure below the base one (noise) does not make wide ops cheaper; the JSON keeps both."""
    from sparta.passes.transform import HardwareProfile
    data = load_profile("cpu").to_json()
    data.update(rows=0, stream_weights=False, k=768, wide_k=4096)
    fp32 = next(k for k in data["kernels"] if (k["weight_bits"], k["act_bits"]) == (32, 32))
    fp32.update(blocks={"32x32": 10.0, "64x64": 40.0}, blocks_wide_k={"32x32": 15.0, "64x64": 30.0})
    fp32.pop("blocks_one_row", None)
    prof = HardwareProfile.from_json(data)
    assert HardwareProfile.from_json(prof.to_json()) == prof
    at = {k: prof.block_us(100, (32, 32), 64, 32, 32, k) for k in (0, 512, 768, 2432, 4096, 8192)}
    assert at[0] == at[512] == at[768] == pytest.approx(100 * 64 * 10.0 / 1e3)
    assert at[2432] == pytest.approx(100 * 64 * 12.5 / 1e3)
    assert at[4096] == at[8192] == pytest.approx(100 * 64 * 15.0 / 1e3)
    assert prof.block_us(10, (64, 64), 64, 32, 32, 4096) == prof.block_us(10, (64, 64), 64, 32, 32, 768)


# ---- bit rounding --------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 32), min_size=1, max_size=40),
       st.sets(st.sampled_from([2, 4, 8, 16, 32]), min_size=1, max_size=5))
def test_round_bits_rounds_up_to_smallest_width(values, widths):
    widths = sorted(widths | {32})
    t = TeSA.from_bits(torch.tensor(values, dtype=torch.uint8))
    r = round_bits(t, widths).bits.tolist()
    for v, got in zip(values, r):
        assert got == (0 if v == 0 else min(w for w in widths if w >= v))


def test_groupings_enumerate_all_contiguous_splits():
    bits = torch.tensor([0, 3, 4, 8, 12, 16, 32, 32], dtype=torch.uint8)
    options = groupings(TeSA.from_bits(bits), [4, 8, 16, 32])
    assert len(options) == 2 ** 3                     # widths present: 4, 8, 16, 32
    finest, widest = options[0], options[-1]
    assert [g.bits for g in finest] == [4, 8, 16, 32]
    assert [g.bits for g in widest] == [32] and widest[0].tesa.density == 7 / 8
    for option in options:                            # each option partitions the kept elements
        total = sum(g.tesa.mask.to(torch.int32) for g in option)
        assert torch.equal(total, (bits > 0).to(torch.int32))
        for g in option:                              # and never lowers a width
            assert bool((bits[g.tesa.mask] <= g.bits).all())
    assert groupings(TeSA.pruned((3,)), [8, 32]) == [[]]

# ---- weighted block cover --------------------------------------------------------------------

COSTS = {(4, 4): 6.0, (2, 2): 2.5, (1, 1): 1.0}


@st.composite
def masks(draw, max_side=12):
    h, w = draw(st.integers(1, max_side)), draw(st.integers(1, max_side))
    mode = draw(st.sampled_from(["random", "blocks", "all", "none", "one"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 10_000)))
    if mode == "all":
        return torch.ones(h, w, dtype=torch.bool)
    if mode == "none":
        return torch.zeros(h, w, dtype=torch.bool)
    if mode == "one":
        m = torch.zeros(h, w, dtype=torch.bool)
        m[draw(st.integers(0, h - 1)), draw(st.integers(0, w - 1))] = True
        return m
    if mode == "blocks":
        keep = torch.rand(math.ceil(h / 3), math.ceil(w / 3), generator=g) < 0.4
        noise = torch.rand(h, w, generator=g) < 0.05
        return keep.repeat_interleave(3, 0).repeat_interleave(3, 1)[:h, :w] | noise
    return torch.rand(h, w, generator=g) < draw(st.sampled_from([0.1, 0.5, 0.9]))


@settings(max_examples=80, deadline=None)
@given(masks(), st.sampled_from([[(4, 4), (1, 1)], [(2, 2), (1, 1)], [(4, 4), (2, 2), (1, 1)], [(2, 2)], [(4, 4)]]))
def test_cover_assigns_every_kept_element_exactly_once(mask, shapes):
    cover = block_cover(mask, {s: COSTS[s] for s in shapes})
    check_cover(mask, cover)
    if not mask.any():
        assert cover == [] and cover_cost(cover) == 0


def optimum(mask, costs):
    """Exact min-cost cover by brute force over the coarse blocks (1×1 fills the rest)."""
    cands = []
    for (bh, bw), c in costs.items():
        if (bh, bw) == (1, 1):
            continue
        for i in range(math.ceil(mask.shape[0] / bh)):
            for j in range(math.ceil(mask.shape[1] / bw)):
                cell = torch.zeros_like(mask)
                cell[i * bh:(i + 1) * bh, j * bw:(j + 1) * bw] = True
                if (cell & mask).any():
                    cands.append((cell, c))
    best = math.inf
    for r in range(len(cands) + 1):
        for subset in itertools.combinations(cands, r):
            covered = torch.zeros_like(mask)
            cost = 0.0
            for cell, c in subset:
                covered |= cell
                cost += c
            best = min(best, cost + costs[(1, 1)] * int((mask & ~covered).sum()))
    return best


@settings(max_examples=40, deadline=None)
@given(masks(max_side=6))
def test_greedy_within_harmonic_bound_of_optimum(mask):
    costs = {(4, 4): 6.0, (2, 2): 2.5, (1, 1): 1.0}
    greedy = cover_cost(block_cover(mask, costs))
    opt = optimum(mask, costs)
    harmonic = sum(1 / i for i in range(1, 17))       # H(largest block size)
    assert opt <= greedy + 1e-9 <= harmonic * opt + 1e-9


def test_cover_mixes_shapes_where_it_pays():
    mask = torch.zeros(64, 64, dtype=torch.bool)
    mask[:32, :32] = True                             # one dense block
    mask[40, 50] = mask[60, 3] = True                 # two stragglers
    cover = {c.shape: c for c in block_cover(mask, {(32, 32): 100.0, (1, 1): 1.0})}
    assert cover[(32, 32)].n_blocks == 1 and cover[(1, 1)].n_blocks == 2
    with pytest.raises(ValueError, match="at least one block shape"):
        block_cover(mask, {})
    assert block_cover(torch.ones(5, 7, dtype=torch.bool), {(4, 4): 1.0})[0].n_blocks == 4


def test_cover_without_fine_blocks_covers_with_coarse():
    mask = torch.rand(10, 10, generator=torch.Generator().manual_seed(0)) < 0.3
    cover = block_cover(mask, {(4, 4): 3.0})
    check_cover(mask, cover)

# ---- plans ----------------------------------------------------------------------------------


def block_mask(shape, block, density, seed=0):
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(math.ceil(shape[0] / block), math.ceil(shape[1] / block), generator=g) < density
    return keep.repeat_interleave(block, 0).repeat_interleave(block, 1)[: shape[0], : shape[1]]


@pytest.fixture(scope="module")
def bert_plan():
    model = tiny_bert(hidden=128, inter=512)
    ids = torch.randint(0, 100, (4, 32))
    w = {f"encoder.layer.{i}.{p}.dense.weight": TeSA.from_mask(block_mask(s, 32, 0.1, i))
         for i in range(2) for p, s in (("intermediate", (512, 128)), ("output", (128, 512)))}
    return sparta.compile(model, w, (ids,))


def test_every_op_has_a_plan_and_sparse_ffn_wins(bert_plan):
    graph, plan = bert_plan.graph, bert_plan.plan
    assert set(plan.ops) == {o.name for o in graph.ops()}
    ffn = [p for p in plan.ops.values() if p.weight and "intermediate" in p.weight]
    assert ffn and all(p.kind == "sparse" and p.est_us < p.dense_us for p in ffn)
    qkv = [p for p in plan.ops.values() if p.weight and "attention.self.query" in p.weight]
    assert qkv and all(p.kind == "dense" and p.est_us == p.dense_us for p in qkv), "dense weights stay dense"
    for p in ffn:
        sub = p.subops[0]
        assert sub.template == "block_sparse" and sub.block in {(16, 16), (32, 32)}  # both tile 32x32 blocks
        assert sub.nnz == sum(s.nnz for s in p.subops) == int(graph.tesa(p.weight).mask.sum())
        assert p.est_us <= min(c.est_us for c in p.candidates) * 1.05 and len(p.candidates) > 2
        assert p.epilogue == ["bias", "gelu"]
    report = bert_plan.plan_report(only_gemm=True)
    assert "x16x16@W32A32" in report or "x32x32@W32A32" in report
    assert "dense µs" in report and "total: est" in report


def test_plan_json_roundtrip_and_strict_fields(bert_plan):
    plan = bert_plan.plan
    text = json.dumps(plan.to_json())
    back = Plan.from_json(json.loads(text))
    assert back.to_json() == plan.to_json()
    name = next(n for n, p in plan.ops.items() if p.kind == "sparse")
    assert back[name].subops[0].elements == plan[name].subops[0].elements
    bad = json.loads(text)
    bad["ops"][name]["colour"] = "red"
    with pytest.raises(PlanError, match="colour"):
        Plan.from_json(bad)
    plan.pin(name, dismantle="tile")
    assert plan[name].dismantle == "tile"
    with pytest.raises(PlanError, match="unknown field"):
        plan.pin(name, blocksize=3)
    with pytest.raises(PlanError, match="dismantle"):
        plan.pin(name, dismantle="sometimes")
    with pytest.raises(PlanError, match="no plan"):
        plan["nope"]


def test_cnn_has_plans_for_every_op():
    model = randomize_bn(SmallCNN()).eval()
    x = torch.randn(2, 3, 16, 16)
    compiled = sparta.compile(model, {"pw.weight": TeSA.from_mask(torch.rand(16, 8, 1, 1) < 0.2)}, (x,))
    plan = compiled.plan
    assert set(plan.ops) == {o.name for o in compiled.graph.ops()}
    conv = plan["conv2d_2"]
    assert conv.gemm == (2 * 8 * 8, 16, 8) and conv.kind == "dense"      # no sparse conv template yet
    assert any("no sparse template" in c.description for c in conv.candidates)
    assert plan["relu"].kind == "torch"


def test_mixed_bits_and_fine_stragglers_on_cpu():
    graph = sparta.capture(torch.nn.Linear(256, 256).eval(), (torch.randn(64, 256),))
    bits = torch.zeros(256, 256, dtype=torch.uint8)
    bits[:64, :64] = 8                                  # a dense 8-bit corner
    bits[128:160, 128:160] = 32                         # a dense 32-bit block
    bits[200, 7] = bits[250, 100] = 32                  # stragglers
    graph.set_tesa("weight", TeSA.from_bits(bits))
    graph.set_tesa("input", TeSA.from_bits(torch.full((64, 256), 8, dtype=torch.uint8)))
    plan = transform(graph, "cpu")
    p = plan[next(o.name for o in graph.ops("linear"))]
    names = {c.name for c in p.candidates}
    assert any("@W8A8" in n and "@W32A8" not in n for n in names)
    assert p.kind == "sparse" and {s.weight_bits for s in p.subops} <= {8, 32}
    elems = sum(s.elements.mask.to(torch.int32) for s in p.subops)
    assert torch.equal(elems, (bits > 0).to(torch.int32)), "sub-ops partition the kept weights"


def test_all_pruned_weight_costs_nothing():
    graph = sparta.capture(torch.nn.Linear(64, 32).eval(), (torch.randn(8, 64),))
    graph.set_tesa("weight", TeSA.pruned((32, 64)))
    p = transform(propagate(graph), "cpu")["linear"]
    assert p.kind == "sparse" and p.subops == [] and p.est_us == 0.0


def test_op_plan_validates_fields():
    with pytest.raises(PlanError, match="kind"):
        OpPlan("x", "linear", "fast", 1.0, 1.0)


@pytest.mark.slow
def test_bert_base_gets_a_plan_for_every_op():
    from models import bert_base
    model = bert_base()
    graph = sparta.capture(model, (torch.randint(0, 30522, (1, 128)),))
    for i in range(12):
        name = f"encoder.layer.{i}.intermediate.dense.weight"
        graph.set_tesa(name, TeSA.from_mask(block_mask((3072, 768), 32, 0.1, i)))
    graph = propagate(graph)
    for target in ("cpu", "cuda"):
        plan = transform(graph, target)
        assert set(plan.ops) == {o.name for o in graph.ops()}
        gemms = [p for p in plan.ops.values() if p.gemm]
        assert len(gemms) == 12 * 6 + 1                       # Q, K, V, O, FFN1, FFN2 per layer + pooler
        ffn1 = [p for p in gemms if p.weight and "intermediate" in p.weight]
        assert all(p.kind == "sparse" for p in ffn1), target
        assert "total: est" in plan.report()


def test_dense_rate_at_few_rows_follows_the_measured_table():
    from sparta.passes.transform import KernelCosts
    k = KernelCosts(32, 32, 100.0, {}, dense_gflops_rows={1: 10.0, 4: 20.0, 64: 80.0})
    assert k.dense_rate(1) == 10.0 and k.dense_rate(4) == 20.0 and k.dense_rate(2) == pytest.approx(15.0)
    assert 20.0 < k.dense_rate(16) < 80.0 and k.dense_rate(256) == 100.0 and k.dense_rate(10_000) == 100.0
    assert KernelCosts(32, 32, 100.0, {}).dense_rate(1) == 100.0
