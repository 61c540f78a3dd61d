"""The LayerNorm (+ per-token int8) template: compile-only CUDA builds and spec checks (no GPU)."""

import json
import shutil

import pytest

from sparta.codegen.cuda_build import ARCHS, build_cuda
from sparta.templates.norm.kernel import layer_norm_kernel
from sparta.templates.norm.spec import LayerNormSpec, argument_names, pick_threads

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


@needs_nvcc
@pytest.mark.parametrize("spec,grid,block", [
    (LayerNormSpec(37, 1000, out="both", name="ln_warp"), 10, 128),              # a warp per row, 4 rows per CTA
    (LayerNormSpec(33, 4104, out="int8", threads=512, name="ln_cta"), 33, 512),   # a CTA per row
    (LayerNormSpec(5, 24, affine=False, bias=False, name="ln_plain"), 2, 128),
])
def test_builds_cubins_with_the_arguments_its_outputs_need(tmp_path, monkeypatch, spec, grid, block):
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    art = build_cuda(layer_norm_kernel, spec)
    launch = json.loads((art.path / "launch.json").read_text())
    assert sorted(launch["cubins"]) == sorted(ARCHS)
    assert launch["grid"][0] == grid and launch["block"][0] == block
    assert sorted(a["name"] for a in launch["args"]) == sorted(argument_names(spec))
    src = (art.path / "kernel.cu").read_text()
    assert "shfl_sync" in src and "uint4" in src                       # butterfly merges, 16-byte loads
    assert ("__syncthreads" in src) == (spec.threads > 32)             # shared memory only across warps
    assert ("nearbyintf" in src) == (spec.out != "fp16")


def test_bad_specs_are_refused():
    for kw in (dict(n=12), dict(threads=48), dict(out="int4"), dict(eps=0.0), dict(affine=False)):
        with pytest.raises(ValueError):
            LayerNormSpec(**{"m": 4, "n": 64, **kw})


def test_threads_per_row():
    assert [pick_threads(n) for n in (24, 768, 1024, 1032, 4096, 8192, 65536)] == [32, 32, 32, 128, 256, 512, 1024]
    assert LayerNormSpec(4, 4104, threads=512).per_thread == 2 and LayerNormSpec(4, 768).per_thread == 3


def test_a_saved_op_refuses_a_kernel_folder_built_for_another_spec(tmp_path):
    import dataclasses

    from sparta.runtime.cuda import CudaRuntimeError, check_saved_spec
    spec = LayerNormSpec(4, 64, out="both")
    check_saved_spec("ln", tmp_path, spec)                      # no spec.json: nothing to compare
    (tmp_path / "spec.json").write_text(json.dumps(dataclasses.asdict(spec)))
    check_saved_spec("ln", tmp_path, spec)
    with pytest.raises(CudaRuntimeError, match="built for a different spec"):
        check_saved_spec("ln", tmp_path, dataclasses.replace(spec, out="int8"))
