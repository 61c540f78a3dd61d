"""Quantization by calibration: the bits chosen, the errors promised, and the wiring into compile."""

import copy

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import sparta
from sparta.passes import calibrate
from sparta.passes.quant import QuantConfig, QuantizationError, fake_quantized_weights
from sparta.passes.quant.walk import relative_mse

from models import MLP, SmallCNN, randomize_bn


def batches_of(shape, n=3, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=g) * scale,) for _ in range(n)]


def rel_mse(model_a, model_b, batches):
    with torch.no_grad():
        return relative_mse([[model_a(*b) for b in batches]], [[model_b(*b) for b in batches]])


def with_weights(model, graph):
    """``model`` with the weights the kernels apply (calibrated, dequantised)."""
    m = copy.deepcopy(model)
    state = m.state_dict()
    state.update(fake_quantized_weights(graph))
    m.load_state_dict(state)
    return m


def single_linear(w, bias=False):
    lin = nn.Linear(w.shape[1], w.shape[0], bias=bias)
    with torch.no_grad():
        lin.weight.copy_(w)
    return lin.eval()


def test_weights_exactly_representable_in_int4_get_4_bits():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-7, 8, (24, 64), generator=g).float()
    codes[:, 0] = 7                                         # every row reaches the top code: absmax is exact
    w = codes * (torch.rand(24, 1, generator=g) + 0.1)      # a scale per channel
    model = single_linear(w)
    batches = batches_of((16, 64))
    graph = sparta.capture(model, batches[0])
    report = calibrate(graph, batches, 1e-10, granularity="channel", progress=False)
    (d,) = report.decisions
    assert d.bits == 4 and d.trials[4] < 1e-10
    assert graph.tesa("weight").uniform == 4
    assert torch.allclose(fake_quantized_weights(graph)["weight"], w, atol=1e-5)


def test_wide_dynamic_range_is_refused():
    """A huge weight on a quiet input feature: any range covering it rounds every other weight to zero."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 64, generator=g)
    w[:, 0] = 1e3
    model = single_linear(w)
    batches = [(x * torch.cat([torch.tensor([1e-3]), torch.ones(63)]),) for (x,) in batches_of((32, 64))]
    graph = sparta.capture(model, batches[0])
    report = calibrate(graph, batches, 1e-2, activations=True, progress=False)
    assert [d.bits for d in report.decisions] == [32, 32]
    assert report.decisions[0].trials and min(report.decisions[0].trials.values()) > 0.5
    assert report.decisions[1].trials[8] > 0.5
    assert graph.tesa("weight").uniform == 32 and not report.weights


def test_tolerance_zero_changes_nothing():
    torch.manual_seed(0)
    model = MLP().eval()
    batches = batches_of((8, 24))
    graph = sparta.capture(model, batches[0])
    before = {s["name"]: s["bits"] for s in graph.tesa_stats()}
    report = calibrate(graph, batches, 0.0, activations=True, progress=False)
    assert report.lowered() == [] and report.model_error == 0.0
    assert {s["name"]: s["bits"] for s in graph.tesa_stats()} == before


def test_model_error_stays_within_the_model_tolerance_and_is_what_the_weights_give():
    torch.manual_seed(0)
    model = MLP(64, 128, 32).eval()
    batches = batches_of((32, 64))
    loose = sparta.capture(model, batches[0])
    free = calibrate(loose, batches, 1e-2, progress=False)
    limit = free.model_error * 0.8
    graph = sparta.capture(model, batches[0])
    report = calibrate(graph, batches, 1e-2, model_tolerance=limit, progress=False)
    assert free.model_error > limit >= report.model_error
    assert any(d.reverted for d in report.decisions) and report.lowered()
    # independently: the original torch model with the calibrated weights
    measured = rel_mse(model, with_weights(model, graph), batches)
    assert measured == pytest.approx(report.model_error, rel=1e-3, abs=1e-9)
    assert measured <= limit


def test_a_metric_callback_decides_instead_of_the_output_mse():
    torch.manual_seed(0)
    model = MLP(64, 128, 32).eval()
    batches = batches_of((32, 64))
    seen = []

    def argmax_changes(ref, quant):   # fraction of predictions that change
        seen.append(len(ref))
        return sum(float((r.argmax(-1) != q.argmax(-1)).float().mean()) for r, q in zip(ref, quant)) / len(ref)
    graph = sparta.capture(model, batches[0])
    report = calibrate(graph, batches, 1.0, metric=argmax_changes, model_tolerance=0.0, progress=False)
    assert seen and all(n == len(batches) for n in seen)
    assert report.model_error == 0.0


@settings(max_examples=12, deadline=None)
@given(n=st.integers(4, 40), k=st.integers(4, 70), tol=st.floats(1e-5, 1e-1), seed=st.integers(0, 1000),
       bias=st.booleans(), symmetric=st.booleans())
def test_accepted_widths_add_at_most_the_tolerance(n, k, tol, seed, bias, symmetric):
    """Soundness of the rule: measured independently, an accepted width adds no more error than
    allowed, and a refused one would have added more."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g).add(0.1)
    model = single_linear(w, bias)
    batches = batches_of((9, k), seed=seed)
    graph = sparta.capture(model, batches[0])
    report = calibrate(graph, batches, tol, symmetric=symmetric, group_size=16, progress=False)
    (d,) = report.decisions
    measured = rel_mse(model, with_weights(model, graph), batches)
    if d.bits < 32:
        assert measured <= tol * (1 + 1e-4) + 1e-12
        assert measured == pytest.approx(d.trials[d.bits], rel=1e-3, abs=1e-9)
    refused = [b for b in d.trials if b < d.bits]
    assert (refused or d.bits == 4) and all(d.trials[b] > tol for b in refused)


def test_pruned_elements_stay_pruned_and_user_bits_stay_fixed():
    torch.manual_seed(0)
    model = MLP(64, 128, 32).eval()
    batches = batches_of((32, 64))
    mask = torch.rand(128, 64) < 0.5
    tesa = {"fc1.weight": sparta.TeSA.from_mask(mask), "fc2.weight": sparta.TeSA.dense((128, 128), bits=8)}
    graph = sparta.capture(model, batches[0])
    for name, t in tesa.items():
        graph.set_tesa(name, t)
    calibrate(graph, batches, 1e-1, progress=False)
    bits = graph.tesa("fc1.weight").bits
    assert torch.equal(bits == 0, ~mask) and set(bits[mask].unique().tolist()) == {4}
    assert (fake_quantized_weights(graph)["fc1.weight"][~mask] == 0).all()
    assert graph.tesa("fc2.weight").uniform == 8 and "fc2.weight" not in graph.quantization.weights


def test_deterministic():
    torch.manual_seed(0)
    model = MLP(64, 128, 32).eval()
    batches = batches_of((32, 64))
    runs = []
    for _ in range(2):
        graph = sparta.capture(model, batches[0])
        report = calibrate(graph, batches, 3e-3, activations=True, progress=False)
        runs.append(([(d.tensor, d.bits, d.trials) for d in report.decisions], fake_quantized_weights(graph)))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])


def test_convolutions_including_depthwise_are_calibrated():
    model = randomize_bn(SmallCNN(c=8)).eval()
    batches = batches_of((2, 3, 16, 16))
    graph = sparta.capture(model, batches[0])
    report = calibrate(graph, batches, 5e-2, progress=False)
    tried = {d.tensor for d in report.decisions}
    assert {"conv1.weight", "dw.weight", "pw.weight", "fc.weight"} <= tried
    first = next(d for d in report.decisions if d.tensor == "conv1.weight")
    if first.bits == 4:  # the first op sees unquantised inputs: its added error is measurable directly
        conv = model.conv1
        q = fake_quantized_weights(graph)["conv1.weight"]
        ys = [conv(b[0]) for b in batches]
        yq = [torch.nn.functional.conv2d(b[0], q, padding=1) for b in batches]
        assert relative_mse([ys], [yq]) == pytest.approx(first.error, rel=1e-3)
    assert rel_mse(model, with_weights(model, graph), batches) == pytest.approx(report.model_error, rel=1e-3)


def test_gemm_outputs_get_a_static_scale_where_it_is_accurate_enough():
    """CUDA target: an 8-bit activation a GEMM (+ ReLU/GELU) makes and only GEMMs read is tried at one static
    scale; the graph input (no producing kernel) stays per token. The model error the report states is what
    the static scales and per-token codes really give; static_activations=False keeps every one per token."""
    from sparta.passes.quant.scheme import fake_quant_rows, fake_quant_static
    torch.manual_seed(0)
    model = MLP(64, 128, 32).eval()
    batches = batches_of((48, 64))
    graph = sparta.capture(model, batches[0])
    report = calibrate(graph, batches, 1e-2, activations=True, target="cuda", progress=False)
    acts = {d.tensor: d for d in report.decisions if d.kind == "activation"}
    static = report.static_scales
    assert set(static) and set(static) <= {t for t, d in acts.items() if d.bits == 8}
    for t, scale in static.items():
        d = acts[t]
        assert d.scale == scale > 0 and d.error == d.static_error <= 1e-2 and f"static scale {scale:.3g}" in report.table()
        assert graph.producer(t) is not None
    assert not any(graph.producer(t) is None for t in static), "graph inputs stay per token"
    w = fake_quantized_weights(graph)
    names = list(acts)
    assert names[0] not in static and all(t in static for t in names[1:] if acts[t].bits == 8)

    def forward(x):
        quant = (lambda t, v: fake_quant_static(v, 8, static[t]) if t in static else
                 fake_quant_rows(v, acts[t].bits) if acts[t].bits < 32 else v)
        h = torch.relu(quant(names[0], x) @ w["fc1.weight"].t() + model.fc1.bias)
        h = torch.nn.functional.gelu(quant(names[1], h) @ w["fc2.weight"].t() + model.fc2.bias)
        return quant(names[2], h) @ w["fc3.weight"].t() + model.fc3.bias
    with torch.no_grad():
        ref = [[model(*b) for b in batches]]
        assert relative_mse(ref, [[forward(*b) for b in batches]]) == pytest.approx(report.model_error, rel=1e-3)
    again = sparta.capture(model, batches[0])
    assert calibrate(again, batches, 1e-2, activations=True, target="cuda", static_activations=False,
                     progress=False).static_scales == {}
    cpu = sparta.capture(model, batches[0])
    # the CPU kernels quantise per token
    assert calibrate(cpu, batches, 1e-2, activations=True, progress=False).static_scales == {}


def test_report_table_and_plot(tmp_path):
    torch.manual_seed(0)
    model = MLP(64, 128, 32).eval()
    batches = batches_of((32, 64))
    graph = sparta.capture(model, batches[0])
    report = calibrate(graph, batches, 1e-2, activations=True, progress=False)
    table = report.table()
    assert table.count("\n") == len(report.decisions) + 1 and "fc1.weight" in table
    assert report.to_json()["decisions"][0]["tensor"] == "fc1.weight"
    pytest.importorskip("matplotlib")
    png = report.plot(tmp_path / "bits.png")
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_bad_input_is_explained():
    model = MLP().eval()
    x = torch.randn(8, 24)
    graph = sparta.capture(model, (x,))
    with pytest.raises(QuantizationError, match="no batches"):
        calibrate(graph, [], 1e-2)
    with pytest.raises(QuantizationError, match="iterable of batches"):
        calibrate(graph, x, 1e-2)
    with pytest.raises(QuantizationError, match="batch 1: .*shape"):
        calibrate(graph, [(x,), (torch.randn(4, 24),)], 1e-2)
    with pytest.raises(QuantizationError, match="quant_tolerance"):
        QuantConfig(-1.0)
    with pytest.raises(QuantizationError, match="granularity"):
        QuantConfig(1e-2, granularity="row")
    with pytest.raises(sparta.SpartaError, match="both calibration"):
        sparta.compile(model, {}, (x,), calibration=[(x,)])


def test_compile_with_calibration_runs_int8_and_int4_kernels():
    """The chosen bits select the quantised kernels; the compiled model verifies against the
    dequantised reference and stays as close to the fp32 model as calibration said."""
    torch.manual_seed(0)
    model = MLP(256, 512, 256).eval()
    batches = batches_of((64, 256), n=2)
    w8 = sparta.compile(model, {}, batches[0], calibration=batches, verify=True,
                        quant_tolerance={"tolerance": 1e-2, "activations": True, "progress": False})
    assert {k["bits"] for k in w8.kernels} == {"W8A8"}
    assert rel_mse(model, w8, batches) <= 2 * w8.quantization.model_error + 1e-6


def test_int4_kernels_apply_the_fitted_scales(tmp_path):
    """On this CPU the measured int4 kernel is slower than fp32, so the cost model keeps fp32 for
    weight-only 4 bits; pinned to the W4A32 sub-op (the plan is a plain dataclass), the kernel
    applies exactly the calibrated (asymmetric, grouped) weights."""
    from sparta.codegen.specialize import specialize
    from sparta.compiled_model import CompiledModel
    from sparta.passes import transform
    from sparta.passes.transform import weight_quantisation
    from sparta.passes.transform.plan import SubOp

    torch.manual_seed(0)
    model = MLP(64, 96, 32).eval()
    batches = batches_of((8, 64), n=2)
    graph = sparta.capture(model, batches[0])
    report = calibrate(graph, batches, 5e-2, symmetric=False, group_size=16, progress=False)
    assert {d.bits for d in report.decisions} == {4}
    plan = transform(graph, "cpu")
    for op_plan in list(plan.ops.values()):
        if op_plan.gemm is not None:
            w = graph.tesa(op_plan.weight)
            sub = SubOp("dense", 4, 32, None, 0, w.numel(), 1.0, elements=sparta.TeSA.from_mask(w.mask, 4))
            pinned = op_plan.replace(kind="sparse", subops=[sub])
            quant = weight_quantisation(graph, graph.op(op_plan.op), pinned, report.weights)
            assert {q.source for q in quant.values()} == {"calibration"}
            plan.pin(op_plan.op, kind="sparse", subops=[sub], weight_quant=quant)
    replacements, kernels = specialize(graph, plan, "cpu")
    assert {k["bits"] for k in kernels} == {"W4A32"}
    compiled = CompiledModel(graph, plan=plan, replacements=replacements, kernels=kernels)
    expected = with_weights(model, graph)
    for m in (m for m in replacements.values() if hasattr(m, "weight_name")):   # not fused activations
        torch.testing.assert_close(m.reference_weight, expected.state_dict()[m.weight_name], rtol=0, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(compiled(*batches[1]), expected(*batches[1]), rtol=1e-4, atol=1e-4)
    assert rel_mse(model, compiled, batches) == pytest.approx(report.model_error, rel=1e-3)
    loaded = sparta.load(compiled.save(tmp_path / "w4"))           # scales, offsets, scale groups survive
    with torch.no_grad():
        assert torch.equal(loaded(*batches[1]), compiled(*batches[1]))


def test_calibration_runs_on_the_device_asked_and_falls_back_to_the_cpu_with_a_warning():
    """``QuantConfig.device``: a device the ops cannot run on (here the meta device) is reported and the batches run
    on the CPU, to the same decisions; a CUDA device without a GPU is refused; the default is the batches' device
    (the CPU for CPU batches, and for batches on a GPU this machine does not have)."""
    from sparta.passes.quant.calibrate import calibration_device
    model = MLP(32, 48, 16).eval()
    batches = batches_of((8, 32))

    def run(**kw):
        g = sparta.capture(model, batches[0])
        return calibrate(g, batches, QuantConfig(1e-3, activations=True, progress=False, **kw), target="cuda")

    cpu = run(device="cpu")
    with pytest.warns(UserWarning, match="calibration on meta failed .*calibrating on the CPU"):
        fallback = run(device="meta")
    assert cpu.device == fallback.device == "cpu"
    assert [(d.tensor, d.bits) for d in cpu.decisions] == [(d.tensor, d.bits) for d in fallback.decisions]
    assert cpu.static_scales == pytest.approx(fallback.static_scales)
    assert calibration_device(None) == "cpu" == calibration_device(None, [[torch.ones(2)]])
    assert calibration_device(None, [[3, torch.ones(2, device="meta")]]) == "meta"
    if not torch.cuda.is_available():
        with pytest.raises(QuantizationError, match="sees no CUDA GPU"):
            calibration_device("cuda")
    with pytest.raises(QuantizationError, match="not a torch device"):
        calibration_device("tpu9")


def test_an_op_that_creates_a_tensor_creates_it_on_the_calibration_device():
    class Ramp(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x):
            return self.lin(x) + torch.arange(x.shape[-1], device="cpu").float()

    graph = sparta.capture(Ramp().eval(), (torch.randn(4, 16),))
    (ramp,) = [op for op in graph.ops() if op.op == "arange"]
    assert ramp.call({})[0].device.type == "cpu"
    assert ramp.call({}, torch.device("meta"))[0].device.type == "meta", "created where the walk runs"


def test_a_view_of_a_tensor_laid_out_otherwise_on_the_device_still_runs():
    """A captured ``view`` whose input another device returns non-contiguous (SDPA's output on CUDA) runs on a
    contiguous copy in the calibration walk: the same values."""
    from sparta.passes.quant.walk import LockstepWalk

    class Merge(nn.Module):
        def forward(self, x):
            return (x.transpose(1, 2).contiguous() * 2).view(x.shape[0], -1)

    x = torch.randn(3, 4, 5)
    graph = sparta.capture(Merge().eval(), (x,))
    (view,) = [op for op in graph.ops() if op.op == "view"]
    walk = LockstepWalk(graph, [[x]], {})
    strided = (x * 2).transpose(1, 2)                 # the view's input laid out transposed
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        view.call({view.inputs[0]: strided})
    (out,) = walk.call(view, {view.inputs[0]: [strided]}, 0)
    assert torch.equal(out, strided.reshape(3, -1))
