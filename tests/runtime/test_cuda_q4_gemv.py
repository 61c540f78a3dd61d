"""sparta's dp4a W4A8 GEMV (``templates/cuda_q4_gemv.py``) and its q8 activation quantiser, on a GPU.

Kernels built beforehand by ``python benchmarks/build_cuda_kernels.py`` (``t_q4_*``, ``t_q8_*``):
odd N, K blocks that do not fill the 32 lanes, M = 1, 3, 8, with and without bias. Fresh random
data each run (per-block magnitudes vary over 100×); outputs poisoned with NaN first.
"""

import json
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(os.environ.get("SPARTA_CUDA_ARTIFACTS", Path(__file__).resolve().parents[2] / "artifacts" / "cuda"))
GEMVS = sorted(p.name for p in ROOT.glob("t_q4_*") if (p / "spec.json").is_file()) if ROOT.is_dir() else []
QUANTS = sorted(p.name for p in ROOT.glob("t_q8_*") if (p / "spec.json").is_file()) if ROOT.is_dir() else []
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(not GEMVS, reason=f"no built q4 kernels in {ROOT}")]


def _spec(name):
    return json.loads((ROOT / name / "spec.json").read_text())


def _x(m, k):
    scale = torch.rand(m, k // 32, 1, device="cuda") * 10 + 0.1          # per-block magnitudes 0.1 … 10
    return (torch.randn(m, k // 32, 32, device="cuda") * scale).reshape(m, k).half()


def _op(name):
    from sparta.runtime.q4_gemv import Q4GemvOp
    from sparta.templates.cuda_q4_gemv import quantize_weight
    s = _spec(name)
    w = torch.randn(s["n"], s["k"], device="cuda")
    w[: s["n"] // 3, :64] = 0                                            # whole pruned blocks: scale 0
    wq, dw = quantize_weight(w)
    bias = torch.randn(s["n"], device="cuda").half() if s["bias"] else None
    return Q4GemvOp(ROOT / name, ROOT / f"t_q8_{s['m']}x{s['k']}", wq, dw, bias), w, wq, dw, bias


@pytest.mark.parametrize("name", QUANTS)
def test_q8_quantiser_is_bit_exact_with_torch(name):
    from sparta.runtime.cuda import CudaKernel
    from sparta.templates.cuda_q4_gemv import quantize_q8
    s = _spec(name)
    x = _x(s["m"], s["k"])
    x[0, :32] = 0                                                        # an all-zero block
    xq = torch.empty(s["m"], s["k"], dtype=torch.int8, device="cuda")
    xd = torch.full((s["m"], s["k"] // 32, 2), float("nan"), device="cuda")
    CudaKernel(ROOT / name).call(X=x, XQ=xq, XD=xd)
    rq, rd = quantize_q8(x)
    assert torch.equal(xq, rq) and torch.equal(xd, rd)


@pytest.mark.parametrize("name", GEMVS)
def test_q4_gemv_matches_reference(name):
    from sparta.templates.cuda_q4_gemv import reference
    op, w, wq, dw, bias = _op(name)
    x = _x(op.spec.m, op.spec.k)
    y = torch.full((op.spec.m, op.spec.n), float("nan"), dtype=torch.float16, device="cuda")
    op(x, out=y)
    torch.cuda.synchronize()
    assert not y.isnan().any(), "some outputs were not written"
    ref = reference(x, wq, dw, bias)
    err = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    assert err < 2e-3, f"{name}: max error {err:.2e} of max |ref|"
    exact = torch.nn.functional.linear(x.float(), w, bias.float() if bias is not None else None)
    sqnr = 10 * torch.log10(exact.pow(2).mean() / (y.float() - exact).pow(2).mean()).item()
    assert sqnr > 15, f"{name}: SQNR {sqnr:.1f} dB against the fp32 product (int4 weights, int8 activations)"


def test_q4_gemv_runs_in_a_cuda_graph_and_refuses_bad_input():
    from sparta.runtime.cuda import CudaRuntimeError
    from sparta.templates.cuda_q4_gemv import reference
    op, _, wq, dw, bias = _op(GEMVS[0])
    x = _x(op.spec.m, op.spec.k)
    y = torch.empty(op.spec.m, op.spec.n, dtype=torch.float16, device="cuda")
    op(x, out=y)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        op(x, out=y)
    x.copy_(_x(op.spec.m, op.spec.k))
    y.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    ref = reference(x, wq, dw, bias).float()
    assert ((y.float() - ref).abs().max() / ref.abs().max()).item() < 2e-3
    with pytest.raises(CudaRuntimeError, match="input must be"):
        op(torch.randn(op.spec.m, op.spec.k + 32, device="cuda").half())
