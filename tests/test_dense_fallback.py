"""Sparse ops run dense again where they measure slower: ``compiled.run_dense`` and ``compile(..., measure=True)``."""

import shutil
import time

import pytest
import torch

import sparta
from models import ResidualMLP
from sparta.backend.fx import Fused, Passthrough
from sparta.templates.cpu_linear.runtime import SparseLinearCPU

pytest.importorskip("tvm", reason="compiles CPU kernels")


def block_mask(n, k, seed, density=0.3):
    grid = torch.rand(n // 32, k // 32, generator=torch.Generator().manual_seed(seed)) < density
    grid[0, 0] = True
    return grid.repeat_interleave(32, 0).repeat_interleave(32, 1)


def compiled_mlp(**options):
    torch.manual_seed(0)
    model = ResidualMLP().eval()
    tesa = {"up.weight": block_mask(256, 128, 1), "down.weight": block_mask(128, 256, 2)}
    return model, sparta.compile(model, tesa, (torch.randn(2, 24, 128),), dynamic=False, **options)


def test_an_op_run_dense_runs_its_torch_op_and_its_activation_and_the_plan_says_so(tmp_path):
    model, compiled = compiled_mlp()
    modules = compiled.module_replacements()
    assert isinstance(modules["linear"], SparseLinearCPU) and isinstance(modules["gelu"], Passthrough)
    with pytest.raises(sparta.SpartaError, match="'add' cannot run dense"):
        compiled.run_dense(["linear", "add"])           # refused whole: nothing changed
    assert compiled.module_replacements().keys() == modules.keys() and compiled.plan["linear"].kind == "sparse"
    x = torch.randn(2, 24, 128)
    with torch.no_grad():
        want = compiled.reference()(x)[0]
        assert compiled.run_dense(["linear"], "measured slower") == ["linear"]
        modules = compiled.module_replacements()
        assert "linear" not in modules and "gelu" not in modules and "linear_1" in modules
        plan = compiled.plan["linear"]
        assert plan.kind == "dense" and plan.kernel is None and plan.note == "runs dense: measured slower"
        assert compiled.plan["gelu"].est_us > 0 and not any(k["op"] == "linear" for k in compiled.kernels)
        assert "runs dense: measured slower" in compiled.plan_report()
        torch.testing.assert_close(compiled(x), want, rtol=1e-5, atol=1e-5)
        assert "gelu" in compiled.module.code and "kernel_linear_1" in compiled.module.code
        loaded = sparta.load(compiled.save(tmp_path / "saved"))
        assert "linear" not in loaded.module_replacements() and loaded.plan["linear"].kind == "dense"
        torch.testing.assert_close(loaded(x), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(sparta.SpartaError, match="runs no sparta GEMM kernel"):
        compiled.run_dense(["linear"])
    with pytest.raises(sparta.SpartaError, match="runs no sparta GEMM kernel"):
        compiled.run_dense(["add"])


def test_measure_runs_dense_what_measures_slower(monkeypatch):
    """A kernel made 20 ms slower is measured so at compile time and its op runs dense; the plan notes the times."""
    launch = SparseLinearCPU.launch

    def slow(self, inputs):
        if self.op_name == "linear_1":
            time.sleep(0.02)
        return launch(self, inputs)

    monkeypatch.setattr(SparseLinearCPU, "launch", slow)
    _, compiled = compiled_mlp(measure=True)
    assert compiled.plan["linear_1"].kind == "dense" and "measured" in compiled.plan["linear_1"].note
    assert "linear_1" not in compiled.module_replacements() and compiled.timings["measure"] > 0
    with pytest.raises(sparta.SpartaError, match="no GPU"):
        sparta.compile(ResidualMLP().eval(), {}, (torch.randn(2, 4, 128),), target="cuda", measure=True)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_a_gated_cuda_linear_run_dense_gives_its_slices_activation_and_product_back():
    from torch._subclasses.fake_tensor import FakeTensorMode

    class Gated(torch.nn.Module):
        def __init__(self, d=512, h=1024):
            super().__init__()
            self.gate, self.up = torch.nn.Linear(d, h, bias=False), torch.nn.Linear(d, h, bias=False)
            self.down = torch.nn.Linear(h, d, bias=False)

        def forward(self, x):
            return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))

    torch.manual_seed(0)
    model = Gated().half().eval()
    tesa = {f"{n}.weight": block_mask(*getattr(model, n).weight.shape, i, 0.1)
            for i, n in enumerate(("gate", "up", "down"))}
    compiled = sparta.compile(model, tesa, (torch.randn(2, 64, 512).half(),), target="cuda")
    gated = next(name for name, m in compiled.module_replacements().items()
                 if getattr(getattr(m, "spec", None), "gate", False))
    assert any(isinstance(m, Fused) and m.into == gated for m in compiled.module_replacements().values())
    compiled.run_dense([gated], "asked")
    assert not any(isinstance(m, Fused) for m in compiled.module_replacements().values())
    assert "+swiglu" not in compiled.plan_report() and "silu" in compiled.module.code
    with FakeTensorMode():
        state = {k: torch.empty(v.shape, dtype=v.dtype, device="cuda")
                 for k, v in [*compiled.module.named_parameters(), *compiled.module.named_buffers()]}
        (out,) = torch.func.functional_call(compiled.module, state,
                                            (torch.empty(3, 7, 512, device="cuda", dtype=torch.float16),))
        assert out.shape == (3, 7, 512) and out.dtype == torch.float16
