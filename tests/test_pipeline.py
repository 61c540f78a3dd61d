"""``sparta.compile`` is a flat list of passes over one typed context (``sparta/pipeline.py``), and the facts passes
hand on about the graph are typed fields that a save keeps."""

import ast
import dataclasses
import json
from pathlib import Path

import pytest
import torch

import sparta
from sparta.graph import Simplified, TokenRange
from sparta.graph_json import graph_from_json, graph_to_json
from sparta.pipeline import CODEGEN, PASSES, PASSES_BY_NAME, CompileContext, CompileOptions, run_pass, run_passes


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
    run_pass(ctx, "specialize")                    # by name, timed under its key
    assert ctx.replacements and ctx.kernels and "codegen" in ctx.timings


def test_each_pass_is_timed_under_its_name_where_it_runs():
    model, tesa = _mlp()
    compiled = sparta.compile(model, tesa, (torch.randn(4, 64),))
    ran = {p.key for p in PASSES if p.key and p.applies(CompileOptions("cpu"))}
    assert ran <= set(compiled.timings) and "fuse_siblings" not in compiled.timings
    assert not {"measure", "verify", "dismantle", "propagate_and_plan"} & set(compiled.timings)
    assert {"propagate", "plan_cache"} & set(compiled.timings)


def test_passes_run_under_their_options_and_targets():
    options = CompileOptions("cpu", measure=True, dismantle="tile")
    assert PASSES_BY_NAME["measure"].applies(options) and PASSES_BY_NAME["dismantle"].applies(options)
    assert not PASSES_BY_NAME["verify"].applies(options) and not PASSES_BY_NAME["fuse_siblings"].applies(options)
    assert PASSES_BY_NAME["fuse_siblings"].applies(CompileOptions("cuda"))
    assert set(CODEGEN) == {"cpu", "cuda"} and CODEGEN["cuda"][1].endswith(":specialize_cuda")


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


def test_a_saved_graph_with_the_old_meta_keys_loads_them_into_the_typed_fields():
    model, tesa = _mlp()
    graph = sparta.compile(model, tesa, (torch.randn(4, 64),), tokens=(2, 64)).graph
    graph.stacked_weights = {"0.weight": [["a.weight", 0, 32], ["b.weight", 32, 64]]}
    data, tensors = graph_to_json(graph)
    data = json.loads(json.dumps(data))            # the saved form: the facts under the same meta keys as before
    assert {"token_range", "stacked_weights", "propagation"} <= set(data["meta"])
    loaded = graph_from_json(data, tensors)
    assert loaded.token_range == TokenRange(2, 64, 4) and loaded.stacked_weights == graph.stacked_weights
    assert loaded.propagation.table() == graph.propagation.table()
    assert not {"token_range", "stacked_weights", "propagation"} & set(loaded.meta)


def test_passes_quant_imports_nothing_of_passes_transform():
    """The shared pieces (GEMM views, fusion, WeightQuant) live where quant and transform both import them one way."""
    root = Path(sparta.__file__).resolve().parent.parent / "passes" / "quant"
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = ["." * node.level + (node.module or "")]
            for module in names:
                assert "transform" not in module.split("."), f"{path.name} imports {module}"
