"""``sparta.compile`` is a flat list of passes over one typed context (``sparta/pipeline.py``), and the facts passes
hand on about the graph are typed fields that a save keeps."""

import dataclasses

import pytest
import torch

import sparta
from sparta.graph import Simplified, TokenRange
from sparta.pipeline import PASSES, PASSES_BY_NAME, CompileContext, CompileOptions, run_passes


def _mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 32)).eval()
    keep = (torch.rand(3, 2) < 0.5).repeat_interleave(32, 0).repeat_interleave(32, 1)
    keep[:32, :32] = True
    return model, {"0.weight": keep}


def test_the_passes_in_order_each_for_its_targets():
    names = [p.name for p in PASSES]
    assert names[:3] == ["capture", "attach_tesa", "simplify"] and names[-2:] == ["measure", "verify"]
    assert names.index("propagate_and_plan") < names.index("select") < names.index("specialize")
    assert PASSES_BY_NAME["fuse_siblings"].targets == ("cuda",)
    assert all(set(p.targets) <= {"cpu", "cuda"} for p in PASSES)


def test_a_prefix_of_the_pipeline_runs_alone_and_hands_on_typed_fields():
    model, tesa = _mlp()
    options = CompileOptions("cpu", tesa, (torch.randn(4, 64),), dynamic=True)
    upto = [p for p in PASSES if p.name in ("capture", "attach_tesa", "simplify", "plan_tokens", "target",
                                            "propagate_and_plan")]
    ctx = run_passes(CompileContext(model, options), upto)
    assert ctx.plan is not None and ctx.compiled is None and ctx.target.name == "cpu"
    assert isinstance(ctx.graph.token_range, TokenRange) and ctx.graph.token_range.lo == 1
    assert isinstance(ctx.graph.simplified, Simplified) and ctx.graph.propagation is not None
    assert "capture" in ctx.timings and {"propagate", "plan_cache"} & set(ctx.timings)
    PASSES_BY_NAME["select"].run(ctx)              # one pass more, alone
    assert ctx.plan.ops["linear"].kernel.kernel == "cpu_linear"


def test_compile_times_its_passes_and_the_typed_facts_survive_a_save(tmp_path):
    model, tesa = _mlp()
    compiled = sparta.compile(model, tesa, (torch.randn(4, 64),), tokens=(2, 64))
    assert {"capture", "select", "codegen"} <= set(compiled.timings)
    assert dataclasses.astuple(compiled.graph.token_range) == (2, 64, 4)
    loaded = sparta.load(compiled.save(tmp_path / "m"))
    assert loaded.graph.token_range == compiled.graph.token_range
    assert loaded.graph.propagation.table() == compiled.graph.propagation.table()


def test_a_graph_copy_keeps_its_facts_unshared():
    model, tesa = _mlp()
    graph = sparta.compile(model, tesa, (torch.randn(4, 64),), dynamic=True).graph
    copy = graph.copy()
    assert copy.token_range == graph.token_range and copy.simplified == graph.simplified
    copy.simplified.dropped_masks.append("x")
    assert "x" not in graph.simplified.dropped_masks


@pytest.mark.parametrize("key", ["quantization", "simplified", "token_range", "propagation", "stacked_weights"])
def test_no_pass_hands_on_through_graph_meta(key):
    model, tesa = _mlp()
    compiled = sparta.compile(model, tesa, (torch.randn(4, 64),), dynamic=True)
    assert key not in compiled.graph.meta
