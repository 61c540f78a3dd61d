"""sparta's W8A8 GEMV (``templates/w8a8_gemv/``) on a GPU, against the W8A8 reference.

Kernels built beforehand by ``python tests/fixtures/build_cuda.py`` (``t_w8g_*``), dp4a and tensor-core
(``mma``): N not a multiple of the CTA's warps (or of the 16-row tiles), K not a multiple of the 512 bytes a warp
loads (or of the warps' chunks), batches shorter than the group, M = 1, 3, 8, 9, 16, bias, ReLU and exact GELU,
programmatic dependent launch, fp16 or int8 codes out. Fresh random data each run (per-row magnitudes vary
over 100×); outputs poisoned with NaN first.
"""

import json

import pytest
import torch

from fixtures.artifacts import MISSING, ROOT
GEMVS = sorted(p.name for p in ROOT.glob("t_w8g_*") if (p / "spec.json").is_file()) if ROOT.is_dir() else []
ANY_M = sorted(p.name for p in ROOT.glob("a_w8g_*") if (p / "spec.json").is_file()) if ROOT.is_dir() else []
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(not GEMVS, reason=MISSING + f"no built W8A8 GEMV kernels in {ROOT}")]


def _case(name, seed=0, density=1.0, rows=None):
    from sparta.templates.w8a8_gemv.runtime import W8A8GemvOp
    from sparta.templates.quant.spec import quantize_rows
    from sparta.templates.w8a8_gemv.spec import W8A8GemvSpec, pack_weight, reference
    spec = W8A8GemvSpec(**json.loads((ROOT / name / "spec.json").read_text()))
    g = torch.Generator(device="cuda").manual_seed(seed)
    m = spec.m or rows
    x = torch.randn(m, spec.k, device="cuda", generator=g) * (torch.rand(m, 1, device="cuda", generator=g) * 10 + 0.1)
    w = torch.randn(spec.n, spec.k, device="cuda", generator=g) * (torch.rand(spec.n, 1, device="cuda", generator=g)
                                                                    + 0.01)
    bias = torch.randn(spec.n, device="cuda", generator=g).to(_dtype(spec)) if spec.bias else None
    rows_per, k_per = (spec.bn, spec.bk) if spec.blocks else (16, 32)
    keep = torch.rand(-(-spec.n // rows_per), -(-spec.k // k_per), device="cuda", generator=g) < density
    if density < 1:       # prune whole chunks (or the tile's blocks) the kernel skips; a pruned row has scale 0
        w = w * keep.repeat_interleave(rows_per, 0)[:spec.n].repeat_interleave(k_per, 1)[:, :spec.k]
    wq, ws = quantize_rows(w)
    xq, xs = quantize_rows(x)
    scale = None
    if spec.out == "int8":      # a static output scale that clips the largest outputs, as calibration's may
        scale = 0.8 * reference(xq, xs, wq, ws, bias, spec.act).float().abs().max().item() / 127
    if spec.blocks:       # the int8 tile's packed blocks and table
        from sparta.templates.bsr_linear.packing import pack_weight as pack_blocks
        from sparta.templates.bsr_linear.spec import BsrSpec
        tile = BsrSpec(0, spec.n, spec.k, bn=spec.bn, bk=spec.bk, tm=64, warps_m=1, warps_n=spec.bn // 16,
                       dtype="int8")
        packed, table = pack_blocks(wq, tile, keep.cpu())
    else:
        packed, table = pack_weight(spec, wq)
    op = W8A8GemvOp(ROOT / name, spec, packed, ws, bias, out_scale=scale, table=table)
    return spec, op, (xq, xs), wq, ws, bias, scale


def _check(spec, y, xq, xs, wq, ws, bias, scale):
    from sparta.templates.w8a8_gemv.spec import reference
    if spec.out == "int8":
        codes = reference(xq, xs, wq, ws, bias, spec.act, scale).int()
        diff = (y.int() - codes).abs()
        # the saturating requantisation rounds y·r/254 + ½ once more: one code off right next to a tie
        assert (y != -128).all() and diff.max() <= 1 and diff.float().mean() < 0.01
        assert (codes.abs() == 127).any(), "the scale clips some outputs"
        return
    ref = reference(xq, xs, wq, ws, bias, spec.act, dtype=_dtype(spec))
    assert torch.isfinite(y).all() and y.dtype == ref.dtype
    # exact int32 sums; the fp32 epilogue and 16-bit rounding differ from the reference's by an ulp at most
    tol = 1e-2 if y.dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol * ref.float().abs().max().item())


def _poisoned(spec):
    if spec.out == "int8":
        return torch.full((spec.m, spec.n), -128, dtype=torch.int8, device="cuda")     # no code is -128
    return torch.full((spec.m, spec.n), float("nan"), dtype=_dtype(spec), device="cuda")


def _dtype(spec):
    return torch.bfloat16 if spec.out == "bfloat16" else torch.float16


SPARSE = [n for n in GEMVS if json.loads((ROOT / n / "spec.json").read_text()).get("sparse")]


@pytest.mark.parametrize("name", GEMVS)
def test_w8a8_gemv_matches_the_int8_reference(name):
    spec, op, (xq, xs), wq, ws, bias, scale = _case(name)
    y = _poisoned(spec)
    op(xq, xs, out=y)
    _check(spec, y, xq, xs, wq, ws, bias, scale)
    assert op(xq, xs).equal(y), "deterministic: int32 sums do not depend on the order"


@pytest.mark.parametrize("name", SPARSE)
@pytest.mark.parametrize("density", [0.0, 0.35, 1.0])
def test_sparse_w8a8_gemv_skips_pruned_chunks_exactly(name, density):
    """The block-sparse GEMV at 0% (no chunk kept: bias and activation only), 35% and 100% of its 16x32 chunks."""
    from sparta.templates.w8a8_gemv.spec import chunk_mask
    spec, op, (xq, xs), wq, ws, bias, scale = _case(name, seed=3, density=density)
    kept = op.table.numel() - spec.tiles - 1
    assert kept == int(chunk_mask(wq).sum()) and (kept == 0) == (density == 0)
    y = _poisoned(spec)
    op(xq, xs, out=y)
    _check(spec, y, xq, xs, wq, ws, bias, scale)


@pytest.mark.parametrize("name", GEMVS)
def test_w8a8_gemv_back_to_back_and_in_a_cuda_graph(name):
    """Launches that follow one another (programmatic dependents where built so) write the same output: the
    last one's result must be what stays, eagerly and replayed from a CUDA graph."""
    spec, op_a, xa, *_ = _case(name, seed=1)
    _, op_b, xb, wq, ws, bias, scale = _case(name, seed=2)
    y = _poisoned(spec)
    for _ in range(3):
        op_a(*xa, out=y)
        op_b(*xb, out=y)
    _check(spec, y, *xb, wq, ws, bias, scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op_a(*xa, out=y)
        op_b(*xb, out=y)
    y.copy_(_poisoned(spec))
    graph.replay()
    torch.cuda.synchronize()
    _check(spec, y, *xb, wq, ws, bias, scale)


def test_w8a8_gemv_refuses_inputs_that_do_not_fit():
    from sparta.runtime.cuda import CudaRuntimeError
    spec, op, (xq, xs), *_ = _case(GEMVS[0])
    with pytest.raises(CudaRuntimeError, match="int8"):
        op(xq.float(), xs)
    with pytest.raises(CudaRuntimeError, match="int8"):
        op(xq[:, :-16].contiguous(), xs)


@pytest.mark.parametrize("name", ANY_M)
def test_w8a8_gemv_of_any_m_matches_the_int8_reference_at_every_row_count(name):
    """A GEMV built for any M up to its rows (what the default compile runs for few-row calls): each count of rows
    (fresh data, half the chunks pruned for the sparse kernel) against the reference."""
    from sparta.templates.w8a8_gemv.spec import W8A8GemvSpec
    spec = W8A8GemvSpec(**json.loads((ROOT / name / "spec.json").read_text()))
    assert spec.m == 0
    for seed, rows in enumerate(r for r in (1, 3, 8, 9, 12, 16) if r <= spec.rows):
        spec, op, (xq, xs), wq, ws, bias, scale = _case(name, seed, 0.5 if spec.sparse else 1.0, rows)
        y = op(xq, xs)
        assert y.shape == (rows, spec.n)
        _check(spec, y, xq, xs, wq, ws, bias, scale)
