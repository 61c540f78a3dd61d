"""Calls of many rows on the dense GEMM (``KernelChoice.dense_from``): where the plan switches, what the report says
runs per bucket of rows is what the module runs, and the dense path computes the kernels' epilogue."""

import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparta.passes.transform.plan import KernelChoice, OpPlan, Plan
from sparta.passes.transform.transform_op import dense_switch
from sparta.templates.bsr_linear.packing import block_mask_for, pack_weight, unpack_weight
from sparta.templates.bsr_linear.runtime import SparseLinearCUDA
from sparta.templates.bsr_linear.spec import BsrSpec
from sparta.templates.epilogue_ref import activate, gated

costs_st = st.lists(st.tuples(st.floats(0.1, 100), st.floats(0.1, 100)), min_size=2, max_size=9)


@settings(max_examples=200, deadline=None)
@given(costs_st)
def test_the_switch_is_where_dense_wins_for_good_and_never_costs_more(pairs):
    rows = [7] + [4 ** i for i in range(len(pairs) - 1)]
    costs, dense = [c for c, _ in pairs], [d for _, d in pairs]
    new, switch = dense_switch(rows, costs, dense)
    if switch is None:
        assert new == costs
        assert costs[-1] <= dense[-1] or all(c > d for c, d in zip(costs[1:], dense[1:]))
        return
    below, start = switch
    assert below < start and below in rows[1:] and start in rows[1:]
    points = list(zip(rows, costs, dense))[1:]
    assert all(c > d for r, c, d in points if r >= start), "dense wins at every point from the switch on"
    assert next(c for r, c, d in points if r == below) <= next(d for r, c, d in points if r == below)
    assert all(n == (d if r >= start else c) for r, n, c, d in zip(rows, new, costs, dense))
    assert all(n <= c for n, c in zip(new[1:], costs[1:])), "at the row points, never dearer than the kernels"


def dispatch(choice: KernelChoice, rows: int) -> str:
    """What ``SparseLinearCUDA.launch`` runs for ``rows`` rows (its order of checks), as a ``by_rows`` label."""
    if choice.dense_from is not None and rows >= choice.dense_from:
        return "cuBLAS[dense copy]"
    if rows == 1 and choice.gemv.get("one_row"):
        return f"bsr_gemv[1 row, {choice.gemv['one_row']['warps']} warps]"
    if rows <= choice.gemv["rows"]:
        return f"bsr_gemv[{choice.gemv['warps']} warps]"
    bucket = next((t for top, t in choice.buckets or () if rows <= top), None)
    return f"tm {bucket['tm']}" if bucket else "bsr_linear[float16 128x32x32]"


@pytest.mark.parametrize("dense_from", [None, 2, 4, 5, 6, 64, 128, 129, 130, 300, 1024, 1025, 5000])
def test_the_kernel_per_bucket_of_rows_is_what_the_module_runs(dense_from):
    choice = KernelChoice("bsr_linear", "bsr_tile", "", "float16", dict(tm=128, bn=32, bk=32),
                          gemv=dict(rows=4, warps=8, one_row=dict(warps=8)),
                          buckets=[[128, dict(tm=32)], [1024, dict(tm=64)]], dense_from=dense_from)
    for rows in range(1, 1400):
        assert choice.kernel_at(rows) == dispatch(choice, rows), (dense_from, rows, choice.by_rows())
    tops = [t for t, _ in choice.by_rows()]
    assert tops[-1] is None and tops[:-1] == sorted(set(tops[:-1]))
    assert choice.describe().startswith("M<=1: bsr_gemv[1 row")
    assert choice.describe().split("; ")[-1].startswith("else cuBLAS" if dense_from else "else bsr_linear")


@pytest.mark.parametrize("gate, act, bias", [(False, "none", False), (False, "gelu", True), (True, "silu", True)])
def test_the_dense_path_computes_the_kernels_epilogue_over_the_kept_blocks(gate, act, bias):
    torch.manual_seed(0)
    n, k = 96, 160                               # neither a multiple of 64: edge blocks
    spec = BsrSpec(0, n, k, bn=32, bk=32, gate=gate, act=act, bias=bias, dtype="bfloat16")
    w = torch.randn(2 * n if gate else n, k)
    mask = torch.rand(block_mask_for(w, spec).shape, generator=torch.Generator().manual_seed(1)) < 0.5
    b = torch.randn(2 * n if gate else n) if bias else None
    module = SparseLinearCUDA.from_weight("op", "x", "/not/built", spec, w.bfloat16(), mask, b, (5, n), dense_from=8)
    kept = unpack_weight(*pack_weight(w.bfloat16(), spec, mask), spec)
    assert torch.equal(module._dense_weight(), kept)
    x = torch.randn(9, k).bfloat16()
    y = torch.nn.functional.linear(x.float(), kept.float(), None if b is None else b.bfloat16().float())
    want = gated(y, act) if gate else activate(y, act)
    torch.testing.assert_close(module.dense_rows_call(x).float(), want, rtol=2e-2, atol=2e-2)
    assert module.dense_rows_call(x[:7]) is None, "fewer rows than dense_from: the kernels"
    assert "cuBLAS on a dense copy from 8 rows" in repr(module)
    with pytest.raises(Exception, match="16-bit kernel"):
        SparseLinearCUDA.from_weight("op", "x", "/not/built", BsrSpec(0, n, k, bn=32, bk=32, dtype="int8"),
                                     w[:n], mask[: spec.row_blocks], None, (5, n), dense_from=8)


def test_the_choice_survives_the_plan_json_and_older_plans_load():
    choice = KernelChoice("bsr_linear", "bsr_tile", "", "float16", dict(tm=128, bn=32, bk=32),
                          gemv=dict(rows=4, warps=8), dense_from=200)
    plan = Plan("cuda", {})
    plan.ops["linear"] = OpPlan("linear", "linear", "sparse", 1.0, 2.0, kernel=choice, dense_from=(16, 256))
    again = Plan.from_json(plan.to_json()).ops["linear"]
    assert again.kernel.dense_from == 200 and list(again.dense_from) == [16, 256]
    old = plan.to_json()
    del old["ops"]["linear"]["kernel"]["dense_from"], old["ops"]["linear"]["dense_from"]
    older = Plan.from_json(old).ops["linear"]
    assert older.kernel.dense_from is None and older.dense_from is None


def _two_linears(density: float, block: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048, bias=False), torch.nn.ReLU(),
                                torch.nn.Linear(2048, 2048)).half().eval()
    masks = {}
    for i, name in enumerate(("0.weight", "2.weight")):
        grid = torch.rand(2048 // block, 2048 // block, generator=torch.Generator().manual_seed(i)) < density
        masks[name] = grid.repeat_interleave(block, 0).repeat_interleave(block, 1)
    return model, masks


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_a_half_pruned_linear_runs_its_gemv_at_decode_and_cublas_at_prefill(tmp_path):
    """50% of the blocks kept, planned over 1-2048 tokens: dense at every row count would be the old plan; now the
    GEMV takes the few-row calls and cuBLAS the many-row ones, the report says so per bucket with its estimate, the
    module holds the switch, its dense path equals the masked model, and a saved model keeps it. 90% of the blocks
    pruned: the kernels win over the whole range (no switch)."""
    pytest.importorskip("tvm", reason="builds CUDA kernels")
    import sparta
    from sparta.target import load_target
    profile = load_target("cuda").profile
    model, masks = _two_linears(0.5, 32)
    compiled = sparta.compile(model, masks, (torch.randn(2, 16, 2048).half(),), target="cuda", dynamic=True,
                              tokens=(1, 2048))
    mods = {k: m for k, m in compiled.module_replacements().items() if type(m).__name__ == "SparseLinearCUDA"}
    assert sorted(mods) == ["linear", "linear_1"], compiled.plan_report()
    for name, module in mods.items():
        p = compiled.plan.ops[name]
        assert p.kind == "sparse" and p.dense_from is not None and p.kernel.dense_from == module.dense_from > 4
        assert p.kernel.kernel_at(1).startswith("bsr_gemv[1 row") and p.kernel.kernel_at(4).startswith("bsr_gemv[")
        assert p.kernel.kernel_at(module.dense_from) == "cuBLAS[dense copy]"
        assert p.kernel.kernel_at(module.dense_from - 1) != "cuBLAS[dense copy]"
        last = p.kernel.bucket_us[-1]
        assert last[1] == "cuBLAS[dense copy]" and last[3] == pytest.approx(profile.dense_us(last[2], 2048, 2048, 16, 16),
                                                                            abs=1e-3)
        lows = [0] + [top for top, _ in p.kernel.buckets or ()]
        assert all(low + 1 < module.dense_from for low in lows[:-1]), "no tile built for rows only cuBLAS takes"
        line = next(r for r in compiled.plan_report().splitlines() if r.startswith(name + " "))
        assert "else cuBLAS[dense copy]" in line
        w = torch.where(masks[f"{'0' if name == 'linear' else '2'}.weight"], model[0 if name == "linear" else 2].weight, 0)
        assert torch.equal(module._dense_weight(), w.half())
    x = torch.randn(mods["linear"].dense_from + 3, 2048).half()
    h = mods["linear"].dense_rows_call(x)
    torch.testing.assert_close(h.float(), torch.relu(x.float() @ mods["linear"]._dense_weight().float().T),
                               rtol=1e-2, atol=1e-2)
    compiled.save(tmp_path / "saved")
    loaded = sparta.load(tmp_path / "saved")
    assert {k: m.dense_from for k, m in loaded.module_replacements().items() if k in mods} == \
        {k: m.dense_from for k, m in mods.items()}
    sparse = sparta.compile(*_two_linears(0.1, 32), (torch.randn(2, 16, 2048).half(),), target="cuda",
                            dynamic=True, tokens=(1, 2048))
    assert all(p.kernel.dense_from is None for p in sparse.plan.ops.values() if p.kernel is not None
               and p.kernel.kernel == "bsr_linear"), sparse.plan_report()
