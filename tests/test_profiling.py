"""``compiled.profile()``: one forward timed op by op against the dense reference and the plan's estimates."""

import time

import pytest
import torch

import sparta
from models import ResidualMLP
from sparta.profiling import OpTime, Profile

pytest.importorskip("tvm", reason="compiles CPU kernels")


@pytest.fixture(scope="module")
def compiled():
    torch.manual_seed(0)
    grid = torch.rand(256 // 32, 128 // 32, generator=torch.Generator().manual_seed(1)) < 0.3
    grid[0, 0] = True
    mask = grid.repeat_interleave(32, 0).repeat_interleave(32, 1)
    return sparta.compile(ResidualMLP().eval(), {"up.weight": mask}, (torch.randn(2, 24, 128),), dynamic=False)


def test_every_op_is_timed_beside_its_dense_op_and_the_plans_estimate(compiled):
    prof = compiled.profile(torch.randn(2, 24, 128), reps=3)
    assert [o.op for o in prof.ops] == [op.name for op in compiled.graph.ops()]
    up = prof.op("linear")
    assert up.runs.startswith("cpu_linear[") and up.est_us == compiled.plan["linear"].est_us
    assert up.dense_est_us == compiled.plan["linear"].dense_us and up.measured_us > 0 and up.dense_us > 0
    gelu = prof.op("gelu")
    assert gelu.runs == "fused" and gelu.est_us is None and gelu.dense_us > 0, "the epilogue computes the GELU"
    assert prof.op("linear_1").runs == "torch", "the dense linear runs the torch op"
    assert prof.forward_us > 0 and prof.dense_forward_us > 0 and prof.inputs == [[2, 24, 128]]
    text = prof.report()
    assert "cpu_linear[" in text and "forward as called" in text
    assert prof.to_json()["ops"][0]["op"] == prof.ops[0].op


def test_the_times_are_the_ops_own(compiled, monkeypatch):
    """A kernel made 20 ms slower measures 20 ms slower, and is named slower than dense; the others are not."""
    module = compiled.module_replacements()["linear"]
    launch = module.launch

    def slow(inputs):
        time.sleep(0.02)
        return launch(inputs)

    monkeypatch.setattr(module, "launch", slow)
    prof = compiled.profile(reps=2)             # random inputs of the example's shapes
    assert prof.op("linear").measured_us > 2e4 > prof.op("linear_1").measured_us
    assert prof.slower_than_dense() == ["linear"] and "slower than dense: linear" in prof.report()


def test_a_profile_reads_as_a_table():
    prof = Profile("cpu", [[1, 4]], [OpTime("a", "linear", "cpu_linear[float32]", 10.0, 30.0, 12.0, 25.0),
                                     OpTime("b", "add", "torch", 1.0, 1.0),
                                     OpTime("c", "scaled_dot_product_attention", "attention[float32]", 2.0, 1.0)],
                   20.0, 40.0)
    assert prof.op("a").speedup == 3.0 and prof.slower_than_dense(0.2) == ["a"]
    assert prof.slower_than_dense() == [], "only GEMMs run_dense can take (attention has no dense plan to fall to)"
    lines = prof.report(top=1).splitlines()
    assert lines[2].startswith("a ") and not any(line.startswith("b ") for line in lines)
    with pytest.raises(sparta.SpartaError, match="reps"):
        sparta.profiling.profile(None, reps=0)


def test_the_prune_loop_example_runs_a_round(monkeypatch):
    import sys
    from pathlib import Path

    import transformers
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "examples"))
    sys.modules.pop("prune_loop", None)
    from prune_loop import prune_round
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(
        num_hidden_layers=1, hidden_size=128, intermediate_size=512, num_attention_heads=4, vocab_size=100,
        max_position_embeddings=64)).eval()
    ids = torch.randint(0, 100, (1, 32), generator=torch.Generator().manual_seed(0))
    row, compiled = prune_round(model, 0.8, ids, reps=2)
    assert row["max_abs_err"] < 1e-4 and row["forward_us"] > 0 and row["dense_forward_us"] > 0
    plans = compiled.plan.ops.values()
    assert row["sparse_ops"] == sum(p.kind == "sparse" for p in plans) > 0
    assert row["run_dense"] == sum(p.note.startswith("runs dense") for p in plans)


def test_a_cuda_model_is_profiled_on_its_gpu():
    model = ResidualMLP().eval()
    compiled = sparta.compile(model, {}, (torch.randn(2, 4, 128),), target="cuda", dynamic=False)
    with pytest.raises(sparta.SpartaError, match=r"compiled.to\('cuda'\) first"):
        compiled.profile()


def test_a_dynamic_models_estimates_are_read_at_the_calls_rows():
    """Planned over 1..48 tokens: a one-token call is held against the plan's one-token estimate, not the example's."""
    from types import SimpleNamespace

    from sparta.profiling import estimate_at
    plan = SimpleNamespace(gemm=(48, 256, 128), est_us=40.0, dense_us=80.0, rows_us=[[1, 2.0, 4.0], [4, 5.0, 10.0],
                                                                                     [16, 14.0, 30.0], [48, 40.0, 80.0]])
    assert estimate_at(plan, 4) == (5.0, 10.0) and estimate_at(plan, 10) == (9.5, 20.0)
    assert estimate_at(plan, 96) == (79.0, 155.0), "continued beyond the range from its last two points"
    grid = torch.rand(256 // 32, 128 // 32, generator=torch.Generator().manual_seed(1)) < 0.3
    grid[0, 0] = True
    mask = grid.repeat_interleave(32, 0).repeat_interleave(32, 1)
    compiled = sparta.compile(ResidualMLP().eval(), {"up.weight": mask}, (torch.randn(2, 24, 128),))
    up = compiled.plan["linear"]
    one = compiled.profile(torch.randn(1, 1, 128), reps=2).op("linear")
    assert one.rows == 1 and (one.est_us, one.dense_est_us) == estimate_at(up, 1) and one.est_us < up.est_us
    assert compiled.profile(torch.randn(2, 24, 128), reps=2).op("linear").est_us == pytest.approx(up.est_us)
