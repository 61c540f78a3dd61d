"""The RMSNorm variant of the norm family on the GPU against Hugging Face's formula: the residual stream's sum written
bit for bit as torch's add, odd row counts, fp16 and bf16, int8 codes, no weight, CUDA graphs. Kernels are built
beforehand where TVM is (``tests/fixtures/build_cuda.py``)."""

import json

import pytest
import torch

from sparta.templates.norm.runtime import LayerNormOp
from sparta.templates.norm.spec import LayerNormSpec, rms_norm_ref
from sparta.templates.quant.spec import quantize_rows

from fixtures.artifacts import MISSING, ROOT

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CASES = ["t_rms_bf16_res_out", "t_rms_warp_both", "t_rms_cta_plain", "t_rms_res_out_int8", "t_rms_bf16_res"]
TOL = {torch.float16: dict(rtol=2e-3, atol=4e-3), torch.bfloat16: dict(rtol=1.6e-2, atol=3e-2)}


def _op(name, seed=0):
    folder = ROOT / name
    if not (folder / "launch.json").is_file():
        pytest.skip(MISSING + f"kernel {name} not built in {ROOT}")
    spec = LayerNormSpec(**json.loads((folder / "spec.json").read_text()))
    dtype = torch.bfloat16 if spec.dtype == "bfloat16" else torch.float16
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.rand(spec.n, device="cuda", generator=g) + 0.5).to(dtype) if spec.affine else None
    return spec, LayerNormOp(folder, spec, w), w, g, dtype


@pytest.mark.parametrize("rows", [1, 37, 300])
@pytest.mark.parametrize("name", CASES)
def test_matches_hugging_faces_rms_norm_and_writes_the_sum(name, rows):
    spec, op, w, g, dtype = _op(name)
    x = (torch.randn(rows, spec.n, device="cuda", generator=g) * 3 + 0.5).to(dtype)
    r = (torch.randn(rows, spec.n, device="cuda", generator=g) * 2).to(dtype) if spec.residual else None
    h = x if r is None else x + r                       # torch's 16-bit add
    ref = rms_norm_ref(h, w, spec.eps)
    outs = op(x, r)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    if spec.out != "int8":
        torch.testing.assert_close(outs.pop(0).float(), ref.float(), **TOL[dtype])
    if spec.residual_out:
        assert torch.equal(outs.pop(0), h)              # the residual stream, bit for bit
    if spec.out != "fp16":
        xq, xs = outs
        rq, rs = quantize_rows(ref)
        torch.testing.assert_close(xs, rs, rtol=4e-3, atol=0)
        assert (xq.int() - rq.int()).abs().max() <= 1 and (xq != rq).float().mean() < 0.02


def test_zero_rows_stay_finite_and_a_cuda_graph_replays():
    spec, op, w, g, dtype = _op("t_rms_bf16_res_out", seed=1)
    x = torch.randn(8, spec.n, device="cuda", generator=g).to(dtype)
    r = torch.randn(8, spec.n, device="cuda", generator=g).to(dtype)
    r[3] = -x[3]                                        # a zero row: eps keeps it finite
    y, h = op(x, r)
    assert torch.isfinite(y.float()).all() and not y[3].any()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, h = op(x, r)
    x.copy_(torch.randn(8, spec.n, device="cuda", generator=g).to(dtype))
    graph.replay()
    torch.testing.assert_close(y.float(), rms_norm_ref(x + r, w, spec.eps).float(), **TOL[dtype])
    assert torch.equal(h, x + r)
