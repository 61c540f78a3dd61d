"""``sparta.compile(..., target="cuda")`` on a machine without a GPU: sparse linears are cross-compiled."""

import json
import shutil
from pathlib import Path

import pytest
import torch

import sparta
from sparta.runtime.cuda import CudaRuntimeError

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


def _mlp_and_mask(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1024))
    grid = torch.rand(2048 // 32, 1024 // 32) < 0.1
    return model, grid.repeat_interleave(32, 0).repeat_interleave(32, 1)


def test_cuda_compile_builds_cubins_without_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    model, mask = _mlp_and_mask()
    compiled = sparta.compile(model, {"0.weight": mask}, (torch.randn(16, 256, 1024),), target="cuda")
    rows = [k for k in compiled.kernels if k["template"] == "bsr_linear"]
    assert len(rows) == 1 and rows[0]["op"] == "linear"
    assert rows[0]["blocks"] == f"{int(mask[::32, ::32].sum())}x32x32"
    folder = Path(rows[0]["artifact"])
    launch = json.loads((folder / "launch.json").read_text())
    assert sorted(launch["cubins"]) == ["sm_80", "sm_90"]
    assert "relu" in launch["name"], "the ReLU after the linear is fused into the kernel"
    assert "bsr_linear" in compiled.kernel_report()
    with pytest.raises(CudaRuntimeError, match="compiled for CUDA"):
        compiled(torch.randn(16, 256, 1024))


def test_ops_the_template_cannot_take_stay_torch_ops(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(1020, 2048))          # K = 1020: not a multiple of 8
    grid = torch.rand(2048 // 32, -(-1020 // 32)) < 0.1
    mask = grid.repeat_interleave(32, 0).repeat_interleave(32, 1)[:, :1020]
    compiled = sparta.compile(model, {"0.weight": mask}, (torch.randn(16, 256, 1020),), target="cuda")
    assert all(k["template"] == "torch" for k in compiled.kernels)
    assert any("multiple of 8" in k["key"] for k in compiled.kernels)
    out = compiled(x := torch.randn(16, 256, 1020))
    torch.testing.assert_close(out, torch.nn.functional.linear(x, model[0].weight * mask, model[0].bias),
                               rtol=1e-4, atol=1e-4)


def test_exact_gelu_after_a_sparse_linear_is_fused(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    model, mask = _mlp_and_mask(2)
    model = torch.nn.Sequential(model[0], torch.nn.GELU())
    compiled = sparta.compile(model, {"0.weight": mask}, (torch.randn(4096, 1024),), target="cuda")
    row = next(k for k in compiled.kernels if k["template"] == "bsr_linear")
    assert "gelu_erf" in json.loads((Path(row["artifact"]) / "launch.json").read_text())["name"]
    assert type(compiled.module_replacements()["gelu"]).__name__ == "Passthrough"
