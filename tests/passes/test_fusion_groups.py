"""The fusion pass (``passes/transform/groups.py``): what each chosen kernel computes of its neighbours is a typed
group on the plan, shown by the plan report, kept by the plan's JSON, and what codegen builds."""

import pytest
import torch

import sparta
from sparta.errors import CodegenError
from sparta.passes.transform.groups import FusionGroup, check_epilogue, group_of
from sparta.passes.transform.plan import Plan


def _mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32)).eval()
    mask = (torch.rand(4, 2) < 0.5).repeat_interleave(32, 0).repeat_interleave(32, 1)
    mask[0, 0] = True
    return model, {"0.weight": mask}


def test_a_cpu_linear_computing_its_relu_is_an_epilogue_group_in_the_plan_and_its_report():
    model, tesa = _mlp()
    compiled = sparta.compile(model, tesa, (torch.randn(5, 64),), dynamic=False)
    (group,) = compiled.plan.fusions
    assert (group.kind, group.anchor, group.ops) == ("epilogue", "linear", ["relu"])
    assert group_of(compiled.plan, "relu") is group and group_of(compiled.plan, "linear") is None
    assert "fusion (epilogue): linear computes relu in its epilogue" in compiled.plan_report()
    x = torch.randn(5, 64)
    torch.testing.assert_close(compiled(x), compiled.reference()(x)[0], rtol=1e-4, atol=1e-4)


def test_fusion_groups_round_trip_the_plan_json_and_unknown_fields_are_refused():
    model, tesa = _mlp()
    plan = sparta.compile(model, tesa, (torch.randn(5, 64),), dynamic=False).plan
    plan.fusions.append(FusionGroup("codes", "linear_1", [], "y", ["z"], 0.25, tiles={"pingpong": True}))
    again = Plan.from_json(plan.to_json())
    assert again.fusions == plan.fusions
    data = plan.to_json()
    data["fusions"][0]["bogus"] = 1
    with pytest.raises(sparta.SpartaError, match="bogus"):
        Plan.from_json(data)
    data["fusions"][0].pop("bogus")
    data["fusions"][0]["kind"] = "mystery"
    with pytest.raises(sparta.SpartaError, match="unknown kind 'mystery'"):
        Plan.from_json(data)


def test_a_build_that_fuses_other_than_the_plan_says_is_refused():
    model, tesa = _mlp()
    plan = sparta.compile(model, tesa, (torch.randn(5, 64),), dynamic=False).plan
    check_epilogue(plan, "linear", ["relu"])
    with pytest.raises(CodegenError, match="the plan fuses"):
        check_epilogue(plan, "linear", [])
    with pytest.raises(CodegenError, match="nothing"):
        check_epilogue(plan, "linear_1", ["relu"])
