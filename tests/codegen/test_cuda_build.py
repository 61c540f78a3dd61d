"""Compile-only CUDA build (no GPU needed): TVM emits CUDA C, nvcc builds cubins, launch spec is right."""

import json
import shutil

import pytest

from sparta.codegen.cuda_build import ARCHS, build_cuda
from sparta.templates.cuda_gemm import GemmSpec, mma_gemm

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


def test_gemm_template_builds_cubins_for_every_arch(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    spec = GemmSpec(128, 192, 64, name="probe_gemm")
    art = build_cuda(mma_gemm, spec)
    src = (art.path / "kernel.cu").read_text()
    assert "mma.sync.aligned.m16n8k16" in src and "ldmatrix" in src, "tensor-core instructions are emitted"
    launch = json.loads((art.path / "launch.json").read_text())
    assert sorted(launch["cubins"]) == sorted(ARCHS)
    for info in launch["cubins"].values():
        assert (art.path / info["file"]).read_bytes()[:4] == b"\x7fELF"
    assert sorted(a["name"] for a in launch["args"]) == ["W", "X", "Y"]
    shapes = {a["name"]: (a["dtype"], a["shape"]) for a in launch["args"]}
    assert shapes == {"X": ("float16", [128, 64]), "W": ("float16", [192, 64]), "Y": ("float32", [128, 192])}
    assert launch["grid"][0] * launch["grid"][1] == (128 // 64) * (192 // 64)
    assert launch["block"][0] * launch["block"][1] == 128
    again = build_cuda(mma_gemm, spec)
    assert again.cached and again.path == art.path
    (art.path / launch["cubins"]["sm_90"]["file"]).write_bytes(b"corrupt")
    rebuilt = build_cuda(mma_gemm, spec)
    assert not rebuilt.cached, "a damaged cubin is rebuilt"


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="multiples"):
        GemmSpec(100, 64, 32)
