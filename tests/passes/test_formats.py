"""Number formats (``sparta/formats.py``): the table, the torch references (fake quantisation idempotent, its error
bounded), the formats a target runs per role, and the plan's per-sub-operator formats (defaults, JSON, selection)."""

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sparta.passes.transform import transform
from sparta.passes.transform.plan import Plan, SubOp

import sparta
from sparta import TeSA
from sparta.errors import PlanError, SpartaError
from sparta.formats import FORMATS, NF4_TABLE, default_format, get_format
from sparta.target import load_target

NAMES = ["int4", "nf4", "int8", "fp8_e4m3", "fp8_e5m2", "fp16", "bf16", "fp32"]


def test_the_table_holds_each_format_with_its_bits_kind_range_and_dtype():
    assert list(FORMATS) == NAMES
    f = {n: get_format(n) for n in NAMES}
    assert [f[n].bits for n in NAMES] == [4, 4, 8, 8, 8, 16, 16, 32]
    assert f["nf4"].kind == "lookup" and f["int8"].kind == "int" and f["fp8_e5m2"].kind == "float"
    assert f["fp8_e4m3"].dtype == torch.float8_e4m3fn and f["fp8_e5m2"].dtype == torch.float8_e5m2
    assert f["bf16"].dtype == torch.bfloat16 and f["int8"].dtype == torch.int8 and f["int4"].dtype is None
    assert (f["fp8_e4m3"].max_value, f["fp8_e5m2"].max_value, f["int8"].max_value, f["int4"].max_value) == \
        (448.0, 57344.0, 127.0, 7.0)
    assert (f["fp8_e4m3"].mantissa_bits, f["fp8_e5m2"].mantissa_bits, f["bf16"].mantissa_bits) == (3, 2, 7)
    assert {"1x128", "128x128"} <= set(f["fp8_e4m3"].scales) and f["int8"].scales[:2] == ("channel", "token")
    assert not f["fp16"].needs_scale and f["nf4"].needs_scale and f["nf4"].group == 64
    with pytest.raises(SpartaError, match="unknown number format 'fp8'; known: int4, nf4"):
        get_format("fp8")


def test_default_formats_are_todays_meaning_of_the_bits():
    assert [default_format(b) for b in (4, 8, 16, 32)] == ["int4", "int8", "fp16", "fp32"]
    assert default_format(16, torch.bfloat16) == "bf16" and default_format(16, torch.float32) == "fp16"


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(name=st.sampled_from(NAMES), n=st.integers(1, 9), k=st.integers(1, 300), seed=st.integers(0, 2 ** 16),
       spread=st.sampled_from([1e-3, 1.0, 1e3]),
       granularity=st.sampled_from(["tensor", "channel", "token", "group", "1x128", "128x128", None]))
def test_fake_quant_is_idempotent_and_its_error_bounded(name, n, k, seed, spread, granularity):
    fmt = get_format(name)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g) * spread
    x[torch.rand(n, k, generator=g) < 0.1] = 0.0
    scale = fmt.scale_of(x, granularity if fmt.needs_scale else None, group=32)
    y = fmt.fake_quant(x, scale)
    assert y.shape == x.shape and y.dtype == torch.float32 and torch.isfinite(y).all()
    assert torch.equal(fmt.fake_quant(y, scale), y), "rounding twice moves nothing"
    err = (y - x).abs()
    bound = fmt.error_bound(x, scale) * (1 + 1e-5) + 1e-30
    assert (err <= bound).all(), (err - bound).max()
    assert torch.equal(y[x == 0], torch.zeros_like(y[x == 0])), "zeros stay zero"


def test_quantize_saturates_and_codes_are_the_formats_own():
    e4m3, int8, nf4 = get_format("fp8_e4m3"), get_format("int8"), get_format("nf4")
    x = torch.tensor([1e6, -1e6, 3.3, float("nan")])
    assert e4m3.quantize(x).dtype == torch.float8_e4m3fn
    assert e4m3.fake_quant(x).tolist() == [448.0, -448.0, 3.25, 0.0]
    assert int8.quantize(x, 0.5).tolist() == [127, -127, 7, 0]
    codes = nf4.quantize(torch.linspace(-2, 2, 9), 2.0)
    assert codes.dtype == torch.uint8 and codes.min() == 0 and codes.max() == 15
    assert set(nf4.dequantize(codes, 1.0).tolist()) <= set(torch.tensor(NF4_TABLE).tolist())


def test_scale_granularities_cover_blocks_groups_and_rows():
    fmt = get_format("fp8_e4m3")
    x = torch.zeros(130, 260)
    x[129, 259] = 448.0 * 3
    x[0, 0] = 448.0
    for gran, one_at in (("128x128", (127, 127)), ("1x128", (0, 127)), ("channel", (0, 259)), ("tensor", None)):
        s = fmt.scale_of(x, gran)
        assert s.shape == (x.shape if gran != "tensor" else ())
        if one_at is not None:
            assert s[0, 0] == 1.0 and s[one_at] == 1.0 and s[129, 259] == 3.0
    assert get_format("int4").scale_of(torch.ones(2, 256) * 7).shape == (2, 256)
    assert torch.equal(get_format("bf16").scale_of(x), torch.ones(()))


# ---- the target's formats ----------------------------------------------------------------------------------------
def test_targets_list_the_formats_they_run_per_role(tmp_path):
    cuda, cpu = load_target("cuda"), load_target("cpu")
    assert {"fp8_e4m3", "fp8_e5m2", "int8", "int4", "fp16", "bf16", "fp32"} == set(cuda.runs("weight"))
    assert "int4" not in cuda.runs("act") and "fp8_e4m3" in cuda.runs("act")
    assert set(cpu.runs("weight")) == {"int4", "int8", "fp32"} and set(cpu.runs("act")) == {"int8", "fp32"}
    data = json.loads(_shipped("cpu"))
    del data["formats"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = load_target("cpu", tmp_path / "old.json")        # an older profile without formats: the shipped ones
    assert set(old.runs("weight")) == {"int4", "int8", "fp32"}
    data["formats"] = {"weight": ["int8", "fp32", "fp16"], "act": ["fp32"]}
    (tmp_path / "new.json").write_text(json.dumps(data))
    new = load_target("cpu", str(tmp_path / "new.json"))    # its own, kept to the widths its kernels run
    assert new.runs("weight") == ("int8", "fp32") and new.runs("act") == ("fp32",)
    from sparta.passes.transform.profile import HardwareProfile
    assert load_target("cuda", HardwareProfile.from_json(json.loads(_shipped("cuda")))).runs("weight") == \
        cuda.runs("weight")
    data["formats"] = {"weights": ["int8"]}
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(PlanError, match="profile formats"):
        load_target("cpu", str(tmp_path / "bad.json"))


def _shipped(name: str) -> str:
    from importlib import resources
    return resources.files("sparta.passes").joinpath("profiles", f"{name}.json").read_text()


# ---- formats in the plan -----------------------------------------------------------------------------------------
def test_sub_ops_default_to_their_bits_and_say_other_formats_in_the_report():
    s = SubOp("block_sparse", 8, 8, (32, 32), 3, 0, 1.0)
    assert (s.weight_format, s.act_format) == ("int8", "int8") and s.describe() == "3x32x32@W8A8"
    fp8 = SubOp("dense", 8, 8, None, 0, 0, 1.0, weight_format="fp8_e4m3", act_format="fp8_e4m3")
    assert fp8.describe() == "dense@W8A8[fp8_e4m3]"
    assert SubOp("dense", 4, 16, None, 0, 0, 1.0, act_format="bf16").describe() == "dense@W4A16[int4×bf16]"
    with pytest.raises(PlanError, match="unknown number format"):
        SubOp("dense", 8, 8, None, 0, 0, 1.0, weight_format="int7")


def _linear(dtype=torch.float32, bits=8, act_bits=8):
    graph = sparta.capture(torch.nn.Linear(128, 64).to(dtype).eval(), (torch.randn(16, 128, dtype=dtype),))
    keep = (torch.rand(2, 4, generator=torch.Generator().manual_seed(1)) < 0.6).repeat_interleave(32, 0)
    graph.set_tesa("weight", TeSA.from_mask(keep.repeat_interleave(32, 1), bits=bits))
    if act_bits:
        graph.set_tesa("input", TeSA.dense((16, 128), act_bits))
    return graph


def test_plans_keep_todays_formats_and_old_plan_json_loads():
    plan = transform(_linear(), "cuda")
    p = plan["linear"]
    assert {(s.weight_format, s.act_format) for s in p.subops} == {("int8", "int8")} and "@W8A8[" not in plan.report()
    data = plan.to_json()
    assert data["ops"]["linear"]["subops"][0]["weight_format"] == "int8"
    for s in data["ops"]["linear"]["subops"]:       # a plan saved before formats existed
        del s["weight_format"], s["act_format"]
    assert Plan.from_json(json.loads(json.dumps(data)))["linear"].subops[0].act_format == "int8"


def test_a_bf16_model_plans_bf16_and_fp16_stays_fp16():
    bf = transform(_linear(torch.bfloat16, 16, 0), "cuda")["linear"]
    assert {(s.weight_format, s.act_format) for s in bf.subops} == {("bf16", "bf16")}
    w4 = transform(_linear(torch.bfloat16, 4, 0), "cuda")["linear"]
    assert {(s.weight_format, s.act_format) for s in w4.subops} <= {("int4", "bf16"), ("bf16", "bf16")}
    fp = transform(_linear(torch.float16, 16, 0), "cuda")["linear"]
    assert {(s.weight_format, s.act_format) for s in fp.subops} == {("fp16", "fp16")}


def test_asked_formats_land_on_the_sub_ops_of_their_width_and_survive_json():
    from sparta.passes.transform.bitround import choose_formats
    graph, cuda = _linear(), load_target("cuda")
    plan = choose_formats(graph, transform(graph, cuda), cuda, {"weight": "fp8_e5m2"})
    subs = plan["linear"].subops
    assert {(s.weight_format, s.act_format) for s in subs} == {("fp8_e5m2", "fp8_e5m2")}
    assert 8 not in plan["linear"].weight_quant, "no integer scales for fp8 weights"
    again = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again["linear"].subops[0].weight_format == "fp8_e5m2" and "[fp8_e5m2]" in again.report()
    assert choose_formats(graph, plan, cuda)["linear"].subops[0].weight_format == "int8", "None: the defaults again"
    plan = choose_formats(graph, plan, cuda, "bf16")       # no 16-bit weight here: nothing changes
    assert plan["linear"].subops[0].weight_format == "int8"


@pytest.mark.parametrize("formats, match", [
    ({"weight": "nf4"}, "cuda .* does not run nf4 weights; it runs int4, int8, fp8_e4m3"),
    ({"weight": "fp16"}, r"fp16 is 16-bit, but weight's TeSA bits round to 8"),
    ({"wieght": "int8"}, "unknown weight 'wieght'; did you mean 'weight'"),
    ({"weight": "e4m3"}, "unknown number format 'e4m3'"),
    (["fp8_e4m3"], "formats must be a format name"),
])
def test_asked_formats_are_checked(formats, match):
    from sparta.passes.transform.bitround import choose_formats
    graph, cuda = _linear(), load_target("cuda")
    with pytest.raises(SpartaError, match=match):
        choose_formats(graph, transform(graph, cuda), cuda, formats)


# ---- selection sees the format -----------------------------------------------------------------------------------
def test_cuda_selection_runs_no_other_format_in_place_of_the_asked_one():
    from sparta.codegen.select_cuda import select_gemm
    cuda = load_target("cuda")
    fp8 = select_gemm(_site("W8A8", ("fp8_e4m3", "fp8_e4m3")), cuda)
    assert (fp8.kernel, fp8.rule) == ("torch", "not_a_format_we_run") and fp8.reason.startswith("fp8_e4m3 weights")
    int8 = select_gemm(_site("W8A8", ("int8", "int8")), cuda)
    assert int8.kernel == "bsr_linear" and int8.dtype == "int8"
    bf16 = select_gemm(_site("W16A16", ("bf16", "bf16")), cuda)          # bf16 asked in a float16 model
    assert bf16.rule == "not_a_format_we_run" and "bf16 weights" in bf16.reason
    assert select_gemm(_site("W16A16", ("bf16", "bf16"), "bfloat16"), cuda).rule == "bsr_tile"
    assert select_gemm(_site("W16A16", ("fp16", "fp16")), cuda).rule == "bsr_tile"
    assert select_gemm(_site("W16A16", None), cuda).rule == "bsr_tile", "a site without formats: as before"


def _site(bits, formats, act16="float16", m=4096, n=256, k=512):
    from types import SimpleNamespace

    from sparta.codegen.select_cuda import GemmSite
    from sparta.passes.transform.plan import OpPlan
    keep = (torch.rand(n // 32, k // 32, generator=torch.Generator().manual_seed(0)) < 0.3)
    weight = torch.where(keep.repeat_interleave(32, 0).repeat_interleave(32, 1), torch.randn(n, k), 0.0)
    return GemmSite(SimpleNamespace(op="linear"), OpPlan("op", "linear", "sparse", 1.0, 2.0), m, n, k, bits, False,
                    32, "vector", "none", False, weight, 0, "", False, act16, False, (formats,) if formats else ())
