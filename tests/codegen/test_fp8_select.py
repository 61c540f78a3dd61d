"""Selection of the FP8 GEMV (``templates/fp8_gemv/select.py``): a planned FP8 weight runs the GEMV up to the rows
where the dense GEMM is cheaper (by the profile), then cuBLAS over the weight dequantised per call; its tiling by density; formats and
epilogues it does not run go to torch with the reason; each bucket priced by the kernel that runs there."""

import pytest
import torch

from sparta.errors import PlanError
from sparta.passes.transform.fp8 import FP8_MAX_ROWS, fp8_bytes
from sparta.pipeline import PASSES, CompileContext, CompileOptions, run_passes
from sparta.target import load_target
from sparta.templates.fp8_gemv.select import fp8_dense_from, fp8_tiling
from sparta.tesa import TeSA


def _selected(tesa: TeSA, rows: int = 2, formats=None, dynamic=None, act=False):
    """The GEMM's plan after selection (the pipeline up to ``select``, no kernel built), and the target."""
    n, k = tesa.shape
    model = torch.nn.Sequential(*[torch.nn.Linear(k, n, bias=act)] + ([torch.nn.GELU()] if act else [])).eval()
    options = CompileOptions("cuda", {"0.weight": tesa}, (torch.randn(2, rows, k).bfloat16(),), dynamic=dynamic,
                             formats=formats, tokens=(1, 2048) if dynamic is None else None)
    upto = [p for p in PASSES if p.name in ("capture", "attach_tesa", "simplify", "fuse_siblings", "plan_tokens",
                                            "target", "propagate_and_plan", "shrink", "formats", "select")]
    ctx = run_passes(CompileContext(model.bfloat16(), options), upto)
    return next(p for p in ctx.plan.ops.values() if p.gemm is not None), ctx.target


def test_the_switch_to_the_dense_gemm_is_where_it_wins_for_good_by_the_profile():
    prof = load_target("cuda").profile
    for n, k, kept in ((4096, 4096, 1.0), (11008, 4096, 1.0), (11008, 4096, 0.1), (256, 256, 1.0)):
        blocks = round(-(-n // 32) * -(-k // 32) * kept)
        start = fp8_dense_from(n, k, blocks, prof)
        assert 2 <= start <= FP8_MAX_ROWS + 1
        gemv = [prof.low_bit_gemv_us("fp8_gemv", r, fp8_bytes(blocks, n)) for r in range(1, FP8_MAX_ROWS + 1)]
        dequant = prof.dequant_us(n, k, fp8_bytes(blocks, n))
        dense = [prof.dense_us(r, n, k, 16, 16) + dequant for r in range(1, FP8_MAX_ROWS + 1)]
        assert all(g > d for g, d in zip(gemv[start - 1:], dense[start - 1:]))
        assert start == 2 or gemv[start - 2] <= dense[start - 2]


def test_a_dense_and_a_sparse_fp8_weight_pick_their_tilings_and_report_each_bucket():
    assert fp8_tiling(4096, 4096, True, 132)["warps"] == 8 and fp8_tiling(4096, 4096, True, 132)["ksplit"] > 1
    assert fp8_tiling(4096, 4096, False, 132) == dict(mma=True, warps=16, inflight=1, ksplit=1, trigger="early")
    p, target = _selected(TeSA.dense((11008, 4096), 8), act=True)
    choice = p.kernel
    assert choice.kernel == "fp8_gemv" and choice.rule == "fp8_weights", choice
    assert choice.dense_from == fp8_dense_from(11008, 4096, 344 * 128, target.profile)
    assert choice.kernel_at(1).startswith("fp8_gemv") and choice.kernel_at(4096) == "cuBLAS[dequantised per call]"
    (top, label, rows, est, dense), last = choice.bucket_us[0], choice.bucket_us[-1]
    assert est < dense, "the GEMV where it is cheaper"
    assert label.startswith("fp8_gemv") and top == rows == choice.dense_from - 1
    assert est == pytest.approx(target.profile.low_bit_gemv_us("fp8_gemv", rows, fp8_bytes(344 * 128, 11008)),
                                abs=1e-3)
    assert last[1] == "cuBLAS[dequantised per call]" and last[3] == pytest.approx(
        last[4] + target.profile.dequant_us(11008, 4096, fp8_bytes(344 * 128, 11008)), abs=1e-3)
    assert p.epilogue == ["bias", "gelu"], "bias and GELU in the GEMV's epilogue"
    grid = torch.rand(64, 64, generator=torch.Generator().manual_seed(0)) < 0.2
    sparse, _ = _selected(TeSA.from_blocks(grid, (64, 64), 8), formats="fp8_e4m3")
    assert sparse.kernel.kernel == "fp8_gemv" and sparse.kernel.tiles["warps"] == 16


def test_a_static_decode_graph_runs_the_gemv_for_every_call():
    p, _ = _selected(TeSA.dense((4096, 4096), 8), rows=1, dynamic=False)
    assert p.kernel.kernel == "fp8_gemv" and p.kernel.dense_from is None and p.kernel.bucket_us is None


def test_a_format_the_gemv_does_not_run_goes_to_torch_with_its_reason():
    p, _ = _selected(TeSA.dense((4096, 4096), 8), formats={"0.weight": "fp8_e5m2"})
    assert p.kernel.kernel == "torch" and "fp8_e5m2" in p.kernel.reason and "E4M3" not in p.kernel.reason
    with pytest.raises(PlanError, match="as fp8_e4m3; it has no int8 kernel there"):
        _selected(TeSA.dense((4096, 4096), 8), formats={"0.weight": "int8"})
    p, _ = _selected(TeSA.dense((4096, 4096), 8), formats="int8")          # the 8-bit format of W8A8 weights
    assert p.kernel.kernel == "fp8_gemv", p.kernel


@pytest.fixture(scope="module")
def fp8_model():
    import shutil
    import sys
    from pathlib import Path
    if shutil.which("nvcc") is None:
        pytest.skip("builds CUDA kernels: needs nvcc")
    pytest.importorskip("tvm", reason="builds CUDA kernels")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fixtures.saved_models import fp8_mlp
    return fp8_mlp()


def test_the_dense_path_applies_the_dequantised_weight_and_a_checkpoint_packs_again(fp8_model, tmp_path):
    """The weight the many-row calls (from ``dense_from``) dequantise is the one the GEMV applies; a kernels-only save loaded
    with the model's own weights packs the same codes, scales and block table; a checkpoint with a weight where the
    plan prunes is refused."""
    import sparta
    from sparta.errors import SpartaError
    from fixtures.kernel_choices import check_fp8_mlp
    mods = check_fp8_mlp(fp8_model)
    for m in mods.values():
        w = m.dense_weight()
        assert torch.equal(m.unpacked(), w.to(torch.bfloat16)) and m.plan_tensors() == ({"table"} if m.spec.sparse
                                                                                        else set())
        x = torch.randn(m.dense_from + 2, m.spec.k).bfloat16()
        y = x.float() @ w.T + (m.bias.float() if m.bias is not None else 0)
        torch.testing.assert_close(m.dense_rows_call(x).float(), torch.nn.functional.gelu(y) if m.spec.act == "gelu"
                                   else y, rtol=2e-2, atol=2e-2)
        assert m.dense_rows_call(x[:m.dense_from - 1]) is None
    fp8_model.save(tmp_path / "k", weights=False)
    state = fp8_model.source_reference().state_dict()
    loaded = sparta.load(tmp_path / "k", weights=state)
    for name, m in check_fp8_mlp(loaded).items():
        ref = mods[name]
        assert torch.equal(m.codes, ref.codes) and torch.equal(m.scales, ref.scales)
        assert (m.table is None) == (ref.table is None) and (m.table is None or torch.equal(m.table, ref.table))
    other = dict(state)
    w = other["2.weight"].clone()
    w[mods["linear_1"].dense_weight() == 0] = 1.0                 # a weight where the plan prunes its block
    other["2.weight"] = w
    with pytest.raises(SpartaError):
        sparta.load(tmp_path / "k", weights=other)
