"""sparta's block-sparse CUDA linear (``templates/bsr_linear/``) against its torch reference, on a GPU.

Kernels are built beforehand (``python tests/fixtures/build_cuda.py``, TVM + nvcc, no GPU)
into ``$SPARTA_CUDA_ARTIFACTS`` (default ``artifacts/cuda``); the small ``t_*`` ones cover odd
M, a partial last block row and block column, every epilogue, both table kinds and a
dense tile. Fresh random data each run; outputs are poisoned with NaN first.
"""


import pytest
import torch

from fixtures.artifacts import MISSING, ROOT
SMALL = sorted(p.name for p in ROOT.glob("t_*") if (p / "spec.json").is_file()
               and not p.name.startswith(("t_q", "t_ln", "t_rms", "t_w8g"))) if ROOT.is_dir() else []
QUANT = sorted(p.name for p in ROOT.glob("t_q_*") if (p / "spec.json").is_file()) if ROOT.is_dir() else []
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(not SMALL, reason=MISSING + f"no built bsr kernels in {ROOT}")]


def _mask(spec, density):
    from sparta.templates.bsr_linear.spec import BsrSpec
    if spec.table == "const":
        return spec.pattern_mask()
    if spec.gemv_group:                # the W4A16 GEMVs' pack is dense
        return torch.ones(spec.row_blocks, spec.k_blocks, dtype=torch.bool)
    assert isinstance(spec, BsrSpec)
    return torch.rand(spec.row_blocks, spec.k_blocks) < density


def _check(name, density):
    """The kernel against its torch reference on fresh data; W8A8 kernels against the exact int8
    reference (int32 dot products are exact, so only fp32 rounding differs), W4A16 kernels against
    the product with the dequantised int4 weight, and both, by SQNR, against the fp16 product
    (the quantisation error)."""
    from sparta.templates.bsr_linear.runtime import BsrLinearOp, load_spec
    from sparta.templates.bsr_linear.int4_records import unpack_w4
    from sparta.templates.bsr_linear.spec import reference, reference_int8
    from sparta.templates.quant.spec import quantize_rows
    spec = load_spec(ROOT / name)
    mask = _mask(spec, density)
    x = torch.randn(spec.m, spec.k, device="cuda").half()
    w = torch.randn(spec.n, spec.k, device="cuda").half()
    bias = torch.randn(spec.n, device="cuda").half() if spec.bias else None
    w4 = spec.dtype == "w4a16"
    if spec.out == "int8":
        return _check_requantized(name, spec, mask, x, w, bias)
    op = BsrLinearOp(ROOT / name, spec, w, mask, bias, group=64 if spec.zero else 128)
    y = torch.full((spec.m, spec.n), float("nan"), dtype=torch.float16, device="cuda")
    op(x, out=y)
    torch.cuda.synchronize()
    assert not y.isnan().any(), "some outputs were not written"
    exact = reference(x, w, mask, bias, spec.act, spec.bn, spec.bk)
    int8 = spec.dtype == "int8"
    if int8:
        ref = reference_int8(*quantize_rows(x), *quantize_rows(w), mask, bias, spec.act, spec.bn, spec.bk)
    elif w4:
        ref = reference(x, unpack_w4(op.wp, op.table, spec), None, bias, spec.act, spec.bn, spec.bk)
    else:
        ref = exact
    scale = ref.float().abs().max().clamp_min(1.0)
    err = ((y.float() - ref.float()).abs().max() / scale).item()
    assert err < 2e-3, f"{name} density {density}: max error {err:.2e} of max |{spec.dtype} ref|"
    if (int8 or w4) and exact.float().abs().max() > 0:      # (a small random mask can keep no block)
        sqnr = 10 * torch.log10(exact.float().pow(2).mean() / (y.float() - exact.float()).pow(2).mean()).item()
        assert sqnr > (15 if w4 else 30), f"{name}: SQNR {sqnr:.1f} dB against the fp16 product"
    return err


def _check_requantized(name, spec, mask, x, w, bias):
    """An ``out="int8"`` kernel: its codes against the reference's (fp32 value / the static scale, rounded half
    to even, clamped) — equal but where the fp32 epilogue rounds differently (at most one code apart, rarely);
    the scale clips the largest outputs, so the clamp is exercised too."""
    from sparta.templates.bsr_linear.runtime import BsrLinearOp
    from sparta.templates.bsr_linear.spec import reference, reference_int8
    from sparta.templates.quant.spec import quantize_rows
    exact = reference(x, w, mask, bias, spec.act, spec.bn, spec.bk).float()
    scale = float(exact.abs().max().clamp_min(1e-3)) * 0.8 / 127
    op = BsrLinearOp(ROOT / name, spec, w, mask, bias, out_scale=scale)
    y = torch.full((spec.m, spec.n), -128, dtype=torch.int8, device="cuda")   # -128: a code never written
    op(x, out=y)
    torch.cuda.synchronize()
    assert not (y == -128).any(), "some outputs were not written"
    if spec.dtype == "int8":
        ref = reference_int8(*quantize_rows(x), *quantize_rows(w), mask, bias, spec.act, spec.bn, spec.bk, scale)
    else:
        ref = reference(x, w, mask, bias, spec.act, spec.bn, spec.bk, scale)
    diff = (y.int() - ref.int()).abs()
    assert diff.max() <= 1 and diff.float().mean() < 1e-3, \
        f"{name}: codes off by {diff.max()} ({diff.float().mean():.2e} on average)"
    assert (ref.abs() == 127).any() or exact.abs().max() == 0, "the scale did not clip (test setup)"
    if exact.abs().max() > 0:
        sqnr = 10 * torch.log10(exact.pow(2).mean() / (y.float() * scale - exact.clamp(-127 * scale, 127 * scale))
                                .pow(2).mean()).item()
        assert sqnr > 25, f"{name}: SQNR {sqnr:.1f} dB of the dequantised codes against the fp16 product"
    with pytest.raises(Exception, match="out_scale"):
        BsrLinearOp(ROOT / name, spec, w, mask, bias)
    return diff.float().mean().item()


def _fp16_blocks_for_first(dtype):
    """(folder, spec, all-kept mask, weight, fp16 blocks + table packed as if the kernel were fp16) of the
    first small kernel of ``dtype``."""
    from sparta.templates.bsr_linear.runtime import load_spec
    from sparta.templates.bsr_linear.packing import pack_weight
    names = [n for n in SMALL if load_spec(ROOT / n).dtype == dtype and load_spec(ROOT / n).out == "float16"]
    if not names:
        pytest.skip(MISSING + f"no {dtype} kernels built")
    spec = load_spec(ROOT / names[0])
    mask = torch.ones(spec.row_blocks, spec.k_blocks, dtype=torch.bool)
    w = torch.randn(spec.n, spec.k, device="cuda")
    wp16, table = pack_weight(w.half(), spec.__class__(**{**spec.__dict__, "dtype": "float16", "zero": False}), mask)
    return ROOT / names[0], spec, mask, w, wp16, table


def test_w4a16_rejects_fp16_blocks():
    from sparta.templates.bsr_linear.runtime import BsrLinearOp
    from sparta.runtime.cuda import CudaRuntimeError
    folder, spec, _, _, wp16, table = _fp16_blocks_for_first("w4a16")
    with pytest.raises(CudaRuntimeError, match="do not fit"):
        BsrLinearOp.packed(folder, spec, wp16, table, torch.zeros(spec.n, device="cuda"))


def test_int8_rejects_fp16_blocks_and_takes_prequantised_rows():
    from sparta.templates.bsr_linear.runtime import BsrLinearOp
    from sparta.runtime.cuda import CudaRuntimeError
    from sparta.templates.quant.spec import quantize_rows
    folder, spec, mask, w, wp16, table = _fp16_blocks_for_first("int8")
    bias = torch.randn(spec.n, device="cuda").half() if spec.bias else None
    with pytest.raises(CudaRuntimeError, match="int8 blocks"):
        BsrLinearOp.packed(folder, spec, wp16, table, bias)
    op = BsrLinearOp(folder, spec, w, mask, bias)
    x = torch.randn(spec.m, spec.k, device="cuda").half()
    torch.testing.assert_close(op.int8(*quantize_rows(x)), op(x))


@pytest.mark.parametrize("name", QUANT)
def test_row_quantizer_is_bit_exact_with_torch(name):
    from sparta.templates.quant.runtime import RowQuantizer
    from sparta.templates.quant.spec import quantize_rows
    q = RowQuantizer(ROOT / name)
    x = (torch.randn(q.m, q.k, device="cuda") * torch.rand(q.m, 1, device="cuda") * 10).half()
    x[0] = 0                                           # an all-zero row: scale clamps, codes are 0
    xq, xs = q(x)
    rq, rs = quantize_rows(x)
    assert torch.equal(xs, rs) and torch.equal(xq, rq)


@pytest.mark.parametrize("density", [0.0, 0.35, 1.0])
@pytest.mark.parametrize("name", SMALL)
def test_bsr_linear_matches_reference(name, density):
    _check(name, density)


def test_bsr_linear_graph_capture():
    from sparta.templates.bsr_linear.runtime import BsrLinearOp, load_spec
    from sparta.templates.bsr_linear.spec import reference
    name = SMALL[0]
    spec = load_spec(ROOT / name)
    mask = _mask(spec, 0.5)
    w = torch.randn(spec.n, spec.k, device="cuda").half()
    bias = torch.randn(spec.n, device="cuda").half() if spec.bias else None
    op = BsrLinearOp(ROOT / name, spec, w, mask, bias)
    x = torch.randn(spec.m, spec.k, device="cuda").half()
    y = torch.empty(spec.m, spec.n, dtype=torch.float16, device="cuda")
    op(x, out=y)                                   # load the module outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        op(x, out=y)
    x.copy_(torch.randn_like(x))
    y.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    ref = reference(x, w, mask, bias, spec.act, spec.bn, spec.bk)
    assert ((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1)).item() < 2e-3


def test_bsr_linear_rejects_bad_input():
    from sparta.templates.bsr_linear.runtime import BsrLinearOp, load_spec
    from sparta.runtime.cuda import CudaRuntimeError
    spec = load_spec(ROOT / SMALL[0])
    w = torch.randn(spec.n, spec.k, device="cuda").half()
    op = BsrLinearOp(ROOT / SMALL[0], spec, w, None, torch.zeros(spec.n, device="cuda") if spec.bias else None)
    with pytest.raises(CudaRuntimeError, match="input must be"):
        op(torch.randn(spec.m + 1, spec.k, device="cuda").half())
    with pytest.raises(CudaRuntimeError, match="weight is"):
        BsrLinearOp(ROOT / SMALL[0], spec, w[:, :-8], None, None)


@pytest.mark.parametrize("graph", [False, True])
def test_programmatic_dependent_launch_chains_read_what_the_previous_kernel_wrote(graph):
    """``pdl`` kernels may start while the previous one in the stream ends; each reads X (and its row scales) only
    after ``griddepcontrol.wait``. A chain x → y1 → … → y5 through one square kernel (each launch's output is the
    next one's input: fp16, or int8 codes of one static scale read back as codes with that scale per row), eagerly
    and replayed from a CUDA graph, every hop against the reference of the previous hop's actual output."""
    from sparta.templates.bsr_linear.runtime import BsrLinearOp, load_spec
    from sparta.templates.bsr_linear.spec import reference, reference_int8
    from sparta.templates.quant.spec import quantize_rows
    chained = [n for n in SMALL if load_spec(ROOT / n).pdl]
    if not chained:
        pytest.skip(MISSING + "no pdl kernels built")
    for name in chained:
        spec = load_spec(ROOT / name)
        assert spec.n == spec.k
        mask = _mask(spec, 0.6)
        w = (torch.randn(spec.n, spec.k, device="cuda") * 2 / spec.k ** 0.5).half()  # the chain neither grows nor fades
        bias = (torch.randn(spec.n, device="cuda") * 0.1).half() if spec.bias else None
        x = torch.randn(spec.m, spec.k, device="cuda").half()
        q8 = spec.out == "int8"
        scale = 4.0 / 127
        op = BsrLinearOp(ROOT / name, spec, w, mask, bias, **({"out_scale": scale} if q8 else {}))
        fill = -128 if q8 else float("nan")
        ys = [torch.full((spec.m, spec.n), fill, dtype=torch.int8 if q8 else torch.float16, device="cuda")
              for _ in range(6)]
        xs = torch.full((spec.m,), scale, device="cuda")                   # the codes' scale, per row

        def hop(i):
            if q8:
                op.int8(*(quantize_rows(x) if i == 0 else (ys[i - 1], xs)), out=ys[i])
            else:
                op(x if i == 0 else ys[i - 1], out=ys[i])
        hop(0)
        assert (op._prepared.config is not None) == (torch.cuda.get_device_capability() >= (9, 0))
        if graph:
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for i in range(1, len(ys)):
                    hop(i)
            for y in ys[1:]:
                y.fill_(fill)
            g.replay()
        else:
            for i in range(1, len(ys)):
                hop(i)
        torch.cuda.synchronize()
        for i in range(1, len(ys)):
            assert not (ys[i] == fill).any() if q8 else not ys[i].isnan().any(), f"{name} hop {i}: not written"
            if q8:
                wq = quantize_rows(w)
                ref = reference_int8(ys[i - 1], xs, *wq, mask, bias, spec.act, spec.bn, spec.bk, scale)
                diff = (ys[i].int() - ref.int()).abs()
                assert diff.max() <= 1 and diff.float().mean() < 1e-3, f"{name} hop {i}: codes off by {diff.max()}"
                assert ys[i].float().std() > 3, f"{name} hop {i}: the chain faded (test setup)"
            else:
                ref = reference(ys[i - 1], w, mask, bias, spec.act, spec.bn, spec.bk).float()
                err = ((ys[i].float() - ref).abs().max() / ref.abs().max().clamp_min(1)).item()
                assert err < 2e-3 and ref.abs().max() > 0.1, f"{name} hop {i}: max error {err:.2e}"
