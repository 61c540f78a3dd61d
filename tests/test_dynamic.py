"""One compile for every batch and sequence length: ``compile(..., dynamic=True)`` on the CPU target."""

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import transformers

import sparta
from sparta.errors import CaptureError
from sparta.graph_json import GraphFormatError
from sparta.graph import SymRef

pytest.importorskip("tvm", reason="compiles CPU kernels")


def block_mask(n, k, density, seed, block=32):
    g = torch.Generator().manual_seed(seed)
    grid = torch.rand(n // block, k // block, generator=g) < density
    grid[0, 0] = True
    return grid.repeat_interleave(block, 0).repeat_interleave(block, 1)


def tiny_bert():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=128, intermediate_size=512, num_attention_heads=4,
                                  vocab_size=500, max_position_embeddings=64)
    model = transformers.BertModel(cfg).eval()
    tesa = {f"encoder.layer.{i}.{part}.weight": block_mask(*w.shape, 0.3, 10 * i + j)
            for i in range(2) for j, part in enumerate(("intermediate.dense", "output.dense"))
            for w in [dict(model.named_parameters())[f"encoder.layer.{i}.{part}.weight"]]}
    return model, tesa


@pytest.fixture(scope="module")
def dynamic_bert():
    model, tesa = tiny_bert()
    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(1))
    return model, sparta.compile(model, tesa, (ids,), dynamic=True)


def test_one_compile_answers_every_batch_and_sequence(dynamic_bert):
    model, compiled = dynamic_bert
    assert compiled.graph.meta["dynamic_dims"] and any(p.kind == "sparse" for p in compiled.plan.ops.values())
    specs = [s.spec for m in compiled.module_replacements().values() for s in getattr(m, "subs", [])]
    assert specs and all(s.m == 0 for s in specs), "every kernel takes any number of rows"
    reference = compiled.reference()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for batch in (1, 3, 8):
            for seq in (1, 17, 64):
                ids = torch.randint(0, 500, (batch, seq), generator=g)
                out = compiled(ids).last_hidden_state
                assert out.shape == (batch, seq, 128)
                torch.testing.assert_close(out, reference(ids)[0], rtol=1e-4, atol=1e-4)


def test_verify_checks_three_shapes_and_positions_stay_unpruned(dynamic_bert):
    """verify() runs the example's shape, one token and longer ones; the position table keeps rows the example's
    16 tokens never read (propagation may prune only what GEMMs read, in a dynamic graph)."""
    from sparta.sampling import verification_sizes
    model, compiled = dynamic_bert
    sizes = verification_sizes(compiled.graph, 2)
    assert len(sizes) >= 3 and sizes[0] is None and len({tuple(s.values()) for s in sizes[1:]}) >= 2
    compiled.verify(trials=3)
    assert compiled.tesa("embeddings.position_embeddings.weight").density == 1.0
    kept = compiled.graph.propagation.sequence_bound
    assert "embeddings.position_embeddings.weight" in kept or "embeddings.position_ids" in kept


def test_shapes_outside_the_captured_range_are_refused(dynamic_bert):
    model, compiled = dynamic_bert
    with pytest.raises(sparta.SpartaError, match="does not fit"):
        compiled(torch.randint(0, 500, (2, 65)))        # past max_position_embeddings
    with pytest.raises(sparta.SpartaError, match="does not fit"):
        compiled(torch.randint(0, 500, (2, 3, 4)))


def test_a_saved_dynamic_model_loads_and_runs_new_shapes(dynamic_bert, tmp_path):
    model, compiled = dynamic_bert
    loaded = sparta.load(compiled.save(tmp_path / "m"))
    assert loaded.graph.meta["dynamic_dims"] == compiled.graph.meta["dynamic_dims"]
    ids = torch.randint(0, 500, (5, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).last_hidden_state, compiled(ids).last_hidden_state)


def test_a_size_expression_is_data_not_code():
    """Saved size expressions are parsed by sympy: only dimension symbols, integers and the size functions pass."""
    from sparta.graph_json import decode, encode
    assert decode(encode(SymRef("FloorDiv(s70*s72, 2) + 1", 5))) == SymRef("FloorDiv(s70*s72, 2) + 1", 5)
    for bad in ("__import__('os').system('true')", "s1.__class__", "lambda: 1", "x" * 300, "eval(s1)"):
        with pytest.raises(GraphFormatError, match="not an expression"):
            decode({"$sym": [bad, 1]})


def test_a_dynamic_mlp_runs_its_sparse_linear_at_any_rows():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 160), torch.nn.GELU(), torch.nn.Linear(160, 96)).eval()
    x = torch.randn(4, 10, 96)
    compiled = sparta.compile(model, {"0.weight": block_mask(160, 96, 0.4, 3)}, (x,), dynamic=True, verify=True)
    assert compiled.graph.dynamic_dims_of(compiled.graph.inputs[0]) == {0: next(iter(
        compiled.graph.meta["dynamic_dims"])), 1: list(compiled.graph.meta["dynamic_dims"])[1]}
    with torch.no_grad():
        for shape in ((1, 1, 96), (3, 70, 96), (9, 5, 96)):
            x = torch.randn(shape)
            torch.testing.assert_close(compiled(x), compiled.reference()(x)[0], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(torch.compile(compiled, fullgraph=True, dynamic=True)(x), compiled(x),
                                       rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_dynamic_cuda_compile_builds_kernels_for_any_rows(tmp_path, dtype):
    """Compiled for CUDA here (no GPU): the linears, LayerNorms and quantisers take M as an argument (grids from M),
    16-bit block-sparse linears carry the few-row GEMV over the same blocks, a bf16 model gets bf16 kernels, and fake
    CUDA tensors of new shapes propagate (the ops' outputs follow the inputs' rows and dtype)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from sparta.templates.bsr_linear.runtime import SparseLinearCUDA
    from sparta.templates.norm.runtime import LayerNormCUDA
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1024),
                                torch.nn.LayerNorm(1024)).to(dtype).eval()
    compiled = sparta.compile(model, {"0.weight": block_mask(2048, 1024, 0.1, 1),
                                      "2.weight": block_mask(1024, 2048, 0.1, 2)},
                              (torch.randn(4, 64, 1024).to(dtype),), target="cuda", dynamic=True)
    linears = [m for m in compiled.module.modules() if isinstance(m, SparseLinearCUDA)]
    norms = [m for m in compiled.module.modules() if isinstance(m, LayerNormCUDA)]
    assert len(linears) == 2 and len(norms) == 1 and norms[0].spec.dtype == str(dtype)[6:]
    for module in linears + norms:
        launch = json.loads((Path(module.folder) / "launch.json").read_text())
        assert module.spec.m == 0 and launch["grid"][0][0] == "M" and launch["args"][-1] == \
            {"name": "M", "dtype": "int32", "scalar": True}
    for module in linears:
        assert module.gemv is not None and module.gemv[1].rows == 4 and module.gemv[1].bn == module.spec.bn
        assert module.spec.dtype == module.gemv[1].dtype == str(dtype)[6:] and module.wp.dtype == dtype
        assert json.loads((Path(module.gemv[0]) / "launch.json").read_text())["args"][-1]["name"] == "M"
        tops = [top for top, _, _ in module.buckets]
        assert tops == [128, 1024] and [b.tm for _, _, b in module.buckets] == [32, 64] and module.spec.tm == 128
        assert all(b.m == 0 and (b.bn, b.bk, b.dtype) == (module.spec.bn, module.spec.bk, module.spec.dtype)
                   for _, _, b in module.buckets)
    assert all("up to 4 rows run the GEMV" in row["note"] for row in compiled.kernels if row["template"] == "bsr_linear")
    assert "M<=4: bsr_gemv[" in compiled.plan_report(), "the plan report shows the kernel per bucket of rows"
    assert re.search(r"M<=128: tm 32 ~[0-9.]+ µs \(dense [0-9.]+ µs\); M<=1024: tm 64 ~[0-9.]+ µs \(dense [0-9.]+ µs\); "
                     r"else bsr_linear\[", compiled.plan_report()), "each bucket's kernel with its estimate"
    for shape in ((1, 1, 1024), (3, 17, 1024), (8, 128, 1024)):
        with FakeTensorMode():
            state = {k: torch.empty(v.shape, dtype=v.dtype, device="cuda")
                     for k, v in [*compiled.module.named_parameters(), *compiled.module.named_buffers()]}
            (out,) = torch.func.functional_call(compiled.module, state, (torch.empty(shape, device="cuda").to(dtype),))
            assert out.device.type == "cuda" and out.shape == shape and out.dtype == dtype
    compiled.save(tmp_path / "saved")
    loaded = sparta.load(tmp_path / "saved")
    assert [(m.gemv[1], [(t, b) for t, _, b in m.buckets]) for m in loaded.module.modules()
            if isinstance(m, SparseLinearCUDA)] == [(m.gemv[1], [(t, b) for t, _, b in m.buckets]) for m in linears]


def test_dynamic_is_refused_where_it_cannot_hold(tmp_path):
    model = torch.nn.Linear(64, 64).eval()
    if shutil.which("python"):
        onnx_path = tmp_path / "m.onnx"
        torch.onnx.export(model, (torch.randn(4, 64),), str(onnx_path), dynamo=False)
        with pytest.raises(CaptureError, match="ONNX"):
            sparta.compile(str(onnx_path), {}, (torch.randn(4, 64),), dynamic=True)
    assert SymRef("s0*s1", 6).hint == 6


def test_dynamic_shapes_pick_which_dimensions_stay_free():
    """A dict of torch.export dynamic_shapes frees only the dimensions it names: here the batch."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU()).eval()
    x = torch.randn(4, 8, 64)
    compiled = sparta.compile(model, {"0.weight": block_mask(96, 64, 0.5, 4)}, (x,),
                              dynamic={"input": {0: torch.export.Dim.AUTO}})
    assert list(compiled.graph.dynamic_dims_of(compiled.graph.inputs[0])) == [0]
    with torch.no_grad():
        y = torch.randn(7, 8, 64)
        torch.testing.assert_close(compiled(y), compiled.reference()(y)[0], rtol=1e-4, atol=1e-4)
    with pytest.raises(sparta.SpartaError, match="does not fit"):
        compiled(torch.randn(4, 9, 64))
    with pytest.raises(sparta.SpartaError, match="dynamic must be"):
        sparta.compile(model, {}, (x,), dynamic="yes")


def test_by_default_one_compile_takes_any_rows_and_dynamic_false_specialises():
    """The default frees the batch and sequence dimensions; the plan report's last line says so and names the token
    range; a dimension of size 1 in the example stays 1 (torch.export's 0/1 rule), with a warning saying how to free
    it; ``dynamic=False`` gives a model of the example's shape that refuses others."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 256).eval()
    mask = {"weight": block_mask(256, 256, 0.3, 5)}
    any_rows = sparta.compile(lin, mask, (torch.randn(64, 256),))
    ref = any_rows.reference()
    with torch.no_grad():
        for m in (1, 7, 128):
            x = torch.randn(m, 256)
            torch.testing.assert_close(any_rows(x), ref(x)[0], rtol=1e-4, atol=1e-4)
    assert any_rows.shapes_line() == "shapes: any size of input[0]; planned over 1-64 tokens (the example's: 64)"
    assert any_rows.shapes_line() in any_rows.plan_report().splitlines()
    with pytest.warns(UserWarning, match=r"input\[0\] fixed at the example's size 1"):
        one = sparta.compile(lin, mask, (torch.randn(1, 5, 256),))
    assert one.graph.any_rows and one(torch.randn(1, 9, 256)).shape == (1, 9, 256)
    assert "trace with 2 or more" in one.shapes_line()
    with pytest.raises(sparta.SpartaError, match="does not fit"):
        one(torch.randn(3, 5, 256))
    fixed = sparta.compile(lin, mask, (torch.randn(64, 256),), dynamic=False)
    assert "the example's only" in fixed.shapes_line()
    with pytest.raises(sparta.SpartaError, match="does not fit the compiled"):
        fixed(torch.randn(1, 256))


def test_a_model_export_cannot_free_is_compiled_for_its_example_with_a_warning(monkeypatch):
    """Where torch.export cannot capture free dimensions, the default falls back to the example's shapes, warns and
    puts the reason in the plan report; ``dynamic=True`` makes it an error."""
    real = torch.export.export

    def no_dynamic(*args, dynamic_shapes=None, **kwargs):
        if dynamic_shapes is not None:
            raise RuntimeError("a guard on the batch size")
        return real(*args, **kwargs)
    monkeypatch.setattr(torch.export, "export", no_dynamic)
    lin = torch.nn.Linear(64, 64).eval()
    with pytest.warns(UserWarning, match="example's shapes only"):
        compiled = sparta.compile(lin, {}, (torch.randn(4, 64),))
    assert not compiled.graph.any_rows and "a guard on the batch size" in compiled.shapes_line()
    assert compiled.shapes_line() in compiled.plan_report().splitlines()
    with pytest.raises(CaptureError, match="a guard on the batch size"):
        sparta.compile(lin, {}, (torch.randn(4, 64),), dynamic=True)


def test_the_plan_is_costed_over_the_token_range():
    """Each GEMM is costed at its rows scaled across ``tokens`` (powers of 4 between the ends); ``tokens`` is checked
    and only for models of free dimensions."""
    from sparta.passes.transform import row_points
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)).eval()
    tesa = {"0.weight": block_mask(512, 256, 0.2, 6), "2.weight": block_mask(256, 512, 0.2, 7)}
    x = torch.randn(4, 64, 256)
    compiled = sparta.compile(model, tesa, (x,), tokens=(2, 1000), target="cuda")
    assert dataclasses.astuple(compiled.graph.token_range) == (2, 1000, 256)
    assert row_points(compiled.graph, 256) == [256, 2, 4, 16, 64, 256, 1000]
    assert row_points(compiled.graph, 8) == [8, 1, 2, 8, 31]          # an op over fewer rows (a pooler's batch)
    p = compiled.plan.ops["linear"]
    assert [r for r, _, _ in p.rows_us] == [2, 4, 16, 64, 256, 1000] and all(e > 0 and d > 0 for _, e, d in p.rows_us)
    assert "M=2: " in compiled.plan_report() and "M=1000: " in compiled.plan_report()
    assert "planned over 2-1000 tokens" in compiled.plan_report()
    for bad in ((0, 10), (10, 2), (1.5, 8), 8):
        with pytest.raises(sparta.SpartaError, match="tokens must be"):
            sparta.compile(model, tesa, (x,), tokens=bad, target="cuda", propagate=False)
    with pytest.raises(sparta.SpartaError, match="captured for one shape"):
        sparta.compile(model, tesa, (x,), tokens=(1, 8), dynamic=False)
