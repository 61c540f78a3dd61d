"""2:4 linears compiled for CUDA here (no GPU: TVM and nvcc build the kernels): the rule picks the 2:4 kernel for the
planned ``nm_sparse`` sub-operator with cuBLAS above its rows, the report says so per bucket with estimates, the
module's dense path applies the masked weight, and a kernels-only save takes a checkpoint's weights (a checkpoint
with another mask is refused)."""

import shutil

import pytest
import torch

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


@pytest.fixture(scope="module")
def compiled():
    pytest.importorskip("tvm", reason="builds CUDA kernels")
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fixtures.saved_models import nm_mlp
    return nm_mlp()


def test_the_report_names_the_two_four_kernel_and_cublas_per_bucket_with_estimates(compiled):
    from sparta.passes.transform.nm import nm_bytes
    from sparta.target import load_target
    prof = load_target("cuda").profile
    lines = [r for r in compiled.plan_report().splitlines() if "nm_linear[" in r]
    assert len(lines) == 2 and all("else cuBLAS[dense copy]" in r for r in lines), compiled.plan_report()
    for p in (p for p in compiled.plan.ops.values() if p.kernel is not None and p.kernel.kernel == "nm_linear"):
        (m, n, k) = p.gemm
        few, wide, dense = p.kernel.bucket_us
        for bucket, rows in ((few, 8), (wide, 16)):
            assert bucket[0] == rows and bucket[3] == pytest.approx(
                prof.low_bit_gemv_us("nm_linear", rows, nm_bytes(n, k)), abs=1e-3) and bucket[3] < bucket[4]
        assert dense[1] == "cuBLAS[dense copy]" and dense[3] == dense[4]
        assert p.kernel.describe().startswith("M<=8: nm_linear[8 warps]") and "M<=16: nm_linear[bfloat16]" in \
            p.kernel.describe()


def test_the_dense_path_applies_the_masked_weight(compiled):
    from fixtures.kernel_choices import check_nm_mlp
    mods = check_nm_mlp(compiled)
    for name, m in mods.items():
        w = compiled.graph.tensor(m.weight_name).data
        keep = compiled.plan.ops[name].kept(m.spec.n, m.spec.k)
        assert torch.equal(m.unpacked(), torch.where(keep, w, 0).to(torch.bfloat16))
        x = torch.randn(19, m.spec.k).bfloat16()
        torch.testing.assert_close(m.dense_rows_call(x).float(), x.float() @ m.unpacked().float().T,
                                   rtol=2e-2, atol=2e-2)
        assert m.dense_rows_call(x[:16]) is None


def test_a_kernels_only_save_takes_the_checkpoint_and_refuses_another_mask(compiled, tmp_path):
    import sparta
    from sparta.errors import SpartaError
    compiled.save(tmp_path / "k", weights=False)
    from fixtures.saved_models import _GatedMLP, nm_masks
    torch.manual_seed(0)
    model = _GatedMLP(1024, 2816).eval().to(torch.bfloat16)            # nm_mlp's model, its masks applied
    state = {n: torch.where(m, p.detach(), 0) for (n, p), m in zip(model.named_parameters(), nm_masks(model).values())}
    loaded = sparta.load(tmp_path / "k", weights=state)
    for name, m in loaded.module_replacements().items():
        if type(m).__name__ == "NmLinearCUDA":
            ref = compiled.module_replacements()[name]
            assert torch.equal(m.values, ref.values) and torch.equal(m.meta, ref.meta)
            assert m.dense_from == 17 and m.input_names == ref.input_names
            assert m.few_spec == ref.few_spec and m.few_folder != ref.few_folder, "the few-row kernel saved"
    other = dict(state)
    w = other["gate.weight"].clone()
    w[0, :4] = 1.0                                               # 4 kept in a group: not the compiled mask
    other["gate.weight"] = w
    with pytest.raises(SpartaError):
        sparta.load(tmp_path / "k", weights=other)
