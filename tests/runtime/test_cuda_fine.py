"""sparta's fine-grained sparse CUDA linear (``templates/cuda_fine.py``) against its torch reference, on a GPU.

Kernels are built beforehand (``python benchmarks/build_cuda_kernels.py``) into ``artifacts/cuda``;
the ``t_fine_*`` ones cover odd M/N, both row tilings (16 and 32 rows per CTA), every epilogue.
"""

import os
from pathlib import Path

import pytest
import torch

ROOT = Path(os.environ.get("SPARTA_CUDA_ARTIFACTS", Path(__file__).resolve().parents[2] / "artifacts" / "cuda"))
FINE = sorted(p.name for p in ROOT.glob("t_fine_*") if (p / "spec.json").is_file()) if ROOT.is_dir() else []
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(not FINE, reason=f"no built fine-grained kernels in {ROOT}")]


def _spec(name):
    import json
    from sparta.templates.cuda_fine import FineSpec
    return FineSpec(**json.loads((ROOT / name / "spec.json").read_text()))


@pytest.mark.parametrize("density", [0.0, 0.03, 0.3, 1.0])
@pytest.mark.parametrize("name", FINE)
def test_fine_linear_matches_reference(name, density):
    from sparta.runtime.fine_linear import FineLinearOp
    from sparta.templates.cuda_fine import reference
    spec = _spec(name)
    x = torch.randn(spec.m, spec.k, device="cuda").half()
    w = torch.randn(spec.n, spec.k, device="cuda").half()
    keep = torch.rand(spec.n, spec.k, device="cuda") < density
    bias = torch.randn(spec.n, device="cuda").half() if spec.bias else None
    op = FineLinearOp(ROOT / name, spec, w, keep, bias)
    y = torch.full((spec.m, spec.n), float("nan"), dtype=torch.float16, device="cuda")
    op(x, out=y)
    torch.cuda.synchronize()
    assert not y.isnan().any(), "some outputs were not written"
    ref = reference(x, w, keep, bias, spec.act)
    err = ((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1.0)).item()
    assert err < 2e-3, f"{name} density {density}: max error {err:.2e} of max |ref|"


def test_fine_linear_in_a_cuda_graph():
    from sparta.runtime.fine_linear import FineLinearOp
    spec = _spec(FINE[0])
    w = torch.randn(spec.n, spec.k, device="cuda").half()
    bias = torch.randn(spec.n, device="cuda").half() if spec.bias else None
    op = FineLinearOp(ROOT / FINE[0], spec, w, torch.rand_like(w.float()) < 0.1, bias)
    x = torch.randn(spec.m, spec.k, device="cuda").half()
    y = torch.empty(spec.m, spec.n, dtype=torch.float16, device="cuda")
    op(x, out=y)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op(x, out=y)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, op(x), rtol=0, atol=0)
