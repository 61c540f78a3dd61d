import pytest
import torch
from models import MLP, tiny_bert

import sparta
from sparta import SpartaError, TeSA, TeSAError


def test_masks_apply_and_equal_masked_dense_reference():
    model = MLP().eval()
    x = torch.randn(6, 24)
    mask = torch.rand(48, 24, generator=torch.Generator().manual_seed(0)) < 0.4
    compiled = sparta.compile(model, {"fc1.weight": TeSA.from_mask(mask)}, (x,), propagate=False)
    ref = MLP().eval()
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        ref.fc1.weight.mul_(mask)
        torch.testing.assert_close(compiled(x), ref(x), rtol=1e-5, atol=1e-6)
        assert not torch.allclose(compiled(x), model(x), rtol=1e-3, atol=1e-4)
    assert model.fc1.weight.count_nonzero() == 48 * 24, "the user's model is never modified"


def test_bool_mask_accepted_and_propagation_on_by_default():
    model = MLP().eval()
    cols = torch.ones(48, 48, dtype=torch.bool)
    cols[:, :8] = False
    compiled = sparta.compile(model, {"fc2.weight": cols}, (torch.randn(2, 24),))
    assert compiled.tesa("fc1.weight").density == pytest.approx(40 / 48)
    off = sparta.compile(model, {"fc2.weight": cols}, (torch.randn(2, 24),), propagate=False)
    assert off.tesa("fc1.weight").is_dense
    assert "fc1.weight" in compiled.report() and {"propagate", "plan_cache"} & set(compiled.timings)


def test_verify_passes_and_reports():
    model = tiny_bert()
    ids = torch.randint(0, 100, (2, 9))
    w = "encoder.layer.1.output.dense.weight"
    compiled = sparta.compile(model, {w: TeSA.from_mask(torch.rand(64, 128) < 0.3)}, (ids,), verify=True)
    errs = compiled.verify()
    assert set(errs) == set(compiled.graph.outputs) and max(errs.values()) < 1e-5


@pytest.mark.parametrize("tesa, match", [
    ({"fc9.weight": TeSA.dense((48, 24))}, "unknown parameter.*fc9.weight.*did you mean"),
    ({"fc1.weight": TeSA.dense((24, 48))}, "fc1.weight.*does not match"),
    ({"fc1.weight": torch.ones(48, 24)}, "fc1.weight.*expected a sparta.TeSA"),
])
def test_bad_tesa_inputs(tesa, match):
    with pytest.raises(TeSAError, match=match):
        sparta.compile(MLP().eval(), tesa, (torch.randn(2, 24),))


def test_bad_dismantle_level():
    with pytest.raises(sparta.SpartaError, match="dismantle"):
        sparta.compile(MLP().eval(), {}, (torch.randn(2, 24),), dismantle="sometimes")


def test_bad_target_and_inputs():
    with pytest.raises(SpartaError, match="unknown target"):
        sparta.compile(MLP().eval(), {}, (torch.randn(2, 24),), target="tpu")
    compiled = sparta.compile(MLP().eval(), {}, (torch.randn(2, 24),))
    with pytest.raises(SpartaError, match="1 tensor inputs"):
        compiled(torch.randn(2, 24), torch.randn(2, 24))


def test_a_profile_given_to_compile_plans_the_model_and_the_report_names_it(tmp_path, monkeypatch):
    import json
    from sparta.passes.transform import load_profile
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256)).eval()
    keep = (torch.rand(8, 8) < 0.3).repeat_interleave(32, 0).repeat_interleave(32, 1)
    x = torch.randn(64, 256)
    shipped = load_profile("cpu").to_json()
    slow = {**shipped, "device": "a machine whose dense GEMM crawls", "date": "2026-01-01",
            "kernels": [{**k, "dense_gflops": k["dense_gflops"] / 1000,
                         "dense_gflops_rows": {r: v / 1000 for r, v in k.get("dense_gflops_rows", {}).items()}}
                        for k in shipped["kernels"]]}
    path = tmp_path / "host.json"
    path.write_text(json.dumps(slow))
    fast = sparta.compile(model, {"0.weight": keep}, (x,), profile=str(path))
    assert "a machine whose dense GEMM crawls, 2026-01-01" in fast.plan_report()
    assert fast.plan.ops["linear"].dense_us > 100 * sparta.compile(model, {"0.weight": keep}, (x,)).plan.ops["linear"].dense_us
    with pytest.raises(sparta.SpartaError, match="profile"):
        sparta.compile(model, {"0.weight": keep}, (x,), profile=str(tmp_path / "missing.json"))


def test_the_cpu_profile_is_this_machines_measured_once_per_cpu_model(tmp_path, monkeypatch):
    """On a CPU model the shipped profile was not measured on, compile measures one here on first use, keeps it in
    the kernel cache and names it in the plan report; the next compile reads it back."""
    from sparta.codegen import profile as profiling
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SPARTA_CPU_PROFILE", raising=False)
    monkeypatch.setattr(profiling, "_cpu_name", lambda: "Imaginary CPU 9000 (2 cores, 2 threads)")
    model = torch.nn.Sequential(torch.nn.Linear(256, 256)).eval()
    keep = (torch.rand(8, 8) < 0.3).repeat_interleave(32, 0).repeat_interleave(32, 1)
    x = torch.randn(64, 256)
    first = sparta.compile(model, {"0.weight": keep}, (x,))
    saved = list((tmp_path / "cache" / "profiles").glob("cpu-Imaginary_CPU_9000*.json"))
    assert len(saved) == 1
    assert "Imaginary CPU 9000" in first.plan_report() and "measured on this host" in first.plan.profile["source"]
    monkeypatch.setattr(profiling, "measure_sparta_cpu", lambda *a, **k: pytest.fail("measured twice"))
    second = sparta.compile(model, {"0.weight": keep}, (x,))
    assert second.plan.profile == first.plan.profile
    monkeypatch.setenv("SPARTA_CPU_PROFILE", "shipped")
    assert sparta.compile(model, {"0.weight": keep}, (x,)).plan.profile["device"] != first.plan.profile["device"]
