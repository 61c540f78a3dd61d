"""sparta's W4A16 CUDA kernel (``templates/w4a16_gemv/``) against its torch reference, on a GPU.

Kernels are built beforehand (``python tests/fixtures/build_cuda.py``, TVM + nvcc, no GPU) into
``$SPARTA_CUDA_ARTIFACTS/w4a16`` (default ``artifacts/cuda/w4a16``); the ``t_*`` ones cover batch 1, 5,
9, 16, odd N, a partial last K chunk, groups 32/64/128, symmetric and asymmetric, bias, fp32 and fp16
accumulation and ragged tilings. Fresh random weights and inputs each run; outputs are poisoned
with NaN first. Tolerances against the fp32 dequantise-then-matmul reference: fp32 accumulation
SQNR > 55 dB and max error < 2e-3 of max |ref|; fp16 accumulation SQNR > 35 dB, max error < 1e-2.
With ``$SPARTA_RESULTS`` set, the measured errors are written to ``w4a16_accuracy.json`` there.
"""

import json
import os
from pathlib import Path

import pytest
import torch

from fixtures.artifacts import MISSING, ROOT
W4 = ROOT / "w4a16"
SMALL = sorted(p.name for p in W4.glob("t_*") if (p / "spec.json").is_file()) if W4.is_dir() else []
ANY_M = sorted(p.name for p in W4.glob("a_*") if (p / "spec.json").is_file()) if W4.is_dir() else []
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(not SMALL, reason=MISSING + f"no built w4a16 kernels in {W4}")]
LIMITS = {"float32": (55.0, 2e-3), "float16": (35.0, 1e-2),     # (min SQNR dB, max error / max |ref|)
          "bfloat16": (45.0, 1e-2)}                              # bf16 X, weights and Y: 8-bit mantissas
RESULTS = {}


@pytest.fixture(scope="module", autouse=True)
def accuracy_report():
    """Once the module's tests have run, the errors they measured go to ``$SPARTA_RESULTS/w4a16_accuracy.json``."""
    yield
    out = os.environ.get("SPARTA_RESULTS")
    if out and RESULTS:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "w4a16_accuracy.json").write_text(json.dumps(RESULTS, indent=1))


def _load(name):
    from sparta.runtime.cuda import CudaKernel
    from sparta.templates.w4a16_gemv.spec import W4A16Spec
    return W4A16Spec(**json.loads((W4 / name / "spec.json").read_text())), CudaKernel(W4 / name)


def _operands(spec, gain=None):
    from sparta.templates.w4a16_gemv.spec import pack_weight, quantize, split_buffers
    w = torch.randn(spec.n, spec.k, device="cuda") * (0.02 + torch.rand(spec.n, 1, device="cuda"))
    if gain is not None:
        w = w * (gain / w.norm(dim=1, keepdim=True))
    scale, zero = quantize(w, spec.group, spec.sym)
    wq, s, z = pack_weight(w, scale, zero, spec)
    x = torch.randn(spec.m, spec.k, device="cuda").to(_act(spec))
    bias = torch.randn(spec.n, device="cuda").to(_act(spec)) if spec.bias else None
    return {"X": x, "Wq": wq, "S": s, "Z": z, "B": bias, **split_buffers(spec, "cuda")}


def _act(spec):
    return torch.bfloat16 if spec.dtype == "bfloat16" else torch.float16


def _errors(y, ref):
    assert not y.isnan().any(), "some outputs were not written"
    diff = y.float() - ref
    sqnr = 10 * torch.log10(ref.pow(2).sum() / diff.pow(2).sum().clamp_min(1e-30)).item()
    return sqnr, (diff.abs().max() / ref.abs().max()).item()


def _run(spec, kernel, ops):
    from sparta.templates.w4a16_gemv.spec import reference
    from sparta.runtime.cuda import lanes16
    y = torch.full((spec.m, spec.n), float("nan"), dtype=_act(spec), device="cuda")
    kernel.call(**{k: lanes16(v) for k, v in ops.items() if v is not None}, Y=lanes16(y))
    torch.cuda.synchronize()
    return y, reference(ops["X"], ops["Wq"], ops["S"], ops["Z"], ops["B"], spec)


@pytest.mark.parametrize("name", SMALL)
def test_w4a16_matches_reference(name):
    spec, kernel = _load(name)
    for trial in range(2):                                 # two fresh draws: a race would show as a moving error
        y, ref = _run(spec, kernel, _operands(spec))
        sqnr, err = _errors(y, ref)
        RESULTS.setdefault(name, []).append({"sqnr_db": sqnr, "max_err": err})
        min_sqnr, max_err = LIMITS["bfloat16" if spec.dtype == "bfloat16" else spec.acc]
        assert sqnr > min_sqnr and err < max_err, f"{name}: SQNR {sqnr:.1f} dB, max error {err:.2e}"


def test_fp32_accumulation_is_at_least_as_accurate_as_fp16():
    pairs = [("t_m16_asym_g128_bias", "t_m16_asym_g128_f16acc")]
    for a, b in pairs:
        if a not in SMALL or b not in SMALL:
            pytest.skip(MISSING + "kernels not built")
        (sa, ka), (sb, kb) = _load(a), _load(b)
        ops = _operands(sa)
        ya, ref = _run(sa, ka, ops)
        ops_b = {**ops, "B": None}
        yb, ref_b = _run(sb, kb, ops_b)
        (qa, ea), (qb, eb) = _errors(ya, ref), _errors(yb, ref_b)
        RESULTS["fp32_vs_fp16_acc"] = {"fp32": {"sqnr_db": qa, "max_err": ea}, "fp16": {"sqnr_db": qb, "max_err": eb}}
        assert qa > qb - 1.0, f"fp32 accumulation {qa:.1f} dB vs fp16 {qb:.1f} dB"


def test_split_k_is_deterministic_and_leaves_its_counters_zero():
    split = [n for n in SMALL if _load(n)[0].ksplit > 1]
    if not split:
        pytest.skip(MISSING + "no ksplit kernels built")
    for name in split:
        spec, kernel = _load(name)
        ops = _operands(spec)
        ys = [_run(spec, kernel, ops)[0] for _ in range(3)]
        assert int(ops["C"].abs().sum()) == 0, f"{name}: arrival counters not reset: {ops['C'].tolist()}"
        assert all(torch.equal(ys[0], y) for y in ys[1:]), f"{name}: split-K sums differ between runs"


def test_w4a16_in_a_cuda_graph():
    for name in {next((n for n in SMALL if "m5" in n), SMALL[0]), next((n for n in SMALL if "ks" in n), SMALL[0])}:
        _graph_replay(name)


def _graph_replay(name):
    spec, kernel = _load(name)
    ops = _operands(spec)
    y = torch.empty(spec.m, spec.n, dtype=torch.float16, device="cuda")
    tensors = {k: v for k, v in ops.items() if v is not None}
    kernel.call(**tensors, Y=y)                                  # load the module outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        kernel.call(**tensors, Y=y)
    ops["X"].copy_(torch.randn_like(ops["X"]))
    y.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    from sparta.templates.w4a16_gemv.spec import reference
    sqnr, err = _errors(y, reference(ops["X"], ops["Wq"], ops["S"], ops["Z"], ops["B"], spec))
    RESULTS["graph_" + name] = {"sqnr_db": sqnr, "max_err": err}
    assert sqnr > LIMITS[spec.acc][0] and err < LIMITS[spec.acc][1]


@pytest.mark.parametrize("graph", [False, True])
def test_programmatic_dependent_launch_chains_read_what_the_previous_kernel_wrote(graph):
    """Kernels launched with programmatic dependent launch (``pdl``) may start before the previous one in the stream
    ends; each reads its X only after ``griddepcontrol.wait``. A chain x → y1 → y2 … through one square kernel (its
    output is the next launch's input; split-K counters shared by all launches) against the reference chain, eagerly
    and replayed from a CUDA graph; every hop checked."""
    from sparta.templates.w4a16_gemv.spec import reference
    chained = [n for n in SMALL if _load(n)[0].pdl]
    if not chained:
        pytest.skip(MISSING + "no pdl kernels built")
    for name in chained:
        spec, kernel = _load(name)
        assert spec.n == spec.k and kernel.launch.get("pdl")
        ops = _operands(spec, gain=1.0)           # weights of norm ≈ 1 per row: the chain neither grows nor fades
        ys = [torch.full((spec.m, spec.n), float("nan"), dtype=torch.float16, device="cuda") for _ in range(6)]
        rest = {k: v for k, v in ops.items() if v is not None and k != "X"}
        prep = kernel.prepare(X=ops["X"], Y=ys[0], **rest)
        assert (prep.config is not None) == (torch.cuda.get_device_capability() >= (9, 0))

        def chain():
            for i in range(1, len(ys)):
                prep.launch(X=ys[i - 1], Y=ys[i])
        if graph:
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                chain()
            for y in ys[1:]:
                y.fill_(float("nan"))
            ops["X"].copy_(torch.randn_like(ops["X"]))
            prep.launch(X=ops["X"], Y=ys[0])
            g.replay()
        else:
            chain()
        torch.cuda.synchronize()
        for i in range(1, len(ys)):
            ref = reference(ys[i - 1], ops["Wq"], ops["S"], ops["Z"], ops["B"], spec)
            sqnr, err = _errors(ys[i], ref)
            assert sqnr > LIMITS[spec.acc][0] and err < LIMITS[spec.acc][1], f"{name} hop {i}: SQNR {sqnr:.1f} dB"
        if spec.ksplit > 1:
            assert int(ops["C"].abs().sum()) == 0



@pytest.mark.parametrize("name", ANY_M)
def test_w4a16_of_any_m_matches_reference_at_every_row_count(name):
    """A GEMV built for any M up to its rows (what the default compile runs for few-row calls): every count of rows
    from 0 to its most through one prepared launch, fresh data each, against the reference."""
    from sparta.templates.w4a16_gemv.runtime import W4A16GemvOp
    spec, _ = _load(name)
    assert spec.m == 0
    ops = _operands(spec)
    op = W4A16GemvOp(W4 / name, spec, ops["Wq"], ops["S"], ops["Z"], ops["B"])
    from sparta.templates.w4a16_gemv.spec import reference
    assert op(torch.randn(0, spec.k, device="cuda").to(_act(spec))).shape == (0, spec.n)
    for rows in [r for r in (1, 2, 5, 8, 9, 12, 13, 16) if r <= spec.rows] * 2:
        x = torch.randn(rows, spec.k, device="cuda").to(_act(spec))
        y = op(x)
        torch.cuda.synchronize()
        sqnr, err = _errors(y, reference(x, ops["Wq"], ops["S"], ops["Z"], ops["B"], spec))
        min_sqnr, max_err = LIMITS["bfloat16" if spec.dtype == "bfloat16" else spec.acc]
        assert sqnr > min_sqnr and err < max_err, f"{name} at {rows} rows: SQNR {sqnr:.1f} dB, max error {err:.2e}"
    with pytest.raises(Exception, match="at most"):
        op(torch.randn(spec.rows + 1, spec.k, device="cuda").to(_act(spec)))
    if spec.ksplit > 1:
        assert int(op.split["C"].abs().sum()) == 0
