"""``sparta.compile(..., target="cuda")`` on a machine without a GPU: sparse linears are cross-compiled (tests of
one-M kernels compile with ``dynamic=False``; models of any rows: test_dynamic.py)."""

import json
import shutil
from pathlib import Path

import pytest
import torch

import sparta
from sparta.target import load_target
from sparta.compiled_model import reference_weight
from sparta.runtime.cuda import CudaRuntimeError

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


def _plan_scale(compiled, op):
    """The per-channel int8 scales the plan holds for ``op``'s weight (as the kernel applies them)."""
    from sparta.passes.transform import weight_matrix
    p = compiled.plan.ops[op]
    w = weight_matrix(compiled.graph, compiled.graph.op(op))
    return p.weight_quant[8].params(torch.where(p.kept(*w.shape), w, 0.0)).scale[:, 0]


def _mlp_and_mask(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1024))
    grid = torch.rand(2048 // 32, 1024 // 32) < 0.1
    return model, grid.repeat_interleave(32, 0).repeat_interleave(32, 1)


def test_cuda_compile_builds_cubins_without_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    model, mask = _mlp_and_mask()
    compiled = sparta.compile(model, {"0.weight": mask}, (torch.randn(16, 256, 1024),), target="cuda")
    rows = [k for k in compiled.kernels if k["template"] == "bsr_linear"]
    assert len(rows) == 1 and rows[0]["op"] == "linear"
    assert rows[0]["blocks"] == f"{int(mask[::32, ::32].sum())}x32x32"
    folder = Path(rows[0]["artifact"])
    launch = json.loads((folder / "launch.json").read_text())
    assert sorted(launch["cubins"]) == ["sm_80", "sm_90"]
    assert "relu" in launch["name"], "the ReLU after the linear is fused into the kernel"
    assert "bsr_linear" in compiled.kernel_report()
    with pytest.raises(CudaRuntimeError, match="compiled for CUDA"):
        compiled(torch.randn(16, 256, 1024))


def test_ops_the_template_cannot_take_stay_torch_ops(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(1020, 2048))          # K = 1020: not a multiple of 8
    grid = torch.rand(2048 // 32, -(-1020 // 32)) < 0.1
    mask = grid.repeat_interleave(32, 0).repeat_interleave(32, 1)[:, :1020]
    compiled = sparta.compile(model, {"0.weight": mask}, (torch.randn(16, 256, 1020),), target="cuda")
    assert all(k["template"] == "torch" for k in compiled.kernels)
    assert any("multiple of 8" in k["key"] for k in compiled.kernels)
    out = compiled(x := torch.randn(16, 256, 1020))
    torch.testing.assert_close(out, torch.nn.functional.linear(x, model[0].weight * mask, model[0].bias),
                               rtol=1e-4, atol=1e-4)


def test_exact_gelu_after_a_sparse_linear_is_fused(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    model, mask = _mlp_and_mask(2)
    model = torch.nn.Sequential(model[0], torch.nn.GELU())
    compiled = sparta.compile(model, {"0.weight": mask}, (torch.randn(4096, 1024),), target="cuda")
    row = next(k for k in compiled.kernels if k["template"] == "bsr_linear")
    assert json.loads((Path(row["artifact"]) / "launch.json").read_text())["name"].endswith("_gelu_bias")
    assert type(compiled.module_replacements()["gelu"]).__name__ == "Passthrough"


def test_calibrated_int8_bits_build_w8a8_kernels_that_save_and_reload(tmp_path, monkeypatch):
    """Calibration on the CUDA target lowers weights and inputs to W8A8; compile builds int8 kernels
    (with the calibrated per-channel scales and a per-token quantiser) and the model saves with them."""
    from sparta.passes.quant import fake_quantized_weights
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path / "cache"))
    model, mask = _mlp_and_mask()
    x = torch.randn(2, 64, 1024)
    batches = [(torch.randn(2, 64, 1024),) for _ in range(2)]
    compiled = sparta.compile(model, {"0.weight": mask}, (x,), target="cuda", calibration=batches,
                              quant_tolerance={"tolerance": 1e-2, "activations": True, "progress": False})
    rows = {k["op"]: k for k in compiled.kernels}
    assert {r["bits"] for r in rows.values()} == {"W8A8"}, compiled.kernel_report()
    src = (Path(rows["linear"]["artifact"]) / "kernel.cu").read_text()
    assert "m16n8k32.row.col.s32.s8.s8.s32" in src
    module = compiled.module_replacements()["linear"]
    fitted = _plan_scale(compiled, "linear")
    assert torch.equal(module.weight_scale, fitted.float()) and module.quant_folder
    expected = fake_quantized_weights(compiled.graph)["0.weight"]
    torch.testing.assert_close(reference_weight(module).float(), expected.half().float(), rtol=0, atol=2e-3)
    # the dense W8A8 op also carries a Hopper wgmma kernel over the same packed blocks
    dense = compiled.module_replacements()["linear_1"]
    folder, spec = dense.hopper
    assert spec.mma == "wgmma" and (spec.bn, spec.bk) == (dense.spec.bn, dense.spec.bk) and dense.spec.mma == "sync"
    assert sorted(json.loads((Path(folder) / "launch.json").read_text())["cubins"]) == ["sm_90a"]
    assert "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8" in (Path(folder) / "kernel.cu").read_text()
    assert "wgmma" in rows["linear_1"]["note"] and module.hopper is None
    loaded = sparta.load(compiled.save(tmp_path / "w8a8"))
    again = loaded.module_replacements()["linear"]
    assert torch.equal(again.wp, module.wp) and torch.equal(again.weight_scale, module.weight_scale)
    assert again.quant_folder and (Path(again.quant_folder) / "launch.json").is_file()
    # the reference weight comes back from the packed codes and scales, bit for bit, and is not stored twice
    assert torch.equal(reference_weight(again), reference_weight(module))
    from safetensors import safe_open
    with safe_open(str(tmp_path / "w8a8" / "tensors.safetensors"), "pt") as f:
        assert not any(k.endswith("reference_weight") for k in f.keys())
    dense_again = loaded.module_replacements()["linear_1"]
    assert dense_again.hopper[1] == spec and (Path(dense_again.hopper[0]) / "kernel.sm_90a.cubin").is_file()


@pytest.mark.parametrize("symmetric", [True, False])
def test_calibrated_4bit_weights_build_w4a16_kernels_that_save_and_reload(tmp_path, monkeypatch, symmetric):
    """An fp16 model on 16 tokens (decode-like: the weights' bytes decide), weights calibrated to 4 bits:
    the sparse op gets a W4A16 block kernel (the fitted group scales and zero points packed into int4
    block records), the dense one the W4A16 GEMV with the same scales and bias fused."""
    from sparta.passes.quant import fake_quantized_weights
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path / "cache"))
    model, mask = _mlp_and_mask(1)
    model = model.half()
    batches = [(torch.randn(2, 8, 1024).half(),) for _ in range(2)]
    compiled = sparta.compile(model, {"0.weight": mask}, batches[0], target="cuda", dynamic=False, calibration=batches,
                              quant_tolerance={"tolerance": 1.0, "widths": (4,), "symmetric": symmetric,
                                               "group_size": 64, "progress": False})
    rows = {k["op"]: k for k in compiled.kernels}
    assert {r["bits"] for r in rows.values()} == {"W4A16"}, compiled.kernel_report()
    assert not any("plan asked for" in r.get("note", "") for r in rows.values()), compiled.kernel_report()
    mods = compiled.module_replacements()
    assert mods["linear"].spec.dtype == "w4a16" and mods["linear"].spec.zero == (not symmetric)
    side = compiled.plan["linear"].subops[0].block or (32, 32)      # a block cover, or every 32x32 block (dense tile)
    assert (mods["linear"].spec.bn, mods["linear"].spec.bk) == side
    assert rows["linear_1"]["template"] == "w4a16_gemv" and type(mods["linear_1"]).__name__ == "W4A16GemvCUDA"
    assert (mods["linear_1"].spec.group, mods["linear_1"].spec.sym, mods["linear_1"].spec.bias) == (64, symmetric, True)
    # 16 rows, K = 2N: two CTAs split K; the workspace is allocated, not saved
    assert mods["linear_1"].spec.ksplit == 2 and not mods["linear_1"].split_C.any()
    assert not any(k.startswith("split_") for k in mods["linear_1"].state_dict())
    for op in ("linear", "linear_1"):
        assert "lop3.b32" in (Path(rows[op]["artifact"]) / "kernel.cu").read_text()
    expected = fake_quantized_weights(compiled.graph)
    for op, weight in (("linear", "0.weight"), ("linear_1", "2.weight")):
        got, want = reference_weight(mods[op]).float(), expected[weight].float()
        assert got.shape == want.shape
        # fp16 scales: each weight within one fp16 rounding of the scale (x 7.5 steps) of the fp32 one
        assert (got - want).abs().max() <= 8 * want.abs().max() * 2 ** -10
        assert torch.equal(got == 0, want == 0)         # pruned elements stay exactly zero
    loaded = sparta.load(compiled.save(tmp_path / "w4"))
    for op in ("linear", "linear_1"):
        again = loaded.module_replacements()[op]
        assert again.spec == mods[op].spec and torch.equal(again.dense_weight(), mods[op].dense_weight())


def test_4bit_scales_the_kernel_cannot_hold_fall_back_to_fp16_with_a_note(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path / "cache"))
    model, mask = _mlp_and_mask(2)
    model = model.half()
    batches = [(torch.randn(2, 8, 1024).half(),) for _ in range(2)]
    compiled = sparta.compile(model, {"0.weight": mask}, batches[0], target="cuda", calibration=batches,
                              quant_tolerance={"tolerance": 1.0, "widths": (4,), "group_size": 16, "progress": False})
    row = next(k for k in compiled.kernels if k["op"] == "linear")
    assert row["bits"] == "W16A16" and "multiple of 32 columns" in row["note"]


def test_dense_4bit_ops_where_the_int4_gemm_is_slower_stay_cublas(tmp_path, monkeypatch):
    """At 64 rows the W4A16 dense GEMM measured 2x slower than cuBLAS fp16: compiled for those rows alone, the dense
    op stays a torch op (on the dequantised weights) and says why; the sparse op still gets its W4A16 kernel. Compiled
    for any rows (the default) it keeps its 4-bit weight: the GEMVs up to 16 rows, the tile above, the plan saying
    where the tile is the slower one."""
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path / "cache"))
    model, mask = _mlp_and_mask(3)
    model = model.half()
    batches = [(torch.randn(2, 32, 1024).half(),) for _ in range(2)]
    quant = {"tolerance": 1.0, "widths": (4,), "progress": False}
    compiled = sparta.compile(model, {"0.weight": mask}, batches[0], target="cuda", calibration=batches,
                              quant_tolerance=quant, dynamic=False)
    rows = {k["op"]: k for k in compiled.kernels}
    assert rows["linear_1"]["template"] == "torch" and "slower than cuBLAS" in rows["linear_1"]["key"]
    assert rows["linear"]["bits"] == "W4A16"
    any_rows = sparta.compile(model, {"0.weight": mask}, batches[0], target="cuda", calibration=batches,
                              quant_tolerance=quant)
    dense = any_rows.plan["linear_1"].kernel
    assert [(top, family) for top, family, _ in dense.few_rows] == [(8, "w4a16_gemv"), (12, "w4a16_gemv"), (16, "w4a16_gemv")]
    assert dense.kernel == "bsr_linear" and "slower than cuBLAS fp16 there" in dense.note
    assert dense.kernel_at(1).startswith("w4a16_gemv") and dense.kernel_at(64).startswith("bsr_linear")
    report = any_rows.plan_report()
    assert "M<=8: w4a16_gemv[16 warps] ~" in report and "else bsr_linear[w4a16 64x128x128] +bias ~" in report


@pytest.mark.parametrize("residual", [True, False])
def test_a_layer_norm_feeding_w8a8_linears_emits_their_int8_codes(tmp_path, monkeypatch, residual):
    """The LayerNorm becomes sparta's kernel, which quantises its output per token for the W8A8 linear
    reading it (fp16 as well when the residual reads it); the plan, the graph module and a save keep it."""
    from models import NormBlock
    from sparta.templates.norm.runtime import LayerNormCUDA
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    model = NormBlock(256, 512, residual=residual).eval()
    with torch.no_grad():
        model.ln.weight.uniform_(0.5, 1.5)
        model.ln.bias.uniform_(-0.5, 0.5)
    batches = [(torch.randn(2, 24, 256),) for _ in range(2)]
    mask = (torch.rand(512 // 32, 256 // 32) < 0.3).repeat_interleave(32, 0).repeat_interleave(32, 1)
    compiled = sparta.compile(model, {"fc1.weight": mask}, batches[0], target="cuda", calibration=batches,
                              quant_tolerance={"tolerance": 1e-2, "activations": True, "progress": False})
    mods = compiled.module_replacements()
    norm, fc1 = mods["layer_norm"], mods["linear"]
    assert isinstance(norm, LayerNormCUDA) and fc1.spec.dtype == "int8", compiled.kernel_report()
    assert norm.spec.out == ("both" if residual else "int8") and norm.spec.eps == 1e-5
    assert fc1.input_names == ["layer_norm:int8", "layer_norm:scale"] and fc1.quant_folder is None
    assert norm.output_names == (["layer_norm"] if residual else []) + fc1.input_names
    torch.testing.assert_close(norm.weight.float(), model.ln.weight.detach(), rtol=1e-3, atol=1e-3)
    row = next(r for r in compiled.kernels if r["op"] == "layer_norm")
    assert row["template"] == "norm" and "linear" in row["note"]
    src = (Path(row["artifact"]) / "kernel.cu").read_text()
    assert "shfl_sync" in src and ("Y_ptr" in src) == residual
    code = compiled.module.code      # the module's tuple output feeds the linear's two inputs
    assert "kernel_layer_norm" in code and "getitem" in code
    loaded = sparta.load(compiled.save(tmp_path / "saved"))
    again = loaded.module_replacements()
    assert again["layer_norm"].spec == norm.spec and again["layer_norm"].output_names == norm.output_names
    assert again["linear"].input_names == fc1.input_names and again["linear"].out_dtype == torch.float32


def test_stream_tiles_take_ops_whose_block_rows_keep_few_blocks():
    from sparta.templates.bsr_linear.select import stream_tiles
    cuda = load_target("cuda")
    stream = cuda.tiles("stream")
    few = torch.zeros(48, 12, dtype=torch.bool)
    few[torch.arange(48), torch.arange(48) % 12] = True                 # one block per row
    assert stream_tiles(4096, few, cuda)["groups"] == round(stream["ctas_per_sm"] * cuda.sms / 64)
    assert stream_tiles(128, few, cuda)["groups"] == 48, "no more groups than block rows"
    many = torch.rand(48, 12) < 0.5
    many[:, : stream["max_row_blocks"] + 1] = True
    assert stream_tiles(4096, many, cuda) is None
    assert stream_tiles(4096, torch.ones(48, 2, dtype=torch.bool), cuda) is None, "dense ops keep the one-tile grid"


def test_a_linear_with_few_blocks_per_row_compiles_to_the_streaming_grid(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.ReLU())
    grid = torch.rand(2048 // 64, 256 // 64) < 0.3
    mask = grid.repeat_interleave(64, 0).repeat_interleave(64, 1)
    compiled = sparta.compile(model, {"0.weight": mask}, (torch.randn(1000, 256),), target="cuda", dynamic=False)
    row = next(k for k in compiled.kernels if k["template"] == "bsr_linear")
    assert row["blocks"] == f"{int(grid.sum())}x64x64" and "streaming grid of 32 groups" in row["dismantle"]
    launch = json.loads((Path(row["artifact"]) / "launch.json").read_text())
    assert launch["grid"][:2] == [16, 32] and "relu" in launch["name"]
    compiled.save(tmp_path / "saved")
    loaded = sparta.load(tmp_path / "saved").kernels[0]
    assert loaded["dismantle"] == row["dismantle"] and loaded["key"] == row["key"]


def test_decode_sized_4bit_linear_folds_group128_scales_into_the_fp32_sum(tmp_path, monkeypatch):
    """Up to 8 rows with calibration's groups of 128, the W4A16 GEMV applies the scale once per chunk
    (measured faster at batch 1); the reference weight is still the dequantised one the kernel applies."""
    from sparta.templates.w4a16_gemv.spec import dequantize
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path / "cache"))
    model, mask = _mlp_and_mask(3)
    model = model.half()
    batches = [(torch.randn(1, 4, 1024).half(),) for _ in range(2)]
    compiled = sparta.compile(model, {"0.weight": mask}, batches[0], target="cuda", dynamic=False, calibration=batches,
                              quant_tolerance={"tolerance": 1.0, "widths": (4,), "progress": False})
    gemv = compiled.module_replacements()["linear_1"]
    assert type(gemv).__name__ == "W4A16GemvCUDA" and gemv.spec.fold and gemv.spec.group == 128
    src = (Path(gemv.folder) / "kernel.cu").read_text()
    assert "lop3.b32" in src and "mul.f16x2" not in src
    torch.testing.assert_close(reference_weight(gemv), dequantize(gemv.wq, gemv.scale, None, gemv.spec).half(),
                               rtol=0, atol=0)


def test_fp16_layer_norms_run_sparta_kernel_with_the_residual_add_fused(tmp_path, monkeypatch):
    """In an fp16 model every LayerNorm becomes sparta's kernel; one whose input is a residual add read by
    nothing else normalises the add's two inputs itself and the add runs nothing; a save keeps both."""
    from models import PostLNBlock
    from sparta.backend.fx import Fused
    from sparta.templates.norm.runtime import LayerNormCUDA
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    model = PostLNBlock(256).half().eval()
    mask = (torch.rand(256 // 32, 256 // 32) < 0.3).repeat_interleave(32, 0).repeat_interleave(32, 1)
    compiled = sparta.compile(model, {"fc.weight": mask}, (torch.randn(3, 7, 256).half(),), target="cuda")
    mods = compiled.module_replacements()
    first, second = mods["layer_norm"], mods["layer_norm_1"]
    assert isinstance(first, LayerNormCUDA) and isinstance(second, LayerNormCUDA), compiled.kernel_report()
    assert first.spec.residual and first.input_names == ["linear", "x"] and first.spec.out == "fp16"
    assert not second.spec.residual and second.input_names == ["layer_norm"] and second.spec.m == 0   # any rows
    add = next(o.name for o in compiled.graph.ops() if o.op == "add")
    assert isinstance(mods[add], Fused) and mods[add].into == "layer_norm"
    row = next(r for r in compiled.kernels if r["op"] == "layer_norm")
    assert f"({add} fused)" in row["note"] and row["bits"] == "A16->A16"
    src = (Path(row["artifact"]) / "kernel.cu").read_text()
    assert "R_ptr" in src and "shfl_sync" in src
    code = compiled.module.code
    assert "kernel_layer_norm(linear, x)" in code.replace("kernel_layer_norm = self.kernel_layer_norm", "")
    groups = [g for g in compiled.plan.fusions if g.kind == "norm"]        # the plan says so, and its report
    assert [(g.anchor, g.ops, g.out) for g in groups] == [("layer_norm", [add], "fp16"), ("layer_norm_1", [], "fp16")]
    assert compiled.plan.ops["layer_norm"].kernel.describe() == "norm[float16]"
    assert f"fusion (norm): layer_norm adds the residual ({add})" in compiled.plan_report()
    loaded = sparta.load(compiled.save(tmp_path / "saved"))
    again = loaded.module_replacements()
    assert again["layer_norm"].spec == first.spec and again["layer_norm"].input_names == first.input_names
    assert isinstance(again[add], Fused) and loaded.plan.fusions == compiled.plan.fusions


def test_fp32_layer_norms_stay_torch_ops(tmp_path, monkeypatch):
    from models import PostLNBlock
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path / "cache"))
    model = PostLNBlock(256).eval()
    mask = (torch.rand(256 // 32, 256 // 32) < 0.3).repeat_interleave(32, 0).repeat_interleave(32, 1)
    compiled = sparta.compile(model, {"fc.weight": mask}, (torch.randn(3, 7, 256),), target="cuda")
    assert not {"layer_norm", "layer_norm_1", "add"} & set(compiled.module_replacements())
    assert not [g for g in compiled.plan.fusions if g.kind == "norm"] and compiled.plan.ops["layer_norm"].kernel is None


def test_a_linear_whose_output_has_a_static_scale_writes_int8_codes(tmp_path, monkeypatch):
    """Calibration gives the GELU output between two W8A8 linears one static scale: the first linear is rebuilt
    with the requantising epilogue (out="int8", GELU fused), the GELU op runs nothing, the second reads the
    codes and the scale without a quantiser; the graph module, the report and a save keep it."""
    from sparta.backend.fx import Fused
    from sparta.templates.norm.runtime import quantized_names
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path / "cache"))
    model, mask = _mlp_and_mask(3)
    model = torch.nn.Sequential(model[0], torch.nn.GELU(), model[2]).eval()
    batches = [(torch.randn(2, 64, 1024),) for _ in range(2)]
    quant = {"tolerance": 1e-2, "activations": True, "progress": False}
    compiled = sparta.compile(model, {"0.weight": mask}, batches[0], target="cuda", dynamic=False, calibration=batches,
                              quant_tolerance=quant)
    scale = compiled.plan.static_scales["gelu"]
    mods = compiled.module_replacements()
    fc1, fc2 = mods["linear"], mods["linear_1"]
    assert fc1.spec.out == "int8" and fc1.spec.act == "gelu" and fc1.output_names == quantized_names("gelu")
    assert fc1.out_scale == scale and torch.equal(fc1.code_scale, torch.full((128,), scale, dtype=torch.float32))
    assert isinstance(mods["gelu"], Fused) and mods["gelu"].into == "linear"
    assert fc2.input_names == quantized_names("gelu") and fc2.quant_folder is None and fc2.spec.out == "float16"
    row = next(k for k in compiled.kernels if k["op"] == "linear")
    assert "writes int8 codes of gelu" in row["note"] and row["artifact"] == fc1.folder
    launch = json.loads((Path(fc1.folder) / "launch.json").read_text())
    assert {a["name"]: a["dtype"] for a in launch["args"]}["Y"] == "int8"
    assert "kernel_linear" in compiled.module.code and "gelu" not in compiled.module.code   # no call: fused
    codes = [g for g in compiled.plan.fusions if g.kind == "codes"]
    assert [(g.anchor, g.tensor, g.readers, g.scale) for g in codes] == [("linear", "gelu", ["linear_1"], scale)]
    assert "fusion (codes): linear writes int8 codes of gelu at static scale" in compiled.plan_report()
    loaded = sparta.load(compiled.save(tmp_path / "saved"))
    again = loaded.module_replacements()
    assert again["linear"].spec == fc1.spec and again["linear"].output_names == fc1.output_names
    assert again["linear"].out_scale == scale and isinstance(again["gelu"], Fused)
    assert again["linear_1"].input_names == fc2.input_names
    per_token = sparta.compile(model, {"0.weight": mask}, batches[0], target="cuda", dynamic=False, calibration=batches,
                               quant_tolerance={**quant, "static_activations": False})
    assert per_token.module_replacements()["linear"].output_names is None
    assert per_token.module_replacements()["linear_1"].quant_folder


def test_int8_codes_of_a_dense_gemm_with_many_tiles_per_sm_come_from_the_ping_pong_kernel():
    from sparta.passes.transform.plan import KernelChoice
    from sparta.templates.bsr_linear.build import int8_codes_spec
    from sparta.templates.bsr_linear.select import codes_tiles, int8_dense_tiles
    from sparta.templates.bsr_linear.spec import BsrSpec
    cuda = load_target("cuda")

    def chosen(m, n, tiles, hopper):     # the code-writing tiling the fusion pass picks for the op
        return codes_tiles(KernelChoice("bsr_linear", "w8a8_dense_tile", "", "int8", tiles, hopper), (m, n, 768), cuda)
    ffn1, ffn2 = (4096, 3072), (4096, 768)
    assert int8_dense_tiles(*ffn1, cuda)[1]["bn"] == 256            # fp16 out: 128x256 (measured best)
    tiles, hopper = int8_dense_tiles(*ffn1, cuda, requantized=True)
    assert tiles["bn"] == hopper["bn"] == 192 and tiles["warps_n"] == 3
    pp = int8_codes_spec(BsrSpec(*ffn1, 768, dtype="int8", name="h", **hopper), chosen(*ffn1, tiles, hopper))
    assert pp.pingpong and pp.producer and pp.ctas == cuda.sms == 132 and pp.out == "int8" and pp.stages == 4
    assert pp.shared_bytes <= 227 * 1024 and pp.name == "h_pp_q8"
    sync = int8_codes_spec(BsrSpec(*ffn1, 768, dtype="int8", name="s", **tiles), chosen(*ffn1, tiles, hopper))   # the mma.sync twin: codes only
    assert sync.out == "int8" and not sync.pingpong and (sync.bn, sync.stages, sync.name) == (192, 3, "s_q8")
    # FFN2 (one wave of tiles) and short M keep the cooperative 128x192 kernel, 5 stages
    for m, n in (ffn2, (256, 3072)):
        tiles, hopper = int8_dense_tiles(m, n, cuda, requantized=True)
        q8 = int8_codes_spec(BsrSpec(m, n, 768, dtype="int8", name="h", **hopper), chosen(m, n, tiles, hopper))
        assert (q8.bn, q8.stages, q8.pingpong, q8.out, q8.name) == (192, 5, False, "int8", "h_q8")


def test_a_dense_w8a8_linear_writing_codes_for_bert_sized_batches_runs_the_ping_pong_kernel(tmp_path, monkeypatch):
    """BERT-base FFN shapes at 4096 tokens, dense, calibrated W8A8 with a static scale on the GELU output: FFN1 is
    packed in 128x192 blocks and its Hopper kernel is the ping-pong one writing int8 codes; FFN2 keeps the
    cooperative kernel; both survive a save and load."""
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(768, 3072), torch.nn.GELU(), torch.nn.Linear(3072, 768)).eval()
    batches = [(torch.randn(8, 512, 768),) for _ in range(2)]
    compiled = sparta.compile(model, {}, batches[0], target="cuda", dynamic=False, calibration=batches,
                              quant_tolerance={"tolerance": 1e-2, "activations": True, "progress": False})
    mods = compiled.module_replacements()
    fc1, fc2 = mods["linear"], mods["linear_1"]
    assert fc1.output_names is not None and fc1.spec.out == "int8" and fc1.spec.bn == 192
    folder, spec = fc1.hopper
    assert spec.pingpong and spec.out == "int8" and (spec.bn, spec.bk) == (fc1.spec.bn, fc1.spec.bk)
    src = (Path(folder) / "kernel.cu").read_text()
    assert "setmaxnreg.inc" in src and "cp.async.mbarrier.arrive.noinc" in src
    assert not fc2.hopper[1].pingpong and fc2.hopper[1].stages == 5
    again = sparta.load(compiled.save(tmp_path / "saved")).module_replacements()["linear"]
    assert again.hopper[1] == spec and torch.equal(again.wp, fc1.wp)


def test_block_sparse_w8a8_kernels_of_64_blocks_launch_as_programmatic_dependents(tmp_path, monkeypatch):
    """A 64-block sparse W8A8 linear is built with pdl="tail" (the next kernel may launch once every CTA finished its
    main loop; measured faster in chains on the H100), its int8-code twin too; launch.json asks the runtime for the
    attribute and a save keeps it. A dense W8A8 linear (wgmma twin) is built without."""
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path / "cache"))
    model, _ = _mlp_and_mask(5)
    mask = (torch.rand(2048 // 64, 1024 // 64) < 0.15).repeat_interleave(64, 0).repeat_interleave(64, 1)
    batches = [(torch.randn(2, 512, 1024),) for _ in range(2)]   # BERT-like rows: the cover keeps 64-blocks
    compiled = sparta.compile(model, {"0.weight": mask}, batches[0], target="cuda", calibration=batches,
                              quant_tolerance={"tolerance": 1e-2, "activations": True, "progress": False})
    mods = compiled.module_replacements()
    fc1, fc2 = mods["linear"], mods["linear_1"]
    assert fc1.spec.dtype == "int8" and fc1.spec.pdl == "tail" and fc1.spec.out == "int8", compiled.kernel_report()
    assert json.loads((Path(fc1.folder) / "launch.json").read_text())["pdl"] is True
    assert fc2.spec.dtype == "int8" and not fc2.spec.pdl and fc2.hopper is not None
    loaded = sparta.load(compiled.save(tmp_path / "saved")).module_replacements()
    assert loaded["linear"].spec == fc1.spec


def test_decode_sized_w8a8_linears_run_the_w8a8_gemv_and_save(tmp_path, monkeypatch):
    """At 8 tokens linears calibrated to W8A8 get the W8A8 GEMV (the tile kernels' 128-row tiles would leave the GPU
    nearly idle): calibration's per-channel codes in fragment order, the activation fused; a sparse one keeps only its
    kept 16x32 chunks (table), a dense one all. The dense one's input arrives as the int8 codes the sparse one writes
    (requantising epilogue), or is quantised per token on the way in. Both save and reload."""
    from sparta.passes.quant import fake_quantized_weights
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1040),
                                torch.nn.ReLU())
    mask = (torch.rand(2048 // 32, 1024 // 32) < 0.1).repeat_interleave(32, 0).repeat_interleave(32, 1)
    batches = [(torch.randn(2, 4, 1024),) for _ in range(2)]
    compiled = sparta.compile(model, {"0.weight": mask}, batches[0], target="cuda", dynamic=False, calibration=batches,
                              quant_tolerance={"tolerance": 1e-2, "activations": True, "progress": False})
    rows, mods = {k["op"]: k for k in compiled.kernels}, compiled.module_replacements()
    assert rows["linear"]["template"] == rows["linear_1"]["template"] == "w8a8_gemv", compiled.kernel_report()
    sparse = mods["linear"]
    assert sparse.spec.sparse and not mods["linear_1"].spec.sparse and rows["linear_1"]["blocks"] == "dense"
    from sparta.templates.w8a8_gemv.spec import chunk_mask
    chunks = chunk_mask(torch.round(compiled.graph.tensor("0.weight").data * mask / sparse.weight_scale[:, None]))
    assert rows["linear"]["blocks"] == f"{int(chunks.sum())}x16x32" and sparse.wq.shape[0] == int(chunks.sum())
    assert torch.equal(sparse.dense_weight() != 0, (reference_weight(sparse) != 0)), "pruned chunks stay zero"
    gemv = mods["linear_1"]
    assert type(gemv).__name__ == "W8A8GemvCUDA" and rows["linear_1"]["bits"] == "W8A8"
    assert (gemv.spec.m, gemv.spec.n, gemv.spec.k, gemv.spec.act, gemv.spec.bias) == (8, 1040, 2048, "relu", True)
    assert type(mods["relu_1"]).__name__ == "Passthrough"
    assert gemv.input_names == mods["linear"].output_names and mods["linear"].spec.out == "int8"
    assert gemv.quant_folder is None and "linear_1" in rows["linear"]["note"]
    assert gemv.spec.mma and "m16n8k32.row.col.s32.s8.s8.s32" in (Path(rows["linear_1"]["artifact"]) /
                                                                 "kernel.cu").read_text()
    fitted = _plan_scale(compiled, "linear_1")
    assert torch.equal(gemv.weight_scale, fitted.float()) and gemv.wq.shape == gemv.spec.weight_shape()
    expected = fake_quantized_weights(compiled.graph)["2.weight"]
    torch.testing.assert_close(reference_weight(gemv).float(), expected.half().float(), rtol=0, atol=2e-3)
    loaded = sparta.load(compiled.save(tmp_path / "w8a8_gemv"))
    again = loaded.module_replacements()["linear_1"]
    assert again.spec == gemv.spec and torch.equal(again.wq, gemv.wq) and again.input_names == gemv.input_names
    assert torch.equal(again.dense_weight(), gemv.dense_weight())
    again_sparse = loaded.module_replacements()["linear"]
    assert torch.equal(again_sparse.table, sparse.table) and torch.equal(again_sparse.dense_weight(), sparse.dense_weight())
    # per-token activations (no static scale): the GEMV quantises its input with the row quantiser
    per_token = sparta.compile(model, {"0.weight": mask}, batches[0], target="cuda", dynamic=False, calibration=batches,
                               quant_tolerance={"tolerance": 1e-2, "activations": True, "static_activations": False,
                                                "progress": False})
    gemv = per_token.module_replacements()["linear_1"]
    assert type(gemv).__name__ == "W8A8GemvCUDA" and gemv.quant_folder and gemv.input_names == ["relu"]
    loaded = sparta.load(per_token.save(tmp_path / "w8a8_gemv_per_token"))
    assert (Path(loaded.module_replacements()["linear_1"].quant_folder) / "launch.json").is_file()


def test_compile_picks_the_measured_w8a8_gemv_tilings():
    from sparta.templates.w8a8_gemv.select import w8a8_gemv_tiling
    cuda = load_target("cuda")
    # N = 4096: 256 tiles of 16 rows, 16 warps each; one row: launched early behind the previous kernel
    assert w8a8_gemv_tiling(1, 4096, 4096, cuda) == dict(warps=16, group=4, mma=True, pdl="early")
    assert w8a8_gemv_tiling(16, 4096, 11008, cuda) == dict(warps=16, group=4, mma=True, pdl="")
    # N = 11008: 688 tiles of 8 warps; two grids would not fit on the SMs at once, so no early launch
    assert w8a8_gemv_tiling(1, 11008, 4096, cuda) == dict(warps=8, group=4, mma=True, pdl="")
    # K not a multiple of the MMA's 32: dp4a
    assert w8a8_gemv_tiling(3, 4096, 4112, cuda) == dict(warps=4, group=8, pdl="early")
    # block-sparse: 16 warps take a tile's few kept chunks one at a time
    assert w8a8_gemv_tiling(1, 4096, 4096, cuda, sparse=True) == dict(warps=16, group=1, mma=True, sparse=True)


def test_decode_w8a8_gemvs_hand_each_other_int8_codes(tmp_path, monkeypatch):
    """Two dense W8A8 linears at 8 tokens with a static scale between them: the first GEMV (ReLU fused) writes the
    int8 codes the second reads, so no quantiser runs between them; the save keeps the hand-over."""
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1024))
    batches = [(torch.randn(2, 4, 1024),) for _ in range(2)]
    compiled = sparta.compile(model, {}, batches[0], target="cuda", dynamic=False, calibration=batches,
                              quant_tolerance={"tolerance": 1e-2, "activations": True, "progress": False})
    mods, rows = compiled.module_replacements(), {k["op"]: k for k in compiled.kernels}
    first, second = mods["linear"], mods["linear_1"]
    assert type(first).__name__ == type(second).__name__ == "W8A8GemvCUDA", compiled.kernel_report()
    assert first.spec.out == "int8" and first.spec.act == "relu" and first.output_names == second.input_names
    assert first.out_scale == compiled.plan.static_scales["relu"] and second.quant_folder is None
    assert "__saturatef" in (Path(rows["linear"]["artifact"]) / "kernel.cu").read_text()
    assert "writes int8 codes of relu" in rows["linear"]["note"]
    again = sparta.load(compiled.save(tmp_path / "chain")).module_replacements()
    assert again["linear"].output_names == first.output_names and again["linear"].out_scale == first.out_scale
    assert again["linear"].spec == first.spec and again["linear_1"].input_names == second.input_names


def test_a_4bit_tesa_without_calibration_runs_w4a16_and_the_report_says_why(tmp_path, monkeypatch):
    """The user's own 4-bit TeSA on an fp16 4096x4096 linear, no calibration data: at one row the W4A16 GEMV
    runs with scales fitted to the weight, and the saved model holds its weights in at most 0.4x the fp16 bytes;
    at 4096 rows the plan report names the kernel and why; an 8-bit TeSA runs FP8 (E4M3) weights."""
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    lin = torch.nn.Linear(4096, 4096).half().eval()
    four = sparta.TeSA.dense((4096, 4096), 4)
    one = sparta.compile(lin, {"weight": four}, (torch.randn(1, 4096).half(),), target="cuda", dynamic=False)
    p = one.plan.ops["linear"]
    assert (p.kernel.kernel, p.kernel.rule) == ("w4a16_gemv", "w4a16_gemv") and p.weight_quant[4].source == "weight"
    assert "w4a16_gemv[w4a16] +bias" in one.plan_report() and "GEMV streams them" in one.plan_report()
    assert [(k["template"], k["bits"]) for k in one.kernels] == [("w4a16_gemv", "W4A16")]
    module = one.module_replacements()["linear"]
    w = torch.where(p.kept(4096, 4096), lin.weight.detach().float(), 0.0)
    params = p.weight_quant[4].params(w)                      # the kernel holds fp16 scales
    assert torch.allclose(module.graph_weight().float(), params.dequantize(w), rtol=2e-3, atol=1e-6)
    assert torch.equal(module.graph_weight().float() != 0, params.codes(w) != 0)
    one.save(tmp_path / "one")
    saved = (tmp_path / "one" / "tensors.safetensors").stat().st_size
    assert saved <= 0.4 * lin.weight.numel() * 2, saved
    many = sparta.compile(lin, {"weight": four}, (torch.randn(4096, 4096).half(),), target="cuda", dynamic=False)
    report = many.plan_report()
    assert many.plan.ops["linear"].kind == "dense" and "vendor" in report
    assert "4-bit weights run at W16A16 on the vendor GEMM" in report and "cheapest plan that keeps the bits" in report
    eight = sparta.compile(lin, {"weight": sparta.TeSA.dense((4096, 4096), 8)}, (torch.randn(1, 4096).half(),),
                           target="cuda")
    report = eight.plan_report()
    assert "@W8A16[fp8_e4m3×fp16]" in report and "fp8_gemv[e4m3" in report, report


@pytest.mark.parametrize("widths, rows", [((8,), 64), ((8,), 8), ((4,), 8)])
def test_a_bf16_model_gets_bf16_low_bit_kernels(tmp_path, monkeypatch, widths, rows):
    """A bf16 model's W8A8 (tile kernel, GEMV) and W4A16 (block kernel, GEMV) linears are built for bf16: bf16 in
    (the quantiser reads bf16), bf16 bias and out, bf16 scales and MMA for 4 bits; no cast to fp16 around them.
    The specs survive a save and load."""
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path / "cache"))
    model, mask = _mlp_and_mask(1)
    model = model.bfloat16()
    batches = [(torch.randn(1, rows, 1024).bfloat16(),) for _ in range(2)]
    tolerance = {"tolerance": 1.0, "widths": widths, "activations": widths == (8,), "progress": False,
                 **({"group_size": 64} if widths == (4,) else {})}
    compiled = sparta.compile(model, {"0.weight": mask}, batches[0], target="cuda", dynamic=False,
                              calibration=batches, quant_tolerance=tolerance)
    rows_ = {k["op"]: k for k in compiled.kernels}
    assert {r["bits"].split()[0] for r in rows_.values()} == {f"W{widths[0]}A{8 if widths == (8,) else 16}"}, \
        compiled.kernel_report()
    for name, module in compiled.module_replacements().items():
        spec = getattr(module, "spec", None)
        if spec is None:
            continue
        if getattr(spec, "out", "") != "int8":          # a linear writing int8 codes for the next one has no 16-bit Y
            assert getattr(spec, "act16", getattr(spec, "dtype", None)) == "bfloat16", (name, spec)
            assert module.dense_weight().dtype == torch.bfloat16
        src = (Path(module.folder) / "kernel.cu").read_text()
        assert (".bf16.bf16" in src) == (widths == (4,)), name      # bf16 MMA for 4 bits; s8 MMA or dp4a for 8
        if getattr(module, "quant_folder", None):
            assert json.loads((Path(module.quant_folder) / "spec.json").read_text())["dtype"] == "bfloat16"
    families = {type(m).__name__ for m in compiled.module_replacements().values()}
    assert {"W8A8GemvCUDA" if widths == (8,) else "W4A16GemvCUDA"} <= families or rows > 16, families
    loaded = sparta.load(compiled.save(tmp_path / "m"))
    for name, module in compiled.module_replacements().items():
        if getattr(module, "spec", None) is not None:
            assert loaded.module_replacements()[name].spec == module.spec
