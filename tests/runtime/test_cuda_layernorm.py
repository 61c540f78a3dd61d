"""sparta's LayerNorm kernel (``templates/norm/``) on the GPU against torch, and a saved
W8A8 block whose LayerNorm hands the linear its int8 codes. Kernels are built beforehand where TVM is
(``tests/fixtures/build_cuda.py``)."""


import pytest
import torch

from sparta.templates.norm.runtime import LayerNormOp
from sparta.templates.norm.spec import LayerNormSpec, layer_norm_ref
from sparta.templates.quant.spec import quantize_rows

from fixtures import kernel_choices
from fixtures.artifacts import MISSING, ROOT
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CASES = ["t_ln_warp_both", "t_ln_plain", "t_ln_cta_int8", "t_ln_cta2_weight_only", "t_ln_res_warp_both",
         "t_ln_res_cta_fp16"]


def _op(name, seed=0):
    folder = ROOT / name
    if not (folder / "launch.json").is_file():
        pytest.skip(MISSING + f"kernel {name} not built in {ROOT}")
    import json
    spec = LayerNormSpec(**json.loads((folder / "spec.json").read_text()))
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.rand(spec.n, device="cuda", generator=g).half() + 0.5 if spec.affine else None
    b = torch.randn(spec.n, device="cuda", generator=g).half() if spec.bias else None
    return spec, LayerNormOp(folder, spec, w, b), w, b, g


def _outputs(spec, outs):
    outs = outs if isinstance(outs, tuple) else (outs,)
    y = outs[0] if spec.out != "int8" else None
    q = outs[-2:] if spec.out != "fp16" else None
    return y, q


@pytest.mark.parametrize("name", CASES)
def test_matches_torch_layer_norm_and_its_int8_codes(name):
    spec, op, w, b, g = _op(name)
    x = (torch.randn(spec.m, spec.n, device="cuda", generator=g) * 4 + 3).half()   # an offset mean stresses the variance
    r = (torch.randn(spec.m, spec.n, device="cuda", generator=g) * 2).half() if spec.residual else None
    ref = layer_norm_ref(x if r is None else x + r, w, b, spec.eps)     # torch's fp16 add, then the norm
    y, q = _outputs(spec, op(x, r))
    if y is not None:
        torch.testing.assert_close(y.float(), ref.float(), rtol=2e-3, atol=4e-3)
    if q is not None:
        xq, xs = q
        base = y if y is not None else ref
        rq, rs = quantize_rows(base)
        torch.testing.assert_close(xs, rs, rtol=4e-3, atol=0)
        if y is not None:          # on the kernel's own fp16 output: bit for bit the per-token quantiser
            assert torch.equal(xq, rq) and torch.equal(xs, rs)
        else:                      # against torch's output: codes off by at most one where fp16 rounding differs
            assert (xq.int() - rq.int()).abs().max() <= 1 and (xq != rq).float().mean() < 0.02


def test_constant_rows_and_zero_rows():
    spec, op, w, b, _ = _op("t_ln_warp_both", seed=1)
    x = torch.full((spec.m, spec.n), 7.25, device="cuda").half()
    x[5] = 0
    y, xq, xs = op(x)
    expected = (b if b is not None else torch.zeros_like(y[0])).float()
    torch.testing.assert_close(y.float(), expected.expand_as(y), rtol=0, atol=2e-3)   # (x - mean) = 0 exactly
    rq, rs = quantize_rows(y)
    assert torch.equal(xq, rq) and torch.equal(xs, rs)


def test_captures_in_a_cuda_graph_and_refuses_bad_input():
    from sparta.runtime.cuda import CudaRuntimeError
    spec, op, w, b, g = _op("t_ln_cta_int8")
    x = torch.randn(spec.m, spec.n, device="cuda", generator=g).half()
    op(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        xq, xs = op(x)
    x.copy_(torch.randn(spec.m, spec.n, device="cuda", generator=g).half())
    graph.replay()
    rq, rs = quantize_rows(layer_norm_ref(x, w, b, spec.eps))
    assert (xq.int() - rq.int()).abs().max() <= 1
    torch.testing.assert_close(xs, rs, rtol=4e-3, atol=0)
    with pytest.raises(CudaRuntimeError, match="contiguous fp16"):
        op(x.float())
    with pytest.raises(CudaRuntimeError, match="weight"):
        LayerNormOp(ROOT / "t_ln_cta_int8", spec, None, b)
    with pytest.raises(CudaRuntimeError, match="residual"):
        op(x, x)


SAVED_FP16 = ROOT / "saved_postln_fp16"


@pytest.mark.skipif(not (SAVED_FP16 / "sparta.json").is_file(), reason=MISSING + f"no saved model in {SAVED_FP16}")
def test_saved_fp16_post_ln_block_fuses_the_residual_add_into_its_layer_norm():
    import sparta
    model = sparta.load(SAVED_FP16, inductor=False).to("cuda")
    kernel_choices.check_postln(model)
    g = model.graph
    x = torch.randn(4, 96, 768, device="cuda").half()

    def weight(name):
        return g.tensor(name).data.cuda().half()
    w = (g.tensor("fc.weight").data.float() * g.tesa("fc.weight").mask.float()).cuda().half()   # pruned as compiled
    fc = torch.nn.functional.linear(x, w, weight("fc.bias"))
    h = torch.nn.functional.layer_norm(fc + x, (768,), weight("ln.weight"), weight("ln.bias"))
    ref = torch.nn.functional.layer_norm(h, (768,), weight("ln2.weight"), weight("ln2.bias"))
    out = model(x)
    assert ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item() < 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = model(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(captured, model(x), rtol=0, atol=0)


SAVED = ROOT / "saved_norm_w8a8"


@pytest.mark.skipif(not (SAVED / "sparta.json").is_file(), reason=MISSING + f"no saved model in {SAVED}")
def test_saved_norm_block_feeds_int8_codes_to_the_w8a8_linear():
    import sparta
    model = sparta.load(SAVED, inductor=False).to("cuda")
    mods = model.module_replacements()
    norm, fc1 = mods["layer_norm"], mods["linear"]
    assert type(norm).__name__ == "LayerNormCUDA" and norm.spec.out == "both"
    assert fc1.spec.dtype == "int8" and fc1.input_names == ["layer_norm:int8", "layer_norm:scale"]
    assert max(model.verify(trials=2).values()) < 5e-2
    g = model.graph
    x = torch.randn(3, 333, 1024, device="cuda") * 3 + 1
    ln = torch.nn.functional.layer_norm(x, (1024,), g.tensor("ln.weight").data.cuda(), g.tensor("ln.bias").data.cuda())
    q, s = quantize_rows(ln.half().reshape(-1, 1024))
    w1, b1 = g.tensor("fc1.weight").data.cuda().float(), g.tensor("fc1.bias").data.cuda().float()
    w2, b2 = g.tensor("fc2.weight").data.cuda().float(), g.tensor("fc2.bias").data.cuda().float()
    h = torch.relu(torch.nn.functional.linear(q.float() * s[:, None], w1, b1))
    hq, hs = quantize_rows(h.half()) if mods["linear_1"].spec.dtype == "int8" else (h, torch.ones(h.shape[0], device="cuda"))
    ref = torch.nn.functional.linear(hq.float() * hs[:, None], w2, b2).reshape(3, 333, 1024) + ln
    out = model(x)
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    assert err < 2e-2, err
    graph = torch.cuda.CUDAGraph()       # the norm kernel, the int8 kernels and the quantiser capture together
    with torch.cuda.graph(graph):
        captured = model(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(captured, model(x), rtol=0, atol=0)
