"""The process-pool build (``cuda_build.prebuild``) builds the kernels the serial one builds, byte for byte."""

import json
import shutil

import pytest

from sparta.codegen import cuda_build
from sparta.templates.bsr_linear.kernel import bsr_linear
from sparta.templates.bsr_linear.spec import BsrSpec

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")

SPECS = [BsrSpec(0, 64, 96, bn=32, bk=32, tm=64, warps_m=2, stages=2, act="relu", name="pool_a"),
         BsrSpec(0, 96, 64, bn=32, bk=32, tm=64, warps_m=2, stages=2, name="pool_b")]


def _built(monkeypatch, root, jobs):
    monkeypatch.setenv("SPARTA_CACHE", str(root))
    items = [(bsr_linear, s) for s in SPECS] * 2           # repeats are built once
    assert cuda_build.prebuild(items, jobs=jobs) == len(SPECS)
    assert cuda_build.prebuild(items, jobs=jobs) == 0       # then all cached
    out = {}
    for spec in SPECS:
        art = cuda_build.build_cuda(bsr_linear, spec)
        assert art.cached
        launch = json.loads((art.path / "launch.json").read_text())
        out[spec.name] = (art.path.name, launch, (art.path / "kernel.cu").read_text())
    return out


def test_pool_builds_what_serial_builds(monkeypatch, tmp_path):
    assert _built(monkeypatch, tmp_path / "pool", 2) == _built(monkeypatch, tmp_path / "serial", 1)


def test_build_jobs_from_environment(monkeypatch):
    monkeypatch.setenv("SPARTA_BUILD_JOBS", "3")
    assert cuda_build.build_jobs() == 3
    monkeypatch.setenv("SPARTA_BUILD_JOBS", "many")
    with pytest.raises(Exception, match="SPARTA_BUILD_JOBS"):
        cuda_build.build_jobs()
