"""The RMSNorm variant of the norm family: compile-only CUDA builds, spec checks and its torch reference against
Hugging Face's LlamaRMSNorm formula and ``F.rms_norm`` (no GPU)."""

import dataclasses
import json
import shutil

import pytest
import torch

from sparta.codegen.cuda_build import ARCHS, build_cuda
from sparta.templates.norm.kernel import layer_norm_kernel
from sparta.templates.norm.runtime import LayerNormCUDA
from sparta.templates.norm.spec import LayerNormSpec, argument_names, pick_threads, rms_norm_ref

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
RMS = dict(kind="rms", bias=False, eps=1e-6)


@needs_nvcc
@pytest.mark.parametrize("spec", [
    LayerNormSpec(0, 4096, residual=True, residual_out=True, threads=pick_threads(4096), dtype="bfloat16",
                  name="rms_res_out", **RMS),
    LayerNormSpec(37, 1000, out="both", name="rms_warp_both", **RMS),
    LayerNormSpec(0, 5120, affine=False, threads=pick_threads(5120), name="rms_plain", **RMS),
])
def test_builds_cubins_with_the_arguments_its_outputs_need(tmp_path, monkeypatch, spec):
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    art = build_cuda(layer_norm_kernel, spec)
    launch = json.loads((art.path / "launch.json").read_text())
    assert sorted(launch["cubins"]) == sorted(ARCHS)
    assert sorted(a["name"] for a in launch["args"] if not a.get("scalar")) == sorted(argument_names(spec))
    src = (art.path / "kernel.cu").read_text()
    assert "shfl_sync" in src and "uint4" in src and "rsqrtf" in src
    assert ("H_ptr" in src) == spec.residual_out and ("nearbyintf" in src) == (spec.out != "fp16")
    lines = [line for line in src.splitlines() if "st_ptr[0] = (st_ptr[0] +" in line]
    assert lines, "the sum of squares is reduced, not a Welford (count, mean, M2) merge"


def test_bad_rms_specs_are_refused():
    for kw in (dict(bias=True), dict(residual_out=True), dict(kind="group")):
        with pytest.raises(ValueError):
            LayerNormSpec(**{"m": 4, "n": 64, **RMS, **kw})


def test_a_layer_norm_keeps_its_spec_key_and_an_rms_norm_names_its_kind():
    ln = LayerNormSpec(4, 64)
    assert "kind" not in ln.key() and "residual_out" not in ln.key()
    assert LayerNormSpec(4, 64, **RMS).key()["kind"] == "rms"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_reference_is_hugging_faces_llama_rms_norm(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    torch.manual_seed(0)
    n = 2056
    norm = LlamaRMSNorm(n, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(n) + 0.5)
    x = (torch.randn(7, n) * 3 + 1).to(dtype)
    assert torch.equal(rms_norm_ref(x, norm.weight.data, 1e-6), norm(x).detach())
    f = torch.nn.functional.rms_norm(x.float(), (n,), norm.weight.float(), 1e-6)
    torch.testing.assert_close(rms_norm_ref(x, norm.weight.data, 1e-6).float(), f, rtol=2e-2, atol=2e-2)


def test_the_module_returns_the_sum_after_the_output_and_fakes_its_shapes(tmp_path):
    spec = LayerNormSpec(0, 64, residual=True, residual_out=True, out="both", **RMS)
    (tmp_path / "spec.json").write_text(json.dumps(dataclasses.asdict(spec)))
    with pytest.raises(Exception, match="returns 4 tensors"):
        LayerNormCUDA("n", "x", ["y", "y:int8", "y:scale"], tmp_path, spec, torch.ones(64), None, (3, 64), "r")
    module = LayerNormCUDA("n", "x", ["y", "h", "y:int8", "y:scale"], tmp_path, spec, torch.ones(64), None,
                           (3, 64), "r")
    fake = module.fake([torch.empty(5, 64, dtype=torch.float16)])
    assert [tuple(t.shape) for t in fake] == [(5, 64), (5, 64), (5, 64), (5,)]
    assert [t.dtype for t in fake] == [torch.float16, torch.float16, torch.int8, torch.float32]
    again = LayerNormCUDA.from_saved(*module.saved_state()[:2], {tmp_path.name: tmp_path})
    assert again.spec == spec and again.output_names == module.output_names


def test_a_layer_norm_saved_before_the_rms_fields_still_loads(tmp_path):
    spec = LayerNormSpec(0, 64, out="both", residual=True)
    old = {k: v for k, v in dataclasses.asdict(spec).items() if k not in ("kind", "residual_out")}
    (tmp_path / "spec.json").write_text(json.dumps(old))
    module = LayerNormCUDA("n", "x", ["y", "y:int8", "y:scale"], tmp_path, spec, torch.ones(64), torch.zeros(64),
                           (3, 64), "r")
    config, tensors, _ = module.saved_state()
    config["spec"] = old
    again = LayerNormCUDA.from_saved(config, tensors, {tmp_path.name: tmp_path})
    assert again.spec == spec and again.spec.kind == "layer" and not again.spec.residual_out
