"""A model compiled for CUDA and saved where TVM is (``tests/fixtures/build_cuda.py``), loaded and run on a GPU.

The GPU machine has no TVM: this is the path a user's saved model takes.
"""

import importlib.util
from pathlib import Path

import pytest
import torch

from fixtures import kernel_choices
from fixtures.artifacts import MISSING, ROOT
SAVED = ROOT / "saved_mlp"
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(not (SAVED / "sparta.json").is_file(), reason=MISSING + f"no saved model in {SAVED}")]


@pytest.fixture(scope="module")
def loaded():
    import sparta
    return sparta.load(SAVED, inductor=False).to("cuda")


def test_loads_without_tvm_and_verifies(loaded):
    kinds = sorted(type(m).__name__ for m in loaded.module_replacements().values())
    assert kinds.count("SparseLinearCUDA") == 2, kinds
    assert sum("streaming grid" in k["dismantle"] for k in loaded.kernels) == 1, "the 64-block linear streams"
    if importlib.util.find_spec("tvm") is None:
        import sys
        assert not any(k.startswith("tvm") for k in sys.modules)
    worst = loaded.verify(trials=3)
    assert max(worst.values()) < 1e-2


def test_matches_a_torch_model_with_the_masked_weights(loaded):
    g = loaded.graph
    w0, w2 = g.tensor("0.weight").data.cuda(), g.tensor("2.weight").data.cuda()
    b0, b2 = g.tensor("0.bias").data.cuda(), g.tensor("2.bias").data.cuda()
    x = torch.randn(3, 333, 1024, device="cuda")
    ref = torch.nn.functional.gelu(torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, w0, b0)), w2, b2))
    out = loaded(x)
    assert out.dtype == torch.float32 and out.shape == (3, 333, 1024)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))


def replay_on_new_input(model, x):
    """Capture ``model(x)`` in a CUDA graph, refill ``x``, replay; assert the replay equals an eager call
    on the new ``x``. Returns the replayed output."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        model(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    return out


def test_runs_inside_a_cuda_graph(loaded):
    x = torch.randn(3, 333, 1024, device="cuda")
    eager = loaded(x)
    assert not torch.equal(replay_on_new_input(loaded, x), eager)


W8A8 = ROOT / "saved_mlp_w8a8"
needs_w8a8 = pytest.mark.skipif(not (W8A8 / "sparta.json").is_file(), reason=MISSING + f"no saved W8A8 model in {W8A8}")


@needs_w8a8
def test_calibrated_w8a8_model_runs_int8_kernels_and_matches_fake_quantised_math():
    import sparta
    from sparta.templates.quant.spec import quantize_rows
    model = sparta.load(W8A8, inductor=False).to("cuda")
    mods = {k: m for k, m in model.module_replacements().items() if type(m).__name__ == "SparseLinearCUDA"}
    assert len(mods) == 2 and all(m.spec.dtype == "int8" and m.quant_folder for m in mods.values())
    assert max(model.verify(trials=2).values()) < 5e-2
    g = model.graph

    def fq(t):          # per-token int8, as the quantiser kernel applies it
        q, s = quantize_rows(t.half())
        return q.float() * s[..., None]
    w0, w2 = g.tensor("0.weight").data.cuda().float(), g.tensor("2.weight").data.cuda().float()   # dequantised
    b0, b2 = g.tensor("0.bias").data.cuda().float(), g.tensor("2.bias").data.cuda().float()
    x = torch.randn(3, 333, 1024, device="cuda")
    h = torch.relu(torch.nn.functional.linear(fq(x.reshape(-1, 1024)), w0, b0))
    ref = torch.nn.functional.gelu(torch.nn.functional.linear(fq(h.half().float()), w2, b2)).reshape(3, 333, 1024)
    out = model(x)
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-2, err
    replay_on_new_input(model, x)                # the quantiser and the int8 kernels capture in a CUDA graph
    dense = next(m for m in mods.values() if m.hopper is not None)     # the dense W8A8 op: wgmma on sm_90
    folder, spec = dense.kernel_for(x.device)
    hopper = torch.cuda.get_device_capability() == (9, 0)
    assert (spec.mma == "wgmma") == hopper and dense._op.kernel.folder == Path(folder)
    if hopper:   # the mma.sync kernel over the same packed blocks gives the same output
        from sparta.templates.bsr_linear.runtime import BsrLinearOp
        xh = torch.randn(dense.spec.m, dense.spec.k, device="cuda").half()
        sync = BsrLinearOp.packed(dense.folder, dense.spec, dense.wp, dense.table, dense.bias, dense.weight_scale)
        torch.testing.assert_close(dense._op(xh), sync(xh), rtol=2e-3, atol=2e-3)


W8A8_STATIC = ROOT / "saved_mlp_w8a8_static"


@pytest.mark.skipif(not (W8A8_STATIC / "sparta.json").is_file(), reason=MISSING + f"no saved model in {W8A8_STATIC}")
def test_w8a8_model_with_a_static_scale_hands_int8_codes_between_linears():
    """The first linear's epilogue (ReLU) writes int8 codes at calibration's static scale, which the second
    (dense, wgmma on Hopper) reads with no quantiser in between: against the fake-quantised math."""
    import sparta
    from sparta.templates.quant.spec import quantize_rows
    model = sparta.load(W8A8_STATIC, inductor=False).to("cuda")
    mods = model.module_replacements()
    fc1, fc2 = mods["linear"], mods["linear_1"]
    assert fc1.spec.out == "int8" and fc1.output_names == ["relu:int8", "relu:scale"] and fc1.quant_folder
    assert fc2.input_names == fc1.output_names and fc2.quant_folder is None and type(mods["relu"]).__name__ == "Fused"
    assert fc1.out_scale > 0 and torch.all(fc1.code_scale == fc1.out_scale)
    assert max(model.verify(trials=2).values()) < 5e-2
    g = model.graph
    w0, w2 = g.tensor("0.weight").data.cuda().float(), g.tensor("2.weight").data.cuda().float()   # dequantised
    b0, b2 = g.tensor("0.bias").data.cuda().float(), g.tensor("2.bias").data.cuda().float()
    x = torch.randn(3, 333, 1024, device="cuda")
    q, s = quantize_rows(x.half().reshape(-1, 1024))
    h = torch.relu(torch.nn.functional.linear(q.float() * s[:, None], w0, b0))
    s32 = torch.tensor(fc1.out_scale, dtype=torch.float32)
    hq = torch.round(h / s32).clamp(-127, 127) * s32
    ref = torch.nn.functional.gelu(torch.nn.functional.linear(hq, w2, b2)).reshape(3, 333, 1024)
    out = model(x)
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-2, err
    replay_on_new_input(model, x)


DECODE = ROOT / "saved_decode_w4a16"
TESA_W4 = ROOT / "saved_tesa_w4a16"


@pytest.mark.skipif(not (TESA_W4 / "sparta.json").is_file(), reason=MISSING + f"no saved model in {TESA_W4}")
def test_4bit_tesas_without_calibration_run_w4a16_kernels_on_the_weights_own_scales():
    """The user's 4-bit TeSAs and no calibration: the dense linear runs the W4A16 GEMV, the block-sparse one a 4-bit
    kernel, both on scales fitted to the weight (the plan's), and the model matches the dequantised math."""
    import sparta
    model = sparta.load(TESA_W4, inductor=False).to("cuda")
    mods = kernel_choices.check_tesa_w4a16(model)
    assert max(model.verify(trials=2).values()) < 1e-2
    g = model.graph
    b0, b2 = g.tensor("0.bias").data.cuda().float(), g.tensor("2.bias").data.cuda().float()
    w0, w2 = (mods[n].dense_weight().cuda().float() for n in ("linear", "linear_1"))
    x = torch.randn(1, 4096, device="cuda").half()
    h = torch.relu(torch.nn.functional.linear(x.float(), w0, b0)).half()
    ref = torch.nn.functional.linear(h.float(), w2, b2)
    err = ((model(x).float() - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-2, err
    replay_on_new_input(model, x)


@pytest.mark.skipif(not (DECODE / "sparta.json").is_file(), reason=MISSING + f"no saved model in {DECODE}")
def test_decode_w4a16_gemvs_back_to_back_launch_programmatically_and_match():
    """Two 4-bit linears compiled the default way (any rows): calls of up to 8 rows run the W4A16 GEMV built for
    programmatic dependent launch (the second may start before the first ends and reads its X only after the wait),
    up to 16 rows the 16-row GEMV, more rows the tile kernel; the GEMVs' packed codes are the tile's, and every row
    count matches the dequantised math, eagerly and replayed."""
    import sparta
    from sparta.templates.w4a16_gemv.spec import dequantize
    model = sparta.load(DECODE, inductor=False).to("cuda")
    mods = kernel_choices.check_decode_w4a16(model)
    for m in mods.values():
        g = m.few_rows[0][2]
        gemv_w = dequantize(*(t.cpu() for t in m.w4_pack()), g)
        torch.testing.assert_close(gemv_w.half(), m.dense_weight().half(), rtol=0, atol=0)
    assert max(model.verify(trials=2).values()) < 1e-2
    (w0, l0), (w1, l1) = sorted((m.weight_name, m) for m in mods.values())
    g = model.graph
    b0, b1 = g.tensor("0.bias").data.cuda().float(), g.tensor("1.bias").data.cuda().float()
    for rows in (4, 1, 5, 12, 16, 17, 40):
        x = torch.randn(1, rows, 1024, device="cuda").half()
        h = torch.nn.functional.linear(x.float(), l0.dense_weight().cuda().float(), b0).half()
        ref = torch.relu(torch.nn.functional.linear(h.float(), l1.dense_weight().cuda().float(), b1))
        for _ in range(2):
            err = ((model(x).float() - ref).abs().max() / ref.abs().max()).item()
            assert err < 1e-2, (rows, err)
        if rows == 4:
            hopper = torch.cuda.get_device_capability() >= (9, 0)
            assert all(set(m._few_ops) == {8} for m in mods.values())       # 4 rows ran the 8-row GEMVs
            assert all((m._few_ops[8]._prepared.config is not None) == hopper for m in mods.values())
    assert all(set(m._few_ops) == set(kernel_choices.rows_of(m)) for m in mods.values())
    replay_on_new_input(model, torch.randn(1, 4, 1024, device="cuda").half())


DECODE_W8A8 = ROOT / "saved_decode_w8a8"


@pytest.mark.skipif(not (DECODE_W8A8 / "sparta.json").is_file(), reason=MISSING + f"no saved model in {DECODE_W8A8}")
def test_decode_w8a8_gemvs_hand_each_other_int8_codes_and_match():
    """LayerNorm → linear (70% block-sparse) → GELU → linear on 4 tokens, calibrated to W8A8 with a static scale
    after the GELU: both linears run the W8A8 GEMV (the first its sparse kernel), the first on the LayerNorm kernel's
    int8 codes, writing the codes of GELU(·) that the second reads (no quantiser between them). The output matches
    the same math in torch (per-token codes of the LayerNorm, codes of the GELU at the static scale, the dequantised
    weights), eagerly and from a CUDA graph."""
    import sparta
    from sparta.templates.epilogue_ref import requantize
    from sparta.templates.quant.spec import quantize_rows
    model = sparta.load(DECODE_W8A8, inductor=False).to("cuda")
    mods = model.module_replacements()
    kernel_choices.check_decode_w8a8(model)
    fc1, fc2 = mods["linear"], mods["linear_1"]
    assert fc2.w8_pack()[0].data_ptr() == fc2.wp.data_ptr() and fc2.gemv_wq is None   # the dense tile's blocks
    assert fc1.gemv_wq is not None and 0 < fc1.gemv_wq.shape[0] < -(-fc1.spec.n // 16) * fc1.spec.k // 32   # kept chunks
    assert max(model.verify(trials=2).values()) < 5e-2
    g = model.graph

    def w8a8(q, s, layer, bias):
        codes = layer.dense_codes().cuda().float()
        return (q.float() @ codes.t()) * s[:, None] * layer.weight_scale[None, :] + bias.cuda().float()
    for rows in (4, 1, 6, 10, 13, 24):                  # each GEMV, then the tile kernels
        x = torch.randn(1, rows, 1024, device="cuda").half()
        h = torch.nn.functional.layer_norm(x.float(), (1024,), g.tensor("0.weight").data.cuda().float(),
                                           g.tensor("0.bias").data.cuda().float()).half().reshape(rows, 1024)
        h8 = requantize(torch.nn.functional.gelu(w8a8(*quantize_rows(h), fc1, g.tensor("1.bias").data)),
                        fc1.out_scale)
        ref = w8a8(h8, torch.full((rows,), fc1.out_scale, device="cuda"), fc2, g.tensor("3.bias").data)
        ref = ref.reshape(1, rows, -1)
        for _ in range(2):
            err = ((model(x).float() - ref).abs().max() / ref.abs().max()).item()
            assert err < 2e-2, (rows, err)
    assert set(fc1._few_ops) == set(kernel_choices.rows_of(fc1)) and set(fc2._few_ops) == set(kernel_choices.rows_of(fc2))
    replay_on_new_input(model, torch.randn(1, 4, 1024, device="cuda").half())


PINGPONG = ROOT / "saved_ffn_w8a8_pingpong"


@pytest.mark.skipif(not (PINGPONG / "sparta.json").is_file(), reason=MISSING + f"no saved model in {PINGPONG}")
def test_dense_w8a8_ffn_at_bert_size_writes_codes_from_the_ping_pong_kernel():
    """Dense BERT-base FFN compiled the default way (any rows) at 4096 tokens, GELU(FFN1) at a static scale: on
    Hopper FFN1 runs the ping-pong kernel (built for any M) writing int8 codes; they match the mma.sync kernel's over the same packed blocks (within one code) and the model
    matches its fake-quantised math."""
    import sparta
    from sparta.templates.bsr_linear.runtime import BsrLinearOp
    model = sparta.load(PINGPONG, inductor=False).to("cuda")
    mods = model.module_replacements()
    kernel_choices.check_pingpong(model)
    fc1 = mods["linear"]
    assert max(model.verify(trials=2).values()) < 5e-2
    x = torch.randn(8, 512, 768, device="cuda")
    out = model(x)
    folder, spec = fc1.kernel_for(x.device)
    hopper = torch.cuda.get_device_capability() == (9, 0)
    assert spec.pingpong == hopper and fc1._op.kernel.folder == Path(folder)
    xh = torch.randn(4096, spec.k, device="cuda").half()
    sync = BsrLinearOp.packed(fc1.folder, fc1.spec, fc1.wp, fc1.table, fc1.bias, fc1.weight_scale, fc1.out_scale)
    a, b = fc1._op(xh).int(), sync(xh).int()
    assert (a - b).abs().max() <= 1 and (a != b).float().mean() < 1e-3 and a.abs().max() > 64
    assert not torch.equal(replay_on_new_input(model, x), out)


W4A16 = ROOT / "saved_mlp_w4a16"


@pytest.mark.skipif(not (W4A16 / "sparta.json").is_file(), reason=MISSING + f"no saved W4A16 model in {W4A16}")
def test_calibrated_4bit_model_runs_w4a16_kernels_and_matches_its_dequantised_weights():
    """16 tokens, 4-bit weights with zero points: the sparse linear runs the W4A16 block kernel, the dense
    one the W4A16 GEMV (beside its tile kernel, for calls of up to 16 rows)."""
    import sparta
    model = sparta.load(W4A16, inductor=False).to("cuda")
    mods = kernel_choices.check_mlp_w4a16(model)
    assert max(model.verify(trials=2).values()) < 1e-2
    g = model.graph
    (w0, l0), (w2, l2) = sorted((m.weight_name, m) for m in mods.values())
    assert (w0, w2) == ("0.weight", "2.weight")
    b0, b2 = g.tensor("0.bias").data.cuda().float(), g.tensor("2.bias").data.cuda().float()
    x = torch.randn(2, 8, 1024, device="cuda").half()
    h = torch.relu(torch.nn.functional.linear(x.float(), l0.dense_weight().cuda().float(), b0))
    ref = torch.nn.functional.gelu(torch.nn.functional.linear(h.half().float(), l2.dense_weight().cuda().float(), b2))
    out = model(x)
    assert out.dtype == torch.float16
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-2, err
    fq = {w: g.tensor(w).data.cuda().float() for w in (w0, w2)}     # calibration's fake-quantised weights
    for w, m in ((w0, l0), (w2, l2)):
        assert ((m.dense_weight().cuda().float() - fq[w]).abs().max() / fq[w].abs().max()).item() < 1e-2
    replay_on_new_input(model, x)
