"""``sparta.compile(..., formats=...)``: the number format a weight's bits mean, checked against the target, in the
plan and its report; a format no kernel runs yet (fp8 on CUDA) falls back to torch, the plan saying why."""

import json

import pytest
import torch
from sparta.passes.transform import Plan

import sparta
from sparta import TeSA
from sparta.errors import ArgumentTypeError, SpartaError


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)).eval()
    keep = (torch.rand(8, 4) < 0.5).repeat_interleave(32, 0).repeat_interleave(32, 1)
    keep2 = (torch.rand(2, 8) < 0.5).repeat_interleave(32, 0).repeat_interleave(32, 1)
    tesa = {"0.weight": TeSA.from_mask(keep, bits=8), "2.weight": TeSA.from_mask(keep2, bits=8),
            "input": TeSA.dense((32, 128), 8)}
    return model, tesa, torch.randn(32, 128)


def test_fp8_on_cuda_is_planned_and_falls_back_with_the_reason_in_the_report():
    model, tesa, x = _model()
    compiled = sparta.compile(model, tesa, (x,), target="cuda", dynamic=False, formats={"0.weight": "fp8_e4m3"})
    fc1 = compiled.plan["linear"]
    assert {(s.weight_bits, s.weight_format, s.act_format) for s in fc1.subops} == {(8, "fp8_e4m3", "fp8_e4m3")}
    assert (fc1.kernel.kernel, fc1.kernel.rule) == ("torch", "not_a_format_we_run")
    report = compiled.plan.report()
    assert "@W8A8[fp8_e4m3]" in report and "fp8_e4m3 weights: no sparta CUDA kernel for fp8_e4m3 yet" in report
    again = Plan.from_json(json.loads(json.dumps(compiled.plan.to_json())))
    assert again["linear"].subops[0].weight_format == "fp8_e4m3"


def test_one_format_for_every_weight_of_its_width():
    model, tesa, x = _model()
    compiled = sparta.compile(model, tesa, (x,), target="cuda", dynamic=False, formats="fp8_e5m2")
    for op in ("linear", "linear_1"):
        p = compiled.plan[op]
        assert {s.weight_format for s in p.subops if s.weight_bits == 8} <= {"fp8_e5m2"}
        if p.kind == "sparse":
            assert p.kernel.rule == "not_a_format_we_run"


def test_by_default_nothing_changes():
    model, tesa, x = _model()
    compiled = sparta.compile(model, tesa, (x,), target="cuda", dynamic=False)
    fc1 = compiled.plan["linear"]
    assert {(s.weight_format, s.act_format) for s in fc1.subops} == {("int8", "int8")}
    assert fc1.kernel.kernel == "bsr_linear" and "[int8" in fc1.kernel.describe()


@pytest.mark.parametrize("target, formats, error, match", [
    ("cuda", {"0.weight": "nf4"}, SpartaError, r"does not run nf4 weights; it runs int4, int8, fp8_e4m3, fp8_e5m2"),
    ("cpu", "fp8_e4m3", SpartaError, r"cpu .* does not run fp8_e4m3 weights; it runs int4, int8, fp32"),
    ("cuda", {"0.weight": "bf16"}, SpartaError, r"bf16 is 16-bit, but 0.weight's TeSA bits round to 8"),
    ("cuda", {"0.weigth": "int8"}, SpartaError, r"unknown weight '0.weigth'; did you mean '0.weight'"),
    ("cpu", {"0.weight": "fp9"}, SpartaError, r"unknown number format 'fp9'"),
    ("cpu", 8, ArgumentTypeError, r"formats must be a format name"),
])
def test_asked_formats_are_checked(target, formats, error, match):
    model, tesa, x = _model()
    with pytest.raises(error, match=match):
        sparta.compile(model, tesa, (x,), target=target, dynamic=False, formats=formats)


class _Siblings(torch.nn.Module):
    """Two linears reading one input: on CUDA they run stacked as one linear."""

    def __init__(self):
        super().__init__()
        self.q, self.k = torch.nn.Linear(128, 64), torch.nn.Linear(128, 64)

    def forward(self, x):
        return self.q(x) * self.k(x)


def test_linears_stacked_as_one_take_one_format_and_names_must_be_planned_weights():
    torch.manual_seed(0)
    model, x = _Siblings().eval(), torch.randn(32, 128)
    tesa = {"q.weight": TeSA.dense((64, 128), 8), "k.weight": TeSA.dense((64, 128), 8), "x": TeSA.dense((32, 128), 8)}
    both = {"q.weight": "fp8_e4m3", "k.weight": "fp8_e4m3"}
    compiled = sparta.compile(model, tesa, (x,), target="cuda", dynamic=False, formats=both)
    stacked = [p for p in compiled.plan.ops.values() if p.weight and "+" in p.weight]
    assert stacked and {s.weight_format for s in stacked[0].subops} == {"fp8_e4m3"}
    with pytest.raises(SpartaError, match=r"q.weight, k.weight run stacked as one linear .* q.weight=fp8_e4m3, "
                                          r"k.weight=default"):
        sparta.compile(model, tesa, (x,), target="cuda", dynamic=False, formats={"q.weight": "fp8_e4m3"})
    with pytest.raises(SpartaError, match=r"'q.bias' is not the weight of a GEMM"):
        sparta.compile(model, tesa, (x,), target="cpu", dynamic=False, formats={"q.bias": "int8"})


def test_fp8_on_a_cpu_profile_that_lists_it_runs_as_torch_with_the_reason(tmp_path):
    """A CPU profile may list fp8 (a device that runs it); no sparta CPU kernel does: torch, never int8 instead."""
    from importlib import resources
    data = json.loads(resources.files("sparta.passes.profiles").joinpath("cpu.json").read_text())
    data["formats"] = {"weight": data["formats"]["weight"] + ["fp8_e4m3"], "act": data["formats"]["act"]}
    path = tmp_path / "cpu_fp8.json"
    path.write_text(json.dumps(data))
    model, tesa, x = _model()
    compiled = sparta.compile(model, tesa, (x,), target="cpu", dynamic=False, profile=str(path),
                              formats={"0.weight": "fp8_e4m3"})
    fc1, fc2 = compiled.plan["linear"], compiled.plan["linear_1"]
    assert {s.weight_format for s in fc1.subops} == {"fp8_e4m3"}
    assert (fc1.kernel.kernel, fc1.kernel.rule) == ("torch", "not_a_format_we_run")
    assert fc2.kernel is None or fc2.kernel.kernel != "torch"
    assert "fp8_e4m3 weights: no sparta CPU kernel for fp8_e4m3 yet" in compiled.plan.report()
    assert torch.isfinite(compiled(x)).all()
